"""Aggregate scored records into one summary row per (bundle, B, tau, draft source, adaptive masks).

Row fields:
    bundle, block_size, tau, draft (``masks`` = plain MARS, and plain AR at tau >= 1)
    adaptive_masks: the row's runs fed masks only while they paid (false where masks were fed every
        step, and in records written before the field existed)
    num_prompts, num_gsm8k, num_humaneval, num_chat: prompts in the row
    num_tokens, num_forwards: totals over the row's prompts (decode forwards; prefill excluded)
    tpf: num_tokens / num_forwards (tokens per decode forward; a ratio of totals)
    decode_seconds: total wall-clock decode time, s (prefill excluded)
    tokens_per_second: num_tokens / decode_seconds (decode tokens/s)
    speedup_vs_ar: tokens_per_second / that of the same bundle's AR row (tau >= 1, masks) with the same B
    agreement_exact: fraction of prompts whose ids equal the AR ids
    agreement_prefix: mean common_prefix_fraction (see scoring)
    gsm8k_accuracy: fraction of GSM8K prompts answered correctly (None without GSM8K)
    humaneval_pass_at_1: fraction of HumanEval tasks passed, one greedy sample each (None without HumanEval)
"""

from __future__ import annotations

from runtime.decode.params import tokens_per_forward
from runtime.evaluation.scoring import AR_DRAFT
from runtime.evaluation.tasks import CHAT, GSM8K, HUMANEVAL

FIELDS = ("bundle", "block_size", "tau", "draft", "adaptive_masks", "num_prompts", "num_gsm8k", "num_humaneval",
          "num_chat", "num_tokens", "num_forwards",
          "tpf", "decode_seconds", "tokens_per_second", "speedup_vs_ar", "agreement_exact", "agreement_prefix",
          "gsm8k_accuracy", "humaneval_pass_at_1")


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_group(records: list[dict]) -> dict:
    """The row of one (bundle, B, tau, draft, adaptive masks) group, without ``speedup_vs_ar``."""
    first = records[0]
    tokens, forwards = sum(r["num_tokens"] for r in records), sum(r["num_forwards"] for r in records)
    seconds = sum(r["decode_seconds"] for r in records)
    return {"bundle": first["bundle"], "block_size": first["block_size"], "tau": first["tau"],
            "draft": first["draft"], "adaptive_masks": is_adaptive(first), "num_prompts": len(records),
            "num_gsm8k": sum(r["task"] == GSM8K for r in records),
            "num_humaneval": sum(r["task"] == HUMANEVAL for r in records),
            "num_chat": sum(r["task"] == CHAT for r in records),
            "num_tokens": tokens, "num_forwards": forwards, "tpf": tokens_per_forward(tokens, forwards), "decode_seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else None,
            "agreement_exact": _mean([r["identical_to_ar"] for r in records]),
            "agreement_prefix": _mean([r["common_prefix_fraction"] for r in records]),
            "gsm8k_accuracy": _mean([r["correct"] for r in records if r["task"] == GSM8K]),
            "humaneval_pass_at_1": _mean([r["passed"] for r in records if r["task"] == HUMANEVAL])}


def is_adaptive(record: dict) -> bool:
    """Whether a record's run had adaptive masks (records written before the field existed had not)."""
    return record.get("adaptive_masks", False)


def draft_label(row: dict) -> str:
    """A row's draft source as the table and plot name it: the source, then `` adaptive`` with adaptive masks."""
    return row["draft"] + (" adaptive" if row["adaptive_masks"] else "")


def summarize(records: list[dict]) -> list[dict]:
    """One row per (bundle, B, tau, draft, adaptive masks), bundles in order of first appearance;
    within a bundle by B, then tau descending, the AR row before a draft source's row at the same
    tau, a row with fixed masks just before its twin with adaptive masks."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["bundle"], r["block_size"], r["tau"], r["draft"], is_adaptive(r)), []).append(r)
    bundles = list(dict.fromkeys(key[0] for key in groups))
    keys = sorted(groups, key=lambda k: (bundles.index(k[0]), k[1], -k[2], k[3] != AR_DRAFT, k[3], k[4]))
    rows = [summarize_group(groups[k]) for k in keys]
    ar_speed = {(row["bundle"], row["block_size"]): row["tokens_per_second"] for row in rows
                if row["tau"] >= 1.0 and row["draft"] == AR_DRAFT}
    for row in rows:
        ar, speed = ar_speed.get((row["bundle"], row["block_size"])), row["tokens_per_second"]
        row["speedup_vs_ar"] = speed / ar if ar and speed is not None else None
    return [{name: row[name] for name in FIELDS} for row in rows]

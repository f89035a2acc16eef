"""The decode loop: every prompt of every bundle at every (block size B, tau), torch-free.

Runs are interleaved per prompt (AR, then each (B, tau < 1)), so slow drifts of the
machine (thermal, other load) hit every setting alike (DESIGN.md §7). ``tau >= 1`` is
greedy AR whatever B (one token per step), so it is decoded once per prompt and its
record is reported under every B. At least one tau >= 1 is always run (1.0 is added to
the list if none is given): it is the reference for agreement and speed-up.

With a draft source other than ``masks`` (DESIGN.md §3 "Draft sources"), every tau < 1
run feeds prompt-lookup drafts in front of the masks, and tau 1 is also run with them:
that row is lossless (its output must equal AR), so its TPF is what the drafts alone gain.

With adaptive masks (:mod:`runtime.decode.mask_backoff`), every run that feeds masks
(:meth:`~runtime.decode.params.DecodeParams.uses_masks`: tau < 1, and tau 1 with draft
``both``) is run a second time with them, right after it, so fixed and adaptive masks are
measured side by side; the adaptive tau-1 run is lossless too.

Record fields (one dict per bundle x B x tau x draft x adaptive masks x prompt):
    bundle, block_size, tau, draft (``masks`` for the AR reference), adaptive_masks (false
    for the AR reference and every run that feeds masks every step), task, item_id,
    num_prompt_tokens, token_ids, text,
    num_tokens, num_forwards (decode forwards), num_prefill_forwards, tpf (tokens per
    decode forward), seconds, prefill_seconds, decode_seconds (wall-clock s),
    finish_reason (``stop`` or ``length``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from runtime.bundle import load_config
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams, GenerationResult
from runtime.evaluation.scoring import AR_DRAFT
from runtime.evaluation.tasks import EvalItem
from runtime.text.tokenizer import Tokenizer

DEFAULT_TAUS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
DEFAULT_BLOCK_SIZES = (4, 8)


def plan_taus(taus: list[float]) -> list[float]:
    """``taus`` with 1.0 put first when none is >= 1 (the AR reference)."""
    return list(taus) if any(t >= 1.0 for t in taus) else [1.0, *taus]


def plan_block_sizes(requested: list[int] | None, bundle_block_size: int) -> list[int]:
    """Block sizes to run on a bundle exported with B = ``bundle_block_size``.

    ``None`` means the defaults (4 and 8) that the bundle allows, or the bundle's B if
    neither does. Requested sizes above the bundle's B are left out.

    Raises:
        ValueError: none of the requested sizes fits the bundle.
    """
    if requested is None:
        return [b for b in DEFAULT_BLOCK_SIZES if b <= bundle_block_size] or [bundle_block_size]
    fitting = [b for b in requested if b <= bundle_block_size]
    if not fitting:
        raise ValueError(f"none of the block sizes {requested} fits a bundle exported with B = {bundle_block_size} "
                         "(the run-time block size may only lower B)")
    return fitting


def plan_runs(taus: list[float], draft: str, adaptive_masks: bool = False) -> list[tuple[float, str, bool]]:
    """The (tau, draft source, adaptive masks) runs per block size: the AR reference for every
    tau >= 1, each tau < 1 with ``draft``, and, for a draft source other than masks, tau 1 with
    it too; with ``adaptive_masks``, each of them that feeds masks again with adaptive masks,
    right after it."""
    runs = [(tau, AR_DRAFT if tau >= 1.0 else draft) for tau in taus]
    if draft != AR_DRAFT:
        runs.insert(next(i for i, (tau, _) in enumerate(runs) if tau >= 1.0) + 1, (1.0, draft))
    planned = []
    for tau, source in runs:
        planned.append((tau, source, False))
        if adaptive_masks and DecodeParams(tau=tau, draft=source).uses_masks(tau):
            planned.append((tau, source, True))
    return planned


def make_record(label: str, block_size: int, tau: float, draft: str, adaptive_masks: bool, item: EvalItem,
                prompt_ids: list[int], result: GenerationResult, text: str) -> dict:
    """One record (see the module docstring) of a generation."""
    return {"bundle": label, "block_size": block_size, "tau": tau, "draft": draft, "adaptive_masks": adaptive_masks,
            "task": item.task, "item_id": item.item_id,
            "num_prompt_tokens": len(prompt_ids), "token_ids": list(result.token_ids), "text": text,
            "num_tokens": result.num_tokens, "num_forwards": result.num_forwards,
            "num_prefill_forwards": result.num_prefill_forwards, "tpf": result.tpf, "seconds": result.seconds,
            "prefill_seconds": result.prefill_seconds, "decode_seconds": result.seconds - result.prefill_seconds,
            "finish_reason": result.finish_reason}


def encode_prompts(tokenizer: Tokenizer, items: list[EvalItem], max_new_tokens: int, window: int,
                   max_context: int) -> list[list[int]]:
    """Chat-template token ids of every item, checked against the context before any decoding.

    Raises:
        ValueError: a prompt plus ``max_new_tokens`` plus the window does not fit ``max_context``.
    """
    prompts = [tokenizer.encode_chat(item.messages()) for item in items]
    for item, ids in zip(items, prompts):
        if len(ids) + max_new_tokens + window > max_context:
            raise ValueError(f"{item.item_id}: prompt ({len(ids)} tokens) + --max-new-tokens ({max_new_tokens}) + "
                             f"window ({window}) exceeds the model's max context {max_context}; "
                             "lower --max-new-tokens")
    return prompts


def run_bundle(bundle_dir: str | Path, label: str, items: list[EvalItem], taus: list[float],
               block_sizes: list[int] | None, max_new_tokens: int, metric: str = "probability",
               provider: str = "cpu", num_threads: int = 0, draft: str = AR_DRAFT, adaptive_masks: bool = False,
               log=None) -> list[dict]:
    """Decode every item at every (B, tau, draft, adaptive masks) on one bundle; return the records.

    Args:
        taus: thresholds (see :func:`plan_taus`); block_sizes: requested B's or None
            (see :func:`plan_block_sizes`); num_threads: onnxruntime intra-op threads
            (0: its choice); draft: draft source of the MARS runs; adaptive_masks: run those
            that feed masks also with adaptive masks (see :func:`plan_runs`);
            log: called with one progress line per prompt (default: stderr).
    """
    from runtime.backends.onnx import OnnxBackend  # here: mars-eval imports this module without onnxruntime

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    config = load_config(bundle_dir)
    sizes = plan_block_sizes(block_sizes, config.block_size)
    runs = plan_runs(plan_taus(taus), draft, adaptive_masks)
    tokenizer = Tokenizer(bundle_dir)
    prompts = encode_prompts(tokenizer, items, max_new_tokens, config.window, config.max_context)
    decoder = Decoder(OnnxBackend(bundle_dir, config, provider, num_threads), config)
    records, start = [], time.perf_counter()
    for number, (item, ids) in enumerate(zip(items, prompts), 1):
        ar = decoder.generate(ids, DecodeParams(tau=1.0, metric=metric, max_new_tokens=max_new_tokens))
        ar_text = tokenizer.decode(ar.token_ids)
        for block_size in sizes:
            for tau, source, adaptive in runs:
                result = ar if (tau >= 1.0 and source == AR_DRAFT) else decoder.generate(
                    ids, DecodeParams(tau=tau, metric=metric, max_new_tokens=max_new_tokens, block_size=block_size,
                                      draft=source, adaptive_masks=adaptive))
                text = ar_text if result is ar else tokenizer.decode(result.token_ids)
                records.append(make_record(label, block_size, tau, source, adaptive, item, ids, result, text))
        log(f"[{label}] {number}/{len(items)} {item.item_id}: AR {ar.num_tokens} tokens; "
            f"{time.perf_counter() - start:.0f} s so far")
    return records

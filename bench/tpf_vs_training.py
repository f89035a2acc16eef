"""TPF of MARS decoding against training progress, from a mars-train LoRA run's checkpoints.

    python bench/tpf_vs_training.py RUN_DIR --gsm8k FILE [--chat FILE] [--num-prompts 5]
        [--max-new-tokens 64] [--tau 0.9] [--block-size 4] [--every 50] [--data FILE ...]
        [--init-adapter DIR] [--name tpf_vs_training] [--compare JSON ...] [--out bench/results]
        [--force] [--init-steps N --append]

For the starting model and each ``checkpoint-N`` in RUN_DIR: merge the adapter into the
default model and decode held-out prompts with the PyTorch reference MARS decoder (same
rule and window protocol as the runtime) at tau = 1 and at the given tau, B = W. The
prompts: the first ``--num-prompts`` GSM8K test questions (not the last 100, which
``mars-eval`` uses) and, with ``--chat``, as many multi-turn conversations from the
OpenAssistant trees (``chat_multiturn/oasst_en_100_tree.jsonl``; read by mars-eval's
:func:`~runtime.evaluation.tasks.load_chat`).
TPF alone misleads (an untrained model's mask predictions can be confident and wrong), so
the exact and common-prefix agreement of the tau output with the tau = 1 output is
reported too, for all prompts and per prompt set.

The starting model (the first row) is the base model, or with ``--init-adapter`` the
adapter the run continued (``mars-train --lora-init``). x axes: examples seen (steps x
batch) and, with ``--data`` (the run's training files), example tokens seen, estimated as
examples seen x the mean tokens of an example of the data. Writes ``NAME.json`` and
``NAME.png`` (after every row; those of an earlier run are replaced only with ``--force``); ``--compare`` adds
other curves (JSON files this script wrote) to the plot.
A run continued from an earlier run's checkpoint is added to its curve with
``--init-steps`` (the steps the initial adapter had) and ``--append``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peft import PeftModel

from mars_export.model_source import default_checkpoint, load_checkpoint
from mars_export.reference import ReferenceDecoder
from runtime.command_line import (ArgumentParser, UsageError, check_results_folder, existing_file, existing_folder,
                                  path_value, results_name, run_main, tau_value)
from runtime.decode.params import DecodeParams
from runtime.evaluation.scoring import common_prefix
from runtime.evaluation.tasks import DataError, load_chat, read_jsonl

Messages = list[dict[str, str]]
SETTINGS = ("tau", "block_size", "num_prompts", "max_new_tokens", "chat")


def checkpoints(run_dir: Path, every: int) -> list[tuple[int, Path | None]]:
    """(step, checkpoint dir) of the checkpoints to measure, after (0, None) for the starting model."""
    found = sorted((int(p.name.split("-")[1]), p) for p in run_dir.glob("checkpoint-*") if p.is_dir())
    return [(0, None), *((step, path) for step, path in found if step % every == 0 or path == found[-1][1])]


def measure(adapter: Path | None, prompt_sets: dict[str, list[Messages]], args) -> dict:
    """TPF at ``args.tau`` and agreement with tau = 1 over all prompts, and per prompt set."""
    model, tokenizer = load_checkpoint(default_checkpoint())
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    decoder = ReferenceDecoder(model, args.block_size, args.block_size, model.config.mars_mask_token_id,
                               (tokenizer.eos_token_id,))
    per_set = {}
    for name, conversations in prompt_sets.items():
        tokens = forwards = identical = 0
        prefix = 0.0
        for messages in conversations:
            ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])
            ar = decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=args.max_new_tokens)).token_ids
            result = decoder.generate(ids, DecodeParams(tau=args.tau, max_new_tokens=args.max_new_tokens))
            tokens, forwards = tokens + result.num_tokens, forwards + result.num_forwards
            identical += result.token_ids == ar
            prefix += common_prefix(result.token_ids, ar) / max(len(ar), len(result.token_ids))
        per_set[name] = {"num_prompts": len(conversations), "num_tokens": tokens, "num_forwards": forwards,
                         "identical": identical, "prefix_sum": prefix}
    return {**summary(per_set.values()), "sets": {name: summary([s]) for name, s in per_set.items()}}


def summary(parts) -> dict:
    """TPF and mean agreement with AR of the summed counts of ``parts``."""
    parts = list(parts)
    n = sum(p["num_prompts"] for p in parts)
    tokens, forwards = sum(p["num_tokens"] for p in parts), sum(p["num_forwards"] for p in parts)
    return {"tpf": tokens / forwards, "num_tokens": tokens, "num_forwards": forwards,
            "exact_agreement_with_ar": sum(p["identical"] for p in parts) / n,
            "prefix_agreement_with_ar": sum(p["prefix_sum"] for p in parts) / n}


def mean_example_tokens(data: list[str]) -> float:
    """Mean prompt + response tokens of an example of ``data`` (as mars-train reads it, no length cut)."""
    from transformers import AutoTokenizer

    from mars_export.training.data import load_examples
    examples, _ = load_examples(data, AutoTokenizer.from_pretrained(default_checkpoint()))
    return sum(e.length for e in examples) / len(examples)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=existing_folder, help="the --output folder of a mars-train run")
    p.add_argument("--gsm8k", type=existing_file, required=True)
    p.add_argument("--chat", type=existing_file, default=None, help="OpenAssistant tree JSONL (chat_multiturn)")
    p.add_argument("--num-prompts", type=int, default=5, help="prompts of each set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tau", type=tau_value, default=0.9)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--every", type=int, default=50, help="use checkpoints whose step is a multiple of this (and the last)")
    p.add_argument("--data", action="append", default=[], help="the run's training files (for example tokens seen)")
    p.add_argument("--init-adapter", type=existing_folder, default=None,
                   help="the --lora-init adapter the run continued: measured as the first row instead of the base model")
    p.add_argument("--name", type=results_name, default="tpf_vs_training", help="output file stem")
    p.add_argument("--compare", type=existing_file, nargs="*", default=[],
                   help="other curves (JSON) to draw in the plot")
    p.add_argument("--out", type=path_value, default=Path("bench/results"))
    p.add_argument("--init-steps", type=int, default=0,
                   help="steps the run's --lora-init adapter had already trained; added to each checkpoint's step")
    p.add_argument("--append", action="store_true",
                   help="add rows to the existing NAME.json (same settings; no new first row)")
    p.add_argument("--force", action="store_true",
                   help="replace the NAME.json and NAME.png of an earlier run in --out (default: refuse)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.every < 1:
        p.error("--num-prompts and --every must be >= 1")
    check_results_folder(args.out, [f"{args.name}.json", f"{args.name}.png"], args.force or args.append)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompt_sets = {"gsm8k": [[{"role": "user", "content": question}] for question in gsm8k_questions(args)]}
    if args.chat is not None:
        try:
            prompt_sets["chat"] = [item.messages() for item in load_chat(args.chat, args.num_prompts)]
        except DataError as e:
            raise UsageError(f"--chat: {e}") from e
        if not prompt_sets["chat"]:
            raise UsageError(f"--chat: {args.chat} holds no records (it is empty or only blank lines); give an "
                             "OpenAssistant tree file (chat_multiturn/oasst_en_100_tree.jsonl)")
    try:
        tokens_per_example = mean_example_tokens(args.data) if args.data else None
    except ValueError as e:  # a missing or malformed training file, as mars-train reads it
        raise UsageError(f"--data: {e}") from e
    rows = previous_rows(args) if args.append else []
    for step, adapter in checkpoints(args.run_dir, args.every)[1 if args.append else 0:]:
        state = json.loads((adapter / "trainer_state.json").read_text()) if adapter else {"train_batch_size": 0}
        step += args.init_steps if adapter else 0
        row = {"step": step, "examples_seen": step * state["train_batch_size"],
               **measure(adapter or args.init_adapter, prompt_sets, args)}
        if tokens_per_example is not None:
            row["example_tokens_seen"] = round(row["examples_seen"] * tokens_per_example)
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(args, rows)  # after every row: a long run stopped early keeps what it measured


def gsm8k_questions(args) -> list[str]:
    """The first ``--num-prompts`` questions of ``--gsm8k`` (the bare question: no instruction, unlike mars-eval);
    UsageError naming the file and line of a line that is no JSON object with a string 'question'."""
    try:
        records = read_jsonl(args.gsm8k, args.num_prompts)
    except DataError as e:
        raise UsageError(f"--gsm8k: {e}") from e
    if not records:
        raise UsageError(f"--gsm8k: {args.gsm8k} holds no records (it is empty or only blank lines); give a GSM8K "
                         "JSON-lines file, one question a line")
    for number, _, record in records:
        if not isinstance(record.get("question"), str):
            raise UsageError(f"--gsm8k: {args.gsm8k}:{number}: a GSM8K record needs a string field 'question'")
    return [record["question"] for _, _, record in records]


def previous_rows(args) -> list[dict]:
    """The rows of the existing curve; UsageError if it is missing or was measured differently."""
    path = args.out / f"{args.name}.json"
    if not path.is_file():
        raise UsageError(f"--append: {path} not found; run without --append first")
    old = json.loads(path.read_text())
    settings = {k: str(v) if isinstance(v := getattr(args, k), Path) else v for k in SETTINGS}
    if {k: old["meta"].get(k) for k in settings} != settings:
        raise UsageError(f"--append: {path} was measured with {old['meta']}, not {settings}; use those settings "
                         "or another --name")
    return old["rows"]


def write(args, rows: list[dict]) -> None:
    """``NAME.json`` (meta + rows by step) and ``NAME.png`` (this curve and the --compare ones)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) if isinstance(v := getattr(args, k), Path) else v for k in SETTINGS}
    meta |= {"run_dir": str(args.run_dir), "init_adapter": args.init_adapter and str(args.init_adapter),
             "data": args.data}
    rows = sorted(rows, key=lambda r: r["step"])
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    curves = [(args.name, rows)] + [(p.stem, json.loads(p.read_text())["rows"]) for p in args.compare]
    x_key = "example_tokens_seen" if all("example_tokens_seen" in r for _, c in curves for r in c) else "examples_seen"
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for (label, curve), color in zip(curves, ["tab:blue", "tab:orange", "tab:green", "tab:red"]):
        x = [r[x_key] for r in curve]
        axes[0].plot(x, [r["tpf"] for r in curve], marker="o", color=color, label=label)
        axes[1].plot(x, [r["prefix_agreement_with_ar"] for r in curve], marker="s", color=color, label=label)
    for ax, title in zip(axes, [f"TPF at tau={args.tau}, B={args.block_size}", "common-prefix agreement with tau=1"]):
        ax.set_xlabel(x_key.replace("_", " "))
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"held-out prompts ({', '.join(meta_sets(args))}), reference decoder", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out / f"{args.name}.png", dpi=120)
    plt.close(fig)


def meta_sets(args) -> list[str]:
    return [f"{args.num_prompts} GSM8K test"] + ([f"{args.num_prompts} oasst chat"] if args.chat else [])


if __name__ == "__main__":
    sys.exit(run_main(main))

"""TPF of MARS decoding against training progress, from a mars-train LoRA run's checkpoints.

    python bench/tpf_vs_training.py RUN_DIR --gsm8k FILE [--num-prompts 5] [--max-new-tokens 64]
        [--tau 0.9] [--block-size 4] [--out bench/results] [--init-steps N --append]

For the base model (step 0) and each ``checkpoint-N`` in RUN_DIR: merge the adapter into
the default model and decode the first N GSM8K test questions with the PyTorch reference
MARS decoder (same rule and window protocol as the runtime) at tau = 1 and at the given
tau, B = W. TPF alone misleads (an untrained model's mask predictions can be confident
and wrong), so the agreement of the tau output with the tau = 1 output is reported too.
Writes ``tpf_vs_training.json`` and ``.png``; x axis = examples seen (steps x batch).
A run continued with ``mars-train --lora-init`` is added to an earlier curve with
``--init-steps`` (the steps the initial adapter had) and ``--append``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from peft import PeftModel

from mars_export.model_source import default_checkpoint, load_checkpoint
from mars_export.parity import chat_prompt_ids
from mars_export.reference import ReferenceDecoder
from runtime.decode.params import DecodeParams
from runtime.evaluation.scoring import common_prefix


def checkpoints(run_dir: Path, every: int) -> list[tuple[int, Path | None]]:
    found = sorted((int(p.name.split("-")[1]), p) for p in run_dir.glob("checkpoint-*") if p.is_dir())
    return [(0, None), *((step, path) for step, path in found if step % every == 0 or path == found[-1][1])]


def measure(adapter: Path | None, prompts: list[str], args) -> dict:
    model, tokenizer = load_checkpoint(default_checkpoint())
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    decoder = ReferenceDecoder(model, args.block_size, args.block_size, model.config.mars_mask_token_id,
                               (tokenizer.eos_token_id,))
    tokens = forwards = identical = 0
    prefix = 0.0
    for text in prompts:
        ids = chat_prompt_ids(tokenizer, text)
        ar = decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=args.max_new_tokens)).token_ids
        result = decoder.generate(ids, DecodeParams(tau=args.tau, max_new_tokens=args.max_new_tokens))
        tokens, forwards = tokens + result.num_tokens, forwards + result.num_forwards
        identical += result.token_ids == ar
        prefix += common_prefix(result.token_ids, ar) / max(len(ar), len(result.token_ids))
    return {"tpf": tokens / forwards, "num_tokens": tokens, "num_forwards": forwards,
            "exact_agreement_with_ar": identical / len(prompts), "prefix_agreement_with_ar": prefix / len(prompts)}



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--gsm8k", type=Path, required=True)
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tau", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--every", type=int, default=50, help="use checkpoints whose step is a multiple of this (and the last)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--init-steps", type=int, default=0,
                   help="steps the run's --lora-init adapter had already trained; added to each checkpoint's step")
    p.add_argument("--append", action="store_true",
                   help="add rows to the existing tpf_vs_training.json (same settings; no new step-0 row)")
    args = p.parse_args()
    prompts = [json.loads(line)["question"] for line in args.gsm8k.open()][:args.num_prompts]
    rows = previous_rows(args) if args.append else []
    for step, adapter in checkpoints(args.run_dir, args.every)[1 if args.append else 0:]:
        state = json.loads((adapter / "trainer_state.json").read_text()) if adapter else {"train_batch_size": 0}
        step += args.init_steps if adapter else 0
        row = {"step": step, "examples_seen": step * state["train_batch_size"], **measure(adapter, prompts, args)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(args, rows)


def previous_rows(args) -> list[dict]:
    """The rows of the existing curve; SystemExit if it is missing or was measured differently."""
    path = args.out / "tpf_vs_training.json"
    if not path.is_file():
        raise SystemExit(f"error: --append: {path} not found; run without --append first")
    old = json.loads(path.read_text())
    settings = {k: getattr(args, k) for k in ("tau", "block_size", "num_prompts", "max_new_tokens")}
    if {k: old["meta"][k] for k in settings} != settings:
        raise SystemExit(f"error: --append: {path} was measured with {old['meta']}, not {settings}")
    return old["rows"]


def write(args, rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"tau": args.tau, "block_size": args.block_size, "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens, "run_dir": str(args.run_dir)}
    rows = sorted(rows, key=lambda r: r["step"])
    (args.out / "tpf_vs_training.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    seen = [r["examples_seen"] for r in rows]
    ax.plot(seen, [r["tpf"] for r in rows], marker="o", label="TPF")
    ax.plot(seen, [r["prefix_agreement_with_ar"] for r in rows], marker="s", label="prefix agreement with AR")
    ax.set_xlabel("training examples seen")
    ax.set_ylabel(f"tau={args.tau}, B={args.block_size}")
    ax.legend(fontsize=8)
    ax.set_title("GSM8K test prompts, reference decoder", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out / "tpf_vs_training.png", dpi=120)


if __name__ == "__main__":
    main()

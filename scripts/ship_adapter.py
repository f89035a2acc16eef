"""Package a mars-train LoRA checkpoint as the adapter shipped for ``default-mars``.

    python scripts/ship_adapter.py CHECKPOINT_DIR [--out mars_export/data/smollm2-135m-mars]
        --block-size 4 --command "the mars-train command that produced it" --data FILE [--data FILE ...]

Copies ``adapter_config.json``, stores the adapter weights as float16 safetensors (half
the size; they are cast back when merged), and writes ``mars_adapter.json`` with the mask
token, block size, the training command, optimizer steps, examples and tokens seen, and
the last logged loss terms (from the checkpoint's ``trainer_state.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mars_export.default_model import DEFAULT_BASE_MODEL_NAME
from mars_export.model_source import default_checkpoint
from mars_export.training.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, write_shipped_adapter
from mars_export.training.data import load_examples
from runtime.command_line import ArgumentParser, run_main


def training_stats(checkpoint: Path, data: list[str], max_length: int) -> dict:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    logs = [entry for entry in state["log_history"] if "loss_mask" in entry]
    batch = state["train_batch_size"]
    from transformers import AutoTokenizer
    examples, _ = load_examples(data, AutoTokenizer.from_pretrained(default_checkpoint()), max_length)
    mean_tokens = sum(e.length for e in examples) / len(examples)
    seen = state["global_step"] * batch
    return {"optimizer_steps": state["global_step"], "examples_seen": seen,
            "tokens_seen_estimate": round(seen * mean_tokens), "mean_example_tokens": round(mean_tokens, 1),
            "last_log": {k: logs[-1][k] for k in ("step", "loss", "loss_mask", "loss_ar")} if logs else None,
            "loss_curve": [{k: e[k] for k in ("step", "loss_mask", "loss_ar")} for e in logs]}


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--out", type=Path, default=Path("mars_export/data/smollm2-135m-mars"))
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--command", required=True)
    p.add_argument("--data", action="append", required=True)
    args = p.parse_args(argv)
    missing = [name for name in ("trainer_state.json", ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)
               if not (args.checkpoint / name).is_file()]
    if missing:
        p.error(f"{args.checkpoint} is no checkpoint of a mars-train --lora run: it holds no {missing[0]}; pass one of "
                "the run's checkpoint-N folders")
    base_config = json.loads((default_checkpoint() / "config.json").read_text())
    try:
        stats = training_stats(args.checkpoint, args.data, args.max_length)
    except ValueError as e:  # a missing or malformed training file, as mars-train reads it
        p.error(f"--data: {e}")
    info = {"mask_token": base_config["mars_mask_token"], "block_size": args.block_size, "command": args.command,
            **stats}
    write_shipped_adapter(args.checkpoint, args.out, info, DEFAULT_BASE_MODEL_NAME)
    print(json.dumps({k: v for k, v in info.items() if k != "loss_curve"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))

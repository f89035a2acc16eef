"""Write a random-weight checkpoint of a real model's size in the published MARS layout.

    python scripts/random_checkpoint.py CONFIG -o DIR [--tokenizer DIR] [--seed 0] [--dtype bfloat16]

CONFIG is a Hugging Face ``config.json`` (or its directory), for example
``samples/jetson/configs/qwen2.5-1.5b-instruct``. DIR gets what the paper's published MARS
checkpoints hold (github.com/Xalp/MARS): the weights, a ``config.json`` whose
``model_type`` / ``architectures`` are the authors' (``a2d-qwen2``,
``A2DQwen2LMHeadModel``), and a tokenizer with ``<|mask|>`` added as its ``mask_token``.
No weights are downloaded: they are transformers' random initialization (seeded), so
exports, memory and speed can be measured at real sizes without the real checkpoint.
The tokenizer (default: the default model's, which uses the same ChatML chat template as
Qwen2.5) keeps the config's embedding rows (Qwen2.5: 151,936), so ``<|mask|>`` lies in the
padding rows as in the published checkpoints; bos / eos / pad ids become the tokenizer's.
Name DIR like the published ones (``MARS-Qwen2.5-1.5B-blk4``) and ``mars-export DIR``
takes B from the name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mars_export.model_source import default_checkpoint  # noqa: E402
from runtime.command_line import ArgumentParser, existing_folder, run_main  # noqa: E402

# transformers model type -> the authors' model type and class name (dllm/pipelines/a2d/models).
A2D_LAYOUTS = {"qwen2": ("a2d-qwen2", "A2DQwen2LMHeadModel"), "qwen3": ("a2d-qwen3", "A2DQwen3LMHeadModel"),
               "llama": ("a2d-llama", "A2DLlamaLMHeadModel")}
MASK_TOKEN = "<|mask|>"


def write_published_layout(directory: Path, model_type: str) -> None:
    """Rewrite ``directory/config.json``'s ``model_type`` and ``architectures`` to the authors' for ``model_type``.

    Raises:
        ValueError: the authors' code has no class for ``model_type``.
    """
    if model_type not in A2D_LAYOUTS:
        raise ValueError(f"no published MARS layout for model_type {model_type!r}; known: {sorted(A2D_LAYOUTS)}")
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["model_type"], config["architectures"] = A2D_LAYOUTS[model_type][0], [A2D_LAYOUTS[model_type][1]]
    path.write_text(json.dumps(config, indent=2) + "\n")


def make_random_checkpoint(config_path: Path, out: Path, tokenizer_dir: Path, seed: int, dtype: torch.dtype) -> Path:
    """Save a seeded random model of ``config_path``'s architecture plus the tokenizer to ``out``.

    Raises:
        ValueError: the tokenizer's ids (with ``<|mask|>``) do not fit the config's embedding rows,
            or the model type has no published layout.
    """
    config = AutoConfig.from_pretrained(config_path.parent if config_path.name == "config.json" else config_path)
    if config.model_type not in A2D_LAYOUTS:  # refused before anything is written (write_published_layout's check)
        raise ValueError(f"no published MARS layout for model_type {config.model_type!r}; known: {sorted(A2D_LAYOUTS)}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if tokenizer.mask_token is None:
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the config only {config.vocab_size} rows")
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_published_layout(out, config.model_type)
    return out


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path, help="a Hugging Face config.json or its directory")
    p.add_argument("-o", "--output", type=Path, required=True, help="checkpoint directory to write (must not exist)")
    p.add_argument("--tokenizer", type=existing_folder, default=None,
                   help="tokenizer directory (default: the default model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="dtype of the saved weights (default bfloat16, as the published checkpoints)")
    args = p.parse_args(argv)
    if not args.config.exists():  # else transformers reads the path as a hub id and names its spelling
        p.error(f"{args.config} does not exist; give a Hugging Face config.json or the folder holding it")
    if args.output.exists():
        p.error(f"{args.output} already exists; choose another -o")
    try:
        out = make_random_checkpoint(args.config, args.output, args.tokenizer or default_checkpoint(), args.seed,
                                     getattr(torch, args.dtype))
    except (OSError, ValueError) as e:
        p.error(str(e))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))

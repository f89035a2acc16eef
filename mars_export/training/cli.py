"""``mars-train``: MARS fine-tuning (MARS, arXiv 2604.07023) and self-distillation data.

Usage::

    mars-train MODEL --data FILE [--data FILE ...] --output DIR [options]
    mars-train distill MODEL|BUNDLE --prompts FILE [--prompts FILE ...] --output data.jsonl
                       [--max-new-tokens N] [--batch-size K] [--threads N]

Training runs on the Hugging Face Trainer, so ``accelerate launch -m mars_export.training.cli``
or ``torchrun`` spread it over devices. A model literally called ``distill`` must be
written as ``./distill``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from runtime.backends.providers import OnnxRuntimeMissing
from runtime.command_line import ArgumentParser, threads_value
from mars_export.default_model import MODEL_SPECS_HELP
from mars_export.training.config import LR_SCHEDULERS, PRECISIONS, LoraSettings, TrainConfig


def make_train_parser() -> ArgumentParser:
    p = ArgumentParser(prog="mars-train", description="Fine-tune a causal LM with the MARS objective "
                                "(two streams, block size B, loss = CE(noisy) + alpha * CE(clean)).",
                                epilog="Self-distillation data: mars-train distill --help")
    p.add_argument("model", metavar="MODEL", help=MODEL_SPECS_HELP)
    p.add_argument("--revision", default=None, help="with a hub id: the branch, tag or commit to train (default: main)")
    p.add_argument("--data", action="append", required=True, metavar="FILE",
                   help="training data (.jsonl/.json; chat, prompt/response, instruction or GSM8K records); repeatable")
    p.add_argument("--output", required=True, metavar="DIR", help="checkpoints and the final model go here")
    p.add_argument("--block-size", type=int, default=4, metavar="B", help="MARS block size (default 4)")
    p.add_argument("--alpha", type=float, default=1.0, help="weight of the clean-stream AR loss (default 1)")
    p.add_argument("--max-length", type=int, default=1024,
                   help="drop (and count) examples longer than this many tokens (default 1024)")
    p.add_argument("--mask-token", default=None, help="mask token (default: the one recorded with the model)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps; overrides --epochs when > 0")
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate (default 1e-5; try 1e-4 with --lora)")
    p.add_argument("--lr-scheduler", choices=LR_SCHEDULERS, default="linear")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1, help="examples per device per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-steps", type=int, default=500, help="checkpoint every N steps; 0 = none")
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="auto: bf16 (or fp16) on CUDA, fp32 on CPU; bf16 autocast also runs on CPU")
    p.add_argument("--group-by-length", action="store_true",
                   help="batch examples of similar length together (less padding with --batch-size > 1)")
    lora = p.add_argument_group("LoRA (merged into the weights of the final model)")
    lora.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of all weights")
    lora.add_argument("--lora-rank", type=int, default=16)
    lora.add_argument("--lora-alpha", type=float, default=32.0)
    lora.add_argument("--lora-dropout", type=float, default=0.05)
    lora.add_argument("--lora-targets", default="all-linear", help="'all-linear' or names like q_proj,v_proj")
    lora.add_argument("--lora-freeze-mask-embedding", action="store_true",
                      help="do not train the mask token's embedding row")
    lora.add_argument("--lora-init", metavar="DIR", default=None,
                      help="continue training this LoRA adapter (e.g. mars_export/data/smollm2-135m-mars) "
                           "instead of a fresh one; its rank and targets apply")
    return p


def make_distill_parser() -> ArgumentParser:
    p = ArgumentParser(prog="mars-train distill",
                                description="Answer prompts with the model's own greedy AR output (the runtime "
                                            "engine at tau 1, continuous batching); write chat JSONL.")
    p.add_argument("model", metavar="MODEL",
                   help=MODEL_SPECS_HELP + " (exported to a temporary bundle first), or a bundle directory of it")
    p.add_argument("--revision", default=None, help="with a hub id: the branch, tag or commit to answer with "
                                                    "(default: main)")
    p.add_argument("--prompts", action="append", required=True, metavar="FILE",
                   help="any data file mars-train reads (answers ignored); repeatable")
    p.add_argument("--output", required=True, metavar="FILE", help="chat JSONL to write")
    p.add_argument("--max-new-tokens", type=int, default=512,
                   help="token cap; longer answers are cut there, kept and marked \"cut\": true (default 512)")
    p.add_argument("--batch-size", type=int, default=8, help="requests decoding at once (default 8)")
    p.add_argument("--max-prompts", type=int, default=None, help="answer only the first N prompts")
    p.add_argument("--threads", type=threads_value, default=0,
                   help="onnxruntime intra-op threads (default 0: its choice)")
    p.add_argument("--mask-token", default=None)
    return p


def distill_main(argv: list[str]) -> int:
    """``mars-train distill``; returns the exit status (2 on a bad argument or input, one ``error:`` line)."""
    try:
        args = make_distill_parser().parse_args(argv)
        from mars_export.training.distill import distill
        report = distill(args.model, args.prompts, args.output, args.max_new_tokens, args.batch_size,
                         args.max_prompts, args.mask_token, args.threads, args.revision)
    except (ValueError, OnnxRuntimeMissing) as err:  # a value, prompts or model (a hub error); no [cpu] extra
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Build the validated :class:`TrainConfig` (raises ValueError on a bad value)."""
    lora = None
    if args.lora_init is not None and not args.lora:
        raise ValueError("--lora-init continues a LoRA adapter: add --lora")
    default = LoraSettings()
    shaped = (args.lora_rank, args.lora_alpha, args.lora_targets) != (default.rank, default.alpha, default.targets)
    if args.lora_init is not None and shaped:
        raise ValueError("--lora-rank, --lora-alpha and --lora-targets do not apply with --lora-init "
                         "(the adapter keeps its own); drop them")
    if args.lora:
        lora = LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                            targets=args.lora_targets, train_mask_embedding=not args.lora_freeze_mask_embedding,
                            init=args.lora_init)
    return TrainConfig(
        model=args.model, data=args.data, output=args.output, block_size=args.block_size, alpha=args.alpha,
        max_length=args.max_length, mask_token=args.mask_token, lora=lora, epochs=args.epochs,
        max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler=args.lr_scheduler,
        warmup_steps=args.warmup_steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
        seed=args.seed, save_steps=args.save_steps, logging_steps=args.logging_steps, resume=args.resume,
        precision=args.precision, group_by_length=args.group_by_length, revision=args.revision,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mars-train``; returns the exit status (2 on a bad argument or input, one ``error:`` line)."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["distill"]:
        return distill_main(argv[1:])
    try:
        config = config_from_args(make_train_parser().parse_args(argv))
    except ValueError as err:  # how the command was typed; argparse's refusals are UsageErrors
        print(f"error: {err}", file=sys.stderr)
        return 2
    from mars_export.training.trainer import end_process_group, prepare_trainer, save_final_model
    try:
        trainer, resume_from = prepare_trainer(config)
    except ValueError as err:  # what --output, the model (a hub error included) or the data hold
        print(f"error: {err}", file=sys.stderr)
        return 2
    trainer.train(resume_from_checkpoint=resume_from)
    save_final_model(trainer, config)
    if trainer.is_world_process_zero():  # once, not once per process under accelerate launch / torchrun
        print(f"saved the MARS model to {config.output}")
    end_process_group(trainer)  # under accelerate launch / torchrun: the order that cannot hang at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())

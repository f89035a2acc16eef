"""One-shot MARS training on a borrowed GPU machine that receives and returns size-limited files.

The machine has torch, transformers, peft and accelerate but no network (and maybe not
this project's other dependencies); each command receives at most 64 MiB of carried files
and returns at most 16 MiB per file written under ``$OUT``. So:

    # here: the weights (the default model as its GGUF Q4_1 blocks) and the prompts, in parts
    .venv/bin/python scripts/gpu_train.py prepare default --prompts ../shared/data/gsm8k/train.jsonl ...
    # there, one command per part, back to back on the same warm machine (carry=[".gpu-run/part-K"])
    python3 scripts/gpu_train.py receive .gpu-run/part-1
    python3 scripts/gpu_train.py receive .gpu-run/part-2 && python3 scripts/gpu_train.py train --out "$OUT"

``receive`` checks each part (size, sha256 of every file) and keeps it in ``--store``
(``/tmp/mars-gpu-run``). ``train`` rebuilds the checkpoint bit-exactly (each tensor's
sha256 against the sending side's), self-distills the prompts with transformers ``generate``
(greedy, batched, float32 so the answers are the deployed fp32 model's; answers over
``--max-new-tokens`` are cut and kept, as ``mars-train distill`` does), trains a LoRA adapter
with the MARS objective (bf16) within a time budget, and writes to ``--out``: ``adapter/``
(the layout of ``mars_export/data/smollm2-135m-mars``, its base model named as ``prepare``
resolved it: the default model's name, the hub id with its commit, or the checkpoint
directory's path here), ``train_log.json``, ``gpu_train.log`` and ``distilled.jsonl.gz``,
refusing any file over 16 MiB.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, uninstalled on the GPU machine

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from mars_export import default_model  # noqa: E402
from mars_export.default_model import DEFAULT_BASE_MODEL_NAME  # noqa: E402
from mars_export.hub_model import check_revision, fetch_snapshot, is_hub_id  # noqa: E402
from mars_export.model_source import DEFAULT_SPEC, default_checkpoint, load_model  # noqa: E402
from mars_export.training.adapter import write_shipped_adapter  # noqa: E402
from mars_export.training.config import LoraSettings, TrainConfig  # noqa: E402
from mars_export.training.data import read_records, record_prompt_messages  # noqa: E402
from mars_export.training.distill import generate_greedy, prepare_record, read_prompts  # noqa: E402
from mars_export.training.trainer import prepare_trainer  # noqa: E402
from mars_export.training.transfer import (  # noqa: E402
    MIB, assemble_checkpoint, check_size, prepare_parts, receive_part,
)
from runtime.command_line import ArgumentParser, UsageError  # noqa: E402

MAX_RETURN_BYTES = 16 * MIB  # the most one returned file may hold
DEFAULT_PART_MIB = 50.0
DEFAULT_STORE = "/tmp/mars-gpu-run"
PROMPTS_FILE, DISTILLED_FILE = "prompts.jsonl.gz", "distilled.jsonl"
SOURCE_FILE = "source.json"  # {"base_model": the name of the model sent}, from prepare to train
logger = logging.getLogger("gpu_train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="scripts/gpu_train.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="here: write the weights and prompts as part directories")
    prep.add_argument("model", help="'default' (sent as its GGUF blocks), a checkpoint directory (float32) or a "
                                    "Hugging Face hub id (owner/name; its snapshot is fetched here)")
    prep.add_argument("--revision", default=None,
                      help="with a hub id: the branch, tag or commit to send (default: main)")
    prep.add_argument("--prompts", action="append", required=True, metavar="FILE", help="data files; repeatable")
    prep.add_argument("--max-prompts", type=int, default=None, help="a random sample of this many prompts")
    prep.add_argument("--seed", type=int, default=0, help="shuffles the prompts (a time-limited run sees a mix)")
    prep.add_argument("--out", default=".gpu-run", help="directory of the parts (default .gpu-run, gitignored)")
    prep.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB,
                      help=f"most MiB per part, all its files (default {DEFAULT_PART_MIB:g}; at most 64)")
    recv = sub.add_parser("receive", help="there: check one part and keep it in the store")
    recv.add_argument("part")
    recv.add_argument("--store", default=DEFAULT_STORE)
    train = sub.add_parser("train", help="there: rebuild, distill, train, write the adapter and logs to --out")
    train.add_argument("--store", default=DEFAULT_STORE)
    train.add_argument("--out", required=True, help="returned files go here ($OUT)")
    train.add_argument("--max-new-tokens", type=int, default=256, help="distillation token cap (default 256)")
    train.add_argument("--distill-batch", type=int, default=256, help="prompts per generate call (default 256)")
    train.add_argument("--distill-seconds", type=float, default=200.0, help="distillation time budget (default 200)")
    train.add_argument("--max-prompts", type=int, default=None, help="distill at most this many prompts")
    train.add_argument("--train-seconds", type=float, default=200.0, help="training time budget (default 200)")
    train.add_argument("--epochs", type=float, default=2.0, help="epochs over the distilled data (default 2)")
    train.add_argument("--max-steps", type=int, default=-1, help="optimizer steps; overrides --epochs when > 0")
    train.add_argument("--batch-size", type=int, default=32)
    train.add_argument("--lr", type=float, default=3e-4)
    train.add_argument("--block-size", type=int, default=4)
    train.add_argument("--max-length", type=int, default=1024)
    train.add_argument("--lora-rank", type=int, default=16)
    train.add_argument("--lora-init", default=None,
                       help="continue this adapter (e.g. mars_export/data/smollm2-135m-mars)")
    train.add_argument("--logging-steps", type=int, default=5)
    train.add_argument("--group-by-length", action="store_true")
    train.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def prepare(args: argparse.Namespace) -> list[Path]:
    """Write the parts and print the device commands.

    Raises:
        ValueError: ``--revision`` without a hub id, or a hub id the cache and the hub do not have
            (:func:`~mars_export.hub_model.fetch_snapshot`); a malformed prompt file; a directory with no
            safetensors weights, one file or shards (:func:`~mars_export.training.transfer.read_weights`).
    """
    check_revision(args.model, args.revision)
    if args.model == DEFAULT_SPEC:
        checkpoint, gguf_path, source = default_checkpoint(), default_model.fetch_gguf(), DEFAULT_BASE_MODEL_NAME
    elif is_hub_id(args.model):  # the GPU machine has no network
        snapshot = fetch_snapshot(args.model, args.revision)
        checkpoint, gguf_path, source = snapshot.path, None, snapshot.source
    else:
        checkpoint, gguf_path, source = Path(args.model), None, str(Path(args.model).resolve())
    prompts = read_prompts(args.prompts)
    random.Random(args.seed).shuffle(prompts)
    with tempfile.TemporaryDirectory() as tmp:
        prompts_path, source_path = Path(tmp) / PROMPTS_FILE, Path(tmp) / SOURCE_FILE
        with gzip.open(prompts_path, "wt", encoding="utf-8") as sink:
            sink.writelines(json.dumps({"messages": p}, ensure_ascii=False) + "\n" for p in prompts[:args.max_prompts])
        source_path.write_text(json.dumps({"base_model": source}) + "\n")
        parts = prepare_parts(checkpoint, Path(args.out), int(args.part_mib * MIB), gguf_path,
                              {PROMPTS_FILE: prompts_path, SOURCE_FILE: source_path})
    for part in parts:
        size = sum(f.stat().st_size for f in part.rglob("*") if f.is_file()) / MIB
        print(json.dumps({"carry": [str(part)], "mib": round(size, 2),
                          "command": f"python3 scripts/gpu_train.py receive {part}"}))
    print("then, in the same call as the last part: python3 scripts/gpu_train.py train --out \"$OUT\"")
    return parts


def distill_on_device(model, tokenizer, prompts: list, args: argparse.Namespace, path: Path) -> dict:
    """Greedy answers of ``prompts`` in their (shuffled) order until the time budget; returns the counts.

    Each run of 8 batches is sorted by prompt length (less left padding), so a run cut
    short by the budget still holds the mix of prompts, not the shortest ones.
    """
    stats = {"num_prompts": len(prompts), "num_written": 0, "num_cut": 0, "num_tokens": 0}
    start, last, group = time.perf_counter(), 0.0, 8 * args.distill_batch
    with open(path, "w", encoding="utf-8") as sink:
        for begin in range(0, len(prompts), args.distill_batch):
            if time.perf_counter() - start + last > args.distill_seconds:
                break
            if begin % group == 0:
                run = sorted(prompts[begin:begin + group], key=lambda p: len(
                    tokenizer.apply_chat_template(p, add_generation_prompt=True)))
            t = time.perf_counter()
            batch = run[begin % group:begin % group + args.distill_batch]
            for prompt, ids in zip(batch, generate_greedy(model, tokenizer, batch, args.max_new_tokens)):
                record = prepare_record(prompt, ids, {tokenizer.eos_token_id},
                                        lambda x: tokenizer.decode(x, skip_special_tokens=True))
                sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                stats["num_written"] += 1
                stats["num_cut"] += record["cut"]
                stats["num_tokens"] += len(ids)
            last = time.perf_counter() - t
            logger.info("distilled %d/%d prompts (%.1f s)", stats["num_written"], len(prompts),
                        time.perf_counter() - start)
    stats["seconds"] = round(time.perf_counter() - start, 1)
    stats["tokens_per_second"] = round(stats["num_tokens"] / max(stats["seconds"], 1e-9), 1)
    return stats


def train(args: argparse.Namespace) -> dict:
    """Rebuild, distill, train; write the adapter and logs to ``args.out``. Returns the log."""
    out, store, begin = Path(args.out), Path(args.store), time.perf_counter()
    log = {"argv": sys.argv[1:], "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    checkpoint = assemble_checkpoint(store, store / "checkpoint-rebuilt")
    log["base_model"] = read_base_model(store)
    log["rebuild_seconds"] = round(time.perf_counter() - begin, 1)
    logger.info("checkpoint rebuilt bit-exactly in %.1f s", log["rebuild_seconds"])
    log["distill"], mask_token = distill_checkpoint(checkpoint, store, args)
    with open(store / DISTILLED_FILE, "rb") as src, gzip.open(out / f"{DISTILLED_FILE}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)  # returned even if training runs out of time
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    state = train_adapter(checkpoint, store, args)
    log.update(train_seconds=state["seconds"], optimizer_steps=state["global_step"], precision=state["precision"],
               epochs_done=round(state["epoch"] or 0.0, 3), log_history=state["log_history"])
    info = {"mask_token": mask_token, "block_size": args.block_size,
            "command": "python3 scripts/gpu_train.py " + " ".join(sys.argv[1:]),
            "optimizer_steps": log["optimizer_steps"], "epochs": log["epochs_done"], "distill": log["distill"],
            "loss_curve": [{k: e[k] for k in ("step", "loss_mask", "loss_ar")} for e in log["log_history"]
                           if "loss_mask" in e]}
    write_shipped_adapter(store / "run" / "adapter", out / "adapter", info, log["base_model"])
    log["total_seconds"] = round(time.perf_counter() - begin, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    for path in out.rglob("*"):
        if path.is_file():
            check_size(path, MAX_RETURN_BYTES)
    logger.info("done in %.1f s: %d steps, %.2f epochs", log["total_seconds"], log["optimizer_steps"],
                log["epochs_done"])
    return log


def read_base_model(store: Path) -> str:
    """The name of the model ``prepare`` sent (its ``source.json``), for the adapter and the log.

    Raises:
        ValueError: every part arrived but none held ``source.json``: an older ``prepare`` wrote them, and the
            base model they hold cannot be named (the default's name would be wrong for any other model).
    """
    if not (store / SOURCE_FILE).is_file():
        raise ValueError(f"{store} has no {SOURCE_FILE} (the name of the model sent): its parts come from an older "
                         "scripts/gpu_train.py prepare; run prepare again and send the new parts")
    return json.loads((store / SOURCE_FILE).read_text())["base_model"]


def distill_checkpoint(checkpoint: Path, store: Path, args: argparse.Namespace) -> tuple[dict, str]:
    """Distill the received prompts with the rebuilt model (float32, no TF32); (counts, mask token)."""
    torch.backends.cuda.matmul.allow_tf32 = False  # greedy answers of the float32 model, as deployed
    loaded = load_model(str(checkpoint))
    with gzip.open(store / PROMPTS_FILE, "rt", encoding="utf-8") as f:
        (store / "prompts.jsonl").write_text(f.read(), encoding="utf-8")
    prompts = [record_prompt_messages(r) for r in read_records(store / "prompts.jsonl")][:args.max_prompts]
    model = loaded.model.to("cuda" if torch.cuda.is_available() else "cpu")
    stats = distill_on_device(model, loaded.tokenizer, prompts, args, store / DISTILLED_FILE)
    del model, loaded.model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return stats, loaded.mask_token


def train_adapter(checkpoint: Path, store: Path, args: argparse.Namespace) -> dict:
    """Train a LoRA adapter on the distilled data (bf16 on CUDA) into ``store/run/adapter``; the trainer state."""
    lora = (LoraSettings(init=args.lora_init) if args.lora_init
            else LoraSettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank))
    config = TrainConfig(model=str(checkpoint), data=[str(store / DISTILLED_FILE)], output=str(store / "run"),
                         block_size=args.block_size, max_length=args.max_length, lora=lora, epochs=args.epochs,
                         max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler="constant_with_warmup",
                         warmup_steps=10, batch_size=args.batch_size, seed=args.seed, save_steps=0,
                         logging_steps=args.logging_steps, group_by_length=args.group_by_length)
    shutil.rmtree(config.output, ignore_errors=True)
    trainer, _ = prepare_trainer(config)
    trainer.add_callback(TimeBudget(args.train_seconds))
    start = time.perf_counter()
    trainer.train()
    trainer.save_model(str(Path(config.output) / "adapter"))
    return {"seconds": round(time.perf_counter() - start, 1), "global_step": trainer.state.global_step,
            "epoch": trainer.state.epoch, "log_history": trainer.state.log_history,
            "precision": "bf16" if trainer.args.bf16 else "fp32"}


class TimeBudget(TrainerCallback):
    """Stops training at the first step end after ``seconds`` of training."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() - self.start > self.seconds:
            logger.info("training time budget of %.0f s used at step %d", self.seconds, state.global_step)
            control.should_training_stop = True


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as err:  # argparse's refusals: one line, as the errors below
        print(f"error: {err}", file=sys.stderr)
        return 2
    handlers = [logging.StreamHandler()]
    if args.command == "train":
        Path(args.out).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(args.out) / "gpu_train.log"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", handlers=handlers, force=True)
    try:
        if args.command == "prepare":
            prepare(args)
        elif args.command == "receive":
            info = receive_part(Path(args.part), Path(args.store))
            print(f"part {info['index']} of {info['num_parts']} received into {args.store}")
        else:
            train(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

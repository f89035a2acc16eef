"""Example tokens/s of the MARS training step (``mars-train``'s own trainer) for each training setting.

    python bench/train_throughput.py MODEL --data FILE [--data FILE ...] [--num-examples 64]
        [--steps 8] [--warmup 2] [--rounds 2] [--batch-size 4] [--max-length 256]
        [--precisions fp32 bf16] [--threads 1 2] [--grouping random length]
        [--lora-ranks 16 8] [--lora-targets all-linear q_proj,v_proj] [--freeze-mask-embedding no yes]
        [--out bench/results]

One factor at a time: the baseline is the first value of every axis, and each other value
of an axis is one point that differs from the baseline in that axis alone. Every point runs
``mars-train``'s step (MarsTrainer: two-stream forward, MARS loss, backward, AdamW) on the
same examples (the first ``--num-examples`` of the data files, taken in turn) for
``--warmup`` untimed and ``--steps`` timed optimizer steps. ``--rounds`` repeats the
points interleaved (A B C A B C), so slow drift of a shared machine hits all points alike.

Reported per point: example tokens/s (real prompt + response tokens of one stream, what
the data holds) and padded tokens/s (batch x padded length), the mean loss of the timed
steps (a sanity check, not a measure of how well a setting trains), and the step time.
Writes ``train_throughput.json`` and ``train_throughput.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import TrainerCallback

from mars_export.default_model import check_model_spec
from mars_export.training.config import LoraSettings, TrainConfig
from mars_export.training.data import read_records
from mars_export.training.trainer import prepare_trainer
from runtime.command_line import ArgumentParser, UsageError, run_main


@dataclass(frozen=True)
class Point:
    """One training setting."""

    precision: str = "fp32"
    threads: int = 1
    grouping: str = "random"
    lora_rank: int = 16
    lora_targets: str = "all-linear"
    freeze_mask_embedding: str = "no"

    @property
    def label(self) -> str:
        return (f"{self.precision} t{self.threads} {self.grouping} r{self.lora_rank} {self.lora_targets}"
                + (" frozen-mask" if self.freeze_mask_embedding == "yes" else ""))


AXES = {"precisions": "precision", "threads": "threads", "grouping": "grouping", "lora_ranks": "lora_rank",
        "lora_targets": "lora_targets", "freeze_mask_embedding": "freeze_mask_embedding"}


def make_points(args: argparse.Namespace) -> list[Point]:
    """The baseline (first value of every axis), then one point per other value of each axis."""
    base = Point(**{field: getattr(args, axis)[0] for axis, field in AXES.items()})
    points = [base]
    for axis, field in AXES.items():
        points += [replace(base, **{field: value}) for value in getattr(args, axis)[1:]]
    return points


class StepClock(TrainerCallback):
    """Wall time of every optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


class CountingCollator:
    """Wraps the collator; records (real tokens, padded tokens) of every batch it makes."""

    def __init__(self, collator) -> None:
        self.collator, self.counts = collator, []

    def __call__(self, items):
        batch = self.collator(items)
        self.counts.append((int(batch["lengths"].sum()), batch["input_ids"].numel()))
        return batch


def run_point(point: Point, args: argparse.Namespace, data: Path, output: Path) -> dict:
    """Train ``--warmup + --steps`` steps at ``point``; tokens/s of the timed steps."""
    lora = LoraSettings(rank=point.lora_rank, alpha=2.0 * point.lora_rank, targets=point.lora_targets,
                        train_mask_embedding=point.freeze_mask_embedding == "no")
    config = TrainConfig(model=args.model, data=[str(data)], output=str(output), block_size=args.block_size,
                         max_length=args.max_length, lora=lora, max_steps=args.warmup + args.steps,
                         learning_rate=1e-4, lr_scheduler="constant", batch_size=args.batch_size, save_steps=0,
                         logging_steps=1, precision=point.precision, group_by_length=point.grouping == "length",
                         seed=args.seed)
    previous = torch.get_num_threads()
    torch.set_num_threads(point.threads)
    try:
        trainer, _ = prepare_trainer(config)
        clock, counter = StepClock(), CountingCollator(trainer.data_collator)
        trainer.data_collator = counter
        trainer.add_callback(clock)
        trainer.train()
    finally:
        torch.set_num_threads(previous)
    timed = slice(args.warmup, args.warmup + args.steps)
    seconds = sum(clock.times[timed])
    real, padded = (sum(c[i] for c in counter.counts[timed]) for i in (0, 1))
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e][timed]
    return {"example_tokens_per_s": real / seconds, "padded_tokens_per_s": padded / seconds,
            "step_seconds": seconds / args.steps, "padding_fraction": 1 - real / padded,
            "mean_loss": statistics.fmean(losses) if losses else None}


def write_subset(paths: list[str], num_examples: int, out: Path) -> Path:
    """The first ``num_examples`` records, taken from the files in turn, as one JSONL file."""
    records = [read_records(path) for path in paths]
    mixed = [r for group in zip(*records) for r in group] if len(records) > 1 else records[0]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in mixed[:num_examples]))
    return out


def summarize(points: list[Point], rounds: list[list[dict]]) -> list[dict]:
    """Per point: the setting, every round's figures, and the median example tokens/s."""
    rows = []
    for i, point in enumerate(points):
        runs = [r[i] for r in rounds]
        rows.append({"label": point.label, "setting": point.__dict__, "rounds": runs,
                     "example_tokens_per_s": statistics.median(r["example_tokens_per_s"] for r in runs)})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh([r["label"] for r in rows], [r["example_tokens_per_s"] for r in rows], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel("example tokens/s (median over rounds)")
    ax.set_title("MARS training step throughput (first row: baseline)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="'default', a .gguf file or a checkpoint directory")
    p.add_argument("--data", action="append", required=True)
    p.add_argument("--num-examples", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per point")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--threads", nargs="+", type=int, default=[torch.get_num_threads(), 1])
    p.add_argument("--grouping", nargs="+", default=["random", "length"], choices=["random", "length"])
    p.add_argument("--lora-ranks", nargs="+", type=int, default=[16, 8])
    p.add_argument("--lora-targets", nargs="+", default=["all-linear", "q_proj,k_proj,v_proj,o_proj"])
    p.add_argument("--freeze-mask-embedding", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    if min(args.steps, args.rounds, args.num_examples) < 1 or args.warmup < 0:
        p.error("--steps, --rounds and --num-examples must be >= 1 and --warmup >= 0")
    try:
        check_model_spec(args.model)
    except ValueError as e:  # no such file, or a folder that is no checkpoint
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    points = make_points(args)
    with tempfile.TemporaryDirectory(prefix="train-throughput-") as tmp:
        try:
            data = write_subset(args.data, args.num_examples, Path(tmp) / "examples.jsonl")
        except ValueError as e:  # a missing or malformed training file
            raise UsageError(f"--data: {e}") from e
        rounds = [[run_point(pt, args, data, Path(tmp) / f"r{r}-{i}") for i, pt in enumerate(points)]
                  for r in range(args.rounds)]
    rows = summarize(points, rounds)
    result = {"model": args.model, "machine": {"cpu": platform.processor() or platform.machine(),
                                               "torch": torch.__version__, "cuda": torch.cuda.is_available()},
              "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"data": args.data}, "points": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_throughput.json").write_text(json.dumps(result, indent=1, default=str))
    plot(rows, args.out / "train_throughput.png")
    for row in rows:
        print(f"{row['example_tokens_per_s']:9.1f} example tokens/s  {row['label']}")
    return result


if __name__ == "__main__":
    sys.exit(run_main(main))

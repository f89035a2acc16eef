"""Several runs of the peer benchmark summed up: each row's decode tok/s per run, and our speed over a peer's within each run.

    python bench/peers_runs.py RUN_DIR [RUN_DIR ...] [--out bench/results] [--name peers_runs] [--force]

Each RUN_DIR holds the ``peers.json`` one ``scripts/bench_peers.sh`` run wrote (its ``OUT``), or one
round of a run with ``ROUNDS=N`` (``OUT/round1`` ..., which that run sums up itself).
On a shared machine the speed drifts by tens of percent between minutes, and one run measures
its engines one after another, so a single run's ratio ours / peer carries that drift. This
takes the ratio inside every run (the two rows of one run, same prompts, settings and
machine), then its median, min and max over the runs; likewise each row's decode tok/s.
Ratios are of decode tokens/s (tokens after each sequence's first / time after TTFT), at each
batch size both rows ran; above 1 ours is faster.

Writes {name}.json, {name}.csv (column ``kind``: ``speed`` or ``ratio``) and {name}.png (each
ratio per run, and its median) to --out, and prints Markdown tables.
"""

from __future__ import annotations

import json
import statistics
import sys
from functools import partial
from pathlib import Path

from results_files import add_results_options, check_results, write_results  # bench/ is on the path
from runtime.command_line import ArgumentParser, UsageError, run_main

OK = "ok"
# (label, numerator (engine, variant), denominator (engine, variant)): the comparisons of GitHub issue 11.
RATIOS = (
    ("ours fp32 ar / GenAI fp32", ("ours", "ar"), ("ortgenai", "model builder fp32")),
    ("ours fp32 ar / llama.cpp F32", ("ours", "ar"), ("llamacpp", "gguf f32")),
    ("fused fp32 ar / GenAI fp32", ("ours", "fused ar"), ("ortgenai", "model builder fp32")),
    ("fused fp32 ar / llama.cpp F32", ("ours", "fused ar"), ("llamacpp", "gguf f32")),
    ("ours int8 ar / llama.cpp Q8_0", ("ours", "int8 ar"), ("llamacpp", "gguf q8_0")),
    ("fused int8 ar / llama.cpp Q8_0", ("ours", "fused int8 ar"), ("llamacpp", "gguf q8_0")),
    ("ours int4 ar / llama.cpp Q4_1", ("ours", "int4 ar"), ("llamacpp", "gguf q4_1")),
    ("fused int4 ar / llama.cpp Q4_1", ("ours", "fused int4 ar"), ("llamacpp", "gguf q4_1")),
    ("fused int4 ar / llama.cpp Q8_0", ("ours", "fused int4 ar"), ("llamacpp", "gguf q8_0")),
    ("fused fp32 ar / ours fp32 ar", ("ours", "fused ar"), ("ours", "ar")),
    ("fused int8 ar / ours int8 ar", ("ours", "fused int8 ar"), ("ours", "int8 ar")),
    ("ours fp32 verify + both / ours fp32 ar", ("ours", "verify + both"), ("ours", "ar")),
    ("fused fp32 verify + both / GenAI fp32", ("ours", "fused verify + both"), ("ortgenai", "model builder fp32")),
    ("fused int8 verify + both / llama.cpp Q8_0", ("ours", "fused int8 verify + both"), ("llamacpp", "gguf q8_0")),
)


def read_run(run_dir: Path) -> dict[tuple[str, str, int], float]:
    """(engine, variant, batch size) -> decode tok/s of the rows of ``run_dir``/peers.json that ran.

    Raises:
        UsageError: peers.json missing or not a peer benchmark's report.
    """
    path = run_dir / "peers.json"
    if not path.is_file():
        raise UsageError(f"{path} not found; pass folders a scripts/bench_peers.sh run wrote (its OUT)")
    try:
        report = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise UsageError(f"{path} is not JSON ({e}); is it the report of bench/peers.py?") from e
    rows = report.get("rows") if isinstance(report, dict) else None
    if not isinstance(rows, list):
        raise UsageError(f"{path} has no rows; is it the report of bench/peers.py?")
    return {(r["engine"], r["variant"], r["batch_size"]): r["decode_tokens_per_second"] for r in rows
            if r.get("status") == OK and r.get("decode_tokens_per_second")}


def spread(values: list[float]) -> dict:
    """The per-run values and their median, min and max."""
    return {"per_run": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict]) -> dict:
    """``speeds``: each row that ran in every run, with its decode tok/s per run; ``ratios``: each
    :data:`RATIOS` comparison at each batch size whose two rows ran in every run, per run; ``left_out``:
    the rows that ran in some runs only, with how many."""
    by_batch = lambda k: (k[2], k[0], k[1])  # noqa: E731
    common = set.intersection(*(set(run) for run in runs))
    keys = sorted(common, key=by_batch)
    partial = sorted(set.union(*(set(run) for run in runs)) - common, key=by_batch)
    left_out = [{"engine": e, "variant": v, "batch_size": b, "num_runs": sum((e, v, b) in run for run in runs)}
                for e, v, b in partial]
    speeds = [{"engine": e, "variant": v, "batch_size": b, **spread([run[e, v, b] for run in runs])}
              for e, v, b in keys]
    ratios = []
    for label, top, bottom in RATIOS:
        for batch in sorted({b for _, _, b in keys}):
            if (*top, batch) in keys and (*bottom, batch) in keys:
                ratios.append({"ratio": label, "batch_size": batch,
                               **spread([run[(*top, batch)] / run[(*bottom, batch)] for run in runs])})
    return {"speeds": speeds, "ratios": ratios, "left_out": left_out}


def markdown(summary: dict, num_runs: int) -> str:
    """The two tables as Markdown."""
    lines = [f"Decode tok/s over {num_runs} runs:", "", "| engine | variant | batch | median | min | max |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {s['engine']} | {s['variant']} | {s['batch_size']} | {s['median']:.1f} | {s['min']:.1f} | "
              f"{s['max']:.1f} |" for s in summary["speeds"]]
    lines += ["", f"Within-run ratios of decode tok/s over {num_runs} runs:", "",
              "| ratio | batch | median | min | max | per run |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['ratio']} | {r['batch_size']} | {r['median']:.2f} | {r['min']:.2f} | {r['max']:.2f} | "
              f"{' '.join(f'{v:.2f}' for v in r['per_run'])} |" for r in summary["ratios"]]
    return "\n".join(lines)


def csv_rows(result: dict) -> list[dict]:
    """The CSV's rows: each speed, then each ratio, their per-run values joined by spaces."""
    rows = [{"kind": "speed", **{k: v for k, v in s.items() if k != "per_run"},
             "per_run": " ".join(f"{v:.2f}" for v in s["per_run"])} for s in result["speeds"]]
    rows += [{"kind": "ratio", **{k: v for k, v in r.items() if k != "per_run"},
              "per_run": " ".join(f"{v:.3f}" for v in r["per_run"])} for r in result["ratios"]]
    return rows


def plot(ratios: list[dict], path: Path) -> None:
    """Each ratio's per-run values (dots) and median (bar), one line per (ratio, batch); 1 marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(ratios) + 1.5))
    for i, r in enumerate(ratios):
        ax.scatter(r["per_run"], [i] * len(r["per_run"]), s=14, color="tab:blue", alpha=0.6)
        ax.plot([r["median"]] * 2, [i - 0.3, i + 0.3], color="black")
    ax.axvline(1.0, color="tab:red", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(ratios)), [f"{r['ratio']} (batch {r['batch_size']})" for r in ratios], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="decode tok/s ratio within a run (dots: runs, bar: median)", title="ours / peer, per run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="folders of peers.json, one per scripts/bench_peers.sh run")
    add_results_options(p, "peers_runs")
    args = p.parse_args()
    check_results(args)
    runs = [read_run(run_dir) for run_dir in args.runs]
    summary = summarize(runs)
    if not summary["speeds"]:
        p.error("no row ran in every run; pass runs of the same settings")
    result = {"runs": [str(r) for r in args.runs], **summary}
    write_results(args.out, args.name, result, csv_rows(result), partial(plot, summary["ratios"]))
    print(markdown(summary, len(runs)))
    for row in summary["left_out"]:  # a row that failed or was not run in some runs: no per-run ratio for it
        print(f"note: {row['engine']} {row['variant']} at batch {row['batch_size']} ran in {row['num_runs']} of "
              f"{len(runs)} runs only; left out", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(run_main(main))

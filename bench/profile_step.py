"""Time one decode step of one or more bundles, interleaved, and break it down by ONNX op type.

    python bench/profile_step.py BUNDLE [BUNDLE ...] [--past 128] [--windows 1 4] [--batch 1]
                                 [--steps 20] [--rounds 5] [--threads N] [--top 12]
                                 [--out bench/results] [--name profile_step]

Dimension letters: B batch (--batch), W window, P past length (--past), H KV heads, D head
dim, V vocabulary.

For every bundle and window W the step is the engine's: B rows of W tokens at positions
P .. P+W-1 against a random past (per layer (key, value) [B, H, P, D] in the bundle dtype),
all P past keys visible plus causal within the window (:func:`runtime.batch.window_mask`).

1. Timing, interleaved: ``--rounds`` rounds, each timing ``--steps`` steps of every
   (bundle, W) in turn, so that load from other processes hits all of them alike. Per
   (bundle, W): the median over rounds of the mean step time, and its ratio to the first
   bundle's at the same W (the A/B figure to quote on a shared machine).
2. Greedy post-processing (the engine's, per step): copying the logits [B, W, V] out and
   taking the argmax, timed the same way, as a share of the step.
3. Op breakdown: onnxruntime's profiler over ``--steps`` steps per (bundle, W): kernel
   time per op type (ms per step, share of the profiled total) and the node count per op
   type in the optimized graph.

Writes {name}.json to --out and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime import bundle
from runtime.batch import window_mask


def step_feeds(config: bundle.BundleConfig, batch: int, window: int, past: int, rng: np.random.Generator) -> dict:
    """Feeds for one step: ids [B, W], positions [B, W], mask bool [B, 1, W, P + W], past [B, H, P, D] per layer."""
    shape = (batch, config.num_kv_heads, past, config.head_dim)
    past_kv = [tuple(rng.standard_normal(shape, np.float32).astype(config.dtype) for _ in range(2))
               for _ in range(config.num_layers)]
    ids = rng.integers(0, config.vocab_size, (batch, window), dtype=np.int64)                      # [B, W]
    positions = np.broadcast_to(past + np.arange(window, dtype=np.int64), (batch, window)).copy()  # [B, W]
    mask = window_mask(np.full(batch, past, np.int64), past, window)                               # [B, 1, W, P + W]
    return bundle.step_feeds(ids, positions, mask, past_kv)


def make_session(path: Path, threads: int, profile_dir: str | None = None) -> ort.InferenceSession:
    """A CPU session with ``threads`` intra-op threads; profiling into ``profile_dir`` when given."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if profile_dir is not None:
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(profile_dir, "step")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def mean_seconds(fn, repeats: int) -> float:
    """Mean wall time of ``repeats`` calls of ``fn`` (seconds)."""
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def greedy_postprocess(session: ort.InferenceSession, feeds: dict):
    """The step as a greedy engine sees it: run, then argmax over the logits [B, W, V] -> ids [B, W]."""
    logits = session.run(None, feeds)[0]
    return logits.argmax(-1)


def op_breakdown(path: Path, feeds: dict, threads: int, steps: int) -> dict[str, dict]:
    """op type -> {"ms": kernel ms per step, "share": of the profiled total, "nodes": count in the optimized graph}."""
    with tempfile.TemporaryDirectory() as tmp:
        session = make_session(path, threads, tmp)
        session.run(None, feeds)  # warm-up, then profile only the timed steps
        for _ in range(steps):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    kernel_us, nodes = collections.Counter(), collections.defaultdict(set)
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    first_timed = runs[1]["ts"] if len(runs) > 1 else 0  # skip the warm-up run
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= first_timed:
            op = event["args"]["op_name"]
            kernel_us[op] += event["dur"]
            nodes[op].add(event["name"])
    total = sum(kernel_us.values()) or 1
    return {op: {"ms": us / steps / 1000, "share": us / total, "nodes": len(nodes[op])}
            for op, us in kernel_us.most_common()}


def interleaved_times(sessions: dict, feeds: dict, steps: int, rounds: int) -> dict[tuple, dict]:
    """(bundle, W) -> {"step_ms", "greedy_ms"}: medians over ``rounds`` of the mean over ``steps``."""
    samples = collections.defaultdict(lambda: {"step_ms": [], "greedy_ms": []})
    for key in sessions:  # warm-up: first runs allocate
        sessions[key].run(None, feeds[key])
    for _ in range(rounds):
        for key, session in sessions.items():
            step = mean_seconds(lambda: session.run(None, feeds[key]), steps)
            greedy = mean_seconds(lambda: greedy_postprocess(session, feeds[key]), steps)
            samples[key]["step_ms"].append(step * 1000)
            samples[key]["greedy_ms"].append(greedy * 1000)
    return {key: {name: float(np.median(values)) for name, values in s.items()} for key, s in samples.items()}


def run(args) -> dict:
    """All measurements; returns {"meta": ..., "rows": [...]} with one row per (bundle, W)."""
    rng = np.random.default_rng(0)
    sessions, feeds, paths = {}, {}, {}
    for bundle_dir in args.bundles:
        config = bundle.load_config(bundle_dir)
        paths[str(bundle_dir)] = bundle_dir / config.onnx_file
        session = make_session(paths[str(bundle_dir)], args.threads)
        for window in args.windows:
            sessions[str(bundle_dir), window] = session
            feeds[str(bundle_dir), window] = step_feeds(config, args.batch, window, args.past, rng)
    times = interleaved_times(sessions, feeds, args.steps, args.rounds)
    rows = []
    for (name, window), timing in times.items():
        base = times[str(args.bundles[0]), window]["step_ms"]
        ops = op_breakdown(paths[name], feeds[name, window], args.threads, args.steps)
        rows.append({"bundle": name, "window": window, "batch": args.batch, "past": args.past, **timing,
                     "ratio_to_first": timing["step_ms"] / base,
                     "greedy_overhead_ms": timing["greedy_ms"] - timing["step_ms"],
                     "profiled_ms": sum(o["ms"] for o in ops.values()),
                     "num_nodes": sum(o["nodes"] for o in ops.values()), "ops": ops})
        print(f"{name} W={window}: step {timing['step_ms']:.2f} ms ({rows[-1]['ratio_to_first']:.3f}x first), "
              f"with argmax {timing['greedy_ms']:.2f} ms", flush=True)
    meta = {"command": "python bench/profile_step.py " + " ".join(sys.argv[1:]), "threads": args.threads,
            "onnxruntime": ort.__version__, "loadavg_end": os.getloadavg()}
    return {"meta": meta, "rows": rows}


def markdown(result: dict, top: int) -> str:
    """Timing table, then per (bundle, W) the top op types."""
    rows = result["rows"]
    lines = ["| bundle | W | step ms | vs first | step + argmax ms | nodes | profiled ms |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['bundle']} | {r['window']} | {r['step_ms']:.2f} | {r['ratio_to_first']:.3f} | {r['greedy_ms']:.2f} | "
              f"{r['num_nodes']} | {r['profiled_ms']:.2f} |" for r in rows]
    for r in rows:
        lines += ["", f"{r['bundle']}, W = {r['window']}, B = {r['batch']}, P = {r['past']}:", "",
                  "| op type | nodes | ms/step | share |", "|---|---|---|---|"]
        lines += [f"| {op} | {o['nodes']} | {o['ms']:.3f} | {o['share']:.1%} |" for op, o in list(r["ops"].items())[:top]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", type=Path, nargs="+", help="bundle directories; ratios are to the first")
    p.add_argument("--past", type=int, default=128, help="past length P")
    p.add_argument("--windows", type=int, nargs="+", default=[1, 4], help="windows W to time")
    p.add_argument("--batch", type=int, default=1, help="batch B")
    p.add_argument("--steps", type=int, default=20, help="steps per timing sample and per profile")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="onnxruntime intra-op threads")
    p.add_argument("--top", type=int, default=12, help="op types listed per (bundle, W)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default="profile_step", help="stem of the output file (default profile_step)")
    args = p.parse_args()
    if args.past < 0 or min(args.windows) < 1 or args.batch < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--past must be >= 0; --windows, --batch, --steps and --rounds at least 1")
    if not 1 <= args.threads <= 256:
        p.error(f"--threads must be in 1..256, got {args.threads}")
    try:
        result = run(args)
    except bundle.BundleError as e:
        sys.exit(f"error: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    print(markdown(result, args.top))


if __name__ == "__main__":
    main()

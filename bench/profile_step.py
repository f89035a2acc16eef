"""Time one decode step of one or more bundles, interleaved, and break it down by ONNX op type.

    python bench/profile_step.py BUNDLE [BUNDLE ...] [--pasts 128] [--windows 1 4] [--batches 1]
                                 [--steps 20] [--rounds 5] [--threads N] [--top 12] [--pages huge|small|both]
                                 [--out bench/results] [--name profile_step]

Dimension letters: B batch (--batches), W window (--windows), P past length (--pasts),
H KV heads, D head dim, V vocabulary. The bundles must be exports of one model (same KV
shapes and dtype): they are fed the same inputs.

For every (B, P, W) the step is the engine's, with the inputs of ``bench/scaling.py``
(``decode_inputs``): B rows of W tokens at positions P .. P+W-1 into a KV cache of S = P + W
positions (per layer (key, value) [B, H, S, D] in the bundle dtype, random), all P past keys
visible plus causal within the window (mask [B, 1, W, S]), run as
:class:`runtime.backends.onnx.OnnxBackend` runs it: the cache bound once as both past and
present (:class:`runtime.backends.kv_binding.KVBinding`), the step writing its W entries into it
in place (every timed step rewrites the same entries), its other inputs bound per step. A fused
bundle (``mars-export --graph fused``, batch 1) runs as its backend runs it
(:class:`runtime.backends.fused.FusedStep`: the same past copied once into buffers with room for
the window, two positions for a one-token window; written in place; I/O binding).

1. Timing, interleaved: ``--rounds`` rounds, each timing ``--steps`` steps of every
   bundle in turn (after two untimed steps: a session's first steps after another's run
   slower), so that load from other processes hits all of them alike. Per
   (bundle, B, P, W): the median over rounds of the mean step time (wall, and this
   process's CPU time), and their ratios to the first bundle's (the A/B figures to quote
   on a shared machine; at ``--threads 1`` the CPU time is the steadier one).
2. A greedy step, timed the same way, as a greedy engine (tau >= 1) runs it: the step plus copying the
   logits [B, W, V] out and taking their argmax, or, for a bundle with the greedy head
   (``mars_export.greedy_head``: float32 bundles), the step reading its argmax ids instead. For a
   bundle with the confidence gate (``mars_export.confidence_gate``: float32 step and fused graphs), also a
   threshold step whose gate skips the float32 head (``skipped_ms``: ``confidence_tau`` 1, which every
   row's bound meets) and one whose gate runs it (``fired_ms``: -1, the head always runs); the
   step's own ``step_ms`` is a threshold step of a graph without the gate.
3. Op breakdown at the first B and P, per bundle and W: onnxruntime's profiler over
   ``--steps`` greedy steps: kernel time per op type (ms per step, share of the profiled total)
   and the node count per op type in the graph as onnxruntime optimized it.

Each session's weights lie on transparent huge pages where the machine allows, as the runtime loads them
(:mod:`runtime.backends.huge_pages`); ``--pages small`` keeps onnxruntime's own pages, ``--pages both``
runs every bundle both ways (its second entry named ``BUNDLE [small pages]``).

Writes {name}.json to --out and prints Markdown tables.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime import bundle
from runtime.backends.fused import FusedStep, past_with_room
from runtime.backends.huge_pages import new_memory_on_huge_pages
from runtime.backends.kv_binding import KVBinding
from runtime.command_line import ArgumentParser, path_value, results_name, run_main
from scaling import decode_inputs  # bench/ is on the path when this file runs as a script


PAGES = {"huge": [("", True)], "small": [("", False)], "both": [("", True), (" [small pages]", False)]}


def make_session(path: Path, threads: int, huge_pages: bool = True, profile_dir: str | None = None) -> ort.InferenceSession:
    """A CPU session with ``threads`` intra-op threads, its weights on huge pages if ``huge_pages`` (as
    :class:`runtime.backends.onnx.OnnxBackend` loads them); profiling into ``profile_dir`` when given."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3  # errors only, as runtime.backends.onnx: num_logits "appears in graph inputs"
    if profile_dir is not None:
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(profile_dir, "step")
    with new_memory_on_huge_pages(huge_pages):
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def mean_seconds(fn, repeats: int, clock=time.perf_counter) -> float:
    """Mean time of ``repeats`` calls of ``fn`` on ``clock`` (seconds; wall time by default)."""
    start = clock()
    for _ in range(repeats):
        fn()
    return (clock() - start) / repeats


def step_call(session: ort.InferenceSession, config: bundle.BundleConfig, inputs: tuple):
    """A no-argument function running one step of ``session`` over ``inputs`` (``decode_inputs``' ids, positions
    P .. P+W-1, mask [B, 1, W, S], the KV cache [B, H, S, D]); returns its logits float32 [B, W, V].

    A step graph runs as ``OnnxBackend.step`` runs it: the cache bound as past and present once
    (:class:`KVBinding`; each step checks that it is still the bound memory), ids, positions and mask bound
    every step, the logits written into a new array; the step writes its W entries into ``inputs``' cache, the
    same entries at every call. A fused bundle gets the past's first P positions copied once into buffers with
    room for what the step writes (past_with_room: [1, H, P + max(W, 2), D]), as its engine cache has."""
    ids, positions, mask, past = inputs
    if config.graph == "fused":
        start = int(positions[0, 0])
        step, buffers = FusedStep(session, ort, config), past_with_room(past, start, ids.shape[1])
        return lambda: step(ids, positions, buffers)[0]
    kv = KVBinding(session, ort)  # the cache bound at the first call, then only checked, as in OnnxBackend.step
    return lambda: kv.run_step(ids, positions, mask, past, config.vocab_size)


def greedy_call(session: ort.InferenceSession, config: bundle.BundleConfig, inputs: tuple):
    """As :func:`step_call`, a step as a greedy engine runs it; returns the argmax ids int64 [B, W]: the
    greedy head's (a graph that has it), else the argmax of the step's logits."""
    if config.graph == "fused" and bundle.NUM_GREEDY in {i.name for i in session.get_inputs()}:
        ids, positions, _, past = inputs
        step, buffers = FusedStep(session, ort, config), past_with_room(past, int(positions[0, 0]), ids.shape[1])
        return lambda: step(ids, positions, buffers, greedy_ids=True)[0]
    if bundle.NUM_GREEDY in {i.name for i in session.get_overridable_initializers()}:  # a float32 step graph's
        ids, positions, mask, past = inputs
        kv = KVBinding(session, ort)
        return lambda: kv.run_step_without_head(ids, positions, mask, past, config.vocab_size, greedy_ids=True)
    call = step_call(session, config, inputs)
    return lambda: call().argmax(-1)


def gated_call(session: ort.InferenceSession, config: bundle.BundleConfig, inputs: tuple, tau: float):
    """As :func:`step_call`, a threshold step through the confidence gate (``KVBinding.run_gated_step``, or
    ``FusedStep`` with ``confidence_tau``) with ``confidence_tau`` ``tau`` in every row; returns (ids, logits or
    None); None for a graph without the gate."""
    ids, positions, mask, past = inputs
    taus = np.full(len(ids), tau, np.float32)
    if config.graph == "fused" and bundle.CONFIDENCE_TAU in {i.name for i in session.get_inputs()}:
        step, buffers = FusedStep(session, ort, config), past_with_room(past, int(positions[0, 0]), ids.shape[1])
        return lambda: step(ids, positions, buffers, greedy_ids=True, confidence_tau=taus)[0]
    if bundle.CONFIDENCE_TAU not in {i.name for i in session.get_overridable_initializers()}:
        return None
    kv = KVBinding(session, ort)
    return lambda: kv.run_gated_step(ids, positions, mask, past, config.vocab_size, taus)


def op_breakdown(path: Path, config: bundle.BundleConfig, inputs: tuple, threads: int, huge_pages: bool,
                 steps: int) -> tuple[dict[str, dict], float]:
    """(op type -> {"ms": kernel ms per step, "share": of the profiled total, "nodes": count in the optimized
    graph}, ms per step of the whole profiled ``run``). The run's time beyond the sum of its kernels is what the
    executor spends between kernels (dispatch, allocation, thread-pool hand-offs, binding the I/O) plus the
    profiler's own per-node cost, which also inflates the kernel times: compare both with the unprofiled step."""
    with tempfile.TemporaryDirectory() as tmp:
        session = make_session(path, threads, huge_pages, tmp)
        call = greedy_call(session, config, inputs)
        call()  # warm-up, then profile only the timed steps
        for _ in range(steps):
            call()
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
    run_us = sum(e["dur"] for e in runs[1:]) / max(len(runs) - 1, 1)
    return ({op: {"ms": us / steps / 1000, "share": us / total, "nodes": len(nodes[op])}
             for op, us in kernel_us.most_common()}, run_us / 1000)


SETTLE_CALLS = 2  # untimed calls per turn: after another session ran, a session's first steps run ~13% slower


def interleaved_times(calls: dict, steps: int, rounds: int, others: dict | None = None) -> dict[str, dict]:
    """name -> {"step_ms", "cpu_ms", and a key of ``others`` each}: medians over ``rounds`` of the mean over
    ``steps`` of each call, the calls taking turns; each turn starts with :data:`SETTLE_CALLS` untimed calls
    (measured on the default int8 bundle: a session's first 20 steps after another session's were 1.13-1.16x its
    next 20). ``others``: figure name (e.g. "greedy_ms") -> name -> a call timed the same way after the step
    (:func:`greedy_call`, :func:`gated_call`), or None where the bundle has no such step.
    cpu_ms is this process's CPU time per step (all its threads, spinning included): at ``--threads 1`` it
    hardly moves with other processes' load, so it is the steadier A/B figure."""
    others = others or {}
    samples = {name: {kind: [] for kind in ("step_ms", "cpu_ms", *others)} for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(SETTLE_CALLS):
                call()
            samples[name]["step_ms"].append(mean_seconds(call, steps) * 1000)
            samples[name]["cpu_ms"].append(mean_seconds(call, steps, time.process_time) * 1000)
            for kind, other in others.items():
                if other[name] is not None:
                    samples[name][kind].append(mean_seconds(other[name], steps) * 1000)
    return {name: {key: float(np.median(values)) if values else None for key, values in s.items()}
            for name, s in samples.items()}


def load_bundles(bundle_dirs: list[Path], pages: str = "huge") -> dict[str, tuple[bundle.BundleConfig, Path, bool]]:
    """name -> (config, ONNX path, whether its weights go on huge pages) of each bundle, once per way of
    ``pages`` (a key of :data:`PAGES`).

    Raises:
        BundleError: a bundle is malformed, or its KV shapes or dtype differ from the first's
            (the bundles share one set of inputs).
    """
    loaded = {}
    for bundle_dir in bundle_dirs:
        config = bundle.load_config(bundle_dir)
        for suffix, huge_pages in PAGES[pages]:
            loaded[str(bundle_dir) + suffix] = config, bundle_dir / config.onnx_file, huge_pages
    shapes = {(c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size, c.dtype) for c, _, _ in loaded.values()}
    if len(shapes) > 1:
        raise bundle.BundleError(f"the bundles differ in (layers, KV heads, head dim, vocab, dtype): {sorted(shapes)}; "
                                 "compare exports of one model")
    return loaded


def run(args) -> dict:
    """All measurements; returns {"meta": ..., "rows": [...]} with one row per (bundle, B, P, W)."""
    rng = np.random.default_rng(0)
    loaded = load_bundles(args.bundles, args.pages)
    fused = [name for name, (c, _, _) in loaded.items() if c.graph == "fused"]
    if fused and max(args.batches) > 1:
        raise bundle.BundleError(f"{fused[0]} is a fused bundle: it runs batch 1; pass --batches 1")
    step_config = replace(next(iter(loaded.values()))[0], graph="step")  # inputs with a cache of P + W positions
    sessions = {name: make_session(path, args.threads, huge) for name, (_, path, huge) in loaded.items()}
    rows = []
    for batch, past, window in itertools.product(args.batches, args.pasts, args.windows):
        inputs = decode_inputs(step_config, window, batch, past, rng)
        calls = {name: step_call(session, loaded[name][0], inputs) for name, session in sessions.items()}
        others = {"greedy_ms": {name: greedy_call(session, loaded[name][0], inputs) for name, session in sessions.items()},
                  "skipped_ms": {name: gated_call(session, loaded[name][0], inputs, 1.0) for name, session in sessions.items()},
                  "fired_ms": {name: gated_call(session, loaded[name][0], inputs, -1.0) for name, session in sessions.items()}}
        times = interleaved_times(calls, args.steps, args.rounds, others)
        is_profiled = (batch, past) == (args.batches[0], args.pasts[0])
        for name, timing in times.items():
            config, path, huge = loaded[name]
            ops, run_ms = (op_breakdown(path, config, inputs, args.threads, huge, args.steps) if is_profiled
                           else ({}, 0.0))
            rows.append({"bundle": name, "window": window, "batch": batch, "past": past, **timing,
                         "ratio_to_first": timing["step_ms"] / next(iter(times.values()))["step_ms"],
                         "cpu_ratio_to_first": timing["cpu_ms"] / next(iter(times.values()))["cpu_ms"],
                         "profiled_ms": sum(o["ms"] for o in ops.values()), "profiled_run_ms": run_ms,
                         "num_nodes": sum(o["nodes"] for o in ops.values()), "ops": ops})
            print(f"{name} B={batch} P={past} W={window}: step {timing['step_ms']:.2f} ms "
                  f"({rows[-1]['ratio_to_first']:.3f}x first), greedy step {timing['greedy_ms']:.2f} ms", flush=True)
        del inputs, calls
    meta = {"command": "python bench/profile_step.py " + " ".join(sys.argv[1:]), "threads": args.threads,
            "onnxruntime": ort.__version__, "loadavg_end": os.getloadavg()}
    return {"meta": meta, "rows": rows}


def markdown(result: dict, top: int) -> str:
    """Timing table, then per (bundle, W) the top op types."""
    rows = result["rows"]
    shown = lambda ms: "" if ms is None else f"{ms:.2f}"  # noqa: E731
    lines = ["| bundle | B | P | W | step ms | vs first | CPU ms | vs first | greedy step ms | gate skipped ms | "
             "gate fired ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['bundle']} | {r['batch']} | {r['past']} | {r['window']} | {r['step_ms']:.2f} | "
              f"{r['ratio_to_first']:.3f} | {r['cpu_ms']:.2f} | {r['cpu_ratio_to_first']:.3f} | {r['greedy_ms']:.2f} | "
              f"{shown(r['skipped_ms'])} | {shown(r['fired_ms'])} |" for r in rows]
    for r in (r for r in rows if r["ops"]):
        lines += ["", f"{r['bundle']}, W = {r['window']}, B = {r['batch']}, P = {r['past']}: {r['num_nodes']} nodes "
                  f"after onnxruntime's optimizer, {r['profiled_ms']:.2f} ms kernel time per greedy step of a profiled run of "
                  f"{r['profiled_run_ms']:.2f} ms (unprofiled step {r['step_ms']:.2f} ms: the profiler's own cost "
                  "per node is in both profiled figures)", "",
                  "| op type | nodes | ms/step | share |", "|---|---|---|---|"]
        lines += [f"| {op} | {o['nodes']} | {o['ms']:.3f} | {o['share']:.1%} |" for op, o in list(r["ops"].items())[:top]]
    return "\n".join(lines)


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", type=Path, nargs="+", help="bundle directories; ratios are to the first")
    p.add_argument("--pasts", type=int, nargs="+", default=[128], help="past lengths P")
    p.add_argument("--windows", type=int, nargs="+", default=[1, 4], help="windows W")
    p.add_argument("--batches", type=int, nargs="+", default=[1], help="batch sizes B")
    p.add_argument("--steps", type=int, default=20, help="steps per timing sample and per profile")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="onnxruntime intra-op threads")
    p.add_argument("--top", type=int, default=12, help="op types listed per (bundle, W)")
    p.add_argument("--pages", choices=sorted(PAGES), default="huge",
                   help="weights on huge pages as the runtime loads them (huge, the default), on onnxruntime's own "
                        "pages (small), or each bundle both ways")
    p.add_argument("--out", type=path_value, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", type=results_name, default="profile_step",
                   help="stem of the output file (default profile_step)")
    args = p.parse_args()
    if min(args.pasts) < 0 or min(args.windows + args.batches) < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--pasts must be >= 0; --windows, --batches, --steps and --rounds at least 1")
    if not 1 <= args.threads <= 256:
        p.error(f"--threads must be in 1..256, got {args.threads}")
    result = run(args)  # a BundleError: one error line (run_main)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    print(markdown(result, args.top))


if __name__ == "__main__":
    sys.exit(run_main(main))

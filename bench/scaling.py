"""Decode-step time, achieved memory bandwidth and prefill throughput against context, batch and threads.

    python bench/scaling.py [BUNDLE] [--contexts 128 256 512 1024 2048] [--batch-sizes 1 4 16] [--window W ...]
                            [--prompt-lengths 128 256 512 1024] [--prefill-batch 4] [--threads N] [--repeats 10]
                            [--warmup 2] [--max-seconds 6] [--rounds 1] [--max-kv-gib 4] [--stream-mib 1024]
                            [--out bench/results] [--name scaling] [--force]

Dimension letters: B batch, W decode window (--window), P past length, T prompt
tokens, L layers, H KV heads, D head dim, V vocabulary. Times in ms or s as named; bytes in
decimal GB (1e9) and bandwidth in GB/s.

1. Decode step: for every (W, B, P) one forward of W tokens (``--window``, one or more; default 1,
   the engine's AR step, on dynamic-window graphs, else the bundle's W) at positions P .. P+W-1 into
   a KV cache of S = P + W positions (per layer (key, value) [B, H, S, D], distinct arrays, bundle
   dtype, random; a fused bundle's S = P + max(W, 2)) with the runtime's mask [B, 1, W, S] (the P
   past keys plus causal within the window), run as the runtime runs it (``OnnxBackend.step``: the
   cache bound as past and present, the step writing its W entries into it in place; every run
   rewrites the same entries). The engine's cache is usually longer (its capacity doubles as a
   sequence grows: S from P + W up to about 2(P + W)) and the step graph attends over all S
   positions, so this is a step's least time at that P. ``--warmup`` runs, then timed runs until
   ``--repeats`` or ``--max-seconds`` (at least 3): median, p10, p90. With ``--rounds R`` the points
   take turns R times, and the step-time ratios between points (each W against the smallest, each P
   against the next smaller, with the bytes ratio beside it) are taken within each round: median and
   range over the rounds, so that a change of the machine's speed between rounds cancels (a drift
   within a round does not; a point's window partners are timed next to it). Points whose
   past KV (P positions) exceeds ``--max-kv-gib`` are skipped and listed. Batch 1 is also run at 1 thread.
2. Bandwidth: the least a step must move = weights read whole (all initializers except those
   only gathered, e.g. an untied token-embedding table) + past KV read (B·2·L·H·P·D·itemsize)
   + new KV written (B·2·L·H·W·D·itemsize); logits (B·W·V·4) are not counted. Divided by the
   median step time and compared with a STREAM-like test at the same thread count (reference:
   the better of copy and triad; numpy's triad is two passes per cache-sized chunk).
3. Prefill: prompt tokens/s, nothing cached; one forward of T tokens into a zeroed cache of T
   positions (made once per T) if the graph's window axis is dynamic, else W-token forwards
   through the runtime's slot cache. Graphs with the ``num_logits`` input are timed with the
   output head skipped (as the engine prefills) and on every row, and (step graphs)
   ``--prefill-batch`` prompts in one forward [n, T] (batched prefill), the calls taking turns.

Writes {name}.json (machine, bundle config, STREAM, weights, rows, ratios), {name}.csv (all rows,
column ``kind`` = decode | prefill) and {name}.png to --out, and prints Markdown tables.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from results_files import add_results_options, check_results, write_results  # bench/ is on the path
from runtime import bundle
from runtime.backends.fused import written_positions
from runtime.backends.onnx import OnnxBackend
from runtime.command_line import ArgumentParser, UsageError, run_main, threads_value
from runtime.decode.batch import run_batch, run_first_chunks, scratch_past, window_mask
from runtime.decode.kv_cache import KVCache

GB = 1e9
GIB = 2**30
TRIAD_CHUNK = 2**17  # float64 elements (1 MiB): the two passes of a triad chunk meet in cache


# ---------------------------------------------------------------- machine and graph

def machine_info() -> dict:
    """CPU model, usable cores, versions and load average (a loaded machine slows every figure)."""
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.exists() else []
    return {"cpu_model": models[0] if models else platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "onnxruntime": ort.__version__, "numpy": np.__version__, "onnx": onnx.__version__,
            "loadavg_start": os.getloadavg()}


def weight_bytes(onnx_path: Path) -> dict:
    """Initializer bytes of the graph (sizes from dims; external data is not loaded).

    Returns:
        all: every initializer; gather_only: those whose every use is as Gather data (a step
        reads only the gathered rows); read: all - gather_only (the headline); embedding:
        the table gathered by input_ids; embedding_tied: True if it is also read whole
        (e.g. by a tied output head).
    """
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
             for t in graph.initializer}
    uses = defaultdict(set)  # initializer -> {(op_type, input slot)}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            if name in sizes:
                uses[name].add((node.op_type, slot))
    gather_only = [n for n, u in uses.items() if u == {("Gather", 0)}]
    embedding = next((n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in sizes
                      and n.input[1] == bundle.INPUT_IDS), None)
    total, gathered = sum(sizes.values()), sum(sizes[n] for n in gather_only)
    return {"all": total, "gather_only": gathered, "read": total - gathered, "embedding_name": embedding,
            "embedding": sizes.get(embedding, 0), "embedding_tied": embedding is not None and embedding not in gather_only}


def stream_bandwidth(num_threads: int, mib: int, repeats: int) -> dict:
    """Best-of-``repeats`` STREAM copy (c = a) and triad (a = b + q·c) in GB/s over float64 arrays
    of ``mib`` MiB each, one thread per disjoint slice (numpy releases the GIL). Bytes counted as
    STREAM does (copy 2, triad 3 arrays; write-allocate traffic not counted).

    Also ``read_gbs``: a pass that only reads (numpy's sum of each slice of ``a``), which STREAM
    lacks. A decode step's weights are only read, so this is nearer their kind of traffic; numpy's
    sum is not the fastest reading loop, so it is a lower bound on what a kernel that only reads
    could reach. The fractions of STREAM (issue 11's targets) stay against copy and triad."""
    n = mib * 2**20 // 8
    a, b, c = np.full(n, 1.0), np.full(n, 2.0), np.full(n, 0.0)  # written, so every page is mapped
    slices = [slice(s[0], s[-1] + 1) for s in np.array_split(np.arange(n), num_threads)]

    def copy(s):
        np.copyto(c[s], a[s])

    def read(s):
        np.add.reduce(a[s])

    def triad(s):
        for i in range(s.start, s.stop, TRIAD_CHUNK):
            j = min(i + TRIAD_CHUNK, s.stop)
            np.multiply(c[i:j], 3.0, out=a[i:j])
            np.add(a[i:j], b[i:j], out=a[i:j])

    best = {}
    with ThreadPoolExecutor(num_threads) as pool:
        for name, kernel in (("copy", copy), ("triad", triad), ("read", read)):
            best[name] = min(_wall(partial(_map_all, pool, kernel, slices)) for _ in range(repeats))
    return {"threads": num_threads, "array_mib": mib, "copy_gbs": 2 * a.nbytes / best["copy"] / GB,
            "triad_gbs": 3 * a.nbytes / best["triad"] / GB, "read_gbs": a.nbytes / best["read"] / GB}


def _map_all(pool: ThreadPoolExecutor, kernel, slices: list[slice]) -> None:
    list(pool.map(kernel, slices))


def _wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_calls(fn, warmup: int, repeats: int, max_seconds: float, min_runs: int) -> dict:
    """Run ``fn`` ``warmup`` times, then time it until ``repeats`` runs or ``max_seconds`` (at least
    ``min_runs``). Returns :func:`summary` of the times."""
    for _ in range(warmup):
        fn()
    times, spent = [], 0.0
    while len(times) < min_runs or (len(times) < repeats and spent < max_seconds):
        times.append(_wall(fn))
        spent += times[-1]
    return summary(times)


def summary(times: list[float]) -> dict:
    """Median/p10/p90/min/max in ms of ``times`` (seconds) and their number."""
    ms = np.array(times) * 1000
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "min_ms": float(ms.min()), "max_ms": float(ms.max()),
            "num_runs": len(times)}


# ---------------------------------------------------------------- decode steps

def kv_bytes(config: bundle.BundleConfig, batch: int, positions: int) -> int:
    """Bytes of keys and values for ``batch`` rows of ``positions`` each: B·2·L·H·P·D·itemsize."""
    itemsize = np.dtype(config.dtype).itemsize
    return batch * 2 * config.num_layers * config.num_kv_heads * positions * config.head_dim * itemsize


def decode_inputs(config: bundle.BundleConfig, window: int, batch: int, past: int, rng: np.random.Generator) -> tuple:
    """(ids int64 [B, W], positions int64 [B, W] = P .. P+W-1, mask bool [B, 1, W, S], per layer (key, value)
    [B, H, S, D]: the KV cache, S = P + W, random in the bundle dtype (the first P positions the past, the
    rest written by the step), 2·L distinct C-contiguous arrays as in a real cache). The step writes its W
    entries into the cache in place (runtime.backends.kv_binding), so it can be run again on the same inputs:
    it rewrites the same entries. A fused bundle's cache has room for what its step writes (written_positions:
    S = P + max(W, 2)), as its engine cache has (runtime.backends.fused)."""
    room = written_positions(window) if config.graph == "fused" else window
    shape = (batch, config.num_kv_heads, past + room, config.head_dim)                       # [B, H, S, D]
    ids = rng.integers(0, config.vocab_size, (batch, window), dtype=np.int64)                # [B, W]
    positions = np.broadcast_to(past + np.arange(window, dtype=np.int64), (batch, window)).copy()  # [B, W]
    mask = window_mask(np.full(batch, past, np.int64), past + room, window)                  # [B, 1, W, S]
    kv = [tuple(rng.standard_normal(shape, np.float32).astype(config.dtype, copy=False) for _ in range(2))
          for _ in range(config.num_layers)]
    return ids, positions, mask, kv


def decode_sweep(backend, config, threads: int, batch_sizes, contexts, args, rng) -> list[dict]:
    """One row per (W, B, P), W in ``args.window``: step time (bandwidth columns added later).

    The points take turns over ``args.rounds`` rounds (each round times every point once, from inputs made afresh,
    in (B, P, W) order so that a point's window partners run next to it, starting one point later than the last
    round: :func:`rotated`), so that a change of the machine's speed between rounds falls on every point alike.
    A row's ``median_ms`` is the median of its rounds' medians (``round_median_ms``); p10 / p90 the medians of its
    rounds', min / max over all its runs. One round: the point's own figures."""
    rows, todo = {}, []
    for point in ((w, b, p) for w in args.window for b in batch_sizes for p in contexts):
        window, batch, past = point
        row = {"kind": "decode", "threads": threads, "batch_size": batch, "past": past, "window": window,
               "kv_mib": kv_bytes(config, batch, past) / 2**20}
        if config.graph == "fused" and batch > 1:
            row["status"] = "not supported: a fused bundle runs batch 1"
        elif kv_bytes(config, batch, past) > args.max_kv_gib * GIB:
            row["status"] = f"skipped: KV {row['kv_mib']:.0f} MiB > {args.max_kv_gib} GiB"
            print(f"skip B={batch} P={past}: {row['status']}", flush=True)
        else:
            todo.append(point)
        rows[point] = row
    todo = sorted(dict.fromkeys(todo), key=lambda point: (point[1], point[2], point[0]))  # (B, P, W); repeats once
    timings = {point: [] for point in todo}
    for round_index in range(args.rounds):
        for point in rotated(todo, round_index):
            window, batch, past = point
            inputs = decode_inputs(config, window, batch, past, rng)
            timing = time_calls(partial(backend.step, *inputs), args.warmup, args.repeats, args.max_seconds, 3)
            del inputs
            timings[point].append(timing)
            print(f"decode threads={threads} W={window} B={batch} P={past} round {round_index + 1}: "
                  f"{timing['median_ms']:.1f} ms (p10 {timing['p10_ms']:.1f}, p90 {timing['p90_ms']:.1f}, "
                  f"{timing['num_runs']} runs)", flush=True)
    for point, rounds in timings.items():
        rows[point].update({"status": "ok", **over_rounds(rounds)})
    return list(rows.values())


def rotated(items: list, round_index: int) -> list:
    """The order ``items`` take turns in round ``round_index``: each round starts one later, so that none always
    runs first (right after the machine's idle gap, or after the same neighbour)."""
    start = round_index % len(items) if items else 0
    return items[start:] + items[:start]


def over_rounds(rounds: list[dict]) -> dict:
    """One point's :func:`summary` per round -> its figures over the rounds (see :func:`decode_sweep`; one round:
    its own figures)."""
    return {"median_ms": float(np.median([r["median_ms"] for r in rounds])),
            "p10_ms": float(np.median([r["p10_ms"] for r in rounds])),
            "p90_ms": float(np.median([r["p90_ms"] for r in rounds])),
            "min_ms": min(r["min_ms"] for r in rounds), "max_ms": max(r["max_ms"] for r in rounds),
            "num_runs": sum(r["num_runs"] for r in rounds), "round_median_ms": [r["median_ms"] for r in rounds]}


def within_round_ratios(rows: list[dict]) -> list[dict]:
    """Step-time ratios between decode points, taken within each round, so that the machine's drift between rounds
    cancels: each window against the smallest window at the same (threads, B, P) (``against`` = "window"), and each
    past against the next smaller past at the same (threads, W, B) (``against`` = "past", with the bytes-per-step
    ratio beside it). Median and range over the rounds. Needs :func:`add_bandwidth` done (``bytes_per_step``)."""
    done = {(r["threads"], r["window"], r["batch_size"], r["past"]): r for r in rows
            if r["kind"] == "decode" and r["status"] == "ok"}
    ratios = []
    for (threads, window, batch, past), row in sorted(done.items()):
        windows = sorted(w for t, w, b, p in done if (t, b, p) == (threads, batch, past))
        pasts = sorted(p for t, w, b, p in done if (t, w, b) == (threads, window, batch) and p < past)
        bases = ([("window", done[threads, windows[0], batch, past])] if window != windows[0] else [])
        bases += [("past", done[threads, window, batch, pasts[-1]])] if pasts else []
        for against, base in bases:
            per_round = [a / b for a, b in zip(row["round_median_ms"], base["round_median_ms"])]
            ratios.append({"threads": threads, "batch_size": batch, "past": past, "window": window, "against": against,
                           "base_window": base["window"], "base_past": base["past"],
                           "time_ratio": float(np.median(per_round)), "time_ratio_min": min(per_round),
                           "time_ratio_max": max(per_round), "bytes_ratio": row["bytes_per_step"] / base["bytes_per_step"],
                           "num_rounds": len(per_round)})
    return ratios


def add_bandwidth(row: dict, config, weights: dict, stream: dict) -> None:
    """Bytes per step (headline weights + KV read + KV written) and achieved GB/s, in place.

    The fraction compares the headline with the better of STREAM copy and triad at the row's
    thread count."""
    if row["status"] != "ok":
        return
    kv = kv_bytes(config, row["batch_size"], row["past"]) + kv_bytes(config, row["batch_size"], row["window"])
    seconds = row["median_ms"] / 1000
    reference = max(stream["copy_gbs"], stream["triad_gbs"])
    row.update({"bytes_per_step": weights["read"] + kv, "kv_bytes": kv,
                "achieved_gbs": (weights["read"] + kv) / seconds / GB,
                "achieved_gbs_all_weights": (weights["all"] + kv) / seconds / GB,
                "achieved_gbs_no_embedding": (weights["all"] - weights["embedding"] + kv) / seconds / GB,
                "stream_gbs": reference, "fraction": (weights["read"] + kv) / seconds / GB / reference,
                "positions_per_s": row["batch_size"] * row["window"] / seconds})


# ---------------------------------------------------------------- prefill

def prefill_past(config, num_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A zeroed KV cache ``([1, H, S, D], [1, H, S, D])`` per layer for one prompt of T = ``num_tokens``: S = T
    (a fused bundle's: max(T, 2), what its step writes; runtime.backends.fused)."""
    length = written_positions(num_tokens) if config.graph == "fused" else num_tokens
    return scratch_past(config.num_layers, 1, config.num_kv_heads, length, config.head_dim, config.dtype)


def prefill_single(backend, config, ids: np.ndarray, past: list, logits: bool = False) -> None:
    """All T ids [T] in one forward at positions 0..T-1 into ``past`` (:func:`prefill_past`, [1, H, S, D], S >= T,
    nothing cached: its entries 0..T-1 are written; run again, the same entries are rewritten), mask
    [1, 1, T, S]; the output head skipped, as the engine prefills, or run on every row (``logits``, as graphs
    without ``num_logits`` do)."""
    num_tokens = len(ids)
    mask = window_mask(np.array([0]), past[0][0].shape[2], num_tokens)  # [1, 1, T, S]
    backend.step(ids[None], np.arange(num_tokens, dtype=np.int64)[None], mask, past, logits=logits)


def prefill_chunked(backend, config, ids: np.ndarray) -> None:
    """ids [T] W at a time (ceil(T / W) forwards) through a slot cache: capacity doubling, masked
    past, commit, as the engine prefills."""
    window = config.window
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, len(ids) + window, config.dtype)
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window].tolist()
        count = len(chunk)
        cache.reserve(int(cache.lengths[0]) + window)
        _, presents = run_batch(backend, cache, [chunk + [config.pad_token_id] * (window - count)],
                                config.pad_token_id)
        cache.commit(presents, [count])


def prefill_batched(backend, config, ids: np.ndarray, num_prompts: int) -> None:
    """``num_prompts`` prompts of ids [T] prefilled in one forward [n, T], as the engine's batched prefill runs
    rows with nothing cached (:func:`runtime.decode.batch.run_first_chunks`; output head skipped)."""
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, len(ids), config.dtype, num_prompts)
    run_first_chunks(backend, cache, [ids.tolist()] * num_prompts, config.pad_token_id)


def prefill_variants(backend, path: str, prompts_per_forward: int) -> list[tuple[str, bool, int]]:
    """(output head, logits, prompts per forward) of each way to time: the single-forward path of a graph with
    ``num_logits`` runs the head ``skipped`` (the engine's prefill) and on ``every row`` (graphs exported before),
    and, with ``--prefill-batch`` n > 1 on a graph that takes batches, n prompts in one forward (batched prefill);
    other graphs and the chunked path (W-token decode steps) run the head on every row."""
    if path != "single" or not backend.takes_num_logits:
        return [("every row", True, 1)]
    variants = [("skipped", False, 1), ("every row", True, 1)]
    if prompts_per_forward > 1 and backend.max_batch is None:
        variants.append(("skipped", False, prompts_per_forward))
    return variants


def prefill_call(backend, config, ids: np.ndarray, path: str, logits: bool, prompts: int, past: list):
    """The call that prefills ``prompts`` prompts ``ids`` [T] as one :func:`prefill_variants` entry says (one prompt
    in one forward: into ``past``, :func:`prefill_past`)."""
    if path != "single":
        return partial(prefill_chunked, backend, config, ids)
    if prompts == 1:
        return partial(prefill_single, backend, config, ids, past, logits)
    return partial(prefill_batched, backend, config, ids, prompts)


def prefill_sweep(backend, config, path: str, args, rng) -> list[dict]:
    """Rows per prompt length T and :func:`prefill_variants`: time of the whole prefill and prompt tokens/s, the
    variants' calls taking turns."""
    variants = prefill_variants(backend, path, args.prefill_batch)
    rows = []
    for num_tokens in args.prompt_lengths:
        ids = rng.integers(0, config.vocab_size, num_tokens, dtype=np.int64)  # [T]
        forwards = 1 if path == "single" else -(-num_tokens // config.window)
        past = prefill_past(config, num_tokens) if path == "single" else None  # one cache per T, as the engine's slot
        calls = [prefill_call(backend, config, ids, path, logits, prompts, past) for _, logits, prompts in variants]
        if path == "single":  # chunked forwards have the decode step's shapes, already warm
            for call in calls:
                call()
        times, spent = [[] for _ in calls], 0.0
        while not times[0] or (len(times[0]) < args.prefill_repeats and spent < args.max_seconds):
            for samples, call in zip(times, calls):
                samples.append(_wall(call))
                spent += samples[-1]
        for (head, _, prompts), samples in zip(variants, times):
            timing = summary(samples)
            rows.append({"kind": "prefill", "threads": args.threads, "batch_size": prompts,
                         "prompt_tokens": num_tokens, "path": path,
                         "window": num_tokens if path == "single" else config.window, "output_head": head,
                         "num_forwards": forwards, "status": "ok", **timing,
                         "tokens_per_s": prompts * num_tokens / (timing["median_ms"] / 1000)})
            print(f"prefill {path} T={num_tokens} x {prompts} prompts, output head {head}: "
                  f"{timing['median_ms'] / 1000:.2f} s, {rows[-1]['tokens_per_s']:.0f} tokens/s "
                  f"({forwards} forwards)", flush=True)
    return rows


# ---------------------------------------------------------------- run and report

def run(args) -> dict:
    """All measurements; returns {"meta": ..., "rows": [...], "ratios": [...] (:func:`within_round_ratios`)}."""
    config = bundle.load_config(args.bundle)
    onnx_path = args.bundle / config.onnx_file
    if not onnx_path.is_file():
        raise bundle.BundleError(f"{onnx_path} not found; re-export the bundle with mars-export")
    meta = {"machine": machine_info(), "bundle": str(args.bundle), "config": asdict(config),
            "command": "python bench/scaling.py " + " ".join(sys.argv[1:]), "weights": weight_bytes(onnx_path)}
    rng = np.random.default_rng(0)
    backend = OnnxBackend(args.bundle, config, num_threads=args.threads)
    meta["prefill_path"] = "single" if backend.is_window_dynamic else "chunked"
    if args.window is None:  # the engine's plain AR step: 1 token on dynamic-window graphs, else W
        args.window = [1 if meta["prefill_path"] == "single" else config.window]
    elif set(args.window) != {config.window} and meta["prefill_path"] == "chunked":
        raise UsageError(f"--window {args.window}: this graph's window is fixed at {config.window}; "
                         f"pass --window {config.window} or leave it out")
    meta["decode_windows"] = args.window
    print("weights (bytes):", json.dumps(meta["weights"]), flush=True)  # the bundle and --window passed
    rows = decode_sweep(backend, config, args.threads, args.batch_sizes, args.contexts, args, rng)
    rows += prefill_sweep(backend, config, meta["prefill_path"], args, rng)
    if args.also_chunked and meta["prefill_path"] == "single":
        rows += prefill_sweep(backend, config, "chunked", args, rng)
    del backend
    if args.threads != 1:
        rows += decode_sweep(OnnxBackend(args.bundle, config, num_threads=1), config, 1, [1], args.contexts, args, rng)
    # STREAM last: run first (until 2026-12-02), the first decode point after it was slow (default fused fp32,
    # W = 1, P = 128: 29.0 ms, slower than W = 4's 27.9; with STREAM last 22.4 ms; one run each)
    meta["stream"] = [stream_bandwidth(n, args.stream_mib, args.stream_repeats) for n in sorted({1, args.threads})]
    print("STREAM:", json.dumps(meta["stream"]), flush=True)
    stream = {s["threads"]: s for s in meta["stream"]}
    for row in rows:
        if row["kind"] == "decode":
            add_bandwidth(row, config, meta["weights"], stream[row["threads"]])
    meta["machine"]["loadavg_end"] = os.getloadavg()
    return {"meta": meta, "rows": rows, "ratios": within_round_ratios(rows)}


def markdown(result: dict) -> str:
    """The decode, threads, prefill, STREAM and within-round ratio tables as Markdown."""
    meta, rows = result["meta"], result["rows"]
    w = meta["weights"]
    embedding = "tied: also read whole by the head" if w["embedding_tied"] else "only gathered"
    lines = [(f"Decode windows W = {meta['decode_windows']}. Weights read per step (headline): {w['read'] / GB:.3f} GB "
              f"(all initializers {w['all'] / GB:.3f} GB; token embedding {w['embedding'] / GB:.3f} GB, {embedding})"),
             "", "| threads | W | B | P | KV MiB | step ms (median) | p10–p90 ms | runs | GB/step | achieved GB/s | "
             "fraction of STREAM |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "decode"):
        head = f"| {r['threads']} | {r['window']} | {r['batch_size']} | {r['past']} | {r['kv_mib']:.0f} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']} | | | | | |")
            continue
        lines.append(f"{head} {r['median_ms']:.1f} | "
                     f"{r['p10_ms']:.1f}–{r['p90_ms']:.1f} | {r['num_runs']} | {r['bytes_per_step'] / GB:.3f} | "
                     f"{r['achieved_gbs']:.1f} | {r['fraction']:.2f} |")
    lines += ["", "| T | prompts | path | output head | forwards per prompt | prefill s (median) | prompt tokens/s |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt_tokens']} | {r['batch_size']} | {r['path']} (W={r['window']}) | {r['output_head']} | "
              f"{r['num_forwards']} | {r['median_ms'] / 1000:.2f} | {r['tokens_per_s']:.0f} |"
              for r in rows if r["kind"] == "prefill"]
    lines += ["", "| STREAM threads | copy GB/s | triad GB/s | read only GB/s |", "|---|---|---|---|"]
    lines += [f"| {s['threads']} | {s['copy_gbs']:.1f} | {s['triad_gbs']:.1f} | {s['read_gbs']:.1f} |"
              for s in meta["stream"]]
    return "\n".join(lines + [threads_table(rows), ratios_table(result["ratios"])])


def threads_table(rows: list[dict]) -> str:
    """Batch-1 step time at 1 thread against the most threads measured, per (W, P)."""
    step = {(r["threads"], r["window"], r["past"]): r["median_ms"] for r in rows
            if r["kind"] == "decode" and r["batch_size"] == 1 and r["status"] == "ok"}
    most = max((t for t, _, _ in step), default=1)
    if most == 1:
        return ""
    lines = ["", f"| W | P | 1 thread ms | {most} threads ms | speedup |", "|---|---|---|---|---|"]
    for window, past in sorted({(w, p) for t, w, p in step if t == 1 and (most, w, p) in step}):
        one, many = step[1, window, past], step[most, window, past]
        lines.append(f"| {window} | {past} | {one:.1f} | {many:.1f} | {one / many:.2f}× |")
    return "\n".join(lines)


def ratios_table(ratios: list[dict]) -> str:
    """The within-round step-time ratios (:func:`within_round_ratios`), median and range over the rounds."""
    if not ratios:
        return ""
    lines = ["", f"Step-time ratios within each round ({ratios[0]['num_rounds']} round(s)): median (min–max)", "",
             "| threads | B | W | P | against | time ratio | bytes ratio |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['batch_size']} | {r['window']} | {r['past']} | W {r['base_window']}, "
              f"P {r['base_past']} | {r['time_ratio']:.3f} ({r['time_ratio_min']:.3f}–{r['time_ratio_max']:.3f}) | "
              f"{r['bytes_ratio']:.3f} |" for r in ratios]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Step time vs P per (batch, threads); achieved bandwidth fraction vs P; prefill tokens/s vs T."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in rows if r["kind"] == "decode" and r["status"] == "ok"]
    fig, (time_ax, frac_ax, fill_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    for key in dict.fromkeys((r["batch_size"], r["threads"], r["window"]) for r in decode):
        points = sorted((r["past"], r["median_ms"], r["fraction"]) for r in decode
                        if (r["batch_size"], r["threads"], r["window"]) == key)
        label, style = f"B={key[0]}, W={key[2]}, {key[1]} thread{'s' * (key[1] > 1)}", "--" if key[1] == 1 else "-"
        time_ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label)
        frac_ax.plot([p[0] for p in points], [p[2] for p in points], style, marker="o", label=label)
    time_ax.set(title="decode step (W tokens per row)", xlabel="past P (tokens)", ylabel="median step time (ms)",
                xscale="log", yscale="log")
    frac_ax.set(title="achieved / STREAM bandwidth", xlabel="past P (tokens)", ylabel="fraction", xscale="log")
    for key in dict.fromkeys((r["path"], r["output_head"], r["batch_size"]) for r in rows if r["kind"] == "prefill"):
        points = sorted((r["prompt_tokens"], r["tokens_per_s"]) for r in rows
                        if r["kind"] == "prefill" and (r["path"], r["output_head"], r["batch_size"]) == key)
        fill_ax.plot(*zip(*points), marker="o", label=f"{key[0]}, head {key[1]}, {key[2]} per forward")
    fill_ax.set(title="prefill, batch 1", xlabel="prompt tokens T", ylabel="prompt tokens/s", xscale="log")
    frac_ax.set_ylim(bottom=0)
    fill_ax.set_ylim(bottom=0)
    for ax in (time_ax, frac_ax, fill_ax):
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path, nargs="?", default=Path("bundles/default-mars-b4"))
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048], help="past lengths P")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--window", type=int, nargs="+", default=None,
                   help="decode windows W, one or more (default: 1 on dynamic-window graphs, the AR step; else the "
                        "bundle's W)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 256, 512, 1024], help="prefill T")
    p.add_argument("--threads", type=threads_value, default=len(os.sched_getaffinity(0)),
                   help="onnxruntime and STREAM threads")
    p.add_argument("--repeats", type=int, default=10, help="timed decode steps per point (at most)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per point")
    p.add_argument("--max-seconds", type=float, default=6.0, help="stop timing a point after this (min 3 steps)")
    p.add_argument("--rounds", type=int, default=1,
                   help="decode points take turns over this many rounds; ratios between points are taken within rounds")
    p.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills per T (at most; min 1)")
    p.add_argument("--also-chunked", action="store_true", help="dynamic-window graphs: also time chunked prefill")
    p.add_argument("--prefill-batch", type=int, default=4,
                   help="also time this many prompts prefilled in one forward (batched prefill; 1: not)")
    p.add_argument("--max-kv-gib", type=float, default=4.0, help="skip points whose past KV exceeds this")
    p.add_argument("--stream-mib", type=int, default=1024, help="MiB per STREAM array (3 arrays)")
    p.add_argument("--stream-repeats", type=int, default=5)
    add_results_options(p, "scaling")
    args = p.parse_args()
    for name in ("contexts", "batch_sizes", "prompt_lengths", "window"):
        if getattr(args, name) is not None and min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if (not 1 <= args.threads <= 256 or args.repeats < 1 or args.prefill_repeats < 1 or args.prefill_batch < 1
            or args.rounds < 1):
        p.error("--threads must be in 1..256 and --repeats, --prefill-repeats, --prefill-batch, --rounds at least 1")
    check_results(args)
    result = run(args)  # a BundleError: one error line (run_main)
    write_results(args.out, args.name, result, result["rows"], partial(plot, result["rows"]))
    print(markdown(result))


if __name__ == "__main__":
    sys.exit(run_main(main))

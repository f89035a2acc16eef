"""Time one decode step of a bundle and break it down by ONNX op type.

    python bench/profile_step.py BUNDLE [--past 128] [--steps 20]

Prints the step time with and without onnxruntime's profiler, the cost of copying the
past KV out of the runtime's cache buffers, and the top op types by kernel time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime import bundle
from runtime.decoding import causal_window_mask
from runtime.kv_cache import KVCache


def feeds_for(config: bundle.BundleConfig, cache: KVCache) -> dict:
    window, past = config.window, cache.length
    feeds = {bundle.INPUT_IDS: np.zeros((1, window), np.int64),
             bundle.POSITION_IDS: np.arange(past, past + window, dtype=np.int64)[None],
             bundle.ATTENTION_MASK: causal_window_mask(past, window)}
    for i, (k, v) in enumerate(cache.past()):
        feeds.update(zip(bundle.past_names(i), (k, v)))
    return feeds


def mean_seconds(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def op_breakdown(path: Path, feeds: dict, repeats: int) -> collections.Counter:
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "step")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for _ in range(repeats):
        session.run(None, feeds)
    per_op = collections.Counter()
    for event in json.loads(Path(session.end_profiling()).read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op[event["args"]["op_name"]] += event["dur"] / repeats / 1000  # ms per step
    return per_op


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--past", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    config = bundle.load_config(args.bundle)
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, args.past + config.window,
                    np.dtype(config.dtype))
    cache.length = args.past
    feeds = feeds_for(config, cache)
    session = ort.InferenceSession(str(args.bundle / config.onnx_file), providers=["CPUExecutionProvider"])
    step = mean_seconds(lambda: session.run(None, feeds), args.steps)
    copy = mean_seconds(cache.past, args.steps)
    print(f"W={config.window} past={args.past}: step {step * 1000:.1f} ms, past KV copy {copy * 1000:.2f} ms")
    per_op = op_breakdown(args.bundle / config.onnx_file, feeds, args.steps)
    print(f"profiled kernel time {sum(per_op.values()):.1f} ms/step; top op types:")
    for op, ms in per_op.most_common(8):
        print(f"  {op:16s} {ms:6.2f} ms")


if __name__ == "__main__":
    main()

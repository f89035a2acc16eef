"""One decode step at batch 1: our step graph against onnxruntime-genai's model-builder graph of the same weights.

    python bench/builder_step.py BUILDER_DIR BUNDLE [BUNDLE ...] [--quantize int8 int4]
                                 [--pasts 128 1024] [--windows 1 4] [--max-context 2048]
                                 [--steps 20] [--rounds 5] [--threads N] [--out bench/results]
                                 [--name builder_step]

Dimension letters: W window (--windows), P past length (--pasts), H KV heads, D head dim,
V vocabulary, S the builder graph's KV buffer length (--max-context).

Is a graph of fused onnxruntime operators worth building for the step (GitHub issue 11)?
ONNX Runtime GenAI decodes our weights faster than our runtime does, with the same MatMul
kernels; its graph has ~11 nodes per layer (SkipSimplifiedLayerNormalization, one packed
QKV MatMul, GroupQueryAttention with rotary, ...) where ours has ~37. This times the two
graphs alone, without either runtime's loop.

BUILDER_DIR holds ``model.onnx`` written by onnxruntime-genai's model builder from the
checkpoint the bundles were exported from, e.g. ``scripts/bench_peers.sh`` writes one to
``~/.cache/mars-edge-peers/ortgenai-model/NAME``, or::

    python -m onnxruntime_genai.models.builder -i CHECKPOINT -o BUILDER_DIR -p fp32 -e cpu

``--quantize int8 int4`` adds the builder graph with its MatMuls made weight-only
MatMulNBits by the same quantizer, scheme and ``accuracy_level`` as ``mars-export --int8 |
--int4`` (:func:`mars_export.quantize.quantize_step_graph`), so that the int8 rows differ
from an int8 bundle's in the graph only.

Every graph gets the same W token ids at positions P .. P+W-1 over the same random past,
causal inside the window:

- a bundle: the step as our engine runs it (``bench/scaling.py``'s ``decode_inputs``: per
  layer (key, value) [1, H, P, D] fed as arrays, present = the W new entries);
- the builder graph: as ONNX Runtime GenAI runs it on CPU, past and present bound to one
  buffer [1, H, S, D] per layer and name (I/O binding; GroupQueryAttention writes the W new
  entries in place), attention_mask int64 [1, P + W] of ones.

Timing is interleaved (``--rounds`` rounds of ``--steps`` steps of every graph in turn;
median of the round means; wall time and this process's CPU time), ratios are to the
first bundle, and every graph's logits [1, W, V] are compared with the first bundle's
(max |difference| and argmax agreement over the W positions: a float32 builder graph must
compute the same function). Writes {name}.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from mars_export.quantize import WEIGHT_BITS, quantize_step_graph
from profile_step import load_bundles, make_session, mean_seconds  # bench/ is on the path as a script
from runtime import bundle
from scaling import decode_inputs

BUILDER_FILE = "model.onnx"


def builder_call(session: ort.InferenceSession, ids: np.ndarray, past: list[tuple[np.ndarray, np.ndarray]],
                 max_context: int):
    """A no-argument function running one builder-graph step; returns its logits float32 [1, W, V].

    Args:
        ids: int64 [1, W]; past: per layer (key, value) [1, H, P, D] float32, copied into
            the first P positions of buffers [1, H, S, D] that are bound as both past and
            present (GroupQueryAttention then writes the W new entries at P .. P+W-1 of them).
    """
    window, past_len = ids.shape[1], past[0][0].shape[2]
    binding = session.io_binding()
    binding.bind_cpu_input("input_ids", ids)
    binding.bind_cpu_input("attention_mask", np.ones((1, past_len + window), np.int64))
    binding.bind_output("logits")  # first: get_outputs() lists the outputs in binding order
    for layer, pair in enumerate(past):
        for kind, array in zip(("key", "value"), pair):
            buffer = np.zeros((1, array.shape[1], max_context, array.shape[3]), np.float32)  # [1, H, S, D]
            buffer[:, :, :past_len] = array
            value = ort.OrtValue.ortvalue_from_numpy(buffer)
            binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
            binding.bind_ortvalue_output(f"present.{layer}.{kind}", value)

    def call() -> np.ndarray:
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()
    return call


def check_builder_graph(path: Path, config: bundle.BundleConfig) -> None:
    """Raises ValueError unless ``path`` is a model-builder graph of ``config``'s model (names and KV shapes)."""
    if not path.is_file():
        raise ValueError(f"{path} is no file: pass the folder onnxruntime-genai's model builder wrote "
                         "(python -m onnxruntime_genai.models.builder -i CHECKPOINT -o DIR -p fp32 -e cpu)")
    graph = onnx.load(str(path), load_external_data=False).graph
    inputs = {i.name: i for i in graph.input}
    expected = {"input_ids", "attention_mask"} | {f"past_key_values.{i}.{k}" for i in range(config.num_layers)
                                                 for k in ("key", "value")}
    if set(inputs) != expected:
        raise ValueError(f"{path} is not a model-builder graph of a {config.num_layers}-layer model: its inputs are "
                         f"{sorted(inputs)[:5]}...")
    dims = [d.dim_value for d in inputs["past_key_values.0.key"].type.tensor_type.shape.dim]
    if dims[1] != config.num_kv_heads or dims[3] not in (0, config.head_dim):
        raise ValueError(f"{path} has past KV {dims}, the bundle {config.num_kv_heads} KV heads of {config.head_dim}: "
                         "build it from the checkpoint the bundle was exported from")


def builder_graphs(builder_dir: Path, quantize: list[str], workdir: Path) -> dict[str, Path]:
    """name -> ONNX path: the builder's float32 graph, then one weight-only quantized copy per ``quantize`` dtype."""
    source = builder_dir / BUILDER_FILE
    graphs = {f"builder float32 ({builder_dir})": source}
    for dtype in quantize:
        path = workdir / f"builder-{dtype}.onnx"
        summary = quantize_step_graph(source, path, dtype)
        graphs[f"builder {dtype} (block {summary['block_size']}, "
               f"{'sym' if summary['is_symmetric'] else 'asym'}, level {summary['accuracy_level']})"] = path
    return graphs


def agreement(logits: np.ndarray, reference: np.ndarray) -> dict:
    """max |difference| and the fraction of the W positions with the same argmax, against ``reference`` [1, W, V]."""
    return {"max_abs_logit_diff": float(np.abs(logits - reference).max()),
            "top1_agreement": float((logits.argmax(-1) == reference.argmax(-1)).mean())}


def time_interleaved(calls: dict, steps: int, rounds: int) -> dict[str, dict]:
    """name -> {"step_ms", "cpu_ms"}: medians over ``rounds`` of the mean over ``steps``, the calls taking turns."""
    samples = {name: {"step_ms": [], "cpu_ms": []} for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name]["step_ms"].append(mean_seconds(call, steps) * 1000)
            samples[name]["cpu_ms"].append(mean_seconds(call, steps, time.process_time) * 1000)
    return {name: {key: float(np.median(values)) for key, values in s.items()} for name, s in samples.items()}


def run(args, workdir: Path) -> dict:
    """All measurements; returns {"meta": ..., "rows": [...]} with one row per (graph, P, W)."""
    loaded = load_bundles(args.bundles)
    config = next(iter(loaded.values()))[0]
    if config.dtype != "float32":
        raise ValueError(f"the first bundle is {config.dtype}; the builder graph is fed float32 KV: "
                         "pass float32, int8 or int4 bundles (their KV is float32)")
    check_builder_graph(args.builder / BUILDER_FILE, config)
    ours = {name: make_session(path, args.threads) for name, (_, path) in loaded.items()}
    builders = {name: make_session(path, args.threads)
                for name, path in builder_graphs(args.builder, args.quantize, workdir).items()}
    rng, rows = np.random.default_rng(0), []
    for past_len, window in itertools.product(args.pasts, args.windows):
        ids, positions, mask, past = decode_inputs(config, window, 1, past_len, rng)
        feeds = bundle.step_feeds(ids, positions, mask, past)
        calls = {name: (lambda s=session: s.run(None, feeds)[0]) for name, session in ours.items()}
        calls |= {name: builder_call(session, ids, past, args.max_context) for name, session in builders.items()}
        reference = next(iter(calls.values()))()  # also every graph's warm-up
        checks = {name: agreement(call(), reference) for name, call in calls.items()}
        times = time_interleaved(calls, args.steps, args.rounds)
        first = next(iter(times.values()))
        for name, timing in times.items():
            rows.append({"graph": name, "past": past_len, "window": window, **timing, **checks[name],
                         "ratio_to_first": timing["step_ms"] / first["step_ms"],
                         "cpu_ratio_to_first": timing["cpu_ms"] / first["cpu_ms"]})
            print(f"{name} P={past_len} W={window}: step {timing['step_ms']:.2f} ms "
                  f"({rows[-1]['ratio_to_first']:.3f}x first), logits within {checks[name]['max_abs_logit_diff']:.1e}",
                  flush=True)
    meta = {"command": "python bench/builder_step.py " + " ".join(sys.argv[1:]), "threads": args.threads,
            "onnxruntime": ort.__version__, "max_context": args.max_context, "loadavg_end": os.getloadavg()}
    return {"meta": meta, "rows": rows}


def markdown(result: dict) -> str:
    """One table row per (graph, P, W)."""
    lines = ["| graph | P | W | step ms | vs first | CPU ms | vs first | max abs logit diff | top-1 agree |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['graph']} | {r['past']} | {r['window']} | {r['step_ms']:.2f} | {r['ratio_to_first']:.3f} | "
              f"{r['cpu_ms']:.2f} | {r['cpu_ratio_to_first']:.3f} | {r['max_abs_logit_diff']:.2e} | "
              f"{r['top1_agreement']:.2f} |" for r in result["rows"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("builder", type=Path, help="folder with the model builder's model.onnx (same weights)")
    p.add_argument("bundles", type=Path, nargs="+", help="bundle directories; ratios are to the first (float32)")
    p.add_argument("--quantize", nargs="*", default=[], choices=sorted(WEIGHT_BITS),
                   help="also time the builder graph quantized as mars-export --int8 / --int4 quantizes")
    p.add_argument("--pasts", type=int, nargs="+", default=[128, 1024], help="past lengths P")
    p.add_argument("--windows", type=int, nargs="+", default=[1, 4], help="windows W")
    p.add_argument("--max-context", type=int, default=2048, help="the builder graph's KV buffer length S")
    p.add_argument("--steps", type=int, default=20, help="steps per timing sample")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="onnxruntime intra-op threads")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default="builder_step", help="stem of the output file (default builder_step)")
    args = p.parse_args()
    if min(args.pasts) < 0 or min(args.windows) < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--pasts must be >= 0; --windows, --steps and --rounds at least 1")
    if max(args.pasts) + max(args.windows) > args.max_context:
        p.error(f"--max-context ({args.max_context}) must hold the longest past + window "
                f"({max(args.pasts) + max(args.windows)})")
    if not 1 <= args.threads <= 256:
        p.error(f"--threads must be in 1..256, got {args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = run(args, Path(tmp))
        except (bundle.BundleError, ValueError) as e:
            sys.exit(f"error: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()

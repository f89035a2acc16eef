"""One decode step at batch 1: our step graph against onnxruntime-genai's model-builder graph of the same weights.

    python bench/builder_step.py BUILDER_DIR BUNDLE [BUNDLE ...] [--quantize int8 int4]
                                 [--pasts 128 1024] [--windows 1 4] [--max-context 2048]
                                 [--steps 20] [--rounds 5] [--threads N] [--identity-tokens 8]
                                 [--identity-prompt 32] [--chunks 1 2 3 4] [--out bench/results]
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
causal inside the window; both kinds of graph write the W new entries into their KV cache in
place, past and present bound to one buffer per layer and name (I/O binding):

- a bundle: the step as our engine runs it (``bench/scaling.py``'s ``decode_inputs`` and
  ``bench/profile_step.py``'s ``step_call``: a cache [1, H, P + W, D] per layer and name, mask
  bool [1, 1, W, P + W] over its indices; our attention reads all of its positions);
- the builder graph: as ONNX Runtime GenAI runs it on CPU, a buffer [1, H, S, D] per layer and
  name holding the same P past entries (GroupQueryAttention reads only the first P + W),
  attention_mask int64 [1, P + W] of ones.

Timing is interleaved (``--rounds`` rounds of ``--steps`` steps of every graph in turn;
median of the round means; wall time and this process's CPU time), ratios are to the
first bundle, and every graph's logits [1, W, V] are compared with the first bundle's
(max |difference| and argmax agreement over the W positions: a float32 builder graph must
compute the same function).

**Identity by chunking** (``--identity-tokens N``, 0 skips it; ``--chunks``): tau = 1 is exactly
greedy AR, and verify mode exactly AR, only if a token's logits do not depend on how the
tokens are cut into windows (DESIGN.md §3). After a prompt of ``--identity-prompt`` random ids
(one window), every graph is fed the same N ids in windows of c (per ``--chunks``; the last
window takes the rest), each over the KV cache the earlier windows wrote (a bundle: the
runtime's KVCache and ``run_batch``; a builder graph: its shared past/present buffer), and each
position's logits are compared bit for bit with those of one window of all N. On onnxruntime
1.32 (CPU, float32 and int8, 1 and 2 threads) the builder graph is bit-identical for every cut
into windows of >= 2 tokens and differs only where a window holds one token (its
GroupQueryAttention, ``bench/gqa_attention.py``); our bundles at every cut.

Writes {name}.json and prints Markdown tables.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from mars_export.quantize import WEIGHT_BITS, quantize_step_graph
from profile_step import interleaved_times, load_bundles, make_session, step_call  # bench/ is on the path as a script
from runtime import bundle
from runtime.backends.onnx import OnnxBackend
from runtime.command_line import (ArgumentParser, existing_folder, path_value, results_name, run_main,
                                  threads_value)
from runtime.decode.batch import run_batch, run_prefill
from scaling import decode_inputs

BUILDER_FILE = "model.onnx"


def builder_call(session: ort.InferenceSession, ids: np.ndarray, past: list[tuple[np.ndarray, np.ndarray]],
                 past_len: int, max_context: int):
    """A no-argument function running one builder-graph step; returns its logits float32 [1, W, V].

    Args:
        ids: int64 [1, W]; past: per layer (key, value) [1, H, >= P, D] float32 (a bundle's cache), whose
            first P = ``past_len`` positions are copied into the first P positions of buffers [1, H, S, D]
            that are bound as both past and present (GroupQueryAttention then writes the W new entries at
            P .. P+W-1 of them).
    """
    window = ids.shape[1]
    binding = session.io_binding()
    binding.bind_cpu_input("input_ids", ids)
    binding.bind_cpu_input("attention_mask", np.ones((1, past_len + window), np.int64))
    binding.bind_output("logits")  # first: get_outputs() lists the outputs in binding order
    for layer, pair in enumerate(past):
        for kind, array in zip(("key", "value"), pair):
            buffer = np.zeros((1, array.shape[1], max_context, array.shape[3]), np.float32)  # [1, H, S, D]
            buffer[:, :, :past_len] = array[:, :, :past_len]
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


def run(args, workdir: Path) -> dict:
    """All measurements; returns {"meta": ..., "rows": [...]} with one row per (graph, P, W)."""
    loaded = load_bundles(args.bundles)
    config = next(iter(loaded.values()))[0]
    if config.dtype != "float32":
        raise ValueError(f"the first bundle is {config.dtype}; the builder graph is fed float32 KV: "
                         "pass float32, int8 or int4 bundles (their KV is float32)")
    check_builder_graph(args.builder / BUILDER_FILE, config)
    ours = {name: make_session(path, args.threads) for name, (_, path, _) in loaded.items()}
    builders = {name: make_session(path, args.threads)
                for name, path in builder_graphs(args.builder, args.quantize, workdir).items()}
    rng, rows = np.random.default_rng(0), []
    step_config = replace(config, graph="step")  # inputs with a cache of P + W positions (fused bundles copy it)
    for past_len, window in itertools.product(args.pasts, args.windows):
        inputs = decode_inputs(step_config, window, 1, past_len, rng)
        ids, _, _, past = inputs
        calls = {name: step_call(session, loaded[name][0], inputs) for name, session in ours.items()}
        calls |= {name: builder_call(session, ids, past, past_len, args.max_context)
                  for name, session in builders.items()}
        reference = next(iter(calls.values()))()  # also every graph's warm-up
        checks = {name: agreement(call(), reference) for name, call in calls.items()}
        times = interleaved_times(calls, args.steps, args.rounds)
        first = next(iter(times.values()))
        for name, timing in times.items():
            rows.append({"graph": name, "past": past_len, "window": window, **timing, **checks[name],
                         "ratio_to_first": timing["step_ms"] / first["step_ms"],
                         "cpu_ratio_to_first": timing["cpu_ms"] / first["cpu_ms"]})
            print(f"{name} P={past_len} W={window}: step {timing['step_ms']:.2f} ms "
                  f"({rows[-1]['ratio_to_first']:.3f}x first), logits within {checks[name]['max_abs_logit_diff']:.1e}",
                  flush=True)
    identity = []
    if args.identity_tokens:
        ids = rng.integers(0, config.vocab_size, args.identity_prompt + args.identity_tokens)  # [prompt + N]
        runs = {name: lambda chunks, c=c, path=path: bundle_logits(path, c, args.threads, ids, chunks)
                for name, (c, path, _) in loaded.items()}
        runs |= {name: lambda chunks, s=session: builder_logits(s, config, args.max_context, ids, chunks)
                 for name, session in builders.items()}
        identity = identity_rows(runs, args)
    meta = {"command": "python bench/builder_step.py " + " ".join(sys.argv[1:]), "threads": args.threads,
            "onnxruntime": ort.__version__, "max_context": args.max_context, "loadavg_end": os.getloadavg()}
    return {"meta": meta, "rows": rows, "identity": identity}


def cuts(num_tokens: int, chunk: int) -> list[int]:
    """Window sizes feeding ``num_tokens`` in windows of ``chunk``, the last one the rest."""
    return [min(chunk, num_tokens - start) for start in range(0, num_tokens, chunk)]


def bundle_logits(path: Path, config: bundle.BundleConfig, threads: int, ids: np.ndarray,
                  chunks: list[int]) -> np.ndarray:
    """A bundle's logits [N, V] of the last N = sum(chunks) of ``ids`` fed in windows of ``chunks``
    after the rest as one prefill window, as the engine runs it (the backend's cache, run_prefill, run_batch)."""
    backend = OnnxBackend(path.parent, config, num_threads=threads)
    # one position more: a fused bundle's one-token window writes a second row's KV (runtime.backends.fused)
    cache = backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, len(ids) + 1, config.dtype)
    cache.reserve(len(ids))
    prompt = len(ids) - sum(chunks)
    cache.commit_slot(0, run_prefill(backend, cache, 0, [int(t) for t in ids[:prompt]]), 0, prompt)
    logits, start = [], prompt
    for width in chunks:
        out, presents = run_batch(backend, cache, [[int(t) for t in ids[start:start + width]]], config.pad_token_id)
        cache.commit(presents, [width])
        logits.append(out[0])
        start += width
    return np.concatenate(logits)


def builder_logits(session: ort.InferenceSession, config: bundle.BundleConfig, max_context: int, ids: np.ndarray,
                   chunks: list[int]) -> np.ndarray:
    """A builder graph's logits [N, V], fed as :func:`bundle_logits` feeds a bundle, past and present
    bound to one buffer [1, H, S, D] per layer and name (GroupQueryAttention writes in place)."""
    shape = (1, config.num_kv_heads, max_context, config.head_dim)
    cache = {f"{layer}.{kind}": ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
             for layer in range(config.num_layers) for kind in ("key", "value")}

    def window(start: int, width: int) -> np.ndarray:
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids[None, start:start + width], np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, start + width), np.int64))
        binding.bind_output("logits")
        for name, value in cache.items():
            binding.bind_ortvalue_input(f"past_key_values.{name}", value)
            binding.bind_ortvalue_output(f"present.{name}", value)
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[0]  # [width, V]

    prompt = len(ids) - sum(chunks)
    window(0, prompt)
    starts = prompt + np.cumsum([0] + chunks[:-1])
    return np.concatenate([window(int(start), width) for start, width in zip(starts, chunks)])


def identity_rows(runs: dict, args) -> list[dict]:
    """Per graph and ``--chunks`` size: positions whose logits are bit-identical to one window's."""
    rows = []
    for name, run_chunks in runs.items():
        whole = run_chunks([args.identity_tokens])
        for chunk in args.chunks:
            logits = run_chunks(cuts(args.identity_tokens, chunk))
            same = [bool(np.array_equal(logits[i], whole[i])) for i in range(args.identity_tokens)]
            rows.append({"graph": name, "chunk": chunk, "num_tokens": args.identity_tokens,
                         "identical_positions": sum(same), "max_abs_logit_diff": float(np.abs(logits - whole).max()),
                         "top1_agreement": float((logits.argmax(-1) == whole.argmax(-1)).mean())})
            print(f"identity {name}: windows of {chunk}: {sum(same)}/{len(same)} positions bit-identical to one "
                  f"window (max |diff| {rows[-1]['max_abs_logit_diff']:.1e})", flush=True)
    return rows


def markdown(result: dict) -> str:
    """One table row per (graph, P, W)."""
    lines = ["| graph | P | W | step ms | vs first | CPU ms | vs first | max abs logit diff | top-1 agree |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['graph']} | {r['past']} | {r['window']} | {r['step_ms']:.2f} | {r['ratio_to_first']:.3f} | "
              f"{r['cpu_ms']:.2f} | {r['cpu_ratio_to_first']:.3f} | {r['max_abs_logit_diff']:.2e} | "
              f"{r['top1_agreement']:.2f} |" for r in result["rows"]]
    if result["identity"]:
        lines += ["", "| graph | window of | positions bit-identical to one window | max abs logit diff |",
                  "|---|---|---|---|"]
        lines += [f"| {r['graph']} | {r['chunk']} | {r['identical_positions']}/{r['num_tokens']} | "
                  f"{r['max_abs_logit_diff']:.1e} |" for r in result["identity"]]
    return "\n".join(lines)


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("builder", type=existing_folder, help="folder with the model builder's model.onnx (same weights)")
    p.add_argument("bundles", type=Path, nargs="+", help="bundle directories; ratios are to the first (float32)")
    p.add_argument("--quantize", nargs="*", default=[], choices=sorted(WEIGHT_BITS),
                   help="also time the builder graph quantized as mars-export --int8 / --int4 quantizes")
    p.add_argument("--pasts", type=int, nargs="+", default=[128, 1024], help="past lengths P")
    p.add_argument("--windows", type=int, nargs="+", default=[1, 4], help="windows W")
    p.add_argument("--max-context", type=int, default=2048, help="the builder graph's KV buffer length S")
    p.add_argument("--steps", type=int, default=20, help="steps per timing sample")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--threads", type=threads_value, default=len(os.sched_getaffinity(0)),
                   help="onnxruntime intra-op threads")
    p.add_argument("--identity-tokens", type=int, default=8,
                   help="tokens of the identity-by-chunking check (default 8; 0 skips it)")
    p.add_argument("--identity-prompt", type=int, default=32, help="prompt ids before them (default 32)")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 3, 4],
                   help="window sizes the identity check cuts them into (default 1 2 3 4)")
    p.add_argument("--out", type=path_value, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", type=results_name, default="builder_step",
                   help="stem of the output file (default builder_step)")
    args = p.parse_args()
    if min(args.pasts) < 0 or min(args.windows + args.chunks) < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--pasts must be >= 0; --windows, --chunks, --steps and --rounds at least 1")
    if args.identity_tokens < 0 or args.identity_prompt < 1:
        p.error("--identity-tokens must be >= 0 and --identity-prompt >= 1")
    if args.identity_prompt + args.identity_tokens > args.max_context:
        p.error(f"--max-context ({args.max_context}) must hold --identity-prompt + --identity-tokens")
    if max(args.pasts) + max(args.windows) > args.max_context:
        p.error(f"--max-context ({args.max_context}) must hold the longest past + window "
                f"({max(args.pasts) + max(args.windows)})")
    if not 1 <= args.threads <= 256:
        p.error(f"--threads must be in 1..256, got {args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = run(args, Path(tmp))
        except ValueError as e:  # a bundle or builder graph that does not fit (BundleError among them)
            p.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    sys.exit(run_main(main))

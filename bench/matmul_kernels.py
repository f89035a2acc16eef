"""How fast onnxruntime's CPU kernels read a decode step's weights, alone, beside STREAM.

    python bench/matmul_kernels.py BUNDLE [--formats fp32 int8-32 int8-128 int4-32 int4-128] [--rows 1 4]
                                   [--threads N] [--repeats 20] [--stream-mib 512] [--pages huge small]
                                   [--out bench/results] [--name matmul_kernels] [--force]

Dimension letters: M rows of the activation (B·W of a decode step; ``--rows``), K input and N
output features of one weight, NB = ceil(K / block) blocks. Times in ms, bytes in decimal GB
(1e9), bandwidth in GB/s.

A decode step at batch 1 is a chain of matrix-vector products over the weights; whatever else
it does, it cannot be faster than its kernels reading those weights. This script measures that
floor for each weight format the exporter can write:

- ``fp32``: ``MatMul`` over a float32 [K, N] weight (4 bytes a weight);
- ``int8-S`` / ``int4-S``: ``com.microsoft::MatMulNBits`` with ``bits`` 8 / 4, symmetric blocks of
  S weights along K (no zero points, a float32 scale per block) at ``accuracy_level`` 4
  (bits / 8 + 4 / S bytes a weight). ``mars-export --int8`` writes int8-32; ``--int4`` of a
  float checkpoint writes asymmetric blocks of 32 (a 4-bit zero point more per block, 1/64
  byte a weight), and of a GGUF file its own blocks with side paths, whose time this script
  does not model: give it the float32 bundle, whose shapes are the model's.

The shapes are the bundle's: every constant weight [K, N] of its MatMul (or MatMulNBits) nodes,
fused projections and the output head (tied or not) included, the greedy head's int8 screening
of the output head not (a logits step does not run it). Per format, one graph holds
**all** of them, each with its own random weights (values do not change a kernel's speed) and
fed by one input x_K [M, K] per distinct K, so that, as in a real step, the weights stream from
memory instead of staying in cache. Its median wall time over ``--repeats`` runs at
``--threads`` is the **weights-only step**: the least time a step of M rows could take with
these kernels. Bytes read / that time is compared with the STREAM copy and triad at the same
thread count (``bench/scaling.py``), and with a pass that only reads (its ``read_gbs``): a kernel
below that pass leaves bandwidth the machine has unused.

``--pages``: where the session keeps the weights: ``huge``, on transparent huge pages as the runtime
loads a bundle (:mod:`runtime.backends.huge_pages`; numpy's STREAM arrays get them too), ``small``, on
onnxruntime's own pages (4 KiB where the kernel's THP mode is ``madvise``). Given both, each (format, M)
times the two sessions one after the other.

Writes {name}.json (machine, STREAM, shapes, rows), {name}.csv (one row per format and M)
and {name}.png (bandwidth per format and M against STREAM) to --out, and prints a Markdown
table.
"""

from __future__ import annotations

import collections
import os
import re
import sys
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

from runtime import bundle
from runtime.backends.huge_pages import new_memory_on_huge_pages
from runtime.command_line import ArgumentParser, run_main
from results_files import add_results_options, check_results, write_results  # bench/ is on the path
from scaling import GB, machine_info, stream_bandwidth, time_calls  # bench/ is on the path when this file runs as a script

FORMAT = re.compile(r"^(fp32|int(8|4)-(\d+))$")
QUANT_OP = "MatMulNBits"


def weight_shapes(onnx_path: Path) -> collections.Counter:
    """(K, N) -> how many MatMul / MatMulNBits nodes of the graph multiply by a constant weight of that shape
    (a weight may be an initializer or the Transpose of one, as a tied output head is). The greedy head's
    nodes (its int8 screening of the output head) are not counted: a logits step does not run them.

    Raises:
        ValueError: the graph has no such node.
    """
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except (OSError, DecodeError) as e:
        raise ValueError(f"cannot read {onnx_path} ({e}); is the bundle complete?") from e
    bundle.strip_greedy_head(model)
    graph = model.graph
    dims = {t.name: tuple(t.dims) for t in graph.initializer}
    for node in graph.node:  # a transposed constant is a constant (onnxruntime folds it)
        if node.op_type == "Transpose" and len(dims.get(node.input[0], ())) == 2:
            dims[node.output[0]] = dims[node.input[0]][::-1]
    shapes = collections.Counter()
    for node in graph.node:
        if node.op_type == "MatMul" and len(dims.get(node.input[1], ())) == 2:
            shapes[dims[node.input[1]]] += 1
        elif node.op_type == QUANT_OP:
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            shapes[(attributes["K"], attributes["N"])] += 1
    if not shapes:
        raise ValueError(f"{onnx_path} has no MatMul with a constant 2-D weight; is it a bundle's step graph?")
    return shapes


def parse_format(name: str) -> tuple[int, int]:
    """``fp32`` -> (32, 0); ``intB-S`` -> (B, S). Raises ValueError naming the accepted forms."""
    match = FORMAT.match(name)
    if not match:
        raise ValueError(f"unknown format {name!r}: use fp32, int8-S or int4-S (S a block size such as 32 or 128)")
    if match.group(1) == "fp32":
        return 32, 0
    block = int(match.group(3))
    if block < 16 or block & (block - 1):
        raise ValueError(f"{name}: the block size must be a power of 2 >= 16 (MatMulNBits), got {block}")
    return int(match.group(2)), block


def weights_graph(shapes: collections.Counter, bits: int, block: int, rng: np.random.Generator
                  ) -> tuple[onnx.ModelProto, int]:
    """One graph of every weight in ``shapes`` (count copies of each), and the bytes of its weights.

    Inputs x_K float32 [M, K], one per distinct K; one output y_i [M, N] per weight. ``bits`` 32:
    float32 MatMul over [K, N]; 8 or 4: symmetric MatMulNBits with ``block`` weights per block
    (codes uint8 [N, NB, block · bits / 8], scales float32 [N, NB]), accuracy level 4.
    """
    nodes, arrays, outputs = [], {}, []
    for (k, n), count in sorted(shapes.items()):
        for copy in range(count):
            name = f"w{k}x{n}_{copy}"
            if bits == 32:
                arrays[name] = rng.standard_normal((k, n), dtype=np.float32)
                nodes.append(helper.make_node("MatMul", [f"x{k}", name], [f"y_{name}"]))
            else:
                blocks = -(-k // block)
                arrays[name] = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
                arrays[f"{name}_scales"] = rng.random((n, blocks), dtype=np.float32) / 64
                nodes.append(helper.make_node(QUANT_OP, [f"x{k}", name, f"{name}_scales"], [f"y_{name}"],
                                              domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                                              accuracy_level=4))
            outputs.append(helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, ["M", n]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["M", k]) for k in sorted({k for k, _ in shapes})]
    weights = [numpy_helper.from_array(array, name) for name, array in arrays.items()]
    model = helper.make_model(helper.make_graph(nodes, "weights_only_step", inputs, outputs, weights),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model, sum(array.nbytes for array in arrays.values())


def make_session(model: onnx.ModelProto, threads: int, huge_pages: bool) -> ort.InferenceSession:
    """A CPU session of ``model`` at ``threads`` intra-op threads, its weights on huge pages if ``huge_pages``."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    with new_memory_on_huge_pages(huge_pages):
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def time_graph(session: ort.InferenceSession, model: onnx.ModelProto, rows: int, repeats: int,
               rng: np.random.Generator) -> float:
    """Median wall ms of ``repeats`` runs of ``session`` (over ``model``) at M = ``rows`` (after two warm-up runs;
    ``scaling.time_calls``)."""
    feeds = {i.name: rng.standard_normal((rows, i.type.tensor_type.shape.dim[1].dim_value), dtype=np.float32)
             for i in model.graph.input}
    return time_calls(lambda: session.run(None, feeds), warmup=2, repeats=repeats, max_seconds=0.0,
                      min_runs=repeats)["median_ms"]


def run(args) -> dict:
    """All measurements: {"meta", "stream", "shapes", "rows"}."""
    rng = np.random.default_rng(0)
    config = bundle.load_config(args.bundle)
    shapes = weight_shapes(args.bundle / config.onnx_file)
    stream = stream_bandwidth(args.threads, args.stream_mib, 3)
    reference = max(stream["copy_gbs"], stream["triad_gbs"])
    rows, kept = [], []  # every session lives to the end: a session freed earlier would hand its memory, on either
    # kind of pages, to a later format's sessions, and memory mapped before a load is not moved (runtime.backends.huge_pages)
    for name in args.formats:
        bits, block = parse_format(name)
        model, nbytes = weights_graph(shapes, bits, block, rng)
        sessions = {pages: make_session(model, args.threads, pages == "huge") for pages in args.pages}
        kept.append(sessions)
        for m in args.rows:
            for pages, session in sessions.items():
                ms = time_graph(session, model, m, args.repeats, rng)
                gbs = nbytes / (ms / 1000) / GB
                rows.append({"format": name, "pages": pages, "rows": m, "weight_gb": nbytes / GB,
                             "step_weights_ms": ms, "gbs": gbs, "fraction_of_stream": gbs / reference,
                             "fraction_of_read": gbs / stream["read_gbs"]})
                print(f"{name} M={m} ({pages} pages): {ms:.2f} ms for {nbytes / GB:.3f} GB, {gbs:.1f} GB/s", flush=True)
        del model
    meta = {"command": "python bench/matmul_kernels.py " + " ".join(sys.argv[1:]), "bundle": str(args.bundle),
            "threads": args.threads, "repeats": args.repeats, "machine": machine_info(),
            "loadavg_end": os.getloadavg()}
    return {"meta": meta, "stream": stream, "shapes": [{"K": k, "N": n, "count": c} for (k, n), c in shapes.items()],
            "rows": rows}


def markdown(result: dict) -> str:
    """The weights-only step per format and M."""
    stream = result["stream"]
    lines = [f"STREAM at {stream['threads']} thread(s): copy {stream['copy_gbs']:.1f} GB/s, triad "
             f"{stream['triad_gbs']:.1f} GB/s; a read-only pass {stream['read_gbs']:.1f} GB/s", "",
             "| format | pages | M | weights GB | weights-only step ms | GB/s | of STREAM | of the read-only pass |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['pages']} | {r['rows']} | {r['weight_gb']:.3f} | {r['step_weights_ms']:.2f} | {r['gbs']:.1f} | "
              f"{r['fraction_of_stream']:.2f} | {r['fraction_of_read']:.2f} |" for r in result["rows"]]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Weights-only step bandwidth per format, one bar group per M, STREAM and the read-only pass as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(dict.fromkeys(r["format"] for r in result["rows"]))
    bars = list(dict.fromkeys((r["rows"], r["pages"]) for r in result["rows"]))
    gbs = {(r["format"], r["rows"], r["pages"]): r["gbs"] for r in result["rows"]}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(bars)
    for i, (m, pages) in enumerate(bars):
        ax.bar([f + i * width for f in range(len(formats))], [gbs[(f, m, pages)] for f in formats], width,
               label=f"M = {m}, {pages} pages")
    stream = result["stream"]
    ax.axhline(max(stream["copy_gbs"], stream["triad_gbs"]), color="k", linestyle="--",
               label=f"STREAM, {stream['threads']} thread(s)")
    ax.axhline(stream["read_gbs"], color="k", linestyle=":", label="read-only pass (numpy sum)")
    ax.set_xticks([f + width * (len(bars) - 1) / 2 for f in range(len(formats))], formats)
    ax.set(title="weights-only decode step: bytes read / kernel time", ylabel="GB/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path, help="bundle directory whose weight shapes are measured")
    p.add_argument("--formats", nargs="+", default=["fp32", "int8-32", "int8-128", "int4-32", "int4-128"],
                   help="weight formats: fp32, int8-S, int4-S (S the block size)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="activation rows M (B x W)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="onnxruntime intra-op threads")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per (format, M)")
    p.add_argument("--stream-mib", type=int, default=512, help="STREAM array size in MiB")
    p.add_argument("--pages", nargs="+", choices=["huge", "small"], default=["huge"],
                   help="weights on huge pages as the runtime loads them (huge), on onnxruntime's own pages (small), "
                        "or both")
    add_results_options(p, "matmul_kernels")
    args = p.parse_args()
    if min(args.rows) < 1 or args.repeats < 1 or args.stream_mib < 1 or not 1 <= args.threads <= 256:
        p.error("--rows, --repeats and --stream-mib must be >= 1, --threads in 1..256")
    for name in args.formats:
        try:
            parse_format(name)
        except ValueError as e:
            p.error(str(e))  # a bad argument: one error: line and exit status 2, as for the others
    check_results(args)
    try:
        result = run(args)
    except ValueError as e:  # a graph without the weights to time (BundleError among them)
        p.error(str(e))
    write_results(args.out, args.name, result, result["rows"], partial(plot, result))
    print(markdown(result))


if __name__ == "__main__":
    sys.exit(run_main(main))

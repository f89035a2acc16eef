"""One layer's attention at batch 1: our step graph's form against onnxruntime's GroupQueryAttention.

    python bench/gqa_attention.py [--pasts 128 1024] [--windows 1 4] [--heads 9] [--kv-heads 3]
                                  [--head-dim 64] [--layers 30] [--max-context 2048] [--repeats 200]
                                  [--rounds 5] [--threads 2] [--identity-tokens 8] [--chunks 1 2 3 4]
                                  [--out bench/results] [--name gqa_attention]

Dimension letters: W window, P past length, H query heads, Hkv KV heads, D head dim.
Defaults are SmolLM2-135M's (the default model). Whether a GroupQueryAttention (GQA) step
is worth building (GitHub issue 11, items 1-2) depends on what its attention costs against
ours; the projections and the MLP are the same MatMuls in both, so they are left out. Both
get the same inputs and their outputs are compared (max |difference| per row).

Both graphs take the projections' outputs q [1, W, H·D], k, v [1, W, Hkv·D], apply RoPE,
write the W new entries at positions P .. P+W-1 of a KV cache whose first P positions hold
the past, and attend over the P cached positions and the W new ones, returning [1, W, H·D]
and the cache; each runs as a runtime runs it, past and present bound to one buffer per name
with I/O binding (the W new entries are written in place, nothing else copied):

- ours: :func:`mars_export.step_module.step_attention` with :func:`rotary_joint`, exported
  by torch as the step graph is (cache [1, Hkv, S, D] with S = P + W here, the entries written
  by a ScatterND at ``positions``, mask bool [1, 1, W, S] over the cache's indices; the
  scores and p·v run over all S positions, so in the runtime, whose cache capacity S is up to
  about twice the length, ours costs more than here);
- GQA: one ``com.microsoft::GroupQueryAttention`` node with ``do_rotary`` (cos/sin caches
  of ``--max-context`` positions), cache [1, Hkv, max context, D] (it reads the first P + W).

Timing is interleaved (``profile_step.interleaved_times``: rounds of ``--repeats`` calls each,
median of the round means; wall time and this process's CPU time, the steadier figure on a busy
machine at ``--threads 1``),
and the per-call time is also given times ``--layers`` (ms per step).

**Identity by chunking** (``--identity-tokens N``, ``--chunks``): tau = 1 is exactly greedy AR,
and verify mode exactly AR, only if a token scored inside a window gets the bits it gets when
the window is cut differently (DESIGN.md §3). Both graphs feed the same N new tokens after the
largest ``--pasts`` in windows of c tokens (c per ``--chunks``; the last window takes the rest),
each window attending over the KV the earlier ones wrote, and every position's output is
compared bit for bit with that of one window of all N (ours over one cache of P + N positions,
GQA over its buffer of ``--max-context``, as a runtime's fixed cache). On onnxruntime 1.32 (CPU),
GroupQueryAttention is bit-identical for every cut into windows of >= 2 tokens and differs
(~1e-7) only where a window holds a single token; ours is bit-identical at every cut.

Writes {name}.json: ``rows`` (timing) and ``identity`` (graph, chunk, identical positions).
"""

from __future__ import annotations

import io
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from mars_export.step_module import StepKV, rotary_joint, step_attention
from profile_step import interleaved_times  # bench/ is on the path when this file runs as a script
from runtime.command_line import ArgumentParser, path_value, results_name, run_main
from runtime.decode.batch import window_mask

ROOT = Path(__file__).resolve().parents[1]
ROPE_THETA = 100000.0  # SmolLM2's; the value does not change the cost


class OursAttention(torch.nn.Module):
    """RoPE + grouped attention of one layer as the step graph traces it (batch 1)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.shape = heads, kv_heads, head_dim
        self.layer_idx = 0

    def forward(self, q, k, v, cos, sin, mask, positions, past_key, past_value):
        """q [1, W, H·D], k, v [1, W, Hkv·D], cos, sin [1, W, D], mask bool [1, 1, W, S], positions int64 [1, W]
        (< S), past_key, past_value [1, Hkv, S, D] -> (out [1, W, H·D], the cache's key and value [1, Hkv, S, D]
        with the W new entries at ``positions``)."""
        heads, kv_heads, head_dim = self.shape
        window = q.shape[1]
        q = q.view(1, window, heads, head_dim).transpose(1, 2)  # [1, H, W, D]
        k = k.view(1, window, kv_heads, head_dim).transpose(1, 2)  # [1, Hkv, W, D]
        v = v.view(1, window, kv_heads, head_dim).transpose(1, 2)
        q, k = rotary_joint(q, k, cos, sin)
        bias = torch.where(mask, torch.zeros(()), torch.finfo(torch.float32).min)  # [1, 1, W, S]
        step_kv = StepKV(past=[(past_key, past_value)], positions=positions)
        out, _ = step_attention(self, q, k, v, bias, head_dim**-0.5, step_kv=step_kv)  # [1, W, H, D]
        (present_key, present_value), = step_kv.present  # [1, Hkv, S, D]
        return out.reshape(1, window, heads * head_dim), present_key, present_value


def export_ours(path: Path, heads: int, kv_heads: int, head_dim: int) -> None:
    """``OursAttention`` to ONNX with dynamic W and S (the exporter's own log goes nowhere)."""
    from torch.export import Dim

    window, capacity = Dim("window", min=1, max=4096), Dim("capacity", min=1, max=8192)
    w, s = 2, 7
    example = (torch.randn(1, w, heads * head_dim), torch.randn(1, w, kv_heads * head_dim),
               torch.randn(1, w, kv_heads * head_dim), torch.randn(1, w, head_dim), torch.randn(1, w, head_dim),
               torch.ones(1, 1, w, s, dtype=torch.bool), torch.arange(s - w, s)[None],
               torch.randn(1, kv_heads, s, head_dim), torch.randn(1, kv_heads, s, head_dim))
    shapes = ({1: window}, {1: window}, {1: window}, {1: window}, {1: window}, {2: window, 3: capacity},
              {1: window}, {2: capacity}, {2: capacity})
    stdout, sys.stdout = sys.stdout, io.StringIO()
    try:
        program = torch.onnx.export(OursAttention(heads, kv_heads, head_dim).eval(), example, dynamo=True,
                                    dynamic_shapes=shapes, opset_version=18, optimize=True)
    finally:
        sys.stdout = stdout
    program.save(str(path))


def gqa_model(heads: int, kv_heads: int, head_dim: int, max_context: int) -> onnx.ModelProto:
    """One GroupQueryAttention node with rotary; past and present [1, Hkv, max_context, D] meant to share a buffer."""
    inv_freq = 1.0 / ROPE_THETA ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)  # [D / 2]
    angles = np.arange(max_context, dtype=np.float32)[:, None] * inv_freq  # [max_context, D / 2]
    kv = [1, kv_heads, max_context, head_dim]
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, "W", heads * head_dim]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, "W", kv_heads * head_dim]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, "W", kv_heads * head_dim]),
              helper.make_tensor_value_info("past_key", TensorProto.FLOAT, kv),
              helper.make_tensor_value_info("past_value", TensorProto.FLOAT, kv),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, "W", heads * head_dim]),
               helper.make_tensor_value_info("present_key", TensorProto.FLOAT, kv),
               helper.make_tensor_value_info("present_value", TensorProto.FLOAT, kv)]
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens_k",
                                                    "total_sequence_length", "cos_cache", "sin_cache"],
                            ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=heads,
                            kv_num_heads=kv_heads, do_rotary=1, scale=head_dim**-0.5)
    caches = [onnx.numpy_helper.from_array(np.cos(angles), "cos_cache"),
              onnx.numpy_helper.from_array(np.sin(angles), "sin_cache")]
    graph = helper.make_graph([node], "gqa", inputs, outputs, caches)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def make_inputs(heads, kv_heads, head_dim, past: int, window: int, rng) -> dict:
    """q [1, W, H·D], k, v [1, W, Hkv·D], past_key, past_value [1, Hkv, P, D]: random float32."""
    return {"q": rng.standard_normal((1, window, heads * head_dim), np.float32),
            "k": rng.standard_normal((1, window, kv_heads * head_dim), np.float32),
            "v": rng.standard_normal((1, window, kv_heads * head_dim), np.float32),
            "past_key": rng.standard_normal((1, kv_heads, past, head_dim), np.float32),
            "past_value": rng.standard_normal((1, kv_heads, past, head_dim), np.float32)}


def kv_buffers(inputs: dict, length: int) -> list[np.ndarray]:
    """Zeroed key and value caches [1, Hkv, ``length``, D] holding ``inputs``' past at their first P positions."""
    _, kv_heads, past, head_dim = inputs["past_key"].shape
    buffers = []
    for name in ("past_key", "past_value"):
        buffer = np.zeros((1, kv_heads, length, head_dim), np.float32)  # [1, Hkv, length, D]
        buffer[:, :, :past] = inputs[name]
        buffers.append(buffer)
    return buffers


def ours_call(session, inputs: dict):
    """A no-argument function running one call of our attention graph over a cache of P + W positions, bound as
    past and present (each call writes the same W entries); returns [out]."""
    past, window = inputs["past_key"].shape[2], inputs["q"].shape[1]
    return bound_call(session, bind_ours(session, kv_buffers(inputs, past + window), inputs, past))


def gqa_call(session, max_context: int, inputs: dict):
    """A no-argument function running one GQA call, past and present bound to the same buffers; returns [out]."""
    past = inputs["past_key"].shape[2]
    return bound_call(session, bind_gqa(session, kv_buffers(inputs, max_context), inputs, past))


def bound_call(session, binding):
    """A no-argument function running ``binding``; returns [its first output], copied out."""
    def call():
        session.run_with_iobinding(binding)
        return [binding.get_outputs()[0].numpy()]
    return call


def bind_ours(session, buffers: list[np.ndarray], window: dict, start: int):
    """The I/O binding of one call of our attention graph: ``window``'s q, k, v [1, W, ...] at positions
    ``start`` .. ``start``+W-1 over the cache ``buffers`` (key, value) [1, Hkv, S, D], which it reads the past from
    (positions < ``start``, mask [1, 1, W, S]) and writes the W new entries into, bound as past and present."""
    width, head_dim = window["q"].shape[1], buffers[0].shape[3]
    inv_freq = 1.0 / ROPE_THETA ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    positions = np.arange(start, start + width, dtype=np.int64)[None]  # [1, W]
    angles = positions[0, :, None].astype(np.float32) * inv_freq  # [W, D / 2]
    angles = np.concatenate([angles, angles], -1)[None]  # [1, W, D]
    mask = window_mask(np.array([start]), buffers[0].shape[2], width)  # [1, 1, W, S]
    values = [window["q"], window["k"], window["v"], np.cos(angles), np.sin(angles), mask, positions]
    names = [i.name for i in session.get_inputs()]  # in forward's argument order
    binding = session.io_binding()
    for name, value in zip(names, values):
        binding.bind_cpu_input(name, np.ascontiguousarray(value))
    out, present_key, present_value = (o.name for o in session.get_outputs())
    binding.bind_output(out)  # first: get_outputs() lists outputs in binding order
    for name_in, name_out, buffer in zip(names[len(values):], (present_key, present_value), buffers):
        value = ort.OrtValue.ortvalue_from_numpy(buffer)  # the buffer's memory, not a copy
        binding.bind_ortvalue_input(name_in, value)
        binding.bind_ortvalue_output(name_out, value)
    return binding


def bind_gqa(session, buffers: list[np.ndarray], window: dict, start: int):
    """The I/O binding of one GQA call: ``window``'s q, k, v [1, W, ...] after ``start`` cached positions, over the
    cache ``buffers`` (key, value) [1, Hkv, max context, D], which it reads the past from and writes the W new
    entries into (at ``start`` .. ``start``+W-1), bound as past and present."""
    width = window["q"].shape[1]
    binding = session.io_binding()
    cache = [ort.OrtValue.ortvalue_from_numpy(buffer) for buffer in buffers]  # the buffers' memory, not copies
    for name in ("q", "k", "v"):
        binding.bind_cpu_input(name, window[name])
    binding.bind_cpu_input("seqlens_k", np.array([start + width - 1], np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(start + width, np.int32))
    binding.bind_ortvalue_input("past_key", cache[0])
    binding.bind_ortvalue_input("past_value", cache[1])
    binding.bind_output("out")  # first: get_outputs() lists outputs in binding order
    binding.bind_ortvalue_output("present_key", cache[0])
    binding.bind_ortvalue_output("present_value", cache[1])
    return binding


def run(args) -> dict:
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    ours_path = args.out / f"{args.name}_ours.onnx"
    export_ours(ours_path, args.heads, args.kv_heads, args.head_dim)
    ours = ort.InferenceSession(str(ours_path), options, providers=["CPUExecutionProvider"])
    ours_path.unlink()
    gqa = ort.InferenceSession(gqa_model(args.heads, args.kv_heads, args.head_dim, args.max_context)
                               .SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng, rows = np.random.default_rng(0), []
    dims = (args.heads, args.kv_heads, args.head_dim)
    for past, window in itertools.product(args.pasts, args.windows):
        inputs = make_inputs(*dims, past, window, rng)
        calls = {"ours": ours_call(ours, inputs), "gqa": gqa_call(gqa, args.max_context, inputs)}
        max_diff = float(np.abs(calls["ours"]()[0] - calls["gqa"]()[0]).max())
        times = interleaved_times(calls, args.repeats, args.rounds)
        ms = {f"{name}_{clock}": t[kind] for name, t in times.items()
              for clock, kind in (("ms", "step_ms"), ("cpu_ms", "cpu_ms"))}
        rows.append({"past": past, "window": window, "max_abs_diff": max_diff, **ms,
                     "gqa_over_ours": ms["gqa_ms"] / ms["ours_ms"],
                     "gqa_over_ours_cpu": ms["gqa_cpu_ms"] / ms["ours_cpu_ms"],
                     "ours_ms_per_step": ms["ours_ms"] * args.layers, "gqa_ms_per_step": ms["gqa_ms"] * args.layers})
        print(f"P={past} W={window}: ours {ms['ours_ms'] * 1000:.1f} us, GQA {ms['gqa_ms'] * 1000:.1f} us per layer "
              f"({rows[-1]['gqa_over_ours']:.2f}x; CPU time {rows[-1]['gqa_over_ours_cpu']:.2f}x); x{args.layers} "
              f"layers: {ms['ours_ms'] * args.layers:.2f} vs {ms['gqa_ms'] * args.layers:.2f} ms per step; "
              f"outputs differ by {max_diff:.1e}", flush=True)
    identity = identity_rows(ours, gqa, args, rng)
    return {"meta": {"command": "python bench/gqa_attention.py " + " ".join(sys.argv[1:]),
                     "onnxruntime": ort.__version__, **{k: v for k, v in vars(args).items() if k != "out"}},
            "rows": rows, "identity": identity}


def chunked(session, bind, length: int, inputs: dict, chunk: int) -> np.ndarray:
    """Outputs [N, H·D] of N new tokens fed in windows of ``chunk`` (the last one the rest), each a call of
    ``session`` bound by ``bind(session, buffers, window, start)`` (:func:`bind_ours`, :func:`bind_gqa`) over one
    KV cache of ``length`` positions holding the past: each window reads the entries the windows before it wrote."""
    num_tokens, outs = inputs["q"].shape[1], []
    buffers, past = kv_buffers(inputs, length), inputs["past_key"].shape[2]
    for start in range(0, num_tokens, chunk):
        window = {name: np.ascontiguousarray(inputs[name][:, start:start + chunk]) for name in ("q", "k", "v")}
        binding = bind(session, buffers, window, past + start)
        session.run_with_iobinding(binding)
        outs.append(binding.get_outputs()[0].numpy()[0])
    return np.concatenate(outs)


def identity_rows(ours, gqa, args, rng) -> list[dict]:
    """Per graph and ``--chunks`` size: how many of ``--identity-tokens`` positions get the bits of one window."""
    inputs = make_inputs(args.heads, args.kv_heads, args.head_dim, max(args.pasts), args.identity_tokens, rng)
    graphs = {"ours": (ours, bind_ours, max(args.pasts) + args.identity_tokens),
              "gqa": (gqa, bind_gqa, args.max_context)}
    rows = []
    for graph, (session, bind, length) in graphs.items():
        whole = chunked(session, bind, length, inputs, args.identity_tokens)
        for chunk in args.chunks:
            out = chunked(session, bind, length, inputs, chunk)
            same = [bool(np.array_equal(out[i], whole[i])) for i in range(args.identity_tokens)]
            rows.append({"graph": graph, "chunk": chunk, "num_tokens": args.identity_tokens,
                         "identical_positions": sum(same), "max_abs_diff": float(np.abs(out - whole).max())})
            print(f"identity {graph}: windows of {chunk}: {sum(same)}/{len(same)} positions bit-identical to one "
                  f"window of {args.identity_tokens} (max |diff| {rows[-1]['max_abs_diff']:.1e})", flush=True)
    return rows


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pasts", type=int, nargs="+", default=[128, 1024], help="past lengths P")
    p.add_argument("--windows", type=int, nargs="+", default=[1, 4], help="windows W")
    p.add_argument("--heads", type=int, default=9, help="query heads H (default 9, SmolLM2-135M)")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads Hkv (default 3)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D (default 64)")
    p.add_argument("--layers", type=int, default=30, help="layers per step, for the per-step figure (default 30)")
    p.add_argument("--max-context", type=int, default=2048, help="GQA's KV buffer length (default 2048)")
    p.add_argument("--repeats", type=int, default=200, help="calls per timing sample (default 200)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    p.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads (default 2)")
    p.add_argument("--identity-tokens", type=int, default=8,
                   help="new tokens fed for the identity check, after the largest past (default 8)")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 3, 4],
                   help="window sizes the identity check cuts them into (default 1 2 3 4)")
    p.add_argument("--out", type=path_value, default=ROOT / "bench" / "results")
    p.add_argument("--name", type=results_name, default="gqa_attention", help="stem of the output file")
    args = p.parse_args()
    if min(args.pasts) < 0 or min(args.windows + args.chunks) < 1 or min(args.repeats, args.rounds) < 1:
        p.error("--pasts must be >= 0; --windows, --chunks, --repeats and --rounds at least 1")
    if args.identity_tokens < 1:
        p.error(f"--identity-tokens must be at least 1, got {args.identity_tokens}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.head_dim % 16:
        p.error(f"--head-dim must be a multiple of 16 (GroupQueryAttention's CPU kernel), got {args.head_dim}")
    if max(args.pasts) + max(args.windows + [args.identity_tokens]) > args.max_context:
        p.error(f"--max-context ({args.max_context}) must hold the longest past + window (and + --identity-tokens)")
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(run_main(main))

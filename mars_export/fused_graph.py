"""The fused graph of a bundle: onnxruntime-genai's model builder run on the checkpoint (GitHub issue 11).

``mars-export --graph fused`` writes, instead of our step graph, the graph the model builder
writes from the same weights (GroupQueryAttention with rotary, SkipSimplifiedLayerNormalization,
one packed QKV MatMul; 342 nodes after onnxruntime's optimizer where our step graph has 1193), run
at batch 1 by :mod:`runtime.backends.fused`. The builder is a library (``onnxruntime-genai``,
the ``[fused]`` extra) and is run as its own command, as its documentation does, on the model
saved as a Hugging Face checkpoint (a MARS adapter merged, a GGUF source dequantized).

One change is made to the builder's graph (:func:`tile_one_token_windows`): a one-token window
runs its attention as two rows. onnxruntime's CPU ``GroupQueryAttention`` gives a token other
bits in a one-token window than in any window of two or more (MLAS takes its GEMV path for the
probabilities x V product of one query row), which would break "tau = 1 is exactly greedy AR"
(DESIGN.md §3). Duplicating the one row inside each attention keeps every other op at one row,
where the runtime would otherwise feed a second, padding token through the whole model
(``runtime.backends.fused``).

A model the builder is known to fail on (a Phi3 config it takes for Phi-3 128k), or whose rope scaling it computes
otherwise than transformers (:data:`FUSED_ROPE_TYPES`), is refused before the export writes anything, naming
``--graph step`` (:func:`check_builder_accepts`). A dynamic-NTK rope is given to the builder as the default rope
(:func:`prepare_builder_config`), which it is below ``max_position_embeddings``, the bundle's context.

A float32 fused bundle also gets the greedy head (:mod:`mars_export.greedy_head`): the argmax ids of the
window's last ``num_greedy`` rows, exact, without reading the float32 output head; and its confidence gate
(:mod:`mars_export.confidence_gate`, ``confidence_tau`` a required input): a threshold step skips the float32
head where every tau test provably fails.

A quantized fused bundle (``--int8`` / ``--int4``) also gets the MLP's gate and up projections (any MatMuls reading
one input; the builder already packs Q, K and V, also for Qwen3) fused into one MatMul and a Split
(:func:`mars_export.fuse_projections.fuse_shared_input_matmuls`, the step graph's rule): one
MatMulNBits kernel and one quantization of its input instead of two per layer. Same bits; speed in
BENCHMARKS.md (it pays in int8, not in float32, where the Split costs what the kernel saves). Its
weights are quantized from float32, also for a GGUF source (:func:`mars_export.quantize.prepare_gguf_graph`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

import onnx
import onnx_ir as ir
from onnx import TensorProto, helper
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from mars_export.confidence_gate import add_confidence_gate
from mars_export.context import config_fields
from mars_export.fuse_projections import fuse_shared_input_matmuls
from mars_export.greedy_head import add_greedy_head
from mars_export.logits_rows import compute_logits_of_last_rows
from runtime.backends.fused import ONE_TOKEN_WINDOW_KEY, TILED  # model metadata: tile_one_token_windows ran
from runtime.bundle import MAX_INLINE_BYTES, external_data_file
from runtime.context import ALL_LAYERS, rope_types
from runtime.model_types import base_model_type

BUILDER = "onnxruntime_genai.models.builder"
BUILDER_FILE = "model.onnx"
# The rope types whose cos/sin onnxruntime-genai's model builder (0.18) writes as transformers computes them, at
# every position of the bundle's context, by model type; every type also takes "default" and "dynamic" (given to
# the builder as the default rope, which transformers' dynamic NTK is below max_position_embeddings). What else
# the builder does: its Llama reads llama3 only and writes linear, yarn and longrope as the default rope; its
# Qwen2, Qwen3 and Mistral write yarn without transformers' rounding of the correction range (other frequencies,
# off by radians past the original context) and refuse llama3 and longrope. Phi3's longrope is capped to its
# original context (runtime.context). tests/test_rope_scaling.py holds the builder to this table.
FUSED_ROPE_TYPES = {"llama": ("llama3",), "mistral": ("linear",), "qwen2": ("linear",), "qwen3": ("linear",),
                    "phi3": ("longrope",)}
ANY_MODEL_ROPE_TYPES = ("default", "dynamic")


def require_builder() -> None:
    """Raise RuntimeError, naming the extra to install, if onnxruntime-genai is not installed."""
    if find_spec("onnxruntime_genai") is None:
        raise RuntimeError("--graph fused needs onnxruntime-genai's model builder: pip install 'mars-edge[fused]'")


def check_builder_accepts(config: PretrainedConfig) -> None:
    """Raise ValueError, naming ``--graph step``, for a model the model builder is known to fail on or to compute
    otherwise than transformers: rope settings per layer type (Gemma3; the builder reads one), a rope type not in
    :data:`FUSED_ROPE_TYPES` for the model type, or a Phi3 config it takes for Phi-3 128k.

    Phi3: the builder takes its LongRoPE class (Phi-3 128k) whenever ``max_position_embeddings`` differs from
    ``original_max_position_embeddings``, and that class fails (``KeyError: 'multi_cache'``) unless the rope
    scaling is ``longrope``. transformers reads ``original_max_position_embeddings`` only for scaled rope, so such
    a config (Phi3Config's default 4096 beside another context) is an ordinary model the builder cannot take.
    """
    types = rope_types(config_fields(config))
    if set(types) - {ALL_LAYERS}:
        per_layer = ", ".join(f"{layer} {rope_type}" for layer, rope_type in types.items())
        raise ValueError(f"--graph fused: this model gives rope settings per layer type ({per_layer}), and "
                         "onnxruntime-genai's model builder reads one for all layers; export it with --graph step")
    model_type, rope_type = base_model_type(config.model_type), types.get(ALL_LAYERS, "default")
    supported = (*ANY_MODEL_ROPE_TYPES, *FUSED_ROPE_TYPES.get(model_type, ()))
    if rope_type not in supported:
        raise ValueError(f"--graph fused: onnxruntime-genai's model builder does not compute {rope_type} rope scaling "
                         f"as transformers does on a {model_type} model (it does: {', '.join(supported)}); export it "
                         "with --graph step")
    if model_type != "phi3" or config.max_position_embeddings == config.original_max_position_embeddings:
        return
    if rope_type != "longrope":
        raise ValueError(f"--graph fused: onnxruntime-genai's model builder cannot build this Phi3 model "
                         f"(max_position_embeddings {config.max_position_embeddings} differs from "
                         f"original_max_position_embeddings {config.original_max_position_embeddings} without "
                         "longrope rope scaling); export it with --graph step")


def prepare_builder_config(fields: dict) -> dict:
    """The checkpoint's ``config.json`` ``fields`` as the builder is to read them: without a quantization config
    (a GGUF-loaded model is dequantized already, DESIGN.md §8), a dynamic-NTK rope as the default one (its rope_theta
    and partial_rotary_factor kept; the builder's Qwen2 and Mistral refuse dynamic, its Llama takes it as default),
    and the rope type also under longrope's older key ``type``, which the builder reads (Phi-3 128k)."""
    fields = {name: value for name, value in fields.items() if name != "quantization_config"}
    rope = fields.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_type" not in rope:
        return fields
    if rope_types(fields).get(ALL_LAYERS) == "dynamic":
        kept = {name: value for name, value in rope.items() if name in ("rope_theta", "partial_rotary_factor")}
        rope = {**kept, "rope_type": "default"}
    return {**fields, "rope_parameters": {"type": rope["rope_type"], **rope}}


def write_fused_graph(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path,
                      fuse_projections: bool = False, greedy_mask_token: int | None = None) -> None:
    """Write the model builder's float32 CPU graph of ``model`` to ``path`` (weights inline; over 2 GB in
    ``path`` + .data), one-token windows tiled (:func:`tile_one_token_windows`), the output head on the
    window's last ``num_logits`` rows (:mod:`mars_export.logits_rows`).

    ``fuse_projections``: MatMuls reading one input become one (for a graph that will be quantized).
    ``greedy_mask_token``: add the greedy head (:mod:`mars_export.greedy_head`), which never returns that
    token, and its confidence gate (:mod:`mars_export.confidence_gate`); None: neither (a graph to be quantized, whose ids must be its own quantized head's argmax).

    Raises:
        RuntimeError: onnxruntime-genai is not installed, or the builder failed (its last
            error line, e.g. an architecture it does not know).
        ValueError: a model the builder is known to fail on or to compute otherwise than transformers
            (:func:`check_builder_accepts`), before it runs.
    """
    require_builder()
    check_builder_accepts(model.config)
    with tempfile.TemporaryDirectory(prefix="mars-fused-") as tmp:
        checkpoint, out = Path(tmp) / "checkpoint", Path(tmp) / "out"
        model.save_pretrained(checkpoint)
        tokenizer.save_pretrained(checkpoint)
        config_file = checkpoint / "config.json"
        config_file.write_text(json.dumps(prepare_builder_config(json.loads(config_file.read_text())), indent=2))
        done = subprocess.run([sys.executable, "-m", BUILDER, "-i", str(checkpoint), "-o", str(out), "-p", "fp32",
                               "-e", "cpu", "-c", str(Path(tmp) / "cache")], capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()] or ["(no output)"]
            raise RuntimeError(f"onnxruntime-genai's model builder failed: {lines[-1][:300]}")
        # the builder keeps the weights apart: loaded into memory, saved as one file below protobuf's 2 GiB
        model = ir.from_proto(onnx.load(str(out / BUILDER_FILE)))
        if fuse_projections:
            fuse_shared_input_matmuls(model.graph)
        compute_logits_of_last_rows(model.graph, has_default=False)  # FusedStep binds it (I/O binding)
        if greedy_mask_token is not None:
            screening = add_greedy_head(model.graph, greedy_mask_token)
            if screening:  # threshold steps skip the float32 head where every tau test provably fails
                add_confidence_gate(model.graph, screening, greedy_mask_token, has_default=False)
        graph = ir.to_proto(model)
        tile_one_token_windows(graph)
        onnx.save(graph, str(path), save_as_external_data=graph.ByteSize() > MAX_INLINE_BYTES,
                  location=external_data_file(path.name))


def tile_one_token_windows(model: onnx.ModelProto) -> None:
    """Run a one-token window's attention as two rows, in place: every ``GroupQueryAttention`` gets its
    query, key and value inputs (a packed QKV [1, S, (H + 2 Hkv) D], or three [1, S, . D] where the builder
    normalizes Q and K apart, as for Qwen3) tiled to [1, 2, ...] when S = 1 (unchanged otherwise), and its
    output sliced back to S rows. The second row, at position P + 1, writes KV beyond the window (past and present
    share one buffer; the runtime gives it room and never commits it) and its output is dropped, so the
    first row gets the bits any window of two or more gives it. The caller feeds attention_mask of
    P + max(S, 2) ones. Marks the model with ``{ONE_TOKEN_WINDOW_KEY: TILED}``.

    Raises:
        ValueError: the graph has no GroupQueryAttention.
    """
    graph = model.graph
    attentions = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    if not attentions:
        raise ValueError("the model builder's graph has no GroupQueryAttention")
    prefix = "/mars_edge/one_token_window"
    const = lambda name, values: helper.make_node(  # noqa: E731
        "Constant", [], [f"{prefix}/{name}"], value=helper.make_tensor(f"{prefix}/{name}", TensorProto.INT64,
                                                                        [len(values)], values))
    shared = [const("one", [1]), const("two", [2]), const("axis1", [1]), const("zero", [0]),
              helper.make_node("Shape", ["input_ids"], [f"{prefix}/shape"]),
              helper.make_node("Slice", [f"{prefix}/shape", f"{prefix}/one", f"{prefix}/two"], [f"{prefix}/S"]),
              helper.make_node("Equal", [f"{prefix}/S", f"{prefix}/one"], [f"{prefix}/is_one"]),
              helper.make_node("Where", [f"{prefix}/is_one", f"{prefix}/two", f"{prefix}/one"], [f"{prefix}/rows"]),
              helper.make_node("Concat", [f"{prefix}/one", f"{prefix}/rows", f"{prefix}/one"], [f"{prefix}/repeats"],
                               axis=0)]  # [1, 2 if S == 1 else 1, 1]
    nodes = list(graph.node)
    first = nodes.index(attentions[0])
    for i, node in enumerate(attentions):
        tiles = []
        for j in (j for j in range(min(3, len(node.input))) if node.input[j]):  # query, key, value (or packed QKV)
            tiled = f"{prefix}/{i}/input{j}"
            tiles.append(helper.make_node("Tile", [node.input[j], f"{prefix}/repeats"], [tiled],
                                          name=f"{prefix}/{i}/Tile{j}"))
            node.input[j] = tiled
        out, whole = node.output[0], f"{prefix}/{i}/out"
        cut = helper.make_node("Slice", [whole, f"{prefix}/zero", f"{prefix}/S", f"{prefix}/axis1"], [out],
                               name=f"{prefix}/{i}/Slice")
        node.output[0] = whole
        at = nodes.index(node)
        nodes[at:at + 1] = [*tiles, node, cut]
    nodes[first:first] = shared
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, ONE_TOKEN_WINDOW_KEY: TILED})

"""Weight-only int8 / int4 quantization of the exported step graph (``mars-export --int8 | --int4``).

Every MatMul whose weight is a constant becomes an onnxruntime ``com.microsoft::MatMulNBits``
node (``onnxruntime.quantization.matmul_nbits_quantizer``): the weight is stored in blocks
of ``BLOCK_SIZE`` values along the reduction axis K, each block with one float32 scale and,
asymmetric, one zero point. Only the weights are stored quantized: attention, norms, the
KV cache and the logits stay float32 and the graph's I/O is unchanged, so the runtime runs
it as it runs fp32. Inside MatMulNBits the CPU kernel quantizes its input per block to int8
for the dot products (``ACCURACY_LEVEL``), the only fast path of this onnxruntime.

Tied embeddings: the dynamo exporter writes the output head of a tied model as
``MatMul(h, Transpose(W))`` with ``W`` the embedding table that the input ``Gather`` also
reads. The quantizer skips it (its weight is not a constant), yet at W <= 8 tokens per step
the fp32 head is the largest weight read per step (V x hidden). With ``include_lm_head``
the head gets its own transposed copy, quantized like the other MatMuls; the ``Gather``
keeps the float32 table (it reads only W rows per step).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from mars_export.gguf_blocks import BLOCK_TYPES
from mars_export.gguf_import import GgufImport, import_gguf_matmuls, prepare_gguf_import
from mars_export.logits_rows import output_head
from mars_export.model_source import LoadedModel, load_gguf_model
from mars_export.onnx_export import export_step_graph
from mars_export.parity import ParityError, fit_prompts, measure_parity
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import MAX_INLINE_BYTES, BundleConfig, strip_greedy_head
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams
from runtime.evaluation.scoring import common_prefix

WEIGHT_BITS = {"int8": 8, "int4": 4}
# Block size and symmetry per weight dtype, from a sweep on the default model's step graph
# (bench/quantized_step.py, profile_step.py; BENCHMARKS.md "Weight-only int8 / int4 on the
# fused step graph"). int8: symmetric blocks of 32 (llama.cpp Q8_0's scheme) kept top-1
# agreement with the float32 graph at 0.970 (asymmetric 32: 0.951) with a W = 1 step 0.44x
# float32 (CPU time, 1 thread; asymmetric 32: 0.46x). Blocks of 128 were faster (0.38x) but
# their top-1 against PyTorch on the export's parity prompts was 0.911, too near the 0.9
# floor for a default. int4: asymmetric blocks of 32 keep top-1 at 0.65; blocks of 128
# (0.27-0.31x) fell to 0.56-0.60 (this model's weights were dequantized from Q4_1,
# asymmetric blocks of 32, so int4 re-quantizes them).
BLOCK_SIZE = {"int8": 32, "int4": 32}
IS_SYMMETRIC = {"int8": True, "int4": False}
# MatMulNBits compute on CPU: 4 = int8 dot products, the activations quantized per block
# of K at run time (weights stay as stored). With fp32 compute (level unset) one
# 8 x 576 x 1536 MatMul took 3.0 ms (int4) and 34 ms (int8: no fast kernel) against 1.2 ms
# in fp32; with level 4, 1.3 ms and 1.4 ms (2-core AMD EPYC, onnxruntime 1.32).
ACCURACY_LEVEL = 4
QUANT_OP = "MatMulNBits"
REFERENCE_FILE = "reference-float32.onnx"  # the float32 graph, kept in the temporary bundle while measuring
BASE_FILE = "base-float32.onnx"  # the float32 graph of the model before its adapter, while importing GGUF blocks
# Weight dtypes that take a GGUF source's blocks as they are (mars_export.gguf_import); int8
# re-quantizes (8-bit codes of 4-bit blocks would double the bytes for the same weights).
GGUF_DTYPES = ("int4",)
# Gate of a quantized export: top-1 agreement with the float32 PyTorch model on the parity
# prompts (quantized logits cannot meet the float32 |Δlogit| tolerance). A floor that
# catches a broken graph, not a quality mark: the default model measured 0.96 (int8) and
# 0.64 (int4) against its float32 graph on 6 real prompts; tiny random models 0.98-1.0 and
# 0.92-0.97. int4 holding a GGUF file's own blocks (every layer imported, none re-quantized)
# keeps much more: default-mars 0.894 against PyTorch on the parity prompts (accuracy level
# 4; the rest is the int8 activations), so its floor is stricter. See README "Quantized exports".
MIN_TOP1_AGREEMENT = {"int8": 0.9, "int4": 0.5}
MIN_TOP1_GGUF_BLOCKS = 0.8
AGREEMENT_TOKENS = 64


def quantize_step_graph(src: Path, dst: Path, weight_dtype: str, include_lm_head: bool = True,
                        block_size: int | None = None, is_symmetric: bool | None = None,
                        accuracy_level: int | None = ACCURACY_LEVEL, gguf: GgufImport | None = None) -> dict:
    """Write ``src`` (a float32 step graph) to ``dst`` with weight-only quantized MatMuls, without the greedy head
    ``src`` may have (:func:`runtime.bundle.strip_greedy_head`: the quantized head's argmax gives the ids).

    Args:
        weight_dtype: ``"int8"`` or ``"int4"`` (MatMulNBits with bits 8 or 4).
        include_lm_head: also quantize the output head, the MatMul whose output becomes ``logits``
            (:func:`_output_head`; a tied head is untied first, see the module docstring).
        block_size, is_symmetric: None = the dtype's :data:`BLOCK_SIZE` / :data:`IS_SYMMETRIC`.
        accuracy_level: MatMulNBits compute type (see :data:`ACCURACY_LEVEL`); None = fp32.
        gguf: the GGUF blocks of ``src``'s weights (``weight_dtype`` int4): the MatMuls they
            hold are imported as they are (:mod:`mars_export.gguf_import`) and only the others
            are quantized; None quantizes every MatMul.

    Returns:
        ``{"weight_dtype", "block_size", "is_symmetric", "accuracy_level", "lm_head_quantized", "num_quantized"}``,
        with ``gguf``: also ``"gguf_imported"`` (ggml type -> number of layers imported) and
        ``"gguf_requantized"`` (the same for layers quantized again).

    Raises:
        ValueError: unknown ``weight_dtype``, or the graph has no constant-weight MatMul.
    """
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if weight_dtype not in WEIGHT_BITS:
        raise ValueError(f"weight dtype must be one of {sorted(WEIGHT_BITS)}, got {weight_dtype!r}")
    block_size = BLOCK_SIZE[weight_dtype] if block_size is None else block_size
    is_symmetric = IS_SYMMETRIC[weight_dtype] if is_symmetric is None else is_symmetric
    model = onnx.load(str(src))
    strip_greedy_head(model)  # a quantized graph's ids are its own quantized head's argmax
    head = _output_head(model.graph)
    if include_lm_head and head is not None:
        _untie(model.graph, head)
    excluded = [head.name] if head is not None and not include_lm_head else []
    imported = import_gguf_matmuls(model.graph, gguf, accuracy_level) if gguf is not None else None
    if imported is not None:
        excluded += imported["side_path_nodes"]
        _say_requantized(imported["requantized"], weight_dtype)
    quantizer = MatMulNBitsQuantizer(model, bits=WEIGHT_BITS[weight_dtype], block_size=block_size,
                                     is_symmetric=is_symmetric, accuracy_level=accuracy_level,
                                     nodes_to_exclude=excluded)
    with _quiet("onnxruntime.quantization"):
        quantizer.process()
    model = quantizer.model.model
    num_quantized = sum(node.op_type == QUANT_OP for node in model.graph.node)
    if num_quantized == 0:
        raise ValueError(f"{src} has no MatMul with a constant weight: nothing to quantize")
    onnx.save(model, str(dst), save_as_external_data=model.ByteSize() > MAX_INLINE_BYTES)
    summary = {"weight_dtype": weight_dtype, "block_size": block_size, "is_symmetric": is_symmetric,
               "accuracy_level": accuracy_level, "lm_head_quantized": include_lm_head and head is not None,
               "num_quantized": num_quantized}
    if imported is not None:
        summary.update(gguf_imported=imported["ggml_types"], gguf_requantized=imported["requantized"])
    return summary


def _say_requantized(requantized: dict[str, int], weight_dtype: str) -> None:
    """One line on stderr when some linear layers of a GGUF source are quantized a second time."""
    if requantized:
        kinds = ", ".join(f"{n} {kind}" for kind, n in requantized.items())
        print(f"{weight_dtype}: {sum(requantized.values())} linear layers are not held as {'/'.join(BLOCK_TYPES)} "
              f"blocks of one width ({kinds}): quantized again from float32", file=sys.stderr)


def quantize_and_check(loaded: LoadedModel, bundle_dir: Path, config: BundleConfig, prompts: list[list[int]],
                       min_top1: float | None = None, block_size: int | None = None) -> dict:
    """Quantize the bundle's float32 graph to ``config.weight_dtype`` and measure it; the export's parity step.

    int4 of a step graph read from GGUF blocks imports them (:func:`prepare_gguf_graph`; a fused graph quantizes
    again from float32). Measures
    the quantized graph against the float32 PyTorch ``loaded.model`` (max |Δlogit|, top-1
    agreement) and its greedy output against the float32 graph's (:func:`measure_greedy_agreement`),
    then removes the float32 graph.

    Args:
        min_top1: lowest top-1 agreement allowed; None = :data:`MIN_TOP1_AGREEMENT` of the dtype,
            or :data:`MIN_TOP1_GGUF_BLOCKS` where every layer holds GGUF blocks as they are.
        block_size: weights per block of the layers quantized here (None: :data:`BLOCK_SIZE` of the dtype;
            layers imported from GGUF blocks keep theirs).

    Returns:
        the parity record for ``mars_config.json``.

    Raises:
        ParityError: top-1 agreement below ``min_top1``.
    """
    reference_config, weights = quantize_bundle_graph(bundle_dir, config, loaded, block_size)
    floor = default_top1_floor(weights) if min_top1 is None else min_top1
    backend = OnnxBackend(bundle_dir, config)
    parity = {**measure_parity(loaded.model, backend, config, prompts), "backend": "onnxruntime-cpu",
              "min_top1_agreement": floor, "weights": weights}
    check_top1_floor(parity, weights, min_top1)
    parity["greedy_vs_float32"] = measure_greedy_agreement(OnnxBackend(bundle_dir, reference_config), backend,
                                                           config, prompts)
    (bundle_dir / REFERENCE_FILE).unlink()
    return parity


def quantize_bundle_graph(bundle_dir: Path, config: BundleConfig, loaded: LoadedModel | None = None,
                          block_size: int | None = None) -> tuple[BundleConfig, dict]:
    """Quantize the float32 graph ``config.onnx_file`` of ``bundle_dir`` in place to ``config.weight_dtype``.

    The float32 graph is kept as :data:`REFERENCE_FILE` for the agreement measurement; the
    caller removes it. ``loaded``: the model of the graph, whose GGUF blocks int4 imports
    (:func:`prepare_gguf_graph`); None quantizes every weight. ``block_size``: as
    :func:`quantize_step_graph`.

    Returns:
        the config of the float32 reference graph, and :func:`quantize_step_graph`'s summary.
    """
    graph = bundle_dir / config.onnx_file
    reference = graph.rename(bundle_dir / REFERENCE_FILE)
    source, gguf = prepare_gguf_graph(loaded, bundle_dir, config) if loaded is not None else (reference, None)
    summary = quantize_step_graph(source, graph, config.weight_dtype, block_size=block_size, gguf=gguf)
    if source != reference:
        source.unlink()
    return replace(config, onnx_file=REFERENCE_FILE, weight_dtype=None), summary


def prepare_gguf_graph(loaded: LoadedModel, bundle_dir: Path, config: BundleConfig) -> tuple[Path, GgufImport | None]:
    """The float32 graph to quantize and, for int4 of a GGUF source, the blocks to import into it.

    Without an adapter that graph is the bundle's (:data:`REFERENCE_FILE`); with one (``default-mars``)
    the graph of the model re-read from the GGUF file is exported to :data:`BASE_FILE` and the
    adapter becomes side paths.
    Other sources and dtypes, and fused graphs (the model builder's packed weights are quantized
    again, as llama.cpp's own quantizer does with a float32 GGUF): (the reference graph, None).
    """
    reference = bundle_dir / REFERENCE_FILE
    if config.weight_dtype not in GGUF_DTYPES or loaded.gguf_file is None:
        return reference, None
    if config.graph == "fused":
        print(f"{config.weight_dtype}: the fused graph's weights are quantized again from float32 (the GGUF's own "
              "blocks are imported into --graph step only)", file=sys.stderr)
        return reference, None
    if loaded.adapter_dir is None:
        return reference, prepare_gguf_import(loaded.gguf_file, loaded.model)
    base = load_gguf_model(loaded.gguf_file)
    export_step_graph(base, bundle_dir / BASE_FILE, config.window, config.max_context)
    gguf = prepare_gguf_import(loaded.gguf_file, base, loaded.model, loaded.adapter_dir)
    return bundle_dir / BASE_FILE, gguf


def measure_greedy_agreement(reference, backend, config: BundleConfig, prompts: list[list[int]],
                             num_tokens: int = AGREEMENT_TOKENS) -> dict:
    """Greedy (tau = 1) output of ``backend`` against ``reference`` on ``prompts``, up to ``num_tokens`` each.

    In a small context (a sliding window's, :mod:`mars_export.context`) ``num_tokens`` is lowered to half of what
    one window leaves, and the prompts are cut to fit beside them (:func:`mars_export.parity.fit_prompts`).

    Returns:
        ``{"num_prompts", "num_tokens"`` (the tokens generated per prompt), ``"identical_fraction"`` (prompts whose
        ids are all equal), ``"mean_common_prefix"`` (tokens before the first difference), ``"mean_reference_tokens"}``.
    """
    num_tokens = min(num_tokens, (config.max_context - config.window) // 2)
    prompts = fit_prompts(prompts, config, num_tokens)
    params = DecodeParams(tau=1.0, max_new_tokens=num_tokens)
    pairs = [(Decoder(reference, config).generate(ids, params).token_ids,
              Decoder(backend, config).generate(ids, params).token_ids) for ids in prompts]
    prefixes = [common_prefix(a, b) for a, b in pairs]
    return {"num_prompts": len(pairs), "num_tokens": num_tokens,
            "identical_fraction": sum(a == b for a, b in pairs) / len(pairs),
            "mean_common_prefix": float(np.mean(prefixes)),
            "mean_reference_tokens": float(np.mean([len(a) for a, _ in pairs]))}


def default_top1_floor(summary: dict) -> float:
    """The top-1 floor of a graph quantized as :func:`quantize_step_graph`'s ``summary`` says."""
    return MIN_TOP1_GGUF_BLOCKS if _holds_gguf_blocks(summary) else MIN_TOP1_AGREEMENT[summary["weight_dtype"]]


def _holds_gguf_blocks(summary: dict) -> bool:
    """Whether every layer of the graph ``summary`` describes holds a GGUF file's blocks as they are."""
    return bool(summary.get("gguf_imported")) and not summary.get("gguf_requantized")


def check_top1_floor(result: dict, weights: dict, min_top1: float | None = None) -> None:
    """Raise :class:`ParityError` if the top-1 agreement with PyTorch is below the floor: ``min_top1`` (``--min-top1``)
    where given, else :func:`default_top1_floor` of ``weights`` (:func:`quantize_step_graph`'s summary).

    The default floor is set to catch a broken graph, not as a quality mark (:data:`MIN_TOP1_AGREEMENT`), so the
    message calls the quantization broken only below it; below a stricter floor the user asked for, it says so.
    """
    agreement, default = result["top1_agreement"], default_top1_floor(weights)
    floor = default if min_top1 is None else min_top1
    if agreement >= floor:
        return
    dtype = weights["weight_dtype"]
    kind = f"{dtype} exports" + (" holding a GGUF file's own blocks" if _holds_gguf_blocks(weights) else "")
    measured = (f"parity check failed for the {dtype} graph: top-1 agreement with the float32 PyTorch model "
                f"{agreement:.4f} over {result['num_positions']} positions (max |Δlogit| "
                f"{result['max_abs_logit_diff']:.3g})")
    blocks = weights.get("block_size")
    broke = "quantization broke the model" + (
        f", or blocks of {blocks} (--quant-block) keep too little of it" if blocks not in (None, BLOCK_SIZE[dtype])
        else "")
    if min_top1 is None:
        raise ParityError(f"{measured} is below the default floor {default:g} of {kind}, set to catch a broken graph, "
                          f"not as a quality mark (README \"Quantized exports\"): {broke}; pass a lower --min-top1 to "
                          "keep it on purpose")
    if agreement < default:
        raise ParityError(f"{measured} is below the floor you asked for (--min-top1 {min_top1:g}) and below the "
                          f"default floor {default:g} of {kind} too, set to catch a broken graph: {broke}")
    raise ParityError(f"{measured} is below the floor you asked for (--min-top1 {min_top1:g}); it passes the default "
                      f"floor {default:g} of {kind}, set to catch a broken graph, not as a quality mark (README "
                      "\"Quantized exports\"): lower --min-top1 to keep this export")


def count_quantized_nodes(path: Path) -> int:
    """Number of MatMulNBits nodes in the graph at ``path`` (weights not loaded)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return sum(node.op_type == QUANT_OP for node in graph.node)


def _output_head(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The MatMul whose output becomes ``logits``, found as the ``num_logits`` cut and the greedy head find it
    (:func:`mars_export.logits_rows.output_head`: also behind Gemma2's final logit soft-capping), or None if
    another op computes the logits."""
    head = output_head(ir.serde.deserialize_graph(graph))
    if head is None or head.op_type != "MatMul":
        return None
    written = head.outputs[0].name
    return next(node for node in graph.node if written in node.output)


def _untie(graph: onnx.GraphProto, head: onnx.NodeProto) -> None:
    """If ``head`` reads ``Transpose(W)`` of an initializer ``W`` (tied embeddings), give it its own constant.

    The new initializer ``W.T`` [K, N] is what the quantizer can see; the Transpose is
    removed once nothing else reads it, and ``W`` stays for the embedding Gather.
    """
    initializers = {t.name: t for t in graph.initializer}
    producer = next((n for n in graph.node if head.input[1] in n.output), None)
    if producer is None or producer.op_type != "Transpose" or producer.input[0] not in initializers:
        return
    weight = numpy_helper.to_array(initializers[producer.input[0]])  # [N, K]
    assert weight.ndim == 2 and _perm(producer) in ([1, 0], []), "the tied head is a plain 2-D transpose"
    untied = numpy_helper.from_array(np.ascontiguousarray(weight.T), f"{producer.input[0]}.untied_t")  # [K, N]
    graph.initializer.append(untied)
    head.input[1] = untied.name
    if not any(producer.output[0] in n.input for n in graph.node):
        graph.node.remove(producer)


def _perm(node: onnx.NodeProto) -> list[int]:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), [])


class _quiet:
    """Silence a logger below ERROR for the duration of a ``with`` block."""

    def __init__(self, name: str):
        self.logger = logging.getLogger(name)

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)

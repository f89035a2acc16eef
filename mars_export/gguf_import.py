"""An int4 step graph whose quantized weights are the GGUF file's own blocks (GitHub issue 11).

Dimension letters: K input features, N output features of one MatMul (for a fused Q/K/V or
gate/up MatMul the sum over its parts), NB = K / 32 blocks, r the rank of a LoRA term.

A model loaded from a GGUF file was dequantized from blocks (:mod:`mars_export.gguf_blocks`);
quantizing its float32 graph again rounds every weight to a second grid. Instead, each
``MatMul(x, Wᵀ)`` of the float32 graph whose weight came from Q4_0 / Q4_1 / Q8_0 blocks
becomes ``com.microsoft::MatMulNBits`` holding those blocks: the codes as they are, the
block scales d, and integer zero points (8 for Q4_0, 0 for Q4_1, 128 for Q8_0). Q4_1's
block minimum m is not a zero point of that form (``-m / d`` is fractional, and
onnxruntime 1.32's CPU kernel with float zero points runs ~20x slower than float32, at any
accuracy level), so ``Σ_blocks m · Σ_block x`` goes into a float32 side path. The same side
path carries a LoRA adapter left unmerged, ``(x @ Aᵀ) @ (scale · B)ᵀ``, and the rows of the
output head that an adapter's trainable tokens changed. Per part of a MatMul (the Q, K and V
of a fused Q/K/V MatMul, ...) the graph computes (:mod:`mars_export.side_path`)

    y_p = MatMulNBits(x)_p + [s | x @ Aᵀ_p] @ [mᵀ ; (scale · B_p)ᵀ]

with s the block sums of x, NB more output rows of the same MatMulNBits (codes 0 / 1), which
equals the GGUF weights plus the adapter, with no second rounding of any weight. (Why float
zero points are slow: onnxruntime's MatMulNBits skips prepacking with them and dequantizes B
to a float32 [K, N] buffer on every call.)

Which float32 MatMul holds which linear layer is found by value: the columns of the graph's
constant weight are compared bit for bit with the weights of the model it was exported
from, and a layer is imported only where its blocks dequantize bit for bit to that weight.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from transformers import PreTrainedModel

from mars_export.gguf_blocks import GGUF_BLOCK, BlockWeight, read_block_weights
from mars_export.side_path import Part, add_side_path

QUANT_OP = "MatMulNBits"


@dataclass
class GgufImport:
    """The weights an int4 export takes from a GGUF file, and the float32 additions on top of them.

    Attributes:
        weights: linear module name -> its float32 weight [N, K] in the graph's source model.
        blocks: linear module name -> the GGUF blocks of that weight (bit-exact ones only).
        low_rank: linear module name -> [(L [K, r], Rm [r, N])] float32 terms added to its output
            (the minima of Q4_1 blocks are added too, where the blocks are imported).
        embedding_rows: (row ids int64 [T], rows float32 [T, K]) to write into the input
            embedding table (an adapter's trainable tokens), or None.
        requantized: linear module name -> ggml type of weights that have no usable blocks.
    """

    weights: dict[str, np.ndarray]
    blocks: dict[str, BlockWeight]
    low_rank: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    embedding_rows: tuple[np.ndarray, np.ndarray] | None = None
    requantized: dict[str, str] = field(default_factory=dict)


def prepare_gguf_import(gguf_file: Path, base: PreTrainedModel, merged: PreTrainedModel | None = None,
                        adapter_dir: Path | None = None) -> GgufImport:
    """Read ``gguf_file``'s blocks for the linear layers of ``base`` (the model loaded from it).

    Args:
        base: the model as transformers loaded it from ``gguf_file`` (its graph is the one
            :func:`import_gguf_matmuls` rewrites). With an adapter it is wrapped by peft here:
            export its graph first.
        merged: ``base`` with ``adapter_dir`` merged in (its embedding rows are the adapter's
            trainable tokens); None when there is no adapter.
        adapter_dir: a peft LoRA adapter kept unmerged as side paths, or None.

    Raises:
        ValueError: the GGUF file cannot be read, or the adapter uses what a side path cannot
            express (DoRA, a LoRA bias, fan_in_fan_out).
    """
    linears = {name: module for name, module in base.named_modules() if isinstance(module, _linear_type())}
    weights = {name: module.weight.detach().numpy().copy() for name, module in linears.items()}
    stored, others = read_block_weights(gguf_file, base)
    blocks, requantized = {}, {}
    for name, module in linears.items():
        key = _parameter_name(base, module.weight)
        if key in stored and np.array_equal(stored[key].dequantize(), weights[name]):
            blocks[name] = stored[key]
        else:
            requantized[name] = others.get(key, stored[key].ggml_type + " (not bit-exact)" if key in stored else "float")
    result = GgufImport(weights, blocks, requantized=requantized)
    if adapter_dir is not None:
        _add_token_rows(result, base, merged)
        for name, term in _lora_terms(base, adapter_dir).items():
            result.low_rank.setdefault(name, []).append(term)
    return result


def import_gguf_matmuls(graph: onnx.GraphProto, source: GgufImport, accuracy_level: int | None) -> dict:
    """Rewrite the constant-weight MatMuls of ``graph`` (float32, output head untied) in place.

    Each MatMul whose parts all have blocks of one bit width becomes MatMulNBits, plus a side
    path for its Q4_1 minima; low-rank terms go into the side path of every MatMul. Other
    MatMuls stay for the re-quantizer (their float32 weights include the minima).

    Returns:
        ``{"num_imported", "ggml_types"`` (type -> count of imported layers), ``"requantized"``
        (type -> count of the layers left to the re-quantizer), ``"side_path_nodes"`` (names of
        the float32 side-path MatMuls, which must not be quantized)}.
    """
    initializers = {t.name: t for t in graph.initializer}
    summary = {"num_imported": 0, "ggml_types": collections.Counter(), "requantized": collections.Counter(),
               "side_path_nodes": []}
    for node in [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in initializers]:
        weight = numpy_helper.to_array(initializers[node.input[1]])  # [K, N]
        parts = _match_columns(weight, source.weights) if weight.ndim == 2 else None
        if parts is None:
            continue
        x, output = node.input[0], node.output[0]
        is_imported = all(name in source.blocks for name in parts) \
            and len({source.blocks[n].bits for n in parts}) == 1 and weight.shape[0] % GGUF_BLOCK == 0
        sums = None
        if is_imported:
            sums = _replace_with_blocks(graph, node, [source.blocks[n] for n in parts], accuracy_level)
            summary["num_imported"] += 1
            summary["ggml_types"].update(source.blocks[name].ggml_type for name in parts)
        else:
            summary["requantized"].update(source.requantized.get(name) or source.blocks[name].ggml_type
                                          for name in parts)
        side = [Part(column, source.weights[name].shape[0], source.blocks[name].mins if is_imported else None,
                     source.low_rank.get(name, [])) for column, name in _offsets(parts, source.weights)]
        if not all(part.is_empty for part in side):
            summary["side_path_nodes"] += add_side_path(graph, x, output, side, sums)
    if source.embedding_rows is not None:
        _write_embedding_rows(graph, *source.embedding_rows)
    return {**summary, "ggml_types": dict(summary["ggml_types"]), "requantized": dict(summary["requantized"])}


def _linear_type():
    import torch
    return torch.nn.Linear


def _parameter_name(model: PreTrainedModel, parameter) -> str:
    """The first state-dict name of ``parameter`` (a tied output head answers with the embedding's name)."""
    return next(name for name, p in model.named_parameters(remove_duplicate=True) if p is parameter)


def _lora_terms(base: PreTrainedModel, adapter_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """linear module name -> (Aᵀ [K, r], (scale · B)ᵀ [r, N]) of the adapter's LoRA layers (wraps ``base``)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    terms = {}
    for name, module in peft_model.base_model.model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
            continue
        if module.use_dora.get("default") or module.fan_in_fan_out or module.lora_bias.get("default"):
            raise ValueError(f"{adapter_dir}: LoRA layer {name} uses DoRA, a bias or fan_in_fan_out, which an "
                             "unmerged int4 export cannot hold; export without --int4")
        a = module.lora_A["default"].weight.detach().numpy()  # [r, K]
        b = module.lora_B["default"].weight.detach().numpy()  # [N, r]
        terms[name] = (np.ascontiguousarray(a.T), np.ascontiguousarray((b * module.scaling["default"]).T))
    return terms


def _add_token_rows(result: GgufImport, base: PreTrainedModel, merged: PreTrainedModel) -> None:
    """The embedding rows an adapter's trainable tokens changed: into the table, and (tied head) a side path."""
    old = base.get_input_embeddings().weight.detach().numpy()  # [V, K]
    new = merged.get_input_embeddings().weight.detach().numpy()
    rows = np.flatnonzero((old != new).any(axis=1))
    if rows.size:
        result.embedding_rows = (rows, new[rows].copy())
    head_name = next(n for n, m in base.named_modules() if m is base.get_output_embeddings())
    head_old = result.weights[head_name]  # [V, K]
    head_new = merged.get_output_embeddings().weight.detach().numpy()
    rows = np.flatnonzero((head_old != head_new).any(axis=1))
    if rows.size:
        one_hot = np.zeros((rows.size, head_old.shape[0]), np.float32)  # [T, V]
        one_hot[np.arange(rows.size), rows] = 1
        result.low_rank.setdefault(head_name, []).append((np.ascontiguousarray((head_new[rows] - head_old[rows]).T),
                                                            one_hot))


def _match_columns(weight: np.ndarray, linears: dict[str, np.ndarray]) -> list[str] | None:
    """The linear modules whose weights, transposed and side by side, are ``weight`` [K, N] bit for bit."""
    parts, column = [], 0
    while column < weight.shape[1]:
        first = weight[:, column]
        name = next((n for n, w in linears.items() if w.shape[1] == weight.shape[0]
                     and column + w.shape[0] <= weight.shape[1] and np.array_equal(w[0], first)
                     and np.array_equal(w.T, weight[:, column:column + w.shape[0]])), None)
        if name is None:
            return None
        parts.append(name)
        column += linears[name].shape[0]
    return parts


def _offsets(parts: list[str] | None, linears: dict[str, np.ndarray]):
    """(first output column, name) of each part."""
    column = 0
    for name in parts or []:
        yield column, name
        column += linears[name].shape[0]


def _replace_with_blocks(graph: onnx.GraphProto, node: onnx.NodeProto, blocks: list[BlockWeight],
                         accuracy_level: int | None) -> str | None:
    """Turn ``node`` into MatMulNBits over ``blocks`` (rows concatenated: the fused parts in order).

    With Q4_1 blocks among them the MatMulNBits gets NB rows more, the 0/1 block indicator (codes
    0 / 1, scale 1, zero point 0, exact at any accuracy level): their outputs, split off, are the
    block sums of x, at accuracy level 4 of the same int8 input the weights meet, as llama.cpp's
    Q8_1 sums are for Q4_1. Returns the name of the block sums [..., NB], or None.
    """
    bits = blocks[0].bits
    codes = np.concatenate([b.codes for b in blocks])  # [N, NB, 32]
    scales = np.concatenate([b.scales for b in blocks])  # [N, NB]
    zero_points = np.concatenate([np.full(b.scales.shape, b.zero_point, np.uint8) for b in blocks])  # [N, NB]
    num_rows, num_blocks = scales.shape
    has_sums = any(b.mins is not None for b in blocks)
    if has_sums:  # [N + NB, ...]
        codes = np.concatenate([codes, np.repeat(np.eye(num_blocks, dtype=np.uint8)[..., None], GGUF_BLOCK, axis=2)])
        scales = np.concatenate([scales, np.ones((num_blocks, num_blocks), np.float32)])
        zero_points = np.concatenate([zero_points, np.zeros((num_blocks, num_blocks), np.uint8)])
    if bits == 4:  # two codes per byte, the even one in the low nibble; zero points likewise along NB
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [N, NB, 16]
        if zero_points.shape[1] % 2:
            zero_points = np.pad(zero_points, ((0, 0), (0, 1)))
        zero_points = zero_points[:, 0::2] | (zero_points[:, 1::2] << 4)  # [N, ceil(NB / 2)]
    prefix = f"{node.input[1]}.gguf"
    graph.initializer.extend([numpy_helper.from_array(codes, f"{prefix}.codes"),
                              numpy_helper.from_array(scales, f"{prefix}.scales"),
                              numpy_helper.from_array(zero_points, f"{prefix}.zero_points")])
    attributes = {"K": num_blocks * GGUF_BLOCK, "N": scales.shape[0], "bits": bits, "block_size": GGUF_BLOCK}
    if accuracy_level is not None:
        attributes["accuracy_level"] = accuracy_level
    output, sums = node.output[0], f"{node.output[0]}.block_sums"
    new = [helper.make_node(QUANT_OP, [node.input[0], f"{prefix}.codes", f"{prefix}.scales", f"{prefix}.zero_points"],
                            [f"{output}.with_sums" if has_sums else output], name=f"{node.name}.gguf",
                            domain="com.microsoft", **attributes)]
    if has_sums:
        graph.initializer.append(numpy_helper.from_array(np.array([num_rows, num_blocks], np.int64), f"{prefix}.rows"))
        new.append(helper.make_node("Split", [f"{output}.with_sums", f"{prefix}.rows"], [output, sums], axis=-1,
                                    name=f"{node.name}.gguf.sums"))  # [..., N], [..., NB]
    _drop_unused_initializer(graph, node.input[1], node)
    position = list(graph.node).index(node)
    graph.node.remove(node)
    for offset, added in enumerate(new):
        graph.node.insert(position + offset, added)
    return sums if has_sums else None


def _write_embedding_rows(graph: onnx.GraphProto, rows: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` into rows ``rows`` of the table every Gather of token ids reads."""
    initializers = {t.name: t for t in graph.initializer}
    tables = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in initializers
              and len(initializers[n.input[0]].dims) == 2 and initializers[n.input[0]].dims[1] == values.shape[1]}
    assert len(tables) == 1, f"expected one embedding table, found {sorted(tables)}"
    table = numpy_helper.to_array(initializers[next(iter(tables))]).copy()  # [V, K]
    table[rows] = values
    initializers[next(iter(tables))].CopyFrom(numpy_helper.from_array(table, next(iter(tables))))


def _drop_unused_initializer(graph: onnx.GraphProto, name: str, reader: onnx.NodeProto) -> None:
    if not any(name in n.input for n in graph.node if n is not reader):
        graph.initializer.remove(next(t for t in graph.initializer if t.name == name))

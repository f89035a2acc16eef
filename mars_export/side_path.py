"""The float32 side path of a MatMul holding GGUF blocks: Q4_1 block minima and unmerged low-rank terms.

Dimension letters: K input features and N output features of the MatMul, NB = K / 32 blocks,
n the output features of one part (a fused Q/K/V or gate/up MatMul has several, in column
order), r the rank of one low-rank term.

A part's output gets ``Σ_b m[:, b] · s_b + Σ_terms (x @ L) @ Rm``, where ``s_b`` is the sum of x
over block b and m the part's Q4_1 block minima (:mod:`mars_export.gguf_import`). The graph
computes, with s = ReduceSum of x reshaped to [..., NB, 32] and one MatMul for every term's
``x @ L`` together,

    out_p = [s | x @ L_p] @ [mᵀ ; Rm_p]     per piece p (one part, or neighbouring parts alike)
    y     = MatMulNBits(x) + Concat_p(out_p)

Why this form (GitHub issue 11): at one thread a side path costs the bytes of its float32
weights plus about a microsecond per node. The first form, ``(x @ [S | L]) @ R`` with S the
0/1 block indicator [K, NB] and one R for all parts, was two MatMuls but read S (12.6 MB per
default-mars step), the padding of ``[S | L]`` to 16 columns in onnxruntime's packed layout,
and zero rows where one part's rank-r rows met another part's columns (9.6 MB). This form
reads only mᵀ and the terms (22 MB less per step) at the price of Reshape, ReduceSum, Split
and Concat nodes; default-mars' step took 0.92x (W = 1) / 0.96x (W = 4) of the first form's
CPU time. Measured and not kept (whole step, W = 1, against the first form): the block sums
as NB extra rows of the MatMulNBits itself (codes 0/1, scale 1) with one R, 0.98x, or per
part, 0.97x; the minima as their own MatMul (s @ mᵀ) beside one R for the terms, 1.0x, or
beside per-part terms, 0.97-1.0x.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mars_export.gguf_blocks import GGUF_BLOCK

SIDE_PATH_SUFFIX = ".side"  # prefix of the side path's node and initializer names, after the MatMul's name


@dataclass
class Part:
    """What the side path adds to the output columns [column, column + width) of one linear layer.

    Attributes:
        column: first output column of the part in the MatMul.
        width: n, the part's output features.
        mins: float32 [n, NB], Q4_1 block minima, or None.
        terms: [(L [K, r], Rm [r, n])] float32 low-rank terms.
    """

    column: int
    width: int
    mins: np.ndarray | None = None
    terms: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.mins is None and not self.terms


def add_side_path(graph: onnx.GraphProto, output: str, parts: list[Part], rank: int) -> list[str]:
    """Add the side path of ``parts`` to ``output``, written by a MatMul or its MatMulNBits replacement.

    Args:
        parts: every part of the MatMul in column order, at least one not empty.
        rank: rank of the MatMul's input x [..., K] (the block sums reshape it to [..., NB, 32]).

    Returns:
        The names of the new float32 MatMuls (which the re-quantizer must leave alone).
    """
    node = next(n for n in graph.node if output in n.output)
    name = f"{node.name}{SIDE_PATH_SUFFIX}"
    new, initializers = [], []
    sources = {}  # an input of the pieces' MatMuls: "sums" or id(L) -> tensor name
    if any(p.mins is not None for p in parts):
        num_blocks = next(p.mins for p in parts if p.mins is not None).shape[1]
        initializers += [numpy_helper.from_array(np.array([0] * (rank - 1) + [num_blocks, GGUF_BLOCK], np.int64),
                                                 f"{name}.block_shape"),
                         numpy_helper.from_array(np.array([-1], np.int64), f"{name}.last_axis")]
        new += [helper.make_node("Reshape", [node.input[0], f"{name}.block_shape"], [f"{name}.blocks"],
                                 name=f"{name}.blocks"),  # [..., NB, 32]
                helper.make_node("ReduceSum", [f"{name}.blocks", f"{name}.last_axis"], [f"{name}.sums"],
                                 keepdims=0, name=f"{name}.sums")]  # [..., NB]
        sources["sums"] = f"{name}.sums"
    terms = [term for p in parts for term in p.terms]
    if terms:
        initializers.append(numpy_helper.from_array(np.concatenate([left for left, _ in terms], axis=1), f"{name}.left"))
        new.append(helper.make_node("MatMul", [node.input[0], f"{name}.left"], [f"{name}.low"], name=f"{name}.down"))
        outputs = [f"{name}.low.{i}" for i in range(len(terms))] if len(terms) > 1 else [f"{name}.low"]
        if len(terms) > 1:
            initializers.append(numpy_helper.from_array(np.array([left.shape[1] for left, _ in terms], np.int64),
                                                        f"{name}.ranks"))
            new.append(helper.make_node("Split", [f"{name}.low", f"{name}.ranks"], outputs, axis=-1,
                                        name=f"{name}.split"))
        sources.update({id(left): out for (left, _), out in zip(terms, outputs)})
    piece_outputs = []
    for i, (keys, piece) in enumerate(_pieces(parts)):
        inputs = [sources[key] for key in keys]
        low = inputs[0]
        if len(inputs) > 1:
            low = f"{name}.low_{i}"
            new.append(helper.make_node("Concat", inputs, [low], axis=-1, name=low))
        initializers.append(numpy_helper.from_array(_right(keys, piece), f"{name}.right_{i}"))
        new.append(helper.make_node("MatMul", [low, f"{name}.right_{i}"], [f"{name}.out_{i}"], name=f"{name}.up_{i}"))
        piece_outputs.append(f"{name}.out_{i}")
    if len(piece_outputs) > 1:
        new.append(helper.make_node("Concat", piece_outputs, [f"{name}.out"], axis=-1, name=f"{name}.out"))
    node.output[0] = f"{output}.main"
    new.append(helper.make_node("Add", [f"{output}.main", new[-1].output[0]], [output], name=f"{name}.add"))
    graph.initializer.extend(initializers)
    position = list(graph.node).index(node) + 1
    for offset, added in enumerate(new):
        graph.node.insert(position + offset, added)
    return [n.name for n in new if n.op_type == "MatMul"]


def _keys(part: Part) -> tuple:
    """The inputs a part's rows read: ("sums",) for minima, then id(L) of each term."""
    return (("sums",) if part.mins is not None else ()) + tuple(id(left) for left, _ in part.terms)


def _pieces(parts: list[Part]) -> list[tuple[tuple, list[Part]]]:
    """Neighbouring parts that read the same inputs, as one MatMul each: [(keys, parts)].

    An empty part joins the piece before it (the first piece's parts if it leads), with zero columns."""
    pieces: list[tuple[tuple, list[Part]]] = []
    leading = []
    for part in parts:
        if part.is_empty and not pieces:
            leading.append(part)
        elif part.is_empty or (pieces and pieces[-1][0] == _keys(part)):
            pieces[-1][1].append(part)
        else:
            pieces.append((_keys(part), leading + [part]))
            leading = []
    assert pieces, "a side path needs at least one part with minima or terms"
    return pieces


def _right(keys: tuple, piece: list[Part]) -> np.ndarray:
    """float32 [rows, Σ n]: per key its rows (mᵀ [NB, n] for "sums", Rm [r, n] for a term), part by part;
    zeros where a part lacks the key."""
    rows = {key: value.shape[0] for part in piece for key, value in _rows(part).items()}
    blocks = [np.concatenate([_rows(part).get(key, np.zeros((rows[key], part.width), np.float32)) for key in keys])
              for part in piece]  # [rows, n] each
    return np.ascontiguousarray(np.concatenate(blocks, axis=1), dtype=np.float32)


def _rows(part: Part) -> dict:
    """key -> the part's rows of the right-hand matrix: mᵀ [NB, n] under "sums", Rm [r, n] under id(L)."""
    rows = {"sums": part.mins.T} if part.mins is not None else {}
    rows.update({id(left): rm for left, rm in part.terms})
    return rows

"""The float32 side path of a MatMul holding GGUF blocks: Q4_1 block minima and unmerged low-rank terms.

Dimension letters: K input features and N output features of the MatMul, NB = K / 32 blocks,
n the output features of one part (a fused Q/K/V or gate/up MatMul has several, in column
order), r the rank of one low-rank term.

A part's output gets ``Σ_b m[:, b] · s_b + Σ_terms (x @ L) @ Rm``, where ``s_b`` is the sum of x
over block b and m the part's Q4_1 block minima (:mod:`mars_export.gguf_import`). The block
sums s come from NB more output rows of the MatMulNBits itself (0/1 codes, scale 1), split
off its output; one MatMul computes every term's ``x @ L`` together; then

    out_p = [s | x @ L_p] @ [mᵀ ; Rm_p]     per piece p (one part, or neighbouring parts alike)
    y     = MatMulNBits(x)[:N] + Concat_p(out_p)

Why this form (GitHub issue 11): at one thread a side path costs the bytes of its float32
weights plus about a microsecond per node. The first form, ``(x @ [S | L]) @ R`` with S the
0/1 block indicator [K, NB] in float32 and one R for all parts, was two MatMuls but read S
(12.6 MB per default-mars step), the padding of ``[S | L]`` to 16 columns in onnxruntime's
packed layout, and zero rows where one part's rank-r rows met another part's columns (9.6 MB).
This form reads mᵀ, the terms and NB 4-bit rows per MatMul, at the price of Split and Concat
nodes. At accuracy level 4 the sums are of the int8 input that the weights' codes meet, so
``codes · d + m`` is applied to one input, as llama.cpp does with Q8_1 sums; float sums of x
beside the int8 product (the first form, and ReduceSum) left top-1 agreement with the float32
graph at 0.906 / 0.920, these sums give 0.946 (default-mars, 872 positions). Step CPU time,
interleaved against the first form (W = 1, busy machine): this form 0.97x, ReduceSum sums
per part 0.96x; not kept: MatMulNBits sums with one R 0.98x, the minima as their own MatMul
beside one R / beside per-part terms 1.0x / 0.97-1.0x. On a quiet machine at 2 threads, wall
time, this form was 1.06x the first form's step (17.4 against 16.4 ms, W = 1, P = 128): its
540 more nodes cost more there than its 20 MB saved (BENCHMARKS.md "Against the field,
fourth run"); one R per fused MatMul with these sums is the next form to measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

SIDE_PATH_SUFFIX = ".side"  # after the MatMul output's name: the prefix of its side path's nodes and initializers


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


def add_side_path(graph: onnx.GraphProto, x: str, output: str, parts: list[Part], sums: str | None) -> list[str]:
    """Add the side path of ``parts`` to ``output``, the result of a MatMul of ``x`` [..., K] or of its replacement.

    Args:
        parts: every part of the MatMul in column order, at least one not empty.
        sums: the block sums s [..., NB] of the MatMul's input x (a tensor of the graph), or None
            when no part has minima.

    Returns:
        The names of the new float32 MatMuls (which the re-quantizer must leave alone).
    """
    node = next(n for n in graph.node if output in n.output)  # the MatMul(Nbits), or the Split of its block sums
    name = f"{output}{SIDE_PATH_SUFFIX}"
    new, initializers = [], []
    assert (sums is not None) == any(p.mins is not None for p in parts), "block sums are for minima"
    sources = {"sums": sums}  # an input of the pieces' MatMuls: "sums" or id(L) -> tensor name
    terms = [term for p in parts for term in p.terms]
    if terms:
        initializers.append(numpy_helper.from_array(np.concatenate([left for left, _ in terms], axis=1), f"{name}.left"))
        new.append(helper.make_node("MatMul", [x, f"{name}.left"], [f"{name}.low"], name=f"{name}.down"))
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
    by_part = [_rows(part) for part in piece]
    rows = {key: value.shape[0] for part_rows in by_part for key, value in part_rows.items()}
    blocks = [np.concatenate([part_rows.get(key, np.zeros((rows[key], part.width), np.float32)) for key in keys])
              for part, part_rows in zip(piece, by_part)]  # [rows, n] each
    return np.ascontiguousarray(np.concatenate(blocks, axis=1), dtype=np.float32)


def _rows(part: Part) -> dict:
    """key -> the part's rows of the right-hand matrix: mᵀ [NB, n] under "sums", Rm [r, n] under id(L)."""
    rows = {"sums": part.mins.T} if part.mins is not None else {}
    rows.update({id(left): rm for left, rm in part.terms})
    return rows

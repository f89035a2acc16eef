"""The greedy head: the float32 argmax token of the last ``num_greedy`` rows without reading the float32 output head (GitHub issue 11, item 1).

At batch 1 a decode step reads every weight once; the output head (hidden K x vocabulary V, 28M of
SmolLM2-135M's 134M weights) is a fifth of those bytes. A step whose rows are decoded greedily and
whose confidences are not tested (tau >= 1: AR, and verify with any draft source) only needs each
row's argmax. The greedy head finds it in two passes:

1. **Screening.** An int8 copy of the head (``MatMulNBits``, symmetric blocks of :data:`BLOCK` weights
   along K, ``accuracy_level`` 4: onnxruntime also quantizes the activation to int8 per block) gives
   approximate logits ``a_v``, and an upper bound ``e_v`` on ``|a_v - x·W_v|`` from the row ``x``:

       e_v = |x|_1 · R_v  +  (Σ_b max|x_b| / 254) · L_v  +  1e-3 · |x|_1 · M_v  +  1e-3

   R_v the largest quantization error of column v, L_v the largest L1 norm of one of its dequantized
   blocks, M_v its largest |weight|: the weight's rounding, the activation's rounding (half a step of
   ``max|x_b| / 127`` per element) and a float-rounding allowance 15x above the worst case of a
   576-term float32 dot product. Every token whose upper bound ``a_v + e_v`` reaches the best lower
   bound ``max_u (a_u - e_u)`` is a candidate: the true argmax always is (``tests/test_greedy_head.py``
   holds the kernel to the bound). The mask token never is.
2. **Rescoring.** The candidates' rows of the float32 head (the embedding matrix when the head is
   tied to it) give their logits, a float32 product summed over K per (row, candidate): each row's
   bits are independent of how many rows the window has. The argmax (the lowest id on a tie)
   is the output. The full head's MatMul sums in another order, so where two tokens' logits lie
   within a few float32 ulps (a review found flips only below a float64 gap of 5.7e-6; the
   smallest top-2 gap over 3585 real positions was 5.5e-4) the logits path may pick the other.
   A model that soft-caps its logits (Gemma2: ``cap · tanh(x / cap)`` after the head) has the same
   argmax, but the capping's rounding may tie two logits the head tells apart: there too the
   logits path may pick the other (the lower id).

On 948 positions of GSM8K, HumanEval and chat text run through the default model, a row had a median of
4 candidates (99th percentile 95, most 288).

Graph I/O added (:func:`add_greedy_head`; float32 fused graphs, and float32 step graphs exported for
onnxruntime, whose ``num_greedy`` defaults to 0)::

    num_greedy   int64 []     the greedy head runs on the window's last min(num_greedy, W) rows; 0: none
    greedy_ids   int64 [n, G] G = min(num_greedy, W): each row's argmax token id, the mask token excluded

At batch n > 1 the candidates are the union over the n·G rows, each rescored against every row.

The full ``logits`` output stays, on ``num_logits`` rows (:mod:`mars_export.logits_rows`): the runtime feeds
0 there in a step that reads ids only, and 0 to ``num_greedy`` in one that reads logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mars_export.graph_builder import NodeBuilder
from mars_export.logits_rows import output_head
from runtime.bundle import GREEDY_HEAD_PREFIX, GREEDY_IDS, NUM_GREEDY, NUM_LOGITS

BLOCK = 32  # weights per int8 block along K
RELATIVE_SLACK = 1e-3  # float rounding allowance, relative to |x|_1 · max|W_v|
ABSOLUTE_SLACK = 1e-3
EXCLUDED = -1e30  # added to the mask token's approximate logit


def quantize_columns(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric int8 blocks of :data:`BLOCK` along K for each column of ``weight`` float32 [K, V].

    Returns:
        packed uint8 [V, K / BLOCK, BLOCK] (q + 128, MatMulNBits' default zero point), scales float32
        [V * K / BLOCK] (max |w| / 127 per block; float32's smallest normal number where a block is all zeros:
        the kernel's float rounding scales with it, and a zero column's bound has no term to absorb more),
        and the dequantized weight float32 [K, V].
    """
    k, v = weight.shape
    blocks = weight.T.reshape(v, k // BLOCK, BLOCK).astype(np.float32)
    scales = np.abs(blocks).max(axis=-1) / np.float32(127)
    scales[scales == 0] = np.finfo(np.float32).tiny
    q = np.clip(np.rint(blocks / scales[..., None]), -127, 127)
    dequantized = (q * scales[..., None]).reshape(v, k).T
    return (q + 128).astype(np.uint8), scales.reshape(-1).astype(np.float32), np.ascontiguousarray(dequantized)


def bound_coefficients(weight: np.ndarray, dequantized: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column v of the head [K, V]: the coefficient of |x|_1 (R_v + slack · M_v) and of Σ_b max|x_b|
    (L_v / 254) in the screening error bound (module docstring), float32 [V] each, rounded up."""
    k, v = weight.shape
    error = np.abs(weight.astype(np.float64) - dequantized).max(axis=0)  # R_v
    largest = np.abs(weight.astype(np.float64)).max(axis=0)  # M_v
    block_l1 = np.abs(dequantized.astype(np.float64)).reshape(k // BLOCK, BLOCK, v).sum(axis=1).max(axis=0)  # L_v
    up = lambda a: np.nextafter(a.astype(np.float32), np.float32(np.inf))  # noqa: E731
    return up((error + RELATIVE_SLACK * largest) * 1.001), up(block_l1 / 254 * 1.001)


@dataclass(frozen=True)
class Screening:
    """The greedy head's values a later addition reads (:mod:`mars_export.confidence_gate`); nG rows, C candidates.

    Attributes:
        head: the float32 output head (MatMul) writing ``logits``; weight: its [K, V] float32 array.
        rows: float32 [n, G, K], the window's last G = min(num_greedy, W) rows x.
        l1: float32 [nG, 1], |x|_1. screened_lower: float32 [nG, V], ``a_v - e_v``: the screening logits (the mask
            token's lowered by 1e30) less their error bounds. best_lower: float32 [nG, 1], its row maximum, which
            every non-candidate's ``a_v + e_v`` lies below.
        candidates: int64 [C], ascending; rescored: float32 [nG, C], their float32 logits; best: int64 [nG],
            each row's argmax among them.
    """

    head: ir.Node
    weight: np.ndarray
    rows: ir.Value
    l1: ir.Value
    screened_lower: ir.Value
    best_lower: ir.Value
    candidates: ir.Value
    rescored: ir.Value
    best: ir.Value


def add_greedy_head(graph: ir.Graph, mask_token_id: int, has_default: bool = False) -> Screening | None:
    """Give ``graph`` the ``num_greedy`` input and the ``greedy_ids`` output (module docstring), in place.

    Args:
        graph: a graph whose ``logits`` output is written by a float32 MatMul over a constant [K, V]
            head (an initializer, or the ``Transpose`` of a [V, K] one: our step graph's), after the
            ``num_logits`` slice (:func:`mars_export.logits_rows.compute_logits_of_last_rows` ran); between
            the head and ``logits`` only element-wise ops that keep each logit's order (Gemma2's soft-capping,
            :func:`mars_export.logits_rows.output_head`), so the head's argmax is the logits'.
        mask_token_id: the token the head never returns.
        has_default: ``num_greedy`` defaults to 0 (an overridable initializer: the step graph, which
            the C sample and TensorRT run without feeding it); False makes it a required input (the
            fused graph).

    Returns:
        the head's :class:`Screening` values; None, changing nothing, where the head's K is not a multiple of
        :data:`BLOCK` (the runtime then reads the logits).

    The candidates' rows are read from the head's transpose [V, K]: the [V, K] initializer the step graph's
    tied head transposes, or the graph's own ``Transpose`` of the head weight (the model builder's tied
    embedding); an untied head (a [K, V] initializer read by the head alone) is stored as [V, K] and read by
    the head through a ``Transpose``, the form of a tied one (:func:`_store_transposed`): one copy in the
    file, and a row gather (onnxruntime gathers the columns of a [K, V] weight element by element, 7-65x
    slower at K 4096).

    Raises:
        ValueError: no such head (float32 MatMul over a constant), a head not after the ``num_logits``
            slice, a ``num_greedy`` input already, or ``mask_token_id`` outside the vocabulary.
    """
    head = output_head(graph)
    head_weight = _constant_head(head)
    if head_weight is None:
        raise ValueError("the greedy head needs a float32 MatMul over a constant head writing 'logits'")
    rows_slice = head.inputs[0].producer()
    if rows_slice is None or rows_slice.op_type != "Slice" or NUM_LOGITS not in {v.name for v in graph.inputs}:
        raise ValueError("the greedy head goes after the num_logits slice (mars_export.logits_rows)")
    if NUM_GREEDY in {value.name for value in graph.inputs}:
        raise ValueError(f"the graph already has a {NUM_GREEDY!r} input")
    weight, table = head_weight  # [K, V]; a value holding its transpose [V, K], or None
    k, v = weight.shape
    if weight.dtype != np.float32:
        raise ValueError(f"the greedy head needs a float32 output head, got {weight.dtype}")
    if not 0 <= mask_token_id < v:
        raise ValueError(f"mask token id {mask_token_id} is outside the head's vocabulary of {v}")
    if k % BLOCK:
        return None
    packed, scales, dequantized = quantize_columns(weight)
    per_l1, per_block_max = bound_coefficients(weight, dequantized)
    penalty = np.zeros(v, np.float32)
    penalty[mask_token_id] = EXCLUDED

    builder = NodeBuilder(graph, GREEDY_HEAD_PREFIX)
    const, op = builder.const, builder.op

    count = ir.Value(name=NUM_GREEDY, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    graph.inputs.append(count)
    if has_default:
        count.const_value = ir.tensor(np.array(0, np.int64), name=NUM_GREEDY)
        graph.register_initializer(count)
    graph.opset_imports.setdefault("com.microsoft", 1)  # MatMulNBits
    hidden = rows_slice.inputs[0]  # [n, W, K]
    window = op("Shape", [hidden], start=1, end=2)
    start = op("Max", [op("Sub", [window, op("Reshape", [count, const("one", np.array([1], np.int64))])]),
                       const("zero", np.array([0], np.int64))])
    rows = op("Slice", [hidden, start, const("end", np.array([np.iinfo(np.int64).max], np.int64)),
                        const("axis", np.array([1], np.int64))])  # [n, G, K]
    x = op("Reshape", [rows, const("flat", np.array([-1, k], np.int64))])  # [nG, K]
    approx = op("MatMulNBits", [x, const("weight_q", packed), const("scales", scales)], domain="com.microsoft",
                K=k, N=v, bits=8, block_size=BLOCK, accuracy_level=4)  # [nG, V]
    approx = op("Add", [approx, const("penalty", penalty)])
    magnitude = op("Abs", [x])
    l1 = op("ReduceSum", [magnitude, const("axis_last", np.array([1], np.int64))], keepdims=1)  # [nG, 1]
    block_max = op("ReduceMax", [op("Reshape", [magnitude, const("blocks", np.array([0, k // BLOCK, BLOCK], np.int64))]),
                                 const("axis_block", np.array([2], np.int64))], keepdims=0)  # [nG, K / BLOCK]
    block_max_sum = op("ReduceSum", [block_max, const("axis_sum", np.array([1], np.int64))], keepdims=1)  # [nG, 1]
    bound = op("Add", [op("Add", [op("Mul", [l1, const("per_l1", per_l1)]),
                                  op("Mul", [block_max_sum, const("per_block_max", per_block_max)])]),
                       const("absolute", np.array(ABSOLUTE_SLACK, np.float32))])  # [nG, V]
    screened_lower = op("Sub", [approx, bound])
    best_lower = op("ReduceMax", [screened_lower, const("axis_v", np.array([1], np.int64))], keepdims=1)
    is_candidate = op("GreaterOrEqual", [op("Add", [approx, bound]), best_lower])  # [nG, V]
    any_row = op("ReduceMax", [op("Cast", [is_candidate], to=ir.DataType.UINT8), const("axis_rows", np.array([0], np.int64))],
                 keepdims=0)  # [V]
    candidates = op("Reshape", [op("NonZero", [any_row]), const("flat_ids", np.array([-1], np.int64))])  # [C] ascending
    table = table or _transpose_of(head.inputs[1]) or _store_transposed(graph, head, weight)
    candidate_rows = op("Gather", [table, candidates], axis=0)  # [C, K]
    logits = op("ReduceSum", [op("Mul", [op("Unsqueeze", [x, const("axis_mid", np.array([1], np.int64))]), candidate_rows]),
                              const("axis_k", np.array([2], np.int64))], keepdims=0)  # [nG, C]
    best = op("ArgMax", [logits], axis=1, keepdims=0)  # [nG]: the first maximum, the lowest id
    ids = op("Gather", [candidates, best], axis=0)
    out = op("Reshape", [ids, op("Shape", [rows], start=0, end=2)], allowzero=1)  # [n, G]; G may be 0
    out.name = GREEDY_IDS
    out.shape, out.type = ir.Shape(["batch", "greedy_rows"]), ir.TensorType(ir.DataType.INT64)
    graph.extend(builder.nodes)
    graph.outputs.append(out)
    return Screening(head, weight, rows, l1, screened_lower, best_lower, candidates, logits, best)


def _constant_head(head: ir.Node | None) -> tuple[np.ndarray, ir.Value | None] | None:
    """The weight [K, V] of ``head`` when it is a MatMul over a constant, with the value of its transpose
    [V, K] where the graph has one (``MatMul(h, Transpose(W))``: the [V, K] initializer W); else None."""
    if head is None or head.op_type != "MatMul":
        return None
    weight = head.inputs[1]
    if weight.is_initializer():
        return weight.const_value.numpy(), None
    transpose = weight.producer()
    if (transpose is not None and transpose.op_type == "Transpose" and transpose.inputs[0].is_initializer()
            and list(transpose.attributes.get_ints("perm", [1, 0])) == [1, 0]):
        table = transpose.inputs[0]
        return table.const_value.numpy().T, table
    return None


def _store_transposed(graph: ir.Graph, head: ir.Node, weight: np.ndarray) -> ir.Value:
    """Store the head's [K, V] initializer as its transpose [V, K], the head reading it through a ``Transpose``
    (onnxruntime folds it into the MatMul at load, as for a tied head); returns the [V, K] value. Where another
    node also reads the [K, V] weight, it stays and the [V, K] copy is added beside it."""
    original = head.inputs[1]
    table = ir.Value(name=f"{original.name}.rows", const_value=ir.tensor(np.ascontiguousarray(weight.T)))
    graph.register_initializer(table)
    transpose = ir.node("Transpose", [table], attributes={"perm": [1, 0]})
    transpose.name = "/mars_edge/head_transpose"  # outside GREEDY_HEAD_PREFIX: the head's, kept when the greedy head is stripped
    graph.insert_before(head, transpose)
    head.replace_input_with(1, transpose.outputs[0])
    if not original.uses():
        graph.initializers.pop(original.name)
    return table


def _transpose_of(weight: ir.Value) -> ir.Value | None:
    """The output of a ``Transpose(weight)`` node of the graph ([V, K] of a [K, V] weight), if there is one."""
    for use, _ in weight.uses():
        if use.op_type == "Transpose" and list(use.attributes.get_ints("perm", [1, 0])) == [1, 0]:
            return use.outputs[0]
    return None

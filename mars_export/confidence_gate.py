"""The confidence gate: a threshold step skips the float32 output head when its screening proves every tau test fails (GitHub issue 11).

A threshold step (tau < 1, the probability metric, greedy decoding) reads each prediction row's
top-1 probability ``p`` from the float32 logits, left to right, from the output at the window's
first mask token on (:func:`runtime.decode.acceptance.accept`: the outputs before it are the exact
next token and the drafts' checks, read as argmaxes). Most such tests fail (91% of tau 0.9 steps of
the default MARS model, ``bench/confidence_bounds.py``), and a failure can be proven from what the
greedy head (:mod:`mars_export.greedy_head`) already computes. Per greedy row x, with ``f_v`` the full
head's float32 logits, ``a_v`` the screening logits and ``e_v`` their error bounds, ``r_c`` the
candidates' rescored logits and ``s_v = 2 gamma_K |x|_1 max|W_v|`` the float32 dot product's error bound
(``gamma_K = K u / (1 - K u)``, u = 2^-24; ``|r_c - f_c| <= s_c``, ``|f_v - x·W_v| <= s_v / 2``):

    lower_v = r_v - s_v                    for the candidates v: f_v >= lower_v
    lower_v = a_v - e_v - s_v / 2          for the others
    U       = max(max_c (r_c + s_c), max_u (a_u - e_u) + max_v s_v / 2) + margin(U)
    Z_lb    = sum_v exp(lower_v - U)
    p_ub    = min(1, (1 + SLACK) / Z_lb)

U bounds the largest ``f_v`` from above (a candidate's by ``r_c + s_c``; a non-candidate's ``a_v + e_v`` lies
below the best lower bound ``max_u (a_u - e_u)``); ``margin(U) = 1e-6 |U| + 1e-4`` covers the float32 rounding
of the exponents (a few ulps of logits up to ~1e4). ``p`` as the runtime computes it (float32 softmax of
the full head's logits, mask token excluded: ``1 / sum_v exp(f_v - max f)``) is then at most ``p_ub``; SLACK
covers the float32 rounding of both sums over V and of the exponentials (:func:`slack`). The gate skips the
head when, for every row b of the batch, ``p_ub`` at its first mask is at most ``min(confidence_tau[b], 1)``:
the runtime then knows that test fails without the logits (:func:`runtime.decode.reads.gate_tau` sets each row's
``confidence_tau``).

What a skipped step does not prove: that its tokens are the logits' argmaxes. They are the greedy head's
ids, exactly the float32 argmax but for near-ties, where the logits path may pick the other token
(:mod:`mars_export.greedy_head`; measured per export as ``parity.greedy_head_agreement``): a threshold
step's tokens then come from the same ids path as an AR step's.

Graph I/O added (:func:`add_confidence_gate`; float32 step and fused graphs with the greedy head)::

    confidence_tau  float32 [n]  per row, tau of a probability test that may skip the head; -1 (the step
                                 graph's default; the fused graph's is a required input): never skips
                                 (every ``p_ub`` passes it); >= 1: the row reads no
                                 confidence. The runtime sends rows that read their logits anyway
                                 (sampling, another metric) without the gate.
    head_skipped    bool []      True: the head did not run and ``logits`` holds zeros; the greedy
                                 head's ids are the argmaxes and every row's first mask has p <= its tau.

The ``logits`` output keeps its shape [n, min(num_logits, W), V] either way (zeros padded in front of
the head's 0 rows), so the runtime's preallocated outputs fit every step. The rows the gate tests
are the greedy rows' (``num_greedy``); a first mask outside them (or no greedy rows) never skips.
:func:`runtime.bundle.strip_greedy_head` removes the gate with the greedy head, leaving the step graph
as before.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mars_export.graph_builder import NodeBuilder
from mars_export.greedy_head import Screening
from runtime.bundle import CONFIDENCE_TAU, GREEDY_HEAD_PREFIX, HEAD_SKIPPED, INPUT_IDS, LOGITS, NUM_LOGITS

UNIT = 2.0 ** -24  # float32 unit roundoff
MARGIN_RELATIVE, MARGIN_ABSOLUTE = 1e-6, 1e-4  # margin(U) of the module docstring
NEVER = np.float32(np.inf)  # p_ub of a window position the gate does not test: above every tau
PREFIX = f"{GREEDY_HEAD_PREFIX}/gate"  # under the greedy head's prefix: stripped with it
BYPASS = "/bypass"  # a gate node on the model's own path: stripping it joins its first input to its consumers


def slack(vocab_size: int) -> float:
    """Relative widening of ``p_ub`` for float32 rounding: two sums of V positive terms in any order (each
    within (V - 1) u, relative) and the exponentials (1e-5)."""
    return 2 * vocab_size * UNIT + 1e-5


def add_confidence_gate(graph: ir.Graph, screening: Screening, mask_token_id: int, has_default: bool = True) -> bool:
    """Give ``graph`` the ``confidence_tau`` input and the ``head_skipped`` output (module docstring), in place.

    Args:
        graph: a step or fused graph after :func:`mars_export.greedy_head.add_greedy_head`, with an ``input_ids``
            input int64 [n, W].
        screening: what ``add_greedy_head`` returned.
        mask_token_id: the mask token, as given to ``add_greedy_head``.
        has_default: ``confidence_tau`` defaults to [-1] (the step graph, whose ``num_logits`` has a default too);
            False: a required input (the fused graph, which the runtime feeds through an I/O binding, where an
            input with a default cannot be bound).

    Returns:
        True; False, changing nothing, where the head does not write ``logits`` directly (an element-wise
        op between them, e.g. Gemma2's soft-capping: the bound is on the head's logits).

    Raises:
        ValueError: no ``input_ids`` or ``num_logits`` input, or a ``confidence_tau`` input already.
    """
    names = {value.name: value for value in graph.inputs}
    if INPUT_IDS not in names or NUM_LOGITS not in names:
        raise ValueError(f"the confidence gate needs the {INPUT_IDS!r} and {NUM_LOGITS!r} inputs")
    if CONFIDENCE_TAU in names:
        raise ValueError(f"the graph already has a {CONFIDENCE_TAU!r} input")
    head = screening.head
    outputs = [value.name for value in graph.outputs]
    if head.outputs[0].name != LOGITS:
        return False
    k, v = screening.weight.shape
    gamma = k * UNIT / (1 - k * UNIT)
    # s_v / 2 per unit of the graph's |x|_1, which float32 summation may leave up to K u below the true one
    largest = np.abs(screening.weight.astype(np.float64)).max(axis=0)
    half_rounding = np.nextafter((gamma * (1 + 2 * k * UNIT) * largest).astype(np.float32), np.float32(np.inf))

    builder = NodeBuilder(graph, PREFIX)
    const, op = builder.const, builder.op

    tau = ir.Value(name=CONFIDENCE_TAU, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch"]))
    graph.inputs.append(tau)
    if has_default:
        tau.const_value = ir.tensor(np.array([-1], np.float32), name=CONFIDENCE_TAU)
        graph.register_initializer(tau)

    # p_ub of each greedy row [nG]
    axis_v = const("axis_v", np.array([1], np.int64))
    half_s = op("Mul", [screening.l1, const("half_rounding", half_rounding)])  # [nG, V]: s_v / 2
    lower = op("Sub", [screening.screened_lower, half_s])  # [nG, V]
    candidate_s = op("Mul", [op("Gather", [half_s, screening.candidates], axis=1), const("two", np.array(2, np.float32))])
    candidate_lower = op("Sub", [screening.rescored, candidate_s])  # [nG, C]
    where = op("Expand", [op("Unsqueeze", [screening.candidates, const("axis0", np.array([0], np.int64))]),
                          op("Shape", [candidate_lower])])  # [nG, C]
    lower = op("ScatterElements", [lower, where, candidate_lower], axis=1)
    candidate_upper = op("ReduceMax", [op("Add", [screening.rescored, candidate_s]), axis_v], keepdims=1)  # [nG, 1]
    other_upper = op("Add", [screening.best_lower,
                             op("Mul", [screening.l1, const("half_rounding_max", half_rounding.max(initial=0))])])
    upper = op("Max", [candidate_upper, other_upper])  # [nG, 1]
    upper = op("Add", [upper, op("Add", [op("Mul", [op("Abs", [upper]), const("margin_relative",
                                                                                 np.array(MARGIN_RELATIVE, np.float32))]),
                                         const("margin_absolute", np.array(MARGIN_ABSOLUTE, np.float32))])])
    z_lower = op("ReduceSum", [op("Exp", [op("Sub", [lower, upper])]), axis_v], keepdims=0)  # [nG]
    p_upper = op("Min", [op("Div", [const("numerator", np.array(1 + slack(v), np.float32)), z_lower]),
                         const("one", np.array(1, np.float32))])
    # at each batch row's first mask [n]
    p_rows = op("Reshape", [p_upper, op("Shape", [screening.rows], start=0, end=2)], allowzero=1)  # [n, G]
    ids = names[INPUT_IDS]
    untested = op("Sub", [op("Shape", [ids], start=1, end=2), op("Shape", [screening.rows], start=1, end=2)])  # [1]
    pads = op("Concat", [const("pad_zeros", np.array([0], np.int64)), untested,
                         const("pad_tail", np.array([0, 0], np.int64))], axis=0)
    p_window = op("Pad", [p_rows, pads, const("never", NEVER)])  # [n, W]
    is_mask = op("Cast", [op("Equal", [ids, const("mask", np.array(mask_token_id, np.int64))])], to=ir.DataType.INT32)
    first_mask = op("ArgMax", [is_mask], axis=1, keepdims=1)  # [n, 1]; 0 without a mask (no test is read)
    p_first = op("Reshape", [op("GatherElements", [p_window, first_mask], axis=1), const("flat", np.array([-1], np.int64))])
    tau_tested = op("Min", [tau, const("tau_max", np.array(1, np.float32))])  # a tau above 1 tests what 1 does
    proven = op("LessOrEqual", [p_first, tau_tested])  # [n]; a NaN bound proves nothing
    skipped = op("Cast", [op("ReduceMin", [op("Cast", [proven], to=ir.DataType.INT64)], keepdims=0)], to=ir.DataType.BOOL)
    skipped.name, skipped.shape, skipped.type = HEAD_SKIPPED, ir.Shape([]), ir.TensorType(ir.DataType.BOOL)
    # the head on no rows when skipped, its logits padded back to the rows asked
    runs = op("Cast", [op("Not", [skipped])], to=ir.DataType.INT64)
    count = names[NUM_LOGITS]
    gated_count = op("Mul", [count, runs], suffix=BYPASS)
    for use, index in list(count.uses()):
        if use.name.startswith("/mars_edge/num_logits/"):
            use.replace_input_with(index, gated_count)
    asked = op("Min", [op("Reshape", [count, const("one_dim", np.array([1], np.int64))]),
                       op("Shape", [ids], start=1, end=2)])  # [1]: min(num_logits, W)
    head_rows = head.outputs[0]
    head_rows.name = f"{PREFIX}/head_rows"
    front = op("Sub", [asked, op("Shape", [head_rows], start=1, end=2)])
    logits = op("Pad", [head_rows, op("Concat", [const("zero1", np.array([0], np.int64)), front,
                                                  const("zeros4", np.array([0, 0, 0, 0], np.int64))], axis=0)],
                suffix=BYPASS)
    logits.name, logits.shape, logits.type = LOGITS, head_rows.shape, head_rows.type
    graph.extend(builder.nodes)
    graph.outputs[outputs.index(LOGITS)] = logits
    graph.outputs.append(skipped)
    graph.sort()
    return True

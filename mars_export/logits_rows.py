"""The output head runs only on the window rows whose logits are read: the ``num_logits`` input (GitHub issue 11, item 4).

A prefill forward commits T prompt tokens' KV and drops their logits, yet the output head
(hidden x V, 28M of SmolLM2-135M's 134M weights) would run over all T rows: about a fifth of
a prefill's MatMul FLOPs for that model. Both graph kinds (our step graph and the model
builder's fused graph) therefore get one more input:

    num_logits   int64 []   the head runs on the window's last min(num_logits, W) rows;
                            logits are float32 [n, min(num_logits, W), V]; 0: none

In the step graph it is an overridable initializer (an input with a default value) whose
default keeps every row, so whatever does not feed it gets the logits of the whole window as
before: parity, the C sample, TensorRT (its ONNX parser imports an input that has an
initializer as that constant), and the bench scripts. The fused graph, which only
:class:`runtime.backends.fused.FusedStep` runs, gets a required input instead: onnxruntime's
I/O binding cannot bind an input that has an initializer. The runtime feeds 0 in prefill
forwards (:func:`runtime.decode.batch.run_prefill`, ``step(..., logits=False)``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from runtime.bundle import LOGITS, NUM_LOGITS

ALL_ROWS = np.iinfo(np.int64).max  # num_logits' default: every row of the window
HEAD_OPS = ("MatMul", "MatMulNBits")  # what writes the logits (before / after weight-only quantization)
UNARY_ORDER_KEEPING_OPS = ("Cast", "Tanh")  # fp16 exports' Cast to float32; Gemma2's soft-capping
SCALING_OPS = ("Div", "Mul")  # by a positive scalar constant: Gemma2's soft-capping


def output_head(graph: ir.Graph) -> ir.Node | None:
    """The node whose output becomes ``logits`` through element-wise ops that keep each logit's order
    (:func:`keeps_order`): the output head (a MatMul on a step graph), or None without a ``logits`` output
    or producer. Those ops map each row alone, so the head may run on fewer rows, and its argmax is the
    logits' (up to float rounding: :mod:`mars_export.greedy_head`)."""
    outputs = {value.name: value for value in graph.outputs}
    head = outputs[LOGITS].producer() if LOGITS in outputs else None
    while head is not None and keeps_order(head):
        head = head.inputs[0].producer()
    return head


def keeps_order(node: ir.Node) -> bool:
    """Whether ``node`` maps each element of its first input alone by an increasing function: a Cast (fp16
    exports: to float32) or Tanh, or a Div or Mul by a positive scalar constant (Gemma2's final soft-capping
    ``cap · tanh(logits / cap)``)."""
    if node.op_type in UNARY_ORDER_KEEPING_OPS:
        return True
    if node.op_type not in SCALING_OPS or len(node.inputs) != 2 or node.inputs[1] is None:
        return False
    scale = node.inputs[1].const_value
    return scale is not None and scale.size == 1 and float(scale.numpy().reshape(())) > 0


def compute_logits_of_last_rows(graph: ir.Graph, has_default: bool = True) -> None:
    """Give ``graph`` the ``num_logits`` input and slice the output head's input to the window's last rows, in place.

    The head is the MatMul that writes the ``logits`` output (through a Cast in fp16 exports, Gemma2's
    soft-capping: :func:`output_head`); its input [n, W, d] becomes ``x[:, max(W - num_logits, 0):]``.
    The ``logits`` output keeps its declared shape [n, W, V], true at the default (what TensorRT
    builds: it folds the default in); onnxruntime does not hold a symbolic output axis to its name.
    ``has_default``: the input defaults to every row (an overridable initializer); False makes it a
    required input.

    Raises:
        ValueError: the graph has no ``logits`` output, a head other than a MatMul writes it,
            or it already has a ``num_logits`` input.
    """
    if LOGITS not in {value.name for value in graph.outputs}:
        raise ValueError(f"the graph has no {LOGITS!r} output")
    if NUM_LOGITS in {value.name for value in graph.inputs}:
        raise ValueError(f"the graph already has a {NUM_LOGITS!r} input")
    head = output_head(graph)
    if head is None or head.op_type not in HEAD_OPS:
        raise ValueError(f"the {LOGITS!r} output is not written by a MatMul (found {head and head.op_type})")
    count = ir.Value(name=NUM_LOGITS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    graph.inputs.append(count)
    if has_default:
        count.const_value = ir.tensor(np.array(ALL_ROWS, np.int64), name=NUM_LOGITS)
        graph.register_initializer(count)

    def const(name: str, values: list[int]) -> ir.Value:
        value = ir.Value(name=f"/mars_edge/num_logits/{name}", const_value=ir.tensor(np.array(values, np.int64)))
        graph.register_initializer(value)
        return value

    hidden = head.inputs[0]  # [n, W, d]
    window = ir.node("Shape", [hidden], attributes={"start": 1, "end": 2})  # [1]: W
    wanted = ir.node("Reshape", [count, const("one", [1])])  # [1]
    skipped = ir.node("Sub", [window.outputs[0], wanted.outputs[0]])  # [1]: W - num_logits (negative when it passes W)
    start = ir.node("Max", [skipped.outputs[0], const("zero", [0])])
    rows = ir.node("Slice", [hidden, start.outputs[0], const("end", [int(ALL_ROWS)]), const("axis", [1])])
    nodes = [window, wanted, skipped, start, rows]
    for node in nodes:
        node.name = f"/mars_edge/num_logits/{node.op_type}"
    graph.insert_before(head, nodes)
    head.replace_input_with(0, rows.outputs[0])

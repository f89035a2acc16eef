"""Projections that read one tensor become one MatMul: Q/K/V, and gate/up (GitHub issue 11).

The dynamo exporter writes every ``nn.Linear`` as ``MatMul(x, Wᵀ)`` with ``Wᵀ`` a constant
[K, N]. A layer's query, key and value projections all read the normed hidden state, and
its MLP's gate and up projections the second normed state. Each group becomes one
``MatMul(x, [Wq | Wk | Wv])`` [K, ΣN] followed by a ``Split`` on the last axis: per layer
3 fewer MatMul kernels, one pass over ``x`` instead of three, and wider tiles (at W = 1 a
decode step is a chain of matrix-vector products whose fixed cost per kernel is not
small against a 576 x 192 weight). Each output column is the same dot product as before.

Only standard ONNX ops: the fused graph runs on every execution provider and in TensorRT;
a weight-only quantizer then sees one wider constant-weight MatMul per group.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir


def fuse_shared_input_matmuls(graph: ir.Graph) -> int:
    """Fuse each group of MatMuls that read the same input with 2-D constant weights of one K and dtype.

    Args:
        graph: the exported step graph, changed in place (old weights are dropped once unused).

    Returns:
        the number of MatMuls removed (for a Llama layer: 2 for Q/K/V, 1 for gate/up).
    """
    groups = collections.defaultdict(list)
    for node in graph:
        weight = _constant_weight(node)
        if weight is not None:
            groups[node.inputs[0], weight.shape[0], weight.dtype].append(node)
    removed = 0
    for nodes in groups.values():
        if len(nodes) > 1 and not any(node.outputs[0].is_graph_output() for node in nodes):
            _fuse(graph, nodes)
            removed += len(nodes) - 1
    return removed


def _constant_weight(node: ir.Node) -> np.ndarray | None:
    """The [K, N] weight of a standard MatMul whose second input is an initializer, else None."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    weight = node.inputs[1]
    if weight is None or not weight.is_initializer() or weight.const_value is None:
        return None
    array = weight.const_value.numpy()
    return array if array.ndim == 2 else None


def _fuse(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Replace ``nodes`` (same input, weights [K, N_i]) by MatMul(x, concat(W_i)) and a Split into N_i."""
    weights = [node.inputs[1] for node in nodes]
    arrays = [w.const_value.numpy() for w in weights]
    fused = ir.Value(name=f"{weights[0].name}.fused", const_value=ir.tensor(np.concatenate(arrays, axis=1)))  # [K, ΣN]
    sizes = ir.Value(name=f"{weights[0].name}.fused_sizes",
                     const_value=ir.tensor(np.array([a.shape[1] for a in arrays], dtype=np.int64)))
    graph.register_initializer(fused)
    graph.register_initializer(sizes)
    matmul = ir.node("MatMul", [nodes[0].inputs[0], fused], name=f"{nodes[0].name}.fused")
    matmul.outputs[0].name = f"{nodes[0].outputs[0].name}.fused"  # [.., ΣN]
    split = ir.node("Split", [matmul.outputs[0], sizes], {"axis": -1}, num_outputs=len(nodes),
                    name=f"{nodes[0].name}.fused_split")
    graph.insert_before(nodes[0], [matmul, split])
    for node, part in zip(nodes, split.outputs):
        old = node.outputs[0]
        old.replace_all_uses_with(part)
        part.name, old.name = old.name, f"{old.name}.unfused"
        part.type, part.shape = old.type, old.shape
    graph.remove(nodes, safe=True)
    for weight in weights:
        if not weight.uses():
            graph.initializers.pop(weight.name)

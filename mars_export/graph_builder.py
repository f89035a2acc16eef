"""Named initializers and nodes added to an onnx_ir graph under one name prefix (the greedy head, its gate)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


class NodeBuilder:
    """Builds nodes for ``graph``, each named ``{prefix}/{op_type}_{index}{suffix}``; initializers are registered in
    the graph at once, the nodes kept in :attr:`nodes` until the caller adds them (``graph.extend``), so that a
    name prefix finds everything one addition made (``runtime.bundle.strip_greedy_head``)."""

    def __init__(self, graph: ir.Graph, prefix: str):
        self.graph, self.prefix = graph, prefix
        self.nodes: list[ir.Node] = []

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        """An initializer ``{prefix}/{name}`` holding ``array``."""
        value = ir.Value(name=f"{self.prefix}/{name}", const_value=ir.tensor(array))
        self.graph.register_initializer(value)
        return value

    def op(self, op_type: str, inputs: list, domain: str = "", suffix: str = "", **attributes) -> ir.Value:
        """A node of ``op_type`` over ``inputs``; returns its first output."""
        node = ir.node(op_type, inputs, attributes=attributes, domain=domain)
        node.name = f"{self.prefix}/{op_type}_{len(self.nodes)}{suffix}"
        self.nodes.append(node)
        return node.outputs[0]

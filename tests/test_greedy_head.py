"""mars_export.greedy_head: the argmax token of a window's rows from an int8 screening and an exact rescoring.

The guarantee rests on one inequality, that onnxruntime's MatMulNBits (int8 weights, accuracy_level 4)
stays within the error bound the head computes; these tests hold the kernel to it on rows shaped as a
model's final hidden states are (a few dimensions 30x the others), and hold the graph to the argmax.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mars_export import greedy_head
from mars_export.logits_rows import compute_logits_of_last_rows

K, V, MASK = 576, 3000, 7


def hidden_rows(rng: np.random.Generator, n: int, k: int = K) -> np.ndarray:
    """float32 [n, k]: normal rows, some with outlier dimensions (x30); row 1 tiny and row 2 zeros, where n allows."""
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[::3, rng.integers(0, k, 3)] *= 30  # outliers, as RMSNorm outputs have
    x[1:2] *= 1e-6
    x[2:3] = 0
    return x


def head_weight(rng: np.random.Generator, k: int = K, v: int = V) -> np.ndarray:
    """float32 [k, v], columns of different scales and a few very close to one another (near-ties)."""
    w = (rng.standard_normal((k, v)) * rng.uniform(0.005, 0.08, v)).astype(np.float32)
    w[:, 10:20] = w[:, 9:10] + rng.standard_normal((k, 10)).astype(np.float32) * 1e-5
    w[:, 0] = rng.integers(-127, 128, k) * np.float32(0.01)  # on the int8 grid: no weight error, column 0
    w[::greedy_head.BLOCK, 0] = 1.27  # each block's max, so the grid is the quantizer's
    return w


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def screening_session(packed: np.ndarray, scales: np.ndarray) -> ort.InferenceSession:
    """The head's int8 screening alone: MatMulNBits x [m, K] -> [m, V] as add_greedy_head builds it."""
    node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=K, N=V, bits=8,
                            block_size=greedy_head.BLOCK, accuracy_level=4)
    graph = helper.make_graph([node], "screen", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", V])],
                              [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "s")])
    return session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                            helper.make_opsetid("com.microsoft", 1)]))


def test_the_int8_kernel_stays_within_the_screening_bound():
    """|MatMulNBits(x) - x·W| <= the bound of the module docstring, for every row and column."""
    rng = np.random.default_rng(0)
    weight = head_weight(rng)
    packed, scales, dequantized = greedy_head.quantize_columns(weight)
    per_l1, per_block_max = greedy_head.bound_coefficients(weight, dequantized)
    screen = screening_session(packed, scales)
    for m in (1, 2, 4, 16):  # the kernel takes other paths at other row counts
        x = hidden_rows(rng, m)
        x[-1] = worst_activation(rng, weight[:, 0])
        approx = screen.run(None, {"x": x})[0]
        exact = x.astype(np.float64) @ weight.astype(np.float64)
        blocks = np.abs(x).reshape(m, K // greedy_head.BLOCK, greedy_head.BLOCK).max(-1).sum(-1, keepdims=True)
        bound = np.abs(x).sum(-1, keepdims=True) * per_l1 + blocks * per_block_max + greedy_head.ABSOLUTE_SLACK
        error = np.abs(approx - exact)
        assert np.all(error <= bound), (m, float((error / bound).max()))
        assert np.median(error / bound) < 0.5  # a bound the kernel gets near would be one it might pass
        assert error[-1, 0] > 0.6 * bound[-1, 0]  # the activation's rounding, all of one sign: the bound is needed


def test_an_all_zero_column_stays_within_its_bound():
    """A head column of zeros (its logit exactly 0) has a bound of the absolute slack only; with a scale of 1 for
    its blocks the kernel's float rounding reached 125x that on large rows (a review found the argmax lost)."""
    rng = np.random.default_rng(6)
    weight = head_weight(rng)
    weight[:, 3] = 0
    packed, scales, dequantized = greedy_head.quantize_columns(weight)
    per_l1, per_block_max = greedy_head.bound_coefficients(weight, dequantized)
    assert per_l1[3] < 1e-30 and per_block_max[3] < 1e-30 and not np.any(dequantized[:, 3])  # the slack alone
    for scale in (1, 100, 1e4):  # a row for which every other column's logit is negative: the zero column wins
        x = rng.standard_normal((1, K)).astype(np.float32) * np.float32(scale)
        signs = np.where(x.astype(np.float64) @ weight.astype(np.float64) > 0, -1, 1).astype(np.float32)
        flipped = weight * signs  # [K, V], column 3 still zeros
        assert (x.astype(np.float64) @ flipped.astype(np.float64))[0].argmax() == 3
        model, _ = head_graph(flipped)
        assert run_head(session(model), x, 1)[1][0, 0] == 3, scale
    screen = screening_session(packed, scales)
    for m in (1, 4, 256):
        x = rng.standard_normal((m, K)).astype(np.float32) * 100
        assert np.abs(screen.run(None, {"x": x})[0][:, 3]).max() <= greedy_head.ABSOLUTE_SLACK


def worst_activation(rng: np.random.Generator, column: np.ndarray) -> np.ndarray:
    """float32 [K]: a row whose int8 rounding errors all push its product with ``column`` one way: in each
    block one element at the block's max (127 steps), the others 0.49 of a step above a whole step count,
    signed as ``column``."""
    step = np.float32(0.02)
    counts = rng.integers(0, 120, K).astype(np.float32)
    x = (counts + np.float32(0.49)) * step * np.sign(column)
    x[::greedy_head.BLOCK] = 127 * step
    return x.astype(np.float32)


def head_graph(weight: np.ndarray, mask_token_id: int = MASK) -> tuple[onnx.ModelProto, bool]:
    """A graph hidden [1, W, K] -> logits = hidden · weight on num_logits rows, with the greedy head added."""
    k, v = weight.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["hidden", "head"], ["logits"])], "head",
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "w", k])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "w", v])],
                              [numpy_helper.from_array(weight, "head")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    compute_logits_of_last_rows(model.graph, has_default=False)
    added = greedy_head.add_greedy_head(model.graph, mask_token_id)
    return ir.to_proto(model), added


def run_head(sess: ort.InferenceSession, hidden: np.ndarray, num_greedy: int, num_logits: int = 0):
    return sess.run(None, {"hidden": hidden[None], "num_logits": np.array(num_logits, np.int64),
                           "num_greedy": np.array(num_greedy, np.int64)})


def test_the_greedy_ids_are_the_argmax_of_the_logits_with_the_mask_token_excluded():
    rng = np.random.default_rng(1)
    weight = head_weight(rng)
    weight[:, MASK] = weight[:, :50].max(axis=1) * 3  # the mask token would win most rows
    model, added = head_graph(weight)
    assert added
    sess = session(model)
    checked = 0
    for _ in range(40):
        x = hidden_rows(rng, 8)
        x[0] = weight[:, 9] * 5  # a row whose best tokens are the near-tied columns 9..19
        logits_out, ids = run_head(sess, x, 8, num_logits=8)
        exact = x.astype(np.float64) @ weight.astype(np.float64)
        exact[:, MASK] = -np.inf
        top2 = np.sort(exact, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-3  # elsewhere both float32 sums may pick either of a near-tie
        assert ids.shape == (1, 8) and MASK not in ids
        assert np.array_equal(ids[0][clear], exact.argmax(-1)[clear])
        graph_logits = logits_out[0].copy()
        graph_logits[:, MASK] = -np.inf
        gap = graph_logits.max(-1) - np.take_along_axis(graph_logits, ids[0][:, None], 1)[:, 0]
        assert np.all(gap <= 1e-4)  # the graph's own logits: the same token, or a near-tie
        checked += int(clear.sum())
    assert checked > 150


def test_each_row_gets_the_same_id_in_any_window_and_only_the_rows_asked():
    rng = np.random.default_rng(2)
    model, _ = head_graph(head_weight(rng))
    sess = session(model)
    x = hidden_rows(rng, 8)
    whole = run_head(sess, x, 8)[1][0]
    for cut in (1, 2, 3):
        rows = np.concatenate([run_head(sess, x[i:i + cut], cut)[1][0] for i in range(0, 8, cut)])
        assert np.array_equal(rows, whole), cut
    logits_out, ids = run_head(sess, x, 3)
    assert ids.shape == (1, 3) and np.array_equal(ids[0], whole[-3:]) and logits_out.shape == (1, 0, V)
    assert run_head(sess, x, 0, num_logits=2)[1].shape == (1, 0)  # a step that reads logits only
    assert np.array_equal(run_head(sess, x, 99)[1][0], whole)  # more rows than the window: all of them


def test_a_head_whose_width_is_not_a_multiple_of_the_block_gets_none():
    model, added = head_graph(head_weight(np.random.default_rng(3), k=48, v=100))
    assert not added and "greedy_ids" not in {o.name for o in model.graph.output}


def test_the_greedy_head_goes_after_the_num_logits_slice_once():
    weight = head_weight(np.random.default_rng(4), k=64, v=100)
    graph = helper.make_graph([helper.make_node("MatMul", ["hidden", "head"], ["logits"])], "head",
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "w", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "w", 100])],
                              [numpy_helper.from_array(weight, "head")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    with pytest.raises(ValueError, match="num_logits slice"):
        greedy_head.add_greedy_head(model.graph, MASK)
    compute_logits_of_last_rows(model.graph, has_default=False)
    assert greedy_head.add_greedy_head(model.graph, MASK)
    with pytest.raises(ValueError, match="already has"):
        greedy_head.add_greedy_head(model.graph, MASK)


def tied_head_graph(weight: np.ndarray) -> onnx.ModelProto:
    """As :func:`head_graph`, the head written as our step graph writes a tied one: MatMul(hidden, Transpose(table)),
    ``table`` the [V, K] embedding initializer."""
    k, v = weight.shape
    nodes = [helper.make_node("Transpose", ["table"], ["head"], perm=[1, 0]),
             helper.make_node("MatMul", ["hidden", "head"], ["logits"])]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "w", k])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "w", v])],
                              [numpy_helper.from_array(np.ascontiguousarray(weight.T), "table")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    compute_logits_of_last_rows(model.graph, has_default=False)
    assert greedy_head.add_greedy_head(model.graph, MASK)
    return ir.to_proto(model)


def test_the_head_is_stored_once_tied_or_untied_and_both_give_the_same_ids():
    """The rescoring reads the candidates' rows from the head's own weight: an untied [K, V] head is stored as
    [V, K] behind a Transpose (no second float32 copy: a 7B model's head is 2.2 GB), a tied one reads the
    embedding's [V, K] rows; both give the same ids and the same logits."""
    rng = np.random.default_rng(5)
    weight = head_weight(rng)
    untied, _ = head_graph(weight)
    tied = tied_head_graph(weight)
    for model in (untied, tied):
        floats = [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]
        assert sum(a.size for a in floats if a.size >= K * V) == K * V  # the head itself, once
    x = hidden_rows(rng, 8)
    (untied_logits, untied_ids), (tied_logits, tied_ids) = (run_head(session(m), x, 8, 8) for m in (untied, tied))
    assert np.array_equal(untied_ids, tied_ids) and np.array_equal(untied_logits, tied_logits)
    assert np.allclose(untied_logits[0], x @ weight, rtol=1e-5, atol=1e-4)  # the head still computes x · W


def test_an_untied_head_without_the_greedy_head_still_computes_the_logits():
    """Stripping the greedy head (TensorRT builds, quantizing) keeps the untied head's [V, K] weight and its
    Transpose: the head's own nodes, not the greedy head's."""
    from runtime.bundle import strip_greedy_head
    rng = np.random.default_rng(6)
    weight = head_weight(rng, v=500)
    model, _ = head_graph(weight)
    strip_greedy_head(model)
    assert {o.name for o in model.graph.output} == {"logits"}
    x = hidden_rows(rng, 4)
    logits = session(model).run(None, {"hidden": x[None], "num_logits": np.array(4, np.int64)})[0]
    assert np.allclose(logits[0], x @ weight, rtol=1e-5, atol=1e-4)


def test_an_untied_head_is_read_through_a_transpose_and_gathered_as_rows():
    """The form, not only the results: onnxruntime gathers the columns of a [K, V] weight element by element
    (slower than the output head it saves at 1 row), so the rescoring gathers rows of the [V, K] initializer
    the head reads through ``/mars_edge/head_transpose``."""
    weight = head_weight(np.random.default_rng(7), v=500)
    model, _ = head_graph(weight)
    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    head = producers["logits"]
    transpose = producers[head.input[1]]
    assert transpose.name == "/mars_edge/head_transpose" and initializers[transpose.input[0]].shape == (500, K)
    gathers = [node for node in model.graph.node if node.op_type == "Gather" and node.input[0] in initializers]
    assert [(g.input[0], helper.get_attribute_value(g.attribute[0])) for g in gathers] == [(transpose.input[0], 0)]


def test_a_head_weight_read_by_another_node_stays_beside_its_transposed_copy():
    rng = np.random.default_rng(8)
    weight = head_weight(rng, v=300)
    nodes = [helper.make_node("MatMul", ["hidden", "head"], ["logits"]),
             helper.make_node("MatMul", ["hidden", "head"], ["other"])]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "w", K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "w", 300]),
                               helper.make_tensor_value_info("other", TensorProto.FLOAT, [1, "w", 300])],
                              [numpy_helper.from_array(weight, "head")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    compute_logits_of_last_rows(model.graph, has_default=False)
    assert greedy_head.add_greedy_head(model.graph, MASK)
    proto = ir.to_proto(model)
    assert "head" in {t.name for t in proto.graph.initializer}
    x = hidden_rows(rng, 4)
    logits, other, ids = session(proto).run(["logits", "other", "greedy_ids"], {
        "hidden": x[None], "num_logits": np.array(4, np.int64), "num_greedy": np.array(4, np.int64)})
    assert np.allclose(logits[0], x @ weight, rtol=1e-5, atol=1e-4) and np.array_equal(logits, other)
    assert ids.shape == (1, 4)

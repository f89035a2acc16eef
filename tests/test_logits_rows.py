"""The ``num_logits`` input: the output head runs only on the window rows whose logits are read (GitHub issue 11, item 4)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from support import export

from mars_export import onnx_export
from mars_export.logits_rows import compute_logits_of_last_rows
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import CONFIDENCE_TAU, LOGITS, NUM_GREEDY, NUM_LOGITS, load_config, step_feeds
from runtime.decode.batch import scratch_past, window_mask
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams

T = 6  # window of the forwards below


def window_feeds(config, batch: int = 2) -> dict:
    """Feeds of a T-token window at positions 0..T-1 into a zeroed cache of T positions, ``batch`` rows of random ids."""
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (batch, T))  # [n, T]
    past = scratch_past(config.num_layers, batch, config.num_kv_heads, T, config.head_dim, config.dtype)  # [n, H, T, D]
    return step_feeds(ids, np.tile(np.arange(T), (batch, 1)), window_mask(np.zeros(batch, np.int64), T, T), past)


def step_args(feeds: dict, num_layers: int) -> list:
    """``OnnxBackend.step``'s positional arguments from step-graph feeds."""
    return [feeds["input_ids"], feeds["position_ids"], feeds["attention_mask"],
            [(feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"]) for i in range(num_layers)]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_num_logits_gives_the_last_rows_bit_for_bit_and_defaults_to_all(tiny_bundle, arch):
    bundle_dir = tiny_bundle(arch, 4)[1]
    config = load_config(bundle_dir)
    session = ort.InferenceSession(str(bundle_dir / config.onnx_file), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_overridable_initializers()] == [NUM_LOGITS, NUM_GREEDY, CONFIDENCE_TAU]  # not feeding them is allowed
    feeds = window_feeds(config)
    full, *kv = session.run(None, feeds)
    assert full.shape == (2, T, config.vocab_size)
    for count in (0, 1, 3, T, T + 1, 2 * T, 10**6):
        part, *kv_part = session.run(None, {**feeds, NUM_LOGITS: np.array(count, np.int64)})
        assert part.shape == (2, min(count, T), config.vocab_size)
        assert np.array_equal(part, full[:, T - min(count, T):])
        assert all(np.array_equal(a, b) for a, b in zip(kv, kv_part))


def test_a_prefill_step_skips_the_output_head_and_writes_the_same_kv(tiny_bundle):
    bundle_dir = tiny_bundle("llama", 4)[1]
    config = load_config(bundle_dir)
    backend = OnnxBackend(bundle_dir, config)
    assert backend.takes_num_logits
    logits, kv = backend.step(*step_args(window_feeds(config, batch=1), config.num_layers))
    none, kv_none = backend.step(*step_args(window_feeds(config, batch=1), config.num_layers), logits=False)
    assert logits.shape == (1, T, config.vocab_size) and none.shape == (1, 0, config.vocab_size)
    assert np.any(kv[0][0])  # written
    assert all(np.array_equal(a, c) and np.array_equal(b, d) for (a, b), (c, d) in zip(kv, kv_none))


def test_bundles_exported_before_num_logits_still_prefill_and_decode_alike(tiny_bundle, tmp_path, monkeypatch):
    """A step graph without the input (exports before 2026-12-02): the backend computes a prefill's logits and
    drops them; the tokens are those of the new graph."""
    ckpt, new = tiny_bundle("llama", 4)
    monkeypatch.setattr(onnx_export, "compute_logits_of_last_rows", lambda graph: None)
    monkeypatch.setattr(onnx_export, "add_greedy_head", lambda *args, **kwargs: None)  # it came later still
    old = export(str(ckpt), tmp_path / "old", 4, 4, "--mask-token", "<mask>")
    config = load_config(old)
    backend = OnnxBackend(old, config)
    assert not backend.takes_num_logits
    none, _ = backend.step(*step_args(window_feeds(config, batch=1), config.num_layers), logits=False)
    assert none.shape == (1, 0, config.vocab_size)
    prompt = list(range(3, 40))  # a prompt long enough for a prefill forward of several tokens
    params = DecodeParams(max_new_tokens=12, tau=0.7)
    assert (Decoder(backend, config).generate(prompt, params).token_ids
            == Decoder(OnnxBackend(new, load_config(new)), load_config(new)).generate(prompt, params).token_ids)


def graph_with_output(op_type: str) -> ir.Graph:
    """x [1, 2, 4] -> ``op_type`` -> logits: a MatMul head with a constant weight, or another op."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 2, 4]))
    weight = ir.Value(name="w", const_value=ir.tensor(np.ones((4, 3), np.float32)))
    node = ir.node(op_type, [x, weight] if op_type == "MatMul" else [x, x], outputs=[ir.Value(name=LOGITS)])
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[weight], opset_imports={"": 18})
    return graph


def soft_capped_graph(cap: float) -> ir.Graph:
    """x [1, 2, 4] -> MatMul head -> Div(cap) -> Tanh -> Mul(cap) -> logits: Gemma2's final soft-capping."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 2, 4]))
    weight = ir.Value(name="w", const_value=ir.tensor(np.arange(12, dtype=np.float32).reshape(4, 3)))
    scale = ir.Value(name="cap", const_value=ir.tensor(np.array(cap, np.float32)))
    head = ir.node("MatMul", [x, weight])
    divide = ir.node("Div", [head.outputs[0], scale])
    tanh = ir.node("Tanh", [divide.outputs[0]])
    multiply = ir.node("Mul", [tanh.outputs[0], scale], outputs=[ir.Value(name=LOGITS)])
    return ir.Graph([x], multiply.outputs, nodes=[head, divide, tanh, multiply], initializers=[weight, scale],
                    opset_imports={"": 18})


def test_the_head_is_found_behind_the_soft_capping():
    """cap · tanh(x / cap) with cap > 0 maps each logit alone and keeps their order: the head is cut (and may
    serve the greedy head); a negative cap does not keep the order, and the graph is refused."""
    graph = soft_capped_graph(30.0)
    compute_logits_of_last_rows(graph)
    model = ir.Model(graph, ir_version=10)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 2, 4)).astype(np.float32)
    want = 30 * np.tanh(x @ np.arange(12, dtype=np.float32).reshape(4, 3) / 30)  # [1, 2, 3]
    assert np.allclose(session.run(None, {"x": x})[0], want, atol=1e-5)
    assert np.allclose(session.run(None, {"x": x, NUM_LOGITS: np.array(1, np.int64)})[0], want[:, 1:], atol=1e-5)
    with pytest.raises(ValueError, match=r"not written by a MatMul \(found Mul\)"):
        compute_logits_of_last_rows(soft_capped_graph(-30.0))


def test_the_rewrite_refuses_graphs_it_cannot_cut():
    with pytest.raises(ValueError, match="not written by a MatMul"):
        compute_logits_of_last_rows(graph_with_output("Add"))
    graph = graph_with_output("MatMul")
    compute_logits_of_last_rows(graph)
    with pytest.raises(ValueError, match="already has a 'num_logits' input"):
        compute_logits_of_last_rows(graph)
    graph.outputs[0].name = "scores"
    with pytest.raises(ValueError, match="no 'logits' output"):
        compute_logits_of_last_rows(graph)

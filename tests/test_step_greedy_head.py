"""The greedy head on the float32 step graph: argmax ids at any batch, the KV still written in place.

A float32 step-graph export (not quantized, no TensorRT engine) gets the greedy head
(mars_export.greedy_head) with ``num_greedy`` defaulting to 0, so whatever does not feed it (the C
sample, parity, the bench scripts) runs the graph as before. The runtime feeds ``num_logits`` 0 and
``num_greedy`` W in a step whose rows read argmaxes only; these tests hold that step to the logits
path, token for token, at batch 1 and 3 over rows of different lengths.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from runtime import bundle
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.batch import run_batch, run_prefill
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.kv_cache import KVCache
from runtime.decode.params import DecodeParams
from support import export

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [40, 41, 42, 43, 44, 45, 46], [1, 2, 3]]


@pytest.fixture(scope="module")
def step_bundle(tiny_bundle):
    _, path = tiny_bundle("llama", 4)
    config = load_config(path)
    return path, config, OnnxBackend(path, config)


def test_a_float32_step_export_has_the_head_with_a_default(step_bundle):
    path, config, backend = step_bundle
    graph = onnx.load(str(path / config.onnx_file), load_external_data=False).graph
    defaults = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    assert int(defaults[bundle.NUM_GREEDY]) == 0 and bundle.NUM_GREEDY in {i.name for i in graph.input}
    assert [o.name for o in graph.output][-2:] == [bundle.GREEDY_IDS, bundle.HEAD_SKIPPED]  # mars_export.confidence_gate
    assert backend.takes_num_greedy and bundle.has_greedy_head(config)
    assert config.parity["greedy_head_agreement"] == 1.0 and config.parity["greedy_head_max_gap"] == 0.0


def test_greedy_ids_are_the_logits_argmax_at_batch_3_and_the_kv_is_the_same(step_bundle):
    _, config, backend = step_bundle
    caches = {}
    for greedy in (False, True):
        cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 64, np.float32, 3)
        for slot, prompt in enumerate(PROMPTS[:3]):  # rows of 5, 2 and 7 committed tokens
            cache.reserve(len(prompt))
            cache.commit_slot(slot, run_prefill(backend, cache, slot, prompt), 0, len(prompt))
        cache.reserve(7 + 4)
        rows = [[20, 21, config.mask_token_id, 22], [23, 24, 25, 26], [27, config.mask_token_id, 28, 29]]
        out, _ = run_batch(backend, cache, rows, config.pad_token_id, greedy_ids=greedy)
        caches[greedy] = (out, [buffer.copy() for pair in cache.past(3) for buffer in pair])
    logits, ids = caches[False][0], caches[True][0]
    logits[:, :, config.mask_token_id] = -np.inf
    assert ids.shape == (3, 4) and ids.dtype == np.int64
    assert np.array_equal(ids, logits.argmax(-1))
    assert all(np.array_equal(a, b) for a, b in zip(caches[False][1], caches[True][1]))  # written in place alike


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("params", [DecodeParams(mode="ar", max_new_tokens=24),
                                    DecodeParams(mode="verify", draft="both", max_new_tokens=24)], ids=["ar", "verify"])
def test_the_engine_decodes_the_same_tokens_with_and_without_the_head(step_bundle, monkeypatch, batch, params):
    path, config, backend = step_bundle

    def decode(use_head: bool):
        monkeypatch.setattr(backend, "takes_num_greedy", use_head)
        engine = Engine(backend, config, EngineConfig(max_batch_size=batch, max_seq_len=96))
        ids = [engine.add_request(p, params) for p in PROMPTS]
        results = {}
        while len(results) < len(ids):
            results.update((out.request_id, out.result) for out in engine.step() if out.finished)
        return [results[i].token_ids for i in ids], [results[i].num_forwards for i in ids]
    assert decode(True) == decode(False)


def test_an_fp16_export_has_no_head(tiny_bundle, tmp_path):
    """fp16 graphs have no float32 output head to screen (quantized ones read their own quantized head; TensorRT
    builds parse the graph without the head: tests/test_trt.py)."""
    ckpt, _ = tiny_bundle("llama", 4)
    fp16 = export(str(ckpt), tmp_path / "fp16", 4, 4, "--mask-token", "<mask>", "--fp16")
    config = load_config(fp16)
    assert not bundle.has_greedy_head(config) and not OnnxBackend(fp16, config).takes_num_greedy


def test_a_step_graph_without_the_head_refuses_greedy_ids(step_bundle, monkeypatch):
    _, config, backend = step_bundle
    monkeypatch.setattr(backend, "takes_num_greedy", False)
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 16, np.float32, 1)
    cache.reserve(4)
    with pytest.raises(ValueError, match="no greedy head"):
        run_batch(backend, cache, [[1, 2, 3, 4]], config.pad_token_id, greedy_ids=True)


def test_the_engine_asks_for_ids_up_to_the_row_cap_and_reads_logits_above_it(step_bundle, monkeypatch):
    """The greedy head's rescoring grows with the forward's rows (batch x window): above
    ``GREEDY_HEAD_MAX_ROWS`` the engine reads the logits, which a big batch of AR rows gets faster."""
    _, config, backend = step_bundle
    asked = []
    step = backend.step

    def spy(input_ids, *args, logits=True, greedy_ids=False):
        if logits:  # a forward that reads its rows (prefill chunks read nothing)
            asked.append((input_ids.size, greedy_ids))
        return step(input_ids, *args, logits=logits, greedy_ids=greedy_ids)
    monkeypatch.setattr(backend, "step", spy)
    for batch in (1, 3):
        engine = Engine(backend, config, EngineConfig(max_batch_size=batch, max_seq_len=96))
        ids = [engine.add_request(p, DecodeParams(mode="verify", draft="both", max_new_tokens=12)) for p in PROMPTS[:batch]]
        done = set()
        while len(done) < len(ids):
            done.update(out.request_id for out in engine.step() if out.finished)
    assert {greedy for rows, greedy in asked if rows <= bundle.GREEDY_HEAD_MAX_ROWS} == {True}
    assert {greedy for rows, greedy in asked if rows > bundle.GREEDY_HEAD_MAX_ROWS} == {False}

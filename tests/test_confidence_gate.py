"""mars_export.confidence_gate: a threshold step skips the float32 output head only where every tau test fails.

The gate's guarantee: when it reports ``head_skipped``, each batch row's probability at its first mask token,
as the runtime computes it from the full head's logits, is at most that row's ``confidence_tau``. These tests
hold the graph to that on a head of the greedy-head tests' shape, check that stripping it gives back the plain
step graph, and hold the engine to the logits path, token for token and forward for forward.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mars_export import confidence_gate, greedy_head
from mars_export.logits_rows import compute_logits_of_last_rows
from runtime import bundle
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config, strip_greedy_head
from runtime.decode.acceptance import ProvenRejection, confidence
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.params import DecodeParams
from test_greedy_head import K, MASK, V, head_weight, session

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [40, 41, 42, 43, 44, 45, 46], [1, 2, 3]]


def gated_graph(weight: np.ndarray) -> onnx.ModelProto:
    """input_ids [n, W] and hidden [n, W, K] -> logits = hidden · weight (num_logits rows), the greedy head and the gate."""
    k, v = weight.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["hidden", "head"], ["logits"])], "gated",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n", "w"]),
                               helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", "w", k])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", "w", v])],
                              [numpy_helper.from_array(weight, "head")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    compute_logits_of_last_rows(model.graph)
    screening = greedy_head.add_greedy_head(model.graph, MASK, has_default=True)
    assert confidence_gate.add_confidence_gate(model.graph, screening, MASK)
    return ir.to_proto(model)


def runtime_probability(logits: np.ndarray) -> np.ndarray:
    """The probability metric per row of ``logits`` float32 [M, V] as the engine computes it (mask token suppressed)."""
    logits = logits.copy()
    logits[:, MASK] = np.finfo(np.float32).min
    return confidence(logits, "probability")


def test_a_skipped_head_means_every_first_mask_fails_its_tau():
    rng = np.random.default_rng(0)
    weight = head_weight(rng)
    sess = session(gated_graph(weight))
    skipped = fired = 0
    for trial in range(120):
        n, window = (1, 4) if trial % 2 else (2, 4)
        hidden = rng.standard_normal((n, window, K)).astype(np.float32) * rng.uniform(0.2, 8)
        ids = rng.integers(20, 200, (n, window))
        first = rng.integers(1, window, n)  # real tokens, then masks from `first` on
        for b in range(n):
            ids[b, first[b]:] = MASK
        feeds = {"input_ids": ids, "hidden": hidden, "num_logits": np.array(window), "num_greedy": np.array(window)}
        full = sess.run(["logits"], feeds)[0]  # confidence_tau's default: the head always runs
        p = np.array([runtime_probability(full[b, first[b]:first[b] + 1])[0] for b in range(n)])
        # taus on both sides of p, within 10% of it in half the trials: the bound decides near its edge too
        tau = (p * rng.uniform(0.9, 1.1, n) if trial % 4 < 2 else rng.uniform(0.05, 0.99, n)).astype(np.float32)
        logits, greedy_ids, head_skipped = sess.run(["logits", "greedy_ids", "head_skipped"],
                                                    {**feeds, "confidence_tau": tau})
        if head_skipped:
            skipped += 1
            assert np.all(p <= tau), (p, tau)
            assert not logits.any() and logits.shape == full.shape  # zeros in the rows asked
        else:
            fired += 1
            assert np.array_equal(logits, full)
        assert np.array_equal(greedy_ids, sess.run(["greedy_ids"], feeds)[0])
    assert skipped >= 10 and fired >= 20, (skipped, fired)  # both ways taken


def test_a_cancelling_row_whose_largest_logit_the_rescoring_misses_is_not_skipped():
    """The rescoring's float32 sum loses token 23's logit to cancellation (1e7 - 1e7 + 0.5 gives 0, the exact value
    and the full head's is 0.5): the largest full-head logit is not the rescored top. The bound must still hold for
    every tau (a review's counterexample: an upper bound taken from the rescored top skipped at p 0.0697 > tau)."""
    k, v, token = 32, 24, 23
    weight = np.zeros((k, v), np.float32)
    weight[[0, 1, 2], token] = 1
    x = np.zeros(k, np.float32)
    x[:3] = [1e7, -1e7, 0.5]
    hidden = np.zeros((1, 2, k), np.float32)
    hidden[0, 1] = x
    sess = session(gated_graph(weight))
    feeds = {"input_ids": np.array([[30, MASK]]), "hidden": hidden, "num_logits": np.array(2), "num_greedy": np.array(2)}
    p = runtime_probability(sess.run(["logits"], feeds)[0][0, 1:2])[0]
    for tau in np.linspace(0.01, 0.99, 99, dtype=np.float32):
        skipped = sess.run(["head_skipped"], {**feeds, "confidence_tau": np.array([tau], np.float32)})[0]
        assert not skipped or p <= tau, (p, tau)


def test_a_tau_above_1_tests_what_1_does():
    """Untested window positions never skip, whatever tau (the engine feeds at most 1; the graph holds it anyway)."""
    rng = np.random.default_rng(5)
    sess = session(gated_graph(head_weight(rng)))
    hidden = rng.standard_normal((1, 4, K)).astype(np.float32) * 0.01
    feeds = {"input_ids": np.array([[30, MASK, MASK, MASK]]), "hidden": hidden, "num_logits": np.array(4)}
    for tau in (1.0, 2.0, 5.0, np.inf):
        taus = np.array([tau], np.float32)
        assert not sess.run(["head_skipped"], {**feeds, "confidence_tau": taus})[0]  # no greedy rows: untested
        assert sess.run(["head_skipped"], {**feeds, "num_greedy": np.array(4), "confidence_tau": taus})[0]


def test_the_gate_never_skips_by_default_or_outside_the_greedy_rows():
    rng = np.random.default_rng(1)
    sess = session(gated_graph(head_weight(rng)))
    hidden = rng.standard_normal((1, 4, K)).astype(np.float32) * 0.01  # flat logits: p far below every tau
    ids = np.array([[30, MASK, MASK, MASK]])
    base = {"input_ids": ids, "hidden": hidden, "num_logits": np.array(4)}
    assert not sess.run(["head_skipped"], {**base, "num_greedy": np.array(4)})[0]  # confidence_tau's default -1
    tau = np.array([0.9], np.float32)
    assert sess.run(["head_skipped"], {**base, "num_greedy": np.array(4), "confidence_tau": tau})[0]
    assert not sess.run(["head_skipped"], {**base, "num_greedy": np.array(2), "confidence_tau": tau})[0]  # mask at 1
    assert not sess.run(["head_skipped"], {**base, "confidence_tau": tau})[0]  # no greedy rows


def test_stripping_the_greedy_head_takes_the_gate_too():
    rng = np.random.default_rng(2)
    weight = head_weight(rng, v=300)
    model = gated_graph(weight)
    assert any(value.name.startswith(bundle.GREEDY_HEAD_PREFIX) for value in model.graph.value_info)
    strip_greedy_head(model)
    assert not any(value.name.startswith(bundle.GREEDY_HEAD_PREFIX) for value in model.graph.value_info)
    onnx.checker.check_model(model)
    names = {i.name for i in model.graph.input} | {o.name for o in model.graph.output}
    assert not names & {bundle.NUM_GREEDY, bundle.CONFIDENCE_TAU, bundle.GREEDY_IDS, bundle.HEAD_SKIPPED}
    assert not any(node.name.startswith(bundle.GREEDY_HEAD_PREFIX) for node in model.graph.node)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    hidden = rng.standard_normal((2, 3, K)).astype(np.float32)
    logits = sess.run(["logits"], {"input_ids": np.zeros((2, 3), np.int64), "hidden": hidden,
                                   "num_logits": np.array(2)})[0]
    assert np.allclose(logits, hidden[:, 1:] @ weight, rtol=1e-5, atol=1e-4)


def test_a_head_behind_soft_capping_gets_no_gate():
    weight = head_weight(np.random.default_rng(3), v=200)
    graph = helper.make_graph([helper.make_node("MatMul", ["hidden", "head"], ["raw"]),
                               helper.make_node("Tanh", ["raw"], ["logits"])], "capped",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n", "w"]),
                               helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", "w", K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", "w", 200])],
                              [numpy_helper.from_array(weight, "head")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    compute_logits_of_last_rows(model.graph)
    screening = greedy_head.add_greedy_head(model.graph, MASK, has_default=True)
    assert not confidence_gate.add_confidence_gate(model.graph, screening, MASK)
    assert bundle.CONFIDENCE_TAU not in {value.name for value in model.graph.inputs}


TINY = bundle.BundleConfig(block_size=4, window=4, mask_token="<mask>", mask_token_id=1, eos_token_ids=(2,),
                           pad_token_id=0, bos_token_id=None, num_layers=1, num_kv_heads=1, head_dim=4, vocab_size=8,
                           max_context=16, dtype="float32", source_model="tiny")
GREEDY = {"max_abs_logit_diff": 0.0, "greedy_head_agreement": 1.0}  # the parity an export with the greedy head records


@pytest.mark.parametrize("changes, provider, expected", [
    ({}, "cpu", "no greedy head, which the gate tests: either it was exported before the head existed (re-export "
                "it with mars-export), or its model's hidden size is no multiple of 32"),
    ({"graph": "fused"}, "cpu", "exported before the head existed (re-export it with mars-export --graph fused)"),
    ({"parity": GREEDY}, "cpu", "has the greedy head but no gate: either it was exported before the gate existed "
                                "(re-export it with mars-export), or its model changes the logits after the output "
                                "head (Gemma2's final_logit_softcapping)"),
    ({"parity": GREEDY, "graph": "fused"}, "cpu", "before the gate existed (re-export it with mars-export --graph "
                                                  "fused)"),
    ({"weight_dtype": "int8"}, "cpu", "only on float32 bundles and this one is int8 (a --int8 export never has it"),
    ({"weight_dtype": "int4", "graph": "fused"}, "cpu", "this one is int4 (a --int4 export never has it"),
    ({"dtype": "float16", "weight_dtype": "float16"}, "cpu", "this one is float16 (a --fp16 export never"),
    ({"engine_file": "engine.plan"}, "cpu", "exported with --trt has no gate"),
    ({}, "cuda", "the gate runs on the cpu provider only, not cuda: use the cpu provider, or decode without"),
])
def test_a_bundle_without_the_gate_is_told_why_and_what_to_do(changes, provider, expected):
    """Only a float32 bundle exported before the gate gets it by being exported again; a quantized, fp16 or --trt one
    never has it (use a float32 bundle), a GPU provider never runs it; and every one may decode without it."""
    reason = bundle.why_no_confidence_gate(replace(TINY, **changes), provider)
    assert expected in reason and reason.endswith("or decode without the gate (leave confidence_tau out)")
    assert ("re-export" in reason) == (not changes.keys() - {"graph", "parity"} and provider == "cpu")


def test_a_fresh_float32_export_whose_head_gets_no_gate_is_not_told_it_is_old():
    """Gemma2 soft-caps its logits after the head: its float32 bundle has the greedy head (the parity records it) and
    never the gate; 'exported before the gate existed: re-export it' alone sent its user round in circles."""
    reason = bundle.why_no_confidence_gate(replace(TINY, parity=GREEDY))
    assert "softcapping" in reason and "exporting again does not change" in reason


def test_a_proven_rejection_reads_its_row_only():
    scores = ProvenRejection(5, 3)
    assert len(scores) == 5 and scores[3] == -np.inf and scores[1:][2] == -np.inf and len(scores[1:]) == 4
    with pytest.raises(LookupError, match="row 2 was not computed"):
        scores[2]


@pytest.fixture(scope="module")
def step_bundle(tiny_bundle):
    _, path = tiny_bundle("llama", 4)
    config = load_config(path)
    return config, OnnxBackend(path, config)


def decode(backend, config, params: list[DecodeParams], batch: int, scheme: str = "continuous",
           default_taus: list[float] | None = None):
    """Each request's (tokens, forwards); ``default_taus``: the engine's default tau, changed every step in turn."""
    engine = Engine(backend, config, EngineConfig(max_batch_size=batch, max_seq_len=96, scheme=scheme))
    ids = [engine.add_request(p, param) for p, param in zip(PROMPTS, params)]
    results, steps = {}, 0
    while len(results) < len(ids):
        if default_taus:
            engine.default_tau = default_taus[steps % len(default_taus)]
        steps += 1
        results.update((out.request_id, out.result) for out in engine.step() if out.finished)
    return [(results[i].token_ids, results[i].num_forwards) for i in ids]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("draft", ["masks", "both"])
def test_the_engine_decodes_the_same_tokens_through_the_gate(step_bundle, monkeypatch, batch, draft):
    """Threshold mode at several taus (one per request, rows beside each other at batch 2): the gated steps give
    the logits path's tokens and forwards, and with plain masks some steps did skip the head. (With lookup drafts
    the tiny model's loops fill the window with kept drafts: a step that reads no confidence takes the greedy
    ids, not the gate, and here no step that reads one is proven below tau.)"""
    config, backend = step_bundle
    assert backend.takes_confidence_gate
    params = [DecodeParams(tau=tau, draft=draft, max_new_tokens=24) for tau in (0.5, 0.9, 0.2, 0.05)]
    steps = []
    run = backend.kv.run_gated_step

    def counted(*args):
        ids, logits = run(*args)
        steps.append(logits is None)
        return ids, logits
    monkeypatch.setattr(backend.kv, "run_gated_step", counted)
    gated = decode(backend, config, params, batch)
    monkeypatch.setattr(backend, "takes_confidence_gate", False)
    assert gated == decode(backend, config, params, batch)
    assert not all(steps) and (any(steps) or draft == "both"), steps  # both ways taken


MIXED = [DecodeParams(tau=0.2, draft="lookup", max_new_tokens=15), DecodeParams(mode="verify", max_new_tokens=15),
         DecodeParams(mode="ar", max_new_tokens=15), DecodeParams(tau=0.1, max_new_tokens=3)]


@pytest.mark.parametrize("scheme, params, default_taus", [
    ("block", [DecodeParams(tau=t, draft=d, max_new_tokens=20) for t, d in
               ((0.5, "masks"), (0.1, "both"), (0.3, "masks"), (0.05, "both"))], None),
    ("block", MIXED, None),
    ("continuous", MIXED, None),
    ("continuous", [DecodeParams(tau=0.1, max_new_tokens=20, stop_ids=frozenset(range(0, 400, 3)))] * 4, None),
    ("continuous", [DecodeParams(tau=None, draft=d, max_new_tokens=20) for d in ("masks", "both", "lookup", "masks")],
     [0.3, 1.0, 0.05, 0.7]),
    ("continuous", [DecodeParams(tau=t, max_new_tokens=20) for t in (0.1, 1 / 3, 0.7, 0.2)], None),
], ids=["block", "block-mixed", "mixed", "stop-ids", "default-tau-moves", "float32-rounded-taus"])
def test_the_gate_keeps_the_logits_paths_decisions_in_every_scheme_and_mode(step_bundle, monkeypatch, scheme, params,
                                                                            default_taus):
    """Batch 2 (the greedy head's row cap at W 4): block and continuous schemes, verify / AR / threshold rows side by
    side, lookup drafts, small budgets, stop ids, a default tau that changes every step, taus float32 rounds up."""
    config, backend = step_bundle
    gated = decode(backend, config, params, 2, scheme, default_taus)
    monkeypatch.setattr(backend, "takes_confidence_gate", False)
    assert gated == decode(backend, config, params, 2, scheme, default_taus)


def test_rows_the_gate_cannot_skip_for_read_their_logits_without_it(step_bundle, monkeypatch):
    """Sampling, another metric, and a tau below 1 / V (every probability passes it) go without the gate; a row may
    still go through it, untested (tau 1), in a step where it reads no confidence (its last token)."""
    config, backend = step_bundle
    calls, run = [], backend.kv.run_gated_step

    def recorded(*args):
        calls.append(args[-1].copy())
        return run(*args)
    monkeypatch.setattr(backend.kv, "run_gated_step", recorded)
    for params in (DecodeParams(tau=0.5, temperature=0.8, seed=1, max_new_tokens=8),
                   DecodeParams(tau=0.5, metric="margin", max_new_tokens=8),
                   DecodeParams(tau=0.5 / config.vocab_size, max_new_tokens=8)):
        decode(backend, config, [params], 1)
    assert all(np.all(taus == 1) for taus in calls), calls

"""``mars-export --graph fused``: onnxruntime-genai's model-builder graph run at batch 1 (GitHub issue 11).

The fused graph's GroupQueryAttention gives a one-token window other bits than a window of two or
more (bench/builder_step.py, identity rows); the exported graph runs a one-token window's attention as
two rows (an older graph: runtime.backends.fused feeds a pad token), so tau = 1, verify and lookup drafts
stay token-for-token greedy AR on it, as on the step graph.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from support import export
from tiny_models import make_checkpoint
from transformers import AutoTokenizer

from mars_export import fused_graph, model_source
from mars_export.cli import main as export_main
from mars_export.parity import chat_prompt_ids
from runtime import memory
from runtime.backends import fused as fused_module
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import BundleError, load_config
from runtime.decode.batch import run_batch
from runtime.decode.decoder import Decoder
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.kv_cache import KVCache
from runtime.decode.params import DecodeParams
from runtime.serve import resolve_max_batch_size
from runtime.trt_build import TrtBuildOptions, profile_shapes
from runtime.trt_build import main as trt_build_main

MAX_NEW = 24
TEXTS = ["Hi", "Tell me a story about a cat who sails.", "List the planets. " * 6, "1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.fixture(scope="module")
def fused_bundles(tmp_path_factory):
    """(checkpoint, {"float32": bundle, "int8": bundle, "int4": bundle, "untiled": bundle}): one tiny Llama exported with
    --graph fused, W = 4; "untiled" as exports before tile_one_token_windows wrote them (the runtime pads),
    also without the num_logits input and the greedy head (older still)."""
    root = tmp_path_factory.mktemp("fused")
    ckpt = make_checkpoint("llama", root / "ckpt")
    bundles = {"float32": export(str(ckpt), root / "fused", 4, 4, "--mask-token", "<mask>", "--graph", "fused"),
               **{dtype: export(str(ckpt), root / f"fused-{dtype}", 4, 4, "--mask-token", "<mask>", "--graph", "fused",
                                f"--{dtype}") for dtype in ("int8", "int4")}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_graph, "tile_one_token_windows", lambda model: None)
        patch.setattr(fused_graph, "compute_logits_of_last_rows", lambda graph, has_default: None)
        patch.setattr(fused_graph, "add_greedy_head", lambda graph, mask_token_id: False)
        bundles["untiled"] = export(str(ckpt), root / "fused-untiled", 4, 4, "--mask-token", "<mask>", "--graph",
                                    "fused")
    return ckpt, bundles


@pytest.fixture(scope="module", params=["float32", "int8", "int4", "untiled"])
def fused(request, fused_bundles):
    """(backend, config, prompts, bundle dir) of one fused bundle."""
    ckpt, bundles = fused_bundles
    config = load_config(bundles[request.param])
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    prompts = [chat_prompt_ids(tokenizer, text) for text in TEXTS] + [tokenizer.encode("H")]
    return OnnxBackend(bundles[request.param], config), config, prompts, bundles[request.param]


def test_the_bundle_holds_the_builders_graph_and_passed_parity(fused_bundles):
    _, bundles = fused_bundles
    for name, bundle in bundles.items():
        dtype = "float32" if name == "untiled" else name
        config = load_config(bundle)
        assert (config.graph, config.weight_dtype) == ("fused", dtype)
        assert json.loads((bundle / "mars_config.json").read_text())["graph"] == "fused"
        model = onnx.load(bundle / config.onnx_file, load_external_data=False)
        greedy_head = [n for n in model.graph.node if n.name.startswith("/mars_edge/greedy_head/")]
        nodes = [n for n in model.graph.node if n not in greedy_head]
        ops = {node.op_type for node in nodes}
        assert "GroupQueryAttention" in ops and ("MatMulNBits" in ops) == (dtype != "float32")
        has_head = name == "float32"  # not on a quantized graph (its ids are its quantized head's), nor on older exports
        assert (bool(greedy_head), "greedy_ids" in {o.name for o in model.graph.output}) == (has_head, has_head)
        parity = config.parity
        assert ("greedy_head_max_gap" in parity) == has_head
        if dtype == "float32":
            assert parity["max_abs_logit_diff"] < 1e-3
        else:  # quantized again from the float32 weights, in the exporter's blocks
            assert parity["top1_agreement"] >= {"int8": 0.9, "int4": 0.5}[dtype]
            assert parity["weights"]["weight_dtype"] == dtype and not parity["weights"].get("gguf_imported")
        assert not list(bundle.glob("*.data")) and not list(bundle.glob("*reference*"))  # one graph file, no leftovers
        tiled = {p.key: p.value for p in model.metadata_props}.get(fused_module.ONE_TOKEN_WINDOW_KEY)
        assert tiled == (None if name == "untiled" else fused_module.TILED)
        assert sum(n.op_type == "Tile" for n in nodes) == (0 if name == "untiled" else config.num_layers)
        matmuls = sum(n.op_type in ("MatMul", "MatMulNBits") for n in nodes)  # per layer QKV, o, MLP; head
        splits = sum(n.op_type == "Split" for n in nodes)
        assert (matmuls, splits) == ((4 * config.num_layers + 1, config.num_layers) if dtype != "float32"  # gate + up
                                     else (5 * config.num_layers + 1, 0))


def test_a_tiled_graph_runs_a_one_token_window_as_one_token(fused, monkeypatch):
    """The exported graph duplicates a one-token window's attention row itself: the step feeds one token
    (an older, untiled graph gets a pad token after it) with an attention mask of P + 2."""
    backend, config, prompts, bundle = fused
    cache = backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 64, config.dtype)
    cache.reserve(7)
    cache.commit(run_batch(backend, cache, [prompts[1][:5]], config.pad_token_id)[1], [5])
    fed, real = [], backend.fused.kv.binding.bind_cpu_input
    monkeypatch.setattr(backend.fused.kv.binding, "bind_cpu_input",
                        lambda name, array: (fed.append((name, array.shape)), real(name, array))[1])
    logits, presents = run_batch(backend, cache, [prompts[1][5:6]], config.pad_token_id)
    assert backend.fused.is_tiled == (bundle.name != "fused-untiled")
    expected = [("input_ids", (1, 1 if backend.fused.is_tiled else 2)), ("attention_mask", (1, 7))]
    # the untiled bundle is older than num_logits and the greedy head
    assert fed == (expected + [("num_logits", ())] * backend.takes_num_logits + [("num_greedy", ())] * backend.takes_num_greedy
                   + [("confidence_tau", (1,))] * backend.takes_confidence_gate)
    assert logits.shape == (1, 1, config.vocab_size) and np.shares_memory(presents[0][0], cache.keys[0])


def greedy(backend, config, prompts, **params):
    return [Decoder(backend, config).generate(p, DecodeParams(max_new_tokens=MAX_NEW, **params)).token_ids
            for p in prompts]


@pytest.mark.parametrize("params", [{"tau": 1.0}, {"mode": "verify"}, {"mode": "verify", "draft": "lookup"},
                                    {"mode": "verify", "draft": "both"}, {"tau": 1.0, "draft": "both"}],
                         ids=["tau1", "verify", "verify-lookup", "verify-both", "tau1-both"])
def test_lossless_modes_equal_greedy_ar_on_the_fused_graph(fused, params):
    backend, config, prompts, _ = fused
    assert greedy(backend, config, prompts, **params) == greedy(backend, config, prompts, mode="ar")


@pytest.mark.parametrize("params, reads_ids", [({"mode": "ar"}, True), ({"tau": 1.0}, True), ({"mode": "verify"}, True),
                                               ({"mode": "verify", "draft": "both"}, True), ({"tau": 0.5}, True),
                                               ({"tau": 0.5, "metric": "margin"}, False),
                                               ({"mode": "ar", "temperature": 0.7, "seed": 3}, False)],
                         ids=["ar", "tau1", "verify", "verify-both", "tau0.5", "margin", "sampled"])
def test_greedy_steps_read_the_greedy_heads_ids_and_get_the_tokens_of_the_logits(fused_bundles, params, reads_ids,
                                                                                  monkeypatch):
    """On a float32 fused bundle, a decode step whose rows read argmaxes only (greedy, tau >= 1) takes the
    ids of the greedy head (mars_export.greedy_head) instead of the logits, and so does a threshold step through
    the confidence gate (mars_export.confidence_gate); the tokens are those the logits give (the backend told it
    has neither), and other steps (sampling, another metric) still read the logits."""
    ckpt, bundles = fused_bundles
    config = load_config(bundles["float32"])
    backend = OnnxBackend(bundles["float32"], config)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    prompts = [chat_prompt_ids(tokenizer, text) for text in TEXTS]
    assert backend.takes_num_greedy
    calls, step = [], backend.step
    monkeypatch.setattr(backend, "step", lambda *args, **kwargs: (calls.append(kwargs.get("greedy_ids", False)),
                                                                   step(*args, **kwargs))[1])
    with_head = greedy(backend, config, prompts, **params)
    assert any(calls) == reads_ids and (all(calls[-3:]) if reads_ids else True)
    monkeypatch.setattr(backend, "takes_num_greedy", False)
    monkeypatch.setattr(backend, "takes_confidence_gate", False)
    assert with_head == greedy(backend, config, prompts, **params)


@pytest.mark.parametrize("draft", ["masks", "both"])
def test_threshold_steps_through_the_confidence_gate_keep_the_logits_paths_tokens_and_forwards(fused_bundles, draft,
                                                                                                 monkeypatch):
    """A float32 fused bundle has the confidence gate (a required ``confidence_tau`` input): threshold steps at
    several taus give the tokens and forwards of the logits path, some of them with the head skipped."""
    ckpt, bundles = fused_bundles
    config = load_config(bundles["float32"])
    backend = OnnxBackend(bundles["float32"], config)
    assert backend.takes_confidence_gate and "confidence_tau" not in {
        i.name for i in backend.session.get_overridable_initializers()}
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    prompts = [chat_prompt_ids(tokenizer, text) for text in TEXTS]
    skipped, step = [], backend.step

    def recorded(*args, **kwargs):
        out = step(*args, **kwargs)
        if kwargs.get("confidence_tau") is not None:
            skipped.append(out[0][1] is None)
        return out
    monkeypatch.setattr(backend, "step", recorded)

    def decoded():
        return [(r.token_ids, r.num_forwards) for r in (
            Decoder(backend, config).generate(p, DecodeParams(tau=tau, draft=draft, max_new_tokens=MAX_NEW))
            for p, tau in zip(prompts, (0.5, 0.9, 0.2, 0.05)))]
    gated = decoded()
    assert any(skipped) and not all(skipped), skipped  # both ways taken
    monkeypatch.setattr(backend, "takes_confidence_gate", False)
    assert gated == decoded()


@pytest.mark.parametrize("name, match", [
    ("int8", r"no confidence gate .*: the gate exists only on float32 bundles and this one is int8 .*: use a float32 "
             r"bundle \(mars-export without --int8\), or decode without the gate"),
    ("int4", r"only on float32 bundles and this one is int4 .*without --int4\), or decode without the gate"),
    ("untiled", r"no confidence gate .*: this float32 bundle .*exported before the (gate|head) existed \(re-export it "
                r"with mars-export --graph fused\)"),
])
def test_confidence_tau_needs_the_fused_graphs_gate(fused_bundles, name, match):
    """A threshold step asked of a fused graph without the gate is refused, naming why it has none: a quantized
    bundle never has one (exporting it again adds none: use a float32 bundle), a float32 one exported before the
    gate gets it by being exported again. The backend and the fused step say the same."""
    _, bundles = fused_bundles
    config = load_config(bundles[name])
    backend = OnnxBackend(bundles[name], config)
    assert not backend.takes_confidence_gate
    cache = backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 16, config.dtype)
    cache.reserve(config.window)
    taus = np.full(1, 0.5, np.float32)
    with pytest.raises(ValueError, match=match) as raised:
        run_batch(backend, cache, [[5] * config.window], config.pad_token_id, greedy_ids=True, confidence_tau=taus)
    assert config.weight_dtype == "float32" or "re-export" not in str(raised.value)
    ids, positions = np.full((1, config.window), 5, np.int64), np.arange(config.window)[None]
    with pytest.raises(ValueError, match=match):
        backend.fused(ids, positions, cache.past(1), greedy_ids=True, confidence_tau=taus)
    with pytest.raises(ValueError, match="confidence_tau needs greedy_ids=True"):
        backend.step(ids, positions, None, cache.past(1), confidence_tau=taus)


def test_greedy_ids_need_the_greedy_head(fused_bundles):
    """Asking a fused graph without the head (quantized, or exported before it) for ids is an error naming the fix
    (a step graph without it: tests/test_step_greedy_head.py)."""
    _, bundles = fused_bundles
    for bundle, match in ((bundles["int8"], "no greedy head .*; read the logits: an --int8 bundle's argmaxes"),
                          (bundles["int4"], "no greedy head .*; read the logits: an --int4 bundle's argmaxes"),
                          (bundles["untiled"], "no greedy head .*; re-export it with mars-export --graph fused")):
        config = load_config(bundle)
        backend = OnnxBackend(bundle, config)
        assert not backend.takes_num_greedy
        cache = backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 16, config.dtype)
        cache.reserve(config.window)
        with pytest.raises(ValueError, match=match):
            run_batch(backend, cache, [[5] * config.window], config.pad_token_id, greedy_ids=True)


def fed_in_windows(backend, config, ids: list[int], cuts: list[int], capacity: int | None = None,
                   cache=None) -> np.ndarray:
    """Logits [N, V] of ``ids`` fed in windows of ``cuts`` through run_batch and a cache, as the
    engine feeds them: the backend's own (reserved for all ``ids`` at once, or per window from
    ``capacity`` on), or ``cache``."""
    cache = cache or backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 64, config.dtype)
    cache.reserve(capacity or len(ids) + 1)
    logits, start = [], 0
    for width in cuts:
        cache.reserve(int(cache.lengths[0]) + width)
        out, presents = run_batch(backend, cache, [ids[start:start + width]], config.pad_token_id)
        cache.commit(presents, [width])
        logits.append(out[0])
        start += width
    return np.concatenate(logits)


def test_a_token_gets_the_same_logits_in_any_window(fused):
    """The rule the backend keeps: fed one at a time, two, three or all at once, every position's
    logits are bit-identical (without the one-token padding the one-at-a-time cut differs)."""
    backend, config, prompts, _ = fused
    ids = prompts[1][:12]
    whole = fed_in_windows(backend, config, ids, [12])
    for cuts in ([1] * 12, [2] * 6, [3] * 4, [1, 4, 2, 5]):
        assert np.array_equal(fed_in_windows(backend, config, ids, cuts), whole), cuts


def test_the_kv_cache_is_written_in_place_and_grows_without_changing_a_logit(fused, monkeypatch):
    """The engine's cache for a fused bundle is the graph's buffer: a step writes its entries at the
    committed length, commit copies nothing, and a cache that doubles as the sequence grows gives
    the logits of one allocated at full size."""
    backend, config, prompts, _ = fused
    ids = (prompts[2] * 3)[:40]
    cache = backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 64, config.dtype)
    assert isinstance(cache, fused_module.FusedKVCache) and cache.capacity == 16
    cache.reserve(3)
    _, presents = run_batch(backend, cache, [ids[:3]], config.pad_token_id)
    assert np.shares_memory(presents[0][0], cache.keys[0]) and np.any(cache.keys[0][0, :, :3])
    with monkeypatch.context() as patch:
        patch.setattr(KVCache, "_write", lambda *args: pytest.fail("the entries were copied"))
        cache.commit(presents, [3])
    assert cache.lengths[0] == 3
    cache.reserve(16)
    assert cache.capacity == 32  # room for a one-token window's second row at position 16
    grown = fed_in_windows(backend, config, ids, [5, 4] * 4 + [4], capacity=16)
    assert np.array_equal(grown, fed_in_windows(backend, config, ids, [5, 4] * 4 + [4]))


def test_a_prefill_forward_skips_the_output_head_and_writes_the_same_kv(fused):
    """``step(..., logits=False)``: no logits rows (an older graph computes and drops them), the same KV."""
    backend, config, prompts, _ = fused
    assert backend.takes_num_logits == (backend.fused.is_tiled)  # the untiled bundle is also older than num_logits
    ids = prompts[1][:7]
    caches = [backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 64, config.dtype)
              for _ in range(2)]
    outputs = []
    for cache, logits in zip(caches, (True, False)):
        cache.reserve(len(ids))
        out, presents = backend.step(np.array([ids]), np.arange(len(ids))[None], None, cache.past(1), logits=logits)
        cache.commit(presents, [len(ids)])
        outputs.append(out)
    assert outputs[0].shape == (1, 7, config.vocab_size) and outputs[1].shape == (1, 0, config.vocab_size)
    assert all(np.array_equal(a[:, :, :7], b[:, :, :7]) for a, b in zip(caches[0].keys + caches[0].values,
                                                                       caches[1].keys + caches[1].values))


def test_a_fused_cache_has_one_slot_and_a_plain_cache_also_runs_the_graph(fused):
    """The graph also writes into a plain KVCache (whose commit copies each entry onto itself), and
    into new buffers where the past leaves no room for a window and its pad."""
    backend, config, prompts, _ = fused
    with pytest.raises(ValueError, match="1 KV slot.*--graph step"):
        backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 64, config.dtype, 2)
    ids = prompts[1][:9]
    plain = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 64, config.dtype)
    assert np.array_equal(fed_in_windows(backend, config, ids, [1, 3, 1, 4], cache=plain),
                          fed_in_windows(backend, config, ids, [9]))
    full = fed_in_windows(backend, config, ids, [8, 1], capacity=9, cache=KVCache(config.num_layers, config.num_kv_heads,
                                                                       config.head_dim, 9, config.dtype))
    assert np.array_equal(full, fed_in_windows(backend, config, ids, [9]))  # no room for the pad: new buffers


@pytest.mark.parametrize("arch, quantize", [("qwen2", []), ("qwen3", []), ("qwen3", ["--int8"])])
def test_qwen_fused_graphs_keep_the_identity_in_one_token_windows(arch, quantize, tmp_path):
    """Qwen2's builder graph packs QKV like Llama's; Qwen3's normalizes Q and K apart and feeds the attention
    three inputs (split from the builder's packed Q/K/V MatMul): every one is tiled, and a token gets the same
    logits in windows of 1 as in one window."""
    ckpt = make_checkpoint(arch, tmp_path / "ckpt")
    bundle = export(str(ckpt), tmp_path / "fused", 4, 4, "--mask-token", "<mask>", "--graph", "fused", *quantize)
    config = load_config(bundle)
    model = onnx.load(bundle / config.onnx_file, load_external_data=False)
    inputs_per_attention = 3 if arch == "qwen3" else 1
    assert sum(n.op_type == "Tile" for n in model.graph.node) == inputs_per_attention * config.num_layers
    backend = OnnxBackend(bundle, config)
    ids = list(range(5, 17))
    whole = fed_in_windows(backend, config, ids, [12])
    for cuts in ([1] * 12, [3, 1, 4, 1, 3]):
        assert np.array_equal(fed_in_windows(backend, config, ids, cuts), whole), cuts


def test_a_phi3_config_the_builder_fails_on_is_refused_naming_the_step_graph(tmp_path, capsys):
    """The builder takes a Phi3 config whose max_position_embeddings differs from original_max_position_embeddings
    (here Phi3Config's default 4096) for Phi-3 128k and fails (KeyError: 'multi_cache') without longrope scaling;
    the export says so in one line before the builder runs. With the two equal the builder's graph passes parity."""
    ckpt = make_checkpoint("phi3", tmp_path / "ckpt")
    code = export_main([str(ckpt), "-o", str(tmp_path / "fused"), "--block", "4", "--mask-token", "<mask>",
                        "--graph", "fused"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert code == 2 and len(errors) == 1 and "export it with --graph step" in errors[0]
    assert "original_max_position_embeddings 4096" in errors[0] and not (tmp_path / "fused").exists()
    same = make_checkpoint("phi3", tmp_path / "same", original_max_position_embeddings=512)
    assert load_config(export(str(same), tmp_path / "fused", 4, 4, "--mask-token", "<mask>", "--graph",
                              "fused")).graph == "fused"


def test_one_sequence_at_a_time(fused):
    """Batch 1: an engine with more slots is refused naming the fix; the server defaults to 1; a
    second row fed anyway is refused."""
    backend, config, prompts, _ = fused
    with pytest.raises(ValueError, match="exceeds the backend's largest batch 1 .*--graph step"):
        Engine(backend, config, EngineConfig(max_batch_size=2))
    assert resolve_max_batch_size(None, backend.max_batch) == 1
    with pytest.raises(ValueError, match="batch 1"):
        backend.step(np.ones((2, 2), np.int64), np.tile(np.arange(2), (2, 1)), None, None)


def test_gpu_providers_tensorrt_and_other_precisions_are_refused(fused_bundles, capsys):
    ckpt, bundles = fused_bundles
    config = load_config(bundles["float32"])
    with pytest.raises(ValueError, match="cpu provider only.*--graph step"):
        OnnxBackend(bundles["float32"], config, "cuda")
    with pytest.raises(ValueError, match="TensorRT does not build.*--graph step"):
        profile_shapes(config, TrtBuildOptions())
    for flag in ("--fp16", "--trt"):
        assert export_main([str(ckpt), "-o", str(ckpt.parent / "never"), "--graph", "fused", flag]) == 2
        assert f"{flag} needs --graph step" in capsys.readouterr().err
    assert not (ckpt.parent / "never").exists()
    assert trt_build_main([str(bundles["float32"])]) == 2  # the graph is refused before TensorRT is looked for
    err = capsys.readouterr().err
    assert "--graph step" in err and "TensorRT is not available" not in err


def test_without_the_model_builder_the_export_stops_before_loading_the_model(fused_bundles, monkeypatch, capsys):
    ckpt, _ = fused_bundles
    monkeypatch.setattr(fused_graph, "find_spec", lambda name: None)
    monkeypatch.setattr(model_source, "load_model", lambda *args: pytest.fail("the model was loaded"))
    assert export_main([str(ckpt), "-o", str(ckpt.parent / "never"), "--block", "4", "--graph", "fused"]) == 2
    assert "pip install 'mars-edge[fused]'" in capsys.readouterr().err
    assert not (ckpt.parent / "never").exists()


def test_memory_sizing_of_a_fused_bundle(fused_bundles, capsys):
    """Batch 1 only, the KV cache counted once (the engine's slot cache is the graph's buffer)."""
    bundle = fused_bundles[1]["float32"]
    assert memory.main([str(bundle), "--batch", "1", "4", "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "batch 4 left out: this bundle runs at most 1 sequence(s) at once" in out
    per_token = 2 * 2 * 2 * 16 * 4  # tiny llama: 2 layers, 2 KV heads, 16 dims, fp32
    assert f"KV cache {per_token:,} bytes per token = 2 x 2 layers x 2 KV heads x 16 dims x 4 B;" in out
    assert "B=1:" in out and "B=4:" not in out


@pytest.mark.parametrize("batches", [["2"], ["4", "8"]])
def test_memory_sizing_of_a_fused_bundle_at_no_batch_it_runs_is_refused(fused_bundles, capsys, batches):
    """The runtime runs a fused bundle at batch 1 only, whatever the window (the engine refuses more slots, the
    fused step more rows): sizing it only at larger batches is one error line and exit status 2, not an empty
    table."""
    bundle = fused_bundles[1]["float32"]
    assert memory.main([str(bundle), "--batch", *batches, "--context", "64"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"error: bundle {bundle} ")
    assert (f"runs at most 1 sequence(s) at once (a fused bundle), so --batch {' '.join(batches)} leaves nothing to "
            "size; pass --batch 1, or size a bundle exported with --graph step") in captured.err
    config = load_config(bundle)
    with pytest.raises(ValueError, match="exceeds the backend's largest batch 1"):
        Engine(OnnxBackend(bundle, config), config, EngineConfig(max_batch_size=2))


def test_a_step_graph_config_cannot_say_fused(fused_bundles, tiny_bundle, tmp_path):
    """The graph field must match the file: a step graph under graph "fused" is one error line."""
    _, bundle = tiny_bundle("llama", 4)
    copy = tmp_path / "bundle"
    copy.mkdir()
    for path in bundle.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    raw = json.loads((copy / "mars_config.json").read_text())
    (copy / "mars_config.json").write_text(json.dumps({**raw, "graph": "fused"}))
    with pytest.raises(BundleError, match="not the fused graph .*--graph fused"):
        OnnxBackend(copy, load_config(copy))
    (copy / "mars_config.json").write_text(json.dumps({**raw, "graph": "other"}))
    with pytest.raises(BundleError, match="graph 'other'"):
        load_config(copy)


"""TensorRT: optimization profiles and the trtexec line, clear errors without TensorRT, and the
backend, builder, device-resident KV cache and server limits run against the TensorRT contract
stand-in (tests/trt_standin.py: the real code, TensorRT's documented behaviour, onnxruntime's
math); on a machine with TensorRT and an NVIDIA GPU, a tiny engine against onnxruntime too."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mars_export import cli as export_cli
from runtime import bundle as bundle_io
from runtime import trt_build
from runtime.bundle import load_config
from runtime.trt_build import TrtBuildOptions, profile_shapes, trtexec_command


def gpu_missing_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        trt_build.require_tensorrt()
        from runtime.backends.cuda_runtime import CudaRuntime
        CudaRuntime()
    except RuntimeError as e:
        return f"needs TensorRT, cuda-python and an NVIDIA GPU: {e}"
    return None


GPU_MISSING = gpu_missing_reason()


def test_profile_keeps_tied_dimensions_equal(tiny_bundle):
    _, bundle = tiny_bundle("llama", 4)
    config = load_config(bundle)
    shapes = profile_shapes(config, TrtBuildOptions(max_batch=6, opt_batch=2, max_context=256, opt_context=64))
    assert set(shapes) == set(bundle_io.input_names(config.num_layers))
    for which, (batch, past) in enumerate([(1, 4), (2, 64), (6, 256)]):  # min (S = W), opt, max
        assert shapes["input_ids"][which] == shapes["position_ids"][which] == (batch, 4)
        assert shapes["attention_mask"][which] == (batch, 1, 4, past)  # last axis = S, the KV inputs' third
        for name in bundle_io.input_names(config.num_layers)[3:]:
            assert shapes[name][which] == (batch, config.num_kv_heads, past, config.head_dim)
    assert trt_build.profile_limits(shapes.__getitem__) == (6, 256)  # largest batch and past (capacity) it may feed


@pytest.mark.parametrize("options, message", [
    ({"max_context": 4}, "need window (4) < opt context"),
    ({"max_context": 100_000}, "<= the model's context (512)"),
    ({"max_context": 64, "opt_context": 128}, "opt context (128) <= max context (64)"),
])
def test_profile_rejects_bad_contexts(tiny_bundle, options, message):
    _, bundle = tiny_bundle("llama", 4)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        profile_shapes(load_config(bundle), TrtBuildOptions(**options))


def test_bad_batch_options():
    with pytest.raises(ValueError, match="need 1 <= opt batch <= max batch"):
        TrtBuildOptions(max_batch=2, opt_batch=4)


@pytest.mark.parametrize("args, message", [
    (["BUNDLE", "--max-batch", "two"], "argument --max-batch: invalid int value: 'two'"),
    (["BUNDLE", "--bogus"], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: bundle")])
def test_a_bad_command_line_is_one_error_line(capsys, args, message):
    """argparse's refusals printed its usage block before 'python -m runtime.trt_build: error: ...'; a bad option
    value or bundle was one 'error:' line, exit status 2: so are these now (runtime.command_line)."""
    assert trt_build.main(args) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {message}"), line


def test_trtexec_line(tiny_bundle, capsys):
    _, bundle = tiny_bundle("llama", 4)
    config = load_config(bundle)
    line = trtexec_command(config, TrtBuildOptions(max_batch=8, max_context=512, opt_context=128, workspace_mib=1024))
    assert line.startswith("trtexec --onnx=model.onnx --saveEngine=engine.plan --stronglyTyped --noTF32")  # fp32
    assert "--minShapes=input_ids:1x4,position_ids:1x4,attention_mask:1x1x4x4,past_key_values.0.key:1x2x4x16," in line
    assert "--optShapes=input_ids:1x4,position_ids:1x4,attention_mask:1x1x4x128,past_key_values.0.key:1x2x128x16," \
        in line
    assert "--maxShapes=input_ids:8x4,position_ids:8x4,attention_mask:8x1x4x512," in line
    assert "past_key_values.1.value:8x2x512x16" in line and line.endswith("--memPoolSize=workspace:1024")
    assert trt_build.main([str(bundle), "--print-trtexec", "--max-context", "512"]) == 0  # no TensorRT needed
    assert "--maxShapes=input_ids:8x4" in capsys.readouterr().out


def test_backend_module_imports_without_tensorrt_or_torch():
    script = ("import sys; sys.modules['torch'] = None; sys.modules['tensorrt'] = None; sys.modules['cuda'] = None; "
              "import runtime.backends.trt, runtime.trt_build, runtime.memory, runtime.backends.device_kv_cache; print('ok')")
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.skipif(GPU_MISSING is None, reason="TensorRT and a GPU are present: the missing-TensorRT path is moot")
def test_missing_tensorrt_names_the_fix(tiny_bundle, tmp_path, capsys):
    _, original = tiny_bundle("llama", 4)
    bundle = shutil.copytree(original, tmp_path / "bundle")
    (bundle / "engine.plan").write_bytes(b"not built here")
    config = load_config(bundle)
    config = type(config)(**{**config.__dict__, "engine_file": "engine.plan"})
    from runtime.backends.trt import TrtBackend
    with pytest.raises(RuntimeError, match=r"pip install 'mars-edge\[trt\]'"):
        TrtBackend(bundle, config)
    code = export_cli.main(["default", "-o", str(tmp_path / "b"), "--trt"])  # fails before loading any model
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'mars-edge[trt]'" in err[0]


def test_backend_without_engine_is_refused(tiny_bundle):
    _, bundle = tiny_bundle("llama", 4)
    from runtime.bundle import BundleError
    from runtime.backends.trt import TrtBackend
    with pytest.raises(BundleError, match="has no TensorRT engine; build one with python -m runtime.trt_build"):
        TrtBackend(bundle, load_config(bundle))


def compare_with_onnxruntime(bundle, tolerance: float) -> None:
    """Build a tiny engine (batch 1..2, past = cache capacity 4..64), step it with changing batch, capacity
    and row lengths, and compare logits and presents with onnxruntime (host past: the parity path)."""
    from runtime.backends.onnx import OnnxBackend
    from runtime.backends.trt import TrtBackend
    from runtime.decode.batch import window_mask
    assert trt_build.main([str(bundle), "--max-batch", "2", "--max-context", "64", "--opt-context", "32"]) == 0
    config = load_config(bundle)
    assert json.loads((bundle / "mars_config.json").read_text())["engine_file"] == "engine.plan"
    trt, onnx = TrtBackend(bundle, config), OnnxBackend(bundle, config)
    assert (trt.max_batch, trt.max_past) == (2, 64)  # read from the engine's optimization profile
    rng = np.random.default_rng(0)
    # (row lengths, capacity S): buffers grow, then are reused; S = W and S = the profile's largest included
    for lengths, capacity in [([0], 4), ([0, 0], 16), ([37, 10], 48), ([60], 64), ([5, 0], 16)]:
        batch, lengths = len(lengths), np.array(lengths, np.int64)
        ids = rng.integers(0, config.vocab_size, (batch, 4))  # [n, W]
        positions = lengths[:, None] + np.arange(4)[None]  # [n, W]
        mask = window_mask(lengths, capacity, 4)  # [n, 1, W, S]
        past = [tuple(rng.standard_normal((batch, config.num_kv_heads, capacity, config.head_dim)).astype(np.float32)
                      for _ in range(2)) for _ in range(config.num_layers)]
        kept = [(k.copy(), v.copy()) for k, v in past]
        want_logits, want_kv = onnx.step(ids, positions, mask, [(k.copy(), v.copy()) for k, v in past])  # in place
        got_logits, got_kv = trt.step(ids, positions, mask, past)
        assert got_logits.shape == want_logits.shape and got_logits.dtype == np.float32
        assert np.abs(got_logits - want_logits).max() <= tolerance * np.abs(want_logits).max()
        for (gk, gv), (wk, wv), (k, v), (pk, pv) in zip(got_kv, want_kv, past, kept):
            assert gk.shape == wk.shape == (batch, config.num_kv_heads, capacity, config.head_dim)
            assert np.allclose(gk, wk, atol=tolerance) and np.allclose(gv, wv, atol=tolerance)
            assert np.array_equal(k, pk) and np.array_equal(v, pv)  # the past is read, never written
            for b, length in enumerate(lengths):  # the presents are the past outside the row's window
                outside = np.r_[0:length, length + 4:capacity]
                assert np.array_equal(gk[b, :, outside], pk[b, :, outside])
    trt.close()


@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
def test_tiny_engine_matches_onnxruntime(tiny_bundle, tmp_path):
    _, original = tiny_bundle("qwen2", 4)
    compare_with_onnxruntime(shutil.copytree(original, tmp_path / "bundle"), tolerance=1e-3)  # TF32 off: fp32


# --------------------------------------------------------------------------------- the TensorRT contract stand-in
@pytest.fixture
def standin(monkeypatch):
    """TensorRT and cuda-python replaced by the contract stand-in for this test; byte counters reset."""
    import trt_standin
    trt_standin.install(monkeypatch)
    trt_standin.cuda.STATS.clear()
    return trt_standin


@pytest.fixture
def engine_bundle(tiny_bundle, tmp_path, standin):
    """A copy of the tiny Qwen2 bundle (W = 4, fp32) with a stand-in engine for batch 1..2, past 0..60."""
    _, original = tiny_bundle("qwen2", 4)
    bundle = shutil.copytree(original, tmp_path / "bundle")
    assert trt_build.main([str(bundle), "--max-batch", "2", "--max-context", "64", "--opt-context", "32"]) == 0
    return bundle


def test_standin_engine_matches_onnxruntime(tiny_bundle, tmp_path, standin):
    _, original = tiny_bundle("qwen2", 4)
    compare_with_onnxruntime(shutil.copytree(original, tmp_path / "bundle"), tolerance=1e-5)  # same math


def test_window_comes_from_the_profile_not_the_dynamic_shape(engine_bundle, standin):
    """W is a dynamic axis of the graph: the engine reports -1 for it, the profile fixes it."""
    from runtime.bundle import BundleError
    from runtime.backends.trt import TrtBackend
    config = load_config(engine_bundle)
    backend = TrtBackend(engine_bundle, config)
    assert tuple(backend.engine.get_tensor_shape("input_ids")) == (-1, -1)  # [B, W], both dynamic
    fresh = backend.engine.create_execution_context()  # the backend's own has had its inputs set (the KV check)
    assert tuple(fresh.get_tensor_shape("logits"))[:2] == (-1, -1)  # [B, W, V]: unknown before inputs
    with pytest.raises(BundleError, match="takes windows of 4..4 tokens but mars_config.json says 8"):
        TrtBackend(engine_bundle, replace(config, window=8, block_size=4))


def test_fp32_engine_is_built_without_tf32(engine_bundle, standin):
    assert standin.plan_header(engine_bundle / "engine.plan")["tf32"] is False  # TF32 is on unless cleared
    assert standin.plan_header(engine_bundle / "engine.plan")["strongly_typed"] is True


def test_the_engine_is_built_from_the_graph_without_the_greedy_head(tiny_bundle, engine_bundle, standin):
    """A float32 CPU export carries the greedy head (onnxruntime's MatMulNBits, which TensorRT does not parse):
    TensorRT parses the step graph without it, and the copy written for it is gone."""
    _, original = tiny_bundle("qwen2", 4)
    assert bundle_io.has_greedy_head(load_config(original))
    engine = standin.Runtime(None).deserialize_cuda_engine((engine_bundle / "engine.plan").read_bytes())
    assert bundle_io.NUM_GREEDY not in engine.names and bundle_io.GREEDY_IDS not in engine.names
    assert [o.name for o in engine.session.get_outputs()] == bundle_io.output_names(load_config(original).num_layers)
    assert sorted(p.name for p in engine_bundle.iterdir()) == sorted([*(p.name for p in original.iterdir()),
                                                                      "engine.plan"])


def test_engine_dtypes_and_kv_dtype_are_checked(engine_bundle, standin):
    """Nothing is converted silently: a past of another dtype, a cache of another dtype and an
    engine whose tensors differ from the bundle's dtype are refused by name."""
    from runtime.bundle import BundleError
    from runtime.backends.trt import TrtBackend
    config = load_config(engine_bundle)
    backend = TrtBackend(engine_bundle, config)
    assert backend.kv_dtype == np.float32
    ids = np.zeros((1, 4), np.int64)  # [B, W]
    past = [(np.zeros((1, config.num_kv_heads, 4, config.head_dim), np.float16),) * 2] * config.num_layers
    with pytest.raises(ValueError, match="past_key_values.0.key is float16 but the engine takes float32"):
        backend.step(ids, ids, np.ones((1, 1, 4, 4), bool), past)
    with pytest.raises(ValueError, match="KV dtype float16 differs from the engine's float32"):
        backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 60, np.float16)
    with pytest.raises(BundleError) as refused:  # the engine's KV dtype: checked with every tensor's dtype
        TrtBackend(engine_bundle, replace(config, dtype="float16", weight_dtype=None))
    assert str(refused.value) == f"{engine_bundle / 'engine.plan'}: tensor past_key_values.0.key is float32 in the " \
                                 "engine but float16 in a float16 bundle; rebuild the engine from this bundle's ONNX file"


@pytest.mark.parametrize("name, by", [("num_kv_heads", 1), ("head_dim", 8), ("vocab_size", 100)])
def test_engine_disagreeing_with_the_config_is_refused_at_load(engine_bundle, standin, name, by):
    """The onnxruntime backend's check (runtime.bundle.check_graph_fits_config) on the engine's own shapes:
    a mars_config.json that disagrees with the engine fails at load with one line, not at the first step."""
    from runtime.backends.loading import load_backend
    from runtime.bundle import BundleError
    path = engine_bundle / "mars_config.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, name: raw[name] + by}))
    with pytest.raises(BundleError) as refused:
        load_backend(engine_bundle / "engine.plan")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(str(engine_bundle / "engine.plan"))
    assert f"has {name} {raw[name]} but mars_config.json says {raw[name] + by}; rebuild the engine (python -m " \
           f"runtime.trt_build {engine_bundle}) or re-export the bundle (mars-export --trt)" in message


def test_profile_bounds_are_enforced(engine_bundle, standin):
    """set_input_shape refuses a batch past the profile; the engine and server settings stay inside it."""
    from runtime.decode.engine import Engine, EngineConfig
    from runtime.backends.trt import TrtBackend
    config = load_config(engine_bundle)
    backend = TrtBackend(engine_bundle, config)
    ids = np.zeros((3, 4), np.int64)  # [B, W]: batch 3 > 2
    past = [(np.zeros((3, config.num_kv_heads, 4, config.head_dim), np.float32),) * 2] * config.num_layers
    with pytest.raises(ValueError, match=r"input input_ids of shape \(3, 4\) is outside the engine's optimization"):
        backend.step(ids, ids, np.ones((3, 1, 4, 4), bool), past)
    with pytest.raises(ValueError, match="max_batch_size 3 exceeds the backend's largest batch 2"):
        Engine(backend, config, EngineConfig(max_batch_size=3))
    with pytest.raises(ValueError, match=r"max_seq_len 100 exceeds the 64 positions a slot can hold \(the backend's "
                                         "largest past"):
        Engine(backend, config, EngineConfig(max_batch_size=2, max_seq_len=100))
    assert Engine(backend, config, EngineConfig(max_batch_size=2)).cache.max_len == 64


def test_refused_address_and_close(engine_bundle, standin):
    """A refused set_tensor_address raises; close frees every buffer and destroys the stream."""
    from runtime.backends.trt import TrtBackend
    config = load_config(engine_bundle)
    allocated = set(standin.cuda.MEMORY.blocks)
    backend = TrtBackend(engine_bundle, config)
    cache = backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 60, np.float32)
    ids = np.zeros((1, 4), np.int64)  # [B, W]
    backend.step(ids, np.arange(4)[None], np.ones((1, 1, 4, cache.capacity), bool), cache.past(1))
    assert set(standin.cuda.MEMORY.blocks) > allocated
    stream = backend.stream
    cache.close()
    backend.close()
    assert set(standin.cuda.MEMORY.blocks) == allocated and standin.cuda.STREAMS[int(stream)].is_destroyed
    backend = TrtBackend(engine_bundle, config)
    backend.context.set_tensor_address = lambda name, ptr: False  # as TensorRT answers a name it does not know
    past = [(np.zeros((1, config.num_kv_heads, 4, config.head_dim), np.float32),) * 2] * config.num_layers
    with pytest.raises(RuntimeError, match="TensorRT refused the address of input_ids"):
        backend.step(ids, np.arange(4)[None], np.ones((1, 1, 4, 4), bool), past)


@pytest.mark.parametrize("scheme", ["continuous", "block"])
def test_engine_on_the_device_cache_equals_onnxruntime(tiny_bundle, engine_bundle, standin, scheme):
    """tau = 1 and verify mode through the engine: the TensorRT backend with its device-resident
    cache gives the onnxruntime backend's tokens, batch 2, as the cache grows to the profile's past."""
    from transformers import AutoTokenizer

    from mars_export.parity import chat_prompt_ids
    from runtime.decode.decoder import DecodeParams
    from runtime.backends.device_kv_cache import DeviceKVCache
    from runtime.decode.engine import Engine, EngineConfig
    from runtime.backends.onnx import OnnxBackend
    from runtime.backends.trt import TrtBackend
    ckpt, _ = tiny_bundle("qwen2", 4)
    config = load_config(engine_bundle)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    prompts = [chat_prompt_ids(tokenizer, text)[:20] for text in ("Two plus two is", "def add(a, b):", "Hello")]
    trt = TrtBackend(engine_bundle, config)
    for params in [DecodeParams(tau=1.0, max_new_tokens=30, stop_ids=frozenset()),
                   DecodeParams(mode="verify", max_new_tokens=30, stop_ids=frozenset())]:
        engine = Engine(trt, config, EngineConfig(max_batch_size=2, scheme=scheme))
        assert isinstance(engine.cache, DeviceKVCache)
        got = [r.token_ids for r in engine.generate(prompts, params)]
        assert engine.cache.capacity > 16  # grew (device-side copy of the prefix) past its first size
        want = Engine(OnnxBackend(engine_bundle, config), config, EngineConfig(max_batch_size=2, scheme=scheme))
        assert got == [r.token_ids for r in want.generate(prompts, params)]
        engine.cache.close()


def test_step_traffic_matches_the_bytes_moved(engine_bundle, standin):
    """step_traffic, computed from the code paths, equals what the stand-in counted each way:
    host past (whole past in, every present [n, H, S, D] out) and device cache (window inputs in,
    logits out; the commit copies the W entries of each row at its positions, device-side)."""
    from runtime.backends.trt import TrtBackend, step_traffic
    from runtime.decode.batch import window_mask
    config = load_config(engine_bundle)
    backend = TrtBackend(engine_bundle, config)
    cache = backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 64, np.float32, num_slots=2)
    cache.reserve(40)  # capacity S = 64
    cache.lengths[:] = [3, 9]  # committed entries (zeros: the cache is zero-filled)
    ids = np.zeros((2, 4), np.int64)  # [n, W]
    positions = cache.lengths[:, None] + np.arange(4)[None]  # [n, W]
    mask = window_mask(cache.lengths, cache.capacity, 4)  # [n, 1, W, S]
    host_past = [(np.zeros((2, config.num_kv_heads, cache.capacity, config.head_dim), np.float32),) * 2
                 ] * config.num_layers
    for past, is_device in [(host_past, False), (cache.past(2), True)]:
        standin.cuda.STATS.clear()
        _, presents = backend.step(ids, positions, mask, past)
        want = step_traffic(config, 2, cache.capacity, is_device)
        assert standin.cuda.STATS["h2d"] == want["host_to_device"] and standin.cuda.STATS["d2h"] == want["device_to_host"]
        assert standin.cuda.STATS["d2d"] == 0  # the step itself copies nothing device-side
    assert standin.cuda.STATS["h2d_pageable"] == standin.cuda.STATS["d2h_pageable"] == 0  # pinned staging only
    cache.commit(presents, [4, 4])  # every new entry of both rows: the bound step_traffic gives
    backend.cuda.synchronize(backend.stream)  # the commit is queued on the stream, like the forward
    assert standin.cuda.STATS["d2d"] == want["device_to_device"]
    assert list(cache.lengths) == [7, 13]
    for buffer, present in [(cache.keys[0], presents[0][0]), (cache.values[-1], presents[-1][1])]:
        kv = standin.cuda.read_device(buffer.ptr, buffer.shape, np.float32)  # [N, H, S, D]
        new = standin.cuda.read_device(present.ptr, present.shape, np.float32)  # [n, H, S, D]
        assert new.shape == kv.shape  # the presents have the past's shape
        for row, length in enumerate([3, 9]):
            np.testing.assert_array_equal(kv[row, :, length:length + 4], new[row, :, length:length + 4])
            assert np.abs(kv[row, :, length:length + 4]).max() > 0  # the window's entries, at their positions
            assert not kv[row, :, :length].any() and not kv[row, :, length + 4:].any()  # nothing else written
        assert not np.isnan(kv).any()  # zero-filled: masked positions hold finite numbers


def test_presents_have_buffers_of_their_own(engine_bundle, standin):
    """TensorRT does not promise that an output may alias an input: no present is bound at an address
    inside a past (or any input), and a step leaves the device cache as it was until the commit."""
    from runtime.backends.trt import TrtBackend
    from runtime.decode.batch import window_mask
    config = load_config(engine_bundle)
    backend = TrtBackend(engine_bundle, config)
    cache = backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 64, np.float32, num_slots=2)
    lengths = np.array([0, 2], np.int64)
    backend.cuda.synchronize(backend.stream)  # the cache's zero fill is queued on the stream
    before = [standin.cuda.read_device(b.ptr, b.shape, np.float32).copy() for b in cache.keys + cache.values]
    positions = lengths[:, None] + np.arange(4)[None]  # [n, W]
    mask = window_mask(lengths, cache.capacity, 4)  # [n, 1, W, S]
    backend.step(np.ones((2, 4), np.int64), positions, mask, cache.past(2))
    backend.cuda.synchronize(backend.stream)
    after = [standin.cuda.read_device(b.ptr, b.shape, np.float32) for b in cache.keys + cache.values]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    context, engine = backend.context, backend.engine
    spans = {}
    for name in bundle_io.input_names(config.num_layers) + bundle_io.output_names(config.num_layers):
        shape, item = context.get_tensor_shape(name), np.dtype(standin.nptype(engine.get_tensor_dtype(name))).itemsize
        spans[name] = (context.addresses[name], context.addresses[name] + int(np.prod(shape)) * item)
    for out in bundle_io.output_names(config.num_layers):
        for name in bundle_io.input_names(config.num_layers):
            (a, b), (c, d) = spans[out], spans[name]
            assert b <= c or d <= a, f"{out} overlaps {name}"


def test_engine_of_an_older_step_graph_is_refused(tiny_bundle, tmp_path, standin):
    """An engine whose presents hold only the W new entries ([n, H, W, D], graphs before 2026-12-02) is refused
    at load: its dynamic axes read -1, so the check compares the shapes TensorRT infers over the profile's."""
    import onnx

    from runtime.bundle import BundleError
    from runtime.backends.trt import TrtBackend
    _, original = tiny_bundle("qwen2", 4)
    bundle = shutil.copytree(original, tmp_path / "bundle")
    model = onnx.load(str(bundle / "model.onnx"))
    for value in model.graph.output[1:1 + 2 * load_config(bundle).num_layers]:  # present.{i}.*: the old shape [batch, H, window, D]
        value.type.tensor_type.shape.dim[2].dim_param = "window"
    onnx.save(model, str(bundle / "model.onnx"))
    assert trt_build.main([str(bundle), "--max-batch", "2", "--max-context", "64", "--opt-context", "32"]) == 0
    config = load_config(bundle)
    backend_engine = standin.Runtime(None).deserialize_cuda_engine((bundle / "engine.plan").read_bytes())
    assert backend_engine.get_tensor_shape("present.0.key")[2] == backend_engine.get_tensor_shape(
        "past_key_values.0.key")[2] == -1  # nothing to compare on the engine itself
    with pytest.raises(BundleError, match="older step graph that outputs only the window's new KV entries.*rebuild "
                                          "the engine"):
        TrtBackend(bundle, config)


def test_server_takes_its_limits_from_the_engine(engine_bundle, standin, capsys):
    """Default batch = the engine's largest (2 < 8); a batch or context past the profile is refused
    with one line at start-up."""
    from runtime import serve
    app = serve.build_app(serve.parse_args([str(engine_bundle / "engine.plan"), "--threads", "1"]))
    engine = app.state.ctx.engine_thread.engine
    assert engine.engine_config.max_batch_size == 2 and engine.cache.max_len == 64
    for option, value, message in [
            ("--max-batch-size", "8", "max_batch_size (--max-batch-size) 8 exceeds the backend's largest batch 2"),
            ("--max-seq-len", "512", "max_seq_len (--max-seq-len) 512 exceeds the 64 positions")]:
        assert serve.main([str(engine_bundle / "engine.plan"), option, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_gpu_check_full_run_on_the_standin(tiny_bundle, tmp_path, standin):
    """bench/gpu_check.py past its dry run, in process: export --fp16/--fp32 --trt (engine built,
    parity on the TensorRT backend), tau = 1 identity against the CPU references, speed."""
    from support import load_script
    ckpt, _ = tiny_bundle("qwen2", 4)
    gpu_check = load_script(Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py")
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--model", str(ckpt), "--mask-token", "<mask>", "--fp32", "--num-prompts", "2",
                           "--max-new-tokens", "8", "--work", str(tmp_path / "bundles"), "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["environment"]["missing"] == [] and report["environment"]["gpu"].startswith("TensorRT contract")
    assert code == (0 if report["passed"] else 1)
    for name in ("fp16", "fp32"):
        run = report["runs"][name]
        assert run["export"]["exit_code"] == 0 and "tensorrt" in run["parity"]["backends"]
        assert run["identity_tau1"]["total"] == 2 and run["speed"]["tau=1.0"]["tpf"] == 1.0
    assert report["runs"]["fp32"]["identity_tau1"]["identical"] == 2  # same math as the fp32 reference


def test_gpu_check_refuses_an_empty_prompt_set(tmp_path):
    """An identity check over no prompt would pass vacuously: an empty file or --num-prompts 0 is refused."""
    from support import load_script
    gpu_check = load_script(Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py")
    empty = tmp_path / "p.json"
    empty.write_text('{"prompts": []}')
    for path, num in [(str(empty), 2), (None, 0)]:
        with pytest.raises(ValueError, match="no prompts to check"):
            gpu_check.load_prompts(path, num)
    assert len(gpu_check.load_prompts(None, 2)) == 2


def test_a_tensorrt_engine_refuses_adaptive_masks_naming_the_bundle_directory(engine_bundle, standin):
    """The profile fixes W, so no step can go without masks: a request for adaptive masks is refused (naming the
    fix: the bundle directory on onnxruntime), in both schemes; the engine then serves the other requests."""
    from runtime.backends.trt import TrtBackend
    from runtime.decode.engine import Engine, EngineConfig
    from runtime.decode.params import DecodeParams, ParamError
    config = load_config(engine_bundle)
    trt = TrtBackend(engine_bundle, config)
    for scheme, why in [("continuous", r"TensorRT engine's optimization profile fixes the window at W = 4.*serve "
                                       r"the bundle directory instead of engine\.plan"),
                        ("block", "block scheme runs every step W wide")]:
        engine = Engine(trt, config, EngineConfig(max_batch_size=2, scheme=scheme))
        with pytest.raises(ParamError, match=why) as info:
            engine.add_request([1, 2, 3], DecodeParams(tau=0.9, max_new_tokens=4, adaptive_masks=True))
        assert info.value.field == "adaptive_masks"
        assert engine.generate([[1, 2, 3]], DecodeParams(tau=0.9, max_new_tokens=4))[0].num_tokens == 4
        engine.cache.close()


def test_the_server_checks_the_kv_cache_against_free_gpu_memory(engine_bundle, standin, monkeypatch, capsys):
    """On an engine.plan the cache and the presents (2 copies) live in device memory: the start-up check reads
    cudaMemGetInfo's free bytes, and its one line names both options and what fits there."""
    from runtime import serve
    from runtime.serving.kv_memory import largest_fitting, suggestion_budget
    free = (standin.cuda.cudaError_t.cudaSuccess, 150_000, 1 << 30)  # batch 2 x 64 positions x 2 x 512 bytes x 1.5
    monkeypatch.setattr(sys.modules["cuda.bindings.runtime"], "cudaMemGetInfo", lambda: free)
    assert serve.main([str(engine_bundle / "engine.plan")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    num_slots, max_len = largest_fitting(2, 64, 2 * 512, suggestion_budget(150_000), 6)
    assert (num_slots, max_len) == (1, 37) and len(err) == 1
    assert err[0].startswith("error: the KV cache may need 0.2 MiB (2 slots (--max-batch-size) x 64 positions "
                             "(--max-seq-len) x 1,024 bytes, plus the 32 positions per slot it grows from; ")
    assert err[0].endswith("but 0.1 MiB is available (free GPU memory): lower --max-batch-size to 1 or --max-seq-len "
                           "to 37")
    for option, value in (("--max-batch-size", "1"), ("--max-seq-len", "37")):
        app = serve.build_app(serve.parse_args([str(engine_bundle / "engine.plan"), option, value]))
        app.state.ctx.engine_thread.engine.cache.close()


def test_a_device_cache_out_of_memory_gives_back_what_it_got_and_stays(engine_bundle, standin, monkeypatch):
    """cudaMalloc running out while the cache grows: what this growth got is freed, the cache keeps its buffers and
    raises MemoryError, which the engine turns into CannotGrowCache for the row that needed it."""
    from runtime.backends.trt import TrtBackend
    from runtime.decode.engine import CannotGrowCache, Engine, EngineConfig
    from runtime.decode.params import DecodeParams
    config = load_config(engine_bundle)
    engine = Engine(TrtBackend(engine_bundle, config), config, EngineConfig(max_batch_size=2))
    cache = engine.cache
    cache.reserve(20)
    blocks = dict(standin.cuda.MEMORY.blocks)
    used = sum(size for _, size, kind in blocks.values() if kind == "device")
    buffer = 2 * config.num_kv_heads * 64 * config.head_dim * 4  # [N, H, 64, D] float32
    monkeypatch.setattr(standin.cuda, "DEVICE_BYTES", used + 3 * buffer + 100)  # the 4th of 2L = 4 buffers fails
    with pytest.raises(MemoryError, match="out of GPU memory"):
        cache.reserve(40)
    assert standin.cuda.MEMORY.blocks == blocks and cache.capacity == 32
    engine.add_request(list(range(1, 40)), DecodeParams(max_new_tokens=4), "long")
    with pytest.raises(CannotGrowCache) as failed:
        while True:
            engine.step()
    assert failed.value.request_ids == ["long"] and not engine.has_unfinished()
    cache.close()

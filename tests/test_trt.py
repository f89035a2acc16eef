"""TensorRT: optimization profiles and the trtexec line (anywhere), clear errors without
TensorRT, and on a machine with TensorRT and an NVIDIA GPU, a tiny engine against onnxruntime."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace

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
        from runtime.backends.trt import _Cuda
        _Cuda()
    except RuntimeError as e:
        return f"needs TensorRT, cuda-python and an NVIDIA GPU: {e}"
    return None


GPU_MISSING = gpu_missing_reason()


def test_profile_keeps_tied_dimensions_equal(tiny_bundle):
    _, bundle = tiny_bundle("llama", 4)
    config = load_config(bundle)
    shapes = profile_shapes(config, TrtBuildOptions(max_batch=6, opt_batch=2, max_context=256, opt_context=64))
    assert set(shapes) == set(bundle_io.input_names(config.num_layers))
    for which, (batch, past) in enumerate([(1, 0), (2, 60), (6, 252)]):  # min, opt, max
        assert shapes["input_ids"][which] == shapes["position_ids"][which] == (batch, 4)
        assert shapes["attention_mask"][which] == (batch, 1, 4, past + 4)  # last axis = P + W
        for name in bundle_io.input_names(config.num_layers)[3:]:
            assert shapes[name][which] == (batch, config.num_kv_heads, past, config.head_dim)
    assert trt_build.profile_limits(shapes.__getitem__) == (6, 252)  # largest batch and past the engine may feed


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


def test_trtexec_line(tiny_bundle, capsys):
    _, bundle = tiny_bundle("llama", 4)
    config = load_config(bundle)
    line = trtexec_command(config, TrtBuildOptions(max_batch=8, max_context=512, opt_context=128, workspace_mib=1024))
    assert line.startswith("trtexec --onnx=model.onnx --saveEngine=engine.plan --stronglyTyped")
    assert "--minShapes=input_ids:1x4,position_ids:1x4,attention_mask:1x1x4x4,past_key_values.0.key:1x2x0x16," in line
    assert "--optShapes=input_ids:1x4,position_ids:1x4,attention_mask:1x1x4x128,past_key_values.0.key:1x2x124x16," \
        in line
    assert "--maxShapes=input_ids:8x4,position_ids:8x4,attention_mask:8x1x4x512," in line
    assert "past_key_values.1.value:8x2x508x16" in line and line.endswith("--memPoolSize=workspace:1024")
    assert trt_build.main([str(bundle), "--print-trtexec", "--max-context", "512"]) == 0  # no TensorRT needed
    assert "--maxShapes=input_ids:8x4" in capsys.readouterr().out


def test_backend_module_imports_without_tensorrt_or_torch():
    script = ("import sys; sys.modules['torch'] = None; sys.modules['tensorrt'] = None; "
              "import runtime.backends.trt, runtime.trt_build, runtime.memory; print('ok')")
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.skipif(GPU_MISSING is None, reason="TensorRT and a GPU are present: the missing-TensorRT path is moot")
def test_missing_tensorrt_names_the_fix(tiny_bundle, tmp_path, capsys):
    _, original = tiny_bundle("llama", 4)
    bundle = shutil.copytree(original, tmp_path / "bundle")
    (bundle / "engine.plan").write_bytes(b"not built here")
    config = load_config(bundle)
    config = replace(config, engine_file="engine.plan")
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


@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
def test_tiny_engine_matches_onnxruntime(tiny_bundle, tmp_path):
    """Build a tiny engine (batch 1..2, past 0..60) and compare logits and KV with onnxruntime."""
    from runtime.backends.onnx import OnnxBackend
    from runtime.backends.trt import TrtBackend
    _, original = tiny_bundle("qwen2", 4)
    bundle = shutil.copytree(original, tmp_path / "bundle")
    assert trt_build.main([str(bundle), "--max-batch", "2", "--max-context", "64", "--opt-context", "32"]) == 0
    config = load_config(bundle)
    assert json.loads((bundle / "mars_config.json").read_text())["engine_file"] == "engine.plan"
    trt, onnx = TrtBackend(bundle, config), OnnxBackend(bundle, config)
    assert (trt.max_batch, trt.max_past) == (2, 60)  # read from the engine's optimization profile
    rng = np.random.default_rng(0)
    for batch, past_len in [(1, 0), (2, 0), (2, 37), (1, 60)]:
        ids = rng.integers(0, config.vocab_size, (batch, 4))  # [B, W]
        positions = np.tile(np.arange(past_len, past_len + 4), (batch, 1))  # [B, W]
        keys, queries = np.arange(past_len + 4), past_len + np.arange(4)
        mask = np.broadcast_to(keys[None, :] <= queries[:, None], (batch, 1, 4, past_len + 4)).copy()
        past = [tuple(rng.standard_normal((batch, config.num_kv_heads, past_len, config.head_dim)).astype(np.float32)
                      for _ in range(2)) for _ in range(config.num_layers)]
        want_logits, want_kv = onnx.step(ids, positions, mask, past)
        got_logits, got_kv = trt.step(ids, positions, mask, past)
        assert got_logits.shape == want_logits.shape and got_logits.dtype == np.float32
        # TF32 is on by default for float32 layers in TensorRT; the head scale of 40 magnifies it in logits
        assert np.abs(got_logits - want_logits).max() < 0.05 * np.abs(want_logits).max()
        assert (got_logits.argmax(-1) == want_logits.argmax(-1)).mean() >= 0.95
        for (gk, gv), (wk, wv) in zip(got_kv, want_kv):
            assert np.allclose(gk, wk, atol=1e-2) and np.allclose(gv, wv, atol=1e-2)

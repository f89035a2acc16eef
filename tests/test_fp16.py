"""fp16 exports (mars-export --fp16) of tiny Qwen2 and Qwen3 models.

The graph keeps float32 logits, fp16 KV I/O, norms and attention scores in float32 and a
finite mask fill; parity against the float32 PyTorch model is recorded within the fp16
tolerance; tau = 1 gives transformers' float32 greedy output except at near-ties (two
logits closer than fp16 rounding can tell apart), which must be shown to be near-ties.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from support import export
from tiny_models import make_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_export import cli as export_cli
from mars_export.parity import chat_prompt_ids
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config, past_names
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams

ARCHS = ["qwen2", "qwen3"]
PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "def add(a, b):", "Hi"]
MAX_NEW = 32


@pytest.fixture(scope="module")
def fp16_bundle(tmp_path_factory):
    """Factory: arch -> (checkpoint dir, fp16 bundle dir with B = W = 4), exported once per module."""
    made = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"{arch}-fp16")
            ckpt = make_checkpoint(arch, root / "ckpt")
            made[arch] = ckpt, export(str(ckpt), root / "bundle", 4, 4, "--mask-token", "<mask>", "--fp16")
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_config_records_fp16_parity(fp16_bundle, arch):
    _, bundle = fp16_bundle(arch)
    config = load_config(bundle)
    assert config.dtype == "float16"
    parity = config.parity
    assert parity["backend"] == "onnxruntime-cpu" and parity["tolerance"] == export_cli.FP16_PARITY_TOL
    assert 0 < parity["max_abs_logit_diff"] <= export_cli.FP16_PARITY_TOL  # fp16 is not bit-exact, but close
    assert parity["top1_agreement"] >= 0.99


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_types(fp16_bundle, arch):
    """float32 logits, fp16 KV; RMSNorm statistics and attention softmax in float32; fp16 weights."""
    _, bundle = fp16_bundle(arch)
    session = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    types = {t.name: t.type for t in session.get_inputs() + session.get_outputs()}
    assert types["logits"] == "tensor(float)" and types["input_ids"] == "tensor(int64)"
    assert types[past_names(0)[0]] == types["present.0.value"] == "tensor(float16)"
    graph = onnx.shape_inference.infer_shapes(onnx.load(bundle / "model.onnx")).graph
    elem = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    guarded = [n for n in graph.node if n.op_type in ("ReduceMean", "Softmax")]
    assert len(guarded) >= 2 * 2 + 1  # 2 layers x (2 norms [+ q/k norms]) + final norm, + softmaxes
    assert all(elem[n.input[0]] == onnx.TensorProto.FLOAT for n in guarded)
    weights = [numpy_helper.to_array(t) for t in graph.initializer]
    assert all(w.dtype == np.float16 for w in weights if w.size > 64)  # every weight matrix and norm vector
    assert sum(w.size for w in weights if w.dtype == np.float32) < 64  # only scalar constants stay float32


@pytest.mark.parametrize("arch", ARCHS)
def test_rope_frequencies_stay_float32(fp16_bundle, arch):
    """RoPE's inv_freq in the fp16 graph is the float32 model's, not rounded to fp16 (that
    would turn positions in the thousands by a sizeable fraction of a radian)."""
    ckpt, bundle = fp16_bundle(arch)
    inv_freq = AutoModelForCausalLM.from_pretrained(ckpt).model.rotary_emb.inv_freq.numpy()
    assert not np.array_equal(inv_freq.astype(np.float16).astype(np.float32), inv_freq)  # fp16 would round it
    graph = onnx.load(bundle / "model.onnx").graph
    candidates = [numpy_helper.to_array(t) for t in graph.initializer]
    assert any(c.dtype == np.float32 and np.array_equal(c.ravel(), inv_freq) for c in candidates)


def test_fully_masked_row_stays_finite(fp16_bundle):
    """A query row that may see nothing (e.g. padding) gives finite logits: the fill is finite."""
    _, bundle = fp16_bundle("qwen2")
    config = load_config(bundle)
    backend = OnnxBackend(bundle, config)
    past_len, window = 3, config.window
    mask = np.ones((1, 1, window, past_len + window), dtype=bool)  # [1, 1, W, S]
    mask[0, 0, 1] = False  # query 1 sees no key at all
    cache = np.random.default_rng(0).standard_normal((1, config.num_kv_heads, past_len + window, config.head_dim))
    past = [(cache.astype(np.float16), cache.astype(np.float16)) for _ in range(config.num_layers)]
    logits, presents = backend.step(np.array([[5, 6, 7, 8]]), np.arange(past_len, past_len + window)[None],
                                    mask, past)
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    assert all(np.isfinite(k).all() and np.isfinite(v).all() for k, v in presents)


def fp32_gap(model, ids: list[int], chosen: int) -> float:
    """float32 logit of the float32 argmax minus the float32 logit of ``chosen``, after ``ids``."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return float(logits.max() - logits[chosen])


@pytest.mark.parametrize("arch", ARCHS)
def test_tau_one_matches_fp32_greedy_except_near_ties(fp16_bundle, arch):
    ckpt, bundle = fp16_bundle(arch)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    config = load_config(bundle)
    decoder = Decoder(OnnxBackend(bundle, config), config)
    identical = 0
    for text in PROMPTS:
        ids = chat_prompt_ids(tokenizer, text)
        got = decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW)).token_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=model.config.pad_token_id, suppress_tokens=[config.mask_token_id])
        expected = out[0, len(ids):].tolist()
        if got == expected:
            identical += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        gap = fp32_gap(model, ids + expected[:first], got[first])
        assert gap <= 2 * config.parity["max_abs_logit_diff"], (
            f"{text!r}: fp16 chose {got[first]} at step {first}, {gap:.4f} below the float32 argmax; "
            "that is more than fp16 rounding explains")
    assert identical >= len(PROMPTS) - 1


def test_fp16_parity_tolerance_is_enforced(fp16_bundle, tmp_path, capsys):
    ckpt, _ = fp16_bundle("qwen2")
    out = tmp_path / "bundle"
    code = export_cli.main([str(ckpt), "-o", str(out), "--block", "4", "--mask-token", "<mask>", "--fp16",
                            "--parity-tol", "1e-6"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: parity check failed on onnxruntime-cpu: max |Δlogit|")
    assert not out.exists()


def test_cli_reports_dtype(fp16_bundle):
    _, bundle = fp16_bundle("qwen2")
    raw = json.loads((bundle / "mars_config.json").read_text())
    assert raw["dtype"] == "float16" and "engine_file" not in raw  # no engine: the field stays out

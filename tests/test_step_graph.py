"""The step graph's attention, RoPE and RMSNorm forms: same function as transformers, cheaper graph."""

from __future__ import annotations

import collections
import types

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from mars_export.step_module import StepKV, rotary_joint, step_attention
from runtime import bundle

B, H, HKV, W, P, D = 2, 6, 2, 3, 5, 8  # batch, query heads, KV heads, window, past, head dim


def random_attention_inputs(dtype=torch.float32):
    torch.manual_seed(0)
    query = torch.randn(B, H, W, D, dtype=dtype)
    new_key, new_value = torch.randn(B, HKV, W, D, dtype=dtype), torch.randn(B, HKV, W, D, dtype=dtype)
    past = [(torch.randn(B, HKV, P, D, dtype=dtype), torch.randn(B, HKV, P, D, dtype=dtype))]
    mask = torch.rand(B, 1, W, P + W) < 0.6  # holes anywhere, as batching and verification make them
    mask[0, 0, 1] = False  # one fully masked query row: must stay finite
    mask[:, :, :, P:] |= torch.eye(W, dtype=torch.bool)  # every other query sees itself
    bias = torch.where(mask, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)  # [B, 1, W, P + W]
    return query, new_key, new_value, past, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_attention_equals_repeated_kv_attention(dtype):
    query, key, value, past, bias = random_attention_inputs(dtype)
    layer = types.SimpleNamespace(layer_idx=0, num_key_value_groups=H // HKV, training=False)
    step_kv = StepKV(past=past)
    out, _ = step_attention(layer, query, key, value, bias, scaling=D**-0.5, step_kv=step_kv)
    full_key = torch.cat([past[0][0], key], dim=2).float()  # [B, Hkv, P + W, D]
    full_value = torch.cat([past[0][1], value], dim=2).float()
    expected, _ = eager_attention_forward(layer, query.float(), full_key, full_value, bias.float(), scaling=D**-0.5)
    assert out.shape == (B, W, H, D) and out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=1e-5 if dtype == torch.float32 else 5e-3, rtol=0)
    assert step_kv.present[0][0] is key and step_kv.present[0][1] is value


def test_step_attention_needs_the_step_kv():
    query, key, value, _, bias = random_attention_inputs()
    with pytest.raises(ValueError, match="StepModule"):
        step_attention(types.SimpleNamespace(layer_idx=0), query, key, value, bias, scaling=1.0)


def test_joint_rotary_equals_transformers_rotary():
    torch.manual_seed(0)
    query, key = torch.randn(B, H, W, D), torch.randn(B, HKV, W, D)
    angles = torch.rand(B, W, D // 2) * 100
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [B, W, D]
    got, expected = rotary_joint(query, key, cos, sin), apply_rotary_pos_emb(query, key, cos, sin)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)  # the same products and sums, only the sign moved


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_graph_reads_past_in_place_and_fuses_norms(tiny_bundle, arch, tmp_path):
    """No KV-head Expand and no Concat over a past input in the file; onnxruntime's optimizer
    turns every RMSNorm into one SimplifiedLayerNormalization."""
    path = tiny_bundle(arch, 4)[1] / bundle.ONNX_FILE
    graph = onnx.load(str(path)).graph
    past_inputs = {i.name for i in graph.input if i.name.startswith("past_key_values.")}
    assert not [n for n in graph.node if n.op_type == "Expand"]
    assert not [n for n in graph.node if n.op_type == "Concat" and past_inputs & set(n.input)]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)
    num_layers = 2
    norms_per_layer = 4 if arch == "qwen3" else 2  # Qwen3 also normalizes query and key heads
    assert ops["SimplifiedLayerNormalization"] == num_layers * norms_per_layer + 1 and ops["ReduceMean"] == 0
    assert ops["Neg"] <= 1  # RoPE's sign sits in the sine, computed once per step
    assert np.all([ops[op] == 0 for op in ("Pow", "Sqrt", "Reciprocal")])

"""The step graph's attention, RoPE and RMSNorm forms: same function as transformers, cheaper graph."""

from __future__ import annotations

import collections
import types
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from support import export, window_logits
from tiny_models import make_checkpoint
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from mars_export.fuse_projections import fuse_shared_input_matmuls
from mars_export.step_module import StepKV, rotary_joint, step_attention
from runtime import bundle

B, H, HKV, W, P, S, D = 2, 6, 2, 3, 5, 12, 8  # batch, query heads, KV heads, window, committed, capacity, head dim


def random_attention_inputs(dtype=torch.float32, num_kv_heads=HKV, window=W):
    torch.manual_seed(0)
    query = torch.randn(B, H, window, D, dtype=dtype)
    new_key = torch.randn(B, num_kv_heads, window, D, dtype=dtype)
    new_value = torch.randn(B, num_kv_heads, window, D, dtype=dtype)
    past = [tuple(torch.randn(B, num_kv_heads, S, D, dtype=dtype) for _ in range(2))]  # stale after P
    mask = torch.rand(B, 1, window, S) < 0.6  # holes anywhere, as batching and verification make them
    mask[0, 0, min(1, window - 1)] = False  # one fully masked query row: must stay finite
    mask[:, :, :, P:P + window] |= torch.eye(window, dtype=torch.bool)  # every other query sees itself (at its position)
    bias = torch.where(mask, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)  # [B, 1, W, S]
    return query, new_key, new_value, past, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads, window", [(HKV, W), (HKV, 1), (H, W), (H, 1)])  # G = 3, and G = 1 (rows doubled)
def test_grouped_attention_equals_repeated_kv_attention(dtype, num_kv_heads, window):
    """Grouped attention over the cache with the window written at its positions = transformers' eager attention
    (KV heads repeated) over that cache; the present is the past with the new entries there, nothing else changed."""
    query, key, value, past, bias = random_attention_inputs(dtype, num_kv_heads, window)
    layer = types.SimpleNamespace(layer_idx=0, num_key_value_groups=H // num_kv_heads, training=False)
    step_kv = StepKV(past=past, positions=torch.arange(P, P + window).expand(B, window))
    out, _ = step_attention(layer, query, key, value, bias, scaling=D**-0.5, step_kv=step_kv)
    full_key, full_value = past[0][0].clone(), past[0][1].clone()  # [B, Hkv, S, D]
    full_key[:, :, P:P + window], full_value[:, :, P:P + window] = key, value
    expected, _ = eager_attention_forward(layer, query.float(), full_key.float(), full_value.float(), bias.float(),
                                          scaling=D**-0.5)
    assert out.shape == (B, window, H, D) and out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=1e-5 if dtype == torch.float32 else 5e-3, rtol=0)
    assert torch.equal(step_kv.present[0][0], full_key) and torch.equal(step_kv.present[0][1], full_value)


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
def test_graph_groups_kv_heads_and_fuses_norms(tiny_bundle, arch, tmp_path):
    """No KV-head Expand (only position indices are expanded), no past concatenated with anything (the window's
    KV is scattered into the past, one ScatterND per past input); one MatMul for Q/K/V and one for gate/up per layer; onnxruntime's optimizer turns every RMSNorm
    into one SimplifiedLayerNormalization."""
    path = tiny_bundle(arch, 4)[1] / bundle.ONNX_FILE
    graph = onnx.load(str(path)).graph
    weights = {t.name for t in graph.initializer}
    projection_inputs = [n.input[0] for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    num_layers = 2
    assert len(projection_inputs) == len(set(projection_inputs)) >= num_layers * 4  # QKV, o, gate/up, down (+ head)
    past_inputs = {i.name for i in graph.input if i.name.startswith("past_key_values.")}
    types = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(onnx.load(str(path))).graph.value_info}
    constants = {n.output[0] for n in graph.node if n.op_type == "Constant"} | weights
    # only position indices (int64) and the mask filler (a scalar constant) are expanded, never KV heads
    assert all(types.get(n.output[0]) == onnx.TensorProto.INT64 or n.input[0] in constants
               for n in graph.node if n.op_type == "Expand")
    past_readers = [(n.op_type, i) for n in graph.node for i in n.input if i in past_inputs and n.op_type != "Shape"]
    assert sorted(past_readers) == sorted(("ScatterND", i) for i in past_inputs)  # written in place, never copied
    outputs = {o.name for o in graph.output}
    assert {n.output[0] for n in graph.node if n.op_type == "ScatterND"} == outputs - {bundle.LOGITS, bundle.GREEDY_IDS, bundle.HEAD_SKIPPED}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath).graph
    ops = collections.Counter(n.op_type for n in optimized.node)
    norms_per_layer = 4 if arch == "qwen3" else 2  # Qwen3 also normalizes query and key heads
    assert ops["SimplifiedLayerNormalization"] == num_layers * norms_per_layer + 1 and ops["ReduceMean"] == 0
    assert ops["Neg"] <= 1  # RoPE's sign sits in the sine, computed once per step
    assert np.all([ops[op] == 0 for op in ("Pow", "Sqrt", "Reciprocal")])
    # the cache is read where it lies, never transposed into a packed copy: the keys as the first operand of the
    # scores ([S, D] x [D, G·W]: MLAS reads A in place), the values as the second of one-row products ([1, S] x [S, D]:
    # the matrix-vector kernel reads B in place); the keys as a transposed second operand were packed by the general
    # kernel for every (row of B, KV head): 1.06-1.17x the batch-16 step at P 1024-2048
    presents = outputs - {bundle.LOGITS, bundle.GREEDY_IDS, bundle.HEAD_SKIPPED}
    views = {n.output[0]: n.input[0] for n in optimized.node if n.op_type == "Unsqueeze" and n.input[0] in presents}
    readers = [n for n in optimized.node if n.op_type not in ("Unsqueeze", "Shape")
               and any(i in presents or i in views for i in n.input)]
    keys = [n for n in readers if n.input[0] in presents and n.input[0].endswith(".key")]
    values = [n for n in readers if n.op_type == "MatMul" and views.get(n.input[1], "").endswith(".value")]
    assert len(keys) == len(values) == num_layers and len(readers) == 2 * num_layers
    assert all(n.op_type in ("MatMul", "FusedMatMul") and not any(a.name == "transA" and a.i for a in n.attribute)
               for n in keys)


def test_matmuls_sharing_an_input_become_one_matmul_and_split():
    """Three projections of x (and one of another input) -> one MatMul + Split for x; same outputs."""
    rng = np.random.default_rng(0)
    k, sizes = 8, (8, 4, 4)
    weights = [rng.standard_normal((k, n)).astype(np.float32) for n in (*sizes, 3)]
    x, y = (onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["T", k]) for name in ("x", "y"))
    outputs = [onnx.helper.make_tensor_value_info(f"r{i}", onnx.TensorProto.FLOAT, ["T", w.shape[1]])
               for i, w in enumerate(weights)]
    nodes = [onnx.helper.make_node("MatMul", ["x" if i < 3 else "y", f"w{i}"], [f"p{i}"], name=f"proj{i}")
             for i in range(4)]
    nodes += [onnx.helper.make_node("Relu", [f"p{i}"], [f"r{i}"]) for i in range(4)]  # consumers keep reading p_i
    graph = onnx.helper.make_graph(nodes, "g", [x, y], outputs,
                                   [onnx.numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    ir_model = ir.serde.deserialize_model(model)
    assert fuse_shared_input_matmuls(ir_model.graph) == 2
    fused = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(fused, full_check=True)
    assert [n.op_type for n in fused.graph.node].count("MatMul") == 2 and len(fused.graph.initializer) == 3
    feeds = {"x": rng.standard_normal((5, k)).astype(np.float32), "y": rng.standard_normal((5, k)).astype(np.float32)}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
           for m in (model, fused)]
    for before, after in zip(*run):
        np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def one_query_head_per_kv_head_bundle(tmp_path_factory) -> Path:
    """A tiny Llama with as many KV heads as query heads (G = 1, as Llama-2-7B or SmolLM2-1.7B), W = 4."""
    root = tmp_path_factory.mktemp("llama-g1")
    return export(str(make_checkpoint("llama", root / "ckpt", num_kv_heads=4)), root / "bundle", 4, 4,
                  "--mask-token", "<mask>")


def test_a_window_keeps_the_bits_of_one_token_steps_when_a_product_is_split_across_threads(tiny_bundle):
    """Batch 1, a long cache (S = 16390) and 16 onnxruntime threads: MLAS then splits one attention product over
    several threads at W = 1 but not at W = 4 (it gives a product ceil(threads / products) threads when it is big
    enough), so a kernel whose sums depend on where a thread's range starts would give a window other bits than
    one-token steps; the general kernel's do not (a column-vector form of the scores failed here, 9.5e-7)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 16
    session = ort.InferenceSession(str(tiny_bundle("llama", 4)[1] / bundle.ONNX_FILE), options,
                                   providers=["CPUExecutionProvider"])
    shapes = [i.shape for i in session.get_inputs()[3:]]
    rng = np.random.default_rng(0)
    capacity = 16390
    cache = [rng.standard_normal((1, shape[1], capacity, shape[3])).astype(np.float32) for shape in shapes]
    length, tokens = capacity - 12, rng.integers(3, 90, 4).tolist()
    windowed = window_logits(session, [tokens], [buffer.copy() for buffer in cache], [length])
    for offset, token in enumerate(tokens):
        single = window_logits(session, [[token]], cache, [length + offset])
        np.testing.assert_array_equal(windowed[:, offset], single[:, 0])


@pytest.mark.parametrize("level", [ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                   ort.GraphOptimizationLevel.ORT_ENABLE_ALL])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-g1"])
def test_a_window_scores_each_token_with_the_bits_of_one_token_steps(tiny_bundle, one_query_head_per_kv_head_bundle,
                                                                    arch, level):
    """float32, batch 2 at different lengths: a token scored inside a 4-token window gets the logits of the
    same token fed one step at a time, bit for bit (verify mode and lookup drafts rest on it); the KV written
    into the cache in place, bound as the runtime binds it, keeps it, with or without onnxruntime's graph
    optimizations, and with one query head per KV head (a one-row attention MatMul at W = 1 took another
    kernel)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    path = one_query_head_per_kv_head_bundle if arch == "llama-g1" else tiny_bundle(arch, 4)[1]
    session = ort.InferenceSession(str(path / bundle.ONNX_FILE), options, providers=["CPUExecutionProvider"])
    shapes = [i.shape for i in session.get_inputs()[3:]]
    rng = np.random.default_rng(0)
    capacity, window = 48, 4
    cache = [rng.standard_normal((2, shape[1], capacity, shape[3])).astype(np.float32) for shape in shapes]
    lengths = [5, 11]  # each row's committed length; the rest of its buffer holds stale values
    tokens = rng.integers(3, 90, (2, 24)).tolist()
    compared = 0
    for start in range(0, 24, window):
        windowed = window_logits(session, [row[start:start + window] for row in tokens],
                                 [buffer.copy() for buffer in cache], [length + start for length in lengths])
        for offset in range(window):
            single = window_logits(session, [[row[start + offset]] for row in tokens], cache,
                                   [length + start + offset for length in lengths])
            np.testing.assert_array_equal(windowed[:, offset], single[:, 0])
            compared += 1
    assert compared == 24


def test_dynamic_ntk_rope_exports_as_the_default_rope_within_the_models_positions(tmp_path):
    """transformers' dynamic-NTK RoPE rescales its frequencies only once a forward passes max_position_embeddings
    (a branch on the positions, which torch.export refused); below, it is the default RoPE, which the step graph
    traces. The bundle's context stays within those positions, where transformers' frequencies stay the default's."""
    ckpt = make_checkpoint("llama", tmp_path / "ckpt", max_context=512,
                           rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    config = bundle.load_config(export(str(ckpt), tmp_path / "bundle", 4, 4, "--mask-token", "<mask>"))
    assert config.max_context == 512 and config.parity["max_abs_logit_diff"] <= 1e-3
    rotary = LlamaForCausalLM.from_pretrained(ckpt).model.rotary_emb
    rotary(torch.zeros(1), torch.arange(config.max_context)[None])  # a forward up to the bundle's last position
    assert torch.equal(rotary.inv_freq, rotary.compute_default_rope_parameters(rotary.config)[0])

"""int4 exports of a GGUF source hold its own blocks (mars_export.gguf_blocks, gguf_import).

A tiny random Llama is written as a GGUF file (Q4_1, Q4_0, Q8_0 and one Q5_0 weight) and
loaded by transformers' GGUF loader. The blocks read back dequantize bit for bit to what
that loader gives; the int4 graph built from them at the float32 compute level gives the
float32 graph's logits to float32 rounding (no second quantization), also with a LoRA
adapter and a trainable token kept unmerged as side paths. At the fast compute level
(int8 activations) a window scores each token with the same bits as one-at-a-time steps,
so verification gives greedy AR's tokens; the re-quantized int8 graph too.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from support import window_logits
from tiny_gguf import LAYERS, write_tiny_gguf

from mars_export.gguf_blocks import read_block_weights
from mars_export.gguf_import import prepare_gguf_import
from mars_export.model_source import LoadedModel, load_gguf_model
from mars_export.onnx_export import export_step_graph
from mars_export.quantize import ACCURACY_LEVEL, REFERENCE_FILE, prepare_gguf_graph, quantize_step_graph
from runtime import bundle
from runtime.backends.onnx import OnnxBackend
from runtime.decode.decoder import Decoder
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.params import DecodeParams

LAYER_TYPES = [{"attn_v": "Q4_0", "ffn_down": "Q8_0"}, {"attn_q": "Q5_0"}]
WINDOW, CONTEXT = 4, 64


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(GGUF path, the model transformers loads from it)."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", LAYER_TYPES)
    return path, load_gguf_model(path)


def run_graph(path, ids: np.ndarray) -> np.ndarray:
    """logits [1, W, V] of the step graph at ``path`` for ``ids`` [1, W] at positions 0..W-1 of an empty cache."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    feeds = {"input_ids": ids, "position_ids": np.arange(ids.shape[1])[None],
             "attention_mask": np.tril(np.ones((ids.shape[1], ids.shape[1]), bool))[None, None]}  # [1, 1, W, S = W]
    for name in bundle.input_names(LAYERS)[3:]:
        feeds[name] = np.zeros((1, shapes[name][1], ids.shape[1], shapes[name][3]), np.float32)
    return session.run([bundle.LOGITS], feeds)[0]


def test_blocks_dequantize_to_transformers_weights_bit_for_bit(tiny_gguf):
    path, model = tiny_gguf
    blocks, others = read_block_weights(path, model)
    state = model.state_dict()
    assert others == {"model.layers.1.self_attn.q_proj.weight": "Q5_0"}
    assert {b.ggml_type for b in blocks.values()} == {"Q4_0", "Q4_1", "Q8_0"} and len(blocks) == 2 * 7 - 1 + 1
    for name, block in blocks.items():
        np.testing.assert_array_equal(block.dequantize(), state[name].numpy(), err_msg=name)
    q4_1 = blocks["model.layers.0.self_attn.q_proj.weight"]  # llama.cpp's RoPE row order undone
    assert q4_1.codes.max() == 15 and q4_1.mins is not None and q4_1.zero_point == 0


def test_int4_graph_holds_the_gguf_blocks(tiny_gguf, tmp_path, capsys):
    path, model = tiny_gguf
    export_step_graph(model, tmp_path / "f32.onnx", WINDOW, CONTEXT)
    summary = quantize_step_graph(tmp_path / "f32.onnx", tmp_path / "int4.onnx", "int4", accuracy_level=None,
                                  gguf=prepare_gguf_import(path, model))
    # layer 1's fused Q/K/V holds a Q5_0 part: re-quantized whole; every other layer imported, the tied head as Q8_0
    assert summary["gguf_imported"] == {"Q4_1": 9, "Q4_0": 1, "Q8_0": 2}
    assert summary["gguf_requantized"] == {"Q5_0": 1, "Q4_1": 2}
    assert "3 linear layers are not held as Q4_0/Q4_1/Q8_0 blocks" in capsys.readouterr().err
    nodes = [n for n in onnx.load(str(tmp_path / "int4.onnx")).graph.node if n.op_type == "MatMulNBits"]
    bits = sorted(next(a.i for a in n.attribute if a.name == "bits") for n in nodes)
    assert bits == [4] * 7 + [8] * 2  # 2 x (QKV, o, gate/up, down) + head; layer 0's down and the head Q8_0
    # the re-quantized Q/K/V's float32 weight holds its Q4_1 parts' minima: no side path adds them again
    ids = np.array([[3, 17, 42, 90]])
    logits, reference = run_graph(tmp_path / "int4.onnx", ids), run_graph(tmp_path / "f32.onnx", ids)
    assert (logits.argmax(-1) == reference.argmax(-1)).all() and np.abs(logits - reference).max() < 2  # twice: 12


def test_int4_of_exact_blocks_matches_float32_graph(tmp_path):
    path = write_tiny_gguf(tmp_path / "exact.gguf", [{"attn_v": "Q4_0", "ffn_down": "Q8_0"}, {}])
    model = load_gguf_model(path)
    export_step_graph(model, tmp_path / "f32.onnx", WINDOW, CONTEXT)
    summary = quantize_step_graph(tmp_path / "f32.onnx", tmp_path / "int4.onnx", "int4", accuracy_level=None,
                                  gguf=prepare_gguf_import(path, model))
    assert summary["gguf_requantized"] == {} and summary["num_quantized"] == 2 * 4 + 1
    ids = np.array([[3, 17, 42, 90]])
    np.testing.assert_allclose(run_graph(tmp_path / "int4.onnx", ids), run_graph(tmp_path / "f32.onnx", ids),
                               atol=1e-4, rtol=0)  # float32 rounding: sums in another order


def test_unmerged_adapter_matches_merged_float32_graph(tmp_path):
    """LoRA on every projection plus one trainable token (tied head): side paths = the merged model."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.tuners.trainable_tokens import TrainableTokensLayer

    path = write_tiny_gguf(tmp_path / "base.gguf", [{}, {"attn_v": "Q4_0"}])
    base = load_gguf_model(path)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                             init_lora_weights=False, trainable_token_indices=[7]))
    with torch.no_grad():
        for module in adapted.modules():
            if isinstance(module, TrainableTokensLayer) and "default" in module.trainable_tokens_delta:
                module.trainable_tokens_delta["default"].add_(0.3)
    adapted.save_pretrained(tmp_path / "adapter")
    merged = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")).merge_and_unload().eval()
    export_step_graph(merged, tmp_path / "merged.onnx", WINDOW, CONTEXT)
    export_step_graph(base, tmp_path / "base.onnx", WINDOW, CONTEXT)
    gguf = prepare_gguf_import(path, base, merged, tmp_path / "adapter")
    assert gguf.embedding_rows[0].tolist() == [7]
    summary = quantize_step_graph(tmp_path / "base.onnx", tmp_path / "int4.onnx", "int4", accuracy_level=None,
                                  gguf=gguf)
    assert summary["gguf_requantized"] == {} and summary["gguf_imported"] == {"Q4_1": 13, "Q4_0": 1, "Q8_0": 1}
    graph = onnx.load(str(tmp_path / "int4.onnx")).graph
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    side = [weights[n.input[1]] for n in graph.node if n.op_type == "MatMul" and ".side." in n.name]
    assert len(side) == 2 * (4 + 2 + 3 + 2) + 2  # per MatMul one x @ Aᵀ and one per part (Q/K/V: 3); head: 2
    assert all(np.abs(w).max(axis=1).min() > 0 for w in side)  # no zero rows (one part's rank, another's columns)
    # the block sums are NB more output rows of every MatMulNBits holding Q4_1 blocks (head: Q8_0, none)
    assert sum(n.op_type == "Split" and n.name.endswith(".gguf.sums") for n in graph.node) == 2 * 4
    ids = np.array([[7, 17, 42, 7]])
    reference = run_graph(tmp_path / "merged.onnx", ids)
    assert np.abs(run_graph(tmp_path / "base.onnx", ids) - reference).max() > 0.1  # the adapter matters ...
    np.testing.assert_allclose(run_graph(tmp_path / "int4.onnx", ids), reference, atol=1e-4, rtol=0)  # ... and is kept


@pytest.mark.parametrize("weight_dtype", ["int4", "int8"])
def test_window_scores_tokens_as_one_at_a_time_steps(tiny_gguf, tmp_path, weight_dtype):
    """At accuracy level 4 (int8 activations, the shipped setting) a token scored inside a W-token
    window over the runtime's capacity-padded cache gets the logits of the same token fed one step at
    a time, and verification (mask and lookup drafts) decodes greedy AR's ids. Before keys sat at their
    positions (step_module.at_positions), 1-ulp differences in attention flipped int8 roundings."""
    path, model = tiny_gguf
    export_step_graph(model, tmp_path / "f32.onnx", WINDOW, CONTEXT)
    (tmp_path / "bundle").mkdir()
    gguf = prepare_gguf_import(path, model) if weight_dtype == "int4" else None  # int8: every MatMul re-quantized
    quantize_step_graph(tmp_path / "f32.onnx", tmp_path / "bundle" / bundle.ONNX_FILE, weight_dtype,
                        accuracy_level=ACCURACY_LEVEL, gguf=gguf)
    session = ort.InferenceSession(str(tmp_path / "bundle" / bundle.ONNX_FILE), providers=["CPUExecutionProvider"])
    shapes = [session.get_inputs()[i].shape for i in range(3, 3 + 2 * LAYERS)]
    rng = np.random.default_rng(0)
    cache = [rng.standard_normal((1, shape[1], CONTEXT, shape[3])).astype(np.float32) for shape in shapes]
    prompt, tokens = [3, 17, 42, 90, 5, 61, 23, 8, 77], rng.integers(3, 94, 40).tolist()
    window_logits(session, [prompt], cache, [0])
    for start in range(0, len(tokens), WINDOW):  # each window after the cache of the ones before
        window = tokens[start:start + WINDOW]
        windowed = window_logits(session, [window], cache, [len(prompt) + start])[0]
        for offset, token in enumerate(window):
            position = len(prompt) + start + offset
            single = window_logits(session, [[token]], cache, [position])[0]
            np.testing.assert_allclose(windowed[offset], single[0], atol=1e-4, rtol=0, err_msg=f"position {position}")

    config = bundle.BundleConfig(block_size=WINDOW, window=WINDOW, mask_token="<mask>", mask_token_id=95,
                                 eos_token_ids=(94,), pad_token_id=94, bos_token_id=None, num_layers=LAYERS,
                                 num_kv_heads=shapes[0][1], head_dim=shapes[0][3], vocab_size=96, max_context=CONTEXT,
                                 dtype="float32", source_model=str(path), weight_dtype=weight_dtype)
    backend = OnnxBackend(tmp_path / "bundle", config, num_threads=1)
    prompts = [prompt, [7, 7, 30, 7, 7, 30], [60]]
    params = {"max_new_tokens": 40}
    greedy = [Decoder(backend, config).generate(p, DecodeParams(mode="ar", **params)).token_ids for p in prompts]
    for draft in ("masks", "lookup"):
        engine = Engine(backend, config, EngineConfig(max_batch_size=1))
        results = engine.generate(prompts, DecodeParams(mode="verify", draft=draft, **params))
        assert [r.token_ids for r in results] == greedy, draft



def test_a_fused_graph_quantizes_the_gguf_weights_again(tiny_gguf, tmp_path, capsys):
    """--graph fused --int4 of a GGUF source: the model builder packs Q/K/V and the export fuses gate/up, so no
    import applies; every weight is quantized again from float32 (as llama.cpp's own quantizer makes Q4_1 from a
    float32 GGUF), said on stderr. The step graph of the same source imports the blocks."""
    path, model = tiny_gguf
    loaded = LoadedModel(model=model, tokenizer=None, mask_token="<mask>", mask_token_id=95, source=str(path),
                         gguf_file=path)
    config = bundle.BundleConfig(block_size=WINDOW, window=WINDOW, mask_token="<mask>", mask_token_id=95,
                                 eos_token_ids=(94,), pad_token_id=94, bos_token_id=None, num_layers=LAYERS,
                                 num_kv_heads=2, head_dim=8, vocab_size=96, max_context=CONTEXT, dtype="float32",
                                 source_model=str(path), weight_dtype="int4", graph="fused")
    assert prepare_gguf_graph(loaded, tmp_path, config) == (tmp_path / REFERENCE_FILE, None)
    assert "int4: the fused graph's weights are quantized again from float32" in capsys.readouterr().err
    source, gguf = prepare_gguf_graph(loaded, tmp_path, replace(config, graph="step"))
    assert source == tmp_path / REFERENCE_FILE and gguf is not None and not capsys.readouterr().err

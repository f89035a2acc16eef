"""Gemma2 and Gemma3 (text) load and export with the step graph: Gemma2 runs eager attention in PyTorch (transformers
refuses SDPA, which cannot soft-cap), the step graph soft-caps the attention scores as transformers does and keeps
the final logit soft-capping, and the bundle's context is capped to the sliding window (runtime.context).

Dimension letters: B batch, H query heads, Hkv KV heads, W window, S cache capacity, D head dim.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support import export
from tiny_models import make_checkpoint
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from mars_export.cli import main
from mars_export.model_source import load_checkpoint, load_gguf_model
from mars_export.parity import chat_prompt_ids
from mars_export.reference import ReferenceDecoder
from mars_export.step_module import StepKV, step_attention
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams

WINDOW = 48  # the tiny models' sliding window: the bundles' max context
# Scores q·k of about 0.1 (scale 1 / sqrt(query_pre_attn_scalar) = 1) against a cap of 0.02: capped hard, so
# a graph without the soft-capping fails parity (max |Δlogit| 4 in a trial), not only in the last bits.
SOFT_CAPPED = {"attn_logit_softcapping": 0.02, "query_pre_attn_scalar": 1}


def test_step_attention_soft_caps_the_scores_as_transformers_eager_attention():
    """Tier 1: a window of W = 3 queries at positions 2..4 over a cache of S = 6, soft-capped at 0.5."""
    torch.manual_seed(0)
    batch, heads, kv_heads, window, capacity, dim = 1, 4, 2, 3, 6, 8
    query = torch.randn(batch, heads, window, dim) * 2  # [B, H, W, D]
    key, value = torch.randn(2, batch, kv_heads, window, dim)  # [B, Hkv, W, D] each
    past = (torch.randn(batch, kv_heads, capacity, dim), torch.randn(batch, kv_heads, capacity, dim))
    positions = torch.arange(2, 2 + window)[None]  # [B, W]
    visible = torch.arange(capacity)[None, :] <= positions[0][:, None]  # [W, S]: causal over the cache
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]  # [B, 1, W, S]
    step_kv = StepKV(past=[past], positions=positions)
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=heads // kv_heads, training=False, head_dim=dim)
    got, _ = step_attention(module, query, key, value, mask, 0.35, step_kv=step_kv, softcap=0.5)
    cache_key, cache_value = step_kv.present[0]  # [B, Hkv, S, D]: the window written at positions 2..4
    want, _ = eager_attention_forward(module, query, cache_key, cache_value, mask, scaling=0.35, softcap=0.5)
    assert torch.allclose(got, want, atol=1e-6)
    uncapped, _ = step_attention(module, query, key, value, mask, 0.35, step_kv=StepKV(past=[past],
                                                                                        positions=positions))
    assert (uncapped - want).abs().max() > 0.1  # the cap matters here


@pytest.mark.parametrize("arch, config", [("gemma2", SOFT_CAPPED), ("gemma3_text", {})])
def test_gemma_exports_and_decodes_as_transformers(arch, config, tmp_path):
    """Export with parity; then at tau = 1 the runtime gives transformers' greedy ids, at tau = 0.5 the PyTorch
    reference decoder's (contexts within the window)."""
    checkpoint = make_checkpoint(arch, tmp_path / arch, sliding_window=WINDOW, **config)
    model, tokenizer = load_checkpoint(checkpoint)
    if arch == "gemma2":
        assert model.config._attn_implementation == "eager"  # transformers refuses SDPA for Gemma2
    bundle = export(str(checkpoint), tmp_path / "bundle", 4, 4, "--mask-token", "<mask>")
    bundle_config = load_config(bundle)
    assert bundle_config.max_context == WINDOW and bundle_config.parity["max_abs_logit_diff"] <= 1e-3
    decoder = Decoder(OnnxBackend(bundle, bundle_config), bundle_config)
    reference = ReferenceDecoder(model, 4, 4, bundle_config.mask_token_id, bundle_config.eos_token_ids)
    ids = chat_prompt_ids(tokenizer, "Hi")
    max_new = WINDOW - len(ids) - 4  # room for the last window
    greedy = decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=max_new, stop_ids=frozenset()))
    # The random model may rank the mask token first, which MARS decoders never emit; the pad token (<|im_end|>)
    # is in the prompt, so the attention mask is given (generate would take it for padding).
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                             pad_token_id=model.config.pad_token_id, suppress_tokens=[bundle_config.mask_token_id])
    assert greedy.token_ids == out[0, len(ids):].tolist()
    params = DecodeParams(tau=0.5, max_new_tokens=max_new, stop_ids=frozenset())
    assert decoder.generate(ids, params).token_ids == reference.generate(ids, params).token_ids


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_a_bidirectional_model_is_refused_before_export(arch, tmp_path, capsys):
    """use_bidirectional_attention (EmbeddingGemma and the like): tokens see later ones, which causal decoding over
    a KV cache cannot compute; the export says so in one line, that no flag helps, and writes nothing."""
    checkpoint = make_checkpoint(arch, tmp_path / arch, sliding_window=WINDOW, use_bidirectional_attention=True)
    assert main([str(checkpoint), "-o", str(tmp_path / "bundle"), "--block", "4", "--window", "4",
                 "--mask-token", "<mask>"]) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "use_bidirectional_attention" in errors[0] and "no flag" in errors[0]
    assert not (tmp_path / "bundle").exists()


def write_tiny_gemma2_gguf(path):
    """A 2-layer Gemma2 as llama.cpp writes one (float32 tensors, tied head), without a tokenizer."""
    import gguf

    hidden, intermediate, heads, kv_heads, head_dim, vocab = 64, 128, 4, 2, 16, 96
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "gemma2")
    for add, value in [(writer.add_context_length, 256), (writer.add_embedding_length, hidden),
                       (writer.add_block_count, 2), (writer.add_feed_forward_length, intermediate),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_key_length, head_dim), (writer.add_value_length, head_dim),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_sliding_window, WINDOW),
                       (writer.add_vocab_size, vocab)]:
        add(value)
    shapes = {"token_embd": (vocab, hidden), "output_norm": (hidden,)}
    for layer in range(2):
        shapes |= {f"blk.{layer}.{name}": shape for name, shape in [
            ("attn_q", (heads * head_dim, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
            ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, heads * head_dim)),
            ("ffn_gate", (intermediate, hidden)), ("ffn_up", (intermediate, hidden)),
            ("ffn_down", (hidden, intermediate)), ("attn_norm", (hidden,)), ("post_attention_norm", (hidden,)),
            ("ffn_norm", (hidden,)), ("post_ffw_norm", (hidden,))]}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", rng.normal(0, 0.1, shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gemma2_gguf_file_loads_with_eager_attention(tmp_path):
    """A GGUF file loads with the attention its transformers class takes (model_source.attention_implementation),
    as a checkpoint directory does: Gemma2 refuses SDPA."""
    model = load_gguf_model(write_tiny_gemma2_gguf(tmp_path / "gemma2.gguf"))
    assert model.config.model_type == "gemma2" and model.config._attn_implementation == "eager"


def test_a_gemma2_int8_export_quantizes_the_head_behind_the_soft_capping(tmp_path):
    """--int8 finds the output head where the num_logits cut finds it (mars_export.logits_rows.output_head), behind
    Gemma2's final logit soft-capping, and unties and quantizes it as in any other bundle (Gemma2 ties it)."""
    checkpoint = make_checkpoint("gemma2", tmp_path / "gemma2", tie_word_embeddings=True)
    bundle = export(str(checkpoint), tmp_path / "int8", 4, 4, "--mask-token", "<mask>", "--int8")
    weights = load_config(bundle).parity["weights"]
    assert weights["lm_head_quantized"] is True and weights["num_quantized"] == 2 * 4 + 1

"""A tiny random Llama written as a GGUF file with block-quantized weights, as llama.cpp writes one.

The linear weights are stored per layer in the block types given (Q4_0, Q4_1, Q8_0, or
others such as Q5_0 that the int4 export re-quantizes); Q/K rows are permuted for llama.cpp's
RoPE layout (``convert_hf_to_gguf.py``); the output head is tied to ``token_embd``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB, LAYERS = 64, 128, 4, 2, 96, 2
PROJECTIONS = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
               "attn_v": (HIDDEN // HEADS * KV_HEADS, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
               "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN), "ffn_down": (HIDDEN, INTERMEDIATE)}


def write_tiny_gguf(path: Path, layer_types: list[dict[str, str]], embedding_type: str = "Q8_0", seed: int = 0) -> Path:
    """Write a 2-layer Llama GGUF to ``path``.

    Args:
        layer_types: per layer, projection name (``PROJECTIONS``) -> ggml type name; missing ones are Q4_1.
        embedding_type: ggml type of ``token_embd`` (also the tied output head).
    """
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    _add(writer, "token_embd.weight", rng.normal(0, 0.5, (VOCAB, HIDDEN)), embedding_type)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for layer in range(LAYERS):
        for name, shape in PROJECTIONS.items():
            weight = rng.normal(0, 0.15, shape) + rng.normal(0, 0.05, (shape[0], 1))  # row offsets: Q4_1 mins matter
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name)
            if heads is not None:
                weight = _permute_for_rope(weight, heads)
            _add(writer, f"blk.{layer}.{name}.weight", weight, layer_types[layer].get(name, "Q4_1"))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer, name: str, weight: np.ndarray, type_name: str) -> None:
    import gguf
    qtype = gguf.GGMLQuantizationType[type_name]
    writer.add_tensor(name, gguf.quants.quantize(weight.astype(np.float32), qtype), raw_dtype=qtype)


def _permute_for_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order [N, K] (convert_hf_to_gguf.py LlamaModel.permute)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)

"""Tiny random-weight checkpoints (Llama, Qwen2, Qwen3, Mistral, Phi3, Gemma2, Gemma3 text) with a byte-level
tokenizer, built in tests; also in the layout of the paper's published MARS checkpoints (``a2d-qwen2``,
``a2d-qwen3``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

SPECIAL = ["<|im_start|>", "<|im_end|>", "<mask>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
}
# The published layout (github.com/Xalp/MARS, dllm/pipelines/a2d): model type and class name
# of the authors' code, and the mask token their tokenizer setup adds as ``mask_token``.
A2D_LAYOUTS = {
    "qwen2": ("a2d-qwen2", "A2DQwen2LMHeadModel"),
    "qwen3": ("a2d-qwen3", "A2DQwen3LMHeadModel"),
    "qwen3-it": ("a2d-qwen3-it", "A2DQwen3InstructLMHeadModel"),
    "llama": ("a2d-llama", "A2DLlamaLMHeadModel"),
}
A2D_MASK_TOKEN = "<|mask|>"
# Qwen2.5 pads its embedding rows (151,936) beyond its tokenizer (151,665 tokens), and the
# added <|mask|> gets an id among the padding; the tiny a2d models pad 260 tokens to 320 rows.
A2D_PADDED_VOCAB = 320
# Scaling the output head makes the random model's next-token distributions peaked, so
# confidences spread over [0, 1] and thresholds like 0.5 accept some mask predictions.
HEAD_SCALE = 40.0


def make_tokenizer(spare: tuple[str, ...] = ("<mask>",)) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens, no merges, then ``<|im_start|>``, ``<|im_end|>``
    and the ``spare`` special tokens."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab = {ch: i for i, ch in enumerate(sorted(vocab))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   bos_token="<|im_start|>", additional_special_tokens=list(spare))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_checkpoint(arch: str, directory: Path, seed: int = 0, max_context: int = 512, num_kv_heads: int = 2,
                    **config) -> Path:
    """Save a 2-layer random model of ``arch`` (``max_context`` positions, 4 query heads over ``num_kv_heads`` KV
    heads; ``config``: further fields of its transformers config, e.g. ``sliding_window``) plus tokenizer to
    ``directory``; return it."""
    tokenizer = make_tokenizer()
    return _save_random_model(arch, directory, tokenizer, len(tokenizer), seed, max_context, num_kv_heads, **config)


def make_a2d_checkpoint(layout: str, directory: Path, seed: int = 0) -> Path:
    """Save a 2-layer random model in the published MARS layout ``A2D_LAYOUTS[layout]`` to ``directory``.

    As the authors' code writes it: ``config.json`` has their ``model_type`` and
    ``architectures`` and records no mask token or block size; the tokenizer has ``<|mask|>``
    added as its ``mask_token`` (no other spare special token), with an id below the model's
    ``A2D_PADDED_VOCAB`` embedding rows, so the vocabulary is not resized.
    """
    tokenizer = make_tokenizer(spare=())
    tokenizer.add_special_tokens({"mask_token": A2D_MASK_TOKEN})
    _save_random_model(layout.split("-")[0], directory, tokenizer, A2D_PADDED_VOCAB, seed, 512)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["model_type"], config["architectures"] = A2D_LAYOUTS[layout][0], [A2D_LAYOUTS[layout][1]]
    config_path.write_text(json.dumps(config, indent=2))
    return directory


def _save_random_model(arch: str, directory: Path, tokenizer: PreTrainedTokenizerFast, vocab_size: int, seed: int,
                       max_context: int, num_kv_heads: int = 2, **extra) -> Path:
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16,
                        max_position_embeddings=max_context, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        **{"tie_word_embeddings": False} | extra)  # untied unless extra ties them
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory

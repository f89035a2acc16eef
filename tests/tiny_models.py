"""Tiny random-weight checkpoints (Llama, Qwen2, Qwen3) with a byte-level tokenizer, built in tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

SPECIAL = ["<|im_start|>", "<|im_end|>", "<mask>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
# Scaling the output head makes the random model's next-token distributions peaked, so
# confidences spread over [0, 1] and thresholds like 0.5 accept some mask predictions.
HEAD_SCALE = 40.0


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens, no merges, then the three special tokens."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab = {ch: i for i, ch in enumerate(sorted(vocab))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   bos_token="<|im_start|>", additional_special_tokens=["<mask>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_checkpoint(arch: str, directory: Path, seed: int = 0, max_context: int = 512) -> Path:
    """Save a 2-layer random model of ``arch`` (``max_context`` positions) plus tokenizer to ``directory``; return it."""
    tokenizer = make_tokenizer()
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_context,
                        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory

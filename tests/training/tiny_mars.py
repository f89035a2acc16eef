"""Tiny random-weight Llama models and a byte-level chat tokenizer for the training tests.

Built here from configs: nothing is downloaded.

The tokenizer copies SmolLM2's layout where it matters: ``<|im_end|>`` is both eos and
pad (id 2), so a test catches labels masked by pad id; the mask token is ``<mask>`` (id 3).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<mask>"]
EOS_ID, MASK_ID = 2, 3
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a test model<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer (one token per byte, no merges) with the four special tokens first."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIALS + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   additional_special_tokens=["<mask>"], chat_template=CHATML)


def make_model(attn: str = "sdpa", tie: bool = True, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama (hidden 32, 4 heads, 2 KV heads) with random weights, float32, eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(SPECIALS) + 256, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=tie, bos_token_id=None,
                         eos_token_id=EOS_ID, pad_token_id=EOS_ID, attn_implementation=attn)
    model = LlamaForCausalLM(config).eval()
    model.config.mars_mask_token, model.config.mars_mask_token_id = "<mask>", MASK_ID
    return model

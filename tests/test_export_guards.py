"""mars-export and mars-train distill refuse what they cannot do right, with one error line, and lose nothing:
sliding-window models get their context capped to the window, the output may only replace a bundle, the mask
token must be a spare special or new token, packaged model names are never read from the working directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import export
from tiny_models import HEAD_SCALE, make_tokenizer
from transformers import LlamaConfig, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mars_export.context import max_context_of, sliding_window
from runtime import generate
from runtime.bundle import load_config

SLIDING_WINDOW = 24


# --- sliding-window attention: the bundle's context is capped to the window ---

@pytest.mark.parametrize("config, expected", [
    (MistralConfig(sliding_window=300), 300),
    (MistralConfig(sliding_window=None), None),
    (Qwen2Config(use_sliding_window=False, sliding_window=300), None),
    (Qwen2Config(use_sliding_window=True, sliding_window=300, num_hidden_layers=2, max_window_layers=1), 300),
    (Qwen2Config(use_sliding_window=True, sliding_window=300, num_hidden_layers=2, max_window_layers=2), None),
    (LlamaConfig(), None),
], ids=["mistral", "mistral-none", "qwen2-off", "qwen2-upper-layer", "qwen2-no-layer", "llama"])
def test_sliding_window_follows_the_configs_attention(config, expected):
    assert sliding_window(config) == expected


def test_a_window_wider_than_the_context_caps_nothing():
    assert max_context_of(MistralConfig(sliding_window=4096, max_position_embeddings=512)) == (512, None)


def save_sliding_model(arch: str, directory: Path) -> Path:
    """A 2-layer random Mistral, or Qwen2 whose second layer only slides (max_window_layers 1), with a
    SLIDING_WINDOW-token window in a 512-token context."""
    tokenizer = make_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  sliding_window=SLIDING_WINDOW, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if arch == "mistral":
        model_cls, config = MistralForCausalLM, MistralConfig(**common)
    else:
        model_cls, config = Qwen2ForCausalLM, Qwen2Config(use_sliding_window=True, max_window_layers=1, **common)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_window_caps_the_bundles_context(arch, tmp_path, capsys):
    checkpoint = save_sliding_model(arch, tmp_path / arch)
    bundle = export(str(checkpoint), tmp_path / "bundle", 4, 4, "--mask-token", "<mask>")
    log = capsys.readouterr().err
    assert f"max context {SLIDING_WINDOW} tokens, the model's sliding attention window" in log
    config = load_config(bundle)
    assert config.max_context == SLIDING_WINDOW and config.parity["max_abs_logit_diff"] <= 1e-3
    assert generate.main([str(bundle), "--prompt", "hi", "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    assert generate.main([str(bundle), "--prompt", "x" * 30, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"exceeds the {SLIDING_WINDOW} positions a slot can hold" in err[0]

"""Export-time parity: the ONNX step graph against PyTorch on real prompts (DESIGN.md §5).

Each prompt is fed to the exported graph W tokens at a time through the runtime's own
cache and window code (first window with an empty past, later ones with a growing past,
the last one padded with mask tokens), and the logits at every position are compared
with one plain causal PyTorch forward over the same tokens.
"""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from runtime.bundle import BundleConfig
from runtime.decoding import run_window
from runtime.kv_cache import KVCache


class ParityError(RuntimeError):
    """The exported graph disagrees with PyTorch beyond the tolerance."""


def parity_prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Chat-formatted ids of the real prompts shipped in ``mars_export/data/parity_prompts.json``."""
    raw = json.loads(resources.files("mars_export").joinpath("data/parity_prompts.json").read_text())
    return [chat_prompt_ids(tokenizer, p["text"]) for p in raw["prompts"]]


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Ids of ``text`` as one user message with the generation prompt (plain encoding without a template)."""
    messages = [{"role": "user", "content": text}]
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    return tokenizer(text)["input_ids"]


def measure_parity(model: PreTrainedModel, backend, config: BundleConfig, prompts: list[list[int]]) -> dict:
    """Compare graph and PyTorch logits on ``prompts``.

    Returns:
        ``{"max_abs_logit_diff", "top1_agreement", "num_positions", "num_prompts"}``.
    """
    max_diff, agree, total = 0.0, 0, 0
    for ids in prompts:
        onnx_logits = _graph_logits(backend, config, ids)  # [T_padded, V]
        padded = ids + [config.mask_token_id] * (len(onnx_logits) - len(ids))
        with torch.no_grad():
            torch_logits = model(torch.tensor([padded])).logits[0].float().numpy()  # [T_padded, V]
        max_diff = max(max_diff, float(np.abs(onnx_logits - torch_logits).max()))
        agree += int((onnx_logits.argmax(-1) == torch_logits.argmax(-1)).sum())
        total += len(padded)
    return {"max_abs_logit_diff": max_diff, "top1_agreement": agree / total,
            "num_positions": total, "num_prompts": len(prompts)}


def _graph_logits(backend, config: BundleConfig, ids: list[int]) -> np.ndarray:
    window = config.window
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, len(ids) + window, np.dtype(config.dtype))
    chunks = [run_window(backend, cache, ids[i:i + window], config.mask_token_id, window)
              for i in range(0, len(ids), window)]
    return np.concatenate(chunks)


def check_parity(result: dict, tolerance: float) -> None:
    """Raise :class:`ParityError` if the max |Δlogit| is above ``tolerance``."""
    if not result["max_abs_logit_diff"] <= tolerance:
        raise ParityError(f"parity check failed: max |Δlogit| = {result['max_abs_logit_diff']:.3g} > tolerance "
                          f"{tolerance:g} (top-1 agreement {result['top1_agreement']:.4f} over "
                          f"{result['num_positions']} positions); the exported graph does not match PyTorch")

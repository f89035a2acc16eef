"""Export-time parity: the ONNX step graph against PyTorch on real prompts (DESIGN.md §5).

Each prompt is fed to the exported graph W tokens at a time (first window with an empty
past, later ones with a growing past, the last one padded with mask tokens), and the
logits at every position are compared with one plain causal PyTorch forward over the
same tokens. Any backend with ``step`` (onnxruntime on any provider, TensorRT) is
measured the same way. The past is kept here as plain arrays: parity checks the graph,
the runtime's cache manager has its own tests.
"""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from runtime.bundle import BundleConfig
from runtime.backends.fused import written_positions
from runtime.decode.batch import scratch_past, window_mask


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
    """Logits float32 [T_padded, V] of ``ids`` fed W at a time, the last window padded with masks."""
    window, dtype = config.window, np.dtype(config.dtype)
    padded = ids + [config.mask_token_id] * (-len(ids) % window)
    room = written_positions(window) - window if config.graph == "fused" else 0  # a one-token window's second row
    capacity = len(padded) + room
    past = scratch_past(config.num_layers, 1, config.num_kv_heads, capacity, config.head_dim, dtype)  # [1, H, S, D]
    chunks = []
    for start in range(0, len(padded), window):
        tokens = np.array([padded[start:start + window]], dtype=np.int64)  # [1, W]
        positions = np.arange(start, start + window, dtype=np.int64)[None]  # [1, W]
        logits, past = backend.step(tokens, positions, window_mask(np.array([start]), capacity, window), past)
        chunks.append(logits[0])
    return np.concatenate(chunks)


def check_parity(result: dict, tolerance: float) -> None:
    """Raise :class:`ParityError` if the max |Δlogit| is above ``tolerance``."""
    if not result["max_abs_logit_diff"] <= tolerance:
        on = f" on {result['backend']}" if "backend" in result else ""
        raise ParityError(f"parity check failed{on}: max |Δlogit| = {result['max_abs_logit_diff']:.3g} > tolerance "
                          f"{tolerance:g} (top-1 agreement {result['top1_agreement']:.4f} over "
                          f"{result['num_positions']} positions); the exported graph does not match PyTorch")

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
        ``{"max_abs_logit_diff", "top1_agreement", "num_positions", "num_prompts"}``; for a graph with the
        greedy head (``backend.takes_num_greedy``, :mod:`mars_export.greedy_head`) also
        ``"greedy_head_agreement"`` (the fraction of positions where its id is the argmax of the graph's
        own logits, the mask token excluded) and ``"greedy_head_max_gap"`` (the largest amount by which
        its id's logit falls below that argmax's: a near-tie, both being float32 sums in other orders).

    A prompt longer than the bundle's ``max_context`` is cut to the whole windows that fit in it
    (:func:`fit_prompts`).
    """
    max_diff, agree, total, head_agree, head_gap = 0.0, 0, 0, 0, 0.0
    takes_greedy = getattr(backend, "takes_num_greedy", False)
    for ids in fit_prompts(prompts, config):
        onnx_logits = _graph_logits(backend, config, ids)  # [T_padded, V]
        padded = ids + [config.mask_token_id] * (len(onnx_logits) - len(ids))
        with torch.no_grad():
            torch_logits = model(torch.tensor([padded])).logits[0].float().numpy()  # [T_padded, V]
        max_diff = max(max_diff, float(np.abs(onnx_logits - torch_logits).max()))
        agree += int((onnx_logits.argmax(-1) == torch_logits.argmax(-1)).sum())
        total += len(padded)
        if takes_greedy:
            chosen = _graph_logits(backend, config, ids, greedy_ids=True)  # [T_padded]
            allowed = onnx_logits.copy()
            allowed[:, config.mask_token_id] = -np.inf
            head_agree += int((chosen == allowed.argmax(-1)).sum())
            head_gap = max(head_gap, float((allowed.max(-1) - np.take_along_axis(allowed, chosen[:, None], 1)[:, 0]).max()))
    greedy = {"greedy_head_agreement": head_agree / total, "greedy_head_max_gap": head_gap} if takes_greedy else {}
    return {"max_abs_logit_diff": max_diff, "top1_agreement": agree / total,
            "num_positions": total, "num_prompts": len(prompts), **greedy}


def fit_prompts(prompts: list[list[int]], config: BundleConfig,
                num_new_tokens: int | None = None) -> list[list[int]]:
    """``prompts`` cut to what a measurement can feed within the bundle's ``max_context`` (a model with sliding
    attention, or longrope scaling, has a small one: :mod:`mars_export.context`).

    Args:
        num_new_tokens: None to feed each prompt W at a time, the last window padded (:func:`measure_parity`):
            cut to the whole windows that fit; else the tokens generated after it: cut so that prompt + new
            tokens + one window fit, as the engine requires (:meth:`runtime.decode.engine.Engine.room`).

    Raises:
        ValueError: no prompt token fits beside ``num_new_tokens``.
    """
    if num_new_tokens is None:
        max_tokens = config.max_context // config.window * config.window
    else:
        max_tokens = config.max_context - config.window - num_new_tokens
    if max_tokens < 1:
        raise ValueError(f"no prompt token fits in the bundle's max context of {config.max_context} beside "
                         f"{num_new_tokens} new tokens and a window of {config.window}; generate fewer tokens")
    return [ids[:max_tokens] for ids in prompts]


def _graph_logits(backend, config: BundleConfig, ids: list[int], greedy_ids: bool = False) -> np.ndarray:
    """Logits float32 [T_padded, V] of ``ids`` fed W at a time, the last window padded with masks (with
    ``greedy_ids``: the greedy head's ids int64 [T_padded] instead)."""
    window, dtype = config.window, np.dtype(config.dtype)
    padded = ids + [config.mask_token_id] * (-len(ids) % window)
    room = written_positions(window) - window if config.graph == "fused" else 0  # a one-token window's second row
    capacity = len(padded) + room
    past = scratch_past(config.num_layers, 1, config.num_kv_heads, capacity, config.head_dim, dtype)  # [1, H, S, D]
    chunks = []
    for start in range(0, len(padded), window):
        tokens = np.array([padded[start:start + window]], dtype=np.int64)  # [1, W]
        positions = np.arange(start, start + window, dtype=np.int64)[None]  # [1, W]
        mask = window_mask(np.array([start]), capacity, window)
        out, past = (backend.step(tokens, positions, mask, past, greedy_ids=True) if greedy_ids
                     else backend.step(tokens, positions, mask, past))
        chunks.append(out[0])
    return np.concatenate(chunks)


def check_parity(result: dict, tolerance: float) -> None:
    """Raise :class:`ParityError` if the max |Δlogit| is above ``tolerance``, or the greedy head's ids fall
    more than ``tolerance`` below the argmax of the graph's logits."""
    if not result.get("greedy_head_max_gap", 0.0) <= tolerance:
        raise ParityError(f"the greedy head's ids fall {result['greedy_head_max_gap']:.3g} below the argmax logit "
                          f"(tolerance {tolerance:g}; agreement {result['greedy_head_agreement']:.4f}): its screening "
                          "bound does not hold on this onnxruntime; export with --int8 or report it")
    if not result["max_abs_logit_diff"] <= tolerance:
        on = f" on {result['backend']}" if "backend" in result else ""
        raise ParityError(f"parity check failed{on}: max |Δlogit| = {result['max_abs_logit_diff']:.3g} > tolerance "
                          f"{tolerance:g} (top-1 agreement {result['top1_agreement']:.4f} over "
                          f"{result['num_positions']} positions); the exported graph does not match PyTorch")

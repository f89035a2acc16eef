"""PyTorch reference decoders: the oracle every backend is tested against.

- :func:`greedy_generate`: plain greedy AR with a KV cache, one token per forward.
- :class:`ReferenceDecoder`: MARS threshold decoding with a KV cache (MARS, arXiv
  2604.07023, §3; DESIGN.md §3), written independently of the runtime's numpy decoder
  but with the same names, the same window protocol and the same results type
  (:class:`runtime.decode.params.GenerationResult`), so a test can compare them id for id.

Dimension letters (the glossary in :mod:`runtime`): W window, V vocabulary, P cached positions,
r uncached real tokens, M predictions of one step.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel

from runtime.decode.params import DecodeParams, GenerationResult


@torch.no_grad()
def greedy_generate(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: frozenset[int]) -> GenerationResult:
    """Greedy AR decoding with a KV cache: prefill the prompt, then one token per forward."""
    result, start = GenerationResult(), time.perf_counter()
    cache = DynamicCache(config=model.config)
    logits = model(torch.tensor([prompt_ids]), cache=cache, use_cache=True).logits[0, -1]  # [V]
    result.num_prefill_forwards, result.prefill_seconds = 1, time.perf_counter() - start
    while True:
        token = int(logits.argmax())
        result.token_ids.append(token)
        result.num_forwards += 1
        if token in stop_ids:
            result.finish_reason = "stop"
            break
        if result.num_tokens >= max_new_tokens:
            break
        logits = model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
    result.seconds = time.perf_counter() - start
    return result


def confidence(logits: torch.Tensor, metric: str) -> torch.Tensor:
    """Confidence of each row's argmax in [0, 1]; [M, V] -> [M] (same metrics as the runtime)."""
    probs = torch.softmax(logits.float(), dim=-1)
    if metric == "probability":
        return probs.max(dim=-1).values
    if metric == "margin":
        top2 = probs.topk(2, dim=-1).values  # [M, 2], sorted
        return top2[:, 0] - top2[:, 1]
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)
    return 1.0 - entropy / torch.log(torch.tensor(float(probs.shape[-1])))


def count_accepted(predicted_ids: torch.Tensor, confidences: torch.Tensor, tau: float,
                   max_accept: int, stop_ids: frozenset[int]) -> int:
    """Left-to-right acceptance: the first prediction always; each next one while no end
    token was accepted, the count is below ``max_accept`` and its confidence exceeds tau."""
    count = 1
    for j in range(1, min(len(predicted_ids), max_accept)):
        if int(predicted_ids[j - 1]) in stop_ids or not float(confidences[j]) > tau:
            break
        count += 1
    return count


class ReferenceDecoder:
    """MARS threshold decoding in PyTorch, batch 1.

    Args:
        model: the causal LM (float32, eval).
        block_size: B, most tokens accepted per step.
        window: W tokens per decode forward (uncached real tokens, then masks).
        mask_token_id: the MARS mask token.
        eos_token_ids: default stop ids.
    """

    def __init__(self, model: PreTrainedModel, block_size: int, window: int, mask_token_id: int,
                 eos_token_ids: tuple[int, ...]):
        assert 1 <= block_size <= window
        self.model, self.block_size, self.window = model, block_size, window
        self.mask_token_id, self.eos_token_ids = mask_token_id, eos_token_ids

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], params: DecodeParams) -> GenerationResult:
        """Same contract as :meth:`runtime.decode.decoder.Decoder.generate`."""
        block_size = params.block_size or self.block_size
        stop_ids = params.stop_ids if params.stop_ids is not None else frozenset(self.eos_token_ids)
        result, start = GenerationResult(), time.perf_counter()
        cache = DynamicCache(config=self.model.config)
        if len(prompt_ids) > 1:
            self.model(torch.tensor([prompt_ids[:-1]]), cache=cache, use_cache=True)
            result.num_prefill_forwards = 1
        result.prefill_seconds = time.perf_counter() - start
        uncached = [prompt_ids[-1]]
        while result.finish_reason != "stop" and result.num_tokens < params.max_new_tokens:
            past_len = cache.get_seq_length()
            window_ids = uncached + [self.mask_token_id] * (self.window - len(uncached))  # [W]
            positions = torch.arange(past_len, past_len + self.window)[None]  # [1, W]
            logits = self.model(torch.tensor([window_ids]), position_ids=positions, cache=cache,
                                use_cache=True).logits[0, len(uncached) - 1:]  # [W - r + 1, V]
            logits[:, self.mask_token_id] = torch.finfo(logits.dtype).min  # never generate the mask token
            if len(uncached) < self.window:
                cache.crop(len(uncached) - self.window)  # drop the KV of the W - r masks
            predicted = logits.argmax(dim=-1)
            budget = min(block_size, params.max_new_tokens - result.num_tokens)
            accepted = predicted[:count_accepted(predicted, confidence(logits, params.metric), params.tau,
                                                 budget, stop_ids)].tolist()
            result.token_ids.extend(accepted)
            result.num_forwards += 1
            result.finish_reason = "stop" if accepted[-1] in stop_ids else result.finish_reason
            uncached = accepted
        result.seconds = time.perf_counter() - start
        return result

"""The step graph as a torch module with explicit KV-cache I/O (DESIGN.md §5).

Dimension letters: B batch, W window, P past length, H KV heads, D head dim, V vocab.
The module wraps a Hugging Face causal LM so that ``torch.onnx.export`` sees plain
tensors in and out: the past KV per layer goes in as tensors, the W new KV entries per
layer come out, and the attention mask is an explicit bool [B, 1, W, P + W] that the
runtime builds (causal for decoding; anything else for batching or verification).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class StepModule(torch.nn.Module):
    """One forward over a window of W tokens against P cached positions.

    forward(input_ids int64 [B, W], position_ids int64 [B, W], attention_mask bool
    [B, 1, W, P + W], past: list over layers of (key, value) [B, H, P, D])
    -> (logits float32 [B, W, V], list over layers of (key, value) [B, H, W, D]).

    The bool mask becomes an additive mask filled with the dtype's finite minimum
    (never -inf: a fully masked row must stay finite, and eager attention would misread
    a bool 4-D mask). Positions come from ``position_ids``, so RoPE is not tied to the
    length of the example used at export.
    """

    def __init__(self, model: PreTrainedModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, past):
        window = input_ids.shape[1]
        dtype = self.model.dtype
        cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in past], config=self.model.config)
        bias = torch.where(attention_mask, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=bias,
                         cache=cache, use_cache=True)
        present = [(layer.keys[:, :, -window:], layer.values[:, :, -window:]) for layer in cache.layers]
        return out.logits.float(), present

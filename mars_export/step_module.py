"""The step graph as a torch module with explicit KV-cache I/O (DESIGN.md §5).

Dimension letters: B batch, W window, P past length, H heads, Hkv KV heads, D head dim,
V vocab, K keys (P + W).
The module wraps a Hugging Face causal LM so that ``torch.onnx.export`` sees plain
tensors in and out: the past KV per layer goes in as tensors, the W new KV entries per
layer come out, and the attention mask is an explicit bool [B, 1, W, P + W] that the
runtime builds (causal for decoding; anything else for batching or verification).
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    DynamicCache,
    PreTrainedModel,
)
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import sdpa_mask

# fp16 exports compute attention scores and softmax in float32 (see fp32_score_attention).
FP32_SCORE_ATTENTION = "mars_fp32_scores"


class StepModule(torch.nn.Module):
    """One forward over a window of W tokens against P cached positions.

    forward(input_ids int64 [B, W], position_ids int64 [B, W], attention_mask bool
    [B, 1, W, P + W], past: list over layers of (key, value) [B, H, P, D])
    -> (logits float32 [B, W, V], list over layers of (key, value) [B, H, W, D]).

    The bool mask becomes an additive mask filled with the dtype's finite minimum
    (never -inf: a fully masked row must stay finite, and eager attention would misread
    a bool 4-D mask; in fp16 that minimum is -65504, finite in fp16). Positions come from
    ``position_ids``, so RoPE is not tied to the length of the example used at export.
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


def fp32_score_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention whose scores, mask addition and softmax run in float32.

    query [B, H, W, D], key/value [B, Hkv, K, D] in the model dtype; attention_mask
    additive [B, 1, W, K]. Returns ([B, W, H, D] in the model dtype, None). In fp16,
    q·k over D = 64..128 can pass 65504 and a softmax over K keys loses the small terms;
    in float32 neither happens, and the weights go back to fp16 (in [0, 1]) for p·v.
    """
    key = repeat_kv(key, module.num_key_value_groups).float()  # [B, H, K, D]
    scores = torch.matmul(query.float(), key.transpose(2, 3)) * scaling  # [B, H, W, K]
    if attention_mask is not None:
        scores = scores + attention_mask.float()
    weights = torch.softmax(scores, dim=-1).to(value.dtype)  # [B, H, W, K]
    out = torch.matmul(weights, repeat_kv(value, module.num_key_value_groups))  # [B, H, W, D]
    return out.transpose(1, 2).contiguous(), None  # [B, W, H, D]


AttentionInterface.register(FP32_SCORE_ATTENTION, fp32_score_attention)
AttentionMaskInterface.register(FP32_SCORE_ATTENTION, sdpa_mask)


def prepare_fp16_model(model: PreTrainedModel) -> PreTrainedModel:
    """An fp16 copy of ``model`` for export, ``model`` itself untouched (parity compares with it).

    Weights, activations and KV become fp16; Hugging Face's RMSNorm already squares and
    averages in float32; attention scores and softmax run in float32
    (:func:`fp32_score_attention`); logits are cast to float32 by :class:`StepModule`.
    Float buffers (RoPE's ``inv_freq``) stay float32: ``.half()`` would round them to
    11 bits, an angle error of ~1e-4 × position radians (0.8 rad at position 8000).
    """
    half = copy.deepcopy(model).eval()
    buffers = {name: buf for name, buf in half.named_buffers() if buf.is_floating_point()}
    half.half()
    for name, buf in buffers.items():
        owner, _, attr = name.rpartition(".")
        setattr(half.get_submodule(owner), attr, buf)  # assigning to a registered buffer replaces it
    half.set_attn_implementation(FP32_SCORE_ATTENTION)
    return half

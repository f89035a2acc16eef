"""The step graph as a torch module with explicit KV-cache I/O (DESIGN.md §5).

Dimension letters: B batch, W window, P past length, H query heads, Hkv KV heads,
G = H / Hkv query heads per KV head, D head dim, V vocab, K keys (P + W).

The module wraps a Hugging Face causal LM so that ``torch.onnx.export`` sees plain
tensors in and out: the past KV per layer goes in as tensors, the W new KV entries per
layer come out, and the attention mask is an explicit bool [B, 1, W, P + W] that the
runtime builds (causal for decoding; anything else for batching or verification).

What the export traces, to keep a decode step to its weight reads (GitHub issue 11):

- Attention (:func:`step_attention`, through transformers' ``AttentionInterface``): the
  query heads of one KV head are stacked along the query axis, [B, Hkv, G·W, D], so the
  KV heads are never repeated; the scores are one MatMul against the past keys, read in
  place, and one against the W new keys, laid out as if every new key were also written at
  the index of its position (:func:`at_positions`; the mask is moved likewise, and the
  copy left after the past is hidden); p·v is one MatMul against the past values with the
  new ones written that way (a copy of the past values). A key then
  sits at the same index whether it is fed in a window or was committed by an earlier
  step into the runtime's cache (which holds position p at index p, capacity padded), so
  the softmax sum and p·v add the same terms in the same lanes and blocks: a token scored
  inside a window gets the bits of the same token fed one step at a time. Otherwise
  1-ulp differences appear, which int8 activations (MatMulNBits ``accuracy_level`` 4)
  grow into logit differences above 1, so verification left greedy AR. The price is one
  copy of the past values per layer and step (the sum over keys of p·v is what the layout
  fixes; a score is one dot product wherever its key sits, so the past keys need none).
- RoPE (:func:`rotary_joint`) rotates the query and key heads of a layer together, with
  the sign of rotate_half folded into the sine: one half-swap instead of two, no Neg.
- RMSNorm (:func:`rms_norm_div_form`) is traced as ``x / sqrt(mean(x²) + eps) * w``, the
  pattern onnxruntime's graph optimizer fuses into one ``SimplifiedLayerNormalization``
  when it loads the graph; the file itself holds only standard ONNX ops (TensorRT reads it).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.masking_utils import sdpa_mask
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

STEP_ATTENTION = "mars_step"
# Model families whose RMSNorm is weight * x * rsqrt(mean(x²) + eps) (computed in float32)
# and whose attention calls the module-level apply_rotary_pos_emb (rotate_half RoPE).
FAMILIES = (modeling_llama, modeling_qwen2, modeling_qwen3)
RMS_NORM_TYPES = (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm, modeling_qwen3.Qwen3RMSNorm)


@dataclass
class StepKV:
    """The KV of one step, handed to every layer's attention through the model's kwargs.

    Attributes:
        past: per layer (key, value) [B, Hkv, P, D].
        positions: int64 [B, W], the step's position ids: new entry j of row b also goes to
            index ``positions[b, j]`` (< P + W) of the keys and values (:func:`at_positions`).
        present: filled by :func:`step_attention`, layer by layer, with the new
            (key, value) [B, Hkv, W, D] (after RoPE).
    """

    past: list[tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor
    present: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class StepModule(torch.nn.Module):
    """One forward over a window of W tokens against P cached positions.

    forward(input_ids int64 [B, W], position_ids int64 [B, W], attention_mask bool
    [B, 1, W, P + W], past: list over layers of (key, value) [B, Hkv, P, D])
    -> (logits float32 [B, W, V], list over layers of (key, value) [B, Hkv, W, D]).

    The bool mask becomes an additive mask filled with the dtype's finite minimum
    (never -inf: a fully masked row must stay finite; in fp16 that minimum is -65504,
    finite in fp16). Positions come from ``position_ids``, so RoPE is not tied to the
    length of the example used at export; ``position_ids[b, j]`` must be below P + W and
    must not be a past index that row b may see (the runtime feeds position p at cache
    index p, after the row's committed length). The model must run :func:`step_attention`
    (see :func:`step_graph_model`).
    """

    def __init__(self, model: PreTrainedModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, past):
        dtype = self.model.dtype
        step_kv = StepKV(past=list(past), positions=position_ids)
        bias = torch.where(attention_mask, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)  # [B, 1, W, K]
        window = input_ids.shape[1]
        new_bias = bias[..., -window:]  # [B, 1, W, W]: the new keys' columns, moved to their positions
        index = position_ids[:, None, None, :].expand(new_bias.shape)
        bias = torch.cat([bias[..., :-window], torch.full_like(new_bias, torch.finfo(dtype).min)], dim=-1)
        bias = bias.scatter(-1, index, new_bias)  # [B, 1, W, K] in the layout of at_positions
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=bias, use_cache=False,
                         step_kv=step_kv)
        return out.logits.float(), step_kv.present


def step_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, step_kv=None, **kwargs):
    """Grouped attention of W queries over the layer's past and its W new keys.

    Args:
        module: the attention layer (``layer_idx`` picks its past from ``step_kv``).
        query: [B, H, W, D]; key, value: the W new entries [B, Hkv, W, D], in the model dtype.
        attention_mask: additive [B, 1, W, P + W] over the keys as :func:`at_positions` lays
            them out (StepModule moves the new keys' columns there).
        scaling: score scale (1 / sqrt(D) for these models).
        step_kv: the step's :class:`StepKV`; this layer's new (key, value) is appended to
            ``step_kv.present``.

    Returns:
        ([B, W, H, D] in the model dtype, None).

    Scores, mask and softmax run in float32 (in fp16, q·k over D = 64..128 can pass 65504
    and a softmax over K keys loses the small terms); the weights go back to the model
    dtype (in [0, 1]) for p·v. Scores and values are laid out by :func:`at_positions`, so a
    token scored in a window gets the bits of one-at-a-time steps over the runtime's cache
    (onnxruntime CPU); the past keys are read in place. Query head h uses KV head h // G, as
    ``repeat_kv`` would. No MatMul here runs one row or one column: MLAS gives those its matrix-vector
    kernel, whose sums differ from the general kernel's, so a one-token step would get other bits than a
    window; with one query head per KV head (G = 1) every query row is therefore scored twice.

    Raises:
        ValueError: called without ``step_kv`` (the model was not run through StepModule).
    """
    if step_kv is None:
        raise ValueError(f"attention {STEP_ATTENTION!r} runs only inside StepModule (it needs the step's past KV)")
    assert len(step_kv.present) == module.layer_idx, "layers must run in order"
    past_key, past_value = step_kv.past[module.layer_idx]
    step_kv.present.append((key, value))
    batch, num_heads, window, head_dim = query.shape
    num_kv_heads, past = key.shape[1], past_key.shape[2]
    group = num_heads // num_kv_heads
    grouped = _float(query).reshape(batch, num_kv_heads, group * window, head_dim) * scaling  # [B, Hkv, G·W, D]
    if group == 1:  # one query row per KV head at W = 1: score each row twice, so that no MatMul runs one row
        grouped = torch.cat([grouped, grouped], dim=2)  # [B, Hkv, 2·W, D]
    # Against the new keys twice over, then the first W columns: a one-column MatMul (W = 1) would take MLAS's
    # matrix-vector kernel, whose sums differ from the general kernel's unless onnxruntime's optimizer has fused
    # the transpose (bits kept at every graph optimization level, not only at the default).
    new_keys = _float(torch.cat([key, key], dim=2)).transpose(2, 3)  # [B, Hkv, D, 2W]
    scores = at_positions(grouped @ _float(past_key).transpose(2, 3),  # [B, Hkv, G·W, P]: the past read in place
                          (grouped @ new_keys)[..., :window], step_kv.positions, dim=3)  # [B, Hkv, G·W, K]
    scores = scores.view(batch, num_kv_heads, -1, window, past + window)  # [B, Hkv, G, W, K]
    scores = scores + _float(attention_mask)[:, :, None]  # mask [B, 1, 1, W, K]
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    weights = weights.view(batch, num_kv_heads, -1, past + window)  # [B, Hkv, G·W, K]
    out = weights @ at_positions(past_value, value, step_kv.positions)  # [B, Hkv, G·W, D]
    if group == 1:
        out = out[:, :, :window]  # the first copy of each row
    out = out.view(batch, num_heads, window, head_dim)  # [B, H, W, D]
    return out.transpose(1, 2), None  # [B, W, H, D]


def at_positions(past: torch.Tensor, new: torch.Tensor, positions: torch.Tensor, dim: int = 2) -> torch.Tensor:
    """past followed by new along the key axis ``dim``, new entry j of row b also written at index
    ``positions[b, j]`` of that axis.

    Values: past [B, Hkv, P, D], new [B, Hkv, W, D], dim 2 -> [B, Hkv, P + W, D]. Scores: past
    [B, Hkv, G·W, P] (queries against the past keys), new [B, Hkv, G·W, W] (against the new keys),
    dim 3 -> [B, Hkv, G·W, P + W]: the scores of the keys laid out this way, each score the same
    dot product, without a copy of the past keys.

    The runtime's cache holds position p at index p (StepModule's mask hides the rest), so
    each key lands where a later step will read it from the cache; the copies at P.. stay
    hidden by the mask unless they are that index (a past of exactly the committed length).
    """
    shape = [positions.shape[0], 1, 1, 1]
    shape[dim] = positions.shape[1]
    index = positions.reshape(shape).expand(new.shape)  # new's shape, positions[b, j] along dim
    return torch.cat([past, new], dim=dim).scatter(dim, index, new)


def _float(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 (no op, and no Cast in the graph, when it already is)."""
    return x if x.dtype == torch.float32 else x.float()


AttentionInterface.register(STEP_ATTENTION, step_attention)
AttentionMaskInterface.register(STEP_ATTENTION, sdpa_mask)  # unused: StepModule passes a 4-D mask as it is


def rms_norm_div_form(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``norm``'s RMSNorm written as onnxruntime's SimplifiedLayerNormalization fusion expects it.

    hidden [..., C] -> [..., C] in its dtype: weight · (x / sqrt(mean(x²) + eps)) with x
    in float32, the same function as the transformers module (which multiplies by rsqrt).
    """
    x = hidden.float()
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * normed.to(hidden.dtype)


def rotary_joint(query, key, cos, sin, unsqueeze_dim=1):
    """RoPE of query [B, H, W, D] and key [B, Hkv, W, D] in one pass; cos, sin [B, W, D].

    The same function as transformers' ``apply_rotary_pos_emb`` (x·cos + rotate_half(x)·sin
    with rotate_half(x) = (-x2, x1)), written as x·cos + (x2, x1)·(-sin1, sin2): the halves
    are swapped once for all heads and the sign lives in the sine, so the graph has no Neg.
    Returns (query, key) rotated, shapes unchanged.
    """
    half = query.shape[-1] // 2
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # [B, 1, W, D]
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # [B, 1, W, D]
    heads = torch.cat([query, key], dim=1)  # [B, H + Hkv, W, D]
    swapped = torch.cat([heads[..., half:], heads[..., :half]], dim=-1)  # [B, H + Hkv, W, D]
    rotated = heads * cos + swapped * signed_sin  # [B, H + Hkv, W, D]
    return rotated.split([query.shape[1], key.shape[1]], dim=1)


@contextlib.contextmanager
def step_graph_model(model: PreTrainedModel):
    """``model`` set up for tracing the step graph, restored on exit.

    Inside: attention is :func:`step_attention`, every RMSNorm of a known family runs
    :func:`rms_norm_div_form`, and those families' RoPE is :func:`rotary_joint`. The
    weights are shared, never copied.
    """
    previous = model.config._attn_implementation
    norms = [m for m in model.modules() if isinstance(m, RMS_NORM_TYPES)]
    rotaries = [family.apply_rotary_pos_emb for family in FAMILIES]
    model.set_attn_implementation(STEP_ATTENTION)
    for norm in norms:
        norm.forward = lambda hidden, norm=norm: rms_norm_div_form(norm, hidden)
    for family in FAMILIES:
        family.apply_rotary_pos_emb = rotary_joint
    try:
        yield model
    finally:
        for family, rotary in zip(FAMILIES, rotaries):
            family.apply_rotary_pos_emb = rotary
        for norm in norms:
            del norm.forward
        model.set_attn_implementation(previous)


def prepare_fp16_model(model: PreTrainedModel) -> PreTrainedModel:
    """An fp16 copy of ``model`` for export, ``model`` itself untouched (parity compares with it).

    Weights, activations and KV become fp16; RMSNorm squares and averages in float32;
    attention scores and softmax run in float32 (:func:`step_attention`); logits are
    cast to float32 by :class:`StepModule`. Float buffers (RoPE's ``inv_freq``) stay
    float32: ``.half()`` would round them to 11 bits, an angle error of ~1e-4 × position
    radians (0.8 rad at position 8000).
    """
    half = copy.deepcopy(model).eval()
    buffers = {name: buf for name, buf in half.named_buffers() if buf.is_floating_point()}
    half.half()
    for name, buf in buffers.items():
        owner, _, attr = name.rpartition(".")
        setattr(half.get_submodule(owner), attr, buf)  # assigning to a registered buffer replaces it
    return half

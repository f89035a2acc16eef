"""The step graph as a torch module with explicit KV-cache I/O (DESIGN.md §5).

Dimension letters: B batch, W window, S cache capacity (the past fed, every position < S), H query
heads, Hkv KV heads, G = H / Hkv query heads per KV head, D head dim, V vocab.

The module wraps a Hugging Face causal LM so that ``torch.onnx.export`` sees plain
tensors in and out: the KV cache per layer goes in as tensors and comes out with the W new
entries written at their positions, and the attention mask is an explicit bool [B, 1, W, S]
over the cache's indices that the runtime builds (causal for decoding; anything else for
batching or verification).

What the export traces, to keep a decode step to its weight reads (GitHub issue 11):

- KV cache in place: ``past_key_values.{i}.*`` is the runtime's cache [B, Hkv, S, D] (position p at
  index p, S the capacity) and ``present.{i}.*`` is that cache with the W new entries written at the
  indices of their positions (:func:`in_place`, one ScatterND). The runtime binds each present to
  its past's own buffer (onnxruntime I/O binding), where onnxruntime's scatter writes the W entries and
  copies nothing; attention reads the written cache, so no step copies the past, and the runtime's
  commit has nothing left to copy.
- Attention (:func:`step_attention`, through transformers' ``AttentionInterface``): the query heads of
  one KV head are stacked along the query axis, [B, Hkv, G·W, D], so the KV heads are never repeated;
  the scores are one MatMul of the S cached keys by those rows, p·v one product per query row over the S
  cached values (:func:`step_attention` says why). A key sits at the same index whether it is fed in a window or was
  committed by an earlier step, so the softmax sum and p·v add the same terms in the same lanes and
  blocks: a token scored inside a window gets the bits of the same token
  fed one step at a time (onnxruntime CPU). Otherwise 1-ulp differences appear, which int8 activations
  (MatMulNBits ``accuracy_level`` 4) grow into logit differences above 1, so verification left greedy AR.
- RoPE (:func:`rotary_joint`) rotates the query and key heads of a layer together, with
  the sign of rotate_half folded into the sine: one half-swap instead of two, no Neg.
- Dynamic-NTK RoPE (``rope_type`` ``"dynamic"``, also one layer type's, as Gemma3 may have) is traced as the
  default RoPE (:func:`step_graph_model`): transformers recomputes its frequencies only once a forward's positions
  pass ``max_position_embeddings``, which a bundle's context never does, and below that they are the default ones.
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
        past: per layer (key, value) [B, Hkv, S, D], the cache.
        positions: int64 [B, W], the step's position ids: new entry j of row b is written at
            index ``positions[b, j]`` (< S) of the cache (:func:`in_place`).
        present: filled by :func:`step_attention`, layer by layer, with the cache (key, value)
            [B, Hkv, S, D] holding the W new entries (after RoPE) at their positions.
    """

    past: list[tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor
    present: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class StepModule(torch.nn.Module):
    """One forward over a window of W tokens against a KV cache of S positions, the window's KV written into it.

    forward(input_ids int64 [B, W], position_ids int64 [B, W], attention_mask bool [B, 1, W, S],
    past: list over layers of (key, value) [B, Hkv, S, D]) -> (logits float32 [B, W, V], list over
    layers of (key, value) [B, Hkv, S, D]: ``past`` with new entry j of row b at index
    ``position_ids[b, j]``).

    Mask column k is cache index k; a query must see its own and earlier window entries at
    their positions. The bool mask becomes an additive mask filled with the dtype's finite
    minimum (never -inf: a fully masked row must stay finite; in fp16 that minimum is -65504,
    finite in fp16). Positions come from ``position_ids``, so RoPE is not tied to the length of
    the example used at export; ``position_ids`` must be below S and must not be a cache index
    that row b keeps (the runtime feeds position p at cache index p, after the row's committed
    length; an index outside 0..S-1 fails the forward). The model must run :func:`step_attention`
    (see :func:`step_graph_model`).
    """

    def __init__(self, model: PreTrainedModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, past):
        dtype = self.model.dtype
        step_kv = StepKV(past=list(past), positions=position_ids)
        bias = torch.where(attention_mask, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)  # [B, 1, W, S]
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=bias, use_cache=False,
                         step_kv=step_kv)
        return out.logits.float(), step_kv.present


def step_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, step_kv=None, softcap=None,
                   **kwargs):
    """Grouped attention of W queries over the layer's KV cache, the W new entries written into it.

    Args:
        module: the attention layer (``layer_idx`` picks its past from ``step_kv``).
        query: [B, H, W, D]; key, value: the W new entries [B, Hkv, W, D], in the model dtype.
        attention_mask: additive [B, 1, W, S] over the cache's indices.
        scaling: score scale (1 / sqrt(D) for these models).
        step_kv: the step's :class:`StepKV`; this layer's cache with the new entries written
            (:func:`in_place`) is appended to ``step_kv.present``.
        softcap: None, or the cap c of the attention logits (Gemma2's ``attn_logit_softcapping``): the
            scaled scores become c · tanh(score / c) before the mask, as in transformers' eager attention.

    Returns:
        ([B, W, H, D] in the model dtype, None).

    Scores, mask and softmax run in float32 (in fp16, q·k over D = 64..128 can pass 65504
    and a softmax over S keys loses the small terms); the weights go back to the model
    dtype (in [0, 1]) for p·v. Query head h uses KV head h // G, as ``repeat_kv`` would.
    MLAS gives a one-row (or one-column) MatMul its matrix-vector kernels, whose sums differ from
    the general kernel's, so every product must take the same kind whatever W is. The scores are
    the general kernel's, keys first: [S, D] x [D, G·W], the keys read where they lie (as the second
    operand, transposed, they were packed into a copy for every (row of B, KV head): the batch-16
    step 1.06-1.17x as long at P 1024-2048, BENCHMARKS.md), never one column (with one query head
    per KV head, G = 1, every query row is scored twice), and transposed back to [G·W, S] for the
    softmax. Not the column-vector kernel per row: its sums depend on where MLAS's split of the
    S keys between threads falls, which depends on how many products the step has. p·v always runs
    one row: each row [1, S] is its own product with the values, read where they lie (the general
    kernel packs the values for every (row of B, KV head): the batch-16 step 1.12x as long).

    Raises:
        ValueError: called without ``step_kv`` (the model was not run through StepModule).
    """
    if step_kv is None:
        raise ValueError(f"attention {STEP_ATTENTION!r} runs only inside StepModule (it needs the step's past KV)")
    assert len(step_kv.present) == module.layer_idx, "layers must run in order"
    past_key, past_value = step_kv.past[module.layer_idx]
    cache_key = in_place(past_key, key, step_kv.positions)  # [B, Hkv, S, D]
    cache_value = in_place(past_value, value, step_kv.positions)  # [B, Hkv, S, D]
    step_kv.present.append((cache_key, cache_value))
    batch, num_heads, window, head_dim = query.shape
    num_kv_heads, capacity = key.shape[1], past_key.shape[2]
    group = num_heads // num_kv_heads
    grouped = _float(query).reshape(batch, num_kv_heads, group * window, head_dim) * scaling  # [B, Hkv, G·W, D]
    if group == 1:  # one query row per KV head at W = 1: score each row twice, so that no MatMul runs one column
        grouped = torch.cat([grouped, grouped], dim=2)  # [B, Hkv, 2·W, D]
    scores = (_float(cache_key) @ grouped.transpose(2, 3)).transpose(2, 3)  # [B, Hkv, S, G·W] -> [B, Hkv, G·W, S]
    scores = scores.reshape(batch, num_kv_heads, -1, window, capacity)  # [B, Hkv, G, W, S]
    if softcap is not None:  # Gemma2: each score capped to (-softcap, softcap), before the mask
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + _float(attention_mask)[:, :, None]  # mask [B, 1, 1, W, S]
    weights = torch.softmax(scores, dim=-1).to(value.dtype)  # [B, Hkv, G (2 if G = 1), W, S]
    if group == 1:
        weights = weights[:, :, :1]  # the first copy of each row: p·v runs one row anyway
    weights = weights.reshape(batch, num_kv_heads, group * window, 1, capacity)  # [B, Hkv, G·W, 1, S]
    out = (weights @ cache_value[:, :, None]).squeeze(3)  # [B, Hkv, G·W, D]: one product per row
    out = out.view(batch, num_heads, window, head_dim)  # [B, H, W, D]
    return out.transpose(1, 2), None  # [B, W, H, D]


def in_place(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``cache`` [B, Hkv, S, D] with new entry j of row b [B, Hkv, W, D] written at index ``positions[b, j]``
    (int64 [B, W], each < S) of the position axis. One ScatterND in the graph (its indices [B, Hkv, W, 3] are
    shared by every layer), which onnxruntime runs without copying ``cache`` when the result is bound to
    ``cache``'s own buffer; it addresses whole D-vectors, where ScatterElements checked and wrote element by
    element (batch 16, P 1024, W 1: 0.8 against 3.9 ms of kernel time over the 60 scatters, BENCHMARKS.md)."""
    batch, num_heads, window, _ = new.shape
    rows = torch.arange(batch).view(batch, 1, 1).expand(batch, num_heads, window)  # [B, Hkv, W]
    heads = torch.arange(num_heads).view(1, num_heads, 1).expand(batch, num_heads, window)  # [B, Hkv, W]
    return cache.index_put((rows, heads, positions[:, None, :].expand(batch, num_heads, window)), new)


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
    :func:`rms_norm_div_form`, those families' RoPE is :func:`rotary_joint`, and a dynamic-NTK rotary
    embedding (or layer type of one, :func:`as_default_rope`) runs as the default one. The weights are shared,
    never copied.

    Dynamic NTK: transformers' ``dynamic_rope_update`` branches on the forward's largest position (which
    torch.export cannot trace) and rescales the frequencies only past ``max_position_embeddings``; below, they
    are the ones computed at load (``original_inv_freq``), the default RoPE's. The bundle's context never
    passes ``max_position_embeddings`` (:func:`runtime.context.max_context_of`), so that is all the graph needs.
    """
    previous = model.config._attn_implementation
    norms = [m for m in model.modules() if isinstance(m, RMS_NORM_TYPES)]
    rotaries = [family.apply_rotary_pos_emb for family in FAMILIES]
    dynamic = {m: m.rope_type for m in model.modules()
               if isinstance(getattr(m, "rope_type", None), (str, dict)) and as_default_rope(m) != m.rope_type}
    model.set_attn_implementation(STEP_ATTENTION)
    for norm in norms:
        norm.forward = lambda hidden, norm=norm: rms_norm_div_form(norm, hidden)
    for family in FAMILIES:
        family.apply_rotary_pos_emb = rotary_joint
    for rotary in dynamic:
        rotary.rope_type = as_default_rope(rotary)
    try:
        yield model
    finally:
        for rotary, rope_type in dynamic.items():
            rotary.rope_type = rope_type
        for family, rotary in zip(FAMILIES, rotaries):
            family.apply_rotary_pos_emb = rotary
        for norm in norms:
            del norm.forward
        model.set_attn_implementation(previous)


def as_default_rope(rotary: torch.nn.Module) -> str | dict[str, str]:
    """The ``rope_type`` of a transformers rotary embedding with each dynamic-NTK type (any name holding
    ``"dynamic"``, as ``dynamic_rope_update`` tests it) made ``"default"``: the one type, or the type of each
    layer type where the module holds one per layer type (Gemma3's ``{"full_attention": ..., ...}``, whose
    frequencies are ``{layer_type}_inv_freq``).

    Raises:
        AssertionError: a dynamic type's frequencies are not the ones computed at load (a forward past
            ``max_position_embeddings`` rescaled them before the export).
    """
    per_layer = rotary.rope_type if isinstance(rotary.rope_type, dict) else {"": rotary.rope_type}
    is_dynamic = {layer: isinstance(name, str) and "dynamic" in name for layer, name in per_layer.items()}
    for layer in (layer for layer, dynamic in is_dynamic.items() if dynamic):
        prefix = f"{layer}_" if layer else ""
        assert torch.equal(getattr(rotary, f"{prefix}inv_freq"), getattr(rotary, f"{prefix}original_inv_freq")), \
            "dynamic RoPE rescaled before export"
    default = {layer: "default" if is_dynamic[layer] else name for layer, name in per_layer.items()}
    return default if isinstance(rotary.rope_type, dict) else default[""]


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

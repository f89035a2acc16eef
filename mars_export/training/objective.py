"""The MARS training objective for one batch (DESIGN.md §2; MARS, arXiv 2604.07023).

A batch is right-padded token ids plus, per example, the prompt length ``P`` and the
total length ``n`` (prompt + response; the end-of-turn token is the last response
token). Lengths, never the pad id, say where an example ends: pad and eos share an id
in many tokenizers (SmolLM2: both 2), and masking labels by pad id drops the EOS target.

Dimension letters: N batch, L padded length of one stream, S = 2L both streams, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mars_export.training.attention import prepare_mars_attention_mask, prepare_position_ids, to_additive_mask

IGNORE_INDEX = -100


@dataclass
class MarsLoss:
    """The objective and its two terms, each a 0-dim float32 tensor.

    Attributes:
        loss: ``loss_mask + alpha * loss_ar``, the value to differentiate.
        loss_mask: mean CE over response targets predicted from the noisy stream.
        loss_ar: mean CE over the same targets from the clean stream (ordinary SFT loss).
    """

    loss: torch.Tensor
    loss_mask: torch.Tensor
    loss_ar: torch.Tensor


def _response_positions(input_ids: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Bool ``[N, L]``: True at response positions ``P <= p < n``."""
    if not bool((prompt_lengths >= 1).all() and (prompt_lengths < lengths).all()):
        raise ValueError("every example needs 1 <= prompt_length < length, got prompt_lengths="
                         f"{prompt_lengths.tolist()} lengths={lengths.tolist()}")
    if int(lengths.max()) > input_ids.shape[1]:
        raise ValueError(f"a length exceeds the padded width {input_ids.shape[1]}: {lengths.tolist()}")
    pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]  # [1, L]
    return (pos >= prompt_lengths[:, None]) & (pos < lengths[:, None])


def prepare_noisy_ids(input_ids: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor,
                      mask_token_id: int) -> torch.Tensor:
    """The noisy stream, int64 ``[N, L]``: every response position replaced by the mask token.

    Prompt positions and padding keep their ids (MARS, arXiv 2604.07023).
    """
    is_response = _response_positions(input_ids, prompt_lengths, lengths)
    return input_ids.masked_fill(is_response, mask_token_id)


def prepare_targets(input_ids: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """AR-aligned targets, int64 ``[N, L]``, shared by both streams.

    ``targets[:, i]`` is the token the output at index ``i`` must predict: ``input_ids[:, i+1]``
    when position ``i+1`` is a response position, else ``IGNORE_INDEX``. So the last prompt
    position predicts the first response token and the position before the end-of-turn
    token predicts it.
    """
    is_response = _response_positions(input_ids, prompt_lengths, lengths)
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, :-1] = input_ids[:, 1:].masked_fill(~is_response[:, 1:], IGNORE_INDEX)
    return targets


def prepare_mars_inputs(input_ids: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor,
                        mask_token_id: int, block_size: int, mask_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Model inputs for one two-stream forward.

    Returns:
        ``input_ids`` int64 ``[N, S]`` (noisy then clean), ``position_ids`` int64 ``[N, S]`` and
        ``attention_mask`` ``mask_dtype`` ``[N, 1, S, S]`` (additive: safe under eager and SDPA).
    """
    batch_size, max_length = input_ids.shape
    noisy = prepare_noisy_ids(input_ids, prompt_lengths, lengths, mask_token_id)
    mask = prepare_mars_attention_mask(lengths, max_length, block_size)
    return {
        "input_ids": torch.cat([noisy, input_ids], dim=1),  # [N, S]
        "position_ids": prepare_position_ids(batch_size, max_length, input_ids.device),
        "attention_mask": to_additive_mask(mask, mask_dtype),
    }


def mars_loss(logits: torch.Tensor, targets: torch.Tensor, alpha: float = 1.0) -> MarsLoss:
    """``CE(noisy) + alpha * CE(clean)`` over the response targets (MARS, arXiv 2604.07023).

    Args:
        logits: float ``[N, S, V]`` from the two-stream forward (noisy half first).
        targets: int64 ``[N, L]`` from :func:`prepare_targets`.
        alpha: weight of the clean-stream (AR/SFT) term; 0 is the paper's "no SFT loss" ablation.
    """
    if int((targets != IGNORE_INDEX).sum()) == 0:
        raise ValueError("the batch has no response targets")
    max_length = targets.shape[1]
    if logits.shape[1] != 2 * max_length:
        raise ValueError(f"logits cover {logits.shape[1]} positions, expected 2 * {max_length}")
    noisy, clean = logits[:, :max_length].float(), logits[:, max_length:].float()  # [N, L, V] each
    loss_mask = F.cross_entropy(noisy.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    loss_ar = F.cross_entropy(clean.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    return MarsLoss(loss_mask + alpha * loss_ar, loss_mask, loss_ar)


def compute_mars_loss(model: torch.nn.Module, input_ids: torch.Tensor, prompt_lengths: torch.Tensor,
                      lengths: torch.Tensor, mask_token_id: int, block_size: int, alpha: float = 1.0,
                      mask_dtype: torch.dtype = torch.float32) -> MarsLoss:
    """Run one two-stream forward of a causal LM and return the MARS objective.

    Args:
        model: a Hugging Face causal LM (any attention implementation; the mask is additive).
        input_ids: int64 ``[N, L]``, right-padded prompt + response ids.
        prompt_lengths, lengths: int64 ``[N]``.
        mask_dtype: the dtype attention runs in (the autocast dtype under mixed precision).
    """
    inputs = prepare_mars_inputs(input_ids, prompt_lengths, lengths, mask_token_id, block_size, mask_dtype)
    logits = model(**inputs, use_cache=False).logits  # [N, S, V]
    return mars_loss(logits, prepare_targets(input_ids, prompt_lengths, lengths), alpha)

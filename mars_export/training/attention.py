"""The two-stream MARS training attention mask (DESIGN.md §2; MARS, arXiv 2604.07023).

The training input is ``noisy | clean``, two copies of the same ``L`` positions side by
side (``2L`` tokens). Index ``a < L`` is noisy position ``a``; index ``a >= L`` is clean
position ``a - L``. Blocks are counted from position 0: ``blk(p) = p // block_size``.

Dimension letters: N batch, L padded length of one stream, S = 2L both streams.

Pitfall: Hugging Face *eager* attention adds the 4-D mask to the scores, so a bool
mask there is silently wrong (True adds 1, False adds 0). Give the model the additive
float mask from :func:`to_additive_mask` (works under eager and SDPA), or a bool mask
only under ``attn_implementation="sdpa"``.
"""

from __future__ import annotations

import torch


def prepare_mars_attention_mask(lengths: torch.Tensor, max_length: int, block_size: int) -> torch.Tensor:
    """Bool mask ``[N, 1, 2L, 2L]``, True where a query may attend to a key.

    MARS (arXiv 2604.07023) attention, with ``pos`` the position inside its stream:

    - clean query -> clean key: ``pos(k) <= pos(q)`` (plain causal);
    - noisy query -> noisy key: same block and ``pos(k) <= pos(q)``;
    - noisy query -> clean key: ``blk(k) < blk(q)`` (only earlier, complete blocks);
    - clean query -> noisy key: never.

    Right padding (``pos >= lengths[n]``) is never attended, and padded query rows are
    all False (see :func:`to_additive_mask` for why that yields no NaN).

    Args:
        lengths: int64 ``[N]``, real tokens per example (prompt + response), each in ``1..L``.
        max_length: ``L``, the padded length of one stream.
        block_size: ``B`` >= 1, tokens per MARS block.

    Raises:
        ValueError: ``block_size < 1`` or a length outside ``1..max_length``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if lengths.ndim != 1 or int(lengths.min()) < 1 or int(lengths.max()) > max_length:
        raise ValueError(f"lengths must be a 1-D tensor with values in 1..{max_length}, got {lengths.tolist()}")
    pattern = _two_stream_pattern(max_length, block_size, lengths.device)  # [S, S]
    valid = torch.arange(max_length, device=lengths.device)[None, :] < lengths[:, None]  # [N, L]
    valid = valid.repeat(1, 2)  # [N, S]: the same positions in both streams
    mask = pattern[None] & valid[:, :, None] & valid[:, None, :]  # [N, S(query), S(key)]
    return mask[:, None]  # [N, 1, S, S]


def _two_stream_pattern(max_length: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Bool ``[2L, 2L]`` pattern of the four MARS rules, before padding."""
    pos = torch.arange(max_length, device=device)
    blk = pos // block_size
    causal = pos[None, :] <= pos[:, None]  # [L(query), L(key)]
    same_block = blk[None, :] == blk[:, None]
    earlier_block = blk[None, :] < blk[:, None]
    never = torch.zeros_like(causal)
    noisy_rows = torch.cat([causal & same_block, earlier_block], dim=1)  # [L, S]
    clean_rows = torch.cat([never, causal], dim=1)  # [L, S]
    return torch.cat([noisy_rows, clean_rows], dim=0)  # [S, S]


def to_additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a bool mask into an additive float mask: 0 where True, ``finfo(dtype).min`` where False.

    The dtype minimum, not ``-inf``: a fully masked row (a padded query) then gets a
    uniform softmax instead of NaN, and a NaN there would poison the gradients even
    though the row carries no loss. Build it in the dtype attention runs in (the autocast
    dtype under mixed precision): ``finfo(float32).min`` cast to bf16/fp16 becomes ``-inf``.

    Args:
        mask: bool ``[N, 1, S, S]``.
        dtype: a floating dtype.

    Returns:
        ``dtype`` tensor ``[N, 1, S, S]``.
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"expected a bool mask, got dtype {mask.dtype}")
    if not dtype.is_floating_point:
        raise ValueError(f"additive masks need a floating dtype, got {dtype}")
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, torch.finfo(dtype).min)


def prepare_position_ids(batch_size: int, max_length: int, device: torch.device | None = None) -> torch.Tensor:
    """Position ids int64 ``[N, 2L]``: ``0..L-1`` for the noisy stream, then ``0..L-1`` again for the clean one."""
    pos = torch.arange(max_length, device=device)
    return pos.repeat(2)[None].expand(batch_size, -1)  # [N, S]

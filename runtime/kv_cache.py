"""KV cache for one sequence over preallocated buffers (DESIGN.md §3).

Dimension letters: L layers, H KV heads, S max cached positions, D head dim, W window.

Only the KV of positions whose input was a real token is committed; KV computed at mask
or padding positions is never written. Memory traffic per decode step: the step graph
takes the past as a contiguous [1, H, length, D] array per layer, so :meth:`past` copies
``2 * L * H * length * D`` elements out of the buffers, and :meth:`commit` copies
``2 * L * H * count * D`` in. (Removing the copy-out needs a graph that reads the whole
buffer in place; that is the batched cache manager's job.)
"""

from __future__ import annotations

import numpy as np


class KVCache:
    """Per-layer key/value buffers ``[1, H, S, D]`` and the number of committed positions.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        max_len: S, the most positions the cache can hold.
        dtype: numpy dtype of the bundle's KV (float32 or float16).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype):
        shape = (1, num_kv_heads, max_len, head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(num_layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(num_layers)]
        self.length = 0
        self.max_len = max_len

    def past(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Committed KV per layer as contiguous ``([1, H, length, D], [1, H, length, D])``."""
        n = self.length
        return [(np.ascontiguousarray(k[:, :, :n]), np.ascontiguousarray(v[:, :, :n]))
                for k, v in zip(self.keys, self.values)]

    def commit(self, presents: list[tuple[np.ndarray, np.ndarray]], count: int) -> None:
        """Append the first ``count`` entries of each layer's new KV ``[1, H, W, D]``.

        Raises:
            ValueError: the cache would overflow ``max_len``.
        """
        end = self.length + count
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.max_len}")
        for (k_new, v_new), k, v in zip(presents, self.keys, self.values):
            k[:, :, self.length:end] = k_new[:, :, :count]
            v[:, :, self.length:end] = v_new[:, :, :count]
        self.length = end

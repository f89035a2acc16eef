"""KV cache in device memory for GPU backends (DESIGN.md §4): the past never crosses to the host.

Dimension letters: L layers, N slots, H KV heads, S capacity, D head dim, W window, n rows.

Same layout and bookkeeping as :class:`runtime.decode.kv_cache.KVCache` (it is a subclass: the
lengths, :meth:`reserve`'s growth rule and :meth:`commit`'s overflow checks are that
class's); only the storage differs. Per layer one key and one value buffer ``[N, H, S, D]``
in device memory (one ``cudaMalloc`` each, so each is 256-byte aligned, as TensorRT wants
its tensor addresses):
  - :meth:`past` hands the backend :class:`~runtime.backends.cuda_runtime.DeviceTensor` views of
    slots 0..n-1 (the first n * H * S * D elements: a leading-axis slice is contiguous),
    which it binds as the graph's past inputs without a copy;
  - :meth:`commit` takes the backend's present outputs as device tensors ``[n, H, S', D]``
    (the past with each row's new entries written at their positions, in buffers of their
    own: :mod:`runtime.backends.trt` does not alias them to the cache) and copies, for each
    row, its ``count`` entries at positions ``length .. length + count - 1`` into the slot:
    one device-to-device 2-D copy (H rows of ``count * D`` elements) per row and tensor;
  - :meth:`reserve` reallocates (zero-filled: masked keys must hold finite numbers, as
    0 * NaN is NaN) and copies the committed prefix device-to-device; where the device memory
    runs out it frees what it got and raises MemoryError, the cache left as it was.
Host<->device traffic of the cache: none.
"""

from __future__ import annotations

import numpy as np

from runtime.backends.cuda_runtime import CudaRuntime, DeviceTensor
from runtime.decode.kv_cache import KVCache


class DeviceKVCache(KVCache):
    """:class:`~runtime.decode.kv_cache.KVCache` over device buffers, on the backend's CUDA stream.

    Args:
        cuda: the backend's :class:`~runtime.backends.cuda_runtime.CudaRuntime`.
        stream: the backend's stream; every copy is ordered on it with the forwards.
        num_layers, num_kv_heads, head_dim, max_len, dtype, num_slots: as ``KVCache``.

    Raises:
        MemoryError: out of device memory (its first buffers, or :meth:`reserve` growing them).
        RuntimeError: another CUDA call failed.
    """

    def __init__(self, cuda: CudaRuntime, stream, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype, num_slots: int = 1):
        self.cuda, self.stream = cuda, stream  # keys, values: L x DeviceTensor [N, H, S, D]
        super().__init__(num_layers, num_kv_heads, head_dim, max_len, dtype, num_slots)

    def close(self) -> None:
        """Free the device buffers (the cache is unusable afterwards)."""
        self.cuda.synchronize(self.stream)
        for buffer in self.keys + self.values:
            self.cuda.free(buffer.ptr)
        self._set_buffers([], [])

    def __del__(self):
        try:
            if self.keys:
                self.close()
        except (RuntimeError, ImportError):
            pass  # the CUDA context (or cuda-python itself) may already be gone at interpreter exit

    def _rows(self, buffer: DeviceTensor, first: int, count: int) -> DeviceTensor:
        """Slots ``first .. first + count - 1`` of a ``[N, H, S, D]`` buffer as ``[count, H, S, D]`` (no copy; 256-byte
        aligned, as TensorRT wants, when H * S * D * itemsize is a multiple of 256)."""
        _, heads, capacity, dim = buffer.shape
        offset = first * heads * capacity * dim * self.dtype.itemsize  # bytes
        return DeviceTensor(buffer.ptr + offset, (count, heads, capacity, dim), self.dtype)

    def _write(self, slot: int, presents: list[tuple[DeviceTensor, DeviceTensor]], row: int, count: int) -> None:
        """Device-side copy of entries ``lengths[slot] .. + count`` of ``presents`` row ``row`` (``[n, H, S', D]``,
        position p at index p) into slot ``slot`` at the same positions."""
        start, item = int(self.lengths[slot]), self.dtype.itemsize
        for pair, key, value in zip(presents, self.keys, self.values):
            for new, buffer in zip(pair, (key, value)):
                assert isinstance(new, DeviceTensor) and np.dtype(new.dtype) == self.dtype, "presents must be on the device"
                _, heads, positions, dim = new.shape  # [n, H, S', D]
                assert start + count <= positions, f"entries up to {start + count} past the presents' {positions}"
                capacity = buffer.shape[2]
                src = new.ptr + ((row * heads) * positions + start) * dim * item
                dst = buffer.ptr + ((slot * heads) * capacity + start) * dim * item
                self.cuda.copy_rows(dst, capacity * dim * item, src, positions * dim * item, count * dim * item, heads,
                                    self.stream)

    def _allocate(self, capacity: int) -> None:
        """Device buffers ``[N, H, capacity, D]``, zero-filled, holding the committed prefix of the old ones."""
        shape = (self.num_slots, self.num_kv_heads, capacity, self.head_dim)
        keep = min(capacity, self.capacity) if self.keys else 0
        item, old = self.dtype.itemsize, self.keys + self.values
        new = []
        try:
            for _ in range(2 * self.num_layers):
                new.append(DeviceTensor(self.cuda.malloc(int(np.prod(shape)) * item), shape, self.dtype))
                self.cuda.memset(new[-1].ptr, new[-1].nbytes, self.stream)
        except MemoryError:  # out of device memory: give back what this growth got, keep the old buffers
            for buffer in new:
                self.cuda.free(buffer.ptr)
            raise
        for src, dst in zip(old, new) if keep else ():  # rows are (slot, head) pairs: N * H rows of keep * D
            self.cuda.copy_rows(dst.ptr, capacity * self.head_dim * item, src.ptr, src.shape[2] * self.head_dim * item,
                                keep * self.head_dim * item, self.num_slots * self.num_kv_heads, self.stream)
        if old:
            self.cuda.synchronize(self.stream)  # the copies read the old buffers
            for buffer in old:
                self.cuda.free(buffer.ptr)
        self._set_buffers(new[:self.num_layers], new[self.num_layers:])

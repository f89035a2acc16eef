"""cuda-python's runtime module stood in for CPU tests: only the documented behaviour our code relies on.

Installed as ``cuda.bindings.runtime`` by :func:`trt_standin.install`. Behaviours cite the
CUDA runtime API reference [CU] (cudaMalloc, cudaMemcpyAsync, cudaMemcpy2DAsync, streams)
and, for addresses TensorRT takes, NVIDIA TensorRT include/NvInferRuntime.h [H].

"Device memory" is host memory allocated and tracked here (filled with NaN bytes, as device
memory starts uninitialized), so a host pointer where a device pointer belongs (or the
reverse), an address outside its allocation, or a non-int address is refused as CUDA
refuses it. Stream work is queued and runs at ``cudaStreamSynchronize``, as on a GPU, so a
host buffer read before its asynchronous copy finished shows up as wrong data. :data:`STATS`
counts the bytes each copy direction moved.
"""

from __future__ import annotations

import ctypes
import enum
import types
from collections import Counter

import numpy as np

ALIGNMENT = 256  # [CU] cudaMalloc: "The allocated memory is suitably aligned for any kind of variable"; [H]
#                  setTensorAddress: "The pointer must have at least 256-byte alignment."
STATS: Counter = Counter()  # bytes by copy kind ("h2d", "d2h", "d2d", "h2d_pageable", "d2h_pageable")


class cudaError_t(enum.IntEnum):  # noqa: N801 (cuda-python's names)
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class _Memory:
    """Live allocations: base address -> (backing array, "device" or "pinned")."""

    def __init__(self):
        self.blocks: dict[int, tuple[np.ndarray, int, str]] = {}  # base -> (backing, size, kind)

    def allocate(self, size: int, kind: str) -> int:
        backing = np.empty(size + ALIGNMENT, np.uint8)
        # [CU] device memory is uninitialized: NaN bytes model that (0 * NaN is NaN, so unmasked reads show)
        backing[:] = 0xFF
        base = (backing.ctypes.data + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        self.blocks[base] = (backing, size, kind)
        return base

    def release(self, ptr: int, kind: str) -> bool:
        block = self.blocks.get(ptr)
        if block is None or block[2] != kind:
            return False
        del self.blocks[ptr]
        return True

    def kind_of(self, ptr: int, nbytes: int) -> str | None:
        """"device" or "pinned" when [ptr, ptr + nbytes) lies inside one allocation; None for other host memory;
        "out of bounds" when it starts inside one allocation and runs past its end."""
        for base, (_, size, kind) in self.blocks.items():
            if base <= ptr < base + max(size, 1):
                return kind if ptr + nbytes <= base + size else "out of bounds"
        return None


MEMORY = _Memory()
DEVICE_BYTES = 80 << 30  # the stand-in device's memory (an H100's), which cudaMalloc and cudaMemGetInfo count


class _Stream:
    """[CU] Work queued on a stream runs in order; the host sees its results after cudaStreamSynchronize."""

    handles = 0

    def __init__(self):
        _Stream.handles += 1
        self.handle, self.queue, self.is_destroyed = 0x5000 + _Stream.handles, [], False

    def __int__(self):
        return self.handle

    def run(self) -> None:
        while self.queue:
            self.queue.pop(0)()


STREAMS: dict[int, _Stream] = {}


def find_stream(stream) -> _Stream | None:
    found = STREAMS.get(int(stream))
    return found if found is not None and not found.is_destroyed else None


def cudaGetDeviceCount():  # noqa: N802
    return cudaError_t.cudaSuccess, 1


def cudaGetDeviceProperties(device: int):  # noqa: N802
    return cudaError_t.cudaSuccess, types.SimpleNamespace(name=b"TensorRT contract stand-in (CPU)")


def cudaMalloc(size: int):  # noqa: N802 [CU] cudaErrorMemoryAllocation past the device's memory
    if size > cudaMemGetInfo()[1]:
        return cudaError_t.cudaErrorMemoryAllocation, 0
    return cudaError_t.cudaSuccess, MEMORY.allocate(size, "device")


def cudaMemGetInfo():  # noqa: N802 [CU] (free, total) bytes of device memory
    used = sum(size for _, size, kind in MEMORY.blocks.values() if kind == "device")
    return cudaError_t.cudaSuccess, max(DEVICE_BYTES - used, 0), DEVICE_BYTES


def _finish_all() -> None:
    """[CU] cudaFree / cudaFreeHost synchronize with the device: queued work completes first."""
    for stream in STREAMS.values():
        stream.run()


def cudaFree(ptr: int):  # noqa: N802
    _finish_all()
    return (cudaError_t.cudaSuccess if MEMORY.release(ptr, "device") else cudaError_t.cudaErrorInvalidValue,)


def cudaMallocHost(size: int):  # noqa: N802 [CU] page-locked host memory, directly readable by the host
    return cudaError_t.cudaSuccess, MEMORY.allocate(size, "pinned")


def cudaFreeHost(ptr: int):  # noqa: N802
    _finish_all()
    return (cudaError_t.cudaSuccess if MEMORY.release(ptr, "pinned") else cudaError_t.cudaErrorInvalidValue,)


def cudaStreamCreate():  # noqa: N802
    stream = _Stream()
    STREAMS[stream.handle] = stream
    return cudaError_t.cudaSuccess, stream


def cudaStreamDestroy(stream):  # noqa: N802
    found = find_stream(stream)
    if found is None:
        return (cudaError_t.cudaErrorInvalidValue,)
    found.run()  # [CU] work already queued completes before the stream's resources are released
    found.is_destroyed = True
    return (cudaError_t.cudaSuccess,)


def cudaStreamSynchronize(stream):  # noqa: N802
    found = find_stream(stream)
    if found is None:
        return (cudaError_t.cudaErrorInvalidValue,)
    found.run()
    return (cudaError_t.cudaSuccess,)


_DIRECTIONS = {cudaMemcpyKind.cudaMemcpyHostToDevice: ("device", "host", "h2d"),
               cudaMemcpyKind.cudaMemcpyDeviceToHost: ("host", "device", "d2h"),
               cudaMemcpyKind.cudaMemcpyDeviceToDevice: ("device", "device", "d2d")}


def _side(ptr: int, nbytes: int) -> str | None:
    kind = MEMORY.kind_of(ptr, nbytes)
    return {"device": "device", "pinned": "host", None: "host"}.get(kind)


def cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream):  # noqa: N802
    """[CU] height rows of width bytes, rows dpitch / spitch bytes apart; width must not exceed either
    pitch; pointers must match the direction of ``kind``."""
    if not all(type(x) is int for x in (dst, dpitch, src, spitch, width, height)):
        # cuda-python takes addresses and sizes as Python ints; another object (a numpy integer
        # included) would go down its buffer-protocol path and be read as a host buffer
        return (cudaError_t.cudaErrorInvalidValue,)
    found, direction = find_stream(stream), _DIRECTIONS.get(kind)
    if found is None or direction is None or width > dpitch or width > spitch or height < 1:
        return (cudaError_t.cudaErrorInvalidValue,)
    dst_side, src_side = _side(dst, (height - 1) * dpitch + width), _side(src, (height - 1) * spitch + width)
    if (dst_side, src_side) != direction[:2]:
        return (cudaError_t.cudaErrorInvalidValue,)
    name = direction[2]
    if name != "d2d" and MEMORY.kind_of(dst if name == "d2h" else src, 1) is None:
        STATS[f"{name}_pageable"] += width * height
    STATS[name] += width * height

    def copy():
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    found.queue.append(copy)
    return (cudaError_t.cudaSuccess,)


def cudaMemcpyAsync(dst, src, count, kind, stream):  # noqa: N802
    return cudaMemcpy2DAsync(dst, count, src, count, count, 1, kind, stream)


def cudaMemsetAsync(ptr, value, count, stream):  # noqa: N802
    found = find_stream(stream)
    if found is None or type(ptr) is not int or _side(ptr, count) != "device":
        return (cudaError_t.cudaErrorInvalidValue,)
    found.queue.append(lambda: ctypes.memset(ptr, value, count))
    return (cudaError_t.cudaSuccess,)


def read_device(ptr: int, shape, dtype) -> np.ndarray:
    """Test helper: a copy of device memory at ``ptr`` as an array (synchronize first)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert MEMORY.kind_of(ptr, nbytes) == "device", "not a device range"
    return np.frombuffer(ctypes.string_at(ptr, nbytes), dtype).reshape(shape).copy()

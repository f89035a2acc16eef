"""The few CUDA runtime calls the GPU backends make, through cuda-python, each checked.

Device memory and pinned (page-locked) host memory are plain integer addresses here
(Python ints at the cuda-python boundary: a numpy integer is no ``int`` there and would be
read as a host buffer);
:class:`DeviceTensor` gives a device address a shape and a dtype. All copies are
asynchronous on one stream: a host buffer handed to a copy must stay alive and unchanged
until :meth:`CudaRuntime.synchronize` (pinned staging buffers are reused only after it).

Importing this module needs no CUDA; :class:`CudaRuntime` does, and says how to get it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from runtime.trt_build import INSTALL_HINT

@dataclass(frozen=True)
class DeviceTensor:
    """A C-contiguous array in device memory that the caller does not own.

    Attributes:
        ptr: device address of element 0.
        shape: dimensions, e.g. ``[n, H, P, D]`` for a past key.
        dtype: numpy dtype of the elements.
    """

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _import_runtime():
    """The CUDA runtime bindings of cuda-python (``cuda.bindings.runtime``, or ``cuda.cudart`` before 12.6)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError as e:
            raise RuntimeError(f"cuda-python is not available ({e}); {INSTALL_HINT}") from e
    return runtime


class CudaRuntime:
    """Checked CUDA runtime calls: device and pinned allocations, one stream's copies.

    Raises:
        RuntimeError: cuda-python or a CUDA device is missing, or a call fails (the
            message names the call and CUDA's error).
    """

    def __init__(self):
        self.rt = _import_runtime()
        count = self.check(self.rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
        if count < 1:
            raise RuntimeError(f"no CUDA device found; the TensorRT backend needs an NVIDIA GPU ({INSTALL_HINT})")

    def check(self, result, what: str):
        """The value(s) a cuda-python call returned after its error code; raise unless cudaSuccess."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"{what} failed: {err}")
        return values[0] if len(values) == 1 else values

    def malloc(self, nbytes: int) -> int:
        """Device allocation of ``nbytes`` (at least 1: TensorRT wants non-null addresses, even for empty tensors).

        Raises:
            MemoryError: out of device memory (``cudaErrorMemoryAllocation``), as numpy's allocations raise it.
        """
        result = self.rt.cudaMalloc(max(nbytes, 1))
        if result[0] == self.rt.cudaError_t.cudaErrorMemoryAllocation:
            raise MemoryError(f"cudaMalloc of {nbytes:,} bytes failed: out of GPU memory")
        return int(self.check(result, "cudaMalloc"))

    def free_memory(self) -> int:
        """Bytes of device memory free now (``cudaMemGetInfo``)."""
        free, _total = self.check(self.rt.cudaMemGetInfo(), "cudaMemGetInfo")
        return int(free)

    def free(self, ptr: int) -> None:
        self.check(self.rt.cudaFree(int(ptr)), "cudaFree")

    def malloc_pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory as a uint8 array [nbytes] (free with :meth:`free_pinned`)."""
        ptr = int(self.check(self.rt.cudaMallocHost(max(nbytes, 1)), "cudaMallocHost"))
        return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))

    def free_pinned(self, array: np.ndarray) -> None:
        self.check(self.rt.cudaFreeHost(array.ctypes.data), "cudaFreeHost")

    def stream(self):
        return self.check(self.rt.cudaStreamCreate(), "cudaStreamCreate")

    def destroy_stream(self, stream) -> None:
        self.check(self.rt.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def memset(self, ptr: int, nbytes: int, stream) -> None:
        self.check(self.rt.cudaMemsetAsync(int(ptr), 0, nbytes, stream), "cudaMemsetAsync")

    def to_device(self, ptr: int, array: np.ndarray, stream) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.check(self.rt.cudaMemcpyAsync(int(ptr), array.ctypes.data, array.nbytes, kind, stream), "cudaMemcpyAsync H2D")

    def to_host(self, array: np.ndarray, ptr: int, stream) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self.check(self.rt.cudaMemcpyAsync(array.ctypes.data, int(ptr), array.nbytes, kind, stream), "cudaMemcpyAsync D2H")

    def copy_rows(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream) -> None:
        """Device-to-device copy of ``height`` rows of ``width`` bytes, rows ``*_pitch`` bytes apart."""
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self.check(self.rt.cudaMemcpy2DAsync(int(dst), int(dst_pitch), int(src), int(src_pitch), int(width),
                                                  int(height), kind, stream),
                   "cudaMemcpy2DAsync D2D")

    def synchronize(self, stream) -> None:
        self.check(self.rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def device_name(self, device: int = 0) -> str:
        props = self.check(self.rt.cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
        return props.name.decode().rstrip("\0") if isinstance(props.name, bytes) else str(props.name)

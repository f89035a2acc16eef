"""Run a bundle's ``engine.plan`` with TensorRT's Python API and cuda-python (no torch).

Same contract as :class:`runtime.backends.onnx.OnnxBackend`: :meth:`TrtBackend.step` takes
numpy inputs and the past KV and returns float32 logits and the W new KV entries per
layer, so the same decoder, acceptance loop and cache manager drive either backend.

Dimension letters: B batch, W window, P past length, H KV heads, D head dim, V vocab.
Each step copies the inputs to the GPU, runs the engine on one CUDA stream and copies
the outputs back (the KV cache lives on the host, as with onnxruntime). Device buffers
are kept per tensor and grown when a step needs more; empty tensors (P = 0) still get a
non-null buffer, which TensorRT requires.

Importing this module needs neither TensorRT nor a GPU; constructing a backend does, and
says how to get them when they are missing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime import bundle
from runtime.bundle import BundleConfig, BundleError
from runtime.trt_build import INSTALL_HINT, profile_limits, require_tensorrt


def _cuda_runtime():
    """The CUDA runtime bindings of cuda-python (``cuda.bindings.runtime``, or ``cuda.cudart`` before 12.6)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError as e:
            raise RuntimeError(f"cuda-python is not available ({e}); {INSTALL_HINT}") from e
    return runtime


class _Cuda:
    """The few CUDA runtime calls the backend makes, each checked."""

    def __init__(self):
        self.rt = _cuda_runtime()
        count = self._check(self.rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
        if count < 1:
            raise RuntimeError(f"no CUDA device found; the TensorRT backend needs an NVIDIA GPU ({INSTALL_HINT})")

    def _check(self, result, what: str):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"{what} failed: {err}")
        return values[0] if len(values) == 1 else values

    def malloc(self, nbytes: int) -> int:
        return int(self._check(self.rt.cudaMalloc(max(nbytes, 1)), "cudaMalloc"))

    def free(self, ptr: int) -> None:
        self._check(self.rt.cudaFree(ptr), "cudaFree")

    def stream(self):
        return self._check(self.rt.cudaStreamCreate(), "cudaStreamCreate")

    def to_device(self, ptr: int, array: np.ndarray, stream) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._check(self.rt.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes, kind, stream), "cudaMemcpyAsync H2D")

    def to_host(self, array: np.ndarray, ptr: int, stream) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._check(self.rt.cudaMemcpyAsync(array.ctypes.data, ptr, array.nbytes, kind, stream), "cudaMemcpyAsync D2H")

    def synchronize(self, stream) -> None:
        self._check(self.rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")


class TrtBackend:
    """A TensorRT execution context over a bundle's ``engine.plan``.

    Args:
        bundle_dir: the bundle directory.
        config: its :class:`~runtime.bundle.BundleConfig` (``engine_file`` must be set).

    Raises:
        BundleError: the bundle has no engine, the file is missing or not a TensorRT
            engine for this GPU / TensorRT version, or its I/O names do not match.
        RuntimeError: TensorRT, cuda-python or a GPU is missing (the message names the fix).
    """

    def __init__(self, bundle_dir: str | Path, config: BundleConfig):
        if config.engine_file is None:
            raise BundleError(f"{bundle_dir} has no TensorRT engine; build one with "
                              f"python -m runtime.trt_build {bundle_dir} (or mars-export --trt)")
        path = Path(bundle_dir) / config.engine_file
        if not path.is_file():
            raise BundleError(f"{path} not found; build it with python -m runtime.trt_build {bundle_dir}")
        trt = require_tensorrt()
        self.cuda = _Cuda()
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise BundleError(f"cannot load {path}: not a TensorRT engine built by this TensorRT version for this GPU; "
                              f"rebuild it with python -m runtime.trt_build {bundle_dir}")
        self.context = self.engine.create_execution_context()
        self.stream = self.cuda.stream()
        self.num_layers = config.num_layers
        self.kv_dtype = np.dtype(config.dtype)
        self.buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, capacity in bytes)
        self.is_window_dynamic = False  # the optimization profile fixes W (runtime.trt_build)
        self._check_io(config, path, trt)
        # The engine feeds no larger batch nor past (KV cache capacity) than the profile accepts.
        self.max_batch, self.max_past = profile_limits(lambda name: self.engine.get_tensor_profile_shape(name, 0))

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
             past: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """Run one forward over a window; same shapes and dtypes as :meth:`runtime.backends.onnx.OnnxBackend.step`."""
        feeds = bundle.step_feeds(input_ids, position_ids, attention_mask, past)
        for name, array in feeds.items():
            array = np.ascontiguousarray(array, dtype=self.dtypes[name])
            if not self.context.set_input_shape(name, array.shape):
                raise ValueError(f"input {name} of shape {array.shape} is outside the engine's optimization profile; "
                                 "rebuild the engine with a larger --max-batch / --max-context")
            ptr = self._buffer(name, array.nbytes)
            self.cuda.to_device(ptr, array, self.stream)
            self.context.set_tensor_address(name, ptr)
            feeds[name] = array  # keep the host copy alive until the stream is synchronized
        outputs = {}
        for name in bundle.output_names(self.num_layers):
            outputs[name] = np.empty(tuple(self.context.get_tensor_shape(name)), self.dtypes[name])
            self.context.set_tensor_address(name, self._buffer(name, outputs[name].nbytes))
        if not self.context.execute_async_v3(int(self.stream)):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")
        for name, array in outputs.items():
            self.cuda.to_host(array, self.buffers[name][0], self.stream)
        self.cuda.synchronize(self.stream)
        kv = [outputs[name] for name in bundle.output_names(self.num_layers)[1:]]
        return outputs[bundle.LOGITS], list(zip(kv[0::2], kv[1::2]))

    def _buffer(self, name: str, nbytes: int) -> int:
        """Device pointer of ``name``'s buffer, grown (doubling) to hold ``nbytes``."""
        ptr, capacity = self.buffers.get(name, (0, 0))
        if nbytes > capacity or not ptr:
            if ptr:
                self.cuda.synchronize(self.stream)
                self.cuda.free(ptr)
            capacity = max(nbytes, 2 * capacity, 1)
            ptr = self.cuda.malloc(capacity)
            self.buffers[name] = (ptr, capacity)
        return ptr

    def _check_io(self, config: BundleConfig, path: Path, trt) -> None:
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        expected = bundle.input_names(config.num_layers) + bundle.output_names(config.num_layers)
        if sorted(names) != sorted(expected):
            raise BundleError(f"{path} does not match {bundle.CONFIG_FILE}: expected {config.num_layers} layers of "
                              f"past_key_values/present I/O, got {names[:4]}...; rebuild the engine")
        self.dtypes = {name: np.dtype(trt.nptype(self.engine.get_tensor_dtype(name))) for name in names}
        window = self.engine.get_tensor_shape(bundle.INPUT_IDS)[1]
        if window != config.window:
            raise BundleError(f"{path} has a window of {window} tokens but {bundle.CONFIG_FILE} says {config.window}; "
                              "rebuild the engine")

    def __del__(self):
        for ptr, _ in getattr(self, "buffers", {}).values():
            try:
                self.cuda.free(ptr)
            except RuntimeError:
                pass  # the CUDA context may already be gone at interpreter exit

"""Run a bundle's ``engine.plan`` with TensorRT's Python API and cuda-python (no torch).

Same contract as :class:`runtime.backends.onnx.OnnxBackend`: :meth:`TrtBackend.step` takes
the window inputs and the past KV (the cache, position p at index p) and returns float32
logits and the presents, per layer the past with each row's new entries written at their
positions, so the same decoder, acceptance loop and cache manager drive either backend.

Dimension letters (runtime/__init__.py): n batch rows, W window, S past length (the KV cache
capacity: the whole buffer is fed), H KV heads, D head dim, V vocab, L layers.

Unlike onnxruntime (:mod:`runtime.backends.kv_binding`), the presents are NOT bound to the
past's own memory: TensorRT does not promise that an output may share its address with an
input (the engine may read the past after writing part of the present), so each present
output has a device buffer of its own ``[n, H, S, D]``: a second copy of the cache's rows
in device memory (:mod:`runtime.memory` sizes it), and the accepted entries are copied into
the cache at commit.

Where the KV cache lives (DESIGN.md §4):
  - device-resident (:meth:`TrtBackend.make_cache`, what :class:`runtime.decode.engine.Engine`
    uses): the past is bound straight from the cache's device buffers and the present
    outputs stay on the device, where the cache commits the accepted entries itself (a
    device-to-device copy of at most W entries per row). Per step the host sends ids,
    positions and the attention mask and receives the logits, through pinned staging buffers;
  - host arrays (the parity check, any caller with numpy past): the past is copied to the
    device and the presents (whole ``[n, H, S, D]``) copied back.
:func:`step_traffic` counts the bytes each way per step, from these code paths.

Device buffers are kept per tensor and grown when a step needs more (doubling; the present
outputs exactly to the largest step's size, so they never hold more than one more copy of
the cache's rows); an empty tensor would still get a non-null buffer, which TensorRT requires.

Importing this module needs neither TensorRT nor a GPU; constructing a backend does, and
says how to get them when they are missing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime import bundle
from runtime.bundle import BundleConfig, BundleError
from runtime.backends.cuda_runtime import CudaRuntime, DeviceTensor
from runtime.backends.device_kv_cache import DeviceKVCache
from runtime.trt_build import profile_limits, require_tensorrt

ALIGNMENT = 256  # bytes; TensorRT wants every tensor address so aligned (NvInferRuntime.h, setTensorAddress)
WINDOW_INPUTS = (bundle.INPUT_IDS, bundle.POSITION_IDS, bundle.ATTENTION_MASK)


def expected_dtypes(config: BundleConfig) -> dict[str, np.dtype]:
    """The dtype of every step-graph tensor (:mod:`runtime.bundle`): int64 ids and positions,
    bool mask, float32 logits, KV in the bundle dtype."""
    names = bundle.input_names(config.num_layers) + bundle.output_names(config.num_layers)
    dtypes = {name: np.dtype(config.dtype) for name in names}
    dtypes.update({bundle.INPUT_IDS: np.dtype(np.int64), bundle.POSITION_IDS: np.dtype(np.int64),
                   bundle.ATTENTION_MASK: np.dtype(np.bool_), bundle.LOGITS: np.dtype(np.float32)})
    return dtypes


def step_traffic(config: BundleConfig, num_rows: int, past_len: int, is_device_cache: bool) -> dict[str, int]:
    """Bytes one :meth:`TrtBackend.step` moves, by direction, on its two code paths.

    Args:
        config: the bundle (layers, KV heads, head dim, vocab, dtype, window W).
        num_rows: n, the batch rows of the step.
        past_len: S, the past length fed (the cache capacity).
        is_device_cache: True for the device-resident cache (:meth:`TrtBackend.make_cache`),
            False for host numpy past.

    Returns:
        ``host_to_device`` (window inputs, plus the whole past on the host path),
        ``device_to_host`` (logits, plus every present, the whole ``[n, H, S, D]``, on the host path) and
        ``device_to_device`` (the device path's cache commit, at most W entries per row;
        the host path's commit is a host copy). Bytes.
    """
    n, w, kv_item = num_rows, config.window, np.dtype(config.dtype).itemsize
    window_inputs = n * w * 8 * 2 + n * w * past_len  # int64 ids and positions, bool mask [n, 1, W, S]
    logits = n * w * config.vocab_size * 4  # float32 [n, W, V]
    per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_item  # key + value, all layers
    if is_device_cache:
        return {"host_to_device": window_inputs, "device_to_host": logits,
                "device_to_device": n * w * per_position}
    return {"host_to_device": window_inputs + n * past_len * per_position,
            "device_to_host": logits + n * past_len * per_position, "device_to_device": 0}


class TrtBackend:
    """A TensorRT execution context over a bundle's ``engine.plan``.

    Args:
        bundle_dir: the bundle directory.
        config: its :class:`~runtime.bundle.BundleConfig` (``engine_file`` must be set).

    Attributes:
        max_batch, max_past: the largest batch and past length of the engine's optimization
            profile; no step may feed more.
        is_window_dynamic: False: the profile fixes the window at W; ``why_window_fixed`` says so.
        kv_dtype: the engine's KV dtype (the bundle's).

    Raises:
        BundleError: the bundle has no engine, the file is missing or not a TensorRT
            engine for this GPU / TensorRT version, or its I/O names, dtypes, KV heads, head
            dim, vocabulary or window do not match the config.
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
        self.cuda = CudaRuntime()
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise BundleError(f"cannot load {path}: not a TensorRT engine built by this TensorRT version for this GPU; "
                              f"rebuild it with python -m runtime.trt_build {bundle_dir}")
        self.context = self.engine.create_execution_context()
        self.num_layers = config.num_layers
        self.dtypes = expected_dtypes(config)
        _check_io(self.engine, config, path, trt)
        _check_shapes(self.engine, config, path, f"rebuild the engine (python -m runtime.trt_build {bundle_dir}) "
                                                 "or re-export the bundle (mars-export --trt)")
        _check_kv_in_place(self.engine, self.context, config.num_layers, path)
        self.kv_dtype = np.dtype(config.dtype)
        self.is_window_dynamic = False  # the optimization profile fixes W (runtime.trt_build)
        self.why_window_fixed = (f"a TensorRT engine's optimization profile fixes the window at W = {config.window} "
                                 f"tokens (runtime.trt_build); serve the bundle directory instead of {path.name} "
                                 "(onnxruntime; --provider cuda on a GPU)")
        # The engine feeds no larger batch nor past (KV cache capacity) than the profile accepts.
        self.max_batch, self.max_past = profile_limits(lambda name: self.engine.get_tensor_profile_shape(name, 0))
        self.buffers: dict[str, DeviceTensor] = {}  # name -> device buffer (shape = (capacity in bytes,))
        self.staging: dict[str, np.ndarray] = {}  # name -> pinned host buffer (uint8)
        self.stream = self.cuda.stream()

    kv_copies = 2  # the cache and the present outputs, both in device memory (runtime.memory, runtime.serving.kv_memory)

    def free_memory(self) -> int:
        """Bytes of device memory free now, where :meth:`make_cache`'s cache and the presents live."""
        return self.cuda.free_memory()

    def make_cache(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype,
                   num_slots: int = 1) -> DeviceKVCache:
        """A KV cache in this backend's device memory (same arguments as :class:`runtime.decode.kv_cache.KVCache`).

        Raises:
            ValueError: ``dtype`` is not the engine's KV dtype.
        """
        if np.dtype(dtype) != self.kv_dtype:
            raise ValueError(f"KV dtype {np.dtype(dtype)} differs from the engine's {self.kv_dtype}; "
                             "use the bundle's dtype")
        return DeviceKVCache(self.cuda, self.stream, num_layers, num_kv_heads, head_dim, max_len, dtype, num_slots)

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
             past: list[tuple]) -> tuple[np.ndarray, list[tuple]]:
        """Run one forward over a window.

        Args:
            input_ids: int64 [n, W]; position_ids: int64 [n, W], each below S (new entry j of
                row b goes to index ``position_ids[b, j]`` of the presents).
            attention_mask: bool [n, 1, W, S] over the past's indices.
            past: per layer (key, value) [n, H, S, D] in the engine's KV dtype, the KV cache
                (read only: the step never writes into it): numpy arrays, or
                :class:`~runtime.backends.cuda_runtime.DeviceTensor` views of a :meth:`make_cache` cache.

        Returns:
            logits float32 [n, W, V] (host), and the presents: per layer (key, value) [n, H, S, D],
            the past with each row's new entries at their positions, in buffers other than the
            past's: numpy arrays for a numpy past; for a device past, device views of this
            backend's output buffers, valid until the next step.

        Raises:
            ValueError: inputs whose shapes disagree or a position outside the past
                (:func:`runtime.bundle.check_step_inputs`), a shape outside the engine's optimization
                profile, or a dtype other than the engine's (nothing is converted silently).
            RuntimeError: TensorRT refused an address or the forward.
        """
        bundle.check_step_inputs(input_ids, position_ids, attention_mask, past, self.num_layers)
        is_device = isinstance(past[0][0], DeviceTensor)
        feeds = bundle.step_feeds(input_ids, position_ids, attention_mask, past)
        sources = [self._bind_input(name, array) for name, array in feeds.items()]  # alive until synchronized
        outputs = {name: self._bind_output(name, exact=name != bundle.LOGITS)
                   for name in bundle.output_names(self.num_layers)}
        if not self.context.execute_async_v3(int(self.stream)):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")
        logits = self._pinned(bundle.LOGITS, outputs[bundle.LOGITS].shape, np.float32)  # [n, W, V]
        self.cuda.to_host(logits, outputs[bundle.LOGITS].ptr, self.stream)
        kv = [out if is_device else self._to_host(out) for out in list(outputs.values())[1:]]
        self.cuda.synchronize(self.stream)
        del sources
        return logits.copy(), list(zip(kv[0::2], kv[1::2]))  # the pinned logits buffer is reused next step

    def _bind_input(self, name: str, array) -> np.ndarray | None:
        """Set ``name``'s shape and address: a device view as it is, a host array copied to the device
        (the window inputs through pinned staging). Returns the host array the copy reads, if any."""
        if np.dtype(array.dtype) != self.dtypes[name]:
            raise ValueError(f"input {name} is {np.dtype(array.dtype)} but the engine takes {self.dtypes[name]}")
        if not self.context.set_input_shape(name, tuple(array.shape)):
            raise ValueError(f"input {name} of shape {tuple(array.shape)} is outside the engine's optimization "
                             "profile; rebuild the engine with a larger --max-batch / --max-context")
        source = None
        if isinstance(array, DeviceTensor):
            if array.ptr % ALIGNMENT:
                raise ValueError(f"input {name} is at a device address that is not {ALIGNMENT}-byte aligned, which "
                                 "TensorRT requires; bind whole cache buffers (DeviceKVCache.past)")
            ptr = array.ptr
        else:
            source = np.ascontiguousarray(array)
            if name in WINDOW_INPUTS:
                staged = self._pinned(name, source.shape, source.dtype)
                staged[...] = source
                source = staged
            ptr = self._buffer(name, source.nbytes)
            self.cuda.to_device(ptr, source, self.stream)
        self._set_address(name, ptr)
        return source

    def _bind_output(self, name: str, exact: bool = False) -> DeviceTensor:
        """The device buffer of output ``name``, sized from the shape TensorRT infers once all inputs are set
        (grown to exactly that size when ``exact``: the presents, each as large as the past)."""
        shape = tuple(self.context.get_tensor_shape(name))
        if min(shape, default=0) < 0:
            raise RuntimeError(f"TensorRT left output {name} with unknown dimensions {shape} after every input shape "
                               "was set; the engine does not match this runtime's step graph, rebuild it")
        dtype = self.dtypes[name]
        out = DeviceTensor(self._buffer(name, int(np.prod(shape)) * dtype.itemsize, exact), shape, dtype)
        self._set_address(name, out.ptr)
        return out

    def _set_address(self, name: str, ptr: int) -> None:
        if not self.context.set_tensor_address(name, ptr):
            raise RuntimeError(f"TensorRT refused the address of {name}; the engine does not match this runtime's "
                               "step graph, rebuild it")

    def _pinned(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A ``shape`` view of ``name``'s pinned host buffer, grown (doubling) as needed."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        pinned = self.staging.get(name)
        if pinned is None or pinned.nbytes < nbytes:
            capacity = max(nbytes, 2 * pinned.nbytes if pinned is not None else 0)
            if pinned is not None:
                self.cuda.synchronize(self.stream)
                self.cuda.free_pinned(pinned)
            pinned = self.staging[name] = self.cuda.malloc_pinned(capacity)
        return pinned[:nbytes].view(dtype).reshape(shape)

    def _to_host(self, out: DeviceTensor) -> np.ndarray:
        """A new host array that ``out`` is copied into (read it after synchronize)."""
        host = np.empty(out.shape, out.dtype)
        self.cuda.to_host(host, out.ptr, self.stream)
        return host

    def _buffer(self, name: str, nbytes: int, exact: bool = False) -> int:
        """Device pointer of ``name``'s buffer, grown to hold ``nbytes``: doubling, or to exactly ``nbytes``
        when ``exact`` (large buffers, whose growth follows the cache's own doubling)."""
        buffer = self.buffers.get(name)
        if buffer is None or nbytes > buffer.shape[0]:
            capacity = max(nbytes, 1) if exact else max(nbytes, 2 * buffer.shape[0] if buffer else 0, 1)
            if buffer is not None:
                self.cuda.synchronize(self.stream)
                self.cuda.free(buffer.ptr)
            buffer = self.buffers[name] = DeviceTensor(self.cuda.malloc(capacity), (capacity,), np.dtype(np.uint8))
        return buffer.ptr

    def close(self) -> None:
        """Free the device and pinned buffers and destroy the stream (the backend is unusable afterwards)."""
        if getattr(self, "stream", None) is None:
            return
        self.cuda.synchronize(self.stream)
        for buffer in self.buffers.values():
            self.cuda.free(buffer.ptr)
        for pinned in self.staging.values():
            self.cuda.free_pinned(pinned)
        self.cuda.destroy_stream(self.stream)
        self.buffers, self.staging, self.stream = {}, {}, None

    def __del__(self):
        try:
            self.close()
        except (RuntimeError, ImportError):
            pass  # the CUDA context (or cuda-python itself) may already be gone at interpreter exit


def _check_io(engine, config: BundleConfig, path: Path, trt) -> None:
    """Refuse an engine whose tensor names, dtypes or window differ from ``config``'s step graph.

    The window is read from the optimization profile: the engine reports a dynamic axis as -1
    in ``get_tensor_shape`` even when the profile fixes it (NvInferRuntime.h, ICudaEngine::getTensorShape).
    """
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    expected = expected_dtypes(config)
    if sorted(names) != sorted(expected):
        raise BundleError(f"{path} does not match {bundle.CONFIG_FILE}: expected {config.num_layers} layers of "
                          f"past_key_values/present I/O, got {names[:4]}...; rebuild the engine")
    for name, dtype in expected.items():
        got = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
        if got != dtype:
            raise BundleError(f"{path}: tensor {name} is {got} in the engine but {dtype} in a {config.dtype} bundle; "
                              "rebuild the engine from this bundle's ONNX file")
    smallest, _, largest = engine.get_tensor_profile_shape(bundle.INPUT_IDS, 0)  # [B, W] each
    if not smallest[1] == largest[1] == config.window:
        raise BundleError(f"{path} takes windows of {smallest[1]}..{largest[1]} tokens but {bundle.CONFIG_FILE} says "
                          f"{config.window}; rebuild the engine")


def _check_shapes(engine, config: BundleConfig, path: Path, fix: str) -> None:
    """Refuse an engine whose KV heads H, head dim D or vocabulary V differ from ``config``:
    :func:`runtime.bundle.check_graph_fits_config`, the onnxruntime backend's rule, on the engine's I/O
    (past [n, H, S, D], logits [n, W, V]; -1 on a dynamic axis passed as a symbol). The KV dtype is
    :func:`_check_io`'s, with every other tensor's. ``fix`` ends the message."""

    def declared(name: str) -> list:
        return [dim if dim >= 0 else "dynamic" for dim in engine.get_tensor_shape(name)]

    bundle.check_graph_fits_config(declared(bundle.past_names(0)[0]), declared(bundle.LOGITS), config, path, fix)


def _check_kv_in_place(engine, context, num_layers: int, path: Path) -> None:
    """Refuse an engine built from an older step graph, whose presents hold only the W new entries.

    The engine reports the KV axes as -1 (dynamic), so the check sets every input to the
    profile's smallest, then largest shapes and compares the present's position axis, as
    TensorRT infers it, with the past's (:func:`runtime.bundle.check_kv_in_place`). An older
    profile's smallest past is 0 positions, its present's W >= 1, so such an engine never passes.
    The next step sets every input shape again.
    """
    past, present = bundle.past_names(0)[0], bundle.present_names(0)[0]
    for which in (0, 2):  # the profile's min and max shapes
        for name in bundle.input_names(num_layers):
            shape = tuple(engine.get_tensor_profile_shape(name, 0)[which])
            if not context.set_input_shape(name, shape):
                raise BundleError(f"{path}: TensorRT refuses its own profile shape {shape} for {name}; "
                                  "rebuild the engine")
        try:
            bundle.check_kv_in_place(tuple(context.get_tensor_shape(past)), tuple(context.get_tensor_shape(present)),
                                     path)
        except BundleError as e:
            raise BundleError(f"{e}, then rebuild the engine (python -m runtime.trt_build, or mars-export --trt)"
                              ) from None

"""TensorRT and CUDA runtime stand-ins for CPU tests: only the documented behaviour our code relies on.

``install(monkeypatch)`` puts two modules in ``sys.modules``: ``tensorrt`` (the Python API
subset :mod:`runtime.trt_build` and :mod:`runtime.trt_backend` call) and
``cuda.bindings.runtime`` (cuda-python's runtime calls of :mod:`runtime.cuda_runtime`). The
code under test is the real code; only these two libraries are stood in for.

Each behaviour cites where it is documented:
  [H]  NVIDIA TensorRT include/NvInferRuntime.h (ICudaEngine, IExecutionContext, IOptimizationProfile)
  [HB] NVIDIA TensorRT include/NvInfer.h (BuilderFlag)
  [PY] TensorRT Python API reference (tensorrt.Builder, IBuilderConfig, ICudaEngine, IExecutionContext)
  [CU] CUDA runtime API reference (cudaMalloc, cudaMemcpyAsync, cudaMemcpy2DAsync, streams)

The math is real: the "engine" runs the same ONNX file on onnxruntime (CPU, one thread).
"Device memory" is host memory the stand-in allocates and tracks, so a host pointer where
a device pointer belongs (or the reverse) is caught, and so is an address outside its
allocation. Stream work is queued and runs at ``cudaStreamSynchronize``, as on a GPU, so a
host buffer read or written after its asynchronous copy was queued shows up as wrong data.
The counters in :data:`STATS` give the bytes each copy direction moved.
"""

from __future__ import annotations

import ctypes
import enum
import json
import sys
import types
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

MAGIC = b"TRT-STANDIN-PLAN\n"
ALIGNMENT = 256  # [CU] cudaMalloc: "The allocated memory is suitably aligned for any kind of variable"; [H]
#                  setTensorAddress: "The pointer must have at least 256-byte alignment."
STATS: Counter = Counter()  # bytes by copy kind ("h2d", "d2h", "d2d", "h2d_pageable", "d2h_pageable")


# ----------------------------------------------------------------------------------------------- CUDA runtime
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


def _stream(stream) -> _Stream | None:
    found = STREAMS.get(int(stream))
    return found if found is not None and not found.is_destroyed else None


def cudaGetDeviceCount():  # noqa: N802
    return cudaError_t.cudaSuccess, 1


def cudaGetDeviceProperties(device: int):  # noqa: N802
    return cudaError_t.cudaSuccess, types.SimpleNamespace(name=b"TensorRT contract stand-in (CPU)")


def cudaMalloc(size: int):  # noqa: N802
    return cudaError_t.cudaSuccess, MEMORY.allocate(size, "device")


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
    found = _stream(stream)
    if found is None:
        return (cudaError_t.cudaErrorInvalidValue,)
    found.run()  # [CU] work already queued completes before the stream's resources are released
    found.is_destroyed = True
    return (cudaError_t.cudaSuccess,)


def cudaStreamSynchronize(stream):  # noqa: N802
    found = _stream(stream)
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
    found, direction = _stream(stream), _DIRECTIONS.get(kind)
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
    found = _stream(stream)
    if found is None or type(ptr) is not int or _side(ptr, count) != "device":
        return (cudaError_t.cudaErrorInvalidValue,)
    found.queue.append(lambda: ctypes.memset(ptr, value, count))
    return (cudaError_t.cudaSuccess,)


def read_device(ptr: int, shape, dtype) -> np.ndarray:
    """Test helper: a copy of device memory at ``ptr`` as an array (synchronize first)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert MEMORY.kind_of(ptr, nbytes) == "device", "not a device range"
    return np.frombuffer(ctypes.string_at(ptr, nbytes), dtype).reshape(shape).copy()


# ----------------------------------------------------------------------------------------------- TensorRT
class DataType(enum.IntEnum):  # [PY] tensorrt.DataType
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    INT64 = 8


_ONNX_TO_TRT = {onnx.TensorProto.FLOAT: DataType.FLOAT, onnx.TensorProto.FLOAT16: DataType.HALF,
                onnx.TensorProto.INT64: DataType.INT64, onnx.TensorProto.INT32: DataType.INT32,
                onnx.TensorProto.BOOL: DataType.BOOL, onnx.TensorProto.INT8: DataType.INT8}
_NPTYPE = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8,
           DataType.INT32: np.int32, DataType.BOOL: np.bool_, DataType.INT64: np.int64}


def nptype(dtype: DataType):  # [PY] tensorrt.nptype: the numpy type of a TensorRT DataType
    return _NPTYPE[dtype]


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class BuilderFlag(enum.IntEnum):  # [HB] BuilderFlag
    TF32 = 6


class NetworkDefinitionCreationFlag(enum.IntEnum):
    STRONGLY_TYPED = 5  # [PY] Builder: 1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0


class Logger:
    WARNING = 2

    def __init__(self, severity: int = WARNING):
        self.severity = severity


class _Network:
    def __init__(self, flags: int):
        self.flags, self.model = flags, None


class OnnxParser:
    """[PY] parse_from_file -> bool; errors through num_errors / get_error."""

    def __init__(self, network: _Network, logger: Logger):
        self.network, self.errors = network, []

    def parse_from_file(self, path: str) -> bool:
        try:
            self.network.model = onnx.load(path)  # external data beside the file too
        except Exception as e:  # noqa: BLE001 (the parser reports any failure as an error, not an exception)
            self.errors.append(str(e))
            return False
        return True

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> str:
        return self.errors[index]


class _Profile:
    def __init__(self):
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, name: str, smallest, typical, largest) -> None:
        self.shapes[name] = tuple(tuple(int(d) for d in s) for s in (smallest, typical, largest))


class _BuilderConfig:
    def __init__(self):
        self.flags = {BuilderFlag.TF32}  # [HB] kTF32: "Enabled by default."
        self.profiles: list[_Profile] = []
        self.pool_limits: dict = {}

    def set_flag(self, flag) -> None:
        self.flags.add(flag)

    def clear_flag(self, flag) -> None:
        self.flags.discard(flag)

    def get_flag(self, flag) -> bool:
        return flag in self.flags

    def set_memory_pool_limit(self, pool, nbytes: int) -> None:
        self.pool_limits[pool] = nbytes

    def add_optimization_profile(self, profile: _Profile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1


def _dims(value_info) -> list:
    """ONNX dims: an int, or the dim_param name of a dynamic axis."""
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


class Builder:
    """[PY] build_serialized_network returns the plan, or None when the build fails."""

    def __init__(self, logger: Logger):
        self.logger = logger
        self.platform_has_tf32 = True

    def create_network(self, flags: int = 0) -> _Network:
        return _Network(flags)

    def create_builder_config(self) -> _BuilderConfig:
        return _BuilderConfig()

    def create_optimization_profile(self) -> _Profile:
        return _Profile()

    def build_serialized_network(self, network: _Network, config: _BuilderConfig):
        graph = network.model.graph
        if not config.profiles:  # [H] IOptimizationProfile: dynamic inputs need at least one profile
            return None
        profile = config.profiles[0].shapes
        for value in graph.input:
            shapes, dims = profile.get(value.name), _dims(value)
            if shapes is None or any(len(s) != len(dims) for s in shapes):
                return None
            smallest, typical, largest = shapes
            for i, dim in enumerate(dims):  # fixed axes must match; min <= opt <= max on every axis
                if not smallest[i] <= typical[i] <= largest[i] or (isinstance(dim, int) and smallest[i] != dim
                                                                    or isinstance(dim, int) and largest[i] != dim):
                    return None
        header = {"profile": {k: [list(s) for s in v] for k, v in profile.items()},
                  "tf32": BuilderFlag.TF32 in config.flags,
                  "strongly_typed": bool(network.flags & (1 << NetworkDefinitionCreationFlag.STRONGLY_TYPED))}
        raw = json.dumps(header).encode()
        return MAGIC + len(raw).to_bytes(8, "little") + raw + network.model.SerializeToString()


class Runtime:
    def __init__(self, logger: Logger):
        self.logger = logger

    def deserialize_cuda_engine(self, plan: bytes):
        """[PY] returns the engine, or None for data that is not a plan of this TensorRT version."""
        if not plan.startswith(MAGIC):
            return None
        size = int.from_bytes(plan[len(MAGIC):len(MAGIC) + 8], "little")
        start = len(MAGIC) + 8
        return ICudaEngine(json.loads(plan[start:start + size]), plan[start + size:])


class ICudaEngine:
    def __init__(self, header: dict, model_bytes: bytes):
        model = onnx.load_from_string(model_bytes)
        self.header = header
        self.profile = {k: tuple(tuple(s) for s in v) for k, v in header["profile"].items()}
        self.io = {v.name: (TensorIOMode.INPUT, v) for v in model.graph.input}
        self.io.update({v.name: (TensorIOMode.OUTPUT, v) for v in model.graph.output})
        self.names = list(self.io)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    @property
    def num_optimization_profiles(self) -> int:
        return 1

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self.io[name][0] if name in self.io else TensorIOMode.NONE

    def get_tensor_dtype(self, name: str) -> DataType:
        # [H] getTensorDataType: "DataType::kFLOAT if the provided name does not map to an input or output"
        return _ONNX_TO_TRT[self.io[name][1].type.tensor_type.elem_type] if name in self.io else DataType.FLOAT

    def get_tensor_shape(self, name: str) -> tuple:
        """[H] ICudaEngine::getTensorShape: "with -1 in place of each dynamic runtime dimension",
        even when the profile fixes it."""
        if name not in self.io:
            return ()
        return tuple(d if isinstance(d, int) else -1 for d in _dims(self.io[name][1]))

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list:
        """[PY] ICudaEngine.get_tensor_profile_shape: [min, opt, max] of an input under a profile."""
        if profile_index != 0 or name not in self.profile:
            raise RuntimeError(f"no profile {profile_index} shape for {name}")
        return [tuple(s) for s in self.profile[name]]

    def create_execution_context(self) -> IExecutionContext:
        return IExecutionContext(self)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine):
        self.engine = engine
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape) -> bool:
        """[H] setInputShape: false if the name is not an input; "Each dimension must agree with the
        network dimension unless the latter was -1"; [H] IOptimizationProfile: shapes outside the
        profile's min..max are an error."""
        if self.engine.get_tensor_mode(name) != TensorIOMode.INPUT:
            return False
        shape, network = tuple(int(d) for d in shape), self.engine.get_tensor_shape(name)
        smallest, _, largest = self.engine.profile[name]
        if len(shape) != len(network) or any(n not in (-1, d) for n, d in zip(network, shape)) \
                or any(not lo <= d <= hi for lo, d, hi in zip(smallest, shape, largest)):
            return False
        self.shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> tuple:
        """[H] IExecutionContext::getTensorShape: an input is -1 on runtime dimensions until
        setInputShape, unless the profile fixes them (min = max); an output is -1 on runtime
        dimensions while some input shape is not set."""
        mode = self.engine.get_tensor_mode(name)
        if mode == TensorIOMode.INPUT:
            if name in self.shapes:
                return self.shapes[name]
            smallest, _, largest = self.engine.profile[name]
            return tuple(lo if lo == hi else -1 for lo, hi in zip(smallest, largest))
        if mode != TensorIOMode.OUTPUT:
            return ()
        bound = self._symbols()
        return tuple(d if isinstance(d, int) else bound.get(d, -1) for d in _dims(self.engine.io[name][1]))

    def _symbols(self) -> dict[str, int]:
        """Named dynamic axes -> their values, once every input shape is set (else none)."""
        inputs = [n for n in self.engine.names if self.engine.get_tensor_mode(n) == TensorIOMode.INPUT]
        if any(n not in self.shapes for n in inputs):
            return {}
        bound = {}
        for n in inputs:
            for dim, value in zip(_dims(self.engine.io[n][1]), self.shapes[n]):
                if isinstance(dim, str):
                    bound[dim] = value
        return bound

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        """[H] setTensorAddress: "Return false if the provided name does not map to an input or output tensor"."""
        if name not in self.engine.io:
            return False
        self.addresses[name] = int(ptr)
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        """[H] enqueueV3: queue the forward on the stream; True if enqueued. "each input must have a
        non-null address and each output must have a non-null address" (empty tensors included);
        [H] setTensorAddress: device buffers "of sufficient size and alignment", 256-byte aligned."""
        stream = _stream(stream_handle)
        shapes = {n: self.get_tensor_shape(n) for n in self.engine.names}
        if stream is None or any(-1 in s for s in shapes.values()):
            return False
        dtypes = {n: np.dtype(nptype(self.engine.get_tensor_dtype(n))) for n in self.engine.names}
        for name in self.engine.names:
            ptr, nbytes = self.addresses.get(name, 0), int(np.prod(shapes[name])) * dtypes[name].itemsize
            if not ptr or ptr % ALIGNMENT or MEMORY.kind_of(ptr, nbytes) != "device":
                return False
        addresses = dict(self.addresses)
        inputs = [n for n in self.engine.names if self.engine.get_tensor_mode(n) == TensorIOMode.INPUT]

        def forward():
            feeds = {n: read_device(addresses[n], shapes[n], dtypes[n]) for n in inputs}
            outputs = self.engine.session.run(None, feeds)
            for out, value in zip(self.engine.session.get_outputs(), outputs):
                assert value.shape == shapes[out.name], (out.name, value.shape, shapes[out.name])
                ctypes.memmove(addresses[out.name], np.ascontiguousarray(value, dtypes[out.name]).ctypes.data,
                               value.nbytes)

        stream.queue.append(forward)
        return True


# ----------------------------------------------------------------------------------------------- install
def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


def install(monkeypatch) -> None:
    """Make ``import tensorrt`` and ``from cuda.bindings import runtime`` find the stand-ins (test scope)."""
    here = sys.modules[__name__].__dict__
    cuda_names = [n for n in here if n.startswith("cuda")]
    runtime = _module("cuda.bindings.runtime", **{n: here[n] for n in cuda_names})
    bindings = _module("cuda.bindings", runtime=runtime)
    trt_names = ["DataType", "nptype", "TensorIOMode", "BuilderFlag", "NetworkDefinitionCreationFlag",
                 "MemoryPoolType", "Logger", "OnnxParser", "Builder", "Runtime", "ICudaEngine", "IExecutionContext"]
    tensorrt = _module("tensorrt", __version__="standin", **{n: here[n] for n in trt_names})
    for name, module in {"tensorrt": tensorrt, "cuda": _module("cuda", bindings=bindings),
                         "cuda.bindings": bindings, "cuda.bindings.runtime": runtime}.items():
        monkeypatch.setitem(sys.modules, name, module)


def plan_header(path: Path) -> dict:
    """Test helper: the build settings a stand-in plan recorded (profile, TF32, strongly typed)."""
    plan = Path(path).read_bytes()
    size = int.from_bytes(plan[len(MAGIC):len(MAGIC) + 8], "little")
    return json.loads(plan[len(MAGIC) + 8:len(MAGIC) + 8 + size])

"""TensorRT's Python API stood in for CPU tests: only the documented behaviour our code relies on.

``install(monkeypatch)`` puts two modules in ``sys.modules``: ``tensorrt`` (this module's
subset of the Python API that :mod:`runtime.trt_build` and :mod:`runtime.backends.trt` call)
and ``cuda.bindings.runtime`` (:mod:`cuda_standin`, cuda-python's runtime calls of
:mod:`runtime.backends.cuda_runtime`). The code under test is the real code; only these two
libraries are stood in for.

Each behaviour cites where it is documented:
  [H]  NVIDIA TensorRT include/NvInferRuntime.h (ICudaEngine, IExecutionContext, IOptimizationProfile)
  [HB] NVIDIA TensorRT include/NvInfer.h (BuilderFlag)
  [PY] TensorRT Python API reference (tensorrt.Builder, IBuilderConfig, ICudaEngine, IExecutionContext)
  [OP] onnx-tensorrt ModelImporter.cpp, importInputs: a graph input that has an initializer is
       imported as that weight, not as a network input

The math is real: the "engine" runs the same ONNX file on onnxruntime (CPU, one thread),
reading its inputs from and writing its outputs to the stand-in's device memory when the
stream runs.
"""

from __future__ import annotations

import ctypes
import enum
import json
import sys
import types
from pathlib import Path

import cuda_standin as cuda
import numpy as np
import onnx
import onnxruntime as ort

MAGIC = b"TRT-STANDIN-PLAN\n"


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


def _network_inputs(graph: onnx.GraphProto) -> list:
    """[OP] The graph inputs that become network inputs: those without an initializer (an input with a
    default value is imported as that constant)."""
    weights = {t.name for t in graph.initializer}
    return [value for value in graph.input if value.name not in weights]


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
        for value in _network_inputs(graph):
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
        self.io = {v.name: (TensorIOMode.INPUT, v) for v in _network_inputs(model.graph)}
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
        stream = cuda.find_stream(stream_handle)
        shapes = {n: self.get_tensor_shape(n) for n in self.engine.names}
        if stream is None or any(-1 in s for s in shapes.values()):
            return False
        dtypes = {n: np.dtype(nptype(self.engine.get_tensor_dtype(n))) for n in self.engine.names}
        for name in self.engine.names:
            ptr, nbytes = self.addresses.get(name, 0), int(np.prod(shapes[name])) * dtypes[name].itemsize
            if not ptr or ptr % cuda.ALIGNMENT or cuda.MEMORY.kind_of(ptr, nbytes) != "device":
                return False
        addresses = dict(self.addresses)
        inputs = [n for n in self.engine.names if self.engine.get_tensor_mode(n) == TensorIOMode.INPUT]

        def forward():
            feeds = {n: cuda.read_device(addresses[n], shapes[n], dtypes[n]) for n in inputs}
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
    runtime = _module("cuda.bindings.runtime", **{n: getattr(cuda, n) for n in dir(cuda) if n.startswith("cuda")})
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

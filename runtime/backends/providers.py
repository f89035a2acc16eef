"""The onnxruntime execution providers and the package that brings each, importable without onnxruntime.

onnxruntime comes from one of two packages that share the ``onnxruntime`` module:
``onnxruntime`` (CPU, the ``[cpu]`` extra) or ``onnxruntime-gpu`` (CUDA and TensorRT
providers, the ``[gpu]`` extra or NVIDIA's Jetson wheel). The command-line tools read
:data:`PROVIDERS` for their options and catch :class:`OnnxRuntimeMissing`, so a runtime
installed without either extra stops with one line naming the extra, not a traceback.
"""

from __future__ import annotations

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
_GPU_INSTALL = ("pip install 'mars-edge[gpu]' (onnxruntime-gpu; on Jetson NVIDIA's onnxruntime-gpu wheel, "
                "samples/jetson/README.md)")
INSTALL = {
    "cpu": "pip install 'mars-edge[cpu]' (onnxruntime) or, for a GPU, " + _GPU_INSTALL,
    "cuda": _GPU_INSTALL + " with CUDA 12 and cuDNN 9",
    "tensorrt": _GPU_INSTALL + " with CUDA 12 and TensorRT 10",
}


class OnnxRuntimeMissing(ImportError):
    """onnxruntime cannot be imported: the runtime was installed without the [cpu] or [gpu] extra."""


def import_onnxruntime():
    """The ``onnxruntime`` module.

    Raises:
        OnnxRuntimeMissing: it cannot be imported; the one-line message names the extra to install.
    """
    try:
        import onnxruntime
    except ImportError as e:  # installed without the [cpu] or [gpu] extra
        raise OnnxRuntimeMissing(f"the runtime needs onnxruntime, which cannot be imported ({e}): "
                                 f"{INSTALL['cpu']}") from e
    return onnxruntime

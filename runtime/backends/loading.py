"""Open a bundle for serving from any of the paths a user may give.

PATH may be the bundle directory, its ONNX step graph (``model.onnx``), or the TensorRT
engine inside it (``engine.plan``). The directory and the ONNX file run on onnxruntime;
the engine runs on TensorRT's own Python API (:mod:`runtime.backends.trt`, imported only
when asked for, as it needs TensorRT and a GPU).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from runtime.backends.onnx import OnnxBackend
from runtime.bundle import CONFIG_FILE, ENGINE_FILE, WHAT_A_BUNDLE_IS, BundleConfig, BundleError, load_config


def load_backend(path: str | Path, provider: str = "cpu", num_threads: int = 0) -> tuple[object, BundleConfig, Path]:
    """Open the backend that PATH names.

    Args:
        path: bundle directory, its ``.onnx`` file, or an ``engine.plan`` inside a bundle.
        provider: onnxruntime execution provider (``cpu``, ``cuda``, ``tensorrt``); ignored for a plan.
        num_threads: onnxruntime intra-op threads (0: its choice); ignored for a plan.

    Returns:
        (backend, bundle config, bundle directory).

    Raises:
        BundleError: PATH is not a bundle, not one of its model files, or the files are bad.
        ValueError: bad provider or thread count, or TensorRT is not available for a plan.
    """
    config, bundle_dir, plan = locate_bundle(path)
    if plan is not None:
        return _trt_backend(plan, config), config, bundle_dir
    return OnnxBackend(bundle_dir, config, provider, num_threads), config, bundle_dir


def locate_bundle(path: str | Path) -> tuple[BundleConfig, Path, Path | None]:
    """The bundle PATH names, read from its ``mars_config.json`` alone (no session opened: :func:`load_backend`
    opens one; ``python -m runtime.serve_ray`` checks the options against the config before Ray starts).

    Returns:
        (bundle config, bundle directory, the TensorRT engine PATH names or None for onnxruntime); a plan's config
        names that engine.

    Raises:
        BundleError: PATH is not a bundle, not one of its model files, or its config is bad.
    """
    path = Path(path)
    paths = "give a bundle directory, its .onnx file or its engine.plan"
    if not path.exists():
        raise BundleError(f"{path} does not exist; {paths}")
    if path.is_file() and path.suffix not in (".onnx", ".plan"):
        raise BundleError(f"{path} is a file, not a MARS bundle: {paths}; {WHAT_A_BUNDLE_IS}")
    bundle_dir = path if path.is_dir() else path.parent
    if path.is_file() and not (bundle_dir / CONFIG_FILE).is_file():
        raise BundleError(f"{path} is not in a MARS bundle: its folder {bundle_dir} holds no {CONFIG_FILE}; {paths}; "
                          f"{WHAT_A_BUNDLE_IS}")
    config = load_config(bundle_dir)
    if path.is_dir() or path.suffix == ".onnx":
        if path.is_file() and path.name != config.onnx_file:
            raise BundleError(f"{path} is not this bundle's step graph ({config.onnx_file} in "
                              f"{bundle_dir / 'mars_config.json'}); give the bundle directory instead")
        return config, bundle_dir, None
    if path.suffix == ".plan":
        if path.name not in {config.engine_file, ENGINE_FILE}:
            raise BundleError(f"{path} is not this bundle's TensorRT engine ({config.engine_file or ENGINE_FILE})")
        return replace(config, engine_file=path.name), bundle_dir, path  # the engine the user named
    raise BundleError(f"{path} is neither a bundle directory, an .onnx file nor an engine.plan")


def _trt_backend(path: Path, config: BundleConfig):
    hint = "install mars-edge[trt] on a machine with an NVIDIA GPU, or serve the bundle directory (onnxruntime)"
    try:
        from runtime.backends.trt import TrtBackend
    except ImportError as e:
        raise ValueError(f"{path} needs TensorRT, which cannot be imported here ({e}); {hint}") from e
    try:
        return TrtBackend(path.parent, config)
    except RuntimeError as e:  # TensorRT, cuda-python or the GPU is missing
        raise ValueError(f"{path} needs TensorRT and a GPU: {e}") from e

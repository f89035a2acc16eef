"""Run the bundle's step graph on onnxruntime (CPU by default; CUDA/TensorRT providers if present).

The backend owns the session and nothing else: it takes explicit inputs and past KV and
returns logits and the new KV; caching and acceptance live elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from runtime import bundle
from runtime.bundle import BundleConfig, BundleError

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
MAX_THREADS = 256
_LOAD_ERRORS = (ort_state.InvalidProtobuf, ort_state.InvalidGraph, ort_state.InvalidArgument, ort_state.Fail,
                ort_state.NoSuchFile, ort_state.RuntimeException)


class OnnxBackend:
    """An onnxruntime session over a bundle's step graph.

    Args:
        bundle_dir: the bundle directory.
        config: its :class:`~runtime.bundle.BundleConfig`.
        provider: execution provider, one of ``cpu``, ``cuda``, ``tensorrt``.
        num_threads: intra-op threads; 0 lets onnxruntime choose.

    Raises:
        BundleError: the ONNX file is missing, corrupt or truncated, or its I/O names do
            not match the config.
        ValueError: unknown or unavailable provider, or num_threads outside 0..256.
    """

    def __init__(self, bundle_dir: str | Path, config: BundleConfig, provider: str = "cpu", num_threads: int = 0):
        path = Path(bundle_dir) / config.onnx_file
        if not path.is_file():
            raise BundleError(f"{path} not found; re-export the bundle with mars-export")
        if not 0 <= num_threads <= MAX_THREADS:
            raise ValueError(f"num_threads must be in 0..{MAX_THREADS} (0 lets onnxruntime choose), got {num_threads}")
        self.session = _make_session(path, provider, num_threads)
        self.num_layers = config.num_layers
        self.kv_dtype = np.dtype(config.dtype)
        _check_io(self.session, config, path)
        # A symbolic window axis (exports since 2026-11-30) also runs T-token prefill forwards.
        self.is_window_dynamic = isinstance(self.session.get_inputs()[0].shape[1], str)
        # Batch and past length are dynamic axes: any batch, any past up to the model's context.
        self.max_batch: int | None = None
        self.max_past = config.max_context

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
             past: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """Run one forward over a window.

        Args:
            input_ids: int64 [B, W]; W is the bundle's window, or any length >= 1 when
                ``is_window_dynamic`` (prefill).
            position_ids: int64 [B, W].
            attention_mask: bool [B, 1, W, P + W].
            past: per layer (key, value), each [B, H, P, D] in the bundle dtype.

        Returns:
            logits float32 [B, W, V], and per layer the new (key, value) [B, H, W, D].
        """
        logits, *kv = self.session.run(None, bundle.step_feeds(input_ids, position_ids, attention_mask, past))
        return logits, list(zip(kv[0::2], kv[1::2]))


def _make_session(path: Path, provider: str, num_threads: int) -> ort.InferenceSession:
    if provider not in PROVIDERS:
        raise ValueError(f"unknown execution provider {provider!r}; choose one of {sorted(PROVIDERS)}")
    name = PROVIDERS[provider]
    if name not in ort.get_available_providers():
        raise ValueError(f"execution provider {name} is not available in this onnxruntime build "
                         f"(available: {ort.get_available_providers()})")
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads
    try:
        return ort.InferenceSession(str(path), options, providers=[name])
    except _LOAD_ERRORS as e:
        first_line = str(e).strip().splitlines()[0][:300]
        raise BundleError(f"cannot load {path}: the ONNX file is corrupt or truncated ({first_line}); "
                          "re-export the bundle with mars-export") from e


def _check_io(session: ort.InferenceSession, config: BundleConfig, path: Path) -> None:
    got_in = [i.name for i in session.get_inputs()]
    got_out = [o.name for o in session.get_outputs()]
    if got_in != bundle.input_names(config.num_layers) or got_out != bundle.output_names(config.num_layers):
        raise BundleError(f"{path} does not match {bundle.CONFIG_FILE}: expected {config.num_layers} layers of "
                          f"past_key_values/present I/O, got inputs {got_in[:4]}... outputs {got_out[:3]}...; "
                          "re-export the bundle")
    window = session.get_inputs()[0].shape[1]
    if not isinstance(window, str) and window != config.window:
        raise BundleError(f"{path} has a window of {window} tokens but {bundle.CONFIG_FILE} says {config.window}; "
                          "re-export the bundle")

"""Run the bundle's step graph on onnxruntime (CPU by default; CUDA/TensorRT providers if present).

The backend owns the session and nothing else: it takes explicit inputs and the past KV, writes
the window's KV into that past in place (:mod:`runtime.backends.kv_binding`) and returns the
logits; caching and acceptance live elsewhere.

onnxruntime comes from one of two packages (:mod:`runtime.backends.providers`); importing
this module without either raises :class:`~runtime.backends.providers.OnnxRuntimeMissing`,
and :func:`require_provider` says which one to install when a requested provider is missing.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import numpy as np

from runtime import bundle
from runtime.backends.fused import FusedKVCache, FusedStep
from runtime.backends.huge_pages import new_memory_on_huge_pages
from runtime.backends.kv_binding import KVBinding
from runtime.backends.providers import INSTALL, PROVIDERS, import_onnxruntime
from runtime.bundle import BundleConfig, BundleError
from runtime.decode.admission import check_num_threads
from runtime.decode.kv_cache import KVCache

ort = import_onnxruntime()  # without the [cpu] or [gpu] extra: OnnxRuntimeMissing, naming the extra
ort_state = ort.capi.onnxruntime_pybind11_state

_LOAD_ERRORS = (ort_state.InvalidProtobuf, ort_state.InvalidGraph, ort_state.InvalidArgument, ort_state.Fail,
                ort_state.NoSuchFile, ort_state.RuntimeException)


def onnx_limits(config: BundleConfig) -> tuple[int | None, int]:
    """(largest batch, largest past) of an :class:`OnnxBackend` over a bundle of ``config``: a fused graph runs
    batch 1 (:mod:`runtime.backends.fused`), a step graph any (None); either, any past up to the model's max
    context. Read from the config alone, so ``python -m runtime.serve_ray`` checks them before any replica loads."""
    return (1 if config.graph == "fused" else None), config.max_context


class OnnxBackend:
    """An onnxruntime session over a bundle's step graph.

    Args:
        bundle_dir: the bundle directory.
        config: its :class:`~runtime.bundle.BundleConfig`.
        provider: execution provider, one of ``cpu``, ``cuda``, ``tensorrt``.
        num_threads: intra-op threads; 0 lets onnxruntime choose.
        huge_pages: on the cpu provider, move the memory the session allocates at load (its weights) onto
            transparent huge pages (:mod:`runtime.backends.huge_pages`; best-effort, Linux). False keeps
            onnxruntime's own pages (for A/B timings).

    Attributes:
        huge_page_bytes: bytes of the session's memory moved onto huge pages at load (0 where none).
        is_window_dynamic: the graph's window axis is dynamic: steps narrower than W (exports since 2026-11-30).
        why_window_fixed: with a fixed window axis, why every step is W wide and what to do
            (:func:`runtime.decode.admission.why_no_adaptive_masks` quotes it); else None.
        why_no_gate: without the confidence gate (``takes_confidence_gate`` False), why this bundle on this
            provider has none and what to do (:func:`runtime.bundle.why_no_confidence_gate`); else None.

    Raises:
        BundleError: the ONNX file is missing, corrupt or truncated, or its I/O names do
            not match the config.
        ValueError: unknown or unavailable provider; a :class:`~runtime.decode.admission.SettingError`
            (``num_threads``) for num_threads outside 0..MAX_THREADS
            (:func:`~runtime.decode.admission.check_num_threads`).
    """

    def __init__(self, bundle_dir: str | Path, config: BundleConfig, provider: str = "cpu", num_threads: int = 0,
                 huge_pages: bool = True):
        path = Path(bundle_dir) / config.onnx_file
        if not path.is_file():
            raise BundleError(f"{path} not found; re-export the bundle with mars-export")
        check_num_threads(num_threads)
        if config.graph == "fused" and provider != "cpu":
            raise ValueError(f"a fused bundle runs on the cpu provider only, not {provider}; "
                             "export with --graph step for CUDA or TensorRT")
        with new_memory_on_huge_pages(huge_pages and provider == "cpu") as moved:
            self.session = _make_session(path, provider, num_threads)
        self.huge_page_bytes = moved.bytes
        self.num_layers = config.num_layers
        self.kv_dtype = np.dtype(config.dtype)
        _check_io(self.session, config, path)
        # A symbolic window axis (exports since 2026-11-30) also runs T-token prefill forwards.
        self.is_window_dynamic = isinstance(self.session.get_inputs()[0].shape[1], str)
        self.why_window_fixed = None if self.is_window_dynamic else (
            f"{path.name} takes exactly W = {config.window} tokens per step (a step graph exported before "
            "2026-11-30); re-export the bundle with mars-export, whose step graphs take narrower steps")
        # Batch and past length are dynamic axes: any batch, any past up to the model's context;
        # a fused graph runs batch 1 and writes its KV into the past in place (runtime.backends.fused).
        self.fused = FusedStep(self.session, ort, config) if config.graph == "fused" else None
        # Exports since 2026-12-02 take num_logits (step graph: an input with a default; fused: required):
        # prefill forwards skip the output head.
        defaults = {i.name for i in self.session.get_overridable_initializers()}
        self.takes_num_logits = self.fused.takes_num_logits if self.fused else bundle.NUM_LOGITS in defaults
        # the argmax tokens without the float32 output head (mars_export.greedy_head): float32 fused graphs since the
        # fourteenth session, float32 step graphs since the seventeenth (not on GPUs: 8-bit MatMulNBits is a CPU kernel)
        self.takes_num_greedy = (self.fused.takes_num_greedy if self.fused
                                 else provider == "cpu" and bundle.NUM_GREEDY in defaults)
        # threshold steps that skip the float32 head where every tau test provably fails (mars_export.confidence_gate):
        # float32 step graphs since the twenty-seventh session, float32 fused graphs since the twenty-eighth
        self.takes_confidence_gate = self.takes_num_greedy and (self.fused.takes_confidence_gate if self.fused
                                                                else bundle.CONFIDENCE_TAU in defaults)
        # what a step asked for confidence_tau without the gate is told (bundle.why_no_confidence_gate)
        self.why_no_gate = None if self.takes_confidence_gate else bundle.why_no_confidence_gate(config, provider)
        self.max_batch, self.max_past = onnx_limits(config)
        self.kv = KVBinding(self.session, ort)
        self.vocab_size = config.vocab_size

    def make_cache(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype,
                   num_slots: int = 1) -> KVCache:
        """The engine's KV cache (``KVCache``'s arguments): a :class:`~runtime.backends.fused.FusedKVCache`
        for a fused bundle (its step writes the entries in place), else a plain ``KVCache``."""
        kind = FusedKVCache if self.fused else KVCache
        return kind(num_layers, num_kv_heads, head_dim, max_len, dtype, num_slots)

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
             past: list[tuple[np.ndarray, np.ndarray]],
             logits: bool = True, greedy_ids: bool = False,
             confidence_tau: np.ndarray | None = None
             ) -> tuple[np.ndarray | tuple[np.ndarray, np.ndarray | None], list[tuple[np.ndarray, np.ndarray]]]:
        """Run one forward over a window, its KV written into ``past`` in place.

        Args:
            input_ids: int64 [n, W]; W is the bundle's window, or any length >= 1 when
                ``is_window_dynamic`` (prefill).
            position_ids: int64 [n, W], each below S: new entry j of row b is written at index
                ``position_ids[b, j]`` of ``past``.
            attention_mask: bool [n, 1, W, S] over the past's indices.
            past: per layer (key, value), each a C-contiguous [n, H, S, D] in the bundle dtype: the KV cache.
            logits: False when no logits are read (prefill): a graph with the ``num_logits``
                input (``takes_num_logits``) then skips the output head.
            greedy_ids: return each row's argmax token, the mask token excluded, instead of its logits
                (graphs with the greedy head only, ``takes_num_greedy``: mars_export.greedy_head; the float32
                output head is skipped).
            confidence_tau: float32 [n], with ``greedy_ids``: a threshold step through the confidence gate
                (``takes_confidence_gate``: mars_export.confidence_gate), per row the tau of its probability
                test (-1: the row reads its logits; >= 1: it tests no confidence).

        Returns:
            logits float32 [n, W, V] ([n, 0, V] when ``logits`` is False; with ``greedy_ids`` the ids
            int64 [n, W] instead; with ``confidence_tau`` the pair (ids int64 [n, W], logits float32 [n, W, V] or
            None where the gate skipped the head)), and the presents: per layer
            (key, value) [n, H, S, D], ``past`` itself with the new entries written (step graphs without
            ``num_logits``, exported before 2026-12-02, compute a prefill's logits and drop them).

        Raises:
            ValueError: inputs whose shapes disagree, a position outside the past (no room for the window),
                or, where the step writes into it, a past that is not C-contiguous and writeable
                (:func:`runtime.bundle.check_step_inputs`, :class:`~runtime.backends.kv_binding.KVBinding`);
                ``greedy_ids`` on a graph without the greedy head, ``confidence_tau`` without ``greedy_ids`` or on a
                graph without the gate (``why_no_gate`` says why it has none and what to do).

        A fused bundle (n = 1, :class:`runtime.backends.fused.FusedStep`) attends causally over the
        past's positions before ``position_ids[0, 0]`` (what the engine's mask says at batch 1).
        """
        bundle.check_confidence_tau(confidence_tau, greedy_ids, self.why_no_gate)
        if self.fused:
            return self.fused(input_ids, position_ids, past, logits, greedy_ids, confidence_tau)
        if greedy_ids and not self.takes_num_greedy:
            raise ValueError("this step graph has no greedy head (num_greedy input) on this provider; read the logits")
        bundle.check_step_inputs(input_ids, position_ids, attention_mask, past, self.num_layers)
        if confidence_tau is not None:
            return self.kv.run_gated_step(input_ids, position_ids, attention_mask, past, self.vocab_size,
                                          confidence_tau), past
        if greedy_ids or not logits and self.takes_num_logits:  # the output head skipped: num_logits 0
            out = self.kv.run_step_without_head(input_ids, position_ids, attention_mask, past, self.vocab_size,
                                                greedy_ids)
            return out, past
        out = self.kv.run_step(input_ids, position_ids, attention_mask, past, self.vocab_size)  # [n, W, V]
        return (out if logits else out[:, :0]), past


def require_provider(provider: str) -> str:
    """The onnxruntime name of ``provider``, checked against the installed onnxruntime build.

    Args:
        provider: ``cpu``, ``cuda`` or ``tensorrt``.

    Returns:
        Its execution provider name, e.g. ``CUDAExecutionProvider``.

    Raises:
        ValueError: unknown provider, or one this build lacks; the one-line message names
            the package to install (and the clash when both onnxruntime packages are in).
    """
    if provider not in PROVIDERS:
        raise ValueError(f"unknown execution provider {provider!r}; choose one of {sorted(PROVIDERS)}")
    name = PROVIDERS[provider]
    available = ort.get_available_providers()
    if name not in available:
        installed = _installed_packages()
        names = " ".join(installed) or "onnxruntime"  # the two wheels write one module: remove the one(s) in
        shown = " + ".join(f"{package} {version}" for package, version in installed.items()) or "onnxruntime"
        raise ValueError(f"execution provider {name} is not in the installed {shown} (it has {available}): "
                         f"pip uninstall -y {names}, then {INSTALL[provider]}")
    return name


def _installed_packages() -> dict[str, str]:
    """The installed onnxruntime packages and their versions, e.g. ``{"onnxruntime": "1.32.0"}``."""
    found = {}
    for package in ("onnxruntime", "onnxruntime-gpu"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found


def _make_session(path: Path, provider: str, num_threads: int) -> ort.InferenceSession:
    name = require_provider(provider)
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads
    # Errors only: at warning level onnxruntime logs, at every load, that the step graph's num_logits
    # "appears in graph inputs" (an input with a default, as mars_export.logits_rows intends).
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), options, providers=[name])
    except _LOAD_ERRORS as e:
        first_line = str(e).strip().splitlines()[0][:300]
        if "MatMulNBits" in str(e) and "4b" in str(e):  # onnxruntime < 1.22 runs 4-bit MatMulNBits only
            raise BundleError(f"cannot load {path} with onnxruntime {ort.__version__}: it holds 8-bit MatMulNBits "
                              "(an --int8 export, or the greedy head of a float32 bundle), which onnxruntime "
                              "runs from 1.22 on; pip install -U 'onnxruntime>=1.22'") from e
        raise BundleError(f"cannot load {path}: the ONNX file is corrupt or truncated ({first_line}); "
                          "re-export the bundle with mars-export") from e
    if name not in session.get_providers():  # onnxruntime falls back to the CPU when a GPU provider cannot start
        raise ValueError(f"execution provider {name} is built in but did not start (a missing CUDA, cuDNN or "
                         f"TensorRT library; onnxruntime logged which): {INSTALL[provider]}")
    return session


def _check_io(session: ort.InferenceSession, config: BundleConfig, path: Path) -> None:
    got_in = [i.name for i in session.get_inputs()]
    got_out = [o.name for o in session.get_outputs()]
    _check_shapes(session, config, path)
    if config.graph == "fused":
        optional_in = {bundle.NUM_LOGITS, bundle.NUM_GREEDY, bundle.CONFIDENCE_TAU}
        optional_out = {bundle.GREEDY_IDS, bundle.HEAD_SKIPPED}
        if ((set(got_in) - optional_in, set(got_out) - optional_out) != bundle.fused_io_names(config.num_layers)
                or (bundle.NUM_GREEDY in got_in) != (bundle.GREEDY_IDS in got_out)
                or (bundle.CONFIDENCE_TAU in got_in) != (bundle.HEAD_SKIPPED in got_out)):
            raise BundleError(f"{path} is not the fused graph of a {config.num_layers}-layer model (inputs "
                              f"{got_in[:3]}...); re-export the bundle with mars-export --graph fused")
        return
    if bundle.NUM_GREEDY in {i.name for i in session.get_overridable_initializers()}:
        # the greedy head's (mars_export.greedy_head) and its confidence gate's (mars_export.confidence_gate)
        got_out = [name for name in got_out if name not in (bundle.GREEDY_IDS, bundle.HEAD_SKIPPED)]
    if got_in != bundle.input_names(config.num_layers) or got_out != bundle.output_names(config.num_layers):
        raise BundleError(f"{path} does not match {bundle.CONFIG_FILE}: expected {config.num_layers} layers of "
                          f"past_key_values/present I/O, got inputs {got_in[:4]}... outputs {got_out[:3]}...; "
                          "re-export the bundle")
    bundle.check_kv_in_place(session.get_inputs()[3].shape, session.get_outputs()[1].shape, path)
    window = session.get_inputs()[0].shape[1]
    if not isinstance(window, str) and window != config.window:
        raise BundleError(f"{path} has a window of {window} tokens but {bundle.CONFIG_FILE} says {config.window}; "
                          "re-export the bundle")


def _check_shapes(session: ort.InferenceSession, config: BundleConfig, path: Path) -> None:
    """The KV heads, head size, vocabulary and KV dtype the graph declares against the config (a graph without
    the KV input or the logits output fails the I/O names check instead)."""
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    past, logits = inputs.get(bundle.past_names(0)[0]), outputs.get(bundle.LOGITS)
    if past is None or logits is None:
        return
    bundle.check_graph_fits_config(past.shape, logits.shape, config, path)
    if past.type != bundle.ONNX_KV_TYPES[config.dtype]:
        raise BundleError(f"{path} holds its KV cache as {past.type} but {bundle.CONFIG_FILE} says dtype "
                          f"{config.dtype}; re-export the bundle")

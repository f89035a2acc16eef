"""What the engine admits, and why not: the rules on a request and on a server's settings that
:class:`runtime.decode.engine.Engine` checks before it takes them (which waiting request takes a free
slot is the scheduler's, :mod:`runtime.decode.scheduler`).

The one home of: the error that names a bad engine or backend setting (:class:`SettingError`), the vocabulary
check on a prompt (:func:`check_prompt_ids`), the batch size a backend can run (:func:`check_max_batch_size`), the
intra-op threads an onnxruntime backend takes (:func:`check_num_threads`), the positions a slot can hold, at
most and at least (:func:`check_max_seq_len`, :func:`min_seq_len`), and where adaptive masks can act
(:func:`why_no_adaptive_masks`).
"""

from __future__ import annotations

from runtime.decode.params import ParamError
from runtime.decode.scheduler import can_narrow_steps

MAX_THREADS = 256  # most onnxruntime intra-op threads a backend takes (--threads)


class SettingError(ValueError):
    """An engine or backend setting out of range; ``setting`` names it (``max_batch_size``, ``max_seq_len``,
    ``num_threads``, ...), as :class:`~runtime.decode.params.ParamError`'s ``field`` names a request's.

    The message is the setting's name, then ``detail`` (what is wrong and what is allowed):
    ``max_batch_size must be >= 1, got 0``. A command line names its option too (:meth:`naming`).

    Attributes:
        setting: the setting's name (the keyword of :class:`~runtime.decode.engine.EngineConfig` or of the backend).
        detail: the message after the name.
        option: the command-line option that sets it, named in the message after the setting; None where none is.
    """

    def __init__(self, setting: str, detail: str, option: str | None = None):
        super().__init__(f"{setting} {detail}" if option is None else f"{setting} ({option}) {detail}")
        self.setting, self.detail, self.option = setting, detail, option

    def naming(self, option: str) -> SettingError:
        """The same error naming ``option`` after the setting: ``max_batch_size (--max-batch-size) must be >= 1``."""
        return SettingError(self.setting, self.detail, option)


def check_prompt_ids(prompt_ids: list[int], vocab_size: int) -> None:
    """The vocabulary check: a prompt is >= 1 token id, each in 0..V-1.

    Raises:
        ParamError: (field ``prompt``) empty, or an id outside the vocabulary.
    """
    if not prompt_ids:
        raise ParamError("prompt", "the prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ParamError("prompt", f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


def check_num_threads(num_threads: int) -> int:
    """Return ``num_threads``, the onnxruntime intra-op threads of a backend, if it is in 0..MAX_THREADS (0 lets
    onnxruntime choose): :class:`~runtime.backends.onnx.OnnxBackend`'s rule, which a ``--threads`` option applies
    as it parses (:func:`runtime.command_line.threads_value`), before onnxruntime loads.

    Raises:
        SettingError: (``num_threads``) outside 0..MAX_THREADS.
    """
    if not 0 <= num_threads <= MAX_THREADS:
        raise SettingError("num_threads", f"must be in 0..{MAX_THREADS} (0 lets onnxruntime choose), got "
                                          f"{num_threads}")
    return num_threads


def check_max_batch_size(max_batch_size: int, backend_max_batch: int | None) -> None:
    """Raise :class:`SettingError` (``max_batch_size``) if ``max_batch_size`` exceeds the backend's largest batch
    (None: no limit), naming the fix: a TensorRT engine's optimization profile, or a fused bundle's 1."""
    if backend_max_batch is not None and max_batch_size > backend_max_batch:
        raise SettingError("max_batch_size", f"{max_batch_size} exceeds the backend's largest batch "
                                             f"{backend_max_batch} (a TensorRT engine's optimization profile, or 1 for "
                                             "a fused bundle); lower it, or rebuild the engine / export with --graph "
                                             "step")


def min_seq_len(window: int) -> int:
    """The fewest positions a slot serves a request with: a prompt of 1 token, 1 token to generate, and the W
    positions every decode step reserves past them (:meth:`runtime.decode.engine.Engine.room` is S - W - prompt)."""
    return 1 + 1 + window


def check_max_seq_len(max_seq_len: int | None, max_context: int, max_past: int, window: int) -> int:
    """The positions a slot holds: ``max_seq_len``, or when None the most any slot may hold,
    min(the model's max context, the backend's largest past). The past fed is the whole
    cache capacity, so the capacity never exceeds the backend's ``max_past``.

    Raises:
        SettingError: (``max_seq_len``) above that limit (never silently capped), or below
            :func:`min_seq_len` of the window W (a slot that could serve no request).
    """
    limit = min(max_context, max_past)
    if max_seq_len is not None and max_seq_len > limit:
        bound = ("the backend's largest past, its optimization profile; rebuild the engine for more"
                 if max_past < max_context else "the model's max context")
        raise SettingError("max_seq_len", f"{max_seq_len} exceeds the {limit} positions a slot can hold "
                                          f"({bound}); give at most {limit}")
    least = min_seq_len(window)
    if max_seq_len is not None and max_seq_len < least:
        raise SettingError("max_seq_len", f"{max_seq_len} leaves no room for a request: a slot holds a prompt of at "
                                          f"least 1 token, 1 token to generate and the window of a decode step "
                                          f"({window}); give at least {least}")
    return limit if max_seq_len is None else max_seq_len


def why_no_adaptive_masks(backend, scheme: str = "continuous") -> str | None:
    """The rule of where adaptive masks (:mod:`runtime.decode.mask_backoff`) can act: they skip masks by running a
    step narrower than W (:func:`runtime.decode.scheduler.can_narrow_steps`), so where every step is W wide they
    would change nothing, and a request for them is refused (:meth:`runtime.decode.engine.Engine.add_request`)
    rather than ignored.

    Args:
        backend: the backend: ``is_window_dynamic``, and ``why_window_fixed`` (why a fixed window is fixed and
            what to do) where it says.
        scheme: the batch scheme (:class:`runtime.decode.decoder.Decoder` runs ``continuous``).

    Returns:
        None where they act; else the refusal, one line naming the cause and the fix: the block scheme, or a
        backend whose window axis is fixed (a TensorRT engine, a step graph exported before 2026-11-30).
    """
    if can_narrow_steps(scheme, backend.is_window_dynamic):
        return None
    if scheme == "block":
        why = ("the block scheme runs every step W wide (it re-runs the block at a fixed shape); use the continuous "
               "scheme (python -m runtime.serve --scheme continuous, the default)")
    else:
        why = getattr(backend, "why_window_fixed", None) or "this backend runs every step W wide"
    return (f"adaptive masks cannot act here: they skip masks by running steps narrower than the window W, and "
            f"{why}; or turn adaptive masks off")

"""Per-request decoding parameters, the result of one generation, and the rules on them.

The one home of: tau's validation (:func:`check_tau`), the error that names the bad
request field (:class:`ParamError`), tokens per forward (:func:`tokens_per_forward`), and which
settings feed mask tokens (:meth:`DecodeParams.uses_masks`; which engines can skip them with adaptive masks:
:func:`runtime.decode.admission.why_no_adaptive_masks`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

from runtime.decode.acceptance import METRICS
from runtime.decode.sampling import is_greedy

MODES = ("ar", "threshold", "verify")
DRAFTS = ("masks", "lookup", "both")
MAX_TEMPERATURE = 2.0  # OpenAI's range, 0..2, which the server's API keeps; the one limit of every entry point


class ParamError(ValueError):
    """A request value out of range; ``field`` names it (``tau``, ``prompt``, ``max_new_tokens``, ...).

    The message says what is allowed; the HTTP layer reports ``field`` as the error's ``param``, a command line
    names its option too (:meth:`naming`).
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def naming(self, option: str) -> ParamError:
        """The same error naming ``option``, the command-line option that sets the field: after the field where the
        message begins with it (``top_p (--top-p) must be in (0, 1], got 0``), else before the message."""
        message = str(self)
        if message.startswith(f"{self.field} "):
            return ParamError(self.field, f"{self.field} ({option}){message[len(self.field):]}")
        return ParamError(self.field, f"{option}: {message}")


@dataclass(frozen=True)
class DecodeParams:
    """Per-request decoding parameters.

    Attributes:
        tau: confidence threshold, >= 0; >= 1 means one token per step (greedy AR, or plain
            AR sampling). None = follow the engine's live default tau at every step.
        mode: ``threshold`` (MARS §3: accept mask predictions while confident), ``ar`` (one
            token per step, whatever tau), or ``verify`` (DESIGN.md §3: the previous step's
            mask predictions are checked as drafts; output exactly greedy AR; tau unused).
        draft: where the drafts come from (DESIGN.md §3 "Draft sources"): ``masks`` (verify
            mode: the previous step's mask predictions; threshold mode: no drafts, plain MARS;
            the default), ``lookup`` (prompt lookup: the tokens that followed the latest earlier
            match of the context's suffix n-gram, see :mod:`runtime.decode.lookup`; verify mode
            feeds no masks, a step without a match feeds one token) or ``both`` (a lookup
            proposal when there is one, else the previous step's mask predictions; masks fill
            the rest of the window). Drafts are kept while each equals the argmax before it; in
            threshold mode the mask predictions after the exact next token are then accepted by
            tau as usual, so at tau >= 1 the output is exactly greedy AR. Greedy only.
        adaptive_masks: feed mask tokens only while they pay (:mod:`runtime.decode.mask_backoff`): after a step
            whose masks gained no token the row runs steps without masks, 1, 2, 4 .. 16 of them, between probes.
            They act only where a step can be narrower than W (the continuous scheme on a graph with a dynamic
            window axis); elsewhere the engine refuses the request
            (:func:`runtime.decode.admission.why_no_adaptive_masks`).
            In threshold mode at tau < 1 the tokens can differ from feeding masks every step (the default, MARS
            §3); where the output is greedy AR anyway (tau >= 1, verify mode) only the forward count changes.
        metric: confidence metric, one of ``probability``, ``margin``, ``entropy``.
        max_new_tokens: most tokens to generate, >= 1.
        block_size: most tokens accepted per step; None = the bundle's B.
        stop_ids: ids that end generation; None = the bundle's eos ids.
        temperature: 0 .. :data:`MAX_TEMPERATURE`; below 1e-5 (0 included, :func:`runtime.decode.sampling.is_greedy`)
            greedy, else sampled (see :mod:`runtime.decode.sampling` for what tau means then).
        top_p: nucleus mass in (0, 1]. top_k: keep the k most likely tokens, 0 = all.
        seed: seed of the request's random generator (sampling only), an integer >= 0; None = fresh entropy.

    Raises:
        ParamError: a value out of range (``field`` and the message name the field and what is
            allowed), verify mode or a draft source other than masks with a sampling temperature,
            or a draft source other than masks in ar mode.
    """

    tau: float | None = 1.0
    mode: str = "threshold"
    draft: str = "masks"
    adaptive_masks: bool = False
    metric: str = "probability"
    max_new_tokens: int = 128
    block_size: int | None = None
    stop_ids: frozenset[int] | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def uses_drafts(self) -> bool:
        """Whether steps feed drafts: verify mode, or a lookup draft source in threshold mode."""
        return self.mode == "verify" or self.draft != "masks"

    def uses_masks(self, tau: float) -> bool:
        """Whether steps feed mask tokens (where adaptive masks, if on, let them): verify mode with a draft source
        that reads mask predictions, threshold mode at ``tau`` < 1 or with draft ``both``.

        Args:
            tau: the threshold the row uses (``tau``, or the engine's live default where it is None).
        """
        if self.mode == "verify":
            return self.draft != "lookup"
        return self.mode == "threshold" and (tau < 1.0 or self.draft == "both")

    def __post_init__(self):
        if self.tau is not None:
            check_tau(self.tau)
        if self.mode not in MODES:
            raise ParamError("mode", f"unknown mode {self.mode!r}; choose one of {MODES}")
        if self.draft not in DRAFTS:
            raise ParamError("draft", f"unknown draft source {self.draft!r}; choose one of {DRAFTS}")
        if self.draft != "masks" and self.mode == "ar":
            raise ParamError("draft", f"draft {self.draft!r} needs mode 'verify' or 'threshold' (drafts are verified "
                             "there); mode 'ar' takes draft 'masks'")
        if not isinstance(self.adaptive_masks, bool):
            raise ParamError("adaptive_masks", f"adaptive_masks must be true or false, got {self.adaptive_masks!r}")
        if self.metric not in METRICS:
            raise ParamError("metric", f"unknown confidence metric {self.metric!r}; choose one of {METRICS}")
        if self.max_new_tokens < 1:
            raise ParamError("max_new_tokens", f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.block_size is not None and self.block_size < 1:
            raise ParamError("block_size", f"block_size must be >= 1, got {self.block_size}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ParamError("temperature", f"temperature must be a number in 0..{MAX_TEMPERATURE:g} (0 = greedy), "
                             f"got {self.temperature}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ParamError("top_k", f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not _is_natural(self.seed):
            raise ParamError("seed", f"seed must be an integer >= 0 (or none: fresh entropy), got {self.seed}")
        if self.mode == "verify" and not is_greedy(self.temperature):
            raise ParamError("mode", "verify mode is greedy only (it reproduces greedy AR); use temperature 0 "
                             "or mode 'threshold'")
        if self.draft != "masks" and not is_greedy(self.temperature):
            raise ParamError("draft", f"draft {self.draft!r} is greedy only (drafts are checked against the argmax); "
                             "use temperature 0 or draft 'masks'")


def check_tau(tau, shown: str | None = None) -> float:
    """Return ``tau`` if it is a finite number >= 0.

    Args:
        tau: the value to check.
        shown: how the message names the value, where it was typed as text (a command line's ``-1``, not ``-1.0``);
            default ``tau`` itself.

    Raises:
        ParamError: otherwise (field ``tau``).
    """
    if not _is_number(tau) or tau < 0:
        raise ParamError("tau", f"tau must be a finite number >= 0, got {tau if shown is None else shown}; "
                                "tau >= 1 means one token per step (greedy AR)")
    return float(tau)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class GenerationResult:
    """Output of one generation.

    Attributes:
        token_ids: generated ids (prompt excluded), end token included if reached.
        num_forwards: decode forwards (prefill excluded).
        num_prefill_forwards: forwards spent on the prompt.
        seconds / prefill_seconds: wall-clock time of the whole call / of prefill.
        finish_reason: ``"stop"`` (end token), ``"length"`` (max_new_tokens) or ``"abort"``.
    """

    token_ids: list[int] = field(default_factory=list)
    num_forwards: int = 0
    num_prefill_forwards: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    finish_reason: str = "length"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tpf(self) -> float:
        """Tokens per decode forward."""
        return tokens_per_forward(self.num_tokens, self.num_forwards)

    def summary(self) -> dict:
        """The counts as a plain dict (for ``--json`` and benchmarks)."""
        decode_seconds = self.seconds - self.prefill_seconds
        return {"num_tokens": self.num_tokens, "num_forwards": self.num_forwards,
                "num_prefill_forwards": self.num_prefill_forwards, "tpf": self.tpf,
                "seconds": self.seconds, "prefill_seconds": self.prefill_seconds,
                "decode_tokens_per_second": self.num_tokens / decode_seconds if decode_seconds > 0 else None,
                "finish_reason": self.finish_reason}


def tokens_per_forward(num_tokens: int, num_forwards: int) -> float:
    """TPF: generated tokens per decode forward (prefill excluded); 0 forwards counts as 1."""
    return num_tokens / max(num_forwards, 1)


def _is_natural(value) -> bool:
    """Whether ``value`` is an integer >= 0 (a Python or numpy integer; not a bool)."""
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= 0
    except TypeError:
        return False

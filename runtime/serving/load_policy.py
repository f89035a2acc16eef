"""The load policy: the server's default tau as a function of queue depth (DESIGN.md §6).

Plain numbers in, plain numbers out. Requests that set no ``tau`` follow the engine's
default tau at every step, so moving the default trades quality for speed under load
with no restart and no model swap; requests that set ``tau`` are never touched.

Rule: with ``q`` waiting requests and the base tau ``t`` (set at start or by the admin
call), the default tau is ``t`` while ``q <= queue_low``, ``tau_min`` once
``q >= queue_high``, and linear in between (rounded to 0.01 so it does not jitter). It
never exceeds ``t``: the policy only lowers tau. As the queue drains it climbs back to ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.decode.params import ParamError, check_tau


@dataclass(frozen=True)
class LoadPolicy:
    """Bounds and thresholds of the policy.

    Attributes:
        tau_min: the lowest default tau the policy sets (at ``queue_high`` or more waiting).
        tau_max: the highest base tau the admin call accepts.
        queue_low: at or below this many waiting requests, the default is the base tau.
        queue_high: at or above this many, the default is ``tau_min``.
    """

    tau_min: float = 1.0
    tau_max: float = 1.0
    queue_low: int = 0
    queue_high: int = 16

    def __post_init__(self):
        if not (_is_tau(self.tau_min) and _is_tau(self.tau_max) and self.tau_min <= self.tau_max):
            raise ValueError(f"need finite 0 <= tau_min <= tau_max, got tau_min={self.tau_min}, "
                             f"tau_max={self.tau_max}")
        if not 0 <= self.queue_low < self.queue_high:
            raise ValueError(f"need 0 <= queue_low (--queue-low) < queue_high (--queue-high), got {self.queue_low} and "
                             f"{self.queue_high}")

    def check_base(self, tau: float) -> float:
        """Validate a base tau (from the command line or the admin call) and return it.

        Raises:
            ParamError: (field ``tau``) not a tau (:func:`runtime.decode.params.check_tau`) in [tau_min, tau_max].
        """
        if not _is_tau(tau) or not self.tau_min <= tau <= self.tau_max:
            raise ParamError("tau", f"tau must be a number in [{self.tau_min}, {self.tau_max}] (the server's --tau-min "
                             f"and --tau-max), got {tau}")
        return float(tau)

    def default_tau(self, base_tau: float, queue_depth: int) -> float:
        """The default tau for ``queue_depth`` waiting requests, given the base tau."""
        if queue_depth <= self.queue_low or base_tau <= self.tau_min:
            return base_tau
        load = min(1.0, (queue_depth - self.queue_low) / (self.queue_high - self.queue_low))  # in (0, 1]
        return max(self.tau_min, round(base_tau - load * (base_tau - self.tau_min), 2))


def _is_tau(value) -> bool:
    """Whether ``value`` passes :func:`runtime.decode.params.check_tau` (the one tau check)."""
    try:
        check_tau(value)
    except ParamError:
        return False
    return True

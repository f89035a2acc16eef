"""Prometheus metrics of one server (its own registry, so several servers can live in one process).

Written by the engine thread and the request handlers (prometheus_client is thread-safe),
read by ``GET /metrics`` in the Prometheus text format.

TPF here is the paper's per-sequence figure: generated tokens / decode forwards summed
over sequences (a batched step is one forward for each sequence in it). Both counters are
exported, so ``rate(tokens) / rate(forwards)`` gives TPF over any range; the gauges give it
over the last ``window_s`` seconds. The tokens and forwards counted are those the responses
report (usage's completion tokens, ``mars.num_forwards``): each request counts its own as it
reads them (:class:`~runtime.serving.request_stream.RequestStream`), so tokens a forward
accepted after a stop string are not counted.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

OUTCOMES = ("stop", "length", "aborted", "rejected", "error")


class ServerMetrics:
    """The server's gauges and counters.

    Args:
        max_slots: KV slots of the engine (most sequences decoding at once).
        window_s: span of the sliding window behind the TPF and tokens/s gauges.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_slots: int, window_s: float = 10.0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("mars_queue_depth", "Requests waiting for a KV slot", registry=r)
        self.active_slots = Gauge("mars_active_slots", "Sequences decoding now (KV slots in use)", registry=r)
        Gauge("mars_max_slots", "KV slots of the engine", registry=r).set(max_slots)
        self.default_tau = Gauge("mars_default_tau", "Default tau now (requests without tau follow it)", registry=r)
        self.base_tau = Gauge("mars_base_tau", "Base tau (admin-set); the load policy lowers from it", registry=r)
        self.tpf = Gauge("mars_tokens_per_forward", f"Tokens per decode forward, last {window_s:g} s", registry=r)
        self.tokens_per_second = Gauge("mars_tokens_per_second", f"Generated tokens/s, last {window_s:g} s",
                                       registry=r)
        self.tokens = Counter("mars_generated_tokens", "Generated tokens", registry=r)
        self.forwards = Counter("mars_decode_forwards", "Decode forwards, counted per sequence", registry=r)
        self.requests = Counter("mars_requests", "Finished requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export every outcome from the start, at 0
        self._window_s = window_s
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, tokens, forwards) per record_output
        self._lock = threading.Lock()

    def record_output(self, num_tokens: int, num_forwards: int, now: float | None = None) -> None:
        """Count the generated tokens and decode forwards of one engine output of one request (0
        and 0: none, which lets the windowed gauges fall when idle); update the gauges."""
        now = time.monotonic() if now is None else now
        self.tokens.inc(num_tokens)
        self.forwards.inc(num_forwards)
        with self._lock:
            self._recent.append((now, num_tokens, num_forwards))
            while self._recent and self._recent[0][0] < now - self._window_s:
                self._recent.popleft()
            tokens = sum(t for _, t, _ in self._recent)
            forwards = sum(f for _, _, f in self._recent)
            span = max(now - self._recent[0][0], 1e-3) if len(self._recent) > 1 else self._window_s
        self.tpf.set(tokens / forwards if forwards else 0.0)
        self.tokens_per_second.set(tokens / span)

    def record_load(self, queue_depth: int, active_slots: int, default_tau: float, base_tau: float) -> None:
        """Set the load gauges."""
        self.queue_depth.set(queue_depth)
        self.active_slots.set(active_slots)
        self.default_tau.set(default_tau)
        self.base_tau.set(base_tau)

    def record_outcome(self, outcome: str) -> None:
        """Count one finished request (one of :data:`OUTCOMES`)."""
        assert outcome in OUTCOMES, outcome
        self.requests.labels(outcome).inc()

    def render(self) -> bytes:
        """All metrics in the Prometheus text format."""
        return generate_latest(self.registry)

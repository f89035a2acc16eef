"""Tier 1: the server's metrics over hand-made steps."""

from __future__ import annotations

import pytest

from runtime.serving.metrics import ServerMetrics


def sample(metrics: ServerMetrics, name: str) -> float:
    lines = metrics.render().decode().splitlines()
    return float(next(line for line in lines if line.startswith(name + " ")).split()[-1])


def test_windowed_tpf_and_tokens_per_second():
    metrics = ServerMetrics(max_slots=4, window_s=10.0)
    metrics.record_output(8, 4, now=100.0)    # 4 sequences, 2 tokens each
    metrics.record_output(4, 4, now=101.0)
    assert sample(metrics, "mars_tokens_per_forward") == 1.5
    assert sample(metrics, "mars_tokens_per_second") == 12.0
    metrics.record_output(0, 0, now=112.0)    # the first two steps left the window
    assert sample(metrics, "mars_tokens_per_forward") == 0.0 and sample(metrics, "mars_tokens_per_second") == 0.0
    assert sample(metrics, "mars_generated_tokens_total") == 12 and sample(metrics, "mars_decode_forwards_total") == 8


def test_load_gauges_and_outcomes():
    metrics = ServerMetrics(max_slots=4)
    metrics.record_load(queue_depth=5, active_slots=4, default_tau=0.7, base_tau=0.9)
    metrics.record_outcome("aborted")
    assert [sample(metrics, n) for n in ("mars_queue_depth", "mars_active_slots", "mars_default_tau",
                                         "mars_base_tau", "mars_max_slots")] == [5, 4, 0.7, 0.9, 4]
    assert sample(metrics, 'mars_requests_total{outcome="aborted"}') == 1
    assert sample(metrics, 'mars_requests_total{outcome="stop"}') == 0
    with pytest.raises(AssertionError):
        metrics.record_outcome("fine")

"""The fleet board of the Ray Serve replicas (``python -m runtime.serve_ray``): one small Ray actor holding the
published base tau and each replica's report, and the ``/fleet/*`` routes that every replica serves from it.
"""

from __future__ import annotations

import time

import ray
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from runtime.serving.errors import APIError

NAMESPACE = "mars-edge"  # Ray namespace of the fleet board
STALE_S = 3.0  # a replica not heard from for this long is left out of /fleet/*


class FleetBoard:
    """State shared by the replicas (a Ray actor): the published base tau and each replica's report.

    The base tau carries a version that grows with each publication, so a replica applies
    each one once, in order; the newest one wins when two admin calls race.
    """

    def __init__(self):
        self._version, self._tau = 0, None
        self._reports: dict[str, tuple[float, dict]] = {}  # replica id -> (monotonic time, report)

    def publish_tau(self, tau: float) -> int:
        """Publish a base tau for every replica; returns its version."""
        self._version, self._tau = self._version + 1, float(tau)
        return self._version

    def report(self, replica_id: str, report: dict) -> tuple[int, float | None]:
        """Record one replica's report; returns the newest (version, base tau) (0, None if none yet)."""
        self._reports[replica_id] = (time.monotonic(), report)
        return self._version, self._tau

    def replicas(self) -> dict[str, dict]:
        """The reports of the replicas heard from within :data:`STALE_S`, by replica id."""
        now = time.monotonic()
        return {rid: report for rid, (seen, report) in sorted(self._reports.items()) if now - seen <= STALE_S}


def merge_metrics(texts: dict[str, str]) -> bytes:
    """The Prometheus texts of several replicas as one, each sample labelled ``replica="ID"``."""
    families: dict[str, Metric] = {}
    for replica_id, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.add_sample(sample.name, sample.labels | {"replica": replica_id}, sample.value)

    class Collector:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=True)
    registry.register(Collector())
    return generate_latest(registry)


async def read_reports(board) -> dict[str, dict]:
    """The board's replica reports (:meth:`FleetBoard.replicas`).

    Raises:
        APIError: 503 when the board actor is gone (a deployment being shut down, or its actor
            killed): /fleet/* then answers an OpenAI-style JSON error, not a bare 500.
    """
    try:
        return await board.replicas.remote()
    except ray.exceptions.RayError as e:
        raise APIError(503, f"the fleet board (Ray actor) is gone, so no replica reports can be read "
                            f"({type(e).__name__}); the replicas still serve /v1, restart the deployment for /fleet",
                       code="fleet_board_unavailable", type_="server_error") from e


def add_fleet_routes(app: FastAPI, board) -> None:
    """``GET /fleet/replicas`` and ``GET /fleet/metrics`` (from the board's reports; 503 without the board)."""

    @app.get("/fleet/replicas")
    async def replicas():
        reports = await read_reports(board)
        return {rid: {k: v for k, v in report.items() if k != "metrics"} for rid, report in reports.items()}

    @app.get("/fleet/metrics")
    async def fleet_metrics():
        reports = await read_reports(board)
        body = merge_metrics({rid: report["metrics"] for rid, report in reports.items()})
        return Response(body, media_type=CONTENT_TYPE_LATEST)

"""One Ray Serve replica (``python -m runtime.serve_ray``): the app of ``python -m runtime.serve`` with the
fleet's engine thread (the admin tau is also published to the fleet board) and the fleet routes, a thread that
reports the replica to the board and applies the fleet's base tau, and the Serve ingress class that holds both.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import partial

import ray
from fastapi import FastAPI
from ray import serve

from runtime import serve as single
from runtime.serving.engine_thread import EngineThread
from runtime.serving.ray_board import NAMESPACE, add_fleet_routes

log = logging.getLogger(__name__)
SYNC_S = 0.25  # how often each replica reports to the board and picks up the fleet's base tau
_BOARD_TIMEOUT_S = 30.0


class FleetEngineThread(EngineThread):
    """The engine thread of a replica: the admin call also publishes the base tau to the board."""

    def __init__(self, *args, board, **kwargs):
        super().__init__(*args, **kwargs)
        self.board = board

    def set_base_tau(self, tau: float) -> float:
        """Set the base tau here, then publish it so every replica applies it (within :data:`SYNC_S`).

        Raises:
            ValueError: outside the policy's [tau_min, tau_max].
        """
        tau = super().set_base_tau(tau)
        ray.get(self.board.publish_tau.remote(tau), timeout=_BOARD_TIMEOUT_S)
        return tau

    def apply_fleet_tau(self, tau: float) -> float:
        """Apply a base tau published by any replica (here only, without publishing it again)."""
        return super().set_base_tau(tau)


class FleetSync:
    """A thread of each replica: every :data:`SYNC_S` it reports the replica to the board and
    applies a newer published base tau."""

    def __init__(self, ctx, board, replica_id: str):
        self.ctx, self.board, self.replica_id = ctx, board, replica_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mars-fleet-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * SYNC_S)

    def report(self) -> dict:
        loop = self.ctx.engine_thread
        return {"pid": os.getpid(), "is_alive": loop.is_alive, "queue_depth": loop.queue_depth,
                "active_slots": loop.num_running, "base_tau": loop.base_tau, "default_tau": loop.default_tau,
                "metrics": self.ctx.metrics.render().decode()}

    def _run(self) -> None:
        seen = 0
        while not self._stop.wait(SYNC_S):
            if not self.ctx.engine_thread.is_alive:  # not started yet, or stopping
                continue
            try:
                version, tau = ray.get(self.board.report.remote(self.replica_id, self.report()),
                                       timeout=_BOARD_TIMEOUT_S)
                if version > seen:
                    self.ctx.engine_thread.apply_fleet_tau(tau)
                    seen = version
            except (ray.exceptions.RayError, ValueError) as e:  # the board is gone (shutdown) or a bad tau
                log.warning("fleet sync of replica %s failed: %s", self.replica_id, e)


def make_replica_app(serve_argv: list[str], board) -> FastAPI:
    """The app of one replica: ``python -m runtime.serve``'s for ``serve_argv``, with the fleet's engine thread and
    routes, in a process whose own loggers log at its ``--log-level`` (Serve's logger gets it from the deployment's
    ``logging_config``, :func:`~runtime.serving.ray_deploy.deploy`).

    Raises:
        BundleError, ValueError: bad path, bundle or option value.
    """
    args = single.parse_args(serve_argv)
    single.configure_logging(args.log_level)
    app = single.build_app(args, make_thread=partial(FleetEngineThread, board=board))
    add_fleet_routes(app, board)
    return app


@serve.ingress()
class MarsReplica:
    """One Serve replica: the app of ``python -m runtime.serve`` (one engine) for ``serve_argv``.

    Raises (in the replica; Serve reports the deployment as failed):
        BundleError, ValueError: bad path, bundle or option value.
    """

    def __init__(self, serve_argv: list[str], board_name: str):
        board = ray.get_actor(board_name, namespace=NAMESPACE)
        self.fastapi_app = make_replica_app(serve_argv, board)
        self.sync = FleetSync(self.fastapi_app.state.ctx, board, serve.get_replica_context().replica_id.unique_id)
        self.sync.start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.fastapi_app

    def __del__(self):
        if hasattr(self, "sync"):  # Serve calls this also when __init__ failed
            self.sync.stop()

"""Serve a MARS bundle with Ray Serve replicas: ``python -m runtime.serve_ray PATH --replicas N [options]``.

Each replica is one Ray Serve replica that owns one :class:`~runtime.decode.engine.Engine` (its
own batch, KV cache, load policy and live tau) behind the FastAPI app of
``python -m runtime.serve``, mounted as the Serve ingress: the same OpenAI routes, streamed
or not, ``/health``, ``/metrics`` and ``/admin/tau``. Serve's proxy routes each request to a
replica by its ongoing requests, and with ``--max-replicas`` Serve's autoscaler adds and
removes replicas to keep about ``--target-ongoing-requests`` per replica.

The replicas share one small Ray actor, the *fleet board*: ``POST /admin/tau`` on any
replica sets that replica's base tau and publishes it there, and every replica applies the
newest published base tau within :data:`SYNC_S` (a replica that Ray restarts applies it as
it starts). Each replica reports its load and its Prometheus metrics to the board, served
by two routes that exist only here: ``GET /fleet/replicas`` (per replica: pid, queue depth,
slots, base and default tau) and ``GET /fleet/metrics`` (every replica's metrics, labelled
``replica="ID"``). Needs the ``serve-ray`` extra. Options after the Ray ones are those of
``python -m runtime.serve`` (``--host``/``--port`` are the Serve proxy's, binding 127.0.0.1
unless told; ``--shutdown-timeout`` is each replica's graceful shutdown in Serve, and on Ctrl-C this
command waits that long, plus :data:`STOP_MARGIN_S`, for Serve to stop; ``--log-level`` is Serve's
level for its replicas, controller and proxy, and the level of each replica's own loggers).
"""

from __future__ import annotations

import argparse
import http.client
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from functools import partial

import ray
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.schema import LoggingConfig

from runtime import serve as single
from runtime.backends.providers import OnnxRuntimeMissing, import_onnxruntime
from runtime.serving.engine_thread import EngineThread
from runtime.serving.errors import APIError

log = logging.getLogger(__name__)
NAMESPACE = "mars-edge"  # Ray namespace of the fleet board
APP_NAME = "mars"
SYNC_S = 0.25  # how often each replica reports to the board and picks up the fleet's base tau
STALE_S = 3.0  # a replica not heard from for this long is left out of /fleet/*
_BOARD_TIMEOUT_S = 30.0
PROXY_START_S = 120.0  # longest wait for Serve's HTTP proxy to open its port after serve.run
# Serve marks a proxy unhealthy and kills it after 3 readiness checks of 5 s each; on a loaded 2-core
# machine its process takes longer than that to start, and the deployment fails. A Ray of our own
# gets this check timeout instead (an environment variable set beforehand wins).
PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_CHECK_S = 30.0
SERVE_GONE_S = 120.0  # longest wait for an earlier Serve instance to finish shutting down before serve.start
STOP_MARGIN_S = 30.0  # on Ctrl-C, the wait for Serve to stop beyond --shutdown-timeout (its controller, the proxy)


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


def make_replica_app(serve_argv: list[str], board) -> FastAPI:
    """The app of one replica: ``python -m runtime.serve``'s for ``serve_argv``, with the fleet's engine thread and
    routes, in a process whose own loggers log at its ``--log-level`` (Serve's logger gets it from the deployment's
    ``logging_config``, :func:`deploy`).

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


@dataclass(frozen=True)
class FleetOptions:
    """How many replicas and what each may take.

    Attributes:
        replicas: replicas to start with (fixed when ``max_replicas`` is None).
        max_replicas: autoscale between ``replicas`` and this many (None: no autoscaling).
        target_ongoing_requests: ongoing requests per replica the autoscaler aims at.
        max_ongoing_requests: most requests one replica holds at once (running or in its
            engine's queue); more wait in Serve's proxy.
        num_cpus: Ray CPUs reserved per replica (fractions allowed).
        upscale_delay_s: how long the load must stay above target before a replica is added
            (Serve's default, 30 s).

    A replica's graceful shutdown is not here: it is the server options' ``--shutdown-timeout``, which
    :func:`deploy` gives Serve as ``graceful_shutdown_timeout_s`` (how long a replica being stopped, on Ctrl-C, a
    redeploy or a downscale, lets its open requests run before Serve kills it).
    """

    replicas: int = 1
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    max_ongoing_requests: int = 24
    num_cpus: float = 1.0
    upscale_delay_s: float = 30.0

    def __post_init__(self):
        if self.replicas < 1 or (self.max_replicas is not None and self.max_replicas < self.replicas):
            raise ValueError(f"need --replicas >= 1 and --max-replicas >= --replicas, got {self.replicas}, "
                             f"{self.max_replicas}")
        if min(self.target_ongoing_requests, self.max_ongoing_requests) <= 0 or \
                min(self.num_cpus, self.upscale_delay_s) < 0:
            raise ValueError("need --target-ongoing-requests > 0, --max-ongoing-requests >= 1, "
                             "--num-cpus-per-replica >= 0 and --upscale-delay-s >= 0")

    def deployment_options(self) -> dict:
        """Keyword arguments of ``Deployment.options``."""
        options = {"ray_actor_options": {"num_cpus": self.num_cpus}, "max_ongoing_requests": self.max_ongoing_requests}
        if self.max_replicas is None:
            return options | {"num_replicas": self.replicas}
        return options | {"autoscaling_config": {"min_replicas": self.replicas, "max_replicas": self.max_replicas,
                                                 "target_ongoing_requests": self.target_ongoing_requests,
                                                 "upscale_delay_s": self.upscale_delay_s}}


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` now (an IPv4 or IPv6 address or name; empty: every IPv4 interface, as
    Serve's proxy binds it).

    Raises:
        ValueError: ``host`` does not resolve (:func:`runtime.serve.resolve_host`).
    """
    family = single.resolve_host(host)[0][0]
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (RFC 3986); an empty host (every IPv4 interface, where
    Serve's proxy binds it) as ``0.0.0.0``."""
    host = host or "0.0.0.0"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def start_local_ray(**options) -> None:
    """``ray.init`` a Ray of our own on this machine: loopback node address, no dashboard, the
    fleet's namespace, and a Serve proxy readiness timeout of ``PROXY_READY_CHECK_S`` (its
    processes inherit the environment; a value already set wins). ``options`` go to ``ray.init``
    (e.g. ``num_cpus``).

    Only Serve's HTTP proxy binds ``--host`` (127.0.0.1 unless told): Ray 2.60 replaces a loopback node address
    by the machine's reachable IP, its dashboard and runtime-env agents listen there and its GCS, raylet and
    worker gRPC servers on every interface (README, "Ray Serve"): firewall those ports where the network is not
    trusted."""
    os.environ.setdefault(PROXY_READY_ENV, str(PROXY_READY_CHECK_S))
    ray.init(namespace=NAMESPACE, _node_ip_address="127.0.0.1", include_dashboard=False, **options)


def wait_until_serve_is_gone(timeout_s: float = SERVE_GONE_S) -> None:
    """Return once no Serve controller is left on the connected Ray cluster.

    ``serve.shutdown()`` waits at most 30 s for the controller to stop; on a loaded machine it
    returns while the controller is still shutting down, and that controller then also stops
    the proxy of the next ``serve.start`` (its actor is killed before it runs).

    Raises:
        RuntimeError: a controller is still there after ``timeout_s`` seconds (Serve runs, or
            cannot stop); the message says to call ``serve.shutdown()`` first.
    """
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE  # Ray's own names

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:  # no actor of that name: gone
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"Ray Serve still runs on this cluster after {timeout_s:g} s: call serve.shutdown() "
                               "(and let it finish) before deploying again")
        time.sleep(0.2)


def wait_for_proxy(host: str, port: int, timeout_s: float = PROXY_START_S) -> None:
    """Return once Serve's HTTP proxy answers on ``host:port`` (a wildcard host is tried on loopback) that it is
    ready: ``GET /-/healthz`` is 200 ``success`` (:func:`is_serve_proxy`).

    ``serve.run`` returns when the replicas are up; the proxy may still be starting (after a ``serve.shutdown()``
    on a loaded machine: seconds), and a request sent then is refused. A connection alone does not say whose port
    it is: another process may listen there (here, while the proxy runs on another machine of a cluster). One
    that shares the port with SO_REUSEPORT, as Serve's proxy binds it, gets some of the connections, which no
    check from outside rules out: :func:`launch` checks the port before it starts a Ray.

    Raises:
        RuntimeError: no such answer within ``timeout_s`` seconds; the message names the address.
    """
    target = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    deadline = time.monotonic() + timeout_s
    while not is_serve_proxy(target, port):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"Serve's HTTP proxy did not answer on {target}:{port} within {timeout_s:g} s (no "
                               "answer, or another server's: is --port taken there?); see Ray's logs "
                               "(/tmp/ray/session_latest/logs)")
        time.sleep(0.1)


def is_serve_proxy(host: str, port: int) -> bool:
    """Whether ``host:port`` answers ``GET /-/healthz`` as a ready Serve proxy does: 200, ``success``."""
    connection = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        connection.request("GET", "/-/healthz")
        response = connection.getresponse()
        return response.status == 200 and response.read() == b"success"
    except (OSError, http.client.HTTPException):  # nothing listens, no answer in time, or not HTTP
        return False
    finally:
        connection.close()


@dataclass(frozen=True)
class Deployed:
    """A running deployment (keep it until :func:`stop`: the fleet board lives while this handle does).

    Attributes:
        url: the Serve proxy's base URL.
        board: the fleet board (a Ray actor handle).
        shutdown_timeout_s: each replica's graceful shutdown in Serve (the server options' ``--shutdown-timeout``),
            which :func:`stop` waits for.
    """

    url: str
    board: object
    shutdown_timeout_s: float


def deploy(serve_argv: list[str], fleet: FleetOptions) -> Deployed:
    """Start Serve's proxy and the replicas on the connected Ray cluster.

    Returns once every replica is up and the proxy answers (:func:`wait_for_proxy`). Serve must not run yet on the
    cluster (its proxy's address is set once; ``serve.shutdown()`` between two deployments). ``serve_argv`` are
    ``python -m runtime.serve`` arguments (path first); its ``--host``/``--port`` are the proxy's (port 0: a free one),
    its ``--log-level`` the level of Serve's logs (``LoggingConfig``: the controller's and proxy's through
    ``serve.start``, the replicas' through the deployment) and of each replica's own loggers
    (:func:`make_replica_app`), its ``--shutdown-timeout`` each replica's graceful shutdown in Serve
    (:attr:`Deployed.shutdown_timeout_s`, which :func:`stop` waits for).

    The port is not checked on this machine first: Serve's proxy binds it on the cluster's head node (and on each
    node of a replica), maybe another machine; a proxy that cannot bind it stops this with an error naming it
    (:func:`start_serve`). :func:`launch` checks it here before it starts a Ray of its own. Once Serve is started,
    a failure shuts it down again: no half-started deployment is left on the cluster.

    Raises:
        BundleError, ValueError: bad path, bundle or option value, or a batch the bundle cannot run
            (checked here first, not in every replica).
        RuntimeError: an earlier Serve instance did not go within ``SERVE_GONE_S`` seconds, Serve's proxy could
            not start (its port in use where it runs), or it did not answer within ``PROXY_START_S`` seconds.
    """
    args = check_serve_args(serve_argv)
    port = args.port or free_port(args.host)
    wait_until_serve_is_gone()
    logging_config = LoggingConfig(log_level=args.log_level.upper())
    try:
        start_serve(args.host, port, logging_config)
        board = run_replicas(serve_argv, args, fleet, logging_config)
        wait_for_proxy(args.host, port)
    except Exception:
        serve.shutdown()  # a proxy that cannot bind would be restarted for ever, replicas would hold their CPUs
        raise
    return Deployed(http_url(args.host, port), board, args.shutdown_timeout)


def check_serve_args(serve_argv: list[str]) -> argparse.Namespace:
    """The server options of ``serve_argv``, checked here once rather than in every replica: ``--host`` resolves
    (not a proxy retrying it), the bundle loads and takes the batch.

    Raises:
        BundleError, ValueError: bad path, bundle, option value or batch.
    """
    from runtime.backends.loading import load_backend  # here: without onnxruntime, main prints one error line
    from runtime.decode.engine import check_max_batch_size
    args = single.parse_args(serve_argv)
    single.resolve_host(args.host)
    backend, _, _ = load_backend(args.path, args.provider, 1)
    check_max_batch_size(single.resolve_max_batch_size(args.max_batch_size, backend.max_batch), backend.max_batch)
    return args


def start_serve(host: str, port: int, logging_config: LoggingConfig) -> None:
    """``serve.start`` with its HTTP proxy on ``host:port``; Serve waits for the proxies it starts with (the head
    node's), which bind the port with SO_REUSEPORT.

    Raises:
        RuntimeError: a proxy could not start, most often as its port is in use where it runs (not by a listener
            with SO_REUSEPORT too: that one shares it); the message names the address, the proxy's error and
            ``--port``, instead of Ray's remote traceback.
    """
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config=logging_config)
    except ray.exceptions.RayTaskError as e:  # the proxy's readiness check raised
        raise RuntimeError(f"Serve's HTTP proxy did not start on {host} port {port} ({e.cause}): if the port is in "
                           "use where the proxy runs, stop what listens there, or choose another --port (--port 0 "
                           "picks a free one)") from None


def run_replicas(serve_argv: list[str], args: argparse.Namespace, fleet: FleetOptions,
                 logging_config: LoggingConfig):
    """Create a fleet board and run the replicas (``serve.run``, once every replica is up); returns the board."""
    board_name = f"{APP_NAME}-fleet-board-{uuid.uuid4().hex[:12]}"  # new for each deployment: no stale reports
    board = ray.remote(num_cpus=0)(FleetBoard).options(name=board_name, namespace=NAMESPACE).remote()
    deployment = serve.deployment(MarsReplica).options(name="MarsReplica", logging_config=logging_config,
                                                       graceful_shutdown_timeout_s=args.shutdown_timeout,
                                                       **fleet.deployment_options())
    serve.run(deployment.bind(replica_argv(serve_argv, args.api_key), board_name), name=APP_NAME, route_prefix="/")
    return board


def launch(serve_argv: list[str], fleet: FleetOptions, address: str | None = None, **ray_options) -> Deployed:
    """Connect Ray and :func:`deploy`: join the cluster at ``address``, or start a Ray of our own here
    (:func:`start_local_ray`; ``ray_options`` go to ``ray.init`` either way). For a Ray of our own, Serve's proxy
    binds ``--host``/``--port`` on this machine: they are checked first, by the plain server's rule
    (:func:`runtime.serve.check_can_listen`), so a port in use stops this before Ray starts, also one that another
    listener holds with SO_REUSEPORT (Serve's proxy would share it). With ``address`` the proxy may bind on
    another machine: :func:`deploy` names a port it cannot bind. Ray is shut down (for a cluster: left) when
    :func:`deploy` fails; :func:`stop` ends a deployment that started.

    Raises:
        runtime.serve.CannotListen: (without ``address``) the port is in use here, or cannot be bound; nothing
            started.
        BundleError, ValueError, RuntimeError: as :func:`deploy`.
    """
    if address:
        ray.init(address=address, namespace=NAMESPACE, **ray_options)
    else:
        args = single.parse_args(serve_argv)
        single.check_can_listen(args.host, args.port)
        start_local_ray(**ray_options)
    try:
        return deploy(serve_argv, fleet)
    except Exception:
        ray.shutdown()
        raise


def stop(deployed: Deployed) -> None:
    """Stop Serve, giving the replicas of ``deployed`` their graceful shutdown (``deployed.shutdown_timeout_s``, the
    ``--shutdown-timeout`` that :func:`deploy` gave them) to finish their requests, then Ray.

    ``serve.shutdown()`` waits at most 30 s for Serve's controller (Ray's own cap; it takes no timeout). The
    controller goes on stopping the replicas after that, each within its ``graceful_shutdown_timeout_s``, and exits
    once everything is gone, whereas ``ray.shutdown()`` of a Ray of our own kills whatever still runs. So the
    controller gets ``shutdown_timeout_s`` plus :data:`STOP_MARGIN_S`, counted from this call (``serve.shutdown()``'s
    own wait included), to be gone before Ray is shut down; past that one ``warning:`` line says Ray is shut down
    regardless.
    """
    shutdown_timeout_s = deployed.shutdown_timeout_s
    deadline = time.monotonic() + shutdown_timeout_s + STOP_MARGIN_S
    serve.shutdown()
    try:
        wait_until_serve_is_gone(max(deadline - time.monotonic(), 0.0))
    except RuntimeError:
        print(f"warning: Ray Serve did not stop within --shutdown-timeout {shutdown_timeout_s:g} s + "
              f"{STOP_MARGIN_S:g} s; shutting Ray down", file=sys.stderr, flush=True)
    ray.shutdown()


def replica_argv(serve_argv: list[str], api_key: str | None) -> list[str]:
    """The ``python -m runtime.serve`` arguments each replica parses, with ``api_key`` (the key resolved here from
    ``--api-key`` or ``$MARS_API_KEY``) given explicitly: a replica parses them in its own process, whose
    environment lacks this one's ``$MARS_API_KEY`` on a cluster started elsewhere (``--address``), and would
    serve without authentication. Without a key here the arguments stay as they are."""
    return [*serve_argv, f"--api-key={api_key}"] if api_key else list(serve_argv)  # "=": a key may start with "-"


def make_parser() -> argparse.ArgumentParser:
    """The parser of the Ray options (the rest go to ``python -m runtime.serve``'s)."""
    p = argparse.ArgumentParser(prog="python -m runtime.serve_ray", description=__doc__.splitlines()[0],
                                epilog="Every option of `python -m runtime.serve` also applies, to each replica "
                                       "(--host and --port to Serve's proxy; --shutdown-timeout is how long Serve "
                                       "lets a stopping replica finish its requests, and on Ctrl-C this command "
                                       f"waits that long plus {STOP_MARGIN_S:g} s for Serve to stop; --log-level "
                                       "is also Serve's, for its replicas, controller and proxy).")
    p.add_argument("--replicas", type=int, default=1, help="replicas (the minimum with --max-replicas; default 1)")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas")
    p.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling target per replica (default: --max-batch-size)")
    p.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="most requests a replica holds (default: --max-batch-size + --queue-high, so the load "
                        "policy sees its whole range)")
    p.add_argument("--upscale-delay-s", type=float, default=30.0,
                   help="seconds above target before the autoscaler adds a replica (default 30)")
    p.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="Ray CPUs per replica (default 1)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start one on this machine)")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The Ray options, and the rest (``python -m runtime.serve`` arguments)."""
    return make_parser().parse_known_args(argv)


def fleet_options(ray_args: argparse.Namespace, args: argparse.Namespace) -> FleetOptions:
    """Ray's options from both command lines; the request targets default to the replicas' batch
    (``--max-batch-size``, else the server's default, before any engine is loaded)."""
    batch = single.resolve_max_batch_size(args.max_batch_size)
    return FleetOptions(ray_args.replicas, ray_args.max_replicas,
                        ray_args.target_ongoing_requests or batch,
                        ray_args.max_ongoing_requests or batch + args.queue_high,
                        ray_args.num_cpus_per_replica, ray_args.upscale_delay_s)


def main(argv: list[str] | None = None) -> int:
    """Run the deployment until SIGTERM or Ctrl-C; 2 (after one ``error:`` line) for a bad option or bundle,
    3 (:data:`runtime.serve.STARTUP_FAILURE`, as ``python -m runtime.serve``) after one ``error:`` line for a
    ``--port`` in use, checked before Ray starts by the plain server's rule (only for a Ray of our own: with
    ``--address`` Serve's proxy may bind on another machine of the cluster)."""
    ray_args, serve_argv = parse_args(argv)
    try:
        fleet = prepare_fleet(ray_args, serve_argv)
        deployed = launch(serve_argv, fleet, ray_args.address)
    except single.CannotListen as e:  # a Ray of our own: --port in use here, found before Ray starts
        return print_error(e, single.STARTUP_FAILURE)
    except (single.BundleError, ValueError, RuntimeError, OnnxRuntimeMissing) as e:  # RuntimeError: Serve did not start
        return print_error(e, 2)
    print_running(deployed, fleet)
    wait_for_stop_signal()
    stop(deployed)
    return 0


def prepare_fleet(ray_args: argparse.Namespace, serve_argv: list[str]) -> FleetOptions:
    """The fleet's options, once every option is checked and onnxruntime imports: all before Ray starts.

    Raises:
        ValueError: a bad option value (each replica builds the server settings again; a bad one stops here).
        OnnxRuntimeMissing: installed without the [cpu] or [gpu] extra.
    """
    serve_args = single.parse_args(serve_argv)
    single.server_settings(serve_args)
    single.resolve_host(serve_args.host)
    fleet = fleet_options(ray_args, serve_args)
    import_onnxruntime()
    return fleet


def print_error(error: Exception, status: int) -> int:
    """Print ``error`` as one ``error:`` line on stderr; returns the exit ``status``."""
    print(f"error: {error}", file=sys.stderr)
    return status


def print_running(deployed: Deployed, fleet: FleetOptions) -> None:
    """The line saying where the deployment runs, with how many replicas."""
    count = fleet.replicas if fleet.max_replicas is None else f"{fleet.replicas} to {fleet.max_replicas}"
    print(f"mars-edge on Ray Serve running on {deployed.url} (replicas: {count}); Ctrl-C stops it", flush=True)


def wait_for_stop_signal() -> None:
    """Return at the first SIGINT (Ctrl-C) or SIGTERM; then both are back to their default, so a second one while
    Serve drains ends the command at once."""
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    stopping.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())

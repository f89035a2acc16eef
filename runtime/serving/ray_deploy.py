"""A deployment of the replicas on a connected Ray cluster (``python -m runtime.serve_ray``): the fleet's
options, :func:`deploy` (check the server options, start Serve's proxy, the fleet board and the replicas, wait for
the proxy) and the :class:`Deployed` handle it returns.
"""

from __future__ import annotations

import argparse
import math
import time
import uuid
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.schema import LoggingConfig

from runtime import serve as single
from runtime.command_line import ENGINE_FLAGS, naming_options
from runtime.serving.ray_board import NAMESPACE, FleetBoard
from runtime.serving.ray_proxy import free_port, head_node_ip, http_url, start_serve, wait_for_proxy
from runtime.serving.ray_replica import MarsReplica

APP_NAME = "mars"
SERVE_GONE_S = 120.0  # longest wait for an earlier Serve instance to finish shutting down before serve.start


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
        if not (math.isfinite(self.target_ongoing_requests) and self.target_ongoing_requests > 0) or \
                self.max_ongoing_requests < 1 or not all(math.isfinite(v) and v >= 0
                                                         for v in (self.num_cpus, self.upscale_delay_s)):
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


@dataclass(frozen=True)
class Deployed:
    """A running deployment (keep it until :func:`~runtime.serving.ray_launch.stop`: the fleet board lives while
    this handle does).

    Attributes:
        url: the Serve proxy's base URL.
        board: the fleet board (a Ray actor handle).
        shutdown_timeout_s: each replica's graceful shutdown in Serve (the server options' ``--shutdown-timeout``),
            which :func:`~runtime.serving.ray_launch.stop` waits for.
    """

    url: str
    board: object
    shutdown_timeout_s: float


def deploy(serve_argv: list[str], fleet: FleetOptions) -> Deployed:
    """Start Serve's proxy and the replicas on the connected Ray cluster.

    Returns once every replica is up and the proxy answers (:func:`wait_for_proxy`; a loopback ``--host`` on a head
    node elsewhere cannot be asked from here, and one ``warning:`` line says so). Serve must not run yet on the
    cluster (its proxy's address is set once; ``serve.shutdown()`` between two deployments). ``serve_argv`` are
    ``python -m runtime.serve`` arguments (path first); its ``--host``/``--port`` are the proxy's (port 0: a free one),
    its ``--log-level`` the level of Serve's logs (``LoggingConfig``: the controller's and proxy's through
    ``serve.start``, the replicas' through the deployment) and of each replica's own loggers
    (:func:`~runtime.serving.ray_replica.make_replica_app`), its ``--shutdown-timeout`` each replica's graceful
    shutdown in Serve (:attr:`Deployed.shutdown_timeout_s`, which :func:`~runtime.serving.ray_launch.stop` waits
    for).

    The port is not checked on this machine first: Serve's proxy binds it on the cluster's head node (and on each
    node of a replica), maybe another machine; a proxy that cannot bind it stops this with an error naming it
    (:func:`start_serve`). :func:`~runtime.serving.ray_launch.launch` checks it here before it starts a Ray of its
    own. Once Serve is started, a failure shuts it down again: no half-started deployment is left on the cluster.

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
        wait_for_proxy(args.host, port, head_node_ip())
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
    from runtime.decode.admission import check_max_batch_size
    args = single.parse_args(serve_argv)
    single.resolve_host(args.host)
    backend, _, _ = load_backend(args.path, args.provider, 1)
    with naming_options(ENGINE_FLAGS):  # as python -m runtime.serve names them
        check_max_batch_size(single.resolve_max_batch_size(args.max_batch_size, backend.max_batch), backend.max_batch)
    return args


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


def replica_argv(serve_argv: list[str], api_key: str | None) -> list[str]:
    """The ``python -m runtime.serve`` arguments each replica parses, with ``api_key`` (the key resolved here from
    ``--api-key`` or ``$MARS_API_KEY``) given explicitly: a replica parses them in its own process, whose
    environment lacks this one's ``$MARS_API_KEY`` on a cluster started elsewhere (``--address``), and would
    serve without authentication. Without a key here the arguments stay as they are."""
    return [*serve_argv, f"--api-key={api_key}"] if api_key else list(serve_argv)  # "=": a key may start with "-"


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

"""Ray around a deployment (``python -m runtime.serve_ray``): :func:`launch` joins a cluster or starts a Ray of
our own, then deploys; :func:`stop` gives the replicas their graceful shutdown, waits for Serve to be gone, then
shuts Ray down.
"""

from __future__ import annotations

import os
import sys
import time

import ray
from ray import serve

from runtime import serve as single
from runtime.serving.ray_board import NAMESPACE
from runtime.serving.ray_deploy import Deployed, FleetOptions, deploy, wait_until_serve_is_gone

# Serve marks a proxy unhealthy and kills it after 3 readiness checks of 5 s each; on a loaded 2-core
# machine its process takes longer than that to start, and the deployment fails. A Ray of our own
# gets this check timeout instead (an environment variable set beforehand wins).
PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_CHECK_S = 30.0
STOP_MARGIN_S = 30.0  # on Ctrl-C, the wait for Serve to stop beyond --shutdown-timeout (its controller, the proxy)


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

"""Serve a MARS bundle with Ray Serve replicas: ``python -m runtime.serve_ray PATH --replicas N [options]``.

Each replica is one Ray Serve replica that owns one :class:`~runtime.decode.engine.Engine` (its
own batch, KV cache, load policy and live tau) behind the FastAPI app of
``python -m runtime.serve``, mounted as the Serve ingress: the same OpenAI routes, streamed
or not, ``/health``, ``/metrics`` and ``/admin/tau``. Serve's proxy routes each request to a
replica by its ongoing requests, and with ``--max-replicas`` Serve's autoscaler adds and
removes replicas to keep about ``--target-ongoing-requests`` per replica.

The replicas share one small Ray actor, the *fleet board*: ``POST /admin/tau`` on any
replica sets that replica's base tau and publishes it there, and every replica applies the
newest published base tau within :data:`~runtime.serving.ray_replica.SYNC_S` (a replica that
Ray restarts applies it as it starts). Each replica reports its load and its Prometheus metrics
to the board, served by two routes that exist only here: ``GET /fleet/replicas`` (per replica:
pid, queue depth, slots, base and default tau) and ``GET /fleet/metrics`` (every replica's
metrics, labelled ``replica="ID"``). Needs the ``serve-ray`` extra. Options after the Ray ones
are those of ``python -m runtime.serve`` (``--host``/``--port`` are the Serve proxy's, binding
127.0.0.1 unless told; ``--shutdown-timeout`` is each replica's graceful shutdown in Serve, and
on Ctrl-C this command waits that long, plus :data:`~runtime.serving.ray_launch.STOP_MARGIN_S`,
for Serve to stop; ``--log-level`` is Serve's level for its replicas, controller and proxy, and
the level of each replica's own loggers).

The parts live in ``runtime/serving/ray_*.py``: the fleet board (:mod:`~runtime.serving.ray_board`), one
replica (:mod:`~runtime.serving.ray_replica`), Serve's proxy (:mod:`~runtime.serving.ray_proxy`), a deployment
on a connected Ray (:mod:`~runtime.serving.ray_deploy`) and Ray around it (:mod:`~runtime.serving.ray_launch`:
:func:`~runtime.serving.ray_launch.launch` and :func:`~runtime.serving.ray_launch.stop`, for Python callers too).
This module is the command.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading

from runtime import serve as single
from runtime.backends.providers import OnnxRuntimeMissing, import_onnxruntime
from runtime.command_line import ENGINE_FLAGS, ArgumentParser, naming_options
from runtime.decode.engine import EngineConfig
from runtime.serving import kv_memory
from runtime.serving.ray_deploy import Deployed, FleetOptions
from runtime.serving.ray_launch import STOP_MARGIN_S, launch, stop


def positive_number(text: str) -> float:
    """``type=`` of ``--target-ongoing-requests``: a finite number > 0, or argparse's refusal (one ``error:`` line,
    exit status 2); ``nan`` and ``inf`` reached Ray's autoscaler, and 0 became the default."""
    value = _finite_number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_number(text: str) -> float:
    """``type=`` of ``--upscale-delay-s`` and ``--num-cpus-per-replica``: a finite number >= 0, or argparse's
    refusal (``nan`` and ``inf`` reached Ray)."""
    value = _finite_number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _finite_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_int(text: str) -> int:
    """``type=`` of ``--max-ongoing-requests``: an integer >= 1, or argparse's refusal (0 became the default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def make_parser() -> ArgumentParser:
    """The parser of the Ray options (the rest go to ``python -m runtime.serve``'s)."""
    p = ArgumentParser(prog="python -m runtime.serve_ray", description=__doc__.splitlines()[0],
                       epilog="Every option of `python -m runtime.serve` also applies, to each replica "
                              "(--host and --port to Serve's proxy; --shutdown-timeout is how long Serve "
                              "lets a stopping replica finish its requests, and on Ctrl-C this command "
                              f"waits that long plus {STOP_MARGIN_S:g} s for Serve to stop; --log-level "
                              "is also Serve's, for its replicas, controller and proxy).")
    p.add_argument("--replicas", type=int, default=1, help="replicas (the minimum with --max-replicas; default 1)")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas")
    p.add_argument("--target-ongoing-requests", type=positive_number, default=None,
                   help="autoscaling target per replica (default: a replica's batch, --max-batch-size or its "
                        "default, 1 for a fused bundle)")
    p.add_argument("--max-ongoing-requests", type=positive_int, default=None,
                   help="most requests a replica holds (default: --max-batch-size + --queue-high, so the load "
                        "policy sees its whole range)")
    p.add_argument("--upscale-delay-s", type=non_negative_number, default=30.0,
                   help="seconds above target before the autoscaler adds a replica (default 30)")
    p.add_argument("--num-cpus-per-replica", type=non_negative_number, default=1.0,
                   help="Ray CPUs per replica (default 1)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start one on this machine)")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The Ray options, and the rest (``python -m runtime.serve`` arguments)."""
    return make_parser().parse_known_args(argv)


def fleet_options(ray_args: argparse.Namespace, args: argparse.Namespace, batch: int) -> FleetOptions:
    """Ray's options from both command lines; the request targets default to ``batch``, the batch each replica runs
    (:func:`check_engine_settings`) where not given (``None``; a value given is FleetOptions' to check)."""
    target, most = ray_args.target_ongoing_requests, ray_args.max_ongoing_requests
    return FleetOptions(ray_args.replicas, ray_args.max_replicas,
                        batch if target is None else target,
                        batch + args.queue_high if most is None else most,
                        ray_args.num_cpus_per_replica, ray_args.upscale_delay_s)


def main(argv: list[str] | None = None) -> int:
    """Run the deployment until SIGTERM or Ctrl-C; 2 (after one ``error:`` line) for a bad option or bundle,
    3 (:data:`runtime.serve.STARTUP_FAILURE`, as ``python -m runtime.serve``) after one ``error:`` line for a
    ``--port`` in use, checked before Ray starts by the plain server's rule (only for a Ray of our own: with
    ``--address`` Serve's proxy may bind on another machine of the cluster)."""
    try:
        ray_args, serve_argv = parse_args(argv)  # argparse's refusals: UsageError, a ValueError
        fleet = prepare_fleet(ray_args, serve_argv, is_local=ray_args.address is None)
        deployed = launch(serve_argv, fleet, ray_args.address)
    except single.CannotListen as e:  # a Ray of our own: --port in use here, found before Ray starts
        return print_error(e, single.STARTUP_FAILURE)
    except (single.BundleError, ValueError, RuntimeError, OnnxRuntimeMissing) as e:  # RuntimeError: Serve did not start
        return print_error(e, 2)
    print_running(deployed, fleet)
    wait_for_stop_signal()
    stop(deployed)
    return 0


def prepare_fleet(ray_args: argparse.Namespace, serve_argv: list[str], is_local: bool) -> FleetOptions:
    """The fleet's options, once every option is checked and onnxruntime imports: all before Ray starts.

    Args:
        is_local: the replicas run on this machine (a Ray of our own): their KV cache is checked against its memory.

    Raises:
        BundleError: the path is no bundle.
        ValueError: a bad option value (each replica builds the server settings again; a bad one stops here).
        OnnxRuntimeMissing: installed without the [cpu] or [gpu] extra.
    """
    serve_args = single.parse_args(serve_argv)
    single.server_settings(serve_args)
    single.resolve_host(serve_args.host)
    import_onnxruntime()
    return fleet_options(ray_args, serve_args, check_engine_settings(serve_args, is_local))


def check_engine_settings(args: argparse.Namespace, is_local: bool) -> int:
    """The engine options against the bundle's ``mars_config.json`` alone, with no session (each replica checks
    them again once its backend loads, as ``python -m runtime.serve`` does), so that a bad one is one error line
    here, not every replica's traceback once Ray has started: ``--max-batch-size`` and ``--max-seq-len`` against
    the model's limits (a TensorRT engine's profile is read as a replica loads it), and, where the replicas run on
    this machine on onnxruntime, one replica's KV cache against this machine's free memory (a TensorRT engine's
    lives in GPU memory, checked as a replica loads it).

    Returns:
        The batch each replica runs, as the server resolves it: ``--max-batch-size``, else the default within the
        bundle's largest batch (1 for a fused bundle; a TensorRT engine's profile is not read here).

    Raises:
        BundleError: the path is no bundle.
        ValueError: a setting out of range, or a KV cache past the memory, naming the options (as the server).
    """
    from runtime.backends.loading import locate_bundle  # here: they import onnxruntime
    from runtime.backends.onnx import onnx_limits

    config, _, plan = locate_bundle(args.path)
    max_batch, max_past = (None, config.max_context) if plan else onnx_limits(config)
    available = kv_memory.host_memory_available() if is_local and plan is None else None
    batch = single.resolve_max_batch_size(args.max_batch_size, max_batch)
    with naming_options(ENGINE_FLAGS):
        kv_memory.check_engine_fits(config, EngineConfig(batch, args.scheme, args.max_seq_len), max_batch, max_past,
                                    1, available)
    return batch


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

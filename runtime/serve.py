"""Serve a MARS bundle over HTTP: ``python -m runtime.serve PATH [options]``.

OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (streamed or not), with
per-request ``tau`` and ``mode``; ``/health``; ``/metrics`` (Prometheus); ``/admin/tau`` to
set the default tau live; a browser playground at ``/`` (unless ``--no-ui``); and a load
policy that lowers the default tau as the queue grows (down to ``--tau-min``) and restores
it as the queue drains. PATH is a bundle directory, its ONNX file, or the ``engine.plan``
inside it. Binds 127.0.0.1 unless told.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from pathlib import Path

from fastapi import FastAPI

from runtime.backends.providers import PROVIDERS, OnnxRuntimeMissing
from runtime.bundle import BundleError
from runtime.command_line import (ENGINE_FLAGS, ArgumentParser, make_engine_int_value, naming_options, tau_value,
                                  threads_value)
from runtime.decode.engine import EngineConfig
from runtime.decode.scheduler import SCHEMES
from runtime.serving.app import ServerContext, ServerLimits, check_limits_fit, make_app
from runtime.serving.engine_thread import EngineThread
from runtime.serving.kv_memory import make_engine
from runtime.serving.load_policy import LoadPolicy
from runtime.serving.metrics import ServerMetrics
from runtime.serving.playground import install_playground
from runtime.serving.shutdown import Server
from runtime.text.tokenizer import Tokenizer

API_KEY_ENV = "MARS_API_KEY"
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_TOKENS = 256  # max_tokens of a request that sets none, unless --max-tokens-limit is lower
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0  # on SIGTERM / Ctrl-C, how long open requests may still run before they are aborted
STARTUP_FAILURE = 3  # uvicorn's exit status when the server cannot start (uvicorn.config.STARTUP_FAILURE, 0.31+)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options.

    Raises:
        UsageError: a malformed command line (a ValueError: :func:`main` prints it as one ``error:`` line).
        ValueError: an API key of whitespace only (:func:`resolve_api_key`).
    """
    p = ArgumentParser(prog="python -m runtime.serve", description=__doc__.splitlines()[0])
    p.add_argument("path", help="bundle directory, its .onnx file, or its engine.plan")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port, 1..65535 (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1 and /admin (default: ${API_KEY_ENV}, else none; "
                        "an empty key is none, one of whitespace only is refused)")
    p.add_argument("--model-name", default=None, help="model id in responses (default: the bundle's folder name)")
    p.add_argument("--no-ui", action="store_true", help="do not serve the browser playground at /")
    g = p.add_argument_group("engine")
    g.add_argument("--max-batch-size", type=make_engine_int_value("max_batch_size"), default=None,
                   help=f"KV slots: most sequences decoding at once (default {DEFAULT_MAX_BATCH}, or the backend's "
                        "largest batch when smaller: a TensorRT engine's, a fused bundle's 1). One long request grows "
                        "every slot to its length, so start-up refuses slots x --max-seq-len whose KV cache cannot fit "
                        "the free memory (RAM; a TensorRT engine's GPU), naming the largest values that fit 95%% of it")
    g.add_argument("--scheme", default="continuous", choices=SCHEMES,
                   help="batch scheme (default continuous; block runs every step W wide, so it refuses requests for "
                        "adaptive masks)")
    g.add_argument("--max-seq-len", type=make_engine_int_value("max_seq_len"), default=None,
                   help="tokens per slot (default: the model's context, or a TensorRT engine's profile; at least the "
                        "bundle's window + 2: a 1-token prompt, 1 token to generate and a decode step); checked "
                        "with --max-batch-size against the free memory at start-up")
    g.add_argument("--provider", default="cpu", choices=sorted(PROVIDERS), help="onnxruntime execution provider")
    g.add_argument("--threads", type=threads_value, default=0, help="onnxruntime intra-op threads (0: its choice)")
    g = p.add_argument_group("tau and the load policy")
    g.add_argument("--tau", type=_tau, default=1.0,
                   help="base default tau for requests without tau, 0..1 (default 1.0)")
    g.add_argument("--tau-min", type=_tau, default=None,
                   help="lowest default tau the load policy sets under load, and the lowest base tau /admin/tau "
                        "accepts, 0..--tau (default: --tau, i.e. policy off)")
    g.add_argument("--tau-max", type=_tau, default=None, help="highest base tau /admin/tau accepts, --tau..1 "
                                                              "(default 1.0)")
    g.add_argument("--queue-low", type=int, default=0, help="waiting requests at or below which the default tau "
                                                            "is the base tau (default 0)")
    g.add_argument("--queue-high", type=int, default=16, help="waiting requests at or above which the default tau "
                                                              "is --tau-min (default 16)")
    g = p.add_argument_group("limits")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: context allows)")
    g.add_argument("--max-tokens-limit", type=int, default=2048, help="largest max_tokens accepted (default 2048)")
    g.add_argument("--default-max-tokens", type=int, default=None,
                   help=f"max_tokens when a request sets none (default {DEFAULT_MAX_TOKENS}, or --max-tokens-limit "
                        "when lower)")
    p.add_argument("--shutdown-timeout", type=_non_negative_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM or Ctrl-C, seconds open requests may still run before they are aborted (a 503, "
                        "or an error event ending a stream) and the server exits (default "
                        f"{DEFAULT_SHUTDOWN_TIMEOUT_S:g}; 0: abort them at once)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = p.parse_args(argv)
    args.api_key = resolve_api_key(args.api_key)
    return args


def resolve_api_key(key: str | None) -> str | None:
    """The API key to require: None for none (unset, or empty as ``MARS_API_KEY=``), else the key
    without surrounding whitespace.

    Raises:
        ValueError: a key of whitespace only (no client could send it, and taking it as none would
            turn authentication off unseen); the message names both ways to set it.
    """
    if key and not key.strip():
        raise ValueError(f"the API key (--api-key or ${API_KEY_ENV}) is whitespace only: set a key, or leave it "
                         "empty or unset to serve without one")
    return (key or "").strip() or None


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit() and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"must be a port number in 1..65535 (0 picks a free one), got {text}")
    return int(text)


def _tau(text: str) -> float:
    try:
        tau = tau_value(text)  # the one rule on tau: a finite number >= 0
    except argparse.ArgumentTypeError:
        tau = None
    if tau is None or tau > 1:
        raise argparse.ArgumentTypeError(f"must be a number in 0..1 (tau 1 is greedy AR, one token per step; a larger "
                                         f"tau decodes the same), got {text if text.strip() else repr(text)}")
    return tau


def _non_negative_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return seconds


def make_server(app: FastAPI, args: argparse.Namespace) -> Server:
    """uvicorn's server of ``app`` for the options (the one place they are mapped)."""
    return Server(app, args.shutdown_timeout, host=args.host, port=args.port, log_level=args.log_level)


class CannotListen(Exception):
    """``--host``/``--port`` cannot be bound now (:func:`check_can_listen`); the message names the option."""


def resolve_host(host: str, port: int = 0) -> list[tuple]:
    """The addresses to bind for ``--host``/``--port``, each once: ``getaddrinfo`` entries (family, type, proto,
    canonical name, address), passive as uvicorn binds them (an empty host is every interface). The one check of
    ``--host``, also for ``python -m runtime.serve_ray`` before Ray starts (Serve's proxy would retry a host that
    does not resolve for minutes).

    Raises:
        ValueError: ``host`` does not resolve (the message names ``--host`` and what to pass).
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve ({e.strerror}): pass an IP address or a name of this "
                         "machine, e.g. --host 127.0.0.1") from None
    return list(dict.fromkeys(infos))


def check_can_listen(host: str, port: int) -> None:
    """Bind a TCP socket to each address of ``host:port``, as uvicorn will (SO_REUSEADDR on POSIX, IPv6 sockets
    IPv6 only, as asyncio's ``create_server``), and close it: a port in use is found before the model loads, not
    after. uvicorn binds again later; a port taken in between still fails there, with its own error line.

    Raises:
        ValueError: ``host`` does not resolve (:func:`resolve_host`).
        CannotListen: ``port`` is in use, or the address cannot be bound (the message names the address and
            ``--port``).
    """
    infos = resolve_host(host, port)
    if port == 0:  # uvicorn picks a free one
        return
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            if os.name == "posix":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise CannotListen(f"port {port} on {host} is in use: stop what listens there, or choose another "
                                       "--port (--port 0 picks a free one)") from None
                raise CannotListen(f"cannot listen on {host} port {port} ({e.strerror}): check --host and "
                                   "--port") from None


def configure_logging(log_level: str) -> None:
    """``--log-level`` for this process's Python loggers (ours, and libraries' without a level of their own): the
    root logger's level, and a stderr handler where the root has none yet (a Ray replica's may have one)."""
    logging.basicConfig()
    logging.getLogger().setLevel(log_level.upper())


def resolve_max_batch_size(requested: int | None, backend_limit: int | None = None) -> int:
    """The server's KV slots: ``--max-batch-size`` when given, else :data:`DEFAULT_MAX_BATCH`
    within the backend's largest batch (a TensorRT engine's profile; None: no limit)."""
    if requested is not None:
        return requested
    return min(DEFAULT_MAX_BATCH, backend_limit or DEFAULT_MAX_BATCH)


def server_settings(args: argparse.Namespace) -> tuple[LoadPolicy, ServerLimits]:
    """The load policy and HTTP limits the options ask for, checked (before any bundle or Ray starts).

    Raises:
        ValueError: an option value out of range, or two that contradict each other (the message
            names the options).
    """
    tau_min, tau_max = tau_range(args)
    policy = LoadPolicy(tau_min=tau_min, tau_max=tau_max, queue_low=args.queue_low, queue_high=args.queue_high)
    default_max_tokens = args.default_max_tokens
    if default_max_tokens is None:
        default_max_tokens = min(DEFAULT_MAX_TOKENS, args.max_tokens_limit)
    return policy, ServerLimits(args.max_body_bytes, args.max_prompt_tokens, args.max_tokens_limit, default_max_tokens)


def tau_range(args: argparse.Namespace) -> tuple[float, float]:
    """The base taus ``/admin/tau`` accepts, ``(--tau-min, --tau-max)``, defaults applied (--tau, 1.0).

    Raises:
        ValueError: ``--tau`` below ``--tau-min`` or above ``--tau-max`` (the message names the options and their
            values; each is in 0..1 already, by :func:`parse_args`).
    """
    tau_min = args.tau if args.tau_min is None else args.tau_min
    tau_max = 1.0 if args.tau_max is None else args.tau_max
    need = "need --tau-min <= --tau <= --tau-max (the base taus /admin/tau accepts)"
    if args.tau < tau_min:
        raise ValueError(f"--tau {args.tau:g} is below --tau-min {tau_min:g}: {need}")
    if args.tau > tau_max:
        raise ValueError(f"--tau {args.tau:g} is above --tau-max {tau_max:g}: {need}")
    return tau_min, tau_max


def build_app(args: argparse.Namespace, make_thread=EngineThread) -> FastAPI:
    """Load the bundle and build the app (the engine thread starts with the app's lifespan).

    ``make_thread`` builds the engine thread from ``(engine, policy, metrics, base_tau)``:
    :class:`EngineThread`, or a subclass such as the Ray replicas' (runtime/serving/ray_replica.py).

    Raises:
        BundleError, ValueError: bad path, bundle, or option value (the message says which); a KV cache whose
            worst case does not fit the memory available (:func:`runtime.serving.kv_memory.make_engine`).
        OnnxRuntimeMissing: installed without the [cpu] or [gpu] extra.
    """
    from runtime.backends.loading import load_backend  # here: without onnxruntime, one error line
    policy, limits = server_settings(args)
    with naming_options(ENGINE_FLAGS):
        backend, config, bundle_dir = load_backend(args.path, args.provider, args.threads)
        # The limits come from the engine: a setting past its profile is refused (Engine), the default fits it.
        max_batch_size = resolve_max_batch_size(args.max_batch_size, backend.max_batch)
        engine = make_engine(backend, config, EngineConfig(max_batch_size, args.scheme, args.max_seq_len))  # KV fits
    check_limits_fit(limits, engine)
    metrics = ServerMetrics(max_batch_size)
    ctx = ServerContext(engine_thread=make_thread(engine, policy, metrics, args.tau), tokenizer=Tokenizer(bundle_dir),
                        metrics=metrics, model_name=args.model_name or Path(bundle_dir).resolve().name,
                        limits=limits, api_key=args.api_key)
    app = make_app(ctx)
    if not args.no_ui:
        install_playground(app)
    return app


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGTERM or Ctrl-C; 2 (after one ``error:`` line) for a bad option or
    bundle, 3 (uvicorn's code) if it cannot start serving: after one ``error:`` line for a port in use
    (checked before the bundle loads), after uvicorn's own for one taken while it loaded."""
    try:
        args = parse_args(argv)
        server_settings(args)  # a bad option before the port, and both before the bundle loads (build_app)
        check_can_listen(args.host, args.port)
        app = build_app(args)
    except CannotListen as e:
        print(f"error: {e}", file=sys.stderr)
        return STARTUP_FAILURE
    except (BundleError, ValueError, OnnxRuntimeMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    server = make_server(app, args)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it handled again once it has stopped
        pass
    return 0 if server.started else STARTUP_FAILURE


if __name__ == "__main__":
    sys.exit(main())

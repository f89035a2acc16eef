"""Serve's HTTP proxy as the deploying machine sees it (``python -m runtime.serve_ray``): its address (a free
port, the URL), its start (``serve.start``, naming a port it cannot bind), where it runs (the head node) and its
readiness (``GET /-/healthz``, asked where this machine reaches it).
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import sys
import time

import ray
from ray import serve
from ray.serve.schema import LoggingConfig

from runtime import serve as single

PROXY_START_S = 120.0  # longest wait for Serve's HTTP proxy to open its port after serve.run
WILDCARD_LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}  # a wildcard host, asked on its machine


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


def head_node_ip() -> str:
    """The address of the connected Ray cluster's head node, as Ray reports it (``ray.nodes()``): Serve's controller
    runs there, and always one of its HTTP proxies, the one :func:`wait_for_proxy` asks (a cluster joined with
    ``--address``: maybe another machine)."""
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME  # Ray's own name

    [ip] = [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"] and
            HEAD_NODE_RESOURCE_NAME in node["Resources"]]
    return ip


def readiness_address(host: str, head_ip: str) -> str | None:
    """Where this machine asks Serve's proxy, bound to ``host`` on the head node at ``head_ip``, whether it is
    ready; None where it cannot.

    The head on this machine (a Ray of our own, or a cluster started here): a wildcard host is asked on loopback,
    any other as it is. The head on another machine: a wildcard host is asked at ``head_ip``; a loopback host is
    that machine's loopback, which nothing here reaches (None); any other host as it is.
    """
    is_here = is_this_machine(head_ip)
    if host in WILDCARD_LOOPBACK:
        return WILDCARD_LOOPBACK[host] if is_here else head_ip
    return host if is_here or not is_loopback(host) else None


def is_this_machine(ip: str) -> bool:
    """Whether ``ip`` is an address of this machine (a socket here can bind it)."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        try:
            s.bind((ip, 0))
        except OSError:  # EADDRNOTAVAIL: another machine's
            return False
    return True


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (127.0.0.0/8, ::1; e.g. ``localhost``).

    Raises:
        ValueError: ``host`` does not resolve (:func:`runtime.serve.resolve_host`).
    """
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in single.resolve_host(host))


def wait_for_proxy(host: str, port: int, head_ip: str, timeout_s: float = PROXY_START_S) -> None:
    """Return once Serve's HTTP proxy, bound to ``host:port`` on the head node at ``head_ip``, answers that it is
    ready where this machine reaches it (:func:`readiness_address`): ``GET /-/healthz`` is 200 ``success``
    (:func:`is_serve_proxy`). A loopback host on a head elsewhere cannot be asked from here: one ``warning:`` line
    says so, and this returns at once (``serve.start`` has waited for that proxy to start).

    ``serve.run`` returns when the replicas are up; the proxy may still be starting (after a ``serve.shutdown()``
    on a loaded machine: seconds), and a request sent then is refused. A connection alone does not say whose port
    it is: another process may listen there (here, while the proxy runs on another machine of a cluster). One
    that shares the port with SO_REUSEPORT, as Serve's proxy binds it, gets some of the connections, which no
    check from outside rules out: :func:`~runtime.serving.ray_launch.launch` checks the port before it starts a Ray.

    Raises:
        RuntimeError: no such answer within ``timeout_s`` seconds; the message names the address.
    """
    target = readiness_address(host, head_ip)
    if target is None:
        print(f"warning: Serve's proxy listens on {host} port {port} of the cluster's head node ({head_ip}), not of "
              f"this machine: its readiness cannot be checked from here, and {http_url(host, port)} is that "
              "machine's address (pass a --host that this machine reaches to check it)", file=sys.stderr, flush=True)
        return
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

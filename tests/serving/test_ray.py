"""The Ray Serve deployment (python -m runtime.serve_ray, runtime/serving/ray_*.py) with real Ray on this
machine: 2 replicas of the tiny random Llama (B = W = 4), driven by the openai client through Serve's proxy.

One Ray instance for the module (2 CPUs; Serve's proxy on loopback), shut down at the end. Waits poll
with deadlines far above a healthy run (:data:`DEADLINE_S`) and return as soon as the
condition holds; nothing depends on the machine's speed.
"""

from __future__ import annotations

import http.server
import logging
import os
import signal
import socket
import threading
from concurrent import futures
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from server_support import DEADLINE_S, wait_until
from support import export
from test_server import MAX_NEW, PROMPTS, chat, complete, runtime_parts  # noqa: F401 (a fixture)

ray = pytest.importorskip("ray", reason="needs the serve-ray extra")
from ray import serve  # noqa: E402
from ray.serve.schema import LoggingConfig  # noqa: E402

from runtime.decode.decoder import DecodeParams  # noqa: E402
from runtime.decode.admission import why_no_adaptive_masks  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from runtime import serve as single  # noqa: E402
from runtime import serve_ray  # noqa: E402
from runtime.serving import kv_memory, ray_deploy, ray_launch, ray_proxy, ray_replica  # noqa: E402
from runtime.serving.ray_board import NAMESPACE, FleetBoard, add_fleet_routes, merge_metrics  # noqa: E402
from runtime.serving.ray_deploy import FleetOptions, deploy  # noqa: E402
from runtime.serving.errors import install_error_handlers  # noqa: E402
from runtime.serving.metrics import ServerMetrics  # noqa: E402

NUM_REPLICAS = 2


@pytest.fixture(scope="module")
def fleet(tiny_bundle):
    """The deployment, started and stopped as a program does it: launch (a Ray of our own; shut down if deploy
    fails), then stop (the replicas' graceful shutdown, a wait for Serve to be gone, then Ray)."""
    _, bundle = tiny_bundle("llama", 4)
    deployed = ray_launch.launch([str(bundle), "--port", "0", "--max-batch-size", "4", "--threads", "1",
                                  "--tau-min", "0.5", "--queue-high", "4", "--log-level", "warning"],
                                 FleetOptions(replicas=NUM_REPLICAS, num_cpus=0.5, max_ongoing_requests=16),
                                 num_cpus=2, log_to_driver=False)
    url = deployed.url
    http = httpx.Client(base_url=url, timeout=DEADLINE_S)
    try:
        yield SimpleNamespace(url=url, http=http, client=openai.OpenAI(base_url=f"{url}/v1", api_key="none",
                                                                       max_retries=0, timeout=DEADLINE_S))
    finally:
        http.close()
        ray_launch.stop(deployed)


def replicas(fleet) -> dict[str, dict]:
    return fleet.http.get("/fleet/replicas").json()


def wait_replicas(fleet, condition, what: str) -> dict[str, dict]:
    """Poll /fleet/replicas until NUM_REPLICAS replicas report and ``condition(reports)`` holds."""
    found = {}

    def check():
        found.update(reports=replicas(fleet))
        return len(found["reports"]) == NUM_REPLICAS and condition(found["reports"])

    wait_until(check, what)
    return found["reports"]


def solo_ids(runtime_parts, text: str, chat_: bool) -> list[int]:
    tokenizer, decoder = runtime_parts
    ids = tokenizer.encode_chat([{"role": "user", "content": text}]) if chat_ else tokenizer.encode(text)
    return decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW)).token_ids


def test_fleet_board_publishes_each_base_tau_once_in_order():
    board = FleetBoard()
    assert board.report("a", {"pid": 1}) == (0, None)
    assert board.publish_tau(0.7) == 1 and board.publish_tau(0.9) == 2
    assert board.report("b", {"pid": 2}) == (2, 0.9)
    assert board.replicas() == {"a": {"pid": 1}, "b": {"pid": 2}}


def test_merge_metrics_labels_every_sample_with_its_replica():
    busy, idle = ServerMetrics(2), ServerMetrics(2)
    busy.record_output(6, 2, now=1.0)
    busy.record_outcome("stop")
    merged = merge_metrics({"r1": busy.render().decode(), "r2": idle.render().decode()}).decode()
    samples = {(s.name, s.labels.get("outcome"), s.labels["replica"]): s.value
               for family in text_string_to_metric_families(merged) for s in family.samples}
    tokens = "mars_generated_tokens_total"
    assert samples[tokens, None, "r1"] == 6 and samples[tokens, None, "r2"] == 0
    assert samples["mars_requests_total", "stop", "r1"] == 1 and samples["mars_requests_total", "stop", "r2"] == 0
    assert samples["mars_max_slots", None, "r2"] == 2


def test_fleet_options_reject_bad_counts():
    with pytest.raises(ValueError, match="--max-replicas"):
        FleetOptions(replicas=2, max_replicas=1)
    for target in (float("nan"), float("inf"), 0.0):  # nan passed the check for Python callers
        with pytest.raises(ValueError, match="--target-ongoing-requests > 0"):
            FleetOptions(target_ongoing_requests=target)
    for options in ({"upscale_delay_s": float("nan")}, {"num_cpus": float("inf")}):
        with pytest.raises(ValueError, match="--upscale-delay-s >= 0"):
            FleetOptions(**options)
    assert FleetOptions(replicas=1, max_replicas=3).deployment_options()["autoscaling_config"] == \
        {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8.0, "upscale_delay_s": 30.0}


@pytest.mark.parametrize("options, named", [(["--tau", "0.5", "--tau-min", "0.9"], "--tau-min"),
                                            (["--default-max-tokens", "300", "--max-tokens-limit", "200"],
                                             "--default-max-tokens"),
                                            (["--api-key", "  "], "--api-key"),
                                            # a bad command line, Ray's options or the server's: argparse's usage
                                            # block and 'python -m runtime.serve_ray: error: ...' before
                                            (["--replicas", "two"], "argument --replicas: invalid int value: 'two'"),
                                            (["--port", "80x"], "argument --port: must be a port number"),
                                            (["--max-batch-size", "0"], "argument --max-batch-size: must be >= 1"),
                                            (["--threads", "300"], "argument --threads: must be in 0..256"),
                                            (["--bogus"], "unrecognized arguments: --bogus")])
def test_bad_server_options_stop_before_ray_starts(tiny_bundle, monkeypatch, capsys, options, named):
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # the bundle's export output, if it was made now
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray was started"))
    assert serve_ray.main([str(bundle), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and err.count("\n") == 1


@pytest.mark.parametrize("options", [["--max-batch-size", "100000"], ["--max-seq-len", "99999"],
                                     ["--max-seq-len", "5"]], ids=["kv-memory", "past-context", "below-window"])
def test_an_engine_option_the_bundle_refuses_stops_main_before_ray_in_the_servers_words(tiny_bundle, monkeypatch,
                                                                                        capsys, options):
    """--max-batch-size 100000 or --max-seq-len 99999 started Ray, and 17-45 s later ~200 lines of replica
    tracebacks ended in 'Deploying application mars failed'. They are checked against the bundle's config before
    Ray starts (one replica's KV cache against this machine's memory; the context's limits), in the one line
    python -m runtime.serve gives."""
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # the bundle's export output, if it was made now
    monkeypatch.setattr(kv_memory, "host_memory_available", lambda: (64 << 20, "MemAvailable in /proc/meminfo"))
    monkeypatch.setattr(single, "make_server", lambda *a: pytest.fail("the server started"))
    assert single.main([str(bundle), "--port", "0", *options]) == 2
    expected = capsys.readouterr().err
    assert expected.startswith("error: ") and expected.count("\n") == 1 and "(--m" in expected, expected
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray was started"))
    assert serve_ray.main([str(bundle), *options]) == 2
    assert capsys.readouterr().err == expected


def test_replicas_on_a_cluster_are_not_held_to_this_machines_memory(tiny_bundle, monkeypatch):
    """With --address the replicas may run on other machines: their KV cache is not checked against this one's
    memory before Ray starts (each replica checks its own), while the bundle's context still is."""
    _, bundle = tiny_bundle("llama", 4)
    monkeypatch.setattr(kv_memory, "host_memory_available", lambda: (64 << 20, "MemAvailable in /proc/meminfo"))

    def joined(**kwargs):  # the cluster is joined: stop there
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "init", joined)
    with pytest.raises(KeyboardInterrupt):
        serve_ray.main([str(bundle), "--max-batch-size", "100000", "--address", "ray://elsewhere:10001"])
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray was started"))
    assert serve_ray.main([str(bundle), "--max-seq-len", "99999", "--address", "ray://elsewhere:10001"]) == 2


def test_our_own_ray_gives_the_serve_proxy_time_to_start(tiny_bundle, monkeypatch):
    _, bundle = tiny_bundle("llama", 4)
    monkeypatch.delenv(ray_launch.PROXY_READY_ENV, raising=False)
    seen = {}

    def stub(**kwargs):  # record what the Ray processes would inherit, then stop before anything starts
        seen.update(env=os.environ.get(ray_launch.PROXY_READY_ENV), kwargs=kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "init", stub)
    with pytest.raises(KeyboardInterrupt):
        serve_ray.main([str(bundle)])
    assert float(seen["env"]) == ray_launch.PROXY_READY_CHECK_S > 5 and "address" not in seen["kwargs"]
    assert seen["kwargs"]["_node_ip_address"] == "127.0.0.1"


@pytest.fixture
def health_server():
    """Factory: an HTTP server on loopback answering GET /-/healthz with (status, body); yields its port."""
    servers = []

    def start(status: int, body: bytes) -> int:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_wait_for_proxy_returns_once_serves_proxy_answers(health_server):
    """The wait ends at the first answer of Serve's proxy (its health route, 200 "success"), named on timeout."""
    ray_proxy.wait_for_proxy("0.0.0.0", health_server(200, b"success"), "127.0.0.1", timeout_s=0)  # head: here
    port = ray_proxy.free_port("127.0.0.1")
    with pytest.raises(RuntimeError, match=f"did not answer on 127.0.0.1:{port} within 0.3 s"):
        ray_proxy.wait_for_proxy("127.0.0.1", port, "127.0.0.1", timeout_s=0.3)  # nothing listens: until the deadline


def test_wait_for_proxy_is_not_fooled_by_another_process_on_the_port(health_server):
    """The wait returned at the first TCP connection, which another process listening on the port (here, while
    Serve's proxy runs on another machine of the cluster) also accepts: Serve's proxy is told by its answer."""
    with socket.socket() as other:  # listens, never answers
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"did not answer on 127.0.0.1:{port} within 0.3 s .*--port taken"):
            ray_proxy.wait_for_proxy("127.0.0.1", port, "127.0.0.1", timeout_s=0.3)
    for status, body in ((404, b"success"), (200, b'{"detail":"Not Found"}')):  # another server's answers
        assert not ray_proxy.is_serve_proxy("127.0.0.1", health_server(status, body))


def test_hosts_ipv6_and_unresolvable():
    """An IPv6 --host gets a free port of its family and a bracketed URL; a name that does not
    resolve stops main before Ray starts, naming --host."""
    port = ray_proxy.free_port("::1")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))  # it was free
    assert ray_proxy.http_url("::1", port) == f"http://[::1]:{port}"
    assert ray_proxy.http_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="--host 'no-such-host.invalid' does not resolve"):
        ray_proxy.free_port("no-such-host.invalid")


def test_main_refuses_an_unresolvable_host_before_ray(tiny_bundle, monkeypatch, capsys):
    _, bundle = tiny_bundle("llama", 4)
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray started"))
    assert serve_ray.main([str(bundle), "--host", "no-such-host.invalid"]) == 2
    assert "error: --host 'no-such-host.invalid' does not resolve" in capsys.readouterr().err


def test_a_port_in_use_stops_main_before_ray_starts(tiny_bundle, monkeypatch, capsys):
    """Serve's proxy met a --port in use only once Ray had started and the bundle had loaded: main checks it
    first, by the plain server's rule (runtime.serve.check_can_listen), with its error line and exit status 3.
    With --address the proxy may bind on another machine of the cluster, so this machine's port is not checked."""
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # the bundle's export output, if it was made now
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray started"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_ray.main([str(bundle), "--port", str(port)]) == single.STARTUP_FAILURE
        assert capsys.readouterr().err == (f"error: port {port} on 127.0.0.1 is in use: stop what listens there, or "
                                           "choose another --port (--port 0 picks a free one)\n")

        def joined(**kwargs):  # the cluster is joined: stop there
            raise KeyboardInterrupt

        monkeypatch.setattr(ray, "init", joined)
        with pytest.raises(KeyboardInterrupt):
            serve_ray.main([str(bundle), "--port", str(port), "--address", "ray://elsewhere:10001"])


def test_main_serves_until_a_signal_then_stops_the_deployment(tiny_bundle, monkeypatch, capsys):
    """main's steps in order: check the options (against the bundle's config too), launch, one line saying where
    it runs, wait for SIGTERM or Ctrl-C, stop; after the first signal both are back to their default, so a second
    one ends the command at once. Ray and Serve are stubbed (launch and stop)."""
    bundle = str(tiny_bundle("llama", 4)[1])
    capsys.readouterr()  # the bundle's export output, if it was made now
    deployed = ray_deploy.Deployed("http://127.0.0.1:8123", board=None, shutdown_timeout_s=5.0)
    calls = []
    monkeypatch.setattr(serve_ray, "launch", lambda argv, fleet, address: calls.append(("launch", argv)) or deployed)
    monkeypatch.setattr(serve_ray, "stop", lambda handle: calls.append(("stop", handle)))
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def send_sigterm():  # only once main waits, with its handler installed
        wait_until(lambda: signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM], "main's handler")
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send_sigterm)
    sender.start()
    try:
        assert serve_ray.main([bundle, "--replicas", "2", "--max-replicas", "3", "--port", "0"]) == 0
        assert [signal.getsignal(sig) for sig in before] == [signal.SIG_DFL, signal.SIG_DFL]
    finally:
        sender.join()
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert calls == [("launch", [bundle, "--port", "0"]), ("stop", deployed)]
    assert capsys.readouterr().out == ("mars-edge on Ray Serve running on http://127.0.0.1:8123 (replicas: 2 to 3); "
                                       "Ctrl-C stops it\n")


def test_launch_checks_the_port_here_before_it_starts_a_ray(tiny_bundle, monkeypatch):
    """A program's local path (launch without an address) checks --port before Ray starts, by the plain server's
    rule: also a port held with SO_REUSEPORT, which Serve's proxy (SO_REUSEPORT too) would share unseen. Joining
    a cluster, the port is not checked here: the proxy may bind on another machine."""
    _, bundle = tiny_bundle("llama", 4)
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray started"))
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(single.CannotListen, match=f"port {port} on 127.0.0.1 is in use: .*--port 0 picks"):
            ray_launch.launch([str(bundle), "--port", str(port)], FleetOptions())

        def joined(**kwargs):  # the cluster is joined: stop there
            raise KeyboardInterrupt

        monkeypatch.setattr(ray, "init", joined)
        with pytest.raises(KeyboardInterrupt):
            ray_launch.launch([str(bundle), "--port", str(port)], FleetOptions(), address="ray://elsewhere:10001")


def test_launch_shuts_ray_down_when_deploy_fails(monkeypatch):
    """launch connected Ray, so a deploy that fails leaves it shut down (a cluster joined: disconnected)."""
    calls = []

    def deploy(argv, fleet):
        calls.append("deploy")
        raise ValueError("bad bundle")

    monkeypatch.setattr(ray_launch, "start_local_ray", lambda **kwargs: calls.append(("ray.init", kwargs)))
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(("ray.init", kwargs)))
    monkeypatch.setattr(ray_launch, "deploy", deploy)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    for address in (None, "ray://elsewhere:10001"):
        calls.clear()
        with pytest.raises(ValueError, match="bad bundle"):
            ray_launch.launch(["BUNDLE", "--port", "0"], FleetOptions(), address, num_cpus=2)
        assert calls[1:] == ["deploy", "ray.shutdown"] and calls[0][1]["num_cpus"] == 2


def test_deploy_refuses_an_unresolvable_host_before_serve_starts(tiny_bundle, monkeypatch):
    """deploy(), the programmatic entry, checks --host too before anything of Serve starts."""
    _, bundle = tiny_bundle("llama", 4)
    monkeypatch.setattr(serve, "start", lambda **kwargs: pytest.fail("Serve started"))
    with pytest.raises(ValueError, match="--host 'no-such-host.invalid' does not resolve"):
        ray_deploy.deploy([str(bundle), "--host", "no-such-host.invalid"], FleetOptions())


def test_an_empty_host_is_every_interface_as_for_the_plain_server(tiny_bundle, monkeypatch, stubbed_serve):
    """--host "" is every interface for runtime.serve (its one host rule, runtime.serve.resolve_host); serve_ray had
    a rule of its own that refused it as a host that does not resolve. Serve's proxy binds it on every IPv4
    interface: the URL says 0.0.0.0."""
    _, bundle = tiny_bundle("llama", 4)
    deployed = ray_deploy.deploy([str(bundle), "--host", ""], FleetOptions())
    port = stubbed_serve.start["http_options"]["port"]
    assert stubbed_serve.start["http_options"]["host"] == "" and deployed.url == f"http://0.0.0.0:{port}"

    def started(**kwargs):  # main got past its checks: stop where Ray starts
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "init", started)
    with pytest.raises(KeyboardInterrupt):
        serve_ray.main([str(bundle), "--host", "", "--port", "0"])


@pytest.fixture
def stubbed_serve(monkeypatch) -> SimpleNamespace:
    """Serve and Ray stubbed for deploy() (the head node: this machine): what it asks of them is recorded
    (``start``: serve.start's keyword arguments, ``options``: the deployment's, ``bound``: the arguments each replica
    would be constructed with, ``shutdown``: serve.shutdown's calls)."""
    seen = SimpleNamespace(start={}, options={}, bound=[], shutdown=[])

    class Deployment:
        def options(self, **kwargs):
            seen.options.update(kwargs)
            return self

        def bind(self, *args):
            seen.bound.append(args)
            return args

    board = SimpleNamespace(options=lambda **kwargs: SimpleNamespace(remote=lambda: "board"))
    monkeypatch.setattr(ray_deploy, "wait_until_serve_is_gone", lambda: None)
    monkeypatch.setattr(ray_deploy, "head_node_ip", lambda: "127.0.0.1")
    monkeypatch.setattr(ray_deploy, "wait_for_proxy", lambda host, port, head_ip: None)
    monkeypatch.setattr(serve, "shutdown", lambda: seen.shutdown.append("serve.shutdown"))
    monkeypatch.setattr(serve, "start", lambda **kwargs: seen.start.update(kwargs))
    monkeypatch.setattr(serve, "run", lambda app, **kwargs: None)
    monkeypatch.setattr(serve, "deployment", lambda cls: Deployment())
    monkeypatch.setattr(ray, "remote", lambda **kwargs: lambda cls: board)
    return seen


def test_a_proxy_that_cannot_bind_is_named_and_serve_shut_down(tiny_bundle, monkeypatch, stubbed_serve):
    """serve.start waits for its proxy, which raises when it cannot bind (a port in use where it runs, maybe another
    machine of the cluster): deploy said so with Ray's remote traceback, and left Serve's controller running, whose
    proxy it restarts for ever. Now one line names the address and --port, and Serve is shut down again."""
    _, bundle = tiny_bundle("llama", 4)
    bind_failed = ray.exceptions.RayTaskError("ProxyActor.ready", "Traceback ...",
                                              RuntimeError("Failed to bind to address '127.0.0.1:8123'.")
                                              ).as_instanceof_cause()

    def start(**kwargs):
        raise bind_failed

    monkeypatch.setattr(serve, "start", start)
    with pytest.raises(RuntimeError) as raised:
        ray_deploy.deploy([str(bundle), "--port", "8123"], FleetOptions())
    assert str(raised.value) == ("Serve's HTTP proxy did not start on 127.0.0.1 port 8123 (Failed to bind to address "
                                 "'127.0.0.1:8123'.): if the port is in use where the proxy runs, stop what listens "
                                 "there, or choose another --port (--port 0 picks a free one)")
    assert stubbed_serve.shutdown == ["serve.shutdown"] and stubbed_serve.bound == []


def test_a_deploy_that_fails_once_serve_started_shuts_serve_down(tiny_bundle, monkeypatch, stubbed_serve):
    """A proxy that never answers (or replicas that fail) leaves no half-started deployment on the cluster."""
    _, bundle = tiny_bundle("llama", 4)

    def never(host, port, head_ip):
        raise RuntimeError(f"Serve's HTTP proxy did not answer on {host}:{port}")

    monkeypatch.setattr(ray_deploy, "wait_for_proxy", never)
    with pytest.raises(RuntimeError, match="did not answer"):
        ray_deploy.deploy([str(bundle), "--port", "0"], FleetOptions())
    assert stubbed_serve.shutdown == ["serve.shutdown"] and len(stubbed_serve.bound) == 1


REMOTE_HEAD = "192.0.2.7"  # TEST-NET-1: an address of no interface here


@pytest.mark.parametrize("host, asked", [("127.0.0.1", None), ("localhost", None), ("0.0.0.0", REMOTE_HEAD),
                                         (REMOTE_HEAD, REMOTE_HEAD)])
def test_the_proxy_of_a_head_elsewhere_is_asked_where_this_machine_reaches_it(tiny_bundle, monkeypatch, capsys,
                                                                              stubbed_serve, host, asked):
    """Joined to a cluster (--address), Serve's proxy runs on the head node, maybe another machine: deploy asked
    this machine's loopback for a loopback or wildcard --host, so with the head elsewhere it waited its full 120 s
    and failed (or found another server here). Now a wildcard host is asked at the head's address, a loopback
    one (that machine's loopback) not at all, with one warning line; other hosts as they are."""
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # the bundle's export output, if it was made now
    head = {"Alive": True, "NodeManagerAddress": REMOTE_HEAD, "Resources": {"CPU": 2.0, "node:__internal_head__": 1.0}}
    monkeypatch.setattr(ray, "nodes", lambda: [{**head, "Resources": {"CPU": 2.0}}, head])  # a worker node, the head
    monkeypatch.setattr(ray_deploy, "head_node_ip", ray_proxy.head_node_ip)  # the real ones, not stubbed_serve's
    monkeypatch.setattr(ray_deploy, "wait_for_proxy", ray_proxy.wait_for_proxy)
    probes = []
    monkeypatch.setattr(ray_proxy, "is_serve_proxy", lambda *address: probes.append(address) or True)
    deployed = ray_deploy.deploy([str(bundle), "--host", host, "--port", "8123"], FleetOptions())
    assert probes == ([] if asked is None else [(asked, 8123)]) and stubbed_serve.shutdown == []
    warning = capsys.readouterr().err
    if asked is None:
        assert warning == (f"warning: Serve's proxy listens on {host} port 8123 of the cluster's head node "
                           f"({REMOTE_HEAD}), not of this machine: its readiness cannot be checked from here, and "
                           f"{deployed.url} is that machine's address (pass a --host that this machine reaches to "
                           "check it)\n")
    else:
        assert warning == ""


@pytest.mark.parametrize("given", ["env", "option"])
def test_replicas_get_the_api_key_resolved_here(tiny_bundle, monkeypatch, stubbed_serve, given):
    """A replica parses the server options in its own process, whose environment on a cluster started
    elsewhere (--address) lacks this one's $MARS_API_KEY: deploy passes the key it resolved, so the
    replica requires it. Serve itself is stubbed: what matters is what each replica is built from."""
    _, bundle = tiny_bundle("llama", 4)
    monkeypatch.setenv(single.API_KEY_ENV, " -sesame " if given == "env" else "")
    ray_deploy.deploy([str(bundle), *(["--api-key=-sesame"] if given == "option" else [])], FleetOptions())
    [(argv, board_name)] = stubbed_serve.bound
    monkeypatch.delenv(single.API_KEY_ENV)  # the replica's environment, on another machine
    assert single.parse_args(argv).api_key == "-sesame" and board_name.startswith(ray_deploy.APP_NAME)
    assert ray_deploy.replica_argv(["BUNDLE"], None) == ["BUNDLE"]  # no key here: the replica's own, as before


def test_the_log_level_is_serves_for_the_replicas_controller_and_proxy(tiny_bundle, stubbed_serve):
    """--log-level goes to Serve's LoggingConfig: the deployment's (the replicas' Serve logs, access logs
    included) and serve.start's (controller and proxy); Serve itself accepts it on the deployment."""
    _, bundle = tiny_bundle("llama", 4)
    ray_deploy.deploy([str(bundle), "--log-level", "warning"], FleetOptions())
    assert stubbed_serve.options["logging_config"] == LoggingConfig(log_level="WARNING")
    assert stubbed_serve.start["logging_config"] == LoggingConfig(log_level="WARNING")
    deployment = ray.serve.api.deployment(ray_replica.MarsReplica).options(**stubbed_serve.options)  # Serve's own
    assert deployment.logging_config["log_level"] == "WARNING"


@pytest.mark.parametrize("level", ["debug", "error"])
def test_a_replica_logs_at_the_log_level(tiny_bundle, level):
    """A replica's own loggers (ours, by the root logger) take --log-level, as the single server's do; the app
    is the single server's with the fleet routes."""
    _, bundle = tiny_bundle("llama", 4)
    root = logging.getLogger()
    before = root.level
    try:
        app = ray_replica.make_replica_app([str(bundle), "--log-level", level], board=None)
        assert root.level == getattr(logging, level.upper())
        assert logging.getLogger("runtime.serving.app").getEffectiveLevel() == root.level
    finally:
        root.setLevel(before)
    assert {"/fleet/replicas", "/fleet/metrics", "/v1/chat/completions"} <= {route.path for route in app.routes}


@pytest.mark.parametrize("gone_after_polls, timeout_s", [(3, 45.0), (None, 0.0)], ids=["stops", "never-stops"])
def test_ray_shuts_down_only_once_serve_is_gone_or_past_the_shutdown_timeout(monkeypatch, capsys, gone_after_polls,
                                                                             timeout_s):
    """serve.shutdown() gives up waiting after 30 s (Ray's cap) while the controller goes on stopping replicas that
    have --shutdown-timeout to finish: Ray (which would kill them) is shut down only once the controller is gone,
    or after --shutdown-timeout plus STOP_MARGIN_S, with one warning line."""
    calls, polls = [], []

    def get_actor(name, namespace=None):  # Serve's controller: there for gone_after_polls polls
        polls.append(name)
        if gone_after_polls is not None and len(polls) > gone_after_polls:
            raise ValueError(f"Failed to look up actor with name '{name}'")

    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("ray.shutdown", len(polls))))
    monkeypatch.setattr(ray_launch, "STOP_MARGIN_S", 0.0 if gone_after_polls is None else ray_launch.STOP_MARGIN_S)
    ray_launch.stop(ray_deploy.Deployed("http://127.0.0.1:8000", board=None, shutdown_timeout_s=timeout_s))
    if gone_after_polls is None:  # the deadline passed at the first poll
        assert calls == ["serve.shutdown", ("ray.shutdown", 1)]
        assert capsys.readouterr().err == "warning: Ray Serve did not stop within --shutdown-timeout 0 s + 0 s; " \
                                          "shutting Ray down\n"
    else:
        assert calls == ["serve.shutdown", ("ray.shutdown", gone_after_polls + 1)]
        assert capsys.readouterr().err == ""


@pytest.mark.parametrize("options, timeout_s", [(["--shutdown-timeout", "0"], 0), (["--shutdown-timeout", "60"], 60),
                                                ([], single.DEFAULT_SHUTDOWN_TIMEOUT_S)])
def test_the_shutdown_timeout_is_each_replicas_graceful_shutdown(tiny_bundle, stubbed_serve, options, timeout_s):
    """Serve's proxy, not uvicorn, serves the replicas: the server options' --shutdown-timeout, and nothing else,
    goes to Serve as the time a stopping replica may finish its requests in (0: none); deploy() with FleetOptions'
    defaults takes it too."""
    _, bundle = tiny_bundle("llama", 4)
    ray_deploy.deploy([str(bundle), *options], FleetOptions())
    assert stubbed_serve.options["graceful_shutdown_timeout_s"] == timeout_s
    deployment = ray.serve.api.deployment(ray_replica.MarsReplica).options(**stubbed_serve.options)  # Serve checks
    assert deployment._deployment_config.graceful_shutdown_timeout_s == timeout_s  # (no public attribute reads it)


@pytest.mark.parametrize("options, timeout_s", [(["--shutdown-timeout", "60"], 60),
                                                ([], single.DEFAULT_SHUTDOWN_TIMEOUT_S)])
def test_stop_waits_as_long_as_deploy_gave_the_replicas(tiny_bundle, stubbed_serve, monkeypatch, options, timeout_s):
    """A programmatic caller's deploy() returns the graceful shutdown it gave the replicas, and stop() takes that
    handle and waits for it (plus STOP_MARGIN_S) before Ray goes; stop() took the timeout separately, so a caller
    could deploy with 60 s and stop with another value."""
    _, bundle = tiny_bundle("llama", 4)
    deployed = ray_deploy.deploy([str(bundle), *options], FleetOptions())
    assert deployed.shutdown_timeout_s == timeout_s == stubbed_serve.options["graceful_shutdown_timeout_s"]
    waits = []
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    monkeypatch.setattr(ray_launch, "wait_until_serve_is_gone", waits.append)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    ray_launch.stop(deployed)
    assert timeout_s + ray_launch.STOP_MARGIN_S - 5 < waits[0] <= timeout_s + ray_launch.STOP_MARGIN_S


@pytest.mark.parametrize("options, message", [
    (["--target-ongoing-requests", "nan"], "argument --target-ongoing-requests: must be a finite number, got nan"),
    (["--target-ongoing-requests", "inf"], "argument --target-ongoing-requests: must be a finite number, got inf"),
    (["--target-ongoing-requests", "0"], "argument --target-ongoing-requests: must be a finite number > 0, got 0"),
    (["--target-ongoing-requests", "-2"], "argument --target-ongoing-requests: must be a finite number > 0, got -2"),
    (["--target-ongoing-requests", "x"], "argument --target-ongoing-requests: invalid float value: 'x'"),
    (["--max-ongoing-requests", "0"], "argument --max-ongoing-requests: must be >= 1, got 0"),
    (["--max-ongoing-requests", "2.5"], "argument --max-ongoing-requests: invalid int value: '2.5'"),
    (["--upscale-delay-s", "nan"], "argument --upscale-delay-s: must be a finite number, got nan"),
    (["--num-cpus-per-replica", "inf"], "argument --num-cpus-per-replica: must be a finite number, got inf"),
    (["--num-cpus-per-replica", "-1"], "argument --num-cpus-per-replica: must be a finite number >= 0, got -1")],
    ids=["nan", "inf", "zero", "negative", "no-number", "max-zero", "max-float", "delay-nan", "cpus-inf",
         "cpus-negative"])
def test_request_targets_out_of_range_are_refused_at_parsing(options, message, monkeypatch, capsys, tmp_path):
    """--target-ongoing-requests nan or inf reached Ray's autoscaler, and 0 (either option) became the default
    (``x or batch``): one 'error:' line naming the option, exit status 2, before the bundle is read or Ray starts."""
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray was started"))
    assert serve_ray.main([str(tmp_path / "none"), *options]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_fleet_options_take_a_given_request_target_as_given():
    """A target given (a Python caller's 0 too) is FleetOptions' to check, not replaced by the default; only None
    is not given."""
    ray_args = SimpleNamespace(replicas=1, max_replicas=None, target_ongoing_requests=None, max_ongoing_requests=None,
                               num_cpus_per_replica=1.0, upscale_delay_s=30.0)
    fleet = serve_ray.fleet_options(ray_args, SimpleNamespace(queue_high=4), 8)
    assert (fleet.target_ongoing_requests, fleet.max_ongoing_requests) == (8, 12)
    for zero in ({"target_ongoing_requests": 0.0}, {"max_ongoing_requests": 0}):
        with pytest.raises(ValueError, match="need --target-ongoing-requests > 0, --max-ongoing-requests >= 1"):
            serve_ray.fleet_options(SimpleNamespace(**{**vars(ray_args), **zero}), SimpleNamespace(queue_high=4), 8)


def test_fleet_options_default_to_the_replicas_batch(tiny_bundle, tmp_path):
    """Without --max-batch-size (the README's command) the request targets follow the batch each replica runs: the
    server's default for a step bundle, 1 for a fused bundle (it runs one sequence at a time; 8 kept the autoscaler
    from adding a replica until 8 requests waited on each)."""
    ckpt, step_bundle = tiny_bundle("llama", 4)
    fused_bundle = export(str(ckpt), tmp_path / "fused", 4, 4, "--mask-token", "<mask>", "--graph", "fused")
    queue_high = single.parse_args(["BUNDLE"]).queue_high
    for bundle, options, batch in [(step_bundle, [], single.DEFAULT_MAX_BATCH),
                                   (step_bundle, ["--max-batch-size", "3"], 3), (fused_bundle, [], 1)]:
        ray_args, serve_argv = serve_ray.parse_args([str(bundle), "--replicas", "2", *options])
        fleet = serve_ray.prepare_fleet(ray_args, serve_argv, is_local=False)
        assert (fleet.target_ongoing_requests, fleet.max_ongoing_requests) == (batch, batch + queue_high), bundle


def test_fleet_routes_answer_a_503_json_error_when_the_board_is_gone(fleet):
    """/fleet/* read the board actor; once it is gone (killed here) they answer an OpenAI-style
    503, not a bare 500. (``fleet``: for its Ray instance.)"""
    board = ray.remote(num_cpus=0)(FleetBoard).options(namespace=NAMESPACE).remote()
    assert ray.get(board.replicas.remote(), timeout=DEADLINE_S) == {}
    ray.kill(board)
    app = FastAPI()
    install_error_handlers(app, 1 << 20, lambda *_: None)
    add_fleet_routes(app, board)
    with TestClient(app) as client:
        for route in ("/fleet/replicas", "/fleet/metrics"):
            r = client.get(route)
            assert r.status_code == 503, (route, r.text)
            error = r.json()["error"]
            assert error["code"] == "fleet_board_unavailable" and "the fleet board (Ray actor) is gone" in \
                error["message"], error


def test_openai_client_chat_and_completions_streamed_and_not(fleet, runtime_parts):
    tokenizer, _ = runtime_parts
    for text in PROMPTS[:2]:
        for call, is_chat in ((chat, True), (complete, False)):
            plain, streamed = call(fleet, text, extra_body={"tau": 1.0}), call(fleet, text, stream=True,
                                                                               extra_body={"tau": 1.0})
            solo = solo_ids(runtime_parts, text, is_chat)
            for got_text, _, mars, *_ in (plain, streamed):
                assert mars["token_ids"] == solo
                assert got_text == tokenizer.decode(solo)


def test_sixteen_concurrent_requests_each_equal_to_its_solo_run(fleet, runtime_parts):
    texts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(16)]
    with futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda t: chat(fleet, t, stream=len(t) % 2 == 0, extra_body={"tau": 1.0}), texts))
    for text, (_, finish_reason, mars, _) in zip(texts, results):
        assert finish_reason in ("stop", "length")
        assert mars["token_ids"] == solo_ids(runtime_parts, text, True), text
    # metrics per replica: both replicas served requests, each under its own label
    metrics = fleet.http.get("/fleet/metrics").text
    served = {line.split('replica="')[1].split('"')[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith('mars_requests_total{outcome="length"') or
              line.startswith('mars_requests_total{outcome="stop"')}
    assert len(served) == NUM_REPLICAS and set(served) == set(replicas(fleet))


def test_admin_tau_reaches_every_replica(fleet):
    for tau in (0.7, 1.0):
        r = fleet.http.post("/admin/tau", json={"tau": tau})
        assert r.status_code == 200 and r.json()["base_tau"] == tau
        wait_replicas(fleet, lambda reports: all(rep["base_tau"] == tau for rep in reports.values()),
                      f"base tau {tau} on every replica")
    assert fleet.http.post("/admin/tau", json={"tau": 2.0}).status_code == 400  # the policy's bounds hold


def test_killed_replica_restarts_and_requests_end_cleanly(fleet, runtime_parts):
    before = wait_replicas(fleet, lambda reports: True, "both replicas")
    victim = min(before.values(), key=lambda rep: rep["pid"])["pid"]
    stop, outcomes = threading.Event(), []

    def client(worker: int) -> None:
        for i in range(50):  # bounded
            if stop.is_set():
                return
            text = f"{PROMPTS[0]} ({worker}.{i})"
            try:
                _, _, mars, _ = chat(fleet, text, stream=worker % 2 == 0, extra_body={"tau": 1.0})
                outcomes.append(("ok", mars["token_ids"] == solo_ids(runtime_parts, text, True)))
            except openai.APIError as e:  # a clean error: an HTTP error status or a broken connection
                outcomes.append(("error", type(e).__name__))
            except AssertionError as e:  # a stream that ended without its final chunk: lost, not clean
                outcomes.append(("lost", str(e)))

    threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(outcomes) >= 4, "requests to run")
    os.kill(victim, signal.SIGKILL)
    wait_replicas(fleet, lambda reports: victim not in {rep["pid"] for rep in reports.values()},
                  "Ray to restart the killed replica")
    stop.set()
    for t in threads:
        t.join(timeout=DEADLINE_S)
    assert all(ok for kind, ok in outcomes if kind == "ok") and all(kind != "lost" for kind, _ in outcomes), outcomes
    after = [chat(fleet, f"{PROMPTS[1]} [{i}]", extra_body={"tau": 1.0}) for i in range(4)]
    for i, (_, _, mars, _) in enumerate(after):
        assert mars["token_ids"] == solo_ids(runtime_parts, f"{PROMPTS[1]} [{i}]", True)


def test_deploy_refuses_to_start_over_a_running_serve(fleet):
    """deploy waits for an earlier Serve to be gone (serve.shutdown may return before it is); one still running
    is named, not raced."""
    with pytest.raises(RuntimeError, match=r"still runs on this cluster after 0.5 s: call serve.shutdown\(\)"):
        ray_deploy.wait_until_serve_is_gone(timeout_s=0.5)
    assert replicas(fleet)  # and the running fleet is untouched


def test_our_own_rays_head_node_is_this_machine(fleet):
    """Serve's proxy runs on the head node; a Ray of our own has it here, so a loopback --host is still asked
    here (the fixture's deploy did), not skipped as one on another machine would be."""
    head_ip = ray_proxy.head_node_ip()
    assert ray_proxy.is_this_machine(head_ip) and ray_proxy.readiness_address("127.0.0.1", head_ip) == "127.0.0.1"


def test_adaptive_masks_on_a_block_scheme_fleet_are_the_plain_servers_400(fleet, tiny_bundle, runtime_parts):
    """Redeploys (after the tests of the fixture's deployment, before the autoscaling one) one replica on the block
    scheme, which runs every step W wide: a request with adaptive_masks gets, through Serve's proxy, streamed or
    not, the plain server's 400 naming the fix (not a 500), /health gives that reason beforehand, and a request
    without them decodes as the plain runtime does."""
    serve.shutdown()
    _, bundle = tiny_bundle("llama", 4)
    deployed = deploy([str(bundle), "--port", "0", "--scheme", "block", "--max-batch-size", "2", "--threads", "1",
                       "--log-level", "warning"], FleetOptions(replicas=1, num_cpus=0.5))
    block = SimpleNamespace(http=httpx.Client(base_url=deployed.url, timeout=DEADLINE_S),
                            client=openai.OpenAI(base_url=f"{deployed.url}/v1", api_key="none", max_retries=0,
                                                 timeout=DEADLINE_S))
    why = why_no_adaptive_masks(SimpleNamespace(is_window_dynamic=True), "block")  # the plain server's message
    try:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                chat(block, PROMPTS[0], stream=stream, extra_body={"tau": 0.9, "adaptive_masks": True})
            assert info.value.status_code == 400, stream
            assert (info.value.body["param"], info.value.body["message"]) == ("adaptive_masks", why), stream
        health = block.http.get("/health").json()
        assert (health["can_adaptive_masks"], health["why_no_adaptive_masks"]) == (False, why)
        assert chat(block, PROMPTS[0], extra_body={"tau": 1.0})[2]["token_ids"] == \
            solo_ids(runtime_parts, PROMPTS[0], True)
    finally:
        block.http.close()


def test_autoscaling_adds_a_replica_under_load(fleet, tiny_bundle):
    """Last in the module: redeploys with 1 to 2 replicas, a target of 1 ongoing request and no
    upscale delay; 4 clients keep requests running until Serve has started the second replica."""
    serve.shutdown()
    _, bundle = tiny_bundle("llama", 4)
    deployed = deploy([str(bundle), "--port", "0", "--max-batch-size", "4", "--threads", "1", "--log-level", "warning"],
                      FleetOptions(replicas=1, max_replicas=2, target_ongoing_requests=1, num_cpus=0.5,
                                   upscale_delay_s=0))
    scaled = SimpleNamespace(http=httpx.Client(base_url=deployed.url, timeout=DEADLINE_S),
                             client=openai.OpenAI(base_url=f"{deployed.url}/v1", api_key="none", max_retries=0,
                                                  timeout=DEADLINE_S))
    # a replica reports to the board after it starts serving: on a loaded machine that can come after deploy returns
    wait_until(lambda: len(replicas(scaled)) == 1, "the first replica's report")
    stop = threading.Event()

    def client(worker: int) -> None:
        for i in range(500):  # bounded
            if stop.is_set():
                return
            chat(scaled, f"{PROMPTS[2]} ({worker}.{i})", extra_body={"tau": 1.0})

    with futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(client, w) for w in range(4)]
        try:
            # Serve decides from request metrics averaged over its look-back window and then starts
            # a replica process (imports, bundle load): on a loaded 2-core machine that took past
            # DEADLINE_S once, so this one wait gets a wider bound. Still a bound, never a timing.
            wait_until(lambda: len(replicas(scaled)) == 2, "the autoscaler to add a replica", timeout=4 * DEADLINE_S)
        finally:
            stop.set()
        for done in running:
            done.result()
    scaled.http.close()

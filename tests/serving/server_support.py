"""The real server (uvicorn) started by a test on a free port, in a thread."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import openai
import uvicorn

from runtime.serve import build_app, parse_args


class RunningServer:
    """A server started by a test: its base URL, an openai client and an httpx client."""

    def __init__(self, url: str, api_key: str | None):
        self.url = url
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=url, timeout=120)

    def health(self) -> dict:
        return self.http.get("/health").json()

    def metric(self, name: str) -> float:
        """The value of one sample in /metrics (e.g. ``mars_requests_total{outcome="aborted"}``)."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(name)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Poll /health until no request runs or waits; return it."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if health["active_slots"] == 0 and health["queue_depth"] == 0 or time.monotonic() > deadline:
                return health
            time.sleep(0.02)


@contextmanager
def serve(*argv: str, prepare=None):
    """Run ``python -m runtime.serve ARGV --port 0`` in a thread; yield a :class:`RunningServer`.

    ``prepare(app)``, if given, runs on the app before the server starts.
    """
    args = parse_args([*argv, "--port", "0", "--threads", "1", "--log-level", "warning"])
    app = build_app(args)
    if prepare is not None:
        prepare(app)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    running = RunningServer(f"http://{args.host}:{port}", args.api_key)
    try:
        yield running
    finally:
        running.http.close()
        server.should_exit = True
        thread.join(timeout=30)

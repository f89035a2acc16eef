"""The real server (uvicorn) started by a test on a free port, in a thread, its backend behind a gate.

Nothing here depends on the machine's speed: a test that needs a request still running
when something happens (a disconnect, a long queue) closes the gate, so the engine thread
waits before each forward until the test lets it go; waits for the server poll with
deadlines far above any healthy run, and return as soon as the condition holds.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import openai

from runtime.serve import build_app, make_server, parse_args
from runtime.serving.shutdown import Server

DEADLINE_S = 120.0  # longest wait for a condition; a healthy run needs far less


def wait_until(condition, what: str, timeout: float = DEADLINE_S) -> None:
    """Poll ``condition()`` until it is true.

    Raises:
        AssertionError: still false after ``timeout`` seconds (names ``what``).
    """
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.02)


class GatedBackend:
    """The real backend behind a gate: while it is closed, each forward waits at the gate until
    the test opens it or lets a number of forwards through.

    Open by default (no change in behaviour). A forward held longer than :data:`DEADLINE_S`
    fails with RuntimeError, so a test that forgets to open the gate fails instead of hanging.
    """

    def __init__(self, backend):
        self.backend = backend
        self._changed = threading.Condition()
        self._permits: int | None = None  # None: open; else forwards that may still pass
        self._is_waiting = False  # a forward is at the gate

    def step(self, *args, **kwargs):
        with self._changed:
            self._is_waiting = True
            self._changed.notify_all()
            is_free = self._changed.wait_for(lambda: self._permits is None or self._permits > 0, DEADLINE_S)
            self._is_waiting = False
            if not is_free:
                raise RuntimeError("a forward waited at the closed test gate for too long")
            if self._permits is not None:
                self._permits -= 1
        return self.backend.step(*args, **kwargs)

    @contextmanager
    def closed(self):
        """Hold every forward inside the block (opened again on leaving it, also on errors)."""
        with self._changed:
            self._permits = 0
        try:
            yield self
        finally:
            with self._changed:
                self._permits = None
                self._changed.notify_all()

    def allow(self, num_forwards: int = 1) -> None:
        """Let ``num_forwards`` more forwards through the closed gate."""
        with self._changed:
            self._permits += num_forwards
            self._changed.notify_all()

    def is_holding(self) -> bool:
        """Whether a forward waits at the closed gate now."""
        with self._changed:
            return self._is_waiting and self._permits == 0

    def wait_held(self) -> None:
        """Return once a forward waits at the closed gate (the engine thread is paused there).

        Raises:
            AssertionError: none arrived within :data:`DEADLINE_S`.
        """
        with self._changed:
            assert self._changed.wait_for(lambda: self._is_waiting and self._permits == 0, DEADLINE_S), \
                "no forward reached the closed gate"


class RunningServer:
    """A server started by a test: its base URL, an openai client, an httpx client, the app and
    the gate in front of its backend."""

    def __init__(self, url: str, api_key: str | None, app, gate: GatedBackend, server: Server,
                 thread: threading.Thread):
        self.url, self.app, self.gate = url, app, gate
        self._server, self._thread = server, thread
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

    def advance_until(self, condition, max_forwards: int) -> dict:
        """With the gate closed: let forwards through one at a time until ``condition(health)``
        holds while a forward waits at the gate (the engine paused, /health stable); return
        that health.

        Raises:
            AssertionError: not within ``max_forwards`` forwards.
        """
        for _ in range(max_forwards + 1):
            self.gate.wait_held()
            health = self.health()
            if condition(health):
                return health
            self.gate.allow(1)
        raise AssertionError(f"/health never met the condition within {max_forwards} forwards: {health}")

    def begin_shutdown(self) -> None:
        """Ask the server to stop, as SIGTERM or Ctrl-C does."""
        self._server.should_exit = True

    def has_exited(self, timeout: float = DEADLINE_S) -> bool:
        """Whether the server's thread ends within ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_idle(self, timeout: float = DEADLINE_S) -> dict:
        """Poll /health until no request runs or waits (or ``timeout`` passes); return it."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if health["active_slots"] == 0 and health["queue_depth"] == 0 or time.monotonic() > deadline:
                return health
            time.sleep(0.02)


@contextmanager
def serve(*argv: str, prepare=None):
    """Run ``python -m runtime.serve ARGV --port 0`` in a thread; yield a :class:`RunningServer`.

    The engine's backend is put behind an (open) :class:`GatedBackend`; ``prepare(app)``, if
    given, runs on the app after that and before the server starts.
    """
    args = parse_args([*argv, "--port", "0", "--threads", "1", "--log-level", "warning"])
    app = build_app(args)
    engine = app.state.ctx.engine_thread.engine
    gate = engine.backend = GatedBackend(engine.backend)
    if prepare is not None:
        prepare(app)
    server = make_server(app, args)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the server to start")
    assert thread.is_alive(), "the server stopped while starting"
    port = server.servers[0].sockets[0].getsockname()[1]
    running = RunningServer(f"http://{args.host}:{port}", args.api_key, app, gate, server, thread)
    try:
        yield running
    finally:
        running.http.close()
        running.begin_shutdown()
        running.has_exited(timeout=30)

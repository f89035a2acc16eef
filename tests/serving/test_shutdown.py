"""Tier 2: SIGTERM / Ctrl-C with requests still open: a bounded wait, then they are aborted with an
answer (a 503, or an error event ending the stream) and the server exits, with one WARNING line
and no ERROR or traceback.

The request is held open by the closed test gate (its engine waits before a forward), so
nothing depends on the machine's speed: without a bounded wait it would never end.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from server_support import serve, wait_until

from runtime.serving import shutdown
from runtime.serving.protocol import SSE_DONE, sse_event
from runtime.serving.shutdown import shutdown_error

SHUTDOWN_TIMEOUT_S = 0.5


@contextmanager
def recording_logs():
    """Record what the server logs at WARNING or above (uvicorn's loggers stop at "uvicorn", which
    uvicorn's config makes: so this starts after the server)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def shutdown_lines(records: list[logging.LogRecord]) -> list[tuple[str, str]]:
    """(level, message) of the records the shutdown is about: the server's own shutdown logger's, and any at ERROR
    or with a traceback (uvicorn's "Cancel N running task(s)" among them). A WARNING of another logger (a library's
    deprecation, say) is not the shutdown's."""
    return [(r.levelname, r.getMessage()) for r in records
            if r.name == shutdown.log.name or r.levelno >= logging.ERROR or r.exc_info]


def log_an_unrelated_warning() -> None:
    """A library's WARNING while the server shuts down: the checks below pass over it."""
    logging.getLogger("some.library").warning("something unrelated is deprecated")


def request_until_closed(url: str, stream: bool, answers: list) -> None:
    """POST a long completion, read it until the server ends it, and append (status, body)."""
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={"prompt": "hi", "max_tokens": 400, "stream": stream}) as response:
        answers.append((response.status_code, response.read().decode()))


@pytest.mark.parametrize("timeout_s", [SHUTDOWN_TIMEOUT_S, 0])
@pytest.mark.parametrize("stream", [True, False])
def test_shutdown_aborts_requests_still_open_after_the_timeout(tiny_bundle, stream, timeout_s):
    _, bundle = tiny_bundle("llama", 4)
    answers = []
    with serve(str(bundle), "--shutdown-timeout", str(timeout_s)) as server, recording_logs() as records:
        registry = server.app.state.ctx.metrics.registry
        client = threading.Thread(target=request_until_closed, args=(server.url, stream, answers))
        with server.gate.closed():
            client.start()
            server.gate.wait_held()  # the request is in the engine, paused before a forward
            asked = time.monotonic()
            server.begin_shutdown()  # as SIGTERM does
            log_an_unrelated_warning()
            wait_until(lambda: registry.get_sample_value("mars_requests_total", {"outcome": "aborted"}) == 1,
                       "the open request to be aborted", timeout=30)
            assert time.monotonic() - asked >= timeout_s  # it had its grace period
        assert server.has_exited(timeout=30)
        client.join(timeout=30)
        assert not client.is_alive()
    [(status, body)] = answers
    if stream:
        assert status == 200 and body.endswith(sse_event(shutdown_error()) + SSE_DONE), body
    else:
        assert (status, json.loads(body)) == (503, shutdown_error())
    assert shutdown_lines(records) == [
        ("WARNING", f"shutting down: aborted 1 request(s) still open after --shutdown-timeout {timeout_s:g}")]


def test_a_zero_timeout_without_open_requests_logs_nothing(tiny_bundle):
    """uvicorn with a graceful timeout of 0 logs an ERROR on every shutdown ("Cancel 0 running
    task(s)"): the server's own grace period does not."""
    _, bundle = tiny_bundle("llama", 4)
    with serve(str(bundle), "--shutdown-timeout", "0") as server, recording_logs() as records:
        assert server.health()["status"] == "ok"
        server.begin_shutdown()
        log_an_unrelated_warning()
        assert server.has_exited(timeout=30)
    assert shutdown_lines(records) == []

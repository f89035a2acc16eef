"""Tier 2: SIGTERM / Ctrl-C with requests still open: a bounded wait, then they are aborted and the server exits.

The request is held open by the closed test gate (its engine waits before a forward), so
nothing depends on the machine's speed: without a bounded wait it would never end.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_support import serve, wait_until

SHUTDOWN_TIMEOUT_S = 0.5


def request_until_closed(url: str, stream: bool) -> None:
    """POST a long completion and read it until the server ends it (or closes the connection)."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={"prompt": "hi", "max_tokens": 400, "stream": stream}) as response:
            for _ in response.iter_bytes():
                pass
    except httpx.HTTPError:
        pass  # the server closed the connection under the request: what a shutdown does


@pytest.mark.parametrize("stream", [True, False])
def test_shutdown_aborts_requests_still_open_after_the_timeout(tiny_bundle, stream):
    _, bundle = tiny_bundle("llama", 4)
    with serve(str(bundle), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)) as server:
        registry = server.app.state.ctx.metrics.registry
        client = threading.Thread(target=request_until_closed, args=(server.url, stream))
        with server.gate.closed():
            client.start()
            server.gate.wait_held()  # the request is in the engine, paused before a forward
            asked = time.monotonic()
            server.begin_shutdown()  # as SIGTERM does
            wait_until(lambda: registry.get_sample_value("mars_requests_total", {"outcome": "aborted"}) == 1,
                       "the open request to be aborted", timeout=30)
            assert time.monotonic() - asked >= SHUTDOWN_TIMEOUT_S  # it had its grace period
        assert server.has_exited(timeout=30)
        client.join(timeout=30)
        assert not client.is_alive()

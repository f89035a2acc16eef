"""A bounded, quiet shutdown: the requests still open after ``--shutdown-timeout`` end with an answer.

On SIGTERM or Ctrl-C uvicorn stops accepting connections and waits for the open requests, at
most its ``timeout_graceful_shutdown``; then it logs an ERROR, cancels them, and logs each
cancelled request's traceback ("Exception in ASGI application": the CancelledError leaves
the app). With a timeout of 0 it logs that ERROR on every shutdown, even with no request open.

Here :class:`Server` waits ``grace_s`` itself, then cancels the requests still open through
:class:`OpenRequests` and logs one WARNING line. The request handlers clean up as on any
cancellation (the request aborted in the engine, counted ``aborted``), and the middleware
answers in their place instead of letting the CancelledError reach uvicorn: a 503 error when
no response was started, an error event and ``[DONE]`` ending a started event stream.
uvicorn's own timeout stays as a backstop, :data:`BACKSTOP_S` later, for a request that still
does not end (a client that reads nothing while the server writes).
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from fastapi.responses import JSONResponse

from runtime.serving import protocol

log = logging.getLogger(__name__)
BACKSTOP_S = 5.0  # after grace_s: uvicorn cancels what is still open, with its ERROR lines
SHUTDOWN_MESSAGE = "the server is shutting down: the request was aborted after --shutdown-timeout"


def shutdown_error() -> dict:
    """The OpenAI-style error of a request aborted at shutdown."""
    return protocol.error_body(SHUTDOWN_MESSAGE, "server_error", None, "server_shutting_down")


class OpenRequests:
    """ASGI middleware that keeps the tasks of the HTTP requests in flight, so that
    :meth:`cancel_all` can end them; a request it cancelled is answered, its CancelledError
    does not leave the app.

    Args:
        app: the ASGI app.
    """

    def __init__(self, app):
        self.app = app
        self._tasks: set[asyncio.Task] = set()
        self._is_cancelling = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        task, response = asyncio.current_task(), _ResponseState(send)
        self._tasks.add(task)
        try:
            await self.app(scope, receive, response.send)
        except asyncio.CancelledError:
            if not self._is_cancelling:
                raise
            await response.end_aborted(scope, receive)  # then the task ends (nothing left to cancel in it)
        finally:
            self._tasks.discard(task)

    def cancel_all(self) -> int:
        """Cancel every request in flight (each is answered as aborted); returns how many."""
        self._is_cancelling = True
        for task in self._tasks:
            task.cancel()
        return len(self._tasks)


class _ResponseState:
    """How far a request's response got: its ``send``, recording what went out."""

    def __init__(self, send):
        self._send = send
        self.is_started = self.is_complete = self.is_event_stream = False

    async def send(self, message: dict) -> None:
        await self._send(message)  # a cancelled send wrote nothing (uvicorn writes after its last await)
        if message["type"] == "http.response.start":
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            self.is_started, self.is_event_stream = True, content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.is_complete = True

    async def end_aborted(self, scope, receive) -> None:
        """Answer the request as aborted at shutdown, as far as its response allows."""
        if not self.is_started:
            await JSONResponse(shutdown_error(), status_code=503)(scope, receive, self._send)
        elif not self.is_complete:
            tail = protocol.sse_event(shutdown_error()) + protocol.SSE_DONE if self.is_event_stream else ""
            await self._send({"type": "http.response.body", "body": tail.encode()})


class Server(uvicorn.Server):
    """uvicorn's server of ``app`` with the bounded, quiet shutdown above.

    Args:
        app: the ASGI app (served behind :class:`OpenRequests`).
        grace_s: seconds the open requests may still run after SIGTERM or Ctrl-C (0: none).
        **options: the other keyword arguments of ``uvicorn.Config`` (host, port, log_level).
    """

    def __init__(self, app, grace_s: float, **options):
        self.requests, self.grace_s = OpenRequests(app), grace_s
        super().__init__(uvicorn.Config(self.requests, timeout_graceful_shutdown=grace_s + BACKSTOP_S, **options))

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace_s, self._end_open_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end_open_requests(self) -> None:
        num_open = self.requests.cancel_all()
        if num_open:
            log.warning("shutting down: aborted %d request(s) still open after --shutdown-timeout %g", num_open,
                        self.grace_s)

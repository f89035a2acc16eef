"""The HTTP boundary's errors: OpenAI-style error JSON, the body size limit, JSON bodies in UTF-8 and the API key.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status and
a message that names the bad field and what is allowed; the server keeps serving.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.serving.protocol import error_body


_SEND_UTF8 = "JSON over HTTP must be UTF-8 (RFC 8259 §8.1): send the body as UTF-8"
TOO_DEEP = ("the request body nests JSON arrays or objects too deeply to be parsed (Python's json stops near its "
            "recursion limit, about 1000 levels); a request of this API nests a few levels")


class APIError(Exception):
    """A request the server refuses (or, with status 5xx, failed to serve)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


class BodyTooLarge(Exception):
    """Raised by :class:`BodyLimit` while a body without Content-Length (chunked) streams in past the limit."""


def body_too_large(max_body_bytes: int) -> APIError:
    """The 413 of a body over the server's ``--max-body-bytes`` (one message for every way it is found)."""
    return APIError(413, f"the request body exceeds {max_body_bytes} bytes (the server's --max-body-bytes)",
                    code="request_too_large")


def install_error_handlers(app: FastAPI, max_body_bytes: int, on_error: Callable[[Request, int], None]) -> None:
    """Map every failure at the boundary to an OpenAI-style error response.

    Args:
        app: the app.
        max_body_bytes: the body limit (for the 413 message).
        on_error: called with the request and the status of each error response (for metrics).
    """

    def respond(request: Request, response: JSONResponse) -> JSONResponse:
        on_error(request, response.status_code)
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return respond(request, exc.response())

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return respond(request, validation_response(exc.errors(), request.headers.get("content-type")))

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge):
        return respond(request, body_too_large(max_body_bytes).response())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's "error parsing the body" wraps what reading or decoding the body raised: BodyLimit's
        # BodyTooLarge (a chunked body past the limit), a body that is not UTF-8 (json could not decode it), or
        # one nested too deeply for json (RecursionError)
        cause, error = exc.__cause__, None
        if isinstance(cause, BodyTooLarge):
            error = body_too_large(max_body_bytes)
        elif isinstance(cause, UnicodeDecodeError):
            error = encoding_error(cause.object)
        elif isinstance(cause, RecursionError):
            error = APIError(400, TOO_DEEP, code="invalid_value")
        error = error or APIError(exc.status_code, str(exc.detail), code=_slug(str(exc.detail)))
        return respond(request, error.response())


def validation_response(errors, content_type: str | None = None) -> JSONResponse:
    """400 naming every bad field (pydantic's ``loc``) and what it expected.

    A ValueError of a validator in :mod:`runtime.serving.protocol` is already one sentence naming
    the field and the value: it is the message as it is (without pydantic's "Value error, ").
    A body that is no JSON is said so, with no field; one sent without a JSON ``content_type`` (the request's
    header) as :func:`not_json_error` says it (FastAPI before 0.132 parses a body without the header before
    :func:`require_json_body` runs: its JSON error is answered as that check would have answered).
    """
    messages, params = [], []
    for error in errors:
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        field = ".".join(loc) or "body"
        params.append(field)
        if error.get("type") == "extra_forbidden":
            messages.append(f"unknown field '{field}': this server does not accept it")
        elif error.get("type") == "json_invalid":
            params[-1] = None
            messages.append(f"the request body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})"
                            if is_json_content_type(content_type) else not_json_error(content_type).message)
        elif isinstance(error.get("ctx", {}).get("error"), ValueError):  # the protocol's own validators
            messages.append(str(error["ctx"]["error"]))  # one sentence that names the field and the value
        else:
            messages.append(f"{field}: {error.get('msg')}, got {_preview(error.get('input'))}")
    return APIError(400, "; ".join(messages), param=params[0] if params else None, code="invalid_value").response()


class BodyLimit:
    """ASGI middleware: refuse bodies over ``max_bytes``: by Content-Length before reading, else (a
    chunked body) by counting the bytes as they stream in, raising :class:`BodyTooLarge` at the limit."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await body_too_large(self.max_bytes).response()(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)


def make_auth_check(api_key: str | None):
    """A FastAPI dependency that requires ``Authorization: Bearer <api_key>`` when a key is set."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", type_="authentication_error")

    return check


def encoding_error(body: bytes) -> APIError | None:
    """The one rule for request body encodings: None for UTF-8, else a 400 saying what the body is.

    JSON exchanged over HTTP is UTF-8 (RFC 8259 §8.1). Python's ``json`` would detect and
    accept UTF-16 and UTF-32 (named in the message); bytes that are no UTF-8 at all (Latin-1,
    cp1252) fail its decoding (the message names the first bad byte). A leading UTF-8 byte
    order mark is ignored, as the RFC allows.
    """
    encoding = json.detect_encoding(body) if body else "utf-8"
    if encoding not in ("utf-8", "utf-8-sig"):
        return APIError(400, f"the request body is encoded in {encoding.upper()}; {_SEND_UTF8}",
                        code="invalid_encoding")
    try:
        body.decode("utf-8", "surrogatepass")  # as json.loads decodes bytes
    except UnicodeDecodeError as e:
        return APIError(400, f"the request body is not UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start}; Latin-1 "
                             f"or another 8-bit encoding?); {_SEND_UTF8}", code="invalid_encoding")
    return None


def is_json_content_type(content_type: str | None) -> bool:
    """Whether a request's Content-Type header says JSON: ``application/json`` or ``application/*+json``,
    parameters (``charset``) aside, as FastAPI tells a JSON body. No header (None) is no JSON."""
    main, _, sub = (content_type or "").split(";", 1)[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def not_json_error(content_type: str | None) -> APIError:
    """The 400 of a body sent without a JSON Content-Type (none, or curl -d's form type)."""
    return APIError(400, f"the request body was not read as JSON (Content-Type: {content_type or 'none'}): send the "
                         "header 'Content-Type: application/json'", code="invalid_value")


async def require_json_body(request: Request) -> None:
    """A FastAPI dependency of the routes that take a JSON body: refuse a body without a JSON Content-Type
    (:func:`not_json_error`), then one that parsed but is not UTF-8 (UTF-16, UTF-32) by :func:`encoding_error`;
    bodies json cannot decode at all reach the error handler instead.

    The Content-Type rule is the server's own: FastAPI before 0.132 parsed a body without the header as JSON, and
    from 0.132 (``strict_content_type``) does not; either way such a body is refused here, with the same answer.
    """
    body = await request.body()  # already read (and cached) by FastAPI
    content_type = request.headers.get("content-type")
    if body and not is_json_content_type(content_type):
        raise not_json_error(content_type)
    error = encoding_error(body)
    if error is not None:
        raise error


def _preview(value) -> str:
    """The start of ``repr(value)``, for a message; a value nested too deeply for ``repr`` (a body that json just
    parsed, nearly at the recursion limit) is said so."""
    try:
        return repr(value)[:80]
    except RecursionError:
        return "a value nested too deeply to show"


def _slug(text: str) -> str:
    return "_".join(text.lower().split())[:40]

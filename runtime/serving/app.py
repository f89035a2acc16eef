"""The HTTP routes (FastAPI): OpenAI-compatible chat and completions, health, metrics, admin.

Routes:
    POST /v1/chat/completions, POST /v1/completions   streamed (SSE) or not
    GET  /v1/models
    GET  /health                                      200 while the engine thread runs, else 503; also what the
                                                      bundle allows (block size, adaptive masks or why not)
    GET  /metrics                                     Prometheus text format
    GET  /admin/tau, POST /admin/tau {"tau": x}       read / set the base tau live

Each generation request becomes a :class:`~runtime.serving.request_stream.RequestStream`; the
streamed and the non-streamed response both consume its text deltas.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from runtime.decode.admission import check_prompt_ids
from runtime.decode.params import DecodeParams, ParamError
from runtime.serving import protocol
from runtime.serving.engine_thread import EngineThread
from runtime.serving.errors import APIError, BodyLimit, install_error_handlers, make_auth_check, require_json_body
from runtime.serving.kv_memory import KVCacheOutOfMemory
from runtime.serving.metrics import ServerMetrics
from runtime.serving.protocol import SSE_DONE, ChatRequest, CompletionRequest, TauRequest, sse_event
from runtime.serving.request_stream import RequestStream
from runtime.text.tokenizer import Tokenizer


# ServerLimits field -> the option of python -m runtime.serve that sets it (named in errors).
LIMIT_FLAGS = {"max_body_bytes": "--max-body-bytes", "max_prompt_tokens": "--max-prompt-tokens",
               "max_tokens": "--max-tokens-limit", "default_max_tokens": "--default-max-tokens"}


@dataclass(frozen=True)
class ServerLimits:
    """Limits at the HTTP boundary.

    Attributes:
        max_body_bytes: largest request body.
        max_prompt_tokens: longest prompt in tokens (None: as much as the context allows).
        max_tokens: largest ``max_tokens`` a request may ask for.
        default_max_tokens: ``max_tokens`` of a request that sets none (cut to the context left).

    Raises:
        ValueError: a limit below 1, or ``default_max_tokens`` above ``max_tokens``.
    """

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens: int = 2048
    default_max_tokens: int = 256

    def __post_init__(self):
        for name, flag in LIMIT_FLAGS.items():
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} ({flag}) must be >= 1, got {value}")
        if self.default_max_tokens > self.max_tokens:  # else a request that sets none would pass the limit
            raise ValueError(f"the default max_tokens ({self.default_max_tokens}, {LIMIT_FLAGS['default_max_tokens']}) "
                             f"is above the largest one accepted ({self.max_tokens}, {LIMIT_FLAGS['max_tokens']}): "
                             "lower the first or raise the second")


@dataclass
class ServerContext:
    """What the routes need; the context budget and the vocabulary check are the engine's."""

    engine_thread: EngineThread
    tokenizer: Tokenizer
    metrics: ServerMetrics
    model_name: str
    limits: ServerLimits = ServerLimits()
    api_key: str | None = None


def make_app(ctx: ServerContext) -> FastAPI:
    """Build the app; its lifespan starts and stops the engine thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.engine_thread.start()
        yield
        await asyncio.to_thread(ctx.engine_thread.stop)  # the loop meanwhile ends the requests cancelled at shutdown

    app = FastAPI(title="mars-edge", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.add_middleware(BodyLimit, max_bytes=ctx.limits.max_body_bytes)
    install_error_handlers(app, ctx.limits.max_body_bytes, lambda request, status: _count_error(ctx, request, status))
    auth = [Depends(make_auth_check(ctx.api_key))]
    json_body = [*auth, Depends(require_json_body)]  # routes that take a JSON body

    @app.post("/v1/chat/completions", dependencies=json_body)
    async def chat(body: ChatRequest, request: Request):
        try:
            prompt_ids = ctx.tokenizer.encode_chat([m.as_template_message() for m in body.messages])
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        return await _generate(ctx, body, prompt_ids, "messages", request, chat=True)

    @app.post("/v1/completions", dependencies=json_body)
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            try:
                prompt_ids = ctx.tokenizer.encode(body.prompt)
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from e
        else:
            prompt_ids = list(body.prompt)
            try:
                check_prompt_ids(prompt_ids, ctx.engine_thread.engine.config.vocab_size)
            except ParamError as e:
                raise APIError(400, str(e), param="prompt", code="invalid_value") from e
        return await _generate(ctx, body, prompt_ids, "prompt", request, chat=False)

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "owned_by": "mars-edge"}]}

    @app.get("/health")
    async def health():
        loop, engine = ctx.engine_thread, ctx.engine_thread.engine  # engine: constants only, set at construction
        body = {"status": "ok" if loop.is_alive else "engine stopped", "model": ctx.model_name,
                "queue_depth": loop.queue_depth, "active_slots": loop.num_running,
                "default_tau": loop.default_tau, "base_tau": loop.base_tau,
                "block_size": engine.config.block_size,
                # the refusal a request with adaptive_masks would get (None: they act), for clients to show first
                "can_adaptive_masks": engine.why_no_adaptive_masks is None,
                "why_no_adaptive_masks": engine.why_no_adaptive_masks}
        return JSONResponse(body, status_code=200 if loop.is_alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    @app.get("/admin/tau", dependencies=auth)
    async def get_tau():
        return _tau_state(ctx)

    @app.post("/admin/tau", dependencies=json_body)
    async def set_tau(body: TauRequest):
        try:
            await asyncio.to_thread(ctx.engine_thread.set_base_tau, body.tau)
        except ValueError as e:
            raise APIError(400, str(e), param="tau", code="invalid_value") from e
        return _tau_state(ctx) | {"base_tau": body.tau}

    return app


def _count_error(ctx: ServerContext, request: Request, status: int) -> None:
    if request.url.path.startswith("/v1/") and request.method == "POST":
        ctx.metrics.record_outcome("rejected" if status < 500 else "error")


def _tau_state(ctx: ServerContext) -> dict:
    loop, policy = ctx.engine_thread, ctx.engine_thread.policy
    return {"base_tau": loop.base_tau, "default_tau": loop.default_tau, "tau_min": policy.tau_min,
            "tau_max": policy.tau_max, "queue_low": policy.queue_low, "queue_high": policy.queue_high}


async def _generate(ctx: ServerContext, body, prompt_ids: list[int], prompt_field: str, request: Request,
                    chat: bool):
    max_new = _check_budget(ctx, prompt_ids, body, prompt_field)
    try:
        params = DecodeParams(tau=body.tau, mode=body.mode, draft=body.draft, adaptive_masks=body.adaptive_masks,
                              max_new_tokens=max_new, block_size=body.block_size, temperature=body.temperature,
                              top_p=body.top_p, top_k=body.top_k, seed=body.seed)
    except ParamError as e:
        raise APIError(400, str(e), param=e.field, code="invalid_value") from e
    gen = RequestStream(ctx.engine_thread, ctx.tokenizer, ctx.metrics, prompt_ids, params, body.stop_strings)
    try:
        await gen.start()
    except ParamError as e:  # e.g. a block_size above the bundle's B
        raise APIError(400, str(e), param=e.field, code="invalid_value") from e
    except ValueError as e:
        raise APIError(400, str(e), param=prompt_field, code="invalid_value") from e
    except RuntimeError as e:
        raise engine_failure(e) from e
    if body.stream:
        async def close():  # also runs when the client left before the stream started
            gen.close()
        return StreamingResponse(_stream(ctx, gen, body, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(close))
    text = await _collect(gen, request)
    if text is None:  # the client left; nobody reads this
        return Response(status_code=499)
    usage = protocol.usage(len(prompt_ids), gen.num_tokens)
    make = protocol.chat_response if chat else protocol.completion_response
    return make("chatcmpl-" + gen.request_id if chat else "cmpl-" + gen.request_id, ctx.model_name, text,
                gen.finish_reason, usage,
                gen.mars_info(body.return_token_ids, gen.step_tokens if body.return_step_tokens else None))


def _check_budget(ctx: ServerContext, prompt_ids: list[int], body, prompt_field: str) -> int:
    """The max_new_tokens to run with; 400 if the prompt or the request's max_tokens does not fit
    (named as the client sent it: ``max_tokens`` or ``max_completion_tokens``)."""
    limits, num_prompt, engine = ctx.limits, len(prompt_ids), ctx.engine_thread.engine
    requested, field = body.requested_max_tokens, body.max_tokens_field
    max_prompt = longest_prompt(engine)
    if limits.max_prompt_tokens is not None:
        max_prompt = min(max_prompt, limits.max_prompt_tokens)
    if num_prompt > max_prompt:
        raise APIError(400, f"{prompt_field}: the prompt has {num_prompt} tokens; this server accepts at most "
                            f"{max_prompt}", param=prompt_field, code="context_length_exceeded")
    if requested is not None and requested > limits.max_tokens:
        raise APIError(400, f"{field} must be in 1..{limits.max_tokens} (the server's --max-tokens-limit), "
                            f"got {requested}", param=field, code="invalid_value")
    room = engine.room(num_prompt)
    if requested is not None and requested > room:
        raise APIError(400, f"the prompt ({num_prompt} tokens) + {field} ({requested}) + window "
                            f"({engine.config.window}) exceeds the context of {engine.cache.max_len} tokens; "
                            f"lower {field} to {room} or shorten the prompt", param=field,
                       code="context_length_exceeded")
    return requested if requested is not None else min(limits.default_max_tokens, room)


def longest_prompt(engine) -> int:
    """The most prompt tokens a slot of ``engine`` takes: :meth:`~runtime.decode.engine.Engine.room` of an empty
    prompt less one, so that at least one token is left to generate."""
    return engine.room(0) - 1


def check_limits_fit(limits: ServerLimits, engine) -> None:
    """Refuse limits the engine's slots cannot honour (before the server starts).

    Raises:
        ValueError: ``max_prompt_tokens`` above :func:`longest_prompt` (named with its option, like the
            slot's own limit ``--max-seq-len``, never silently capped).
    """
    longest, flag = longest_prompt(engine), LIMIT_FLAGS["max_prompt_tokens"]
    if limits.max_prompt_tokens is not None and limits.max_prompt_tokens > longest:
        raise ValueError(f"max_prompt_tokens ({flag}) {limits.max_prompt_tokens} exceeds the {longest} tokens a "
                         f"prompt can have (the {engine.cache.max_len} positions a slot holds, --max-seq-len, less the "
                         f"window {engine.config.window} and one token to generate); give at most {longest}")


async def _collect(gen: RequestStream, request: Request) -> str | None:
    """All text deltas joined; None (and the request aborted) if the client disconnects first."""
    parts: list[str] = []

    async def join():
        async for delta in gen.deltas():
            parts.append(delta)

    joiner, watcher = asyncio.create_task(join()), asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({joiner, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled (a shutdown past --shutdown-timeout)
        watcher.cancel()
        is_left = not joiner.done()
        if is_left:
            joiner.cancel()
            gen.close()
    if is_left:
        return None
    try:
        joiner.result()
    except RuntimeError as e:
        raise engine_failure(e) from e
    return "".join(parts)


def engine_failure(e: RuntimeError) -> APIError:
    """The error answer of a request the engine failed: 507 where the KV cache could not grow for it
    (:class:`~runtime.serving.kv_memory.KVCacheOutOfMemory`), else a 500 ``engine_error``."""
    if isinstance(e, KVCacheOutOfMemory):
        return APIError(e.status, str(e), code=e.code, type_="server_error")
    return APIError(500, str(e), code="engine_error", type_="server_error")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(ctx: ServerContext, gen: RequestStream, body, chat: bool):
    """Server-sent events: one chunk per text delta, a final chunk with the finish reason, [DONE]."""
    rid = ("chatcmpl-" if chat else "cmpl-") + gen.request_id
    model = ctx.model_name

    def chunk(text: str, finish_reason: str | None = None, mars: dict | None = None) -> str:
        if chat:
            delta = {"content": text} if finish_reason is None else {}
            return sse_event(protocol.chat_chunk(rid, model, delta, finish_reason, mars))
        return sse_event(protocol.completion_chunk(rid, model, text, finish_reason, mars))

    try:
        if chat:
            yield sse_event(protocol.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        async for delta in gen.deltas():
            yield chunk(delta, mars={"step_tokens": gen.take_step_tokens()} if body.return_step_tokens else None)
        yield chunk("", gen.finish_reason,
                    gen.mars_info(body.return_token_ids, gen.take_step_tokens() if body.return_step_tokens else None))
        if body.include_usage:
            object_ = "chat.completion.chunk" if chat else "text_completion"
            usage = protocol.usage(len(gen.prompt_ids), gen.num_tokens)
            yield sse_event(protocol.usage_chunk(rid, model, object_, usage))
    except RuntimeError as e:  # headers are sent: the error goes in the stream
        ctx.metrics.record_outcome("error")
        error = engine_failure(e)
        yield sse_event(protocol.error_body(error.message, error.type, None, error.code))
    finally:
        gen.close()
    yield SSE_DONE

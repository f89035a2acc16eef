"""The OpenAI protocol's edges: null fields, ``logprobs: false``, the field a limit error names, bodies that are no JSON.

Tier 1 on the request models, then the tiny server over HTTP for what the client sees.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pydantic import ValidationError
from starlette.requests import Request

from runtime.serving.errors import (TOO_DEEP, APIError, is_json_content_type, require_json_body,
                                    validation_response)
from runtime.serving.protocol import ChatRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]
NULLABLE = ["model", "max_tokens", "stop", "temperature", "top_p", "seed", "n", "stream", "stream_options", "user",
            "presence_penalty", "frequency_penalty", "logprobs", "tau", "mode", "draft", "block_size", "top_k",
            "return_token_ids", "return_step_tokens"]
NOT_JSON = "the request body was not read as JSON (Content-Type: {}): send the header 'Content-Type: application/json'"
UNSUPPORTED = ["logit_bias", "tools", "tool_choice", "functions", "function_call", "response_format",
               "parallel_tool_calls", "service_tier"]  # OpenAI fields this server does not know


def test_a_null_field_takes_its_default():
    """The OpenAI spec lets clients send null for an optional field: it means "not set"."""
    sent = ChatRequest.model_validate({"messages": MESSAGES, "max_completion_tokens": None,
                                       **dict.fromkeys(NULLABLE)})
    assert sent == ChatRequest.model_validate({"messages": MESSAGES})
    sent = CompletionRequest.model_validate({"prompt": "hi", "echo": None, "suffix": None, **dict.fromkeys(NULLABLE)})
    assert sent == CompletionRequest.model_validate({"prompt": "hi"})
    assert ChatRequest.model_validate({"messages": MESSAGES, "stream_options": {"include_usage": None}})


def test_the_api_takes_the_temperatures_decode_params_take():
    """One limit (runtime.decode.params.MAX_TEMPERATURE): runtime.generate accepted --temperature 3, which the
    server refused."""
    from runtime.decode.params import MAX_TEMPERATURE, DecodeParams, ParamError

    assert MAX_TEMPERATURE == 2.0  # OpenAI's
    for temperature in (0.0, MAX_TEMPERATURE):
        assert ChatRequest.model_validate({"messages": MESSAGES, "temperature": temperature})
        assert DecodeParams(temperature=temperature).temperature == temperature
    with pytest.raises(ValidationError, match="less than or equal to 2"):
        ChatRequest.model_validate({"messages": MESSAGES, "temperature": 2.01})
    with pytest.raises(ParamError, match=r"temperature must be a number in 0\.\.2"):
        DecodeParams(temperature=2.01)


def test_a_null_unknown_field_is_not_set_and_a_value_is_refused():
    """Clients send null for fields this server does not know (tools, logit_bias; in an assistant
    message echoed back, tool_calls): null means "not set"; a value is still refused."""
    message = MESSAGES[0] | {"tool_calls": None, "refusal": None, "function_call": None}
    sent = ChatRequest.model_validate({"messages": [message], **dict.fromkeys(UNSUPPORTED)})
    assert sent == ChatRequest.model_validate({"messages": MESSAGES})
    assert CompletionRequest.model_validate({"prompt": "hi", "best_of": None, "logit_bias": None}) == \
        CompletionRequest.model_validate({"prompt": "hi"})
    for body in ({"messages": MESSAGES, "tools": []}, {"messages": [message | {"tool_calls": []}]}):
        with pytest.raises(ValidationError, match="extra_forbidden"):
            ChatRequest.model_validate(body)
    with pytest.raises(ValidationError, match="messages"):  # a required field stays required
        ChatRequest.model_validate({"messages": None})


def chat(server, **fields):
    return server.http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
                            | fields)


def test_null_fields_and_logprobs_false_are_served(tiny_server):
    r = chat(tiny_server, **dict.fromkeys(["temperature", "top_p", "stop", "seed", "n", "stream", "stream_options"]),
             logprobs=False)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = tiny_server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": None})
    assert r.status_code == 200, r.text
    assert chat(tiny_server, **dict.fromkeys(UNSUPPORTED)).status_code == 200
    r = chat(tiny_server, tools=[])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert r.json()["error"]["message"] == "unknown field 'tools': this server does not accept it"


@pytest.mark.parametrize("route, logprobs", [("chat/completions", True), ("completions", 1), ("completions", 0)])
def test_logprobs_asked_for_are_a_clear_400(tiny_server, route, logprobs):
    body = {"max_tokens": 2, "logprobs": logprobs} | ({"messages": MESSAGES} if route.startswith("chat")
                                                      else {"prompt": "hi"})
    r = tiny_server.http.post(f"/v1/{route}", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert r.json()["error"]["message"] == ("logprobs are not supported (this server returns no log probabilities): "
                                            f"send false or leave it out, got {str(logprobs).lower()}")


@pytest.mark.parametrize("max_tokens", [5000, 600])  # over --max-tokens-limit (2048); over the 512-token context
def test_a_limit_error_names_the_field_the_client_sent(tiny_server, max_tokens):
    r = chat(tiny_server, max_completion_tokens=max_tokens)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_completion_tokens" and "max_completion_tokens" in \
        error["message"] and "max_tokens " not in error["message"], error
    error = chat(tiny_server, max_tokens=max_tokens).json()["error"]
    assert error["param"] == "max_tokens" and "max_completion_tokens" not in error["message"]


def test_a_body_that_is_no_json_says_so(tiny_server):
    r = tiny_server.http.post("/v1/chat/completions", content=b'{"messages": [}',
                              headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] is None
    assert error["message"].startswith("the request body is not valid JSON (")
    for content in (b'{"prompt": "hi"}', b'{"prompt": [}'):  # JSON or not: the type is refused first
        for content_type in (None, "application/x-www-form-urlencoded", "text/plain"):  # curl -d sends the form type
            r = tiny_server.http.post("/v1/completions", content=content,
                                      headers={"content-type": content_type} if content_type else {})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] is None
            assert error["message"] == NOT_JSON.format(content_type or "none"), (content, content_type)
    for content_type in ("application/json; charset=utf-8", "application/vnd.mars+json"):
        r = tiny_server.http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                                  headers={"content-type": content_type})
        assert r.status_code == 200, (content_type, r.text)


def test_a_body_nested_too_deeply_is_a_400_that_says_so(tiny_server):
    """100000 nested lists (alone, as messages, as a prompt, as a message's content): json stops at its recursion
    limit, which FastAPI answered as a bare "There was an error parsing the body"; the 400 says what is wrong, and
    the server serves on."""
    deep = "[" * 100000 + "]" * 100000
    for route, body in (("/v1/chat/completions", deep), ("/v1/chat/completions", f'{{"messages": {deep}}}'),
                        ("/v1/completions", f'{{"prompt": {deep}}}'), ("/admin/tau", f'{{"tau": {deep}}}'),
                        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {deep}}}]}}')):
        r = tiny_server.http.post(route, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"] == TOO_DEEP, (route, body[:40], r.text)
    assert tiny_server.health()["status"] == "ok"
    assert tiny_server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_field_nested_too_deeply_to_show_is_still_named():
    """A body json parsed just below its recursion limit can be too deep for repr() in the error handler, a level
    or more further down: the 400 names the field without showing the value (it was a RecursionError, a 500)."""
    deep = []
    for _ in range(100000):
        deep = [deep]
    errors = [{"type": "string_type", "loc": ("body", "prompt"), "msg": "Input should be a valid string",
               "input": deep}]
    response = validation_response(errors, "application/json")
    assert response.status_code == 400
    assert json.loads(response.body)["error"]["message"] == \
        "prompt: Input should be a valid string, got a value nested too deeply to show"


@pytest.mark.parametrize("content_type, is_json", [
    ("application/json", True), ("Application/JSON; charset=utf-8", True), ("application/problem+json", True),
    (None, False), ("", False), ("text/plain", False), ("application/x-www-form-urlencoded", False),
    ("text/json", False), ("application/jsonp", False)])
def test_json_content_types(content_type, is_json):
    assert is_json_content_type(content_type) is is_json


def posted(body: bytes, content_type: str | None) -> Request:
    """A POST request as a route's dependency sees it."""
    headers = [(b"content-type", content_type.encode())] if content_type else []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive)


def test_a_json_body_without_its_content_type_is_refused_by_the_servers_own_rule():
    """FastAPI before 0.132 parsed a body sent without Content-Type as JSON, later versions do not (strict
    Content-Type): the server refuses it itself, in its dependency, whichever FastAPI runs it. Where an old FastAPI's
    parse of such a body fails before the dependency runs, its JSON error is answered as the dependency would."""
    with pytest.raises(APIError) as refused:
        asyncio.run(require_json_body(posted(b'{"prompt": "hi"}', None)))
    assert (refused.value.status, refused.value.param, refused.value.message) == (400, None, NOT_JSON.format("none"))
    asyncio.run(require_json_body(posted(b'{"prompt": "hi"}', "application/json")))  # accepted
    asyncio.run(require_json_body(posted(b"", None)))  # no body: left to the request model, which names the field
    invalid = [{"type": "json_invalid", "loc": ("body", 11), "msg": "JSON decode error", "input": {},
                "ctx": {"error": "Expecting value"}}]
    for content_type, message in ((None, NOT_JSON.format("none")),
                                  ("application/json", "the request body is not valid JSON (Expecting value)")):
        assert json.loads(validation_response(invalid, content_type).body)["error"]["message"] == message

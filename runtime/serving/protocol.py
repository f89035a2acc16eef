"""OpenAI-compatible request models and response bodies (chat and completions, streamed or not).

Requests are pydantic models that refuse unknown fields and out-of-range values; the
server turns a validation failure into an OpenAI-style 400 naming the field. MARS extras
(sent by the openai client through ``extra_body``):

- ``tau``: confidence threshold for this request (>= 0; >= 1 is greedy AR). Absent: the
  request follows the server's live default tau (which the load policy may lower).
- ``mode``: ``threshold`` (MARS, default), ``ar`` (one token per step) or ``verify``
  (lossless drafts, greedy only).
- ``draft``: the draft source of verify and threshold mode: ``masks`` (default), ``lookup``
  (prompt lookup over the prompt and the generated text) or ``both``; ``ar`` mode takes
  ``masks`` only, and lookup drafts are greedy only.
- ``adaptive_masks``: feed mask tokens only while they pay (``runtime.decode.mask_backoff``): after a
  step whose masks gained no token, steps without masks back off 1, 2 .. 16 at a time (default false).
  Where every step is W wide (``--scheme block``, a TensorRT engine, a fixed-window bundle) the engine
  refuses it: a 400 naming the fix (``runtime.decode.admission.why_no_adaptive_masks``).
- ``block_size``: most tokens accepted per decode step, 1..the bundle's B (absent: B).
- ``top_k``: sampling filter (0 = off).
- ``return_token_ids``: add the generated ids to the response's ``mars`` object.
- ``return_step_tokens``: add ``step_tokens``, the tokens accepted by each decode forward
  in order, to the ``mars`` object. Streamed, every content chunk carries in its own
  ``mars`` object the counts of the forwards whose tokens it is the first to show, and the
  final chunk the rest (forwards whose tokens show no text, e.g. the end token); the lists
  joined over the stream are the non-streamed list (its length is ``num_forwards``, its sum
  the completion tokens).

A field sent as null is as if not sent (the OpenAI spec allows null for its optional fields, and
clients send it for fields this server does not know, e.g. ``tools``: a value there is refused);
``logprobs`` may be false (log probabilities are not supported). ``model`` is not checked:
the server serves one model, whatever the name.

Responses carry a ``mars`` object with the decode forwards and tokens per forward (TPF).
Deliberate difference from OpenAI: ``temperature`` defaults to 0 (greedy), because MARS
acceptance and its lossless modes are defined over the argmax.
"""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from runtime.decode.params import MAX_TEMPERATURE

MAX_STOP_STRINGS = 4


class _RequestObject(BaseModel):
    """An object of a request body: JSON types not coerced, and null for any field means "not set"
    (OpenAI clients send null for what they do not set, also for fields this server does not know):
    a null is dropped before validation unless the field is required, so a known field takes its
    default and an unknown one is absent; an unknown field with a value is refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k in fields and fields[k].is_required()}


class StreamOptions(_RequestObject):
    include_usage: bool = False


class _GenerationRequest(_RequestObject):
    """Fields shared by chat and completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None  # chat: a bool; completions: a count; only "none" is served
    # MARS extras
    tau: float | None = None  # checked by DecodeParams (runtime.decode.params.check_tau)
    mode: Literal["threshold", "ar", "verify"] = "threshold"
    draft: Literal["masks", "lookup", "both"] = "masks"
    adaptive_masks: bool = False
    block_size: int | None = Field(None, ge=1)  # at most the bundle's B (checked by the engine)
    top_k: int = Field(0, ge=0)
    return_token_ids: bool = False
    return_step_tokens: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n must be 1 (this server returns one choice per request), got {n}")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float, info: ValidationInfo) -> float:
        if value != 0:
            raise ValueError(f"{info.field_name} must be 0 (penalties are not supported), got {value}")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs):
        if logprobs is not False:  # None never reaches a validator
            raise ValueError(f"logprobs are not supported (this server returns no log probabilities): send false "
                             f"or leave it out, got {json.dumps(logprobs)}")
        return logprobs

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty "
                             f"strings, got {stop!r}")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def max_tokens_field(self) -> str:
        """The field that sets the completion's length, as the client sent it (named in errors)."""
        return "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return getattr(self, self.max_tokens_field)


class TextPart(_RequestObject):
    type: Literal["text"]
    text: str


class ChatMessage(_RequestObject):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def max_tokens_field(self) -> str:
        """``max_completion_tokens`` when sent (it wins), else ``max_tokens``."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Literal[False] = False
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"prompt must be one prompt per request (a string or a list of token ids), got "
                                 f"{len(prompt)}")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: give at least one character or token id")
        return prompt


class TauRequest(_RequestObject):
    tau: float


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI-style error JSON."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse_event(payload: dict) -> str:
    """One server-sent event carrying ``payload`` (a chunk, or an error ending a stream)."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"  # the last event of every stream


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(request_id: str, object_: str, model: str, choices: list, **extra) -> dict:
    """The fields every response and chunk shares, then its choices and any extra fields."""
    return {"id": request_id, "object": object_, "created": int(time.time()), "model": model, "choices": choices,
            **extra}


def _mars_field(mars: dict | None) -> dict:
    return {"mars": mars} if mars is not None else {}


def chat_response(request_id: str, model: str, text: str, finish_reason: str, usage_: dict, mars: dict) -> dict:
    message = {"role": "assistant", "content": text}
    return _envelope(request_id, "chat.completion", model,
                     [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
                     usage=usage_, mars=mars)


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None,
               mars: dict | None = None) -> dict:
    return _envelope(request_id, "chat.completion.chunk", model,
                     [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                     **_mars_field(mars))


def completion_response(request_id: str, model: str, text: str, finish_reason: str, usage_: dict,
                        mars: dict) -> dict:
    return _envelope(request_id, "text_completion", model,
                     [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
                     usage=usage_, mars=mars)


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None,
                     mars: dict | None = None) -> dict:
    return _envelope(request_id, "text_completion", model,
                     [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
                     **_mars_field(mars))


def usage_chunk(request_id: str, model: str, object_: str, usage_: dict) -> dict:
    return _envelope(request_id, object_, model, [], usage=usage_)

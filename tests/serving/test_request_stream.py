"""Tier 1: a RequestStream fed scripted engine outputs (no model, no HTTP).

The tokenizer is the tiny models' byte-level one (one token per byte), so the token that
completes a stop string is known from the text alone.
"""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import make_tokenizer

from runtime.decode.engine import StepOutput
from runtime.decode.params import DecodeParams, GenerationResult
from runtime.serving.engine_thread import ADMITTED
from runtime.serving.metrics import ServerMetrics
from runtime.serving.request_stream import RequestStream
from runtime.text.tokenizer import Tokenizer

ANSWER = "She sold 72 clips.\n\nQuestion: how many"
STOP = "\n\nQuestion"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("byte-tokenizer")
    make_tokenizer().save_pretrained(path)
    return Tokenizer(path)


class ScriptedEngineThread:
    """Stands in for the engine thread: admits each submission, then delivers ``ids`` as one
    engine output per forward of ``num_per_forward`` tokens (the last one finished, ``length``)."""

    def __init__(self, ids: list[int], num_per_forward: int):
        self.ids, self.num_per_forward, self.aborted = ids, num_per_forward, []

    def submit(self, submission) -> None:
        submission.deliver(ADMITTED)
        chunks = [self.ids[i:i + self.num_per_forward] for i in range(0, len(self.ids), self.num_per_forward)]
        for forward, chunk in enumerate(chunks, 1):
            is_last = forward == len(chunks)
            result = GenerationResult(token_ids=self.ids[:forward * self.num_per_forward], num_forwards=forward)
            submission.deliver(StepOutput(submission.request_id, chunk, is_last, "length" if is_last else None,
                                          result))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def run(tokenizer, ids, num_per_forward, stops, metrics=None):
    """The text, usage count, reported ids, step_tokens and finish reason of one scripted request."""
    engine_thread = ScriptedEngineThread(ids, num_per_forward)
    gen = RequestStream(engine_thread, tokenizer, metrics or ServerMetrics(1), [1],
                        DecodeParams(max_new_tokens=len(ids)), stops)

    async def consume():
        await gen.start()
        return "".join([delta async for delta in gen.deltas()])

    text = asyncio.run(consume())
    return text, gen.num_tokens, gen.mars_info(return_token_ids=True)["token_ids"], gen.step_tokens, gen.finish_reason


@pytest.mark.parametrize("num_per_forward", [3, 5, 6, 100])  # none divides the 28 tokens through the stop
def test_counts_end_at_the_token_that_completes_the_stop_string(tokenizer, num_per_forward):
    """Tokens a forward accepted after the stop string are not part of the completion: the
    usage count, token_ids and step_tokens are those of one token per forward (AR)."""
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    num_through_stop = len(tokenizer.encode(ANSWER[:ANSWER.index(STOP) + len(STOP)], add_special_tokens=False))
    one_per_forward = run(tokenizer, ids, 1, [STOP])
    assert one_per_forward[:3] == ("She sold 72 clips.", num_through_stop, ids[:num_through_stop])
    text, num_tokens, token_ids, step_tokens, finish_reason = run(tokenizer, ids, num_per_forward, [STOP])
    assert (text, num_tokens, token_ids, finish_reason) == (*one_per_forward[:3], "stop")
    assert sum(step_tokens) == num_tokens and len(step_tokens) == -(-num_through_stop // num_per_forward)


def test_without_a_stop_string_every_token_counts(tokenizer):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    assert len(ids) == 38
    assert run(tokenizer, ids, 3, []) == (ANSWER, 38, ids, [3] * 12 + [2], "length")


@pytest.mark.parametrize("stops", [[STOP], []])
def test_the_metrics_count_what_usage_reports(tokenizer, stops):
    """mars_generated_tokens counts the completion tokens of usage (none accepted after a stop
    string), mars_decode_forwards the forwards of the response's num_forwards."""
    ids, metrics = tokenizer.encode(ANSWER, add_special_tokens=False), ServerMetrics(1)
    _, num_tokens, _, step_tokens, _ = run(tokenizer, ids, 5, stops, metrics)
    values = {name: metrics.registry.get_sample_value(name) for name in ("mars_generated_tokens_total",
                                                                         "mars_decode_forwards_total")}
    assert values == {"mars_generated_tokens_total": num_tokens, "mars_decode_forwards_total": len(step_tokens)}

"""One request seen from the event loop: engine outputs in, final text deltas out.

The engine thread delivers items to the request's asyncio queue; :meth:`RequestStream.deltas`
turns token ids into text (never splitting a character), cuts at stop strings, and ends
with the finish reason. The streamed response sends each delta as it comes; the
non-streamed response joins the same deltas, so the two texts are equal by construction.

Leaving :meth:`RequestStream.deltas` before the end (client gone, stop string found) aborts
the request in the engine, which frees its KV slot at the engine's next turn.

The request's tokens and forwards are counted in the metrics here, as it reads them, so the
counters count what the responses report (usage, ``mars.num_forwards``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from runtime.decode.params import DecodeParams, tokens_per_forward
from runtime.serving.engine_thread import ADMITTED, EngineThread, Submission
from runtime.serving.metrics import ServerMetrics
from runtime.text.detokenize import TextStream
from runtime.text.tokenizer import Tokenizer


class RequestStream:
    """A request in flight.

    Args:
        engine_thread: the engine thread.
        tokenizer: the bundle's tokenizer.
        metrics: where the outcome, tokens and forwards are counted.
        prompt_ids: the prompt's ids.
        params: decoding parameters.
        stops: stop strings.
    """

    def __init__(self, engine_thread: EngineThread, tokenizer: Tokenizer, metrics: ServerMetrics,
                 prompt_ids: list[int], params: DecodeParams, stops: list[str]):
        self.request_id = uuid.uuid4().hex
        self.prompt_ids = prompt_ids
        self.text = TextStream(tokenizer, stops)
        self.finish_reason: str | None = None
        self.num_forwards = 0
        self.step_tokens: list[int] = []  # tokens accepted by each decode forward, in order
        self._num_steps_taken = 0  # leading entries of step_tokens already handed out by take_step_tokens
        self._engine_thread, self._metrics, self._params = engine_thread, metrics, params
        self._queue: asyncio.Queue = asyncio.Queue()
        self._is_open = False  # submitted to the engine and not finished there

    async def start(self) -> None:
        """Submit to the engine and wait until it admits the request.

        Raises:
            ValueError: the engine refused it (the message says why).
        """
        loop = asyncio.get_running_loop()

        def deliver(item) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(self._queue.put_nowait, item)

        self._is_open = True
        self._engine_thread.submit(Submission(self.request_id, self.prompt_ids, self._params, deliver))
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        if isinstance(item, Exception):  # the HTTP layer answers (and counts) the refusal
            self._is_open = False
            raise item
        assert item == ADMITTED

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas until the end; then :attr:`finish_reason` is ``"stop"`` or ``"length"``.

        Raises:
            RuntimeError: the engine failed.
        """
        try:
            while self.finish_reason is None:
                out = await self._queue.get()
                if isinstance(out, Exception):  # the HTTP layer answers (and counts) the failure
                    self._is_open = False
                    raise out
                delta, num_taken = self._add_until_stop(out.new_token_ids)
                self.step_tokens.append(num_taken)  # one engine output per decode forward
                self._metrics.record_output(num_taken, out.result.num_forwards - self.num_forwards)
                self.num_forwards = out.result.num_forwards
                if self.text.is_stopped:
                    self.finish_reason = "stop"  # a stop string: the engine sequence is aborted below
                elif out.finished:
                    self._is_open = False
                    self.finish_reason = out.finish_reason
                    delta += self.text.finish()
                    if self.text.is_stopped:
                        self.finish_reason = "stop"
                if delta:
                    yield delta
            self._metrics.record_outcome(self.finish_reason)
        finally:
            self.close()

    def _add_until_stop(self, token_ids: list[int]) -> tuple[str, int]:
        """Feed one forward's ids one at a time, up to the one that completes a stop string; return
        the text and the number of ids taken. Ids the forward accepted after that one are not part
        of the completion (usage, ``token_ids``, ``step_tokens``), so the counts and the text do
        not depend on how many tokens a forward accepted."""
        deltas = []
        for num_taken, token_id in enumerate(token_ids, 1):
            deltas.append(self.text.add([token_id]))
            if self.text.is_stopped:
                return "".join(deltas), num_taken
        return "".join(deltas), len(token_ids)

    def close(self) -> None:
        """Abort the request in the engine unless it already finished there (idempotent)."""
        if self._is_open:
            self._is_open = False
            self._engine_thread.abort(self.request_id)
            if self.finish_reason is None:
                self._metrics.record_outcome("aborted")

    @property
    def num_tokens(self) -> int:
        """Generated tokens so far, up to the one that completed a stop string (for usage counts)."""
        return len(self.text.detokenizer.token_ids)

    def take_step_tokens(self) -> list[int]:
        """The accept counts of the decode forwards received since the last call (a streamed chunk's share)."""
        taken = self.step_tokens[self._num_steps_taken:]
        self._num_steps_taken = len(self.step_tokens)
        return taken

    def mars_info(self, return_token_ids: bool, step_tokens: list[int] | None = None) -> dict:
        """The MARS extras of the response: decode forwards, TPF, the ids if asked, and
        ``step_tokens`` (accept counts per forward) when given."""
        info = {"num_forwards": self.num_forwards, "tpf": tokens_per_forward(self.num_tokens, self.num_forwards)}
        if return_token_ids:
            info["token_ids"] = list(self.text.detokenizer.token_ids)
        return info | ({"step_tokens": step_tokens} if step_tokens is not None else {})

"""Streaming detokenization and stop strings, for the server (and anything else that streams).

Two small state machines, fed in order:

- :class:`Detokenizer`: token ids in, text out. It never emits part of a multi-byte
  character (it waits while the decoded text ends in U+FFFD), and what it emits,
  concatenated, equals ``Tokenizer.decode(all ids)``: :meth:`Detokenizer.finish` emits the
  difference (for example a character cut off by ``max_tokens`` decodes to U+FFFD there,
  exactly as the one-shot decode writes it).
- :class:`StopMatcher`: text in, text out. It holds back any tail of the text that could
  be the start of a stop string, cuts the text before the first stop string it finds and
  reports that the sequence must stop (OpenAI semantics: the stop string is not returned).

The server builds the non-streamed text by concatenating the same deltas it would have
streamed, so streamed text == non-streamed text by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from runtime.text.tokenizer import Tokenizer


class Detokenizer:
    """Incremental decode of one sequence of generated ids.

    Args:
        tokenizer: the bundle's tokenizer.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._step = tokenizer.make_decode_stream(skip_special_tokens=True)
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far

    def add(self, token_ids: Iterable[int]) -> str:
        """Feed new ids; return the text they complete ("" while a character is still open)."""
        delta = []
        for token_id in token_ids:
            self.token_ids.append(token_id)
            chunk = self._step(token_id)
            if chunk:
                delta.append(chunk)
        new_text = "".join(delta)
        self.text += new_text
        return new_text

    def finish(self) -> str:
        """The text still held back, so that all emitted text equals the one-shot decode."""
        full = self._tokenizer.decode(self.token_ids)
        # For byte-level tokenizers the emitted text is always a prefix of the one-shot decode;
        # if a tokenizer ever broke that, streamed text already sent cannot be taken back.
        rest = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += rest
        return rest


class StopMatcher:
    """Find stop strings in a text that arrives in pieces.

    Args:
        stops: the stop strings (each non-empty); empty means none.
    """

    def __init__(self, stops: Sequence[str] = ()):
        assert all(stops), "stop strings must be non-empty (validated at the API boundary)"
        self.stops = tuple(stops)
        self._held = ""
        self.is_stopped = False

    def feed(self, text: str) -> str:
        """Add ``text``; return what is safe to emit. Sets :attr:`is_stopped` at a stop string."""
        assert not self.is_stopped
        buffer = self._held + text
        found = [i for i in (buffer.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self._held, self.is_stopped = "", True
            return buffer[:min(found)]
        keep = max((_overlap(buffer, stop) for stop in self.stops), default=0)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """The held-back tail, once the sequence ended without a stop string."""
        held, self._held = self._held, ""
        return held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``stop``."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0


class TextStream:
    """Detokenizer then stop matcher: ids in, final text deltas out, for one sequence.

    Args:
        tokenizer: the bundle's tokenizer.
        stops: stop strings.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        self.detokenizer = Detokenizer(tokenizer)
        self.matcher = StopMatcher(stops)

    @property
    def is_stopped(self) -> bool:
        """True once a stop string was found; the engine should abort the sequence."""
        return self.matcher.is_stopped

    def add(self, token_ids: Iterable[int]) -> str:
        """Feed new ids; return the text that may be sent now."""
        return self.matcher.feed(self.detokenizer.add(token_ids))

    def finish(self) -> str:
        """The sequence ended (end token or length): return the rest of the text."""
        if self.is_stopped:
            return ""
        text = self.matcher.feed(self.detokenizer.finish())
        return text if self.is_stopped else text + self.matcher.flush()

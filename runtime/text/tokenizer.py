"""Tokenizer and chat template of a bundle, without transformers or torch.

Encoding and decoding use the ``tokenizers`` library on the bundle's ``tokenizer.json``;
chat templates are rendered with jinja2 in a sandbox, as transformers does. In a chat, the text
of the messages' contents is encoded as plain text (see :meth:`Tokenizer.encode_chat`).
"""

from __future__ import annotations

import copy
import json
import re
from functools import cached_property, lru_cache
from itertools import accumulate
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from runtime.bundle import (CONFIG_FILE, TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, BundleError,
                            load_config)

# What stands for message i's content in a second rendering of a chat, which shows where the contents lie:
# digits between private-use characters, which no template writes and trimming leaves whole.
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000([0-9]+)\ue001")


class Tokenizer:
    """Encode, decode and apply the chat template of a bundle directory.

    Raises:
        BundleError: ``bundle_dir`` is no bundle, ``tokenizer.json`` is missing or unreadable, or
            ``tokenizer_config.json`` is no JSON object.
    """

    def __init__(self, bundle_dir: str | Path):
        bundle_dir = Path(bundle_dir)
        path = bundle_dir / TOKENIZER_FILE
        if not path.is_file():
            if not (bundle_dir / CONFIG_FILE).is_file():  # no bundle at all (missing, a file, another folder)
                load_config(bundle_dir)  # raises, saying so and what a bundle is
            raise BundleError(f"{path} not found: the bundle lacks its tokenizer; re-export it with mars-export")
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on parse errors
            raise BundleError(f"cannot read {path} ({e}); re-export the bundle") from e
        config = _read_tokenizer_config(bundle_dir)
        self._special = _special_tokens(config)
        self._special_ids = {i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special}
        self.chat_template = _read_chat_template(bundle_dir, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognized, so a raw prompt (the server's
        ``/v1/completions``) can write a chat template itself. Chats go through :meth:`encode_chat`.

        Raises:
            ValueError: ``text`` is not valid Unicode (e.g. undecodable bytes from a shell).
        """
        return self._encode(text, add_special_tokens).ids

    def _encode(self, text: str, add_special_tokens: bool) -> Encoding:
        """The library's encoding of ``text`` (ids and character offsets); raises as :meth:`encode`."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not valid UTF-8 text ({e.reason} at position {e.start})") from e
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def make_decode_stream(self, skip_special_tokens: bool = True):
        """Incremental decoder (``tokenizers``' DecodeStream): call it with one id at a time; it
        returns the new text, or None while the ids so far end inside a multi-byte character."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token_id: stream.step(self._tokenizer, token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the bundle's template.

        Raises:
            ValueError: the bundle has no chat template, or it fails to render.
        """
        if self.chat_template is None:
            raise ValueError("this bundle has no chat template; pass a plain prompt instead of --chat")
        try:
            return _compile(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                       **self._special)
        except jinja2.TemplateError as e:
            raise ValueError(f"the bundle's chat template failed: {e}; re-export the bundle or drop --chat") from e

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Ids of the rendered chat, ready for generation (no extra special tokens added).

        The text of each message's (string) content is plain text: a special token's string written in it
        (``<|im_end|>``, say) becomes ordinary text tokens, as OpenAI's API does, so a message cannot forge
        turns or roles; the template's own special tokens stay control tokens. Special tokens are those
        ``tokenizer.json`` marks special; other added tokens (Qwen3's ``<think>``, say) are recognized in contents
        as in any text. Where no content holds a special token's string, the ids are those of the whole rendered
        chat, as transformers' ``apply_chat_template`` gives them.

        Raises:
            ValueError: the bundle has no chat template or it fails to render; the chat is not valid UTF-8; or
                a content holds a special token's string and the template changes contents beyond trimming
                them, so where they lie in the rendered chat is unknown (the message names the token).
        """
        text, spans = self._render_with_content_spans(messages)
        encoding = self._encode(text, add_special_tokens=False)
        specials = [i for i, token_id in enumerate(encoding.ids) if token_id in self._special_ids]
        if spans is None:
            self._check_no_special_text(messages)
            return encoding.ids
        forged = {i for i in specials if _overlaps(_core_span(text, encoding.offsets[i]), spans)}
        if not forged:
            return encoding.ids
        return self._encode_as_text_between(text, encoding, [i for i in specials if i not in forged], forged)

    def _render_with_content_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]] | None]:
        """The rendered chat and the (start, end) of each string content in it, found by rendering the chat
        again with a sentinel for each content; None where that fails, or where putting the contents at the
        sentinels, as they are or all trimmed (jinja's ``trim``), does not give the rendered chat."""
        text = self.apply_chat_template(messages)
        contents = {i: m["content"] for i, m in enumerate(messages) if isinstance(m.get("content"), str)}
        marked = [{**m, "content": _SENTINEL.format(i)} if i in contents else m for i, m in enumerate(messages)]
        try:
            pieces = _SENTINEL_RE.split(self.apply_chat_template(marked))  # template text, content index, ...
        except ValueError:
            return text, None
        if not all(int(index) in contents for index in pieces[1::2]):  # a list content wrote a sentinel's text
            return text, None
        for transform in (lambda content: content, str.strip):
            filled = [transform(contents[int(piece)]) if j % 2 else piece for j, piece in enumerate(pieces)]
            if "".join(filled) == text:
                ends = list(accumulate(len(piece) for piece in filled))
                return text, [(ends[j] - len(filled[j]), ends[j]) for j in range(1, len(filled), 2)]
        return text, None

    def _check_no_special_text(self, messages: list[dict]) -> None:
        """Raises ValueError naming the first special token whose string a string content holds."""
        for i, message in enumerate(messages):
            content = message.get("content")
            ids = self._encode(content, add_special_tokens=False).ids if isinstance(content, str) else []
            special = next((token_id for token_id in ids if token_id in self._special_ids), None)
            if special is not None:
                raise ValueError(f"message {i}'s content holds {self._tokenizer.id_to_token(special)!r}, a special "
                                 "token of this model, and the bundle's chat template changes contents beyond "
                                 "trimming them, so it cannot be kept as plain text: remove it from the content")

    def _encode_as_text_between(self, text: str, encoding: Encoding, kept: list[int], forged: set[int]) -> list[int]:
        """Ids of ``text`` where only the special tokens at ``kept`` (indices in ``encoding``) are control tokens.

        The library encodes the text between two special tokens on its own; a piece between two kept ones
        that holds a forged one is encoded again with special-token strings as text, and the other pieces
        keep their ids.
        """
        ids, start, previous = [], 0, -1
        for k in [*kept, len(encoding.ids)]:
            end = encoding.offsets[k][0] if k < len(encoding.ids) else len(text)
            if any(previous < i < k for i in forged):
                ids += self._text_encoders[start > 0].encode(text[start:end], add_special_tokens=False).ids
            else:
                ids += encoding.ids[previous + 1:k]
            if k < len(encoding.ids):
                ids.append(encoding.ids[k])
                start = encoding.offsets[k][1]
            previous = k
        return ids

    @cached_property
    def _text_encoders(self) -> tuple[HFTokenizer, HFTokenizer]:
        """Copies of the tokenizer that encode special-token strings as text: one for a piece at the start of
        a text, one for a piece inside it. They differ where a Metaspace pre-tokenizer has ``prepend_scheme``
        "first": the library prepends its "▁" to the piece at the text's start only."""
        spec = json.loads(self._tokenizer.to_str())
        at_start = _as_text_encoder(spec)
        inner = copy.deepcopy(spec)
        _never_prepend(inner.get("pre_tokenizer"))
        return at_start, at_start if inner == spec else _as_text_encoder(inner)


def _read_tokenizer_config(bundle_dir: Path) -> dict:
    """The bundle's ``tokenizer_config.json`` ({} without one).

    Raises:
        BundleError: the file is not a JSON object (names the file).
    """
    path = bundle_dir / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BundleError(f"cannot read {path} ({e}); re-export the bundle with mars-export") from e
    if not isinstance(config, dict):
        raise BundleError(f"{path} is not a JSON object; re-export the bundle with mars-export")
    return config


def _read_chat_template(bundle_dir: Path, config: dict) -> str | None:
    if (bundle_dir / TEMPLATE_FILE).is_file():
        return (bundle_dir / TEMPLATE_FILE).read_text()
    return config.get("chat_template")


def _special_tokens(config: dict) -> dict:
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    return {name: config[name] for name in names if isinstance(config.get(name), str)}


def _core_span(text: str, offsets: tuple[int, int]) -> tuple[int, int]:
    """A special token's span less the whitespace it took in (``lstrip``/``rstrip`` tokens)."""
    start, end = offsets
    piece = text[start:end]
    if not piece.strip():
        return start, end
    return start + len(piece) - len(piece.lstrip()), end - len(piece) + len(piece.rstrip())


def _overlaps(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    return any(span[0] < end and start < span[1] for start, end in spans)


def _as_text_encoder(spec: dict) -> HFTokenizer:
    encoder = HFTokenizer.from_str(json.dumps(spec))
    encoder.encode_special_tokens = True  # special tokens are matched no more; other added tokens still are
    return encoder


def _never_prepend(pre_tokenizer: dict | None) -> None:
    """Set ``prepend_scheme`` "first" to "never" in the Metaspace pre-tokenizers of ``pre_tokenizer``, in place."""
    if not pre_tokenizer:
        return
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        pre_tokenizer["prepend_scheme"] = "never"
    for child in pre_tokenizer.get("pretokenizers", []):
        _never_prepend(child)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    """The template, compiled once per string: compiling costs about 100 renders of a short chat."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)

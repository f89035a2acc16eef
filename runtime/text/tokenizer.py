"""Tokenizer and chat template of a bundle, without transformers or torch.

Encoding and decoding use the ``tokenizers`` library on the bundle's ``tokenizer.json``;
chat templates are rendered with jinja2 in a sandbox, as transformers does.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from runtime.bundle import TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, BundleError


class Tokenizer:
    """Encode, decode and apply the chat template of a bundle directory.

    Raises:
        BundleError: ``tokenizer.json`` is missing or unreadable, or ``tokenizer_config.json`` is no JSON object.
    """

    def __init__(self, bundle_dir: str | Path):
        bundle_dir = Path(bundle_dir)
        path = bundle_dir / TOKENIZER_FILE
        if not path.is_file():
            raise BundleError(f"{path} not found: the bundle lacks its tokenizer; re-export it with mars-export")
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on parse errors
            raise BundleError(f"cannot read {path} ({e}); re-export the bundle") from e
        config = _read_tokenizer_config(bundle_dir)
        self._special = _special_tokens(config)
        self.chat_template = _read_chat_template(bundle_dir, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognized.

        Raises:
            ValueError: ``text`` is not valid Unicode (e.g. undecodable bytes from a shell).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not valid UTF-8 text ({e.reason} at position {e.start})") from e
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

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
        """Ids of the rendered chat, ready for generation (no extra special tokens added)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


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


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    """The template, compiled once per string: compiling costs about 100 renders of a short chat."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)

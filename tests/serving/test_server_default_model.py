"""Tier 3: the server on the default model (SmolLM2-135M-Instruct, B = W = 8) with real prompts.

At tau = 1 the server's ids are the runtime decoder's ids; the streamed text, the
non-streamed text and ``Tokenizer.decode`` of the ids are one and the same string,
also for outputs with emoji and CJK characters split across tokens.
"""

from __future__ import annotations

import pytest
from server_support import serve
from support import real_prompts

from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams
from runtime.text.detokenize import Detokenizer
from runtime.text.tokenizer import Tokenizer

MAX_NEW = 64
MULTIBYTE_PROMPTS = ["Write 'thank you' in Chinese, Japanese and Korean, then add three emoji.",
                     "Reply only with emoji: 🍕🎉🚀 and the word 你好."]


@pytest.fixture(scope="module")
def default_server(default_bundle):
    with serve(str(default_bundle), "--max-batch-size", "4") as running:
        yield running


@pytest.fixture(scope="module")
def default_parts(default_bundle):
    config = load_config(default_bundle)
    return Tokenizer(default_bundle), Decoder(OnnxBackend(default_bundle, config), config)


def run_chat(server, text, stream):
    kwargs = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": MAX_NEW,
              "extra_body": {"tau": 1.0, "return_token_ids": True}}
    if not stream:
        r = server.client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.mars["token_ids"]
    chunks = list(server.client.chat.completions.create(**kwargs, stream=True))
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), final.mars["token_ids"]


def check_streamed_equals_non_streamed_equals_decoder(server, parts, text):
    tokenizer, decoder = parts
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": text}])
    expected = decoder.generate(prompt_ids, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW)).token_ids
    plain, streamed = run_chat(server, text, False), run_chat(server, text, True)
    assert plain == streamed == (tokenizer.decode(expected), expected)


@pytest.mark.parametrize("index", range(4))  # real_prompts(2): two GSM8K questions, two HumanEval prompts
def test_real_prompts_streamed_equals_non_streamed_equals_decoder(default_server, default_parts, shared_data, index):
    check_streamed_equals_non_streamed_equals_decoder(default_server, default_parts, real_prompts(2)[index][1])


@pytest.mark.parametrize("text", MULTIBYTE_PROMPTS)
def test_multibyte_prompts_streamed_equals_non_streamed_equals_decoder(default_server, default_parts, text):
    check_streamed_equals_non_streamed_equals_decoder(default_server, default_parts, text)


@pytest.mark.parametrize("text", ["你好，世界！日本語のテキスト。", "🤖🍕🇫🇷👩‍👩‍👧 emoji", "naïve café Ω≈ç√∫"])
def test_multibyte_text_split_across_real_tokens(default_parts, text):
    tokenizer, _ = default_parts
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some character does span tokens
    detokenizer = Detokenizer(tokenizer)
    deltas = [detokenizer.add([i]) for i in ids] + [detokenizer.finish()]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)

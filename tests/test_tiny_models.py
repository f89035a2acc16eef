"""Tier 2: tiny random-weight Llama, Qwen2 and Qwen3 exported with windows 4 and 8.

The ONNX runtime at tau = 1 must give exactly the ids of transformers' greedy
``generate``; at tau = 0.5 it must give exactly the ids of the PyTorch reference MARS
decoder (same rule, two implementations).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from support import fix_window
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_export.parity import chat_prompt_ids
from mars_export.reference import ReferenceDecoder, greedy_generate
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.decoder import Decoder
from runtime.decode.engine import EngineConfig
from runtime.decode.params import DecodeParams

ARCHS = ["llama", "qwen2", "qwen3"]
WINDOWS = [4, 8]
PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "def add(a, b):", "Hi"]
MAX_NEW = 48


def load(tiny_bundle, arch, window):
    ckpt, bundle = tiny_bundle(arch, window)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    config = load_config(bundle)
    return model, tokenizer, config, Decoder(OnnxBackend(bundle, config), config)


def hf_greedy(model, ids, max_new, mask_token_id):
    """transformers greedy generate; the random model may rank the mask token first, which
    MARS decoders never emit, so it is suppressed here too."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=model.config.pad_token_id,
                             suppress_tokens=[mask_token_id])
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("arch", ARCHS)
def test_tau_one_equals_transformers_generate(tiny_bundle, arch, window):
    model, tokenizer, config, decoder = load(tiny_bundle, arch, window)
    for text in PROMPTS:
        ids = chat_prompt_ids(tokenizer, text)
        result = decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW))
        assert result.token_ids == hf_greedy(model, ids, MAX_NEW, config.mask_token_id)
        assert result.num_forwards == result.num_tokens and result.tpf == 1.0


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("arch", ARCHS)
def test_reference_and_runtime_agree_at_tau_half(tiny_bundle, arch, window):
    assert_reference_and_runtime_agree(*load(tiny_bundle, arch, window))


def assert_reference_and_runtime_agree(model, tokenizer, config, decoder, tau: float = 0.5) -> None:
    """The runtime's ids and forwards equal the PyTorch reference decoder's on every prompt at ``tau``."""
    reference = ReferenceDecoder(model, config.block_size, config.window, config.mask_token_id, config.eos_token_ids)
    tpfs = []
    for text in PROMPTS:
        ids = chat_prompt_ids(tokenizer, text)
        params = DecodeParams(tau=tau, max_new_tokens=MAX_NEW)
        expected, got = reference.generate(ids, params), decoder.generate(ids, params)
        assert got.token_ids == expected.token_ids
        assert got.num_forwards == expected.num_forwards
        tpfs.append(got.tpf)
    assert max(tpfs) > 1.0, "no mask prediction was ever accepted: the comparison would be vacuous"


def test_reference_greedy_equals_transformers_generate(tiny_bundle):
    model, tokenizer, config, _ = load(tiny_bundle, "llama", 4)
    ids = chat_prompt_ids(tokenizer, PROMPTS[0])
    result = greedy_generate(model, ids, MAX_NEW, frozenset(config.eos_token_ids))
    assert result.token_ids == hf_greedy(model, ids, MAX_NEW, config.mask_token_id)


@pytest.mark.parametrize("arch", ARCHS)
def test_long_prompt_beyond_export_example(tiny_bundle, arch):
    """Prefill of ~300 tokens (the export example had 5 past + W; two prefill forwards) then decoding past it."""
    model, tokenizer, config, decoder = load(tiny_bundle, arch, 8)
    ids = chat_prompt_ids(tokenizer, "Count the sheep: " + " ".join(str(i) for i in range(90)))
    assert len(ids) > 250
    result = decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=64))
    assert result.token_ids == hf_greedy(model, ids, 64, config.mask_token_id)
    assert result.num_prefill_forwards == -(-(len(ids) - 1) // EngineConfig().prefill_chunk) == 2


def test_fixed_window_bundle_prefills_w_tokens_per_forward(tiny_bundle, tmp_path):
    """A bundle exported before the window axis was dynamic still runs (W-token prefill and steps)
    and decodes the ids of the dynamic graph, whose steps are only as wide as needed."""
    model, tokenizer, config, decoder = load(tiny_bundle, "llama", 4)
    old = fix_window(shutil.copytree(tiny_bundle("llama", 4)[1], tmp_path / "old"), config.window)
    backend = OnnxBackend(old, config)
    assert decoder.backend.is_window_dynamic and not backend.is_window_dynamic
    ids = chat_prompt_ids(tokenizer, PROMPTS[0])
    for params in (DecodeParams(tau=1.0, max_new_tokens=MAX_NEW), DecodeParams(tau=0.5, max_new_tokens=MAX_NEW),
                   DecodeParams(tau=0.5, block_size=2, max_new_tokens=MAX_NEW),
                   DecodeParams(mode="verify", block_size=3, max_new_tokens=MAX_NEW),
                   DecodeParams(mode="verify", draft="lookup", max_new_tokens=MAX_NEW),
                   DecodeParams(tau=1.0, draft="lookup", max_new_tokens=MAX_NEW),
                   DecodeParams(tau=0.5, draft="both", max_new_tokens=MAX_NEW)):
        result = Decoder(backend, config).generate(ids, params)  # every step W wide
        narrow = decoder.generate(ids, params)  # steps as wide as the row needs: 1, block_size
        assert (result.token_ids, result.num_forwards) == (narrow.token_ids, narrow.num_forwards), params
        assert result.num_prefill_forwards == -(-(len(ids) - 1) // config.window)
    assert result.token_ids[:1] == hf_greedy(model, ids, 1, config.mask_token_id)


@pytest.mark.parametrize("arch", ARCHS)
def test_first_step_with_empty_past(tiny_bundle, arch):
    """A one-token prompt: no prefill, the first decode step runs with past length 0."""
    model, tokenizer, config, decoder = load(tiny_bundle, arch, 4)
    ids = [tokenizer.bos_token_id]
    result = decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=24))
    assert result.num_prefill_forwards == 0
    assert result.token_ids == hf_greedy(model, ids, 24, config.mask_token_id)
    reference = ReferenceDecoder(model, config.block_size, config.window, config.mask_token_id, config.eos_token_ids)
    params = DecodeParams(tau=0.5, max_new_tokens=24)
    assert decoder.generate(ids, params).token_ids == reference.generate(ids, params).token_ids


def test_mask_token_never_in_output(tiny_bundle):
    model, tokenizer, config, decoder = load(tiny_bundle, "qwen2", 8)
    for tau in (1.0, 0.5, 0.0):
        for text in PROMPTS:
            result = decoder.generate(chat_prompt_ids(tokenizer, text), DecodeParams(tau=tau, max_new_tokens=MAX_NEW))
            assert config.mask_token_id not in result.token_ids

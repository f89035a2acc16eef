"""``mars-train distill``: the engine's greedy answers, cut answers kept and marked."""

from __future__ import annotations

import json

import torch
from tiny_mars import EOS_ID, make_model, make_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_export.training.cli import main
from mars_export.training.data import record_prompt_messages
from mars_export.training.distill import generate_greedy
from runtime.backends.loading import load_backend
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.params import DecodeParams
from runtime.text.tokenizer import Tokenizer

PROMPTS = ["hi", "What is 7 times 8?", "a much longer question about the number of apples in the basket",
           "ok", "Name three colours.", "x" * 60, "Why?", "Sum 1..10", "two words", "Write a haiku about rain.",
           "q"]


def write_prompts(path) -> list[dict]:
    records = [{"question": q, "answer": "ignored"} if i % 2 else {"prompt": q} for i, q in enumerate(PROMPTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_distill_writes_the_engines_greedy_answers_and_keeps_cut_ones(tiny_bundle, tmp_path):
    checkpoint, bundle = tiny_bundle("llama", 4)
    records = write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "distilled.jsonl"
    assert main(["distill", str(bundle), "--prompts", str(tmp_path / "prompts.jsonl"), "--output", str(out),
                 "--max-new-tokens", "12", "--batch-size", "8"]) == 0
    written = read_jsonl(out)
    prompts = [record_prompt_messages(r) for r in records]
    assert [r["messages"][:-1] for r in written] == prompts  # prompt order, every prompt answered

    backend, config, _ = load_backend(bundle)  # each prompt alone through the engine
    tokenizer = Tokenizer(bundle)
    solo = Engine(backend, config, EngineConfig(max_batch_size=1)).generate(
        [tokenizer.encode_chat(p) for p in prompts], DecodeParams(tau=1.0, max_new_tokens=12))
    model, hf_tokenizer = AutoModelForCausalLM.from_pretrained(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    reference = [generate_greedy(model.eval(), hf_tokenizer, [p], 12)[0] for p in prompts]
    for record, engine_result, ids in zip(written, solo, reference):
        assert engine_result.token_ids == ids  # the engine's greedy output is transformers' greedy output
        is_cut = not ids or ids[-1] not in config.eos_token_ids
        assert record["cut"] is is_cut
        assert record["messages"][-1] == {"role": "assistant",
                                          "content": tokenizer.decode(ids if is_cut else ids[:-1])}
    assert all(r["cut"] for r in written)  # a random model never says end-of-turn within 12 tokens


def eos_model() -> torch.nn.Module:
    """An untied tiny Llama whose every greedy step says end-of-turn (hand-set weights)."""
    model = make_model(tie=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0  # the residual stream is the embedding
        model.lm_head.weight.zero_()
        model.lm_head.weight[EOS_ID, 0] = 1.0
    return model


def test_distill_exports_a_checkpoint_and_marks_finished_answers(tmp_path):
    eos_model().save_pretrained(tmp_path / "eos")
    make_tokenizer().save_pretrained(tmp_path / "eos")
    write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "distilled.jsonl"
    assert main(["distill", str(tmp_path / "eos"), "--prompts", str(tmp_path / "prompts.jsonl"), "--prompts",
                 str(tmp_path / "prompts.jsonl"), "--output", str(out), "--max-new-tokens", "3",
                 "--max-prompts", "13"]) == 0
    written = read_jsonl(out)
    assert len(written) == 13 and [r["messages"][0]["content"] for r in written[11:]] == PROMPTS[:2]
    assert all(r["messages"][-1] == {"role": "assistant", "content": ""} and r["cut"] is False for r in written)


def test_batched_greedy_matches_one_prompt_at_a_time():
    model, tokenizer = make_model(), make_tokenizer()
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "a much longer question"}]]
    batched = generate_greedy(model, tokenizer, prompts, max_new_tokens=6)
    assert batched == [generate_greedy(model, tokenizer, [p], max_new_tokens=6)[0] for p in prompts]

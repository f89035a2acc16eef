"""Records -> chat messages -> token ids -> padded batches."""

from __future__ import annotations

import json

import pytest
from tiny_mars import EOS_ID

from mars_export.training.data import (
    Example, ExampleDataset, MarsCollator, load_examples, prepare_example, read_records, record_is_cut,
    record_prompt_messages, record_response,
)
from mars_export.training.objective import IGNORE_INDEX, prepare_targets

@pytest.mark.parametrize("record, prompt, answer", [
    ({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                   {"role": "assistant", "content": "A"}]},
     [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "A"),
    ({"prompt": "Q", "response": "A"}, [{"role": "user", "content": "Q"}], "A"),
    ({"instruction": "Do", "input": "this", "output": "A"}, [{"role": "user", "content": "Do\n\nthis"}], "A"),
    ({"instruction": "Do", "input": "", "response": "A"}, [{"role": "user", "content": "Do"}], "A"),
    ({"question": "Q", "answer": "A\n#### 3"}, [{"role": "user", "content": "Q"}], "A\n#### 3"),
    ({"messages": [{"role": "user", "content": "Q"}]}, [{"role": "user", "content": "Q"}], None),
])
def test_record_formats(record, prompt, answer):
    assert record_prompt_messages(record) == prompt
    assert record_response(record) == answer


def test_unknown_record_raises_naming_its_keys():
    with pytest.raises(ValueError, match="'text'"):
        record_prompt_messages({"text": "hi"})


def test_example_is_prompt_template_then_answer_ending_with_end_of_turn(tokenizer):
    prompt = [{"role": "user", "content": "Hi"}]
    example = prepare_example(tokenizer, prompt, "Hello there")
    assert example.prompt_ids == tokenizer.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
    assert tokenizer.decode(example.response_ids) == "Hello there<|im_end|>"  # the template's "\n" is cut
    assert example.response_ids[-1] == EOS_ID


def test_cut_answer_has_no_end_of_turn_target(tmp_path, tokenizer):
    prompt = [{"role": "user", "content": "Hi"}]
    whole, cut = prepare_example(tokenizer, prompt, "Hello th"), prepare_example(tokenizer, prompt, "Hello th", True)
    assert cut.prompt_ids == whole.prompt_ids and cut.response_ids == whole.response_ids[:-1]
    assert tokenizer.decode(cut.response_ids) == "Hello th" and EOS_ID not in cut.response_ids
    for example, last_target in [(whole, EOS_ID), (cut, cut.response_ids[-1])]:
        batch = MarsCollator(pad_token_id=EOS_ID)([ExampleDataset([example])[0]])
        targets = prepare_targets(batch["input_ids"], batch["prompt_lengths"], batch["lengths"])[0]
        assert targets[targets != IGNORE_INDEX].tolist()[-1] == last_target  # every response token is a target
        assert int((targets != IGNORE_INDEX).sum()) == len(example.response_ids)
    path = tmp_path / "distilled.jsonl"
    path.write_text("".join(json.dumps({"messages": prompt + [{"role": "assistant", "content": "Hello th"}],
                                        "cut": flag}) + "\n" for flag in (False, True)))
    assert load_examples([path], tokenizer)[0] == [whole, cut]
    with pytest.raises(ValueError, match="'cut' must be true or false"):
        record_is_cut({"cut": "yes"})
    with pytest.raises(ValueError, match="cut answer .* is empty"):
        prepare_example(tokenizer, prompt, "", is_cut=True)


def test_read_records_jsonl_and_json(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "p", "response": "r"}\n\n{"question": "q", "answer": "a"}\n')
    (tmp_path / "b.json").write_text(json.dumps([{"instruction": "i", "output": "o"}]))
    assert len(read_records(tmp_path / "a.jsonl")) == 2 and len(read_records(tmp_path / "b.json")) == 1
    (tmp_path / "bad.jsonl").write_text('{"prompt": "p", "response": "r"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_records(tmp_path / "bad.jsonl")


def test_too_long_examples_are_dropped_and_counted(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "p", "response": "short"}) + "\n"
                    + json.dumps({"prompt": "p", "response": "long " * 40}) + "\n")
    short = prepare_example(tokenizer, [{"role": "user", "content": "p"}], "short")
    examples, report = load_examples([path], tokenizer, max_length=short.length)
    assert examples == [short]
    assert (report.num_records, report.num_dropped_too_long) == (2, 1)
    with pytest.raises(ValueError, match="no usable training examples"):
        load_examples([path], tokenizer, max_length=short.length - 1)


def test_collator_right_pads_and_reports_lengths():
    dataset = ExampleDataset([Example([1, 5], [6, EOS_ID]), Example([1, 7, 8], [EOS_ID])])
    batch = MarsCollator(pad_token_id=EOS_ID)([dataset[1], dataset[0]])
    assert batch["input_ids"].tolist() == [[1, 7, 8, EOS_ID], [1, 5, 6, EOS_ID]]
    assert batch["prompt_lengths"].tolist() == [3, 2] and batch["lengths"].tolist() == [4, 4]
    batch = MarsCollator(pad_token_id=0)([dataset[0], ExampleDataset([Example([1], [EOS_ID])])[0]])
    assert batch["input_ids"].tolist() == [[1, 5, 6, EOS_ID], [1, EOS_ID, 0, 0]]
    assert batch["lengths"].tolist() == [4, 2]


@pytest.mark.parametrize("name", ["gsm8k/train.jsonl", "instruct_tuning/code_alpaca_2k.json",
                                  "instruct_tuning/gpteacher_codegen-instruct.json"])
def test_shared_training_files_parse(name, tokenizer, shared_data):
    record = read_records(shared_data / name)[0]
    example = prepare_example(tokenizer, record_prompt_messages(record), record_response(record))
    assert example.response_ids[-1] == EOS_ID and len(example.response_ids) > 1

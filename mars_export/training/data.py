"""Training data for MARS: records -> chat messages -> (prompt ids, response ids) -> padded batches.

Accepted record formats (one JSON object per line in ``.jsonl``, or a JSON list in ``.json``):

- chat: ``{"messages": [{"role": ..., "content": ...}, ...]}`` ending with an assistant
  message; only the last assistant turn is a response, earlier turns are prompt;
- ``{"prompt": ..., "response": ...}``;
- instruction tuning: ``{"instruction": ..., "input": ..., "response" | "output": ...}``;
- GSM8K: ``{"question": ..., "answer": ...}``.

The prompt is the chat template with ``add_generation_prompt=True``; the response is the
assistant text plus the end-of-turn token the template writes (DESIGN.md §2), tokenized
on its own, as the model meets it when generating after the prompt.

A record may carry ``"cut": true`` (``mars-train distill`` writes it for answers that hit
the token cap): its answer is a true prefix of the model's output that never reached its
end, so its response gets no end-of-turn token. Every response token is still a target of
both streams; only the "stop here" target is missing, since the text did not stop there.
The last block of a cut answer may be partial, exactly as for a finished one.

Dimension letters: N batch, L longest example in the batch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Example:
    """One training example as token ids: ``prompt_ids + response_ids`` is the sequence ``s``."""

    prompt_ids: list[int]
    response_ids: list[int]

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.response_ids:
            raise ValueError("an example needs a non-empty prompt and a non-empty response")

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class LoadReport:
    """What :func:`load_examples` read and what it dropped, and why."""

    num_records: int = 0
    num_dropped_too_long: int = 0
    max_length: int | None = None

    def __str__(self) -> str:
        kept = self.num_records - self.num_dropped_too_long
        return (f"{kept} of {self.num_records} examples kept; {self.num_dropped_too_long} dropped "
                f"as longer than --max-length {self.max_length}")


def read_records(path: str | Path) -> list[dict]:
    """JSON objects from a ``.jsonl`` file (one per non-empty line) or a ``.json`` list.

    Raises:
        ValueError: the file is missing or not valid JSON, or an entry is not an object.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON ({err.msg}, line {err.lineno})") from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: a .json data file must hold a list of records")
        where = [f"{path}[{i}]" for i in range(len(records))]
    else:
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        records, where = [], []
        for n, line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: invalid JSON ({err.msg})") from None
            where.append(f"{path}:{n}")
    for record, place in zip(records, where):
        if not isinstance(record, dict):
            raise ValueError(f"{place}: expected a JSON object, got {type(record).__name__}")
    return records


def record_prompt_messages(record: dict) -> Messages:
    """The prompt of a record as chat messages (no assistant answer at the end).

    Raises:
        ValueError: the record matches none of the accepted formats.
    """
    if "messages" in record:
        messages = record["messages"]
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        if not messages or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
            raise ValueError("a 'messages' record needs at least one message before the answer, "
                             "each an object with 'role' and 'content'")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if "prompt" in record:
        return [{"role": "user", "content": record["prompt"]}]
    if "instruction" in record:
        extra = record.get("input") or ""
        return [{"role": "user", "content": record["instruction"] + (f"\n\n{extra}" if extra else "")}]
    if "question" in record:
        return [{"role": "user", "content": record["question"]}]
    raise ValueError(f"unrecognised record with keys {sorted(record)}; expected 'messages', "
                     "'prompt'/'response', 'instruction'/'input'/'response'|'output' or 'question'/'answer'")


def record_response(record: dict) -> str | None:
    """The assistant answer of a record, or None when it has none (a prompt-only record)."""
    if "messages" in record:
        last = record["messages"][-1] if record["messages"] else {}
        return last["content"] if last.get("role") == "assistant" else None
    for key in ("response", "output", "answer"):
        if key in record:
            return record[key]
    return None


def record_is_cut(record: dict) -> bool:
    """Whether the record's answer was cut at a token cap (``"cut": true``; absent means False).

    Raises:
        ValueError: ``cut`` is not a JSON boolean.
    """
    cut = record.get("cut", False)
    if not isinstance(cut, bool):
        raise ValueError(f"'cut' must be true or false, got {cut!r}")
    return cut


def prepare_example(tokenizer: PreTrainedTokenizerBase, prompt: Messages, response: str,
                    is_cut: bool = False) -> Example:
    """Token ids of one prompt/answer pair through the tokenizer's chat template.

    The response ends with the end-of-turn token (``tokenizer.eos_token_id``): whatever the
    template writes after it (SmolLM2: a newline) is cut, and it is appended if the
    template writes none. A cut answer (``is_cut``) ends without it.

    Raises:
        ValueError: the template does not render the prompt as a prefix of the conversation,
            or a cut answer is empty.
    """
    prompt_text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full_text = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": response}],
                                              tokenize=False)
    if not full_text.startswith(prompt_text):
        raise ValueError("the chat template does not render the generation prompt as a prefix of the "
                         "full conversation; cannot split prompt and response")
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(full_text[len(prompt_text):], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos in response_ids:
        response_ids = response_ids[:len(response_ids) - response_ids[::-1].index(eos)]
    else:
        response_ids = response_ids + [eos]
    if is_cut:
        if len(response_ids) < 2:
            raise ValueError("a cut answer (\"cut\": true) is empty; drop the record")
        response_ids = response_ids[:-1]  # it never reached its end-of-turn token
    return Example(prompt_ids, response_ids)


def load_examples(paths: list[str | Path], tokenizer: PreTrainedTokenizerBase,
                  max_length: int | None = None) -> tuple[list[Example], LoadReport]:
    """Read every record of ``paths`` into examples, dropping (and counting) the too-long ones.

    Raises:
        ValueError: a record is malformed or has no answer, or every example is too long.
    """
    examples, report = [], LoadReport(max_length=max_length)
    for path in paths:
        for record in read_records(path):
            prompt, response = record_prompt_messages(record), record_response(record)
            if response is None:
                raise ValueError(f"{path}: a training record has no answer: {json.dumps(record)[:200]}")
            example = prepare_example(tokenizer, prompt, response, record_is_cut(record))
            report.num_records += 1
            if max_length is not None and example.length > max_length:
                report.num_dropped_too_long += 1
                continue
            examples.append(example)
    logger.log(logging.WARNING if report.num_dropped_too_long else logging.INFO, "training data: %s", report)
    if not examples:
        raise ValueError(f"no usable training examples in {[str(p) for p in paths]}: {report}")
    return examples, report


class ExampleDataset(torch.utils.data.Dataset):
    """A list of :class:`Example` as a map-style dataset of dicts (what the collator takes)."""

    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        example = self.examples[index]
        return {"input_ids": example.prompt_ids + example.response_ids, "prompt_length": len(example.prompt_ids)}


@dataclass
class MarsCollator:
    """Right-pads a list of dataset items into a batch.

    Returns a dict with ``input_ids`` int64 ``[N, L]`` (padded with ``pad_token_id``),
    ``prompt_lengths`` int64 ``[N]`` and ``lengths`` int64 ``[N]``. The pad id is never used
    to find the end of an example (it may equal eos); ``lengths`` is.
    """

    pad_token_id: int

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        lengths = torch.tensor([len(item["input_ids"]) for item in items], dtype=torch.long)
        input_ids = torch.full((len(items), int(lengths.max())), self.pad_token_id, dtype=torch.long)  # [N, L]
        for row, item in enumerate(items):
            input_ids[row, :len(item["input_ids"])] = torch.tensor(item["input_ids"], dtype=torch.long)
        prompt_lengths = torch.tensor([item["prompt_length"] for item in items], dtype=torch.long)
        return {"input_ids": input_ids, "prompt_lengths": prompt_lengths, "lengths": lengths}

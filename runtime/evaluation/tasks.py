"""Read GSM8K and HumanEval files into evaluation items with their chat prompts.

Files are JSON lines, plain or gzipped (``.gz``): GSM8K records hold ``question`` and
``answer`` (ending in ``#### N``); HumanEval records hold ``task_id``, ``prompt``,
``entry_point`` and ``test``. The first ``limit`` records of each file are used.

Prompts (one user message in the bundle's chat template):
    GSM8K:     the question, then :data:`GSM8K_INSTRUCTION`.
    HumanEval: :data:`HUMANEVAL_INSTRUCTION`, then the prompt in a ```` ```python ```` block.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from runtime.evaluation.answers import parse_gold

GSM8K = "gsm8k"
HUMANEVAL = "humaneval"
GSM8K_INSTRUCTION = "Solve the problem step by step. End with the final answer as '#### <number>'."
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, "
                         "signature included, in one ```python code block.")
HUMANEVAL_FIELDS = ("task_id", "prompt", "entry_point", "test")


class DataError(ValueError):
    """An evaluation file is missing or malformed."""


@dataclass(frozen=True)
class EvalItem:
    """One prompt to evaluate.

    Attributes:
        task: ``gsm8k`` or ``humaneval``.
        item_id: ``gsm8k/<line index>`` or the HumanEval ``task_id``.
        user_message: the text of the single user message given to the model.
        gold: GSM8K gold answer (a number); None for HumanEval.
        problem: the HumanEval record (task_id, prompt, entry_point, test); None for GSM8K.
    """

    task: str
    item_id: str
    user_message: str
    gold: float | None = None
    problem: dict | None = None

    def messages(self) -> list[dict]:
        """The chat messages fed to the model."""
        return [{"role": "user", "content": self.user_message}]


def read_jsonl(path: str | Path, limit: int) -> list[tuple[int, dict]]:
    """(line number, object) of the first ``limit`` non-empty lines of a JSON-lines file (.gz allowed).

    Raises:
        DataError: missing file, invalid JSON, or a line that is not an object.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} not found")
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if len(records) == limit:
                    break
                if line.strip():
                    records.append((number, json.loads(line)))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a JSON-lines file ({e})") from e
    for number, record in records:
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: each line must be a JSON object")
    return records


def load_gsm8k(path: str | Path, limit: int) -> list[EvalItem]:
    """The first ``limit`` GSM8K records as items.

    Raises:
        DataError: unreadable file, or a record without a string question and a '#### N' answer.
    """
    items = []
    for index, (number, record) in enumerate(read_jsonl(path, limit)):
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise DataError(f"{path}:{number}: a GSM8K record needs string fields 'question' and 'answer'")
        try:
            gold = parse_gold(answer)
        except ValueError as e:
            raise DataError(f"{path}:{number}: {e}") from e
        items.append(EvalItem(GSM8K, f"gsm8k/{index}", f"{question}\n\n{GSM8K_INSTRUCTION}", gold=gold))
    return items


def load_humaneval(path: str | Path, limit: int) -> list[EvalItem]:
    """The first ``limit`` HumanEval records as items.

    Raises:
        DataError: unreadable file, or a record lacking a string task_id, prompt, entry_point or test.
    """
    items = []
    for number, record in read_jsonl(path, limit):
        missing = [k for k in HUMANEVAL_FIELDS if not isinstance(record.get(k), str)]
        if missing:
            raise DataError(f"{path}:{number}: a HumanEval record needs string fields {list(HUMANEVAL_FIELDS)}, "
                            f"missing {missing}")
        problem = {k: record[k] for k in HUMANEVAL_FIELDS}
        message = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt'].rstrip()}\n```"
        items.append(EvalItem(HUMANEVAL, problem["task_id"], message, problem=problem))
    return items

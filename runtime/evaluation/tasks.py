"""Read GSM8K, HumanEval and chat files into evaluation items with their chat prompts.

Files are JSON lines, plain or gzipped (``.gz``): GSM8K records hold ``question`` and
``answer`` (ending in ``#### N``); HumanEval records hold ``task_id``, ``prompt``,
``entry_point`` and ``test``; chat records are OpenAssistant message trees (``prompt``:
``{text, role, replies}``, as in ``chat_multiturn/oasst_en_100_tree.jsonl``). The first
``limit`` records of each file are used, or the last ``limit`` with ``from_end``.

Prompts (in the bundle's chat template):
    GSM8K:     one user message: the question, then :data:`GSM8K_INSTRUCTION`.
    HumanEval: one user message: :data:`HUMANEVAL_INSTRUCTION`, then the prompt in a
               ```` ```python ```` block.
    chat:      the tree's first reply at every level, at most :data:`CHAT_MAX_TURNS`
               messages, ending with a user turn (no reference answer: scored by agreement only).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from runtime.evaluation.answers import parse_gold

GSM8K = "gsm8k"
HUMANEVAL = "humaneval"
CHAT = "chat"
CHAT_MAX_TURNS = 3
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
        task: ``gsm8k``, ``humaneval`` or ``chat``.
        item_id: ``gsm8k/<record index>``, the HumanEval ``task_id``, or ``chat/<record index>``
            (index: 0-based position among the file's records).
        user_message: the text of the last user message given to the model.
        gold: GSM8K gold answer (a number); None otherwise.
        problem: the HumanEval record (task_id, prompt, entry_point, test); None otherwise.
        history: the messages before the last user message (chat items); empty otherwise.
    """

    task: str
    item_id: str
    user_message: str
    gold: float | None = None
    problem: dict | None = None
    history: tuple[dict, ...] = ()

    def messages(self) -> list[dict]:
        """The chat messages fed to the model."""
        return [*self.history, {"role": "user", "content": self.user_message}]


def read_jsonl(path: str | Path, limit: int, from_end: bool = False) -> list[tuple[int, int, dict]]:
    """(line number, record index, object) of the first ``limit`` non-empty lines of a
    JSON-lines file (.gz allowed), or of the last ``limit`` with ``from_end``.

    The record index is the 0-based position among the file's non-empty lines, so an item
    keeps its id whichever end it is read from.

    Raises:
        DataError: missing file, invalid JSON, or a line that is not an object.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} not found")
    opener = gzip.open if path.suffix == ".gz" else open
    lines = []  # (line number, record index, text) of the non-empty lines, in file order
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if len(lines) == limit and not from_end:
                    break
                if line.strip():
                    lines.append((number, len(lines), line))
    except (UnicodeDecodeError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a JSON-lines file ({e})") from e
    records = []
    for number, index, line in (lines[-limit:] if from_end else lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not a JSON-lines file ({e})") from e
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: each line must be a JSON object")
        records.append((number, index, record))
    return records


def load_gsm8k(path: str | Path, limit: int, from_end: bool = False) -> list[EvalItem]:
    """The first (``from_end``: last) ``limit`` GSM8K records as items.

    Raises:
        DataError: unreadable file, or a record without a string question and a '#### N' answer.
    """
    items = []
    for number, index, record in read_jsonl(path, limit, from_end):
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise DataError(f"{path}:{number}: a GSM8K record needs string fields 'question' and 'answer'")
        try:
            gold = parse_gold(answer)
        except ValueError as e:
            raise DataError(f"{path}:{number}: {e}") from e
        items.append(EvalItem(GSM8K, f"gsm8k/{index}", f"{question}\n\n{GSM8K_INSTRUCTION}", gold=gold))
    return items


def load_humaneval(path: str | Path, limit: int, from_end: bool = False) -> list[EvalItem]:
    """The first (``from_end``: last) ``limit`` HumanEval records as items.

    Raises:
        DataError: unreadable file, or a record lacking a string task_id, prompt, entry_point or test.
    """
    items = []
    for number, _, record in read_jsonl(path, limit, from_end):
        missing = [k for k in HUMANEVAL_FIELDS if not isinstance(record.get(k), str)]
        if missing:
            raise DataError(f"{path}:{number}: a HumanEval record needs string fields {list(HUMANEVAL_FIELDS)}, "
                            f"missing {missing}")
        problem = {k: record[k] for k in HUMANEVAL_FIELDS}
        message = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt'].rstrip()}\n```"
        items.append(EvalItem(HUMANEVAL, problem["task_id"], message, problem=problem))
    return items


def load_chat(path: str | Path, limit: int, from_end: bool = False) -> list[EvalItem]:
    """The first (``from_end``: last) ``limit`` OpenAssistant trees as chat items.

    Each follows the first reply at every level (prompter, assistant, prompter, ...) for at
    most :data:`CHAT_MAX_TURNS` messages and drops a trailing assistant message, so the model
    answers the last user turn with the earlier turns as context.

    Raises:
        DataError: unreadable file, or a record without ``prompt.text`` and ``prompt.role``
            (not an OpenAssistant tree file).
    """
    items = []
    for number, index, record in read_jsonl(path, limit, from_end):
        node, turns = record.get("prompt"), []
        while len(turns) < CHAT_MAX_TURNS and (node is not None or not turns):
            if not _is_chat_node(node):
                raise DataError(f"{path}:{number}: expected an OpenAssistant tree: every message an object with a "
                                "string 'text', a 'role' of 'prompter' or 'assistant' and a list of 'replies', "
                                "as in chat_multiturn/oasst_en_100_tree.jsonl")
            turns.append({"role": "user" if node["role"] == "prompter" else "assistant", "content": node["text"]})
            node = (node.get("replies") or [None])[0]
        if turns[-1]["role"] == "assistant":
            turns.pop()
        if not turns or turns[0]["role"] != "user":
            raise DataError(f"{path}:{number}: the conversation must start with a 'prompter' message")
        items.append(EvalItem(CHAT, f"chat/{index}", turns[-1]["content"], history=tuple(turns[:-1])))
    return items


def _is_chat_node(node) -> bool:
    """Whether ``node`` is one message of an OpenAssistant tree (text, role, optional replies list)."""
    return (isinstance(node, dict) and isinstance(node.get("text"), str)
            and node.get("role") in ("prompter", "assistant") and isinstance(node.get("replies", []), list))

"""Per-record scores: agreement with the AR output, GSM8K correctness, HumanEval pass.

Fields added to each record:
    identical_to_ar: the ids equal those of the same bundle's AR run on the prompt (tau >= 1,
        draft source masks).
    common_prefix_fraction: length of the common prefix of the two id lists divided by
        the longer one's length (1.0 iff identical; 1.0 for two empty lists).
    GSM8K records: gold, predicted (float or None), correct.
    HumanEval records: completion (what was appended to the prompt), passed,
        exec_result (the harness's word).
"""

from __future__ import annotations

from runtime.evaluation.answers import extract_answer, is_correct
from runtime.evaluation.code_extraction import prepare_completion
from runtime.evaluation.execution import check_completion
from runtime.evaluation.tasks import GSM8K, HUMANEVAL, EvalItem

AR_DRAFT = "masks"  # the draft source of the AR reference (tau >= 1): plain greedy AR


def common_prefix(a: list[int], b: list[int]) -> int:
    """Number of leading positions where ``a`` and ``b`` hold the same id."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def score_agreement(records: list[dict]) -> None:
    """Add ``identical_to_ar`` and ``common_prefix_fraction`` to every record, in place."""
    reference = {(r["bundle"], r["item_id"]): r["token_ids"] for r in records
                 if r["tau"] >= 1.0 and r["draft"] == AR_DRAFT}
    for r in records:
        ref = reference[r["bundle"], r["item_id"]]
        r["identical_to_ar"] = r["token_ids"] == ref
        longest = max(len(ref), len(r["token_ids"]))
        r["common_prefix_fraction"] = common_prefix(ref, r["token_ids"]) / longest if longest else 1.0


def score_gsm8k(record: dict, item: EvalItem) -> None:
    """Add ``gold``, ``predicted`` and ``correct`` to a GSM8K record, in place."""
    record["gold"] = item.gold
    record["predicted"] = extract_answer(record["text"])
    record["correct"] = is_correct(record["predicted"], item.gold)


def score_humaneval(record: dict, item: EvalItem, cache: dict, timeout: float, check=check_completion) -> None:
    """Add ``completion``, ``passed`` and ``exec_result`` to a HumanEval record, in place.

    ``cache`` maps (task_id, completion) to a :class:`~runtime.evaluation.execution.CheckResult`
    so identical completions (common across taus) are executed once.
    """
    completion = prepare_completion(record["text"], item.problem["entry_point"])
    key = item.problem["task_id"], completion
    if key not in cache:
        cache[key] = check(item.problem, completion, timeout)
    record["completion"], record["passed"], record["exec_result"] = completion, cache[key].passed, cache[key].result


def score_all(records: list[dict], items: list[EvalItem], exec_timeout: float, check=check_completion) -> None:
    """Score every record in place (agreement, then the task's own score; chat items have
    no reference answer and are scored by agreement only)."""
    score_agreement(records)
    by_id, cache = {item.item_id: item for item in items}, {}
    for record in records:
        item = by_id[record["item_id"]]
        if item.task == GSM8K:
            score_gsm8k(record, item)
        elif item.task == HUMANEVAL:
            score_humaneval(record, item, cache, exec_timeout, check)

"""GSM8K final-answer extraction and comparison (plain functions over strings).

The usual rule: the number after the last ``####`` if the text has one; otherwise the
first number after the last "answer is" / "answer:" / ``\\boxed{``; otherwise the last
number in the text. Numbers may carry a leading ``$`` and a minus sign (``-5``, ``-$5``,
``$-5``), thousands commas (``1,234``) and decimals (``3.75``, ``.5``); a trailing period
ends the number (``42.`` is 42). A minus glued to a preceding word or digit is a hyphen,
not a sign (``3-4`` reads as 3 and 4). Comparison is numeric, so ``18.00`` equals ``18``.
"""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(
    r"(?<![\w.])"                       # not glued to a word, or to a previous number's decimal point
    r"(?P<prefix>[-−$]{0,2})"           # optional sign and/or dollar, in either order
    r"(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_FINAL_MARK = "####"
_ANSWER_MARK = re.compile(r"answer\s+is|answer\s*:|\\boxed\{", re.IGNORECASE)


def parse_numbers(text: str) -> list[float]:
    """Every number in ``text``, left to right, as floats (see the module docstring for the forms)."""
    values = []
    for match in _NUMBER.finditer(text):
        value = float(match["digits"].replace(",", ""))
        values.append(-value if any(c in match["prefix"] for c in "-−") else value)
    return values


def extract_answer(text: str) -> float | None:
    """The final numeric answer of a model's reply, or None when it holds no number."""
    if _FINAL_MARK in text:
        after = parse_numbers(text.rsplit(_FINAL_MARK, 1)[1])
        if after:
            return after[0]
    marks = list(_ANSWER_MARK.finditer(text))
    if marks:
        after = parse_numbers(text[marks[-1].end():])
        if after:
            return after[0]
    numbers = parse_numbers(text)
    return numbers[-1] if numbers else None


def parse_gold(answer: str) -> float:
    """The gold number of a GSM8K ``answer`` field (the number after its last ``####``).

    Raises:
        ValueError: no ``####`` followed by a number.
    """
    if _FINAL_MARK not in answer or not parse_numbers(answer.rsplit(_FINAL_MARK, 1)[1]):
        raise ValueError(f"a GSM8K answer must end with '#### <number>', got ...{answer[-60:]!r}")
    return parse_numbers(answer.rsplit(_FINAL_MARK, 1)[1])[0]


def is_correct(predicted: float | None, gold: float) -> bool:
    """Numeric equality within 1e-6 (absolute) or 1e-9 (relative); None is wrong."""
    return predicted is not None and math.isclose(predicted, gold, rel_tol=1e-9, abs_tol=1e-6)

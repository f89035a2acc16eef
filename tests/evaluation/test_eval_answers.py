"""GSM8K answer extraction and comparison on hand-made replies."""

from __future__ import annotations

import pytest

from runtime.evaluation.answers import extract_answer, is_correct, parse_gold, parse_numbers


@pytest.mark.parametrize("text, expected", [
    ("She makes 9 * 2 = $18 every day.\n#### 18", 18),
    ("#### 1,234", 1234),
    ("The total is 1,450,000 dollars.", 1_450_000),
    ("It costs $1,234.50.", 1234.5),
    ("So the answer is 42.", 42),
    ("The answer is $70,000.", 70_000),
    ("**Answer:** $5,600", 5600),
    ("The temperature is now -5 degrees.", -5),
    ("He lost -$12 on the deal.", -12),
    ("#### -3", -3),
    ("It takes 3.75 hours.", 3.75),
    ("Half is .5 of a cake.", 0.5),
    ("Each costs $0.25, so 4 cost 1.", 1),
    ("The answer is 7. Check: 7 * 2 = 14, good.", 7),      # the marker wins over the last number
    ("Step 1: 16 - 3 - 4 = 9. Step 2: 9 * 2 = 18", 18),   # no marker: the last number
    ("It was between 3-4 hours, about 4", 4),
    ("#### 10\nThe answer is 12", 10),                      # '####' wins over 'answer is'
    ("Result: \\boxed{64}", 64),
    ("I choose the 2nd option, which gives 30 apples.", 30),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", ["I do not know.", "", "#### none, sorry"])
def test_no_number_gives_none(text):
    assert extract_answer(text) is None


def test_hyphen_is_not_a_minus_sign():
    assert parse_numbers("pages 3-4 and -2") == [3, 4, -2]
    assert parse_numbers("a list 1,2,3 and 1,000") == [1, 2, 3, 1000]


def test_gold_and_comparison():
    assert parse_gold("He pays 2,000 + 125 = <<2000+125=2125>>2125\n#### 2,125") == 2125
    with pytest.raises(ValueError, match="####"):
        parse_gold("no final marker 12")
    assert is_correct(18.0, 18) and is_correct(extract_answer("$18.00."), 18)
    assert not is_correct(18.5, 18) and not is_correct(None, 18) and not is_correct(-18, 18)

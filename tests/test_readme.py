"""The README's command synopses and quantization gates agree with the code.

Every synopsis block of a command-line tool must list exactly the options its argparse
parser has, and where it shows a value instead of a placeholder (``[--port 8000]``,
``[--scheme continuous|block]``, ``[--taus 1.0 0.95 ...]``), that value must be the
parser's default or its choices.
"""

from __future__ import annotations

import argparse
import json
import re
from importlib import import_module
from pathlib import Path

import pytest

from mars_export import cli as export_cli
from mars_export.quantize import MIN_TOP1_AGREEMENT
from mars_export.training import cli as train_cli
from runtime import generate, serve
from runtime.evaluation import cli as eval_cli

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
PARSERS = {  # synopsis start -> the parser of that command
    "mars-export MODEL": lambda: _parser_of(export_cli.parse_args),
    "python -m runtime.generate": lambda: _parser_of(generate.parse_args),
    "python -m runtime.serve_ray": lambda: import_module("runtime.serve_ray").make_parser(),  # before its prefix
    "python -m runtime.serve": lambda: _parser_of(serve.parse_args),
    "mars-train MODEL": train_cli.make_train_parser,
    "mars-train distill": train_cli.make_distill_parser,
    "mars-eval BUNDLE": lambda: _parser_of(eval_cli.parse_args),
}


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _parser_of(parse_args) -> argparse.ArgumentParser:
    """The parser a ``parse_args(argv)`` function builds (caught at its parse_args call)."""
    def catch(parser, args=None, namespace=None):
        raise _Parsed(parser)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        parse_args([])
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{parse_args} built no parser")


def synopses() -> dict[str, str]:
    """Synopsis start -> its text: the first README code block part that starts with it."""
    found = {}
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", README, re.S | re.M):
        for part in re.split(r"\n(?=mars-train distill)", block):
            start = next((s for s in PARSERS if part.startswith(s)), None)
            if start is not None:
                found.setdefault(start, part)  # the first block of a command is its synopsis; later ones are examples
    return found


def test_every_tool_has_a_synopsis():
    assert sorted(synopses()) == sorted(PARSERS)


@pytest.mark.parametrize("start", sorted(PARSERS))
def test_synopsis_lists_exactly_the_options_with_their_defaults(start):
    text, parser = synopses()[start], PARSERS[start]()
    actions = {max(a.option_strings, key=len): a for a in parser._actions if a.option_strings and a.dest != "help"}
    shown = re.findall(r"(--[a-z0-9-]+|-o)((?: (?![-|])[^\s\[\]]+)*)", text)  # (flag, its values)
    named = {"--output" if flag == "-o" else flag for flag, _ in shown}
    assert named == set(actions), f"only in README: {named - set(actions)}; only in code: {set(actions) - named}"
    for flag, value in shown:
        action, value = actions["--output" if flag == "-o" else flag], value.split()
        if not value or value[0].isupper() or value[0] in ("...", "FILE"):
            continue  # a placeholder
        if "|" in value[0]:
            assert set(value[0].split("|")) == set(action.choices), flag
        else:
            default = [str(v) for v in (action.default if isinstance(action.default, list) else [action.default])]
            assert _same_values(default, value), f"{flag}: README shows {' '.join(value)}, the default is {action.default}"


def _same_values(default: list[str], shown: list[str]) -> bool:
    """Whether the README's values are the default's (numbers compared as numbers: 3 == 3.0)."""
    try:
        return [float(v) for v in default] == [float(v) for v in shown]
    except ValueError:
        return default == shown


def test_quantization_gates_match_the_code():
    gates = re.search(r"at least ([\d.]+) for int8\s+and ([\d.]+) for int4", README)
    assert gates and (float(gates[1]), float(gates[2])) == (MIN_TOP1_AGREEMENT["int8"], MIN_TOP1_AGREEMENT["int4"])


def test_generate_json_prints_the_keys_the_readme_lists(tiny_bundle, capsys):
    """runtime.generate --json printed a ``tau`` key the README's list left out."""
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # the bundle's export output, if it was made now
    assert generate.main([str(bundle), "--prompt", "hi", "--max-new-tokens", "2", "--threads", "1", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    listed = re.search(r"with `--json` one object with (.*?)\. ", README, re.S).group(1)
    assert re.findall(r"`(\w+)`", listed) == list(printed)

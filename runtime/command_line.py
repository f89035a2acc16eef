"""The argument parser of the project's commands: ``mars-export``, ``mars-train``, ``mars-eval``, the
``python -m runtime.*`` commands and the scripts in ``bench/``, ``scripts/`` and ``samples/``.

A bad command line (a value of the wrong type, an unknown choice or option, a missing argument) is refused as
every other refusal of these commands is: one ``error: ...`` line and exit status 2, not argparse's usage block
(``--help`` still prints the usage). The commands catch :class:`UsageError` with their other errors.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


class UsageError(ValueError):
    """A bad command line (reported as one ``error:`` line, exit status 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose refusals raise :class:`UsageError` instead of printing the usage and
    exiting (argparse documents overriding ``error``; ``exit_on_error=False`` leaves out a missing argument)."""

    def error(self, message: str):
        raise UsageError(message)


def run_main(main: Callable[[], object]) -> int:
    """Run a script's ``main()``, one that parses ``sys.argv`` with :class:`ArgumentParser` and refuses bad values
    through its ``error``, and return the exit status: 0 when it returns (what it returns is ignored), 2 after one
    ``error: MESSAGE`` line on stderr when it raises :class:`UsageError`. For the scripts in ``bench/``, as
    ``sys.exit(run_main(main))``; the commands with a ``main(argv) -> int`` catch :class:`UsageError` themselves."""
    try:
        main()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

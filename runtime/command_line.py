"""The argument parser of the project's commands: ``mars-export``, ``mars-train``, ``mars-eval``, the
``python -m runtime.*`` commands and the scripts in ``bench/``, ``scripts/`` and ``samples/``.

A bad command line (a value of the wrong type, an unknown choice or option, a missing argument) is refused as
every other refusal of these commands is: one ``error: ...`` line and exit status 2, not argparse's usage block
(``--help`` still prints the usage). The commands catch :class:`UsageError` with their other errors; the scripts
run ``main`` through :func:`run_main`, which reports a bad input path (no bundle, no such file) the same way.
An engine's or backend's setting, or a request's parameter, out of range names the option that sets it
(:func:`naming_options`).
A ``--tau`` value is parsed with :func:`tau_value`, the runtime's one rule on tau (several, ``--taus``, with
:func:`make_taus_value`'s), and a ``--threads`` value with :func:`threads_value`, the backend's rule on its
onnxruntime threads; an engine's integer setting (``--max-batch-size``) with :func:`make_engine_int_value`, the
engine's rule. An output path must not be empty or blank (:func:`check_path_given`); a folder of result files
is checked by :func:`check_results_folder` (``--force`` to replace an earlier run's).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# The option that sets each field, for naming_options (the one home of these tables): an EngineConfig setting of
# python -m runtime.serve (and serve_ray), named in its errors that reach past parsing (a TensorRT engine's limits;
# --threads is refused at parsing, by threads_value); a DecodeParams field of python -m runtime.generate (--tau,
# --mode, --draft and --metric are refused at parsing).
ENGINE_FLAGS = {"max_batch_size": "--max-batch-size", "max_seq_len": "--max-seq-len"}
PARAM_FLAGS = {"max_new_tokens": "--max-new-tokens", "block_size": "--block-size", "temperature": "--temperature",
               "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed"}


class UsageError(ValueError):
    """A bad command line (reported as one ``error:`` line, exit status 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose refusals raise :class:`UsageError` instead of printing the usage and
    exiting (argparse documents overriding ``error``; ``exit_on_error=False`` leaves out a missing argument)."""

    def error(self, message: str):
        raise UsageError(message)


def existing_file(text: str) -> Path:
    """``type=`` of an argument naming a file to read: its path, or argparse's refusal naming it (one ``error:``
    line, exit status 2) when there is no such file."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file" if path.is_dir() else
                                         f"{text} does not exist; give an existing file")
    return path


def existing_folder(text: str) -> Path:
    """``type=`` of an argument naming a folder to read: its path, or argparse's refusal naming it."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a folder" if path.exists() else
                                         f"{text} does not exist; give an existing folder")
    return path


def check_path_given(text: str, option: str, what: str) -> None:
    """Refuse an empty or blank ``option`` value (``--output ""``, ``--out " "``), which ``Path`` would read as the
    current directory or a folder named by spaces; ``what`` says what to give.

    Raises:
        UsageError: ``--output is empty: give WHAT``.
    """
    if not text.strip():
        raise UsageError(f"{option} is {_blankness(text)}: give {what}")


def results_name(text: str) -> str:
    """``type=`` of a script's ``--name``: its result files' stem, or argparse's refusal (one ``error:`` line, exit
    status 2) of one that is empty or blank (hidden ``.json``, ``.png``), holds a ``/`` (a folder under ``--out``
    that may not exist, or, with ``..``, one outside it) or is ``.`` or ``..`` (a folder's name)."""
    fix = "give a file stem (the files are NAME.json and the like; --out is their folder)"
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{_blankness(text)}; {fix}")
    if "/" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"{text!r} is a path, not a file name; {fix}")
    return text


def path_value(text: str) -> Path:
    """``type=`` of an option that names an output path (a bench script's ``--out``): the path, or argparse's
    refusal of an empty or blank one (:func:`check_path_given`'s rule: ``''`` would be the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"is {_blankness(text)}: give a path")
    return Path(text)


def _blankness(text: str) -> str:
    """How an empty or blank value is named in a message: ``empty``, or ``blank (' ')``."""
    return "empty" if not text else f"blank ({text!r})"


def check_results_folder(out: Path, names: list[str], force: bool, option: str = "--out") -> None:
    """Refuse, before anything is loaded, a results folder ``out`` (given as ``option``) that the result files
    ``names`` cannot be written to: a file, or a path under one; a symbolic link to nowhere, or a path under one; a
    result's path that is a symbolic link (the run would write where it points); one on a disk or in a
    folder that takes no new entry; one where a result's path is a folder, which no run can replace; and, unless
    ``force``, one that holds results of an earlier run, which this run would replace (``mars-eval --out``, the
    scripts in ``bench/``).

    Raises:
        UsageError: naming the path and the fix.
    """
    dangling = next((path for path in (out, *out.parents) if path.is_symlink() and not path.exists()), None)
    if dangling is not None:
        where = f"{option} {out} is" if dangling == out else f"{option} {out} lies under {dangling},"
        raise UsageError(f"{where} a symbolic link to {os.readlink(dangling)}, which does not exist; make that "
                         f"folder or choose another {option}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{option} {out} is a file, not a directory; choose another {option}")
    above = next((folder for folder in out.parents if folder.exists()), None)
    if above is not None and not above.is_dir():
        raise UsageError(f"{option} {out} lies under {above}, which is a file, not a directory, so no results can "
                         f"be written there; choose another {option}")
    _check_takes_a_folder(out if out.is_dir() else above or Path("."), out, option)
    link = next((out / name for name in names if (out / name).is_symlink()), None)
    if link is not None:
        raise UsageError(f"{option} {out}: {link} is a symbolic link, which this run would write through (to "
                         f"{os.readlink(link)}); remove it or choose another {option}")
    folder = next((out / name for name in names if (out / name).is_dir()), None)
    if folder is not None:
        raise UsageError(f"{option} {out}: {folder} is a folder, where this run writes a file, and --force replaces "
                         f"only files; move it away or choose another {option}")
    earlier = [name for name in names if (out / name).exists()]
    if earlier and not force:
        raise UsageError(f"{option} {out} already holds {', '.join(earlier)} of an earlier run; choose another "
                         f"{option} or pass --force to replace them")


def _check_takes_a_folder(base: Path, out: Path, option: str) -> None:
    """Refuse ``out`` where ``base``, the folder the results (or the folders above them) are made in, takes no new
    entry: a read-only disk, no permission (also for root on a read-only mount), ``/proc``. Tried: a hidden folder
    made there and removed at once."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mars-write-check-", dir=base))
    except OSError as e:
        raise UsageError(f"{option} {out} cannot be written: no folder can be made in {base} "
                         f"{cannot_make_folder(e, option)}") from e


def cannot_make_folder(error: OSError, option: str) -> str:
    """Why no folder could be made for ``option``'s path, and the fix, for a message's end: ``(read-only file
    system); choose an --out on a writable disk``; shared by the output checks of the commands (results folders
    here, :func:`mars_export.output_dir.check_can_write`)."""
    elsewhere = {errno.EROFS: "on a writable disk", errno.EACCES: "where you may write",
                 errno.EPERM: "where you may write"}
    todo = f"choose an {option} {elsewhere[error.errno]}" if error.errno in elsewhere else f"choose another {option}"
    return f"({(error.strerror or str(error)).lower()}); {todo}"


@contextmanager
def naming_options(options: dict[str, str]) -> Iterator[None]:
    """Within it, a :class:`~runtime.decode.admission.SettingError` of a setting in ``options`` (setting -> the
    option that sets it), or a :class:`~runtime.decode.params.ParamError` of a request field in it (field -> the
    option), is raised again naming the option after the setting, as the server's limits name theirs:
    ``max_batch_size (--max-batch-size) must be >= 1, got 0``. The rule and its words stay the engine's, the
    backend's or the request's; any other error passes unchanged."""
    # here: run_main's callers need only the standard library
    from runtime.decode.admission import SettingError
    from runtime.decode.params import ParamError
    try:
        yield
    except (SettingError, ParamError) as e:
        name = e.setting if isinstance(e, SettingError) else e.field
        if name not in options:
            raise
        raise e.naming(options[name]) from e


def tau_value(text: str) -> float:
    """``type=`` of an option taking one tau (``--tau``): the number, or argparse's refusal in the words of the one
    rule on tau (:func:`runtime.decode.params.check_tau`), naming the value as typed, before anything is loaded."""
    from runtime.decode.params import ParamError, check_tau  # imported here: the module loads numpy

    try:
        value = float(text)
    except ValueError:
        value = None  # no number: check_tau refuses it
    try:
        return check_tau(value, shown=text if text.strip() else repr(text))
    except ParamError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def make_taus_value(option: str) -> Callable[[str], float]:
    """``type=`` of ``option``, one taking several taus (``nargs="+"``): :func:`tau_value`, whose refusal of a
    value with a comma adds how to give several (``separate taus by spaces (--taus 0.9 0.8)``, naming ``option``)."""

    def taus_value(text: str) -> float:
        try:
            return tau_value(text)
        except argparse.ArgumentTypeError as e:
            hint = f"; separate taus by spaces ({option} 0.9 0.8)" if "," in text else ""
            raise argparse.ArgumentTypeError(f"{e}{hint}") from None

    return taus_value


def threads_value(text: str) -> int:
    """``type=`` of a ``--threads`` argument (an onnxruntime backend's intra-op threads): the number, or argparse's
    refusal in the words of the backend's rule (:func:`runtime.decode.admission.check_num_threads`: ``argument
    --threads: must be in 0..256 (0 lets onnxruntime choose), got 300``), before anything is loaded."""
    from runtime.decode.admission import SettingError, check_num_threads  # imported here: the module loads numpy

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    try:
        return check_num_threads(value)
    except SettingError as e:
        raise argparse.ArgumentTypeError(e.detail) from None


def make_engine_int_value(setting: str) -> Callable[[str], int]:
    """``type=`` of the option that sets the integer :class:`~runtime.decode.engine.EngineConfig` ``setting``
    (``--max-batch-size``, ``--max-seq-len``): the number, or argparse's refusal by EngineConfig's own rule and in
    its words (``argument --max-batch-size: must be >= 1, got 0``), before any bundle loads; the limits that need
    the bundle (its context, a TensorRT profile) are the engine's, once it loads."""

    def engine_int_value(text: str) -> int:
        # imported here: the modules load numpy
        from runtime.decode.admission import SettingError
        from runtime.decode.engine import EngineConfig

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        try:
            EngineConfig(**{setting: value})
        except SettingError as e:
            raise argparse.ArgumentTypeError(e.detail) from None
        return value

    return engine_int_value


def how_it_ended(returncode: int, shell: bool = False) -> str:
    """How a failed process ended, for a message: ``exit status 1``, or ``killed by signal 11 (SIGSEGV)``.

    Args:
        returncode: ``subprocess``'s return code (a negative one is the signal that killed the process) or, with
            ``shell``, a shell's ``$?`` (128 + the signal's number where a signal killed it).
    """
    number = (returncode - 128 if returncode > 128 else 0) if shell else -returncode
    names = {s.value: s.name for s in signal.Signals}
    if number > 0 and (number in names or not shell):  # a shell's 128 + N that is no signal is the command's own
        return f"killed by signal {number}" + (f" ({names[number]})" if number in names else "")
    return f"exit status {returncode}"


def run_main(main: Callable[[], object]) -> int:
    """Run a script's ``main()``, one that parses ``sys.argv`` with :class:`ArgumentParser`, and return the exit
    status: what ``main`` returns when that is an int, else 0 (None, or a result some main returns); or 2 after
    one ``error: MESSAGE`` line on stderr when it raises an input error, one that names a bad input and its fix:
    :class:`UsageError` (a bad command line, or a value the script refuses through ``parser.error``),
    ``BundleError`` (a path that is no MARS bundle, or a broken one) or ``DataError`` (a missing or malformed data
    file). A closed stdout (``| head``) ends it quietly with status 1. Any other exception is a bug or a failed run
    and keeps its traceback. Used as ``sys.exit(run_main(main))``."""
    # Imported here, and both modules need only the standard library: bench/peers.py runs this in the peer
    # engines' venvs, where the project and its dependencies are not installed.
    from runtime.bundle import BundleError
    from runtime.evaluation.tasks import DataError

    try:
        status = main()
        sys.stdout.flush()  # a closed stdout shows here, where it is caught, not in the flush at exit
    except (UsageError, BundleError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            raise  # another pipe broke (a subprocess's, a socket): a failed run
        # stdout's reader has gone (``| head``): stop quietly, as the Python docs' 'Note on SIGPIPE' does, with
        # stdout pointed at devnull so the flush at exit raises nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return status if isinstance(status, int) else 0

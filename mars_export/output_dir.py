"""Where an export may write its bundle (``-o DIR``), and the leftovers of killed exports beside it.

``--force`` replaces a bundle, never anything else: the output may not be a file or a symbolic link, may not be
or hold the model it is exported from or what a link in the model's folder points to (a Hugging Face hub
snapshot's ``blobs/``; a bundle inside a model's folder is fine), an existing directory is replaced only when
it is a bundle (holds ``mars_config.json``) or is empty, and the export must be able to make its folders there
(:func:`check_can_write`). Torch-free: ``mars-export`` checks before it loads the model. The rules that an output
may not be or hold the model (:func:`check_apart_from_model`) and that it must take a new folder
(:func:`check_can_write`) also guard ``mars-train --output`` (:mod:`mars_export.training.output_dir`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
from pathlib import Path

from mars_export.default_model import DEFAULT_SPEC, MARS_DEFAULT_SPEC, default_model_dir, shipped_adapter_dir
from mars_export.hub_model import is_hub_id, repo_cache_folder
from runtime.bundle import CONFIG_FILE
from runtime.command_line import cannot_make_folder

PARTIAL_MARK = ".partial-"  # hidden work directories: .{name}.partial-{pid}-{random}


def model_paths(spec: str) -> list[Path]:
    """The files and directories the model ``spec`` (as for ``mars-export MODEL``) is read from; for a hub id its
    folder in the hub cache (downloaded yet or not: its ``blobs/`` and ``refs/``) and each snapshot in it (a
    checkpoint directory whose files link into ``blobs/``)."""
    if spec in (DEFAULT_SPEC, MARS_DEFAULT_SPEC):
        return [default_model_dir()] + ([shipped_adapter_dir()] if spec == MARS_DEFAULT_SPEC else [])
    if is_hub_id(spec):
        folder = repo_cache_folder(spec)
        return [folder, *sorted(folder.glob("snapshots/*"))]
    return [Path(spec)]


def check_output_dir(out_dir: Path, model_paths: list[Path], overwrite: bool) -> None:
    """Raise if the bundle may not be written to ``out_dir``; nothing is left behind (:func:`check_can_write` makes
    a folder and removes it at once).

    Checked where the export lands (:func:`landing_path`), so ``-o a/new/../../x`` is checked as ``x``, which is where
    the export writes it (making no ``a/new``); the messages name ``out_dir`` as given and, where they differ, where
    it lands (:func:`named_path`).

    Raises:
        ValueError: ``out_dir`` is a symbolic link or not a directory, lies under a file, overlaps one of ``model_paths``
            (:func:`check_apart_from_model`), (with ``overwrite``) is a non-empty directory that is not a bundle, or
            no folder can be made where the export makes its first one (:func:`check_can_write`).
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    where, named = landing_path(out_dir), named_path(out_dir)
    if where.is_symlink():
        raise ValueError(f"-o {named} is a symbolic link; give the directory it points to, or another -o")
    blocker = _file_on_path(where)
    if blocker is not None:
        raise ValueError(f"-o {named} lies under {blocker}, which is a file, not a directory, so no bundle can be "
                         "written there; choose another -o")
    check_apart_from_model(out_dir, model_paths, "-o")
    if where.exists() and not where.is_dir():
        raise ValueError(f"-o {named} is a file, not a directory; choose another -o")
    if where.exists() and not overwrite:
        raise FileExistsError(f"{named} already exists; choose another -o or pass --force to replace it")
    if where.exists() and not (where / CONFIG_FILE).is_file() and any(where.iterdir()):
        raise ValueError(f"-o {named} is not a MARS bundle (no {CONFIG_FILE}) and not empty; --force replaces "
                         "only a bundle: choose another -o, or move its files away")
    check_can_write(out_dir)


def check_can_write(out_dir: Path, flag: str = "-o", into: bool = False) -> None:
    """Raise ValueError where the export could not make its first folder: its work directory beside ``out_dir``
    (:func:`partial_prefix`; renamed to ``out_dir`` at the end) or, where ``out_dir``'s parent is missing, the
    folder :func:`make_parent_folders` makes first in the nearest existing folder above it. Tried as the export
    does it (a hidden folder made there and removed at once), so a read-only disk, missing permissions (also for
    root on a read-only mount) and a folder that takes no new entries (``/proc``) all fail here, before the model
    loads. One killed meanwhile is a stale partial (:func:`remove_stale_partials`).

    Args:
        out_dir: the output as given.
        flag: the option that gives it, named in the message (``-o``; ``--output`` for ``mars-train``).
        into: the command writes into ``out_dir`` itself (``mars-train`` its checkpoints): an existing ``out_dir``
            must take a new folder, not the folder above it.
    """
    where = landing_path(out_dir)
    above = next(folder for folder in where.parents if folder.exists())  # the root always exists
    base = where if into and where.is_dir() else above
    try:
        os.rmdir(tempfile.mkdtemp(prefix=partial_prefix(out_dir), dir=base))
    except OSError as e:
        raise ValueError(f"{flag} {named_path(out_dir)} cannot be written: no folder can be made in {base} "
                         f"{cannot_make_folder(e, flag)}") from e


def landing_path(out_dir: Path) -> Path:
    """Where the export writes ``-o out_dir`` once it has made the missing folders above it
    (:func:`make_parent_folders`): the folder above with its symbolic links and ``..`` resolved as the OS will then
    resolve them (``a/new/../../x`` is ``x``, though ``a/new/../..`` names nothing while ``a/new`` is missing), the
    last name as given (a link there is refused, not followed); ``-o x/..`` is where that ``..`` leads."""
    if out_dir.name == "..":
        return Path(os.path.realpath(out_dir))
    return Path(os.path.realpath(out_dir.parent), out_dir.name)


def landing_if_other(path: Path) -> Path | None:
    """Where ``path`` lands (:func:`landing_path`) where that differs from ``path`` in more than being relative (a
    ``..`` or a symbolic link on the way), else None."""
    where = landing_path(path)
    return None if where == Path.cwd() / path else where


def named_path(path: Path) -> str:
    """``path`` as messages name it: as given, and where it lands if that is not plain from it
    (:func:`landing_if_other`): ``a/new/../../x (that is /home/me/x)``."""
    where = landing_if_other(path)
    return str(path) if where is None else f"{path} (that is {where})"


def _file_on_path(out_dir: Path) -> Path | None:
    """The nearest existing folder above ``out_dir`` when it is no folder (a file: ``README.md/sub``), else None."""
    for parent in out_dir.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def check_apart_from_model(out_dir: Path, model_paths: list[Path], flag: str, what: str = "the model") -> None:
    """Raise ValueError if ``out_dir`` is or contains one of ``model_paths``, or what a link in one of them points
    to (a Hugging Face hub snapshot's files link into ``../../blobs/``): writing there (``mars-export``,
    ``mars-train``) could overwrite the model's files, and replacing it (``--force``) would delete them. An output
    inside a model's folder is fine. ``flag`` names the option in the message, ``what`` the paths ("the model",
    "the adapter"). A link that cannot be resolved (a loop) points at nothing to overwrite and is skipped; an
    ``out_dir`` that cannot be resolved is refused."""
    target = _resolved(out_dir)
    if target is None:
        raise ValueError(f"{flag} {out_dir} cannot be resolved (a symbolic link loop on its path); "
                         f"choose another {flag}")
    for path in model_paths:
        source = _resolved(path)
        if source is not None and (target == source or target in source.parents):
            how = "is" if target == source else "contains"
            raise ValueError(f"{flag} {named_path(out_dir)} {how} {what} {path}; writing there could overwrite or "
                             f"delete its files: choose another {flag}")
        for link in _links_under(path):
            real = _resolved(link)
            if real is not None and (target == real or target in real.parents):
                raise ValueError(f"{flag} {named_path(out_dir)} {'is' if target == real else 'holds'} {real}, which "
                                 f"{what}'s {link} links to; writing there could overwrite or delete it: choose "
                                 f"another {flag}")


def _resolved(path: Path) -> Path | None:
    """``path`` with every symbolic link resolved, or None where that cannot be done (a link loop). Read with
    ``os.path.realpath``, which on a loop leaves the looping link in the path on every Python version (where
    ``Path.resolve`` raises on 3.10-3.12 and, from 3.13, returns such a path), so a link left in it marks a loop."""
    try:
        real = Path(os.path.realpath(path))
        return None if any(part.is_symlink() for part in (real, *real.parents)) else real
    except OSError:
        return None


def _links_under(folder: Path) -> list[Path]:
    """The symbolic links in ``folder`` and its subfolders (linked folders not entered); none for a file."""
    return [Path(parent, name) for parent, folders, files in os.walk(folder) for name in folders + files
            if Path(parent, name).is_symlink()]


def make_parent_folders(out_dir: Path) -> list[Path]:
    """Make the missing folders above ``out_dir`` (``-o a/b/c/bundle`` where only ``a`` exists: ``a/b``, ``a/b/c``).

    Returns:
        The folders this call made, outermost first (one another process made meanwhile is not among them), for
        :func:`remove_empty_folders` to remove should the export fail.

    Raises:
        OSError: a folder cannot be made (its ``filename`` names it); those made before it are removed.
    """
    missing = list(itertools.takewhile(lambda folder: not folder.exists(), out_dir.parents))
    made = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                if not folder.is_dir():
                    raise
                continue  # another process made it: not ours to remove
            made.append(folder)
    except BaseException:
        remove_empty_folders(made)
        raise
    return made


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove those of ``folders`` (:func:`make_parent_folders`'s) that are empty, innermost first; one that holds
    anything (another process wrote there meanwhile) stays, and so do the folders above it."""
    for folder in reversed(folders):
        with contextlib.suppress(OSError):  # not empty, or gone
            folder.rmdir()


def remove_stale_partials(out_dir: Path) -> None:
    """Remove the work directories that exports to ``out_dir`` killed outright (SIGKILL) left beside it:
    those whose process no longer runs. A live export's, or one whose name has no process id, stays."""
    prefix = f".{out_dir.name}{PARTIAL_MARK}"
    for path in out_dir.parent.iterdir() if out_dir.parent.is_dir() else ():
        pid = path.name[len(prefix):].split("-")[0]
        if path.name.startswith(prefix) and path.is_dir() and not path.is_symlink() and pid.isdigit() \
                and not _is_running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def partial_prefix(out_dir: Path) -> str:
    """The name prefix of this process's work directory for ``out_dir`` (``tempfile.mkdtemp`` adds the rest)."""
    return f".{out_dir.name}{PARTIAL_MARK}{os.getpid()}-"


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True

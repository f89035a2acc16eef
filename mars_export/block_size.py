"""Choose the block size B of an export (DESIGN.md §1; the paper trains B = 4, 8 and 16).

In order: ``--block``; the one recorded with the model (``mars_block_size`` in the
``config.json`` that ``mars-train`` writes, ``block_size`` in the shipped adapter's
``mars_adapter.json`` for ``default-mars``); a ``blkN`` word anywhere in the checkpoint's
name (between separators ``-``, ``_``, ``.`` or the name's ends; for a hub id the name after
``owner/``, and the export says it came from the id), which is where the authors'
published checkpoints keep it (``MARS-Qwen2.5-0.5B-blk4``, ``MARS-Qwen2.5-0.5B-blk8-no-sft``).
A name with ``blk0`` or two different ``blkN`` is refused. Torch-free: it runs before the
model is loaded, so a missing block size costs no model load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mars_export.default_model import (ADAPTER_INFO_FILE, DEFAULT_SPEC, MARS_DEFAULT_SPEC, MODEL_SPECS_HELP,
                                       shipped_adapter_dir)
from mars_export.hub_model import HubSnapshot

# "blk4" as a whole word of a name: after a start or a separator, before an end or a separator.
_NAME_BLOCK = re.compile(r"(?:^|[-_.])blk(\d+)(?=$|[-_.])", re.IGNORECASE)


def resolve_block_size(requested: int | None, spec: str, snapshot: HubSnapshot | None = None) -> tuple[int, str]:
    """Return ``(block_size, origin)``, ``origin`` saying where it came from, for the export log.

    Args:
        requested: ``--block``, or None.
        spec: the model spec given to ``mars-export`` (see :func:`mars_export.model_source.load_model`).
        snapshot: ``spec``'s snapshot where it is a hub id (:func:`mars_export.hub_model.fetch_snapshot`): read
            from its folder in the hub cache, named in errors by the id and revision given.

    Raises:
        ValueError: no block size is requested, recorded or in the name (the message asks for
            ``--block``; for ``default``, the base model, it also names ``default-mars``), the
            name's ``blkN`` is unusable (:func:`block_size_from_name`), or ``spec`` names no file
            and no default model (the message lists the accepted names).
    """
    if requested is not None:
        return requested, "--block"
    location = str(snapshot.path) if snapshot else spec  # where the model's files are
    recorded = recorded_block_size(location)
    if recorded is not None:
        return recorded, "recorded with the model"
    if spec == DEFAULT_SPEC:
        raise ValueError(f"'{DEFAULT_SPEC}' is the base model, not trained for MARS, and records no block size: "
                         f"pass --block B, or export '{MARS_DEFAULT_SPEC}' (the shipped MARS adapter, block size "
                         f"{recorded_block_size(MARS_DEFAULT_SPEC)})")
    if snapshot is not None:  # the id's name, not its folder in the hub cache, which the user never typed
        guessed = block_size_in_names([snapshot.repo_id.split("/")[-1]])
        if guessed is not None:
            return guessed[0], f"from the hub id {snapshot.repo_id!r}"
    path = Path(location).resolve()
    guessed = None if snapshot else block_size_from_name(path)
    if guessed is not None:
        block, name = guessed
        where = "" if name in (path.name, path.stem) else f" {name!r} above it"
        return block, f"from the directory name{where}"
    if not path.exists():
        raise ValueError(f"cannot load model {spec!r}: no such file or directory (expected {MODEL_SPECS_HELP})")
    raise ValueError(f"{snapshot.source if snapshot else spec} records no block size and its name has no 'blkN': "
                     "pass --block B, the block size it was trained with (the paper's checkpoints: 4, 8 or 16)")


def recorded_block_size(spec: str) -> int | None:
    """The block size recorded with the model ``spec``, or None (also for unreadable files,
    which the model loader reports). A packaged name (``default``, ``default-mars``) is never read
    as a directory of the working directory, as the model loader does not read it so either."""
    path = Path(spec)
    if spec == MARS_DEFAULT_SPEC:
        return _read_int(shipped_adapter_dir() / ADAPTER_INFO_FILE, "block_size")
    if spec != DEFAULT_SPEC and path.is_dir():
        return _read_int(path / "config.json", "mars_block_size")
    return None


def block_size_from_name(path: Path) -> tuple[int, str] | None:
    """``(B, name)`` from the ``blkN`` word of the checkpoint's name, or None if it has none.

    The name is the directory's (a ``.gguf`` file's stem); for a Hugging Face hub cache
    snapshot (``models--ORG--NAME/snapshots/REV``) the repository's, and for a trainer's
    ``checkpoint-*`` directory its parent's. ``blkN`` may stand anywhere in the name as a
    word (``-blk8-no-sft``, ``-blk4-v2``); ``myblk4`` is no word.

    Raises:
        ValueError: the name says ``blk0`` (a block size must be >= 1), or two different ``blkN``.
    """
    names = [path.stem if path.suffix == ".gguf" else path.name]
    if path.parent.name == "snapshots":
        names.append(path.parent.parent.name)
    if path.name.startswith("checkpoint-"):
        names.append(path.parent.name)
    return block_size_in_names(names)


def block_size_in_names(names: list[str]) -> tuple[int, str] | None:
    """``(B, name)`` from the first of ``names`` with a ``blkN`` word (:func:`block_size_from_name`), or None.

    Raises:
        ValueError: the name says ``blk0``, or two different ``blkN``.
    """
    for name in names:
        found = sorted({int(n) for n in _NAME_BLOCK.findall(name)})
        if len(found) > 1:
            raise ValueError(f"the name {name!r} gives {len(found)} block sizes "
                             f"({', '.join(f'blk{n}' for n in found)}): pass --block B")
        if found == [0]:
            raise ValueError(f"the name {name!r} gives block size 0 (blk0), but a block size must be >= 1: "
                             "pass --block B, the block size the model was trained with")
        if found:
            return found[0], name
    return None


def _read_int(path: Path, key: str) -> int | None:
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None

"""Where ``mars-train`` may write (``--output DIR``), checked before the model loads so that nothing is lost.

Training writes checkpoints (``checkpoint-N/``) straight into ``--output`` as it goes: they are the run's
resumable state. The final model (``config.json``, the weights, the tokenizer files, a LoRA run's ``adapter/``) is
written to a hidden folder there first (:data:`FINAL_WORK_DIR`) and moved in once complete, replacing an earlier
final model's whole, as :data:`FINAL_MANIFEST` lists it (:func:`move_final_model`): a run killed while saving it
leaves no half-written model among them.
Hence: a fresh run takes a missing or empty directory; ``--resume`` takes one that holds a run's checkpoints (that
run's own ``--output``); either must be one training can make or write in, and neither a file, nor the model it
trains, the adapter it starts from (``--lora-init``) or a folder holding them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

from mars_export.output_dir import check_apart_from_model, check_can_write, model_paths
from mars_export.training.config import TrainConfig

FINAL_WORK_DIR = ".final-model.partial"  # in --output: the final model while it is written
FINAL_MANIFEST = ".final-model.json"  # in --output: a JSON list of the final model's file and folder names there
ADAPTER_DIR = "adapter"  # in the final model: a LoRA run's adapter alone
# a Hugging Face checkpoint's weights: one file, or shards NNNNN-of-NNNNN and their index; safetensors or torch's .bin
WEIGHTS_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)|"
                          r"(model\.safetensors|pytorch_model\.bin)\.index\.json")


def find_resume_checkpoint(config: TrainConfig) -> str | None:
    """The checkpoint to resume from, or None for a fresh run; nothing is left changed.

    Raises:
        ValueError: ``--output`` is a file, is or contains the model or the ``--lora-init`` adapter, cannot be
            made or written (:func:`~mars_export.output_dir.check_can_write`), or is not empty on a fresh run
            (naming ``--resume`` when it holds checkpoints); ``--resume`` without a checkpoint in ``--output``.
    """
    output = Path(config.output)
    check_apart_from_model(output, model_paths(config.model), "--output")
    if config.lora and config.lora.init:
        check_apart_from_model(output, [Path(config.lora.init)], "--output", "the adapter")
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file, not a directory; choose another --output")
    check_can_write(output, "--output", into=True)
    last = get_last_checkpoint(str(output)) if output.is_dir() else None
    if config.resume and last is None:
        raise ValueError(f"--resume: no checkpoint-* directory in {output}; point --output at the folder holding "
                         "the run's checkpoint-N directories, or drop --resume to start a fresh run into a new or "
                         "empty folder")
    if not config.resume and last is not None:
        raise ValueError(f"{output} already holds {Path(last).name}; pass --resume to continue "
                         "from it, or choose another --output")
    held = sorted(path.name for path in output.iterdir()) if output.is_dir() and not config.resume else []
    if held == [FINAL_WORK_DIR]:
        raise ValueError(f"--output {output} holds only {FINAL_WORK_DIR}, the unfinished final model of a run killed "
                         f"while saving it, and no checkpoint-N to --resume: remove {output} or "
                         "choose another --output")
    if held:
        raise ValueError(f"--output {output} is not empty and holds no checkpoint-N to --resume; training would "
                         "overwrite files there (config.json, the weights): choose a new or empty --output, or, if "
                         f"it is what a run left that stopped before its first checkpoint, remove {output}")
    return last


def move_final_model(work: Path, output: Path) -> None:
    """Move the final model's files from ``work`` (:data:`FINAL_WORK_DIR`) into ``output``, then remove ``work``.

    They replace an earlier final model's (a folder such as ``adapter/`` as a whole), and the earlier model's files
    and folders the new one lacks (:func:`read_final_names`: its ``adapter/`` under a full run's model, other
    shards, ...) are removed, while checkpoints and other files stay. The earlier ``config.json`` is removed first
    and the new one moved in last, so that until the move is done ``output`` is no checkpoint a loader takes: a kill
    meanwhile leaves no mix of the two models that loads. :data:`FINAL_MANIFEST` then lists the names of both models
    until the earlier one's are gone, so that the move a rerun makes removes what a killed one left.
    """
    new_names = {path.name for path in work.iterdir()}
    old_names = read_final_names(output)
    (output / "config.json").unlink(missing_ok=True)
    write_final_names(output, old_names | new_names)
    for name in sorted(old_names - new_names):
        remove_entry(output / name)
    for path in sorted(work.iterdir(), key=lambda path: (path.name == "config.json", path.name)):
        if path.name == "config.json":
            write_final_names(output, new_names)
        target = output / path.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(path, target)
    work.rmdir()


def read_final_names(output: Path) -> set[str]:
    """The names of an earlier final model's files and folders in ``output``, as :data:`FINAL_MANIFEST` lists them.

    An output without one (a final model moved in before the manifest was written, or none), or whose manifest is
    no JSON list of names (edited by hand, or another tool's file), gets the names a loader would take from it:
    ``config.json``, the weight files (:data:`WEIGHTS_FILE`; a loader prefers ``model.safetensors`` to an index, and
    would take an old one beside new shards) and ``adapter/``. Only plain names are returned, never a path, a hidden
    name or a checkpoint's, so the move removes nothing else.
    """
    try:
        names = json.loads((output / FINAL_MANIFEST).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):  # ValueError: not JSON, or not UTF-8
        names = None
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        names = [path.name for path in output.iterdir() if path.name in ("config.json", ADAPTER_DIR)
                 or WEIGHTS_FILE.fullmatch(path.name) and path.is_file()]
    return {name for name in names if name and name == Path(name).name and not name.startswith((".", "checkpoint-"))}


def write_final_names(output: Path, names: set[str]) -> None:
    """Write ``names`` to :data:`FINAL_MANIFEST` in ``output`` whole (to a temporary file renamed over it)."""
    partial = output / f"{FINAL_MANIFEST}.partial"
    partial.write_text(json.dumps(sorted(names)) + "\n")
    os.replace(partial, output / FINAL_MANIFEST)


def remove_entry(path: Path) -> None:
    """Remove the file, link or folder (with what it holds) at ``path``, if any."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)

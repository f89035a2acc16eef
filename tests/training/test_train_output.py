"""``mars-train --output``: one error line before the model loads, and nothing touched, for a folder training
would overwrite; a fresh run takes a new or empty folder, ``--resume`` the run's own."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from tiny_mars import make_model
from transformers import AutoModelForCausalLM

from mars_export.training.cli import main
from mars_export.training.config import LoraSettings, TrainConfig
from mars_export.training.output_dir import FINAL_MANIFEST, FINAL_WORK_DIR, find_resume_checkpoint, move_final_model


def files_under(path: Path) -> dict[str, bytes]:
    """The files under ``path`` and their contents, but for the final model's manifest (a test of its own)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.relative_to(path) != Path(FINAL_MANIFEST)}


def make_adapter(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    return path


@pytest.fixture
def model(tiny_checkpoint, tmp_path) -> Path:
    """A copy of the tiny checkpoint in its own folder under tmp_path (tmp_path/models/model)."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "models" / "model"))


@pytest.mark.parametrize("make_output, extra, message", [
    (lambda tmp, model: model, [], "is the model"),
    (lambda tmp, model: model.parent, [], "contains the model"),
    (lambda tmp, model: tmp / "models" / "adapter", ["--lora", "--lora-init"], "is the adapter"),
    (lambda tmp, model: tmp / "notes.txt", [], "is a file, not a directory"),
    (lambda tmp, model: tmp / "mine", [], "is not empty and holds no checkpoint-N to --resume"),
    (lambda tmp, model: model, ["--resume"], "is the model"),
], ids=["model", "holds-model", "lora-init", "file", "foreign-folder", "resume-into-model"])
def test_an_output_training_would_overwrite_is_refused(model, tiny_jsonl, tmp_path, capsys, make_output, extra,
                                                       message):
    make_adapter(tmp_path / "models" / "adapter")
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("my own config")
    (model / "checkpoint-1").mkdir()  # a model trained earlier into its own folder: --resume must not write there
    if "--lora-init" in extra:
        extra = [*extra, str(tmp_path / "models" / "adapter")]
    before = files_under(tmp_path)
    assert main([str(model), "--data", tiny_jsonl, "--output", str(make_output(tmp_path, model)), "--max-steps", "1",
                 *extra]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0]
    assert files_under(tmp_path) == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_that_cannot_be_made_is_refused_before_the_model_loads(model, tiny_jsonl, capsys, monkeypatch):
    """--output /sys/kernel/x (here /proc/x: /proc takes no new folders, for root too) loaded the model, then the
    Trainer failed making it: a PermissionError traceback, exit status 1. mars-export's rule (check_can_write)
    refuses it in one line, before the model loads."""
    monkeypatch.setattr("mars_export.training.trainer.load_model", lambda *a: pytest.fail("the model was loaded"))
    assert main([str(model), "--data", tiny_jsonl, "--output", "/proc/x", "--max-steps", "1"]) == 2
    line, = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert line.startswith("error: --output /proc/x cannot be written: no folder can be made in /proc ("), line
    assert "choose" in line and "Errno" not in line


def test_an_existing_output_training_cannot_write_in_is_refused(tmp_path, monkeypatch):
    """Training writes into --output itself (its checkpoints), so an existing folder is tried, not the one above
    it: a read-only one (root on a read-only disk) is refused naming it, and nothing is left there."""
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)

    def refuse(*args, dir=None, **kwargs):
        if Path(dir) == run:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_mkdtemp(*args, dir=dir, **kwargs)
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(ValueError) as raised:
        find_resume_checkpoint(config(run, resume=True))
    assert str(raised.value) == (f"--output {run} cannot be written: no folder can be made in {run} (read-only file "
                                 "system); choose an --output on a writable disk")
    monkeypatch.undo()
    assert find_resume_checkpoint(config(run, resume=True)) == str(run / "checkpoint-2")
    assert os.listdir(run) == ["checkpoint-2"]


def config(output: Path, resume: bool = False, model: str = "default", lora: LoraSettings | None = None):
    return TrainConfig(model=model, data=["d.jsonl"], output=str(output), resume=resume, lora=lora)


def test_a_fresh_run_takes_a_new_or_empty_folder_and_resume_its_own(tmp_path):
    assert find_resume_checkpoint(config(tmp_path / "new")) is None
    assert find_resume_checkpoint(config(tmp_path)) is None  # empty
    run = tmp_path / "run"
    for name in ("checkpoint-3", "checkpoint-5"):
        (run / name).mkdir(parents=True)
    (run / "config.json").write_text("{}")  # the final model of the run so far
    assert find_resume_checkpoint(config(run, resume=True)) == str(run / "checkpoint-5")
    with pytest.raises(ValueError, match="already holds checkpoint-5; pass --resume"):
        find_resume_checkpoint(config(run))
    with pytest.raises(ValueError, match="--resume: no checkpoint-.*; point --output at the folder holding the run's "
                                         "checkpoint-N directories, or drop --resume to start a fresh run"):
        find_resume_checkpoint(config(tmp_path / "new", resume=True))


def test_a_run_may_write_inside_the_models_folder(tmp_path):
    """Only being or holding the model (or the adapter it starts from) can overwrite their files."""
    model, adapter = tmp_path / "model", make_adapter(tmp_path / "adapter")
    model.mkdir()
    lora = LoraSettings(init=str(adapter))
    assert find_resume_checkpoint(config(model / "run", model=str(model), lora=lora)) is None
    assert find_resume_checkpoint(config(adapter / "run", model=str(model), lora=lora)) is None


def test_a_link_loop_in_the_models_folder_is_passed_by(tmp_path):
    """A link that cannot be resolved (a loop: Path.resolve raises on Python 3.10-3.12 and returns the loop's
    link from 3.13; the check reads os.path.realpath, which leaves it on all) points at nothing training could
    overwrite: the check passes it by and still finds an overlap; an --output on a loop is refused, also where
    the loop is in the middle of its path."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "a").symlink_to("b")
    (model / "b").symlink_to("a")
    assert find_resume_checkpoint(config(tmp_path / "run", model=str(model))) is None
    with pytest.raises(ValueError, match="is the model"):
        find_resume_checkpoint(config(model, model=str(model)))
    with pytest.raises(ValueError, match=r"cannot be resolved \(a symbolic link loop on its path\); choose another"):
        find_resume_checkpoint(config(model / "a" / "run", model=str(model)))
    with pytest.raises(ValueError, match="cannot be resolved"):
        find_resume_checkpoint(config(model / "a" / "b" / "run", model=str(model)))


class Killed(Exception):
    """Stands for the process being killed."""


def make_final_model(path: Path, weights: list[str], tag: str) -> Path:
    """A stand-in final model in ``path``: ``config.json``, the weight files named, a tokenizer; contents ``tag``."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ["config.json", *weights, "tokenizer.json"]:
        (path / name).write_text(tag)
    return path


# the manifest (both models), model.safetensors, tokenizer.json, the manifest (the new model), config.json
@pytest.mark.parametrize("num_renames", range(5))
def test_a_kill_while_the_final_model_moves_in_leaves_no_config(tmp_path, monkeypatch, num_renames):
    """Over an earlier final model (a --resume after a finished run), a kill at any point of the move leaves no
    config.json, so no loader takes a mix of the two models for a checkpoint; a rerun that writes the final model
    again and moves it in leaves the new one only."""
    output = make_final_model(tmp_path / "run", ["model.safetensors"], "old")
    work = make_final_model(output / FINAL_WORK_DIR, ["model.safetensors"], "new")
    replace = os.replace

    def killed_after_renames(source, target):
        if killed_after_renames.num_done == num_renames:
            raise Killed
        killed_after_renames.num_done += 1
        replace(source, target)

    killed_after_renames.num_done = 0
    monkeypatch.setattr(os, "replace", killed_after_renames)
    with pytest.raises(Killed):
        move_final_model(work, output)
    assert not (output / "config.json").exists()
    monkeypatch.undo()
    shutil.rmtree(work)
    move_final_model(make_final_model(work, ["model.safetensors"], "new"), output)
    assert files_under(output) == {name: b"new" for name in ("config.json", "model.safetensors", "tokenizer.json")}


SINGLE = ["model.safetensors"]
TWO_SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
THREE_SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["model.safetensors.index.json"]


@pytest.mark.parametrize("old_weights, new_weights", [(SINGLE, TWO_SHARDS), (TWO_SHARDS, SINGLE),
                                                      (TWO_SHARDS, THREE_SHARDS), (SINGLE, SINGLE)],
                         ids=["single-to-shards", "shards-to-single", "two-to-three-shards", "same"])
def test_the_final_model_moved_in_leaves_only_its_own_weight_files(tmp_path, old_weights, new_weights):
    """An earlier final model's weight files that the new one lacks are removed; checkpoints and other files stay."""
    output = make_final_model(tmp_path / "run", old_weights, "old")
    make_final_model(output / "checkpoint-2", SINGLE, "checkpoint")
    (output / "training_args.bin").write_text("old")
    move_final_model(make_final_model(output / FINAL_WORK_DIR, new_weights, "new"), output)
    expected = {name: b"new" for name in ["config.json", *new_weights, "tokenizer.json"]}
    expected |= {f"checkpoint-2/{name}": b"checkpoint" for name in ["config.json", *SINGLE, "tokenizer.json"]}
    assert files_under(output) == expected | {"training_args.bin": b"old"}


def test_an_earlier_final_models_adapter_files_the_new_one_lacks_are_removed(tmp_path):
    """A LoRA run's final model over an earlier one's (a --resume after a finished run): the adapter folder is
    replaced as a whole, so an old adapter/adapter_model.bin does not stay beside the new adapter_model.safetensors
    (PEFT loads the safetensors first, but the folder would hold two adapters); the checkpoints stay."""
    output = make_final_model(tmp_path / "run", SINGLE, "old")
    old_adapter = output / "adapter"
    old_adapter.mkdir()
    for name in ("adapter_config.json", "adapter_model.bin", "README.md"):
        (old_adapter / name).write_text("old")
    make_final_model(output / "checkpoint-2", SINGLE, "checkpoint")
    work = make_final_model(output / FINAL_WORK_DIR, SINGLE, "new")
    (work / "adapter").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (work / "adapter" / name).write_text("new")
    move_final_model(work, output)
    expected = {name: b"new" for name in ["config.json", *SINGLE, "tokenizer.json", "adapter/adapter_config.json",
                                          "adapter/adapter_model.safetensors"]}
    expected |= {f"checkpoint-2/{name}": b"checkpoint" for name in ["config.json", *SINGLE, "tokenizer.json"]}
    assert files_under(output) == expected


def test_a_sharded_final_model_over_a_single_file_one_loads_as_the_new_model(tmp_path):
    """The case a stale file would break: a loader takes model.safetensors before model.safetensors.index.json."""
    output, new = tmp_path / "run", make_model()
    make_model().save_pretrained(output)
    with torch.no_grad():
        new.model.embed_tokens.weight.add_(1.0)
    new.save_pretrained(output / FINAL_WORK_DIR, max_shard_size="100KB")
    assert (output / FINAL_WORK_DIR / "model.safetensors.index.json").exists()
    move_final_model(output / FINAL_WORK_DIR, output)
    loaded = AutoModelForCausalLM.from_pretrained(output)
    assert torch.equal(loaded.model.embed_tokens.weight, new.model.embed_tokens.weight)


def make_lora_final_model(path: Path, tag: str) -> Path:
    """A stand-in final model of a LoRA run: :func:`make_final_model`'s and ``adapter/``; contents ``tag``."""
    make_final_model(path / "adapter", ["adapter_model.safetensors"], tag)
    return make_final_model(path, SINGLE, tag)


def make_full_final_model(path: Path, tag: str) -> Path:
    """A stand-in final model of a full run (``Trainer.save_model``): ``training_args.bin`` beside the model."""
    return make_final_model(path, [*SINGLE, "training_args.bin"], tag)


@pytest.mark.parametrize("make_old, make_new", [(make_lora_final_model, make_full_final_model),
                                                (make_full_final_model, make_lora_final_model)],
                         ids=["lora-then-full", "full-then-lora"])
def test_a_final_model_moved_in_over_another_leaves_none_of_the_earlier_ones_files(tmp_path, make_old, make_new):
    """A full run's final model over a LoRA run's leaves no stale adapter/ beside it (a loader could take it), and a
    LoRA run's over a full run's no stale training_args.bin; the checkpoints and the user's files stay."""
    output = tmp_path / "run"
    make_final_model(output / "checkpoint-2", SINGLE, "checkpoint")
    (output / "notes.txt").write_text("user")
    move_final_model(make_old(output / FINAL_WORK_DIR, "old"), output)
    move_final_model(make_new(output / FINAL_WORK_DIR, "new"), output)
    expected = {f"checkpoint-2/{name}": b"checkpoint" for name in ["config.json", *SINGLE, "tokenizer.json"]}
    expected |= {"notes.txt": b"user"} | files_under(make_new(tmp_path / "expected", "new"))
    assert files_under(output) == expected


def test_an_earlier_final_model_without_a_manifest_loses_its_adapter(tmp_path):
    """A final model moved in before the manifest existed: its adapter/ goes with its config.json and weights, the
    other files stay (nothing says they were the model's)."""
    output = make_lora_final_model(tmp_path / "run", "old")
    (output / "notes.txt").write_text("user")
    move_final_model(make_full_final_model(output / FINAL_WORK_DIR, "new"), output)
    assert files_under(output) == {"notes.txt": b"user", "tokenizer.json": b"new"} | {
        name: b"new" for name in ["config.json", *SINGLE, "training_args.bin"]}


@pytest.mark.parametrize("manifest", [b"{not json", b"\xff\xfe", b'{"adapter": 1}', b'["adapter", 3]'],
                         ids=["not-json", "not-utf8", "not-a-list", "not-names"])
def test_a_manifest_that_is_no_list_of_names_counts_as_none(tmp_path, manifest):
    """A broken manifest (edited by hand, another tool's file) does not fail the move at the end of a run: the move
    takes the names a loader would read, as for an output without one."""
    output = make_lora_final_model(tmp_path / "run", "old")
    (output / FINAL_MANIFEST).write_bytes(manifest)
    move_final_model(make_full_final_model(output / FINAL_WORK_DIR, "new"), output)
    assert files_under(output) == {"tokenizer.json": b"new"} | {
        name: b"new" for name in ["config.json", *SINGLE, "training_args.bin"]}


def test_a_rerun_after_a_kill_during_the_move_removes_what_the_killed_move_brought_in(tmp_path, monkeypatch):
    """A LoRA run's move over a full run's model killed after moving adapter/ in, then a full run's final model
    (a --resume without --lora): the manifest listed both models' names during the move, so adapter/ goes."""
    output = tmp_path / "run"
    move_final_model(make_full_final_model(output / FINAL_WORK_DIR, "old"), output)
    replace = os.replace

    def killed_after_the_adapter(source, target):
        replace(source, target)
        if Path(target).name == "adapter":
            raise Killed

    monkeypatch.setattr(os, "replace", killed_after_the_adapter)
    with pytest.raises(Killed):
        move_final_model(make_lora_final_model(output / FINAL_WORK_DIR, "new"), output)
    monkeypatch.undo()
    assert (output / "adapter").is_dir() and not (output / "config.json").exists()
    shutil.rmtree(output / FINAL_WORK_DIR)
    move_final_model(make_full_final_model(output / FINAL_WORK_DIR, "newer"), output)
    assert files_under(output) == files_under(make_full_final_model(tmp_path / "expected", "newer"))

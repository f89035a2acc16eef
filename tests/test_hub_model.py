"""MODEL as a Hugging Face hub id (``owner/name``): found in the local hub cache, loaded as a checkpoint directory.

No network: tiny random checkpoints are laid out as ``snapshot_download`` leaves a download in ``HF_HOME/hub``
(``models--owner--name/blobs/`` named by hash, ``snapshots/COMMIT/`` linking to them, ``refs/main``), and the
commands run in a subprocess with ``HF_HOME`` there and ``HF_HUB_OFFLINE=1``, or in this process with the hub
cache moved there (the ``hub_cache`` fixture) and ``HF_HUB_OFFLINE`` set. Tier 1 checks the id rules, the files
asked for and the output-folder guard with no model; tier 2 exports a tiny model by its id, trains it
(mars-train) and sends it (scripts/gpu_train.py prepare).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file
from support import ROOT, export, load_script
from tiny_models import make_a2d_checkpoint, make_checkpoint

from mars_export import cli as export_cli
from mars_export.block_size import resolve_block_size
from mars_export.default_model import check_model_spec
from mars_export.hub_model import (CONFIG_AND_TOKENIZER_FILES, SAFETENSORS_FILES, HubSnapshot, check_revision,
                                   fetch_snapshot, is_hub_id)
from mars_export.output_dir import check_output_dir, model_paths
from mars_export.training import cli as train_cli
from mars_export.training.config import TrainConfig
from mars_export.training.transfer import assemble_checkpoint, receive_part
from runtime.bundle import load_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "Xalphinions/MARS-tiny-qwen2-blk4"  # the published layout; block size 4 from the name
TIMEOUT_S = 600


def make_hub_cache(hf_home: Path, repo_id: str, checkpoint: Path, commit: str = COMMIT) -> Path:
    """Lay ``checkpoint``'s files out in ``hf_home/hub`` as a download of ``repo_id`` at ``commit`` (branch
    ``main``); return the snapshot folder."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot, blobs = repo / "snapshots" / commit, repo / "blobs"
    for folder in (snapshot, blobs, repo / "refs"):
        folder.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for file in checkpoint.iterdir():
        blob = blobs / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def run_offline(hf_home: Path, module: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m module argv`` with the hub cache in ``hf_home`` and the hub unreachable (HF_HUB_OFFLINE)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env |= {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=TIMEOUT_S, check=False)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """This process's hub cache moved to ``tmp_path/hf/hub`` (huggingface_hub reads HF_HOME at import)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    return tmp_path / "hf"


# --- tier 1: which strings are hub ids, what is downloaded, where an export may write ---

@pytest.mark.parametrize("spec, expected", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("owner/name.v2", True),
    ("foo", False), ("./missing", False), ("a/b/c", False), ("/abs/model", False), ("../model", False),
    ("dir/model.gguf", False), ("owner--x/name", False), ("owner/name@main", False), ("", False),
])
def test_which_strings_are_hub_ids(spec, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id(spec) is expected


def test_a_local_path_is_never_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("owner/name").mkdir(parents=True)
    Path("owner/file").write_text("")
    assert not is_hub_id("owner/name") and not is_hub_id("owner/file")


@pytest.mark.parametrize("spec", ["foo", "./missing", "a/b/c"])
def test_neither_path_nor_hub_id_keeps_the_clear_error_naming_hub_ids(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"no such file or directory .*Hugging Face hub id owner/name"):
        check_model_spec(spec)


@pytest.mark.parametrize("make", [Path.mkdir, lambda path: path.write_text("")], ids=["folder", "file"])
def test_a_local_path_spelled_as_a_hub_id_that_is_no_model_says_it_shadows_the_id(make, tmp_path, monkeypatch):
    """mars-export owner/name -o owner/name/bundle makes ./owner/name; the next run of owner/name reads that folder,
    and the error says why the hub id was not fetched."""
    monkeypatch.chdir(tmp_path)
    Path("owner").mkdir()
    make(Path("owner/name"))
    with pytest.raises(ValueError) as raised:
        check_model_spec("owner/name")
    message = str(raised.value)
    assert "a local path wins over the Hugging Face hub id owner/name" in message
    assert "(holding config.json)" not in message


def test_a_path_not_spelled_as_a_hub_id_that_is_no_model_says_nothing_of_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("a/b/c").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"it is a directory without config.json \(expected 'default'") as raised:
        check_model_spec("a/b/c")
    assert "local path wins" not in str(raised.value)


def test_a_hub_id_passes_the_torch_free_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_model_spec(REPO)


def test_revision_is_for_hub_ids_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_revision(REPO, "v1")
    for spec in ("default", str(tmp_path)):
        with pytest.raises(ValueError, match="--revision v1 .* no hub id"):
            check_revision(spec, "v1")
    with pytest.raises(ValueError, match="no hub id"):
        TrainConfig(model="default", data=["d.jsonl"], output="out", revision="v1")


def test_only_the_files_loading_reads_are_asked_for():
    """SmolLM2-135M-Instruct's repository: neither its ONNX nor its GGUF nor torch's .bin next to safetensors."""
    repo_files = ["config.json", "generation_config.json", "merges.txt", "model.safetensors", "onnx/model.onnx",
                  "onnx/model_q4.onnx", "onnx/config.json", "pytorch_model.bin", "smollm2.Q4_K_M.gguf", "README.md",
                  ".gitattributes", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
                  "vocab.json", "runs/events.txt"]
    chosen = set(filter_repo_objects(repo_files, allow_patterns=list(CONFIG_AND_TOKENIZER_FILES + SAFETENSORS_FILES)))
    assert chosen == {"config.json", "generation_config.json", "merges.txt", "model.safetensors",
                      "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"}


SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]


@pytest.mark.parametrize("weights, fetched, calls", [(SHARDS + ["pytorch_model.bin"], SHARDS, 1),
                                                     (["pytorch_model.bin"], ["pytorch_model.bin"], 2)])
def test_torch_weights_are_fetched_only_without_safetensors(weights, fetched, calls, tmp_path, monkeypatch):
    """A stand-in for snapshot_download writes the repository's files that the patterns allow."""
    asked = []

    def download(repo_id, revision, allow_patterns):
        asked.append(allow_patterns)
        snapshot = tmp_path / "snapshots" / COMMIT
        snapshot.mkdir(parents=True, exist_ok=True)
        for name in filter_repo_objects(["config.json", "tokenizer.json", "model.gguf", *weights],
                                        allow_patterns=allow_patterns):
            (snapshot / name).write_text("")
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.snapshot_download", download)
    snapshot = fetch_snapshot("owner/name")
    assert len(asked) == calls
    assert sorted(p.name for p in snapshot.path.iterdir()) == sorted(["config.json", "tokenizer.json", *fetched])
    assert (snapshot.repo_id, snapshot.revision, snapshot.commit) == ("owner/name", "main", COMMIT)


def test_an_unreachable_hub_is_one_line_with_the_fix(monkeypatch):
    def download(repo_id, revision, allow_patterns):
        raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")

    monkeypatch.setattr("huggingface_hub.snapshot_download", download)
    with pytest.raises(ValueError) as raised:
        fetch_snapshot("owner/name", "v2")
    message = str(raised.value)
    assert "\n" not in message and message.startswith("cannot load model 'owner/name' at revision 'v2': ")
    assert "not in the local cache" in message and "could not be reached" in message
    assert "hf download owner/name --revision v2" in message


@pytest.mark.parametrize("raised, code, line", [
    (OSError(errno.ENOSPC, "No space left on device", "/cache/blobs/x"), 2,
     "error: cannot load the model: /cache/blobs/x: no space left on device; free space on its disk"),
    (KeyboardInterrupt(), 130, "error: interrupted; nothing was written")])
def test_a_download_that_stops_is_one_line(raised, code, line, tmp_path, monkeypatch, capsys):
    """A full disk or Ctrl-C while mars-export fetches a hub id: one line, no traceback, nothing written."""
    def fetch(repo_id, revision):
        raise raised

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(export_cli, "fetch_snapshot", fetch)
    assert export_cli.main(["owner/name", "-o", "out", "--block", "4"]) == code
    assert capsys.readouterr().err.splitlines() == [line] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("revision, resolved", [([], f"revision main, commit {COMMIT}"),
                                                (["--revision", COMMIT], f"commit {COMMIT}")])
def test_a_hub_model_without_a_block_size_is_named_by_its_id(revision, resolved, tmp_path, hub_cache, monkeypatch,
                                                              capsys):
    """No block size recorded and no blkN in the id: the error names the id and revision the user typed, not the
    snapshot folder in the cache, and says to pass --block."""
    snapshot = make_hub_cache(hub_cache, "owner/name", make_checkpoint("llama", tmp_path / "ckpt"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    capsys.readouterr()  # the progress bar of saving the checkpoint
    assert export_cli.main(["owner/name", "-o", "out", *revision]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: owner/name (Hugging Face hub, {resolved}) records no block size and its name "
                           "has no 'blkN': pass --block B")
    assert str(snapshot) not in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("repo_id, expected", [
    ("owner/tiny-blk4", (4, "from the hub id 'owner/tiny-blk4'")),
    ("blk8/tiny", None),  # the owner is no part of the model's name (its cache folder is models--blk8--tiny)
    ("owner/tiny-blk0", "the name 'tiny-blk0' gives block size 0 (blk0)")])
def test_a_block_size_in_a_hub_ids_name_is_said_to_come_from_the_id(repo_id, expected, tmp_path, hub_cache):
    """The export logged 'from the directory name 'models--owner--tiny-blk4' above it', the hub cache's folder,
    which the user never typed; the id is where it came from (its revision and commit are on the line before)."""
    path = make_hub_cache(hub_cache, repo_id, make_checkpoint("llama", tmp_path / "ckpt"))
    snapshot = HubSnapshot(repo_id, "main", COMMIT, path)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=re.escape(expected)):
            resolve_block_size(None, repo_id, snapshot)
    elif expected is None:
        with pytest.raises(ValueError, match="records no block size and its name has no 'blkN'"):
            resolve_block_size(None, repo_id, snapshot)
    else:
        assert resolve_block_size(None, repo_id, snapshot) == expected


def test_the_output_may_not_be_or_hold_a_cached_hub_model(tmp_path, hub_cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    snapshot = make_hub_cache(hub_cache, "owner/name", make_checkpoint("llama", tmp_path / "ckpt"))
    repo = snapshot.parents[1]
    assert model_paths("owner/name") == [repo, snapshot]
    for out, why in [(snapshot, "is the model"), (repo / "blobs", "links to"), (hub_cache, "contains the model")]:
        with pytest.raises(ValueError, match=why):
            check_output_dir(out, model_paths("owner/name"), overwrite=True)
    check_output_dir(tmp_path / "bundle", model_paths("owner/name"), overwrite=False)
    assert model_paths("owner/other") == [hub_cache / "hub" / "models--owner--other"]  # not downloaded yet


# --- tier 2: mars-export by hub id, from the cache ---

def test_export_by_hub_id_from_the_cache(tmp_path):
    """The published layout by its id, with neither --block (from the id's name) nor --mask-token; the bundle
    records the id and the commit."""
    hf_home = tmp_path / "hf"
    make_hub_cache(hf_home, REPO, make_a2d_checkpoint("qwen2", tmp_path / "ckpt"))
    done = run_offline(hf_home, "mars_export.cli", REPO, "-o", "bundle", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    config = load_config(tmp_path / "bundle")
    assert config.source_model == f"{REPO} (Hugging Face hub, revision main, commit {COMMIT})"
    assert config.block_size == 4 and config.parity["max_abs_logit_diff"] <= 1e-3
    log = done.stderr.splitlines()
    assert f"model {REPO} (Hugging Face hub, revision main, commit {COMMIT})" in log
    assert f"block size 4 (from the hub id '{REPO}'; pass --block to change)" in log


def test_an_export_by_hub_id_resolves_it_once(tmp_path, hub_cache, monkeypatch):
    """The snapshot that gave the block size is the one loaded: one snapshot_download (a round trip to the hub
    online), and the bundle records the revision asked for beside its commit."""
    import huggingface_hub
    make_hub_cache(hub_cache, REPO, make_a2d_checkpoint("qwen2", tmp_path / "ckpt"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    asked, real = [], huggingface_hub.snapshot_download

    def counted(repo_id, **kwargs):
        asked.append((repo_id, kwargs["revision"]))
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", counted)
    bundle = export(REPO, tmp_path / "bundle", 4, 4)
    assert asked == [(REPO, "main")]
    assert load_config(bundle).source_model == f"{REPO} (Hugging Face hub, revision main, commit {COMMIT})"


@pytest.mark.parametrize("argv, which", [(["owner/missing"], "'owner/missing'"),
                                         ([REPO, "--revision", "v2"], f"'{REPO}' at revision 'v2'")])
def test_a_model_not_in_the_cache_is_one_error_line_and_writes_nothing(argv, which, tmp_path):
    hf_home = tmp_path / "hf"
    make_hub_cache(hf_home, REPO, make_checkpoint("llama", tmp_path / "ckpt"))
    done = run_offline(hf_home, "mars_export.cli", *argv, "-o", "out/bundle", "--block", "4", cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: cannot load model {which}: ") and "Traceback" not in done.stderr
    assert "not in the local cache" in lines[0] and "could not be reached (HF_HUB_OFFLINE is set)" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_local_directory_of_the_same_name_wins(tmp_path, hub_cache, monkeypatch):
    make_hub_cache(hub_cache, "owner/name", make_checkpoint("llama", tmp_path / "cached", seed=1))
    monkeypatch.chdir(tmp_path)
    make_checkpoint("llama", Path("owner/name"))
    bundle = export("owner/name", tmp_path / "bundle", 4, 4, "--mask-token", "<mask>")
    assert load_config(bundle).source_model == str((tmp_path / "owner" / "name").resolve())


# --- mars-train and mars-train distill by hub id ---

def write_data(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"add {i} and {i}", "response": f"{2 * i}"}) + "\n"
                            for i in range(4)))
    return path


@pytest.mark.parametrize("command, files", [([], ["--data", "data.jsonl", "--output", "run"]),
                                            (["distill"], ["--prompts", "data.jsonl", "--output", "out.jsonl"])],
                         ids=["train", "distill"])
@pytest.mark.parametrize("model, which", [(["owner/missing"], "'owner/missing'"),
                                          ([REPO, "--revision", "v2"], f"'{REPO}' at revision 'v2'")])
def test_mars_train_says_a_model_not_in_the_cache_in_one_line_as_mars_export_does(command, files, model, which,
                                                                                 tmp_path, hub_cache, monkeypatch,
                                                                                 capsys):
    """The hub's errors are about the model, not how the command was typed: no usage line before them."""
    make_hub_cache(hub_cache, REPO, make_checkpoint("llama", tmp_path / "ckpt"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    write_data(tmp_path / "data.jsonl")
    capsys.readouterr()  # the progress bar of saving the checkpoint
    assert train_cli.main([*command, *model, *files]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: cannot load model {which}: ") and "not in the local cache" in line
    assert not (tmp_path / "run").exists() and not (tmp_path / "out.jsonl").exists()


def test_mars_train_by_hub_id_logs_the_commit_it_trains(tmp_path, hub_cache, monkeypatch, caplog):
    make_hub_cache(hub_cache, REPO, make_a2d_checkpoint("qwen2", tmp_path / "ckpt"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    data = write_data(tmp_path / "data.jsonl")
    with caplog.at_level(logging.INFO):
        assert train_cli.main([REPO, "--data", str(data), "--output", str(tmp_path / "run"), "--max-steps", "1",
                               "--save-steps", "0", "--block-size", "2", "--max-length", "128"]) == 0
    assert f"model {REPO} (Hugging Face hub, revision main, commit {COMMIT})" in caplog.messages
    assert (tmp_path / "run" / "config.json").is_file()


# --- scripts/gpu_train.py prepare by hub id (the GPU machine has no network: the snapshot is fetched here) ---

def test_gpu_train_sends_a_hub_model_at_the_revision_given(tmp_path, hub_cache, monkeypatch):
    gpu_train = load_script(ROOT / "scripts" / "gpu_train.py")
    make_hub_cache(hub_cache, "owner/name", make_checkpoint("llama", tmp_path / "ckpt"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    prompts = write_data(tmp_path / "prompts.jsonl")
    assert gpu_train.main(["prepare", "owner/name", "--revision", COMMIT, "--prompts", str(prompts),
                           "--out", str(tmp_path / "parts")]) == 0
    for part in sorted((tmp_path / "parts").glob("part-*")):
        receive_part(part, tmp_path / "store")
    base = load_file(tmp_path / "ckpt" / "model.safetensors")
    rebuilt = load_file(assemble_checkpoint(tmp_path / "store", tmp_path / "rebuilt") / "model.safetensors")
    assert base.keys() == rebuilt.keys() and all(torch.equal(base[k], rebuilt[k]) for k in base)
    source = json.loads((tmp_path / "store" / "source.json").read_text())  # train names the adapter's base so
    assert source == {"base_model": f"owner/name (Hugging Face hub, commit {COMMIT})"}


@pytest.mark.parametrize("model, message", [
    ("owner/name", "error: cannot load model 'owner/name' at revision 'v2': "),
    ("ckpt", "error: --revision v2 picks a version of a Hugging Face hub model, but 'ckpt' is no hub id")])
def test_gpu_train_refuses_a_revision_it_cannot_send_in_one_line(model, message, tmp_path, hub_cache, monkeypatch,
                                                                 capsys):
    gpu_train = load_script(ROOT / "scripts" / "gpu_train.py")
    make_hub_cache(hub_cache, "owner/name", make_checkpoint("llama", tmp_path / "ckpt"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    write_data(tmp_path / "prompts.jsonl")
    capsys.readouterr()  # the progress bar of saving the checkpoint
    assert gpu_train.main(["prepare", model, "--revision", "v2", "--prompts", "prompts.jsonl"]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(message) and not (tmp_path / ".gpu-run").exists()

"""mars-export and mars-train distill refuse what they cannot do right, with one error line, and lose nothing:
sliding-window models get their context capped to the window, the output may only replace a bundle, the mask
token must be a spare special or new token, packaged model names are never read from the working directory."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

import pytest
from support import export
from tiny_models import make_checkpoint
from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config

from mars_export import bundle_writer, model_source
from mars_export import cli as export_cli
from mars_export.block_size import resolve_block_size
from mars_export.context import config_fields, max_context_of
from mars_export.onnx_export import export_step_graph
from mars_export.output_dir import check_output_dir, make_parent_folders, named_path, remove_stale_partials
from mars_export.parity import ParityError
from mars_export.training import cli as train_cli
from mars_export.training import distill as distill_module
from runtime import generate
from runtime.bundle import load_config
from runtime.context import sliding_window

SLIDING_WINDOW = 24
DEAD_PID = 4_194_305  # above Linux's largest pid (2**22): no process has it


def error_lines(capsys) -> list[str]:
    """stderr lines that report an error (progress bars of model loading may precede them)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]


def run_export(capsys, model, out, *extra) -> tuple[int, list[str]]:
    code = export_cli.main([str(model), "-o", str(out), *extra])
    return code, error_lines(capsys)


def files_under(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# --- sliding-window attention: the bundle's context is capped to the window ---

@pytest.mark.parametrize("config, expected", [
    (MistralConfig(sliding_window=300), 300),
    (MistralConfig(sliding_window=None), None),
    (MistralConfig(sliding_window=300, layer_types=["full_attention"] * 32), 300),  # not Mistral's: all slide
    (Qwen2Config(use_sliding_window=False, sliding_window=300), None),
    (Qwen2Config(use_sliding_window=True, sliding_window=300, num_hidden_layers=2, max_window_layers=1), 300),
    (Qwen2Config(use_sliding_window=True, sliding_window=300, num_hidden_layers=2, max_window_layers=2), None),
    (LlamaConfig(), None),
], ids=["mistral", "mistral-none", "mistral-layer-types", "qwen2-off", "qwen2-upper-layer", "qwen2-no-layer", "llama"])
def test_sliding_window_follows_the_configs_attention(config, expected):
    assert sliding_window(config_fields(config)) == expected


@pytest.mark.parametrize("fields, expected", [
    ({"sliding_window": 300}, 300),
    ({"use_sliding_window": False, "sliding_window": 300, "max_window_layers": 0, "num_hidden_layers": 2}, None),
    ({"use_sliding_window": True, "sliding_window": 300, "max_window_layers": 1, "num_hidden_layers": 2}, 300),
    ({"use_sliding_window": True, "sliding_window": 300, "max_window_layers": 2, "num_hidden_layers": 2}, None),
    ({"sliding_window": 300, "layer_types": ["sliding_attention", "full_attention"]}, 300),
    ({"sliding_window": 300, "layer_types": ["full_attention"]}, None),
    ({}, None),
], ids=["every-layer", "qwen2.5-off", "qwen2-upper-layer", "qwen2-no-layer", "layer-types", "no-sliding-type",
        "none"])
def test_sliding_window_of_config_json_fields(fields, expected):
    """A config.json as published (Qwen2.5: no layer_types, which transformers derives from max_window_layers)."""
    assert sliding_window(fields) == expected


@pytest.mark.parametrize("fields", [
    {"model_type": "qwen2", "sliding_window": 300, "max_window_layers": 0, "num_hidden_layers": 2},
    {"model_type": "qwen3", "sliding_window": 300, "max_window_layers": 0, "num_hidden_layers": 2},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 300, "num_hidden_layers": 2},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 300, "num_hidden_layers": 30},
    {"model_type": "qwen3", "use_sliding_window": True, "max_window_layers": 0, "num_hidden_layers": 2},
    {"model_type": "a2d-qwen2", "sliding_window": 300, "max_window_layers": 0, "num_hidden_layers": 2},
    {"model_type": "mistral"},
    {"model_type": "gemma2", "num_hidden_layers": 2},
    {"model_type": "gemma3_text", "sliding_window": 300, "num_hidden_layers": 2},
    {"model_type": "gemma3_text", "sliding_window": 300, "sliding_window_pattern": 1, "num_hidden_layers": 2},
    {"model_type": "llama"},
], ids=["qwen2-no-use-field", "qwen3-no-use-field", "qwen2-no-max-window-layers", "qwen2-layers-past-28",
        "qwen3-no-window-field", "a2d-qwen2", "mistral-no-window-field", "gemma2-defaults", "gemma3-pattern",
        "gemma3-pattern-1", "llama"])
def test_a_config_json_lacking_fields_reads_as_transformers_reads_it(fields):
    """A field a config.json lacks means transformers' default for its model type (Qwen2's use_sliding_window
    is False, max_window_layers 28; Mistral's and Gemma's sliding_window 4096; ...): the torch-free rule over
    the raw fields gives what it gives over the transformers config loaded from them."""
    model_type = {"a2d-qwen2": "qwen2"}.get(fields["model_type"], fields["model_type"])
    config = AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k != "model_type"})
    assert sliding_window(fields) == sliding_window(config_fields(config))


@pytest.mark.parametrize("fields", [
    {"model_type": "mistral", "layer_types": ["full_attention"] * 2},
    {"model_type": "phi3", "layer_types": ["full_attention"] * 2},
    {"model_type": "gemma2", "sliding_window_pattern": 1},
], ids=["mistral-layer-types", "phi3-layer-types", "gemma2-sliding-window-pattern"])
def test_a_field_transformers_does_not_read_is_not_read(fields):
    """A config.json field transformers ignores for the model type (runtime.context.UNREAD_FIELDS): here each
    would say no layer slides, yet transformers slides Mistral's and Phi3's every layer (their modeling applies
    sliding_window to all) and Gemma2's every other one (layer_types derived with 2, whatever the pattern)."""
    fields = {**fields, "sliding_window": 300, "num_hidden_layers": 2}
    config = AutoConfig.for_model(fields["model_type"], **{k: v for k, v in fields.items() if k != "model_type"})
    if fields["model_type"] == "gemma2":
        assert config.layer_types == ["sliding_attention", "full_attention"]
    assert sliding_window(fields) == 300 == sliding_window(config_fields(config))


def test_a_window_wider_than_the_context_caps_nothing():
    assert max_context_of(MistralConfig(sliding_window=4096, max_position_embeddings=512)) == (512, None)


def save_sliding_model(arch: str, directory: Path) -> Path:
    """A 2-layer random Mistral, or Qwen2 whose second layer only slides (max_window_layers 1), with a
    SLIDING_WINDOW-token window in a 512-token context."""
    qwen2 = {"use_sliding_window": True, "max_window_layers": 1} if arch == "qwen2" else {}
    return make_checkpoint(arch, directory, sliding_window=SLIDING_WINDOW, **qwen2)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_window_caps_the_bundles_context(arch, tmp_path, capsys):
    checkpoint = save_sliding_model(arch, tmp_path / arch)
    bundle = export(str(checkpoint), tmp_path / "bundle", 4, 4, "--mask-token", "<mask>")
    log = capsys.readouterr().err
    assert f"max context {SLIDING_WINDOW} tokens, the model's sliding attention window" in log
    config = load_config(bundle)
    assert config.max_context == SLIDING_WINDOW and config.parity["max_abs_logit_diff"] <= 1e-3
    assert generate.main([str(bundle), "--prompt", "hi", "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    assert generate.main([str(bundle), "--prompt", "x" * 30, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"exceeds the {SLIDING_WINDOW} positions a slot can hold" in err[0]


# --- the output directory: --force replaces a bundle, nothing else ---

@pytest.fixture
def checkpoint(tiny_bundle):
    return tiny_bundle("llama", 4)[0]


@pytest.mark.parametrize("where, message", [
    (lambda ckpt, tmp: ckpt, "is the model"),
    (lambda ckpt, tmp: ckpt.parent, "contains the model"),
])
def test_output_overlapping_the_model_is_refused(checkpoint, tmp_path, capsys, where, message):
    before = files_under(checkpoint.parent)
    code, err = run_export(capsys, checkpoint, where(checkpoint, tmp_path), "--block", "4", "--force")
    assert code == 2 and len(err) == 1 and message in err[0]
    assert files_under(checkpoint.parent) == before and not (checkpoint / "bundle").exists()


def test_a_bundle_may_be_written_inside_the_models_folder(tmp_path):
    """Only being or holding the model can delete its files: a bundle inside its folder (e.g. beside a
    mars-train run's checkpoints) is allowed, also replaced with --force."""
    model = tmp_path / "run"
    model.mkdir()
    check_output_dir(model / "bundle", [model], overwrite=False)
    (model / "bundle").mkdir()
    (model / "bundle" / "mars_config.json").write_text("{}")
    check_output_dir(model / "bundle", [model], overwrite=True)


def make_hub_snapshot(model: Path, hub: Path) -> Path:
    """``model``'s files in the Hugging Face hub cache's layout under ``hub``: models--org--tiny/snapshots/<rev>/NAME
    are links to ../../blobs/<hash>, the files themselves."""
    repo = hub / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(model.iterdir())):
        (blobs / f"blob{i}").write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    return snapshot


def test_output_holding_a_hub_snapshots_blobs_is_refused(checkpoint, tmp_path, capsys):
    snapshot = make_hub_snapshot(checkpoint, tmp_path / "hub")
    before = files_under(tmp_path / "hub")
    code, err = run_export(capsys, snapshot, snapshot.parent.parent / "blobs", "--block", "4", "--force")
    assert code == 2 and len(err) == 1 and "which the model's" in err[0] and "links to" in err[0]
    assert files_under(tmp_path / "hub") == before
    assert check_output_dir(snapshot / "bundle", [snapshot], overwrite=False) is None  # inside it is still fine


def test_force_keeps_a_bundle_the_models_files_link_into(tmp_path):
    """--force replaces a bundle, but not one holding a file a link in the model's folder points to."""
    bundle, model = tmp_path / "bundle", tmp_path / "model"
    bundle.mkdir()
    model.mkdir()
    (bundle / "mars_config.json").write_text("{}")
    (bundle / "model.safetensors").write_bytes(b"the model's weights")
    (model / "model.safetensors").symlink_to(bundle / "model.safetensors")
    with pytest.raises(ValueError, match="holds .*model.safetensors, which the model's .* links to"):
        check_output_dir(bundle, [model], overwrite=True)


def test_force_keeps_a_folder_that_is_no_bundle(checkpoint, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, err = run_export(capsys, checkpoint, out, "--block", "4", "--force")
    assert code == 2 and len(err) == 1 and "is not a MARS bundle (no mars_config.json)" in err[0]
    assert files_under(out) == {"notes.txt": b"keep me"} and sorted(os.listdir(tmp_path)) == ["mine"]


@pytest.mark.parametrize("make, message", [
    (lambda out, tmp: out.write_text("a file"), "is a file, not a directory"),
    (lambda out, tmp: out.symlink_to(tmp / "target", target_is_directory=True), "is a symbolic link"),
])
def test_force_refuses_a_file_or_a_link(checkpoint, tmp_path, capsys, make, message):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "mars_config.json").write_text("{}")
    out = tmp_path / "out"
    make(out, tmp_path)
    before = files_under(tmp_path)
    code, err = run_export(capsys, checkpoint, out, "--block", "4", "--mask-token", "<mask>", "--force")
    assert code == 2 and len(err) == 1 and message in err[0]
    assert files_under(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["out", "target"]


def test_an_output_under_a_file_is_refused_before_the_model_loads(checkpoint, tmp_path, capsys):
    """README.md/sub/bundle: one line naming the file in the path (no traceback, no errno text), nothing made."""
    (tmp_path / "notes.txt").write_text("a file")
    code, err = run_export(capsys, checkpoint, tmp_path / "notes.txt" / "sub" / "bundle", "--block", "4",
                           "--mask-token", "<mask>")
    assert code == 2 and len(err) == 1, err
    assert f"lies under {tmp_path / 'notes.txt'}, which is a file, not a directory" in err[0]
    assert "choose another -o" in err[0] and "Errno" not in err[0]
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_a_full_disk_gives_one_line_and_leaves_no_partial_bundle(checkpoint, tmp_path, monkeypatch, capsys):
    """ENOSPC while the bundle is written (after the graph is saved into the work directory): one error line
    naming -o, the problem and what to do; the work directory is removed."""
    written = []

    def export_then_fill_the_disk(model, path, *args, **kwargs):
        export_step_graph(model, path, *args, **kwargs)
        written.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write() to a full disk: no file name
    monkeypatch.setattr(bundle_writer, "export_step_graph", export_then_fill_the_disk)
    out = tmp_path / "out" / "bundle"
    code, err = run_export(capsys, checkpoint, out, "--block", "4", "--mask-token", "<mask>")
    assert written and code == 2 and len(err) == 1, err
    assert err[0] == (f"error: cannot write the bundle to -o {out}: no space left on device; free space on its "
                      "disk, or choose an -o on another disk (no bundle was written)")
    assert os.listdir(tmp_path) == []  # no bundle, no partial directory, no folder made for it


@pytest.mark.parametrize("failure, expected_code", [
    (ParityError("max |Δlogit| 9.9 > 0.001"), 2),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 2),
    (KeyboardInterrupt(), 130),
], ids=["parity", "enospc", "interrupt"])
def test_a_failed_export_removes_the_empty_folders_it_made_and_no_others(tmp_path, monkeypatch, capsys, failure,
                                                                          expected_code):
    """-o kept/a/b/c/bundle where only kept/ exists, the export failing once the folders are made: a/b/c go, but
    not kept/ (there before) nor a/ (a file landed in it meanwhile), so a failed export leaves no empty folders."""
    checkpoint = make_checkpoint("llama", tmp_path / "ckpt")
    (tmp_path / "kept").mkdir()

    def fail(model, path, *args, **kwargs):
        assert path.parent.parent == tmp_path / "kept" / "a" / "b" / "c"  # the work directory beside -o
        (tmp_path / "kept" / "a" / "notes.txt").write_text("not the export's")
        raise failure

    monkeypatch.setattr(bundle_writer, "export_step_graph", fail)
    code, _ = run_export(capsys, checkpoint, tmp_path / "kept" / "a" / "b" / "c" / "bundle", "--block", "4",
                         "--mask-token", "<mask>")
    assert code == expected_code
    assert files_under(tmp_path / "kept") == {"a/notes.txt": b"not the export's"}
    assert os.listdir(tmp_path / "kept" / "a") == ["notes.txt"]


def test_folders_above_the_output_made_before_one_that_cannot_be_made_are_removed(tmp_path, monkeypatch):
    """-o a/b/c/bundle, a/ made and b/ refused (a full disk): the error names b/, and a/ is removed."""
    mkdir = Path.mkdir

    def no_room_for_b(self, *args, **kwargs):
        if self.name == "b":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", no_room_for_b)
    with pytest.raises(OSError) as raised:
        make_parent_folders(tmp_path / "a" / "b" / "c" / "bundle")
    assert raised.value.filename == str(tmp_path / "a" / "b") and os.listdir(tmp_path) == []


class ModelLoaded(Exception):
    """Raised by a stand-in for load_model: the export got past its output checks."""


@pytest.fixture
def no_model_load(monkeypatch):
    """mars-export may not load the model: its output checks must refuse first."""
    def load_model(*args, **kwargs):
        raise ModelLoaded
    monkeypatch.setattr(model_source, "load_model", load_model)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("out", ["/proc/forbidden/x", "/proc/x"])
def test_an_output_whose_folder_cannot_be_made_is_refused_before_the_model_loads(checkpoint, capsys, no_model_load,
                                                                                 out):
    """-o /proc/forbidden/x (a folder to make first) or /proc/x (the work directory beside it): /proc takes no new
    folders, for root too (ENOENT; EACCES for others). One line, before the model loads, nothing made."""
    code, err = run_export(capsys, checkpoint, out, "--block", "4", "--mask-token", "<mask>")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: -o {out} cannot be written: no folder can be made in /proc (")
    assert "choose" in err[0] and "Errno" not in err[0]
    assert not any(name.startswith(".x.partial-") for name in os.listdir("/proc"))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write in a folder without write permission")
def test_an_output_under_a_read_only_folder_is_refused_before_the_model_loads(checkpoint, tmp_path, capsys,
                                                                              no_model_load):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        code, err = run_export(capsys, checkpoint, tmp_path / "ro" / "a" / "bundle", "--block", "4")
        assert code == 2 and len(err) == 1, err
        assert f"no folder can be made in {tmp_path / 'ro'} (permission denied); choose an -o where you may write" \
            in err[0]
        assert os.listdir(tmp_path / "ro") == []
    finally:
        (tmp_path / "ro").chmod(0o755)


@pytest.mark.parametrize("failure, todo", [(errno.EROFS, "choose an -o on a writable disk"),
                                           (errno.EACCES, "choose an -o where you may write"),
                                           (errno.ENOSPC, "choose another -o")])
def test_a_folder_that_cannot_be_made_names_the_folder_and_the_fix(tmp_path, monkeypatch, failure, todo):
    """A read-only disk (root too), no permission, a full disk: the folder where the export would make its first
    folder, the problem and what to do; nothing made."""
    def refuse(*args, dir=None, **kwargs):
        raise OSError(failure, os.strerror(failure), str(Path(dir) / ".bundle.partial-1-x"))
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(ValueError) as raised:
        check_output_dir(tmp_path / "a" / "b" / "bundle", [], overwrite=False)
    assert str(raised.value) == (f"-o {tmp_path / 'a' / 'b' / 'bundle'} cannot be written: no folder can be made in "
                                 f"{tmp_path} ({os.strerror(failure).lower()}); {todo}")
    assert os.listdir(tmp_path) == []


def test_a_writable_output_is_checked_without_leaving_anything(tmp_path):
    check_output_dir(tmp_path / "bundle", [], overwrite=False)
    check_output_dir(tmp_path / "a" / "b" / "bundle", [], overwrite=False)
    assert os.listdir(tmp_path) == []


def test_an_output_that_is_a_file_is_refused_before_the_model_loads(checkpoint, tmp_path, capsys, no_model_load):
    (tmp_path / "out").write_text("a file")
    code, err = run_export(capsys, checkpoint, tmp_path / "out", "--block", "4")
    assert code == 2 and err == [f"error: -o {tmp_path / 'out'} is a file, not a directory; choose another -o"]
    assert os.listdir(tmp_path) == ["out"]


def test_an_output_reached_through_a_missing_folder_is_checked_where_it_lands(checkpoint, tmp_path, capsys,
                                                                              no_model_load):
    """-o a/new/../../mine --force, new/ missing: the OS follows that '..' only once the export has made new/, and
    then the path is mine/, a folder that is no bundle: refused before the model loads, nothing made. The message
    says which folder that is (it named only the path as typed)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    out = tmp_path / "a" / "new" / ".." / ".." / "mine"
    code, err = run_export(capsys, checkpoint, out, "--block", "4", "--force")
    assert code == 2 and err == [f"error: -o {out} (that is {tmp_path / 'mine'}) is not a MARS bundle (no "
                                 "mars_config.json) and not empty; --force replaces only a bundle: choose another -o, "
                                 "or move its files away"], err
    assert files_under(tmp_path) == {"mine/notes.txt": b"keep me"} and os.listdir(tmp_path / "a") == []


def test_an_output_reached_through_a_missing_folder_leaves_no_folder_behind(checkpoint, tmp_path, capsys):
    """-o a/new/../../fresh, new/ missing: the bundle lands in fresh/; the export made a/new only to pass through
    it and left it behind, empty. It makes only the folders above where the bundle lands (none here)."""
    (tmp_path / "a").mkdir()
    export(str(checkpoint), tmp_path / "a" / "new" / ".." / ".." / "fresh", 4, 4, "--mask-token", "<mask>")
    assert (tmp_path / "fresh" / "mars_config.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["a", "fresh"] and os.listdir(tmp_path / "a") == []
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["bundle"] == str(tmp_path / "fresh")


def test_an_output_is_named_as_typed_and_also_where_it_lands_where_that_is_not_plain(tmp_path, monkeypatch):
    real = Path(os.path.realpath(tmp_path))
    monkeypatch.chdir(real)
    (real / "real").mkdir()
    (real / "link").symlink_to("real")
    assert [named_path(Path(p)) for p in ("bundle", "./bundle", str(real / "bundle"))] == \
        ["bundle", "bundle", str(real / "bundle")]
    assert named_path(Path("a/new/../../bundle")) == f"a/new/../../bundle (that is {real / 'bundle'})"
    assert named_path(Path("link/bundle")) == f"link/bundle (that is {real / 'real' / 'bundle'})"


def test_force_fills_an_empty_folder_and_removes_dead_exports_leftovers(checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead, live = tmp_path / f".out.partial-{DEAD_PID}-abc", tmp_path / f".out.partial-{os.getpid()}-abc"
    dead.mkdir()
    live.mkdir()
    export(str(checkpoint), out, 4, 4, "--mask-token", "<mask>", "--force")
    assert (out / "mars_config.json").is_file()
    assert sorted(os.listdir(tmp_path)) == [live.name, "out"]  # a live export's work directory stays


def test_stale_partials_of_other_outputs_stay(tmp_path):
    for name in (f".other.partial-{DEAD_PID}-x", ".out.partial-abc", f".out.partial-{DEAD_PID}-y"):
        (tmp_path / name).mkdir()
    remove_stale_partials(tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == [".other.partial-4194305-x", ".out.partial-abc"]


# --- the mask token ---

@pytest.mark.parametrize("token, message", [
    ("", "the mask token must not be empty"),
    ("a", "mask token 'a' is in the vocabulary but not a spare special token"),
])
def test_mask_token_must_be_a_spare_special_or_new_token(checkpoint, tmp_path, capsys, token, message):
    code, err = run_export(capsys, checkpoint, tmp_path / "b", "--block", "4", "--mask-token", token)
    assert code == 2 and len(err) == 1 and message in err[0] and "<mask>" in err[0]
    assert not (tmp_path / "b").exists()


# --- model names and block sizes ---

def test_default_without_block_names_the_mars_model(tmp_path, monkeypatch, capsys):
    """The base default model records no block size; a ./default/config.json in the working directory that
    records one is not read for the packaged name."""
    monkeypatch.chdir(tmp_path)
    Path("default").mkdir()
    Path("default/config.json").write_text(json.dumps({"mars_block_size": 8}))
    with pytest.raises(ValueError, match="pass --block B, or export 'default-mars' .*block size 4"):
        resolve_block_size(None, "default")
    code, err = run_export(capsys, "default", tmp_path / "x")
    assert code == 2 and len(err) == 1 and "'default-mars'" in err[0] and not (tmp_path / "x").exists()


def test_an_unknown_model_name_lists_the_accepted_ones(tmp_path, capsys):
    code, err = run_export(capsys, "defualt", tmp_path / "x")
    assert code == 2 and len(err) == 1 and "no such file or directory" in err[0]
    assert "'default' (SmolLM2-135M-Instruct), 'default-mars'" in err[0]


@pytest.mark.parametrize("make, what", [
    (lambda path: path.write_text("# a README"), "it is a file but not a .gguf file"),
    (lambda path: path.mkdir(), "it is a directory without config.json"),
], ids=["file", "folder"])
def test_a_model_path_that_is_no_model_is_named_before_the_block_size(tmp_path, capsys, make, what):
    """mars-export README.md -o X: the model argument is checked first (it said 'records no block size')."""
    make(tmp_path / "README.md")
    code, err = run_export(capsys, tmp_path / "README.md", tmp_path / "x")
    assert code == 2 and len(err) == 1, err
    assert what in err[0] and "'default' (SmolLM2-135M-Instruct), 'default-mars'" in err[0] and ".gguf" in err[0]
    assert "block size" not in err[0] and not (tmp_path / "x").exists()


# --- other flags ---

@pytest.mark.parametrize("args, message", [
    (["--window", "508"], "use --window 507 or less"),
    (["--trt-max-batch", "4"], "--trt-max-batch sets the TensorRT profile; it applies with --trt only: add --trt or "
                               "drop it"),
    (["--trt-max-context", "256"], "--trt-max-context sets the TensorRT profile; it applies with --trt only"),
    (["--trt-max-batch", "4", "--trt-max-context", "256"], "--trt-max-batch and --trt-max-context set the TensorRT "
                                                           "profile; they apply with --trt only: add --trt or drop them"),
])
def test_flags_that_cannot_work_are_refused(checkpoint, tmp_path, capsys, args, message):
    code, err = run_export(capsys, checkpoint, tmp_path / "b", "--block", "4", "--mask-token", "<mask>", *args)
    assert code == 2 and len(err) == 1 and message in err[0]
    assert os.listdir(tmp_path) == []


def test_an_empty_output_is_refused_not_read_as_the_current_directory(checkpoint, tmp_path, monkeypatch, capsys):
    """-o "" was read as "." and refused as "already exists" or as "contains the model" where the current
    directory holds it: an empty -o is refused as such, before anything is checked or loaded."""
    monkeypatch.chdir(tmp_path)
    code, err = run_export(capsys, checkpoint, "", "--block", "4", "--mask-token", "<mask>")
    assert code == 2 and err == ["error: -o is empty: give the directory to write the bundle to (e.g. -o bundles/mine)"]
    code, err = run_export(capsys, checkpoint, " ", "--block", "4", "--mask-token", "<mask>")  # wrote a bundle ' '
    assert code == 2 and err == ["error: -o is blank (' '): give the directory to write the bundle to (e.g. -o "
                                 "bundles/mine)"]
    assert os.listdir(tmp_path) == []


def test_the_tensorrt_profile_defaults_have_one_home(monkeypatch, capsys):
    """mars-export's --trt-max-batch help and runtime.trt_build's --max-batch default read TrtBuildOptions."""
    from runtime import trt_build
    monkeypatch.setattr(trt_build.TrtBuildOptions, "max_batch", 5)
    with pytest.raises(SystemExit):
        export_cli.parse_args(["--help"])
    assert "of the TensorRT profile (default 5)" in " ".join(capsys.readouterr().out.split())
    assert trt_build.parse_args(["bundle"]).max_batch == 5


def test_the_help_names_every_model_name(capsys):
    """mars-export --help lists MODEL's values from default_model.MODEL_SPECS_HELP, default-mars included."""
    with pytest.raises(SystemExit):
        export_cli.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "'default' (SmolLM2-135M-Instruct), 'default-mars' (it with the shipped MARS adapter)" in help_text


def test_the_largest_window_the_precheck_allows_exports(checkpoint, tmp_path):
    """The pre-check is the trace's own bound: W 507 (512 - the example's 5 past positions) exports."""
    assert load_config(export(str(checkpoint), tmp_path / "b", 4, 507, "--mask-token", "<mask>")).window == 507


# --- mars-train distill --output ---

def distill(bundle, prompts, out) -> int:
    return train_cli.main(["distill", str(bundle), "--prompts", str(prompts), "--output", str(out),
                           "--max-new-tokens", "2"])


def test_distill_failure_keeps_the_existing_output(tiny_bundle, tmp_path, monkeypatch):
    _, bundle = tiny_bundle("llama", 4)
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "d1.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in ("hi", "ok", "why")))
    out.write_text("earlier answers\n")

    calls = []

    def fail_on_the_second(prompt, *args):
        calls.append(prompt)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return {"messages": prompt, "cut": True}
    monkeypatch.setattr(distill_module, "prepare_record", fail_on_the_second)
    with pytest.raises(RuntimeError, match="injected"):
        distill(bundle, prompts, out)
    assert out.read_text() == "earlier answers\n"
    assert sorted(os.listdir(tmp_path)) == ["d1.jsonl", "d1.jsonl.partial", "prompts.jsonl"]
    assert [json.loads(line)["messages"] for line in (tmp_path / "d1.jsonl.partial").read_text().splitlines()] == \
        [calls[0]], "the answer written before the failure is kept apart"
    (tmp_path / "d1.jsonl.partial").unlink()
    monkeypatch.undo()
    assert distill(bundle, prompts, out) == 0
    assert len(out.read_text().splitlines()) == 3 and sorted(os.listdir(tmp_path)) == ["d1.jsonl", "prompts.jsonl"]


@pytest.mark.parametrize("output, message", [
    (lambda tmp: tmp, "is a directory"),
    (lambda tmp: tmp / "missing" / "d.jsonl", "does not exist; create it first"),
])
def test_distill_output_is_checked_before_the_export(tmp_path, capsys, output, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert distill(tmp_path / "no-such-model", prompts, output(tmp_path)) == 2  # a model load would fail otherwise
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and message in line

"""``scripts/gpu_train.py`` end to end on CPU with a tiny model: parts, receive, rebuild, distill, train, return."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from support import load_script
from tiny_mars import make_model, make_tokenizer
from transformers import AutoModelForCausalLM

from mars_export.default_model import DEFAULT_BASE_MODEL_NAME
from mars_export.model_source import merge_adapter
from mars_export.training.transfer import MIB, assemble_checkpoint, prepare_parts, receive_part

REPO = Path(__file__).resolve().parents[2]
gpu_train = load_script(REPO / "scripts" / "gpu_train.py")
# The GPU machine may lack everything but torch, transformers, peft and accelerate (and their dependencies).
DEVICE_STEP = """
import sys
for name in ("onnxruntime", "onnx", "onnxscript", "gguf", "matplotlib", "runtime.backends", "runtime.decode"):
    sys.modules[name] = None  # any import of them now raises ImportError (our torch-free modules travel with the
    # working tree, but nothing that needs onnxruntime may be reached)
sys.argv[0] = "scripts/gpu_train.py"
import runpy
runpy.run_path("scripts/gpu_train.py", run_name="__main__")
"""


@pytest.fixture()
def tiny_parts(tmp_path):
    """A tiny checkpoint and its prompts prepared as parts of at most 0.03 MiB (so several)."""
    make_model().save_pretrained(tmp_path / "ckpt")
    make_tokenizer().save_pretrained(tmp_path / "ckpt")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": "x"}) + "\n"
                               for i in range(6)))
    assert gpu_train.main(["prepare", str(tmp_path / "ckpt"), "--prompts", str(prompts), "--out",
                           str(tmp_path / "parts"), "--part-mib", "0.03"]) == 0
    return tmp_path / "ckpt", sorted((tmp_path / "parts").glob("part-*"))


def test_whole_flow_on_cpu_returns_an_adapter_and_a_log(tiny_parts, tmp_path):
    checkpoint, parts = tiny_parts
    assert len(parts) >= 3 and all(sum(f.stat().st_size for f in p.rglob("*")) <= 0.03 * MIB for p in parts)
    store, out = tmp_path / "device-store", tmp_path / "OUT"
    for part in parts:  # one device command per part
        assert gpu_train.main(["receive", str(part), "--store", str(store)]) == 0
    train = ["train", "--store", str(store), "--out", str(out), "--max-new-tokens", "6", "--distill-batch", "4",
             "--max-steps", "2", "--batch-size", "2", "--lora-rank", "4", "--block-size", "2", "--logging-steps", "1"]
    done = subprocess.run([sys.executable, "-c", DEVICE_STEP, *train], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    base = load_file(checkpoint / "model.safetensors")
    rebuilt = load_file(store / "checkpoint-rebuilt" / "model.safetensors")
    assert base.keys() == rebuilt.keys() and all(torch.equal(base[k], rebuilt[k]) for k in base)
    log = json.loads((out / "train_log.json").read_text())
    assert log["optimizer_steps"] == 2 and log["distill"]["num_written"] == 6
    assert any("loss_mask" in entry for entry in log["log_history"]) and (out / "gpu_train.log").stat().st_size
    assert {p.name for p in (out / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                                             "mars_adapter.json"}
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(checkpoint.resolve())  # the model prepared, not the default's
    assert log["base_model"] == config["base_model_name_or_path"]
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    adapted = PeftModel.from_pretrained(model, out / "adapter")
    assert adapted.peft_config["default"].r == 4
    merged = merge_adapter(AutoModelForCausalLM.from_pretrained(checkpoint), out / "adapter")
    assert merged.config.mars_block_size == 2
    assert len((out / "distilled.jsonl.gz").read_bytes()) > 0


def test_parts_are_checked_and_limits_enforced(tiny_parts, tmp_path):
    checkpoint, parts = tiny_parts
    with pytest.raises(ValueError, match="at most 64 MiB"):
        prepare_parts(checkpoint, tmp_path / "big", 65 * MIB)
    with pytest.raises(ValueError, match="exceed the part limit"):
        prepare_parts(checkpoint, tmp_path / "small", 1024)
    store = tmp_path / "store"
    receive_part(parts[0], store)
    with pytest.raises(ValueError, match=r"parts \[2"):
        assemble_checkpoint(store, tmp_path / "rebuilt")
    weights = next(parts[1].glob("weights.*"))
    weights.write_bytes(b"\0" + weights.read_bytes()[1:])
    with pytest.raises(ValueError, match="sha256 mismatch"):
        receive_part(parts[1], store)
    assert gpu_train.main(["receive", str(parts[1]), "--store", str(store)]) == 2


def test_default_model_travels_as_its_gguf_blocks_bit_exactly(tmp_path):
    from mars_export.model_source import default_checkpoint
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert gpu_train.main(["prepare", "default", "--prompts", str(prompts), "--out", str(tmp_path / "parts")]) == 0
    parts = sorted((tmp_path / "parts").glob("part-*"))
    sizes = [sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in parts]
    assert len(parts) == 2 and max(sizes) <= gpu_train.DEFAULT_PART_MIB * MIB and sum(sizes) < 100 * MIB
    assert (parts[0] / "python" / "gguf" / "quants.py").is_file()  # the decoder travels with part 1
    for part in parts:
        receive_part(part, tmp_path / "store")
    rebuilt = load_file(assemble_checkpoint(tmp_path / "store", tmp_path / "rebuilt") / "model.safetensors")
    base = load_file(default_checkpoint() / "model.safetensors")
    assert json.loads((tmp_path / "store" / "source.json").read_text()) == {"base_model": DEFAULT_BASE_MODEL_NAME}
    assert base.keys() == rebuilt.keys() and all(torch.equal(base[k], rebuilt[k]) for k in base)


def test_a_sharded_checkpoint_travels_bit_exactly(tmp_path):
    """transformers writes larger models as shards and an index (model.safetensors.index.json): prepare reads them
    all, sends neither the index nor the shards as checkpoint files, and the rebuilt checkpoint loads."""
    checkpoint = tmp_path / "ckpt"
    make_model().save_pretrained(checkpoint, max_shard_size="20KB")
    make_tokenizer().save_pretrained(checkpoint)
    shards = sorted(checkpoint.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (checkpoint / "model.safetensors").exists()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert gpu_train.main(["prepare", str(checkpoint), "--prompts", str(prompts), "--out", str(tmp_path / "parts"),
                           "--part-mib", "0.05"]) == 0
    parts = sorted((tmp_path / "parts").glob("part-*"))
    assert not any(p.name.startswith("model") for p in (parts[0] / "checkpoint").iterdir())
    for part in parts:
        receive_part(part, tmp_path / "store")
    rebuilt = assemble_checkpoint(tmp_path / "store", tmp_path / "rebuilt")
    base = {name: tensor for shard in shards for name, tensor in load_file(shard).items()}
    weights = load_file(rebuilt / "model.safetensors")
    assert base.keys() == weights.keys() and all(torch.equal(base[k], weights[k]) for k in base)
    assert not (rebuilt / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(rebuilt)
    assert torch.equal(loaded.model.embed_tokens.weight, base["model.embed_tokens.weight"])


@pytest.mark.parametrize("files, message", [
    ({"config.json": "{}"}, "holds no safetensors weights (model.safetensors, or model.safetensors.index.json "
                            "and its shards)"),
    ({"config.json": "{}", "pytorch_model.bin": ""}, "holds torch .bin weights only"),
    ({"config.json": "{}", "model.safetensors.index.json": json.dumps({"weight_map": {"w": "model-1.safetensors"}})},
     "names shards that are not there: model-1.safetensors"),
    ({"config.json": "{}", "model.safetensors.index.json": "{not json"}, "is no safetensors index"),
    ({"model.safetensors": None}, "has no config.json"),
    (None, "no such directory")])
def test_a_directory_without_weights_is_one_line(files, message, tmp_path, capsys):
    """Each was a traceback (FileNotFoundError: .../model.safetensors, or .../config.json)."""
    checkpoint = tmp_path / "ckpt"
    for name, text in (files or {}).items():
        checkpoint.mkdir(exist_ok=True)
        if text is None:
            save_file({"w": torch.zeros(2)}, checkpoint / name)
        else:
            (checkpoint / name).write_text(text)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert gpu_train.main(["prepare", str(checkpoint), "--prompts", str(prompts), "--out",
                           str(tmp_path / "parts")]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {checkpoint}") and message in line, line
    assert not (tmp_path / "parts").exists()


def test_parts_of_a_prepare_without_source_json_are_one_line_asking_to_prepare_again(tiny_parts, tmp_path, capsys):
    """Parts written before prepare sent source.json (the base model's name) have none: train says to re-run
    prepare (was a FileNotFoundError traceback) and names no base model it cannot know."""
    _, parts = tiny_parts
    info = json.loads((parts[-1] / "part.json").read_text())  # the last part as an older prepare wrote it
    del info["files"][gpu_train.SOURCE_FILE]
    (parts[-1] / "part.json").write_text(json.dumps(info))
    (parts[-1] / gpu_train.SOURCE_FILE).unlink()
    store, out = tmp_path / "store", tmp_path / "OUT"
    for part in parts:
        assert gpu_train.main(["receive", str(part), "--store", str(store)]) == 0
    capsys.readouterr()
    assert gpu_train.main(["train", "--store", str(store), "--out", str(out), "--max-steps", "1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"error: {store} has no {gpu_train.SOURCE_FILE} (the name of the model sent): its parts come "
                      "from an older scripts/gpu_train.py prepare; run prepare again and send the new parts"]
    assert not (out / "adapter").exists() and not (out / "train_log.json").exists()


@pytest.mark.parametrize("make, why", [(lambda path: None, "no such directory"),
                                       (lambda path: path.mkdir(), "it holds no part.json")], ids=["missing", "folder"])
def test_receiving_a_path_that_is_no_part_is_one_line(tmp_path, capsys, make, why):
    """Was a FileNotFoundError traceback (of the size check, or of part.json)."""
    part, store = tmp_path / "part-1", tmp_path / "store"
    make(part)
    assert gpu_train.main(["receive", str(part), "--store", str(store)]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line == f"error: {part} is no part ({why}); pass a part directory that 'scripts/gpu_train.py prepare' wrote"
    assert not store.exists()


@pytest.mark.parametrize("argv, message", [
    (["prepare", "default", "--prompts", "p.jsonl", "--max-prompts", "many"],
     "argument --max-prompts: invalid int value: 'many'"),
    (["train", "--store", "store"], "the following arguments are required: --out"),
    (["receive", "part", "--bogus"], "unrecognized arguments: --bogus"),
    (["send"], "argument command: invalid choice: 'send'")])
def test_a_bad_command_line_is_one_error_line_as_every_other_refusal(argv, message, tmp_path, monkeypatch, capsys):
    """argparse's refusals printed its usage block before 'scripts/gpu_train.py: error: ...'; a bad part, checkpoint
    or prompt file was one 'error:' line, exit status 2: so are these now (runtime.command_line)."""
    monkeypatch.chdir(tmp_path)
    assert gpu_train.main(argv) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {message}"), line
    assert list(tmp_path.iterdir()) == []

"""``mars-train`` end to end on a tiny model: train, checkpoint, resume, LoRA merge, --lora-init."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from tiny_mars import MASK_ID, make_tokenizer
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from mars_export.model_source import load_model
from mars_export.training.cli import main, make_train_parser
from mars_export.training.output_dir import FINAL_MANIFEST


def train(checkpoint: str, data: str, output: Path, *extra: str) -> int:
    return main([checkpoint, "--data", data, "--output", str(output), "--block-size", "2", "--lr", "1e-3",
                 "--lr-scheduler", "constant", "--logging-steps", "1", "--max-length", "256", *extra])


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_train_checkpoint_reload_and_resume(tiny_checkpoint, tiny_jsonl, tmp_path):
    out = tmp_path / "run"
    assert train(tiny_checkpoint, tiny_jsonl, out, "--max-steps", "3", "--save-steps", "3") == 0
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert all({"loss_mask", "loss_ar"} <= set(log) for log in state["log_history"] if "loss" in log)
    reloaded = load_model(str(out))
    assert (reloaded.mask_token, reloaded.mask_token_id) == ("<mask>", MASK_ID)
    assert json.loads((out / "config.json").read_text())["mars_block_size"] == 2
    assert not torch.equal(weights(out)["model.embed_tokens.weight"],
                           weights(Path(tiny_checkpoint))["model.embed_tokens.weight"])

    assert train(tiny_checkpoint, tiny_jsonl, out, "--max-steps", "5", "--save-steps", "3", "--resume") == 0
    resumed = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())
    assert resumed["global_step"] == 5
    assert resumed["log_history"][:3] == state["log_history"][:3]  # steps 1-3 came from the checkpoint

    straight = tmp_path / "straight"
    assert train(tiny_checkpoint, tiny_jsonl, straight, "--max-steps", "5", "--save-steps", "0") == 0
    for name, tensor in weights(straight).items():
        torch.testing.assert_close(weights(out)[name], tensor, msg=f"resumed run differs at {name}")


def test_resume_errors(tiny_checkpoint, tiny_jsonl, tmp_path):
    assert train(tiny_checkpoint, tiny_jsonl, tmp_path / "empty", "--max-steps", "1", "--resume") == 2
    (tmp_path / "busy" / "checkpoint-1").mkdir(parents=True)
    assert train(tiny_checkpoint, tiny_jsonl, tmp_path / "busy", "--max-steps", "1") == 2


class Killed(Exception):
    """Stands for the process being killed."""


def test_a_run_killed_while_saving_its_final_model_leaves_none_of_it(tiny_checkpoint, tiny_jsonl, tmp_path,
                                                                    monkeypatch, capsys):
    """The final model is written to a hidden folder in --output and moved in once complete: a run killed while
    writing it (here at the tokenizer, after the weights) leaves no config.json or weights there. Rerun, a run
    without checkpoints is refused naming what to do; one with a checkpoint resumes and replaces the leftover."""
    save = PreTrainedTokenizerFast.save_pretrained

    def killed_after_the_checkpoints(self, directory, *args, **kwargs):
        if not Path(directory).name.startswith("checkpoint-"):
            raise Killed
        return save(self, directory, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", killed_after_the_checkpoints)
    bare, resumable = tmp_path / "bare", tmp_path / "resumable"
    with pytest.raises(Killed):
        train(tiny_checkpoint, tiny_jsonl, bare, "--max-steps", "1", "--save-steps", "0")
    with pytest.raises(Killed):
        train(tiny_checkpoint, tiny_jsonl, resumable, "--max-steps", "1", "--save-steps", "1")
    monkeypatch.undo()
    for run in (bare, resumable):
        assert not (run / "config.json").exists() and not (run / "model.safetensors").exists()
    assert train(tiny_checkpoint, tiny_jsonl, bare, "--max-steps", "1", "--save-steps", "0") == 2
    assert f"remove {bare} or choose another --output" in capsys.readouterr().err
    assert train(tiny_checkpoint, tiny_jsonl, resumable, "--max-steps", "1", "--save-steps", "1", "--resume") == 0
    assert load_model(str(resumable)).mask_token_id == MASK_ID
    assert [path.name for path in resumable.iterdir() if path.name.startswith(".")] == [FINAL_MANIFEST]


def test_lora_output_is_a_merged_plain_checkpoint(tiny_checkpoint, tiny_jsonl, tmp_path):
    out = tmp_path / "lora"
    assert train(tiny_checkpoint, tiny_jsonl, out, "--max-steps", "2", "--save-steps", "0", "--lora",
                 "--lora-rank", "4") == 0
    assert not (out / "adapter_config.json").exists()
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert merged.config.mars_mask_token_id == MASK_ID
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(merged.model.embed_tokens.weight[MASK_ID], base.model.embed_tokens.weight[MASK_ID])
    assert torch.equal(merged.model.embed_tokens.weight[MASK_ID + 1], base.model.embed_tokens.weight[MASK_ID + 1])
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    ids = torch.randint(4, 260, (1, 12))
    torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=1e-5)


def test_lora_init_continues_a_saved_adapter(tiny_checkpoint, tiny_jsonl, tmp_path, capsys):
    first = tmp_path / "first"
    assert train(tiny_checkpoint, tiny_jsonl, first, "--max-steps", "2", "--save-steps", "0", "--lora",
                 "--lora-rank", "4") == 0
    frozen = tmp_path / "frozen"  # a learning rate of 1e-12: the result is the adapter it started from
    assert train(tiny_checkpoint, tiny_jsonl, frozen, "--max-steps", "1", "--save-steps", "0", "--lora",
                 "--lora-init", str(first / "adapter"), "--lr", "1e-12") == 0
    for name, tensor in weights(first).items():
        torch.testing.assert_close(weights(frozen)[name], tensor, msg=f"--lora-init did not load {name}")
    # --lora-init without --lora
    assert train(tiny_checkpoint, tiny_jsonl, tmp_path / "a", "--max-steps", "1", "--lora-init",
                 str(first / "adapter")) == 2
    broken = tmp_path / "broken"
    broken.mkdir()
    for content, message in [(None, "no adapter_config.json"), ("{not json", "is not valid JSON"),
                             ((first / "adapter" / "adapter_config.json").read_text(), "no adapter_model")]:
        if content is not None:
            (broken / "adapter_config.json").write_text(content)
        assert train(tiny_checkpoint, tiny_jsonl, tmp_path / "b", "--max-steps", "1", "--lora", "--lora-init",
                     str(broken)) == 2
        assert message in capsys.readouterr().err
    # the adapter's own rank applies
    assert train(tiny_checkpoint, tiny_jsonl, tmp_path / "c", "--max-steps", "1", "--lora", "--lora-rank", "8",
                 "--lora-init", str(first / "adapter")) == 2
    assert "do not apply with --lora-init" in capsys.readouterr().err


def test_every_process_ends_its_process_group_after_saving(tiny_checkpoint, tiny_jsonl, tmp_path, monkeypatch):
    """Under accelerate launch a process that exits with gloo's threads alive can die of SIGABRT
    after a good run (a CI failure of test_distributed); main must end every run the clean way."""
    import mars_export.training.trainer as trainer_module

    calls = []

    class Trainer:
        def train(self, resume_from_checkpoint):
            calls.append("train")

        def is_world_process_zero(self):
            return False  # a process other than the main one

    monkeypatch.setattr(trainer_module, "prepare_trainer", lambda config: (Trainer(), None))
    monkeypatch.setattr(trainer_module, "save_final_model", lambda trainer, config: calls.append("save"))
    monkeypatch.setattr(trainer_module, "end_process_group", lambda trainer: calls.append("end_process_group"))
    assert train(tiny_checkpoint, tiny_jsonl, tmp_path / "run", "--max-steps", "1") == 0
    assert calls == ["train", "save", "end_process_group"]


def test_the_ddp_wrapper_is_gone_before_the_process_group_is_destroyed():
    """If the DDP wrapper's Reducer holds the gloo process group's last reference, destroying it joins
    gloo's threads with the GIL held and can hang the process for ever (a CI hang of test_distributed,
    pytorch/pytorch#56297): the barrier comes first, then the wrapper goes, then the process group."""
    from mars_export.training.trainer import end_process_group

    events = []
    model = torch.nn.Linear(2, 2)
    wrapper = torch.nn.Sequential(model)  # stands for DistributedDataParallel(model)
    alive = weakref.ref(wrapper)

    class Accelerator:
        def __init__(self):
            self._models = [wrapper]

        def wait_for_everyone(self):
            events.append(("barrier", alive() is not None))

        def free_memory(self):
            self._models = []

        def end_training(self):
            events.append(("destroy", alive() is not None))

    trainer = SimpleNamespace(accelerator=Accelerator(), model=model, model_wrapped=wrapper)
    del wrapper
    end_process_group(trainer)
    assert events == [("barrier", True), ("destroy", False)]
    assert trainer.model_wrapped is model


def test_the_help_names_every_model_name(capsys):
    """mars-train --help lists MODEL's values as mars-export does (default_model.MODEL_SPECS_HELP), default-mars
    included."""
    with pytest.raises(SystemExit):
        make_train_parser().parse_args(["--help"])
    assert "'default' (SmolLM2-135M-Instruct), 'default-mars'" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, message", [
    (["m", "--data", "d", "--output", "o", "--block-size", "abc"], "argument --block-size: invalid int value: 'abc'"),
    (["m", "--data", "d", "--output", "o", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["m", "--output", "o"], "the following arguments are required: --data"),
    (["m", "--data", "d", "--output", "o", "--bogus"], "unrecognized arguments: --bogus"),
    (["m", "--data", "d", "--output", "o", "--lora-init", "a"], "--lora-init continues a LoRA adapter: add --lora"),
    (["m", "--data", "d", "--output", ""], "--output is empty: give the directory to write the checkpoints and the "
                                           "final model to"),  # was read as the current directory
    (["m", "--data", "d", "--output", " "], "--output is blank (' '): give the directory to write the "
                                            "checkpoints and the final model to"),  # trained into a folder ' '
    (["distill", "m", "--prompts", "p", "--output", ""], "--output is empty: give the path of the JSONL file to "
                                                         "write"),  # said '--output . is a directory'
    (["distill", "m", "--prompts", "p", "--output", "o", "--batch-size", "q"],
     "argument --batch-size: invalid int value: 'q'")])
def test_a_bad_command_line_is_one_error_line_like_every_other_refusal(argv, message, tmp_path, monkeypatch, capsys):
    """argparse's refusals (and the config's) printed argparse's usage block and 'mars-train: error: ...'; what
    --output, the model or the data hold was one 'error:' line. Now all are one line, exit status 2."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {message}"), line
    assert list(tmp_path.iterdir()) == []

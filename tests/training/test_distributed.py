"""``mars-train`` under ``accelerate launch`` with 2 processes on this CPU (DDP, gloo) on a tiny model.

Two processes with batch 1 each make the same global batch as one process with batch 1
and 2 gradient-accumulation steps: the same examples in the same order (accelerate hands
process r the r-th batch of each pair), and the same loss (the MARS loss is a per-batch
token mean; DDP averages the two gradients as accumulation averages the two micro-batches).
So the logged loss and gradient norm of every step, and the weights after, must match.
LoRA dropout is 0 here: each process draws its own dropout masks, so with dropout the two
runs are equally valid but not equal.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from test_training_cli import train, weights

ARGS = ["--block-size", "2", "--lr", "1e-3", "--lr-scheduler", "constant", "--logging-steps", "1",
        "--max-length", "256"]  # as test_training_cli.train
TIMEOUT_S = 600


def launch_two(checkpoint: str, data: str, output: Path, *extra: str) -> str:
    """``accelerate launch`` ``mars-train`` on 2 CPU processes; returns its stdout.

    Raises:
        AssertionError: the launch failed (its output is in the message).
    """
    with socket.socket() as s:  # a free rendezvous port on loopback, not accelerate's fixed 29500
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
               "-m", "mars_export.training.cli", checkpoint, "--data", data, "--output", str(output), *ARGS, *extra]
    env = os.environ | {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def step_logs(run: Path, step: int) -> list[tuple[float, float]]:
    """(loss, grad_norm) of each logged step in ``run/checkpoint-STEP``."""
    history = json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]
    return [(log["loss"], log["grad_norm"]) for log in history if "loss" in log]


def assert_same_weights(a: Path, b: Path) -> None:
    expected = weights(b)
    for name, tensor in weights(a).items():
        torch.testing.assert_close(tensor, expected[name], msg=f"2 processes and 1 differ at {name}")


def test_two_processes_match_one_with_grad_accum_and_resume(tiny_checkpoint, tiny_jsonl, tmp_path):
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    stdout = launch_two(tiny_checkpoint, tiny_jsonl, ddp, "--max-steps", "3", "--save-steps", "3")
    assert stdout.count("saved the MARS model") == 1  # the main process reports, once
    launch_two(tiny_checkpoint, tiny_jsonl, ddp, "--max-steps", "5", "--save-steps", "3", "--resume")
    assert train(tiny_checkpoint, tiny_jsonl, single, "--max-steps", "5", "--save-steps", "3", "--grad-accum", "2") == 0

    for step in (3, 5):  # steps 1-3 before the resume, 4-5 after it
        got, expected = step_logs(ddp, step), step_logs(single, step)
        assert len(got) == step
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_weights(ddp, single)


def test_two_processes_lora_merged_output_equals_one(tiny_checkpoint, tiny_jsonl, tmp_path):
    lora = ["--max-steps", "2", "--save-steps", "0", "--lora", "--lora-rank", "4", "--lora-dropout", "0"]
    launch_two(tiny_checkpoint, tiny_jsonl, tmp_path / "ddp", *lora)
    assert train(tiny_checkpoint, tiny_jsonl, tmp_path / "single", *lora, "--grad-accum", "2") == 0
    assert_same_weights(tmp_path / "ddp", tmp_path / "single")
    assert (tmp_path / "ddp" / "adapter" / "adapter_model.safetensors").is_file()

"""Smoke test of ``bench/train_throughput.py``: tiny model, one timed step per point (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from support import load_script

REPO = Path(__file__).resolve().parents[2]
bench = load_script(REPO / "bench" / "train_throughput.py")


def test_writes_json_and_plot_for_each_setting(tiny_checkpoint, tiny_jsonl, tmp_path):
    bench.main([tiny_checkpoint, "--data", tiny_jsonl, "--data", tiny_jsonl, "--num-examples", "6", "--steps", "1",
                "--warmup", "1", "--rounds", "1", "--batch-size", "2", "--block-size", "2", "--threads", "1",
                "--lora-ranks", "4", "2", "--lora-targets", "all-linear", "q_proj,v_proj", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "train_throughput.json").read_text())
    labels = [row["label"] for row in result["points"]]
    assert labels == ["fp32 t1 random r4 all-linear", "bf16 t1 random r4 all-linear", "fp32 t1 length r4 all-linear",
                      "fp32 t1 random r2 all-linear", "fp32 t1 random r4 q_proj,v_proj",
                      "fp32 t1 random r4 all-linear frozen-mask"]
    for row in result["points"]:
        (run,) = row["rounds"]
        assert run["example_tokens_per_s"] > 0 and 0 <= run["padding_fraction"] < 1 and run["mean_loss"] > 0
    assert (tmp_path / "train_throughput.png").stat().st_size > 0

"""Smoke tests: every script in bench/ and scripts/ runs on a tiny model and writes its outputs.

Each runs as a user runs it (a subprocess from the repository root) with small arguments,
and the test checks the exit status and the files written, never a timing. The tiny
model is a random 2-layer Llama with a byte-level tokenizer and 2048 positions, so the
real GSM8K / HumanEval prompts the scripts use fit; tpf_vs_training.py and ship_adapter.py
read a LoRA run of the default model, so one mars-train step on it is made once. Covered
elsewhere: scripts/test.sh and scripts/setup.sh are what CI runs (.ci/run);
``mars-export default-mars --block 4`` (the export demo.sh does when no BUNDLE is given) is
the ``default_mars_bundle`` fixture.
bench/gpu_check.py runs in full only where TensorRT and a GPU are; its --dry-run (everything
before the first GPU call) runs here.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from support import export, fix_window, load_script
from test_trt import GPU_MISSING
from tiny_models import make_checkpoint

from runtime.command_line import UsageError, results_name

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900  # far above a healthy run (seconds); a smoke test is never a timing
VERIFY_VARIANTS = ["verify", "verify + lookup", "verify + both"]  # lossless: must equal our AR ids


@pytest.fixture(scope="module")
def smoke_model(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, bundle): the tiny Llama with 2048 positions, B = W = 4."""
    root = tmp_path_factory.mktemp("smoke")
    ckpt = make_checkpoint("llama", root / "ckpt", max_context=2048)
    return ckpt, export(str(ckpt), root / "bundle", 4, 4, "--mask-token", "<mask>")


def run(*command: str, env: dict | None = None) -> str:
    """Run ``command`` from the repository root; assert exit status 0; return stdout."""
    done = subprocess.run([str(c) for c in command], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def python(script: str, *args) -> str:
    return run(sys.executable, script, *args)


def assert_results(out: Path, stem: str, suffixes=(".json", ".csv", ".png")) -> dict:
    """Each ``out/stem.SUFFIX`` exists and is not empty; the JSON and CSV parse; return the JSON."""
    for suffix in suffixes:
        assert (out / f"{stem}{suffix}").stat().st_size > 0, f"{stem}{suffix} is empty"
    if ".csv" in suffixes:
        assert list(csv.DictReader((out / f"{stem}.csv").open())), f"{stem}.csv has no rows"
    return json.loads((out / f"{stem}.json").read_text())


@pytest.mark.usefixtures("shared_data")
def test_engine_modes(smoke_model, tmp_path):
    """Every mode and draft source runs, those that feed masks also with adaptive masks; the verify rows (each
    draft source) and threshold mode with lookup drafts at tau 1 reproduce AR."""
    _, bundle = smoke_model
    python("bench/engine_modes.py", bundle, "--batch-sizes", "1", "2", "--schemes", "continuous", "--taus", "0.9",
           "--num-prompts", "2", "--max-new-tokens", "8", "--threads", "1", "--adaptive-masks", "--out", tmp_path)
    rows = assert_results(tmp_path, "engine_modes")["rows"]
    assert len(rows) == 2 * 11 and {row["mode"] for row in rows} == {"ar", "threshold", "verify"}
    adaptive = [(row["mode"], row["draft"], row["tau"]) for row in rows if row["adaptive_masks"]]
    assert sorted(set(adaptive)) == [("threshold", "lookup", 0.9), ("threshold", "masks", 0.9), ("verify", "both", 1.0),
                                     ("verify", "masks", 1.0)] and len(adaptive) == 2 * 4
    verify = [row for row in rows if row["mode"] == "verify"]
    assert sorted({row["draft"] for row in verify}) == ["both", "lookup", "masks"]
    drafted = [row for row in rows if row["mode"] == "threshold" and row["draft"] == "lookup"]
    assert sorted(row["tau"] for row in drafted) == [0.9, 0.9, 0.9, 0.9, 1.0, 1.0]
    assert all(row["identical_to_ar"] == 1.0 for row in verify + [r for r in drafted if r["tau"] == 1.0])
    assert all(0 < row["graph_seconds"] < row["seconds"] and row["runtime_ms_per_forward"] > 0 for row in rows)
    too_long = subprocess.run([sys.executable, "bench/engine_modes.py", str(bundle), "--batch-sizes", "1",
                               "--max-new-tokens", "5000", "--out", str(tmp_path / "long")],
                              cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert too_long.returncode == 2 and "exceeds the" in too_long.stderr and "Traceback" not in too_long.stderr
    assert not (tmp_path / "long").exists()


@pytest.mark.usefixtures("shared_data")
def test_confidence_bounds(smoke_model, tmp_path):
    """Every row the acceptance rule reads is counted once as rejected, accepted or undecided, and its exact
    probability lies within its bounds; the steps reading the head are those with an undecided row."""
    ckpt, _ = smoke_model
    python("bench/confidence_bounds.py", ckpt, "--mask-token", "<mask>", "--taus", "0.9", "0.0",
           "--num-prompts", "2", "--max-new-tokens", "6", "--out", tmp_path, "--name", "bounds")
    rows = assert_results(tmp_path, "bounds")["rows"]
    assert [r["tau"] for r in rows] == [0.9, 0.0]
    for r in rows:
        assert r["violations"] == 0 and r["rows_read"] == r["rejected"] + r["accepted"] + r["undecided"]
        assert r["steps"] >= 1 and r["steps_reading_head"] <= min(r["steps"], r["undecided"])
        assert r["tokens"] >= r["steps"]
    at_zero = rows[1]  # every p > 0 and every lower bound too: each row read is decided as accepted
    assert at_zero["rows_read"] == at_zero["accepted"] > 0 and at_zero["steps_reading_head"] == 0


def test_runtime_vs_transformers(smoke_model, tmp_path):
    ckpt, bundle = smoke_model
    python("bench/runtime_vs_transformers.py", bundle, "--checkpoint", ckpt, "--taus", "1.0", "--max-new-tokens", "8",
           "--out", tmp_path)
    assert assert_results(tmp_path, "runtime_vs_transformers")["runs"]


def test_scaling(smoke_model, tmp_path):
    _, bundle = smoke_model
    out = python("bench/scaling.py", bundle, "--contexts", "16", "24", "--batch-sizes", "1", "--prompt-lengths", "8",
                 "--repeats", "1", "--warmup", "0", "--max-seconds", "1", "--rounds", "2", "--prefill-repeats", "1",
                 "--stream-mib", "1", "--stream-repeats", "1", "--threads", "1", "--prefill-batch", "3", "--out", tmp_path)
    result = assert_results(tmp_path, "scaling")
    decode = [row for row in result["rows"] if row["kind"] == "decode"]
    assert [(row["past"], len(row["round_median_ms"]), row["num_runs"]) for row in decode] == [(16, 2, 6), (24, 2, 6)]
    [ratio] = result["ratios"]  # P 24 against P 16, within each of the 2 rounds
    assert (ratio["against"], ratio["base_past"], ratio["num_rounds"]) == ("past", 16, 2) and ratio["bytes_ratio"] > 1
    assert "| 1 | 1 | 1 | 24 | W 1, P 16 |" in out
    [stream] = result["meta"]["stream"]
    assert stream["read_gbs"] > 0 and f"| 1 | {stream['copy_gbs']:.1f} | {stream['triad_gbs']:.1f} | " \
        f"{stream['read_gbs']:.1f} |" in out
    rows = [row for row in result["rows"] if row["kind"] == "prefill"]
    # the output head skipped (as the engine prefills) and on every row; three prompts in one forward
    assert sorted((row["output_head"], row["batch_size"]) for row in rows) == [("every row", 1), ("skipped", 1),
                                                                               ("skipped", 3)]
    assert all(row["tokens_per_s"] > 0 for row in rows)


def test_scaling_ratios_are_taken_within_rounds(monkeypatch):
    """Each window against the smallest at the same (threads, B, P), each past against the next smaller one, the
    ratio taken in each round: a round where the machine ran twice as slow for every point changes no ratio."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    scaling = load_script(ROOT / "bench" / "scaling.py")
    def row(window, past, ms, gb):  # two rounds, the second twice as slow
        return {"kind": "decode", "status": "ok", "threads": 2, "batch_size": 1, "window": window, "past": past,
                "round_median_ms": [ms, 2 * ms], "bytes_per_step": gb * 1e9}
    rows = [row(1, 128, 10.0, 0.5), row(4, 128, 11.0, 0.5), row(1, 1024, 12.0, 0.6), row(4, 1024, 15.0, 0.6),
            {"kind": "decode", "status": "skipped: KV too large", "threads": 2, "batch_size": 1, "window": 1,
             "past": 2048}]
    got = {(r["window"], r["past"], r["against"]): (r["time_ratio"], r["time_ratio_min"], r["time_ratio_max"],
                                                    round(r["bytes_ratio"], 6)) for r in scaling.within_round_ratios(rows)}
    assert got == {(4, 128, "window"): (1.1, 1.1, 1.1, 1.0), (1, 1024, "past"): (1.2, 1.2, 1.2, 1.2),
                   (4, 1024, "window"): (1.25, 1.25, 1.25, 1.0), (4, 1024, "past"): (15 / 11, 15 / 11, 15 / 11, 1.2)}
    assert scaling.over_rounds([{"median_ms": 2.0, "p10_ms": 1.0, "p90_ms": 3.0, "min_ms": 1.0, "max_ms": 4.0,
                                 "num_runs": 3}, {"median_ms": 4.0, "p10_ms": 3.0, "p90_ms": 5.0, "min_ms": 0.5,
                                                  "max_ms": 6.0, "num_runs": 3}]) == {
        "median_ms": 3.0, "p10_ms": 2.0, "p90_ms": 4.0, "min_ms": 0.5, "max_ms": 6.0, "num_runs": 6,
        "round_median_ms": [2.0, 4.0]}


def test_scaling_on_a_fused_bundle(smoke_model, tmp_path):
    """A fused bundle (batch 1) is measured at batch 1 over its in-place past; other batches are rows saying so."""
    ckpt, _ = smoke_model
    fused = export(str(ckpt), tmp_path / "fused", 4, 4, "--mask-token", "<mask>", "--graph", "fused")
    out = python("bench/scaling.py", fused, "--contexts", "16", "--batch-sizes", "1", "2", "--window", "1", "4",
                 "--prompt-lengths", "8", "--repeats", "1", "--warmup", "0", "--max-seconds", "1", "--prefill-repeats",
                 "1", "--stream-mib", "1", "--stream-repeats", "1", "--threads", "2", "--out", tmp_path)
    rows = [row for row in assert_results(tmp_path, "scaling")["rows"] if row["kind"] == "decode"]
    assert sorted((row["threads"], row["window"], row["batch_size"], row["status"]) for row in rows) == [
        (1, 1, 1, "ok"), (1, 4, 1, "ok"), (2, 1, 1, "ok"), (2, 1, 2, "not supported: a fused bundle runs batch 1"),
        (2, 4, 1, "ok"), (2, 4, 2, "not supported: a fused bundle runs batch 1")]
    assert "| 4 | 16 |" in out.split("| W | P | 1 thread ms")[1]  # the threads table, per window
    assert all(row["achieved_gbs"] > 0 for row in rows if row["status"] == "ok")


@pytest.mark.usefixtures("shared_data")
def test_quantized_step(smoke_model, tmp_path):
    from mars_export.quantize import quantize_step_graph
    _, bundle = smoke_model
    quantize_step_graph(bundle / "model.onnx", tmp_path / "ready.onnx", "int4")
    python("bench/quantized_step.py", bundle, "--variants", "int8", "int4-s16-h", "--prompts-each", "1", "--tokens", "4",
           "--graphs", f"ready={tmp_path / 'ready.onnx'}@0", "--clock", "cpu",
           "--past", "8", "--windows", "1", "2", "--repeats", "2", "--threads", "1", "--out", tmp_path)
    result = json.loads((tmp_path / "quantized_step.json").read_text())["results"]
    assert set(result) == {"float32", "int8", "int4-s16-h", "ready"}
    assert result["ready"]["accuracy_level"] == 0 and 0 <= result["ready"]["greedy_vs_float32"]["identical_fraction"] <= 1
    assert result["int4-s16-h"]["block_size"] == 16 and result["int4-s16-h"]["is_symmetric"] is True
    assert result["int4-s16-h"]["lm_head_quantized"] is False and result["int8"]["lm_head_quantized"] is True
    assert all(r["step_ms_w1"] >= 0 and r["step_ms_w2"] >= 0 for r in result.values())  # CPU time: may round to 0


def test_gqa_attention(tmp_path):
    """Our attention and GroupQueryAttention on the same inputs: same outputs, both timed; ours gives
    every position the same bits however the tokens are cut into windows."""
    python("bench/gqa_attention.py", "--pasts", "0", "8", "--windows", "1", "3", "--heads", "4", "--kv-heads", "2",
           "--head-dim", "16", "--max-context", "16", "--repeats", "1", "--rounds", "1", "--threads", "1",
           "--identity-tokens", "5", "--chunks", "1", "2", "--out", tmp_path)
    result = json.loads((tmp_path / "gqa_attention.json").read_text())
    rows = result["rows"]
    assert [(r["past"], r["window"]) for r in rows] == [(0, 1), (0, 3), (8, 1), (8, 3)]
    assert all(r["max_abs_diff"] < 1e-4 for r in rows)
    assert all(min(r["ours_ms"], r["gqa_ms"], r["ours_cpu_ms"], r["gqa_cpu_ms"]) > 0 for r in rows)
    identity = {(r["graph"], r["chunk"]): r for r in result["identity"]}
    assert set(identity) == {("ours", 1), ("ours", 2), ("gqa", 1), ("gqa", 2)}
    assert all(identity["ours", c]["identical_positions"] == 5 for c in (1, 2))
    assert all(0 <= r["identical_positions"] <= 5 and r["max_abs_diff"] < 1e-4 for r in identity.values())


def test_builder_step_times_both_graphs_of_the_same_weights(smoke_model, tmp_path):
    """The model builder's graph of the tiny checkpoint against its bundle, float32 and int8: same logits."""
    ckpt, bundle = smoke_model
    run(sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", ckpt, "-o", tmp_path / "builder", "-p", "fp32",
        "-e", "cpu", "-c", tmp_path / "cache")
    stdout = python("bench/builder_step.py", tmp_path / "builder", bundle, "--quantize", "int8", "--pasts", "0", "8",
                    "--windows", "1", "3", "--max-context", "16", "--steps", "2", "--rounds", "1", "--threads", "1",
                    "--identity-tokens", "5", "--identity-prompt", "3", "--chunks", "1", "2", "--out", tmp_path,
                    "--name", "b")
    result = json.loads((tmp_path / "b.json").read_text())
    rows = result["rows"]
    graphs = [str(bundle), f"builder float32 ({tmp_path / 'builder'})", "builder int8 (block 32, sym, level 4)"]
    assert [(r["past"], r["window"], r["graph"]) for r in rows] == \
        [(p, w, g) for p in (0, 8) for w in (1, 3) for g in graphs]
    for row in rows:
        assert min(row["step_ms"], row["cpu_ms"]) > 0
        assert row["max_abs_logit_diff"] < (1e-4 if "int8" not in row["graph"] else 2.0)
    assert all(r["top1_agreement"] == 1.0 for r in rows if "int8" not in r["graph"])
    assert "| graph | P | W |" in stdout
    identity = {(r["graph"], r["chunk"]): r for r in result["identity"]}
    assert set(identity) == {(g, c) for g in graphs for c in (1, 2)}
    assert all(identity[str(bundle), c]["identical_positions"] == 5 for c in (1, 2))  # our graph: at every cut
    assert all(0 <= r["identical_positions"] <= 5 and 0 <= r["top1_agreement"] <= 1 for r in identity.values())
    assert "| graph | window of |" in stdout
    done = subprocess.run([sys.executable, "bench/builder_step.py", tmp_path, bundle], cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2 and "is no file" in done.stderr and "onnxruntime_genai.models.builder" in done.stderr


@pytest.mark.parametrize("command", [["bench/engine_modes.py", "BUNDLE"], ["bench/quantized_step.py", "BUNDLE"],
                                     ["bench/peers.py", "prompts", "--bundle", "BUNDLE", "--work", "WORK"]],
                         ids=["engine_modes", "quantized_step", "peers-prompts"])
def test_benches_without_the_shared_data_stop_with_one_line_naming_it(command, smoke_model, tmp_path):
    """A clone without ../shared/data (and no $MARS_SHARED_DATA): usage error, no traceback, nothing written."""
    _, bundle = smoke_model
    args = [str(bundle) if a == "BUNDLE" else str(tmp_path / "work") if a == "WORK" else a for a in command]
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**os.environ, "MARS_SHARED_DATA": str(tmp_path / "none")})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"the shared data folder {tmp_path / 'none'} is not here: set MARS_SHARED_DATA" in done.stderr
    assert not (tmp_path / "work").exists()


BAD_COMMAND_LINES = {  # script -> (a bad command line: a wrong type, an unknown choice or option, a missing argument;
    # the start of its one error line)
    "bench/builder_step.py": ([".", "BUNDLE", "--steps", "two"], "argument --steps: invalid int value: 'two'"),
    "bench/c_sample.py": (["BUNDLE"], "the following arguments are required: --binary"),
    "bench/confidence_bounds.py": (["--block", "four"], "argument --block: invalid int value: 'four'"),
    "bench/engine_modes.py": (["BUNDLE", "--schemes", "fast"], "argument --schemes: invalid choice: 'fast'"),
    "bench/gpu_check.py": (["--bogus"], "unrecognized arguments: --bogus"),
    "bench/gqa_attention.py": (["--heads", "nine"], "argument --heads: invalid int value: 'nine'"),
    "bench/load_test.py": (["BUNDLE", "--clients", "many"], "argument --clients: invalid int value: 'many'"),
    "bench/matmul_kernels.py": (["BUNDLE", "--pages", "big"], "argument --pages: invalid choice: 'big'"),
    "bench/peers.py": (["run", "--engine", "ours"], "the following arguments are required: --work"),
    "bench/peers_runs.py": ([], "the following arguments are required: runs"),
    "bench/profile_step.py": (["BUNDLE", "--bogus"], "unrecognized arguments: --bogus"),
    "bench/quantized_step.py": (["BUNDLE", "--past", "long"], "argument --past: invalid int value: 'long'"),
    "bench/runtime_vs_transformers.py": (["BUNDLE", "--max-new-tokens", "x"],
                                         "argument --max-new-tokens: invalid int value: 'x'"),
    "bench/scaling.py": (["BUNDLE", "--contexts", "big"], "argument --contexts: invalid int value: 'big'"),
    "bench/step_ablation.py": ([], "the following arguments are required: bundle"),
    "bench/tpf_vs_training.py": (["."], "the following arguments are required: --gsm8k"),
    "bench/train_throughput.py": (["MODEL", "--data", "D", "--precisions", "fp8"],
                                  "argument --precisions: invalid choice: 'fp8'"),
    "samples/demo.py": (["BUNDLE", "--draft", "fast"], "argument --draft: invalid choice: 'fast'"),
    "samples/c/mars_c.py": (["BUNDLE", "--prompt", "hi", "--max-new-tokens", "many"],
                            "argument --max-new-tokens: invalid int value: 'many'"),
    "samples/jetson/list_ops.py": ([], "the following arguments are required: bundle"),
    "scripts/gpu_train.py": (["receive"], "the following arguments are required: part"),
    "scripts/playground_screenshot.py": (["BUNDLE", "-o", "x.png", "--width", "wide"],
                                         "argument --width: invalid int value: 'wide'"),
    "scripts/random_checkpoint.py": (["config.json"], "the following arguments are required: -o/--output"),
    "scripts/ship_adapter.py": (["CKPT", "--command", "c", "--data", "d"],
                                "the following arguments are required: --block-size"),
}


@pytest.mark.parametrize("script", sorted(BAD_COMMAND_LINES))
def test_a_bad_command_line_is_one_error_line_in_every_script(script, tmp_path):
    """argparse's refusals printed its usage block before 'SCRIPT: error: ...' (and so did the scripts' own checks
    through parser.error), while their other refusals were one 'error:' line: each script now parses with
    runtime.command_line's parser, as every command, and a bad command line is one 'error:' line, exit status 2."""
    args, message = BAD_COMMAND_LINES[script]
    done = subprocess.run([sys.executable, ROOT / script, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    line, = done.stderr.splitlines()
    assert line.startswith(f"error: {message}"), line
    assert os.listdir(tmp_path) == []


SEVERAL_TAUS = {"bench/confidence_bounds.py", "bench/engine_modes.py", "bench/peers.py",  # whose tau option takes
                "bench/runtime_vs_transformers.py", "samples/demo.py"}  # several taus
BAD_TAUS = {  # script -> a command line whose TAUS is a bad value of its tau option, refused before anything loads
    "bench/c_sample.py": ["BUNDLE", "--binary", f"c={sys.executable}", "--tau", "TAUS"],
    "bench/confidence_bounds.py": ["--taus", "TAUS"],
    "bench/engine_modes.py": ["BUNDLE", "--taus", "TAUS"],
    "bench/peers.py": ["prompts", "--work", "OUT", "--taus", "TAUS"],
    "bench/runtime_vs_transformers.py": ["BUNDLE", "--taus", "TAUS"],
    "bench/tpf_vs_training.py": [".", "--gsm8k", "FILE", "--tau", "TAUS"],
    "samples/c/mars_c.py": ["BUNDLE", "--prompt", "hi", "--tau", "TAUS"],
    "samples/demo.py": ["BUNDLE", "--tau", "TAUS"],
    "scripts/playground_screenshot.py": ["BUNDLE", "-o", "OUT", "--tau-b", "TAUS"],
}


@pytest.mark.parametrize("script", sorted(BAD_TAUS))
@pytest.mark.parametrize("taus, message", [("0.9,abc", "got 0.9,abc; tau >= 1 means one token per step (greedy AR)"),
                                           ("-1", "got -1;")], ids=["comma-list", "negative"])
def test_a_bad_tau_is_one_error_line_in_the_words_of_the_one_rule(script, taus, message, tmp_path):
    """'--taus 0.9,abc' said 'invalid float value' and a negative tau ran until the decoder refused it (or, in
    tpf_vs_training.py, until a model had loaded): every script that takes taus parses them with
    runtime.command_line.tau_value, the runtime's one rule on tau (check_tau)."""
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": "What is 2 + 3?"}) + "\n")
    places = {"TAUS": taus, "OUT": tmp_path / "out", "FILE": tmp_path / "data.jsonl", "BUNDLE": tmp_path / "none"}
    done = run_in(tmp_path, script, BAD_TAUS[script], places)
    option = BAD_TAUS[script][BAD_TAUS[script].index("TAUS") - 1]
    assert_one_error_line(done, f"argument {option}: tau must be a finite number >= 0, {message}")
    several = script in SEVERAL_TAUS and "," in taus  # the hint named --taus where the option was --tau, or took one
    assert ("separate taus" in done.stderr) == several, done.stderr
    assert not several or done.stderr.rstrip().endswith(f"; separate taus by spaces ({option} 0.9 0.8)"), done.stderr
    assert os.listdir(tmp_path) == ["data.jsonl"]


def test_every_script_that_takes_taus_is_tried_on_a_bad_tau():
    """Every script with a --tau, --taus, --tau-a or --tau-b option; bench/load_test.py's --tau-min is the server's
    load-policy floor, tried below."""
    files = {str(path.relative_to(ROOT)): path.read_text() for folder in ("bench", "samples", "scripts")
             for path in (ROOT / folder).rglob("*.py")}
    assert {name for name, text in files.items() if '"--tau' in text} - {"bench/load_test.py"} == set(BAD_TAUS)


@pytest.mark.parametrize("tau_min, message", [
    ("1.5", "need finite 0 <= tau_min <= tau_max, got tau_min=1.5, tau_max=1.0 (tau_max: the server's --tau-max); "
            "give a --tau-min in 0..1"),
    ("nan", "need finite 0 <= tau_min <= tau_max, got tau_min=nan"),
    ("low", "invalid float value: 'low'")])
def test_load_tests_tau_min_is_refused_by_the_load_policys_rule(tau_min, message, tmp_path):
    """bench/load_test.py's --tau-min took any float and passed it to the server it starts, which refused it only
    after the solo reference runs had loaded the bundle: it is the load policy's floor, parsed by its rule."""
    done = run_in(tmp_path, "bench/load_test.py", ["BUNDLE", "--tau-min", tau_min], {"BUNDLE": tmp_path / "none"})
    assert_one_error_line(done, f"argument --tau-min: {message}")
    assert os.listdir(tmp_path) == []


BAD_THREADS = {  # script -> a command line whose THREADS is a bad --threads value, refused before anything loads
    "bench/builder_step.py": [".", "BUNDLE", "--threads", "THREADS"],
    "bench/c_sample.py": ["BUNDLE", "--binary", f"c={sys.executable}", "--threads", "THREADS"],
    "bench/engine_modes.py": ["BUNDLE", "--threads", "THREADS"],
    "bench/load_test.py": ["BUNDLE", "--threads", "THREADS"],
    "bench/quantized_step.py": ["BUNDLE", "--threads", "THREADS"],
    "bench/scaling.py": ["BUNDLE", "--threads", "THREADS"],
    "samples/c/mars_c.py": ["BUNDLE", "--prompt", "hi", "--threads", "THREADS"],
}
# --threads that is no OnnxBackend's: onnxruntime sessions built by hand (their own 1..256 check, or none), torch's
# threads, every peer engine's threads
OTHER_THREADS = {"bench/gqa_attention.py", "bench/matmul_kernels.py", "bench/peers.py", "bench/profile_step.py",
                 "bench/step_ablation.py", "bench/train_throughput.py"}


@pytest.mark.parametrize("script", sorted(BAD_THREADS))
@pytest.mark.parametrize("threads", ["300", "-1"])
def test_bad_threads_are_one_error_line_in_the_words_of_the_backends_rule(script, threads, tmp_path):
    """--threads took any int (bench/c_sample.py had its own copy of the backend's rule): 300 or -1 ran until
    OnnxBackend refused it, or the server did. Every script whose --threads sets an OnnxBackend's threads parses it
    with runtime.command_line.threads_value, the backend's rule (check_num_threads)."""
    places = {"THREADS": threads, "BUNDLE": tmp_path / "none"}
    done = run_in(tmp_path, script, BAD_THREADS[script], places)
    assert_one_error_line(done, f"argument --threads: must be in 0..256 (0 lets onnxruntime choose), got {threads}")
    assert os.listdir(tmp_path) == []


def test_every_script_that_takes_threads_is_tried_on_bad_threads():
    files = {str(path.relative_to(ROOT)): path.read_text() for folder in ("bench", "samples", "scripts")
             for path in (ROOT / folder).rglob("*.py")}
    assert {name for name, text in files.items() if '"--threads"' in text} - OTHER_THREADS == set(BAD_THREADS)


def test_no_command_builds_argparses_own_parser_and_every_script_has_a_bad_command_line_above():
    """No module or script builds argparse.ArgumentParser itself (its refusals print the usage block), and every
    script that builds a parser is in BAD_COMMAND_LINES (a new one too)."""
    paths = [path for folder in ("runtime", "mars_export", "bench", "scripts", "samples")
             for path in (ROOT / folder).rglob("*.py")]
    files = {str(path.relative_to(ROOT)): path.read_text() for path in paths}
    assert [name for name, text in files.items() if "argparse.ArgumentParser(" in text] == []
    scripts = {name for name, text in files.items() if name.startswith(("bench/", "scripts/", "samples/"))
               and "ArgumentParser(" in text}
    assert scripts == set(BAD_COMMAND_LINES)


NOT_A_BUNDLE = {  # script -> a command line whose BUNDLE is a path that is no bundle (OUT: its output, never made)
    "bench/builder_step.py": [".", "BUNDLE", "--out", "OUT"],
    "bench/c_sample.py": ["BUNDLE", "--binary", f"c={sys.executable}", "--out", "OUT"],
    "bench/engine_modes.py": ["BUNDLE", "--out", "OUT"],
    "bench/load_test.py": ["BUNDLE", "--out", "OUT"],
    "bench/matmul_kernels.py": ["BUNDLE", "--out", "OUT"],
    "bench/peers.py": ["prompts", "--bundle", "BUNDLE", "--work", "OUT"],
    "bench/profile_step.py": ["BUNDLE", "--out", "OUT"],
    "bench/quantized_step.py": ["BUNDLE", "--out", "OUT"],
    "bench/runtime_vs_transformers.py": ["BUNDLE", "--out", "OUT"],
    "bench/scaling.py": ["BUNDLE", "--out", "OUT"],
    "bench/step_ablation.py": ["BUNDLE", "--out", "OUT"],
    "samples/c/mars_c.py": ["BUNDLE", "--prompt", "hi", "--binary", sys.executable],
    "samples/demo.py": ["BUNDLE", "--max-new-tokens", "4"],
    "samples/jetson/list_ops.py": ["BUNDLE"],
    "scripts/playground_screenshot.py": ["BUNDLE", "-o", "OUT/shot.png"],
}
NEEDS_SHARED_DATA = {"bench/c_sample.py", "bench/engine_modes.py", "bench/peers.py", "bench/quantized_step.py",
                     "bench/confidence_bounds.py"}  # checked before the path: a clone without it says that first
def run_in(tmp_path: Path, script: str, args: list[str], places: dict[str, Path]) -> subprocess.CompletedProcess:
    """``script`` run from ``tmp_path`` with each placeholder of ``args`` (a key of ``places``) made its path."""
    command = [str(places.get(a, a)) for a in args]
    return subprocess.run([sys.executable, ROOT / script, *command], cwd=tmp_path, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def assert_one_error_line(done: subprocess.CompletedProcess, message: str) -> None:
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout[-500:], done.stderr[-2000:])
    line, = done.stderr.splitlines()
    assert line.startswith(f"error: {message}"), line


@pytest.mark.parametrize("script", sorted(NOT_A_BUNDLE))
@pytest.mark.parametrize("where", ["folder", "missing"])
def test_a_path_that_is_no_bundle_is_one_error_line_in_every_script(script, where, tmp_path, request):
    """A folder that holds no bundle, or no path at all, where a script takes a bundle: one 'error:' line naming it
    and what a bundle is, exit status 2, nothing written (several ended in a BundleError traceback, exit status 1;
    others said 'error: ...' with exit status 1, or 'the bundle lacks its tokenizer; re-export it')."""
    if script in NEEDS_SHARED_DATA:
        request.getfixturevalue("shared_data")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a bundle")
    bundle = mine if where == "folder" else tmp_path / "none"
    done = run_in(tmp_path, script, NOT_A_BUNDLE[script], {"BUNDLE": bundle, "OUT": tmp_path / "out"})
    why = "it holds no mars_config.json" if where == "folder" else "it does not exist"
    assert_one_error_line(done, f"{bundle} is not a MARS bundle: {why}; a MARS bundle is the folder mars-export writes")
    assert os.listdir(tmp_path) == ["mine"] and os.listdir(mine) == ["notes.txt"]


def test_every_script_that_takes_a_bundle_is_tried_on_a_path_that_is_no_bundle():
    files = {str(path.relative_to(ROOT)): path.read_text() for folder in ("bench", "scripts", "samples")
             for path in (ROOT / folder).rglob("*.py")}
    takes_a_bundle = {name for name, text in files.items() if re.search(r'add_argument\("(--)?bundles?"', text)}
    assert takes_a_bundle == set(NOT_A_BUNDLE)


MISSING_INPUTS = {  # case -> (script, a command line naming NONE, a path that does not exist, or MINE, a folder of
    # the wrong kind; FILE: a JSONL file in MINE; OUT: its output, never made), the start of its one error line)
    "builder_step builder": ("bench/builder_step.py", ["NONE", "MINE", "--out", "OUT"],
                             "argument builder: NONE does not exist; give an existing folder"),
    "confidence_bounds model": ("bench/confidence_bounds.py", ["NONE", "--out", "OUT"],
                                "cannot load model 'NONE': no such file or directory"),
    "gpu_check --model": ("bench/gpu_check.py", ["--dry-run", "--model", "NONE", "--out", "OUT/check.json"],
                          "cannot load model 'NONE': no such file or directory"),
    "gpu_check --prompts": ("bench/gpu_check.py", ["--dry-run", "--prompts", "NONE", "--out", "OUT/check.json"],
                            "--prompts NONE is no file"),
    "peers run --work": ("bench/peers.py", ["run", "--engine", "ours", "--work", "NONE"],
                         "--work NONE holds no prompts.json: write it first with 'bench/peers.py prompts"),
    "peers report --work": ("bench/peers.py", ["report", "--work", "MINE", "--out", "OUT"],
                            "--work MINE holds no prompts.json"),
    "peers record --log": ("bench/peers.py", ["record", "--engine", "ours", "--status", "failed", "--log", "NONE",
                                              "--work", "OUT"], "argument --log: NONE does not exist"),
    "peers_runs run": ("bench/peers_runs.py", ["MINE", "--out", "OUT"], "MINE/peers.json not found"),
    "tpf_vs_training run": ("bench/tpf_vs_training.py", ["NONE", "--gsm8k", "FILE", "--out", "OUT"],
                            "argument run_dir: NONE does not exist; give an existing folder"),
    "tpf_vs_training --gsm8k": ("bench/tpf_vs_training.py", ["MINE", "--gsm8k", "MINE", "--out", "OUT"],
                                "argument --gsm8k: MINE is a folder; give a file"),
    "tpf_vs_training --data": ("bench/tpf_vs_training.py", ["MINE", "--gsm8k", "FILE", "--data", "NONE", "--out",
                                                            "OUT"], "--data: data file NONE does not exist"),
    "tpf_vs_training --append": ("bench/tpf_vs_training.py", ["MINE", "--gsm8k", "FILE", "--append", "--out", "OUT"],
                                 "--append: OUT/tpf_vs_training.json not found; run without --append first"),
    "tpf_vs_training --gsm8k no JSON": ("bench/tpf_vs_training.py", ["MINE", "--gsm8k", "TEXT", "--out", "OUT"],
                                        "--gsm8k: TEXT:2: not a JSON-lines file (Expecting value: line 1 column 1"),
    "tpf_vs_training --gsm8k no question": ("bench/tpf_vs_training.py", ["MINE", "--gsm8k", "TEXT", "--num-prompts",
                                                                         "1", "--out", "OUT"],
                                            "--gsm8k: TEXT:1: a GSM8K record needs a string field 'question'"),
    "tpf_vs_training --chat": ("bench/tpf_vs_training.py", ["MINE", "--gsm8k", "FILE", "--chat", "FILE", "--out", "OUT"],
                               "--chat: FILE:1: expected an OpenAssistant tree"),
    "train_throughput model": ("bench/train_throughput.py", ["NONE", "--data", "FILE", "--out", "OUT"],
                               "cannot load model 'NONE': no such file or directory"),
    "train_throughput --data": ("bench/train_throughput.py", ["default", "--data", "NONE", "--out", "OUT"],
                                "--data: data file NONE does not exist"),
    "random_checkpoint config": ("scripts/random_checkpoint.py", ["NONE", "-o", "OUT"],
                                 "NONE does not exist; give a Hugging Face config.json or the folder holding it"),
    "ship_adapter checkpoint": ("scripts/ship_adapter.py", ["MINE", "--out", "OUT", "--block-size", "4", "--command",
                                                            "c", "--data", "FILE"],
                                "MINE is no checkpoint of a mars-train --lora run: it holds no trainer_state.json"),
}


@pytest.mark.parametrize("case", sorted(MISSING_INPUTS))
def test_an_input_path_that_is_not_there_or_of_another_kind_is_one_error_line(case, tmp_path, request):
    """A model, run, data file, log, curve or work folder that is not there, a folder where a file goes, a data file
    of another form: one 'error:' line naming it, exit status 2, nothing written (each was a traceback, an 'error:'
    line with exit status 1, a report listing the model as missing, or a message about a hub id's spelling)."""
    script, args, message = MISSING_INPUTS[case]
    if script in NEEDS_SHARED_DATA:
        request.getfixturevalue("shared_data")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.jsonl").write_text(json.dumps({"question": "What is 2 + 3?", "prompt": "Name a color.",
                                                 "response": "Blue."}) + "\n")
    (mine / "text.jsonl").write_text('{"prompt": "Name a color."}\nnot JSON\n')
    places = {"NONE": tmp_path / "none", "MINE": mine, "FILE": mine / "data.jsonl", "TEXT": mine / "text.jsonl",
              "OUT": tmp_path / "out"}
    done = run_in(tmp_path, script, args, places)
    for name, path in places.items():
        message = message.replace(name, str(path))
    assert_one_error_line(done, message)
    assert os.listdir(tmp_path) == ["mine"] and sorted(os.listdir(mine)) == ["data.jsonl", "text.jsonl"]


@pytest.mark.parametrize("content", ["", "\n  \n"], ids=["empty", "blank-lines"])
@pytest.mark.parametrize("option", ["--gsm8k", "--chat"])
def test_tpf_vs_training_refuses_a_prompt_file_without_records_before_the_model_loads(option, content, tmp_path):
    """--gsm8k (or --chat) a file of 0 bytes or only blank lines: the model loaded, then TPF divided by zero
    forwards (ZeroDivisionError). One line naming the file, exit status 2, nothing written."""
    (tmp_path / "run").mkdir()
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": "What is 2 + 3?"}) + "\n")
    (tmp_path / "empty.jsonl").write_text(content)
    files = {"--gsm8k": "empty.jsonl", "--chat": "data.jsonl"} if option == "--gsm8k" else \
        {"--gsm8k": "data.jsonl", "--chat": "empty.jsonl"}
    done = run_in(tmp_path, "bench/tpf_vs_training.py", ["run", "--out", "out", *sum(files.items(), ())], {})
    assert_one_error_line(done, f"{option}: empty.jsonl holds no records (it is empty or only blank lines)")
    assert sorted(os.listdir(tmp_path)) == ["data.jsonl", "empty.jsonl", "run"]


def test_tpf_vs_training_replaces_an_earlier_curve_only_with_force(tmp_path):
    """The default --out is bench/results: a run silently overwrote the committed tpf_vs_training.json/.png. They
    are refused, as mars-eval refuses its earlier results (runtime.command_line.check_results_folder), unless
    --force, or --append, which adds to the curve."""
    (tmp_path / "run").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tpf_vs_training.png").write_text("earlier")
    (tmp_path / "empty.jsonl").write_text("")
    args = ["run", "--gsm8k", "empty.jsonl", "--out", "out"]
    done = run_in(tmp_path, "bench/tpf_vs_training.py", args, {})
    assert_one_error_line(done, "--out out already holds tpf_vs_training.png of an earlier run; choose another --out "
                                "or pass --force to replace them")
    for extra in ("--force", "--append"):  # past the check: to the next one, the empty --gsm8k
        done = run_in(tmp_path, "bench/tpf_vs_training.py", [*args, extra], {})
        assert_one_error_line(done, "--gsm8k: empty.jsonl holds no records")
    assert os.listdir(tmp_path / "out") == ["tpf_vs_training.png"]
    assert (tmp_path / "out" / "tpf_vs_training.png").read_text() == "earlier"



WRITES_RESULTS = {  # script -> (its default --name, a command line with OUT its --out, the error past the check)
    **{script: (Path(script).stem, NOT_A_BUNDLE[script], "BUNDLE is not a MARS bundle")
       for script in ("bench/c_sample.py", "bench/engine_modes.py", "bench/matmul_kernels.py", "bench/scaling.py",
                      "bench/step_ablation.py")},
    "bench/peers_runs.py": ("peers_runs", ["BUNDLE", "--out", "OUT"], "BUNDLE/peers.json not found"),
    "bench/confidence_bounds.py": ("confidence_bounds", ["BUNDLE", "--out", "OUT"],
                                   "cannot load model 'BUNDLE': no such file or directory"),
}


@pytest.mark.parametrize("script", sorted(WRITES_RESULTS))
def test_the_scripts_writing_result_files_replace_an_earlier_run_only_with_force(script, tmp_path, request):
    """bench/results_files.write_results overwrote an earlier run's NAME.json/.csv/.png silently (the default --out
    is bench/results, where the committed results are). Each script that writes them refuses, before anything loads,
    as mars-eval and bench/tpf_vs_training.py do (check_results_folder), unless --force."""
    if script in NEEDS_SHARED_DATA:
        request.getfixturevalue("shared_data")
    name, args, past = WRITES_RESULTS[script]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / f"{name}.csv").write_text("earlier")
    places = {"BUNDLE": tmp_path / "none", "OUT": tmp_path / "out"}
    done = run_in(tmp_path, script, args, places)
    assert_one_error_line(done, f"--out {tmp_path / 'out'} already holds {name}.csv of an earlier run; choose another "
                                "--out or pass --force to replace them")
    done = run_in(tmp_path, script, [*args, "--force"], places)  # past the check: to the missing bundle
    assert_one_error_line(done, past.replace("BUNDLE", str(tmp_path / "none")))
    assert os.listdir(tmp_path / "out") == [f"{name}.csv"] and (tmp_path / "out" / f"{name}.csv").read_text() == "earlier"


def test_every_script_that_writes_result_files_is_tried_on_an_earlier_run():
    files = {str(path.relative_to(ROOT)): path.read_text() for path in (ROOT / "bench").glob("*.py")}
    assert {name for name, text in files.items() if "write_results(" in text} - {"bench/results_files.py"} == \
        set(WRITES_RESULTS)


BAD_NAMES = {  # a --name that is no file stem -> the start of its refusal (after 'argument --name: ')
    "": "empty; give a file stem", " ": "blank (' '); give a file stem", "a/b": "'a/b' is a path, not a file name",
    "../x": "'../x' is a path, not a file name", ".": "'.' is a path, not a file name",
    "..": "'..' is a path, not a file name"}


@pytest.mark.parametrize("name", sorted(BAD_NAMES))
def test_results_name_refuses_what_is_no_file_stem(name):
    """runtime.command_line.results_name, the one rule on --name of every script writing result files."""
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(BAD_NAMES[name])):
        results_name(name)
    assert results_name("run.2") == "run.2"


@pytest.mark.parametrize("script", ["bench/builder_step.py", "bench/gqa_attention.py", "bench/profile_step.py",
                                    "bench/tpf_vs_training.py"])
def test_the_scripts_writing_one_result_file_refuse_a_name_that_is_no_file_stem(script, tmp_path):
    """--name ../x wrote beside --out and --name a/b failed after the run: the same rule (results_name) at parsing."""
    done = run_in(tmp_path, script, ["--name", "../x", "x"], {})  # --name parsed before the positional
    assert_one_error_line(done, f"argument --name: {BAD_NAMES['../x']}")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script", sorted(WRITES_RESULTS))
@pytest.mark.parametrize("name", ["", "../x"], ids=["empty", "outside-out"])
def test_the_scripts_writing_result_files_refuse_a_name_that_is_no_file_stem(script, name, tmp_path):
    """--name '' wrote hidden .json/.csv/.png, --name a/b ended in a FileNotFoundError traceback after the run and
    --name ../x wrote beside --out, not in it (only bench/c_sample.py had a rule, its own): each script parses
    --name with runtime.command_line.results_name, one 'error:' line at parsing, nothing written."""
    _, args, _ = WRITES_RESULTS[script]
    done = run_in(tmp_path, script, [*args, "--name", name], {"BUNDLE": tmp_path / "none", "OUT": tmp_path / "out"})
    assert_one_error_line(done, f"argument --name: {BAD_NAMES[name]}")
    assert os.listdir(tmp_path) == []

@pytest.mark.parametrize("script", sorted(WRITES_RESULTS))
@pytest.mark.parametrize("out, message", [
    ("", "argument --out: is empty: give a path"), (" ", "argument --out: is blank (' '): give a path"),
    ("/proc/x", "--out /proc/x cannot be written: no folder can be made in /proc (")], ids=["empty", "blank", "proc"])
def test_the_scripts_writing_result_files_refuse_an_out_that_cannot_be_written(script, out, message, tmp_path):
    """--out '' wrote the results into the current folder, --out ' ' into a folder named by a space, and an --out
    that takes no new folder (a read-only disk, /proc) failed in a traceback after the whole run: one 'error:' line
    before anything loads (path_value, check_results_folder), nothing written."""
    if out == "/proc/x" and not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    _, args, _ = WRITES_RESULTS[script]
    done = run_in(tmp_path, script, args, {"BUNDLE": tmp_path / "none", "OUT": out})
    assert_one_error_line(done, message)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("second, message", [
    ({"rows": [{"engine": "llamacpp", "variant": "gguf f32", "batch_size": 1, "status": "ok",
                "decode_tokens_per_second": 9.0}]}, "no row ran in every run; pass runs of the same settings"),
    ("{not json", "is not JSON ("), ([1, 2], "has no rows; is it the report of bench/peers.py?")],
    ids=["other-settings", "not-json", "no-rows"])
def test_peers_runs_that_cannot_be_summed_up_are_one_error_line(tmp_path, second, message):
    """Runs of other settings (no row in both), or a peers.json that is no report: one 'error:' line, exit status 2
    (was 1, or a JSONDecodeError / AttributeError traceback), nothing written."""
    row = {"engine": "ours", "variant": "ar", "batch_size": 1, "status": "ok", "decode_tokens_per_second": 10.0}
    for name, report in (("one", {"rows": [row]}), ("two", second)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "peers.json").write_text(report if isinstance(report, str) else json.dumps(report))
    done = run_in(tmp_path, "bench/peers_runs.py", ["one", "two", "--out", "out"], {})
    assert_one_error_line(done, message if message.startswith("no row") else f"two/peers.json {message}")
    assert sorted(os.listdir(tmp_path)) == ["one", "two"]


def test_random_checkpoint_of_a_model_type_without_a_published_layout_writes_nothing(tmp_path):
    """The model was saved before its type was found to have no published layout: -o was left half-written."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}))
    done = run_in(tmp_path, "scripts/random_checkpoint.py", ["config.json", "-o", "out"], {})
    assert_one_error_line(done, "no published MARS layout for model_type 'gpt2'")
    assert os.listdir(tmp_path) == ["config.json"]


def test_scaling_refuses_a_window_a_fixed_window_graph_cannot_take_before_measuring(smoke_model, tmp_path):
    """--window 1 on a graph whose window is fixed at 4: one error line, exit status 2 (was 1, after printing the
    weights), nothing written."""
    fixed = fix_window(shutil.copytree(smoke_model[1], tmp_path / "fixed"), 4)
    done = run_in(tmp_path, "bench/scaling.py", [fixed, "--window", "1", "--contexts", "16", "--out", "OUT"],
                  {"OUT": tmp_path / "out"})
    assert_one_error_line(done, "--window [1]: this graph's window is fixed at 4; pass --window 4 or leave it out")
    assert os.listdir(tmp_path) == ["fixed"]


def test_load_test(smoke_model, tmp_path, monkeypatch):
    """Both phases against one server. The periodic sampler is slowed to one sample per run (as on a loaded machine,
    where a 2 s phase got no sample of its own and its tokens/s came out NaN): each phase still has the samples that
    bracket it, so its throughput is measured."""
    _, bundle = smoke_model
    load_test = load_script(ROOT / "bench" / "load_test.py")
    monkeypatch.setattr(load_test, "SAMPLE_EVERY_S", 3600.0)
    monkeypatch.setattr(tempfile, "tempdir", str((tmp_path / "tmp").resolve()))  # the server's log went to a
    (tmp_path / "tmp").mkdir()  # /tmp/mars-load-* folder that stayed there
    assert load_test.main([str(bundle), "--clients", "2", "--duration", "2", "--max-tokens", "8", "--max-batch-size",
                           "2", "--threads", "1", "--queue-high", "2", "--ramp", "1", "2", "--ramp-step", "1",
                           "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "load_test.json").read_text())
    for phase in ("fixed", "ramp"):
        assert result[phase]["tokens"] > 0 and result[phase]["tokens_per_second"] > 0, result[phase]
    assert result["checks"]["fixed_zero_failed_or_lost"] and result["checks"]["fixed_all_equal_solo"]
    assert os.listdir(tmp_path / "tmp") == []


def test_load_test_server_that_does_not_start_leaves_no_folder_and_shows_its_log(tmp_path, monkeypatch):
    """A server that fails to start: the error shows the end of its log (in a folder removed with the run)."""
    load_test = load_script(ROOT / "bench" / "load_test.py")
    monkeypatch.setattr(tempfile, "tempdir", str((tmp_path / "tmp").resolve()))
    (tmp_path / "tmp").mkdir()
    args = load_test.parse_args([str(tmp_path / "no-bundle")])
    with pytest.raises(RuntimeError, match="the server did not start; the end of its log:\n.*no-bundle does not exist"):
        load_test.run_single(args, [], [], None)
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize("fails", [None, "run", "deploy"])
def test_load_test_stops_each_ray_deployment_through_ray_launch_stop(monkeypatch, fails):
    """--ray stopped Serve with serve.shutdown() itself, which waits at most 30 s and skips the replicas' graceful
    shutdown and the wait for Serve to be gone: each replica count now gets a Ray of its own, stopped through
    runtime.serving.ray_launch.stop(deployed), also when its run fails; a failed deploy (no handle) shuts Ray down.
    Ray and Serve are stubbed: what matters is the order of the calls."""
    ray_launch = pytest.importorskip("runtime.serving.ray_launch", reason="needs the serve-ray extra")
    load_test = load_script(ROOT / "bench" / "load_test.py")
    calls = []

    def deploy(argv, fleet):
        calls.append(("deploy", fleet.replicas))
        if fails == "deploy":
            raise ValueError("bad bundle")
        return ray_launch.Deployed(f"http://127.0.0.1:{8000 + fleet.replicas}", board=None, shutdown_timeout_s=5.0)

    class Run:  # LoadRun's records and samples, of a run with no requests
        def __init__(self, url, pid, *rest):
            self.url, self.records = url, []
            self.samples = [{"t_s": t, "phase": "fixed", "tokens": 8 * t, "forwards": 4 * t, "rss_mb": 100.0}
                            for t in (0, 1)]

        async def run(self, args):
            calls.append(("run", self.url))
            if fails == "run":
                raise RuntimeError("a client failed")

    monkeypatch.setattr(ray_launch, "start_local_ray", lambda **kwargs: calls.append(("ray.init",)))
    monkeypatch.setattr(ray_launch, "deploy", deploy)
    monkeypatch.setattr(ray_launch, "stop", lambda deployed: calls.append(("stop", deployed.url)))
    monkeypatch.setattr(ray_launch.serve, "shutdown", lambda: pytest.fail("Serve was shut down directly"))
    monkeypatch.setattr(ray_launch.ray, "shutdown", lambda: calls.append(("ray.shutdown",)))
    monkeypatch.setattr(load_test, "LoadRun", Run)
    args = load_test.parse_args(["BUNDLE", "--ray", "1", "2"])
    first = [("ray.init",), ("deploy", 1), ("run", "http://127.0.0.1:8001"), ("stop", "http://127.0.0.1:8001")]
    if fails is None:
        result, _ = load_test.run_ray(args, [], [], None)
        assert [row["replicas"] for row in result["replicas"]] == [1, 2]
        assert calls == first + [("ray.init",), ("deploy", 2), ("run", "http://127.0.0.1:8002"),
                                 ("stop", "http://127.0.0.1:8002")]
        return
    with pytest.raises((RuntimeError, ValueError)):
        load_test.run_ray(args, [], [], None)
    assert calls == (first if fails == "run" else [("ray.init",), ("deploy", 1), ("ray.shutdown",)])


def test_load_test_against_ray_replicas(smoke_model, tmp_path):
    """--ray 1 2: the fixed phase against 1 then 2 Ray Serve replicas, every response equal to its solo run."""
    _, bundle = smoke_model
    python("bench/load_test.py", bundle, "--clients", "2", "--duration", "2", "--max-tokens", "8",
           "--max-batch-size", "2", "--threads", "1", "--queue-high", "2", "--ray", "1", "2", "--out", tmp_path)
    rows = json.loads((tmp_path / "load_test_ray.json").read_text())["replicas"]
    assert [r["replicas"] for r in rows] == [1, 2] and rows[0]["ratio_to_first"] == 1.0
    assert all(r["checks"]["fixed_all_equal_solo"] and r["checks"]["streamed_text_equals_decode"] for r in rows), rows


@pytest.mark.usefixtures("shared_data")
def test_bench_peers_ours_only(smoke_model, tmp_path):
    """ENGINES=ours: no peer is installed and no checkpoint written; each of ROUNDS=2 rounds makes its report,
    with every variant of ours, the int8 bundle's and the fused bundles' rows (batch 1 only), and the lossless
    ones equal our AR ids; bench/peers_runs.py sums the two rounds up."""
    ckpt, bundle = smoke_model[0], shutil.copytree(smoke_model[1], tmp_path / "bundle")
    export(str(ckpt), tmp_path / "bundle-int8", 4, 4, "--mask-token", "<mask>", "--int8")  # found as $BUNDLE-int8
    export(str(ckpt), tmp_path / "bundle-fused", 4, 4, "--mask-token", "<mask>", "--graph", "fused")  # $BUNDLE-fused
    for dtype in ("int8", "int4"):  # $BUNDLE-fusedint8, $BUNDLE-fusedint4
        export(str(ckpt), tmp_path / f"bundle-fused{dtype}", 4, 4, "--mask-token", "<mask>", "--graph", "fused",
               f"--{dtype}")
    out = tmp_path / "out"
    stale = tmp_path / "peers" / "work" / "rows-llamacpp.json"  # an earlier run's rows: not part of the rounds
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    printed = run("bash", "scripts/bench_peers.sh", "--num-prompts", "2", "--max-new-tokens", "8", "--batch-sizes", "1",
                  "2", "--threads", "1", "--taus", "0.9", "--llamacpp-n-batch", "1",
                  env={"ENGINES": "ours", "QUANTIZED": "int8", "FUSED": "float32 int8 int4", "BUNDLE": str(bundle),
                       "PEER_ENVS": str(tmp_path / "peers"), "OUT": str(out), "ROUNDS": "2"})
    assert "== round 1 of 2: ours" in printed and "== round 2 of 2: ours" in printed
    reports = [assert_results(out / f"round{i}", "peers") for i in (1, 2)]
    assert [report["meta"]["llamacpp_n_batch"] for report in reports] == [1, 1]
    rounds = [report["rows"] for report in reports]
    assert not stale.exists() and (tmp_path / "peers" / "logs" / "ours.run.round2.log").is_file()
    for rows in rounds:
        fused = ["ar", "threshold tau=0.9", "threshold tau=0.9 + both", *VERIFY_VARIANTS]
        assert {row["engine"] for row in rows} == {"ours"}
        assert all(row["status"] == ("ok" if row["batch_size"] == 1 or not row["variant"].startswith("fused") else
                                     "not supported") for row in rows)
        assert all(row["error"].startswith("a fused bundle runs one sequence") for row in rows if row["status"] != "ok")
        assert [r["variant"] for r in rows if r["batch_size"] == 1] == \
            ["ar", "threshold tau=0.9", "threshold tau=0.9 + both", *VERIFY_VARIANTS,
             *[f"fused {name}" for name in fused], "fused int4 ar", "fused int4 verify + both", "fused int8 ar",
             "fused int8 verify + both", "int8 ar",
             "int8 verify + both"]  # tagged rows files in name order
        lossless = ["ar", *VERIFY_VARIANTS, "fused ar", *[f"fused {name}" for name in VERIFY_VARIANTS]]
        assert all(r["identical_to_ours_ar"] == 2 for r in rows if r["variant"] in lossless and r["status"] == "ok")
    assert "| ours | verify + lookup | 2 |" in printed and "| ours | int8 verify + both | 2 |" in printed
    assert "| ours | fused verify + both | 2 |" in printed
    assert not (tmp_path / "peers" / "ckpt").exists()
    # the summary of the rounds: each within-round ratio, round by round
    ratios = assert_results(out, "peers_runs")["ratios"]
    fused_over_step = {(r["ratio"], r["batch_size"]): r for r in ratios}[("fused fp32 ar / ours fp32 ar", 1)]
    ar = [{r["variant"]: r["decode_tokens_per_second"] for r in rows if r["status"] == "ok" and r["batch_size"] == 1}
          for rows in rounds]
    assert fused_over_step["per_run"] == [speeds["fused ar"] / speeds["ar"] for speeds in ar]
    assert not any("GenAI" in r["ratio"] or r["batch_size"] == 2 and "fused" in r["ratio"] for r in ratios)
    assert "| fused fp32 ar / ours fp32 ar | 1 |" in printed
    missing = subprocess.run([sys.executable, "bench/peers_runs.py", tmp_path / "peers", "--out", tmp_path / "none"],
                             cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert missing.returncode != 0 and "peers.json not found" in missing.stderr


@pytest.mark.usefixtures("shared_data")
def test_bench_peers_rounds_try_a_failed_setup_once(smoke_model, tmp_path):
    """A peer whose install fails becomes a 'not installable here' row in every round, installed once (a
    llama.cpp build that failed would otherwise cost its 10-35 minutes again each round)."""
    peers = tmp_path / "peers"
    (peers / "ckpt" / "m").mkdir(parents=True)
    (peers / "ckpt" / "m" / "config.json").write_text("{}")  # the checkpoint the peers read: there already
    venv_bin = peers / "ortgenai" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text("#!/bin/sh\nexit 1\n")
    (venv_bin / "pip").write_text(f"#!/bin/sh\necho call >> {tmp_path / 'pip_calls'}\necho 'ERROR: no wheel' >&2\nexit 1\n")
    for stub in venv_bin.iterdir():
        stub.chmod(0o755)
    out = tmp_path / "out"
    run("bash", "scripts/bench_peers.sh", "--num-prompts", "1", "--max-new-tokens", "4", "--batch-sizes", "1",
        "--threads", "1", "--taus", "0.9",
        env={"ENGINES": "ours ortgenai", "QUANTIZED": "", "FUSED": "", "BUNDLE": str(smoke_model[1]), "MODEL": "m",
             "PEER_ENVS": str(peers), "OUT": str(out), "ROUNDS": "3"})
    assert (tmp_path / "pip_calls").read_text().splitlines() == ["call"]
    for i in (1, 2, 3):
        rows = assert_results(out / f"round{i}", "peers")["rows"]
        assert [r["status"] for r in rows if r["engine"] == "ortgenai"] == ["not installable here"]
    assert assert_results(out, "peers_runs")["left_out"] == []


@pytest.mark.usefixtures("shared_data")
def test_bench_peers_records_an_engine_killed_by_a_signal(smoke_model, tmp_path):
    """An engine run killed by a signal (llama.cpp segfaulting) is a failed row whose error says so after its log's
    last line (that line alone, a speed, read as the reason)."""
    peers = tmp_path / "peers"
    (peers / "ckpt" / "m").mkdir(parents=True)
    (peers / "ckpt" / "m" / "config.json").write_text("{}")  # the checkpoint the peers read: there already
    (peers / "optimum-model" / "m").mkdir(parents=True)
    (peers / "optimum-model" / "m" / "model.onnx").write_text("")  # the export: there already
    venv = peers / "optimum"
    (venv / "bin").mkdir(parents=True)
    (venv / ".pins").write_text("stub\n")  # the venv is up to date with OPTIMUM_PINS=stub
    (venv / "bin" / "python").write_text("#!/bin/sh\necho 'optimum fp32 batch 1: 2.5 tok/s'\nkill -SEGV $$\n")
    (venv / "bin" / "python").chmod(0o755)
    run("bash", "scripts/bench_peers.sh", "--num-prompts", "1", "--max-new-tokens", "4", "--batch-sizes", "1",
        "--threads", "1", "--taus", "0.9",
        env={"ENGINES": "optimum", "OPTIMUM_PINS": "stub", "BUNDLE": str(smoke_model[1]), "MODEL": "m",
             "PEER_ENVS": str(peers), "OUT": str(tmp_path / "out")})
    rows = assert_results(tmp_path / "out", "peers")["rows"]
    assert [(r["status"], r["error"]) for r in rows] == \
        [("failed", "optimum fp32 batch 1: 2.5 tok/s; killed by signal 11 (SIGSEGV)")]


@pytest.mark.usefixtures("shared_data")
def test_bench_peers_llamacpp_cmake_args_are_a_pin(smoke_model, tmp_path):
    """llama.cpp's venv is rebuilt when LLAMACPP_CMAKE_ARGS change (pip told to skip its cache of the wheel built
    with the old ones), and kept when they and the pins are unchanged."""
    peers = tmp_path / "peers"
    (peers / "ckpt" / "m").mkdir(parents=True)
    (peers / "ckpt" / "m" / "config.json").write_text("{}")  # the checkpoint the peers read: there already
    (peers / "src" / "llama_cpp_python-0.3.36").mkdir(parents=True)  # the sdist: there already
    calls = tmp_path / "pip_calls"
    for venv in ("llamacpp", "gguf-convert"):
        (peers / venv / "bin").mkdir(parents=True)
        (peers / venv / "bin" / "pip").write_text(f'#!/bin/sh\necho "{venv} CMAKE_ARGS=$CMAKE_ARGS $*" >> {calls}\n'
                                                  "exit 1\n")
        (peers / venv / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")  # the venv is there: not made anew
        for stub in (peers / venv / "bin").iterdir():
            stub.chmod(0o755)
    (peers / "llamacpp" / ".pins").write_text("stub CMAKE_ARGS=-DOLD=ON\n")  # built with other CMake arguments
    env = {"ENGINES": "llamacpp", "LLAMACPP_PINS": "stub", "GGUF_PINS": "stub", "BUNDLE": str(smoke_model[1]),
           "MODEL": "m", "PEER_ENVS": str(peers), "OUT": str(tmp_path / "out")}
    args = ("bash", "scripts/bench_peers.sh", "--num-prompts", "1", "--max-new-tokens", "4", "--batch-sizes", "1",
            "--threads", "1", "--taus", "0.9")
    run(*args, env={**env, "LLAMACPP_CMAKE_ARGS": "-DNEW=ON"})
    assert calls.read_text().splitlines() == [
        "llamacpp CMAKE_ARGS=-DNEW=ON install --disable-pip-version-check --no-cache-dir --force-reinstall stub"]
    calls.unlink()
    (peers / "llamacpp" / ".pins").write_text("stub CMAKE_ARGS=-DNEW=ON\n")  # as a successful build leaves it
    run(*args, env={**env, "LLAMACPP_CMAKE_ARGS": "-DNEW=ON"})
    assert calls.read_text().splitlines() == ["gguf-convert CMAKE_ARGS= install --disable-pip-version-check stub"]


@pytest.mark.parametrize("env, message", [
    ({"ROUNDS": "0"}, "ROUNDS takes a whole number of rounds >= 1, got '0'"),
    ({"ROUNDS": "two"}, "ROUNDS takes a whole number of rounds >= 1, got 'two'"),
    ({"ROUNDS": "00"}, "ROUNDS takes a whole number of rounds >= 1, got '00'"),
    ({"ENGINES": "*"}, "unknown engine '*'"),  # not expanded to file names
    ({"ENGINES": "ours llama"}, "unknown engine 'llama'; choose from: ours transformers ortgenai llamacpp optimum"),
    ({"QUANTIZED": "int8 fp16"}, "QUANTIZED takes int8 and/or int4, got 'fp16'"),
    ({"FUSED": "float32 q4"}, "FUSED takes float32, int8 and/or int4, got 'q4'"),
])
def test_bench_peers_refuses_bad_settings_before_running_anything(tmp_path, env, message):
    """A bad ROUNDS, engine name or bundle dtype stops the script with exit status 2 before any engine runs or any report is made."""
    done = subprocess.run(["bash", "scripts/bench_peers.sh"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**os.environ, "PEER_ENVS": str(tmp_path / "peers"), "OUT": str(tmp_path / "out"), **env})
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "peers").exists()


def test_peers_runs_names_the_rows_missing_from_some_runs(monkeypatch):
    """A row that ran in some runs only (failed once) gets no per-run ratio and is named in left_out."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as when it runs as a script
    runs_script = load_script(ROOT / "bench" / "peers_runs.py")
    runs = [{("ours", "ar", 1): 50.0, ("ortgenai", "model builder fp32", 1): 40.0},
            {("ours", "ar", 1): 60.0}]
    summary = runs_script.summarize(runs)
    assert [(r["engine"], r["per_run"]) for r in summary["speeds"]] == [("ours", [50.0, 60.0])]
    assert summary["ratios"] == []
    assert summary["left_out"] == [{"engine": "ortgenai", "variant": "model builder fp32", "batch_size": 1,
                                    "num_runs": 1}]


def test_bench_peers_like_for_like_ratios():
    """Our int8 / int4 AR over llama.cpp's Q8_0 / Q4_1 rows at the batch sizes both ran; pairs with a side
    that did not run (failed, not supported, absent) are left out; a missing decode speed gives no decode ratio."""
    peers = load_script(ROOT / "bench" / "peers.py")

    def row(engine, variant, bs, tps, decode=None, status="ok"):
        return {"engine": engine, "variant": variant, "batch_size": bs, "status": status,
                "tokens_per_second": tps, "decode_tokens_per_second": decode}
    rows = [row("ours", "int8 ar", 1, 60.0, 80.0), row("ours", "int8 ar", 4, 150.0, 200.0),
            row("ours", "int4 ar", 1, 45.0), row("ours", "ar", 1, 50.0, 70.0),
            row("ours", "fused int8 ar", 1, 90.0, 110.0), row("ours", "fused int4 ar", 1, 135.0, 190.0),
            row("llamacpp", "gguf q8_0", 1, 120.0, 100.0), row("llamacpp", "gguf q4_1", 1, 90.0, 95.0),
            row("llamacpp", "gguf q8_0", 4, None, status="not supported"),
            row("llamacpp", "gguf q4_0", 1, None, status="failed")]
    pairs = peers.like_for_like(rows)
    assert pairs == [{"ours": "int8 ar", "llamacpp": "gguf q8_0", "batch_size": 1, "tokens_per_second_ratio": 0.5,
                      "decode_tokens_per_second_ratio": 0.8},
                     {"ours": "fused int8 ar", "llamacpp": "gguf q8_0", "batch_size": 1,
                      "tokens_per_second_ratio": 0.75, "decode_tokens_per_second_ratio": 1.1},
                     {"ours": "int4 ar", "llamacpp": "gguf q4_1", "batch_size": 1, "tokens_per_second_ratio": 0.5,
                      "decode_tokens_per_second_ratio": None},
                     {"ours": "fused int4 ar", "llamacpp": "gguf q4_1", "batch_size": 1,
                      "tokens_per_second_ratio": 1.5, "decode_tokens_per_second_ratio": 2.0}]
    assert peers.like_for_like_lines(pairs).splitlines() == [
        "- ours int8 ar / llamacpp gguf q8_0, batch 1: 0.50x end-to-end tok/s, 0.80x decode tok/s",
        "- ours fused int8 ar / llamacpp gguf q8_0, batch 1: 0.75x end-to-end tok/s, 1.10x decode tok/s",
        "- ours int4 ar / llamacpp gguf q4_1, batch 1: 0.50x end-to-end tok/s, - decode tok/s",
        "- ours fused int4 ar / llamacpp gguf q4_1, batch 1: 1.50x end-to-end tok/s, 2.00x decode tok/s"]
    assert peers.like_for_like([r for r in rows if r["engine"] == "ours"]) == []


def test_bench_peers_report_leaves_out_rows_of_other_settings(tmp_path, capsys):
    """Rows files an earlier run left in the work folder with other settings (here: other prompts), its status rows
    included, are left out of the report, named on stderr and in peers.json; the rows made with prompts.json's
    settings are reported."""
    import argparse
    peers = load_script(ROOT / "bench" / "peers.py")
    prompts = [{"id": "gsm8k-0", "task": "gsm8k", "ids": [5, 6, 7]}]
    settings = {"bundle": "b", "source_model": "m", "max_new_tokens": 4, "batch_sizes": [1], "threads": 1,
                "taus": [0.9], "eos_ids": [2], "pad_id": 2, "prompts": prompts}
    (tmp_path / "prompts.json").write_text(json.dumps(settings))

    def rows_file(engine, variant, key):
        row = {"engine": engine, "variant": variant, "batch_size": 1, "status": "ok", "error": "", "num_prompts": 1,
               "num_tokens": 3, "seconds": 0.1, "ttft_seconds_mean": 0.01, "decode_tokens_per_second": 30.0,
               "tokens_per_second": 30.0, "num_forwards": 3, "tpf": 1.0, "prompt_tokens": [3], "outputs": [[8, 9, 2]]}
        peers.write_rows(tmp_path, engine, [row], {"settings": key})
    other = {**settings, "prompts": [{**prompts[0], "id": "other"}]}
    (tmp_path / "prompts.json").write_text(json.dumps(other))  # an earlier run's: its status rows carry its settings
    peers.record_status(argparse.Namespace(engine="optimum", tag=None, status="not installable here", log=None,
                                           error="no wheel", exit_status=None, work=tmp_path))
    (tmp_path / "prompts.json").write_text(json.dumps(settings))
    peers.record_status(argparse.Namespace(engine="transformers", tag=None, status="failed", log=None, error="boom",
                                           exit_status=None, work=tmp_path))  # this run's failure: reported
    rows_file("ours", "ar", peers.run_key(settings))
    rows_file("ortgenai", "model builder fp32", peers.run_key(other))
    peers.report(argparse.Namespace(work=tmp_path, out=tmp_path / "out"))
    result = json.loads((tmp_path / "out" / "peers.json").read_text())
    assert [(r["engine"], r["status"]) for r in result["rows"]] == [("ours", "ok"), ("transformers", "failed")]
    assert result["meta"]["left_out"] == ["rows-ortgenai.json", "rows-optimum.json"]
    assert "rows-ortgenai.json, rows-optimum.json" in capsys.readouterr().err
    for name in ("ours", "transformers"):
        (tmp_path / f"rows-{name}.json").unlink()
    with pytest.raises(UsageError, match="no rows .* come from the settings of prompts.json"):
        peers.report(argparse.Namespace(work=tmp_path, out=tmp_path / "out"))


def test_bench_peers_llamacpp_n_batch_is_a_setting_rows_must_share():
    """--llamacpp-n-batch (1: the workaround for llama.cpp's AMX crash) changes how llama.cpp prefills, so rows made
    with another value are another run's; a prompts.json from before the setting counts as llama.cpp's default."""
    peers = load_script(ROOT / "bench" / "peers.py")
    settings = {"bundle": "b", "max_new_tokens": 4, "batch_sizes": [1], "threads": 1, "taus": [0.9],
                "prompts": [{"id": "gsm8k-0", "ids": [5, 6, 7]}]}
    assert peers.run_key(settings) == peers.run_key({**settings, "llamacpp_n_batch": 512})
    assert peers.run_key(settings) != peers.run_key({**settings, "llamacpp_n_batch": 1})


def test_bench_peers_prompts_refuse_a_llamacpp_n_batch_below_one(tmp_path):
    done = subprocess.run([sys.executable, "bench/peers.py", "prompts", "--work", str(tmp_path), "--llamacpp-n-batch",
                           "0"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: --num-prompts, --batch-sizes, --max-new-tokens and --llamacpp-n-batch must be >= 1"]
    assert not (tmp_path / "prompts.json").exists()


def test_bench_peers_quantize_gguf_needs_the_f32_file(tmp_path):
    """quantize-gguf stops before loading llama.cpp when its F32 input is missing, naming the file and the fix."""
    done = subprocess.run([sys.executable, "bench/peers.py", "quantize-gguf", "--type", "q4_1", "--input",
                           str(tmp_path / "m.f32.gguf"), "--out", str(tmp_path / "m.q4_1.gguf")],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2 and f"--input {tmp_path / 'm.f32.gguf'} is no file" in done.stderr
    assert "convert_hf_to_gguf.py --outtype f32" in done.stderr and not list(tmp_path.iterdir())


def test_profile_step_writes_times_and_op_breakdown(smoke_model, tmp_path):
    """Two bundles interleaved over pasts x windows: per-row times and ratios, the op breakdown at the first past."""
    _, bundle = smoke_model
    copy = shutil.copytree(bundle, tmp_path / "copy")
    stdout = python("bench/profile_step.py", bundle, copy, "--pasts", "6", "0", "--windows", "1", "3", "--steps", "2",
                    "--rounds", "1", "--threads", "1", "--out", tmp_path, "--name", "p")
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [(r["past"], r["window"], r["bundle"]) for r in rows] == \
        [(p, w, str(b)) for p in (6, 0) for w in (1, 3) for b in (bundle, copy)]
    for row in rows:
        assert min(row["step_ms"], row["cpu_ms"], row["greedy_ms"], row["ratio_to_first"], row["cpu_ratio_to_first"]) > 0
        assert row["skipped_ms"] > 0 and row["fired_ms"] > 0  # a float32 step graph's confidence gate, both ways
    assert [r["ratio_to_first"] for r in rows[0::2]] == [1.0] * 4
    for row in rows[:4]:  # the op breakdown is taken at the first past
        assert row["ops"]["MatMul"]["nodes"] > 0 and abs(sum(o["share"] for o in row["ops"].values()) - 1) < 1e-6
        assert 0 < row["profiled_ms"] <= row["profiled_run_ms"]  # the kernels run inside the profiled run
    assert all(not row["ops"] for row in rows[4:])
    assert "| op type | nodes | ms/step | share |" in stdout and "unprofiled step" in stdout


def test_profile_step_runs_a_bundle_on_both_kinds_of_pages(smoke_model, tmp_path):
    """--pages both: each bundle twice, on huge pages (as the runtime loads it) and on onnxruntime's own."""
    _, bundle = smoke_model
    python("bench/profile_step.py", bundle, "--pasts", "6", "--windows", "1", "--steps", "2", "--rounds", "1",
           "--threads", "1", "--pages", "both", "--out", tmp_path, "--name", "p")
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [r["bundle"] for r in rows] == [str(bundle), f"{bundle} [small pages]"]
    assert all(r["step_ms"] > 0 and r["ops"] for r in rows)


@pytest.fixture(scope="module")
def smoke_fused(smoke_model, tmp_path_factory) -> Path:
    """The tiny Llama's fused bundle (the model builder's graph), B = W = 4."""
    ckpt, _ = smoke_model
    return export(str(ckpt), tmp_path_factory.mktemp("smoke-fused") / "fused", 4, 4, "--mask-token", "<mask>",
                  "--graph", "fused")


def test_profile_step_runs_a_fused_bundle_as_its_backend_does(smoke_model, smoke_fused, tmp_path):
    """A fused bundle beside the step graph of the same model: its step over the same past (P = 0 included)
    and its op breakdown (GroupQueryAttention, the greedy head); more than one row is refused naming --batches 1."""
    _, bundle = smoke_model
    fused = smoke_fused
    python("bench/profile_step.py", bundle, fused, "--pasts", "6", "0", "--windows", "1", "3", "--steps", "2",
           "--rounds", "1", "--threads", "1", "--out", tmp_path, "--name", "p")
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [(r["past"], r["window"], r["bundle"]) for r in rows] == \
        [(p, w, str(b)) for p in (6, 0) for w in (1, 3) for b in (bundle, fused)]
    assert all(row["step_ms"] > 0 for row in rows)
    assert all(row["ops"]["GroupQueryAttention"]["nodes"] == 2 for row in rows[1:4:2])  # 2 layers
    # the greedy step of a float32 fused bundle reads its greedy head's ids: the int8 screening runs, and
    # the float32 output head on no rows
    assert all(row["ops"]["MatMulNBits"]["nodes"] == 1 and row["greedy_ms"] > 0 for row in rows[1:4:2])
    # and its confidence gate, both ways
    assert all(row["skipped_ms"] > 0 and row["fired_ms"] > 0 for row in rows[1::2])
    refused = subprocess.run([sys.executable, "bench/profile_step.py", fused, "--batches", "2"], cwd=ROOT,
                             capture_output=True, text=True, timeout=TIMEOUT_S)
    assert refused.returncode != 0 and "fused bundle: it runs batch 1; pass --batches 1" in refused.stderr


@pytest.mark.parametrize("part, removed_ops", [("attention", {"GroupQueryAttention"}),
                                                ("norms", {"SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"}),
                                                ("activation", {"Sigmoid"})])
def test_step_ablation_removes_a_part_and_the_graph_still_runs(smoke_fused, smoke_model, part, removed_ops, monkeypatch):
    """Each part leaves every layer (2 layers: 2 attentions, 4 skip-norms and the first norm, 2 SiLUs replaced), the nodes that only
    fed it go too, and the graph keeps its I/O and runs a step; a step graph has no attention of that form (an error
    naming fused bundles)."""
    import onnx
    import onnxruntime as ort
    from runtime import bundle as bundle_module
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    ablation = load_script(ROOT / "bench" / "step_ablation.py")
    model = onnx.load(str(smoke_fused / bundle_module.ONNX_FILE))
    before = [n.op_type for n in model.graph.node]
    assert removed_ops & set(before)
    io = ([i.name for i in model.graph.input], [o.name for o in model.graph.output])
    replaced = ablation.ablate(model, part, head_dim=bundle_module.load_config(smoke_fused).head_dim)
    assert replaced == {"attention": 2, "norms": 5, "activation": 2}[part]  # norms: 4 skip-norms and the first plain one
    after = [n.op_type for n in model.graph.node]
    assert not removed_ops & set(after) and len(after) < len(before) + 6 * replaced
    for kernel in ("MatMul", "MatMulNBits"):  # every weight is still read
        assert after.count(kernel) == before.count(kernel)
    read = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    assert all(out in read for n in model.graph.node for out in n.output if out)  # no node left that feeds nothing
    assert ([i.name for i in model.graph.input], [o.name for o in model.graph.output]) == io
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    config = bundle_module.load_config(smoke_fused)
    feeds = {"input_ids": np.array([[5, 6]], np.int64), "attention_mask": np.ones((1, 2), np.int64),
             bundle_module.NUM_LOGITS: np.array(2, np.int64), bundle_module.NUM_GREEDY: np.array(0, np.int64),
             bundle_module.CONFIDENCE_TAU: np.full(1, -1, np.float32)}  # the confidence gate's: never skips
    feeds.update({i.name: np.zeros((1, config.num_kv_heads, 4, config.head_dim), np.float32)
                  for i in session.get_inputs() if i.name.startswith("past_key_values.")})
    assert session.run([bundle_module.LOGITS], feeds)[0].shape == (1, 2, config.vocab_size)
    step_graph = onnx.load(str(smoke_model[1] / bundle_module.ONNX_FILE))
    with pytest.raises(ValueError, match="no attention of the model builder's form.*fused bundle"):
        ablation.ablate(step_graph, "attention", head_dim=config.head_dim)


def test_step_ablation_refuses_a_removal_that_leaves_a_weight_unread(monkeypatch):
    """An attention fed by its own K and V projections (separate MatMuls): removing it would leave them unread, so
    the variant would not read every weight; ablate says so and leaves the graph as it was."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    ablation = load_script(ROOT / "bench" / "step_ablation.py")
    weights = [numpy_helper.from_array(np.ones((8, 8), np.float32), f"w{p}") for p in "qkv"]
    nodes = [helper.make_node("MatMul", ["x", f"w{p}"], [p], name=f"{p}_proj") for p in "qkv"]
    nodes.append(helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens", "total", "cos",
                                                          "sin"], ["out", "present_k", "present_v"],
                                  domain="com.microsoft", num_heads=2, kv_num_heads=2))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "past_k", "past_v", "cos", "sin")]
    inputs += [helper.make_tensor_value_info(n, TensorProto.INT32, None) for n in ("seqlens", "total")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "present_k", "present_v")]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, weights))
    with pytest.raises(ValueError, match="would leave 2 weight MatMuls unread"):
        ablation.ablate(model, "attention", head_dim=4)
    assert [n.op_type for n in model.graph.node] == ["MatMul"] * 3 + ["GroupQueryAttention"]


def test_step_ablation_pairs_the_whole_step_and_a_variant_within_each_round(monkeypatch):
    """A part's cost is the median over rounds of (whole - variant) in the same round, with the rounds' range: a round
    where the machine ran slower for both does not make the part look dearer; each round starts one variant later."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    ablation = load_script(ROOT / "bench" / "step_ablation.py")
    rounds = [{"whole": {"step_ms": w, "cpu_ms": 2 * w}, "norms": {"step_ms": v, "cpu_ms": 2 * v}}
              for w, v in ((10.0, 9.0), (20.0, 18.5), (11.0, 10.5))]
    assert [ablation.rotated(["whole", "norms", "all"], i) for i in range(4)] == [  # scaling.rotated
        ["whole", "norms", "all"], ["norms", "all", "whole"], ["all", "whole", "norms"], ["whole", "norms", "all"]]
    got = ablation.paired(rounds, "norms")
    assert got["part_ms"] == 1.0 and (got["part_ms_min"], got["part_ms_max"]) == (0.5, 1.5)
    assert got["step_ms"] == 10.5 and got["part_share"] == 1.0 / 11.0 and got["part_cpu_ms"] == 2.0


def test_step_ablation_times_each_part_against_the_whole_step(smoke_fused, smoke_model, tmp_path):
    """Every variant at every (P, W), each part's cost = the whole step's time - the variant's (in each round; one here);
    a step-graph bundle
    is refused with one line naming fused bundles and bench/profile_step.py."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    stdout = run(sys.executable, "bench/step_ablation.py", smoke_fused, "--pasts", "6", "0", "--windows", "1", "2",
                 "--steps", "1", "--rounds", "1", "--threads", "1", "--out", tmp_path, "--name", "a",
                 env={"TMPDIR": str(scratch)})
    result = assert_results(tmp_path, "a")
    rows = result["rows"]
    assert result["meta"]["started_utc"] <= result["meta"]["ended_utc"]
    variants = ["whole", "attention", "norms", "activation", "all"]
    assert [(r["past"], r["window"], r["variant"]) for r in rows] == \
        [(p, w, v) for p in (6, 0) for w in (1, 2) for v in variants]
    for point in range(4):
        whole, *others = rows[point * 5:point * 5 + 5]
        assert whole["step_ms"] > 0 and whole["part_ms"] is whole["part_ms_min"] is whole["part_share"] is None
        for r in others:  # one round: the paired difference is the difference of the medians
            assert r["part_ms_min"] == r["part_ms"] == pytest.approx(whole["step_ms"] - r["step_ms"]) == r["part_ms_max"]
    assert "| P | W | variant |" in stdout and not list(scratch.glob("mars-ablation-*"))  # the variants are gone
    refused = subprocess.run([sys.executable, "bench/step_ablation.py", smoke_model[1]], cwd=ROOT, capture_output=True,
                             text=True, timeout=TIMEOUT_S)
    assert refused.returncode == 2 and "give it a fused bundle" in refused.stderr and "profile_step.py" in refused.stderr
    too_far = subprocess.run([sys.executable, "bench/step_ablation.py", smoke_fused, "--pasts", "2047"], cwd=ROOT,
                             capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, "TMPDIR": str(scratch)})
    assert too_far.returncode == 2 and "beyond the model's context of 2048" in too_far.stderr
    assert "built the variant" not in too_far.stdout  # refused before any variant was built


def test_demo_on_another_bundle(smoke_model):
    """The README's main command with BUNDLE=DIR: setup (a no-op check after CI's), then the demo."""
    _, bundle = smoke_model
    out = run("bash", "scripts/demo.sh", "--max-new-tokens", "8", "--tau", "1.0", "0.5", "--draft", "both",
              env={"BUNDLE": str(bundle)})
    assert out.count("tau=1.0") >= 6 and "### tau=0.5" in out and "draft both" in out, out[-1500:]
    assert re.search(r"decode tok/s at tau=0\.5 / tau=1\.0: \d+\.\d\dx", out), out[-500:]


def test_demo_with_adaptive_masks_on_a_fixed_window_bundle_stops_with_one_line(tiny_bundle, tmp_path):
    """A graph exported before 2026-11-30 takes only W-token steps: --adaptive-masks could skip no mask, so the
    demo says so and what to do (re-export), exit status 2, before decoding anything."""
    old = fix_window(shutil.copytree(tiny_bundle("llama", 4)[1], tmp_path / "old"), 4)
    done = subprocess.run([sys.executable, "samples/demo.py", str(old), "--adaptive-masks", "--max-new-tokens", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith("error: adaptive masks cannot act") and "re-export" in err[0]


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    (["--tau", "-1"], "tau must be a finite number >= 0, got -1"),
    (["--tau", "nan"], "tau must be a finite number >= 0, got nan"),
    (["--tau", "1.0", "-1"], "tau must be a finite number >= 0, got -1"),  # not after the tau 1.0 run
    (["--max-new-tokens", "100000"], "--max-new-tokens 100000 does not fit: after the longest prompt ("),
    (["--bundle-is-a-file"], "is not a MARS bundle: it is a file"),
], ids=["max-new-tokens-0", "tau-negative", "tau-nan", "second-tau-negative", "beyond-context", "not-a-bundle"])
def test_demo_refuses_bad_values_with_one_line_before_decoding(tiny_bundle, tmp_path, args, message):
    """demo.py ended in a traceback on a bad value (the runtime's ParamError, BundleError), and checked each tau only
    when its run began, so '--tau 1.0 -1' ran the whole tau 1.0 pass first. Every value is checked by the runtime's
    own rules before any decoding: one error line, exit status 2, nothing on stdout."""
    bundle = tiny_bundle("llama", 4)[1]
    if args == ["--bundle-is-a-file"]:
        bundle, args = tmp_path / "notes.txt", []
        bundle.write_text("mine")
    done = subprocess.run([sys.executable, "samples/demo.py", str(bundle), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


FAKE_BINARIES = {  # case -> (a shell script standing in for mars_c, exit status, lines c_sample.py prints)
    "missing": (None, 2, ["error: argument --binary: BINARY is no file; build mars_c first (see samples/c/README.md)"]),
    "fails": ("for i in $(seq 1 30); do echo \"onnxruntime log line $i\" >&2; done\n"
              "echo 'mars_c: error at model.c:42: out of memory' >&2\nexit 1\n", 1,
              ["error: --binary c=BINARY failed on the 64-token prompt (exit status 1):",
               *(f"onnxruntime log line {i}" for i in range(22, 31)), "mars_c: error at model.c:42: out of memory"]),
    "is-no-mars_c": ("exit 0\n", 1, ["error: --binary c=BINARY failed on the 64-token prompt:",
                                     "BINARY printed no token ids and counts line as mars_c does; is it a mars_c "
                                     "build? (see samples/c/README.md)"]),
    "crashes": ("echo 'onnxruntime: loading the session' >&2\nkill -SEGV $$\n", 1,
                ["error: --binary c=BINARY failed on the 64-token prompt (killed by signal 11 (SIGSEGV)):",
                 "onnxruntime: loading the session"]),
}


@pytest.mark.usefixtures("shared_data")
@pytest.mark.parametrize("case", sorted(FAKE_BINARIES))
def test_c_sample_names_a_binary_that_is_not_built_or_fails_without_a_traceback(smoke_model, tmp_path, case):
    """A binary that is not there is a bad command line (one line naming how to build it, exit status 2); one that
    fails during the run stops it with exit status 1 and the end of its stderr (all of it was printed, and a program
    that printed nothing, not being mars_c, ended in an IndexError traceback), after how it ended: its exit status,
    or the signal that killed it (a crash showed only its stderr). Nothing is written either way."""
    script, status, lines = FAKE_BINARIES[case]
    binary = tmp_path / "mars_c"
    if script is not None:
        binary.write_text("#!/bin/sh\n" + script)
        binary.chmod(0o755)
    done = subprocess.run([sys.executable, "bench/c_sample.py", str(smoke_model[1]), "--binary", f"c={binary}",
                           "--prompt-lengths", "64", "--max-new-tokens", "4", "--repeats", "1", "--threads", "1",
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert (done.returncode, done.stdout) == (status, ""), done.stderr[-2000:]
    assert done.stderr.splitlines() == [line.replace("BINARY", str(binary)) for line in lines]
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("shared_data")
def test_engine_modes_refuses_adaptive_masks_on_the_block_scheme(smoke_model, tmp_path):
    """The block scheme runs every step W wide: --adaptive-masks with it (both schemes are the default) stops
    before any run, naming --schemes and the continuous scheme, and writes nothing."""
    _, bundle = smoke_model
    done = subprocess.run([sys.executable, "bench/engine_modes.py", str(bundle), "--adaptive-masks", "--taus", "0.9",
                           "--batch-sizes", "1", "--num-prompts", "2", "--max-new-tokens", "8", "--threads", "1",
                           "--out", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--adaptive-masks with --schemes block" in errors[0]
    assert "use the continuous scheme" in errors[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("make", [lambda path: (path / "notes.txt").write_text("mine"), lambda path: None],
                         ids=["folder", "empty-folder"])
def test_demo_refuses_a_bundle_path_that_holds_no_bundle_in_its_own_terms(tmp_path, make):
    """BUNDLE=DIR, an existing folder that is no bundle: one line saying what to do with BUNDLE, not the exporter's
    -o/--force, before setup. Runs a copy of demo.sh beside a setup.sh and a .venv that record being called."""
    repo, mine = tmp_path / "repo", tmp_path / "mine"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "demo.sh", repo / "scripts" / "demo.sh")
    (repo / "scripts" / "setup.sh").write_text(f"touch {tmp_path / 'setup-ran'}\n")
    (repo / ".venv" / "bin").mkdir(parents=True)
    for tool in ("mars-export", "python"):
        (repo / ".venv" / "bin" / tool).write_text(f"#!/bin/sh\ntouch {tmp_path / (tool + '-ran')}\nexit 1\n")
        (repo / ".venv" / "bin" / tool).chmod(0o755)
    mine.mkdir()
    make(mine)
    done = subprocess.run(["bash", repo / "scripts" / "demo.sh"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BUNDLE": str(mine)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"BUNDLE={mine} exists but is not a MARS bundle" in done.stderr
    assert f"set BUNDLE to a bundle or to a path that does not exist yet, or remove the directory {mine}" in done.stderr
    assert not re.search(r"(^|\s)(-o|--force)\b", done.stderr), done.stderr  # the exporter's flags
    assert sorted(os.listdir(tmp_path)) == ["mine", "repo"]  # neither setup, the export nor the demo ran


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory, data file): one LoRA step of mars-train on the default model, checkpointed
    (the two scripts below read a run of the default model)."""
    root = tmp_path_factory.mktemp("lora-run")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n"
                            for p, r in [("What is 2 + 3?", "2 + 3 = 5."), ("Name a color.", "Blue.")]))
    run(Path(sys.executable).parent / "mars-train", "default", "--data", data, "--output", root / "run", "--lora",
        "--max-steps", "1", "--save-steps", "1", "--max-length", "128", "--batch-size", "1", "--block-size", "4")
    return root / "run", data


def test_tpf_vs_training(lora_run, tmp_path, shared_data):
    run_dir, data = lora_run
    python("bench/tpf_vs_training.py", run_dir, "--gsm8k", shared_data / "gsm8k" / "test.jsonl", "--chat",
           shared_data / "chat_multiturn" / "oasst_en_100_tree.jsonl", "--num-prompts", "1", "--max-new-tokens", "4",
           "--every", "1", "--data", data, "--name", "curve", "--out", tmp_path)
    rows = assert_results(tmp_path, "curve", (".json", ".png"))["rows"]
    assert [r["step"] for r in rows] == [0, 1]  # base, checkpoint-1
    for row in rows:
        assert set(row["sets"]) == {"gsm8k", "chat"} and row["sets"]["chat"]["num_tokens"] > 0
        assert row["num_tokens"] == sum(s["num_tokens"] for s in row["sets"].values())
    assert rows[1]["example_tokens_seen"] > rows[0]["example_tokens_seen"] == 0


def test_ship_adapter(lora_run, tmp_path):
    run_dir, data = lora_run
    python("scripts/ship_adapter.py", run_dir / "checkpoint-1", "--out", tmp_path, "--block-size", "4",
           "--max-length", "128", "--command", "mars-train default --lora ...", "--data", data)
    info = json.loads((tmp_path / "mars_adapter.json").read_text())
    assert info["block_size"] == 4 and info["optimizer_steps"] == 1
    assert (tmp_path / "adapter_model.safetensors").stat().st_size > 0 and (tmp_path / "adapter_config.json").exists()


def test_gpu_check_dry_run(smoke_model, tmp_path):
    """Everything up to the first GPU call: environment, the package's prompts, CPU references;
    what the GPU part lacks here (TensorRT at least) is listed with its install line."""
    ckpt, _ = smoke_model
    out = tmp_path / "gpu_check.json"
    printed = json.loads(python("bench/gpu_check.py", "--dry-run", "--model", ckpt, "--mask-token", "<mask>",
                                "--num-prompts", "2", "--max-new-tokens", "4", "--out", out))
    report = json.loads(out.read_text())
    assert printed["passed"] and report["passed"] and report["dry_run"] and report["runs"] == {}
    assert [r["num_tokens"] for r in report["references"]] == [4, 4]
    assert report["references"][0]["kind"].startswith("GSM8K")  # mars_export/data/parity_prompts.json
    if GPU_MISSING is not None:
        assert any("mars-edge[trt]" in line for line in report["environment"]["missing"])


def test_random_checkpoint(smoke_model, tmp_path):
    """A 2-layer Qwen2 config sized like nothing real, the tiny model's tokenizer: the published
    layout, <|mask|> as the tokenizer's mask token in the padding rows, loadable for export."""
    config = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "MARS-random-blk4"
    python("scripts/random_checkpoint.py", tmp_path / "config.json", "-o", out, "--tokenizer", smoke_model[0])
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"], written["vocab_size"]) == \
        ("a2d-qwen2", ["A2DQwen2LMHeadModel"], 300)
    from mars_export.model_source import load_model
    loaded = load_model(str(out))
    assert (loaded.mask_token, loaded.mask_token_origin) == ("<|mask|>", "the tokenizer's mask_token")
    assert loaded.mask_token_id < 300 == loaded.model.get_input_embeddings().num_embeddings


def test_playground_screenshot(smoke_model, tmp_path):
    """The server started, a compare run in headless Chromium, a PNG of the page at 1280 pixels wide."""
    try:
        load_script(ROOT / "scripts" / "playground_screenshot.py").find_browser()
    except FileNotFoundError as e:  # .ci/run installs them
        pytest.skip(f"no browser: {e}")
    out = tmp_path / "playground.png"
    python("scripts/playground_screenshot.py", smoke_model[1], "-o", out, "--max-tokens", "8", "--width", "1280")
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1280  # IHDR width


@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
def test_gpu_check(tmp_path):
    """The GPU check end to end, small: fp16 export with a TensorRT engine, parity, identity, speed."""
    python("bench/gpu_check.py", "--num-prompts", "1", "--max-new-tokens", "8", "--work", tmp_path / "bundles",
           "--out", tmp_path / "gpu_check.json")
    assert json.loads((tmp_path / "gpu_check.json").read_text())


def test_matmul_kernels_times_all_the_step_weights_in_every_format(smoke_model, tmp_path):
    """One weights-only step per (format, M), over every constant MatMul weight of the graph, tied head included."""
    import onnx

    _, bundle = smoke_model
    stdout = python("bench/matmul_kernels.py", bundle, "--formats", "fp32", "int8-32", "int4-16", "--rows", "1", "2",
                    "--repeats", "2", "--stream-mib", "8", "--threads", "1", "--pages", "huge", "small",
                    "--out", tmp_path, "--name", "k")
    result = assert_results(tmp_path, "k")
    graph = onnx.load(bundle / "model.onnx").graph
    constant = {t.name for t in graph.initializer}
    constant |= {n.output[0] for n in graph.node if n.op_type == "Transpose" and n.input[0] in constant}
    num_matmuls = sum(n.op_type == "MatMul" and n.input[1] in constant for n in graph.node)
    assert sum(s["count"] for s in result["shapes"]) == num_matmuls > 0
    assert [(r["format"], r["rows"], r["pages"]) for r in result["rows"]] == \
        [(f, m, pages) for f in ("fp32", "int8-32", "int4-16") for m in (1, 2) for pages in ("huge", "small")]
    fp32_bytes = sum(s["count"] * s["K"] * s["N"] * 4 for s in result["shapes"])
    int8_bytes = sum(s["count"] * s["N"] * (s["K"] + 4 * -(-s["K"] // 32)) for s in result["shapes"])
    assert result["rows"][0]["weight_gb"] * 1e9 == pytest.approx(fp32_bytes)
    assert result["rows"][4]["weight_gb"] * 1e9 == pytest.approx(int8_bytes)
    assert all(r["step_weights_ms"] > 0 and r["gbs"] > 0 and r["fraction_of_stream"] > 0 for r in result["rows"])
    assert all(r["fraction_of_read"] == pytest.approx(r["gbs"] / result["stream"]["read_gbs"]) for r in result["rows"])
    assert "| format | pages | M | weights GB |" in stdout
    done = subprocess.run([sys.executable, "bench/matmul_kernels.py", bundle, "--formats", "int3-32"], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2 and "unknown format 'int3-32'" in done.stderr

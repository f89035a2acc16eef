"""``mars-eval`` end to end on a tiny bundle, and its one-line errors."""

from __future__ import annotations

import csv
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import fix_window

from runtime.decode.decoder import Decoder
from runtime.evaluation.answers import extract_answer, is_correct
from runtime.evaluation.cli import main
from runtime.evaluation.code_extraction import prepare_completion

GSM8K = [
    {"question": "Tom has 2 apples and buys 3 more. How many apples does he have?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "A pen costs $1,200. What do 2 pens cost?", "answer": "2 * 1200 = 2400\n#### 2,400"},
]
HUMANEVAL = [
    {"task_id": "Tiny/0", "prompt": 'def add(a, b):\n    """Return a + b."""\n', "entry_point": "add",
     "canonical_solution": "    return a + b\n", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"},
    {"task_id": "Tiny/1", "prompt": 'def neg(x):\n    """Return -x."""\n', "entry_point": "neg",
     "canonical_solution": "    return -x\n", "test": "def check(candidate):\n    assert candidate(4) == -4\n"},
]


@pytest.fixture
def data(tmp_path):
    paths = tmp_path / "gsm8k.jsonl", tmp_path / "humaneval.jsonl"
    for path, records in zip(paths, (GSM8K, HUMANEVAL)):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [str(p) for p in paths]


def eval_args(bundle, data, out, *extra):
    return [str(bundle), "--gsm8k", data[0], "--humaneval", data[1], "--out", str(out), "--threads", "1",
            "--max-new-tokens", "16", *extra]


def recomputed(records: list[dict]) -> dict:
    """The summary numbers of one (bundle, B, tau) group, computed here from its records."""
    gsm8k = [r for r in records if r["task"] == "gsm8k"]
    humaneval = [r for r in records if r["task"] == "humaneval"]
    tokens = sum(r["num_tokens"] for r in records)
    return {"num_prompts": len(records), "num_tokens": tokens, "num_forwards": sum(r["num_forwards"] for r in records),
            "tpf": tokens / sum(r["num_forwards"] for r in records),
            "tokens_per_second": tokens / sum(r["seconds"] - r["prefill_seconds"] for r in records),
            "agreement_exact": sum(r["identical_to_ar"] for r in records) / len(records),
            "agreement_prefix": sum(r["common_prefix_fraction"] for r in records) / len(records),
            "gsm8k_accuracy": sum(r["correct"] for r in gsm8k) / len(gsm8k),
            "humaneval_pass_at_1": sum(r["passed"] for r in humaneval) / len(humaneval)}


def test_end_to_end_outputs_are_consistent(bundle, data, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(eval_args(bundle, data, out, "--taus", "0.5", "--block-sizes", "2", "4")) == 0
    printed = capsys.readouterr().out
    assert "TPF" in printed and "pass@1" in printed

    results = json.loads((out / "results.json").read_text())
    records, summary = results["records"], results["summary"]
    assert results["settings"]["taus"] == [1.0, 0.5]  # the AR reference is added
    assert len(records) == 4 * 2 * 2 and len(summary) == 2 * 2
    assert (out / "tpf_quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    for row in summary:
        group = [r for r in records if (r["block_size"], r["tau"]) == (row["block_size"], row["tau"])]
        assert {k: row[k] for k in recomputed(group)} == pytest.approx(recomputed(group))
        assert 1.0 <= row["tpf"] <= row["block_size"]
        if row["tau"] == 1.0:
            assert row["tpf"] == 1.0 and row["agreement_exact"] == 1.0 and row["speedup_vs_ar"] == 1.0
    assert max(row["tpf"] for row in summary) > 1.0, "tau 0.5 accepted no mask prediction on the tiny model"

    ar = {r["item_id"]: r["token_ids"] for r in records if r["tau"] == 1.0}
    gold = {"gsm8k/0": 5, "gsm8k/1": 2400}
    entry = {p["task_id"]: p["entry_point"] for p in HUMANEVAL}
    for r in records:
        ref = ar[r["item_id"]]
        same = next((i for i, (a, b) in enumerate(zip(ref, r["token_ids"])) if a != b), min(len(ref), r["num_tokens"]))
        assert r["identical_to_ar"] == (r["token_ids"] == ref)
        assert r["common_prefix_fraction"] == same / max(len(ref), r["num_tokens"])
        assert r["num_tokens"] == len(r["token_ids"]) <= 16
        if r["task"] == "gsm8k":
            assert r["gold"] == gold[r["item_id"]] and r["correct"] == is_correct(extract_answer(r["text"]), r["gold"])
        else:
            assert r["completion"] == prepare_completion(r["text"], entry[r["item_id"]])
            assert r["exec_result"] == "passed" or r["exec_result"].startswith(("failed", "timed out"))

    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["block_size"]), float(r["tau"]), float(r["tpf"])) for r in rows] == \
        [(s["block_size"], s["tau"], s["tpf"]) for s in summary]


@pytest.mark.parametrize("extra, message", [
    (["--taus", "1.0", "-0.1"], "argument --taus: tau must be a finite number >= 0, got -0.1"),
    (["--taus", "nan"], "argument --taus: tau must be a finite number >= 0, got nan"),
    (["--taus", "0.9,0.8"], "got 0.9,0.8; tau >= 1 means one token per step (greedy AR); separate taus by spaces"),
    (["--block-sizes", "8"], "none of the block sizes [8] fits a bundle exported with B = 4"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--max-new-tokens", "600"], "exceeds the model's max context"),
    (["--metric", "vibes"], "unknown confidence metric"),
    (["--taus"], "expected at least one argument"),
])
def test_bad_values_give_one_error_line(bundle, data, tmp_path, capsys, extra, message):
    assert main(eval_args(bundle, data, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]


@pytest.mark.parametrize("threads", ["300", "-1"])
def test_threads_out_of_the_backends_range_is_refused_before_anything_loads(bundle, data, tmp_path, capsys,
                                                                            monkeypatch, threads):
    """mars-eval had its own --threads >= 0 rule and no upper limit (300 ran until OnnxBackend refused it, after the
    items loaded): --threads is parsed by the backend's rule (runtime.decode.admission.check_num_threads)."""
    monkeypatch.setattr("runtime.evaluation.cli.load_config", lambda *a: pytest.fail("a bundle was loaded"))
    monkeypatch.setattr("runtime.evaluation.cli.load_items", lambda *a: pytest.fail("the items were loaded"))
    assert main(eval_args(bundle, data, tmp_path / "out", "--threads", threads)) == 2
    assert capsys.readouterr().err == ("error: argument --threads: must be in 0..256 (0 lets onnxruntime choose), "
                                       f"got {threads}\n")


def test_bad_files_give_one_error_line(bundle, data, tmp_path, capsys):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "no answer field"}\n')
    cases = [
        ([str(tmp_path / "missing"), "--gsm8k", data[0]], "is not a MARS bundle"),
        ([str(bundle), "--gsm8k", str(tmp_path / "missing.jsonl")], "missing.jsonl not found"),
        ([str(bundle), "--gsm8k", str(broken)], "broken.jsonl:1: a GSM8K record needs"),
        ([str(bundle), "--humaneval", data[0]], "a HumanEval record needs"),
        ([str(bundle)], "give at least one of --gsm8k FILE, --humaneval FILE and --chat FILE"),
    ]
    for argv, message in cases:
        assert main([*argv, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_refused_as_the_other_tools_refuse_it(bundle, data, tmp_path, capsys, monkeypatch):
    """--out README.md (an existing file) gave "error: [Errno 17] File exists: 'README.md'", after the bundles
    were loaded. It is refused before anything is loaded, in the words of mars-export -o and mars-train --output,
    and the file is kept."""
    monkeypatch.chdir(tmp_path)
    Path("README.md").write_text("mine")
    monkeypatch.setattr("runtime.evaluation.cli.load_config", lambda *a: pytest.fail("a bundle was loaded"))
    for out, message in (("README.md", "error: --out README.md is a file, not a directory; choose another --out"),
                         ("README.md/results", "error: --out README.md/results lies under README.md, which is a file, "
                                               "not a directory, so no results can be written there; choose another "
                                               "--out")):
        assert main(eval_args(bundle, data, out)) == 2
        assert capsys.readouterr().err == message + "\n"
    assert Path("README.md").read_text() == "mine"
    assert main(eval_args(bundle, data, "")) == 2  # not read as the current directory
    assert capsys.readouterr().err == "error: --out is empty: give the directory to write the results to (default " \
                                      "./mars-eval-results)\n"
    assert main(eval_args(bundle, data, "  ")) == 2  # not a folder named by two spaces
    assert capsys.readouterr().err == "error: --out is blank ('  '): give the directory to write the results " \
                                      "to (default ./mars-eval-results)\n"



@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_that_cannot_be_written_is_refused_before_anything_is_loaded(bundle, data, tmp_path, capsys,
                                                                           monkeypatch):
    """--out was tried only when it was made, after the bundles loaded and the items were read: --out /proc/x (a
    folder that takes no new entries, for root too) failed then, and an existing --out on a read-only disk only
    when the results were written, after the whole run. Both are refused at the start, by the results folder's rule
    (runtime.command_line.check_results_folder, the bench scripts' too), naming --out."""
    monkeypatch.setattr("runtime.evaluation.cli.load_config", lambda *a: pytest.fail("a bundle was loaded"))
    assert main(eval_args(bundle, data, "/proc/x")) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --out /proc/x cannot be written: no folder can be made in /proc ("), line
    out = tmp_path / "out"
    out.mkdir()

    def refuse(*args, dir=None, **kwargs):
        if Path(dir) == out:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_mkdtemp(*args, dir=dir, **kwargs)
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    assert main(eval_args(bundle, data, out)) == 2
    assert capsys.readouterr().err == (f"error: --out {out} cannot be written: no folder can be made in {out} "
                                       "(read-only file system); choose an --out on a writable disk\n")
    assert os.listdir(out) == []


def test_an_out_that_links_to_nowhere_is_refused_before_anything_is_loaded(bundle, data, tmp_path, capsys,
                                                                           monkeypatch):
    """--out a symbolic link to a missing folder ended after the whole run in "error: [Errno 17] File exists"."""
    monkeypatch.setattr("runtime.evaluation.cli.load_config", lambda *a: pytest.fail("a bundle was loaded"))
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "gone")
    assert main(eval_args(bundle, data, out)) == 2
    assert capsys.readouterr().err == (f"error: --out {out} is a symbolic link to {tmp_path / 'gone'}, which does "
                                       "not exist; make that folder or choose another --out\n")

def test_mars_eval_imports_without_torch():
    script = ("import sys; sys.modules['torch'] = None\n"
              "import runtime.evaluation.cli\n"
              "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if sys.modules.get(m) is not None))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


CHAT_TREE = {"prompt": {"text": "Hi there", "role": "prompter", "replies": [
    {"text": "Hello! How can I help?", "role": "assistant", "replies": [
        {"text": "Name a prime.", "role": "prompter", "replies": [{"text": "7", "role": "assistant"}]}]}]}}


def test_items_from_the_end_keep_their_file_index(tmp_path):
    from runtime.evaluation.tasks import load_gsm8k
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n\n" for r in GSM8K * 3))  # 6 records, blank lines between
    assert [i.item_id for i in load_gsm8k(path, 2)] == ["gsm8k/0", "gsm8k/1"]
    last = load_gsm8k(path, 2, from_end=True)
    assert [i.item_id for i in last] == ["gsm8k/4", "gsm8k/5"] and [i.gold for i in last] == [5, 2400]
    assert len(load_gsm8k(path, 10, from_end=True)) == 6


def test_chat_items_end_with_a_user_turn(tmp_path):
    from runtime.evaluation.tasks import DataError, load_chat
    path = tmp_path / "chat.jsonl"
    single = {"prompt": {"text": "Just one", "role": "prompter", "replies": [{"text": "ok", "role": "assistant"}]}}
    path.write_text(json.dumps(CHAT_TREE) + "\n" + json.dumps(single) + "\n")
    first, second = load_chat(path, 5)
    assert first.item_id == "chat/0" and first.task == "chat" and first.messages() == [
        {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a prime."}]  # three turns at most; the assistant's '7' is left out
    assert second.messages() == [{"role": "user", "content": "Just one"}]
    path.write_text(json.dumps(GSM8K[0]) + "\n")
    with pytest.raises(DataError, match="expected an OpenAssistant tree"):
        load_chat(path, 1)


@pytest.mark.parametrize("tree, message", [
    ({"prompt": {"text": "Hi", "role": "prompter", "replies": [{"text": "Hello"}]}}, "expected an OpenAssistant tree"),
    ({"prompt": {"text": "Hi", "role": "prompter", "replies": [{"text": None, "role": "assistant"}]}},
     "expected an OpenAssistant tree"),
    ({"prompt": {"text": "Hi", "role": "prompter", "replies": "Hello"}}, "expected an OpenAssistant tree"),
    ({"prompt": {"text": "Hi", "role": "bot"}}, "expected an OpenAssistant tree"),
    ({"prompt": {"text": "Hello", "role": "assistant"}}, "must start with a 'prompter' message"),
])
def test_malformed_chat_trees_give_one_error_line(bundle, tmp_path, capsys, tree, message):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(tree) + "\n")
    assert main([str(bundle), "--chat", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}:1: ") and message in err[0], err


def test_real_chat_trees_give_conversations_ending_with_a_user_turn(shared_data):
    from runtime.evaluation.tasks import load_chat
    items = load_chat(shared_data / "chat_multiturn" / "oasst_en_100_tree.jsonl", 10)
    assert len(items) == 10
    for turns in (item.messages() for item in items):
        assert turns[-1]["role"] == "user" and len(turns) in (1, 3)
        assert [t["role"] for t in turns] == ["user", "assistant", "user"][:len(turns)]
    assert any(len(item.messages()) == 3 for item in items)


def test_lookup_drafts_add_a_lossless_tau_one_row(bundle, data, tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps(CHAT_TREE) + "\n")
    out = tmp_path / "out"
    args = eval_args(bundle, data, out, "--chat", str(chat), "--taus", "1.0", "0.5", "--block-sizes", "4",
                     "--draft", "both", "--num-prompts", "1", "--from-end")
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    summary, records = results["summary"], results["records"]
    assert results["settings"]["draft"] == "both" and results["settings"]["from_end"] is True
    assert [(r["tau"], r["draft"]) for r in summary] == [(1.0, "masks"), (1.0, "both"), (0.5, "both")]
    assert sorted({r["item_id"] for r in records}) == ["Tiny/1", "chat/0", "gsm8k/1"]
    lossless = [r for r in records if (r["tau"], r["draft"]) == (1.0, "both")]
    assert len(lossless) == 3 and all(r["identical_to_ar"] for r in lossless)
    assert summary[0]["speedup_vs_ar"] == 1.0 and summary[0]["tpf"] == 1.0
    assert summary[0]["num_chat"] == 1 and summary[0]["gsm8k_accuracy"] is not None
    chat_record = next(r for r in records if r["task"] == "chat")
    assert "correct" not in chat_record and "passed" not in chat_record
    assert " both " in capsys.readouterr().out



@pytest.mark.parametrize("draft, expected", [
    ("masks", [(1.0, "masks", False), (0.5, "masks", False), (0.5, "masks", True)]),
    ("both", [(1.0, "masks", False), (1.0, "both", False), (1.0, "both", True), (0.5, "both", False),
              (0.5, "both", True)]),
])
def test_adaptive_masks_add_a_twin_after_each_run_that_feeds_masks(bundle, data, tmp_path, capsys, monkeypatch,
                                                                    draft, expected):
    """--adaptive-masks decodes each run that feeds masks again with adaptive masks, right after it (the runs
    as the decoder gets them), and adds rows marked adaptive_masks; without it nothing changes but the field."""
    decoded, generate = [], Decoder.generate
    monkeypatch.setattr(Decoder, "generate", lambda self, ids, params: decoded.append(params) or generate(
        self, ids, params))
    results, tables = {}, {}
    for adaptive in (False, True):
        out, decoded[:] = tmp_path / f"out-{adaptive}", []
        args = eval_args(bundle, data, out, "--taus", "1.0", "0.5", "--block-sizes", "4", "--draft", draft,
                         "--num-prompts", "1", *(["--adaptive-masks"] if adaptive else []))
        assert main(args) == 0
        results[adaptive] = json.loads((out / "results.json").read_text())
        tables[adaptive] = capsys.readouterr().out.split("\n\n")[0]  # the summary table
        runs = [run for run in expected if adaptive or not run[2]]
        assert [(p.tau, p.draft, p.adaptive_masks) for p in decoded] == 2 * runs  # per prompt; AR is the first
        summary = results[adaptive]["summary"]
        assert [(r["tau"], r["draft"], r["adaptive_masks"]) for r in summary] == runs
        assert results[adaptive]["settings"]["adaptive_masks"] is adaptive
        with (out / "summary.csv").open() as f:
            assert [r["adaptive_masks"] for r in csv.DictReader(f)] == [str(run[2]) for run in runs]
    plain, flagged = results[False]["records"], results[True]["records"]
    assert {tuple(r) for r in flagged} == {tuple(r) for r in plain} and all("adaptive_masks" in r for r in plain)
    twins = [r for r in flagged if r["adaptive_masks"]]
    assert len(twins) == 2 * sum(run[2] for run in expected)
    assert all(r["identical_to_ar"] for r in twins if r["tau"] >= 1.0)  # tau 1 with adaptive mask drafts: lossless
    same = ("tau", "draft", "item_id", "token_ids", "num_forwards", "identical_to_ar", "correct", "passed")
    assert [[r.get(k) for k in same] for r in flagged if not r["adaptive_masks"]] == [[r.get(k) for k in same]
                                                                                      for r in plain]
    assert f" {draft} adaptive " in tables[True] and "adaptive" not in tables[False]


def test_adaptive_masks_on_a_fixed_window_bundle_stop_before_any_decoding(bundle, data, tmp_path, capsys,
                                                                           monkeypatch):
    """A graph exported before 2026-11-30 takes only W-token steps, so adaptive masks could skip no mask: one error
    line naming that bundle and the re-export, before the first (good) bundle decodes anything."""
    old = fix_window(shutil.copytree(bundle, tmp_path / "old"), 4)
    decoded = []
    monkeypatch.setattr(Decoder, "generate", lambda self, ids, params: decoded.append(params))
    argv = [str(bundle), str(old), "--gsm8k", data[0], "--out", str(tmp_path / "out"), "--threads", "1"]
    assert main([*argv, "--adaptive-masks"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --adaptive-masks on {old}: adaptive masks cannot act")
    assert "re-export the bundle with mars-export" in err[0]
    assert decoded == [] and not (tmp_path / "out").exists()


def test_an_out_with_earlier_results_is_refused_unless_force(bundle, data, tmp_path, capsys, monkeypatch):
    """mars-eval --out DIR silently replaced the results of an earlier run in DIR. It refuses, before anything is
    loaded, naming the files and --force, and keeps them; other files in DIR are no obstacle."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "summary.csv").write_text("earlier")
    (out / "tpf_quality.png").write_text("earlier")
    with monkeypatch.context() as m:
        m.setattr("runtime.evaluation.cli.load_config", lambda *a: pytest.fail("a bundle was loaded"))
        assert main(eval_args(bundle, data, out)) == 2
    assert capsys.readouterr().err == (f"error: --out {out} already holds summary.csv, tpf_quality.png of an earlier "
                                       "run; choose another --out or pass --force to replace them\n")
    assert (out / "summary.csv").read_text() == "earlier" and not (out / "results.json").exists()
    assert main(eval_args(bundle, data, out, "--force")) == 0
    assert (out / "summary.csv").read_text() != "earlier" and (out / "results.json").is_file()
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_a_results_path_that_is_a_folder_is_refused_before_anything_is_loaded(bundle, data, tmp_path, capsys,
                                                                                 monkeypatch, force):
    """OUT/results.json a folder: --force ran the whole evaluation, then failed writing it (IsADirectoryError).
    A folder cannot be replaced by a results file: one line at the start, the folder kept as it was."""
    out = tmp_path / "out"
    (out / "results.json").mkdir(parents=True)
    (out / "results.json" / "mine.txt").write_text("mine")
    monkeypatch.setattr("runtime.evaluation.cli.load_config", lambda *a: pytest.fail("a bundle was loaded"))
    assert main(eval_args(bundle, data, out, *force)) == 2
    assert capsys.readouterr().err == (f"error: --out {out}: {out / 'results.json'} is a folder, where this run "
                                       "writes a file, and --force replaces only files; move it away or choose "
                                       "another --out\n")
    assert os.listdir(out) == ["results.json"] and os.listdir(out / "results.json") == ["mine.txt"]

"""runtime.command_line: run_main's exit status and error line, the path types of the scripts' parsers, and the
options named in a setting's error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.bundle import BundleError
from runtime.command_line import (ArgumentParser, UsageError, check_results_folder, existing_file, existing_folder,
                                  how_it_ended,
                                  make_engine_int_value, make_taus_value, naming_options, run_main, tau_value,
                                  threads_value)
from runtime.decode.admission import SettingError
from runtime.decode.params import ParamError
from runtime.evaluation.tasks import DataError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("error", [UsageError("bad --x"), BundleError("/p is not a MARS bundle"),
                                   DataError("f.jsonl is no JSON")], ids=["usage", "bundle", "data"])
def test_run_main_reports_an_input_error_in_one_line_with_status_2(error, capsys):
    """A bad path or value named on the command line is the user's to fix: one 'error:' line, exit status 2,
    as a bad command line (a BundleError used to end the scripts in a traceback, status 1)."""
    def main():
        raise error
    assert run_main(main) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {error}\n"


def test_run_main_returns_mains_status_and_keeps_other_errors_traceback():
    assert run_main(lambda: None) == 0 and run_main(lambda: 3) == 3 and run_main(lambda: {"rows": []}) == 0
    def broken():
        raise KeyError("a bug")
    with pytest.raises(KeyError):  # not an input error: the traceback stays
        run_main(broken)


def test_run_main_needs_nothing_but_the_standard_library():
    """bench/peers.py runs in the peer engines' venvs, which lack numpy and the project's dependencies: run_main
    reports a BundleError there too."""
    code = "\n".join([
        "import sys",
        "sys.modules.update(dict.fromkeys(['numpy', 'onnx', 'onnxruntime', 'tokenizers', 'jinja2']))  # absent",
        "from runtime.bundle import BundleError",
        "from runtime.command_line import run_main",
        "def main():",
        "    raise BundleError('x is not a MARS bundle')",
        "sys.exit(run_main(main))"])
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "error: x is not a MARS bundle\n")


def test_path_types_name_a_missing_path_and_the_wrong_kind(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    p = ArgumentParser()
    p.add_argument("--file", type=existing_file)
    p.add_argument("--folder", type=existing_folder)
    assert p.parse_args(["--file", str(tmp_path / "f.txt"), "--folder", str(tmp_path)]).file == tmp_path / "f.txt"
    for args, message in [(["--file", str(tmp_path / "no")], f"argument --file: {tmp_path / 'no'} does not exist"),
                          (["--file", str(tmp_path)], f"argument --file: {tmp_path} is a folder; give a file"),
                          (["--folder", str(tmp_path / "f.txt")], "is a file; give a folder"),
                          (["--folder", str(tmp_path / "no")], "does not exist; give an existing folder")]:
        with pytest.raises(UsageError, match=message.replace(".", r"\.")):
            p.parse_args(args)


def test_naming_options_names_the_option_of_the_settings_field():
    """The option comes from the error's ``setting`` field, not from its words: a plain ValueError whose message
    begins with a setting's name passes unchanged (it used to be rewritten), and so does a setting no option sets."""
    options = {"max_batch_size": "--max-batch-size"}
    with pytest.raises(SettingError) as caught, naming_options(options):
        raise SettingError("max_batch_size", "must be >= 1, got 0")
    assert str(caught.value) == "max_batch_size (--max-batch-size) must be >= 1, got 0"
    assert (caught.value.setting, caught.value.option) == ("max_batch_size", "--max-batch-size")
    for error in (ValueError("max_batch_size must be >= 1, got 0"), SettingError("prefill_chunk", "must be >= 0")):
        with pytest.raises(ValueError) as caught, naming_options(options):
            raise error
        assert caught.value is error


def test_naming_options_names_the_option_of_a_request_field():
    """A request parameter's error (ParamError, by its ``field``) names the option as a setting's does: after the
    field where the message begins with it, else before the message; a field no option sets passes unchanged."""
    options = {"top_p": "--top-p", "mode": "--mode"}
    with pytest.raises(ParamError) as caught, naming_options(options):
        raise ParamError("top_p", "top_p must be in (0, 1], got 0")
    assert str(caught.value) == "top_p (--top-p) must be in (0, 1], got 0" and caught.value.field == "top_p"
    with pytest.raises(ParamError) as caught, naming_options(options):
        raise ParamError("mode", "verify mode is greedy only")
    assert str(caught.value) == "--mode: verify mode is greedy only"
    error = ParamError("seed", "seed must be an integer >= 0")
    with pytest.raises(ParamError) as caught, naming_options(options):
        raise error
    assert caught.value is error


def test_the_decode_package_summary_names_the_home_of_setting_errors():
    """runtime/decode/__init__.py summarises each module: admission's line named its checks, not SettingError,
    which every engine and backend setting error is (the one home a reader looks for)."""
    import runtime.decode
    line = next(line for line in runtime.decode.__doc__.splitlines() if line.strip().startswith("admission"))
    assert "SettingError" in line


RULE = "tau must be a finite number >= 0, got {}; tau >= 1 means one token per step (greedy AR)"


@pytest.mark.parametrize("text, message", [
    ("0.9,abc", RULE.format("0.9,abc") + "; separate taus by spaces (--taus 0.9 0.8)"),
    *((text, RULE.format(text)) for text in ("-0.5", "-1", "nan", "inf", "abc")),
    ("", RULE.format("''")), (" ", RULE.format("' '"))])
def test_tau_value_refuses_in_the_words_of_the_one_rule_on_tau(text, message):
    """The scripts' --tau/--taus took any float (a comma list was 'invalid float value', a negative or nan tau ran
    until the decoder refused it, or not at all): tau_value applies check_tau, the runtime's one rule. The value is
    named as typed: '-1' said 'got -1.0', and an empty one 'got ;'."""
    p = ArgumentParser()
    p.add_argument("--taus", type=make_taus_value("--taus"), nargs="+")
    assert p.parse_args(["--taus", "0", "0.9", "1", "1.5"]).taus == [0.0, 0.9, 1.0, 1.5]
    with pytest.raises(UsageError) as caught:
        p.parse_args(["--taus", "0.9", text])
    assert str(caught.value) == f"argument --taus: {message}"


@pytest.mark.parametrize("option, nargs", [("--tau", None), ("--tau", "+"), ("--taus", "+")])
def test_the_comma_hint_names_the_option_and_only_where_several_taus_are_allowed(option, nargs):
    """'--tau 0.9,abc' said 'separate taus by spaces (--taus 0.9 0.8)' in scripts that take one --tau (and so no
    taus to separate), and named --taus where the option of several is --tau (samples/demo.py)."""
    p = ArgumentParser()
    p.add_argument(option, type=tau_value if nargs is None else make_taus_value(option), nargs=nargs)
    with pytest.raises(UsageError) as caught:
        p.parse_args([option, "0.9,abc"])
    hint = "" if nargs is None else f"; separate taus by spaces ({option} 0.9 0.8)"
    assert str(caught.value) == f"argument {option}: {RULE.format('0.9,abc')}{hint}"


def test_threads_value_refuses_in_the_words_of_the_backends_rule():
    """--threads took any int: 300 or -1 ran until OnnxBackend refused it, after the bundle (and mars-eval's items)
    loaded. threads_value applies the backend's rule (check_num_threads) as the command line is parsed."""
    p = ArgumentParser()
    p.add_argument("--threads", type=threads_value)
    assert [p.parse_args(["--threads", t]).threads for t in ("0", "1", "256")] == [0, 1, 256]
    for text, message in [("300", "must be in 0..256 (0 lets onnxruntime choose), got 300"),
                          ("-1", "must be in 0..256 (0 lets onnxruntime choose), got -1"),
                          ("two", "invalid int value: 'two'")]:
        with pytest.raises(UsageError, match=re.escape(f"argument --threads: {message}")):
            p.parse_args(["--threads", text])



def test_make_engine_int_value_refuses_in_the_words_of_the_engines_rule():
    """python -m runtime.serve's --max-batch-size and --max-seq-len are refused at parsing by EngineConfig's own
    rule; the option type lives beside threads_value, the command line's other types (it was serve's own)."""
    p = ArgumentParser()
    p.add_argument("--max-batch-size", type=make_engine_int_value("max_batch_size"))
    p.add_argument("--max-seq-len", type=make_engine_int_value("max_seq_len"))
    assert p.parse_args(["--max-batch-size", "4", "--max-seq-len", "2"]).max_batch_size == 4
    for options, message in [(["--max-batch-size", "0"], "argument --max-batch-size: must be >= 1, got 0"),
                             (["--max-seq-len", "1"], "argument --max-seq-len: must be >= 2, got 1"),
                             (["--max-seq-len", "two"], "argument --max-seq-len: invalid int value: 'two'")]:
        with pytest.raises(UsageError) as caught:
            p.parse_args(options)
        assert str(caught.value) == message

MEMORY = [sys.executable, "-m", "runtime.memory", "samples/jetson/configs/qwen2.5-7b-instruct", "--batch",
          *map(str, range(1, 200)), "--context", "512", "1024", "2048"]  # a report longer than a pipe's buffer
PRINTS = [sys.executable, "-c", "import sys\nfrom runtime.command_line import run_main\n"
          "sys.exit(run_main(lambda: print('line\\n' * 100000)))"]


@pytest.mark.parametrize("command", [MEMORY, PRINTS], ids=["memory", "run_main"])
def test_a_closed_stdout_ends_a_command_quietly(command):
    """'python -m runtime.memory ... | head -1' ended in a BrokenPipeError traceback: run_main, which the runtime's
    commands and the scripts run through, stops quietly with status 1 (the Python docs' 'Note on SIGPIPE')."""
    reader, writer = os.pipe()
    os.close(reader)  # the reader has gone, as head's after its first line
    done = subprocess.run(command, cwd=ROOT, stdout=writer, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(writer)
    assert (done.returncode, done.stderr) == (1, "")


def test_how_it_ended_reads_both_conventions():
    """subprocess's negative return code and a shell's 128 + N both name the signal; a shell status over 128 that is
    no signal, and any other code, are the exit status (one rule for bench/peers.py and samples/c/mars_c.py)."""
    assert [how_it_ended(code) for code in (0, 1, -11, -200)] == [
        "exit status 0", "exit status 1", "killed by signal 11 (SIGSEGV)", "killed by signal 200"]
    assert [how_it_ended(status, shell=True) for status in (139, 137, 1, 128, 255)] == [
        "killed by signal 11 (SIGSEGV)", "killed by signal 9 (SIGKILL)", "exit status 1", "exit status 128",
        "exit status 255"]


def test_a_results_folder_under_a_link_to_nowhere_or_with_a_linked_result_is_refused(tmp_path):
    """--out LINK/sub, LINK to nowhere, passed (the check climbed to the nearest folder that exists) and the run
    ended in a FileExistsError traceback; a result's path that is a link was written through, out of --out (with a
    link to nowhere even without --force)."""
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UsageError, match=f"lies under {tmp_path / 'gone'}, a symbolic link to .*nowhere, which does "
                                         "not exist"):
        check_results_folder(tmp_path / "gone" / "sub", ["r.json"], force=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "r.json").symlink_to(tmp_path / "elsewhere.json")
    for force in (False, True):
        with pytest.raises(UsageError, match="r.json is a symbolic link, which this run would write through"):
            check_results_folder(out, ["r.json"], force=force)

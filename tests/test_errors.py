"""Bad bundles, bad arguments and failed exports give one clear error line and lose nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mars_export import bundle_writer
from mars_export.parity import ParityError
from mars_export import cli as export_cli
from runtime import generate

from support import declare_old_kv_outputs, export, fix_window


@pytest.fixture
def bundle(tiny_bundle, tmp_path):
    """A private copy of a tiny bundle that a test may damage."""
    _, original = tiny_bundle("llama", 4)
    return shutil.copytree(original, tmp_path / "bundle")


def error_lines(capsys) -> list[str]:
    """stderr lines that report an error (progress bars of model loading may precede them)."""
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error")]
    assert not errors or lines[-1] == errors[-1], "the error must be the last line"
    return errors


def set_config(bundle, **changes):
    """Rewrite fields of the bundle's config; a value of None removes the field."""
    path = bundle / "mars_config.json"
    raw = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))


def bump_config(bundle, name, by):
    """Add ``by`` to the integer field ``name`` of the bundle's config."""
    set_config(bundle, **{name: json.loads((bundle / "mars_config.json").read_text())[name] + by})


def null_config(bundle, name):
    """Set the field ``name`` of the bundle's config to JSON null."""
    path = bundle / "mars_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), name: None}))


def run_generate(bundle, capsys, *extra):
    code = generate.main([str(bundle), "--prompt", "hello", "--max-new-tokens", "4", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def test_valid_bundle_generates(bundle, capsys):
    code, out, err = run_generate(bundle, capsys, "--json", "--tau", "1.5")
    assert code == 0 and err == []
    result = json.loads(out)
    assert result["num_tokens"] == len(result["token_ids"]) == 4 and result["tpf"] == 1.0


def test_verify_with_lookup_drafts_prints_the_greedy_ids(bundle, capsys):
    greedy = json.loads(run_generate(bundle, capsys, "--json", "--max-new-tokens", "24")[1])
    code, out, _ = run_generate(bundle, capsys, "--json", "--max-new-tokens", "24", "--mode", "verify",
                                "--draft", "both")
    assert code == 0 and json.loads(out)["token_ids"] == greedy["token_ids"]


@pytest.mark.parametrize("damage, message", [
    (lambda b: (b / "model.onnx").write_bytes(b"\x08\x07garbage" * 100), "corrupt or truncated"),
    (lambda b: (b / "model.onnx").write_bytes((b / "model.onnx").read_bytes()[:50_000]), "corrupt or truncated"),
    (lambda b: (b / "model.onnx").write_bytes(b""), "corrupt or truncated"),
    (lambda b: (b / "model.onnx").unlink(), "model.onnx not found"),
    (lambda b: set_config(b, mask_token_id=999999), "mask_token_id 999999 is outside the vocabulary"),
    (lambda b: set_config(fix_window(b, 4), window=16, block_size=4),
     "has a window of 4 tokens but mars_config.json says 16"),
    (lambda b: set_config(b, format_version="1"), "format version '1' is not supported"),
    (lambda b: set_config(b, num_layers=None), "mars_config.json has missing fields ['num_layers']; re-export"),
    (lambda b: set_config(b, colour="red"), "mars_config.json has unknown fields ['colour']; re-export"),
    (lambda b: set_config(b, num_layers=None, colour="red"),
     "mars_config.json has missing fields ['num_layers'] and unknown fields ['colour']; re-export"),
    (lambda b: (b / "tokenizer.json").unlink(), "tokenizer.json not found"),
    (lambda b: (b / "mars_config.json").unlink(), "is not a MARS bundle"),
    (lambda b: (b / "mars_config.json").write_text("{not json"), "is not valid JSON"),
    (lambda b: (b / "mars_config.json").write_text('{"parity": ' + "[" * 100000),  # was a RecursionError traceback
     "mars_config.json is not valid JSON (maximum recursion depth exceeded"),
    (lambda b: (b / "mars_config.json").write_bytes(b"\xff\xfe{"), "mars_config.json is not UTF-8 text"),
    (declare_old_kv_outputs, "older step graph that outputs only the window's new KV entries"),
    (lambda b: (b / "mars_config.json").write_text(
        (b / "mars_config.json").read_text().replace('"format_version": 1', '"format_version": 99')),
     "format version 99 is not supported"),
    # the config disagreeing with the graph: refused at load, not at the first forward
    (lambda b: bump_config(b, "num_kv_heads", 1), "model.onnx has num_kv_heads"),
    (lambda b: bump_config(b, "head_dim", 8), "model.onnx has head_dim"),
    (lambda b: bump_config(b, "vocab_size", 100), "model.onnx has vocab_size"),
    (lambda b: set_config(b, dtype="float16"), "holds its KV cache as tensor(float) but mars_config.json says "
                                                "dtype float16"),
    # fields of the wrong JSON type
    (lambda b: set_config(b, block_size=4.0), "block_size must be an integer, got 4.0"),
    (lambda b: set_config(b, num_layers=True), "num_layers must be an integer, got True"),
    (lambda b: null_config(b, "onnx_file"), "onnx_file must be a string, got None"),
    (lambda b: set_config(b, eos_token_ids=[2.5]), "eos_token_ids must be a list of integers"),
])
def test_damaged_bundle_gives_one_clear_line(bundle, capsys, damage, message):
    damage(bundle)
    code, _, err = run_generate(bundle, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0]


@pytest.mark.parametrize("make, why", [(lambda p: None, "it does not exist"),
                                       (lambda p: p.write_text("x"), "it is a file"),
                                       (lambda p: (p.mkdir(), (p / "notes.txt").write_text("x")),
                                        "it holds no mars_config.json")], ids=["missing", "file", "folder"])
def test_the_tokenizer_of_a_path_that_is_no_bundle_says_so(tmp_path, make, why):
    """A path that is no bundle at all is named as such, as load_config names it (the scripts that read the
    tokenizer first said 'the bundle lacks its tokenizer; re-export it'); a bundle without tokenizer.json still
    says that."""
    from runtime.bundle import BundleError
    from runtime.text.tokenizer import Tokenizer
    path = tmp_path / "mine"
    make(path)
    with pytest.raises(BundleError, match=f"{path} is not a MARS bundle: {why}; a MARS bundle is the folder"):
        Tokenizer(path)


def test_a_bundle_without_its_tokenizer_says_so(bundle):
    from runtime.bundle import BundleError
    from runtime.text.tokenizer import Tokenizer
    (bundle / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="tokenizer.json not found: the bundle lacks its tokenizer"):
        Tokenizer(bundle)


def test_an_unreadable_config_gives_one_clear_line(bundle, capsys, monkeypatch):
    """An OSError reading mars_config.json (no permission: root reads anything, so the read is made to fail) is one
    error line naming the file, not a traceback."""
    read_bytes = Path.read_bytes

    def refuse(path):
        if path.name == "mars_config.json":
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)
    monkeypatch.setattr(Path, "read_bytes", refuse)
    code, _, err = run_generate(bundle, capsys)
    assert code == 2 and len(err) == 1 and "cannot read" in err[0] and "mars_config.json (Permission denied)" in err[0]


def test_an_onnxruntime_without_8_bit_matmulnbits_is_named_with_the_version_to_install(bundle, capsys, monkeypatch):
    """onnxruntime before 1.22 (the declared floor; a Jetson wheel installed by hand may be older) refuses 8-bit
    MatMulNBits (int8 exports, the greedy head of float32 bundles) with this message at load; the error names
    the version that runs it, not a corrupt file."""
    import onnxruntime as ort
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    def refuse(*args, **kwargs):  # the message onnxruntime 1.21.0 gives (its matmul_nbits.cc)
        raise ort_state.RuntimeException(
            "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exception during initialization: matmul_nbits.cc:114 "
            "onnxruntime::contrib::MatMulNBits<T1>::MatMulNBits(const onnxruntime::OpKernelInfo&) [with T1 = float] "
            "nbits_ == 4 was false. Only 4b quantization is supported for MatMulNBits op, additional bits support is planned.")
    monkeypatch.setattr(ort, "InferenceSession", refuse)
    code, _, err = run_generate(bundle, capsys)
    assert code == 2 and len(err) == 1 and "8-bit MatMulNBits" in err[0] and "onnxruntime>=1.22" in err[0]


@pytest.mark.parametrize("tau, message", [("-0.5", "tau must be a finite number >= 0"), ("nan", "tau must be a finite number >= 0"), ("inf", "tau must be a finite number >= 0")])
def test_bad_tau(bundle, capsys, monkeypatch, tau, message):
    """--tau was a plain float, refused by DecodeParams after parsing: it is parsed by tau_value (check_tau)."""
    monkeypatch.setattr("runtime.generate.load_config", lambda *a: pytest.fail("the bundle was loaded"))
    code, _, err = run_generate(bundle, capsys, "--tau", tau)
    assert code == 2 and len(err) == 1 and f"error: argument --tau: {message}" in err[0]


@pytest.mark.parametrize("extra, message", [
    # the backend's rule on threads, applied as the command line is parsed (runtime.command_line.threads_value)
    (["--threads", "-1"], "error: argument --threads: must be in 0..256 (0 lets onnxruntime choose), got -1"),
    (["--threads", "300"], "error: argument --threads: must be in 0..256 (0 lets onnxruntime choose), got 300"),
    (["--prompt", "bad \udcff bytes"], "the prompt is not valid UTF-8"),
    (["--mode", "ar", "--draft", "lookup"], "draft 'lookup' needs mode 'verify' or 'threshold'"),
    (["--draft", "both", "--temperature", "0.7"], "draft 'both' is greedy only"),
    (["--temperature", "2.5"], "temperature (--temperature) must be a number in 0..2 (0 = greedy)"),  # the server's
    # a bad command line: argparse's usage block and 'python -m runtime.generate: error: ...' before
    (["--tau", "abc"], "error: argument --tau: tau must be a finite number >= 0, got abc"),  # check_tau's words
    (["--mode", "fast"], "error: argument --mode: invalid choice: 'fast'"),
    (["--bogus"], "error: unrecognized arguments: --bogus"),
])
def test_bad_runtime_arguments(bundle, capsys, extra, message):
    code, _, err = run_generate(bundle, capsys, *extra)
    assert code == 2 and len(err) == 1 and message in err[0]


def test_broken_chat_template(bundle, capsys):
    (bundle / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    code, _, err = run_generate(bundle, capsys, "--chat")
    assert code == 2 and len(err) == 1 and "chat template failed" in err[0]


def test_prompt_beyond_context(bundle, capsys):
    code, _, err = run_generate(bundle, capsys, "--max-new-tokens", "100000")
    assert code == 2 and len(err) == 1 and "exceeds the 512 positions a slot can hold" in err[0]


def test_failed_export_leaves_nothing(tiny_bundle, tmp_path, monkeypatch, capsys):
    ckpt, _ = tiny_bundle("llama", 4)

    def failing_parity(*args, **kwargs):
        raise ParityError("parity check failed: injected")
    monkeypatch.setattr(bundle_writer, "check_parity", failing_parity)
    out = tmp_path / "out" / "bundle"
    code = export_cli.main([str(ckpt), "-o", str(out), "--block", "4", "--mask-token", "<mask>"])
    err = error_lines(capsys)
    assert code == 2 and err == ["error: parity check failed: injected"]
    assert list(tmp_path.iterdir()) == []  # no bundle, no partial directory, not the out/ folder the export made


def test_existing_output_is_kept(tiny_bundle, tmp_path, capsys):
    ckpt, _ = tiny_bundle("llama", 4)
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code = export_cli.main([str(ckpt), "-o", str(out), "--block", "4", "--mask-token", "<mask>"])
    err = error_lines(capsys)
    assert code == 2 and len(err) == 1 and "--force" in err[0]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("args, message", [
    (["--block", "8", "--window", "4"], "need 1 <= --block <= --window"),
    (["--block", "4", "--window", "100000", "--mask-token", "<mask>"], "error: --window 100000 must be smaller than "
                                                                       "the model's context"),
    (["--block", "100000", "--mask-token", "<mask>"], "error: --block 100000 (the window W defaults to B) must be "
                                                      "smaller than the model's context"),  # no --window was given
    (["--block", "0"], "need 1 <= --block <= --window"),
    (["--block", "4", "--parity-tol", "-1"], "--parity-tol must be a number >= 0"),
    (["--block", "4", "--parity-tol", "nan"], "--parity-tol must be a number >= 0"),
    (["--block", "4"], "no MARS mask token is recorded"),
    (["--block", "4", "--mask-token", "<|im_end|>"], "is the bos/eos/pad token"),
])
def test_export_argument_errors(tiny_bundle, tmp_path, capsys, args, message):
    ckpt, _ = tiny_bundle("llama", 4)
    code = export_cli.main([str(ckpt), "-o", str(tmp_path / "b"), *args])
    err = error_lines(capsys)
    assert code == 2 and len(err) == 1 and message in err[0]
    assert not (tmp_path / "b").exists()


def test_a_window_set_by_a_recorded_block_size_is_named_by_it(tiny_bundle, tmp_path, capsys):
    """Neither --block nor --window given: the block size from the directory name (blkN) sets the window, and the
    message says so, naming --block to lower it."""
    ckpt = shutil.copytree(tiny_bundle("llama", 4)[0], tmp_path / "tiny-blk100000")
    code = export_cli.main([str(ckpt), "-o", str(tmp_path / "b"), "--mask-token", "<mask>"])
    err = error_lines(capsys)
    assert code == 2 and len(err) == 1 and not (tmp_path / "b").exists()
    assert err[0].startswith("error: the block size 100000 (from the directory name; the window W defaults to B) must "
                             "be smaller than the model's context") and err[0].endswith("use --block 507 or less"), err


@pytest.mark.parametrize("args, message", [
    (["-o", "b", "--block", "abc"], "argument --block: invalid int value: 'abc'"),
    (["-o", "b", "--graph", "nope"], "argument --graph: invalid choice: 'nope'"),
    (["-o", "b", "--bogus"], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: -o/--output")])
def test_a_bad_command_line_is_one_error_line_as_mars_train_says_it(tmp_path, monkeypatch, capsys, args, message):
    """argparse's refusals printed its usage block before 'mars-export: error: ...'; every other refusal (a flag
    combination, the output, the model) is one 'error:' line: so are these now (runtime.command_line)."""
    monkeypatch.chdir(tmp_path)
    assert export_cli.main(["model", *args]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {message}"), line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "m.gguf").write_bytes(b"GGUF\n"), "cannot read model"),
    (lambda d: (d / "config.json").write_text("{not json"), "cannot read model"),
])
def test_unreadable_model_files(tmp_path, capsys, make, message):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    make(model_dir)
    target = next(model_dir.iterdir())
    code = export_cli.main([str(target if target.suffix == ".gguf" else model_dir), "-o", str(tmp_path / "b"),
                            "--block", "4"])
    err = error_lines(capsys)
    assert code == 2 and len(err) == 1 and message in err[0]
    assert not (tmp_path / "b").exists()


def test_unknown_model_path(tmp_path, capsys):
    code = export_cli.main([str(tmp_path / "nothing"), "-o", str(tmp_path / "b")])
    err = error_lines(capsys)
    assert code == 2 and len(err) == 1 and "no such file or directory" in err[0]


def test_force_replaces_existing_bundle(tiny_bundle, tmp_path):
    ckpt, _ = tiny_bundle("llama", 4)
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "mars_config.json").write_text("{}")  # an older bundle: --force replaces bundles only
    (out / "stale.txt").write_text("old")
    export(str(ckpt), out, 4, 4, "--mask-token", "<mask>", "--force")
    assert not (out / "stale.txt").exists() and (out / "mars_config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


def test_step_inputs_that_do_not_fit_name_the_problem(bundle):
    """The step writes each new KV entry at its position into the past it is handed: inputs that do not fit get
    a ValueError naming the problem (no onnxruntime error, no mask silently broadcast, no write into a read-only
    array), and a failed bind leaves the next valid step working."""
    import numpy as np

    from runtime.backends.onnx import OnnxBackend
    from runtime.bundle import load_config
    from runtime.decode.batch import scratch_past, window_mask

    config = load_config(bundle)
    backend = OnnxBackend(bundle, config)
    ids, positions = np.array([[5, 6, 7, 8]]), np.arange(2, 6)[None]

    def past(capacity: int = 8):
        return scratch_past(config.num_layers, 1, config.num_kv_heads, capacity, config.head_dim, np.float32)

    mask = window_mask(np.array([2]), 8, 4)
    with pytest.raises(ValueError, match="positions 2..5 do not fit a past of 4 positions"):
        backend.step(ids, positions, window_mask(np.array([2]), 4, 4), past(4))
    with pytest.raises(ValueError, match=r"attention_mask \(1, 1, 4, 1\) for a past of 8 positions"):
        backend.step(ids, positions, mask[..., :1], past())
    with pytest.raises(ValueError, match="the past has 3 layers but the model has 2"):
        backend.step(ids, positions, mask, past() + past()[:1])
    read_only = past()
    read_only[1][0].flags.writeable = False
    with pytest.raises(ValueError, match="C-contiguous, writeable arrays"):
        backend.step(ids, positions, mask, read_only)
    kept = past()
    expected, _ = backend.step(ids, positions, mask, kept)
    broken = past()
    broken[1] = (broken[1][0], broken[1][1].astype(np.complex64))  # onnxruntime refuses it halfway through binding
    with pytest.raises(Exception):
        backend.step(ids, positions, mask, broken)
    assert np.array_equal(backend.step(ids, positions, mask, kept)[0], expected)  # bound again, whole
    kept[0][1].flags.writeable = False  # the very arrays bound last, made read-only: still refused
    with pytest.raises(ValueError, match="C-contiguous, writeable arrays"):
        backend.step(ids, positions, mask, kept)


def test_a_raw_prompt_the_model_ends_at_once_gets_a_note_naming_chat(bundle, capsys):
    # the tiny model's first greedy token made its end token: it stops at once, as an instruct model does on raw text
    first = json.loads(run_generate(bundle, capsys, "--json")[1])["token_ids"][0]
    set_config(bundle, eos_token_ids=[first])
    code, _, err = run_generate(bundle, capsys)
    assert code == 0 and len(err) == 1 and err[0].startswith("note: the model ended at once") and "add --chat" in err[0]
    code, _, err = run_generate(bundle, capsys, "--chat")  # asked for the chat: no note, whatever it answers
    assert code == 0 and not any(line.startswith("note:") for line in err)


def test_a_raw_prompt_that_gets_an_answer_gets_no_note(bundle, capsys):
    code, out, err = run_generate(bundle, capsys)
    assert code == 0 and out.strip() and not any(line.startswith("note:") for line in err)

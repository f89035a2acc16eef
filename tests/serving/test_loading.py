"""Tier 2: ``load_backend`` and ``python -m runtime.serve`` accept the paths a user may give."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import pytest

from runtime.backends.loading import load_backend
from runtime.backends.onnx import OnnxBackend
from runtime import generate
from runtime.bundle import BundleError, load_config
from runtime.serve import API_KEY_ENV, STARTUP_FAILURE, check_can_listen, main, parse_args, server_settings


def test_bundle_dir_and_its_onnx_file(tiny_bundle):
    _, bundle = tiny_bundle("llama", 4)
    for path in (bundle, bundle / "model.onnx"):
        backend, config, bundle_dir = load_backend(path)
        assert isinstance(backend, OnnxBackend) and bundle_dir == bundle and config.window == 4


def test_engine_plan_without_tensorrt_is_a_clear_error(tiny_bundle, tmp_path, monkeypatch):
    _, bundle = tiny_bundle("llama", 4)
    copy = shutil.copytree(bundle, tmp_path / "bundle")
    (copy / "engine.plan").write_bytes(b"not an engine")
    with pytest.raises(ValueError, match="TensorRT"):  # not installed here; elsewhere: not an engine
        load_backend(copy / "engine.plan")
    monkeypatch.setitem(sys.modules, "runtime.backends.trt", None)  # as in an install without the module
    with pytest.raises(ValueError, match="needs TensorRT"):
        load_backend(copy / "engine.plan")


@pytest.mark.parametrize("name", ["missing", "mars_config.json", "other.onnx", "engine.plan"])
def test_other_paths_are_refused(tiny_bundle, name):
    _, bundle = tiny_bundle("llama", 4)
    path = bundle / name
    if name == "other.onnx":
        path = bundle.parent / "other" / "other.onnx"
        path.parent.mkdir(exist_ok=True)
        shutil.copy(bundle / "mars_config.json", path.parent)
        path.write_bytes(b"")
    with pytest.raises(BundleError):
        load_backend(path)


def test_a_path_that_is_no_bundle_is_named_with_what_a_bundle_is(tmp_path, capsys, monkeypatch):
    """``python -m runtime.serve README.md`` said ". is not a MARS bundle": the folder of the file, not the path
    given. Each message names the path given and says what a bundle is and how to make one."""
    monkeypatch.chdir(tmp_path)
    Path("README.md").write_text("# notes")
    Path("model.onnx").write_bytes(b"")
    Path("folder").mkdir()
    what = "a MARS bundle is the folder mars-export writes (mars_config.json, the ONNX graph, the tokenizer files); " \
           "make one with 'mars-export MODEL -o DIR'"
    paths = "give a bundle directory, its .onnx file or its engine.plan"
    for path, start in (("README.md", f"README.md is a file, not a MARS bundle: {paths}; "),
                        ("model.onnx", f"model.onnx is not in a MARS bundle: its folder . holds no mars_config.json; "
                                       f"{paths}; "),
                        ("folder", "folder is not a MARS bundle: it holds no mars_config.json; ")):
        assert main([path]) == 2
        assert capsys.readouterr().err == f"error: {start}{what}\n"
    for path, why in (("README.md", "it is a file"), ("gone", "it does not exist")):  # generate, mars-eval, ...
        with pytest.raises(BundleError) as refused:
            load_config(path)
        assert str(refused.value) == f"{path} is not a MARS bundle: {why}; {what}"


def test_serve_cli_reports_errors_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert main([str(tmp_path), "--tau", "0.5", "--tau-min", "0.9"]) == 2
    assert "--tau-min" in capsys.readouterr().err
    assert main([str(tmp_path), "--max-tokens-limit", "64", "--default-max-tokens", "128"]) == 2
    err = capsys.readouterr().err
    assert "--default-max-tokens" in err and "--max-tokens-limit" in err and err.count("\n") == 1
    for queues in (["--queue-low", "5", "--queue-high", "2"], ["--queue-low", "-1"]):  # named in the policy's words
        assert main([str(tmp_path), *queues]) == 2
        err = capsys.readouterr().err
        assert "need 0 <= queue_low (--queue-low) < queue_high (--queue-high), got " in err and err.count("\n") == 1
    for flag in ("--max-body-bytes", "--max-prompt-tokens", "--max-tokens-limit", "--default-max-tokens"):
        assert main([str(tmp_path), flag, "0"]) == 2  # each limit's error names the option to change
        err = capsys.readouterr().err
        assert f"({flag}) must be >= 1, got 0" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("options, message", [
    (["--max-prompt-tokens", "100000"],
     "error: max_prompt_tokens (--max-prompt-tokens) 100000 exceeds the {longest} tokens a prompt can have (the "
     "{context} positions a slot holds, --max-seq-len, less the window 4 and one token to generate); give at most "
     "{longest}\n"),
    (["--max-seq-len", "64", "--max-prompt-tokens", "60"], "error: max_prompt_tokens (--max-prompt-tokens) 60 exceeds "
                                                           "the 59 tokens a prompt can have (the 64 positions"),
    (["--max-seq-len", "100000"], "error: max_seq_len (--max-seq-len) 100000 exceeds the {context} positions a slot "
                                  "can hold (the model's max context); give at most {context}\n"),
    (["--threads", "-1"], "error: argument --threads: must be in 0..256 (0 lets onnxruntime choose), got -1\n"),
    (["--max-seq-len", "5"], "error: max_seq_len (--max-seq-len) 5 leaves no room for a request: a slot holds a prompt "
                             "of at least 1 token, 1 token to generate and the window of a decode step (4); give at "
                             "least 6\n"),
    (["--max-seq-len", "2"], "error: max_seq_len (--max-seq-len) 2 leaves no room for a request"),
    (["--max-seq-len", "5", "--max-prompt-tokens", "3"], "error: max_seq_len (--max-seq-len) 5 leaves no room")],
    ids=["prompt-beyond-context", "prompt-beyond-max-seq-len", "max-seq-len", "threads", "max-seq-len-below-window",
         "max-seq-len-2", "max-seq-len-before-max-prompt-tokens"])
def test_an_engine_option_out_of_range_is_one_line_naming_the_option(tiny_bundle, monkeypatch, capsys, options,
                                                                     message):
    """--max-prompt-tokens past the context was accepted silently (every longer prompt then got the context's 400),
    while --max-seq-len past it was refused: it is refused as that one is. The engine's and the backend's errors
    (max_batch_size, num_threads) named their settings, not the options: they name both, as the limits' errors do."""
    _, bundle = tiny_bundle("llama", 4)
    context = load_config(bundle).max_context
    capsys.readouterr()  # the bundle's export output, if it was made now
    monkeypatch.setattr("runtime.serve.make_server", lambda *a: pytest.fail("the options were accepted"))
    assert main([str(bundle), "--port", "0", *options]) == 2
    err = capsys.readouterr().err
    assert message.format(longest=context - 4 - 1, context=context) in err and err.count("\n") == 1, err


@pytest.mark.parametrize("options, message", [
    (["--tau", "1.5"], "argument --tau: must be a number in 0..1 (tau 1 is greedy AR, one token per step; a larger "
                       "tau decodes the same), got 1.5"),
    (["--tau", "-1"], "argument --tau: must be a number in 0..1"),
    (["--tau-min", "nan"], "argument --tau-min: must be a number in 0..1"),
    (["--tau", ""], "a larger tau decodes the same), got ''\n"),
    (["--tau", " "], "a larger tau decodes the same), got ' '\n"),
    (["--tau-max", "1.5"], "argument --tau-max: must be a number in 0..1"),
    (["--tau", "0.5", "--tau-min", "0.9"], "error: --tau 0.5 is below --tau-min 0.9: need --tau-min <= --tau <= "
                                           "--tau-max (the base taus /admin/tau accepts)\n"),
    (["--tau", "0.9", "--tau-max", "0.8"], "error: --tau 0.9 is above --tau-max 0.8: need --tau-min <= --tau <= "
                                           "--tau-max (the base taus /admin/tau accepts)\n"),
    (["--tau-min", "0.9", "--tau-max", "0.8"], "error: --tau 1 is above --tau-max 0.8")])
def test_a_tau_option_out_of_range_stops_the_server_before_the_bundle_loads(tiny_bundle, monkeypatch, capsys,
                                                                            options, message):
    """--tau 1.5 was accepted, and /admin/tau then accepted only [1.5, 1.5], refusing 1.0; --tau -1 was refused in
    the load policy's terms (tau_min). Each tau option is in 0..1, and --tau-min <= --tau <= --tau-max, refused with
    exit status 2 in the options' names before the bundle loads."""
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # the bundle's export output, if it was made now
    monkeypatch.setattr("runtime.backends.loading.load_backend", lambda *a: pytest.fail("the bundle was loaded"))
    assert main([str(bundle), *options]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1, err



def test_the_servers_tau_options_are_parsed_by_the_one_rule_on_tau(tmp_path, monkeypatch):
    """serve parsed --tau, --tau-min and --tau-max with a float parser of its own: they go through check_tau (the
    runtime's one rule, via runtime.command_line.tau_value) before the server's own 0..1 bound."""
    from runtime.decode import params

    def refuse_half(tau, shown=None):
        if tau == 0.5:
            raise params.ParamError("tau", "refused by check_tau")
        return tau
    monkeypatch.setattr(params, "check_tau", refuse_half)
    assert parse_args([str(tmp_path), "--tau", "0.9"]).tau == 0.9
    for option in ("--tau", "--tau-min", "--tau-max"):
        with pytest.raises(ValueError, match=f"argument {option}: must be a number in 0..1"):
            parse_args([str(tmp_path), option, "0.5"])

def test_the_default_tau_range_is_tau_to_1(tmp_path):
    policy = server_settings(parse_args([str(tmp_path), "--tau", "0.9"]))[0]
    assert (policy.tau_min, policy.tau_max) == (0.9, 1.0)
    policy = server_settings(parse_args([str(tmp_path), "--tau", "1", "--tau-min", "0.5", "--tau-max", "1"]))[0]
    assert (policy.tau_min, policy.tau_max) == (0.5, 1.0)


def test_the_default_max_tokens_follows_a_lower_limit_and_an_explicit_one_above_it_is_refused(tmp_path):
    assert server_settings(parse_args([str(tmp_path)]))[1].default_max_tokens == 256
    assert server_settings(parse_args([str(tmp_path), "--max-tokens-limit", "100"]))[1].default_max_tokens == 100
    limits = server_settings(parse_args([str(tmp_path), "--max-tokens-limit", "100", "--default-max-tokens", "40"]))[1]
    assert (limits.max_tokens, limits.default_max_tokens) == (100, 40)
    with pytest.raises(ValueError, match="--default-max-tokens.*--max-tokens-limit"):
        server_settings(parse_args([str(tmp_path), "--max-tokens-limit", "100", "--default-max-tokens", "101"]))


@pytest.mark.parametrize("port", ["99999", "65536", "-1", "80x"])
def test_a_port_outside_0_to_65535_is_refused(tmp_path, capsys, port):
    assert main([str(tmp_path), "--port", port]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line == f"error: argument --port: must be a port number in 1..65535 (0 picks a free one), got {port}"
    assert [parse_args([str(tmp_path), "--port", p]).port for p in ("0", "1", "65535")] == [0, 1, 65535]


@pytest.mark.parametrize("args, message", [
    (["BUNDLE", "--max-batch-size", "abc"], "argument --max-batch-size: invalid int value: 'abc'"),
    (["BUNDLE", "--max-seq-len", "1.5"], "argument --max-seq-len: invalid int value: '1.5'"),
    # out of the engine's range: refused as a bad command line, before the bundle loads (it was refused once the
    # bundle had loaded, slow for a large one), in EngineConfig's words
    (["BUNDLE", "--max-batch-size", "0"], "argument --max-batch-size: must be >= 1, got 0"),
    (["BUNDLE", "--max-batch-size", "-3"], "argument --max-batch-size: must be >= 1, got -3"),
    (["BUNDLE", "--max-seq-len", "1"], "argument --max-seq-len: must be >= 2, got 1"),
    (["BUNDLE", "--max-seq-len", "0"], "argument --max-seq-len: must be >= 2, got 0"),
    (["BUNDLE", "--scheme", "nope"], "argument --scheme: invalid choice: 'nope'"),
    (["BUNDLE", "--bogus"], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: path")])
def test_a_bad_command_line_is_one_error_line_as_every_other_refusal(monkeypatch, capsys, args, message):
    """argparse's refusals printed its usage block before 'python -m runtime.serve: error: ...'; a bad option value
    or bundle was one 'error:' line, exit status 2: so are these now (runtime.command_line, as mars-export)."""
    monkeypatch.setattr("runtime.backends.loading.load_backend", lambda *a: pytest.fail("the bundle was loaded"))
    assert main(args) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {message}"), line


def test_a_port_in_use_stops_the_server_before_the_bundle_loads(tiny_bundle, monkeypatch, capsys):
    """uvicorn's "address already in use" came only once the model had loaded: the port is bound (and closed)
    first, a port in use is one error line naming it and --port, exit status 3 (uvicorn's). Once free, the same
    check passes again and again: it leaves nothing bound, and uvicorn binds the port itself later."""
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # the bundle's export output, if it was made now
    monkeypatch.setattr("runtime.backends.loading.load_backend", lambda *a: pytest.fail("the bundle was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([str(bundle), "--port", str(port)]) == STARTUP_FAILURE
        assert capsys.readouterr().err == (f"error: port {port} on 127.0.0.1 is in use: stop what listens there, or "
                                           "choose another --port (--port 0 picks a free one)\n")
    for _ in range(2):
        check_can_listen("127.0.0.1", port)
    with socket.socket() as server:  # as uvicorn binds it after the check
        server.bind(("127.0.0.1", port))
        server.listen()
    assert main([str(bundle), "--host", "no-such-host.invalid"]) == 2
    assert capsys.readouterr().err.startswith("error: --host 'no-such-host.invalid' does not resolve (")


def test_an_empty_api_key_means_no_key(tmp_path, monkeypatch):
    """MARS_API_KEY= (set but empty) is as if unset, not a key no client can send."""
    monkeypatch.setenv(API_KEY_ENV, "")
    assert parse_args([str(tmp_path)]).api_key is None
    assert parse_args([str(tmp_path), "--api-key", ""]).api_key is None
    monkeypatch.setenv(API_KEY_ENV, " sesame ")
    assert parse_args([str(tmp_path)]).api_key == "sesame"


@pytest.mark.parametrize("where", ["env", "option"])
def test_a_whitespace_api_key_is_refused_in_one_line(tmp_path, monkeypatch, capsys, where):
    """MARS_API_KEY="  " (e.g. a variable that expanded to nothing) is not taken as no key: that
    would serve without authentication unseen."""
    monkeypatch.setenv(API_KEY_ENV, "  " if where == "env" else "sesame")
    assert main([str(tmp_path), *(["--api-key", " \t"] if where == "option" else [])]) == 2
    assert capsys.readouterr().err == (f"error: the API key (--api-key or ${API_KEY_ENV}) is whitespace only: set a "
                                       "key, or leave it empty or unset to serve without one\n")


@pytest.mark.parametrize("options, message", [
    (["--seed", "-1"], "seed (--seed) must be an integer >= 0 (or none: fresh entropy), got -1"),
    (["--max-new-tokens", "0"], "max_new_tokens (--max-new-tokens) must be >= 1, got 0"),
    (["--top-p", "0"], "top_p (--top-p) must be in (0, 1], got 0.0"),
    (["--top-k", "-1"], "top_k (--top-k) must be >= 0 (0 = off), got -1"),
    (["--block-size", "0"], "block_size (--block-size) must be >= 1, got 0")])
def test_generate_cli_names_the_option_of_a_bad_decode_parameter(tmp_path, capsys, options, message):
    """The decode parameters' errors named the request field (``max_new_tokens must be >= 1``): they name the
    option too, before the bundle loads (tmp_path is none)."""
    assert generate.main([str(tmp_path), "--prompt", "hi", *options]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("content", ["{bad", "[1, 2]", "\xff"])
def test_a_corrupt_tokenizer_config_is_named_in_one_line(tiny_bundle, tmp_path, capsys, content):
    _, bundle = tiny_bundle("llama", 4)
    copy = shutil.copytree(bundle, tmp_path / "bundle")
    (copy / "tokenizer_config.json").write_bytes(content.encode("latin-1"))
    capsys.readouterr()  # what exporting the bundle wrote
    for run in (lambda: main([str(copy)]), lambda: generate.main([str(copy), "--prompt", "hi"])):
        assert run() == 2
        err = capsys.readouterr().err
        assert err.startswith((f"error: {copy / 'tokenizer_config.json'} is not a JSON object",
                               f"error: cannot read {copy / 'tokenizer_config.json'} (")), err
        assert err.endswith("re-export the bundle with mars-export\n") and err.count("\n") == 1, err

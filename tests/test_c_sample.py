"""The C sample (samples/c) against the Python runtime: the same ids on real prompts.

The binary is built once per session with CMake in a temporary directory; the ONNX Runtime
C headers are fetched by samples/c/fetch_headers.sh (Debian 13's libonnxruntime-dev). If
they cannot be downloaded (exit 3: no network, no apt-get) the tests skip and say why; any
other build failure fails. The reference is ``runtime.decode.decoder.Decoder`` on
``runtime.backends.onnx.OnnxBackend`` with the same prompt ids, tau, block size and thread
count; ids, decode forwards, prefill forwards and finish reason must all be equal.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from mars_export import onnx_export
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams
from runtime.text.tokenizer import Tokenizer
from support import RUNTIME_PYTHON, declare_old_kv_outputs, export, fix_window, real_prompts

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "c"
TINY_CASES = [("llama", 4), ("qwen2", 8), ("qwen3", 4)]
TINY_TAUS = (1.0, 0.9, 0.5)
TINY_MAX_NEW, TINY_PROMPT_CHARS = 40, 160  # byte-level tiny models: 512 positions in all
DEFAULT_TAUS = (1.0, 0.9)
DEFAULT_MAX_NEW = 48
ERROR_PREFIX = "mars_c: error at "


def _load_wrapper():
    spec = importlib.util.spec_from_file_location("mars_c_wrapper", SAMPLE / "mars_c.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wrapper = _load_wrapper()


@pytest.fixture(scope="session")
def mars_c(tmp_path_factory) -> Path:
    """Path of the built ``mars_c`` binary (skips only when the headers cannot be downloaded),
    linked to the onnxruntime library of ``support.RUNTIME_PYTHON``."""
    for tool in ("cmake", "cc", "bash"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: cannot build samples/c")
    build = tmp_path_factory.mktemp("c-sample-build")
    fetch = subprocess.run(["bash", str(SAMPLE / "fetch_headers.sh"), str(build / "onnxruntime-headers")],
                           capture_output=True, text=True, timeout=600)
    if fetch.returncode == 3:
        pytest.skip("cannot download the ONNX Runtime C headers (libonnxruntime-dev from Debian trixie), "
                    f"so samples/c cannot be built: {fetch.stderr.strip().splitlines()[-1]}")
    assert fetch.returncode == 0, f"fetch_headers.sh failed:\n{fetch.stderr}"
    for command in (["cmake", "-S", str(SAMPLE), "-B", str(build), f"-DPython3_EXECUTABLE={RUNTIME_PYTHON}"],
                    ["cmake", "--build", str(build)]):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}"
    return build / "mars_c"


@pytest.fixture(scope="session")
def mars_c_sanitized(mars_c, tmp_path_factory) -> Path:
    """``mars_c`` built with ``-DMARS_C_SANITIZE=ON`` (AddressSanitizer + UndefinedBehaviorSanitizer), with the
    headers the plain build fetched."""
    build = tmp_path_factory.mktemp("c-sample-asan")
    headers = mars_c.parent / "onnxruntime-headers" / "include"
    for command in (["cmake", "-S", str(SAMPLE), "-B", str(build), f"-DPython3_EXECUTABLE={RUNTIME_PYTHON}",
                     "-DMARS_C_SANITIZE=ON", f"-DORT_INCLUDE_DIR={headers}"], ["cmake", "--build", str(build)]):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}"
    return build / "mars_c"


def chat_ids(bundle: Path, text: str) -> list[int]:
    return Tokenizer(bundle).encode_chat([{"role": "user", "content": text}])


class MaskedSteps:
    """Spy on a backend: ``count`` is the forwards whose input ids held the mask token (decode steps with masks)."""

    def __init__(self, backend, mask_token_id: int):
        self.count, step = 0, backend.step

        def spy(ids, *args, **kwargs):
            self.count += int(mask_token_id in ids)
            return step(ids, *args, **kwargs)

        backend.step = spy


def check_same_as_python(binary: Path, bundle: Path, prompts: list[tuple[str, str]], taus, max_new: int,
                         num_threads: int, block_size: int | None = None, adaptive_masks: bool = False) -> list[dict]:
    """Run C and Python on every prompt and tau; assert equal ids and counts (the decode forwards that fed masks
    too); return the C counts."""
    config = load_config(bundle)
    backend = OnnxBackend(bundle, config, num_threads=num_threads)
    masked, decoder = MaskedSteps(backend, config.mask_token_id), Decoder(backend, config)
    all_counts = []
    for kind, text in prompts:
        ids = chat_ids(bundle, text)
        for tau in taus:
            masked.count = 0
            expected = decoder.generate(ids, DecodeParams(tau=tau, max_new_tokens=max_new, block_size=block_size,
                                                          adaptive_masks=adaptive_masks))
            got, counts = wrapper.run_binary(binary, bundle, ids, tau, max_new, block_size, num_threads, timeout=600,
                                             adaptive_masks=adaptive_masks)
            where = f"{kind} prompt {text[:50]!r} at tau={tau}, block_size={block_size}, adaptive={adaptive_masks}"
            assert got == expected.token_ids, f"C and Python ids differ on the {where}"
            assert (counts["num_forwards"], counts["num_prefill_forwards"], counts["finish_reason"],
                    counts["num_masked_forwards"]) == (expected.num_forwards, expected.num_prefill_forwards,
                                                       expected.finish_reason, masked.count), where
            assert counts["tpf"] == pytest.approx(expected.tpf, abs=1e-6), where
            all_counts.append({"tau": tau, "python_tps": expected.summary()["decode_tokens_per_second"], **counts})
    return all_counts


def tiny_prompts() -> list[tuple[str, str]]:
    """Two GSM8K questions and two HumanEval prompts, cut to fit the tiny models' 512 positions."""
    return [(kind, text[:TINY_PROMPT_CHARS]) for kind, text in real_prompts(2)]


@pytest.mark.runtime_python
@pytest.mark.parametrize("arch, window", TINY_CASES)
@pytest.mark.usefixtures("shared_data")
def test_tiny_models_same_ids_as_python(mars_c, tiny_bundle, arch, window):
    _, bundle = tiny_bundle(arch, window)
    counts = check_same_as_python(mars_c, bundle, tiny_prompts(), TINY_TAUS, TINY_MAX_NEW, num_threads=1)
    assert any(c["tpf"] > 1.0 for c in counts), "no multi-token step was exercised"
    check_same_as_python(mars_c, bundle, tiny_prompts()[:1], (0.5,), TINY_MAX_NEW, num_threads=1, block_size=2)


@pytest.mark.runtime_python
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.usefixtures("shared_data")
def test_adaptive_masks_same_ids_as_python(mars_c, tiny_bundle, arch):
    """--adaptive-masks against DecodeParams(adaptive_masks=True): the same ids, decode forwards, TPF and forwards
    that fed masks. At these taus the tiny models' masks gain tokens on some steps and miss on others, so rows back
    off (fewer forwards feed masks than without the flag) and still gain tokens from the probes. At tau 1 and
    block size 1 no mask is fed, so there is nothing to back off from: the same as without the flag."""
    _, bundle = tiny_bundle(arch, 4)
    taus = (0.3, 0.5)
    fixed = check_same_as_python(mars_c, bundle, tiny_prompts(), taus, TINY_MAX_NEW, num_threads=1)
    adaptive = check_same_as_python(mars_c, bundle, tiny_prompts(), taus, TINY_MAX_NEW, num_threads=1,
                                    adaptive_masks=True)
    assert sum(a["num_masked_forwards"] for a in adaptive) < sum(f["num_masked_forwards"] for f in fixed) / 2
    assert any(a["num_masked_forwards"] < a["num_forwards"] for a in adaptive), "no step ran without masks"
    assert any(a["tpf"] > 1.0 for a in adaptive), "no mask gained a token with adaptive masks"
    for tau, block_size in [(1.0, None), (0.5, 1)]:
        counts = check_same_as_python(mars_c, bundle, tiny_prompts()[:2], (tau,), TINY_MAX_NEW, num_threads=1,
                                      block_size=block_size, adaptive_masks=True)
        assert all(c["num_masked_forwards"] == 0 and c["tpf"] == 1.0 for c in counts)


@pytest.mark.usefixtures("shared_data")
def test_prompt_at_the_context_bound_matches_python(mars_c, tiny_bundle):
    """prompt + max_new_tokens + W = the model's max context, the largest run either accepts:
    the C program (its cache, S >= P + W, stays within the context) and the Python runtime (its cache
    capacity capped at the context, not doubled past it) give the same ids; one more is refused."""
    _, bundle = tiny_bundle("llama", 4)
    config = load_config(bundle)
    max_new = 8
    text = " ".join(text for _, text in real_prompts(3))
    ids = Tokenizer(bundle).encode(text)[:config.max_context - max_new - config.window]
    assert len(ids) + max_new + config.window == config.max_context
    expected = Decoder(OnnxBackend(bundle, config, num_threads=1), config).generate(
        ids, DecodeParams(tau=0.5, max_new_tokens=max_new))
    got, counts = wrapper.run_binary(mars_c, bundle, ids, 0.5, max_new, num_threads=1, timeout=600)
    assert got == expected.token_ids
    assert counts["num_prefill_forwards"] == expected.num_prefill_forwards == 2  # chunks of 256 prompt tokens
    with pytest.raises(wrapper.MarsCError, match="exceeds the model's max context"):
        wrapper.run_binary(mars_c, bundle, ids + ids[-1:], 0.5, max_new, num_threads=1, timeout=600)


@pytest.mark.usefixtures("shared_data")
def test_bundles_of_a_fixed_window_or_without_num_logits_match_python(mars_c, tiny_bundle, tmp_path, monkeypatch):
    """Older exports: a fixed window axis (before 2026-11-30) prefills W tokens per forward, padded; a step graph
    without ``num_logits`` (before 2026-12-02) prefills T tokens and computes their logits. Both as Python does."""
    ckpt, bundle = tiny_bundle("llama", 4)
    fixed = fix_window(Path(shutil.copytree(bundle, tmp_path / "fixed")), 4)
    monkeypatch.setattr(onnx_export, "compute_logits_of_last_rows", lambda graph: None)
    monkeypatch.setattr(onnx_export, "add_greedy_head", lambda *args, **kwargs: None)  # it came later still
    unsliced = export(str(ckpt), tmp_path / "unsliced", 4, 4, "--mask-token", "<mask>")
    assert not OnnxBackend(unsliced, load_config(unsliced)).takes_num_logits
    for old in (fixed, unsliced):
        counts = check_same_as_python(mars_c, old, tiny_prompts()[:2], (1.0, 0.5), TINY_MAX_NEW, num_threads=1)
        prompt_lengths = [len(chat_ids(old, text)) for _, text in tiny_prompts()[:2] for _ in (1.0, 0.5)]
        per_forward = 4 if old == fixed else 256
        assert [c["num_prefill_forwards"] for c in counts] == [-(-(n - 1) // per_forward) for n in prompt_lengths]


def make_fp16_kv_bundle(src: Path, dst: Path) -> Path:
    """Copy of a float32 bundle whose KV inputs/outputs are float16 (Cast nodes at the graph
    edges; logits stay float32) and whose config says dtype float16, as an fp16 export does."""
    shutil.copytree(src, dst)
    model = onnx.load(str(dst / "model.onnx"))
    graph, head, tail = model.graph, [], []
    for value in graph.input:
        if value.name.startswith("past_key_values."):
            inner = value.name + ".float32"
            for node in graph.node:
                node.input[:] = [inner if name == value.name else name for name in node.input]
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
            head.append(helper.make_node("Cast", [value.name], [inner], to=TensorProto.FLOAT))
    for value in graph.output:
        if value.name.startswith("present."):
            inner = value.name + ".float32"
            for node in graph.node:
                node.input[:] = [inner if name == value.name else name for name in node.input]
                node.output[:] = [inner if name == value.name else name for name in node.output]
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
            tail.append(helper.make_node("Cast", [inner], [value.name], to=TensorProto.FLOAT16))
    nodes = head + list(graph.node) + tail
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(dst / "model.onnx"))
    config = json.loads((dst / "mars_config.json").read_text())
    (dst / "mars_config.json").write_text(json.dumps({**config, "dtype": "float16"}, indent=2))
    return dst


@pytest.mark.usefixtures("shared_data")
def test_float16_kv_bundle_same_ids_as_python(mars_c, tiny_bundle, tmp_path):
    bundle = make_fp16_kv_bundle(tiny_bundle("qwen3", 4)[1], tmp_path / "fp16")
    assert load_config(bundle).dtype == "float16"
    counts = check_same_as_python(mars_c, bundle, tiny_prompts(), (1.0, 0.5), TINY_MAX_NEW, num_threads=1)
    assert any(c["tpf"] > 1.0 for c in counts)


@pytest.mark.usefixtures("shared_data")
def test_default_model_same_ids_as_python(mars_c, default_bundle):
    counts = check_same_as_python(mars_c, default_bundle, real_prompts(2), DEFAULT_TAUS, DEFAULT_MAX_NEW, num_threads=2)
    # the weights moved onto huge pages at load, as the Python runtime moves them (where the kernel lets it)
    python_moved = OnnxBackend(default_bundle, load_config(default_bundle), num_threads=2).huge_page_bytes
    assert all(c["huge_page_bytes"] > 0 for c in counts) or not python_moved
    for c in counts:
        print(f"tau={c['tau']}: C {c['decode_tokens_per_second']:.1f} tok/s, Python {c['python_tps']:.1f} tok/s, "
              f"TPF {c['tpf']:.2f}")


@pytest.mark.usefixtures("shared_data")
@pytest.mark.parametrize("adaptive_masks", [False, True])
def test_wrapper_text_equals_python(mars_c, tiny_bundle, capsys, adaptive_masks):
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # what exporting the bundle printed, when this test exports it
    kind, text = tiny_prompts()[0]
    flags = ["--adaptive-masks"] if adaptive_masks else []
    assert wrapper.main([str(bundle), "--prompt", text, "--chat", "--tau", "0.5", "--max-new-tokens", "20",
                         "--threads", "1", "--binary", str(mars_c), "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    config = load_config(bundle)
    expected = Decoder(OnnxBackend(bundle, config, num_threads=1), config).generate(
        chat_ids(bundle, text), DecodeParams(tau=0.5, max_new_tokens=20, adaptive_masks=adaptive_masks))
    assert out["token_ids"] == expected.token_ids
    assert out["num_forwards"] == expected.num_forwards
    assert (out["num_masked_forwards"] < out["num_forwards"]) is adaptive_masks  # backed off, or masks every step
    assert out["text"] == Tokenizer(bundle).decode(expected.token_ids)


# ---- bad input: a clear message from the one check macro, exit status 1, never a crash ----

def _config_edit(**changes):
    def edit(bundle: Path):
        path = bundle / "mars_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return edit


def _drop_field(name: str):
    def edit(bundle: Path):
        path = bundle / "mars_config.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != name}))
    return edit


def _write(name: str, content: bytes):
    return lambda bundle: (bundle / name).write_bytes(content)


def _truncate_model(bundle: Path):
    data = (bundle / "model.onnx").read_bytes()
    (bundle / "model.onnx").write_bytes(data[: len(data) // 3])


BAD_BUNDLES = {
    "no config": (lambda bundle: (bundle / "mars_config.json").unlink(), "is not a MARS bundle"),
    "not JSON": (_write("mars_config.json", b'{"window": 4,'), "malformed JSON"),
    "trailing garbage": (_write("mars_config.json", b'{"window": 4} x'), "malformed JSON"),
    "deep nesting": (_write("mars_config.json", b'{"parity": ' + b"[" * 100000), "nested too deeply"),
    "format version": (_config_edit(format_version=2), "format version 2 is not supported"),
    "window as string": (_config_edit(window="4"), "field window must be an integer"),
    "fractional window": (_config_edit(window=4.5), "field window must be an integer"),
    "negative layers": (_config_edit(num_layers=-1), "field num_layers must be an integer"),
    "missing field": (_drop_field("vocab_size"), "lacks the field vocab_size"),
    "block above window": (_config_edit(block_size=99), "block_size 99 must be in 1..window"),
    "no eos": (_config_edit(eos_token_ids=[]), "eos_token_ids is empty"),
    "eos outside vocab": (_config_edit(eos_token_ids=[100000]), "outside the vocabulary"),
    "bad dtype": (_config_edit(dtype="bfloat16"), 'dtype must be "float32" or "float16"'),
    "wrong dtype": (_config_edit(dtype="float16"), "element type"),
    "wrong layer count": (_config_edit(num_layers=3), "inputs and"),
    "wrong window": (lambda bundle: _config_edit(window=8, block_size=8)(fix_window(bundle, 4)),
                     "input_ids must be int64 [batch, 8]"),
    "wrong vocab": (_config_edit(vocab_size=300), "logits must be float32 [batch, 4, 300]"),
    "fused graph": (_config_edit(graph="fused"), "runs the step graph only; export the bundle with mars-export "
                                                 "--graph step"),
    "no model": (lambda bundle: (bundle / "model.onnx").unlink(), "not found; re-export"),
    "truncated model": (_truncate_model, "rotobuf"),
    "old KV outputs": (declare_old_kv_outputs, "older step graph that outputs only the window's new KV entries"),
}


@pytest.mark.parametrize("case", sorted(BAD_BUNDLES))
def test_bad_bundle_gives_clear_error(mars_c, tiny_bundle, tmp_path, case):
    edit, message = BAD_BUNDLES[case]
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle("llama", 4)[1], bundle)
    edit(bundle)
    with pytest.raises(wrapper.MarsCError) as error:
        wrapper.run_binary(mars_c, bundle, [1, 2, 3], max_new_tokens=4, num_threads=1, timeout=120)
    assert str(error.value).startswith(ERROR_PREFIX) and message in str(error.value), str(error.value)


BAD_RUNS = {
    "empty prompt": ([], [], "the prompt is empty"),
    "id outside vocab": ([1, 99999], [], "outside the vocabulary"),
    "negative id": ([1, -3], [], "outside the vocabulary"),
    "tau NaN": ([1, 2], ["--tau", "nan"], "--tau must be a finite number"),
    "tau negative": ([1, 2], ["--tau", "-1"], "--tau must be a finite number"),
    "block too large": ([1, 2], ["--block-size", "5"], "exceeds the bundle's block size 4"),
    "max new zero": ([1, 2], ["--max-new-tokens", "0"], "--max-new-tokens must be an integer"),
    "beyond context": ([1, 2], ["--max-new-tokens", "600"], "exceeds the model's max context"),
    "unknown option": ([1, 2], ["--temperature", "1"], "unknown option --temperature"),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_bad_arguments_give_clear_error(mars_c, tiny_bundle, case):
    ids, extra, message = BAD_RUNS[case]
    bundle = tiny_bundle("llama", 4)[1]
    proc = subprocess.run([str(mars_c), str(bundle), "--max-new-tokens", "8", *extra],
                          input=" ".join(map(str, ids)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith(ERROR_PREFIX) and message in proc.stderr, proc.stderr


def test_adaptive_masks_on_a_fixed_window_bundle_give_clear_error(mars_c, tiny_bundle, tmp_path):
    """Every step of a fixed-window graph is W wide, so the flag could change nothing: refused in one line (as the
    Python runtime refuses it there), where the same bundle runs without the flag."""
    fixed = fix_window(Path(shutil.copytree(tiny_bundle("llama", 4)[1], tmp_path / "fixed")), 4)
    assert len(wrapper.run_binary(mars_c, fixed, [1, 2, 3], 0.5, 4, num_threads=1, timeout=120)[0]) == 4
    with pytest.raises(wrapper.MarsCError) as error:
        wrapper.run_binary(mars_c, fixed, [1, 2, 3], 0.5, 4, num_threads=1, timeout=120, adaptive_masks=True)
    message = str(error.value)
    assert message.startswith(ERROR_PREFIX) and "\n" not in message, message
    assert "--adaptive-masks needs a step graph with a dynamic window axis" in message and "W = 4 wide" in message



def test_a_failed_binary_says_how_it_ended(tmp_path):
    """A binary that failed printing nothing on stderr was named with 'exited with status -11' where a signal had
    killed it: its end is the exit status, or the signal by number and name (MarsCError.ended, which
    bench/c_sample.py shows too)."""
    binary = tmp_path / "mars_c"
    binary.write_text("#!/bin/sh\nkill -SEGV $$\n")
    binary.chmod(0o755)
    with pytest.raises(wrapper.MarsCError) as error:
        wrapper.run_binary(binary, tmp_path, [1, 2], timeout=60)
    assert str(error.value) == f"{binary} printed nothing on stderr"
    assert error.value.ended == "killed by signal 11 (SIGSEGV)"


@pytest.mark.parametrize("content", ["#!/nonexistent/interpreter\n", "\x7fELF not this machine's\n"])
def test_a_binary_that_cannot_be_run_is_one_error(tmp_path, content):
    """An executable with a bad #! line or of another machine ended in a FileNotFoundError / exec format error
    traceback."""
    binary = tmp_path / "mars_c"
    binary.write_text(content)
    binary.chmod(0o755)
    with pytest.raises(wrapper.MarsCError, match=r"cannot be run \(.*\): is it a mars_c build for this machine"):
        wrapper.run_binary(binary, tmp_path, [1, 2], timeout=60)


@pytest.mark.parametrize("stderr, end, ended", [
    ("loading bundle", "kill -SEGV $$", "killed by signal 11 (SIGSEGV)"),
    ("mars_c: error at main.c:1: bad", "exit 3", "exit status 3")])
def test_the_wrapper_shows_how_a_binary_ended_before_its_stderr(tmp_path, tiny_bundle, capsys, stderr, end, ended):
    """samples/c/mars_c.py showed only the binary's stderr: a crash after a line on stderr read as that line."""
    binary = tmp_path / "mars_c"
    binary.write_text(f"#!/bin/sh\necho '{stderr}' >&2\n{end}\n")
    binary.chmod(0o755)
    bundle = tiny_bundle("llama", 4)[1]
    capsys.readouterr()  # the bundle's making
    assert wrapper.main([str(bundle), "--binary", str(binary), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {binary} failed ({ended}):", stderr]

def test_non_integer_ids_give_clear_error(mars_c, tiny_bundle):
    proc = subprocess.run([str(mars_c), str(tiny_bundle("llama", 4)[1])], input="1 2 x3", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "'x3' (item 2) is not an integer token id" in proc.stderr, proc.stderr


@pytest.mark.usefixtures("shared_data")
def test_bench_script_smoke(mars_c, tiny_bundle, tmp_path):
    """bench/c_sample.py runs two binaries and the Python runtime on two prompt lengths and writes its results;
    every engine gives the same ids and one prefill forward per prompt (both under 256 tokens). With
    --adaptive-masks every engine runs them: again the same ids and the same decode forwards, which for the 8-token
    prompt differ from those without (checked: at tau 0.5 its masks miss on some step, so rows back off)."""
    _, bundle = tiny_bundle("llama", 4)
    script = Path(__file__).resolve().parents[1] / "bench" / "c_sample.py"
    command = [sys.executable, str(script), str(bundle), "--binary", f"a={mars_c}", "--binary", f"b={mars_c}",
               "--python", "--prompt-lengths", "8", "40", "--repeats", "1", "--max-new-tokens", "6", "--tau", "0.5",
               "--threads", "1", "--out", str(tmp_path), "--name", "smoke"]
    runs = {}
    for name, flags in [("smoke", []), ("adaptive", ["--adaptive-masks"])]:
        done = subprocess.run([*command[:-1], name, *flags], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        for suffix in (".json", ".csv", ".png"):
            assert (tmp_path / f"{name}{suffix}").stat().st_size > 0
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
        summary = runs[name]["summary"]
        assert sorted((s["engine"], s["prompt_tokens"]) for s in summary) == [
            (engine, length) for engine in ("a", "b", "python") for length in (8, 40)]
        assert all(s["same_ids_as_first"] and s["prefill_forwards"] == 1 for s in summary)
    assert (runs["smoke"]["adaptive_masks"], runs["adaptive"]["adaptive_masks"]) == (False, True)
    decode_forwards = {name: {(r["engine"], r["prompt_tokens"]): r["decode_forwards"] for r in run["rows"]}
                       for name, run in runs.items()}
    for forwards in decode_forwards.values():  # each engine as the first, with or without adaptive masks
        assert all(forwards[engine, n] == forwards["a", n] for engine in ("b", "python") for n in (8, 40)), forwards
    assert decode_forwards["adaptive"]["a", 8] != decode_forwards["smoke"]["a", 8], decode_forwards
    (tmp_path / "a_file").write_text("")
    not_executable = tmp_path / "a_file"
    for bad_args, message in [(["--binary", "a=/nonexistent/mars_c"], "is no file"),
                              (["--binary", f"a={not_executable}"], "is not executable"),
                              (["--binary", f"a={mars_c}", "--binary", f"a={mars_c}"], "names must differ"),
                              (["--binary", f"a={mars_c}", "--threads", "1000"],
                               "argument --threads: must be in 0..256"),
                              (["--binary", f"a={mars_c}", "--tau", "nan"], "tau must be"),
                              (["--binary", f"a={mars_c}", "--name", "x/y"],
                               "argument --name: 'x/y' is a path, not a file name"),
                              (["--binary", f"a={mars_c}", "--out", str(not_executable)], "is a file, not a directory"),
                              (["--binary", f"a={mars_c}", "--prompt-lengths", "600"], "exceeds the bundle's context")]:
        out = tmp_path / "bad"
        bad = subprocess.run([sys.executable, str(script), str(bundle), "--out", str(out), *bad_args],
                             capture_output=True, text=True, timeout=600)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, (bad_args, bad.stderr)
        assert not out.exists()
    fixed = fix_window(Path(shutil.copytree(bundle, tmp_path / "fixed")), 4)  # every step W wide: refused up front
    bad = subprocess.run([sys.executable, str(script), str(fixed), "--binary", f"a={mars_c}", "--python",
                          "--prompt-lengths", "8", "--adaptive-masks", "--out", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and "--adaptive-masks: adaptive masks cannot act here" in bad.stderr, bad.stderr
    assert "re-export" in bad.stderr and "Traceback" not in bad.stderr and not out.exists()
    no_model = Path(shutil.copytree(bundle, tmp_path / "no-model"))
    (no_model / "model.onnx").unlink()  # the binary's own error, after the arguments passed
    failed = subprocess.run([*command[:2], str(no_model), *command[3:], "--force"],  # smoke.* are the first run's
                            capture_output=True, text=True, timeout=600)
    assert failed.returncode == 1 and "re-export the bundle" in failed.stderr and "Traceback" not in failed.stderr


def test_sanitized_build_runs_clean_through_cache_growth(mars_c, mars_c_sanitized, tiny_bundle, tmp_path):
    """Long generations (the KV cache laid out again at every doubling, prefill in several chunks) on float32,
    fp16-KV and fixed-window bundles: no AddressSanitizer / UBSan report, no leak, the plain build's ids."""
    _, bundle = tiny_bundle("llama", 4)
    fp16 = make_fp16_kv_bundle(tiny_bundle("qwen3", 4)[1], tmp_path / "fp16")
    fixed = fix_window(Path(shutil.copytree(bundle, tmp_path / "fixed")), 4)
    prompt = [(i * 7) % 200 + 3 for i in range(300)]  # 2 prefill chunks
    env = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    for case, args in [(bundle, ["--tau", "0.5"]), (bundle, ["--tau", "1.0", "--block-size", "2"]),
                       (bundle, ["--tau", "0.5", "--adaptive-masks"]),
                       (fp16, ["--tau", "0.5"]), (fixed, ["--tau", "0.9"])]:
        command = [str(case), *args, "--max-new-tokens", "150", "--threads", "1"]
        ids = " ".join(map(str, prompt))
        plain = subprocess.run([str(mars_c), *command], input=ids, capture_output=True, text=True, timeout=600)
        checked = subprocess.run([str(mars_c_sanitized), *command], input=ids, capture_output=True, text=True,
                                 timeout=600, env={**os.environ, **env})
        assert checked.returncode == 0 and "Sanitizer" not in checked.stderr and "runtime error" not in checked.stderr, (
            case.name, args, checked.stderr[-2000:])
        assert checked.stdout == plain.stdout and len(plain.stdout.split()) == 150, (case.name, args)

"""Memory sizing (runtime.memory): parameter counts against torch, KV bytes by hand, the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)
from tiny_models import make_a2d_checkpoint, make_checkpoint

from mars_export.context import max_context_of
from mars_export.model_source import load_model
from runtime import hf_config, memory

CONFIGS = Path(__file__).resolve().parents[1] / "samples" / "jetson" / "configs"
TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.mark.parametrize("config", [
    LlamaConfig(**TINY, tie_word_embeddings=False),
    LlamaConfig(**TINY, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    LlamaConfig(**TINY, head_dim=24),  # head_dim not hidden / heads
    Qwen2Config(**TINY, tie_word_embeddings=False),
    Qwen2Config(**TINY, tie_word_embeddings=True),
    Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False),
    Phi3Config(**TINY, tie_word_embeddings=False, pad_token_id=0),  # its default pad id is past the tiny vocab
    Phi3Config(**TINY, tie_word_embeddings=True, pad_token_id=0),
], ids=["llama", "llama-tied-biases", "llama-head-dim", "qwen2", "qwen2-tied", "qwen3", "phi3", "phi3-tied"])
def test_parameter_count_equals_torch(config):
    model = AutoModelForCausalLM.from_config(config)
    assert hf_config.count_parameters(config.to_dict()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, expected", [("qwen2.5-0.5b-instruct", 494_032_768),
                                            ("qwen2.5-1.5b-instruct", 1_543_714_304),
                                            ("qwen2.5-7b-instruct", 7_615_616_512)])
def test_shipped_qwen_configs(name, expected):
    """The shipped configs give Qwen's published sizes, and so does transformers' model built from them."""
    path = CONFIGS / name / "config.json"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent))
    assert sum(p.numel() for p in model.parameters()) == expected
    sized = memory.from_hf_config(path, "fp16", "fp16")
    assert sized.num_params == expected and sized.weights_bytes == 2 * expected


@pytest.mark.parametrize("layout", ["qwen2", "qwen3", "qwen3-it", "llama"])
def test_published_mars_checkpoints_are_sized_as_their_base_model(layout, tmp_path):
    """A config.json of the MARS authors' layout (model_type a2d-*) counts as the model it loads as."""
    ckpt = make_a2d_checkpoint(layout, tmp_path / "ckpt")
    assert json.loads((ckpt / "config.json").read_text())["model_type"].startswith("a2d-")
    loaded = load_model(str(ckpt))
    sized = memory.from_hf_config(ckpt / "config.json", "fp32", "fp32")
    assert sized.num_params == sum(p.numel() for p in loaded.model.parameters())


def test_kv_bytes_by_hand():
    # 2 (K and V) x 3 layers x 2 KV heads x 16 dims x 100 tokens x batch 5 x 2 bytes
    assert memory.kv_cache_bytes(3, 2, 16, 100, 5, 2) == 2 * 3 * 2 * 16 * 100 * 5 * 2 == 192_000


def test_config_sizing_by_dtype(tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    Qwen2Config(**TINY, tie_word_embeddings=False).to_json_file(path)
    num_params = hf_config.count_parameters(Qwen2Config(**TINY, tie_word_embeddings=False).to_dict())
    for dtype, bytes_per in [("fp32", 4), ("fp16", 2), ("int8", 1), ("int4", 0.5)]:
        sized = memory.from_hf_config(path, dtype, "fp16")
        assert sized.weights_bytes == int(num_params * bytes_per)
    sized = memory.from_hf_config(path, "fp16", "fp32")
    assert (sized.num_layers, sized.num_kv_heads, sized.head_dim) == (3, 2, 16)
    assert sized.kv_bytes(200, 4) == 2 * 3 * 2 * 16 * 200 * 4 * 4


def test_largest_context_that_fits():
    """8 GiB budget, 1 GiB weights, 1 MiB per token: 7168 tokens at batch 1, 3584 at batch 2."""
    model = memory.ModelMemory("m", memory.GIB, None, 1, 1, 1024 * 1024 // 4, 2, 100_000, "hand-made")
    assert model.kv_bytes(1, 1) == 1024 * 1024
    text = memory.report(model, [1, 2], [1024], 0.0)
    assert "Orin Nano 8GB  B=1: 7168  B=2: 3584" in text
    assert "Orin Nano 8GB  B=1: 6144  B=2: 3072" in memory.report(model, [1, 2], [1024], 1.0)


def test_cli_on_bundle_and_configs(tiny_bundle, capsys):
    _, bundle = tiny_bundle("llama", 4)
    code = memory.main([str(bundle), str(CONFIGS / "qwen2.5-0.5b-instruct"), str(CONFIGS / "qwen2.5-7b-instruct"),
                        "--batch", "1", "8", "--context", "512", "32768"])
    out = capsys.readouterr().out
    assert code == 0
    onnx_bytes = (bundle / "model.onnx").stat().st_size
    assert f"weights {onnx_bytes / memory.GIB:.3f} GiB (model.onnx on disk (float32))" in out
    assert f"KV cache {2 * 2 * 2 * 16 * 4:,} bytes per token" in out  # tiny llama: 2 layers, 2 KV heads, 16 dims, fp32
    assert "parameters 494,032,768" in out and "parameters 7,615,616,512" in out
    assert "KV cache 57,344 bytes per token = 2 x 28 layers x 4 KV heads x 128 dims x 2 B" in out
    # 7B at fp16: 14.19 GiB of weights, never within the Orin Nano's 8 GiB
    assert "Orin Nano 8GB  B=1: 0  B=8: 0" in out


def test_the_table_and_help_say_that_no_reserve_is_applied_by_default(capsys):
    """Qwen2.5-7B at batch 1, 32k tokens (15.935 GiB) "fits" an Orin NX 16GB with 0 bytes left, and --help did not say
    that --reserve-gib defaults to 0: both say it, and how to add a reserve; a reserve given is named instead."""
    config = str(CONFIGS / "qwen2.5-7b-instruct" / "config.json")
    assert memory.main([config, "--batch", "1", "--context", "32768"]) == 0
    out = capsys.readouterr().out
    note = ("fits: weights + KV alone within the board's whole memory: no reserve for the OS, the CUDA context or "
            "activations was applied (--reserve-gib 0, the default); measure what your image uses (tegrastats, free) "
            "and pass it as --reserve-gib GIB\n")
    assert note + "batch context" in out and "15.935" in out
    assert memory.main([config, "--batch", "1", "--context", "32768", "--reserve-gib", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "fits: weights + KV within the board's memory less --reserve-gib 1.5 GiB\nbatch" in out and note not in out
    with pytest.raises(SystemExit):
        memory.parse_args(["--help"])
    assert "(default 0: none, so 'fits' means weights + KV alone fit;" in " ".join(capsys.readouterr().out.split())


def test_cli_rejects_other_paths(tmp_path, capsys):
    assert memory.main([str(tmp_path)]) == 2
    assert "is neither a MARS bundle nor a Hugging Face config.json" in capsys.readouterr().err


def config_json(tmp_path: Path, **changes) -> Path:
    """A tiny Llama config.json with ``changes`` (None: null)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "model_type": "llama", **changes}))
    return path


@pytest.mark.parametrize("make, extra, message", [
    (lambda tmp, bundle: bundle, ["--batch", "0"], "--batch 0: a batch size must be >= 1"),
    (lambda tmp, bundle: bundle, ["--context", "512", "-5"], "--context -5: a context must be >= 1"),
    (lambda tmp, bundle: bundle, ["--reserve-gib", "nan"], "--reserve-gib nan: must be a number of GiB >= 0"),
    (lambda tmp, bundle: bundle, ["--kv-dtype", "fp16"],
     "the runtime keeps this bundle's KV cache in its dtype, float32, so --kv-dtype fp16 would size a cache it never "
     "holds; drop --kv-dtype, or size a bundle exported with --fp16"),
    (lambda tmp, bundle: tmp, [], "is neither a MARS bundle nor a Hugging Face config.json"),
    (lambda tmp, bundle: bundle / "model.onnx", [], "model.onnx is not a Hugging Face config.json (not UTF-8 text)"),
    (lambda tmp, bundle: (tmp / "c.json").write_text("[1]") and tmp / "c.json", [], "(it holds no JSON object)"),
    (lambda tmp, bundle: config_json(tmp, hidden_size="64"), [],
     "config.json: config.json's hidden_size must be a positive integer, got '64'"),
    (lambda tmp, bundle: config_json(tmp, num_attention_heads=0), [], "num_attention_heads must be a positive integer"),
    (lambda tmp, bundle: config_json(tmp, head_dim=0), [], "head_dim must be a positive integer, got 0"),
    (lambda tmp, bundle: config_json(tmp, num_hidden_layers=None), [], "lacks 'num_hidden_layers'"),
    (lambda tmp, bundle: config_json(tmp, max_position_embeddings="x"), [],
     "config.json's max_position_embeddings must be a positive integer, got 'x'"),
    (lambda tmp, bundle: config_json(tmp, max_position_embeddings=None), [],
     "config.json's max_position_embeddings must be a positive integer, got None"),
    # a bad command line: argparse's usage block and 'python -m runtime.memory: error: ...' before
    (lambda tmp, bundle: bundle, ["--batch", "one"], "error: argument --batch: invalid int value: 'one'"),
    (lambda tmp, bundle: bundle, ["--weights-dtype", "fp8"], "error: argument --weights-dtype: invalid choice: 'fp8'"),
    (lambda tmp, bundle: bundle, ["--bogus"], "error: unrecognized arguments: --bogus"),
], ids=["batch-0", "negative-context", "nan-reserve", "bundle-kv-dtype", "no-bundle", "onnx-file", "json-list", "string-field",
        "zero-heads", "zero-head-dim", "null-layers", "string-context", "no-context", "batch-type", "dtype-choice",
        "unknown-option"])
def test_bad_inputs_are_one_error_line(tiny_bundle, tmp_path, capsys, make, extra, message):
    """No traceback, no table: one line naming the bad value or file and what is allowed, exit status 2."""
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # what exporting the bundle printed, when this test exports it
    path = make(tmp_path, bundle)
    assert memory.main([str(path), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    assert message in captured.err, captured.err


def test_null_kv_heads_and_head_dim_are_derived_as_transformers_derives_them(tmp_path):
    """A null num_key_value_heads or head_dim means every attention head and hidden_size / heads (a null
    max_position_embeddings is refused instead: test_bad_inputs_are_one_error_line, "no-context")."""
    sized = memory.from_hf_config(config_json(tmp_path, num_key_value_heads=None, head_dim=None), "fp16", "fp16")
    config = LlamaConfig(**{**TINY, "num_key_value_heads": None})
    assert (sized.num_kv_heads, sized.head_dim) == (config.num_key_value_heads, config.head_dim) == (4, 16)
    assert sized.num_params == hf_config.count_parameters(config.to_dict())


@pytest.mark.parametrize("changes", [{"rope_scaling": "yarn"}, {"rope_parameters": [1, 2]},
                                     {"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": "x"}},
                                     {"sliding_window": 8, "layer_types": 3}],
                         ids=["string-rope", "list-rope", "string-original", "number-layer-types"])
def test_context_fields_of_another_shape_are_one_error_line(changes, tmp_path, capsys):
    """A rope setting or layer_types not as transformers writes them: one line naming the file, no traceback."""
    assert memory.main([str(config_json(tmp_path, **changes))]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"error: {tmp_path / 'config.json'}: its context fields"), captured.err


def test_a_bundle_without_its_graph_is_refused(tiny_bundle, tmp_path, capsys):
    """A bundle folder missing model.onnx would be sized as 0 bytes of weights."""
    _, bundle = tiny_bundle("llama", 4)
    (tmp_path / "mars_config.json").write_bytes((bundle / "mars_config.json").read_bytes())
    assert memory.main([str(tmp_path)]) == 2
    assert f"{tmp_path / 'model.onnx'} not found: the bundle has no graph to size; re-export" in capsys.readouterr().err


def test_contexts_above_the_models_are_capped_to_it(tiny_bundle, capsys):
    """--context beyond the bundle's max context sizes the max context (the option's help: capped), not an empty
    table."""
    _, bundle = tiny_bundle("llama", 4)
    max_context = memory.load(bundle, "fp16", None).max_context
    assert memory.main([str(bundle), "--batch", "1", "--context", "64", str(10 * max_context)]) == 0
    out = capsys.readouterr().out
    assert f"context {10 * max_context} capped to the model's max context {max_context}" in out
    rows = [line.split()[:2] for line in out.splitlines() if line.startswith("    1 ")]
    assert rows == [["1", "64"], ["1", str(max_context)]]


def test_a_batch_given_twice_is_sized_once(tiny_bundle, capsys):
    """--batch 4 1 4: rows and largest contexts for batch 4, then 1, each once (in the order given)."""
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # what exporting the bundle printed, when this test exports it
    assert memory.main([str(bundle), "--batch", "4", "1", "4", "--context", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out if line.endswith("fits")] == [["4", "64"], ["1", "64"]]
    assert "  Orin Nano 8GB  B=4: 512  B=1: 512" in out  # the tiny bundle's max context


def test_a_fused_bundle_at_batches_it_cannot_run_is_left_out_of_a_run_that_sizes_others(tiny_bundle, tmp_path,
                                                                                          capsys):
    """A fused bundle runs one sequence at a time: beside a step bundle, --batch 2 sizes the step bundle and says in
    one line that the fused one was left out and why; with nothing else to size it is one error line, exit status 2
    (test_fused: a real fused bundle)."""
    _, bundle = tiny_bundle("llama", 4)
    capsys.readouterr()  # what exporting the bundle printed, when this test exports it
    fused = tmp_path / "fused"
    shutil.copytree(bundle, fused)
    raw = json.loads((bundle / "mars_config.json").read_text())
    (fused / "mars_config.json").write_text(json.dumps({**raw, "graph": "fused"}))
    assert memory.main([str(fused), str(bundle), "--batch", "2", "--context", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if str(fused) in line] == [
        f"== bundle {fused} ({raw['source_model']}) left out: it runs at most 1 sequence(s) at once (a fused bundle), "
        "so --batch 2 leaves nothing to size (add 1 to --batch to size it)"]
    assert f"== bundle {bundle} ({raw['source_model']})" in out and "    2      64" in "\n".join(out)
    assert memory.main([str(fused), str(fused), "--batch", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"error: bundle {fused} ({raw['source_model']}) runs at most 1 sequence(s) at once (a fused bundle), so "
        "--batch 2 leaves nothing to size; pass --batch 1, or size a bundle exported with --graph step for larger "
        "batches\n")


def test_a_quantized_bundle_names_its_weights_dtype(tiny_bundle, tmp_path, capsys):
    """An int8 bundle's weights are int8, its activations and KV float32: the note says both."""
    _, bundle = tiny_bundle("llama", 4)
    quantized = tmp_path / "int8"
    shutil.copytree(bundle, quantized)
    raw = json.loads((bundle / "mars_config.json").read_text())
    (quantized / "mars_config.json").write_text(json.dumps({**raw, "weight_dtype": "int8"}))
    assert memory.main([str(quantized), "--batch", "1", "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "(model.onnx on disk (int8 weights, float32 activations and KV))" in out
    assert f"KV cache {2 * 2 * 2 * 16 * 4:,} bytes per token" in out


def test_kv_dtype_is_free_for_a_config_json_and_the_bundles_own_for_a_bundle(tiny_bundle, tmp_path, capsys):
    """--kv-dtype sizes a config.json's cache either way (an export yet to be made: --fp16 or not); a bundle's cache is
    in the bundle's dtype (runtime.backends), so there it may only name that dtype (a float32 bundle refuses fp16:
    test_bad_inputs_are_one_error_line)."""
    _, bundle = tiny_bundle("llama", 4)  # 2 layers, 2 KV heads, 16 dims, float32
    fp16 = tmp_path / "fp16"
    shutil.copytree(bundle, fp16)
    raw = json.loads((bundle / "mars_config.json").read_text())
    (fp16 / "mars_config.json").write_text(json.dumps({**raw, "dtype": "float16"}))
    assert memory.load(bundle, "fp16", "fp32").kv_bytes(1, 1) == memory.load(bundle, "fp16", None).kv_bytes(1, 1) \
        == 2 * 2 * 2 * 16 * 4
    assert memory.load(fp16, "fp16", "fp16").kv_bytes(1, 1) == 2 * 2 * 2 * 16 * 2
    with pytest.raises(ValueError, match="in its dtype, float16, so --kv-dtype fp32 .*exported without --fp16$"):
        memory.load(fp16, "fp16", "fp32")
    config = CONFIGS / "qwen2.5-0.5b-instruct" / "config.json"
    assert memory.load(config, "fp16", "fp32").kv_bytes(1, 1) == 2 * memory.load(config, "fp16", "fp16").kv_bytes(1, 1)


def test_tensorrt_holds_the_kv_cache_twice(tiny_bundle, tmp_path, capsys):
    """onnxruntime writes the step's entries into the cache in place (one copy); TensorRT's present outputs,
    [n, H, S, D] per layer beside the cache (runtime.backends.trt), are a second copy: --trt or an engine.plan."""
    _, bundle = tiny_bundle("llama", 4)  # 2 layers, 2 KV heads, 16 dims, fp32
    on_ort, on_trt = memory.load(bundle, "fp16", None), memory.load(bundle, "fp16", None, trt=True)
    assert (on_ort.kv_copies, on_trt.kv_copies) == (1, 2)
    assert on_trt.kv_bytes(100, 3) == 2 * on_ort.kv_bytes(100, 3) == 2 * memory.kv_cache_bytes(2, 2, 16, 100, 3, 4)
    with pytest.raises(ValueError, match="engine.plan is not an engine file; give an engine built with"):
        memory.load(bundle / "engine.plan", "fp16", None)  # not built yet: no silent sizing of a missing file
    engine = tmp_path / "engine-bundle"
    shutil.copytree(bundle, engine)
    (engine / "engine.plan").write_bytes(b"serialized engine")
    assert memory.load(engine / "engine.plan", "fp16", None).kv_copies == 2  # the engine's path: TensorRT
    config = CONFIGS / "qwen2.5-7b-instruct" / "config.json"
    assert memory.from_hf_config(config, "fp16", "fp16", trt=True).kv_bytes(1, 1) == 2 * 57_344
    assert memory.main([str(bundle), str(config), "--trt", "--batch", "1", "8", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    per_token = 2 * 2 * 2 * 2 * 16 * 4  # two copies of 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 4 B
    assert f"KV cache {per_token:,} bytes per token = 2 x 2 layers x 2 KV heads x 16 dims x 4 B x 2 copies " \
           "(TensorRT: the cache and the engine's present outputs)" in out
    assert "KV cache 114,688 bytes per token" in out and "sized for TensorRT" in out
    assert "Orin NX 16GB   B=1: 16990  B=8: 2123" in out  # half the onnxruntime limits (32768 capped, 4247)
    model = memory.ModelMemory("m", memory.GIB, None, 1, 1, 1024 * 1024 // 4, 2, 100_000, "hand-made", kv_copies=2)
    assert "Orin Nano 8GB  B=1: 3584  B=2: 1792" in memory.report(model, [1, 2], [1024], 0.0)
    fused = tmp_path / "fused"
    shutil.copytree(bundle, fused)
    raw = json.loads((bundle / "mars_config.json").read_text())
    (fused / "mars_config.json").write_text(json.dumps({**raw, "graph": "fused"}))
    assert memory.load(fused, "fp16", None).kv_copies == 1
    with pytest.raises(ValueError, match="runs on onnxruntime only .*; size it without --trt"):
        memory.load(fused, "fp16", None, trt=True)
    (fused / "engine.plan").write_bytes(b"serialized engine")
    with pytest.raises(ValueError, match="runs on onnxruntime only .*; size the bundle directory, without --trt"):
        memory.load(fused / "engine.plan", "fp16", None)  # no --trt was given: the message does not ask to drop it


@pytest.mark.parametrize("arch, extra", [("mistral", {}), ("qwen2", {"use_sliding_window": True, "max_window_layers": 1})])
def test_sliding_window_caps_the_sized_context(arch, extra, tmp_path):
    """A sliding-window model's bundle holds only its window (runtime.context, the rule mars-export applies to
    max_context): a config.json is sized to that, not to max_position_embeddings."""
    ckpt = make_checkpoint(arch, tmp_path / arch, max_context=512, sliding_window=48, **extra)
    sized = memory.from_hf_config(ckpt / "config.json", "fp16", "fp16")
    assert sized.max_context == 48 == max_context_of(AutoConfig.from_pretrained(ckpt))[0]
    text = memory.report(sized, [1], [32, 48, 64, 512], 0.0)
    assert max_context_of(AutoConfig.from_pretrained(ckpt))[1] in text.splitlines()  # the export's line
    assert "    1      48" in text and "    1      64" not in text
    assert "Orin Nano 8GB  B=1: 48" in text


@pytest.mark.parametrize("fields, expected", [
    ({"model_type": "qwen2", "sliding_window": 48, "max_window_layers": 0}, 256),  # Qwen2.5 without the switch
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 48}, 256),  # layers from 28 on slide
    ({"model_type": "mistral", "max_position_embeddings": 8192}, 4096),  # Mistral's default window
], ids=["qwen2-no-use-sliding-window", "qwen2-no-max-window-layers", "mistral-no-sliding-window"])
def test_a_config_json_lacking_fields_is_sized_with_transformers_defaults(fields, expected, tmp_path):
    """A field the config.json lacks means transformers' default for its model type (runtime.context): the sized
    context is the one transformers' config of the same file gives."""
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**TINY, **fields}))
    sized = memory.from_hf_config(path, "fp16", "fp16")
    assert sized.max_context == expected == max_context_of(AutoConfig.from_pretrained(path.parent))[0]


@pytest.mark.parametrize("model_type", [*hf_config.ARCHS, "a2d-qwen2"])
def test_a_config_json_lacking_max_position_embeddings_is_sized_to_transformers_default(model_type, tmp_path):
    """Without max_position_embeddings a config.json holds transformers' default for its model type, as the export of
    the checkpoint does (a llama file was sized to a max context of 0 tokens before, its bundle holding 2048)."""
    fields = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**fields, "model_type": model_type}))
    expected = max_context_of(AutoConfig.for_model(model_type.removeprefix("a2d-"), **fields))[0]
    assert memory.from_hf_config(path, "fp16", "fp16").max_context == expected > 0


def test_a_phi3_longrope_config_json_is_sized_to_its_original_context(tmp_path):
    """Phi3 (Phi-3 128k, Phi-3.5) is sized, up to the longrope original context its bundle holds (runtime.context),
    and the report says why with the line the export logs."""
    ckpt = make_checkpoint("phi3", tmp_path / "phi3", max_context=512, original_max_position_embeddings=64,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    config = AutoConfig.from_pretrained(ckpt)
    sized = memory.from_hf_config(ckpt / "config.json", "fp32", "fp16")
    assert sized.num_params == sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert sized.max_context == 64 == max_context_of(config)[0]
    text = memory.report(sized, [1], [32, 64, 128], 0.0)
    assert max_context_of(config)[1] in text.splitlines() and "original_max_position_embeddings" in text
    assert "    1      64" in text and "    1     128" not in text

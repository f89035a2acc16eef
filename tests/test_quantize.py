"""Weight-only quantized exports (mars-export --int8 / --int4) of tiny Llama and Qwen3 models.

The quantized graph replaces model.onnx with the same I/O, holds MatMulNBits nodes of the
right bit width, runs unchanged in the runtime, and its config records the weight dtype,
the parity against the float32 PyTorch model and the greedy agreement with the float32 graph.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from support import export
from tiny_models import make_checkpoint

from mars_export import cli as export_cli
from mars_export import quantize
from mars_export.parity import ParityError
from runtime import generate
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import has_greedy_head, load_config
from runtime.decode.batch import run_batch
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams

CASES = [("llama", "int4"), ("qwen3", "int8")]


@pytest.fixture(scope="module")
def quantized_bundle(tiny_bundle, tmp_path_factory):
    """Factory: (arch, weight dtype) -> (float32 bundle, quantized bundle), B = W = 4, exported once per module."""
    made = {}

    def get(arch: str, weight_dtype: str):
        if (arch, weight_dtype) not in made:
            ckpt, fp32 = tiny_bundle(arch, 4)
            out = tmp_path_factory.mktemp(f"{arch}-{weight_dtype}") / "bundle"
            made[arch, weight_dtype] = fp32, export(str(ckpt), out, 4, 4, "--mask-token", "<mask>", f"--{weight_dtype}")
        return made[arch, weight_dtype]

    return get


def nbits_nodes(bundle) -> list[onnx.NodeProto]:
    graph = onnx.load(str(bundle / "model.onnx")).graph
    return [node for node in graph.node if node.op_type == "MatMulNBits"]


@pytest.mark.parametrize("arch, weight_dtype", CASES)
def test_graph_holds_matmulnbits_of_the_right_width(quantized_bundle, arch, weight_dtype):
    fp32, bundle = quantized_bundle(arch, weight_dtype)
    nodes = nbits_nodes(bundle)
    fp32_matmuls = [n for n in onnx.load(str(fp32 / "model.onnx")).graph.node if n.op_type == "MatMul"]
    # 2 layers x 4 projections (Q/K/V fused, o, gate/up fused, down) + the output head; attention's
    # two MatMuls per layer (scores and p·v over the cache with the window written in) stay float32
    assert len(nodes) == 2 * 4 + 1 and len(fp32_matmuls) == 2 * 4 + 1 + 2 * 2
    initializers = {t.name: t for t in onnx.load(str(bundle / "model.onnx")).graph.initializer}
    bits, block = quantize.WEIGHT_BITS[weight_dtype], quantize.BLOCK_SIZE[weight_dtype]
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["bits"] == bits and attrs["block_size"] == block
        assert attrs["accuracy_level"] == quantize.ACCURACY_LEVEL
        packed = initializers[node.input[1]]  # uint8 [N, K / block, block * bits / 8]
        assert packed.data_type == onnx.TensorProto.UINT8
        assert list(packed.dims) == [attrs["N"], -(-attrs["K"] // block), block * bits // 8]
    assert any("logits" in n.output for n in nodes), "the output head is quantized"
    assert not (bundle / quantize.REFERENCE_FILE).exists()
    assert (bundle / "model.onnx").stat().st_size < (fp32 / "model.onnx").stat().st_size


@pytest.mark.parametrize("arch, weight_dtype", CASES)
def test_config_records_precision_and_parity(quantized_bundle, arch, weight_dtype):
    _, bundle = quantized_bundle(arch, weight_dtype)
    config = load_config(bundle)
    assert config.dtype == "float32" and config.weight_dtype == weight_dtype
    assert not has_greedy_head(config)  # its ids are its own quantized head's argmax
    parity = config.parity
    assert parity["min_top1_agreement"] == quantize.MIN_TOP1_AGREEMENT[weight_dtype]
    assert parity["min_top1_agreement"] <= parity["top1_agreement"] <= 1.0
    assert parity["max_abs_logit_diff"] > 1e-3  # quantized: no longer float32-exact ...
    assert parity["weights"] == {"weight_dtype": weight_dtype, "block_size": quantize.BLOCK_SIZE[weight_dtype],
                                 "is_symmetric": quantize.IS_SYMMETRIC[weight_dtype],
                                 "accuracy_level": quantize.ACCURACY_LEVEL, "lm_head_quantized": True,
                                 "num_quantized": 2 * 4 + 1}
    greedy = parity["greedy_vs_float32"]
    assert greedy["num_prompts"] == 5 and greedy["num_tokens"] == quantize.AGREEMENT_TOKENS
    assert 0 <= greedy["identical_fraction"] <= 1 and greedy["mean_common_prefix"] <= greedy["mean_reference_tokens"]
    if weight_dtype == "int8":  # ... but int8 keeps nearly every prediction
        assert parity["top1_agreement"] >= 0.98


@pytest.mark.parametrize("arch, weight_dtype", CASES)
def test_runtime_runs_the_quantized_bundle(quantized_bundle, arch, weight_dtype, capsys):
    fp32, bundle = quantized_bundle(arch, weight_dtype)
    capsys.readouterr()  # what making the checkpoint and exporting the bundles printed, when this test makes them
    code = generate.main([str(bundle), "--prompt", "hello", "--max-new-tokens", "8", "--json", "--tau", "0.5"])
    out = capsys.readouterr()
    assert code == 0 and out.err.strip() == ""
    result = json.loads(out.out)
    assert 1 <= result["num_tokens"] <= 8 and result["num_forwards"] <= result["num_tokens"]
    # greedy agreement as recorded at export time, recomputed by the runtime
    config, ref_config = load_config(bundle), load_config(fp32)
    prompt = [5, 70, 80, 90, 100, 7]
    params = DecodeParams(tau=1.0, max_new_tokens=quantize.AGREEMENT_TOKENS)
    ids = Decoder(OnnxBackend(bundle, config), config).generate(prompt, params).token_ids
    ref = Decoder(OnnxBackend(fp32, ref_config), ref_config).generate(prompt, params).token_ids
    assert len(ids) >= 1 and quantize.common_prefix(ids, ref) <= len(ref)


def test_a_threshold_step_on_a_quantized_bundle_is_told_the_gate_is_float32_only(quantized_bundle):
    """The confidence gate exists only on float32 bundles: a step asked for confidence_tau on an int8 step graph is
    refused naming that and the two ways on (a float32 bundle, or no gate), not an export again, which adds none.
    The engine never asks (its threshold steps read the logits: test_runtime_runs_the_quantized_bundle)."""
    _, bundle = quantized_bundle("qwen3", "int8")
    config = load_config(bundle)
    backend = OnnxBackend(bundle, config)
    assert not backend.takes_confidence_gate
    cache = backend.make_cache(config.num_layers, config.num_kv_heads, config.head_dim, 16, config.dtype)
    cache.reserve(config.window)
    with pytest.raises(ValueError) as raised:
        run_batch(backend, cache, [[5] * config.window], config.pad_token_id, greedy_ids=True,
                  confidence_tau=np.full(1, 0.5, np.float32))
    message = str(raised.value)
    assert "exists only on float32 bundles and this one is int8" in message, message
    assert "use a float32 bundle (mars-export without --int8), or decode without the gate" in message
    assert "re-export" not in message


def test_output_head_can_stay_float32(tiny_bundle, tmp_path):
    _, fp32 = tiny_bundle("llama", 4)
    summary = quantize.quantize_step_graph(fp32 / "model.onnx", tmp_path / "m.onnx", "int4", include_lm_head=False)
    assert summary["lm_head_quantized"] is False and summary["num_quantized"] == 2 * 4
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    assert next(n for n in graph.node if "logits" in n.output).op_type == "MatMul"


def test_tied_output_head_is_untied_before_quantizing():
    """The dynamo graph of a tied model: logits = MatMul(h, Transpose(E)) and Gather(E, ids)."""
    helper = onnx.helper
    table = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 1000  # [V, K]
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["h"]),
         helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "Et"], ["logits"], name="head")],
        "g", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 4, 64])],
        [onnx.numpy_helper.from_array(table, "E")])
    quantize._untie(graph, graph.node[2])
    assert [n.op_type for n in graph.node] == ["Gather", "MatMul"]
    head = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}[graph.node[1].input[1]]
    np.testing.assert_array_equal(head, table.T)  # [K, V], its own constant; E stays for the Gather
    assert graph.node[0].input[0] == "E"


def test_a_head_behind_the_logit_soft_capping_is_quantized(tmp_path):
    """Gemma2 caps its logits after the tied head, cap · tanh(x / cap): the quantizer finds the head where the
    num_logits cut and the greedy head find it (mars_export.logits_rows.output_head), unties and quantizes it."""
    helper = onnx.helper
    table = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)  # [V, K]
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["h"]),
         helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "Et"], ["head"], name="head"),
         helper.make_node("Div", ["head", "cap"], ["scaled"]),
         helper.make_node("Tanh", ["scaled"], ["capped"]),
         helper.make_node("Mul", ["capped", "cap"], ["logits"])],
        "g", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 4, 64])],
        [onnx.numpy_helper.from_array(table, "E"), onnx.numpy_helper.from_array(np.array(30.0, np.float32), "cap")])
    src = tmp_path / "capped.onnx"
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]), str(src))
    summary = quantize.quantize_step_graph(src, tmp_path / "int8.onnx", "int8")
    assert summary["lm_head_quantized"] is True and summary["num_quantized"] == 1
    nodes = onnx.load(str(tmp_path / "int8.onnx")).graph.node
    assert [n.op_type for n in nodes] == ["Gather", "MatMulNBits", "Div", "Tanh", "Mul"]
    ids = np.array([[3, 17, 40, 63]], np.int64)
    session = ort.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"])
    want = 30 * np.tanh(table[ids] @ table.T / 30)  # [1, 4, V]
    np.testing.assert_allclose(session.run(None, {"ids": ids})[0], want, atol=0.5)


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error")]


@pytest.mark.parametrize("args, message", [
    (["--int4", "--int8"], "choose one precision, got --int8 and --int4"),
    (["--fp16", "--int4"], "choose one precision, got --fp16 and --int4"),
    (["--int8", "--trt"], "--int8 is a CPU (onnxruntime) export"),
    (["--int4", "--trt", "--graph", "fused"], "TensorRT builds its own precisions, drop --trt"),
    (["--int4", "--parity-tol", "0.1"], "use --min-top1 instead of --parity-tol"),
    (["--min-top1", "0.9"], "--min-top1 applies to --int8/--int4 exports only"),
    (["--int4", "--min-top1", "1.5"], "--min-top1 must be a fraction in [0, 1]"),
    (["--quant-block", "64"], "--quant-block applies to --int8/--int4 exports only"),
    (["--int8", "--quant-block", "48"], "--quant-block must be one of 16, 32, 64, 128, 256 (MatMulNBits), got 48"),
])
def test_bad_precision_flags(tiny_bundle, tmp_path, capsys, args, message):
    ckpt, _ = tiny_bundle("llama", 4)
    code = export_cli.main([str(ckpt), "-o", str(tmp_path / "b"), "--mask-token", "<mask>", *args])
    err = error_lines(capsys)
    assert code == 2 and len(err) == 1 and message in err[0]
    assert list(tmp_path.iterdir()) == []


def test_quant_block_sets_the_block_of_every_quantized_weight(tiny_bundle, tmp_path):
    """--quant-block 64: every MatMulNBits holds blocks of 64 along K, and the config records it."""
    ckpt, _ = tiny_bundle("llama", 4)
    bundle = export(str(ckpt), tmp_path / "bundle", 4, 4, "--mask-token", "<mask>", "--int8", "--quant-block", "64")
    nodes = nbits_nodes(bundle)
    assert len(nodes) == 2 * 4 + 1
    assert {onnx.helper.get_attribute_value(a) for n in nodes for a in n.attribute if a.name == "block_size"} == {64}
    assert load_config(bundle).parity["weights"]["block_size"] == 64


def test_a_small_context_measures_the_greedy_agreement_on_prompts_cut_to_fit(tmp_path):
    """A sliding-window model's bundle holds 48 positions (runtime.context), too few for the parity prompts and
    64 tokens: the greedy agreement generates half of what a window leaves, after the prompts cut to fit beside
    them (mars_export.parity.fit_prompts, which also cuts the parity's prompts to the windows that fit)."""
    ckpt = make_checkpoint("mistral", tmp_path / "ckpt", sliding_window=48)
    config = load_config(export(str(ckpt), tmp_path / "int8", 4, 4, "--mask-token", "<mask>", "--int8"))
    agreement = config.parity["greedy_vs_float32"]
    assert config.max_context == 48 and agreement["num_tokens"] == (48 - 4) // 2
    assert agreement["num_prompts"] == config.parity["num_prompts"] and agreement["mean_reference_tokens"] > 0


def test_agreement_below_floor_fails_and_leaves_nothing(tiny_bundle, tmp_path, capsys):
    ckpt, _ = tiny_bundle("llama", 4)
    out = tmp_path / "out" / "bundle"
    code = export_cli.main([str(ckpt), "-o", str(out), "--block", "4", "--mask-token", "<mask>", "--int4",
                            "--min-top1", "1"])
    err = error_lines(capsys)
    assert code == 2 and len(err) == 1 and "parity check failed for the int4 graph: top-1 agreement" in err[0]
    assert list(tmp_path.iterdir()) == []  # not the out/ folder the export made either
    # the tiny model's int4 agreement (0.92-0.97) is normal: below the floor asked for, not a broken quantization
    assert "is below the floor you asked for (--min-top1 1); it passes the default floor 0.5 of int4 exports" in err[0]
    assert err[0].endswith("lower --min-top1 to keep this export") and "broke the model" not in err[0]


@pytest.mark.parametrize("agreement, weights, min_top1, says", [
    (0.954, {"weight_dtype": "int8", "block_size": 32}, 1.0,
     "0.9540 over 348 positions (max |Δlogit| 0.5) is below the floor you asked for (--min-top1 1); it passes the "
     "default floor 0.9 of int8 exports, set to catch a broken graph, not as a quality mark"),
    (0.4, {"weight_dtype": "int8", "block_size": 32}, None,
     "0.4000 over 348 positions (max |Δlogit| 0.5) is below the default floor 0.9 of int8 exports, set to catch a "
     "broken graph, not as a quality mark (README \"Quantized exports\"): quantization broke the model; pass a lower "
     "--min-top1 to keep it on purpose"),
    (0.897, {"weight_dtype": "int8", "block_size": 128}, None,
     "quantization broke the model, or blocks of 128 (--quant-block) keep too little of it;"),
    (0.4, {"weight_dtype": "int4", "block_size": 32}, 0.6,
     "is below the floor you asked for (--min-top1 0.6) and below the default floor 0.5 of int4 exports too, set to "
     "catch a broken graph: quantization broke the model"),
    (0.7, {"weight_dtype": "int4", "block_size": 32, "gguf_imported": {"Q4_1": 7}, "gguf_requantized": {}}, None,
     "is below the default floor 0.8 of int4 exports holding a GGUF file's own blocks"),
], ids=["asked-floor", "default-floor", "default-floor-quant-block", "both-floors", "gguf-blocks"])
def test_a_failed_top1_floor_says_which_floor_and_calls_the_model_broken_only_below_the_default(agreement, weights,
                                                                                                  min_top1, says):
    """--int8 --min-top1 1 failed with "... < floor 1 ...; quantization broke the model" at 0.954, the normal int8
    figure. The default floor is set to catch a broken graph; only below it is the quantization called broken."""
    result = {"top1_agreement": agreement, "num_positions": 348, "max_abs_logit_diff": 0.5}
    with pytest.raises(ParityError) as failed:
        quantize.check_top1_floor(result, weights, min_top1)
    assert says in str(failed.value) and str(failed.value).startswith(
        f"parity check failed for the {weights['weight_dtype']} graph: top-1 agreement with the float32 PyTorch model")
    assert ("broke the model" in str(failed.value)) == (agreement < quantize.default_top1_floor(weights))
    quantize.check_top1_floor({**result, "top1_agreement": min_top1 or 0.95}, weights, min_top1)  # at the floor: passes


@pytest.mark.slow
def test_default_model_int4(tmp_path):
    """The default model in int4: about a quarter of the fp32 file, agreement within the recorded floor."""
    bundle = export("default", tmp_path / "bundle", 4, 4, "--int4")
    config = load_config(bundle)
    assert config.weight_dtype == "int4" and config.parity["top1_agreement"] >= quantize.MIN_TOP1_AGREEMENT["int4"]
    assert (bundle / "model.onnx").stat().st_size < 250e6

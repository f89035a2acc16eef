"""Tier 2: tiny checkpoints in the layout of the paper's published MARS checkpoints.

``config.json`` says ``model_type`` ``a2d-qwen2`` / ``a2d-qwen3`` (the authors' classes), the
tokenizer carries ``<|mask|>`` as its ``mask_token`` inside the padded embedding rows, and
the block size is only in the directory name (``...-blk4``). ``mars-export DIR`` with no
``--block`` and no ``--mask-token`` must export them as the Qwen2 / Qwen3 models they are:
tau = 1 token-identical to transformers' greedy ``generate`` of that class, and the
runtime equal to the PyTorch reference decoder at tau = 0.5.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from test_tiny_models import MAX_NEW, PROMPTS, assert_reference_and_runtime_agree, hf_greedy
from tiny_models import A2D_MASK_TOKEN, A2D_PADDED_VOCAB, make_a2d_checkpoint, make_checkpoint
from transformers import AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

from mars_export import cli as export_cli
from mars_export.block_size import block_size_from_name, resolve_block_size
from mars_export.model_source import load_model
from mars_export.parity import chat_prompt_ids
from runtime.bundle import load_config
from runtime.decode.decoder import Decoder, DecodeParams
from runtime.backends.onnx import OnnxBackend

# layout -> the transformers class the published weights are (the test's oracle, loaded
# directly: it does not go through the exporter's model-type mapping)
HF_CLASSES = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "qwen3-it": Qwen3ForCausalLM,
              "llama": LlamaForCausalLM}


def export_quietly(*argv: str) -> tuple[int, list[str]]:
    """Run mars-export in-process; return its exit code and stderr lines (progress bars dropped)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = export_cli.main(list(argv))
    return code, [line for line in err.getvalue().splitlines() if line and "%|" not in line]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Factory: layout -> (checkpoint, bundle, export log), the checkpoint named like the
    authors' (``MARS-...-blk4``) and exported with neither --block nor --mask-token."""
    made = {}

    def get(layout: str):
        if layout not in made:
            root = tmp_path_factory.mktemp(f"a2d-{layout}")
            ckpt = make_a2d_checkpoint(layout, root / f"MARS-tiny-{layout}-blk4")
            code, log = export_quietly(str(ckpt), "-o", str(root / "bundle"))
            assert code == 0, log
            made[layout] = ckpt, root / "bundle", log
        return made[layout]

    return get


def load(published, layout):
    ckpt, bundle, _ = published(layout)
    model = HF_CLASSES[layout].from_pretrained(ckpt).eval()
    config = load_config(bundle)
    return model, AutoTokenizer.from_pretrained(bundle), config, Decoder(OnnxBackend(bundle, config), config)


@pytest.mark.parametrize("layout", ["qwen2", "qwen3"])
def test_export_takes_block_from_name_and_mask_from_tokenizer(published, layout):
    ckpt, bundle, log = published(layout)
    config = load_config(bundle)
    mask_id = AutoTokenizer.from_pretrained(ckpt).mask_token_id
    assert log == ["block size 4 (from the directory name; pass --block to change)",
                   f"mask token {A2D_MASK_TOKEN!r} (id {mask_id}, the tokenizer's mask_token; pass --mask-token to change)"]
    assert (config.block_size, config.window) == (4, 4)
    assert (config.mask_token, config.mask_token_id) == (A2D_MASK_TOKEN, mask_id)
    assert mask_id < A2D_PADDED_VOCAB == config.vocab_size  # inside the padded rows: nothing was resized
    assert json.loads((ckpt / "config.json").read_text())["model_type"].startswith("a2d-")  # the source is untouched


@pytest.mark.parametrize("layout", ["qwen2", "qwen3"])
def test_tau_one_equals_transformers_generate(published, layout):
    model, tokenizer, config, decoder = load(published, layout)
    for text in PROMPTS:
        ids = chat_prompt_ids(tokenizer, text)
        result = decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW))
        assert result.token_ids == hf_greedy(model, ids, MAX_NEW, config.mask_token_id)
        assert result.tpf == 1.0


@pytest.mark.parametrize("layout", ["qwen2", "qwen3"])
def test_reference_and_runtime_agree_at_tau_half(published, layout):
    assert_reference_and_runtime_agree(*load(published, layout))


@pytest.mark.parametrize("layout", sorted(HF_CLASSES))
def test_every_published_model_type_loads_as_its_transformers_class(tmp_path, layout):
    """Also the authors' Qwen3 instruct type (a2d-qwen3-it) and dllm's a2d-llama: same weights."""
    ckpt = make_a2d_checkpoint(layout, tmp_path / "ckpt")
    loaded = load_model(str(ckpt))
    expected = HF_CLASSES[layout].from_pretrained(ckpt)
    assert type(loaded.model) is HF_CLASSES[layout]
    assert (loaded.mask_token, loaded.mask_token_origin) == (A2D_MASK_TOKEN, "the tokenizer's mask_token")
    for name, tensor in expected.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name


def test_mask_token_flag_overrides_the_tokenizer(tmp_path):
    """A new token takes the first padding row: the embedding keeps its A2D_PADDED_VOCAB rows."""
    ckpt = make_a2d_checkpoint("qwen2", tmp_path / "ckpt")
    loaded = load_model(str(ckpt), "<new_mask>")
    assert (loaded.mask_token, loaded.mask_token_origin) == ("<new_mask>", "--mask-token")
    assert loaded.mask_token_id == len(loaded.tokenizer) - 1 < A2D_PADDED_VOCAB
    assert loaded.model.get_input_embeddings().num_embeddings == A2D_PADDED_VOCAB


def test_no_block_size_anywhere_is_one_error_line(tmp_path):
    ckpt = make_a2d_checkpoint("qwen2", tmp_path / "ckpt")
    code, log = export_quietly(str(ckpt), "-o", str(tmp_path / "b"))
    assert code == 2 and len(log) == 1
    assert log[0].startswith("error: ") and "records no block size" in log[0] and "pass --block B" in log[0]
    assert not (tmp_path / "b").exists()


def test_block_flag_wins_over_the_name(tmp_path):
    ckpt = make_a2d_checkpoint("qwen2", tmp_path / "MARS-tiny-blk4")
    code, log = export_quietly(str(ckpt), "-o", str(tmp_path / "b"), "--block", "2")
    assert code == 0 and not any(line.startswith("block size") for line in log)
    assert load_config(tmp_path / "b").block_size == 2


def test_mars_train_output_exports_with_what_it_records(tmp_path):
    """A plain checkpoint whose config.json records mask token and block size, as
    ``mars-train`` writes it (tests/training/test_training_cli.py checks those fields)."""
    ckpt = make_checkpoint("llama", tmp_path / "run")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(mars_mask_token="<mask>", mars_mask_token_id=258, mars_block_size=2)
    (ckpt / "config.json").write_text(json.dumps(config))
    code, log = export_quietly(str(ckpt), "-o", str(tmp_path / "b"))
    assert code == 0
    assert log == ["block size 2 (recorded with the model; pass --block to change)",
                   "mask token '<mask>' (id 258, recorded with the model; pass --mask-token to change)"]
    assert (load_config(tmp_path / "b").block_size, load_config(tmp_path / "b").mask_token_id) == (2, 258)


@pytest.mark.parametrize("path, expected", [
    ("MARS-Qwen2.5-0.5B-blk4", (4, "MARS-Qwen2.5-0.5B-blk4")),
    ("MARS-Qwen2.5-0.5B-blk8-no-sft", (8, "MARS-Qwen2.5-0.5B-blk8-no-sft")),
    ("hub/models--Xalphinions--MARS-Qwen2.5-7B-blk16/snapshots/0123abc",
     (16, "models--Xalphinions--MARS-Qwen2.5-7B-blk16")),
    ("lr-5e-6-ep-5-seq512-blk4/checkpoint-final", (4, "lr-5e-6-ep-5-seq512-blk4")),
    ("MARS-Qwen2.5-0.5B-blk4-v2", (4, "MARS-Qwen2.5-0.5B-blk4-v2")),  # a word anywhere (README)
    ("MARS-Qwen2.5-0.5B-AR-SFT", None),
    ("myblk4", None),
])
def test_block_size_from_name(tmp_path, path, expected):
    assert block_size_from_name(tmp_path / path) == expected


@pytest.mark.parametrize("name, message", [
    ("X-blk0", "the name 'X-blk0' gives block size 0 (blk0), but a block size must be >= 1: pass --block B"),
    ("blk4-vs-blk8", "the name 'blk4-vs-blk8' gives 2 block sizes (blk4, blk8): pass --block B"),
])
def test_unusable_block_size_in_the_name_is_refused_naming_it(tmp_path, name, message):
    ckpt = make_a2d_checkpoint("qwen2", tmp_path / name)
    code, log = export_quietly(str(ckpt), "-o", str(tmp_path / "b"))
    assert code == 2 and len(log) == 1 and log[0].startswith(f"error: {message}"), log
    assert resolve_block_size(4, str(ckpt)) == (4, "--block")  # --block still wins


def test_unknown_a2d_model_type_lists_the_supported_families(tmp_path):
    ckpt = make_a2d_checkpoint("qwen2", tmp_path / "MARS-tiny-blk4")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "a2d-mistral"}))
    code, log = export_quietly(str(ckpt), "-o", str(tmp_path / "b"), "--block", "4")
    assert code == 2 and len(log) == 1, log
    assert "model type 'a2d-mistral' is a MARS authors' (a2d-*) family that mars-export does not know; " \
           "supported: a2d-llama, a2d-qwen2, a2d-qwen3, a2d-qwen3-it" in log[0]
    assert not (tmp_path / "b").exists()


def test_block_origin_names_the_directory_it_read(tmp_path):
    snapshot = tmp_path / "models--org--m-blk8" / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    assert resolve_block_size(None, str(snapshot)) == (8, "from the directory name 'models--org--m-blk8' above it")
    assert resolve_block_size(3, str(snapshot)) == (3, "--block")
    assert resolve_block_size(None, "default-mars") == (4, "recorded with the model")

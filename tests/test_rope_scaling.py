"""Rope scaling types x graph kinds: a bundle's logits are transformers' at every position it holds, past the
original context too, or the export is refused, naming the rope type, before it writes anything.

Tiny random models with ``max_position_embeddings`` 256 and, for yarn, llama3 and longrope, an original context
of 64; rope_theta 100, so that every frequency turns within the context and a wrong one shows in the logits.
transformers' linear, yarn and llama3 frequencies do not depend on the sequence, dynamic NTK rescales only past
``max_position_embeddings`` (the bundle's context: below it, the default rope), and longrope switches to its long
factors past the original context, which caps the bundle's context (runtime.context, tests/test_longrope.py).
"""

from __future__ import annotations

import pytest
import torch
from support import export
from tiny_models import make_checkpoint

from mars_export import fused_graph
from mars_export.cli import main as export_main
from mars_export.model_source import load_checkpoint
from mars_export.parity import measure_parity
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config

MAX_POSITIONS, ORIGINAL, THETA = 256, 64, 100.0
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    # beta_fast 2 keeps the correction range inside the tiny head's 8 frequencies
    "yarn": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 2.0, "beta_slow": 1.0,
             "original_max_position_embeddings": ORIGINAL},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                 "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [4.0 + 2.0 * i for i in range(8)]},
}


def make_rope_checkpoint(arch: str, rope: str, directory):
    """A tiny ``arch`` model with ``ROPES[rope]`` scaling; for Gemma3 on its full_attention layer (one sliding
    layer beside it, the default rope, a window wider than the context)."""
    settings = {**ROPES[rope], "rope_theta": THETA}
    if arch == "gemma3_text":
        return make_checkpoint(arch, directory, max_context=MAX_POSITIONS, sliding_window=2 * MAX_POSITIONS,
                               layer_types=["sliding_attention", "full_attention"],
                               rope_parameters={"full_attention": settings,
                                                "sliding_attention": {"rope_type": "default", "rope_theta": THETA}})
    return make_checkpoint(arch, directory, max_context=MAX_POSITIONS, rope_parameters=settings)


def max_logit_diff_over_the_context(checkpoint, bundle) -> float:
    """Max |Δlogit| between the bundle and transformers over one sequence as long as the bundle's context, fed W
    tokens at a time (:func:`mars_export.parity.measure_parity`)."""
    config = load_config(bundle)
    model, _ = load_checkpoint(checkpoint)
    ids = torch.randint(0, 256, (config.max_context,), generator=torch.Generator().manual_seed(0)).tolist()
    return measure_parity(model, OnnxBackend(bundle, config), config, [ids])["max_abs_logit_diff"]


@pytest.mark.parametrize("arch, rope", [("llama", "linear"), ("llama", "dynamic"), ("llama", "yarn"),
                                        ("llama", "llama3"), ("gemma3_text", "dynamic")])
def test_the_step_graph_is_transformers_over_the_whole_context(arch, rope, tmp_path):
    """Gemma3 holds its rope types per layer type: its dynamic full_attention layer runs as the default rope too
    (the export failed with an AttributeError on the per-layer-type rotary embedding before)."""
    checkpoint = make_rope_checkpoint(arch, rope, tmp_path / "ckpt")
    bundle = export(str(checkpoint), tmp_path / "step", 4, 4, "--mask-token", "<mask>")
    assert load_config(bundle).max_context == MAX_POSITIONS
    assert max_logit_diff_over_the_context(checkpoint, bundle) <= 1e-4


@pytest.mark.parametrize("arch, rope", [("llama", "llama3"), ("llama", "dynamic"), ("qwen2", "linear"),
                                        ("qwen2", "dynamic")])
def test_the_fused_graph_is_transformers_over_the_whole_context(arch, rope, tmp_path):
    """The rope types the model builder computes as transformers does (FUSED_ROPE_TYPES); dynamic NTK is given to it
    as the default rope (its Qwen2 refused dynamic with NotImplementedError before)."""
    checkpoint = make_rope_checkpoint(arch, rope, tmp_path / "ckpt")
    bundle = export(str(checkpoint), tmp_path / "fused", 4, 4, "--mask-token", "<mask>", "--graph", "fused")
    assert load_config(bundle).max_context == MAX_POSITIONS
    assert max_logit_diff_over_the_context(checkpoint, bundle) <= 1e-4


@pytest.mark.parametrize("arch, rope, message", [
    ("llama", "linear", "linear rope scaling as transformers does on a llama model (it does: default, dynamic, "
                        "llama3)"),
    ("llama", "yarn", "yarn rope scaling"),  # the builder's Llama writes it as the default rope: parity failed
    ("llama", "longrope", "longrope rope scaling"),
    ("qwen2", "yarn", "yarn rope scaling as transformers does on a qwen2 model (it does: default, dynamic, linear)"),
    ("qwen2", "llama3", "llama3 rope scaling"),  # the builder refused it after the model was saved for it
    ("gemma3_text", "linear", "rope settings per layer type (full_attention linear, sliding_attention default)"),
], ids=["llama-linear", "llama-yarn", "llama-longrope", "qwen2-yarn", "qwen2-llama3", "gemma3-per-layer"])
def test_the_fused_graph_refuses_a_rope_the_builder_computes_otherwise_before_writing(arch, rope, message, tmp_path,
                                                                                      monkeypatch, capsys):
    """One error line naming the rope type, what the builder does compute and the step graph; the builder never
    runs and no folder is made for -o. Before, these exports failed parity (the builder's Llama writes linear,
    yarn and longrope as the default rope; its Qwen2 rounds yarn's correction range otherwise: on a real model
    off by radians past the original context, maybe within parity on its short prompts) or in the builder."""
    checkpoint = make_rope_checkpoint(arch, rope, tmp_path / "ckpt")
    monkeypatch.setattr(fused_graph.subprocess, "run", lambda *args, **kwargs: pytest.fail("the builder ran"))
    code = export_main([str(checkpoint), "-o", str(tmp_path / "out" / "fused"), "--block", "4", "--mask-token",
                        "<mask>", "--graph", "fused"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert code == 2 and len(errors) == 1 and message in errors[0] and errors[0].endswith("--graph step")
    assert not (tmp_path / "out").exists()

"""Export the step graph to ONNX with torch's dynamo exporter (opset 18).

Batch, KV cache capacity S and window length are dynamic axes; the KV outputs have the
inputs' shapes (the cache with the window's entries written in place, :mod:`mars_export.step_module`).
The runtime decodes with the bundle's window W and prefills with longer windows; TensorRT
engines fix W in their optimization profile.
I/O names come from :mod:`runtime.bundle`, the one place they are defined.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import torch
from torch.export import Dim
from transformers import PreTrainedModel

from mars_export.confidence_gate import add_confidence_gate
from mars_export.fuse_projections import fuse_shared_input_matmuls
from mars_export.greedy_head import add_greedy_head
from mars_export.logits_rows import compute_logits_of_last_rows
from mars_export.step_module import StepModule, step_graph_model
from runtime import bundle

OPSET = 18
_EXAMPLE_BATCH, _EXAMPLE_PAST = 2, 5


def max_window(max_context: int) -> int:
    """The largest decode window W whose step graph traces at ``max_context`` positions: the traced example
    holds ``_EXAMPLE_PAST`` past positions before the window, and its cache (past + W) must lie within the
    graph's ``max_context`` bound of the past axis."""
    return max_context - _EXAMPLE_PAST


def export_step_graph(model: PreTrainedModel, path: Path, window: int, max_context: int,
                      greedy_mask_token: int | None = None) -> None:
    """Write the step graph of ``model`` to ``path`` (``window``: the bundle's W, the example length).

    Weights go to external data next to ``path`` (``path`` + ``.data``) when the graph's initializers are over
    torch's threshold for it (1.5 GiB, ``ONNXProgram.save``). The
    projections that share an input (Q/K/V, gate/up) are fused into one MatMul each
    (:mod:`mars_export.fuse_projections`); the output head runs on the window's last
    ``num_logits`` rows (:mod:`mars_export.logits_rows`). ``greedy_mask_token``: add the greedy head
    (:mod:`mars_export.greedy_head`, ``num_greedy`` defaulting to 0), which never returns that token, and its
    confidence gate (:mod:`mars_export.confidence_gate`, ``confidence_tau`` defaulting to never skipping the head);
    None: none (fp16, graphs to be quantized, and graphs for TensorRT, whose parser has no ``MatMulNBits``).

    Raises:
        RuntimeError: the exporter failed (the message names the torch.export step).
    """
    cfg = model.config
    num_layers, num_kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    batch, past = Dim("batch", min=1, max=1024), Dim("past", min=1, max=max_context)
    length = Dim("window", min=1, max=max_context)
    # The example needs W >= 2: torch.export specializes a dimension whose example size is 1. The mask's last
    # axis is the cache's (S): one symbol, so the graph and TensorRT profiles know they are equal.
    example = _example_inputs(cfg.vocab_size, num_layers, num_kv_heads, head_dim, max(window, 2), model.dtype)
    kv_shapes = [({0: batch, 2: past}, {0: batch, 2: past}) for _ in range(num_layers)]
    dynamic_shapes = {"input_ids": {0: batch, 1: length}, "position_ids": {0: batch, 1: length},
                      "attention_mask": {0: batch, 2: length, 3: past}, "past": kv_shapes}
    # The exporter narrates each pass on stdout and warns about unrelated optional packages
    # (torchvision) and deprecations; the bundle's parity check is what reports on the result.
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), _quiet("torch.onnx"), \
            step_graph_model(model):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            StepModule(model).eval(), example, dynamo=True, dynamic_shapes=dynamic_shapes,
            input_names=bundle.input_names(num_layers), output_names=bundle.output_names(num_layers),
            opset_version=OPSET, optimize=True)
    fuse_shared_input_matmuls(program.model.graph)
    compute_logits_of_last_rows(program.model.graph)  # the num_logits input: prefill skips the output head
    if greedy_mask_token is not None:
        screening = add_greedy_head(program.model.graph, greedy_mask_token, has_default=True)
        if screening is not None:  # threshold steps skip the float32 head where every tau test provably fails
            add_confidence_gate(program.model.graph, screening, greedy_mask_token)
    program.save(str(path))  # external data above torch's threshold (1.5 GiB of initializers, the greedy head's included)


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _example_inputs(vocab: int, num_layers: int, num_kv_heads: int, head_dim: int, window: int, dtype):
    b, p = _EXAMPLE_BATCH, _EXAMPLE_PAST
    input_ids = torch.randint(0, vocab, (b, window))  # [B, W]
    position_ids = torch.arange(p, p + window).repeat(b, 1)  # [B, W]
    mask = torch.ones(b, 1, window, p + window, dtype=torch.bool).tril(p)  # [B, 1, W, S]: S = P + W, room for W
    past = [(torch.zeros(b, num_kv_heads, p + window, head_dim, dtype=dtype),
             torch.zeros(b, num_kv_heads, p + window, head_dim, dtype=dtype)) for _ in range(num_layers)]
    return input_ids, position_ids, mask, past


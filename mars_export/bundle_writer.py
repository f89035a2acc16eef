"""Write a complete bundle directory (DESIGN.md §5), atomically.

Everything is written into a hidden temporary directory beside the target and renamed
into place only after the parity check passes, so a failed export leaves no
half-written bundle (nor the empty folders it made above it) and never touches an existing one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from mars_export.context import max_context_of
from mars_export.fused_graph import check_builder_accepts, write_fused_graph
from mars_export.model_source import LoadedModel
from mars_export.onnx_export import export_step_graph, max_window
from mars_export.output_dir import (
    check_output_dir,
    landing_path,
    make_parent_folders,
    partial_prefix,
    remove_empty_folders,
    remove_stale_partials,
)
from mars_export.parity import check_parity, measure_parity, parity_prompts
from mars_export.quantize import WEIGHT_BITS, quantize_and_check
from mars_export.step_module import prepare_fp16_model
from runtime.bundle import (
    CONFIG_FILE,
    ENGINE_FILE,
    ONNX_FILE,
    BundleConfig,
    BundleError,
)
from runtime.backends.onnx import PROVIDERS, OnnxBackend, ort


def prepare_config(loaded: LoadedModel, block_size: int, window: int, dtype: str = "float32") -> BundleConfig:
    """The bundle config for ``loaded`` exported in ``dtype`` (parity not yet measured); its ``max_context``
    is the model's, capped to a sliding attention window or a longrope model's original context
    (:func:`mars_export.context.max_context_of`).

    Raises:
        BundleError: the model attends bidirectionally (``use_bidirectional_attention``), block_size not in
            1..window, the window leaves no room in the context for the traced example's past
            (:func:`mars_export.onnx_export.max_window`), or the model lacks an end token.
    """
    cfg, tok = loaded.model.config, loaded.tokenizer
    if getattr(cfg, "use_bidirectional_attention", False):
        raise BundleError(f"{loaded.source}: the model attends bidirectionally (use_bidirectional_attention: true "
                          "in its config, e.g. an embedding model): each token sees later ones, which the graphs, "
                          "decoding causally over a KV cache, cannot compute; no flag changes this, export a "
                          "causal model")
    max_context, _ = max_context_of(cfg)
    check_window_fits(window, max_context)
    eos = loaded.model.generation_config.eos_token_id
    eos_ids = sorted({*(eos if isinstance(eos, list) else [eos]), tok.eos_token_id} - {None})
    return BundleConfig(
        block_size=block_size, window=window, mask_token=loaded.mask_token, mask_token_id=loaded.mask_token_id,
        eos_token_ids=tuple(eos_ids), pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0],
        bos_token_id=tok.bos_token_id, num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        vocab_size=loaded.model.get_output_embeddings().weight.shape[0], max_context=max_context,
        dtype=dtype, source_model=loaded.source)


def check_window_fits(window: int, max_context: int, named: str | None = None, flag: str = "--window") -> None:
    """Refuse a window W that leaves no room in the context for the past the export traces the graph with
    (:func:`mars_export.onnx_export.max_window`).

    Args:
        named: how the message names the window (default ``--window W``); ``flag``: the option to lower. A window
            that defaults to the block size is named by what set that (``--block B (the window W defaults to B)``).

    Raises:
        BundleError: ``window`` above ``max_window(max_context)``.
    """
    if window > max_window(max_context):
        raise BundleError(f"{named or f'--window {window}'} must be smaller than the model's context of {max_context} "
                          f"tokens by at least {max_context - max_window(max_context)} (the past the export traces "
                          f"the graph with): use {flag} {max_window(max_context)} or less")


def write_bundle(loaded: LoadedModel, out_dir: str | Path, block_size: int, window: int,
                 parity_tolerance: float, overwrite: bool = False, dtype: str = "float32",
                 trt_options=None, weight_dtype: str | None = None, min_top1: float | None = None,
                 graph: str = "step", quant_block: int | None = None) -> BundleConfig:
    """Export ``loaded`` to ``out_dir``: step graph, tokenizer files, config with parity results.

    On any failure the partial directory is removed, and so are the folders above ``out_dir`` that the export
    made and that are still empty (:func:`mars_export.output_dir.make_parent_folders`).

    Args:
        dtype: ``"float32"``, or ``"float16"`` for fp16 weights, activations and KV with
            float32 logits (:func:`~mars_export.step_module.prepare_fp16_model`); parity is
            always measured against the float32 PyTorch model.
        trt_options: a :class:`runtime.trt_build.TrtBuildOptions` to also build
            ``engine.plan`` with TensorRT (needs a GPU); None builds no engine.
        weight_dtype: ``"int8"`` or ``"int4"`` for weight-only quantized MatMuls over a
            float32 graph (:mod:`mars_export.quantize`; CPU parity only), gated on top-1
            agreement >= ``min_top1`` instead of ``parity_tolerance``; None keeps ``dtype``.
        graph: ``"step"`` (our step graph) or ``"fused"`` (onnxruntime-genai's model-builder graph,
            :mod:`mars_export.fused_graph`; batch 1, CPU, float32, int8 or int4).
        quant_block: with ``weight_dtype``, weights per quantization block along K (None: the dtype's
            :data:`mars_export.quantize.BLOCK_SIZE`).

    Raises:
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ValueError: ``out_dir`` may not be written (:func:`mars_export.output_dir.check_output_dir`: a file, a
            symbolic link, the model's own files, or a directory that is neither a bundle nor empty).
        ParityError: a backend disagrees with PyTorch beyond ``parity_tolerance``.
        BundleError: a bidirectional model, invalid block size / window (:func:`prepare_config`).
        ValueError: with ``graph`` ``"fused"``, a model the model builder fails on or computes otherwise than
            transformers (its rope scaling: :func:`mars_export.fused_graph.check_builder_accepts`), before anything
            is written.
        OSError: the bundle cannot be written (no permission, a full disk).
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, list(loaded.source_paths), overwrite)
    config = prepare_config(loaded, block_size, window, dtype)
    config = replace(config, weight_dtype=weight_dtype, graph=graph)
    if graph == "fused":
        check_builder_accepts(loaded.model.config)  # before anything is written
    target = landing_path(out_dir)  # -o a/new/../../x is x: no a/new made to pass through
    made = make_parent_folders(target)  # removed again, where still empty, should the export fail
    tmp = None
    try:
        remove_stale_partials(target)
        tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(target), dir=target.parent))
        if graph == "fused":
            quantized = weight_dtype is not None
            write_fused_graph(loaded.model, loaded.tokenizer, tmp / ONNX_FILE, fuse_projections=quantized,  # pays in int8
                              greedy_mask_token=None if quantized else config.mask_token_id)
        else:
            graph_model = prepare_fp16_model(loaded.model) if dtype == "float16" else loaded.model
            # the greedy head: float32 graphs that onnxruntime runs as they are (not quantized, no TensorRT engine)
            greedy = dtype == "float32" and weight_dtype is None and trt_options is None
            export_step_graph(graph_model, tmp / ONNX_FILE, window, config.max_context,
                              greedy_mask_token=config.mask_token_id if greedy else None)
            del graph_model
        loaded.tokenizer.save_pretrained(tmp)
        prompts = parity_prompts(loaded.tokenizer)
        if config.weight_dtype in WEIGHT_BITS:
            parity = quantize_and_check(loaded, tmp, config, prompts, min_top1, quant_block)
        else:
            parity = {**measure_parity(loaded.model, OnnxBackend(tmp, config), config, prompts),
                      "backend": "onnxruntime-cpu", "tolerance": parity_tolerance}
            check_parity(parity, parity_tolerance)
        if trt_options is not None:
            from runtime.trt_build import build_engine
            build_engine(tmp / ONNX_FILE, tmp / ENGINE_FILE, config, trt_options)
            config = replace(config, engine_file=ENGINE_FILE)
        parity = _measure_gpu(loaded, tmp, config, prompts, parity)
        config = replace(config, parity=parity)
        (tmp / CONFIG_FILE).write_text(config.to_json())
        check_output_dir(out_dir, list(loaded.source_paths), overwrite)  # again: the export took a while
        _replace_dir(tmp, target)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_empty_folders(made)
        raise
    return config


def _measure_gpu(loaded: LoadedModel, bundle_dir: Path, config: BundleConfig, prompts: list[list[int]],
                 parity: dict) -> dict:
    """Add parity on onnxruntime CUDA and on the TensorRT engine, where they exist, under
    ``"backends"`` of the CPU ``parity``; raise if any is past the same tolerance.
    Quantized (int8/int4) and fused bundles are measured on CPU only."""
    others = {}
    if config.weight_dtype in WEIGHT_BITS or config.graph == "fused":
        return parity
    if PROVIDERS["cuda"] in ort.get_available_providers():
        others["onnxruntime-cuda"] = measure_parity(loaded.model, OnnxBackend(bundle_dir, config, "cuda"),
                                                    config, prompts)
    if config.engine_file is not None:
        from runtime.backends.trt import TrtBackend
        others["tensorrt"] = measure_parity(loaded.model, TrtBackend(bundle_dir, config), config, prompts)
    for name, result in others.items():
        check_parity({**result, "backend": name}, parity["tolerance"])
    return {**parity, "backends": others} if others else parity


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``, replacing an existing ``dst`` (a directory, checked by
    :func:`~mars_export.output_dir.check_output_dir`) only once ``src`` is complete."""
    src.chmod(0o755)  # mkdtemp creates it private
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old)
    else:
        os.replace(src, dst)

"""Write a complete bundle directory (DESIGN.md §5), atomically.

Everything is written into a hidden temporary directory beside the target and renamed
into place only after the parity check passes, so a failed export leaves no
half-written bundle and never touches an existing one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mars_export.model_source import LoadedModel
from mars_export.onnx_export import export_step_graph
from mars_export.parity import check_parity, measure_parity, parity_prompts
from runtime.bundle import CONFIG_FILE, ONNX_FILE, BundleConfig, BundleError
from runtime.onnx_backend import OnnxBackend


def prepare_config(loaded: LoadedModel, block_size: int, window: int) -> BundleConfig:
    """The bundle config for ``loaded`` (parity not yet measured).

    Raises:
        BundleError: block_size not in 1..window, the window exceeds the model's context,
            or the model lacks an end token.
    """
    cfg, tok = loaded.model.config, loaded.tokenizer
    if window >= cfg.max_position_embeddings:
        raise BundleError(f"--window {window} must be smaller than the model's context of "
                          f"{cfg.max_position_embeddings} tokens")
    eos = loaded.model.generation_config.eos_token_id
    eos_ids = sorted({*(eos if isinstance(eos, list) else [eos]), tok.eos_token_id} - {None})
    return BundleConfig(
        block_size=block_size, window=window, mask_token=loaded.mask_token, mask_token_id=loaded.mask_token_id,
        eos_token_ids=tuple(eos_ids), pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0],
        bos_token_id=tok.bos_token_id, num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        vocab_size=loaded.model.get_output_embeddings().weight.shape[0], max_context=cfg.max_position_embeddings,
        dtype="float32", source_model=loaded.source)


def write_bundle(loaded: LoadedModel, out_dir: str | Path, block_size: int, window: int,
                 parity_tolerance: float, overwrite: bool = False) -> BundleConfig:
    """Export ``loaded`` to ``out_dir``: step graph, tokenizer files, config with parity results.

    Raises:
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ParityError: the graph disagrees with PyTorch beyond ``parity_tolerance``.
        BundleError: invalid block size / window.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; choose another -o or pass --force to replace it")
    config = prepare_config(loaded, block_size, window)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        export_step_graph(loaded.model, tmp / ONNX_FILE, window, config.max_context)
        loaded.tokenizer.save_pretrained(tmp)
        backend = OnnxBackend(tmp, config)
        parity = measure_parity(loaded.model, backend, config, parity_prompts(loaded.tokenizer))
        parity["tolerance"] = parity_tolerance
        check_parity(parity, parity_tolerance)
        config = BundleConfig(**{**config.__dict__, "parity": parity})
        (tmp / CONFIG_FILE).write_text(config.to_json())
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return config


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``, replacing an existing ``dst`` only once ``src`` is complete."""
    src.chmod(0o755)  # mkdtemp creates it private
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old)
    else:
        os.replace(src, dst)

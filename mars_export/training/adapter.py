"""Write a trained LoRA adapter in the layout ``default-mars`` ships (``mars_export/data/smollm2-135m-mars``).

The layout: peft's ``adapter_config.json``, the weights as float16 safetensors (half the
size; peft casts them back when the adapter is loaded or merged), and ``mars_adapter.json``
with the mask token, block size and how the adapter was trained. ``mars-train --lora-init``
continues such an adapter and :func:`mars_export.model_source.merge_adapter` merges it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mars_export.model_source import ADAPTER_INFO_FILE

ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def write_shipped_adapter(adapter_dir: Path, out: Path, info: dict, base_model_name: str) -> Path:
    """Copy the peft adapter in ``adapter_dir`` to ``out`` as float16, with ``mars_adapter.json``.

    Args:
        adapter_dir: a directory peft's ``save_pretrained`` wrote (config + safetensors).
        info: written as ``mars_adapter.json``; must hold ``mask_token`` and ``block_size``.
        base_model_name: recorded as ``base_model_name_or_path`` (the training machine's path means nothing elsewhere).

    Raises:
        ValueError: ``info`` lacks ``mask_token`` or ``block_size``.
    """
    if not {"mask_token", "block_size"} <= set(info):
        raise ValueError(f"{ADAPTER_INFO_FILE} needs 'mask_token' and 'block_size', got {sorted(info)}")
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((adapter_dir / ADAPTER_CONFIG_FILE).read_text())
    config["base_model_name_or_path"] = base_model_name
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    weights = load_file(adapter_dir / ADAPTER_WEIGHTS_FILE)
    save_file({k: v.to(torch.float16) for k, v in weights.items()}, out / ADAPTER_WEIGHTS_FILE)
    (out / ADAPTER_INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return out

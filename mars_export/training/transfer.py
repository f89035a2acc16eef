"""Carry a model's weights, bit-exactly, to a training machine that receives files in size-limited parts.

The sending side (:func:`prepare_parts`) writes the weights as one byte stream cut into
numbered part directories, each with ``part.json`` (the sha256 of every file in it).
Part 1 also holds ``manifest.json`` (how to decode each tensor and the sha256 of its
float32 bytes) and the checkpoint's other files (config, tokenizer). The receiving side
(:func:`receive_part`, then :func:`assemble_checkpoint`) checks every file, rebuilds each
tensor and refuses any whose bytes differ from the sending side's checkpoint.

Two encodings:
- ``F32``: the tensor's float32 bytes (any checkpoint);
- GGUF blocks (``Q4_1``, ``Q8_0``, ...): for the default model, which *is* a dequantized
  Q4_1 GGUF (:mod:`mars_export.default_model`), the GGUF's own blocks (94 MiB instead of
  538 MB). They are decoded by ``gguf.quants.dequantize`` (the function transformers uses
  to load GGUF files), so part 1 carries the pure-Python ``gguf`` package, and q/k
  projections get transformers' reverse RoPE permutation (recorded as ``permute_heads``).

The receiving side needs only numpy, torch and safetensors (and ``gguf``, which it is sent).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MIB = 1 << 20
MAX_CARRY_BYTES = 64 * MIB  # the most one device command receives, all carried files together
MANIFEST_FILE, PART_FILE, WEIGHTS_FILE = "manifest.json", "part.json", "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's: its weight_map names each tensor's shard
CHECKPOINT_DIR, PYTHON_DIR = "checkpoint", "python"


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a float32 tensor's bytes (C order)."""
    return sha256_bytes(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())


def permute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, as transformers does when it loads a GGUF
    (``LlamaTensorProcessor._reverse_permute_weights``): ``[out, in]`` rows regrouped per head."""
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])  # [H, D/2, 2, in]
    return w.swapaxes(2, 1).reshape(weights.shape)


def decode_tensor(data: bytes, entry: dict) -> torch.Tensor:
    """The float32 tensor of one manifest entry from its encoded bytes."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if entry["qtype"] == "F32":
        values = raw.view(np.float32)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        values = dequantize(raw, GGMLQuantizationType[entry["qtype"]])
    values = values.reshape(entry["shape"])
    if entry.get("permute_heads"):
        values = permute_rope_rows(values, entry["permute_heads"])
    return torch.from_numpy(np.array(values, dtype=np.float32, order="C"))  # a writable copy


def _gguf_blocks(gguf_path: Path, names: list[str], config: dict) -> dict[str, tuple[str, bytes, int | None]]:
    """name -> (GGUF type name, block bytes, permute heads) for every checkpoint tensor."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    by_name = {t.name: t for t in reader.tensors}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    blocks = {}
    for name in names:
        tensor = by_name[name_map.get_name(name, try_suffixes=(".weight", ".bias"))]
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        permute = next((h for key, h in heads.items() if f".{key}." in name), None)
        blocks[name] = tensor.tensor_type.name, bytes(tensor.data), permute
    return blocks


def read_weights(checkpoint: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors of a checkpoint directory's safetensors weights and the names of the files they were read from:
    ``model.safetensors``, or the shards that ``model.safetensors.index.json`` names (as transformers writes a
    larger model; no library returns a sharded checkpoint's tensors without a model to load them into).

    Raises:
        ValueError: one line: no such directory, no safetensors weights there (torch ``.bin`` weights only, say),
            an index that is no JSON with a ``weight_map``, or shards it names that are not there.
    """
    if not checkpoint.is_dir():
        raise ValueError(f"{checkpoint}: no such directory; give a Hugging Face checkpoint directory")
    if (checkpoint / WEIGHTS_FILE).is_file():
        return load_file(checkpoint / WEIGHTS_FILE), [WEIGHTS_FILE]
    if not (checkpoint / INDEX_FILE).is_file():
        why = "torch .bin weights only" if any(checkpoint.glob("pytorch_model*.bin")) else \
            f"no safetensors weights ({WEIGHTS_FILE}, or {INDEX_FILE} and its shards)"
        raise ValueError(f"{checkpoint} holds {why}; save the model there with transformers' save_pretrained")
    try:
        shards = sorted(set(json.loads((checkpoint / INDEX_FILE).read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or not its layout
        raise ValueError(f"{checkpoint / INDEX_FILE} is no safetensors index (JSON with a weight_map)") from e
    missing = [str(shard) for shard in shards if str(shard) != Path(str(shard)).name  # a file in the directory
               or not (checkpoint / str(shard)).is_file()]
    if missing:
        raise ValueError(f"{checkpoint / INDEX_FILE} names shards that are not there: {', '.join(missing)}")
    tensors = {}
    for shard in shards:
        tensors.update(load_file(checkpoint / shard))
    return tensors, [INDEX_FILE, *shards]


def prepare_parts(checkpoint: Path, out_dir: Path, max_part_bytes: int, gguf_path: Path | None = None,
                  extra_files: dict[str, Path] | None = None) -> list[Path]:
    """Write ``checkpoint``'s weights and files as part directories ``out_dir/part-1..N``.

    Args:
        checkpoint: a Hugging Face checkpoint directory with safetensors weights, one file or shards
            (:func:`read_weights`; sent as float32).
        max_part_bytes: the most bytes one part directory may hold, all its files together
            (at most :data:`MAX_CARRY_BYTES`).
        gguf_path: the GGUF file the checkpoint was dequantized from (llama architecture),
            to send its blocks instead of float32 bytes; None sends float32.
        extra_files: name -> file, added to the last part (e.g. the prompts).

    Returns:
        The part directories in order.

    Raises:
        ValueError: a limit above :data:`MAX_CARRY_BYTES`, a checkpoint without weights (:func:`read_weights`)
            or without ``config.json``, a part that cannot fit its limit, or an encoding that does not reproduce
            the checkpoint bit-exactly.
    """
    if not 0 < max_part_bytes <= MAX_CARRY_BYTES:
        raise ValueError(f"a part may hold at most {MAX_CARRY_BYTES // MIB} MiB (what one device command "
                         f"receives), got {max_part_bytes / MIB:.1f} MiB")
    tensors, weight_files = read_weights(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise ValueError(f"{checkpoint} has no config.json, so it is no Hugging Face checkpoint directory")
    config = json.loads((checkpoint / "config.json").read_text())
    if gguf_path is not None:
        encoded = _gguf_blocks(gguf_path, list(tensors), config)
    else:
        encoded = {n: ("F32", t.to(torch.float32).contiguous().numpy().tobytes(), None) for n, t in tensors.items()}
    entries, stream, offset = [], bytearray(), 0
    for name, (qtype, data, permute) in encoded.items():
        entry = {"name": name, "qtype": qtype, "shape": list(tensors[name].shape), "offset": offset,
                 "nbytes": len(data), "permute_heads": permute, "sha256": tensor_sha256(tensors[name])}
        if tensor_sha256(decode_tensor(data, entry)) != entry["sha256"]:
            raise ValueError(f"{name}: the {qtype} encoding does not reproduce the checkpoint bit-exactly")
        entries.append(entry)
        stream += data
        offset += len(data)
    return _write_parts(checkpoint, weight_files, out_dir, max_part_bytes, entries, bytes(stream),
                        gguf_path is not None, extra_files or {})


def _write_parts(checkpoint: Path, weight_files: list[str], out_dir: Path, max_part_bytes: int, entries: list[dict],
                 stream: bytes, needs_gguf: bool, extra_files: dict[str, Path]) -> list[Path]:
    first = out_dir / "part-1"
    shutil.rmtree(out_dir, ignore_errors=True)
    (first / CHECKPOINT_DIR).mkdir(parents=True)
    for path in checkpoint.iterdir():  # the weights travel in the stream, rebuilt as one model.safetensors
        if path.is_file() and path.name not in weight_files:
            shutil.copy2(path, first / CHECKPOINT_DIR / path.name)
    if needs_gguf:
        import gguf
        shutil.copytree(Path(gguf.__file__).parent, first / PYTHON_DIR / "gguf",
                        ignore=shutil.ignore_patterns("__pycache__"))
    json_room = 4096 + 160 * len(extra_files)  # part.json: a sha256 line per file
    room = max_part_bytes - _dir_bytes(first) - 2 * json_room - 400 * len(entries)  # and the manifest
    extra_bytes = sum(path.stat().st_size for path in extra_files.values())
    if room <= 0 or max_part_bytes - json_room - extra_bytes <= 0:
        raise ValueError(f"the checkpoint's files or the extra files alone exceed the part limit of "
                         f"{max_part_bytes / MIB:.2f} MiB")
    chunks = [stream[:room]]
    stream = stream[room:]
    while stream:
        chunks.append(stream[:max_part_bytes - json_room])
        stream = stream[max_part_bytes - json_room:]
    if len(chunks[-1]) + extra_bytes > max_part_bytes - json_room:
        chunks.append(b"")  # the extra files get a part of their own
    parts = [out_dir / f"part-{i + 1}" for i in range(len(chunks))]
    for index, (part, chunk) in enumerate(zip(parts, chunks)):
        part.mkdir(exist_ok=True)
        (part / f"weights.{index:03d}").write_bytes(chunk)
    for name, path in extra_files.items():
        shutil.copy2(path, parts[-1] / name)
    manifest = {"tensors": entries, "stream_sha256": sha256_bytes(b"".join(chunks)), "num_parts": len(parts),
                "chunk_sha256": [sha256_bytes(c) for c in chunks]}
    (first / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    for index, part in enumerate(parts, 1):
        files = {str(p.relative_to(part)): sha256_file(p) for p in sorted(part.rglob("*")) if p.is_file()}
        info = {"index": index, "num_parts": len(parts), "run_id": manifest["stream_sha256"], "files": files}
        (part / PART_FILE).write_text(json.dumps(info, indent=1))
        check_size(part, max_part_bytes)
    return parts


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check_size(path: Path, limit: int) -> None:
    """Raise ValueError if the file or directory ``path`` holds more than ``limit`` bytes."""
    size = _dir_bytes(path) if path.is_dir() else path.stat().st_size
    if size > limit:
        raise ValueError(f"{path} holds {size / MIB:.2f} MiB, over the limit of {limit / MIB:.2f} MiB")


def receive_part(part: Path, store: Path) -> dict:
    """Check one part directory (size, every file's sha256) and copy it into ``store``.

    Returns:
        The part's ``part.json``.

    Raises:
        ValueError: ``part`` is no part directory, is over :data:`MAX_CARRY_BYTES`, a file is missing, extra
            or differs, or it belongs to another run than the parts already in ``store``.
    """
    if not (part / PART_FILE).is_file():
        why = f"it holds no {PART_FILE}" if part.is_dir() else "no such directory"
        raise ValueError(f"{part} is no part ({why}); pass a part directory that 'scripts/gpu_train.py prepare' "
                         "wrote")
    check_size(part, MAX_CARRY_BYTES)
    info = json.loads((part / PART_FILE).read_text())
    present = {str(p.relative_to(part)) for p in part.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    if present - {PART_FILE} != set(info["files"]):
        raise ValueError(f"{part}: files differ from its {PART_FILE}: "
                         f"{sorted(present.symmetric_difference(info['files']) - {PART_FILE})}")
    for name, digest in info["files"].items():
        if sha256_file(part / name) != digest:
            raise ValueError(f"{part / name}: sha256 mismatch; the part was damaged on the way, send it again")
    for other in store.glob("received-*.json"):
        if json.loads(other.read_text())["run_id"] != info["run_id"]:
            raise ValueError(f"{part} belongs to another prepare run than the parts in {store}; clear {store}")
    store.mkdir(parents=True, exist_ok=True)
    for name in info["files"]:
        (store / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(part / name, store / name)
    (store / f"received-{info['index']}.json").write_text(json.dumps(info))
    return info


def assemble_checkpoint(store: Path, out: Path) -> Path:
    """Rebuild the checkpoint from every received part: ``out`` gets ``model.safetensors`` and the files.

    Every tensor is checked against the sha256 the sending side recorded.

    Raises:
        ValueError: a part is missing, or a chunk or tensor differs.
    """
    manifest = json.loads((store / MANIFEST_FILE).read_text()) if (store / MANIFEST_FILE).is_file() else None
    if manifest is None:
        raise ValueError(f"{store} has no {MANIFEST_FILE}: part 1 was not received")
    missing = [i for i in range(1, manifest["num_parts"] + 1) if not (store / f"received-{i}.json").is_file()]
    if missing:
        raise ValueError(f"parts {missing} of {manifest['num_parts']} were not received into {store}")
    chunks = [(store / f"weights.{i:03d}").read_bytes() for i in range(manifest["num_parts"])]
    for i, (chunk, digest) in enumerate(zip(chunks, manifest["chunk_sha256"])):
        if sha256_bytes(chunk) != digest:
            raise ValueError(f"weights chunk {i} differs from the one sent")
    stream = b"".join(chunks)
    if str(store / PYTHON_DIR) not in sys.path:
        sys.path.insert(0, str(store / PYTHON_DIR))  # the gguf package, for GGUF blocks
    tensors = {}
    for entry in manifest["tensors"]:
        tensor = decode_tensor(stream[entry["offset"]:entry["offset"] + entry["nbytes"]], entry)
        if tensor_sha256(tensor) != entry["sha256"]:
            raise ValueError(f"{entry['name']}: the rebuilt tensor differs from the sending side's checkpoint")
        tensors[entry["name"]] = tensor
    shutil.copytree(store / CHECKPOINT_DIR, out, dirs_exist_ok=True)
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    return out

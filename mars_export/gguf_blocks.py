"""The block-quantized linear weights of a GGUF file as they are stored (Q4_0, Q4_1, Q8_0).

Dimension letters: N output features (rows of the HF ``nn.Linear`` weight), K input
features, NB = K / 32 blocks per row. llama.cpp's three most used block types quantize each
row in blocks of 32 along K, with fp16 block constants:

- Q4_0: ``w = d * (q - 8)``, q in 0..15;
- Q4_1: ``w = d * q + m``, q in 0..15;
- Q8_0: ``w = d * q``, q in -128..127 (stored here as ``q + 128`` with zero point 128).

Every one is ``scales * (codes - zero_point) + mins`` with unsigned codes, which is
onnxruntime's ``MatMulNBits`` dequantization plus, for Q4_1, a per-block offset (see
:mod:`mars_export.gguf_import`). Rows are put in the Hugging Face order with transformers'
own tensor processor (llama.cpp permutes the Q/K rows of Llama for its RoPE layout; blocks
run along K, so whole rows move), and tensors are named with transformers' GGUF name map,
so :meth:`BlockWeight.dequantize` equals transformers' GGUF loader bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedModel

GGUF_BLOCK = 32  # values per block along K, for the three types below
# ggml type -> (bits, zero point, has per-block mins)
BLOCK_TYPES = {"Q4_0": (4, 8, False), "Q4_1": (4, 0, True), "Q8_0": (8, 128, False)}


@dataclass
class BlockWeight:
    """One linear weight [N, K] as GGUF blocks.

    Attributes:
        ggml_type: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``.
        codes: uint8 [N, NB, 32], unsigned codes in 0..2**bits - 1.
        scales: float32 [N, NB], the block scales d.
        mins: float32 [N, NB], Q4_1's block minimum m; None for the other types.
    """

    ggml_type: str
    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None

    @property
    def bits(self) -> int:
        return BLOCK_TYPES[self.ggml_type][0]

    @property
    def zero_point(self) -> int:
        return BLOCK_TYPES[self.ggml_type][1]

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: ``scales * (codes - zero_point) (+ mins)``, rounded as gguf's dequantize rounds."""
        values = self.scales[..., None] * (self.codes.astype(np.float32) - np.float32(self.zero_point))
        if self.mins is not None:
            values = values + self.mins[..., None]
        return values.reshape(self.codes.shape[0], -1)


def read_block_weights(gguf_file: Path, model: PreTrainedModel) -> tuple[dict[str, BlockWeight], dict[str, str]]:
    """The 2-D weights of ``gguf_file`` stored in a type of :data:`BLOCK_TYPES`, by HF parameter name.

    Args:
        gguf_file: the GGUF file ``model``'s weights were loaded from.
        model: the model transformers loaded from it (names, config and row order come from it).

    Returns:
        (HF parameter name -> :class:`BlockWeight`, HF parameter name -> ggml type of every other
        quantized 2-D weight, which callers re-quantize).

    Raises:
        ValueError: the file cannot be read as GGUF.
    """
    import gguf
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    try:
        reader = gguf.GGUFReader(str(gguf_file))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {gguf_file} as GGUF: {e}") from e
    arch = str(reader.fields["general.architecture"].contents())
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    hf_names = get_gguf_hf_weights_map(model, processor)
    blocks, others = {}, {}
    for tensor in reader.tensors:
        hf_name, type_name = hf_names.get(tensor.name), tensor.tensor_type.name
        if hf_name is None or len(tensor.shape) != 2 or type_name in ("F32", "F16", "BF16"):
            continue
        if type_name not in BLOCK_TYPES:
            others[hf_name] = type_name
            continue
        rows = _row_order(processor, tensor.name, int(tensor.shape[1]))
        blocks[hf_name] = _parse_blocks(type_name, np.asarray(tensor.data)[rows])
    return blocks, others


def _row_order(processor, gguf_name: str, num_rows: int) -> np.ndarray:
    """int64 [N]: the GGUF row index of each HF row, from transformers' processor run on the row numbers."""
    rows = np.arange(num_rows, dtype=np.float64).reshape(num_rows, 1)  # [N, 1]
    moved = processor.process(rows, gguf_name).weights
    assert moved.shape == rows.shape, f"{gguf_name}: the tensor processor changed the shape"
    return moved[:, 0].astype(np.int64)


def _parse_blocks(type_name: str, data: np.ndarray) -> BlockWeight:
    """data uint8 [N, NB * bytes per block] -> BlockWeight (GGUF block layouts of ggml-common.h)."""
    num_rows = data.shape[0]
    bits, _, has_mins = BLOCK_TYPES[type_name]
    head = 4 if has_mins else 2  # fp16 d (and fp16 m) before the codes
    blocks = data.reshape(num_rows, -1, head + GGUF_BLOCK * bits // 8)  # [N, NB, bytes]
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, NB]
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_mins else None
    packed = blocks[..., head:]
    if bits == 8:
        codes = (packed.view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [N, NB, 32]
    else:  # value j < 16 in the low nibble of byte j, value 16 + j in its high nibble
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [N, NB, 32]
    return BlockWeight(type_name, codes, scales, mins)

"""The fused graph of a bundle: onnxruntime-genai's model builder run on the checkpoint (GitHub issue 11).

``mars-export --graph fused`` writes, instead of our step graph, the graph the model builder
writes from the same weights (GroupQueryAttention with rotary, SkipSimplifiedLayerNormalization,
one packed QKV MatMul; 342 nodes after onnxruntime's optimizer where our step graph has 1193), run
at batch 1 by :mod:`runtime.backends.fused`. The builder is a library (``onnxruntime-genai``,
the ``[fused]`` extra) and is run as its own command, as its documentation does, on the model
saved as a Hugging Face checkpoint (a MARS adapter merged, a GGUF source dequantized).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

import onnx
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from runtime.bundle import external_data_file

BUILDER = "onnxruntime_genai.models.builder"
BUILDER_FILE = "model.onnx"
MAX_INLINE_BYTES = 2 * 1024**3 - 1  # protobuf's limit for one file


def require_builder() -> None:
    """Raise RuntimeError, naming the extra to install, if onnxruntime-genai is not installed."""
    if find_spec("onnxruntime_genai") is None:
        raise RuntimeError("--graph fused needs onnxruntime-genai's model builder: pip install 'mars-edge[fused]'")


def write_fused_graph(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """Write the model builder's float32 CPU graph of ``model`` to ``path`` (weights inline; over 2 GB in ``path`` + .data).

    Raises:
        RuntimeError: onnxruntime-genai is not installed, or the builder failed (its last
            error line, e.g. an architecture it does not know).
    """
    require_builder()
    with tempfile.TemporaryDirectory(prefix="mars-fused-") as tmp:
        checkpoint, out = Path(tmp) / "checkpoint", Path(tmp) / "out"
        model.save_pretrained(checkpoint)
        tokenizer.save_pretrained(checkpoint)
        config_file = checkpoint / "config.json"
        config = json.loads(config_file.read_text())
        config.pop("quantization_config", None)  # a GGUF-loaded model is dequantized already (DESIGN.md §8)
        config_file.write_text(json.dumps(config, indent=2))
        done = subprocess.run([sys.executable, "-m", BUILDER, "-i", str(checkpoint), "-o", str(out), "-p", "fp32",
                               "-e", "cpu", "-c", str(Path(tmp) / "cache")], capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()] or ["(no output)"]
            raise RuntimeError(f"onnxruntime-genai's model builder failed: {lines[-1][:300]}")
        graph = onnx.load(str(out / BUILDER_FILE))  # the builder keeps the weights apart; one file, as ours, below 2 GB
        onnx.save(graph, str(path), save_as_external_data=graph.ByteSize() > MAX_INLINE_BYTES,
                  location=external_data_file(path.name))

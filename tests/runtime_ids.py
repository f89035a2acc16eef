"""Token ids of the torch-free runtime on one bundle, as JSON: the tokenizer and chat
template, solo decoding and the batched engine in both schemes, at tau = 1 and 0.5.

Imports only the runtime (numpy, onnxruntime, tokenizers, jinja2), so it runs under any
interpreter that has them: ``python tests/runtime_ids.py BUNDLE`` prints the same object
that :func:`runtime_ids` returns. tests/test_runtime_python.py runs it under
``support.RUNTIME_PYTHON`` (the lowest declared versions in scripts/test_lowest.sh).
"""

from __future__ import annotations

import json
import sys

from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.decoder import Decoder
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.params import DecodeParams
from runtime.text.tokenizer import Tokenizer

PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "def add(a, b):", "Hi"]
TAUS = (1.0, 0.5)
MAX_NEW = 32


def runtime_ids(bundle: str) -> dict:
    """{"prompts": chat-template ids per prompt, "<tau>": {"solo", "continuous", "block": ids per prompt}}."""
    config = load_config(bundle)
    backend = OnnxBackend(bundle, config, num_threads=1)
    tokenizer = Tokenizer(bundle)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS]
    out = {"prompts": prompts}
    for tau in TAUS:
        params = DecodeParams(tau=tau, max_new_tokens=MAX_NEW)
        out[str(tau)] = {"solo": [Decoder(backend, config).generate(p, params).token_ids for p in prompts]}
        for scheme in ("continuous", "block"):
            engine = Engine(backend, config, EngineConfig(max_batch_size=2, scheme=scheme))
            out[str(tau)][scheme] = [r.token_ids for r in engine.generate(prompts, params)]
    return out


if __name__ == "__main__":
    print(json.dumps(runtime_ids(sys.argv[1])))

"""Run a bundle on a few real prompts and print the text, TPF and tokens/s.

    python samples/demo.py BUNDLE [--tau 1.0 0.9] [--max-new-tokens 128]

Prompts: samples/prompts/demo_prompts.json (GSM8K test questions, HumanEval prompts).
Uses only the torch-free runtime.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams
from runtime.text.tokenizer import Tokenizer

PROMPTS = Path(__file__).parent / "prompts" / "demo_prompts.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--tau", type=float, nargs="+", default=[1.0, 0.9])
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    config = load_config(args.bundle)
    decoder, tokenizer = Decoder(OnnxBackend(args.bundle, config), config), Tokenizer(args.bundle)
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    print(f"bundle {args.bundle}: {config.source_model}, B={config.block_size}, W={config.window}")
    for tau in args.tau:
        tokens = forwards = 0
        seconds = 0.0
        for prompt in prompts:
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt["text"]}])
            result = decoder.generate(ids, DecodeParams(tau=tau, max_new_tokens=args.max_new_tokens))
            decode_seconds = result.seconds - result.prefill_seconds
            print(f"\n=== {prompt['id']}  tau={tau}  tokens={result.num_tokens}  TPF={result.tpf:.2f}  "
                  f"decode {result.num_tokens / decode_seconds:.1f} tok/s  (prefill {result.prefill_seconds:.2f} s)")
            print(tokenizer.decode(result.token_ids))
            tokens, forwards, seconds = tokens + result.num_tokens, forwards + result.num_forwards, seconds + decode_seconds
        print(f"\n### tau={tau}: {tokens} tokens, TPF {tokens / forwards:.2f}, decode {tokens / seconds:.1f} tok/s "
              f"over {len(prompts)} prompts\n")


if __name__ == "__main__":
    main()

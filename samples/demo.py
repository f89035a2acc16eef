"""Run a bundle on a few real prompts and print the text, TPF and tokens/s.

    python samples/demo.py BUNDLE [--tau 1.0 0.9] [--draft both|lookup|masks] [--adaptive-masks]
        [--max-new-tokens 128]

Prompts: samples/prompts/demo_prompts.json (GSM8K test questions, HumanEval prompts).
Each tau runs in threshold mode with the given draft source (DESIGN.md §3): ``masks`` is
plain MARS; ``lookup`` / ``both`` also feed prompt-lookup drafts, verified exactly, before
the masks. At tau = 1 the output is the greedy AR output whatever the draft source.
``--adaptive-masks`` feeds masks only while they pay (:mod:`runtime.decode.mask_backoff`); a bundle whose
step graph takes only W-token steps (exported before 2026-11-30) cannot, and the demo stops with one line.
So does any bad value (a tau, --max-new-tokens, a path that is no bundle), checked by the runtime's own rules
before the first run decodes anything (exit status 2).
Uses only the torch-free runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runtime.backends.onnx import OnnxBackend
from runtime.bundle import BundleError, load_config
from runtime.command_line import ArgumentParser, UsageError, make_taus_value
from runtime.decode.admission import why_no_adaptive_masks
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams, ParamError
from runtime.text.tokenizer import Tokenizer

PROMPTS = Path(__file__).parent / "prompts" / "demo_prompts.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--tau", type=make_taus_value("--tau"), nargs="+", default=[1.0, 0.9])
    p.add_argument("--draft", choices=["masks", "lookup", "both"], default="both",
                   help="draft source in every run (default both: lookup drafts, then masks; masks: plain MARS)")
    p.add_argument("--adaptive-masks", action="store_true",
                   help="feed mask tokens only while they pay (runtime.decode.mask_backoff)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status (2 after one ``error:`` line for a bad command line or value, a path
    that is no bundle, or ``--adaptive-masks`` on a bundle that cannot run them, all before any decoding)."""
    try:
        args = parse_args(argv)
        runs = prepare_runs(args)
        config = load_config(args.bundle)
        backend = OnnxBackend(args.bundle, config)
        if args.adaptive_masks and (why := why_no_adaptive_masks(backend)):
            raise ParamError("adaptive_masks", why)
        decoder, tokenizer = Decoder(backend, config), Tokenizer(args.bundle)
        prompts = encode_prompts(tokenizer, json.loads(PROMPTS.read_text())["prompts"], args.max_new_tokens, decoder)
    except (BundleError, ValueError) as e:  # UsageError and ParamError too: a bad option, before any decoding
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"bundle {args.bundle}: {config.source_model}, B={config.block_size}, W={config.window}, "
          f"draft {args.draft}{', adaptive masks' if args.adaptive_masks else ''}")
    speeds = {}
    for tau, params in runs:
        tokens = forwards = 0
        seconds = 0.0
        for prompt, ids in prompts:
            result = decoder.generate(ids, params)
            decode_seconds = result.seconds - result.prefill_seconds
            print(f"\n=== {prompt['id']}  tau={tau}  tokens={result.num_tokens}  TPF={result.tpf:.2f}  "
                  f"decode {result.num_tokens / decode_seconds:.1f} tok/s  (prefill {result.prefill_seconds:.2f} s)")
            print(tokenizer.decode(result.token_ids))
            tokens, forwards, seconds = tokens + result.num_tokens, forwards + result.num_forwards, seconds + decode_seconds
        speeds[tau] = tokens / seconds
        print(f"\n### tau={tau}: {tokens} tokens, TPF {tokens / forwards:.2f}, decode {speeds[tau]:.1f} tok/s "
              f"over {len(prompts)} prompts\n")
    first = args.tau[0]
    for tau in args.tau[1:]:
        print(f"decode tok/s at tau={tau} / tau={first}: {speeds[tau] / speeds[first]:.2f}x")
    return 0


def prepare_runs(args: argparse.Namespace) -> list[tuple[float, DecodeParams]]:
    """Each tau with the parameters of its run, every one checked before any decoding.

    Raises:
        ParamError: a tau or --max-new-tokens out of range (the runtime's own rules, :class:`DecodeParams`).
    """
    return [(tau, DecodeParams(tau=tau, max_new_tokens=args.max_new_tokens, draft=args.draft,
                               adaptive_masks=args.adaptive_masks)) for tau in args.tau]


def encode_prompts(tokenizer: Tokenizer, prompts: list[dict], max_new_tokens: int,
                   decoder: Decoder) -> list[tuple[dict, list[int]]]:
    """Each prompt with its chat-template ids, checked against the tokens the decoder can generate after it
    (:meth:`Decoder.room`).

    Raises:
        ParamError: --max-new-tokens does not fit after the longest prompt.
    """
    encoded = [(prompt, tokenizer.encode_chat([{"role": "user", "content": prompt["text"]}])) for prompt in prompts]
    longest = max(len(ids) for _, ids in encoded)
    if max_new_tokens > (room := decoder.room(longest)):
        raise ParamError("max_new_tokens", f"--max-new-tokens {max_new_tokens} does not fit: after the longest "
                         f"prompt ({longest} tokens) and the window ({decoder.config.window}) a slot holds "
                         f"{max(room, 0)} more tokens; give --max-new-tokens {room} or less")
    return encoded


if __name__ == "__main__":
    sys.exit(main())

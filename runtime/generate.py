"""Generate text from a MARS bundle: ``python -m runtime.generate DIR --prompt TEXT [options]``.

Runs prefill and the MARS acceptance loop on onnxruntime and prints the text, or with
``--json`` one JSON object with the ids, the text and the counts (tokens, decode forwards,
TPF, seconds).
"""

from __future__ import annotations

import argparse
import json
import sys

from runtime.backends.providers import PROVIDERS, OnnxRuntimeMissing
from runtime.bundle import BundleError, load_config
from runtime.command_line import PARAM_FLAGS, ArgumentParser, naming_options, run_main, tau_value, threads_value
from runtime.decode.acceptance import METRICS
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams
from runtime.decode.params import DRAFTS, MODES
from runtime.text.tokenizer import Tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m runtime.generate", description=__doc__.splitlines()[0])
    p.add_argument("bundle", help="bundle directory written by mars-export")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--tau", type=tau_value, default=1.0, help="confidence threshold; >= 1 is greedy AR (default 1.0)")
    p.add_argument("--mode", default="threshold", choices=MODES,
                   help="threshold (MARS), ar (one token per step) or verify (lossless drafts); default threshold")
    p.add_argument("--draft", default="masks", choices=DRAFTS,
                   help="draft source of verify and threshold mode: masks (verify: the last step's mask "
                        "predictions; threshold: none), lookup (tokens that followed the latest earlier match of "
                        "the context's last n-gram) or both; drafts are kept while they equal the argmax, then "
                        "threshold mode accepts masks by tau; default masks")
    p.add_argument("--adaptive-masks", action="store_true",
                   help="feed mask tokens only while they pay: after a step whose masks gained no token, back off "
                        "1, 2 .. 16 steps without masks (runtime.decode.mask_backoff); needs a step graph with a "
                        "dynamic window (exports since 2026-11-30)")
    p.add_argument("--metric", default="probability", choices=METRICS, help="confidence metric (default probability)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; so is anything below 1e-5); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--block-size", type=int, default=None, help="most tokens per step (default: the bundle's B)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--provider", default="cpu", choices=sorted(PROVIDERS), help="onnxruntime execution provider")
    p.add_argument("--threads", type=threads_value, default=0, help="intra-op threads (0: onnxruntime's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m runtime.generate``; returns the exit code (0 ok, 2 after one ``error:`` line for a
    bad command line, option value or bundle)."""
    try:
        args = parse_args(argv)  # argparse's refusals: UsageError, a ValueError
        from runtime.backends.onnx import OnnxBackend  # here: without onnxruntime, one error line
        with naming_options(PARAM_FLAGS):
            params = DecodeParams(tau=args.tau, mode=args.mode, draft=args.draft, adaptive_masks=args.adaptive_masks,
                                  metric=args.metric, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        config = load_config(args.bundle)
        tokenizer = Tokenizer(args.bundle)
        decoder = Decoder(OnnxBackend(args.bundle, config, args.provider, args.threads), config)
        prompt_ids = (tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat
                      else tokenizer.encode(args.prompt))
        with naming_options(PARAM_FLAGS):  # the engine's checks: block_size, max_new_tokens within the context
            result = decoder.generate(prompt_ids, params)
    except (BundleError, ValueError, OnnxRuntimeMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = tokenizer.decode(result.token_ids)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": text, "tau": params.tau, **result.summary()}))
    else:
        print(text)
    if ended_at_once(result.token_ids, config.eos_token_ids) and not args.chat and tokenizer.chat_template is not None:
        print("note: the model ended at once (its first token ends generation); an instruct model answers a chat: "
              "add --chat to wrap the prompt in the bundle's chat template", file=sys.stderr)
    return 0


def ended_at_once(token_ids: list[int], eos_token_ids: tuple[int, ...]) -> bool:
    """Whether generation stopped at its first token: ``token_ids`` (the new ids) is one end token, or none."""
    return len(token_ids) == 0 or (len(token_ids) == 1 and token_ids[0] in eos_token_ids)


if __name__ == "__main__":
    sys.exit(run_main(main))  # run_main: a closed stdout (| head) ends it quietly

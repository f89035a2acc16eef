"""Run the C sample (samples/c, binary ``mars_c``) on text: tokenize, generate in C, detokenize.

    python samples/c/mars_c.py BUNDLE --prompt TEXT [--chat] [--tau T] [--block-size N]
                               [--max-new-tokens N] [--threads N] [--adaptive-masks] [--binary PATH] [--json]

The prompt is encoded with the bundle's tokenizer (``runtime.text.tokenizer.Tokenizer``; with
``--chat`` as one user message through the chat template), the ids go to the binary on
stdin, the generated ids come back on its stdout and the counts as one JSON object on
the last line of its stderr. Prints the text, or with ``--json`` one object shaped like
``python -m runtime.generate --json``. Build the binary first (samples/c/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from runtime.command_line import ArgumentParser, UsageError, how_it_ended, tau_value, threads_value

DEFAULT_BINARY = Path(__file__).resolve().parents[2] / "build" / "c" / "mars_c"


STDERR_TAIL_LINES = 10  # of a failed binary's stderr, in MarsCError's message


class MarsCError(RuntimeError):
    """The binary exited with an error; the message is its own (``mars_c: error at FILE:LINE: ...``), the end of its
    stderr, or says that it printed nothing there, ran too long or printed what mars_c does not; how it ended is
    ``ended``, which a command shows before the message.

    Attributes:
        ended: how the binary ended where it failed (:func:`runtime.command_line.how_it_ended`: ``exit status 1``,
            ``killed by signal 11 (SIGSEGV)``), else None (it ran too long, or exited 0 printing what mars_c does not).
    """

    def __init__(self, message: str, ended: str | None = None):
        super().__init__(message)
        self.ended = ended


def binary_problem(binary: str | Path) -> str | None:
    """Why ``binary`` cannot be run as ``mars_c`` (missing, or not executable), or None."""
    path = Path(binary)
    if not path.is_file():
        return f"{binary} is no file; build mars_c first (see samples/c/README.md)"
    if not os.access(path, os.X_OK):
        return f"{binary} is not executable; build mars_c with CMake (see samples/c/README.md)"
    return None


def run_binary(binary: str | Path, bundle: str | Path, prompt_ids: list[int], tau: float = 1.0,
               max_new_tokens: int = 128, block_size: int | None = None, num_threads: int = 0,
               timeout: float | None = None, adaptive_masks: bool = False) -> tuple[list[int], dict]:
    """Generate with the C binary.

    Args:
        binary: path of ``mars_c``.
        bundle: bundle directory.
        prompt_ids: prompt token ids.
        tau, max_new_tokens, block_size: as in ``runtime.decode.params.DecodeParams`` (probability metric).
        num_threads: onnxruntime intra-op threads, 0 = onnxruntime's choice.
        timeout: seconds before the binary is killed (None: no limit).
        adaptive_masks: feed masks only while they gain tokens, as ``DecodeParams.adaptive_masks``
            (``runtime.decode.mask_backoff``).

    Returns:
        The generated ids, and the counts (``num_tokens``, ``num_forwards``,
        ``num_prefill_forwards``, ``tpf``, ``seconds``, ``prefill_seconds``,
        ``decode_tokens_per_second``, ``finish_reason``, ``num_masked_forwards``, ``huge_page_bytes``).

    Raises:
        MarsCError: the binary failed (bad bundle, bad ids, onnxruntime error).
    """
    # resolved: a bare file name means the file in this folder, not a program on PATH
    command = [str(Path(binary).resolve()), str(bundle), "--tau", repr(float(tau)), "--max-new-tokens",
               str(max_new_tokens), "--threads", str(num_threads)]
    if block_size is not None:
        command += ["--block-size", str(block_size)]
    if adaptive_masks:
        command.append("--adaptive-masks")
    try:
        proc = subprocess.run(command, input=" ".join(map(str, prompt_ids)), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise MarsCError(f"{binary} ran past {timeout:g} s and was stopped") from e
    except OSError as e:  # a build for another machine, a bad #! line, not a program
        raise MarsCError(f"{binary} cannot be run ({(e.strerror or str(e)).lower()}): is it a mars_c build for this "
                         "machine? (see samples/c/README.md)") from e
    lines = proc.stderr.strip().splitlines()
    if proc.returncode != 0:
        ended = how_it_ended(proc.returncode)
        raise MarsCError("\n".join(lines[-STDERR_TAIL_LINES:]) or f"{binary} printed nothing on stderr", ended)
    try:
        return [int(t) for t in proc.stdout.split()], json.loads(lines[-1])
    except (IndexError, ValueError) as e:  # no counts line, or no ids: not what mars_c prints
        raise MarsCError(f"{binary} printed no token ids and counts line as mars_c does; is it a mars_c build? "
                         "(see samples/c/README.md)") from e


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", help="bundle directory written by mars-export")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--tau", type=tau_value, default=1.0, help="confidence threshold; >= 1 is greedy AR (default 1.0)")
    p.add_argument("--block-size", type=int, default=None, help="most tokens per step (default: the bundle's B)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--threads", type=threads_value, default=0, help="intra-op threads (0: onnxruntime's choice)")
    p.add_argument("--adaptive-masks", action="store_true",
                   help="feed mask tokens only while they pay: after a step whose masks gained no token, back off "
                        "1, 2 .. 16 steps without masks (runtime.decode.mask_backoff)")
    p.add_argument("--binary", default=str(DEFAULT_BINARY), help=f"the mars_c binary (default {DEFAULT_BINARY})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from runtime.bundle import BundleError
    from runtime.text.tokenizer import Tokenizer

    try:
        args = parse_args(argv)
    except UsageError as e:  # argparse's refusals: one line, as the errors below
        print(f"error: {e}", file=sys.stderr)
        return 2
    problem = binary_problem(args.binary)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        tokenizer = Tokenizer(args.bundle)
        ids = (tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat
               else tokenizer.encode(args.prompt))
        token_ids, counts = run_binary(args.binary, args.bundle, ids, args.tau, args.max_new_tokens,
                                       args.block_size, args.threads, adaptive_masks=args.adaptive_masks)
    except MarsCError as e:
        print(f"error: {args.binary} failed ({e.ended}):\n{e}" if e.ended else f"error: {e}", file=sys.stderr)
        return 2
    except (BundleError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = tokenizer.decode(token_ids)
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "tau": args.tau, **counts}))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

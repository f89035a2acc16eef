"""Prefill and decode speed of the C sample (samples/c, ``mars_c``): binaries against each other and the Python runtime.

    python bench/c_sample.py BUNDLE --binary NAME=PATH [--binary NAME=PATH ...] [--python]
                             [--prompt-lengths 64 512] [--max-new-tokens 32] [--tau 1.0] [--adaptive-masks]
                             [--repeats 5] [--threads 2] [--out bench/results] [--name c_sample] [--force]

Prompts are real text (GSM8K test questions, joined, through the bundle's tokenizer) cut to each
length in tokens. Every repeat runs each prompt length through every engine in turn (interleaved,
so a slow spell of the machine hits all of them): each ``--binary`` (its own ``prefill_seconds``
and ``decode_tokens_per_second``, session load excluded) and, with ``--python``,
``runtime.decode.decoder.Decoder`` on ``OnnxBackend`` with the same threads. ``--adaptive-masks`` runs every
engine with adaptive masks (``mars_c --adaptive-masks``, ``DecodeParams.adaptive_masks``); a bundle whose step
graph takes only W-wide steps, where they cannot act, stops before any run. Writes
``{name}.json`` (rows and a summary of medians, each engine against the first), ``{name}.csv``
and ``{name}.png`` (prompt tokens/s of the prefill against prompt length); prints the summary
as a markdown table. Bad arguments (a binary that is missing or not built among them) stop before anything
runs with one ``error:`` line, exit status 2; a binary that fails during the run stops it with exit status 1,
how it ended (its exit status, or the signal that killed it) and the end of its stderr. Either way nothing is
written.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from results_files import add_results_options, check_results, write_results  # noqa: E402 (bench/ on the path)
from support import shared_data_file, shared_data_missing  # noqa: E402

from runtime.backends.onnx import OnnxBackend  # noqa: E402
from runtime.bundle import BundleError, load_config  # noqa: E402
from runtime.command_line import ArgumentParser, UsageError, run_main, tau_value, threads_value  # noqa: E402
from runtime.decode.decoder import Decoder  # noqa: E402
from runtime.decode.admission import why_no_adaptive_masks  # noqa: E402
from runtime.decode.params import DecodeParams  # noqa: E402
from runtime.evaluation.tasks import load_gsm8k  # noqa: E402
from runtime.text.tokenizer import Tokenizer  # noqa: E402

PYTHON = "python"  # the engine name of the Python runtime's rows


def load_wrapper():
    """samples/c/mars_c.py (``run_binary``), which is not a package module."""
    spec = importlib.util.spec_from_file_location("mars_c_wrapper", ROOT / "samples" / "c" / "mars_c.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wrapper = load_wrapper()


def prompt_of(tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` ids of GSM8K test questions joined by blank lines.

    Raises:
        ValueError: the questions hold fewer tokens.
    """
    questions = [item.user_message for item in load_gsm8k(shared_data_file("gsm8k/test.jsonl"), 200)]
    ids = tokenizer.encode("\n\n".join(questions))
    if len(ids) < num_tokens:
        raise ValueError(f"the GSM8K questions hold {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def run(args) -> dict:
    config = load_config(args.bundle)
    tokenizer = Tokenizer(args.bundle)
    decoder = Decoder(OnnxBackend(args.bundle, config, num_threads=args.threads), config) if args.python else None
    params = DecodeParams(tau=args.tau, max_new_tokens=args.max_new_tokens, adaptive_masks=args.adaptive_masks)
    prompts = {length: prompt_of(tokenizer, length) for length in args.prompt_lengths}
    rows = []
    for repeat in range(args.repeats):
        for length, ids in prompts.items():
            first_ids = None
            for name, binary in [*args.binary, *([(PYTHON, None)] if decoder else [])]:
                if binary is None:
                    result = decoder.generate(ids, params)
                    summary = result.summary()
                    out_ids, prefill_s, forwards, decode_forwards, decode_tps = (
                        result.token_ids, result.prefill_seconds, result.num_prefill_forwards, result.num_forwards,
                        summary["decode_tokens_per_second"])
                else:
                    try:
                        out_ids, counts = wrapper.run_binary(binary, args.bundle, ids, args.tau, args.max_new_tokens,
                                                             num_threads=args.threads, timeout=600,
                                                             adaptive_masks=args.adaptive_masks)
                    except wrapper.MarsCError as e:
                        ended = f" ({e.ended})" if e.ended else ""
                        raise wrapper.MarsCError(f"--binary {name}={binary} failed on the {length}-token "
                                                 f"prompt{ended}:\n{e}", e.ended) from e
                    prefill_s, forwards, decode_forwards, decode_tps = (
                        counts["prefill_seconds"], counts["num_prefill_forwards"], counts["num_forwards"],
                        counts["decode_tokens_per_second"])
                first_ids = first_ids if first_ids is not None else out_ids
                rows.append({"engine": name, "prompt_tokens": length, "repeat": repeat,
                             "prefill_seconds": prefill_s, "prefill_forwards": forwards,
                             "prompt_tokens_per_s": (length - 1) / prefill_s if prefill_s > 0 else None,
                             "decode_forwards": decode_forwards, "decode_tokens_per_second": decode_tps,
                             "num_tokens": len(out_ids), "same_ids_as_first": out_ids == first_ids})
    return {"bundle": str(args.bundle), "threads": args.threads, "tau": args.tau,
            "adaptive_masks": args.adaptive_masks, "max_new_tokens": args.max_new_tokens, "rows": rows,
            "summary": summarize(rows)}


def summarize(rows: list[dict]) -> list[dict]:
    """Per engine and prompt length: median prefill seconds and decode tok/s, and their ratios to the first engine
    (prefill: first / this, so > 1 is faster; decode: this / first)."""
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    out = []
    for length in dict.fromkeys(r["prompt_tokens"] for r in rows):
        medians = {}
        for engine in engines:
            mine = [r for r in rows if r["engine"] == engine and r["prompt_tokens"] == length]
            medians[engine] = (statistics.median(r["prefill_seconds"] for r in mine),
                               statistics.median(r["decode_tokens_per_second"] for r in mine),
                               mine[0]["prefill_forwards"], all(r["same_ids_as_first"] for r in mine))
        base_prefill, base_decode = medians[engines[0]][:2]
        for engine, (prefill, decode, forwards, same) in medians.items():
            out.append({"engine": engine, "prompt_tokens": length, "prefill_forwards": forwards,
                        "median_prefill_seconds": prefill, "median_decode_tokens_per_second": decode,
                        "prefill_speedup_vs_first": base_prefill / prefill if prefill > 0 else None,
                        "decode_vs_first": decode / base_decode if base_decode > 0 else None,
                        "same_ids_as_first": same})
    return out


def markdown(summary: list[dict]) -> str:
    lines = ["| engine | prompt tokens | prefill forwards | prefill s (median) | vs first | decode tok/s | vs first | "
             "same ids |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        speed = f"{s['prefill_speedup_vs_first']:.2f}x" if s["prefill_speedup_vs_first"] else "-"
        decode = f"{s['decode_vs_first']:.2f}x" if s["decode_vs_first"] else "-"
        lines.append(f"| {s['engine']} | {s['prompt_tokens']} | {s['prefill_forwards']} | "
                     f"{s['median_prefill_seconds']:.3f} | {speed} | {s['median_decode_tokens_per_second']:.1f} | "
                     f"{decode} | {s['same_ids_as_first']} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Prompt tokens/s of the prefill (medians) against prompt length, one line per engine."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for engine in dict.fromkeys(s["engine"] for s in result["summary"]):
        points = sorted((s["prompt_tokens"], (s["prompt_tokens"] - 1) / s["median_prefill_seconds"])
                        for s in result["summary"] if s["engine"] == engine and s["median_prefill_seconds"] > 0)
        ax.plot(*zip(*points), marker="o", label=engine)
    ax.set(title=f"prefill, batch 1, {result['threads']} threads", xlabel="prompt tokens", ylabel="prompt tokens/s",
           xscale="log")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_binary(text: str) -> tuple[str, Path]:
    """``NAME=PATH`` -> (name, absolute path) of a mars_c binary that can run."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--binary takes NAME=PATH, got {text!r}")
    if name == PYTHON:
        raise argparse.ArgumentTypeError(f"{PYTHON!r} names the Python runtime's rows; give the binary another name")
    problem = wrapper.binary_problem(path)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return name, Path(path).resolve()


def usage_problem(args) -> str | None:
    """What is wrong with the arguments, checked before anything runs (the bundle and data too), or None."""
    names = [name for name, _ in args.binary]
    if len(set(names)) < len(names):
        return f"--binary names must differ, got {names}"
    if min(args.prompt_lengths) < 2 or args.repeats < 1 or args.max_new_tokens < 1:
        return "--prompt-lengths must be >= 2, --repeats and --max-new-tokens >= 1"
    try:
        DecodeParams(tau=args.tau, max_new_tokens=args.max_new_tokens)
    except ValueError as e:
        return str(e)
    try:
        check_results(args)
    except UsageError as e:
        return str(e)
    missing = shared_data_missing()
    if missing:
        return missing
    try:
        config = load_config(args.bundle)
    except BundleError as e:
        return str(e)
    longest = max(args.prompt_lengths) + args.max_new_tokens + config.window
    if longest > config.max_context:
        return (f"the longest prompt + --max-new-tokens + window = {longest} exceeds the bundle's context of "
                f"{config.max_context}; shorten --prompt-lengths or --max-new-tokens")
    if args.adaptive_masks:  # the Python runtime's rule, which mars_c applies too (its own one-line refusal)
        try:
            why = why_no_adaptive_masks(OnnxBackend(args.bundle, config, num_threads=args.threads))
        except BundleError as e:
            return str(e)
        return f"--adaptive-masks: {why}" if why else None
    return None


def main() -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--binary", type=parse_binary, action="append", required=True, metavar="NAME=PATH",
                   help="a mars_c binary and its name in the results; repeat to compare builds")
    p.add_argument("--python", action="store_true", help="also run the Python runtime (Decoder on OnnxBackend)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 512], help="prompt tokens")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--tau", type=tau_value, default=1.0)
    p.add_argument("--adaptive-masks", action="store_true",
                   help="feed mask tokens only while they gain tokens, in every engine (runtime.decode.mask_backoff)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=threads_value, default=2, help="onnxruntime intra-op threads (0: its choice)")
    add_results_options(p, "c_sample")
    args = p.parse_args()
    problem = usage_problem(args)
    if problem:
        p.error(problem)
    try:
        result = run(args)
    except (BundleError, ValueError, wrapper.MarsCError) as e:  # a binary's (its stderr's end) or the tokenizer's
        print(f"error: {e}", file=sys.stderr)
        return 1  # a failed run, not a bad command line; nothing written
    write_results(args.out, args.name, result, result["rows"], partial(plot, result))
    print(markdown(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))

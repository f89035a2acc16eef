"""Weight-only int8 / int4 against float32 on one fp32 bundle: size, agreement, decode-step time.

    python bench/quantized_step.py BUNDLE [--variants int8 int4 int8-s128 int4-a32-h ...]
                                   [--graphs NAME=PATH[@LEVEL] ...] [--clock wall|cpu]
                                   [--prompts-each 3] [--tokens 64] [--past 128] [--windows 1 4] [--repeats 30]

From the float32 bundle's graph this builds quantized graphs as ``mars-export --int8 / --int4``
does (:func:`mars_export.quantize.quantize_step_graph`) into a scratch directory. A variant is
``DTYPE[-sN|-aN][-h]``: ``int8`` / ``int4`` with the exporter's defaults, ``-s128`` symmetric
blocks of 128 (``-a``: asymmetric), ``-h`` the output head left float32. ``--graphs`` adds
ready-made graphs of the same model (an ``--int4`` bundle's ``model.onnx``: for a GGUF source
it holds the file's own blocks), ``@LEVEL`` with their MatMulNBits ``accuracy_level`` set to
LEVEL (0: float32 compute). Then, in one process:

- file size of each graph;
- top-1 agreement and max |Δlogit| of each against the float32 graph at every position
  of the prompts (fed W at a time, as the export parity does);
- greedy (tau = 1) agreement with the float32 bundle on real prompts (GSM8K + HumanEval):
  fraction of prompts with identical ids, mean common-prefix length;
- time of one decode step of each ``--windows`` W with ``--past`` cached positions, batch 1,
  the graphs interleaved round-robin in a shuffled order (median over ``--repeats``; ``--clock cpu``: the
  process's CPU time, meaningful at ``--threads 1`` on a busy machine).

Writes ``quantized_step.json`` to ``--out`` (default bench/results/); ``--timing-only`` skips
the agreement and writes ``quantized_step_timing_w{W}.json``.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support import real_prompts, shared_data_missing

from mars_export.parity import _graph_logits
from mars_export import quantize
from mars_export.quantize import measure_greedy_agreement, quantize_step_graph
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import BundleConfig, load_config
from runtime.command_line import ArgumentParser, path_value, run_main, threads_value
from runtime.decode.batch import window_mask
from runtime.text.tokenizer import Tokenizer

VARIANT = re.compile(r"(int8|int4)(?:-([sa])(\d+))?(-h)?")


def parse_variant(spec: str) -> dict:
    """``DTYPE[-sN|-aN][-h]`` -> quantize_step_graph's keyword arguments.

    Raises:
        ValueError: ``spec`` is not of that form.
    """
    match = VARIANT.fullmatch(spec)
    if not match:
        raise ValueError(f"variant {spec!r}: expected int8 or int4, optionally -s<block> (symmetric) or -a<block> "
                         "(asymmetric) and -h (float32 output head), e.g. int8-s128 or int4-a32-h")
    dtype, kind, block, fp32_head = match.groups()
    return {"weight_dtype": dtype, "include_lm_head": not fp32_head,
            "block_size": int(block) if block else quantize.BLOCK_SIZE[dtype],
            "is_symmetric": kind == "s" if kind else quantize.IS_SYMMETRIC[dtype]}


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path, help="a float32 bundle (mars-export MODEL -o DIR)")
    p.add_argument("--prompts-each", type=int, default=3, help="GSM8K and HumanEval prompts each (default 3)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--variants", nargs="+", default=["int8", "int4"],
                   help="quantized graphs to build: DTYPE[-sN|-aN][-h] (default: int8 int4, the exporter's settings)")
    p.add_argument("--past", type=int, default=128, help="cached positions of the timed step (default 128)")
    p.add_argument("--windows", type=int, nargs="+", default=None, help="timed step windows (default: the bundle's W)")
    p.add_argument("--repeats", type=int, default=30, help="timed steps per graph (default 30)")
    p.add_argument("--threads", type=threads_value, default=2, help="onnxruntime intra-op threads (default 2)")
    p.add_argument("--graphs", nargs="+", default=[], metavar="NAME=PATH[@LEVEL]",
                   help="also compare these quantized graphs of the same model; @LEVEL sets their accuracy_level")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="step time: wall clock or process CPU time")
    p.add_argument("--timing-only", action="store_true", help="only the interleaved step time")
    p.add_argument("--out", type=path_value, default=ROOT / "bench" / "results", help="result folder (default bench/results)")
    args = p.parse_args()
    try:
        variants = {spec: parse_variant(spec) for spec in args.variants}
    except ValueError as e:
        p.error(str(e))
    if shared_data_missing():
        p.error(shared_data_missing())
    config = load_config(args.bundle)
    if config.weight_dtype != "float32":
        p.error(f"{args.bundle} is a {config.weight_dtype} bundle: give a float32 one (the variants quantize it)")
    tokenizer = Tokenizer(args.bundle)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}])
               for _, text in real_prompts(args.prompts_each)]
    scratch = Path(tempfile.mkdtemp(prefix="quantized-step-"))
    try:
        shutil.copy(args.bundle / config.onnx_file, scratch / "float32.onnx")
        configs = {"float32": replace(config, onnx_file="float32.onnx")}
        summaries = {}
        for spec, options in variants.items():
            summaries[spec] = quantize_step_graph(scratch / "float32.onnx", scratch / f"{spec}.onnx", **options)
            configs[spec] = replace(config, onnx_file=f"{spec}.onnx", weight_dtype=options["weight_dtype"])
        for spec in args.graphs:
            name, path, level = _parse_graph(spec, p)
            summaries[name] = {"graph": str(path), "accuracy_level": _copy_graph(path, scratch / f"{name}.onnx", level)}
            configs[name] = replace(config, onnx_file=f"{name}.onnx", weight_dtype="int4")
        backends = {name: OnnxBackend(scratch, cfg, num_threads=args.threads) for name, cfg in configs.items()}
        results = {name: {"file_mb": round((scratch / cfg.onnx_file).stat().st_size / 1e6, 1)}
                   for name, cfg in configs.items()}
        reference_logits = [] if args.timing_only else [_graph_logits(backends["float32"], config, ids)
                                                        for ids in prompts]
        for spec in summaries:
            results[spec].update(summaries[spec])
            if not args.timing_only:
                results[spec].update(_logit_agreement(backends[spec], config, prompts, reference_logits))
                results[spec]["greedy_vs_float32"] = measure_greedy_agreement(
                    backends["float32"], backends[spec], config, prompts, args.tokens)
                print(spec, json.dumps(results[spec]), flush=True)
        for window in args.windows or [config.window]:
            step_ms = _interleaved_step_ms(backends, config, args.past, window, args.repeats, args.clock)
            for name in configs:
                results[name][f"step_ms_w{window}"] = step_ms[name]
                results[name][f"step_vs_float32_w{window}"] = round(step_ms[name] / step_ms["float32"], 3)
            print(f"W={window}:", {name: results[name][f"step_vs_float32_w{window}"] for name in configs}, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = {"bundle": str(args.bundle), "source_model": config.source_model, "window": config.window,
           "past": args.past, "threads": args.threads, "clock": args.clock, "num_prompts": len(prompts), "tokens": args.tokens,
           "machine": f"{platform.processor() or platform.machine()}, {_cpu_name()}", "results": results}
    name = f"quantized_step_timing_w{config.window}.json" if args.timing_only else "quantized_step.json"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / name
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


def _logit_agreement(backend, config: BundleConfig, prompts, reference_logits) -> dict:
    agree, total, max_diff = 0, 0, 0.0
    for ids, reference in zip(prompts, reference_logits):
        logits = _graph_logits(backend, config, ids)  # [T_padded, V]
        agree += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        total += len(logits)
        max_diff = max(max_diff, float(np.abs(logits - reference).max()))
    return {"top1_vs_float32_graph": round(agree / total, 4), "max_abs_logit_diff_vs_float32_graph": round(max_diff, 3),
            "num_positions": total}


def _parse_graph(spec: str, parser) -> tuple[str, Path, int | None]:
    """``NAME=PATH[@LEVEL]`` -> (name, path, level or None)."""
    name, _, rest = spec.partition("=")
    path, _, level = rest.partition("@")
    if not name or not path or not Path(path).is_file() or (level and not level.isdigit()):
        parser.error(f"--graphs {spec!r}: expected NAME=PATH[@LEVEL] with an existing PATH, e.g. gguf=/tmp/b/model.onnx@0")
    return name, Path(path), int(level) if level else None


def _copy_graph(src: Path, dst: Path, level: int | None) -> int | None:
    """Copy the graph; with ``level``, set every MatMulNBits' accuracy_level to it. Returns the level now set."""
    import onnx
    model = onnx.load(str(src))
    nodes = [n for n in model.graph.node if n.op_type == quantize.QUANT_OP]
    for node in nodes if level is not None else []:
        attribute = next((a for a in node.attribute if a.name == "accuracy_level"), None)
        if attribute is None:
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
        else:
            attribute.i = level
    onnx.save(model, str(dst))
    found = {a.i for n in nodes for a in n.attribute if a.name == "accuracy_level"}
    return found.pop() if len(found) == 1 else None


def _interleaved_step_ms(backends: dict, config: BundleConfig, past_len: int, window: int, repeats: int,
                         clock: str = "wall") -> dict:
    """Median ms of one batch-1 ``window``-token step with ``past_len`` cached positions, graphs run round-robin
    in a new random order each round.

    Every graph's step runs through its backend (``OnnxBackend.step``) on one KV cache [1, H, S, D] per layer and
    name, S = P + W, bound as past and present: each step writes its W entries at P .. P+W-1 in place (the same
    entries at every step, before its attention reads them).

    clock: ``"wall"`` (perf_counter) or ``"cpu"`` (process CPU time, all threads summed)."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    rng = np.random.default_rng(0)
    capacity = past_len + window  # S
    shape = (1, config.num_kv_heads, capacity, config.head_dim)  # [1, H, S, D]
    past = [(rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
            for _ in range(config.num_layers)]
    ids = rng.integers(0, config.vocab_size, (1, window))  # [1, W]
    positions = np.arange(past_len, past_len + window)[None]  # [1, W]
    mask = window_mask(np.array([past_len]), capacity, window)  # [1, 1, W, S]
    times = {name: [] for name in backends}
    order = list(backends)
    for i in range(repeats + 3):
        rng.shuffle(order)  # in a fixed order the first graph measured up to 10% slower than a copy of it later
        for name in order:
            start = now()
            backends[name].step(ids, positions, mask, past)
            if i >= 3:  # warm-up
                times[name].append(now() - start)
    return {name: round(float(np.median(t)) * 1e3, 2) for name, t in times.items()}


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    sys.exit(run_main(main))

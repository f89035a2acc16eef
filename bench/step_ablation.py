"""Where a fused bundle's decode step goes, by removal: the step timed with one part of every layer taken out.

    python bench/step_ablation.py BUNDLE [--parts attention norms activation] [--pasts 128 1024] [--windows 1]
                                  [--steps 20] [--rounds 5] [--threads N] [--out bench/results] [--name step_ablation]
                                  [--force]

Dimension letters: W window (--windows), P past length (--pasts), H query heads, D head dim. Times in ms.

onnxruntime's profiler (``bench/profile_step.py``) adds its own cost to every node it times, which
inflates the share of small ops (it put GroupQueryAttention at 15% of the fused int8 step at P 128).
This script measures a part's cost without it: each part is removed from every layer of the model
builder's graph of a fused bundle (``mars-export --graph fused``), and the step with the part removed
is timed against the whole step, interleaved, as ``bench/profile_step.py`` times bundles (the engine's
step: the KV cache bound as past and present, written in place). A part's cost is the whole step's
time minus the step's time without it, taken within each round (``--rounds`` rounds of ``--steps``
steps of every variant in turn) and given as the median over rounds with the rounds' range: on a
shared machine a part of under ~1 ms can come out negative in a round. The variants compute wrong
numbers: they exist only to be timed (written to a temporary folder, deleted at the end). Parts
(:func:`ablate`):

- ``attention``: every ``GroupQueryAttention`` (rotary, the KV write, scores, softmax, p·v) gives the
  first H·D columns of its query input instead (a Slice), and its presents are its pasts (an
  Identity, which copies nothing where the runtime binds both to one buffer). Where its query,
  key and value come packed in one input, the one-token window's Tile and Slice stay; where they
  come apart (Qwen3, whose builder graph normalizes the query and key heads), the key and value
  paths that only fed the attention go with it (the key norm among them).
- ``norms``: every ``SkipSimplifiedLayerNormalization`` becomes the Add of its input and skip (for
  both its output and its sum output), every ``SimplifiedLayerNormalization`` an Identity.
- ``activation``: the MLP's SiLU (SiLU(gate) x up becomes gate x up: a Sigmoid and a Mul go); the
  projections, their Split where gate and up are one MatMul, and the product stay.
- ``all`` (added when several parts are given): those parts together; what is left is the weight
  kernels and the graph's glue.

Every weight is still read in every variant (:func:`ablate` refuses a removal that would drop a weight
MatMul). The script holds a session of the whole step and one of each variant at once, and writes the variants'
graphs to a temporary folder: four copies of the bundle's graph on disk (4 x 267 MB for the default model's int8
bundle) and five sessions of it in memory.

Writes {name}.json (command, machine, bundle, rows), {name}.csv (one row per variant, P and W: step and
CPU ms, the part's ms with the rounds' range, and its share of the whole step) and {name}.png (per P and W,
each part's cost with the rounds' range) to --out, and prints a Markdown table.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from profile_step import interleaved_times, make_session, step_call  # bench/ is on the path when this file runs as a script
from results_files import add_results_options, check_results, write_results
from runtime import bundle
from runtime.command_line import ArgumentParser, run_main
from scaling import decode_inputs, machine_info, rotated

PARTS = ("attention", "norms", "activation")
WHOLE = "whole"
ALL = "all"
PREFIX = "/step_ablation"


def ablate(model: onnx.ModelProto, part: str, head_dim: int) -> int:
    """Remove ``part`` (one of :data:`PARTS`) from every layer of the model builder's graph ``model``, in place
    (the nodes that only fed it are dropped); returns how many nodes were replaced. ``head_dim``: D.

    Raises:
        ValueError: ``part`` is unknown, the graph has none of it (not a model builder graph), or removing it
            would leave a weight MatMul unread (its output fed only the part).
    """
    graph = model.graph
    replace_node = {"attention": partial(_without_attention, head_dim=head_dim), "norms": _without_norm,
                    "activation": _without_activation}.get(part)
    if replace_node is None:
        raise ValueError(f"unknown part {part!r}: choose from {', '.join(PARTS)}")
    producers = {out: node for node in graph.node for out in node.output}
    nodes, replaced = [], 0
    for node in graph.node:
        new = replace_node(node, producers)
        replaced += new is not None
        nodes.extend(new if new is not None else [node])
    if not replaced:
        raise ValueError(f"the graph has no {part} of the model builder's form; is it a fused bundle's graph "
                         "(mars-export --graph fused)?")
    kept = _needed(nodes, {o.name for o in graph.output})
    lost = _weight_kernels(graph.node) - _weight_kernels(kept)
    if lost:
        raise ValueError(f"removing the {part} would leave {len(lost)} weight MatMuls unread (e.g. {sorted(lost)[0]}): "
                         "a variant must read every weight; this graph's form is not one this script knows")
    del graph.node[:]
    graph.node.extend(kept)
    return replaced


def _weight_kernels(nodes) -> set[str]:
    """Names (else first outputs) of the MatMul-like nodes among ``nodes``."""
    return {n.name or n.output[0] for n in nodes if n.op_type in ("MatMul", "MatMulNBits", "Gemm", "FusedMatMul")}


def _int64(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array([value], np.int64), name))


def _without_attention(node: onnx.NodeProto, producers: dict, head_dim: int) -> list[onnx.NodeProto] | None:
    """GroupQueryAttention -> the first H·D columns of its query (packed QKV or Q); presents = pasts."""
    if node.op_type != "GroupQueryAttention":
        return None
    num_heads = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "num_heads")
    query, past_key, past_value = node.input[0], node.input[3], node.input[4]
    width = num_heads * head_dim
    name = f"{PREFIX}/{node.output[0]}"
    return [_int64(f"{name}/zero", 0), _int64(f"{name}/width", width), _int64(f"{name}/axis", 2),
            helper.make_node("Slice", [query, f"{name}/zero", f"{name}/width", f"{name}/axis"], [node.output[0]]),
            helper.make_node("Identity", [past_key], [node.output[1]]),
            helper.make_node("Identity", [past_value], [node.output[2]])]


def _without_norm(node: onnx.NodeProto, producers: dict) -> list[onnx.NodeProto] | None:
    """SkipSimplifiedLayerNormalization -> Add(input, skip), for its output and its sum output (an Identity); the
    plain norm -> Identity."""
    if node.op_type == "SimplifiedLayerNormalization":
        return [helper.make_node("Identity", [node.input[0]], [node.output[0]])]
    if node.op_type != "SkipSimplifiedLayerNormalization":
        return None
    added = [helper.make_node("Add", [node.input[0], node.input[1]], [node.output[0]])]
    if len(node.output) > 3 and node.output[3]:  # the residual sum, the next norm's skip
        added.append(helper.make_node("Identity", [node.output[0]], [node.output[3]]))
    return added


def _without_activation(node: onnx.NodeProto, producers: dict) -> list[onnx.NodeProto] | None:
    """Mul(SiLU(gate), up) -> Mul(gate, up), SiLU(gate) being Mul(gate, Sigmoid(gate)) (or QuickGelu(gate))."""
    if node.op_type != "Mul":
        return None
    for silu, up in (node.input, reversed(node.input)):
        act = producers.get(silu)
        if act is None:
            continue
        if act.op_type == "QuickGelu":
            return [helper.make_node("Mul", [act.input[0], up], [node.output[0]])]
        sigmoids = [i for i in act.input if producers.get(i) is not None and producers[i].op_type == "Sigmoid"]
        if act.op_type == "Mul" and len(sigmoids) == 1 and producers[sigmoids[0]].input[0] in act.input:
            return [helper.make_node("Mul", [producers[sigmoids[0]].input[0], up], [node.output[0]])]
    return None


def _needed(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` (in order) that the graph ``outputs`` depend on."""
    wanted, kept = set(outputs), []
    for node in reversed(nodes):
        if any(out in wanted for out in node.output):
            kept.append(node)
            wanted.update(i for i in node.input if i)
    return kept[::-1]


def variant_bundle(source: Path, parts: tuple[str, ...], folder: Path) -> Path:
    """A copy of bundle ``source`` in ``folder`` whose graph has ``parts`` removed (:func:`ablate`), its weights
    inline (beside it over 2 GB, as the exporter writes them). Returns the copy's directory."""
    config = bundle.load_config(source)
    model = onnx.load(str(source / config.onnx_file))
    for part in parts:
        ablate(model, part, config.head_dim)
    target = folder / "-".join(parts)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(config.onnx_file, bundle.external_data_file(config.onnx_file)))
    onnx.save(model, str(target / config.onnx_file), save_as_external_data=model.ByteSize() > bundle.MAX_INLINE_BYTES,
              location=bundle.external_data_file(config.onnx_file))
    return target


def paired(rounds: list[dict], name: str) -> dict:
    """Variant ``name``'s figures over ``rounds`` (per round, name -> {"step_ms", "cpu_ms"}: one interleaved
    sample each): median step and CPU ms, and its part's cost as the median over rounds of the whole step's time
    minus the variant's in the same round (slow drift of the machine's speed cancels), with the rounds' least
    and greatest difference."""
    def differences(kind):
        return [r[WHOLE][kind] - r[name][kind] for r in rounds]
    times = {"step_ms": float(np.median([r[name]["step_ms"] for r in rounds])),
             "cpu_ms": float(np.median([r[name]["cpu_ms"] for r in rounds]))}
    if name == WHOLE:  # nothing removed: no part cost (empty in the CSV)
        return {**times, "part_ms": None, "part_ms_min": None, "part_ms_max": None, "part_share": None,
                "part_cpu_ms": None}
    step = differences("step_ms")
    whole_ms = float(np.median([r[WHOLE]["step_ms"] for r in rounds]))
    return {**times, "part_ms": float(np.median(step)), "part_ms_min": min(step), "part_ms_max": max(step),
            "part_share": float(np.median(step)) / whole_ms, "part_cpu_ms": float(np.median(differences("cpu_ms")))}


def run(args) -> dict:
    """All measurements: {"meta", "rows"}, one row per (variant, P, W)."""
    config = bundle.load_config(args.bundle)
    if config.graph != "fused":
        raise bundle.BundleError(f"{args.bundle} holds a step graph; this script removes parts of the model builder's "
                                 "graph: give it a fused bundle (mars-export --graph fused), or profile a step graph "
                                 "with bench/profile_step.py")
    furthest = max(args.pasts) + max(max(args.windows), 2)  # a fused step writes max(W, 2) positions
    if furthest > config.max_context:
        raise bundle.BundleError(f"--pasts {max(args.pasts)} with --windows {max(args.windows)} reaches position "
                                 f"{furthest - 1}, beyond the model's context of {config.max_context}; pass smaller pasts")
    machine = machine_info()  # before the run: its load average is the machine's, not this script's
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    variants = [(part,) for part in args.parts] + ([tuple(args.parts)] if len(args.parts) > 1 else [])
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mars-ablation-") as tmp:
        paths = {WHOLE: args.bundle / config.onnx_file}
        for parts in variants:
            name = ALL if len(parts) > 1 else parts[0]
            paths[name] = variant_bundle(args.bundle, parts, Path(tmp)) / config.onnx_file
            print(f"built the variant without {' + '.join(parts)}", flush=True)
        sessions = {name: make_session(path, args.threads) for name, path in paths.items()}
        step_config = replace(config, graph="step")  # decode_inputs: a cache of P + W positions, as profile_step
        for past, window in itertools.product(args.pasts, args.windows):
            inputs = decode_inputs(step_config, window, 1, past, rng)
            calls = {name: step_call(session, config, inputs) for name, session in sessions.items()}
            rounds = [interleaved_times({n: calls[n] for n in rotated(list(calls), i)}, args.steps, 1)
                      for i in range(args.rounds)]  # one sample of every variant per round
            for name in calls:
                rows.append({"variant": name, "past": past, "window": window, **paired(rounds, name)})
            print(f"P={past} W={window}: whole step {rows[-len(calls)]['step_ms']:.2f} ms; " + ", ".join(
                f"{r['variant']} {r['part_ms']:.2f} ms ({r['part_share']:.0%})" for r in rows[-len(calls) + 1:]),
                flush=True)
            del calls, inputs
        del sessions
    meta = {"command": "python bench/step_ablation.py " + " ".join(sys.argv[1:]), "bundle": str(args.bundle),
            "started_utc": started, "ended_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "weight_dtype": config.weight_dtype, "threads": args.threads, "steps": args.steps, "rounds": args.rounds,
            "machine": machine, "loadavg_end": os.getloadavg()}
    return {"meta": meta, "rows": rows}


def markdown(result: dict) -> str:
    """Per P and W: the whole step, then each variant's time and what its part costs (median of the rounds' paired
    differences, and their range: a part whose range spans 0 is within the machine's noise)."""
    lines = ["| P | W | variant | step ms | CPU ms | part removed costs, ms (rounds' range) | share of the whole step |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cost = " | " if r["variant"] == WHOLE else \
            f"{r['part_ms']:.2f} ({r['part_ms_min']:.2f} to {r['part_ms_max']:.2f}) | {r['part_share']:.0%}"
        lines.append(f"| {r['past']} | {r['window']} | {r['variant']} | {r['step_ms']:.2f} | {r['cpu_ms']:.2f} | {cost} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Per (P, W), each removal's cost: the median of the rounds, and their range as an error bar (a bar whose range
    crosses 0 is within the noise)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["variant"] != WHOLE]
    points = list(dict.fromkeys((r["past"], r["window"]) for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(5, 1.8 * len(points)), 4.5))
    for j, variant in enumerate(variants):
        at = [next(r for r in rows if r["variant"] == variant and (r["past"], r["window"]) == p) for p in points]
        ax.bar([i + j * width for i in range(len(points))], [r["part_ms"] for r in at], width, color=f"C{j}",
               label=variant, yerr=[[r["part_ms"] - r["part_ms_min"] for r in at],
                                    [r["part_ms_max"] - r["part_ms"] for r in at]], capsize=2)
    ax.axhline(0, color="k", linewidth=0.5)
    ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(points))],
                  [f"P {p}, W {w}" for p, w in points])
    ax.set(ylabel="ms per step", title=f"what removing each part saves, {result['meta']['threads']} thread(s)\n"
                                       "(median of the rounds; bars: their range)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path, help="a fused bundle (mars-export --graph fused)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to remove, one at a time")
    p.add_argument("--pasts", type=int, nargs="+", default=[128, 1024], help="past lengths P")
    p.add_argument("--windows", type=int, nargs="+", default=[1], help="windows W")
    p.add_argument("--steps", type=int, default=20, help="steps per timing sample")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="onnxruntime intra-op threads")
    add_results_options(p, "step_ablation")
    args = p.parse_args()
    if min(args.pasts) < 0 or min(args.windows) < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--pasts must be >= 0; --windows, --steps and --rounds at least 1")
    if not 1 <= args.threads <= 256:
        p.error(f"--threads must be in 1..256, got {args.threads}")
    check_results(args)
    args.parts = list(dict.fromkeys(args.parts))
    try:
        result = run(args)
    except ValueError as e:  # a bundle or graph this script cannot ablate (BundleError among them)
        p.error(str(e))
    write_results(args.out, args.name, result, result["rows"], lambda path: plot(result, path))
    print(markdown(result))


if __name__ == "__main__":
    sys.exit(run_main(main))

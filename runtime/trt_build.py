"""Build ``engine.plan`` from a bundle's ONNX step graph with TensorRT's Python API (no torch).

``python -m runtime.trt_build BUNDLE [options]`` builds the engine on the machine that
will run it (an engine is tied to its GPU and TensorRT version, so a Jetson builds its
own) and records it in ``mars_config.json``. ``--print-trtexec`` prints the equivalent
``trtexec`` line instead and needs no TensorRT.

Dimension letters (runtime/__init__.py): n batch rows, W window (fixed), S past length (the KV
cache capacity: position p at index p, the step's W entries written at their positions), H KV
heads, D head dim. One optimization profile covers B in 1..max_batch and S in W..max_context
(S = W: the first step, positions 0..W-1; a slot never holds more than max_context
positions). Its min, opt and max shapes each keep the dimensions the graph ties together
equal: B in every input, and the attention mask's last axis = S, the KV inputs' third axis.
The present outputs have the past inputs' shapes (TensorRT infers them; outputs get no profile).

Networks are strongly typed (TensorRT 11 allows nothing else; TensorRT 10 gets the flag):
the engine computes in the precision the ONNX graph states, so an fp16 engine comes from
an ``mars-export --fp16`` bundle, not from a builder flag. A float32 graph's engine is
built with TF32 off, so it meets the fp32 export's parity tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from runtime import bundle
from runtime.bundle import BundleConfig, BundleError, load_config
from runtime.command_line import ArgumentParser, run_main

# None for max_context / opt_context: min(model context, MAX_CONTEXT_CAP) and min(max_context, OPT_CONTEXT_CAP)
MAX_CONTEXT_CAP = 4096
OPT_CONTEXT_CAP = 1024
INSTALL_HINT = ("install the TensorRT extra on a machine with an NVIDIA GPU: pip install 'mars-edge[trt]' "
                "(on Jetson: JetPack's python3-libnvinfer and pip install cuda-python)")


@dataclass(frozen=True)
class TrtBuildOptions:
    """The optimization profile and builder limits.

    Attributes:
        max_batch / opt_batch: largest batch, and the batch TensorRT tunes for.
        max_context / opt_context: largest past S (KV cache capacity, the positions a slot may
            hold), and the S tuned for; None = min(model context, MAX_CONTEXT_CAP) and
            min(max_context, OPT_CONTEXT_CAP).
        workspace_mib: builder workspace limit in MiB; None = TensorRT's default (all
            device memory), which a Jetson sharing RAM with the OS may want to lower.
    """

    max_batch: int = 8
    opt_batch: int = 1
    max_context: int | None = None
    opt_context: int | None = None
    workspace_mib: int | None = None

    def __post_init__(self):
        if not 1 <= self.opt_batch <= self.max_batch:
            raise ValueError(f"need 1 <= opt batch <= max batch, got opt {self.opt_batch}, max {self.max_batch}")
        if self.workspace_mib is not None and self.workspace_mib < 1:
            raise ValueError(f"workspace_mib must be >= 1, got {self.workspace_mib}")


def profile_shapes(config: BundleConfig, options: TrtBuildOptions) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shape of every step-graph input.

    Raises:
        ValueError: a fused bundle (its graph is onnxruntime's, not the step graph), a context
            outside W + 1 .. the model's max context, or opt > max.
    """
    if config.graph != "step":
        raise ValueError(f"a {config.graph} bundle holds onnxruntime's fused graph (GroupQueryAttention; CPU, batch 1), "
                         "which TensorRT does not build: export the bundle with mars-export --graph step")
    window = config.window
    max_context = options.max_context or min(config.max_context, MAX_CONTEXT_CAP)
    opt_context = options.opt_context or min(max_context, OPT_CONTEXT_CAP)
    if not window < opt_context <= max_context <= config.max_context:
        raise ValueError(f"need window ({window}) < opt context ({opt_context}) <= max context ({max_context}) "
                         f"<= the model's context ({config.max_context})")
    batches = (1, options.opt_batch, options.max_batch)
    pasts = (window, opt_context, max_context)  # S: the smallest holds one window at positions 0..W-1
    heads, dim = config.num_kv_heads, config.head_dim
    shapes = {
        bundle.INPUT_IDS: tuple((b, window) for b in batches),  # [n, W]
        bundle.POSITION_IDS: tuple((b, window) for b in batches),  # [n, W]
        bundle.ATTENTION_MASK: tuple((b, 1, window, s) for b, s in zip(batches, pasts)),  # [n, 1, W, S]
    }
    for layer in range(config.num_layers):
        for name in bundle.past_names(layer):
            shapes[name] = tuple((b, heads, s, dim) for b, s in zip(batches, pasts))  # [n, H, S, D]
    return shapes


def profile_limits(profile_shape) -> tuple[int, int]:
    """The largest batch and past length S (KV cache capacity) an optimization profile accepts.

    Args:
        profile_shape: input name -> its (min, opt, max) shapes, e.g.
            ``lambda name: engine.get_tensor_profile_shape(name, 0)`` or ``profile_shapes(...).__getitem__``.

    Returns:
        (max batch B, max past S): the largest dimensions 0 and 2 of the first layer's past
        key ``[n, H, S, D]``; the engine must never feed more (:class:`runtime.decode.engine.Engine`),
        so a slot holds at most S positions.
    """
    largest = tuple(profile_shape(bundle.past_names(0)[0])[2])  # [n, H, S, D]
    return int(largest[0]), int(largest[2])


def trtexec_command(config: BundleConfig, options: TrtBuildOptions, onnx_path: str = bundle.ONNX_FILE,
                    engine_path: str = bundle.ENGINE_FILE) -> str:
    """The ``trtexec`` line that builds the same engine as :func:`build_engine`."""
    shapes = profile_shapes(config, options)

    def flag(which: int) -> str:
        return ",".join(f"{name}:{'x'.join(map(str, dims[which]))}" for name, dims in shapes.items())

    no_tf32 = " --noTF32" if config.dtype == "float32" else ""  # as build_engine
    parts = [f"trtexec --onnx={onnx_path} --saveEngine={engine_path} --stronglyTyped{no_tf32}",
             f"--minShapes={flag(0)}", f"--optShapes={flag(1)}", f"--maxShapes={flag(2)}"]
    if options.workspace_mib:
        parts.append(f"--memPoolSize=workspace:{options.workspace_mib}")  # MiB
    return " \\\n    ".join(parts)


def require_tensorrt():
    """Import and return the ``tensorrt`` module, or raise with the fix named.

    Raises:
        RuntimeError: TensorRT is not installed (or cannot load its libraries).
    """
    try:
        import tensorrt
    except (ImportError, OSError) as e:
        raise RuntimeError(f"TensorRT is not available ({e}); {INSTALL_HINT}") from e
    return tensorrt


@contextlib.contextmanager
def graph_for_tensorrt(onnx_path: Path, config: BundleConfig):
    """The path of the step graph TensorRT parses: ``onnx_path``, or, where the graph has the greedy head
    (:func:`runtime.bundle.has_greedy_head`: float32 CPU exports; onnxruntime's 8-bit ``MatMulNBits``, which
    TensorRT's parser does not take), a copy without it (:func:`runtime.bundle.strip_greedy_head`) beside ``onnx_path``, so
    that external data resolves, removed on exit.

    Raises:
        RuntimeError: the graph has the head and the ``onnx`` package is missing (the fix named).
    """
    if not bundle.has_greedy_head(config):
        yield onnx_path
        return
    try:
        import onnx
    except ImportError as e:
        raise RuntimeError(f"{onnx_path} has the greedy head (onnxruntime's MatMulNBits), which TensorRT does not "
                           "parse; leaving it out needs the onnx package: pip install 'onnx>=1.18,<2'") from e
    model = onnx.load(str(onnx_path), load_external_data=False)  # weights in external data stay where they are
    bundle.strip_greedy_head(model)
    fd, name = tempfile.mkstemp(prefix=".tensorrt-", suffix=".onnx", dir=onnx_path.parent)
    os.close(fd)
    try:
        onnx.save(model, name)
        yield Path(name)
    finally:
        os.unlink(name)


def build_engine(onnx_path: str | Path, engine_path: str | Path, config: BundleConfig,
                 options: TrtBuildOptions) -> None:
    """Parse ``onnx_path`` (without the greedy head, :func:`graph_for_tensorrt`), build a strongly typed engine
    with one profile (TF32 off for float32 graphs), write ``engine_path``.

    Raises:
        ValueError: a fused bundle, or bad profile contexts (:func:`profile_shapes`), before TensorRT is loaded.
        RuntimeError: TensorRT missing, onnx missing for a graph with the greedy head, the parser rejected the
            graph (its errors are listed), or the build failed (no GPU, out of memory, unsupported layer).
    """
    shapes = profile_shapes(config, options)
    trt = require_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)  # ignored (always on) in TensorRT 11
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    with graph_for_tensorrt(Path(onnx_path), config) as path:
        if not parser.parse_from_file(str(path)):  # reads external data beside the file too
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
    builder_config = builder.create_builder_config()
    if config.dtype == "float32":
        # TF32 (on by default) rounds float32 matmul inputs to 10-bit mantissas, past the fp32 parity
        # tolerance. The flag is a math mode, not a type choice: TensorRT 11, strongly typed only,
        # still has it (NvInfer.h, BuilderFlag::kTF32), so a strongly typed network may clear it.
        builder_config.clear_flag(trt.BuilderFlag.TF32)
    if options.workspace_mib:
        builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mib << 20)
    profile = builder.create_optimization_profile()
    for name, (smallest, typical, largest) in shapes.items():
        profile.set_shape(name, smallest, typical, largest)
    builder_config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, builder_config)
    if plan is None:
        raise RuntimeError(f"TensorRT could not build an engine from {onnx_path} (see the TensorRT log above)")
    Path(engine_path).write_bytes(bytes(plan))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m runtime.trt_build", description=__doc__.splitlines()[0])
    p.add_argument("bundle", help="bundle directory written by mars-export")
    p.add_argument("--max-batch", type=int, default=TrtBuildOptions.max_batch,
                   help="largest batch (default %(default)s)")
    p.add_argument("--opt-batch", type=int, default=TrtBuildOptions.opt_batch,
                   help="batch to tune for (default %(default)s)")
    p.add_argument("--max-context", type=int, default=None, help="largest KV cache capacity, the positions a slot "
                   f"may hold (default min(context, {MAX_CONTEXT_CAP}))")
    p.add_argument("--opt-context", type=int, default=None,
                   help=f"KV cache capacity to tune for (default min(max context, {OPT_CONTEXT_CAP}))")
    p.add_argument("--workspace-mib", type=int, default=None, help="builder workspace limit in MiB")
    p.add_argument("--print-trtexec", action="store_true", help="print the equivalent trtexec line and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m runtime.trt_build``; returns the exit code (0 ok, 2 after one ``error:`` line)."""
    try:
        args = parse_args(argv)  # argparse's refusals: UsageError, a ValueError
        config = load_config(args.bundle)
        options = TrtBuildOptions(args.max_batch, args.opt_batch, args.max_context, args.opt_context,
                                  args.workspace_mib)
        if args.print_trtexec:
            print(trtexec_command(config, options))
            return 0
        build_engine(Path(args.bundle) / config.onnx_file, Path(args.bundle) / bundle.ENGINE_FILE, config, options)
    except (BundleError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    updated = replace(config, engine_file=bundle.ENGINE_FILE)
    (Path(args.bundle) / bundle.CONFIG_FILE).write_text(updated.to_json())
    print(f"wrote {Path(args.bundle) / bundle.ENGINE_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))  # run_main: a closed stdout (| head) ends it quietly

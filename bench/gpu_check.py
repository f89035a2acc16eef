"""GPU check of the TensorRT path, in one run: build, identity, speed; writes JSON.

    python bench/gpu_check.py [--model default-mars] [--block 4] [--prompts FILE] [--dry-run]
                              [--out bench/results/gpu_check.json]

On a machine with an NVIDIA GPU, TensorRT and cuda-python (``pip install -e '.[gpu,export,trt]'``):

0. What the run needs: TensorRT, cuda-python, a CUDA device, the export side (torch,
   transformers, onnx), onnxruntime and the model (the default one comes from PyPI, 94 MB,
   the first time); the report lists whatever is missing, with what to install.
1. References on the CPU: the prompts (the package's ``mars_export/data/parity_prompts.json``,
   or ``--prompts``, a JSON file of the same form) and float32 PyTorch greedy AR
   (``mars_export.reference.greedy_generate``) for each, before any GPU call.
   ``--dry-run`` stops here: everything up to the first GPU call, runnable on any CPU.
2. ``mars-export MODEL --fp16 --trt`` (and the fp32 graph with --fp32 as well): exports the
   step graph, builds ``engine.plan`` and records parity against PyTorch on onnxruntime CPU,
   onnxruntime CUDA (when that provider exists) and the TensorRT engine; the export fails
   past the tolerance.
3. tau = 1 identity: the TensorRT engine at tau = 1 against the CPU references. A mismatch
   is classed a near-tie when the float32 logits of the two candidate tokens at the first
   differing step are within twice the recorded parity |Δlogit|.
4. Speed: AR (tau = 1) against MARS (tau = 0.9, and 0.7) on the same engine, same prompts,
   same max_new_tokens, interleaved; tokens/s, TPF and the MARS / AR ratio.

Exit code 0 when the export passed parity and every mismatch is a near-tie (with
``--dry-run``: when the CPU part ran); 1 otherwise, the report naming what failed or is
missing; 2 for a bad command line (a --model or --prompts path that is not there among them): one
``error:`` line and no report. CI runs ``--dry-run`` on a tiny model; the full run is the device check.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from importlib import metadata, resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mars_export.default_model import check_model_spec  # noqa: E402
from runtime.command_line import ArgumentParser, UsageError  # noqa: E402

# What the full run imports, and where it comes from when missing.
NEEDED = {"tensorrt": "pip install 'mars-edge[trt]' (tensorrt-cu12; on Jetson: JetPack's python3-libnvinfer)",
          "cuda-python": "pip install 'mars-edge[trt]' (cuda-python)",
          "torch": "pip install 'mars-edge[export]'", "transformers": "pip install 'mars-edge[export]'",
          "onnx": "pip install 'mars-edge[export]'",
          "onnxruntime": "pip install 'mars-edge[gpu]' (or [cpu])"}
MODULES = {"tensorrt": ("tensorrt",), "cuda-python": ("cuda.bindings.runtime", "cuda.cudart"), "torch": ("torch",),
           "transformers": ("transformers",), "onnx": ("onnx",), "onnxruntime": ("onnxruntime",)}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default-mars", help="model spec for mars-export (default default-mars)")
    p.add_argument("--block", type=int, default=4, help="block size B = window W (default 4, the adapter's)")
    p.add_argument("--mask-token", default=None, help="the MARS mask token (default: the one the model records)")
    p.add_argument("--work", default=str(ROOT / "bundles" / "gpu-check"), help="where the bundles go")
    p.add_argument("--prompts", default=None, help="JSON file {\"prompts\": [{\"source\", \"text\"}, ...]} "
                                                   "(default: the package's parity prompts)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--fp32", action="store_true", help="also export and check the fp32 graph")
    p.add_argument("--dry-run", action="store_true", help="stop before the first GPU call (runs on a CPU)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    args = p.parse_args(argv)
    try:  # a model or prompts file that is not there is the user's to fix, not a failed check in the report
        check_model_spec(args.model)
    except ValueError as e:
        p.error(str(e))
    if args.prompts is not None and not Path(args.prompts).is_file():
        p.error(f"--prompts {args.prompts} is no file; give a JSON file {{\"prompts\": [{{\"text\": ...}}]}} "
                "or leave it out")
    return args


def load_prompts(path: str | None, num: int | None) -> list[tuple[str, str]]:
    """(source, text) of the prompts file (the package's parity prompts by default), the first ``num``.

    Raises:
        ValueError: the file is missing, not of the form ``{"prompts": [{"source", "text"}]}``,
            or gives no prompt (the identity check would pass on nothing).
    """
    try:
        raw = json.loads(Path(path).read_text() if path else
                         resources.files("mars_export").joinpath("data/parity_prompts.json").read_text())
        prompts = [(p.get("source", "prompt"), p["text"]) for p in raw["prompts"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read prompts from {path}: {e}; give a JSON file "
                         '{"prompts": [{"source": ..., "text": ...}]}') from e
    prompts = prompts[:num]
    if not prompts:
        raise ValueError(f"no prompts to check ({path or 'the package prompts'}, --num-prompts {num}); "
                         "give at least one")
    return prompts


def environment() -> dict:
    """Python, machine, the installed versions of what the full run needs, the GPU, and what is missing."""
    env, missing = {"python": platform.python_version(), "machine": platform.machine(), "packages": {}}, []
    for package, modules in MODULES.items():
        found = _import_first(modules)
        if isinstance(found, Exception):
            missing.append(f"{package} ({type(found).__name__}: {found}): {NEEDED[package]}")
        else:
            env["packages"][package] = getattr(found, "__version__", None) or _dist_version(package)
    if not missing:
        try:
            from runtime.backends.cuda_runtime import CudaRuntime
            env["gpu"] = CudaRuntime().device_name()
        except RuntimeError as e:
            missing.append(f"a CUDA device: {e}")
    env["missing"] = missing
    return env


def _import_first(modules: tuple[str, ...]):
    """The first of ``modules`` that imports, else the last error (TensorRT's libraries may fail to load)."""
    error = None
    for name in modules:
        try:
            return importlib.import_module(name)
        except (ImportError, OSError) as e:
            error = e
    return error


def _dist_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None  # e.g. JetPack's apt TensorRT, which has no pip metadata


def references(model_spec: str, mask_token: str | None, prompts, max_new: int) -> dict:
    """Load the model (float32, CPU) and greedy-decode every prompt with no stop token (cut at the
    bundle's end tokens when compared); the model stays on the CPU, where its inputs are built."""
    from mars_export.model_source import load_model
    from mars_export.parity import chat_prompt_ids
    from mars_export.reference import greedy_generate
    loaded = load_model(model_spec, mask_token)
    rows = []
    for kind, text in prompts:
        ids = chat_prompt_ids(loaded.tokenizer, text)
        rows.append({"kind": kind, "prompt_ids": ids,
                     "token_ids": greedy_generate(loaded.model, ids, max_new, frozenset()).token_ids})
    return {"loaded": loaded, "rows": rows}


def export_bundle(model: str, mask_token: str | None, out: Path, block: int, fp16: bool) -> dict:
    from mars_export.cli import main as export_main
    args = [model, "-o", str(out), "--block", str(block), "--trt", "--force"] + (["--fp16"] if fp16 else [])
    args += ["--mask-token", mask_token] if mask_token else []
    start = time.perf_counter()
    code = export_main(args)
    return {"args": args, "exit_code": code, "seconds": round(time.perf_counter() - start, 1)}


def cut_at_end(tokens: list[int], stops) -> list[int]:
    """``tokens`` up to and including the first end token."""
    end = next((i for i, t in enumerate(tokens) if t in stops), len(tokens) - 1)
    return tokens[:end + 1]


def identity(model, decoder, config, refs: list[dict], max_new: int) -> dict:
    """tau = 1 on the engine against the CPU references; mismatches classed by their fp32 logit gap."""
    import torch

    from runtime.decode.decoder import DecodeParams
    rows, stops = [], frozenset(config.eos_token_ids)
    near_tie_limit = 2 * max(b["max_abs_logit_diff"] for b in [config.parity, *config.parity.get("backends", {}).values()])
    for ref in refs:
        ids, expected = ref["prompt_ids"], cut_at_end(ref["token_ids"], stops)
        got = decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=max_new)).token_ids
        row = {"kind": ref["kind"], "identical": got == expected, "num_tokens": len(got)}
        if got != expected:
            first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            row["first_difference"] = first
            if first < min(len(got), len(expected)):
                with torch.no_grad():  # the model and these inputs are on the CPU
                    logits = model(torch.tensor([ids + expected[:first]])).logits[0, -1].float()
                gap = float(logits[expected[first]] - logits[got[first]])
                row.update(fp32_gap=gap, near_tie=gap <= near_tie_limit)
            else:
                row["near_tie"] = False  # one output stopped early: an end token differs
        rows.append(row)
    return {"prompts": rows, "identical": sum(r["identical"] for r in rows), "total": len(rows),
            "near_tie_limit": near_tie_limit,
            "all_mismatches_near_ties": all(r["identical"] or r.get("near_tie") for r in rows)}


def speed(decoder, refs: list[dict], max_new: int, taus=(1.0, 0.9, 0.7)) -> dict:
    """Interleaved runs per prompt (warm-up first); tokens/s over decode time, TPF."""
    from runtime.decode.decoder import DecodeParams
    decoder.generate(refs[0]["prompt_ids"], DecodeParams(tau=1.0, max_new_tokens=16))  # warm-up: allocations
    totals = {tau: {"tokens": 0, "forwards": 0, "seconds": 0.0} for tau in taus}
    for ref in refs:
        for tau in taus:
            result = decoder.generate(ref["prompt_ids"], DecodeParams(tau=tau, max_new_tokens=max_new))
            t = totals[tau]
            t["tokens"] += result.num_tokens
            t["forwards"] += result.num_forwards
            t["seconds"] += result.seconds - result.prefill_seconds
    out = {f"tau={tau}": {"tokens_per_second": t["tokens"] / t["seconds"], "tpf": t["tokens"] / t["forwards"],
                          **t} for tau, t in totals.items()}
    ar = out["tau=1.0"]["tokens_per_second"]
    for tau in taus[1:]:
        out[f"tau={tau}"]["speedup_vs_ar"] = out[f"tau={tau}"]["tokens_per_second"] / ar
    return out


def check(bundle: Path, model, refs: list[dict], max_new: int) -> dict:
    from runtime.bundle import load_config
    from runtime.decode.decoder import Decoder
    from runtime.backends.trt import TrtBackend
    config = load_config(bundle)
    decoder = Decoder(TrtBackend(bundle, config), config)
    return {"dtype": config.dtype, "parity": config.parity,
            "identity_tau1": identity(model, decoder, config, refs, max_new),
            "speed": speed(decoder, refs, max_new)}


def run_on_gpu(args, refs: dict, report: dict) -> bool:
    """Steps 2-4 for fp16 (and fp32); True when every export passed and every mismatch is a near-tie."""
    ok = True
    for fp16 in [True, False] if args.fp32 else [True]:
        name = "fp16" if fp16 else "fp32"
        bundle = Path(args.work) / f"{Path(args.model).name}-b{args.block}-{name}"
        run = {"export": export_bundle(args.model, args.mask_token, bundle, args.block, fp16)}
        if run["export"]["exit_code"] == 0:
            run.update(check(bundle, refs["loaded"].model, refs["rows"], args.max_new_tokens))
            ok &= run["identity_tau1"]["all_mismatches_near_ties"]
        else:
            ok = False
        report["runs"][name] = run
    return ok


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:  # argparse's refusals: one line, exit status 2, as every command
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "environment": environment(), "model": args.model,
              "block_size": args.block, "max_new_tokens": args.max_new_tokens, "dry_run": args.dry_run, "runs": {}}
    missing = report["environment"]["missing"]
    refs = None
    if args.dry_run or not missing:  # a full run stops at once when the GPU part cannot run
        try:
            prompts = load_prompts(args.prompts, args.num_prompts)
            refs = references(args.model, args.mask_token, prompts, args.max_new_tokens)
            report["references"] = [{"kind": r["kind"], "num_prompt_tokens": len(r["prompt_ids"]),
                                     "num_tokens": len(r["token_ids"])} for r in refs["rows"]]
        except (ValueError, RuntimeError, ImportError, OSError) as e:
            missing.append(f"the prompts and the model {args.model!r}: {e}")
    if args.dry_run:
        ok = refs is not None  # the CPU part ran; what the GPU part lacks is listed, not fatal
    else:
        ok = not missing and run_on_gpu(args, refs, report)
    report["passed"] = ok
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"passed": ok, "dry_run": args.dry_run, "missing": missing, "out": args.out}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

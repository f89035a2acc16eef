"""Batch-1 speed of the torch-free runtime against transformers ``generate`` on the same model.

    python bench/runtime_vs_transformers.py BUNDLE [--taus 1.0 0.9] [--max-new-tokens 128]

Same process, same prompts (samples/prompts/demo_prompts.json: GSM8K test, HumanEval),
same max_new_tokens, runs interleaved per prompt. The baseline is transformers greedy
``generate`` (fp32, KV cache) on the checkpoint the bundle was exported from (the default
model's cached conversion unless --checkpoint is given). Writes JSON, CSV and a PNG plot
to --out (default bench/results/) and prints ratios to the baseline.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mars_export.model_source import default_checkpoint
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.command_line import ArgumentParser, make_taus_value, run_main
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams
from runtime.text.tokenizer import Tokenizer

PROMPTS = Path(__file__).resolve().parents[1] / "samples" / "prompts" / "demo_prompts.json"


def time_transformers(model, ids: list[int], max_new: int) -> tuple[list[int], float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def run(args) -> list[dict]:
    config = load_config(args.bundle)
    decoder, tokenizer = Decoder(OnnxBackend(args.bundle, config), config), Tokenizer(args.bundle)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint or default_checkpoint(), dtype=torch.float32).eval()
    rows = []
    for prompt in json.loads(PROMPTS.read_text())["prompts"]:
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt["text"]}])
        hf_ids, hf_seconds = time_transformers(model, ids, args.max_new_tokens)
        rows.append({"prompt": prompt["id"], "engine": "transformers", "tau": 1.0, "num_tokens": len(hf_ids),
                     "num_forwards": len(hf_ids), "tpf": 1.0, "seconds": hf_seconds, "identical_to_ar": True})
        for tau in args.taus:
            result = decoder.generate(ids, DecodeParams(tau=tau, max_new_tokens=args.max_new_tokens))
            rows.append({"prompt": prompt["id"], "engine": "runtime-onnx-cpu", "tau": tau, "num_tokens": result.num_tokens,
                         "num_forwards": result.num_forwards, "tpf": result.tpf, "seconds": result.seconds,
                         "prefill_seconds": result.prefill_seconds, "identical_to_ar": result.token_ids == hf_ids})
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    groups = {}
    for row in rows:
        groups.setdefault((row["engine"], row["tau"]), []).append(row)
    summary = []
    for (engine, tau), group in groups.items():
        tokens, seconds = sum(r["num_tokens"] for r in group), sum(r["seconds"] for r in group)
        summary.append({"engine": engine, "tau": tau, "num_tokens": tokens, "seconds": seconds,
                        "tokens_per_second": tokens / seconds,
                        "tpf": tokens / sum(r["num_forwards"] for r in group),
                        "identical_to_ar": sum(r["identical_to_ar"] for r in group), "num_prompts": len(group)})
    base = next(s for s in summary if s["engine"] == "transformers")["tokens_per_second"]
    for s in summary:
        s["speed_ratio_vs_transformers"] = s["tokens_per_second"] / base
    return summary


def write(out: Path, rows: list[dict], summary: list[dict], meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    (out / "runtime_vs_transformers.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": rows}, indent=1))
    with open(out / "runtime_vs_transformers.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows(summary)
    labels = [f"{s['engine']}\ntau={s['tau']}" for s in summary]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(labels, [s["tokens_per_second"] for s in summary], color="#4878a8")
    ax.set_ylabel("tokens/s (end to end, batch 1)")
    ax.set_title(f"{meta['model']} on {meta['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "runtime_vs_transformers.png", dpi=120)


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--checkpoint", default=None, help="HF checkpoint of the baseline (default: the default model)")
    p.add_argument("--taus", type=make_taus_value("--taus"), nargs="+", default=[1.0, 0.9])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    rows = run(args)
    summary = summarize(rows)
    meta = {"model": load_config(args.bundle).source_model, "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores", "torch_threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
            "date": time.strftime("%Y-%m-%d")}
    write(args.out, rows, summary, meta)
    for s in summary:
        print(f"{s['engine']:18s} tau={s['tau']:<4} {s['tokens_per_second']:6.1f} tok/s  TPF {s['tpf']:.2f}  "
              f"x{s['speed_ratio_vs_transformers']:.2f} vs transformers  identical to AR: {s['identical_to_ar']}/{s['num_prompts']}")


if __name__ == "__main__":
    sys.exit(run_main(main))

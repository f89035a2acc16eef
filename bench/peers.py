"""Peer benchmark: our runtime against transformers, ONNX Runtime GenAI, llama.cpp and optimum, same weights.

    scripts/bench_peers.sh [--num-prompts 8] [--max-new-tokens 128] [--batch-sizes 1 4] [--threads N]

The shell script sets up one venv per peer (their pins conflict with the project's) and
runs the subcommands below, each engine in its own process and venv:

    python bench/peers.py checkpoint --out CKPT           # project venv: HF checkpoint of the merged MARS weights
    python bench/peers.py prompts --work DIR [options]   # project venv: prompt ids + settings -> DIR/prompts.json
    python bench/peers.py run --engine E --work DIR --model PATH [--tag T]   # E's rows -> DIR/rows-E[-T].json
    python bench/peers.py record --engine E --work DIR --status S --log FILE [--tag T] [--exit-status N]
                                                         # could not install/run
    python bench/peers.py quantize-gguf --type q4_0|q4_1 --input F32.gguf --out OUT.gguf   # llamacpp venv
    python bench/peers.py report --work DIR --out bench/results    # peers.{json,csv,png} + a Markdown table

Every engine is fed the same prompt token ids (the bundle's chat template, GSM8K test
questions and HumanEval prompts alternating, from $MARS_SHARED_DATA, else ../shared/data beside
the checkout), greedy, fp32 (plus llama.cpp Q8_0, Q4_0 and Q4_1 and our int8 / int4 bundles,
tagged rows of ``ours``; Q8_0 is our int8's scheme and Q4_1 the blocks our int4 bundle of the
default model imports, and the report gives our AR speed against each), the same thread count.
Prompts run in static chunks of the batch size (the same workload for every engine; ours gets
no continuous-batching refill). Per chunk: time to first token
(TTFT: until every sequence of the chunk has its first token; transformers and optimum
measure it with a streamer, in the same ``generate`` call), then decode tokens/s (tokens
after each sequence's first / time after TTFT) and end-to-end tokens/s. Each engine runs
one warm-up generation first. The prompt token count each engine consumed is recorded and
a mismatch with prompts.json stops the run. Only the standard library (and
``runtime/command_line.py``, which needs nothing else) is imported at the top: the peer venvs
lack the project's packages.

Threads: on a machine shared with other jobs, engines using every core (torch, llama.cpp)
slowed down 4-30x in the smoke runs (threads waiting on a busy core); measure on a quiet
machine, or give --threads below the free cores. Each engine's rows record the load
average before and after its run.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# the project is not installed in the peer venvs; runtime/command_line.py needs nothing but argparse
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runtime.command_line import (ArgumentParser, UsageError, existing_file, how_it_ended,  # noqa: E402
                                  make_taus_value, path_value, run_main)

ENGINES = ("ours", "transformers", "ortgenai", "llamacpp", "optimum")
OK, FAILED, UNSUPPORTED = "ok", "failed", "not supported"
QUANTIZED = ("int8", "int4")  # weight dtypes of our quantized bundles; their rows files are rows-ours-DTYPE.json
QUANTIZED_VARIANTS = ("ar", "verify + both")  # what a quantized bundle of ours runs
WARMUP_TOKENS = 4


@dataclass
class Chunk:
    """What one engine did on one static batch of prompts.

    Attributes:
        outputs: generated ids per prompt, cut after the first end token (included).
        seconds: wall-clock of the whole chunk; first_token_seconds: until every row had a token.
        num_forwards: decode forwards summed over rows (None when the engine hides them).
        prompt_tokens: prompt tokens the engine consumed, per row (padding excluded).
    """

    outputs: list
    seconds: float
    first_token_seconds: float
    num_forwards: int | None
    prompt_tokens: list


# ---------------------------------------------------------------- prompts and rows


def prepare_prompts(args) -> None:
    """Project venv: write the prompt ids (bundle chat template) and the run settings to prompts.json."""
    from runtime.evaluation.tasks import load_gsm8k, load_humaneval
    from runtime.bundle import load_config
    from runtime.text.tokenizer import Tokenizer
    from support import shared_data_file  # tests/ is on the path: main put it there for this command

    half = (args.num_prompts + 1) // 2
    items = [x for pair in zip(load_gsm8k(shared_data_file("gsm8k/test.jsonl"), half),
                               load_humaneval(shared_data_file("humaneval/HumanEval.jsonl.gz"), half)) for x in pair]
    tokenizer, config = Tokenizer(args.bundle), load_config(args.bundle)
    prompts = [{"id": it.item_id, "task": it.task, "ids": tokenizer.encode_chat(it.messages())}
               for it in items[:args.num_prompts]]
    settings = {"bundle": str(args.bundle), "max_new_tokens": args.max_new_tokens, "batch_sizes": args.batch_sizes,
                "threads": args.threads or os.cpu_count(), "taus": args.taus, "eos_ids": list(config.eos_token_ids),
                "pad_id": config.pad_token_id, "source_model": config.source_model,
                "llamacpp_n_batch": args.llamacpp_n_batch, "prompts": prompts}
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "prompts.json").write_text(json.dumps(settings))
    print(f"{len(prompts)} prompts, {sum(len(p['ids']) for p in prompts)} prompt tokens -> {args.work / 'prompts.json'}")


def write_checkpoint(args) -> None:
    """Project venv: save ``--model`` (default ``default-mars``: merged MARS weights) as a HF checkpoint.

    transformers 5 writes a config that older readers misread, so two fields are patched
    for the peers that pin transformers 4.57 (optimum, the GGUF converter): ``rope_theta``
    is added (4.57 ignores ``rope_parameters`` and would silently use 10000 instead of
    100000) and ``quantization_config: null`` is dropped (4.57 crashes on it); the
    tokenizer class ``TokenizersBackend`` (5.x only) becomes ``PreTrainedTokenizerFast``.
    """
    from mars_export.model_source import load_model

    loaded = load_model(args.model)
    tmp = args.out.with_name(args.out.name + ".partial")
    loaded.model.save_pretrained(tmp)
    loaded.tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok_path = tmp / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    if tok.get("tokenizer_class") == "TokenizersBackend":
        tok_path.write_text(json.dumps({**tok, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    os.replace(tmp, args.out)
    print(f"{loaded.source} -> {args.out}")


def cut_at_eos(ids: list[int], eos_ids, max_new: int) -> list[int]:
    """``ids`` up to and including the first end token, at most ``max_new`` of them."""
    ids = [int(t) for t in ids[:max_new]]
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[:i + 1]
    return ids


def make_row(engine: str, variant: str, batch_size: int, chunks: list[Chunk], prompts: list[dict]) -> dict:
    """Aggregate the chunks of one (engine, variant, batch size) into a row; stop on a prompt mismatch."""
    prompt_tokens = [n for c in chunks for n in c.prompt_tokens]
    expected = [len(p["ids"]) for p in prompts]
    if prompt_tokens != expected:
        raise SystemExit(f"error: {engine} {variant} batch {batch_size} consumed prompt token counts {prompt_tokens}, "
                         f"expected {expected} (prompts.json): the engines are not fed the same prompts")
    outputs = [o for c in chunks for o in c.outputs]
    num_tokens, seconds = sum(map(len, outputs)), sum(c.seconds for c in chunks)
    decode_seconds = sum(c.seconds - c.first_token_seconds for c in chunks)
    forwards = None if any(c.num_forwards is None for c in chunks) else sum(c.num_forwards for c in chunks)
    return {"engine": engine, "variant": variant, "batch_size": batch_size, "status": OK, "error": "",
            "num_prompts": len(outputs), "num_tokens": num_tokens, "seconds": seconds,
            "ttft_seconds_mean": sum(c.first_token_seconds for c in chunks) / len(chunks),
            "decode_tokens_per_second": (num_tokens - len(outputs)) / decode_seconds if decode_seconds > 0 else None,
            "tokens_per_second": num_tokens / seconds, "num_forwards": forwards,
            "tpf": num_tokens / forwards if forwards else None, "prompt_tokens": prompt_tokens, "outputs": outputs}


def status_row(engine: str, variant: str, batch_size: int | None, status: str, error: str) -> dict:
    """A row for a configuration that did not run (not installable, failed, not supported)."""
    return {"engine": engine, "variant": variant, "batch_size": batch_size, "status": status, "error": error}


KEY_ERROR_PATTERNS = (  # most specific first: (pattern, take the last hit instead of the first)
    (r"CMake Error", False), (r": (fatal )?error: ", False), (r"^\w+(Error|Exception): ", True),
    (r"^ERROR: (?!Failed (building|to build))", False), (r"^(error|ERROR)\b", False), (r"\bfailed\b", False))


def key_error_line(text: str) -> str:
    """The line of a log or traceback that best says what went wrong (a CMake error keeps its next line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern, take_last in KEY_ERROR_PATTERNS:
        hits = [i for i, ln in enumerate(lines) if re.search(pattern, ln) and "-Werror" not in ln]
        if hits:
            i = hits[-1] if take_last else hits[0]
            line = " ".join(lines[i:i + 2]) if pattern == "CMake Error" else lines[i]
            return line[:300]
    return lines[-1][:300] if lines else "(empty log)"


def installed_packages() -> dict:
    """Every distribution installed in this interpreter's environment, name -> version."""
    from importlib import metadata
    return dict(sorted((d.metadata["Name"], d.version) for d in metadata.distributions()))


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def versions(*names: str) -> dict:
    """Installed versions of ``names`` in this interpreter (None if absent)."""
    from importlib import metadata
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


# ---------------------------------------------------------------- engines


def bench_variant(engine: str, variant: str, generate, settings: dict, batch_sizes,
                  unsupported: str | None = None) -> list[dict]:
    """Run ``generate(chunk_of_prompt_ids, max_new)`` in static chunks per batch size; one row each.

    A batch size in the complement of ``batch_sizes`` gets a ``not supported`` row, its error
    ``unsupported`` (default: the engine runs one sequence at a time).
    """
    prompts, max_new = settings["prompts"], settings["max_new_tokens"]
    generate([prompts[0]["ids"]], WARMUP_TOKENS)
    rows = []
    for bs in settings["batch_sizes"]:
        if bs not in batch_sizes:
            why = unsupported or f"{engine} runs one sequence at a time"
            rows.append(status_row(engine, variant, bs, UNSUPPORTED, why))
            continue
        chunks = [generate([p["ids"] for p in prompts[i:i + bs]], max_new) for i in range(0, len(prompts), bs)]
        rows.append(make_row(engine, variant, bs, chunks, prompts))
        r = rows[-1]
        print(f"{engine:12s} {variant:22s} batch {bs}: {r['tokens_per_second']:6.1f} tok/s, "
              f"TTFT {1000 * r['ttft_seconds_mean']:.0f} ms", flush=True)
    return rows


def run_ours(settings: dict, model: str | None) -> tuple[list, dict]:
    """Our runtime (onnxruntime backend, Engine): ar, threshold at each tau (with mask drafts only,
    and with lookup drafts before the masks), verify with each draft source.

    A weight-only quantized bundle (``mars-export --int8 / --int4``) runs ar and verify + both
    only, its variants named after the weight dtype ("int8 ar", "int8 verify + both"); a fused
    bundle (``--graph fused``) runs batch 1 only, its variants prefixed "fused".
    """
    from runtime.bundle import load_config
    from runtime.decode.engine import Engine, EngineConfig
    from runtime.backends.onnx import OnnxBackend
    from runtime.decode.params import DRAFTS, DecodeParams

    bundle = model or settings["bundle"]
    config = load_config(bundle)
    backend = OnnxBackend(bundle, config, num_threads=settings["threads"])
    modes = [("ar", DecodeParams(mode="ar"))] + [(f"threshold tau={t}", DecodeParams(tau=t)) for t in settings["taus"]]
    modes += [(f"threshold tau={t} + both", DecodeParams(tau=t, draft="both")) for t in settings["taus"]]
    modes += [("verify" if draft == "masks" else f"verify + {draft}", DecodeParams(mode="verify", draft=draft))
              for draft in DRAFTS]
    if config.weight_dtype in QUANTIZED:
        modes = [(f"{config.weight_dtype} {name}", params) for name, params in modes if name in QUANTIZED_VARIANTS]
    if config.graph == "fused":  # the model builder's graph: one sequence at a time
        modes = [(f"fused {name}", params) for name, params in modes]
    batch_sizes = [1] if config.graph == "fused" else settings["batch_sizes"]

    def make_generate(params):
        def generate(chunk, max_new):
            # room for the longest prompt + max_new + W (the engine refuses more than the model's context)
            max_len = min(max(map(len, chunk)) + max_new + 2 * config.window, config.max_context)
            engine = Engine(backend, config, EngineConfig(max_batch_size=len(chunk), max_seq_len=max_len))
            return ours_chunk(engine, DecodeParams(**{**asdict(params), "max_new_tokens": max_new}), chunk)
        return generate

    unsupported = "a fused bundle runs one sequence at a time (--graph step runs batches)"
    rows = [r for name, params in modes for r in bench_variant("ours", name, make_generate(params), settings,
                                                                 batch_sizes, unsupported)]
    if not backend.is_window_dynamic:
        print(f"note: {bundle} has a static window axis: prompts are prefilled {config.window} tokens per forward; "
              "a bundle from the current mars-export prefills in one chunk", file=sys.stderr)
    return rows, {**versions("mars-edge", "onnxruntime", "numpy"), "is_window_dynamic": backend.is_window_dynamic}


def ours_chunk(engine, params, chunk: list[list[int]]) -> Chunk:
    """Drive ``engine.step()`` over one chunk, noting when each request gets its first token."""
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in chunk]
    first, results = {}, {}
    while len(results) < len(ids):
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                results[out.request_id] = out.result
    seconds = time.perf_counter() - start
    return Chunk([results[i].token_ids for i in ids], seconds, max(first.values()) - start,
                 sum(results[i].num_forwards for i in ids), [len(p) for p in chunk])


def hf_generate(model, torch, settings: dict):
    """A ``generate(chunk, max_new)`` over a transformers-API model: left-padded, greedy, KV cache.

    TTFT comes from a streamer: ``put`` is called once with the prompt, then once per step
    with the new token of every row; the time of the first step's call is the TTFT.
    """
    from transformers.generation.streamers import BaseStreamer

    class FirstTokenTimer(BaseStreamer):
        def __init__(self):
            self.num_puts, self.first = 0, None

        def put(self, value):
            self.num_puts += 1
            if self.num_puts == 2:
                self.first = time.perf_counter()

        def end(self):
            pass

    pad, eos = settings["pad_id"], settings["eos_ids"]

    def generate(chunk, max_new):
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # [B, T] left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])  # [B, T]
        timer, start = FirstTokenTimer(), time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=pad, eos_token_id=eos, streamer=timer)
        seconds = time.perf_counter() - start
        outputs = [cut_at_eos(row[width:].tolist(), eos, max_new) for row in out]
        return Chunk(outputs, seconds, timer.first - start, sum(map(len, outputs)), mask.sum(dim=1).tolist())
    return generate


def run_transformers(settings: dict, model: str | None) -> tuple[list, dict]:
    """transformers ``generate`` (greedy, fp32, KV cache) on the HF checkpoint of the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(settings["threads"])
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rows = bench_variant("transformers", "generate fp32", hf_generate(hf, torch, settings), settings,
                         settings["batch_sizes"])
    return rows, versions("transformers", "torch")


def run_optimum(settings: dict, model: str | None) -> tuple[list, dict]:
    """optimum's ORTModelForCausalLM (fp32 ONNX export of the same checkpoint, KV cache), greedy."""
    import onnxruntime
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    torch.set_num_threads(settings["threads"])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = settings["threads"], 1
    ort_model = ORTModelForCausalLM.from_pretrained(model, session_options=options, provider="CPUExecutionProvider",
                                                    use_cache=True)
    rows = bench_variant("optimum", "ORTModelForCausalLM fp32", hf_generate(ort_model, torch, settings), settings,
                         settings["batch_sizes"])
    return rows, versions("optimum", "optimum-onnx", "onnxruntime", "transformers", "torch")


def run_ortgenai(settings: dict, model: str | None) -> tuple[list, dict]:
    """ONNX Runtime GenAI (model builder fp32, cpu), greedy, batched generator.

    Batches are right-padded, as GenAI's own ``PadInputs`` does (left padding changed the
    outputs of the shorter prompt in the smoke run). GenAI builds the prompt's attention
    mask from ``pad_token_id`` (src/models/position_inputs.cpp), and the config's pad id 2
    is also <|im_end|>, which every chat prompt contains; as a guard the pad id is overlaid
    with an id that occurs in no prompt (0.18 gave the same ids either way on the smoke prompts).
    """
    import numpy as np
    import onnxruntime_genai as og

    pad = unused_token_id(settings)
    config = og.Config(model)
    config.overlay(json.dumps({"model": {"pad_token_id": pad, "decoder": {"session_options": {
        "intra_op_num_threads": settings["threads"], "inter_op_num_threads": 1}}}}))
    og_model, eos = og.Model(config), settings["eos_ids"]

    def generate(chunk, max_new):
        width = max(map(len, chunk))
        ids = np.array([p + [pad] * (width - len(p)) for p in chunk], dtype=np.int32)  # [B, T] right-padded
        params = og.GeneratorParams(og_model)
        params.set_search_options(max_length=width + max_new, batch_size=len(chunk), do_sample=False)
        start = time.perf_counter()
        gen = og.Generator(og_model, params)
        gen.append_tokens(ids)
        consumed = [int((row != pad).sum()) for row in ids]
        steps, first = 0, None
        while not gen.is_done() and steps < max_new:
            gen.generate_next_token()
            steps += 1
            first = first or time.perf_counter()
        seconds = time.perf_counter() - start
        outputs = [cut_at_eos(list(gen.get_sequence(i))[width:], eos, max_new) for i in range(len(chunk))]
        return Chunk(outputs, seconds, first - start, sum(map(len, outputs)), consumed)

    rows = bench_variant("ortgenai", "model builder fp32", generate, settings, settings["batch_sizes"])
    return rows, {**versions("onnxruntime-genai", "onnxruntime"), "pad_token_id_overlay": pad}


def unused_token_id(settings: dict) -> int:
    """The smallest token id that occurs in no prompt and is no end token."""
    used = {t for p in settings["prompts"] for t in p["ids"]} | set(settings["eos_ids"])
    return next(t for t in range(len(used) + 1) if t not in used)


# llama.cpp's rows: (variant, GGUF type of ``{stem}.{type}.gguf``, with prompt-lookup drafts). f32 and q8_0 come
# from convert_hf_to_gguf.py, q4_0 and q4_1 from llama.cpp's own quantizer on the f32 file (quantize_gguf).
# q8_0 is the scheme of our --int8 bundle. q4_1 holds the kind of weights our --int4 bundle of the default model
# imports from its GGUF, the closest like-for-like row for it (see LIKE_FOR_LIKE): for default-mars both are
# 210 Q4_1 linear weights and a Q8_0 tied head (llama.cpp falls back from Q6_K: 576 columns are no multiple of
# 256). Not the same bits: this file quantizes the merged MARS weights, ours keeps the GGUF's blocks and the
# LoRA adapter as a float32 side path.
# llama.cpp's n_batch: the most prompt tokens one forward takes (llama-cpp-python's default). --llamacpp-n-batch 1
# prefills one token a forward, which decode tokens/s does not see: llama-cpp-python 0.3.36 built with
# GGML_NATIVE on an Intel CPU with AMX repacks Q8_0 / Q4_0 weights for AMX, and that path crashes (SIGSEGV)
# on a forward of 2 or more tokens (seen 2026-12-06; one token a forward runs).
LLAMACPP_N_BATCH = 512
LLAMACPP_VARIANTS = (("gguf f32", "f32", False), ("gguf q8_0", "q8_0", False), ("gguf q4_0", "q4_0", False),
                     ("gguf q4_1", "q4_1", False), ("gguf f32 + prompt lookup", "f32", True))


def run_llamacpp(settings: dict, model: str | None) -> tuple[list, dict]:
    """llama.cpp through llama-cpp-python: F32, Q8_0, Q4_0 and Q4_1 GGUF, greedy; F32 with prompt-lookup decoding.

    ``model`` is the GGUF stem: ``{model}.{type}.gguf`` per type of :data:`LLAMACPP_VARIANTS`;
    a missing file is a failed row of its variant. Batch 1 only.
    """
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    rows = []
    for name, gguf_type, is_lookup in LLAMACPP_VARIANTS:
        path = f"{model}.{gguf_type}.gguf"
        if not Path(path).is_file():
            rows.append(status_row("llamacpp", name, None, FAILED, f"{path} not found (GGUF conversion failed?)"))
            continue
        try:
            draft = LlamaPromptLookupDecoding if is_lookup else None
            rows += bench_variant("llamacpp", name, llamacpp_generate(path, draft, settings), settings, {1})
        except (ValueError, RuntimeError, OSError) as e:  # one variant failing leaves the others' rows
            rows.append(status_row("llamacpp", name, None, FAILED, first_line(e)))
    return rows, versions("llama-cpp-python", "numpy")


def llamacpp_generate(path: str, draft, settings: dict):
    """A batch-1 ``generate(chunk, max_new)`` over a llama.cpp model; counts ``eval`` calls as forwards."""
    from llama_cpp import Llama

    longest = max(len(p["ids"]) for p in settings["prompts"])
    llm = Llama(model_path=path, n_ctx=longest + settings["max_new_tokens"] + 64, n_batch=llamacpp_n_batch(settings),
                n_threads=settings["threads"], n_threads_batch=settings["threads"], verbose=False,
                draft_model=draft() if draft else None)
    evals, plain_eval, eos = [], llm.eval, settings["eos_ids"]

    def counted_eval(tokens):
        evals.append(len(tokens))
        plain_eval(tokens)
    llm.eval = counted_eval

    def generate(chunk, max_new):
        (prompt,) = chunk
        llm.reset()  # no prefix reuse between runs: every run prefills the whole prompt
        evals.clear()
        out, start, first, num_prompt_evals = [], time.perf_counter(), None, 0
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first, num_prompt_evals = time.perf_counter(), len(evals)
            out.append(token)
            if token in eos or len(out) == max_new:
                break
        seconds = time.perf_counter() - start
        consumed = sum(evals[:num_prompt_evals])
        return Chunk([cut_at_eos(out, eos, max_new)], seconds, first - start, len(evals) - num_prompt_evals + 1,
                     [consumed])
    return generate


def llamacpp_n_batch(settings: dict) -> int:
    """llama.cpp's ``n_batch`` (most prompt tokens per forward) of this run: prompts.json's ``llamacpp_n_batch``,
    :data:`LLAMACPP_N_BATCH` in files written before it was a setting."""
    return settings.get("llamacpp_n_batch", LLAMACPP_N_BATCH)


GGUF_QUANTIZED_TYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1"}  # --type: llama_ftype


def quantize_gguf(args) -> None:
    """llamacpp venv: quantize an F32 GGUF to ``--type`` with llama.cpp's own quantizer, as llama-quantize does.

    ``llama_model_quantize`` with ``llama_model_quantize_default_params()``: the 2-D weights in
    blocks of 32 of that type, llama.cpp's own choice for the (tied) output head (Q6_K, or
    Q8_0 where a row is no multiple of 256), 1-D tensors kept F32; it logs each tensor's type.
    Writes ``OUT.partial`` and renames it to ``OUT`` when complete, so a file at ``OUT`` is
    always whole. Stops with an error when llama.cpp reports a failure (its reason is in the
    log above it).
    """
    import ctypes
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, GGUF_QUANTIZED_TYPES[args.type])
    partial = args.out.with_name(args.out.name + ".partial")
    start = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(args.input).encode(), str(partial).encode(), ctypes.byref(params))
    if rc != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"error: llama_model_quantize {args.input} -> {args.type} returned {rc} "
                         "(the reason is in the log above)")
    os.replace(partial, args.out)
    print(f"{args.input} -> {args.out} ({args.type}, {args.out.stat().st_size / 2**20:.1f} MiB, "
          f"{time.perf_counter() - start:.0f} s)")


RUNNERS = {"ours": run_ours, "transformers": run_transformers, "ortgenai": run_ortgenai,
           "llamacpp": run_llamacpp, "optimum": run_optimum}


def run_engine(args) -> None:
    """Run one engine in this process; write DIR/rows-ENGINE.json, or rows-ENGINE-TAG.json with --tag."""
    settings = read_settings(args.work)
    start, load_before = time.perf_counter(), os.getloadavg()
    try:
        rows, found = RUNNERS[args.engine](settings, args.model)
    except (ImportError, OSError, RuntimeError, ValueError) as e:  # an engine that cannot load is a row, not a crash
        print(f"error: {args.engine}: {first_line(e)}", file=sys.stderr)
        rows, found = [status_row(args.engine, "", None, FAILED, first_line(e))], {}
    write_rows(args.work, rows_name(args.engine, args.tag), rows, {"versions": found, "python": platform.python_version(),
                                              "seconds": time.perf_counter() - start, "settings": run_key(settings),
                                              "load_average_before_after": [load_before, os.getloadavg()],
                                              "packages": installed_packages()})


def read_settings(work: Path) -> dict:
    """The run's settings and prompt ids, as ``prompts`` wrote them to DIR/prompts.json.

    Raises:
        UsageError: DIR holds no prompts.json (naming the command that writes it).
    """
    path = work / "prompts.json"
    if not path.is_file():
        raise UsageError(f"--work {work} holds no prompts.json: write it first with "
                         f"'bench/peers.py prompts --work {work}' (scripts/bench_peers.sh does)")
    return json.loads(path.read_text())


def run_key(settings: dict) -> dict:
    """What rows must share to be compared: the settings and the prompts' ids."""
    keys = ("bundle", "max_new_tokens", "batch_sizes", "threads", "taus")
    return {**{k: settings[k] for k in keys}, "llamacpp_n_batch": llamacpp_n_batch(settings),
            "prompt_ids": [p["id"] for p in settings["prompts"]]}


def record_status(args) -> None:
    """Write a single status row for an engine that could not be installed or run (key line of its log), under the
    settings of the work folder's prompts.json where there is one (so a later run with other settings leaves it out).
    With ``--exit-status`` the error ends with how the command ended (a crash's log may end on an ordinary line)."""
    error = key_error_line(Path(args.log).read_text(errors="replace")) if args.log else args.error
    if args.exit_status is not None:
        error = f"{error}; {how_it_ended(args.exit_status, shell=True)}"
    name = rows_name(args.engine, args.tag)
    info = {"settings": run_key(read_settings(args.work))} if (args.work / "prompts.json").exists() else {}
    write_rows(args.work, name, [status_row(args.engine, args.tag or "", None, args.status, error)], info)
    print(f"{name}: {args.status}: {error}")


def rows_name(engine: str, tag: str | None) -> str:
    """Name of an engine's rows file: ``ENGINE``, or ``ENGINE-TAG`` for a second model of it (``ours-int8``)."""
    return f"{engine}-{tag}" if tag else engine


def rows_files(work: Path) -> list[Path]:
    """The rows files in ``work``: per engine in :data:`ENGINES` order, its own first, then its tagged ones."""
    return [path for engine in ENGINES for path in [work / f"rows-{engine}.json",
                                                    *sorted(work.glob(f"rows-{engine}-*.json"))] if path.exists()]


def write_rows(work: Path, name: str, rows: list, info: dict) -> None:
    (work / f"rows-{name}.json").write_text(json.dumps({"engine": name, "info": info, "rows": rows}))


# ---------------------------------------------------------------- report


def machine_info() -> dict:
    """CPU model, cores, load and OS of this machine."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return {"cpu": model.group(1) if model else platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "load_average_at_report": os.getloadavg(), "os": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M")}


def compare_to_reference(rows: list[dict]) -> None:
    """Add per-row agreement with our AR batch-1 ids: identical count and mean common prefix.

    Runs in the project venv (``report``); the peer venvs never import mars_export.
    """
    from runtime.evaluation.scoring import common_prefix
    ref = next((r["outputs"] for r in rows if r["engine"] == "ours" and r.get("variant") == "ar"
                and r["batch_size"] == 1 and r["status"] == OK), None)
    for row in rows:
        if row["status"] != OK or ref is None:
            continue
        prefixes = [common_prefix(o, r) for o, r in zip(row["outputs"], ref)]
        row["identical_to_ours_ar"] = sum(o == r for o, r in zip(row["outputs"], ref))
        row["common_prefix_mean"] = sum(prefixes) / len(prefixes)


# Our quantized AR against llama.cpp on the same kind of weights: (variant of ours, variant of llamacpp).
# Q8_0 is our --int8 scheme (symmetric blocks of 32); Q4_1 (blocks of 32 with a minimum) is what our --int4
# bundle of the default model imports from its GGUF. A fused --int4 bundle quantizes again from float32 in
# asymmetric blocks of 32 with integer zero points (coarser than Q4_1's float minimum), so its Q4_1 row is the
# nearest llama.cpp kind of the same size, not the same weights.
LIKE_FOR_LIKE = (("int8 ar", "gguf q8_0"), ("fused int8 ar", "gguf q8_0"), ("int4 ar", "gguf q4_1"),
                 ("fused int4 ar", "gguf q4_1"))


def like_for_like(rows: list[dict]) -> list[dict]:
    """Speed ratios ours / llama.cpp for each pair of :data:`LIKE_FOR_LIKE` at each batch size both ran (status ok).

    Returns dicts with ``ours``, ``llamacpp`` (variant names), ``batch_size``, ``tokens_per_second_ratio``
    (end to end) and ``decode_tokens_per_second_ratio`` (None when a decode speed is missing); above 1:
    ours is faster. Pairs of which a side did not run are left out.
    """
    ok = {(r["engine"], r["variant"], r["batch_size"]): r for r in rows if r["status"] == OK}
    batch_sizes = sorted({r["batch_size"] for r in rows if r["batch_size"]})
    pairs = []
    for ours, peer in LIKE_FOR_LIKE:
        for bs in batch_sizes:
            mine, theirs = ok.get(("ours", ours, bs)), ok.get(("llamacpp", peer, bs))
            if mine is None or theirs is None:
                continue
            decode = (mine["decode_tokens_per_second"], theirs["decode_tokens_per_second"])
            pairs.append({"ours": ours, "llamacpp": peer, "batch_size": bs,
                          "tokens_per_second_ratio": mine["tokens_per_second"] / theirs["tokens_per_second"],
                          "decode_tokens_per_second_ratio": decode[0] / decode[1] if all(decode) else None})
    return pairs


def like_for_like_lines(pairs: list[dict]) -> str:
    """One Markdown list line per :func:`like_for_like` pair."""
    lines = []
    for p in pairs:
        decode = f"{p['decode_tokens_per_second_ratio']:.2f}x" if p["decode_tokens_per_second_ratio"] else "-"
        lines.append(f"- ours {p['ours']} / llamacpp {p['llamacpp']}, batch {p['batch_size']}: "
                     f"{p['tokens_per_second_ratio']:.2f}x end-to-end tok/s, {decode} decode tok/s")
    return "\n".join(lines)


def report(args) -> None:
    """Merge DIR/rows-*.json into peers.json/csv/png under --out; print a Markdown table and the ratios to llama.cpp.

    Rows files made with other settings than prompts.json (an earlier run's other engines) are left out, named on
    stderr and in the meta's ``left_out``.

    Raises:
        UsageError: no rows file matches the settings (run the engines first).
        SystemExit: the engines consumed different prompt token counts (a failed run, exit status 1).
    """
    settings = read_settings(args.work)
    key = run_key(settings)
    parts, stale = [], []  # the rows files made with these settings; the names of the others
    for path in rows_files(args.work):
        part = json.loads(path.read_text())
        if part["info"].get("settings", key) == key:
            parts.append(part)
        else:
            stale.append(path.name)
    if stale:  # an earlier run's rows (other prompts, tokens, threads): never mixed into this table
        print(f"note: {', '.join(stale)} in {args.work} come from other settings than prompts.json and are left out; "
              "rerun those engines (ENGINES=... scripts/bench_peers.sh with the same arguments) to include them",
              file=sys.stderr)
    if not parts:
        raise UsageError(f"no rows in {args.work} come from the settings of prompts.json; run the engines first")
    rows = [r for p in parts for r in p["rows"]]
    counts = {tuple(r["prompt_tokens"]) for r in rows if r["status"] == OK}
    if len(counts) > 1:
        raise SystemExit(f"error: engines consumed different prompt token counts: {sorted(counts)}")
    compare_to_reference(rows)
    pairs = like_for_like(rows)
    meta = {"machine": machine_info(), "engines": {p["engine"]: p["info"] for p in parts}, "left_out": stale,
            "setup_steps": read_setup_steps(args.work / "setup.tsv"),
            "prompts": [{"id": p["id"], "num_tokens": len(p["ids"])} for p in settings["prompts"]],
            **{k: settings[k] for k in ("bundle", "source_model", "max_new_tokens", "batch_sizes", "threads")},
            "llamacpp_n_batch": llamacpp_n_batch(settings)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps({"meta": meta, "rows": rows, "like_for_like": pairs}, indent=1))
    write_csv(args.out / "peers.csv", rows)
    plot(rows, meta, args.out / "peers.png")
    print(markdown_table(rows, len(settings["prompts"])))
    if pairs:
        print("\nQuantized, ours / llama.cpp on the same kind of weights:\n" + like_for_like_lines(pairs))


def read_setup_steps(path: Path) -> list[dict]:
    """The shell script's timed setup steps (installs, conversions, runs): name, exit status, seconds."""
    if not path.exists():
        return []
    steps = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    latest = {name: (int(rc), int(sec)) for name, rc, sec in steps}  # a rerun step keeps its last result
    return [{"step": name, "rc": rc, "seconds": sec} for name, (rc, sec) in latest.items()]


CSV_FIELDS = ("engine", "variant", "batch_size", "status", "num_prompts", "num_tokens", "seconds", "ttft_seconds_mean",
              "decode_tokens_per_second", "tokens_per_second", "num_forwards", "tpf", "identical_to_ours_ar",
              "common_prefix_mean", "error")


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(rows: list[dict], num_prompts: int) -> str:
    """One line per row: speeds, TPF and agreement with our AR; status and error for rows that did not run."""
    header = "| engine | variant | batch | TTFT ms | decode tok/s | e2e tok/s | TPF | identical to our AR | common prefix | status |"
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != OK:
            lines.append(f"| {r['engine']} | {r['variant']} | {r['batch_size'] or '-'} | | | | | | | "
                         f"{r['status']}: {r['error'].replace('|', '/')} |")
            continue
        tpf = f"{r['tpf']:.2f}" if r["tpf"] else "-"
        same = f"{r.get('identical_to_ours_ar', '-')}/{num_prompts}"
        prefix = f"{r['common_prefix_mean']:.1f}" if "common_prefix_mean" in r else "-"
        decode = f"{r['decode_tokens_per_second']:.1f}" if r["decode_tokens_per_second"] else "-"
        lines.append(f"| {r['engine']} | {r['variant']} | {r['batch_size']} | {1000 * r['ttft_seconds_mean']:.0f} | "
                     f"{decode} | {r['tokens_per_second']:.1f} | {tpf} | {same} | {prefix} | ok |")
    return "\n".join(lines)


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    """End-to-end and decode tokens/s per engine and variant, one panel per batch size; rows that did not run marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(f"{r['engine']}: {r['variant']}" for r in rows if r["variant"]))
    batch_sizes, y = meta["batch_sizes"], range(len(labels))
    fig, axes = plt.subplots(1, len(batch_sizes), figsize=(6 * len(batch_sizes), 0.5 * len(labels) + 1.5),
                             squeeze=False, sharey=True)
    for ax, bs in zip(axes[0], batch_sizes):
        by_label = {f"{r['engine']}: {r['variant']}": r for r in rows if r["batch_size"] == bs}
        ok = [by_label.get(lb, {}).get("status") == OK for lb in labels]
        for key, shift, color, name in (("tokens_per_second", -0.2, "#4878a8", "end to end"),
                                        ("decode_tokens_per_second", 0.2, "#a8c4e0", "decode (after first token)")):
            values = [by_label[lb][key] or 0 if is_ok else 0 for lb, is_ok in zip(labels, ok)]
            ax.barh([i + shift for i in y], values, height=0.4, color=color, label=name)
        for i, lb in enumerate(labels):
            if not ok[i]:
                ax.text(0, i, f" {by_label.get(lb, {}).get('status', 'not run')}", va="center", fontsize=8)
        ax.set(title=f"batch {bs}", xlabel="tokens/s (all sequences of a batch)")
        ax.legend(fontsize=8, loc="best")
    axes[0][0].set_yticks(list(y), labels)
    axes[0][0].invert_yaxis()  # shared: once
    m = meta["machine"]
    fig.suptitle(f"{m['cpu']}, {m['cores']} cores, {meta['threads']} threads, {meta['max_new_tokens']} new tokens, "
                 f"{len(meta['prompts'])} prompts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- command line


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prompts", help="write prompt ids and settings (project venv)")
    pp.add_argument("--bundle", default="bundles/default-mars-b4")
    pp.add_argument("--num-prompts", type=int, default=8, help="half GSM8K test, half HumanEval (default 8)")
    pp.add_argument("--max-new-tokens", type=int, default=128)
    pp.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    pp.add_argument("--threads", type=int, default=0, help="threads of every engine (default: all cores)")
    pp.add_argument("--taus", type=make_taus_value("--taus"), nargs="+", default=[0.95, 0.9, 0.8, 0.7])
    pp.add_argument("--llamacpp-n-batch", type=int, default=LLAMACPP_N_BATCH,
                    help=f"llama.cpp's most prompt tokens per forward (default {LLAMACPP_N_BATCH}; 1 works around "
                         "llama.cpp's AMX crash on multi-token forwards, see LLAMACPP_N_BATCH)")
    pr = sub.add_parser("run", help="run one engine, write its rows")
    pr.add_argument("--engine", required=True, choices=ENGINES)
    pr.add_argument("--model", default=None, help="engine's model: bundle, checkpoint dir, GenAI dir or GGUF stem")
    pc = sub.add_parser("checkpoint", help="write the HF checkpoint every peer loads (project venv)")
    pc.add_argument("--model", default="default-mars", help="model spec of mars_export.model_source.load_model")
    pc.add_argument("--out", type=Path, required=True)
    ps = sub.add_parser("record", help="record a status row for an engine that did not run")
    ps.add_argument("--engine", required=True, choices=ENGINES)
    ps.add_argument("--status", required=True)
    ps.add_argument("--log", type=existing_file, default=None, help="log whose key error line is recorded")
    ps.add_argument("--error", default="")
    ps.add_argument("--exit-status", type=int, default=None, help="the failed command's exit status ($?)")
    pq = sub.add_parser("quantize-gguf", help="quantize an F32 GGUF with llama.cpp's quantizer (llamacpp venv)")
    pq.add_argument("--type", required=True, choices=sorted(GGUF_QUANTIZED_TYPES))
    pq.add_argument("--input", type=Path, required=True, help="the F32 GGUF (convert_hf_to_gguf.py --outtype f32)")
    pq.add_argument("--out", type=Path, required=True)
    po = sub.add_parser("report", help="merge rows into peers.{json,csv,png}, print a Markdown table")
    po.add_argument("--out", type=path_value, default=Path(__file__).resolve().parent / "results")
    for sp in (pr, ps):
        sp.add_argument("--tag", default=None, help="a second model of the engine (int8): rows-ENGINE-TAG.json")
    for sp in (pp, pr, ps, po):  # checkpoint needs no work folder
        sp.add_argument("--work", type=Path, required=True, help="folder of prompts.json and the rows files")
    args = p.parse_args()
    if args.command in ("run", "record") and args.tag is not None and not re.fullmatch(r"[a-z0-9]+", args.tag):
        p.error(f"--tag must be lowercase letters and digits, got {args.tag!r}")
    if args.command == "prompts" and (args.num_prompts < 1 or min(args.batch_sizes) < 1 or args.max_new_tokens < 1
                                      or args.llamacpp_n_batch < 1):
        p.error("--num-prompts, --batch-sizes, --max-new-tokens and --llamacpp-n-batch must be >= 1")
    if args.command == "prompts":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from support import shared_data_missing
        if shared_data_missing():
            p.error(shared_data_missing())
    if args.command == "quantize-gguf" and not args.input.is_file():
        p.error(f"--input {args.input} is no file: make the F32 GGUF first (convert_hf_to_gguf.py --outtype f32)")
    {"prompts": prepare_prompts, "checkpoint": write_checkpoint, "run": run_engine, "record": record_status,
     "report": report, "quantize-gguf": quantize_gguf}[args.command](args)


if __name__ == "__main__":
    sys.exit(run_main(main))

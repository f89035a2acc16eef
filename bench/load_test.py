"""Load test of ``python -m runtime.serve``: concurrent streaming clients on loopback, bounded in time and count.

    python bench/load_test.py [BUNDLE] [--clients 32] [--duration 60] [--max-tokens 64]
                              [--ramp 1 16 32 16 1] [--ramp-step 10] [--tau-min 0.5]

Starts the server as a subprocess on 127.0.0.1 (a free port; nothing else is reachable)
and runs two phases against the same process, without a restart:

1. ``fixed``: ``--clients`` streaming clients for ``--duration`` seconds, every request
   with ``tau = 1``. Each response must equal its solo run at tau = 1 (the runtime
   :class:`~runtime.decode.decoder.Decoder` on the same prompt, computed first in this process),
   and its streamed text must equal ``Tokenizer.decode`` of its ids. Counts failed and
   lost requests (a stream that ends without its final chunk is lost); samples the
   server's RSS.
2. ``ramp``: clients that send no tau (they follow the server's default), their number
   stepping through ``--ramp`` every ``--ramp-step`` seconds. The load policy lowers the
   default tau as the queue grows and restores it as it drains; the timeline records tau,
   queue depth and TPF (from the server's counters) so TPF can be seen rising as tau falls.

Writes ``load_test.json`` to ``--out`` (default bench/results/).

With ``--ray 1 2`` it runs against the Ray Serve deployment instead (``python -m runtime.serve_ray``'s,
``runtime/serving/ray_*.py``, the ``serve-ray`` extra; a local Ray on this machine, loopback only, started for
each replica count by ``runtime.serving.ray_launch.launch`` and stopped with its deployment by
``runtime.serving.ray_launch.stop``): for each replica count in
turn, the warm-up and the ``fixed`` phase with the same checks, the load read from
``/fleet/metrics`` (summed over replicas) and the RSS summed over the replicas' processes;
then the tokens/s of each count relative to the first. Writes ``load_test_ray.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.command_line import ArgumentParser, run_main, threads_value
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams
from runtime.serving.load_policy import LoadPolicy
from runtime.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "samples" / "prompts" / "demo_prompts.json"
EXTRA_PROMPTS = ["Write 'thank you' in Chinese, Japanese and Korean, then add three emoji.",
                 "List four fruits, one per line."]
HOST = "127.0.0.1"  # loopback only, on purpose
MAX_REQUESTS = 5000  # hard cap over both phases
SAMPLE_EVERY_S = 0.5
DRAIN_S = 1.0  # seconds sampled after the last request, before the run ends


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", nargs="?", default=str(ROOT / "bundles" / "default-mars-b4"))
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the fixed phase")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--threads", type=threads_value, default=2, help="onnxruntime threads of the server")
    p.add_argument("--tau-min", type=load_policy_floor, default=0.5,
                   help="the server's --tau-min: the load policy's lowest default tau, 0..1 (default 0.5)")
    p.add_argument("--queue-high", type=int, default=16)
    p.add_argument("--ramp", type=int, nargs="*", default=[1, 16, 32, 16, 1], help="clients per ramp step")
    p.add_argument("--ramp-step", type=float, default=10.0, help="seconds per ramp step")
    p.add_argument("--max-prompt-chars", type=int, default=None, help="cut prompts (for small-context models)")
    p.add_argument("--ray", type=int, nargs="*", default=None, metavar="REPLICAS",
                   help="run the fixed phase against Ray Serve with each of these replica counts (e.g. 1 2)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def load_policy_floor(text: str) -> float:
    """``type=`` of ``--tau-min``, the server's load-policy floor: the number, or argparse's refusal by the load
    policy's rule (:class:`~runtime.serving.load_policy.LoadPolicy`, with the server's default tau_max 1, as this
    bench starts it) before anything loads."""
    try:
        tau_min = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    try:
        LoadPolicy(tau_min=tau_min)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (tau_max: the server's --tau-max); give a --tau-min in "
                                         f"0..{LoadPolicy.tau_max:g}") from None
    return tau_min


def chat_prompts(tokenizer: Tokenizer, max_chars: int | None) -> list[tuple[str, list[int]]]:
    texts = [p["text"][:max_chars] for p in json.loads(PROMPTS.read_text())["prompts"]] + EXTRA_PROMPTS
    return [(t, tokenizer.encode_chat([{"role": "user", "content": t}])) for t in texts]


def solo_runs(bundle: str, prompts, max_tokens: int) -> list[list[int]]:
    """Each prompt alone through the runtime decoder at tau = 1 (the reference)."""
    config = load_config(bundle)
    decoder = Decoder(OnnxBackend(bundle, config, num_threads=2), config)
    return [decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=max_tokens)).token_ids for _, ids in prompts]


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "runtime.serve", args.bundle, "--host", HOST, "--port", "0",
           "--max-batch-size", str(args.max_batch_size), "--threads", str(args.threads),
           "--tau-min", str(args.tau_min), "--queue-high", str(args.queue_high), "--log-level", "info"]
    with log_path.open("w") as log:  # the child keeps its own copy of the file
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"running on http://127\.0\.0\.1:(\d+)", log_path.read_text())
        if found:
            return proc, f"http://{HOST}:{found.group(1)}"
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    tail = "\n".join(log_path.read_text().splitlines()[-20:])  # the log's folder is removed after this
    raise RuntimeError(f"the server did not start; the end of its log:\n{tail}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def parse_metrics(text: str) -> dict:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


async def probe_server(http: httpx.AsyncClient, pid: int) -> dict:
    """Load and RSS of the single server (its /metrics and its process)."""
    m = parse_metrics((await http.get("/metrics")).text)
    return {"rss_mb": round(rss_mb(pid), 1), "queue_depth": m["mars_queue_depth"],
            "active_slots": m["mars_active_slots"], "default_tau": m["mars_default_tau"],
            "tokens": m["mars_generated_tokens_total"], "forwards": m["mars_decode_forwards_total"]}


async def probe_fleet(http: httpx.AsyncClient) -> dict:
    """Load and RSS of the Ray replicas: /fleet/metrics summed over replicas (tau: the lowest)."""
    totals: dict[str, list[float]] = {}
    for name, value in parse_metrics((await http.get("/fleet/metrics")).text).items():
        totals.setdefault(name.split("{")[0], []).append(value)
    pids = [r["pid"] for r in (await http.get("/fleet/replicas")).json().values()]
    return {"rss_mb": round(sum(rss_mb(pid) for pid in pids), 1), "queue_depth": sum(totals["mars_queue_depth"]),
            "active_slots": sum(totals["mars_active_slots"]), "default_tau": min(totals["mars_default_tau"]),
            "tokens": sum(totals["mars_generated_tokens_total"]), "forwards": sum(totals["mars_decode_forwards_total"])}


class LoadRun:
    """Clients, sampler and records of one server process."""

    def __init__(self, url: str, pid: int | None, prompts, solo, tokenizer: Tokenizer, max_tokens: int):
        """``pid``: the single server's process; None for the Ray deployment (read from /fleet/*)."""
        self.client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        self.http = httpx.AsyncClient(base_url=url, timeout=30)
        self.pid, self.prompts, self.solo, self.tokenizer, self.max_tokens = pid, prompts, solo, tokenizer, max_tokens
        self.records: list[dict] = []
        self.samples: list[dict] = []
        self.phase, self.level, self.num_started = "warmup", 0, 0
        self.t0 = time.monotonic()

    async def request(self, worker: int, tau: float | None) -> None:
        index = self.num_started % len(self.prompts)
        self.num_started += 1
        text = self.prompts[index][0]
        record = {"phase": self.phase, "worker": worker, "prompt": index, "start_s": time.monotonic() - self.t0,
                  "ok": False, "lost": False, "error": None}
        start, parts, final = time.monotonic(), [], None
        extra = {"return_token_ids": True} | ({"tau": tau} if tau is not None else {})
        try:
            stream = await self.client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": text}], max_tokens=self.max_tokens,
                stream=True, extra_body=extra)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    record.setdefault("ttft_s", time.monotonic() - start)
                    parts.append(chunk.choices[0].delta.content)
                if chunk.choices and chunk.choices[0].finish_reason:
                    final = chunk
        except openai.OpenAIError as e:
            record["error"] = f"{type(e).__name__}: {e}"
        record["latency_s"] = time.monotonic() - start
        if record["error"] is None and final is None:
            record["lost"] = True
        elif final is not None:
            got = final.mars["token_ids"]
            text_out = "".join(parts)
            record |= {"ok": True, "finish_reason": final.choices[0].finish_reason, "num_tokens": len(got),
                       "tpf": final.mars["tpf"], "text_equals_decode": text_out == self.tokenizer.decode(got),
                       "equals_solo": got == self.solo[index] if tau == 1.0 else None}
        self.records.append(record)

    async def worker(self, worker: int, until: float, tau: float | None, active=lambda w: True) -> None:
        while time.monotonic() < until and self.num_started < MAX_REQUESTS:
            if active(worker):
                await self.request(worker, tau)
            else:
                await asyncio.sleep(0.1)

    async def sample(self) -> None:
        """Append one sample of the server's counters, labelled with the current phase."""
        probe = await (probe_fleet(self.http) if self.pid is None else probe_server(self.http, self.pid))
        self.samples.append({"t_s": round(time.monotonic() - self.t0, 2), "phase": self.phase,
                             "clients": self.level} | probe)

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
            except asyncio.TimeoutError:
                pass

    async def run(self, args) -> None:
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(stop))
        # warm-up: every prompt at once, so the KV cache and onnxruntime reach their working size
        await asyncio.gather(*(self.request(w, 1.0) for w in range(len(self.prompts))))
        self.phase, self.level = "fixed", args.clients
        await self.sample()  # the phase's first and last samples bracket it, however slow the periodic ones are
        until = time.monotonic() + args.duration
        await asyncio.gather(*(self.worker(w, until, 1.0) for w in range(args.clients)))
        await self.sample()
        if args.ray is None:
            await self.ramp(args)
        self.phase, self.level = "drained", 0
        await asyncio.sleep(DRAIN_S)  # the load policy moves tau back once the queue is empty
        await self.sample()
        stop.set()
        await sampler
        await self.http.aclose()
        await self.client.close()  # in this event loop (--ray runs one loop per replica count)

    async def ramp(self, args) -> None:
        self.phase, self.level = "ramp", args.ramp[0]
        await self.sample()
        ramp_start = time.monotonic()

        def active(w: int) -> bool:
            step = min(int((time.monotonic() - ramp_start) // args.ramp_step), len(args.ramp) - 1)
            self.level = args.ramp[step]
            return w < self.level

        until = ramp_start + args.ramp_step * len(args.ramp)
        await asyncio.gather(*(self.worker(w, until, None, active) for w in range(max(args.ramp))))
        await self.sample()


def summarize_phase(records, samples, phase: str) -> dict:
    rs = [r for r in records if r["phase"] == phase]
    ss = [s for s in samples if s["phase"] == phase]
    ok = [r for r in rs if r["ok"]]
    seconds = ss[-1]["t_s"] - ss[0]["t_s"] if len(ss) > 1 else float("nan")
    tokens = ss[-1]["tokens"] - ss[0]["tokens"] if ss else 0
    forwards = ss[-1]["forwards"] - ss[0]["forwards"] if ss else 0
    latencies = sorted(r["latency_s"] for r in ok)
    return {"requests": len(rs), "ok": len(ok), "failed": sum(r["error"] is not None for r in rs),
            "lost": sum(r["lost"] for r in rs),
            "not_equal_to_solo": sum(r.get("equals_solo") is False for r in ok),
            "text_not_equal_to_decode": sum(not r["text_equals_decode"] for r in ok),
            "tokens": int(tokens), "seconds": seconds, "tokens_per_second": tokens / seconds if seconds else None,
            "tpf": tokens / forwards if forwards else None,
            "ttft_s_median": statistics.median(r["ttft_s"] for r in ok if "ttft_s" in r) if ok else None,
            "latency_s_p50": latencies[len(latencies) // 2] if ok else None,
            "latency_s_p95": latencies[int(len(latencies) * 0.95)] if ok else None,
            "rss_mb_start": ss[0]["rss_mb"] if ss else None, "rss_mb_end": ss[-1]["rss_mb"] if ss else None,
            "rss_mb_max": max(s["rss_mb"] for s in ss) if ss else None}


def tpf_by_tau(samples) -> list[dict]:
    """TPF and tokens/s from the counters between consecutive ramp samples, grouped by the default tau then."""
    groups: dict[float, list[float]] = {}
    ss = [s for s in samples if s["phase"] in ("ramp", "drained")]
    for a, b in itertools.pairwise(ss):
        g = groups.setdefault(round(a["default_tau"], 1), [0.0, 0.0, 0.0])
        g[0] += b["tokens"] - a["tokens"]
        g[1] += b["forwards"] - a["forwards"]
        g[2] += b["t_s"] - a["t_s"]
    return [{"default_tau": tau, "seconds": round(sec, 1), "tokens": int(tok),
             "tpf": round(tok / fwd, 3) if fwd else None, "tokens_per_second": round(tok / sec, 2) if sec else None}
            for tau, (tok, fwd, sec) in sorted(groups.items(), reverse=True)]


def rss_trace(samples, phase: str) -> dict:
    """RSS at the start, quarters and end of a phase, and the growth over its second half."""
    rss = [s["rss_mb"] for s in samples if s["phase"] == phase]
    if not rss:
        return {}
    points = {f"rss_mb_at_{q}pct": rss[min(len(rss) - 1, len(rss) * q // 100)] for q in (0, 25, 50, 75, 100)}
    return points | {"rss_mb_growth_second_half": round(rss[-1] - rss[len(rss) // 2], 1)}


def ramp_levels(samples, ramp: list[int]) -> list[dict]:
    """Per ramp step: mean default tau and queue depth, and TPF / tokens/s from the counters."""
    ss = [s for s in samples if s["phase"] == "ramp"]
    steps, current = [], []
    for s in ss:
        if current and s["clients"] != current[-1]["clients"]:
            steps.append(current)
            current = [current[-1]]
        current.append(s)
    steps.append(current)
    rows = []
    for group in steps:
        first, last = group[0], group[-1]
        dt, dtok, dfwd = last["t_s"] - first["t_s"], last["tokens"] - first["tokens"], last["forwards"] - first["forwards"]
        rows.append({"clients": last["clients"], "seconds": round(dt, 1),
                     "mean_default_tau": round(statistics.mean(s["default_tau"] for s in group[1:] or group), 3),
                     "min_default_tau": min(s["default_tau"] for s in group),
                     "mean_queue_depth": round(statistics.mean(s["queue_depth"] for s in group), 1),
                     "tpf": round(dtok / dfwd, 3) if dfwd else None,
                     "tokens_per_second": round(dtok / dt, 1) if dt else None})
    return rows


def fixed_checks(fixed: dict) -> dict:
    """The correctness checks of the fixed phase (tau = 1: every response equals its solo run)."""
    return {"fixed_zero_failed_or_lost": fixed["failed"] == fixed["lost"] == 0,
            "fixed_all_equal_solo": fixed["not_equal_to_solo"] == 0 and fixed["ok"] == fixed["requests"],
            "fixed_rss_growth_mb": round(fixed["rss_mb_end"] - fixed["rss_mb_start"], 1)}


def run_single(args, prompts, solo, tokenizer: Tokenizer) -> tuple[dict, list[str]]:
    """Both phases against one ``python -m runtime.serve`` process; (result, keys to print)."""
    with tempfile.TemporaryDirectory(prefix="mars-load-") as work:  # the server's log, removed after the run
        proc, url = start_server(args, Path(work) / "server.log")
        try:
            run = LoadRun(url, proc.pid, prompts, solo, tokenizer, args.max_tokens)
            asyncio.run(run.run(args))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    fixed = summarize_phase(run.records, run.samples, "fixed")
    ramp = summarize_phase(run.records, run.samples, "ramp")
    levels = ramp_levels(run.samples, args.ramp)
    result = {"fixed": fixed | rss_trace(run.samples, "fixed"), "ramp": ramp, "ramp_levels": levels,
              "tpf_by_default_tau": tpf_by_tau(run.samples),
              "checks": fixed_checks(fixed) | {
                  "streamed_text_equals_decode":
                      fixed["text_not_equal_to_decode"] == ramp["text_not_equal_to_decode"] == 0,
                  "tau_moved": min(l["min_default_tau"] for l in levels) < 1.0,
                  "tau_restored": run.samples[-1]["default_tau"] == 1.0},
              "timeline": run.samples, "requests": run.records}
    return result, ["fixed", "ramp", "ramp_levels", "tpf_by_default_tau", "checks"]


def run_ray(args, prompts, solo, tokenizer: Tokenizer) -> tuple[dict, list[str]]:
    """Warm-up and fixed phase against Ray Serve with each replica count of ``--ray``; (result, keys to print)."""
    rows = []
    for replicas in args.ray:
        run = run_fleet(args, replicas, prompts, solo, tokenizer)
        fixed = summarize_phase(run.records, run.samples, "fixed")
        rows.append({"replicas": replicas, "fixed": fixed | rss_trace(run.samples, "fixed"),
                     "checks": fixed_checks(fixed) | {"streamed_text_equals_decode":
                                                      fixed["text_not_equal_to_decode"] == 0},
                     "timeline": run.samples, "requests": run.records})
    first = rows[0]["fixed"]["tokens_per_second"]
    table = [{"replicas": r["replicas"], "tokens_per_second": r["fixed"]["tokens_per_second"],
              "ratio_to_first": r["fixed"]["tokens_per_second"] / first if first else None,
              "latency_s_p50": r["fixed"]["latency_s_p50"], "checks": r["checks"]} for r in rows]
    return {"replicas": table, "runs": rows}, ["replicas"]


def run_fleet(args, replicas: int, prompts, solo, tokenizer: Tokenizer) -> LoadRun:
    """Warm-up and fixed phase against ``replicas`` Ray Serve replicas, on a Ray of our own started for them.

    The deployment is stopped through ``runtime.serving.ray_launch.stop`` (the replicas' graceful shutdown, a wait
    for Serve to be gone, then Ray), as the ``serve_ray`` command stops it, also when the run fails; a deploy that
    fails leaves no handle to stop, and ``runtime.serving.ray_launch.launch`` shuts Ray (with whatever of Serve
    started) down.
    """
    from runtime.serving.ray_deploy import FleetOptions
    from runtime.serving.ray_launch import launch, stop

    deployed = launch([args.bundle, "--host", HOST, "--port", "0", "--max-batch-size", str(args.max_batch_size),
                       "--threads", str(args.threads), "--tau-min", str(args.tau_min), "--queue-high",
                       str(args.queue_high), "--log-level", "warning"],
                      FleetOptions(replicas=replicas, num_cpus=1.0,
                                   max_ongoing_requests=args.max_batch_size + args.queue_high),
                      num_cpus=max(args.ray), log_to_driver=False)  # as many CPUs for every replica count
    try:
        run = LoadRun(deployed.url, None, prompts, solo, tokenizer, args.max_tokens)
        asyncio.run(run.run(args))
    finally:
        stop(deployed)
    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = Tokenizer(args.bundle)  # a path that is no bundle: one error line (run_main), nothing written
    prompts = chat_prompts(tokenizer, args.max_prompt_chars)
    print(f"solo runs of {len(prompts)} prompts at tau=1 ...", flush=True)
    solo = solo_runs(args.bundle, prompts, args.max_tokens)
    load_before = os.getloadavg()
    result, shown = (run_single if args.ray is None else run_ray)(args, prompts, solo, tokenizer)
    result = {"bundle": args.bundle, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                   "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "settings": {k: v for k, v in vars(args).items() if k != "out"}} | result
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("load_test.json" if args.ray is None else "load_test_ray.json")).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in shown}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))

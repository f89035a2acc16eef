"""The KV cache against the memory it lives in (runtime/serving/kv_memory.py): a server whose cache cannot fit
refuses to start in one line naming --max-batch-size and --max-seq-len; a cache that cannot grow at run time fails
the requests that needed it with a 507, and the others go on.

No test allocates much: the memory available is injected, and allocation failures are injected into the cache."""

from __future__ import annotations

import json
import logging
import re
import threading

import numpy as np
import pytest
from server_support import serve, wait_until

from runtime import serve as serve_cli
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.engine import CannotGrowCache, Engine, EngineConfig
from runtime.decode.kv_cache import KVCache
from runtime.decode.params import DecodeParams
from runtime.serving import kv_memory
from runtime.serving.kv_memory import (check_fits, host_memory_available, largest_fitting, suggestion_budget,
                                      worst_case_bytes)

MIB = 1 << 20


def fail_above(cache: KVCache, capacity: int) -> list[int]:
    """Make ``cache`` unable to allocate buffers of more than ``capacity`` positions per slot (MemoryError, as numpy
    raises it); returns the list of capacities refused."""
    allocate, refused = cache._allocate, []

    def limited(target: int) -> None:
        if target > capacity:
            refused.append(target)
            raise MemoryError(f"Unable to allocate buffers of {target} positions (injected)")
        allocate(target)
    cache._allocate = limited
    return refused


# ------------------------------------------------------------------------------------------------ hand-made numbers
def test_peak_positions_follow_the_growth_rule():
    """The cache doubles from 16 up to max_len, holding the old buffers while it copies: its peak per slot."""
    assert [KVCache.peak_positions(m) for m in (2, 16, 17, 32, 600, 8192, 8193)] == [
        2, 16, 16 + 17, 16 + 32, 512 + 600, 4096 + 8192, 8192 + 8193]
    cache = KVCache(1, 1, 1, 600, np.float32, num_slots=1)
    held = []
    allocate = cache._allocate
    cache._allocate = lambda target: (held.append(cache.capacity + target), allocate(target))
    for needed in range(1, 601):
        cache.reserve(needed)
    assert max(held) == KVCache.peak_positions(600)


def test_a_growth_that_cannot_be_allocated_leaves_the_cache_as_it_was_and_a_shrink_keeps_it():
    cache = KVCache(2, 1, 4, 256, np.float32, num_slots=2)
    cache.reserve(30)
    cache.lengths[:] = [30, 5]
    cache.keys[0][0, 0, :30] = 7.0
    fail_above(cache, 32)
    with pytest.raises(MemoryError):
        cache.reserve(100)
    assert cache.capacity == 32 and cache.lengths.tolist() == [30, 5] and (cache.keys[0][0, 0, :30] == 7.0).all()
    cache._allocate = lambda target: (_ for _ in ()).throw(MemoryError("injected"))  # now every allocation fails
    cache.lengths[:] = [2, 0]
    cache.reserve(2)  # would halve to 16: the larger buffers stay, nothing raised
    assert cache.capacity == 32


def test_largest_fitting_values_fit_and_one_more_does_not():
    per_position, available = 46_080, 20 << 30  # the default model's KV bytes per position, 20 GiB
    num_slots, max_len = largest_fitting(2000, 8192, per_position, available, min_len=6)
    assert worst_case_bytes(num_slots, 8192, per_position) <= available < worst_case_bytes(num_slots + 1, 8192,
                                                                                           per_position)
    assert worst_case_bytes(2000, max_len, per_position) <= available < worst_case_bytes(2000, max_len + 1,
                                                                                         per_position)
    assert largest_fitting(8, 8192, per_position, available, 6) == (8, 8192)  # capped at what was asked
    assert largest_fitting(100_000, 8192, per_position, available, 6)[1] is None  # not even 6 positions each


def test_the_refusal_is_one_line_naming_both_options_and_the_largest_values():
    check_fits(8, 8192, 46_080, 20 << 30, "MemAvailable", min_len=6)  # 4.2 GiB fits: nothing raised
    with pytest.raises(ValueError) as refused:
        check_fits(2000, 8192, 46_080, 20 << 30, "MemAvailable in /proc/meminfo", min_len=6)
    num_slots, max_len = largest_fitting(2000, 8192, 46_080, suggestion_budget(20 << 30), 6)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("the KV cache may need 1054.7 GiB (2000 slots (--max-batch-size) x 8192 positions "
                              "(--max-seq-len) x 46,080 bytes, plus the 4096 positions per slot it grows from; ")
    assert message.endswith(f"but 20.0 GiB is available (MemAvailable in /proc/meminfo): lower --max-batch-size to "
                            f"{num_slots} or --max-seq-len to {max_len}")
    with pytest.raises(ValueError, match="not even 1 slot of 6 positions fits: free memory"):
        check_fits(1, 8192, 46_080, 100_000, "MemAvailable", min_len=6)


def test_host_memory_is_memavailable_within_a_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    v2, v1, none = tmp_path / "v2", tmp_path / "v1", tmp_path / "none"
    for folder in (v2, v1 / "memory", none):
        folder.mkdir(parents=True)
    assert host_memory_available(meminfo, none) == (20_000_000 * 1024, f"MemAvailable in {meminfo}")
    (v2 / "memory.max").write_text(f"{4 << 30}\n")
    (v2 / "memory.current").write_text(f"{3 << 30}\n")
    (v2 / "memory.stat").write_text(f"anon 100\ninactive_file {512 * MIB}\n")
    figure, where = host_memory_available(meminfo, v2)
    assert figure == (1 << 30) + 512 * MIB and "cgroup" in where  # the limit less what is used, droppable cache not
    (v2 / "memory.max").write_text("max\n")
    assert host_memory_available(meminfo, v2)[0] == 20_000_000 * 1024
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    assert host_memory_available(meminfo, v1)[0] == 1 << 30
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert host_memory_available(meminfo, v1)[0] == 20_000_000 * 1024


# ------------------------------------------------------------------------------------------------- the tiny model
@pytest.fixture(scope="module")
def tiny(tiny_bundle):
    """(bundle dir, backend, config) of the tiny Llama (W = 4, max context 512, 512 KV bytes per position)."""
    _, bundle = tiny_bundle("llama", 4)
    config = load_config(bundle)
    return bundle, OnnxBackend(bundle, config, num_threads=1), config


def test_an_engine_whose_cache_cannot_grow_fails_only_the_rows_that_needed_it(tiny):
    """The long row's growth past 64 positions per slot fails: CannotGrowCache names it alone, its slot is free,
    and the short row beside it runs to the end with the tokens it gets alone."""
    _, backend, config = tiny
    params = DecodeParams(max_new_tokens=12)
    short, long = [5, 6, 7], list(range(10, 110))
    alone = Engine(backend, config, EngineConfig(max_batch_size=2)).generate([short], params)[0].token_ids
    engine = Engine(backend, config, EngineConfig(max_batch_size=2))
    refused = fail_above(engine.cache, 64)
    engine.add_request(short, params, "short")
    tokens = [t for out in engine.step() for t in out.new_token_ids]  # the short row runs first
    engine.add_request(long, params, "long")  # and the long one joins it
    with pytest.raises(CannotGrowCache) as failed:
        while True:
            tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert failed.value.request_ids == ["long"] and failed.value.capacity <= 64 and refused
    assert isinstance(failed.value, MemoryError) and engine.num_running == 1 and engine.scheduler.find("long") is None
    assert len(tokens) < len(alone)  # the short row was still running
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == alone
    assert engine.generate([short], params)[0].token_ids == alone  # the engine goes on


def run_main(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = serve_cli.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_server_whose_cache_cannot_fit_refuses_to_start_in_one_line(tiny, monkeypatch, capsys):
    """``--max-batch-size 100000`` crashed with numpy's MemoryError traceback at the first allocation; now the
    worst case (here checked against an injected 64 MiB) stops the server first, naming both options and the
    largest values that fit 95% of the memory (it moves between runs), which then do start."""
    bundle, backend, config = tiny
    monkeypatch.setattr(kv_memory, "host_memory_available", lambda: (64 * MIB, "MemAvailable in /proc/meminfo"))
    allocated = []
    monkeypatch.setattr(KVCache, "_allocate", lambda self, capacity: allocated.append(capacity))
    per_position = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x 16 dims x float32
    code, err = run_main([str(bundle), "--max-batch-size", "100000"], capsys)
    assert code == 2 and len(err) == 1 and not allocated, err
    assert err[0].startswith("error: the KV cache may need 36.6 GiB (100000 slots (--max-batch-size) x 512 positions "
                             "(--max-seq-len) x 512 bytes, plus the 256 positions per slot it grows from; ")
    assert err[0].endswith("but 64.0 MiB is available (MemAvailable in /proc/meminfo): lower --max-batch-size to "
                           f"{suggestion_budget(64 * MIB) // (768 * per_position)}")  # no W + 2 positions for 100000
    code, err = run_main([str(bundle), "--max-batch-size", "2000"], capsys)
    num_slots, max_len = largest_fitting(2000, 512, per_position, suggestion_budget(64 * MIB), config.window + 2)
    assert code == 2 and len(err) == 1 and not allocated, err
    assert err[0].endswith(f"lower --max-batch-size to {num_slots} or --max-seq-len to {max_len}")
    monkeypatch.undo()
    available = (64 * MIB, "injected")
    for engine_config in (EngineConfig(num_slots), EngineConfig(2000, max_seq_len=max_len)):
        assert kv_memory.make_engine(backend, config, engine_config, available).cache.max_len <= 512
    budget = suggestion_budget(64 * MIB)  # the named values fit 95% of it, the largest that do
    assert worst_case_bytes(num_slots + 1, 512, per_position) > budget
    assert worst_case_bytes(2000, max_len + 1, per_position) > budget


def test_a_first_allocation_that_fails_anyway_is_one_line(tiny, monkeypatch, capsys):
    """Where the memory figure is unknown (or the memory went meanwhile), numpy's MemoryError at the first
    allocation is one line naming --max-batch-size, not a traceback."""
    bundle, _, _ = tiny
    monkeypatch.setattr(kv_memory, "host_memory_available", lambda: None)

    def refuse(self, capacity):
        raise MemoryError("Unable to allocate 68.7 GiB for an array with shape (2, 30, 100000, 3, 16, 64)")
    monkeypatch.setattr(KVCache, "_allocate", refuse)
    code, err = run_main([str(bundle), "--max-batch-size", "100000"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0] == ("error: the KV cache's first buffers, 100000 slots (--max-batch-size) x 16 positions x 512 bytes "
                      "= 781.2 MiB, cannot be allocated (MemoryError); lower --max-batch-size")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_cache_cannot_grow_for_is_a_507_and_the_others_go_on(tiny, caplog, stream):
    """With --max-batch-size 2000 a 600-token prompt got a 500 ``engine_error`` (numpy's MemoryError and a traceback
    in the log). Now the request whose growth fails gets a 507 naming the options and what fits, one WARNING line
    is logged, and the request running beside it ends as it would alone."""
    bundle, _, _ = tiny

    def inject(app):
        fail_above(app.state.ctx.engine_thread.engine.cache, 64)

    body = {"model": "tiny", "max_tokens": 16, "temperature": 0}
    with serve(str(bundle), "--max-batch-size", "2", prepare=inject) as server:
        alone = server.http.post("/v1/completions", json=body | {"prompt": [5, 6, 7]}).json()["choices"][0]["text"]
        caplog.clear()
        commands = server.app.state.ctx.engine_thread._commands
        done = {}
        with server.gate.closed():
            short = threading.Thread(target=lambda: done.update(
                short=server.http.post("/v1/completions", json=body | {"prompt": [5, 6, 7]})))
            short.start()
            server.gate.wait_held()  # the short request is in its first forward
            long = threading.Thread(target=lambda: done.update(
                long=server.http.post("/v1/completions", json=body | {"prompt": list(range(10, 110)),
                                                                      "stream": stream})))
            long.start()
            wait_until(lambda: commands.qsize() > 0, "the long request to reach the engine thread")
        for thread in (short, long):
            thread.join(60)
        answer = done["long"]
        if stream:
            assert answer.status_code == 200
            events = [line[len("data: "):] for line in answer.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
        else:
            assert answer.status_code == 507, answer.text
            error = answer.json()["error"]
        assert error["code"] == "kv_cache_out_of_memory" and error["type"] == "server_error"
        assert "--max-batch-size or --max-seq-len" in error["message"]
        fits = re.search(r"the cache holds (\d+) positions per slot .* a prompt plus max_tokens of at most (\d+) "
                         r"tokens fits now", error["message"])
        assert fits and int(fits[1]) <= 64 and int(fits[2]) == int(fits[1]) - 4, error["message"]  # W = 4
        assert done["short"].status_code == 200 and done["short"].json()["choices"][0]["text"] == alone
        assert server.wait_idle()["active_slots"] == 0 and server.health()["status"] == "ok"
        assert server.metric('mars_requests_total{outcome="error"}') == 1
    records = [r for r in caplog.records if r.name == "runtime.serving.engine_thread"]
    assert [r.levelno for r in records] == [logging.WARNING] and records[0].exc_info is None
    assert "1 request(s) failed: the server ran out of memory" in records[0].getMessage()

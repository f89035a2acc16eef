"""The server's KV cache against the memory it lives in: the start-up check, and the answer when it cannot grow.

Dimension letters: N slots (``--max-batch-size``), S positions per slot (``--max-seq-len``, default the
model's context). The engine's cache (:mod:`runtime.decode.kv_cache`) gives every slot the same
capacity, grown (doubled) up to S as the longest row needs it, whoever uses the other slots. So its
worst case is reached by ONE long request:

    bytes = copies x (2 x L x H x D x bytes per element) x N x peak(S)

with the per-position bytes of :func:`runtime.memory.kv_cache_bytes` (the one home of that
arithmetic), ``peak(S)`` = S plus the buffers it grows from (:meth:`KVCache.peak_positions`), and
``copies`` 2 on a TensorRT engine (its present outputs, :mod:`runtime.memory`), else 1.

Where that lives, and the memory it is checked against (:func:`memory_available`):
  - onnxruntime, every provider: numpy arrays in host memory. The figure is ``MemAvailable`` of
    ``/proc/meminfo`` (what the kernel can give without swapping), within a cgroup's memory limit
    (a container's); where neither is readable, the free pages ``os.sysconf`` gives. On the cuda and
    tensorrt providers onnxruntime also copies the rows a step reads to the GPU: not checked here.
  - a TensorRT engine (``engine.plan``): device memory, the free bytes ``cudaMemGetInfo`` gives
    (``backend.free_memory()``).
The figure is read after the model is loaded, so its weights are already out of it. Not counted:
activations, the logits buffer, the attention mask (memory that grows with N too): a check that
passes with little to spare may still run short.

Start-up (:func:`make_engine`): a worst case past the memory available stops the server with one
line naming ``--max-batch-size`` and ``--max-seq-len`` and the largest values that fit; so does a
first allocation that fails anyway (the memory figure unknown or gone meanwhile). ``python -m
runtime.serve_ray`` runs the same checks (:func:`check_engine_fits`) on the bundle's config before Ray
starts, for one replica on this machine. At run time an engine step whose cache cannot grow
(:class:`~runtime.decode.engine.CannotGrowCache`) fails the requests that needed it with
:class:`KVCacheOutOfMemory` (HTTP 507); the others go on.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime.bundle import BundleConfig
from runtime.decode.admission import check_max_batch_size, check_max_seq_len, min_seq_len
from runtime.decode.engine import CannotGrowCache, Engine, EngineConfig
from runtime.decode.kv_cache import MIN_CAPACITY, KVCache
from runtime.memory import GIB, KV_BYTES, kv_cache_bytes

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63
FLAGS = "--max-batch-size or --max-seq-len"
SUGGESTED_SHARE = 0.95  # of the memory available, what the values a refusal names fit: free memory moves between runs


class KVCacheOutOfMemory(RuntimeError):
    """A request the engine had admitted failed: the KV cache could not grow for it (HTTP 507; the server
    and the other requests go on). The message says what fits now and which options to lower."""

    status = 507
    code = "kv_cache_out_of_memory"


def bytes_per_position(config: BundleConfig, copies: int = 1) -> int:
    """Bytes one position of one slot takes in the KV cache, ``copies`` times (:func:`runtime.memory.kv_cache_bytes`)."""
    return copies * kv_cache_bytes(config.num_layers, config.num_kv_heads, config.head_dim, 1, 1,
                                   KV_BYTES[config.dtype])


def worst_case_bytes(num_slots: int, max_len: int, per_position: int) -> int:
    """The cache's largest size: N slots of :meth:`KVCache.peak_positions` each."""
    return num_slots * KVCache.peak_positions(max_len) * per_position


def largest_fitting(num_slots: int, max_len: int, per_position: int, available: int,
                    min_len: int) -> tuple[int, int | None]:
    """What fits in ``available`` bytes: (the most slots at ``max_len``, 0 if not one; the longest ``max_len``
    from ``min_len`` up for ``num_slots``, None if not even ``min_len``)."""
    num_fitting = available // (KVCache.peak_positions(max_len) * per_position)
    lo, hi = min_len - 1, max_len  # peak_positions grows with max_len: the largest that fits, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if worst_case_bytes(num_slots, mid, per_position) <= available else (lo, mid - 1)
    return min(num_fitting, num_slots), lo if lo >= min_len else None


def suggestion_budget(available: int) -> int:
    """The bytes the values a refusal names must fit: ``SUGGESTED_SHARE`` of ``available``, so that they still
    start when the free memory has moved a little (a value that fits all of it may be refused a minute later)."""
    return int(available * SUGGESTED_SHARE)


def check_fits(num_slots: int, max_len: int, per_position: int, available: int, where: str, min_len: int) -> None:
    """Raise ValueError, one line naming ``--max-batch-size`` and ``--max-seq-len`` and the largest values that
    fit :func:`suggestion_budget` of ``available``, where the cache's worst case (:func:`worst_case_bytes`) exceeds
    ``available`` bytes (read from ``where``).

    Args:
        min_len: the shortest ``--max-seq-len`` that serves anything (:func:`~runtime.decode.admission.min_seq_len`).
    """
    need = worst_case_bytes(num_slots, max_len, per_position)
    if need <= available:
        return
    growing = KVCache.peak_positions(max_len) - max_len
    also = f", plus the {growing} positions per slot it grows from" if growing else ""
    num_fitting, len_fitting = largest_fitting(num_slots, max_len, per_position, suggestion_budget(available),
                                               min_len)
    fixes = ([f"--max-batch-size to {num_fitting}"] if num_fitting else []) + (
        [f"--max-seq-len to {len_fitting}"] if len_fitting else [])
    fix = (f"lower {' or '.join(fixes)}" if fixes else
           f"not even 1 slot of {min_len} positions fits: free memory or use a larger machine")
    raise ValueError(f"the KV cache may need {_size(need)} ({num_slots} slots (--max-batch-size) x {max_len} "
                     f"positions (--max-seq-len) x {per_position:,} bytes{also}; one long request grows every slot) "
                     f"but {_size(available)} is available ({where}): {fix}")


def _size(num_bytes: int) -> str:
    """Bytes for a message: GiB, or MiB below 1 GiB."""
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB else f"{num_bytes / (1 << 20):.1f} MiB"


def memory_available(backend) -> tuple[int, str] | None:
    """(bytes, where the figure comes from) of the memory ``backend``'s KV cache lives in: the device's free
    memory where the backend says (``free_memory()``: a TensorRT engine), else :func:`host_memory_available`;
    None where unknown."""
    free_memory = getattr(backend, "free_memory", None)
    if free_memory is not None:
        return free_memory(), "free GPU memory"
    return host_memory_available()


def host_memory_available(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> tuple[int, str] | None:
    """(bytes, where from) of host memory this process may still take: ``MemAvailable`` of ``meminfo`` (else the
    free pages of ``os.sysconf``), within the room left under a cgroup v2 or v1 memory limit; None where none is
    readable."""
    figures = []
    kib = _read_field(meminfo, "MemAvailable:")
    if kib is not None:
        figures.append((kib * 1024, f"MemAvailable in {meminfo}"))
    else:
        try:
            figures.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free memory pages"))
        except (ValueError, OSError, AttributeError):
            pass
    room = cgroup_room(cgroup)
    if room is not None:
        figures.append((room, f"the memory limit of this process's cgroup, {cgroup}"))
    return min(figures) if figures else None


def cgroup_room(cgroup: Path = CGROUP) -> int | None:
    """Bytes left under the memory limit of cgroup v2 (``memory.max``) or v1 (``memory/memory.limit_in_bytes``)
    at ``cgroup``, file cache that can be dropped (inactive file pages) not counted as used; None without a limit."""
    for limit_file, usage_file, stat_file, inactive in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        limit, usage = _read_int(cgroup / limit_file), _read_int(cgroup / usage_file)
        if limit is not None and usage is not None and limit < _NO_LIMIT:
            return max(0, limit - usage + (_read_field(cgroup / stat_file, inactive) or 0))
    return None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # absent, or "max" (no limit)
        return None


def _read_field(path: Path, name: str) -> int | None:
    """The number after ``name`` on its line of ``path`` (``/proc/meminfo``, a cgroup's ``memory.stat``)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and fields[0].rstrip(":") == name.rstrip(":") and fields[1].isdigit():
            return int(fields[1])
    return None


def check_engine_fits(config: BundleConfig, engine_config: EngineConfig, max_batch: int | None, max_past: int,
                      copies: int, available: tuple[int, str] | None) -> int:
    """The positions a slot holds, once ``engine_config`` passes the engine's limits (as :class:`Engine` checks them)
    and its KV cache's worst case fits ``available``: :func:`make_engine`'s checks, on a backend's figures or on
    what a bundle's config alone gives (``python -m runtime.serve_ray``, before any replica loads the bundle).

    Args:
        max_batch, max_past: the backend's largest batch (None: no limit) and past.
        copies: the cache's copies (2 on a TensorRT engine, :mod:`runtime.memory`).
        available: (bytes, where from) of the memory the cache lives in; None: unknown, not checked.

    Raises:
        SettingError: a setting past the backend's or the model's limits (:mod:`runtime.decode.admission`).
        ValueError: the worst case past ``available`` (one line naming the options and what fits).
    """
    check_max_batch_size(engine_config.max_batch_size, max_batch)  # their errors first, as Engine's
    max_len = check_max_seq_len(engine_config.max_seq_len, config.max_context, max_past, config.window)
    if available is not None:
        check_fits(engine_config.max_batch_size, max_len, bytes_per_position(config, copies), *available,
                   min_len=min_seq_len(config.window))
    return max_len


def make_engine(backend, config: BundleConfig, engine_config: EngineConfig,
                available: tuple[int, str] | None = None) -> Engine:
    """The server's engine, once its KV cache's worst case fits the memory it lives in (module docstring).

    Args:
        available: (bytes, where from) to check against; None reads it now (:func:`memory_available`).

    Raises:
        ValueError: as :class:`Engine` (a setting past the backend's or model's limits); the worst case past the
            memory available, or the first buffers failing to allocate (one line naming the options).
    """
    copies = getattr(backend, "kv_copies", 1)
    max_len = check_engine_fits(config, engine_config, backend.max_batch, backend.max_past, copies,
                                available or memory_available(backend))
    try:
        return Engine(backend, config, engine_config)
    except MemoryError as e:  # numpy's message is a shape: say what it is and what to change
        slots, first = engine_config.max_batch_size, min(MIN_CAPACITY, max_len)
        per_position = bytes_per_position(config, copies)
        raise ValueError(f"the KV cache's first buffers, {slots} slots (--max-batch-size) x {first} positions x "
                         f"{per_position:,} bytes = {_size(slots * first * per_position)}, cannot be "
                         f"allocated ({type(e).__name__}); lower --max-batch-size") from None


def cannot_grow_error(e: CannotGrowCache, window: int) -> KVCacheOutOfMemory:
    """What a request the cache could not grow for is told (:class:`KVCacheOutOfMemory`)."""
    return KVCacheOutOfMemory(
        f"the server ran out of memory for this request's KV cache: the cache holds {e.capacity} positions per slot "
        f"for each of its {e.num_slots} slots and cannot grow to {e.needed}; a prompt plus max_tokens of at most "
        f"{max(e.capacity - window, 0)} tokens fits now. The server's operator can lower {FLAGS} "
        "(checked against the memory at start-up)")

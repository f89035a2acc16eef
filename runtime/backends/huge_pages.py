"""Put the memory a session allocates at load, its weights, on transparent huge pages (Linux; GitHub issue 11).

A decode step at batch 1 reads every weight once, from memory. onnxruntime keeps the weights (prepacked
for its kernels) in anonymous memory from its allocator. Where the kernel's transparent huge page (THP)
mode is ``madvise`` (Debian's and Ubuntu's default) that memory lies on 4 KiB pages: a step then walks
a new page, and a new TLB entry, every 4 KiB of weights, and the hardware prefetchers stop at each page's
end. numpy asks for huge pages for its own large arrays (so STREAM, run in numpy, gets them), and
llama.cpp's weights are a file mapping the page cache may hold in large folios. The runtime's CPU
sessions therefore get their new anonymous memory collapsed into 2 MiB pages once, after the load
(:func:`new_memory_on_huge_pages`): ``madvise(MADV_HUGEPAGE)``, then ``madvise(MADV_COLLAPSE)`` (Linux
6.1+), which copies each 2 MiB range into one huge page now rather than when ``khugepaged`` gets to it.

Nothing changes in what is computed: the same bytes at other physical addresses. It is best-effort:
where THP is ``never``, the kernel is older than 6.1, the platform is not Linux, or the kernel has no
huge page free, memory stays as it was and the load goes on. Speed in BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

HUGE_PAGE = 2 << 20  # bytes: x86-64 and arm64 (4 KiB base pages) PMD size
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <asm-generic/mman-common.h>
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass
class Collapsed:
    """What :func:`new_memory_on_huge_pages` did: bytes now on huge pages, and bytes the kernel refused
    (``failed``: no free huge page, a kernel without ``MADV_COLLAPSE``, or a mapping it does not collapse,
    such as a new thread's stack). Both 0 where THP is off."""

    bytes: int = 0
    failed: int = 0


def anonymous_ranges(maps: str) -> list[tuple[int, int]]:
    """The writable private anonymous mappings (and the heap) in the text of ``/proc/self/maps``,
    as [start, end) byte addresses."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p":
            continue
        if len(fields) == 5 or fields[5] == "[heap]":
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def new_ranges(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``after``'s ranges not covered by any of ``before``'s (a mapping may have grown,
    or merged with a neighbour), each rounded inward to whole huge pages; empty ones dropped."""
    out = []
    for start, end in after:
        pieces = [(start, end)]
        for old_start, old_end in before:
            pieces = [part for lo, hi in pieces
                      for part in ((lo, min(hi, old_start)), (max(lo, old_end), hi)) if part[0] < part[1]]
        for lo, hi in pieces:
            lo, hi = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
            if lo < hi:
                out.append((lo, hi))
    return out


def _anonymous_ranges_now() -> list[tuple[int, int]] | None:
    """This process's anonymous ranges now (:func:`anonymous_ranges`), or None where /proc/self/maps cannot be read."""
    try:
        return anonymous_ranges(Path("/proc/self/maps").read_text())
    except OSError:
        return None


def thp_available() -> bool:
    """True on Linux where transparent huge pages are not turned off (mode ``always`` or ``madvise``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


@contextlib.contextmanager
def new_memory_on_huge_pages(enabled: bool = True) -> Iterator[Collapsed]:
    """Collapse the anonymous memory this process maps inside the ``with`` block into huge pages at its end.

    Wrap a session's load (``with new_memory_on_huge_pages() as done: session = ...``); ``done``, a
    :class:`Collapsed`, says how much moved once the block ends. Memory other threads map meanwhile is
    collapsed too (harmless); memory the process had mapped before the block (e.g. freed by an earlier
    session, and reused by the allocator) is not, so the first load of a fresh process gains most.
    Best-effort: never raises for the kernel's refusal; nothing is done when ``enabled`` is False, off
    Linux or where THP is ``never``.
    """
    done = Collapsed()
    before = _anonymous_ranges_now() if enabled and thp_available() else None
    yield done
    after = _anonymous_ranges_now() if before is not None else None
    if after is None:
        return
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for start, end in new_ranges(before, after):
        madvise(start, end - start, MADV_HUGEPAGE)  # later faults in the range get huge pages too
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            done.bytes += end - start
        else:
            done.failed += end - start

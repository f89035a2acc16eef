"""runtime.backends.huge_pages: which memory it collapses, and that it collapses it where the kernel allows."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest

from runtime.backends import huge_pages
from runtime.backends.huge_pages import HUGE_PAGE, anonymous_ranges, new_memory_on_huge_pages, new_ranges

MAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 fe:01 1234    /usr/bin/python3.11
55d0c2000000-55d0c4000000 rw-p 00000000 00:00 0       [heap]
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0
7f0000a00000-7f0000c00000 r--p 00000000 00:00 0
7f0000c00000-7f0000e00000 rw-s 00000000 00:01 77      /dev/shm/x (deleted)
7f0001000000-7f0001400000 rw-p 00000000 fe:01 99      /usr/lib/libfoo.so
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0       [stack]
"""


@pytest.mark.runtime_python
def test_only_writable_private_anonymous_memory_and_the_heap_are_taken():
    assert anonymous_ranges(MAPS) == [(0x55d0c2000000, 0x55d0c4000000), (0x7f0000000000, 0x7f0000a00000)]


@pytest.mark.runtime_python
def test_new_ranges_are_what_was_not_mapped_before_in_whole_huge_pages():
    mib = 1 << 20
    before = [(10 * HUGE_PAGE, 12 * HUGE_PAGE)]
    after = [(10 * HUGE_PAGE, 20 * HUGE_PAGE + mib),  # grew upwards: the new part, its last partial page dropped
             (30 * HUGE_PAGE + mib, 33 * HUGE_PAGE),  # new: its first partial page dropped
             (40 * HUGE_PAGE, 40 * HUGE_PAGE + mib)]  # new but under one huge page: nothing
    assert new_ranges(before, after) == [(12 * HUGE_PAGE, 20 * HUGE_PAGE), (31 * HUGE_PAGE, 33 * HUGE_PAGE)]
    assert new_ranges(after, after) == []
    # a mapping that merged with one either side of an old one keeps both new parts
    assert new_ranges([(4 * HUGE_PAGE, 5 * HUGE_PAGE)], [(0, 9 * HUGE_PAGE)]) == [(0, 4 * HUGE_PAGE),
                                                                                  (5 * HUGE_PAGE, 9 * HUGE_PAGE)]


def _huge_kib_of(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding ``address``, from /proc/self/smaps."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        found = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if found:
            mapping = int(found[1], 16) <= address < int(found[2], 16)
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


needs_thp = pytest.mark.skipif(not huge_pages.thp_available(), reason="transparent huge pages are off or not Linux")


@pytest.mark.runtime_python
@needs_thp
def test_memory_mapped_inside_the_block_ends_on_huge_pages():
    size = 16 * HUGE_PAGE
    with new_memory_on_huge_pages() as done:
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory.write(b"\x01" * size)  # faulted in on 4 KiB pages (THP "madvise": nobody asked yet)
    address = huge_pages.ctypes.addressof(huge_pages.ctypes.c_char.from_buffer(memory))
    assert done.bytes + done.failed >= size - HUGE_PAGE  # the new mapping was found (less a partial page each end)
    if not done.bytes:
        pytest.skip(f"the kernel refused to collapse {done.failed} bytes (no free huge page, or before Linux 6.1)")
    assert _huge_kib_of(address) >= (size - 2 * HUGE_PAGE) // 1024
    memory.seek(0)
    assert memory.read(size) == b"\x01" * size  # the same bytes, moved


@pytest.mark.runtime_python
def test_nothing_is_done_where_the_process_maps_cannot_be_read(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_available", lambda: True)
    monkeypatch.setattr(huge_pages, "Path", lambda path: Path("/nonexistent") / path.lstrip("/"))
    with new_memory_on_huge_pages() as done:
        memory = mmap.mmap(-1, 8 * HUGE_PAGE)
        memory.write(b"\x01" * (8 * HUGE_PAGE))
    assert (done.bytes, done.failed) == (0, 0)


@pytest.mark.runtime_python
def test_nothing_is_done_where_transparent_huge_pages_are_off(monkeypatch, tmp_path):
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    with new_memory_on_huge_pages() as done:
        memory = mmap.mmap(-1, 8 * HUGE_PAGE)
        memory.write(b"\x01" * (8 * HUGE_PAGE))
    assert (done.bytes, done.failed) == (0, 0)


SESSION_SCRIPT = """
import json
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from runtime.backends.huge_pages import new_memory_on_huge_pages

rng = np.random.default_rng(0)
k, layers = 1024, 8  # 8 float32 [1024, 1024] weights: 32 MiB
weights = [numpy_helper.from_array(rng.standard_normal((k, k), dtype=np.float32) / 32, f"w{i}") for i in range(layers)]
nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"y{i - 1}", f"w{i}"], [f"y{i}"]) for i in range(layers)]
graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
                          [helper.make_tensor_value_info(f"y{layers - 1}", TensorProto.FLOAT, [2, k])], weights)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
with new_memory_on_huge_pages() as done:
    huge = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
small = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
with new_memory_on_huge_pages(enabled=False) as none:
    ort.InferenceSession(model, providers=["CPUExecutionProvider"])
x = rng.standard_normal((2, k), dtype=np.float32)
same = bool(np.array_equal(huge.run(None, {"x": x})[0], small.run(None, {"x": x})[0]))
print(json.dumps({"bytes": done.bytes, "failed": done.failed, "weights": layers * k * k * 4, "same": same,
                  "disabled": [none.bytes, none.failed]}))
"""


@needs_thp
def test_a_sessions_weights_move_and_compute_the_same():
    """In a fresh process (as a server or a command loads its bundle) onnxruntime's weights, 32 MiB prepacked at
    load, are found and moved; the session's outputs keep their bits; disabled, nothing moves. (In a process that
    freed earlier sessions the allocator may place the weights in memory mapped before: those stay where they are.)"""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", SESSION_SCRIPT], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    if not got["bytes"] and got["failed"]:
        pytest.skip(f"the kernel refused to collapse {got['failed']} bytes (no free huge page, or before Linux 6.1)")
    assert got["bytes"] >= got["weights"] // 2  # at least the prepacked copies (ranges shared with others round off)
    assert got["same"] and got["disabled"] == [0, 0]

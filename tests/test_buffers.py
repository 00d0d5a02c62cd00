"""pipeline.buffers: the direct-I/O buffers of the admission's ring and the build's direct-read hash."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from pathlib import Path

import pytest

from pipeline import intake
from pipeline.buffers import HUGE_PAGE, direct_io_buffers


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def _anon_huge_kib(start: int, end: int) -> int:
    """AnonHugePages of the mappings of this process that overlap [start, end)."""
    total = 0
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                low, high = int(head.group(1), 16), int(head.group(2), 16)
                inside = low < end and start < high
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.mark.parametrize("count,size", [(1, 4096), (3, 3 * 4096), (6, HUGE_PAGE), (4, 2 * HUGE_PAGE), (2, HUGE_PAGE + 4096)])
def test_buffers_are_disjoint_writable_and_aligned_for_direct_io(count, size):
    buffers = direct_io_buffers(count, size)
    assert [len(b) for b in buffers] == [size] * count
    for index, buffer in enumerate(buffers):
        buffer[:] = bytes([index + 1]) * size
    for index, buffer in enumerate(buffers):
        assert bytes(buffer) == bytes([index + 1]) * size  # no buffer overlaps another
    alignment = HUGE_PAGE if size % HUGE_PAGE == 0 else mmap.PAGESIZE
    assert all(_address(b) % alignment == 0 for b in buffers)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        direct_io_buffers(0, HUGE_PAGE)
    with pytest.raises(ValueError):
        direct_io_buffers(1, 0)
    with pytest.raises(ValueError):  # a stride of 1000 would start the second buffer off a page
        direct_io_buffers(3, 1000)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="this kernel gives no transparent huge pages")
def test_the_admission_ring_is_on_huge_pages_where_the_kernel_gives_them():
    """What made the ring's direct writes ~1.5 x as fast here: the buffers
    sit on huge pages (a huge page can fail to come only when memory is too
    fragmented to make one, which this project's machines are not)."""
    ring = intake.new_ring()
    for buffer in ring:
        buffer[:] = b"\x01" * len(buffer)  # fault every page in
    start = min(_address(b) for b in ring)
    end = max(_address(b) + len(b) for b in ring)
    assert _anon_huge_kib(start, end) * 1024 >= len(ring) * HUGE_PAGE


def test_the_ring_copies_every_byte_through_its_buffers(tmp_path):
    """The copy across several huge-page buffers and a short last one, direct where it can."""
    data = os.urandom(intake._RING_CHUNK * (intake._RING + 2) + 12345)
    source, target = tmp_path / "in.bin", tmp_path / "out.bin"
    source.write_bytes(data)
    in_fd = os.open(source, os.O_RDONLY)
    out_fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        digest, size = intake._pipelined_copy(in_fd, out_fd, "in.bin", len(data), None, len(data))
    finally:
        os.close(in_fd)
        os.close(out_fd)
    import hashlib

    assert (digest, size) == (hashlib.sha256(data).hexdigest(), len(data))
    assert target.read_bytes() == data

"""The copy of a directory source's large files from their own pages, under a
read lease (pipeline.leased_copy): byte-exact, hashed once, given up at once
when another process wants to change the file, and never left behind."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import intake, leased_copy
from pipeline.errors import VianoError
from tests.test_intake_copy import (
    QUIET,
    REL,
    _assert_stored,
    _data,
    _failing_write,
    _machine_has_direct_io,
    _package,
    _stored,
    _tree,
)

MiB = 1024 * 1024
REPO = Path(__file__).resolve().parent.parent
WINDOW = leased_copy.WINDOW


@pytest.fixture
def mapped(monkeypatch, tmp_path):
    """Records what every mapped copy returned, so a test knows the path was taken."""
    _machine_has_direct_io(tmp_path / "probe")
    calls = []
    real = leased_copy.copy_mapped

    def spy(in_fd, size, *args, **kwargs):
        done = real(in_fd, size, *args, **kwargs)
        calls.append((size, done))
        return done

    monkeypatch.setattr(leased_copy, "copy_mapped", spy)
    return calls


def _leases_on(path: Path) -> list[str]:
    """The kernel's lease lines (/proc/locks) for ``path``'s inode."""
    st = os.stat(path)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as locks:
        return [line.strip() for line in locks if "LEASE" in line.split() and inode in line.split()]


def _open_for_writing_from_another_process(path: Path) -> float:
    """Seconds another process waited to open ``path`` for writing."""
    code = "import os, sys, time; t = time.monotonic(); os.close(os.open(sys.argv[1], os.O_WRONLY)); print(time.monotonic() - t)"
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120, check=True)
    return float(result.stdout)


@pytest.mark.parametrize("size", [2 * WINDOW, 2 * WINDOW + 1, 13 * MiB + 4097, 16 * MiB], ids=["2w", "2w+1", "13MiB+4097", "16MiB"])
def test_a_large_file_is_copied_from_its_own_pages_byte_exact(tmp_path, mapped, size):
    data = _data(size)
    src = _package(tmp_path, data)
    progress = []
    manifest = intake.admit(tmp_path / "ws", "c1", src, progress=lambda path, done, total: progress.append((path, done, total)))
    assert mapped == [(size, size)]  # the whole file went the mapped way
    _assert_stored(tmp_path / "ws", "c1", manifest, data)
    sizes = [done for path, done, _total in progress if path == REL]
    assert sizes == sorted(sizes) and sizes[-1] == size
    # The lease went with the copy: no one waits to write to the source now.
    assert _leases_on(src / REL) == []
    assert _open_for_writing_from_another_process(src / REL) < 5


@pytest.mark.parametrize("change", ["truncate", "append"])
def test_a_writer_in_another_process_waits_for_the_windows_in_flight_then_the_rest_is_copied_as_the_file_then_is(
    tmp_path, mapped, change
):
    """The other process's truncate (or open for appending) waits on the
    lease; the copy sees the break at its next window, finishes the windows
    in flight, lets go, and reads the rest as the ring reads any source. The
    stored bytes are the recorded ones either way; no SIGBUS, no SIGURG
    ending the process, and the writer waited well under the kernel's 45 s."""
    size = 64 * MiB
    data = _data(size)
    extra = _data(3 * MiB + 5, seed=11)
    src = _package(tmp_path, data)
    target = src / REL
    cut = 5 * MiB + 77
    if change == "truncate":
        code = f"import os, sys, time; t = time.monotonic(); os.truncate(sys.argv[1], {cut}); print(time.monotonic() - t)"
    else:
        (tmp_path / "extra.bin").write_bytes(extra)
        code = ("import sys, time; t = time.monotonic(); f = open(sys.argv[1], 'ab'); w = time.monotonic() - t; "
                "f.write(open(sys.argv[2], 'rb').read()); f.close(); print(w)")
    children = []

    def progress(path, done, total):
        if path != REL or children:
            return
        args = [sys.executable, "-c", code, str(target)] + ([str(tmp_path / "extra.bin")] if change == "append" else [])
        children.append(subprocess.Popen(args, stdout=subprocess.PIPE, text=True))
        deadline = time.monotonic() + 30
        while not any("BREAKING" in line for line in _leases_on(target)):  # the writer now waits on the lease
            assert time.monotonic() < deadline and children[0].poll() is None, "the other process did not wait"
            time.sleep(0.01)

    manifest = intake.admit(tmp_path / "ws", "c1", src, progress=progress)
    waited = float(children[0].communicate(timeout=60)[0])
    assert children[0].returncode == 0
    assert waited < 10
    [(planned, mapped_bytes)] = mapped
    assert planned == size and WINDOW <= mapped_bytes < size
    stored = _stored(tmp_path / "ws", "c1").read_bytes()
    if change == "truncate":
        assert stored == data[: max(mapped_bytes, cut)]
    else:
        assert stored == data + extra
    _assert_stored(tmp_path / "ws", "c1", manifest, stored)
    assert _leases_on(target) == []


def test_a_source_open_for_writing_elsewhere_is_copied_by_the_ring(tmp_path, mapped):
    data = _data(12 * MiB + 3)
    src = _package(tmp_path, data)
    held = os.open(src / REL, os.O_WRONLY)  # no read lease while anyone may write
    try:
        manifest = intake.admit(tmp_path / "ws", "c1", src, progress=QUIET)
    finally:
        os.close(held)
    assert mapped == []
    _assert_stored(tmp_path / "ws", "c1", manifest, data)


def test_a_write_error_in_the_mapped_copy_is_io_error_leaves_no_trace_and_no_lease(tmp_path, mapped, monkeypatch):
    ws = tmp_path / "ws"
    intake.admit(ws, "other", _package(tmp_path / "other", b"x" * 10), progress=QUIET)
    src = _package(tmp_path, _data(24 * MiB))
    before = _tree(ws)
    seen = _failing_write(monkeypatch, errno.EIO, after=2)
    with pytest.raises(VianoError) as info:
        intake.admit(ws, "c1", src, progress=QUIET)
    monkeypatch.undo()
    assert seen["n"] == 2
    assert info.value.code == "IO_ERROR", str(info.value)
    assert _tree(ws) == before
    assert _leases_on(src / REL) == []


_INTERRUPT_MAPPED = r"""
import json, os, signal, sys, threading, time
from pathlib import Path
from pipeline import intake, leased_copy
base = Path(sys.argv[1])
src = base / "src"
(src / "original" / "context").mkdir(parents=True)
(src / "manifest.json").write_text(json.dumps({"format": "viano-package", "format_version": 1, "package_id": "p",
                                                "project": {"name": "n", "version": "1"}, "analysis_revision": 1}))
(src / "original" / "context" / "dump.bin").write_bytes(os.urandom(48 * 1024 * 1024))
taken = []
real = leased_copy.take_read_lease
leased_copy.take_read_lease = lambda fd: taken.append(real(fd)) or taken[-1]
sent = []

def progress(path, done, total):
    if not sent:
        sent.append(done)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

try:
    intake.admit(base / "ws", "c1", src, progress=progress)
    raised = None
except BaseException as error:
    raised = type(error).__name__
workers = [t.name for t in threading.enumerate() if t.name.startswith("viano-admit")]
print(json.dumps({"raised": raised, "lease_taken": taken, "workers": workers, "case": (base / "ws" / "cases" / "c1").exists()}))
"""


def test_ctrl_c_during_the_mapped_copy_winds_it_up_and_stays_an_interrupt(tmp_path):
    _machine_has_direct_io(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", _INTERRUPT_MAPPED, str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"raised": "KeyboardInterrupt", "lease_taken": [True], "workers": [], "case": False}, outcome
    assert _leases_on(tmp_path / "src" / REL) == []
    assert _open_for_writing_from_another_process(tmp_path / "src" / REL) < 5


def test_no_lease_where_the_kernel_would_revoke_it_before_the_windows_in_flight_are_out(tmp_path, monkeypatch):
    monkeypatch.setattr(leased_copy, "_break_seconds", lambda: leased_copy._MIN_BREAK_SECONDS - 1)
    path = tmp_path / "f"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert leased_copy.take_read_lease(fd) is False
        assert _leases_on(path) == []
    finally:
        os.close(fd)


@pytest.mark.parametrize("failing_write", [2, 4, 6])
def test_a_write_error_on_any_window_ends_the_copy_without_waiting_for_windows_never_written(tmp_path, mapped, monkeypatch, failing_write):
    """6 windows: the error may come while windows are still being mapped or
    once all are (the writer then stops with windows behind it unwritten)."""
    ws = tmp_path / "ws"
    src = _package(tmp_path, _data(6 * WINDOW))
    seen = _failing_write(monkeypatch, errno.ENOSPC, after=failing_write)
    with pytest.raises(VianoError) as info:
        intake.admit(ws, "c1", src, progress=QUIET)
    monkeypatch.undo()
    assert seen["n"] == failing_write
    assert info.value.code == "IO_ERROR", str(info.value)
    assert not (ws / "cases" / "c1").exists()
    assert _leases_on(src / REL) == []

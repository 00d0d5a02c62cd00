"""Admission's large-file copy of directory sources and stored ZIP members (pipeline.intake._pipelined_copy_from).

Every way the copy can write -- direct I/O with its own writer thread (ext4
and most disk filesystems), buffered (tmpfs, or no direct I/O), direct I/O
refused mid-file -- must store the source byte for byte, record the sha256
and size of exactly what was stored, and keep the limits and error codes,
also for a file that shrinks or grows while it is being copied.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import random
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import intake
from pipeline.errors import VianoError

MiB = 1 << 20
RING_BYTES = intake._RING * intake._RING_CHUNK  # what the copy may have read ahead when it first reports
PACKAGE_ID = "copy-pkg"
REL = "original/context/dump.bin"
QUIET = lambda *a: None  # noqa: E731


def _package(root: Path, data: bytes) -> Path:
    src = root / "src"
    (src / "original" / "context").mkdir(parents=True)
    manifest = {
        "format": "viano-package",
        "format_version": 1,
        "package_id": PACKAGE_ID,
        "project": {"name": "copy", "version": "1"},
        "analysis_revision": 1,
    }
    (src / "manifest.json").write_bytes(json.dumps(manifest).encode())
    (src / REL).write_bytes(data)
    return src


def _data(size: int, seed: int = 7) -> bytes:
    return random.Random(seed).randbytes(size)


def _stored(ws: Path, case_id: str) -> Path:
    return ws / "cases" / case_id / "packages" / PACKAGE_ID / "content" / REL


def _tree(root: Path) -> dict:
    state = {}
    if not root.exists():
        return state
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            state[str(path.relative_to(root))] = (st.st_mode, st.st_size if digest else None, digest)
    return state


def _assert_stored(ws: Path, case_id: str, manifest: dict, expected: bytes) -> None:
    stored = _stored(ws, case_id).read_bytes()
    assert stored == expected
    assert manifest["files"][REL] == {"sha256": hashlib.sha256(expected).hexdigest(), "size": len(expected)}
    on_disk = json.loads((ws / "cases" / case_id / "packages" / PACKAGE_ID / "manifests" / "000001.json").read_text())
    assert on_disk["files"][REL] == manifest["files"][REL]
    assert not (ws / ".staging").exists() or os.listdir(ws / ".staging") == []


def _filesystem_type(path: Path) -> str:
    """The filesystem type as coreutils names it: decided without the code under test."""
    import subprocess

    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True).stdout.strip()


def _direct_io_in(directory: Path) -> bool:
    """Whether an aligned O_DIRECT write works here and the filesystem is not
    tmpfs (where admission deliberately stays buffered), by a raw probe."""
    import mmap

    directory.mkdir(parents=True, exist_ok=True)
    if _filesystem_type(directory) == "tmpfs":
        return False
    probe = directory / "direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        buffer = mmap.mmap(-1, 4096)
        try:
            return os.write(fd, buffer) == 4096
        except OSError:
            return False
        finally:
            buffer.close()
    finally:
        os.close(fd)
        probe.unlink()


def _machine_has_direct_io(tmp_path: Path) -> None:
    # This project's machines (and its CI, the same kind) have an ext4 root that
    # takes O_DIRECT: there a "no direct I/O" skip would hide a broken probe.
    if not _direct_io_in(tmp_path):
        if _filesystem_type(tmp_path) == "ext4":
            pytest.fail("ext4 should take an aligned O_DIRECT write")
        pytest.skip(f"the test directory ({_filesystem_type(tmp_path)}) has no direct I/O")


def test_filesystem_detection_agrees_with_an_independent_probe(tmp_path):
    for directory in [tmp_path] + ([Path("/dev/shm")] if os.path.isdir("/dev/shm") else []):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert intake._on_tmpfs(fd) == (_filesystem_type(directory) == "tmpfs"), directory
        finally:
            os.close(fd)
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        expected = _direct_io_in(tmp_path / "independent")
        assert intake._set_direct(fd, True) == expected or _filesystem_type(tmp_path) == "tmpfs"
        assert intake._set_direct(fd, False) is False
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        os.close(fd)


@pytest.fixture
def tmpfs_dir():
    if not os.path.isdir("/dev/shm") or _filesystem_type(Path("/dev/shm")) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")  # the project's machines and CI have one
    path = Path(tempfile.mkdtemp(prefix="viano-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["direct", "tmpfs", "no-direct-io"])
def mode(request, tmp_path, monkeypatch):
    """Where the workspace is and how the copy writes; returns the workspace path.

    ``direct`` is skipped where the test filesystem has no direct I/O, so it
    never silently tests the buffered path instead.
    """
    calls: list[tuple[bool, bool]] = []
    real = intake._set_direct

    def spy(fd: int, on: bool) -> bool:
        result = real(fd, on)
        calls.append((on, result))
        return result

    if request.param == "direct":
        _machine_has_direct_io(tmp_path)
        monkeypatch.setattr(intake, "_set_direct", spy)
        yield tmp_path / "ws"
        assert (True, True) in calls  # direct mode was really used
    elif request.param == "tmpfs":
        base = request.getfixturevalue("tmpfs_dir")
        monkeypatch.setattr(intake, "_set_direct", spy)
        yield base / "ws"
        assert (True, True) not in calls  # tmpfs copies through its page cache anyway
    else:
        monkeypatch.setattr(intake, "_set_direct", lambda fd, on: False)
        yield tmp_path / "ws"


@pytest.mark.parametrize(
    "size",
    [intake.CHUNK + 1, 4 * MiB, 3 * MiB + 123, 9 * MiB + 4096],
    ids=["1MiB+1", "4MiB", "3MiB+123", "9MiB+4096"],
)
def test_large_file_is_stored_byte_exact(tmp_path, mode, size):
    data = _data(size)
    src = _package(tmp_path, data)
    manifest = intake.admit(mode, "c1", src, progress=QUIET)
    _assert_stored(mode, "c1", manifest, data)


def test_progress_reaches_the_file_size(tmp_path, mode):
    data = _data(5 * MiB + 1)
    src = _package(tmp_path, data)
    calls = []
    intake.admit(mode, "c1", src, progress=lambda *a: calls.append(a))
    sizes = [done for path, done, total in calls if path == REL]
    assert sizes == sorted(sizes) and sizes[-1] == len(data)
    assert all(total == len(data) for path, _done, total in calls if path == REL)


def _on_first_progress(action):
    done = []

    def progress(path, size, total):
        if path == REL and not done:
            done.append(size)
            action()

    return progress


def _refused_as_changed(tmp_path: Path, ws: Path, src: Path, progress) -> None:
    """Admitting ``src`` is SOURCE_CHANGED naming the file, and leaves ``ws`` as it was."""
    intake.admit(ws, "other", _package(tmp_path / "other", b"x" * 10), progress=QUIET)
    before = _tree(ws)
    with pytest.raises(VianoError) as info:
        intake.admit(ws, "c1", src, progress=progress)
    assert info.value.code == "SOURCE_CHANGED" and info.value.path == REL, str(info.value)
    assert _tree(ws) == before


def test_file_shrinking_during_copy_is_refused_not_stored_cut(tmp_path, mode):
    """Truncated after the first chunk: the reader is at most a ring ahead, so
    it reads to the new end. What it copied is a prefix of the file that never
    existed as such (the file was never that long): it used to be admitted as
    the file, with that prefix's digest."""
    data = _data(24 * MiB)
    src = _package(tmp_path, data)
    cut = RING_BYTES + 2 * MiB + 77  # beyond what the ring can have read ahead, and not block-aligned
    assert cut < len(data)

    def shrink():
        os.truncate(src / REL, cut)

    _refused_as_changed(tmp_path, mode, src, _on_first_progress(shrink))


def test_file_growing_during_copy_is_refused(tmp_path, mode):
    data = _data(RING_BYTES + 4 * MiB)  # more than the ring reads ahead before the first progress
    extra = _data(2 * MiB + 5, seed=8)
    src = _package(tmp_path, data)

    def grow():
        with open(src / REL, "ab") as f:
            f.write(extra)

    _refused_as_changed(tmp_path, mode, src, _on_first_progress(grow))


def test_file_rewritten_in_place_during_copy_keeping_its_size_is_refused(tmp_path, mode):
    """Same size, new bytes at the front (already copied): only the
    modification time tells, and the copy is half old, half new."""
    data = _data(RING_BYTES + 4 * MiB)
    src = _package(tmp_path, data)

    def rewrite():
        with open(src / REL, "r+b") as f:
            f.write(b"\0" * 4096)
        stat_now = os.stat(src / REL)
        os.utime(src / REL, ns=(stat_now.st_atime_ns, stat_now.st_mtime_ns + 1_000_000))  # past any timestamp tick

    _refused_as_changed(tmp_path, mode, src, _on_first_progress(rewrite))


def test_a_small_file_changed_after_the_walk_is_refused(tmp_path, monkeypatch):
    """Small files are copied in one pass without the ring: a file grown
    between the walk (which sized it for the limits and the free-disk check)
    and its copy is refused too."""
    src = _package(tmp_path, b"small\n")
    walk = intake._DirSource._walk

    def walk_then_grow(self, dir_fd, parts):
        walk(self, dir_fd, parts)
        if not parts:
            with open(src / REL, "ab") as f:
                f.write(b"more\n")

    monkeypatch.setattr(intake._DirSource, "_walk", walk_then_grow)
    _refused_as_changed(tmp_path, tmp_path / "ws", src, QUIET)


def test_file_growing_beyond_the_limit_during_copy_is_refused(tmp_path, mode):
    data = _data(RING_BYTES + 4 * MiB)
    src = _package(tmp_path, data)
    ws = mode
    intake.admit(ws, "other", _package(tmp_path / "other", b"x" * 10), progress=QUIET)
    before = _tree(ws)

    def grow():
        with open(src / REL, "ab") as f:
            f.write(_data(4 * MiB, seed=9))

    limits = intake.ZipLimits(max_entry_bytes=len(data) + 2 * MiB)
    with pytest.raises(VianoError) as info:
        intake.admit(ws, "c1", src, limits=limits, progress=_on_first_progress(grow))
    assert info.value.code == "LIMIT_EXCEEDED", str(info.value)
    assert _tree(ws) == before


def _failing_write(monkeypatch, err: int, after: int):
    """Make the ``after``-th and later os.write calls on a descriptor in direct mode fail with ``err``."""
    real_write = os.write
    seen = {"n": 0}

    def write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            seen["n"] += 1
            if seen["n"] >= after:
                raise OSError(err, os.strerror(err))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    return seen


def _source(kind: str, root: Path, data: bytes) -> Path:
    import zipfile

    return _package(root, data) if kind == "directory" else _zip_package(root, data, zipfile.ZIP_DEFLATED)


@pytest.mark.parametrize("kind", ["directory", "zip"])
def test_direct_io_refused_mid_file_goes_on_buffered(tmp_path, monkeypatch, kind):
    """EINVAL from a direct write (an alignment the filesystem does not take): the rest is written buffered."""
    _machine_has_direct_io(tmp_path)
    ws = tmp_path / "ws"
    data = _data(12 * MiB + 11)
    src = _source(kind, tmp_path, data)
    seen = _failing_write(monkeypatch, errno.EINVAL, after=3)
    manifest = intake.admit(ws, "c1", src, progress=QUIET)
    monkeypatch.undo()
    assert seen["n"] == 3  # refused once, then never tried again
    _assert_stored(ws, "c1", manifest, data)


@pytest.mark.parametrize("kind", ["directory", "zip"])
def test_write_error_in_the_writer_thread_is_io_error_and_leaves_no_trace(tmp_path, monkeypatch, kind):
    _machine_has_direct_io(tmp_path)
    ws = tmp_path / "ws"
    intake.admit(ws, "other", _package(tmp_path / "other", b"x" * 10), progress=QUIET)
    src = _source(kind, tmp_path, _data(12 * MiB))
    before = _tree(ws)
    seen = _failing_write(monkeypatch, errno.EIO, after=2)
    with pytest.raises(VianoError) as info:
        intake.admit(ws, "c1", src, progress=QUIET)
    monkeypatch.undo()
    assert seen["n"] == 2
    assert info.value.code == "IO_ERROR", str(info.value)
    assert _tree(ws) == before


def test_a_failure_in_the_hashing_thread_stops_the_reader_and_the_writer(tmp_path):
    # The main thread hashes; when it fails (here the progress callback) the
    # reader and the direct writer must both be woken and joined, or the
    # admission would hang with threads holding the descriptors. A slow hashing
    # side lets the ring fill up: the reader then waits for a free buffer and
    # the writer for its next chunk, the state in which a missed wake-up hangs.
    import threading
    import time

    _machine_has_direct_io(tmp_path)
    ws = tmp_path / "ws"
    src = _package(tmp_path, _data(24 * MiB))

    class Stop(Exception):
        pass

    calls = {"n": 0}

    def progress(label, done, total):
        calls["n"] += 1
        time.sleep(0.05)
        if calls["n"] == 8:
            raise Stop()

    outcome = {}

    def run():
        try:
            intake.admit(ws, "c1", src, progress=progress)
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            outcome["error"] = error

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "admission hung after its hashing thread failed"
    assert isinstance(outcome.get("error"), Stop)
    assert [t.name for t in threading.enumerate() if t.name.startswith("viano-admit")] == []
    assert not (ws / "cases" / "c1").exists()


def test_direct_mode_is_on_while_copying_and_cleared_when_the_copy_ends(tmp_path, monkeypatch):
    _machine_has_direct_io(tmp_path)
    data = _data(3 * MiB)  # a multiple of the alignment: direct up to the last chunk
    source, target = tmp_path / "in.bin", tmp_path / "out.bin"
    source.write_bytes(data)
    flags_seen = []
    real = intake._write_out

    def spy(fd, view, direct):
        flags_seen.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return real(fd, view, direct)

    monkeypatch.setattr(intake, "_write_out", spy)
    in_fd = os.open(source, os.O_RDONLY)
    out_fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        digest, size = intake._pipelined_copy(in_fd, out_fd, "in.bin", 10 * MiB, None, len(data))
        assert not fcntl.fcntl(out_fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        os.close(in_fd)
        os.close(out_fd)
    assert flags_seen and all(flags_seen)
    assert (digest, size) == (hashlib.sha256(data).hexdigest(), len(data))
    assert target.read_bytes() == data


# --------------------------------------------------------------------------- ZIP sources


def _zip_package(root: Path, data: bytes, method: int) -> Path:
    """The same package as a ZIP file, its large member stored or deflated."""
    import zipfile

    src = _package(root, data)
    target = root / "pkg.zip"
    with zipfile.ZipFile(target, "w") as archive:
        archive.write(src / "manifest.json", "manifest.json", compress_type=zipfile.ZIP_STORED)
        archive.write(src / REL, REL, compress_type=method, compresslevel=1 if method == zipfile.ZIP_DEFLATED else None)
    shutil.rmtree(src)
    return target


@pytest.mark.parametrize("method", ["stored", "deflated"])
@pytest.mark.parametrize("size", [intake.CHUNK + 1, 8 * MiB + 123, 8 * MiB + intake.CHUNK, 9 * MiB + 4096 + 7])
def test_large_zip_member_is_stored_byte_exact(tmp_path, mode, size, method):
    import zipfile

    data = _data(size)
    src = _zip_package(tmp_path, data, zipfile.ZIP_STORED if method == "stored" else zipfile.ZIP_DEFLATED)
    manifest = intake.admit(mode, "c1", src, progress=QUIET)
    _assert_stored(mode, "c1", manifest, data)


def test_corrupt_zip_member_stops_the_direct_copy_with_its_code(tmp_path):
    import zipfile

    _machine_has_direct_io(tmp_path)
    ws = tmp_path / "ws"
    src = _zip_package(tmp_path, _data(12 * MiB), zipfile.ZIP_STORED)
    raw = bytearray(src.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the member's data: its CRC no longer matches
    src.write_bytes(bytes(raw))
    with pytest.raises(VianoError) as info:
        intake.admit(ws, "c1", src, progress=QUIET)
    assert info.value.code == "ZIP_CRC_MISMATCH", str(info.value)
    assert not (ws / "cases" / "c1").exists()


def test_a_large_stored_zip_member_takes_its_crc_on_the_reader_thread(tmp_path, mode, monkeypatch):
    """The CRC-32 of a large stored member is taken where the ring's reader
    fills the buffers, so it overlaps the SHA-256 of the main thread instead
    of adding to it (the stored bytes and their digest are checked too)."""
    import threading
    import zipfile
    import zlib

    from pipeline import zipscan

    data = _data(5 * MiB + 4097)
    src = _zip_package(tmp_path, data, zipfile.ZIP_STORED)
    threads: set[str] = set()
    real_crc32 = zlib.crc32

    def crc32(buffer, value=0):
        threads.add(threading.current_thread().name)
        return real_crc32(buffer, value)

    monkeypatch.setattr(zipscan.zlib, "crc32", crc32)
    manifest = intake.admit(mode, "c1", src, progress=QUIET)
    _assert_stored(mode, "c1", manifest, data)
    assert "viano-admit-read" in threads


def test_corrupt_deflated_member_stops_the_ring_with_its_code(tmp_path, mode):
    """A large deflated member is inflated on the ring's reader thread; its
    own checks (deflate stream, length, CRC-32) still stop the admission with
    their codes and leave no case behind."""
    import zipfile

    src = _zip_package(tmp_path, _data(6 * MiB), zipfile.ZIP_DEFLATED)
    raw = bytearray(src.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the member's deflate stream
    src.write_bytes(bytes(raw))
    with pytest.raises(VianoError) as info:
        intake.admit(mode, "c1", src, progress=QUIET)
    assert info.value.code in ("ZIP_INVALID", "ZIP_CRC_MISMATCH"), str(info.value)
    assert not (mode / "cases" / "c1").exists()


@given(
    chunk_sizes=st.lists(st.integers(0, 5000), max_size=40),
    buffer_size=st.sampled_from([1, 4096, 10_000, 1 << 16]),
)
@settings(max_examples=200, deadline=None)
def test_refill_fills_every_buffer_to_the_brim_but_the_last(chunk_sizes, buffer_size):
    """Chunks of any sizes (an inflated member gives what zlib gives) come out
    as full buffers, so direct writes stay aligned, and in order."""
    rng = random.Random(len(chunk_sizes) * 31 + buffer_size)
    chunks = [rng.randbytes(n) for n in chunk_sizes]
    refill = intake._Refill(iter(chunks))
    buffer = bytearray(buffer_size)
    filled = []
    while (n := refill(buffer)) > 0:
        filled.append(bytes(buffer[:n]))
    assert b"".join(filled) == b"".join(chunks)
    assert all(len(piece) == buffer_size for piece in filled[:-1])
    assert refill(buffer) == 0


_DOUBLE_INTERRUPT = r"""
import json, os, signal, sys, threading, time, zipfile
from pathlib import Path
from pipeline import intake, zipscan

kind, base = sys.argv[1], Path(sys.argv[2])
src = base / "src"
(src / "original" / "context").mkdir(parents=True)
(src / "manifest.json").write_bytes(json.dumps({"format": "viano-package", "format_version": 1,
    "package_id": "copy-pkg", "project": {"name": "copy", "version": "1"}, "analysis_revision": 1}).encode())
payload = os.urandom(1 << 20) * 24
(src / "original" / "context" / "dump.bin").write_bytes(payload)
armed = threading.Event()

def interrupt_twice():
    # Once the ring is busy: Ctrl-C, then again while it stops.
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)

def arm():
    if not armed.is_set():
        armed.set()
        threading.Thread(target=interrupt_twice, daemon=True).start()

if kind == "deflated":
    archive = base / "pkg.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.write(src / "manifest.json", "manifest.json")
        z.write(src / "original" / "context" / "dump.bin", "original/context/dump.bin",
                compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
    src = archive
    real_crc32 = zipscan.zlib.crc32

    def slow_crc32(data, value=0):  # the reader thread is busy inside the member's generator
        if threading.current_thread().name == "viano-admit-read":
            arm()
            time.sleep(0.3)
        return real_crc32(data, value)

    zipscan.zlib.crc32 = slow_crc32
else:
    real_write_out = intake._write_out

    def slow_write_out(fd, view, direct):  # a worker is busy with the output descriptor
        arm()
        time.sleep(0.3)
        return real_write_out(fd, view, direct)

    intake._write_out = slow_write_out

try:
    intake.admit(base / "ws", "c1", src, progress=lambda *a: None)
    raised = None
except BaseException as error:
    raised = type(error).__name__
workers = [t.name for t in threading.enumerate() if t.name.startswith("viano-admit")]
victims = [os.open(base / f"victim{i}", os.O_RDWR | os.O_CREAT, 0o644) for i in range(30)]
time.sleep(1.5)  # a worker still running would now write into one of these
print(json.dumps({"raised": raised, "workers": workers,
                  "victims_written": [v for v in victims if os.fstat(v).st_size],
                  "case": (base / "ws" / "cases" / "c1").exists()}))
"""


@pytest.mark.parametrize("kind", ["directory", "deflated"])
def test_ctrl_c_twice_during_a_large_copy_waits_for_the_ring_and_stays_an_interrupt(tmp_path, kind):
    """A second Ctrl-C while the ring stops used to cut the wait short (on
    Python 3.11 an interrupted Thread.join returns at once the next time):
    the caller closed the output descriptor, or the member's generator, under
    a running worker, which then wrote into whatever file reused the number,
    or failed with "generator already executing". Now the copy waits for its
    workers and raises the interrupt."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    result = subprocess.run([sys.executable, "-c", _DOUBLE_INTERRUPT, kind, str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"raised": "KeyboardInterrupt", "workers": [], "victims_written": [], "case": False}, outcome


def test_one_ring_serves_every_large_file_of_a_package(tmp_path, mode, monkeypatch):
    """The ring's buffers are mapped once per staging, not per file: a package
    of many large files paid for six fresh megabytes (and their page faults)
    per file."""
    rings = []
    real_new_ring = intake.new_ring

    def counted():
        rings.append(real_new_ring())
        return rings[-1]

    monkeypatch.setattr(intake, "new_ring", counted)
    src = _package(tmp_path, _data(2 * MiB + 5))
    datas = {f"original/context/more-{i}.bin": _data(intake.CHUNK + 1 + i * 4096, seed=i) for i in range(4)}
    for rel, data in datas.items():
        (src / rel).write_bytes(data)
    manifest = intake.admit(mode, "c1", src, progress=QUIET)
    assert len(rings) == 1
    for rel, data in datas.items():
        assert manifest["files"][rel]["sha256"] == hashlib.sha256(data).hexdigest()
        assert (mode / "cases" / "c1" / "packages" / PACKAGE_ID / "content" / rel).read_bytes() == data


def test_a_failing_source_read_is_named_as_such(tmp_path, monkeypatch):
    """An I/O error reading the source in the ring is the source's, not the
    staged copy's: IO_ERROR "reading the source failed", nothing left."""
    ws = tmp_path / "ws"
    src = _package(tmp_path, _data(5 * MiB))
    real_readv = os.readv
    calls = {"n": 0}

    def failing_readv(fd, buffers):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_readv(fd, buffers)

    monkeypatch.setattr(intake.os, "readv", failing_readv)
    with pytest.raises(VianoError) as info:
        intake.admit(ws, "c1", src, progress=QUIET)
    monkeypatch.undo()
    assert info.value.code == "IO_ERROR" and "reading the source failed" in str(info.value), str(info.value)
    assert info.value.path == REL
    assert not (ws / "cases" / "c1").exists()


_INTERRUPT_AT_START = r"""
import json, os, signal, sys, tempfile, threading, time
from pipeline import intake

# A Ctrl-C that arrives while the ring starts its workers: the moment at
# which Python would raise it inside the start-up code, before the copy
# could stop and wait for them.
real_start = threading.Thread.start

def start_then_interrupt(thread):
    real_start(thread)
    if thread.name == "viano-admit-read":
        os.kill(os.getpid(), signal.SIGINT)

threading.Thread.start = start_then_interrupt
inside = threading.Event()

def read_into(buffer):
    inside.set()
    try:
        time.sleep(0.2)  # the reader is busy with a buffer when the interrupt comes
        buffer[:4] = b"data"
        return 4
    finally:
        inside.clear()

fd, path = tempfile.mkstemp()
try:
    intake._pipelined_copy_from(read_into, fd, "x", 1 << 40, None, 1 << 40, intake.new_ring())
    outcome = "returned"
except BaseException as error:
    outcome = type(error).__name__
reader_busy = inside.is_set()
handler_restored = signal.getsignal(signal.SIGINT) is signal.default_int_handler
print(json.dumps({"outcome": outcome, "reader_busy_after": reader_busy, "handler_restored": handler_restored}))
"""


def test_a_ctrl_c_while_the_ring_starts_is_raised_only_after_its_workers_stopped():
    """Ctrl-C is deferred while the ring runs (recorded, then raised by the
    copying loop), so it can no longer escape from the code that starts or
    stops the workers and leave one busy with a buffer and the descriptor;
    the standard handler is back afterwards."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    result = subprocess.run([sys.executable, "-c", _INTERRUPT_AT_START], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"outcome": "KeyboardInterrupt", "reader_busy_after": False, "handler_restored": True}, outcome


def test_progress_nobody_reads_does_not_stop_the_admission(tmp_path):
    """A progress stream that fails (a closed pipe: `doit admit ... | true`)
    costs the progress lines, not the admission."""

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    data = _data(3 * MiB)
    src = _package(tmp_path, data)
    progress = intake.StderrProgress(ClosedPipe(), min_size=MiB, step=MiB)
    manifest = intake.admit(tmp_path / "ws", "c1", src, progress=progress)
    _assert_stored(tmp_path / "ws", "c1", manifest, data)

"""Package generations: immutable manifests, verified reads, and the durable PackageWriter.

A package lives at ``cases/<case_id>/packages/<package_id>/`` with
``manifests/NNNNNN.json`` (one immutable manifest per generation; the highest
is current) and ``content/`` (the file tree the manifests describe).

Storage guarantees, and their limits:

* Nothing published is ever rewritten. Every file (content or manifest) is
  written to a temp file in its final directory opened exclusively, flushed
  and fsynced, then published with ``os.link`` -- which fails if the name
  exists, unlike ``os.replace`` -- after which the temp name is unlinked and
  the directory fsynced (RELIABILITY.md 36-40, borg / atomicwrites protocol).
* Generation N+1 exists exactly when ``manifests/N+1`` was linked; two
  writers racing for it cannot both win (the loser gets
  ``GENERATION_CONFLICT``) and no reader ever sees a partial manifest.
* A failed ``fsync`` is reported as ``IO_ERROR`` and never retried (after a
  failed fsync the page cache may already have dropped the dirty pages; a
  second fsync can "succeed" over lost data). Its temp file is removed. If the
  failing fsync is the directory's, after the link, the new name is visible
  but its durability is unknown: the error says so.
* A writer killed mid-way leaves at most a temp file (``.tmp-<pid>-<hex>``),
  removed by :meth:`PackageWriter.cleanup_orphans` at the start of a later
  publish once that pid is gone, and possibly content files that no manifest
  names yet. Those are harmless: a retry with the same bytes adopts them, a
  different writer wanting other bytes at that path gets ``CONTENT_CONFLICT``.
* A workspace package is published under the per-case lock
  (:func:`~pipeline.workspace.case_lock`, re-entrant per process), the same
  lock recovery's roll-forward holds while it removes content no manifest
  lists: no writer is ever between its content and its manifest while that
  runs. Two writers of one generation therefore take turns, and the second
  finds its ``expected_generation`` stale.
* Reads trust only the manifest: a path it does not name is
  ``REFERENCE_MISSING``, bytes whose size or SHA-256 differ are
  ``INTEGRITY_ERROR``, and every open goes through
  :func:`~pipeline.workspace.open_nofollow`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

from .errors import CaseBuildError, IntegrityError, VianoError
from .faults import crashpoint
from .interrupts import InterruptsWhileCopying, despite_interrupts
from .jsoncanon import MAX_SAFE_INTEGER, decode_strict, json_copy, pretty_bytes, read_fd_at_most, sha256_hex
from .workspace import (
    ID_PATTERN,
    Workspace,
    case_lock,
    check_reference,
    makedirs_nofollow,
    open_dir_nofollow,
    open_nofollow,
    refuse_symlinks,
    validate_id,
)

__all__ = [
    "CHUNK_SIZE",
    "MANIFEST_MAX_BYTES",
    "MANIFEST_FORMAT",
    "PUBLISH_LOCK_TIMEOUT",
    "ARTIFACT_KEYS",
    "Package",
    "PackageWriter",
    "StagedFile",
    "write_durable",
    "copy_durable",
    "manifest_name",
    "is_temp_name",
    "check_manifest",
]

CHUNK_SIZE = 1 << 20
MANIFEST_MAX_BYTES = 64 << 20  # a manifest lists paths and hashes only; 64 MiB is ~300k files
MANIFEST_FORMAT = "viano-package"
#: How long PackageWriter.publish waits for the case lock before LOCK_TIMEOUT.
#: Generous: the holder is another command of the same case, doing bounded work.
PUBLISH_LOCK_TIMEOUT = 60.0
ARTIFACT_KEYS = ("case_inputs", "case", "case_summary")

# Six digits, zero-padded; from generation 1,000,000 on, as many as it takes
# (it was invisible there, so the package could never move past 999,999).
_MANIFEST_RE = re.compile(r"(\d{6}|[1-9]\d{6,})\.json")
_TEMP_RE = re.compile(r"\.tmp-(\d+)-[0-9a-f]{16}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_MANIFEST_KEYS = frozenset(
    {"format", "format_version", "case_id", "package_id", "package_generation", "analysis_revision", "project", "artifacts", "files"}
)
_PROJECT_REQUIRED = ("name", "version")
_PROJECT_OPTIONAL = ("repository", "revision")
_NOT_AS_LISTED = "content does not match the manifest's size and SHA-256"

Progress = Callable[[str, int], None]


def manifest_name(generation: int) -> str:
    """File name of a generation's manifest: six digits, ``000001.json``
    (more from generation 1,000,000 on)."""
    return f"{generation:06d}.json"


def is_temp_name(name: str) -> bool:
    """True for names this module uses for temp files (and that cleanup may remove)."""
    return _TEMP_RE.fullmatch(name) is not None


def _temp_name() -> str:
    # The pid lets cleanup tell a dead writer's leftover from a live writer's
    # work in progress; the random part keeps threads of one process apart.
    return f".tmp-{os.getpid()}-{secrets.token_hex(8)}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another thread of ours may be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _io_error(what: str, exc: OSError, path: str | None) -> CaseBuildError:
    return CaseBuildError("IO_ERROR", f"{what} failed: {os.strerror(exc.errno) if exc.errno else exc}", path=path)


# --------------------------------------------------------------------------- hashing


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise _io_error("fsync of a directory", exc, None) from None
    finally:
        os.close(fd)


def _hash_fd(fd: int, progress: Progress | None = None, label: str = "") -> tuple[str, int]:
    """SHA-256 and size of everything readable from ``fd``, in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    while True:
        chunk = os.read(fd, CHUNK_SIZE)
        if not chunk:
            return digest.hexdigest(), size
        digest.update(chunk)
        size += len(chunk)
        if progress is not None:
            progress(label, size)


DIRECT_HASH_MIN = 64 << 20
"""Content at least this large is verified with direct reads when it is not in
the page cache (see :func:`_hash_content`)."""
_DIRECT_CHUNK = 4 << 20
_DIRECT_RING = 4


def _in_page_cache(fd: int, size: int) -> bool:
    """Whether pages spread over the whole file can be read without I/O.

    ``RWF_NOWAIT`` reads only what the page cache holds; probing sixteen
    pages is a cheap stand-in for mincore, which Python lacks. A guess either
    way is only slower, never wrong: both paths hash every byte.
    """
    flag = getattr(os, "RWF_NOWAIT", 0)
    if not flag or not hasattr(os, "preadv"):
        return True  # cannot tell: the plain read path is always correct
    probe = bytearray(4096)
    for offset in [size * k // 16 for k in range(16)] + [max(0, size - 4096)]:
        try:
            if os.preadv(fd, [probe], offset - offset % 4096, flag) <= 0:
                return False
        except BlockingIOError:
            return False
        except OSError:
            return True
    return True


def _open_direct_twin(fd: int) -> int | None:
    """A second descriptor of the very same file, opened for direct reads, or
    None where the filesystem has no direct I/O. Reopened through
    ``/proc/self/fd`` (the open file itself, not its path, which could have
    been replaced meanwhile) and checked to be the same inode."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        twin = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError:
        return None
    first, second = os.fstat(fd), os.fstat(twin)
    if (first.st_dev, first.st_ino) != (second.st_dev, second.st_ino):
        os.close(twin)
        return None
    return twin


def _hash_direct(twin: int, progress: Progress | None, label: str) -> tuple[str, int]:
    """SHA-256 and size read with direct I/O: a thread reads page-aligned
    chunks (DMA from the device, no page-cache pages to fill) while this one
    hashes them, so the hash runs at its own speed instead of waiting for
    each read. On this project's VM, filling page cache in fresh guest memory
    is slow enough that a buffered read of 1 GiB just written by admission
    (which writes with direct I/O too) took 3.2 s against ~1.3 s this way."""
    from .buffers import direct_io_buffers
    import queue
    import threading

    # Huge pages where the kernel gives them: direct reads of 1 GiB into them
    # ran at 2.5-2.7 GB/s here against 1.1-2.2 into small pages.
    buffers = direct_io_buffers(_DIRECT_RING, _DIRECT_CHUNK)
    free: queue.SimpleQueue = queue.SimpleQueue()
    filled: queue.SimpleQueue = queue.SimpleQueue()
    for index in range(_DIRECT_RING):
        free.put(index)
    stop = threading.Event()

    def read() -> None:
        position = 0
        try:
            while not stop.is_set():
                index = free.get()
                if index is None:
                    return
                count = os.readv(twin, [buffers[index]])
                if count == 0:
                    filled.put(None)
                    return
                filled.put((index, count))
                position += count
                if position % 4096:
                    # Only the end of the file gives a read that is not a whole
                    # number of pages, and a direct read from there would start
                    # unaligned, which some filesystems refuse (EINVAL): that
                    # was the end.
                    filled.put(None)
                    return
        except BaseException as exc:  # handed to the hashing thread, which raises it
            filled.put(exc)

    # The reader says when it is done with the buffers and the descriptor
    # (not Thread.join, and Ctrl-C deferred meanwhile: pipeline.interrupts).
    done = threading.Event()

    def run() -> None:
        try:
            read()
        finally:
            done.set()

    def stop_and_wait() -> None:
        stop.set()
        free.put(None)  # wake a reader waiting for a buffer
        done.wait()

    digest = hashlib.sha256()
    size = 0
    with InterruptsWhileCopying(filled.put) as interrupts:
        try:
            try:
                threading.Thread(target=run, name="viano-verify-read", daemon=True).start()
            except RuntimeError:  # no thread: none to wait for
                done.set()
                raise
            while True:
                item = filled.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                index, count = item
                digest.update(memoryview(buffers[index])[:count])
                size += count
                free.put(index)
                if progress is not None:
                    progress(label, size)
        except BaseException:
            despite_interrupts(stop_and_wait)  # the failure that got here is the one raised
            raise
        interrupted = despite_interrupts(stop_and_wait)
    for buffer in buffers:
        buffer.release()  # the last view released unmaps them, 16 MiB the rest of the build does not need
    if interrupted is not None:
        raise interrupted
    interrupts.raise_pending()
    return digest.hexdigest(), size


def _hash_content(fd: int, progress: Progress | None = None, label: str = "") -> tuple[str, int]:
    """:func:`_hash_fd`, with direct reads for large content not in the page cache."""
    size = os.fstat(fd).st_size
    if size < DIRECT_HASH_MIN or _in_page_cache(fd, size):
        return _hash_fd(fd, progress, label)
    twin = _open_direct_twin(fd)
    if twin is None:
        return _hash_fd(fd, progress, label)
    try:
        try:
            return _hash_direct(twin, progress, label)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    finally:
        os.close(twin)
    # EINVAL: a direct read this filesystem refuses (an alignment it wants
    # coarser); start over on the plain path.
    os.lseek(fd, 0, os.SEEK_SET)
    return _hash_fd(fd, progress, label)


def _open_source(source: os.PathLike | str, label: str) -> int:
    """Open a path-valued source for streaming; it must be a regular file, not a symlink."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CaseBuildError("SOURCE_NOT_FOUND", "source file does not exist", path=label) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CaseBuildError("SOURCE_SPECIAL_FILE", "source file is a symlink", path=label) from None
        raise _io_error("opening the source", exc, label) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CaseBuildError("SOURCE_SPECIAL_FILE", "source is not a regular file", path=label)
    return fd


class StagedFile(NamedTuple):
    """A complete private copy in the workspace's staging (an append's), with
    the (sha256, size) its writer hashed while copying it. Published by a
    hard link instead of another copy: a second copy of a large log doubles
    its writes, and written through the page cache it runs at the pace the
    kernel throttles dirty pages to (an append of 400 MB took ~10 s here,
    its admission ~1 s). The staging tree is private to its writer, which
    holds the case lock until it is removed."""

    path: str
    sha256: str
    size: int


def _hash_source(source, label: str, progress: Progress | None = None) -> tuple[str, int]:
    if isinstance(source, StagedFile):
        return source.sha256, source.size
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return hashlib.sha256(data).hexdigest(), len(data)
    fd = _open_source(source, label)
    try:
        return _hash_fd(fd, progress, label)
    finally:
        os.close(fd)


def _hash_existing(dir_fd: int, name: str, label: str) -> tuple[str, int] | None:
    """Hash an existing entry ``name`` in ``dir_fd``; None if it is not a regular file."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None  # a symlink, or it vanished: either way not our identical file
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return _hash_fd(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- durable write


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fill_temp(fd: int, source, label: str, progress: Progress | None) -> tuple[str, int]:
    """Copy ``source`` into ``fd``, hashing each chunk as it passes (one read, one hash)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)  # the very object when it is bytes already
        _write_all(fd, data)
        return sha256_hex(data), len(data)
    src = _open_source(source, label)
    try:
        digest = hashlib.sha256()
        size = 0
        while True:
            chunk = os.read(src, CHUNK_SIZE)
            if not chunk:
                return digest.hexdigest(), size
            digest.update(chunk)
            _write_all(fd, chunk)
            size += len(chunk)
            if progress is not None:
                progress(label, size)
    finally:
        os.close(src)


def _fill_durably(fd: int, source, label: str, progress: Progress | None) -> tuple[str, int]:
    """:func:`_fill_temp`, then fsync: (sha256, size) of what is now on disk."""
    try:
        digest = _fill_temp(fd, source, label, progress)
    except OSError as exc:
        raise _io_error("writing", exc, label) from None
    try:
        os.fsync(fd)
    except OSError as exc:
        raise _io_error("fsync of the new file", exc, label) from None
    return digest


class _NameExists(FileExistsError):
    """The final name existed; carries the (sha256, size) of what we had written, so nobody re-hashes."""

    def __init__(self, digest: tuple[str, int]) -> None:
        super().__init__("name exists")
        self.digest = digest


def _link_new(
    dir_fd: int,
    name: str,
    source,
    *,
    label: str,
    progress: Progress | None = None,
    crash_after_temp: str | None = None,
    crash_after_link: str | None = None,
    rename_without_links: bool = False,
    sync_folder: bool = True,
) -> tuple[str, int]:
    """Publish ``source`` as ``name`` in ``dir_fd`` by temp + fsync + link; return (sha256, size).
    ``sync_folder=False`` leaves the fsync of ``dir_fd`` to the caller.

    Raises :class:`_NameExists` (a ``FileExistsError``; temp already removed)
    when ``name`` exists, so the caller decides what an existing name means. Every other failure is
    ``IO_ERROR`` (or a source error) with the temp removed. With
    ``rename_without_links``, a filesystem that has no hard links (FAT,
    exFAT, many SMB shares) gets the temp renamed into place with
    ``RENAME_NOREPLACE`` instead, which is exclusive the same way.
    """
    if isinstance(source, StagedFile):
        digest = _link_staged(dir_fd, name, source, label=label, crash_after_temp=crash_after_temp,
                              crash_after_link=crash_after_link)
        if digest is not None:
            if sync_folder:
                _fsync_after_publishing(dir_fd, label)
            return digest
        source = source.path  # another filesystem, or no hard links: copied as any file
    temp = _temp_name()
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        raise _io_error("creating a temp file", exc, label) from None
    temp_present = True
    try:
        try:
            digest = _fill_durably(fd, source, label, progress)
        finally:
            os.close(fd)
        if crash_after_temp:
            crashpoint(crash_after_temp)
        try:
            os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            raise _NameExists(digest) from None
        except OSError as exc:
            if not (rename_without_links and exc.errno in _NO_HARD_LINKS):
                raise _io_error("linking the new file into place", exc, label) from None
            try:
                _rename_noreplace(temp, name, dir_fd)
            except FileExistsError:
                raise _NameExists(digest) from None
            except OSError as rename_exc:
                if rename_exc.errno in (errno.EINVAL, errno.ENOSYS):
                    raise CaseBuildError(
                        "IO_ERROR", "this filesystem has neither hard links nor an exclusive rename; "
                        "nothing can be written there without risking an overwrite", path=label,
                    ) from None
                raise _io_error("renaming the new file into place", rename_exc, label) from None
            temp_present = False
        if crash_after_link:
            crashpoint(crash_after_link)
        if temp_present:
            # Published already, under its name, so no failure here may undo
            # or fail the publication: the temp is only a second name of the
            # same complete file. One more try for a passing fault; a temp
            # that stays is removed by cleanup_orphans once this process is gone.
            temp_present = False
            try:
                os.unlink(temp, dir_fd=dir_fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=dir_fd)
        if sync_folder:
            _fsync_after_publishing(dir_fd, label)
        return digest
    finally:
        if temp_present:
            try:
                os.unlink(temp, dir_fd=dir_fd)
            except OSError:
                pass


def _link_staged(
    dir_fd: int, name: str, staged: StagedFile, *, label: str, crash_after_temp: str | None, crash_after_link: str | None
) -> tuple[str, int] | None:
    """Publish ``staged`` as ``name`` by a hard link: the staged file stands
    in for :func:`_link_new`'s temp. Once linked, its staging name goes, so
    no path but the published one reaches it, and its bytes are hashed again
    through the descriptor: the manifest records what the published file
    holds. (The digest taken while staging cannot see a write into the
    staging tree after it, which session 18's reviews made three ways; the
    hash again is a read, ~0.4 s for 400 MB here, where a second copy took
    5-9 s.) None where it cannot be linked (another filesystem, no hard
    links, no ``/proc``): the caller copies it then, hashing what it reads.
    Raises :class:`_NameExists` as :func:`_link_new` does."""
    try:
        fd = os.open(staged.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _io_error("opening the staged file", exc, label) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not os.path.isdir("/proc/self/fd"):
            return None
        if crash_after_temp:
            crashpoint(crash_after_temp)
        if not _link_descriptor(fd, dir_fd, name, (staged.sha256, staged.size), label):
            return None  # another filesystem, no hard links, no usable /proc link
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged.path)  # (a file put in its place is staging's too)
        try:
            digest = _hash_content(fd)
            os.fsync(fd)
        except OSError as exc:
            raise _io_error("reading back the linked file", exc, label) from None
    finally:
        os.close(fd)
    if crash_after_link:
        crashpoint(crash_after_link)
    return digest


def _link_descriptor(fd: int, dir_fd: int, name: str, digest: tuple[str, int], label: str) -> bool:
    """Link the open file ``fd`` as ``name`` in ``dir_fd`` by its
    ``/proc/self/fd`` name, never over an existing one; False where that
    route is closed here (no hard links, another filesystem, no usable
    ``/proc``). Raises :class:`_NameExists` for an existing name."""
    try:
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
    except FileExistsError:
        raise _NameExists(digest) from None
    except OSError as exc:
        if exc.errno in _REAL_LINK_FAILURES:
            raise _io_error("linking the new file into place", exc, label) from None
        return False
    return True


def _link_unnamed(dir_fd: int, name: str, data: bytes, *, label: str) -> tuple[str, int] | None:
    """Publish ``data`` as ``name`` through an unnamed temp file
    (``O_TMPFILE``), fsynced, then linked into place by its ``/proc/self/fd``
    name, which never replaces an existing one: a process killed at any
    moment leaves either nothing or the whole file. For directories outside
    the workspace (export), where no roll-forward would ever remove a named
    temp. None where the kernel, the filesystem or a missing ``/proc``
    cannot do it (or refuse the ``/proc`` link: ENOENT, EXDEV, EACCES, ... on
    some filesystems): the caller then takes the named temp of
    :func:`_link_new`, whose temp a kill can leave behind. Raises
    :class:`_NameExists` as that does."""
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _NO_UNNAMED_FILES:
            return None
        raise _io_error("creating a temp file", exc, label) from None
    try:
        digest = _fill_durably(fd, data, label, None)
        crashpoint("export:before-link")
        if not _link_descriptor(fd, dir_fd, name, digest, label):
            return None  # no hard links, or no usable /proc link here: the named temp does it
    finally:
        os.close(fd)
    _fsync_after_publishing(dir_fd, label)
    return digest


def _fsync_after_publishing(dir_fd: int, label: str) -> None:
    try:
        os.fsync(dir_fd)
    except OSError as exc:
        raise CaseBuildError(
            "IO_ERROR",
            f"fsync of the directory failed after publishing ({os.strerror(exc.errno or 0)}); "
            "the file is visible but may not survive a power loss",
            path=label,
        ) from None


# What link(2) answers when linking would fail by any route (the named temp's too).
_REAL_LINK_FAILURES = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EMLINK, errno.ENAMETOOLONG}

# What open(2) answers for O_TMPFILE where the kernel or the filesystem has no unnamed files.
_NO_UNNAMED_FILES = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL, errno.ENOSYS}

# What link(2) answers where the filesystem has no hard links.
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def _rename_noreplace(source: str, target: str, dir_fd: int) -> None:
    """``renameat2(..., RENAME_NOREPLACE)``: atomic, and never over an existing name."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", target)
    if renameat2(dir_fd, os.fsencode(source), dir_fd, os.fsencode(target), 1) != 0:  # 1 = RENAME_NOREPLACE
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), target)


def _publish_content(
    dir_fd: int,
    name: str,
    source,
    *,
    label: str,
    progress: Progress | None = None,
    rename_without_links: bool = False,
    unnamed_temp: bool = False,
    sync_folder: bool = True,
) -> tuple[str, int]:
    """Create ``name`` exclusively; an existing identical file is accepted, a different one is ``CONTENT_CONFLICT``.
    ``sync_folder=False``: the caller fsyncs ``dir_fd`` after its last file."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        st = None
    if st is not None:
        # Checked before writing so an adopted file (a crashed writer's, or a
        # retry's) costs one hash of the source and no copy.
        mine = _hash_source(source, label, progress)
        if _hash_existing(dir_fd, name, label) != mine:
            raise CaseBuildError("CONTENT_CONFLICT", "the path already exists with different bytes", path=label)
        return mine
    try:
        published = _link_unnamed(dir_fd, name, source, label=label) if unnamed_temp else None
        if published is None:
            published = _link_new(dir_fd, name, source, label=label, progress=progress, rename_without_links=rename_without_links,
                                  sync_folder=sync_folder)
        return published
    except _NameExists as exists:
        # Lost a race for this path to another writer: same bytes are fine.
        mine = exists.digest
        if _hash_existing(dir_fd, name, label) != mine:
            raise CaseBuildError("CONTENT_CONFLICT", "the path already exists with different bytes", path=label) from None
        return mine



#: How many new files of one folder are written side by side at most: a
#: build publishes three (case.json, its summary, case-built.json).
_SIDE_BY_SIDE = 4


def _side_by_side(members) -> bool:
    """Whether a folder's new files are a build's few outputs, held in memory."""
    return 1 < len(members) <= _SIDE_BY_SIDE and all(type(source) is bytes for _, source in members)


def _publish_side_by_side(dir_fd: int, members) -> dict[str, tuple[str, int]]:
    """:func:`_publish_content` for each of a few in-memory files of one
    folder, each in a thread of its own, so that their fsyncs overlap: one
    after the other they cost an append rebuild a journal commit each (~1-2
    ms here). Each file is still fsynced before it is linked, and the folder
    after them all, before any manifest names them. A failure is the first
    member's in order, raised once every thread is done (a file another
    thread linked meanwhile is unpublished content, as one linked before a
    failure always was: adopted or removed by the next attempt)."""
    import threading

    outcomes: list = [None] * len(members)

    def publish(at: int, relpath: str, source: bytes, folder_fd: int) -> None:
        try:
            outcomes[at] = _publish_content(folder_fd, relpath.rpartition("/")[2], source, label=relpath, sync_folder=False)
        except BaseException as error:  # handed to the publishing thread, which raises it
            outcomes[at] = error
        finally:
            if folder_fd != dir_fd:
                os.close(folder_fd)

    started: list = []
    try:
        for at, (relpath, source) in enumerate(members[1:], start=1):
            # Each thread writes through a descriptor of its own: one an
            # exception leaves running (raised into this thread while it
            # started the next) must not write through the caller's, which
            # is closed on the way out and whose number the next open takes
            # (a host program's folder got a case.json so). One whose start
            # was interrupted may or may not run: its descriptor is left to
            # it, never closed twice.
            thread = threading.Thread(target=publish, args=(at, relpath, source, os.dup(dir_fd)), daemon=True)
            started.append(thread)  # before start(), which an interrupt may leave with the thread running
            thread.start()
        publish(0, *members[0], dir_fd)
    finally:
        # Every thread started ends before this returns or raises, Ctrl-C or
        # not; an interrupt met while waiting is raised after.
        interrupted = despite_interrupts(lambda: _join_each(started))
    if interrupted is not None:
        raise interrupted
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return {relpath: outcome for (relpath, _), outcome in zip(members, outcomes)}

def _join_each(threads) -> None:
    """Join every thread whose ``start()`` was called. One whose start was
    interrupted may be on its way to running, or may never run: joining it
    is refused until it has started, so it is waited for a moment first."""
    for thread in threads:
        deadline = time.monotonic() + 1.0
        while True:
            try:
                thread.join()
                break
            except RuntimeError:  # not started (yet)
                if time.monotonic() > deadline:
                    break  # it never ran
                time.sleep(0.001)


def _folders_of(files) -> set[str]:
    """Every folder that holds, at any depth, one of ``files`` (content paths)."""
    folders = set()
    for relpath in files:
        folder = relpath.rpartition("/")[0]
        while folder and folder not in folders:
            folders.add(folder)
            folder = folder.rpartition("/")[0]
    return folders


def _fsync_folder_and_above(content_fd: int, folder: str) -> None:
    """fsync ``folder`` (relative to the content directory) and every folder
    above it, the content directory included."""
    fds = [os.dup(content_fd)]
    try:
        for part in folder.split("/") if folder else []:
            fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
        for fd in reversed(fds):
            _fsync_after_publishing(fd, folder or ".")
    except OSError as exc:
        raise _io_error("opening a folder to fsync it", exc, folder) from None
    finally:
        for fd in fds:
            os.close(fd)


def _single_name(name: str) -> str:
    check_reference(name)
    if "/" in name or is_temp_name(name):
        raise CaseBuildError("REFERENCE_UNSAFE", "expected a single file name", path=name)
    return name


def write_durable(dir_path: Path | str, name: str, data: bytes) -> tuple[str, int]:
    """Create ``dir_path/name`` holding ``data`` durably and exclusively; return (sha256, size).

    Temp in the same directory opened exclusively, fsync, ``os.link`` into
    place, unlink the temp, fsync the directory; the temp is removed on any
    failure. An existing file with identical bytes is accepted; different
    bytes are ``CONTENT_CONFLICT``; fsync failures are ``IO_ERROR``. For a
    destination outside the workspace (export): on a filesystem without hard
    links the temp is renamed into place, never over an existing name.
    """
    dir_fd = os.open(dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _publish_content(
            dir_fd, _single_name(name), bytes(data), label=name, rename_without_links=True, unnamed_temp=True
        )
    finally:
        os.close(dir_fd)


def copy_durable(
    dir_path: Path | str, name: str, source: os.PathLike | str, *, progress: Progress | None = None
) -> tuple[str, int]:
    """Like :func:`write_durable`, streaming a regular file in 1 MiB chunks and hashing as it copies."""
    dir_fd = os.open(dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _publish_content(dir_fd, _single_name(name), source, label=name, progress=progress)
    finally:
        os.close(dir_fd)


# --------------------------------------------------------------------------- manifests


def _problem(doc) -> tuple[str, str] | None:
    """The first structural problem of a viano-package v1 manifest as (pointer, message), or None."""
    if not isinstance(doc, dict):
        return "", "manifest is not an object"
    for key in sorted(doc):
        if key not in _MANIFEST_KEYS:
            return f"/{key}", "unknown field"
    for key in sorted(_MANIFEST_KEYS - {"artifacts"}):
        if key not in doc:
            return "", f"missing field {key!r}"
    if doc["format"] != MANIFEST_FORMAT or doc["format_version"] != 1 or type(doc["format_version"]) is not int:
        return "/format", "not viano-package format_version 1"
    for key in ("case_id", "package_id"):
        value = doc[key]
        if not isinstance(value, str) or ID_PATTERN.fullmatch(value) is None:
            return f"/{key}", "not a safe id"
    if type(doc["package_generation"]) is not int or doc["package_generation"] < 1:
        return "/package_generation", "not a positive integer"
    if type(doc["analysis_revision"]) is not int or doc["analysis_revision"] < 1:
        return "/analysis_revision", "not a positive integer"
    project = doc["project"]
    if not isinstance(project, dict):
        return "/project", "not an object"
    for key in sorted(project):
        if key not in _PROJECT_REQUIRED + _PROJECT_OPTIONAL:
            return f"/project/{key}", "unknown field"
        if not isinstance(project[key], str) or not project[key]:
            return f"/project/{key}", "not a non-empty string"
    for key in _PROJECT_REQUIRED:
        if key not in project:
            return "/project", f"missing field {key!r}"
    files = doc["files"]
    if not isinstance(files, dict):
        return "/files", "not an object"
    for path in sorted(files):
        pointer = "/files/" + path.replace("~", "~0").replace("/", "~1")
        try:
            check_reference(path)
        except VianoError:
            return pointer, "unsafe content path"
        entry = files[path]
        if not isinstance(entry, dict) or set(entry) != {"sha256", "size"}:
            return pointer, "entry must have exactly sha256 and size"
        if not isinstance(entry["sha256"], str) or _SHA256_RE.fullmatch(entry["sha256"]) is None:
            return pointer + "/sha256", "not a lower-case SHA-256 hex digest"
        if type(entry["size"]) is not int or entry["size"] < 0:
            return pointer + "/size", "not a non-negative integer"
    artifacts = doc.get("artifacts", {})
    if not isinstance(artifacts, dict):
        return "/artifacts", "not an object"
    for key in sorted(artifacts):
        if key not in ARTIFACT_KEYS:
            return f"/artifacts/{key}", "unknown artifact"
        if not isinstance(artifacts[key], str) or artifacts[key] not in files:
            return f"/artifacts/{key}", "artifact pointer names no file of the manifest"
    return None


def _schema_check(doc: dict, label: str) -> None:
    """Validate against contracts' package-manifest schema, when contracts/ provides it.

    The msgspec Struct (held in parity with the schema by tests) accepts a
    valid manifest quickly; jsonschema runs only to explain a refusal.
    """
    try:
        import msgspec

        import contracts  # lazily: contracts/ is optional for this module's own checks
        from contracts.structs import STRUCTS
    except ImportError:
        return
    try:
        msgspec.convert(doc, STRUCTS["package-manifest"])
        return
    except (msgspec.ValidationError, KeyError):
        pass
    validate = getattr(contracts, "validate", None)
    if validate is None:
        return
    try:
        validate("package-manifest", doc, path=label)
    except KeyError:
        return  # that schema is not registered (yet); the structural check stands
    except VianoError as exc:
        if exc.code in ("SCHEMA_VIOLATION", "UNSUPPORTED_VERSION"):
            raise IntegrityError(
                "INTEGRITY_ERROR", f"stored manifest violates its contract: {exc.message}", path=label, pointer=exc.pointer
            ) from None
        raise


def _decode_manifest_fast(data: bytes) -> dict | None:
    """The manifest if the reader's fast path vouches for it (strict JSON and
    the package-manifest Struct, see pipeline/reader.py), else None, and the
    slow path names the exact problem. Every build loads every generation's
    manifest, so this is on the rebuild's critical path."""
    try:
        from .reader import read_fast
    except ImportError:  # pragma: no cover - contracts/ absent
        return None
    return read_fast(data, "package-manifest", MANIFEST_MAX_BYTES)


def outline_of(manifest: dict) -> dict:
    """The part of a checked manifest planning reads of an earlier
    generation: whose it is, its revision and its artifact pointers."""
    return {
        "package_generation": manifest["package_generation"],
        "case_id": manifest["case_id"],
        "package_id": manifest["package_id"],
        "analysis_revision": manifest["analysis_revision"],
        "artifacts": dict(manifest.get("artifacts", {})),
    }


def _checked_manifest(data: bytes, label: str) -> dict:
    """A stored manifest's bytes, strictly decoded and checked; else ``INTEGRITY_ERROR``."""
    doc = _decode_manifest_fast(data)
    if doc is None:
        try:
            doc = decode_strict(data, max_bytes=MANIFEST_MAX_BYTES, path=label, error=IntegrityError)
        except VianoError as exc:
            raise IntegrityError(
                "INTEGRITY_ERROR", f"stored manifest is corrupt or truncated ({exc.code}: {exc.message})", path=label,
                pointer=exc.pointer,
            ) from None
        check_manifest(doc, label=label)
        _schema_check(doc, label)
    else:
        check_manifest(doc, label=label)
    return doc


def check_manifest(doc, *, label: str = "manifest", code: str = "INTEGRITY_ERROR") -> dict:
    """Return ``doc`` if it is a structurally valid viano-package v1 manifest, else raise ``code``."""
    found = _problem(doc)
    if found is not None:
        pointer, message = found
        cls = IntegrityError if code == "INTEGRITY_ERROR" else CaseBuildError
        raise cls(code, f"manifest is invalid: {message}", path=label, pointer=pointer)
    return doc


class Package:
    """Read access to one package: its generations, manifests and verified content.

    Manifests are immutable once linked, so parsed ones are cached per
    instance; callers get deep copies and cannot disturb the cache.
    """

    def __init__(self, workspace: Workspace, case_id: str, package_id: str, *, parsed_manifests=None) -> None:
        """``parsed_manifests`` (optional) keeps checked manifests between
        processes, under the sha256 of their bytes: ``get(sha256) -> dict |
        None`` and ``put(sha256, dict, published=bool)``
        (:class:`pipeline.cache.ParsedManifests`).
        Planning loads every generation's manifest, and checking each one
        again (strict decode, contract, every entry) costs milliseconds per
        generation, more with every append and reopen of a long-lived case."""
        self.workspace = workspace
        self.case_id = validate_id(case_id, "case id")
        self.package_id = validate_id(package_id, "package id")
        self.dir = workspace.package_dir(case_id, package_id)
        below = f"cases/{self.case_id}/packages/{self.package_id}"
        refuse_symlinks(workspace, f"{below}/content", f"{below}/manifests")
        self._cache: dict[int, dict] = {}
        self._outlines: dict[int, dict] = {}
        self._digests: dict[int, str] = {}
        self._parsed = parsed_manifests

    @classmethod
    def at(cls, directory: Path | str, case_id: str, package_id: str) -> "Package":
        """A package rooted at an explicit directory (e.g. an admission staging tree)."""
        pkg = cls.__new__(cls)
        pkg.workspace = None
        pkg.case_id = validate_id(case_id, "case id")
        pkg.package_id = validate_id(package_id, "package id")
        pkg.dir = Path(os.path.abspath(os.fspath(directory)))
        pkg._cache = {}
        pkg._outlines = {}
        pkg._digests = {}
        pkg._parsed = None
        return pkg

    @property
    def manifests_dir(self) -> Path:
        return self.dir / "manifests"

    @property
    def content_dir(self) -> Path:
        return self.dir / "content"

    def current_generation(self) -> int:
        """The highest manifest generation, 0 if there is none; a gap is ``INTEGRITY_ERROR``."""
        try:
            names = os.listdir(self.manifests_dir)
        except FileNotFoundError:
            return 0
        numbers = sorted(int(m.group(1)) for m in map(_MANIFEST_RE.fullmatch, names) if m)
        if numbers != list(range(1, len(numbers) + 1)):
            raise IntegrityError(
                "INTEGRITY_ERROR", f"manifest generations are not contiguous from 1: {numbers[:10]}", path="manifests"
            )
        return len(numbers)

    def manifest(self, generation: int | None = None, *, copy: bool = True) -> dict:
        """The manifest of ``generation`` (default: current), strictly decoded and checked.

        Absent -> ``MANIFEST_MISSING``; truncated, corrupt, or not matching its
        own file name and package -> ``INTEGRITY_ERROR`` (never a silent reset
        to an older generation).

        ``copy=False`` gives the object this Package keeps, for a caller that
        only reads it (planning reads every generation's, ~115 KB each at the
        default limits, on every build that plans).
        """
        if generation is None:
            generation = self.current_generation()
        if type(generation) is not int or generation < 1:
            raise CaseBuildError("MANIFEST_MISSING", f"package {self.package_id} has no generation {generation}")
        cached = self._cache.get(generation)
        if cached is None:
            cached = self._load(generation)
            self._cache[generation] = cached
        return json_copy(cached) if copy else cached

    def manifest_outline(self, generation: int) -> dict:
        """What planning takes from an earlier generation's manifest
        (:func:`outline_of`), checked as :meth:`manifest` checks it, without
        keeping its file entries: planning looks at every generation, and a
        case of 300 reopen/append/build cycles (900 manifests of ~1,800
        entries each) held 400 MB of them; ``MemoryError`` under a cap."""
        kept = self._cache.get(generation)
        if kept is not None:
            return outline_of(kept)
        outline = self._outlines.get(generation)
        if outline is None:
            if type(generation) is not int or generation < 1:
                raise CaseBuildError("MANIFEST_MISSING", f"package {self.package_id} has no generation {generation}")
            label = f"manifests/{manifest_name(generation)}"
            data = self._manifest_bytes(generation)
            digest = hashlib.sha256(data).hexdigest()
            outline = self._parsed.get_outline(digest) if self._parsed is not None else None
            if outline is None:
                doc = self._parsed.get(digest) if self._parsed is not None else None
                outline = outline_of(doc if doc is not None else _checked_manifest(data, label))
                if self._parsed is not None:
                    self._parsed.put_outline(digest, outline)
            self._check_belongs(outline, generation, label)
            self._outlines[generation] = outline
            self._digests[generation] = digest
        return outline

    def manifest_sha256(self, generation: int) -> str:
        """The SHA-256 of ``generation``'s manifest bytes, as they are
        (neither decoded nor checked: a no-op build compares it with the
        store's record without importing the decoder)."""
        digest = self._digests.get(generation)
        if digest is None:
            digest = self._digests[generation] = hashlib.sha256(self._manifest_bytes(generation)).hexdigest()
        return digest

    def _manifest_bytes(self, generation: int) -> bytes:
        name = manifest_name(generation)
        label = f"manifests/{name}"
        try:
            fd = open_nofollow(self.manifests_dir, name)
        except VianoError as exc:
            if exc.code == "REFERENCE_MISSING":
                raise CaseBuildError("MANIFEST_MISSING", f"package has no generation {generation}", path=label) from None
            raise IntegrityError("INTEGRITY_ERROR", f"manifest is not a plain file: {exc.message}", path=label) from None
        try:
            # A directory in a manifest's place opens, and its read said only
            # "IO_ERROR: Is a directory", naming nothing.
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise IntegrityError("INTEGRITY_ERROR", "manifest is not a plain file", path=label)
            return read_fd_at_most(fd, MANIFEST_MAX_BYTES, label=label, error=IntegrityError, code="INTEGRITY_ERROR")
        finally:
            os.close(fd)

    def _load(self, generation: int) -> dict:
        label = f"manifests/{manifest_name(generation)}"
        data = self._manifest_bytes(generation)
        digest = hashlib.sha256(data).hexdigest()
        doc = self._parsed.get(digest) if self._parsed is not None else None
        if doc is None:
            doc = _checked_manifest(data, label)
            if self._parsed is not None:
                self._parsed.put(digest, doc)
        self._check_belongs(doc, generation, label)
        self._digests[generation] = digest
        return doc

    def _check_belongs(self, doc: dict, generation: int, label: str) -> None:
        mismatch = [
            key
            for key, want in (("package_generation", generation), ("case_id", self.case_id), ("package_id", self.package_id))
            if doc[key] != want
        ]
        if mismatch:
            raise IntegrityError("INTEGRITY_ERROR", f"manifest does not belong here: {', '.join(mismatch)} differ", path=label)

    def _entry(self, relpath: str, manifest: dict | None) -> tuple[dict, dict]:
        check_reference(relpath)
        manifest = manifest if manifest is not None else self.manifest()
        entry = manifest["files"].get(relpath)
        if entry is None:
            raise CaseBuildError("REFERENCE_MISSING", "the manifest does not list this path", path=relpath)
        return manifest, entry

    def refuse_missing_listed_files(self, manifest: dict) -> None:
        """``INTEGRITY_ERROR`` naming the first file ``manifest`` lists (in
        path order) that the content no longer holds as a regular file of its
        size. One ``lstat`` a file, no reading: for the commands that publish a
        generation without reading earlier files (reopen, append), which went
        on publishing over a package a copy taken while a command ran had left
        without them, carrying the damage forward (session 24's re-review).
        A folder on the way that is a symlink is ``REFERENCE_UNSAFE``, as
        reading the file through it is (``lstat`` follows all but the last
        part: a linked ``case/`` let a reopen publish over it)."""
        plain_folders: set[str] = set()
        for relpath in sorted(manifest["files"]):
            folder = relpath.rpartition("/")[0]
            while folder and folder not in plain_folders:
                try:
                    linked = stat.S_ISLNK(os.lstat(os.path.join(self.content_dir, folder)).st_mode)
                except OSError:
                    break  # gone or unreadable: the file's own lstat below says so
                if linked:
                    raise CaseBuildError("REFERENCE_UNSAFE", "reference crosses a symlink", path=relpath)
                plain_folders.add(folder)
                folder = folder.rpartition("/")[0]
            try:
                st = os.lstat(os.path.join(self.content_dir, relpath))
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != manifest["files"][relpath]["size"]:
                raise IntegrityError(
                    "INTEGRITY_ERROR", "the manifest lists this file but the package content no longer holds it (or not "
                    "at its size): the workspace was changed outside the builder, or copied while a command ran; restore "
                    "it from a copy taken while no command ran; nothing was published", path=relpath,
                )

    def _open_listed(self, relpath: str) -> int:
        """:meth:`_open_content` of a file a manifest lists: one that is gone
        is the workspace's damage, not a reference of the package's (it was
        ``REFERENCE_MISSING``, which sent the user to their index: a
        workspace archived by a CI cache while a build published, found by
        session 24's review)."""
        try:
            return self._open_content(relpath)
        except VianoError as error:
            if error.code != "REFERENCE_MISSING":
                raise
            raise IntegrityError(
                "INTEGRITY_ERROR", "the manifest lists this file but the package content no longer holds it: the "
                "workspace was changed outside the builder, or copied while a command ran; restore it from a copy "
                "taken while no command ran", path=relpath,
            ) from None

    def _open_content(self, relpath: str) -> int:
        fd = open_nofollow(self.content_dir, relpath)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CaseBuildError("REFERENCE_UNSAFE", "content path is not a regular file", path=relpath)
        return fd

    def open_problem(self, relpath: str, size: int) -> VianoError | None:
        """The error reading the listed ``relpath`` (:meth:`read_verified`,
        :meth:`verify_file`) raises before it hashes a byte: gone, a symlink
        on the way, not a regular file, not ``size`` bytes; or None. It opens
        and fstats only, so ``doit status`` can name the refusal a build's
        step would give without reading (it said "would run", the build
        failed)."""
        try:
            fd = self._open_listed(relpath)
        except VianoError as error:
            return error
        except OSError:
            return None  # not foreseen: the step itself says what it is
        try:
            if os.fstat(fd).st_size != size:
                return IntegrityError("INTEGRITY_ERROR", _NOT_AS_LISTED, path=relpath)
        finally:
            os.close(fd)
        return None

    def read_verified(self, relpath: str, limit: int, *, manifest: dict | None = None) -> bytes:
        """The bytes of ``relpath`` if the manifest lists it and they match its size and SHA-256.

        Not listed -> ``REFERENCE_MISSING``; listed size over ``limit`` ->
        ``LIMIT_EXCEEDED`` before reading; listed but gone ->
        ``INTEGRITY_ERROR``; a symlink on the way ->
        ``REFERENCE_UNSAFE``; different bytes -> ``INTEGRITY_ERROR``. No
        case-insensitive or normalising fallback.
        """
        _, entry = self._entry(relpath, manifest)
        if entry["size"] > limit:
            raise CaseBuildError("LIMIT_EXCEEDED", f"{entry['size']} bytes, limit {limit}", path=relpath)
        fd = self._open_listed(relpath)
        try:
            data = read_fd_at_most(fd, entry["size"], label=relpath, error=IntegrityError, code="INTEGRITY_ERROR")
        except IntegrityError:
            data = None  # grown past its recorded size: the same damage as any other change, said the same way
        finally:
            os.close(fd)
        if data is None or len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise IntegrityError("INTEGRITY_ERROR", _NOT_AS_LISTED, path=relpath)
        return data

    def holds(self, relpath: str, size: int, sha256: str) -> bool:
        """Whether ``relpath`` is still a regular file of exactly ``size``
        bytes with this SHA-256. A yes-or-no look that raises nothing: a
        missing, unsafe, unreadable or changed file is "no", and the caller
        takes the path that names the problem (reading with
        :meth:`read_verified`)."""
        try:
            fd = self._open_content(relpath)
        except (OSError, VianoError):
            return False
        try:
            if os.fstat(fd).st_size != size:
                return False
            with open(fd, "rb", closefd=False) as handle:
                return hashlib.file_digest(handle, "sha256").hexdigest() == sha256
        except OSError:
            return False
        finally:
            os.close(fd)

    def verify_file(self, relpath: str, *, manifest: dict | None = None, progress: Progress | None = None) -> tuple[str, int]:
        """Stream ``relpath`` in 1 MiB chunks and return its (sha256, size) if they match the manifest."""
        _, entry = self._entry(relpath, manifest)
        fd = self._open_listed(relpath)
        try:
            found = _hash_content(fd, progress, relpath)
        finally:
            os.close(fd)
        if found != (entry["sha256"], entry["size"]):
            raise IntegrityError("INTEGRITY_ERROR", _NOT_AS_LISTED, path=relpath)
        return found


# --------------------------------------------------------------------------- writer


class PackageWriter:
    """Publishes new content plus manifest N+1 for one package (see the module docstring)."""

    def __init__(self, package: Package) -> None:
        self.package = package

    def cleanup_orphans(self) -> list[str]:
        """Remove temp files left by writers that died; return their package-relative paths.

        A temp is an orphan when the pid in its name is no longer running. A
        live writer's temp is never touched (pid reuse can at worst keep an
        orphan a little longer, never delete live work).
        """
        removed = []
        for top in (self.package.manifests_dir, self.package.content_dir):
            for dirpath, _dirs, names in os.walk(top):
                for name in names:
                    m = _TEMP_RE.fullmatch(name)
                    if m and not _pid_alive(int(m.group(1))):
                        try:
                            os.unlink(os.path.join(dirpath, name))
                        except FileNotFoundError:
                            continue  # another cleaner got there first
                        removed.append(os.path.relpath(os.path.join(dirpath, name), self.package.dir))
        return sorted(removed)

    def publish(
        self,
        expected_generation: int,
        files: Mapping[str, "bytes | os.PathLike[str] | StagedFile"],
        *,
        artifacts: Mapping[str, str | None] | None = None,
        analysis_revision: int | None = None,
        project: Mapping[str, str] | None = None,
        accept_identical: bool = False,
        progress: Progress | None = None,
        lock_timeout: float = PUBLISH_LOCK_TIMEOUT,
    ) -> dict:
        """Publish ``files`` and manifest ``expected_generation + 1``; return the new manifest.

        The whole publication runs under ``case_lock(package.workspace,
        package.case_id)`` when the package belongs to a workspace (a
        ``Package.at`` staging package has no workspace and takes no lock).
        Recovery's roll-forward removes content no manifest lists, under that
        lock, so a writer between linking its content and linking its manifest
        must hold it too. The lock is re-entrant per process, so callers that
        already hold it (commands, ``build.hold_case_lock``) just go on. Not
        getting it within ``lock_timeout`` seconds is ``LOCK_TIMEOUT``, with
        nothing written. Racing writers therefore take turns; the later one
        finds its ``expected_generation`` stale (``GENERATION_CONFLICT``).

        ``expected_generation`` must be the current generation, else
        ``GENERATION_CONFLICT`` before anything is written. Generation 1 is
        created with ``expected_generation=0``, which also needs ``project``
        and ``analysis_revision``. ``artifacts`` updates the pointers (``None``
        removes one); each must name a file of the new manifest.
        ``analysis_revision`` never decreases.

        If another writer already published ``expected_generation + 1`` the
        result is ``GENERATION_CONFLICT`` naming the current generation --
        unless ``accept_identical`` is true and that generation is exactly the
        manifest this call would have written (the retry of a publish whose
        writer died after the link): then it is returned and nothing is written.
        """
        if self.package.workspace is None:
            return self._publish(expected_generation, files, artifacts, analysis_revision, project, accept_identical, progress)
        with case_lock(self.package.workspace, self.package.case_id, timeout=lock_timeout):
            return self._publish(expected_generation, files, artifacts, analysis_revision, project, accept_identical, progress)

    def _publish(self, expected_generation, files, artifacts, analysis_revision, project, accept_identical, progress) -> dict:
        pkg = self.package
        if type(expected_generation) is not int or expected_generation < 0:
            raise CaseBuildError("INVALID_ARGUMENT", f"expected_generation must be an integer >= 0, not {expected_generation!r}")
        entries = sorted(files.items())
        for relpath, source in entries:
            check_reference(relpath)
            if any(is_temp_name(part) for part in relpath.split("/")):
                raise CaseBuildError("REFERENCE_UNSAFE", "content names of the form .tmp-<pid>-<hex> are reserved", path=relpath)
            if not isinstance(source, (bytes, bytearray, memoryview, os.PathLike, str, StagedFile)):
                raise CaseBuildError("INVALID_ARGUMENT", "a file must be bytes, a path or a staged file", path=relpath)
        if expected_generation == 0:
            pkg.manifests_dir.mkdir(parents=True, exist_ok=True)
            pkg.content_dir.mkdir(parents=True, exist_ok=True)
            # New directory entries must survive a power cut before a manifest names them.
            for directory in (pkg.dir, pkg.dir.parent, pkg.dir.parent.parent):
                _fsync_dir(directory)
        elif project is not None:
            raise CaseBuildError("INVALID_ARGUMENT", "project is set at generation 1 only and carried over after")

        self.cleanup_orphans()
        current = pkg.current_generation()
        if current != expected_generation:
            return self._conflict(expected_generation, current, entries, artifacts, analysis_revision, project, accept_identical)
        base = self._base(expected_generation, analysis_revision, project)
        if analysis_revision is not None and analysis_revision < base["analysis_revision"]:
            raise CaseBuildError("INVALID_ARGUMENT", "analysis_revision cannot decrease")
        if analysis_revision is not None and analysis_revision > MAX_SAFE_INTEGER:
            raise CaseBuildError("INVALID_ARGUMENT", "analysis_revision cannot exceed 2^53 - 1, which no manifest reader takes")

        hashes = self._write_content(base, entries, progress)
        crashpoint("publish:after-content")
        manifest = self._next_manifest(base, hashes, artifacts, analysis_revision)
        data = pretty_bytes(manifest)
        name = manifest_name(manifest["package_generation"])
        dir_fd = open_dir_nofollow(pkg.manifests_dir)
        try:
            _link_new(
                dir_fd,
                name,
                data,
                label=f"manifests/{name}",
                crash_after_temp="publish:after-manifest-temp",
                crash_after_link="publish:after-manifest-link",
            )
        except FileExistsError:
            existing = self._identical_or_none(expected_generation + 1, manifest)
            if accept_identical and existing is not None:
                return existing
            raise CaseBuildError(
                "GENERATION_CONFLICT",
                f"another writer published generation {expected_generation + 1} first"
                + (" (with identical content)" if existing is not None else ""),
                path=f"manifests/{name}",
            ) from None
        finally:
            os.close(dir_fd)
        digest = hashlib.sha256(data).hexdigest()
        pkg._cache[manifest["package_generation"]] = json_copy(manifest)
        pkg._digests[manifest["package_generation"]] = digest
        if pkg._parsed is not None:
            # These very bytes were just built from this dict: the next
            # process that plans need not decode and check them again.
            pkg._parsed.put(digest, manifest, published=True)
        return manifest

    # -- helpers

    def _base(self, generation: int, analysis_revision: int | None, project) -> dict:
        if generation:
            # Read only: _next_manifest copies it before it changes anything.
            return self.package.manifest(generation, copy=False)
        if project is None or analysis_revision is None:
            raise CaseBuildError("INVALID_ARGUMENT", "generation 1 needs project and analysis_revision")
        return {
            "format": MANIFEST_FORMAT,
            "format_version": 1,
            "case_id": self.package.case_id,
            "package_id": self.package.package_id,
            "package_generation": 0,
            "analysis_revision": analysis_revision,
            "project": dict(project),
            "artifacts": {},
            "files": {},
        }

    def _write_content(self, base: dict, entries, progress: Progress | None) -> dict[str, tuple[str, int]]:
        """Create every new content file exclusively; return path -> (sha256, size)."""
        hashes: dict[str, tuple[str, int]] = {}
        adopted: list[str] = []
        # Phase 1, before writing anything: every path that already exists
        # (published, or left by a crashed writer) must hold identical bytes,
        # so a conflict leaves the package exactly as it was.
        for relpath, source in entries:
            known = base["files"].get(relpath)
            if known is not None:
                existing = (known["sha256"], known["size"])
            else:
                existing = self._existing_hash(relpath)
                if existing is None:
                    continue
                adopted.append(relpath)
            mine = _hash_source(source, relpath, progress)
            if mine != existing:
                raise CaseBuildError("CONTENT_CONFLICT", "the path already exists with different bytes", path=relpath)
            hashes[relpath] = mine
        # Phase 2: create the new files exclusively, a folder at a time (the
        # entries are sorted, so a folder's files come together): each file
        # is fsynced before it is linked, and the folder once after its last
        # link, before any manifest can name them (a build publishes three
        # files into one new folder).
        content_fd = open_dir_nofollow(self.package.content_dir)
        try:
            folders: dict[str, list[tuple[str, object]]] = {}
            for relpath, source in entries:
                if relpath not in hashes:
                    folders.setdefault(relpath.rpartition("/")[0], []).append((relpath, source))
            # Folders an earlier, failed attempt left (made, or holding the
            # files it linked) may never have been made durable: each is
            # fsynced with every folder above it before a manifest names them.
            unsure = {relpath.rpartition("/")[0] for relpath in adopted}
            known_folders = None
            for parent, members in folders.items():
                try:
                    if parent:
                        dir_fd, created_in = makedirs_nofollow(content_fd, parent)
                    else:
                        dir_fd, created_in = os.dup(content_fd), []
                except OSError as exc:
                    raise _io_error("making the folder", exc, parent or ".") from None
                try:
                    for fd in created_in:  # the new directory entries, before anything is linked in them
                        try:
                            os.fsync(fd)
                        except OSError as exc:
                            raise _io_error("fsync of a new directory's parent", exc, members[0][0]) from None
                    # The folders on the way that were there already (the
                    # ones made now are the path's last ones): the deepest,
                    # if no manifest names anything in it, was made by a
                    # failed attempt, and so may every folder above it.
                    parts = parent.split("/") if parent else []
                    if len(parts) > len(created_in):
                        deepest = "/".join(parts[: len(parts) - len(created_in)])
                        if known_folders is None:
                            known_folders = _folders_of(base["files"])
                        if deepest not in known_folders:
                            unsure.add(deepest)
                    if _side_by_side(members):
                        hashes.update(_publish_side_by_side(dir_fd, members))
                    else:
                        for relpath, source in members:
                            name = relpath.rpartition("/")[2]
                            hashes[relpath] = _publish_content(dir_fd, name, source, label=relpath, progress=progress, sync_folder=False)
                    _fsync_after_publishing(dir_fd, members[-1][0])
                finally:
                    os.close(dir_fd)
                    for fd in created_in:
                        os.close(fd)
            for folder in sorted(unsure):
                _fsync_folder_and_above(content_fd, folder)
        finally:
            os.close(content_fd)
        return hashes

    def _existing_hash(self, relpath: str) -> tuple[str, int] | None:
        """(sha256, size) of a content file no manifest names yet, None if absent."""
        try:
            fd = open_nofollow(self.package.content_dir, relpath)
        except VianoError as exc:
            if exc.code == "REFERENCE_MISSING":
                return None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CaseBuildError("CONTENT_CONFLICT", "the path already exists and is not a file", path=relpath)
            return _hash_fd(fd)
        finally:
            os.close(fd)

    def _next_manifest(self, base: dict, hashes, artifacts, analysis_revision) -> dict:
        manifest = json_copy(base)
        manifest["package_generation"] = base["package_generation"] + 1
        if analysis_revision is not None:
            manifest["analysis_revision"] = analysis_revision
        for relpath, (sha, size) in hashes.items():
            manifest["files"][relpath] = {"sha256": sha, "size": size}
        pointers = dict(manifest.get("artifacts", {}))
        for key, value in (artifacts or {}).items():
            if key not in ARTIFACT_KEYS:
                raise CaseBuildError("INVALID_ARGUMENT", f"unknown artifact {key!r}")
            if value is None:
                pointers.pop(key, None)
            elif value not in manifest["files"]:
                raise CaseBuildError("REFERENCE_MISSING", f"artifact {key} names no file of the package", path=str(value))
            else:
                pointers[key] = value
        manifest["artifacts"] = pointers
        return check_manifest(manifest, label="new manifest", code="MANIFEST_INVALID")

    def _identical_or_none(self, generation: int, candidate: dict) -> dict | None:
        try:
            existing = self.package.manifest(generation)
        except VianoError:
            return None
        return existing if existing == candidate else None

    def _conflict(self, expected, current, entries, artifacts, analysis_revision, project, accept_identical) -> dict:
        """``expected`` is not current: adopt an identical ``expected + 1`` if asked, else refuse."""
        if accept_identical and 0 <= expected < current:
            try:
                base = self._base(expected, analysis_revision, project)
                hashes = {path: _hash_source(src, path) for path, src in entries}
                for path, mine in hashes.items():
                    known = base["files"].get(path)
                    if known is not None and mine != (known["sha256"], known["size"]):
                        hashes = None
                        break
                if hashes is not None:
                    candidate = self._next_manifest(base, hashes, artifacts, analysis_revision)
                    existing = self._identical_or_none(expected + 1, candidate)
                    if existing is not None:
                        return existing
            except VianoError:
                pass  # cannot be identical; report the conflict itself
        raise CaseBuildError(
            "GENERATION_CONFLICT",
            f"expected generation {expected} but the package is at generation {current}",
            path="manifests",
        )

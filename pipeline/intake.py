"""Admission of bug packages (ZIP or directory) as new cases, and append sources.

:func:`admit` turns a package source into ``cases/<case_id>/packages/<package_id>/``
with ``manifests/000001.json`` and ``content/``, then records the case in the
CheckpointStore. It is all-or-nothing:

* Everything that can be decided from the source alone is decided before the
  workspace is touched: ids, the whole ZIP structure (:mod:`pipeline.zipscan`)
  or directory walk, ``manifest.json`` (strict JSON + ``package-source``
  contract), reserved paths, files the manifest names, free disk.
* Content is then streamed in 1 MiB chunks into a private staging tree under
  ``<workspace>/.staging/``; each file is hashed while it is copied (hashing
  overlaps reading and writing on other threads; ``hashlib``, ``os.readv``
  and ``os.write`` release the GIL), so every byte is read once. Large files
  of a directory source are written with direct I/O where the filesystem
  supports it (not tmpfs). CRC and length checks of ZIP members
  happen during this copy; a failure removes the staging tree.
* The staged tree carries a marker file ``cases/<case_id>/.admission-pending``
  (:data:`ADMISSION_MARKER`, beside ``packages/``, so never content). It is
  made durable (per-file ``fsync``, or one ``syncfs`` for many small files),
  then -- under the case lock -- renamed into ``cases/<case_id>`` in one step,
  and the CheckpointStore row is inserted. **The store row is the commit
  point.** Only then is the marker removed (and the directory fsynced).
* A crashed admission is recognised *positively*: a case directory with no
  store row is removed by the next admission of that id (under the lock, by
  renaming it into ``.staging`` first, so a crash mid-removal leaves nothing in
  ``cases/``) only when it holds the marker and exactly the tree an admission
  writes (one package, only ``manifests/000001.json``). Any other case
  directory without a store row -- the store was deleted, ``cases/`` was
  copied into a new workspace, a case was built before its marker could be
  cleared -- is refused with ``CASE_EXISTS`` and never touched: published
  files stay byte-identical forever. A marker left in a committed case (a
  crash between the store commit and its removal) is harmless and is removed
  by the next admission attempt of that id, or by
  :func:`clear_admission_marker`. Staging trees whose writer process is gone
  are removed as well.

A rejected source leaves the workspace byte-identical: staging trees, the
``.staging`` directory and a workspace root created by this call are removed.

:func:`read_append_source` applies the same hostile-source checks to a
``doit append`` source and stages its files for the PackageWriter.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import os
import secrets
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from .buffers import HUGE_PAGE, direct_io_buffers
from .interrupts import InterruptsWhileCopying, despite_interrupts
from .errors import AdmissionError, VianoError, coded_io_error, one_line
from .faults import crashpoint
from .jsoncanon import pretty_bytes, read_fd_at_most
from .lifecycle import CheckpointStore
from .packages import _pid_alive
from .workspace import (
    ADMISSION_MARKER,
    STAGING_OWNER_SUFFIX,
    STAGING_TREE_RE,
    Workspace,
    case_lock,
    check_reference,
    validate_id,
)
from .zipscan import CHUNK, MiB, NameRegistry, ZipArchive, ZipLimits, fold_name, name_problem

__all__ = [
    "ZipLimits",
    "SOURCE_MANIFEST",
    "APPEND_INDEX",
    "RESERVED_PREFIXES",
    "Progress",
    "StderrProgress",
    "AppendSource",
    "ADMISSION_MARKER",
    "admit",
    "clear_admission_marker",
    "read_append_source",
    "remove_stale_staging",
]

SOURCE_MANIFEST = "manifest.json"
APPEND_INDEX = "case-inputs.json"
RESERVED_PREFIXES = ("case", "inputs")
"""First path parts the package writer owns (``case/revisions/...``,
``inputs/<generation>/case-inputs.json``); compared after NFC + case folding
so ``Case/x`` cannot stand in for them on a case-insensitive filesystem."""

Progress = Callable[[str, int, int], None]
"""``progress(path, bytes_done, file_size)``, called after each chunk copied."""

"""File in ``cases/<case_id>/`` (outside ``packages/``) present until the store row is committed."""

_MANIFEST_GENERATION_1 = "000001.json"
_MARKER_BYTES = b"viano admission pending; the case is committed only once the CheckpointStore has its row\n"
_MARKER_LIMIT = 4096
_SYNCFS_MIN_FILES = 8  # above this many files one syncfs beats a fsync per file
_WRITEBACK_EVERY = 16 * MiB  # start writeback of large files early (Linux sync_file_range)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


# ------------------------------------------------------------------ progress


class StderrProgress:
    """The default progress reporter: one stderr line per ~256 MiB or 10 % of a file over 64 MiB."""

    def __init__(self, stream=None, *, min_size: int = 64 * MiB, step: int = 256 * MiB, command: str = "admit") -> None:
        self.stream = stream
        self.command = command  # the line's prefix: which command is copying
        self.min_size = min_size
        self.step = step
        self._next: dict[str, int] = {}

    def __call__(self, path: str, done: int, total: int) -> None:
        if total < self.min_size:
            return
        step = max(1, min(self.step, total // 10))
        nxt = self._next.get(path, step)
        if done >= nxt or done >= total:
            stream = self.stream or sys.stderr
            shown = path.encode("unicode_escape").decode("ascii")
            try:
                print(f"{self.command}: {shown}: {done // MiB} / {total // MiB} MiB", file=stream, flush=True)
            except (OSError, ValueError):
                # Nobody reads the progress any more (a closed pipe or stream):
                # the admission goes on without it rather than failing.
                self.min_size = float("inf")
            self._next[path] = (done // step + 1) * step
            if done >= total:
                self._next.pop(path, None)


# ------------------------------------------------------------------- sources


def _source_error(code: str, message: str, path: str | None = None) -> AdmissionError:
    return AdmissionError(code, message, path=path)


class _Source:
    """A validated package source: ``files`` maps content path -> expected size."""

    label: str
    files: dict[str, int]

    def read_small(self, relpath: str, limit: int) -> bytes:
        raise NotImplementedError

    def chunks(self, relpath: str, limits: ZipLimits) -> Iterator[bytes | memoryview]:
        """A file's bytes in chunks, each to be consumed before the next is asked for."""
        raise NotImplementedError

    def copy_to(
        self, relpath: str, out_fd: int, limits: ZipLimits, progress: Progress | None, total: int, ring: list[memoryview] | None = None
    ) -> tuple[str, int]:
        """Copy one large file into ``out_fd`` through the ring of :func:`_pipelined_copy_from`; return (sha256 hex, bytes)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _ZipSource(_Source):
    def __init__(self, fd: int, limits: ZipLimits, label: str) -> None:
        self.fd = fd
        self.label = label
        self.archive = ZipArchive(fd, limits, label=label)
        self._entries = {e.name: e for e in self.archive.entries if not e.is_dir}
        self.files = {name: e.file_size for name, e in self._entries.items()}

    def read_small(self, relpath: str, limit: int) -> bytes:
        return self.archive.read_entry(self._entries[relpath], limit)

    def copy_to(
        self, relpath: str, out_fd: int, limits: ZipLimits, progress: Progress | None, total: int, ring: list[memoryview] | None = None
    ) -> tuple[str, int]:
        """Copy one large member into ``out_fd``; return (sha256 hex, bytes).

        A stored member goes through the same ring as a directory source's
        file (:func:`_pipelined_copy_from`), read straight into its buffers
        by a reader that also takes the CRC-32 on the reader thread; the CRC
        and the length are checked once the copy ends, before anything is
        recorded. A deflated member goes through the ring too: the reader
        thread inflates it (and takes its CRC-32) into the buffers through
        :class:`_Refill`, so inflation overlaps the hashing as well.
        """
        entry = self._entries[relpath]
        if not entry.stored:
            chunks = self.chunks(relpath, limits)
            try:
                return _pipelined_copy_from(_Refill(chunks), out_fd, relpath, limits.max_entry_bytes, progress, total, ring)
            finally:
                chunks.close()  # the ring's threads are done with it by now
        reader = self.archive.stored_reader(entry)
        result = _pipelined_copy_from(reader, out_fd, relpath, limits.max_entry_bytes, progress, total, ring)
        reader.finish()
        return result

    def chunks(self, relpath: str, limits: ZipLimits) -> Iterator[bytes]:
        return self.archive.iter_entry(self._entries[relpath])

    def close(self) -> None:
        fd, self.fd = self.fd, None  # forgotten first, as in _DirSource._drop_parent
        if fd is not None:
            os.close(fd)


class _DirSource(_Source):
    """A directory walked without following symlinks; every file opened relative to its parent's fd."""

    def __init__(self, root_fd: int, limits: ZipLimits, label: str) -> None:
        self.fd = root_fd
        self.label = label
        self.files = {}
        self._mtimes: dict[str, int] = {}
        self._limits = limits
        self._registry = NameRegistry("SOURCE_NAME_COLLISION", "SOURCE_NAME_COLLISION")
        self._count = 0
        self._total = 0
        self._buffers: tuple[bytearray, bytearray] | None = None
        self._parent: tuple[str, int] | None = None
        self._walk(root_fd, ())

    def _walk(self, dir_fd: int, parts: tuple[str, ...]) -> None:
        with os.scandir(dir_fd) as it:
            names = sorted(entry.name for entry in it)
        for name in names:
            child = parts + (name,)
            try:
                rel = "/".join(child)
                rel.encode("utf-8")
            except UnicodeEncodeError:
                # The name as the system gave it (its odd bytes as surrogates):
                # the message shows each as \xNN, escaped once.
                raise _source_error("SOURCE_UNSAFE_NAME", "file name is not valid UTF-8", "/".join(child)) from None
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError as exc:  # removed since it was listed
                raise _vanished(exc, rel) from None
            mode = st.st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                kind = "a symlink" if stat.S_ISLNK(mode) else "a FIFO, socket or device"
                raise _source_error("SOURCE_SPECIAL_FILE", f"source holds {kind}", rel)
            problem = name_problem(rel)
            if problem:
                raise _source_error("SOURCE_UNSAFE_NAME", problem, rel)
            self._count += 1
            if self._count > self._limits.max_entries:
                raise _source_error(
                    "LIMIT_EXCEEDED", f"source holds more than {self._limits.max_entries} files and directories", rel
                )
            is_dir = stat.S_ISDIR(mode)
            self._registry.add(child, is_dir, rel)
            if is_dir:
                sub = _open_child_dir(dir_fd, name, rel, st)
                try:
                    self._walk(sub, child)
                finally:
                    os.close(sub)
            else:
                if st.st_size > self._limits.max_entry_bytes:
                    raise _source_error(
                        "LIMIT_EXCEEDED", f"file is {st.st_size} bytes, limit {self._limits.max_entry_bytes}", rel
                    )
                self._total += st.st_size
                if self._total > self._limits.max_total_bytes:
                    raise _source_error(
                        "LIMIT_EXCEEDED", f"source holds more than {self._limits.max_total_bytes} bytes", rel
                    )
                self.files[rel] = st.st_size
                self._mtimes[rel] = st.st_mtime_ns

    def _parent_fd(self, parent: str) -> int:
        """Descriptor of directory ``parent`` (relative), opened component by component without following symlinks.

        The last one is cached: files are copied in sorted order, so siblings
        come together.
        """
        if self._parent is not None and self._parent[0] == parent:
            return self._parent[1]
        self._drop_parent()
        fd = os.dup(self.fd)
        if parent:
            parts = parent.split("/")
            try:
                for i, part in enumerate(parts):
                    nxt = _open_child_dir(fd, part, "/".join(parts[: i + 1]), None)
                    os.close(fd)
                    fd = nxt
            except BaseException:
                os.close(fd)
                raise
        self._parent = (parent, fd)
        return fd

    def _drop_parent(self) -> None:
        # Forget the descriptor before closing it: a Ctrl-C between the two
        # then leaks it at worst, where the other order could close it twice
        # (the second time, whatever file reused the number).
        parent, self._parent = self._parent, None
        if parent is not None:
            os.close(parent[1])

    def _open_file(self, relpath: str) -> int:
        parent, _, name = relpath.rpartition("/")
        dir_fd = self._parent_fd(parent)
        try:
            # O_NONBLOCK: a FIFO swapped in after the walk must not block the open.
            ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            raise _vanished(exc, relpath) from None
        if not stat.S_ISREG(os.fstat(ffd).st_mode):
            os.close(ffd)
            raise _source_error("SOURCE_SPECIAL_FILE", "source file was replaced by a special file", relpath)
        os.set_blocking(ffd, True)
        return ffd

    def read_small(self, relpath: str, limit: int) -> bytes:
        fd = self._open_file(relpath)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise _source_error("LIMIT_EXCEEDED", f"{size} bytes, limit {limit}", relpath)
            # Asked for by the file's size, not the limit: read(n) allocates n.
            return read_fd_at_most(fd, limit, label=relpath, error=AdmissionError)
        finally:
            os.close(fd)

    def copy_to(
        self, relpath: str, out_fd: int, limits: ZipLimits, progress: Progress | None, total: int, ring: list[memoryview] | None = None
    ) -> tuple[str, int]:
        """Copy one large file into ``out_fd``; return (sha256 hex, bytes).

        Pipeline over a small ring of private buffers: a worker thread
        reads a chunk into a buffer and writes that buffer out (with direct
        I/O a second worker writes, see :func:`_pipelined_copy`), then hands
        it to this thread, which hashes it and returns it to the ring. Each
        chunk is hashed once, from the very buffer that was written, so the
        recorded hash is the hash of the stored bytes even if the source
        changes meanwhile; and the reads and writes overlap the SHA-256 on
        the other core (hashlib, readv and write all release the GIL).
        """
        fd = self._open_file(relpath)
        try:
            sha, size = _pipelined_copy(fd, out_fd, relpath, limits.max_entry_bytes, progress, total, ring)
            self._check_unchanged(fd, relpath, size)
            return sha, size
        finally:
            os.close(fd)

    def _check_unchanged(self, fd: int, relpath: str, copied: int) -> None:
        """The file must be as the walk found it, to the end of its copy.

        The hash is the stored bytes' whatever happens, but a file written
        to meanwhile (a log still being written, a package copied in while
        admitted) gives a copy that is neither its old version nor its new
        one: a shrunk file read past its new end left a prefix of it, which
        was admitted as the file. Its size and modification time, from the
        walk to the end of the copy, and the bytes copied tell (a change
        that keeps both, within one timestamp tick or forged, is not seen)."""
        st = os.fstat(fd)
        if copied != st.st_size or (st.st_size, st.st_mtime_ns) != (self.files[relpath], self._mtimes[relpath]):
            raise _source_error("SOURCE_CHANGED", "source file changed while it was admitted; admit it again once it is complete", relpath)

    def chunks(self, relpath: str, limits: ZipLimits) -> Iterator[memoryview]:
        """Read into two alternating buffers, for the small files :func:`_stage_files` copies itself."""
        fd = self._open_file(relpath)
        try:
            if self._buffers is None:
                # Shared by all files of this source: each chunk is written
                # before the next is read, and a file before the next opens.
                self._buffers = (bytearray(CHUNK), bytearray(CHUNK))
            buffers = self._buffers
            views = (memoryview(buffers[0]), memoryview(buffers[1]))
            total = 0
            k = 0
            while True:
                n = os.readv(fd, [buffers[k]])
                if n == 0:
                    self._check_unchanged(fd, relpath, total)
                    return
                total += n
                if total > limits.max_entry_bytes:
                    raise _source_error("LIMIT_EXCEEDED", f"file grew beyond {limits.max_entry_bytes} bytes", relpath)
                yield views[k][:n]
                k ^= 1
        finally:
            os.close(fd)

    def close(self) -> None:
        self._drop_parent()
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def _vanished(exc: OSError, relpath: str) -> AdmissionError:
    if exc.errno == errno.ELOOP:
        return _source_error("SOURCE_SPECIAL_FILE", "source path became a symlink", relpath)
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return _source_error("SOURCE_NOT_FOUND", "source file vanished during admission", relpath)
    return _source_error("IO_ERROR", f"cannot open source file: {os.strerror(exc.errno or 0)}", relpath)


def _open_child_dir(dir_fd: int, name: str, rel: str, expected: os.stat_result | None) -> int:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _vanished(exc, rel) from None
    if expected is not None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino):
            os.close(fd)
            raise _source_error("SOURCE_SPECIAL_FILE", "source directory was replaced during admission", rel)
    return fd


def refuse_source_holding(source: os.PathLike | str, workspace_root: os.PathLike | str) -> None:
    """A directory source that holds the workspace (``source=.`` run from a
    directory whose ``service-data`` is the workspace) would be copied into
    the new package with the workspace inside it: other cases' published
    files, the store, the cache. ``INVALID_ARGUMENT`` before anything is read."""
    path = os.fspath(source)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return
    except OSError:
        return  # _open_source names what is wrong with it
    holder = os.path.realpath(path)
    inside = os.path.realpath(os.fspath(workspace_root))
    if inside == holder or inside.startswith(holder.rstrip(os.sep) + os.sep):
        raise AdmissionError(
            "INVALID_ARGUMENT",
            "the source directory holds the workspace; take the package from a directory outside it",
            path=os.path.basename(path.rstrip("/")) or path,
        )


def _open_source(source: os.PathLike | str, limits: ZipLimits) -> _Source:
    """Inspect ``source`` completely (ZIP structure or directory walk) without writing anything."""
    path = os.fspath(source)
    label = os.path.basename(path.rstrip("/")) or path
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise _source_error("SOURCE_NOT_FOUND", "source does not exist", label) from None
    if stat.S_ISLNK(st.st_mode):
        raise _source_error("SOURCE_SPECIAL_FILE", "source is a symlink", label)
    if stat.S_ISDIR(st.st_mode):
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError as exc:
            raise _vanished(exc, label) from None
        try:
            return _DirSource(fd, limits, label)
        except BaseException:
            os.close(fd)
            raise
    if not stat.S_ISREG(st.st_mode):
        raise _source_error("SOURCE_SPECIAL_FILE", "source is neither a regular file nor a directory", label)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _vanished(exc, label) from None
    try:
        return _ZipSource(fd, limits, label)
    except BaseException:
        os.close(fd)
        raise


# ------------------------------------------------------------------- copying

_libc = None


def _libc_fn(name: str):
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:  # pragma: no cover - no libc (not Linux)
            _libc = False
    return getattr(_libc, name, None) if _libc else None


def _syncfs(fd: int) -> bool:
    """``syncfs(2)``: flush every dirty page and inode of ``fd``'s filesystem.

    Since Linux 5.8 it reports writeback errors like ``fsync``. Returns False
    where unavailable (the caller then fsyncs file by file). Raises ``OSError``
    on failure; like a failed fsync it is never retried.
    """
    fn = _libc_fn("syncfs") if sys.platform.startswith("linux") else None
    if fn is None:
        return False
    if fn(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return True


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask Linux to start writing a range back now (no wait), so the final fsync has less to do."""
    fn = _libc_fn("sync_file_range") if sys.platform.startswith("linux") else None
    if fn is not None:
        if fn.argtypes is None:
            fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        fn(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; failures surface at fsync


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


_RING = 6  # buffers in flight in _pipelined_copy: one per stage and some slack
_RING_CHUNK = HUGE_PAGE  # one huge page a buffer: the largest I/O segment the kernel makes of it
_DIRECT_ALIGN = 4096
"""Direct writes start and end on this boundary (from page-aligned buffers): a
multiple of the usual logical block sizes (512, 4096). A filesystem wanting a
coarser one refuses the write with EINVAL and the copy goes on buffered."""


def _on_tmpfs(fd: int) -> bool:
    """True if ``fd`` lives on tmpfs (by its device number in ``/proc/self/mountinfo``).

    Asked anew each time, not cached by device number: a number freed by an
    unmount is given to the next filesystem mounted, of whatever type."""
    return _device_is_tmpfs(os.fstat(fd).st_dev)


def _device_is_tmpfs(st_dev: int) -> bool:
    dev = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == dev and " - " in line:
                    return line.split(" - ", 1)[1].split()[0] == "tmpfs"
    except OSError:
        pass
    return False


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; return whether it is on now (never where unsupported)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | flag) if on else (flags & ~flag))
    except OSError:
        pass  # EINVAL: this filesystem has no direct I/O
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & flag)


def _write_out(fd: int, view: memoryview, direct: bool) -> bool:
    """Write all of ``view``; return whether ``fd`` is still in direct mode for the next write."""
    while view:
        try:
            written = os.write(fd, view)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            # An alignment this filesystem does not take (or a short direct
            # write left the rest unaligned): buffered from here on.
            direct = _set_direct(fd, False)
            if direct:
                raise
            continue
        view = view[written:]
    return direct


class _ChunkWriter:
    """Writes the chunks of one file in order, in direct mode for as long as that works."""

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd = fd
        self.direct = direct
        self.size = 0
        self.flushed = 0

    def __call__(self, view: memoryview) -> None:
        self.size += len(view)
        if self.direct and len(view) % _DIRECT_ALIGN:
            self.direct = _set_direct(self.fd, False)
        self.direct = _write_out(self.fd, view, self.direct)
        if self.direct:
            self.flushed = self.size  # nothing of it waits in the page cache
        elif self.size - self.flushed >= _WRITEBACK_EVERY:
            _start_writeback(self.fd, self.flushed, self.size - self.flushed)
            self.flushed = self.size


def _pipelined_copy(
    in_fd: int, out_fd: int, label: str, limit: int, progress: Progress | None, total: int, ring: list[memoryview] | None = None
) -> tuple[str, int]:
    """Copy ``in_fd`` from where it stands to ``out_fd``: :func:`_pipelined_copy_from` reading with ``readv``."""
    return _pipelined_copy_from(lambda buffer: os.readv(in_fd, [buffer]), out_fd, label, limit, progress, total, ring)


def new_ring() -> list[memoryview]:
    """The buffers of :func:`_pipelined_copy_from`
    (:func:`pipeline.buffers.direct_io_buffers`: page-aligned, as direct I/O
    needs, and on huge pages where the kernel gives them, which made the
    ring's direct writes ~1.5 x as fast here). One ring serves every file of
    a staging in turn (each copy waits for its threads before it returns),
    so a package of many large files does not map and fault in fresh
    buffers for each; left to the garbage collector, because a traceback
    may still hold a view of one."""
    return direct_io_buffers(_RING, _RING_CHUNK)


def _pipelined_copy_from(
    read_into: Callable[[memoryview], int],
    out_fd: int,
    label: str,
    limit: int,
    progress: Progress | None,
    total: int,
    ring: list[memoryview] | None = None,
) -> tuple[str, int]:
    """Copy what ``read_into`` gives to ``out_fd`` hashing the written buffers; return (sha256 hex, bytes).

    ``read_into(buffer)`` fills the start of a buffer and returns how many
    bytes it holds, 0 at the end; it runs on the reader thread, so work it
    does per chunk (a ZIP member's CRC-32) overlaps the hashing here.

    The buffers of a small ring go round: read a chunk into one, write it
    out, hash it here, return it to the ring; the stages work on
    neighbouring chunks at the same time.

    The writes are ``O_DIRECT`` where the filesystem supports it: the bytes go
    from the buffer to the device without a page-cache copy, so the vCPUs
    only read and hash while the device writes, and no page-cache pages have
    to be populated (first-touched memory is slow on this project's VM, and
    how slow varies a lot from run to run). A direct write mostly waits for
    the device, so it gets a thread of its own and the next read goes on
    meanwhile; a buffered write is a memory copy that keeps a core busy, so
    there one thread reads and writes (a third busy thread on two cores
    measured no faster on tmpfs). A chunk whose length is not a multiple of
    :data:`_DIRECT_ALIGN` (the last one, or a short read of a file being
    changed) turns direct mode off for the rest of the file. Durability is
    unchanged: the caller's ``fsync`` still commits the metadata and flushes
    the device cache. ``ring`` (:func:`new_ring`) lends the buffers; by
    default the copy maps its own.
    """
    import queue
    import threading

    buffers = ring if ring is not None else new_ring()
    free: queue.SimpleQueue = queue.SimpleQueue()
    filled: queue.SimpleQueue = queue.SimpleQueue()
    written: queue.SimpleQueue = queue.SimpleQueue()
    for index in range(_RING):
        free.put(index)
    stop = threading.Event()
    # tmpfs takes O_DIRECT but still copies into its pages: nothing to wait
    # for, so no writer thread either.
    direct = not _on_tmpfs(out_fd) and _set_direct(out_fd, True)
    writer = _ChunkWriter(out_fd, direct)

    def read() -> None:
        out = filled if direct else written
        size = 0
        try:
            while not stop.is_set():
                index = free.get()
                if index is None:
                    return
                try:
                    n = read_into(buffers[index])
                except OSError as exc:  # the source, not the staged copy, failed
                    raise _io_error("reading the source", exc, label) from None
                if n == 0:
                    out.put(None)
                    return
                size += n
                if size > limit:
                    raise _source_error("LIMIT_EXCEEDED", f"file grew beyond {limit} bytes", label)
                if not direct:
                    writer(memoryview(buffers[index])[:n])
                out.put((index, n))
        except BaseException as exc:  # passed down the line to the hashing thread, which raises it
            out.put(exc)

    def write() -> None:
        try:
            while not stop.is_set():
                item = filled.get()
                if item is None or isinstance(item, BaseException):
                    written.put(item)
                    return
                index, n = item
                writer(memoryview(buffers[index])[:n])
                written.put(item)
        except BaseException as exc:
            written.put(exc)

    # Each worker says when it is done with the buffers and the descriptor.
    # Not Thread.join: on Python 3.11 a join that Ctrl-C interrupted returns
    # at once the next time, thread still running; Event.wait can be retried.
    finished: list[threading.Event] = []

    def start(target: Callable[[], None], name: str) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                target()
            finally:
                done.set()

        finished.append(done)
        try:
            threading.Thread(target=run, name=name, daemon=True).start()
        except RuntimeError:  # no thread could be started: none to wait for
            done.set()
            raise

    digest = hashlib.sha256()
    size = 0

    def stop_and_wait() -> None:
        stop.set()
        free.put(None)  # unblock a reader waiting for a buffer
        filled.put(None)  # and a writer waiting for a chunk
        # Even after a failure: no buffer may go, and the caller may not
        # close the descriptor, under a running read or write.
        for done in finished:
            done.wait()
        if writer.direct:
            _set_direct(out_fd, False)

    with InterruptsWhileCopying(written.put) as interrupts:
        try:
            start(read, "viano-admit-read")
            if direct:
                start(write, "viano-admit-write")
            while True:
                item = written.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                index, n = item
                digest.update(memoryview(buffers[index])[:n])
                size += n
                free.put(index)
                if progress is not None:
                    progress(label, size, total)
        except BaseException:
            despite_interrupts(stop_and_wait)  # the failure that got here is the one raised
            raise
        interrupted = despite_interrupts(stop_and_wait)
    if interrupted is not None:
        raise interrupted
    interrupts.raise_pending()  # a Ctrl-C that came while the workers finished
    return digest.hexdigest(), size


class _Refill:
    """Fills the ring's buffers from chunks of any size (an inflated ZIP
    member), each buffer to the brim but the last, so direct writes stay
    aligned; called on the reader thread, which then also runs the producer
    of the chunks. The producer's own checks (a ZIP member's length and
    CRC-32, after its last chunk) raise from here like any read error."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._pending = memoryview(b"")

    def __call__(self, buffer) -> int:
        view = memoryview(buffer)
        filled = 0
        while filled < len(view):
            if not self._pending:
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._pending = memoryview(chunk)
                continue
            take = min(len(self._pending), len(view) - filled)
            view[filled:filled + take] = self._pending[:take]
            self._pending = self._pending[take:]
            filled += take
        return filled


# ------------------------------------------------------------------- staging


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, (_DIR_FLAGS if directory else os.O_RDONLY | os.O_CLOEXEC))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _require_real_dir(path: Path, label: str) -> None:
    """``path`` must be a directory, not a symlink to one (RELIABILITY 28): we never write through links."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise AdmissionError("INVALID_ARGUMENT", "the workspace path runs through a file that is not a directory", path=label) from None
    except OSError as exc:
        raise _io_error("inspecting the workspace", exc, label) from None
    if not stat.S_ISDIR(st.st_mode):
        raise AdmissionError("REFERENCE_UNSAFE", "workspace directory is a symlink or not a directory", path=label)


def _require_workspace_root(root: Path) -> None:
    """The workspace root is a directory (a symlink to one is fine) or does not exist yet."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return  # created on demand (and removed again if the admission is rejected)
    except NotADirectoryError:
        raise AdmissionError(
            "INVALID_ARGUMENT", "the workspace path runs through a file that is not a directory", path=os.fspath(root)
        ) from None
    except OSError as exc:
        raise _io_error("inspecting the workspace", exc, os.fspath(root)) from None
    if not stat.S_ISDIR(st.st_mode):
        raise AdmissionError("INVALID_ARGUMENT", "the workspace is not a directory", path=os.fspath(root))


def _io_error(what: str, exc: OSError, path: str | None = None) -> AdmissionError:
    return AdmissionError("IO_ERROR", f"{what} failed: {os.strerror(exc.errno) if exc.errno else exc}", path=path)




class _OwnerTaken(Exception):
    """Between creating an owner file and locking it, a cleaner took it for a
    dead writer's (locked it, or already removed it): try another name."""


def _hold_owner_lock(path: Path) -> int:
    """Create and flock ``path``: the sign that a staging tree's writer lives.

    A flock is released by the kernel when its holder dies, whatever pid
    namespace it ran in; a pid is not (two containers sharing one workspace
    do not see each other's processes). The file is visible a moment before
    it is locked, so a cleaner may take it in between: then the lock is not
    ours, or is on a file no longer linked, and :class:`_OwnerTaken` asks
    for a fresh name. A file that is ours, locked and still linked is one no
    cleaner will remove."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _OwnerTaken() from None  # the cleaner holds it, and will remove it
        if os.fstat(fd).st_nlink == 0:
            raise _OwnerTaken()  # the cleaner removed it before we locked it
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Staging:
    """A private tree ``<root>/<kind>-<id>-<pid>-<hex>/`` removed on failure.

    Directories this object had to create on the way (the workspace root,
    ``.staging``) are removed again by :meth:`cleanup` when empty, so a
    rejected admission leaves no trace. Beside the tree, ``<name>.owner``
    is held locked for the tree's whole life, before the tree exists, so
    :func:`remove_stale_staging` never takes a live writer's tree for dead.
    """

    def __init__(self, root: Path, kind: str, ident: str, *, remove_empty_root: bool) -> None:
        self.root = root
        self._remove_empty_root = remove_empty_root
        self._created: list[Path] = []
        for parent in reversed([root, *root.parents]):
            if not parent.exists():
                try:
                    parent.mkdir()
                    self._created.append(parent)
                except FileExistsError:
                    pass
        _require_real_dir(root, root.name)
        self._owner_fd: int | None = None
        for _ in range(20):
            self.path = root / f"{kind}-{ident}-{os.getpid()}-{secrets.token_hex(6)}"
            self._owner_path = root / (self.path.name + STAGING_OWNER_SUFFIX)
            try:
                self._owner_fd = _hold_owner_lock(self._owner_path)
                break
            except _OwnerTaken:
                continue
            except FileNotFoundError:  # a concurrent cleanup removed the empty root
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._remove_created_roots()
                raise _io_error("creating a staging directory", exc, str(root.name)) from None
        else:  # pragma: no cover
            self._remove_created_roots()
            raise AdmissionError("IO_ERROR", "cannot create a staging directory", path=str(root.name))
        # The owner file keeps the root non-empty, so no cleanup removes it now.
        try:
            self.path.mkdir()
        except BaseException as exc:
            self._release_owner()
            self._remove_created_roots()
            if isinstance(exc, OSError):
                raise _io_error("creating a staging directory", exc, str(root.name)) from None
            raise
        self.dirs: set[Path] = {self.path}

    def _release_owner(self) -> None:
        """Let go of the owner file's lock, unlinking the file first when the
        tree is gone or never was. A tree that could not be removed keeps its
        owner file, unlocked: :func:`remove_stale_staging` then takes it for
        a gone writer's at once, where a tree without one would be judged by
        its pid, this live process's."""
        fd, self._owner_fd = self._owner_fd, None  # forgotten first, as in _DirSource._drop_parent
        if fd is not None:
            if not os.path.lexists(self.path):
                try:
                    os.unlink(self._owner_path)
                except OSError:
                    pass
            os.close(fd)

    def makedirs(self, directory: Path) -> None:
        missing = []
        d = directory
        while d not in self.dirs:
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            d.mkdir()
            self.dirs.add(d)

    def cleanup(self) -> None:
        if self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)
        self._release_owner()
        self._remove_created_roots()

    def _remove_created_roots(self) -> None:
        doomed = list(reversed(self._created))
        if self._remove_empty_root and self.root not in doomed:
            doomed.insert(0, self.root)
        for d in doomed:
            try:
                d.rmdir()
            except OSError:
                break


def remove_stale_staging(staging_root: Path) -> None:
    """Remove staging trees whose writer is gone (crashed admissions and appends).

    A tree's writer lives while it holds the flock on ``<tree>.owner``;
    a tree without one (an interrupted admission's trash, or a tree made
    before owner locks existed) falls back to its pid."""
    import fcntl

    try:
        # Never through a link: what it points at is no staging of ours.
        if not stat.S_ISDIR(os.lstat(staging_root).st_mode):
            return
        names = set(os.listdir(staging_root))
    except FileNotFoundError:
        return
    for name in sorted(names):
        if name.endswith(STAGING_OWNER_SUFFIX) and STAGING_TREE_RE.fullmatch(name[: -len(STAGING_OWNER_SUFFIX)]):
            tree = name[: -len(STAGING_OWNER_SUFFIX)]
        elif STAGING_TREE_RE.fullmatch(name):
            if name + STAGING_OWNER_SUFFIX in names or os.path.lexists(staging_root / (name + STAGING_OWNER_SUFFIX)):
                continue  # decided with its owner file (the listing may predate it)
            if not _pid_alive(int(STAGING_TREE_RE.fullmatch(name).group(2))):
                shutil.rmtree(staging_root / name, ignore_errors=True)
            continue
        else:
            continue
        owner = staging_root / name
        try:
            fd = os.open(owner, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile: its writer cleaned up
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its writer is alive, in whatever pid namespace
            shutil.rmtree(staging_root / tree, ignore_errors=True)
            if os.path.lexists(staging_root / tree):
                continue  # the owner file stays, unlocked, for the next try
            try:
                os.unlink(owner)
            except OSError:
                pass
        finally:
            os.close(fd)


def _check_free_disk(root: Path, needed: int, limits: ZipLimits, what: str = "admission") -> None:
    if not limits.check_free_disk:
        return
    probe = root
    while not probe.exists():
        probe = probe.parent
    vfs = os.statvfs(probe)
    if vfs.f_blocks == 0:
        if _device_is_tmpfs(os.stat(probe).st_dev):
            return  # a tmpfs mounted without a size limit: nothing to check against
        # /proc, /sys and their kind hold no files of ours: the workspace
        # cannot be made there, whatever the free space says.
        raise AdmissionError("IO_ERROR", "the workspace cannot be created on a filesystem without storage", path=os.fspath(root))
    free = vfs.f_bavail * vfs.f_frsize
    if needed + limits.free_disk_reserve > free:
        raise AdmissionError(
            "INSUFFICIENT_DISK",
            f"{what} needs {needed} bytes plus {limits.free_disk_reserve} reserve, {free} available",
        )


def _stage_files(
    staging: _Staging,
    content_dir: Path,
    source: _Source,
    paths: list[str],
    limits: ZipLimits,
    progress: Progress | None,
) -> dict[str, dict]:
    """Copy ``paths`` from ``source`` under ``content_dir``, hashing while copying; make all durable."""
    inventory: dict[str, dict] = {}
    per_file_fsync = len(paths) <= _SYNCFS_MIN_FILES
    # Plain strings in the loop: pathlib costs several microseconds a file,
    # a tenth of the time a small file takes. Paths come sorted, so siblings
    # share the parent made (or found) for the first of them.
    content_root = os.fspath(content_dir)
    made_parent = None
    ring = None  # mapped for the first large file, then lent to every other
    for rel in paths:
        parent = rel.rpartition("/")[0]
        if parent != made_parent:
            staging.makedirs(content_dir / parent if parent else content_dir)
            made_parent = parent
        target = f"{content_root}/{rel}"
        expected = source.files[rel]
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            if expected > CHUNK:
                if ring is None:
                    ring = new_ring()
                sha, size = source.copy_to(rel, fd, limits, progress, expected, ring)
            else:
                digest = hashlib.sha256()
                size = 0
                for chunk in source.chunks(rel, limits):
                    digest.update(chunk)
                    _write_all(fd, chunk)
                    size += len(chunk)
                sha = digest.hexdigest()
                if progress is not None:
                    progress(rel, size, expected)
            if per_file_fsync:
                os.fsync(fd)
        except OSError as exc:
            raise _io_error("writing staged content", exc, rel) from None
        finally:
            os.close(fd)
        inventory[rel] = {"sha256": sha, "size": size}
    return inventory


def _make_durable(staging: _Staging, many_files: bool) -> None:
    """Flush the staged tree.

    With few files, each was fsynced as it was written and only the
    directories remain. With many, nothing was fsynced yet and one
    ``syncfs`` flushes every file and directory of the filesystem at once
    (one journal commit instead of one per file: 256 small files take ~30 ms
    instead of ~100 ms here); where syncfs is unavailable, every file is
    fsynced after all.
    """
    try:
        if many_files:
            fd = os.open(staging.path, _DIR_FLAGS)
            try:
                done = _syncfs(fd)
            finally:
                os.close(fd)
            if done:
                return
            for dirpath, _dirs, files in os.walk(staging.path):  # pragma: no cover - non-Linux fallback
                for name in files:
                    _fsync_path(Path(dirpath) / name)
        for d in sorted(staging.dirs, key=lambda p: len(p.parts), reverse=True):
            _fsync_path(d, directory=True)
    except OSError as exc:
        raise _io_error("fsync of the staged package", exc) from None


def _write_new(path: Path, data: bytes, *, fsync: bool, what: str = "writing the manifest") -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise _io_error(what, exc, path.name) from None
    try:
        _write_all(fd, data)
        if fsync:
            os.fsync(fd)
    except OSError as exc:
        raise _io_error(what, exc, path.name) from None
    finally:
        os.close(fd)


# ------------------------------------------------------------------ manifest


def _check_reserved(paths) -> None:
    for rel in sorted(paths):  # the first in name order, whatever order the source lists them in
        if fold_name(rel.split("/", 1)[0]) in RESERVED_PREFIXES and "/" in rel:
            raise AdmissionError(
                "RESERVED_PATH", f"content under {rel.split('/', 1)[0]}/ is reserved for the case builder", path=rel
            )
        if fold_name(rel) in RESERVED_PREFIXES:
            raise AdmissionError("RESERVED_PATH", "a file may not take a reserved directory name", path=rel)


def _checked_reference(ref: str, pointer: str) -> str:
    try:
        return check_reference(ref)
    except VianoError as exc:
        raise AdmissionError(exc.code, exc.message, path=SOURCE_MANIFEST, pointer=pointer) from None


def _read_contract(data, contract: str, path: str, max_bytes: int) -> dict:
    """Strict JSON checked against ``contract``, as ``decode_strict`` then
    ``contracts.validate`` would (:func:`pipeline.reader.read_document`): a
    document the msgspec Struct vouches for never loads jsonschema, whose
    import and registry cost every admission ~55 ms more than msgspec's."""
    from .reader import read_document

    return read_document(data, contract, path=path, max_bytes=max_bytes, error=AdmissionError)


def _read_source_manifest(source: _Source, limits: ZipLimits) -> dict:
    if SOURCE_MANIFEST not in source.files:
        message = "the package has no manifest.json at its root"
        nested = sorted(path for path in source.files if path.count("/") == 1 and path.endswith("/" + SOURCE_MANIFEST))
        if len(nested) == 1:
            # The usual slip: the package's folder zipped (or given) instead of its contents.
            message += f"; one is at {one_line(nested[0], 200)}: give that folder's contents as the package"
        raise AdmissionError("MANIFEST_MISSING", message, path=source.label)
    data = source.read_small(SOURCE_MANIFEST, limits.manifest_bytes)
    try:
        doc = _read_contract(data, "package-source", SOURCE_MANIFEST, limits.manifest_bytes)
    except AdmissionError as exc:
        if exc.code == "SCHEMA_VIOLATION":
            raise AdmissionError("MANIFEST_INVALID", exc.message, path=SOURCE_MANIFEST, pointer=exc.pointer) from None
        raise
    try:
        validate_id(doc["package_id"], "package id")
    except VianoError as exc:
        raise AdmissionError("UNSAFE_ID", exc.message, path=SOURCE_MANIFEST, pointer="/package_id") from None
    return doc


def _not_held(rel: str) -> str:
    # Refusals about a manifest entry are located in manifest.json (its
    # pointer); the file the entry names goes into the message.
    if rel == SOURCE_MANIFEST:
        return "manifest.json, which is the package's manifest, not one of its files"
    return f"{one_line(rel, 200)}, which the package does not hold"


def _pins(doc: dict, content: dict[str, int]) -> dict[str, dict]:
    """Check every file the manifest names exists; return {path: {pointer, sha256?, size?}} pins
    (``pointer``: the entry's place in the source manifest, for the refusal)."""
    pins: dict[str, dict] = {}
    case_inputs = doc.get("artifacts", {}).get("case_inputs")
    if case_inputs is not None:
        _checked_reference(case_inputs, "/artifacts/case_inputs")
        if case_inputs not in content:
            raise AdmissionError(
                "MANIFEST_FILE_MISSING",
                f"artifacts.case_inputs names {_not_held(case_inputs)}",
                path=SOURCE_MANIFEST,
                pointer="/artifacts/case_inputs",
            )
    for i, item in enumerate(doc.get("files", [])):
        pointer = f"/files/{i}"
        rel = item if isinstance(item, str) else item["path"]
        _checked_reference(rel, pointer if isinstance(item, str) else pointer + "/path")
        if rel in pins:
            raise AdmissionError("MANIFEST_INVALID", "files lists a path twice", path=SOURCE_MANIFEST, pointer=pointer)
        if rel not in content:
            raise AdmissionError("MANIFEST_FILE_MISSING", f"files names {_not_held(rel)}", path=SOURCE_MANIFEST, pointer=pointer)
        pin = {"pointer": pointer} if isinstance(item, str) else {"pointer": pointer, **{k: item[k] for k in ("sha256", "size") if k in item}}
        if "size" in pin and pin["size"] != content[rel]:
            raise AdmissionError(
                "INTEGRITY_ERROR",
                f"{one_line(rel, 200)} is {content[rel]} bytes, the manifest says {pin['size']}",
                path=SOURCE_MANIFEST,
                pointer=pointer + "/size",
            )
        pins[rel] = pin
    return pins


def _stored_manifest(case_id: str, doc: dict, inventory: dict[str, dict]) -> dict:
    return {
        "format": "viano-package",
        "format_version": 1,
        "case_id": case_id,
        "package_id": doc["package_id"],
        "package_generation": 1,
        "analysis_revision": doc["analysis_revision"],
        "project": dict(doc["project"]),
        "artifacts": dict(doc.get("artifacts", {})),
        "files": {rel: inventory[rel] for rel in sorted(inventory)},
    }


# ------------------------------------------------------------------- admit


def _marker_state(case_dir: Path) -> bool:
    """True if ``case_dir`` (a real directory) holds our admission marker as a regular file with our bytes."""
    try:
        fd = os.open(case_dir / ADMISSION_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        return os.read(fd, _MARKER_LIMIT) == _MARKER_BYTES
    except OSError:
        return False
    finally:
        os.close(fd)


def _listdir(path: Path) -> list[str] | None:
    """Names in ``path`` if it is a real directory (not a symlink), else None."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
        return sorted(os.listdir(path))
    except OSError:
        return None


def _not_a_crashed_admission(case_dir: Path) -> str | None:
    """``None`` when ``case_dir`` is positively the tree of an interrupted admission, else why not.

    Positive means: a real directory holding the marker and ``packages/`` and
    nothing else, exactly one package, and in it ``content/`` plus
    ``manifests/`` with only generation 1 -- what :func:`admit` renames into
    place. A later generation (a build, append or publish happened), any
    other file, or no marker means the directory is not ours to delete.
    """
    top = _listdir(case_dir)
    if top is None:
        return "it is not a directory"
    if not _marker_state(case_dir):
        return "it holds no admission marker"
    if top != sorted([ADMISSION_MARKER, "packages"]):
        return "it holds more than an admission writes"
    packages = _listdir(case_dir / "packages")
    if packages is None or len(packages) != 1:
        return "it does not hold exactly one package"
    package = case_dir / "packages" / packages[0]
    if _listdir(package) != ["content", "manifests"] or _listdir(package / "content") is None:
        return "its package holds more than an admission writes"
    if _listdir(package / "manifests") != [_MANIFEST_GENERATION_1]:
        return "its package has generations beyond the admitted one"
    return None


def _refuse_unrecorded(case_id: str, why: str) -> AdmissionError:
    return AdmissionError(
        "CASE_EXISTS",
        f"cases/{case_id} exists but the store has no row for it and {why}, so it is not an interrupted "
        "admission; it was left untouched (restore the store, or move the directory away)",
    )


def _case_exists(case_id: str) -> AdmissionError:
    return AdmissionError("CASE_EXISTS", f"case {case_id} was already admitted")


def clear_admission_marker(workspace: Workspace, case_id: str) -> bool:
    """Remove a leftover admission marker from a *committed* case; True if one was removed.

    Call with the case lock held and only once the CheckpointStore is known to
    have the case's row (a crash between the store commit and the marker's
    removal leaves one behind). The directory is fsynced after the unlink.
    Errors are ``IO_ERROR``.
    """
    case_dir = workspace.case_dir(case_id)
    if _listdir(case_dir) is None or not os.path.lexists(case_dir / ADMISSION_MARKER):
        return False
    try:
        os.unlink(case_dir / ADMISSION_MARKER)
        _fsync_path(case_dir, directory=True)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise _io_error("removing the admission marker", exc, case_id) from None
    return True


def _refuse_a_lost_store(workspace: Workspace) -> None:
    """Before anything is copied or locked: beside admitted cases, a store
    that is missing, empty or too small to hold its tables is refused, from
    the file alone (an SQLite open would leave its -wal/-shm files behind).
    The writing open under the lock refuses again whatever passed here."""
    from .lifecycle import admitted_case_dirs, refuse_a_lost_store, store_file_looks_lost

    how = store_file_looks_lost(workspace.store_path)
    if how is not None and admitted_case_dirs(workspace):
        refuse_a_lost_store(workspace, how)


def _refuse_existing(workspace: Workspace, case_id: str) -> None:
    """Early CASE_EXISTS before any copying (repeated under the lock); never creates a store.

    An admitted case always has its directory, so nothing is refused while
    ``cases/<case_id>`` is absent. A directory with a store row is an admitted
    case (a leftover marker in it is cleared under the lock); one without a
    row must be positively recognisable as an interrupted admission, else it
    is refused here, before anything is copied.
    """
    target = workspace.case_dir(case_id)
    if not os.path.lexists(target):
        return
    recorded = False
    if workspace.store_path.exists():
        store = CheckpointStore(workspace, create=False)
        try:
            recorded = store.exists(case_id)
        finally:
            store.close()
    if recorded:
        if os.path.lexists(target / ADMISSION_MARKER):
            with case_lock(workspace, case_id):
                clear_admission_marker(workspace, case_id)
        # Often the retry of an admission killed after its commit: the staging
        # tree it left is dead, and nothing else would clear it before a build.
        # Only tidying: whatever stops it, the answer is still CASE_EXISTS.
        with contextlib.suppress(OSError, VianoError):
            remove_stale_staging(workspace.staging_dir())
        raise _case_exists(case_id)
    why = _not_a_crashed_admission(target)
    if why is not None:
        raise _refuse_unrecorded(case_id, why)


def admit(
    workspace: Workspace | os.PathLike | str,
    case_id: str,
    source: os.PathLike | str,
    *,
    limits: ZipLimits = ZipLimits(),
    progress: Progress | None = None,
) -> dict:
    """Admit ``source`` (a ZIP file or a directory) as new case ``case_id``; return manifest generation 1.

    The returned dict is exactly what was written to
    ``cases/<case_id>/packages/<package_id>/manifests/000001.json``: the source
    manifest's identity, project, revision and artifacts plus ``case_id``,
    ``package_generation: 1`` and ``files`` (every content path, listed or
    not, with ``sha256`` and ``size``). ``progress`` defaults to
    :class:`StderrProgress`; pass ``lambda *a: None`` for silence.

    Errors (all :class:`~pipeline.errors.VianoError`, workspace unchanged):
    ``UNSAFE_ID``, ``CASE_EXISTS``, ``SOURCE_NOT_FOUND``, ``SOURCE_SPECIAL_FILE``,
    ``SOURCE_UNSAFE_NAME``, ``SOURCE_NAME_COLLISION``, every ``ZIP_*`` code,
    ``LIMIT_EXCEEDED``, ``MANIFEST_MISSING``, ``JSON_*``, ``UNSUPPORTED_VERSION``,
    ``MANIFEST_INVALID``, ``REFERENCE_UNSAFE``, ``MANIFEST_FILE_MISSING``,
    ``RESERVED_PATH``, ``INTEGRITY_ERROR`` (a pinned sha256/size differs),
    ``INSUFFICIENT_DISK``, ``IO_ERROR``, ``LOCK_TIMEOUT``.
    """
    try:
        return _admit(workspace, case_id, source, limits, progress)
    except OSError as exc:
        # A failure no step names more precisely (a directory that cannot be
        # made, a lock file that cannot be opened): coded all the same, after
        # the steps' own clean-up has run.
        raise coded_io_error(exc, AdmissionError) from None


def _admit(workspace, case_id: str, source, limits: ZipLimits, progress: Progress | None) -> dict:
    case_id = validate_id(case_id, "case id")
    try:
        ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    except VianoError as error:
        raise AdmissionError(error.code, error.message) from None
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source.strip():
        raise AdmissionError("INVALID_ARGUMENT", f"source is a str or os.PathLike path, not {type(source).__name__}"
                             if not isinstance(source, str) else "source is empty or blank")
    if "\x00" in source:
        raise AdmissionError("INVALID_ARGUMENT", "the source path holds a NUL character")
    # Checked as CaseBuilder checks them: a wrong kind was a bare TypeError or
    # AttributeError from deep in the copy (session 30's review of the API).
    if not isinstance(limits, ZipLimits):
        raise AdmissionError("INVALID_ARGUMENT", f"limits= takes a ZipLimits, not {type(limits).__name__}")
    if progress is not None and not callable(progress):
        raise AdmissionError("INVALID_ARGUMENT", f"progress= takes a callable, not {type(progress).__name__}")
    if progress is None:
        progress = StderrProgress()
    refuse_source_holding(source, ws.root)
    _require_workspace_root(ws.root)
    _refuse_existing(ws, case_id)
    _refuse_a_lost_store(ws)
    _require_real_dir(ws.cases_dir, "cases")
    src = _open_source(source, limits)
    try:
        doc = _read_source_manifest(src, limits)
        package_id = doc["package_id"]
        content = {rel: size for rel, size in src.files.items() if rel != SOURCE_MANIFEST}
        _check_reserved(content)
        pins = _pins(doc, content)
        paths = sorted(content)
        # Trees of admissions whose process is gone (killed, or interrupted
        # during its own clean-up) go before this one needs the space; until
        # now only a successful commit cleared them.
        remove_stale_staging(ws.staging_dir())
        _check_free_disk(ws.root, sum(content.values()), limits)

        staging = _Staging(ws.staging_dir(), "admit", case_id, remove_empty_root=True)
        try:
            case_tree = staging.path / "case"
            package_tree = case_tree / "packages" / package_id
            content_dir = package_tree / "content"
            staging.makedirs(content_dir)
            inventory = _stage_files(staging, content_dir, src, paths, limits, progress)
            for rel, pin in pins.items():
                if "sha256" in pin and pin["sha256"] != inventory[rel]["sha256"]:
                    raise AdmissionError("INTEGRITY_ERROR", f"{one_line(rel, 200)}'s sha256 differs from the manifest",
                                         path=SOURCE_MANIFEST, pointer=pin["pointer"] + "/sha256")
            manifest = _stored_manifest(case_id, doc, inventory)
            staging.makedirs(package_tree / "manifests")
            many_files = len(paths) > _SYNCFS_MIN_FILES
            _write_new(package_tree / "manifests" / _MANIFEST_GENERATION_1, pretty_bytes(manifest), fsync=not many_files)
            _write_new(case_tree / ADMISSION_MARKER, _MARKER_BYTES, fsync=not many_files, what="writing the admission marker")
            _make_durable(staging, many_files=many_files)
            crashpoint("admit:after-stage")
            _commit(ws, case_id, staging, case_tree, manifest)
        finally:
            staging.cleanup()
    finally:
        src.close()
    return manifest


def _discard_orphan(ws: Workspace, case_id: str, target: Path) -> None:
    """Move an interrupted admission's tree out of ``cases/`` in one rename, then delete it.

    The trash name is a staging name with this process's pid, so a crash
    during the delete leaves a tree :func:`remove_stale_staging` clears later.
    """
    trash = ws.staging_dir() / f"admit-{case_id}-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        os.rename(target, trash)
        _fsync_path(ws.cases_dir, directory=True)
    except OSError as exc:
        raise _io_error("removing an interrupted admission", exc, case_id) from None
    shutil.rmtree(trash, ignore_errors=True)


def _commit(ws: Workspace, case_id: str, staging: _Staging, case_tree: Path, manifest: dict) -> None:
    """Under the case lock: refuse an admitted id, clear an orphan, rename, insert the store row, drop the marker."""
    target = ws.case_dir(case_id)
    with case_lock(ws, case_id):
        store = CheckpointStore(ws)
        try:
            if store.exists(case_id):
                clear_admission_marker(ws, case_id)
                raise _case_exists(case_id)
            if os.path.lexists(target):
                # No store row: only an interrupted admission's tree may go (see module doc).
                why = _not_a_crashed_admission(target)
                if why is not None:
                    raise _refuse_unrecorded(case_id, why)
                _discard_orphan(ws, case_id, target)
            remove_stale_staging(ws.staging_dir())
            _require_real_dir(ws.cases_dir, "cases")
            ws.cases_dir.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(case_tree, target)
            except OSError as exc:
                raise _io_error("publishing the admitted case", exc, f"cases/{case_id}") from None
            try:
                _fsync_path(ws.cases_dir, directory=True)
                _fsync_path(staging.path, directory=True)
            except OSError as exc:
                # Not durable, so not admitted: take the tree back, as when
                # the store row fails below, so no orphan is left in cases/.
                try:
                    os.rename(target, case_tree)
                except OSError:
                    pass  # left with its marker: the next admission of the id clears it
                raise _io_error("publishing the admitted case", exc, f"cases/{case_id}") from None
            crashpoint("admit:after-rename")
            try:
                store.admit(case_id, manifest["package_id"], manifest["analysis_revision"], generation=1,
                            manifest_sha256=hashlib.sha256(pretty_bytes(manifest)).hexdigest())
            except BaseException:
                # Not committed: take the tree back so no orphan is left behind.
                try:
                    os.rename(target, case_tree)
                except OSError:
                    pass
                raise
            crashpoint("admit:after-commit")
            # Committed. A failure from here on must not report the admission as
            # failed: a marker left behind is harmless and cleared lazily.
            try:
                clear_admission_marker(ws, case_id)
            except AdmissionError:
                pass
        finally:
            store.close()


# ------------------------------------------------------------------- append


class AppendSource(tuple):
    """``(index_bytes, files)`` from :func:`read_append_source`, plus where the files are staged.

    Unpacks as a 2-tuple. ``files`` maps each new content path (sorted) to the
    ``Path`` of a private, verified copy under :attr:`root`, and
    :attr:`digests` to its ``(sha256, size)`` as hashed while it was copied;
    call :meth:`cleanup` (or use ``with``) once the PackageWriter has
    published them (:meth:`staged_files`).
    """

    root: Path
    digests: dict[str, tuple[str, int]]

    def __new__(cls, index_bytes: bytes, files: dict[str, Path | None], root: Path | None, staging: _Staging | None,
                digests: dict[str, tuple[str, int]]):
        self = super().__new__(cls, (index_bytes, files))
        self.root = root
        self._staging = staging
        self.digests = digests
        return self

    def staged_files(self) -> dict:
        """Each content path's :class:`~pipeline.packages.StagedFile`, which
        the PackageWriter links into the package instead of copying."""
        from .packages import StagedFile

        return {rel: StagedFile(os.fspath(path), *self.digests[rel]) for rel, path in self.files.items()}

    @property
    def index_bytes(self) -> bytes:
        return self[0]

    @property
    def files(self) -> dict[str, Path]:
        return self[1]

    def cleanup(self) -> None:
        if self._staging is not None:
            self._staging.cleanup()

    def __enter__(self) -> "AppendSource":
        return self

    def __exit__(self, *exc_info) -> None:
        self.cleanup()


def _hash_where_it_is(src: _Source, relpath: str, limits: ZipLimits, progress: Progress | None) -> tuple[str, int]:
    """``(sha256, size)`` of one source file, read as staging reads it (a
    ZIP member's CRC and a directory file's size checked), writing nothing."""
    digest = hashlib.sha256()
    size = 0
    for chunk in src.chunks(relpath, limits):
        digest.update(chunk)
        size += len(chunk)
    if progress is not None:
        progress(relpath, size, src.files[relpath])
    return digest.hexdigest(), size


def read_append_source(
    source: os.PathLike | str,
    limits: ZipLimits = ZipLimits(),
    *,
    staging_dir: os.PathLike | str | None = None,
    progress: Progress | None = None,
    before_staging: Callable[[bytes, dict[str, int]], None] | None = None,
    may_be_held: Callable[[bytes, dict[str, int]], bool] | None = None,
    held: Callable[[bytes, dict[str, tuple[str, int]]], bool] | None = None,
) -> AppendSource:
    """Inspect and stage a ``doit append`` source; return ``(index_bytes, {content path: staged Path})``.

    The source (ZIP or directory, same hostile checks as :func:`admit`) holds
    the returning index at its root as ``case-inputs.json`` (no manifest) and
    new files at their content paths. The index is strictly decoded and checked
    against the ``case-inputs`` contract, and returned as its exact bytes (the
    caller stores it as ``inputs/<generation>/case-inputs.json``). Every other
    file is copied, verified (CRC for ZIP members), under a fresh directory in
    ``staging_dir`` (default: the system temp dir; pass the workspace's
    ``staging_dir()`` to stay on its filesystem). The return value is an
    :class:`AppendSource`: a 2-tuple ``(index_bytes: bytes, files: dict[str,
    Path])`` with ``.root`` and ``.cleanup()``; on error nothing is left behind.

    Errors: as :func:`admit` for the source, ``INDEX_MISSING``, ``JSON_*``,
    ``LIMIT_EXCEEDED``, ``SCHEMA_VIOLATION``/``UNSUPPORTED_VERSION`` for the
    index, ``RESERVED_PATH`` for content under ``case/`` or ``inputs/``.
    ``before_staging(index_bytes, {content path: size})`` runs once the index
    is read and before anything is decoded or copied; whatever it raises
    ends the call with nothing staged. When ``may_be_held(index_bytes,
    sizes)`` says the package may already hold this very append (a repeat),
    the files are hashed where they are, and if ``held(index_bytes,
    digests)`` then says it does, nothing is staged: the result's files map
    to ``None`` and it has no :attr:`root`.
    """
    if progress is None:
        progress = StderrProgress(command="append")
    root = Path(staging_dir) if staging_dir is not None else Path(tempfile.gettempdir())
    src = _open_source(source, limits)
    try:
        if APPEND_INDEX not in src.files:
            raise AdmissionError("INDEX_MISSING", "the append source has no case-inputs.json at its root", path=src.label)
        index_bytes = src.read_small(APPEND_INDEX, limits.manifest_bytes)
        content = {rel: size for rel, size in src.files.items() if rel != APPEND_INDEX}
        if before_staging is not None:
            before_staging(bytes(index_bytes), dict(content))
        _read_contract(index_bytes, "case-inputs", APPEND_INDEX, limits.manifest_bytes)  # refuses; the caller keeps the bytes
        _check_reserved(content)
        for rel in content:
            # A whole package given as an append source: its manifest would
            # become a content file no admission can ever make.
            if "/" not in rel and fold_name(rel) == SOURCE_MANIFEST:
                raise AdmissionError(
                    "RESERVED_PATH", "an append source has no manifest.json (its root holds case-inputs.json and the new files)", path=rel
                )
        if may_be_held is not None and held is not None and may_be_held(bytes(index_bytes), dict(content)):
            # A repeat (a CI step run again) needs no copy, nor the free
            # space for one on a disk that may have filled up meanwhile.
            digests = {rel: _hash_where_it_is(src, rel, limits, progress) for rel in sorted(content)}
            if held(bytes(index_bytes), digests):
                return AppendSource(bytes(index_bytes), dict.fromkeys(sorted(content)), None, None, digests)
        if staging_dir is not None:
            # The workspace's staging: trees of killed appends and admissions
            # go before this one needs the space (admit does the same).
            remove_stale_staging(root)
        _check_free_disk(root, sum(content.values()), limits, "append")
        staging = _Staging(root, "append", "source", remove_empty_root=False)
        try:
            files_dir = staging.path / "files"
            staging.makedirs(files_dir)
            paths = sorted(content)
            inventory = _stage_files(staging, files_dir, src, paths, limits, progress)
            files = {rel: files_dir / rel for rel in paths}
            digests = {rel: (entry["sha256"], entry["size"]) for rel, entry in inventory.items()}
        except BaseException:
            staging.cleanup()
            raise
    except OSError as exc:
        raise coded_io_error(exc, AdmissionError) from None  # as admit: coded, after the clean-up
    finally:
        src.close()
    return AppendSource(bytes(index_bytes), files, staging.path, staging, digests)

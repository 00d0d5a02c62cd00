"""Copy a large source file without copying it through this process's memory.

The ring of :mod:`pipeline.intake` reads every chunk into a buffer (a memory
copy), writes the buffer out and hashes it. Here the source's own page-cache
pages are mapped instead: the main thread hashes a window of them while a
writer thread writes the same window to the staged copy with ``O_DIRECT``
(the device reads the pages; nothing is copied by the CPU). Side by side in
one process, on a 1 GiB file in the page cache, this ran at 1.06 x
``hashlib.file_digest`` where the ring ran at 0.71 x: on this VM's ~1.2
effective cores the ring's memory copy competes with the SHA-256.

A mapping is only safe while the file cannot change under it: a truncation
would make touching a mapped page past the new end a SIGBUS (the process
dies), and a write between the hash and the write-out would store other
bytes than were hashed. So the mapping is used only under a read lease
(``F_SETLEASE``): the kernel grants it only while nobody has the file open
for writing, and while it is held, an ``open`` for writing or a
``truncate`` by anyone waits (up to ``/proc/sys/fs/lease-break-time``,
45 s by default) until the holder lets go. A lease break is seen between
windows (``F_GETLEASE`` no longer says ``F_RDLCK``): the windows in flight
are written out, every mapping is closed, the lease is given up, and the
caller goes on from there with the ring, which copies whatever the file
holds then (as it always has for a source that changes). Where no lease can
be had (not the file's owner without ``CAP_LEASE``, a network filesystem,
leases disabled, a break time under :data:`_MIN_BREAK_SECONDS`), the ring
copies the whole file.

The break notice is a signal to this process; ``SIGIO``, the default, would
end it, so the notice is ``SIGURG``, whose default action is to ignore it.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import threading
from collections import deque
from typing import Callable

__all__ = ["WINDOW", "copy_mapped", "release_lease", "take_read_lease"]

WINDOW = 4 * 1024 * 1024
"""Bytes mapped at once: a multiple of the mapping granularity and of the
direct-write alignment, so every window but the last is written direct."""
_IN_FLIGHT = 4
"""Windows mapped at once (hashed, being written, or waiting): they count in
the process's resident memory, so at most 16 MiB of the file at a time."""
_MIN_BREAK_SECONDS = 5
"""A lease revoked sooner than this after a break could end before the
windows in flight are out; then a truncation could reach a mapped page."""


def take_read_lease(fd: int) -> bool:
    """Take a read lease on ``fd`` (opened read-only); False where none can be had."""
    try:
        import fcntl
        import signal
    except ImportError:
        return False
    if not all(hasattr(fcntl, name) for name in ("F_SETLEASE", "F_GETLEASE", "F_SETSIG")) or not hasattr(signal, "SIGURG"):
        return False  # leases are Linux's
    if _break_seconds() < _MIN_BREAK_SECONDS:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError:  # EAGAIN: open for writing somewhere; EACCES: not ours; EINVAL: no leases here
        return False
    return True


def _break_seconds() -> int:
    try:
        with open("/proc/sys/fs/lease-break-time", "rb") as handle:
            return int(handle.read(32).strip() or b"0")
    except (OSError, ValueError):
        return 0


def _breaking(fd: int) -> bool:
    import fcntl

    try:
        return fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK
    except OSError:
        return True


def release_lease(fd: int) -> None:
    """Give the lease up (a waiting writer goes on); harmless without one."""
    import fcntl

    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError:
        pass


def copy_mapped(
    in_fd: int,
    size: int,
    write: Callable[[memoryview], None],
    digest: "hashlib._Hash",
    *,
    progress: Callable[[int], None] | None = None,
    interrupted: Callable[[], BaseException | None] = lambda: None,
) -> int:
    """Hash and write out ``in_fd``'s first ``size`` bytes window by window,
    under the read lease the caller took; return how many bytes were copied:
    ``size``, or fewer where the lease began to break or a window could not
    be mapped (the caller copies the rest another way, after releasing the
    lease).

    ``write(view)`` runs on a writer thread, one window after another in
    order; ``digest`` is updated here with the same windows. On any failure
    (a write error, an interrupt ``interrupted()`` returns) the windows in flight are finished or abandoned, every mapping
    closed and the writer stopped before it is raised.
    """
    to_write: queue.SimpleQueue = queue.SimpleQueue()
    written: queue.SimpleQueue = queue.SimpleQueue()

    def writer() -> None:
        while True:
            item = to_write.get()
            if item is None:
                return
            try:
                write(item)
            except BaseException as exc:  # handed to the main thread, which raises it
                written.put(exc)
                return
            written.put(True)

    thread = threading.Thread(target=writer, name="viano-admit-mapped-write", daemon=True)
    thread.start()
    pending: deque[tuple[mmap.mmap, memoryview]] = deque()
    failure: BaseException | None = None

    def close_oldest() -> None:
        mapping, view = pending.popleft()
        try:
            view.release()
            mapping.close()
        except BufferError:
            pass  # a traceback still holds a slice: unmapped by the garbage collector; nothing reads it again

    def wait_for_oldest() -> None:
        nonlocal failure
        outcome = written.get()
        if outcome is not True and failure is None:
            failure = outcome
        close_oldest()

    done = 0
    try:
        while done < size:
            stop = interrupted()
            if stop is not None:
                raise stop
            if _breaking(in_fd):
                break
            while len(pending) >= _IN_FLIGHT:
                wait_for_oldest()
                if failure is not None:
                    raise failure
            length = min(WINDOW, size - done)
            try:
                mapping = mmap.mmap(in_fd, length, prot=mmap.PROT_READ, offset=done)
            except OSError:
                break  # this file cannot be mapped here: the caller reads the rest
            view = memoryview(mapping)
            pending.append((mapping, view))
            to_write.put(view)
            digest.update(view)
            done += length
            if progress is not None:
                progress(done)
        # After a failed write the writer has stopped: the windows behind it
        # will never be written, so they are not waited for.
        while pending and failure is None:
            wait_for_oldest()
        if failure is not None:
            raise failure
        return done
    finally:
        to_write.put(None)
        thread.join()
        # A window the writer never took is released unwritten.
        while pending:
            close_oldest()

"""Ctrl-C while a ring of worker threads copies or hashes (pipeline.intake's
admission copy, pipeline.packages' direct-read hash).

A worker that is still running holds a buffer and a descriptor the caller
closes next, and whose number the next ``open`` would reuse. Python raises
KeyboardInterrupt wherever the main thread happens to be, and on Python 3.11
and 3.12 a ``Thread.join`` that it interrupted returns at once the next time
although the thread still runs. So the rings wait on events of their own,
defer Ctrl-C while they run, and stop through :func:`despite_interrupts`.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["InterruptsWhileCopying", "despite_interrupts", "report_interrupts_on_one_line", "ignore_interrupts_from_now"]

_INTERRUPTED_FALLBACK = "the command was stopped (Ctrl-C)"


def report_interrupts_on_one_line() -> None:
    """Ctrl-C ends a command with one ``INTERRUPTED`` line instead of a
    traceback. Only the printing changes: the interpreter still exits by
    SIGINT (status 130 in a shell), and every step is already safe to stop
    anywhere (publication is atomic, a retry resumes).

    Here, in a module that imports nothing at load, so that the dodo file
    installs it before anything else of ours loads: a Ctrl-C while the rest
    of the pipeline imports is one line too."""
    import sys

    if getattr(sys.excepthook, "viano_interrupts", False):
        return
    previous = sys.excepthook

    def hook(kind, value, trace) -> None:
        if issubclass(kind, KeyboardInterrupt):
            try:
                from .errors import ERROR_CODES

                message = ERROR_CODES["INTERRUPTED"]
            except BaseException:  # interrupted while errors itself loaded
                message = _INTERRUPTED_FALLBACK
            sys.stderr.write(f"INTERRUPTED: {message}\n")
            return
        previous(kind, value, trace)

    hook.viano_interrupts = True
    sys.excepthook = hook


def ignore_interrupts_from_now() -> None:
    """Once a command has printed its outcome, a Ctrl-C changes nothing: it
    is ignored for the rest of the process. (Python's own handler raised it
    into doit's last bookkeeping; and at exit, where the interpreter puts the
    default action back, it killed the process silently by SIGINT after a
    success was printed.) Only from the main thread, where handlers live."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class InterruptsWhileCopying:
    """Ctrl-C, while the ring runs, as a message to the copying thread.

    Python raises KeyboardInterrupt wherever the main thread happens to be,
    which may be inside the code that starts the ring's workers or waits for
    them; then the copy would return with a worker still holding a buffer
    and the output descriptor. While this is entered (in the main thread,
    where the standard handler is installed) a Ctrl-C is only recorded and
    handed to ``wake``, which queues it for the copying loop: that loop
    raises it at a point where the stop and the wait always run in full. On
    leaving, the standard handler is back, and an interrupt recorded but not
    yet raised is raised by :meth:`raise_pending`.
    """

    def __init__(self, wake: Callable[[KeyboardInterrupt], None]) -> None:
        self._wake = wake
        self._previous = None
        self.pending: KeyboardInterrupt | None = None

    def __enter__(self) -> "InterruptsWhileCopying":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._record)
        return self

    def _record(self, signum, frame) -> None:
        if self.pending is None:
            self.pending = KeyboardInterrupt()
            self._wake(self.pending)  # SimpleQueue.put may be called from a signal handler

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            import signal

            signal.signal(signal.SIGINT, self._previous)

    def raise_pending(self) -> None:
        if self.pending is not None:
            raise self.pending


def despite_interrupts(cleanup: Callable[[], None]) -> KeyboardInterrupt | None:
    """Run ``cleanup`` (which must bear being run again) to its end, however
    often Ctrl-C interrupts it; return the first interrupt it swallowed, for
    the caller to raise once the cleanup is done. For the ring's stop: a
    worker still running holds a buffer and the output descriptor, which
    the caller closes next (and whose number the next open would reuse)."""
    interrupted = None
    while True:
        try:
            cleanup()
            return interrupted
        except KeyboardInterrupt as exc:
            interrupted = interrupted or exc

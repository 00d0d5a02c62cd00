"""Run the real doit command line and show how the process ends.

* An exit function registered before doit loads says ``exit function ran``
  on standard error, and writes ``said by an exit function`` to standard
  output without flushing it (left in the buffer for the exit to flush).
* An object held by the ``os`` module says ``torn down`` when the
  interpreter frees it, which only its teardown does.

Options, comma-separated in ``VIANO_WATCH_EXIT``:

* ``plain``: the builder's exit without teardown is not installed, so the
  interpreter's own exit runs (what the other options are compared with);
* ``unflushable``: the exit function then leaves a standard output whose
  flush fails;
* ``thread``: the last step starts a non-daemon thread that says
  ``thread done`` 0.3 s later, after doit has returned.

Usage: doit_watching_its_exit.py doit-arguments...
"""

import atexit
import errno
import os
import sys
import threading
import time

OPTIONS = set(filter(None, os.environ.get("VIANO_WATCH_EXIT", "").split(",")))


class _SaysWhenFreed:
    def __del__(self, write=os.write):
        write(2, b"torn down\n")


# Held by a module the interpreter clears at teardown (this one's objects
# are frozen for the collector by then and never freed).
os._viano_held_until_teardown = _SaysWhenFreed()


class _Unflushable:
    """A standard output whose flush fails, as a full disk's may at exit."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _exit_function() -> None:
    os.write(2, b"exit function ran\n")
    sys.stdout.write("said by an exit function\n")
    if "unflushable" in OPTIONS:
        sys.stdout.flush()
        sys.stdout = _Unflushable()


atexit.register(_exit_function)

if "plain" in OPTIONS:
    import pipeline.doitcli as doitcli

    doitcli.end_the_process_without_teardown = lambda: None

if "thread" in OPTIONS:
    import pipeline.build as build

    report_build = build.report_build

    def reporting_then_starting_a_thread(*args, **kwargs):
        def later() -> None:
            time.sleep(0.3)
            os.write(2, b"thread done\n")

        threading.Thread(target=later).start()
        return report_build(*args, **kwargs)

    build.report_build = reporting_then_starting_a_thread

from doit.__main__ import main  # noqa: E402 - after the patches, as the dodo file looks them up

sys.argv = ["doit", *sys.argv[1:]]
sys.exit(main())

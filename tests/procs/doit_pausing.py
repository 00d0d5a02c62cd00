"""Run the real doit command line, pausing at a named crash point.

Usage: doit_pausing.py POINT READY_FILE doit-arguments...

When the pipeline reaches the crash point POINT this process creates
READY_FILE and sleeps (up to 60 s), so a test can signal it right there.
Only :func:`pipeline.faults.crashpoint` is replaced, in this process only.
"""

import sys
import time
from pathlib import Path

import pipeline.faults as faults

point, ready = sys.argv[1], sys.argv[2]


def pausing(name: str) -> None:
    if name == point:
        Path(ready).touch()
        # In short sleeps: a signal that lands between the touch and the sleep's
        # system call (this process descheduled there, under load) is handled
        # without interrupting that call, so one 60 s sleep acted on it only
        # when it ended, past the test's deadline (session 24's CI run).
        until = time.monotonic() + 60
        while time.monotonic() < until:
            time.sleep(0.05)


faults.crashpoint = pausing

from doit.__main__ import main  # noqa: E402 - after the patch, as the pipeline imports it lazily

sys.argv = ["doit", *sys.argv[3:]]
sys.exit(main())

"""Named crash points for crash-consistency tests.

Tests start a real child process with ``VIANO_CRASH_AT=<name>``; when the
child reaches :func:`crashpoint` with that name it kills itself with SIGKILL,
exactly as a power cut or OOM kill would stop it: no ``finally`` blocks, no
flushing. In normal runs the variable is unset and this costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["crashpoint", "CRASH_ENV"]

CRASH_ENV = "VIANO_CRASH_AT"


def crashpoint(name: str) -> None:
    """Die here, by SIGKILL, if the test harness asked for ``name``."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)

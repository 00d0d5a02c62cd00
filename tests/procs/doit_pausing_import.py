"""Run the real doit command line, pausing while the dodo file imports a module.

Usage: doit_pausing_import.py MODULE READY_FILE doit-arguments...

When MODULE is first imported (the dodo file's imports do that) this process
creates READY_FILE and sleeps (up to 60 s) inside that import, so a test can
signal it while the dodo file is still loading.
"""

import importlib.abc
import sys
import time
from pathlib import Path

module, ready = sys.argv[1], sys.argv[2]


class PauseOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == module:
            sys.meta_path.remove(self)
            Path(ready).touch()
            # In short sleeps: a signal that lands between the touch and the sleep's
            # system call (this process descheduled there, under load) is handled
            # without interrupting that call, so one 60 s sleep acted on it only
            # when it ended, past the test's deadline (session 24's CI run).
            until = time.monotonic() + 60
            while time.monotonic() < until:
                time.sleep(0.05)
        return None


sys.meta_path.insert(0, PauseOnImport())

from doit.__main__ import main  # noqa: E402 - doit itself loads before the pause

sys.argv = ["doit", *sys.argv[3:]]
sys.exit(main())

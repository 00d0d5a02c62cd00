"""Run the real doit command line, pausing once a content file is open for reading.

Usage: doit_pausing_open.py RELPATH READY_FILE GO_FILE doit-arguments...

When the pipeline has opened content RELPATH (``Package._open_content``) this
process creates READY_FILE and waits (up to 60 s) for GO_FILE before it reads
a byte, so a test can change the file while the task that reads it runs.
"""

import sys
import time
from pathlib import Path

import pipeline.packages as packages

relpath, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
opened = packages.Package._open_content


def pausing(self, name):
    fd = opened(self, name)
    if name == relpath:
        ready.touch()
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return fd


packages.Package._open_content = pausing

from doit.__main__ import main  # noqa: E402 - after the patch

sys.argv = ["doit", *sys.argv[4:]]
sys.exit(main())

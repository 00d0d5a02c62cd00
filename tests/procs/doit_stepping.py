"""Run the real doit command line, stopping at each of several crash points.

Usage: doit_stepping.py POINT[,POINT...] DIR doit-arguments...

At each named crash point this process creates ``DIR/<point>.ready`` and
waits (up to 60 s) for ``DIR/<point>.go`` before it goes on, so a test can
act between two steps of one real run. Only
:func:`pipeline.faults.crashpoint` is replaced, in this process only.
"""

import sys
import time
from pathlib import Path

import pipeline.faults as faults

points, folder = set(sys.argv[1].split(",")), Path(sys.argv[2])


def stepping(name: str) -> None:
    if name in points:
        (folder / f"{name}.ready").touch()
        deadline = time.monotonic() + 60
        while not (folder / f"{name}.go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)


faults.crashpoint = stepping

from doit.__main__ import main  # noqa: E402 - after the patch, as the pipeline imports it lazily

sys.argv = ["doit", *sys.argv[3:]]
sys.exit(main())

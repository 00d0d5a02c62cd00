"""Race staging cleaners against admissions, with real processes.

Usage:
  staging_race.py clean STAGING_ROOT STOP_FILE   remove stale staging until STOP_FILE exists,
                                                 seeing every pid as dead (as from another
                                                 pid namespace, where no writer's pid is visible)
  staging_race.py admit WORKSPACE SOURCE N       admit SOURCE N times as new cases; prints the
                                                 number of failed admissions, then their errors
"""

import os
import sys
from pathlib import Path

import pipeline.intake as intake

if sys.argv[1] == "clean":
    root, stop = Path(sys.argv[2]), Path(sys.argv[3])
    intake._pid_alive = lambda pid: False
    while not stop.exists():
        intake.remove_stale_staging(root)
else:
    workspace, source, count = sys.argv[2], sys.argv[3], int(sys.argv[4])
    errors = []
    for i in range(count):
        try:
            intake.admit(workspace, f"c{os.getpid()}-{i}", source, progress=lambda *a: None)
        except Exception as error:  # noqa: BLE001 - counted and shown by the test
            errors.append(repr(error))
    print(len(errors))
    print("\n".join(errors[:5]))

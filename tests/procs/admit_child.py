"""Child process for crash tests: ``python admit_child.py WORKSPACE CASE_ID SOURCE``.

Exit 0 on success, 3 with ``CODE`` on stdout for a controlled error. Crash
points are armed by the parent through ``VIANO_CRASH_AT``; for random-delay
kills the parent simply sends SIGKILL.
"""

from __future__ import annotations

import sys

from pipeline import intake
from pipeline.errors import VianoError


def main() -> int:
    workspace, case_id, source = sys.argv[1:4]
    try:
        intake.admit(workspace, case_id, source, progress=lambda *a: None)
    except VianoError as exc:
        print(exc.code)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Take a case lock, signal readiness by creating a file, then hold it until killed.

Usage: lock_holder.py WORKSPACE CASE_ID READY_FILE
"""

import sys
import time
from pathlib import Path

from pipeline.workspace import Workspace, case_lock


def main() -> None:
    root, case_id, ready = sys.argv[1:4]
    with case_lock(Workspace(root), case_id, timeout=10):
        Path(ready).touch()
        time.sleep(120)


if __name__ == "__main__":
    main()

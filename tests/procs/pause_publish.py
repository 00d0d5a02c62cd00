"""Publish one generation, pausing at a named crash point until told to go on.

Usage: pause_publish.py WORKSPACE CASE_ID PACKAGE_ID EXPECTED_GENERATION FILES_JSON POINT READY_FILE GO_FILE

FILES_JSON maps content paths to text. When publish reaches the crash point
POINT (e.g. ``publish:after-content``: content linked, manifest not yet) this
process creates READY_FILE and waits (up to 60 s) for GO_FILE to exist, then
carries on. Prints the new manifest as JSON on success; a controlled error
prints its code and exits 3. The pause replaces ``pipeline.packages.crashpoint``
in this process only; nothing in the pipeline changes.
"""

import json
import os
import sys
import time
from pathlib import Path

import pipeline.packages as packages
from pipeline.errors import VianoError
from pipeline.packages import Package, PackageWriter
from pipeline.workspace import Workspace


def main() -> int:
    root, case_id, package_id, expected, files_json, point, ready, go = sys.argv[1:9]
    files = {path: text.encode() for path, text in json.loads(files_json).items()}
    real_crashpoint = packages.crashpoint

    def pausing(name: str) -> None:
        if name == point:
            Path(ready).touch()
            deadline = time.monotonic() + 60
            while not os.path.exists(go):
                if time.monotonic() > deadline:
                    sys.exit("no go signal")
                time.sleep(0.005)
        real_crashpoint(name)

    packages.crashpoint = pausing
    writer = PackageWriter(Package(Workspace(root), case_id, package_id))
    try:
        manifest = writer.publish(int(expected), files)
    except VianoError as exc:
        print(exc.code)
        return 3
    print(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Publish one generation; run with VIANO_CRASH_AT=<point> to be SIGKILLed at that point.

Usage: crash_publish.py WORKSPACE CASE_ID PACKAGE_ID EXPECTED_GENERATION FILES_JSON

FILES_JSON maps content paths to text; the first path becomes the
``case_inputs`` artifact. Prints the new manifest as JSON on success.
"""

import json
import sys

from pipeline.packages import Package, PackageWriter
from pipeline.workspace import Workspace


def main() -> None:
    root, case_id, package_id, expected, files_json = sys.argv[1:6]
    files = {path: text.encode() for path, text in json.loads(files_json).items()}
    writer = PackageWriter(Package(Workspace(root), case_id, package_id))
    manifest = writer.publish(int(expected), files, artifacts={"case_inputs": next(iter(files))})
    print(json.dumps(manifest))


if __name__ == "__main__":
    main()

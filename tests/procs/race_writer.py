"""One of two processes racing PackageWriter.publish for the same generation, round after round.

Usage: race_writer.py WORKSPACE CASE_ID PACKAGE_ID WHO ROUNDS SYNC_DIR

For round r = 1..ROUNDS: spin until SYNC_DIR/go-<r> exists (the parent
creates it once, so both writers start together), publish generation r+1
with expected_generation=r and a file only this writer writes, then report
{"outcome": "won", "manifest": ...} or {"outcome": CODE, "message": ...} in
SYNC_DIR/res-<r>-<WHO>.json (written to a temp name and renamed, so the
parent never reads half a report).
"""

import json
import os
import sys
import time

from pipeline.errors import VianoError
from pipeline.packages import Package, PackageWriter
from pipeline.workspace import Workspace


def payload(who: str, rnd: int) -> bytes:
    return (f"{who}:{rnd}:".encode() * 4096)[: 48 * 1024]


def main() -> None:
    root, case_id, package_id, who, rounds, sync = sys.argv[1:7]
    writer = PackageWriter(Package(Workspace(root), case_id, package_id))
    for rnd in range(1, int(rounds) + 1):
        go = os.path.join(sync, f"go-{rnd}")
        deadline = time.monotonic() + 30
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                sys.exit(f"{who}: no start signal for round {rnd}")
            time.sleep(0.0002)
        try:
            manifest = writer.publish(rnd, {f"round{rnd}/{who}.bin": payload(who, rnd)})
            report = {"outcome": "won", "manifest": manifest}
        except VianoError as exc:
            report = {"outcome": exc.code, "message": exc.message}
        tmp = os.path.join(sync, f".res-{rnd}-{who}")
        with open(tmp, "w") as fh:
            json.dump(report, fh)
        os.rename(tmp, os.path.join(sync, f"res-{rnd}-{who}.json"))


if __name__ == "__main__":
    main()

"""One of two processes racing CheckpointStore.advance on the same generation, round after round.

Usage: race_advance.py WORKSPACE CASE_ID WHO ROUNDS SYNC_DIR

For round r = 1..ROUNDS: spin until SYNC_DIR/go-<r> exists, then
advance(intake, expected_generation=r, new_generation=r+1) and report
{"outcome": "won", "seq": ...} or {"outcome": CODE} in SYNC_DIR/res-<r>-<WHO>.json.
"""

import json
import os
import sys
import time

from pipeline.errors import VianoError
from pipeline.lifecycle import CheckpointStore
from pipeline.workspace import Workspace


def main() -> None:
    root, case_id, who, rounds, sync = sys.argv[1:6]
    store = CheckpointStore(Workspace(root))
    for rnd in range(1, int(rounds) + 1):
        go = os.path.join(sync, f"go-{rnd}")
        deadline = time.monotonic() + 30
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                sys.exit(f"{who}: no start signal for round {rnd}")
            time.sleep(0.0002)
        try:
            cp = store.advance(case_id, "intake", expected_generation=rnd, new_generation=rnd + 1, detail={"by": who})
            report = {"outcome": "won", "seq": cp.seq}
        except VianoError as exc:
            report = {"outcome": exc.code, "message": exc.message}
        tmp = os.path.join(sync, f".res-{rnd}-{who}")
        with open(tmp, "w") as fh:
            json.dump(report, fh)
        os.rename(tmp, os.path.join(sync, f"res-{rnd}-{who}.json"))
    store.close()


if __name__ == "__main__":
    main()

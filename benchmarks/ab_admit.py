#!/usr/bin/env python3
"""The admission of a large file by two versions of the builder, side by side in one run.

This VM's disk and CPU change pace from hour to hour by more than most
changes to the copy, so a change to it is judged against the code before
it: this checks out ``--base`` (a git ref) into a temporary worktree,
writes one directory package with a large context file (``bench_admit``'s),
and admits it with each version in turn, alternating, each admission in a
child process as ``bench_admit`` runs it, with ``hashlib.file_digest`` of the
same file right before each pair. Prints each version's median ratio to
file_digest, the median of the per-pair ratios current / base, and fails
unless both versions recorded the same SHA-256 and size (read back from the
stored manifests).

    .venv/bin/python benchmarks/ab_admit.py --base HEAD~1 [--size-mib 1024] [--rounds 7]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ab_trees  # noqa: E402
import bench_admit  # noqa: E402  (the package, the child and file_digest)

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def admit(tree: Path, ws: Path, src: Path) -> dict:
    # PYTHONPATH names the tree: its own `pipeline` wins over the installed one.
    env = dict(ENV, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-c", bench_admit._CHILD, str(ws), str(src)], capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        sys.exit(f"admission with {tree} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def stored_files(ws: Path) -> dict:
    manifest = ws / "cases" / "bench" / "packages" / "bench-big" / "manifests" / "000001.json"
    return json.loads(manifest.read_bytes())["files"]


def main() -> None:
    parser = ab_trees.parser(__doc__)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default="/work", help="where to create the temporary directory (default /work)")
    args = parser.parse_args()
    with ab_trees.base_and_current(args.base, "viano-ab-admit-", args.dir) as (root, trees):
        src = bench_admit._big_package(root, args.size_mib)
        big = src / "original" / "context" / "dump.bin"
        bench_admit._file_digest_mbps(big)  # warms the page cache
        ratios: dict[str, list[float]] = {name: [] for name in trees}
        pairs: list[float] = []
        recorded = {}
        for round_ in range(args.rounds):
            base_mbps = bench_admit._file_digest_mbps(big)
            order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
            seconds = {}
            for name in order:
                ws = root / f"ws-{name}"
                shutil.rmtree(ws, ignore_errors=True)
                os.sync()  # the previous round's freed blocks are not this admission's to discard
                seconds[name] = admit(trees[name], ws, src)["admit_s"]
                ratios[name].append(args.size_mib / seconds[name] / base_mbps)
                recorded[name] = stored_files(ws)
            pairs.append(seconds["base"] / seconds["current"])
        for name, values in ratios.items():
            print(f"{name:8s} admission / file_digest of its round: median {statistics.median(values):.2f}  ({' '.join(f'{v:.2f}' for v in values)})")
        print(f"current / base, per pair (speed): median {statistics.median(pairs):.2f}  ({' '.join(f'{v:.2f}' for v in pairs)})")
        same = recorded["base"] == recorded["current"]
        print(f"same files, sizes and SHA-256 recorded by both versions: {same}")
        if not same:
            sys.exit("the versions recorded different content")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The append rebuild of two versions of the builder, side by side in one run.

Machine noise here is larger than most single changes, so a change to the
rebuild path is judged against the code before it, not against a number from
another hour: this checks out ``--base`` (a git ref) into a temporary
worktree, prepares the same package at both versions (admit, build, reopen,
append one report; ``bench_build``'s package), keeps each workspace aside,
then times ``doit build`` of each, alternating, restoring its workspace
before every run. Prints both medians and their ratio, and fails unless the
two versions published byte-identical ``case.json`` and summaries.

Also prints, for each version, the CPU time of a rebuild (user + system,
median; it leaves out waiting for the disk), and what does not vary from run
to run: the minor page faults of a rebuild (memory it touches; median), and
with ``--callgrind`` the instructions one rebuild executes, counted by
valgrind's callgrind (about a minute more; valgrind hides the CPU's SHA
instructions, so OpenSSL's portable SHA-256 runs there and hashing counts
several times its real share). A change of a few milliseconds is lost in
the times here but shows in the counts.

With ``--cycles N`` the rebuild timed is the one after the N-th reopen and
append of one report (each earlier one built first): the appends after the
first extend a case whose prior case already had an appended report, as
repeated work on one case does. The package's 254 documents leave room for
one append at the default limits, so for N > 1 both workspaces get a
``limits.json`` allowing the N - 1 further documents and indexes.

    .venv/bin/python benchmarks/ab_append.py --base HEAD~3 [--context-mib 64] [--rounds 11] [--cycles 1] [--callgrind]
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ab_trees  # noqa: E402
import bench_build  # noqa: E402  (the package and the keep-aside copy)

DOIT = str(Path(sys.executable).parent / "doit")
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run(tree: Path, *args: str, prefix: tuple[str, ...] = ()) -> tuple[float, subprocess.CompletedProcess]:
    # PYTHONPATH first: the tree's own `pipeline` wins over the installed one.
    env = dict(ENV, PYTHONPATH=str(tree))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run([*prefix, DOIT, "-f", str(tree / "dodo.py"), *args], cwd=tree, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result.minor_faults = after.ru_minflt - before.ru_minflt
    result.cpu_seconds = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if result.returncode != 0:
        sys.exit(f"doit {' '.join(args)} failed in {tree}:\n{result.stderr}")
    return elapsed, result


def main() -> None:
    parser = ab_trees.parser(__doc__)
    parser.add_argument("--context-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--callgrind", action="store_true", help="also count one rebuild's instructions under valgrind")
    parser.add_argument("--cycles", type=int, default=1, help="reopen + append rounds before the timed rebuild (default 1)")
    args = parser.parse_args()
    with ab_trees.base_and_current(args.base, "viano-ab-") as (base, trees):
        source = base / "source"
        bench_build.make_package(source, args.context_mib)
        extras = []
        for cycle in range(args.cycles):
            extra = base / f"append-{cycle}"
            name = "new.json" if cycle == 0 else f"new-{cycle}.json"
            bench_build._write_json(extra / "original/reports" / name, bench_build._report(999 - cycle))
            bench_build._write_json(extra / "case-inputs.json", {
                "format": "viano-case-inputs", "format_version": 1, "reports": [f"original/reports/{name}"],
            })
            extras.append(extra)
        for name, tree in trees.items():
            ws = base / f"ws-{name}"
            wsvar = f"workspace={ws}"
            run(tree, "admit", "case=bench", f"source={source}", wsvar)
            if args.cycles > 1:
                bench_build._write_json(ws / "limits.json", {
                    "format": "viano-workspace-limits", "format_version": 1,
                    "case_builder": {"documents": 256 + 2 * (args.cycles - 1)},
                })
            run(tree, "build", "case=bench", wsvar)
            for cycle, extra in enumerate(extras):
                if cycle:
                    run(tree, "build", "case=bench", wsvar)
                run(tree, "reopen", "case=bench", "by=human:bench", f"reason=benchmark append {cycle + 1}", wsvar)
                run(tree, "append", "case=bench", f"source={extra}", wsvar)
            bench_build.keep_aside(ws, base / f"aside-{name}")
        times: dict[str, list[float]] = {name: [] for name in trees}
        faults: dict[str, list[int]] = {name: [] for name in trees}
        cpu: dict[str, list[float]] = {name: [] for name in trees}
        spliced: dict[str, int] = {name: 0 for name in trees}
        for round_ in range(args.rounds):
            order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
            for name in order:
                ws = base / f"ws-{name}"
                bench_build.put_back(base / f"aside-{name}", ws)
                os.sync()
                elapsed, result = run(trees[name], "build", "case=bench", f"workspace={ws}")
                if ".  publish" not in result.stderr:
                    sys.exit(f"{name}: the rebuild did not publish:\n{result.stderr}")
                times[name].append(elapsed)
                faults[name].append(result.minor_faults)
                cpu[name].append(result.cpu_seconds)
                # (Worded "input(s)" before session 21: a base ref may print that.)
                spliced[name] += bool(re.search(r" new (input|document)\(s\) appended to the ", result.stderr))
        for name, values in times.items():
            print(f"{name:8s} median {statistics.median(values):.3f} s  ({' '.join(f'{v:.3f}' for v in values)})")
        print(f"current / base: {statistics.median(times['current']) / statistics.median(times['base']):.2f} (medians)")
        for name, values in cpu.items():
            print(f"{name:8s} CPU time (user + system) median {statistics.median(values):.3f} s")
        print(f"current / base: {statistics.median(cpu['current']) / statistics.median(cpu['base']):.2f} (CPU time, medians)")
        for name, values in faults.items():
            print(f"{name:8s} minor page faults per rebuild: {statistics.median(values):.0f} (median)")
        for name, count in spliced.items():
            print(f"{name:8s} rebuilds spliced onto the previous build: {count} of {args.rounds}")
        if args.callgrind:
            counted = {}
            for name, tree in trees.items():
                ws = base / f"ws-{name}"
                bench_build.put_back(base / f"aside-{name}", ws)
                callgrind = ("valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null")
                _, result = run(tree, "build", "case=bench", f"workspace={ws}", prefix=callgrind)
                found = re.search(r"Collected : (\d+)", result.stderr)
                if found is None or ".  publish" not in result.stderr:
                    sys.exit(f"{name}: no instruction count or no publication under callgrind:\n{result.stderr[-2000:]}")
                counted[name] = int(found.group(1))
                print(f"{name:8s} instructions per rebuild: {counted[name] / 1e6:.1f} M (callgrind)")
            print(f"current / base: {counted['current'] / counted['base']:.3f} (instructions)")
        revision = f"cases/bench/packages/bench/content/case/revisions/{args.cycles + 1:04d}"
        differ = []
        for name in ("case.json", "case_summary.md"):
            same = (base / "ws-base" / revision / name).read_bytes() == (base / "ws-current" / revision / name).read_bytes()
            print(f"{name} byte-identical across the versions: {same}")
            if not same:
                differ.append(name)
        if differ:
            # A speed-up that changes the output is not the same builder.
            sys.exit(f"the versions published different {', '.join(differ)}")


if __name__ == "__main__":
    main()

"""SQLite-style I/O fault sweep over admission and the lifecycle commands.

tests/test_fault_sweep.py sweeps every file-mutating operation of a case
*build*; this file does the same, with the same injector design, for what
happens around builds, each in-process:

* ``intake.admit`` of a directory package (two reports, a reproduction and
  an opaque file of 3 MiB + 1234 bytes: larger than ``intake.CHUNK`` (1 MiB),
  so the ring copy with its reader and writer threads runs, and its last
  chunk is unaligned) into a workspace that already holds another case;
* ``commands.cmd_append`` of a returning index plus one new report onto a
  built and reopened case (a built revision refuses appends: REOPEN_REQUIRED);
* ``commands.cmd_reopen`` of a built case;
* ``commands.cmd_export`` of a built case to a fresh destination.

The operations counted and failed (only the N-th, ``EIO`` in one
parametrisation, ``ENOSPC`` in the other) are those of test_fault_sweep.py
(one injector for both: tests/faultkit.py):
``os.open`` with a write flag, ``os.write``/``pwrite``/``ftruncate``/``fsync``/
``link``/``rename``/``replace``/``mkdir``/``unlink``/``remove``/``rmdir``,
``open``/``io.open`` in a write mode and every ``write`` through such a file.
The writer thread of the ring copy is counted too (only one thread at a time
makes counted calls there, so the numbering is deterministic). What the
CheckpointStore does through sqlite3 is C code and not swept.

For every N, on a fresh copy of a template workspace, the operation either
raises a :class:`VianoError` whose code is ``IO_ERROR`` or
``INSUFFICIENT_DISK`` (never a bare ``OSError`` or another exception), or
succeeds (a failure it deliberately tolerates) with the reference result.
Then, per operation:

admit
    after a failure the workspace holds no trace of the case: everything but
    ``.staging/`` is as before, except ``.locks/<case>.lock`` (lock files are
    never deleted: workspace.case_lock); a staging tree left behind is allowed
    only because the docs say the next admit or append removes a dead
    writer's tree, and the retry is held to that (the workspace after it must
    be the reference workspace exactly). The retried admission returns and
    stores a manifest byte-identical to the reference one. After a tolerated
    success what comes next is run first: the staging clean-up of the next
    admit or append (``read_append_source`` into the workspace's staging) and
    the next admission attempt of the id (CASE_EXISTS; it removes a leftover
    admission marker, documented as harmless); then the workspace must be the
    reference one. An empty ``.staging`` directory counts as absent.
append, reopen
    every manifest that existed before is byte-identical after a failure; a
    retry succeeds; the package tree (content and manifests, byte for byte,
    no temp file), the store record and ``.staging/`` equal the reference
    (after a tolerated success, once the next append's staging clean-up ran).
export
    the failed export changes nothing in the workspace; the destination holds
    none of the three files (they are one export: what a run wrote before
    failing is taken back) and no temp file; a retry gives exactly the
    reference destination.

Each sweep stops at the first N the operation gets through without reaching
the N-th counted call; that N must be the clean run's operation count + 1.
Findings for all N are collected and reported together.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from pipeline import intake
from pipeline.commands import cmd_append, cmd_export
from pipeline.errors import VianoError
from pipeline.workspace import Workspace
from tests import faultkit
from tests.e2e import kit
from tests.faultkit import CASE, MAX_N, PACKAGE

OTHER = "c0"  # the case the admission template already holds
MiB = 1 << 20
BIG = 3 * MiB + 1234  # > intake.CHUNK: the ring copy; an unaligned last chunk
#: The package's opaque file, copied through the ring, and where its index lists it.
OPAQUE, OPAQUE_ROLE = "original/core.bin", "runtime"
QUIET = lambda *_: None  # noqa: E731


# --------------------------------------------------------------------------- observing a workspace


def _fingerprint(root: Path, *, skip=("checkpoints.sqlite3", ".cache")) -> dict[str, tuple]:
    """Every entry under ``root``: type, mode, size and sha256 of files, link targets.
    The store (compared by its records) and the build cache are left out."""
    out: dict[str, tuple] = {}
    if not os.path.lexists(root):
        return {"<absent>": ("absent",)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in skip]
            filenames = [f for f in filenames if not f.startswith(skip)]
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            st = os.lstat(path)
            if rel == ".staging" and stat.S_ISDIR(st.st_mode) and not os.listdir(path):
                continue  # as _staging: an empty staging directory is no trace
            if stat.S_ISREG(st.st_mode):
                out[rel] = ("file", stat.S_IMODE(st.st_mode), st.st_size, hashlib.sha256(path.read_bytes()).hexdigest())
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            else:
                out[rel] = ("dir" if stat.S_ISDIR(st.st_mode) else "other", stat.S_IMODE(st.st_mode))
    return out


def _differ(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _staging(root: Path) -> list[str] | None:
    """What ``.staging`` holds; None when it is absent or empty (an empty
    staging directory holds nothing of any case, and admission removes it)."""
    directory = root / ".staging"
    return (sorted(os.listdir(directory)) or None) if directory.is_dir() else None


def _next_staging_user(root: Path, tiny_append: Path) -> None:
    """What the next admission or append does first to the workspace's staging
    (intake: "a tree whose owner lock can be taken is a dead writer's and is
    removed by the next admit or append"), through the public entry point:
    an append source staged into the workspace's staging and let go again."""
    with intake.read_append_source(tiny_append, staging_dir=Workspace(root).staging_dir(), progress=QUIET):
        pass


# --------------------------------------------------------------------------- packages


def _big_bytes() -> bytes:
    block = hashlib.sha256(b"viano").digest() * 128  # 4 KiB, not a repeating 256-byte pattern
    return (block * (BIG // len(block) + 1))[:BIG]


def _package(root: Path) -> Path:
    return faultkit.package(root, OPAQUE, _big_bytes(), OPAQUE_ROLE)


def _other_package(root: Path) -> Path:
    return kit.make_package(
        root, package_id="pkg-0",
        files={"original/report.json": kit.report("Another case", observations=[{"text": "Unrelated"}])},
        index=kit.index(reports=["original/report.json"]),
    )


# --------------------------------------------------------------------------- what each sweep runs and checks


@dataclass
class Target:
    """One operation under test: a template workspace, how to run the operation
    on a copy of it, and the checks. Filled in by the fixtures below."""

    name: str
    template: Path
    run: Callable[[Path, Path], object]  # (workspace copy, scratch dir of this N)
    before: Callable[[Path], object]  # what a failure must leave as it was
    after_failure: Callable[[Path, Path, object], list[str]]  # (root, scratch, before) -> problems
    retry: Callable[[Path, Path], object]
    final: Callable[[Path, Path], list[str]]  # compared with the reference
    after_tolerated: Callable[[Path, Path], list[str]] = lambda root, scratch: []
    operations: int = 0
    kinds: set = field(default_factory=set)
    threads: set = field(default_factory=set)


def _count(target: Target, reference: Path, scratch: Path) -> None:
    """Run the operation once without faults on the reference copy, counting."""
    counted = faultkit.Injector(0)
    with pytest.MonkeyPatch.context() as patch:
        counted.install(patch)
        target.run(reference, scratch)
    target.operations = counted.count
    target.kinds = counted.kinds
    target.threads = counted.threads


@pytest.fixture(scope="module")
def tiny_append(tmp_path_factory) -> Path:
    """An append source used only to run the next staging clean-up (_next_staging_user)."""
    return kit.make_append(tmp_path_factory.mktemp("tiny") / "src", files={"extra/note.txt": "note\n"}, index=kit.index())


@pytest.fixture(scope="module")
def admission(tmp_path_factory, tiny_append) -> Target:
    base = tmp_path_factory.mktemp("admit")
    source = _package(base / "source")
    template = base / "template"
    intake.admit(Workspace(template), OTHER, _other_package(base / "other"), progress=QUIET)
    reference = base / "reference"
    shutil.copytree(template, reference, symlinks=True)
    manifest_path = Path("cases", CASE, "packages", PACKAGE, "manifests", "000001.json")
    results: dict[str, object] = {}

    def run(root: Path, scratch: Path):
        result = intake.admit(Workspace(root), CASE, source, progress=QUIET)
        results[str(root)] = result
        return result

    def before(root: Path):
        return _fingerprint(root), faultkit.store_state(root, OTHER, CASE)

    def after_failure(root: Path, scratch: Path, was) -> list[str]:
        fingerprint, store = was
        now = _fingerprint(root)
        allowed = {f".locks/{CASE}.lock"}  # lock files are never deleted (workspace.case_lock)
        changed = [p for p in _differ(fingerprint, now) if p not in allowed and p != ".staging" and not p.startswith(".staging/")]
        problems = [f"the failed admission left a trace: {changed[:6]}"] if changed else []
        if faultkit.store_state(root, OTHER, CASE) != store:
            problems.append(f"the store changed: {faultkit.store_state(root, OTHER, CASE)} (before {store})")
        return problems

    def final(root: Path, scratch: Path) -> list[str]:
        problems = []
        manifest = results.get(str(root))
        if manifest != reference_manifest:
            problems.append("admit returned another manifest than the reference")
        if (root / manifest_path).read_bytes() != (reference / manifest_path).read_bytes():
            problems.append("the stored manifest is not the reference bytes")
        diff = _differ(_fingerprint(root), reference_fingerprint)
        if diff:
            problems.append(f"the workspace differs from the reference at {diff[:6]}")
        if faultkit.store_state(root, OTHER, CASE) != reference_store:
            problems.append(f"store {faultkit.store_state(root, OTHER, CASE)} is not the reference {reference_store}")
        return problems

    def after_tolerated(root: Path, scratch: Path) -> list[str]:
        # What comes next: staging a dead writer left is removed by the next
        # admission or append, and a leftover admission marker (harmless) by
        # the next admission attempt of the id (intake's module doc).
        _next_staging_user(root, tiny_append)
        try:
            intake.admit(Workspace(root), CASE, source, progress=QUIET)
        except VianoError as exc:
            if exc.code != "CASE_EXISTS":
                return [f"the next admission attempt gave {exc.code}, not CASE_EXISTS"]
        except Exception as exc:
            return [f"the next admission attempt: {faultkit.describe(exc)}"]
        else:
            return ["the next admission attempt of an admitted id succeeded"]
        return []

    target = Target("admit", template, run, before, after_failure, run, final, after_tolerated)
    _count(target, reference, base)
    reference_manifest = results.pop(str(reference))
    reference_fingerprint = _fingerprint(reference)
    reference_store = faultkit.store_state(reference, OTHER, CASE)
    assert reference_store[1][:3] == ("VALIDATED", 1, 1)
    assert reference_manifest["files"]["original/core.bin"]["size"] == BIG
    return target


def _lifecycle_target(name: str, template: Path, reference: Path, run, base: Path, tiny_append: Path) -> Target:
    """append and reopen: manifests kept, retry, package tree + store + .staging as the reference."""

    def before(root: Path):
        return faultkit.manifests(root)

    def after_failure(root: Path, scratch: Path, was) -> list[str]:
        now = faultkit.manifests(root)
        return [f"manifest {n} changed by the failed {name}" for n, data in was.items() if now.get(n) != data]

    def final(root: Path, scratch: Path) -> list[str]:
        problems = []
        package = faultkit.tree(faultkit.package_dir(root))
        if package != reference_package:
            problems.append(f"package differs from the reference at {_differ(package, reference_package)[:6]}")
        if faultkit.store_state(root, CASE) != reference_store:
            problems.append(f"store record {faultkit.store_state(root, CASE)} differs from the reference {reference_store}")
        if _staging(root) != reference_staging:
            problems.append(f".staging holds {_staging(root)}, the reference {reference_staging}")
        return problems

    def after_tolerated(root: Path, scratch: Path) -> list[str]:
        _next_staging_user(root, tiny_append)  # staging a dead writer left goes with the next admit or append
        return []

    target = Target(name, template, run, before, after_failure, run, final, after_tolerated)
    _count(target, reference, base)
    reference_package = faultkit.tree(faultkit.package_dir(reference))
    reference_store = faultkit.store_state(reference, CASE)
    reference_staging = _staging(reference)
    return target


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Admitted and built once: the template of reopen and export, and the start of append's."""
    base = tmp_path_factory.mktemp("built")
    root = base / "ws"
    intake.admit(Workspace(root), CASE, _package(base / "source"), progress=QUIET)
    assert faultkit.build(root)["status"] == "published"
    return root


@pytest.fixture(scope="module")
def reopen(built, tmp_path_factory, tiny_append) -> Target:
    base = tmp_path_factory.mktemp("reopen")
    reference = base / "reference"
    shutil.copytree(built, reference, symlinks=True)
    target = _lifecycle_target("reopen", built, reference, lambda root, scratch: faultkit.reopen(root), base, tiny_append)
    assert len(faultkit.manifests(reference)) == 3  # admit, build, reopen
    assert faultkit.store_state(reference, CASE)[0][:3] == ("REOPENED", 3, 2)
    return target


@pytest.fixture(scope="module")
def append(built, tmp_path_factory, tiny_append) -> Target:
    base = tmp_path_factory.mktemp("append")
    source = faultkit.append_source(base / "source", OPAQUE, OPAQUE_ROLE)
    template = base / "template"
    shutil.copytree(built, template, symlinks=True)
    faultkit.reopen(template)
    reference = base / "reference"
    shutil.copytree(template, reference, symlinks=True)

    def run(root: Path, scratch: Path):
        cmd_append(case=CASE, source=str(source), workspace=str(root))

    target = _lifecycle_target("append", template, reference, run, base, tiny_append)
    assert len(faultkit.manifests(reference)) == 4  # admit, build, reopen, append
    assert (faultkit.package_dir(reference) / "content" / "original" / "report-c.json").is_file()
    assert faultkit.store_state(reference, CASE)[0][:3] == ("REOPENED", 4, 2)
    return target


@pytest.fixture(scope="module")
def export(built, tmp_path_factory) -> Target:
    base = tmp_path_factory.mktemp("export")
    reference = base / "reference"
    shutil.copytree(built, reference, symlinks=True)
    names = {"case.json", "case_summary.md", "manifest.json"}

    def run(root: Path, scratch: Path):
        cmd_export(case=CASE, dest=str(scratch / "dest"), workspace=str(root))

    def before(root: Path):
        return faultkit.tree(faultkit.package_dir(root)), faultkit.store_state(root, CASE)

    def after_failure(root: Path, scratch: Path, was) -> list[str]:
        problems = []
        if (faultkit.tree(faultkit.package_dir(root)), faultkit.store_state(root, CASE)) != was:
            problems.append("the failed export changed the package or the store")
        dest = scratch / "dest"
        if dest.exists():
            for name in sorted(os.listdir(dest)):
                problems.append(f"the failed export left {name} in the destination")
        return problems

    def final(root: Path, scratch: Path) -> list[str]:
        dest = scratch / "dest"
        got = {p.name: p.read_bytes() for p in dest.iterdir()} if dest.is_dir() else {}
        problems = [] if got == reference_dest else [f"destination holds {sorted(got)}, not the reference export"]
        if (faultkit.tree(faultkit.package_dir(root)), faultkit.store_state(root, CASE)) != reference_state:
            problems.append("the export changed the package or the store")
        return problems

    reference_state = before(reference)
    target = Target("export", built, run, before, after_failure, run, final)
    scratch = base / "reference-scratch"
    scratch.mkdir()
    _count(target, reference, scratch)
    reference_dest = {p.name: p.read_bytes() for p in (scratch / "dest").iterdir()}
    assert set(reference_dest) == names
    return target


# --------------------------------------------------------------------------- the sweep


def _sweep(target: Target, work: Path, code: int, patch: pytest.MonkeyPatch) -> tuple[int, list[str], Counter]:
    """Run the sweep; return (the N that completed, the problems found for all
    N, how the failed runs ended: by error code, "tolerated", or the bare
    exception type)."""
    problems: list[str] = []
    outcomes: Counter = Counter()
    n = 0
    while True:
        n += 1
        assert n <= MAX_N, f"the {target.name} sweep never reached a run that completes"
        root = work / f"n{n:03d}"
        scratch = work / f"s{n:03d}"
        scratch.mkdir()
        shutil.copytree(target.template, root, symlinks=True)
        before = target.before(root)
        injector = faultkit.Injector(n, code)
        try:
            with patch.context() as scoped:
                injector.install(scoped)
                target.run(root, scratch)
            raised = None
        except Exception as exc:  # classified below: only a VianoError with a fault code is right
            raised = exc
        if injector.fired is None:
            # The operation completed without reaching operation N: the sweep ends.
            assert raised is None, f"N={n}: a {target.name} without a fault failed: {faultkit.describe(raised)}"
            problems += [f"N={n} (no fault): {p}" for p in target.final(root, scratch)]
            shutil.rmtree(root)
            shutil.rmtree(scratch)
            return n, problems, outcomes
        kind, arg, site = injector.fired
        label = f"N={n} {kind}({arg}) at {site}"
        found = []
        outcomes[faultkit.outcome(raised)] += 1
        if raised is None:
            found += [f"tolerated, but {p}" for p in target.after_tolerated(root, scratch)]
            found += [f"tolerated (and the next operation's clean-up ran), but {p}" for p in target.final(root, scratch)]
        else:
            found += faultkit.misreported(raised)
            found += target.after_failure(root, scratch, before)
            try:
                target.retry(root, scratch)
            except Exception as exc:
                found.append(f"retry failed: {faultkit.describe(exc)}")
            else:
                found += [f"after retry: {p}" for p in target.final(root, scratch)]
        problems += [f"{label}: {p}" for p in found]
        shutil.rmtree(root)
        shutil.rmtree(scratch)


def _assert_sweep(target: Target, tmp_path: Path, code: int, monkeypatch) -> None:
    faultkit.assert_swept(_sweep(target, tmp_path, code, monkeypatch), target.operations, target.name)


def test_each_clean_run_makes_the_operations_the_sweep_fails(admission, append, reopen, export):
    """The injector sees what each operation really does (a sweep that counted
    nothing would pass vacuously). Admission's large file is written by the
    ring copy's worker thread (the writer with O_DIRECT, the reader where the
    copy is buffered, on tmpfs), and those writes are counted too."""
    assert {"os.open", "os.write", "os.fsync", "os.mkdir", "os.rename", "os.unlink", "os.rmdir"} <= admission.kinds, admission.kinds
    assert admission.threads & {"viano-admit-write", "viano-admit-read"}, admission.threads
    assert {"os.open", "os.write", "os.fsync", "os.link", "os.unlink", "os.mkdir"} <= append.kinds, append.kinds
    assert {"os.open", "os.write", "os.fsync", "os.link"} <= reopen.kinds, reopen.kinds
    assert {"os.open", "os.write", "os.fsync", "os.link"} <= export.kinds, export.kinds
    for target in (admission, append, reopen, export):
        assert 10 <= target.operations <= MAX_N - 1, (target.name, target.operations)


@pytest.mark.parametrize("code", faultkit.ERRNOS)
def test_fail_each_file_operation_of_an_admission(admission, tmp_path, monkeypatch, code):
    """52 counted operations today (N = 1..53): staging tree and owner lock,
    five staged files (the 3 MiB one in four writes by the ring's writer
    thread), manifest and marker, directory fsyncs, the commit under the case
    lock (rename, fsyncs), the marker's removal and the staging clean-up."""
    _assert_sweep(admission, tmp_path, code, monkeypatch)


@pytest.mark.parametrize("code", faultkit.ERRNOS)
def test_fail_each_file_operation_of_an_append(append, tmp_path, monkeypatch, code):
    """Admitted, built, reopened; ``cmd_append`` of a returning index plus one
    report: 42 counted operations today (N = 1..43): the case lock, staging the
    source, the PackageWriter's content and manifest, the cache's parsed
    manifest, the staging clean-up."""
    _assert_sweep(append, tmp_path, code, monkeypatch)


@pytest.mark.parametrize("code", faultkit.ERRNOS)
def test_fail_each_file_operation_of_a_reopen(reopen, tmp_path, monkeypatch, code):
    """Admitted and built; ``cmd_reopen``: 26 counted operations today (N = 1..27),
    the reopen note and manifest, then the prior view it leaves in the cache."""
    _assert_sweep(reopen, tmp_path, code, monkeypatch)


@pytest.mark.parametrize("code", faultkit.ERRNOS)
def test_fail_each_file_operation_of_an_export(export, tmp_path, monkeypatch, code):
    """Admitted and built; ``cmd_export`` to a destination that does not exist
    yet: 18 counted operations today (N = 1..19)."""
    _assert_sweep(export, tmp_path, code, monkeypatch)

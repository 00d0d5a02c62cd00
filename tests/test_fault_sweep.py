"""SQLite-style I/O fault sweep over every file operation of a whole case build.

RELIABILITY.md, "How trusted systems test this": fail the N-th file operation
for N = 1, 2, 3 ... until the operation under test completes, then check
integrity. The fsync-only sweeps (test_packages.py, test_intake.py) cover one
kind of call; this one fails, one at a time, *every* file-mutating call a case
build makes in-process (``CaseBuilder(CheckpointStore(Workspace(root))).build``):

* ``os.open`` with O_WRONLY / O_RDWR / O_CREAT / O_TRUNC / O_APPEND (the case
  lock file, the package writer's exclusive temp files),
* ``os.write`` / ``os.pwrite`` / ``os.ftruncate`` (package content and manifests),
* ``os.fsync`` (files and directories), ``os.link``, ``os.rename``,
  ``os.replace`` (cache records), ``os.mkdir`` (also under ``os.makedirs`` and
  ``Path.mkdir``), ``os.unlink`` / ``os.remove`` / ``os.rmdir``,
* ``builtins.open`` / ``io.open`` in a write mode (cache records), and every
  ``write`` through the file object such an open returns.

What a build does through sqlite3 (the CheckpointStore) is C code and not
swept here. Each failure is transient (only the N-th call fails), with
``EIO`` in one parametrisation and ``ENOSPC`` in the other.

For every N, on a fresh copy of a template workspace:

1. the build either raises a :class:`VianoError` whose code is ``IO_ERROR`` or
   ``INSUFFICIENT_DISK`` (never a bare ``OSError`` or another exception), or
   succeeds (a failure the build deliberately tolerates) with the reference
   outputs;
2. every manifest that existed before the failed build is byte-identical;
3. a retried build (no faults) succeeds, and the package -- content and
   manifests, byte for byte, no temp file -- is exactly the reference
   package: the same case.json and case_summary.md, published by exactly one
   generation;
4. the CheckpointStore record (state, generation, revision, confirmed
   request hash) is the reference one.

The sweep stops at the first N the build gets through without reaching the
N-th operation; that N must be one more than the operation count of a clean
build, so every operation was failed once. Findings for all N are collected
and reported together, so one defect does not hide the others. The injector
and the checks shared with test_fault_sweep_lifecycle.py are in faultkit.py.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from pipeline import intake
from pipeline.commands import cmd_append
from pipeline.plan import case_paths_for
from pipeline.workspace import Workspace
from tests import faultkit
from tests.faultkit import CASE, MAX_N

#: The package's small opaque context file, and where its index lists it.
OPAQUE, OPAQUE_ROLE = "original/db.sql", "database"


# --------------------------------------------------------------------------- the builds under test


class Scenario:
    """A template workspace (everything up to the build under test) and the
    reference: the template built once without faults, with its op count."""

    def __init__(self, template: Path, reference: Path, counted: faultkit.Injector) -> None:
        self.template = template
        self.reference = reference
        self.operations = counted.count
        self.kinds = counted.kinds
        self.package = faultkit.tree(faultkit.package_dir(reference))
        self.manifests = faultkit.manifests(reference)
        (self.store,) = faultkit.store_state(reference, CASE)
        revision = self.store[2]
        paths = case_paths_for(revision)
        self.case = self.package["content/" + paths["case"]]
        self.summary = self.package["content/" + paths["case_summary"]]


def _scenario(base: Path, *, append: bool) -> Scenario:
    template = base / "template"
    source = faultkit.package(base / "source", OPAQUE, "create table t(x);\n", OPAQUE_ROLE)
    intake.admit(Workspace(template), CASE, source, progress=lambda *_: None)
    if append:
        faultkit.build(template)
        faultkit.reopen(template)
        cmd_append(case=CASE, source=str(faultkit.append_source(base / "append", OPAQUE, OPAQUE_ROLE)), workspace=str(template))
    reference = base / "reference"
    shutil.copytree(template, reference, symlinks=True)
    counted = faultkit.Injector(0)
    with pytest.MonkeyPatch.context() as patch:
        result = faultkit.build(reference, counted, patch)
    assert result["status"] == "published"
    return Scenario(template, reference, counted)


@pytest.fixture(scope="module")
def first_build(tmp_path_factory) -> Scenario:
    return _scenario(tmp_path_factory.mktemp("first"), append=False)


@pytest.fixture(scope="module")
def append_rebuild(tmp_path_factory) -> Scenario:
    scenario = _scenario(tmp_path_factory.mktemp("append"), append=True)
    assert len(scenario.manifests) == 5  # admit, first build, reopen, append, this build
    return scenario


# --------------------------------------------------------------------------- the sweep


def _check_against_reference(scenario: Scenario, root: Path) -> list[str]:
    problems = []
    package = faultkit.tree(faultkit.package_dir(root))
    if package != scenario.package:
        differ = sorted(p for p in set(package) | set(scenario.package) if package.get(p) != scenario.package.get(p))
        problems.append(f"package differs from the reference at {differ[:6]}")
    manifests = faultkit.manifests(root)
    if len(manifests) != len(scenario.manifests):
        problems.append(f"{len(manifests)} manifests, the reference has {len(scenario.manifests)}")
    paths = case_paths_for(scenario.store[2])
    for key, expected in (("case", scenario.case), ("case_summary", scenario.summary)):
        if package.get("content/" + paths[key]) != expected:
            problems.append(f"published {paths[key]} is not the reference bytes")
    (state,) = faultkit.store_state(root, CASE)
    if state != scenario.store:
        problems.append(f"store record {state[:3]} differs from the reference {scenario.store[:3]}")
    return problems


def _sweep(scenario: Scenario, work: Path, code: int, patch: pytest.MonkeyPatch) -> tuple[int, list[str], Counter]:
    """Run the sweep; return (the N that completed, the problems found for
    all N, how the failed builds ended: by error code, "tolerated", or the
    bare exception type)."""
    problems: list[str] = []
    outcomes: Counter = Counter()
    n = 0
    while True:
        n += 1
        assert n <= MAX_N, "the sweep never reached a build that completes"
        root = work / f"n{n:03d}"
        shutil.copytree(scenario.template, root, symlinks=True)
        before = faultkit.manifests(root)
        injector = faultkit.Injector(n, code)
        try:
            faultkit.build(root, injector, patch)
            raised = None
        except Exception as exc:  # classified below: only a VianoError with a fault code is right
            raised = exc
        if injector.fired is None:
            # The build completed without reaching operation N: the sweep ends.
            assert raised is None, f"N={n}: a build without a fault failed: {faultkit.describe(raised)}"
            problems += [f"N={n} (no fault): {p}" for p in _check_against_reference(scenario, root)]
            shutil.rmtree(root)
            return n, problems, outcomes
        kind, arg, site = injector.fired
        label = f"N={n} {kind}({arg}) at {site}"
        outcomes[faultkit.outcome(raised)] += 1
        if raised is None:
            found = [f"tolerated, but {p}" for p in _check_against_reference(scenario, root)]
        else:
            found = faultkit.misreported(raised)
        after = faultkit.manifests(root)
        for name, data in before.items():
            if after.get(name) != data:
                found.append(f"manifest {name} changed by the failed build")
        try:
            faultkit.build(root)
        except Exception as exc:
            found.append(f"retry failed: {faultkit.describe(exc)}")
        else:
            found += [f"after retry: {p}" for p in _check_against_reference(scenario, root)]
        problems += [f"{label}: {p}" for p in found]
        shutil.rmtree(root)


def _assert_sweep(scenario: Scenario, tmp_path: Path, code: int, monkeypatch) -> None:
    faultkit.assert_swept(_sweep(scenario, tmp_path, code, monkeypatch), scenario.operations, "build")


def test_a_clean_build_makes_every_kind_of_operation_the_sweep_fails(first_build, append_rebuild):
    """The injector sees what the build really does: a sweep that counted
    nothing would pass vacuously. (No os.rename/rmdir/ftruncate/pwrite on a
    clean build's path; they are counted if a build ever takes them.)"""
    expected = {"os.open", "os.write", "os.fsync", "os.link", "os.unlink", "os.mkdir", "os.replace", "open", "file.write"}
    for scenario in (first_build, append_rebuild):
        assert expected <= scenario.kinds, scenario.kinds
        assert 60 <= scenario.operations <= MAX_N - 1, scenario.operations


@pytest.mark.parametrize("code", faultkit.ERRNOS)
def test_fail_each_file_operation_of_a_first_build(first_build, tmp_path, monkeypatch, code):
    """Admitted package (2 reports, a reproduction, one opaque context file),
    first build: 112 counted operations today, so N = 1..113 (each failed
    build followed by its retry; both parametrisations together ~8 s)."""
    _assert_sweep(first_build, tmp_path, code, monkeypatch)


@pytest.mark.parametrize("code", faultkit.ERRNOS)
def test_fail_each_file_operation_of_an_append_rebuild(append_rebuild, tmp_path, monkeypatch, code):
    """Built, reopened (cmd_reopen), a third report appended (cmd_append,
    what ``doit append`` runs): the rebuild, which splices onto the previous
    revision's case, swept the same way: 92 operations, N = 1..93."""
    _assert_sweep(append_rebuild, tmp_path, code, monkeypatch)

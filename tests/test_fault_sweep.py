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
and reported together, so one defect does not hide the others.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import traceback
from collections import Counter
from pathlib import Path

import pytest

from pipeline import intake
from pipeline.build import CaseBuilder
from pipeline.commands import cmd_append, cmd_reopen
from pipeline.errors import VianoError
from pipeline.lifecycle import CheckpointStore
from pipeline.plan import case_paths_for, step_id_for
from pipeline.workspace import Workspace
from tests.e2e import kit

CASE = "c1"
PACKAGE = "pkg-1"
#: The codes an injected I/O failure may surface as (pipeline/errors.py).
FAULT_CODES = {"IO_ERROR", "INSUFFICIENT_DISK"}
#: A clean build of the small package makes ~90-110 counted operations; the
#: sweep refuses to run away if a build ever stops terminating the loop.
MAX_N = 400

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_OS_CALLS = ("write", "pwrite", "ftruncate", "fsync", "link", "rename", "replace", "mkdir", "unlink", "remove", "rmdir")
_PIPELINE = os.sep + "pipeline" + os.sep


# --------------------------------------------------------------------------- the injector


def _call_site() -> str:
    """The pipeline frames of the current stack, innermost last (``file:line function``)."""
    frames = [f for f in traceback.extract_stack()[:-2] if _PIPELINE in f.filename]
    return " > ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:]) or "(outside pipeline/)"


class _CountedFile:
    """A file object opened for writing whose ``write`` calls are operations too."""

    def __init__(self, inner, injector: "Injector", label: str) -> None:
        self._inner = inner
        self._injector = injector
        self._label = label

    def write(self, data):
        self._injector.hit("file.write", self._label)
        return self._inner.write(data)

    def writelines(self, lines):
        self._injector.hit("file.writelines", self._label)
        return self._inner.writelines(lines)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._inner.__exit__(*exc_info)

    def __iter__(self):
        return iter(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class Injector:
    """Counts file-mutating operations; the ``fail_at``-th raises ``OSError(code)``
    (``fail_at=0``: never, only count). Records which call it failed and where."""

    def __init__(self, fail_at: int, code: int = errno.EIO) -> None:
        self.fail_at = fail_at
        self.code = code
        self.count = 0
        self.kinds: set[str] = set()
        self.fired: tuple[str, str, str] | None = None  # (operation, argument, call site)

    def hit(self, kind: str, label) -> None:
        self.count += 1
        self.kinds.add(kind)
        if self.count == self.fail_at:
            self.fired = (kind, os.path.basename(os.fsdecode(label)) if isinstance(label, (str, bytes, os.PathLike)) else str(label), _call_site())
            raise OSError(self.code, f"injected {errno.errorcode[self.code]} ({kind} #{self.count})")

    def install(self, patch: pytest.MonkeyPatch) -> None:
        for name in _OS_CALLS:
            if hasattr(os, name):
                patch.setattr(os, name, self._counting(name, getattr(os, name)))
        real_os_open = os.open

        def os_open(path, flags, *args, **kwargs):
            if flags & _WRITE_FLAGS:
                self.hit("os.open", path)
            return real_os_open(path, flags, *args, **kwargs)

        patch.setattr(os, "open", os_open)
        real_open = builtins.open

        def open_(file, mode="r", *args, **kwargs):
            if isinstance(file, int) or not any(c in mode for c in "wax+"):
                return real_open(file, mode, *args, **kwargs)
            self.hit("open", file)
            return _CountedFile(real_open(file, mode, *args, **kwargs), self, os.path.basename(os.fspath(file)))

        patch.setattr(builtins, "open", open_)
        patch.setattr(io, "open", open_)  # pathlib's Path.open / write_bytes

    def _counting(self, name: str, real):
        def counted(*args, **kwargs):
            self.hit(f"os.{name}", args[0] if args and not isinstance(args[0], int) else "")
            return real(*args, **kwargs)

        counted.__name__ = name
        return counted


# --------------------------------------------------------------------------- workspaces


def _package_dir(root: Path) -> Path:
    return root / "cases" / CASE / "packages" / PACKAGE


def _tree(directory: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() or path.is_symlink():
            out[path.relative_to(directory).as_posix()] = path.read_bytes() if not path.is_symlink() else b"<symlink>"
        elif path.is_dir() and not any(path.iterdir()):
            out[path.relative_to(directory).as_posix() + "/"] = b"<empty dir>"
    return out


def _manifests(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((_package_dir(root) / "manifests").glob("[0-9]*.json"))}


def _store_state(root: Path) -> tuple:
    store = CheckpointStore(Workspace(root))
    try:
        record = store.get(CASE)
        confirmed = store.confirmed(CASE, step_id_for(record.analysis_revision))
        return (record.state, record.generation, record.analysis_revision,
                confirmed.request_hash if confirmed is not None else None)
    finally:
        store.close()


def _build(root: Path, injector: Injector | None = None, patch: pytest.MonkeyPatch | None = None):
    store = CheckpointStore(Workspace(root))  # opened before any fault: the sweep is of the build
    try:
        if injector is None:
            return CaseBuilder(store).build(CASE, PACKAGE)
        with patch.context() as scoped:
            injector.install(scoped)
            return CaseBuilder(store).build(CASE, PACKAGE)
    finally:
        store.close()


def _small_package(root: Path) -> Path:
    reports = {
        "original/report-a.json": kit.report(
            "Switch stays off",
            summary="Pressing the switch does nothing",
            observations=[{"text": "The switch remains off", "claim": {"key": "switch.state", "value": "off"}}],
            expected=[{"text": "The switch turns on"}],
            complete=True,
            entities=[{"type": "component", "id": 42, "roles": ["focus"]}],
        ),
        "original/report-b.json": kit.report(
            "Switch off again", observations=[{"text": "It is on, actually", "claim": {"key": "switch.state", "value": "on"}}],
        ),
    }
    files = {
        **reports,
        "original/repro.json": kit.reproduction(
            steps=["Open the panel", "Press the switch"],
            observations=[{"text": "Panel shows OFF"}],
            facts=[{"name": "firmware", "value": "1.2.3"}],
        ),
        "original/db.sql": "create table t(x);\n",  # the small opaque context file
    }
    index = kit.index(reports=list(reports), reproductions=["original/repro.json"], database=["original/db.sql"])
    return kit.make_package(root, files=files, index=index)


def _append_source(root: Path) -> Path:
    return kit.make_append(
        root,
        files={"original/report-c.json": kit.report("A third look", observations=[{"text": "Still off after a reboot"}])},
        index=kit.index(
            reports=["original/report-a.json", "original/report-b.json", "original/report-c.json"],
            reproductions=["original/repro.json"],
            database=["original/db.sql"],
        ),
    )


class Scenario:
    """A template workspace (everything up to the build under test) and the
    reference: the template built once without faults, with its op count."""

    def __init__(self, template: Path, reference: Path, counted: Injector) -> None:
        self.template = template
        self.reference = reference
        self.operations = counted.count
        self.kinds = counted.kinds
        self.package = _tree(_package_dir(reference))
        self.manifests = _manifests(reference)
        self.store = _store_state(reference)
        revision = self.store[2]
        paths = case_paths_for(revision)
        self.case = self.package["content/" + paths["case"]]
        self.summary = self.package["content/" + paths["case_summary"]]


def _scenario(base: Path, *, append: bool) -> Scenario:
    template = base / "template"
    intake.admit(Workspace(template), CASE, _small_package(base / "source"), progress=lambda *_: None)
    if append:
        _build(template)
        cmd_reopen(case=CASE, by="human:tester", reason="a third report", workspace=str(template))
        cmd_append(case=CASE, source=str(_append_source(base / "append")), workspace=str(template))
    reference = base / "reference"
    shutil.copytree(template, reference, symlinks=True)
    counted = Injector(0)
    with pytest.MonkeyPatch.context() as patch:
        result = _build(reference, counted, patch)
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


def _describe(exc: BaseException) -> str:
    where = [f for f in traceback.extract_tb(exc.__traceback__) if _PIPELINE in f.filename]
    site = f" raised at {Path(where[-1].filename).name}:{where[-1].lineno} {where[-1].name}" if where else ""
    return f"{type(exc).__name__}: {exc}{site}"


def _check_against_reference(scenario: Scenario, root: Path) -> list[str]:
    problems = []
    package = _tree(_package_dir(root))
    if package != scenario.package:
        differ = sorted(p for p in set(package) | set(scenario.package) if package.get(p) != scenario.package.get(p))
        problems.append(f"package differs from the reference at {differ[:6]}")
    manifests = _manifests(root)
    if len(manifests) != len(scenario.manifests):
        problems.append(f"{len(manifests)} manifests, the reference has {len(scenario.manifests)}")
    paths = case_paths_for(scenario.store[2])
    for key, expected in (("case", scenario.case), ("case_summary", scenario.summary)):
        if package.get("content/" + paths[key]) != expected:
            problems.append(f"published {paths[key]} is not the reference bytes")
    state = _store_state(root)
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
        before = _manifests(root)
        injector = Injector(n, code)
        try:
            _build(root, injector, patch)
            raised = None
        except Exception as exc:  # classified below: only a VianoError with a fault code is right
            raised = exc
        if injector.fired is None:
            # The build completed without reaching operation N: the sweep ends.
            assert raised is None, f"N={n}: a build without a fault failed: {_describe(raised)}"
            problems += [f"N={n} (no fault): {p}" for p in _check_against_reference(scenario, root)]
            shutil.rmtree(root)
            return n, problems, outcomes
        kind, arg, site = injector.fired
        label = f"N={n} {kind}({arg}) at {site}"
        found = []
        outcomes["tolerated" if raised is None else getattr(raised, "code", None) or f"bare {type(raised).__name__}"] += 1
        if raised is None:
            found += [f"tolerated, but {p}" for p in _check_against_reference(scenario, root)]
        elif not isinstance(raised, VianoError):
            found.append(f"bare {_describe(raised)}")
        elif raised.code not in FAULT_CODES:
            found.append(f"code {raised.code} instead of IO_ERROR: {_describe(raised)}")
        after = _manifests(root)
        for name, data in before.items():
            if after.get(name) != data:
                found.append(f"manifest {name} changed by the failed build")
        try:
            _build(root)
        except Exception as exc:
            found.append(f"retry failed: {_describe(exc)}")
        else:
            found += [f"after retry: {p}" for p in _check_against_reference(scenario, root)]
        problems += [f"{label}: {p}" for p in found]
        shutil.rmtree(root)


ERRNOS = [pytest.param(errno.EIO, id="EIO"), pytest.param(errno.ENOSPC, id="ENOSPC")]


def _assert_sweep(scenario: Scenario, tmp_path: Path, code: int, monkeypatch) -> None:
    completed, problems, outcomes = _sweep(scenario, tmp_path, code, monkeypatch)
    # Every counted operation of a clean build was failed once: N runs 1..ops+1.
    assert completed == scenario.operations + 1, (completed, scenario.operations)
    assert sum(outcomes.values()) == scenario.operations
    assert not problems, (
        f"{len(problems)} finding(s) over N=1..{completed}; failed builds ended as {dict(outcomes)}:\n" + "\n".join(problems)
    )


def test_a_clean_build_makes_every_kind_of_operation_the_sweep_fails(first_build, append_rebuild):
    """The injector sees what the build really does: a sweep that counted
    nothing would pass vacuously. (No os.rename/rmdir/ftruncate/pwrite on a
    clean build's path; they are counted if a build ever takes them.)"""
    expected = {"os.open", "os.write", "os.fsync", "os.link", "os.unlink", "os.mkdir", "os.replace", "open", "file.write"}
    for scenario in (first_build, append_rebuild):
        assert expected <= scenario.kinds, scenario.kinds
        assert 60 <= scenario.operations <= MAX_N - 1, scenario.operations


@pytest.mark.parametrize("code", ERRNOS)
def test_fail_each_file_operation_of_a_first_build(first_build, tmp_path, monkeypatch, code):
    """Admitted package (2 reports, a reproduction, one opaque context file),
    first build: 108 counted operations today, so N = 1..109 (each failed
    build followed by its retry; both parametrisations together ~8 s)."""
    _assert_sweep(first_build, tmp_path, code, monkeypatch)


@pytest.mark.parametrize("code", ERRNOS)
def test_fail_each_file_operation_of_an_append_rebuild(append_rebuild, tmp_path, monkeypatch, code):
    """Built, reopened (cmd_reopen), a third report appended (cmd_append,
    what ``doit append`` runs): the rebuild, which splices onto the previous
    revision's case, swept the same way: 88 operations, N = 1..89."""
    _assert_sweep(append_rebuild, tmp_path, code, monkeypatch)

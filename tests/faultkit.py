"""The fault injector of the I/O fault sweeps (tests/test_fault_sweep*.py) and
the helpers they judge a run by.

One copy, so that the build sweep and the lifecycle sweep count and fail the
same operations and hold a failure to the same error codes: the operation
counts their docstrings quote are comparable only while "an operation" means
one thing.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import threading
import traceback
from collections import Counter
from pathlib import Path

import pytest

from pipeline.build import CaseBuilder
from pipeline.commands import cmd_reopen
from pipeline.errors import VianoError
from pipeline.lifecycle import CheckpointStore
from pipeline.plan import step_id_for
from pipeline.workspace import Workspace
from tests.e2e import kit

CASE = "c1"
PACKAGE = "pkg-1"
#: The codes an injected I/O failure may surface as (pipeline/errors.py).
FAULT_CODES = {"IO_ERROR", "INSUFFICIENT_DISK"}
#: Clean runs make ~20-110 counted operations; the sweep refuses to run away
#: if a run ever stops terminating the loop.
MAX_N = 400
ERRNOS = [pytest.param(errno.EIO, id="EIO"), pytest.param(errno.ENOSPC, id="ENOSPC")]

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_OS_CALLS = ("write", "pwrite", "ftruncate", "fsync", "link", "rename", "replace", "mkdir", "unlink", "remove", "rmdir")
_PIPELINE = os.sep + "pipeline" + os.sep


# --------------------------------------------------------------------------- the injector


def _call_site() -> str:
    """The pipeline frames of the current stack, innermost last (``file:line function``)."""
    frames = [f for f in traceback.extract_stack()[:-2] if _PIPELINE in f.filename]
    return " > ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-5:]) or "(outside pipeline/)"


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
        # Admission's ring copy writes from worker threads: a sweep that
        # claims to fail those writes has to be able to show it saw them.
        self.threads: set[str] = set()
        self.fired: tuple[str, str, str] | None = None  # (operation, argument, call site)

    def hit(self, kind: str, label) -> None:
        self.count += 1
        self.kinds.add(kind)
        self.threads.add(threading.current_thread().name)
        if self.count == self.fail_at:
            arg = os.path.basename(os.fsdecode(label)) if isinstance(label, (str, bytes, os.PathLike)) else str(label)
            self.fired = (kind, arg, _call_site())
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


# --------------------------------------------------------------------------- judging a run


def describe(exc: BaseException) -> str:
    where = [f for f in traceback.extract_tb(exc.__traceback__) if _PIPELINE in f.filename]
    site = f" raised at {Path(where[-1].filename).name}:{where[-1].lineno} {where[-1].name}" if where else ""
    return f"{type(exc).__name__}: {exc}{site}"


def outcome(raised: Exception | None) -> str:
    """How a run with a fault ended, for the tally: "tolerated", its error code, or "bare <type>"."""
    return "tolerated" if raised is None else getattr(raised, "code", None) or f"bare {type(raised).__name__}"


def misreported(raised: Exception) -> list[str]:
    """What is wrong with how an injected failure surfaced: only a VianoError
    with a fault code is right."""
    if not isinstance(raised, VianoError):
        return [f"bare {describe(raised)}"]
    if raised.code not in FAULT_CODES:
        return [f"code {raised.code} instead of IO_ERROR: {describe(raised)}"]
    return []


def assert_swept(swept: tuple[int, list[str], Counter], operations: int, name: str) -> None:
    """``swept`` is a sweep's (the N that completed, the problems for all N,
    the outcomes of the failed runs)."""
    completed, problems, outcomes = swept
    # Every counted operation of a clean run was failed once: N runs 1..ops+1.
    assert completed == operations + 1, (completed, operations)
    assert sum(outcomes.values()) == operations
    assert not problems, (
        f"{name}: {len(problems)} finding(s) over N=1..{completed}; failed runs ended as {dict(outcomes)}:\n"
        + "\n".join(problems)
    )


# --------------------------------------------------------------------------- workspaces


def package_dir(root: Path) -> Path:
    return root / "cases" / CASE / "packages" / PACKAGE


def tree(directory: Path) -> dict[str, bytes]:
    """Content and manifests of a package, byte for byte (temp files show up by name)."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() or path.is_symlink():
            out[path.relative_to(directory).as_posix()] = path.read_bytes() if not path.is_symlink() else b"<symlink>"
        elif path.is_dir() and not any(path.iterdir()):
            out[path.relative_to(directory).as_posix() + "/"] = b"<empty dir>"
    return out


def manifests(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((package_dir(root) / "manifests").glob("[0-9]*.json"))}


def store_state(root: Path, *cases: str) -> tuple:
    """(state, generation, revision, package, confirmed request hash) of each case, None if absent."""
    if not (root / "checkpoints.sqlite3").exists():
        return tuple(None for _ in cases)
    store = CheckpointStore(Workspace(root), create=False)
    try:
        out = []
        for case_id in cases:
            if not store.exists(case_id):
                out.append(None)
                continue
            record = store.get(case_id)
            confirmed = store.confirmed(case_id, step_id_for(record.analysis_revision))
            out.append((record.state, record.generation, record.analysis_revision, record.package_id,
                        confirmed.request_hash if confirmed is not None else None))
        return tuple(out)
    finally:
        store.close()


def build(root: Path, injector: Injector | None = None, patch: pytest.MonkeyPatch | None = None):
    """Build CASE; with an injector, under it (installed in a context of ``patch``)."""
    store = CheckpointStore(Workspace(root))  # opened before any fault: the sweep is of the build
    try:
        if injector is None:
            return CaseBuilder(store).build(CASE, PACKAGE)
        with patch.context() as scoped:
            injector.install(scoped)
            return CaseBuilder(store).build(CASE, PACKAGE)
    finally:
        store.close()


def reopen(root: Path) -> None:
    cmd_reopen(case=CASE, by="human:tester", reason="a third report", workspace=str(root))


# --------------------------------------------------------------------------- packages


def package(root: Path, opaque: str, data: bytes | str, role: str) -> Path:
    """Two reports, a reproduction, and the opaque context file ``opaque``
    (listed under ``role``): each sweep picks the opaque file that makes its
    operation take the path it means to sweep."""
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
        opaque: data,
    }
    index = kit.index(reports=list(reports), reproductions=["original/repro.json"], **{role: [opaque]})
    return kit.make_package(root, files=files, index=index)


def append_source(root: Path, opaque: str, role: str) -> Path:
    """The returning index of :func:`package` (same ``opaque`` and ``role``) plus a third report."""
    return kit.make_append(
        root,
        files={"original/report-c.json": kit.report("A third look", observations=[{"text": "Still off after a reboot"}])},
        index=kit.index(
            reports=["original/report-a.json", "original/report-b.json", "original/report-c.json"],
            reproductions=["original/repro.json"],
            **{role: [opaque]},
        ),
    )

"""The library inside a host program (session 23's review of the Python API):
errors a process pool can send back, a fork while another thread builds,
arguments refused with a coded error before anything is written."""

from __future__ import annotations

import copy
import os
import pickle
import signal
import threading
from pathlib import Path

import pytest

import pipeline.build
import pipeline.cache
import pipeline.doitcli
from pipeline.build import CaseBuilder
from pipeline.errors import (
    AdmissionError, CaseBuildError, IntegrityError, LifecycleError, ResearchError, VerificationError, VianoError,
)
from pipeline.intake import admit
from pipeline.lifecycle import CheckpointStore
from pipeline.limits import CaseBuilderLimits
from pipeline.workspace import Workspace
from tests.conftest import FIXTURES


def _quiet(*_args) -> None:
    return None


@pytest.fixture
def admitted(tmp_path) -> Workspace:
    ws = Workspace(tmp_path / "ws")
    admit(ws, "c1", FIXTURES / "sample", progress=_quiet)
    return ws


@pytest.mark.parametrize("kind", [VianoError, AdmissionError, CaseBuildError, IntegrityError, LifecycleError,
                                  ResearchError, VerificationError])
def test_every_error_survives_pickling_and_copying_with_its_code_path_and_pointer(kind):
    # Exception pickles as type(self)(*args), and args held the message alone:
    # a coded error failing a build in a multiprocessing pool killed the
    # pool's result thread, and the host's get() never returned.
    error = kind("JSON_DUPLICATE_KEY", "key 'title' repeated", path="original/r.json", pointer="/title")
    error.extra = [1]
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(again) is kind and str(again) == str(error)
        assert (again.code, again.message, again.path, again.pointer, again.extra) == (
            "JSON_DUPLICATE_KEY", "key 'title' repeated", "original/r.json", "/title", [1])


def _in_a_child(body) -> str:
    """Fork; run ``body`` in the child; its return value (or its error) as text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_end)
        signal.alarm(60)  # a child that hangs ends, and the test fails instead of waiting for ever
        try:
            outcome = body()
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            outcome = f"{type(error).__name__}: {error}"
        os.write(write_end, str(outcome).encode()[:4000])
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    return text


def test_a_fork_while_another_thread_builds_leaves_the_child_free_to_build(admitted):
    """The child of a fork has only the forking thread: a case turn or guard
    another thread held at the fork was never let go there (every later build
    of that case waited 60 s for a thread that does not exist)."""
    ws = admitted
    holding, release = threading.Event(), threading.Event()

    def hold_everything() -> None:
        with pipeline.build._thread_turn(ws, "c1"), pipeline.build._WRITTEN_GUARD, \
                pipeline.doitcli._DIGESTS_GUARD, pipeline.cache._IN_FLIGHT_GUARD:
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold_everything)
    holder.start()
    try:
        assert holding.wait(10)

        def build_in_the_child() -> str:
            with pipeline.build._thread_turn(ws, "c1", timeout=5):
                pass
            with CheckpointStore(ws) as store:
                return CaseBuilder(store, progress=_quiet).build("c1")["status"]

        assert _in_a_child(build_in_the_child) == "published"
    finally:
        release.set()
        holder.join()
    with CheckpointStore(ws) as store:
        assert CaseBuilder(store, progress=_quiet).build("c1")["status"] in ("published", "reused")


def test_a_build_refused_for_its_package_id_records_nothing(admitted):
    with CheckpointStore(admitted) as store:
        before = [c.transition for c in store.checkpoints("c1")], store.get("c1").state
        with pytest.raises(CaseBuildError) as refused:
            CaseBuilder(store, progress=_quiet).build("c1", "not-this-package")
        assert refused.value.code == "INVALID_ARGUMENT" and "not not-this-package" in refused.value.message
        assert ([c.transition for c in store.checkpoints("c1")], store.get("c1").state) == before


def _with_a_store(ws, make):
    # Closed whatever make does: an unclosed connection is a ResourceWarning
    # on Python 3.13, raised into whichever test the collector runs in.
    with CheckpointStore(ws) as store:
        return make(store)


@pytest.mark.parametrize("make", [
    lambda ws: CheckpointStore(str(ws.root)),
    lambda ws: CheckpointStore(None),
    lambda ws: Workspace(""),
    lambda ws: Workspace("  "),
    lambda ws: Workspace(None),
    lambda ws: Workspace(123),
    lambda ws: Workspace(b"/tmp/ws"),
    lambda ws: CaseBuilder(None),
    lambda ws: CaseBuilder(ws),
    lambda ws: _with_a_store(ws, lambda store: CaseBuilder(store, limits={"case_bytes": 1})),
    lambda ws: _with_a_store(ws, lambda store: CaseBuilder(store, progress="stderr")),
    lambda ws: CaseBuilderLimits(case_bytes="x"),
    lambda ws: CaseBuilderLimits(case_bytes=-1),
    lambda ws: CaseBuilderLimits(documents=0),
    lambda ws: CaseBuilderLimits(inline_fact_value=None),
    lambda ws: CaseBuilderLimits(summary_bytes=True),
    lambda ws: CaseBuilderLimits(aggregate_bytes=1.5),
    lambda ws: admit(ws, "c2", None, progress=_quiet),
    lambda ws: admit(ws, "c2", 123, progress=_quiet),
    lambda ws: admit(ws, "c2", b"/tmp/x", progress=_quiet),
    lambda ws: admit(ws, "c2", "", progress=_quiet),
    lambda ws: admit("", "c2", str(FIXTURES / "sample"), progress=_quiet),
])
def test_wrong_arguments_are_refused_with_a_coded_error_and_write_nothing(tmp_path, make):
    ws = Workspace(tmp_path / "ws")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(VianoError) as refused:
            make(ws)
    finally:
        os.chdir(cwd)
    assert refused.value.code == "INVALID_ARGUMENT", refused.value
    assert {p.name for p in tmp_path.iterdir()} <= {"ws"}  # nothing made in the cwd (an empty workspace path)


def test_a_limit_the_caller_gave_is_named_as_the_callers_not_limits_json(admitted):
    with pytest.raises(CaseBuildError) as refused, CheckpointStore(admitted) as store:
        CaseBuilder(store, CaseBuilderLimits(case_bytes=5000), progress=_quiet).build("c1")
    assert refused.value.code == "LIMIT_EXCEEDED"
    assert refused.value.message.endswith("limit 5000 (CaseBuilderLimits.case_bytes, as given to CaseBuilder)"), refused.value
    # The workspace's own limits (none given): the hint names limits.json.
    (Path(admitted.root) / "limits.json").write_text(
        '{"format": "viano-workspace-limits", "format_version": 1, "case_builder": {"case_bytes": 8388608}}')
    with CheckpointStore(admitted) as store:
        assert CaseBuilder(store, progress=_quiet).build("c1")["status"] == "published"


@pytest.fixture
def readable_admitted():
    """(folder, workspace): case c1 admitted by root under umask 022, in a
    folder outside pytest's private one, so that another user may reach it."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="viano-others-"))
    try:
        os.chmod(root, 0o755)
        ws = Workspace(root / "ws")
        previous = os.umask(0o022)
        try:
            admit(ws, "c1", FIXTURES / "sample", progress=_quiet)
        finally:
            os.umask(previous)
        yield root, ws
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _as_nobody(body) -> str:
    """``body()`` in a child process switched to the user nobody (every
    module it needs imported before: none can be read after the switch)."""
    import pwd

    nobody = pwd.getpwnam("nobody")

    def switched() -> str:
        os.setgroups([])
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)
        return body()

    return _in_a_child(switched)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="switches to another user: needs root")
def test_a_user_who_may_only_read_a_workspace_reads_it_and_is_refused_writing_before_anything_is_written(readable_admitted):
    """Session 23's review as ordinary users: status, probes and export of
    another user's workspace said "attempt to write a readonly database"
    (SQLite cannot make the shared-memory file in a folder it may not
    write), and a reopen of a store this user may not write published its
    generation before the store refused it."""
    import pwd

    from pipeline.commands import cmd_export
    from pipeline.workspace import case_lock

    root, ws = readable_admitted
    nobody = pwd.getpwnam("nobody")
    store = CheckpointStore(ws)
    CaseBuilder(store, progress=_quiet).build("c1")
    store.close()  # the last writer gone: its -wal merged, -wal and -shm removed
    assert not (root / "ws" / "checkpoints.sqlite3-shm").exists()
    out = root / "out"
    out.mkdir()
    os.chown(out, nobody.pw_uid, nobody.pw_gid)
    before = sorted(p.name for p in (root / "ws").iterdir())

    def read_export_and_write() -> str:
        seen = []
        reader = CheckpointStore(ws, read_only=True)
        seen.append(reader.get("c1").state)
        reader.close()
        try:
            CheckpointStore(ws)
        except LifecycleError as error:
            seen.append(str(error))
        cmd_export(case="c1", dest=str(out / "export"), workspace=str(ws.root))
        seen.append(",".join(sorted(p.name for p in (out / "export").iterdir())))
        try:
            with case_lock(ws, "c1", timeout=1):
                pass
        except LifecycleError as error:
            seen.append(str(error))
        return " | ".join(seen)

    outcome = _as_nobody(read_export_and_write)
    assert outcome.split(" | ") == [
        "BUILDING_CASE",  # with its case confirmed
        "IO_ERROR: this user cannot write the checkpoint store: its folder belongs to root and group root (mode 755); a workspace shared "
        "by several users needs a common group, setgid folders and umask 002 from its start; one restored or copied by "
        "another user needs chown -R to this user (checkpoints.sqlite3)",
        "case.json,case_summary.md,manifest.json",
        "IO_ERROR: this user may not take case c1's lock: .locks/c1.lock belongs to root and group root (mode 644); a "
        "workspace shared by several users needs a common group, setgid folders and umask 002 from its start; one restored "
        "or copied by another user needs chown -R to this user (.locks/c1.lock)",
    ], outcome
    assert sorted(p.name for p in (root / "ws").iterdir()) == before  # nothing made by the reader


def test_no_memoised_attribute_holds_a_lock_a_fork_could_keep():
    """Python 3.11's functools.cached_property holds one lock per property,
    shared by every instance, while it computes: a fork while another thread
    was inside BuildCache._code left the child's next build waiting for ever."""
    import functools
    import importlib
    import inspect
    import pkgutil

    import pipeline

    found = []
    for module_info in pkgutil.iter_modules(pipeline.__path__):
        module = importlib.import_module(f"pipeline.{module_info.name}")
        for _name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                found += [f"{cls.__name__}.{attr}" for attr, value in vars(cls).items()
                          if isinstance(value, functools.cached_property)]
    assert found == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="switches to another user: needs root")
def test_a_reader_who_may_write_the_folder_but_not_the_store_leaves_no_file_that_locks_its_owner_out(readable_admitted):
    """Session 23's second re-review: a group member's status in a folder it
    may write, of a store it may not, made -wal/-shm files of its own with
    the store's mode 0644, which the store's owner could then not write."""
    root, ws = readable_admitted
    os.chmod(root / "ws", 0o777)  # a folder this user may write; the store stays root's 0644

    def read_and_write() -> str:
        store = CheckpointStore(ws, read_only=True)
        state = store.get("c1").state
        store.close()
        try:
            CheckpointStore(ws)
        except LifecycleError as error:
            return f"{state} | {error}"
        return state

    assert _as_nobody(read_and_write) == (
        "VALIDATED | IO_ERROR: this user cannot write the checkpoint store: checkpoints.sqlite3 belongs to root and group "
        "root (mode 644); a workspace shared by several users needs a common group, setgid folders and umask 002 from its "
        "start; one restored or copied by another user needs chown -R to this user (checkpoints.sqlite3)")
    assert sorted(p.name for p in (root / "ws").iterdir() if p.name.startswith("checkpoints")) == ["checkpoints.sqlite3"]
    # A group's folder, this user not in the group: said so, not the setup advice.
    os.chmod(root / "ws", 0o2775)
    assert _as_nobody(read_and_write) == (
        "VALIDATED | IO_ERROR: this user cannot write the checkpoint store: its folder belongs to root and group root "
        "(mode 2775); this user is not in group root (checkpoints.sqlite3)")


def test_a_builder_given_a_store_made_on_another_thread_builds_with_a_package_id(admitted):
    """The docs audit: the package-id check read through the caller's store,
    whose connection belongs to the thread that made it, so a build on a
    worker thread failed (INTEGRITY_ERROR, 'corrupt or not ours')."""
    store = CheckpointStore(admitted)
    package_id = store.get("c1").package_id
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(CaseBuilder(store, progress=_quiet).build("c1", package_id)["status"]))
    worker.start()
    worker.join()
    assert outcome == ["published"]
    # A store used on another thread than its own is said to be that, not damage.
    def misuse() -> None:
        try:
            store.get("c1")
        except LifecycleError as error:
            outcome.append(error.code)

    worker = threading.Thread(target=misuse)
    worker.start()
    worker.join()
    assert outcome == ["published", "INVALID_ARGUMENT"]
    store.close()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="switches to another user: needs root")
def test_a_reader_who_may_not_write_the_store_is_still_told_of_a_killed_writers_journal(readable_admitted):
    """Session 23's third re-review: the read without shared memory for a
    user who may not write the store skipped SQLite's look at a hot journal
    (an immutable read ignores it), so such a user saw a full status where
    root got the coded refusal."""
    root, ws = readable_admitted
    store = root / "ws" / "checkpoints.sqlite3"
    header = (bytes.fromhex("d9d505f920a163d7") + (0).to_bytes(4, "big") + (0x16C32D62).to_bytes(4, "big")
              + (store.stat().st_size // 4096).to_bytes(4, "big") + (512).to_bytes(4, "big") + (4096).to_bytes(4, "big"))
    (root / "ws" / "checkpoints.sqlite3-journal").write_bytes(header.ljust(512, b"\0"))
    os.chmod(root / "ws" / "checkpoints.sqlite3-journal", 0o644)

    def read() -> str:
        try:
            CheckpointStore(ws, read_only=True).close()
        except LifecycleError as error:
            return str(error)
        return "read"

    outcome = _as_nobody(read)
    assert outcome.startswith("IO_ERROR: the checkpoint store holds a transaction a killed writer left"), outcome


def test_a_store_used_after_close_or_closed_by_another_thread_is_a_coded_refusal(admitted):
    store = CheckpointStore(admitted)
    codes = []

    def close_elsewhere() -> None:
        try:
            store.close()
        except LifecycleError as error:
            codes.append(error.code)

    worker = threading.Thread(target=close_elsewhere)
    worker.start()
    worker.join()
    store.close()
    with pytest.raises(LifecycleError) as used:
        store.get("c1")
    assert codes == ["INVALID_ARGUMENT"] and used.value.code == "INVALID_ARGUMENT", (codes, used.value)
    assert "not after close()" in used.value.message

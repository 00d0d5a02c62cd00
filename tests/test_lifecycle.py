"""Tests for pipeline.lifecycle: the CheckpointStore state machine, CAS, log and corruption."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pipeline import BUILDER_VERSION
from pipeline.errors import VianoError
from pipeline.lifecycle import STATES, TRANSITIONS, CheckpointStore
from pipeline.workspace import Workspace

PROCS = Path(__file__).parent / "procs"
STEP1 = "case-build/v1/r1"
BLOCK = {"code": "RESEARCH_UNAVAILABLE", "route": "research", "retry_after": 60}


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(Workspace(tmp_path / "ws"))
    yield s
    s.close()


def code_of(fn, *args, **kwargs) -> str:
    with pytest.raises(VianoError) as info:
        fn(*args, **kwargs)
    return info.value.code


def built_case(store, case_id="c1"):
    """A case in BUILDING_CASE at generation 2 with a case built for revision 1."""
    store.admit(case_id, "p1", 1)
    store.advance(case_id, "start_build", expected_generation=1, step_id=STEP1)
    return store.advance(
        case_id, "case_built", expected_generation=1, step_id=STEP1, request_hash="h1", new_generation=2,
        artifacts=["case/revisions/0001/case.json"],
    )


# ---------------------------------------------------------------- manifest digests


def test_the_steps_that_take_a_generation_in_record_its_manifest_digest(store):
    digests = {g: f"{g:x}" * 64 for g in range(1, 5)}
    store.admit("c1", "p1", 1, manifest_sha256=digests[1])
    store.advance("c1", "intake", expected_generation=1, new_generation=2, manifest_sha256=digests[2])
    store.advance("c1", "start_build", expected_generation=2, step_id=STEP1)
    store.advance("c1", "case_built", expected_generation=2, step_id=STEP1, request_hash="h1", new_generation=3,
                  manifest_sha256=digests[3])
    store.advance("c1", "reopen", expected_generation=3, new_generation=4, manifest_sha256=digests[4])
    assert [store.recorded_manifest("c1", g) for g in (1, 2, 3, 4)] == list(digests.items())
    assert store.recorded_manifest("other", 1) is None
    # A step without a digest (a builder before the record): the latest one recorded below it stands.
    store.advance("c1", "intake", expected_generation=4, new_generation=5)
    store.advance("c1", "intake", expected_generation=5, new_generation=6)
    assert store.recorded_manifest("c1", 6) == store.recorded_manifest("c1", 5) == (4, digests[4])


@pytest.mark.parametrize("digest", ["A" * 64, "a" * 63, "g" * 64, 7, b"a" * 64])
def test_a_malformed_manifest_digest_is_refused_and_records_nothing(store, digest):
    assert code_of(store.admit, "c1", "p1", 1, manifest_sha256=digest) == "INVALID_ARGUMENT"
    assert not store.exists("c1")
    store.admit("c1", "p1", 1)
    assert code_of(store.advance, "c1", "intake", expected_generation=1, new_generation=2,
                   manifest_sha256=digest) == "INVALID_ARGUMENT"
    assert store.get("c1").generation == 1


def test_a_manifest_digest_goes_only_with_a_step_that_takes_a_generation_in(store):
    store.admit("c1", "p1", 1)
    assert code_of(store.advance, "c1", "start_build", expected_generation=1, step_id=STEP1,
                   manifest_sha256="a" * 64) == "INVALID_ARGUMENT"
    built_case(store, "c2")
    assert code_of(store.advance, "c2", "reopen", expected_generation=2, manifest_sha256="a" * 64) == "INVALID_ARGUMENT"
    assert [c.kind for c in store.checkpoints("c1")] == ["admit"]
    assert store.get("c2").state == "BUILDING_CASE"


def test_a_corrupt_manifest_digest_in_the_store_is_integrity_error(tmp_path):
    ws = Workspace(tmp_path / "ws")
    with CheckpointStore(ws) as store:
        store.admit("c1", "p1", 1, manifest_sha256="a" * 64)
    with sqlite3.connect(ws.store_path) as conn:
        conn.execute("DROP TRIGGER checkpoints_append_only_update")
        conn.execute("UPDATE checkpoints SET manifest_sha256 = 'x'")
    conn.close()
    with CheckpointStore(ws) as store:
        assert code_of(store.recorded_manifest, "c1", 1) == "INTEGRITY_ERROR"


# ---------------------------------------------------------------- the happy path


def test_full_lifecycle(store):
    rec = store.admit("c1", "p1", 1)
    assert (rec.state, rec.analysis_revision, rec.generation, rec.blocked, rec.case_built) == ("VALIDATED", 1, 1, None, False)
    assert code_of(store.admit, "c1", "p1", 1) == "CASE_EXISTS"
    store.advance("c1", "intake", expected_generation=1, new_generation=2)
    store.advance("c1", "start_build", expected_generation=2, step_id=STEP1)
    built = store.advance(
        "c1", "case_built", expected_generation=2, step_id=STEP1, request_hash="h1", new_generation=3, artifacts=["a", "b"]
    )
    assert (built.kind, built.state, built.generation, built.artifacts) == ("complete", "BUILDING_CASE", 3, ("a", "b"))
    assert store.get("c1").case_built
    assert store.confirmed("c1", STEP1) == built
    assert store.confirmed("c1", "case-build/v1/r2") is None
    store.advance("c1", "complete", expected_generation=3)
    assert store.get("c1").state == "COMPLETED"
    reopened = store.advance("c1", "reopen", expected_generation=3, detail={"by": "human:ann", "reason": "new logs"})
    assert (reopened.state, reopened.analysis_revision, reopened.detail) == ("REOPENED", 2, {"by": "human:ann", "reason": "new logs"})
    rec = store.get("c1")
    assert (rec.state, rec.analysis_revision, rec.case_built) == ("REOPENED", 2, False)
    log = store.checkpoints("c1")
    assert [c.kind for c in log] == ["admit", "intake", "start", "complete", "completed", "reopen"]
    assert [c.seq for c in log] == sorted(c.seq for c in log)
    assert all(c.time.endswith("+00:00") for c in log)  # wall clock lives in the log only
    assert store.exists("c1") and not store.exists("c2")
    assert store.case_ids() == ["c1"]


def test_data_survives_reopening_the_store(tmp_path):
    ws = Workspace(tmp_path)
    with CheckpointStore(ws) as s:
        built_case(s)
    with CheckpointStore(ws) as s:
        assert s.get("c1").generation == 2 and s.get("c1").case_built
        assert len(s.checkpoints("c1")) == 3
        assert s._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_unknown_case(store):
    assert code_of(store.get, "nope") == "UNKNOWN_CASE"
    assert code_of(store.advance, "nope", "start_build", expected_generation=1, step_id=STEP1) == "UNKNOWN_CASE"
    assert store.checkpoints("nope") == []
    assert code_of(store.get, "../x") == "UNSAFE_ID"


def test_create_false_leaves_workspace_untouched(tmp_path):
    assert code_of(CheckpointStore, Workspace(tmp_path / "ws"), create=False) == "UNKNOWN_CASE"
    assert not (tmp_path / "ws").exists()


# ---------------------------------------------------------------- refusals change nothing


def _dump(store):
    return (store.get("c1"), store.checkpoints("c1"))


@pytest.mark.parametrize(
    "transition,kwargs,code",
    [
        ("case_built", {"step_id": STEP1, "request_hash": "h", "new_generation": 2}, "ILLEGAL_TRANSITION"),
        ("complete", {}, "ILLEGAL_TRANSITION"),
        ("reopen", {}, "ILLEGAL_TRANSITION"),
        ("resume", {}, "ILLEGAL_TRANSITION"),
        ("start_build", {"step_id": STEP1}, None),
    ],
)
def test_illegal_from_validated(store, transition, kwargs, code):
    store.admit("c1", "p1", 1)
    before = _dump(store)
    if code is None:
        store.advance("c1", transition, expected_generation=1, **kwargs)
        return
    assert code_of(store.advance, "c1", transition, expected_generation=1, **kwargs) == code
    assert _dump(store) == before


def test_stale_generation_changes_nothing(store):
    store.admit("c1", "p1", 1)
    store.advance("c1", "intake", expected_generation=1, new_generation=2)
    before = _dump(store)
    for transition in TRANSITIONS:
        kwargs = {"step_id": STEP1, "request_hash": "h", "new_generation": 5} if transition in ("case_built", "intake") else {}
        if transition == "start_build":
            kwargs = {"step_id": STEP1}
        if transition == "block":
            kwargs = {"detail": BLOCK}
        assert code_of(store.advance, "c1", transition, expected_generation=1, **kwargs) == "STALE_GENERATION"
    assert _dump(store) == before


def test_an_interrupted_transaction_is_interrupted_not_corrupt(store):
    """A host program may interrupt the store's connection (here through a
    progress handler that asks sqlite to stop): the transaction rolls back,
    the code says INTERRUPTED, not INTEGRITY_ERROR, and the store works on."""
    store.admit("c1", "p1", 1)
    before = _dump(store)
    store._conn.set_progress_handler(lambda: 1, 1)  # noqa: SLF001 - what Connection.interrupt() does mid-statement
    try:
        assert code_of(store.advance, "c1", "intake", expected_generation=1, new_generation=2) == "INTERRUPTED"
    finally:
        store._conn.set_progress_handler(None, 1)  # noqa: SLF001
    assert _dump(store) == before
    assert store.advance("c1", "intake", expected_generation=1, new_generation=2).generation == 2


def test_bad_arguments(store):
    store.admit("c1", "p1", 1)
    before = _dump(store)
    bad = [
        ("teleport", {}),
        ("intake", {}),  # needs new_generation
        ("intake", {"new_generation": 1}),  # not newer
        ("case_built", {"new_generation": 2}),  # needs step_id and request_hash
        ("block", {}),
        ("block", {"detail": {"code": "", "route": "r"}}),
        ("block", {"detail": {"code": "X", "route": "r", "retry_after": -1}}),
        ("block", {"detail": {"code": "X", "route": "r", "surprise": 1}}),
        ("start_build", {"step_id": STEP1, "detail": {"x": float("nan")}}),
        ("start_build", {}),  # needs step_id
        ("start_build", {"step_id": "garbage"}),
        ("start_build", {"step_id": "case-build/v1/r0"}),
        ("start_build", {"step_id": "case-build/v1/r1/"}),
        ("start_build", {"step_id": "case-build/v1/r1\n"}),
        ("start_build", {"step_id": 1}),
        ("case_built", {"step_id": "case-build/v1/rx", "request_hash": "h", "new_generation": 2}),
    ]
    for transition, kwargs in bad:
        assert code_of(store.advance, "c1", transition, expected_generation=1, **kwargs) == "INVALID_ARGUMENT", transition
    assert code_of(store.advance, "c1", "start_build", expected_generation=True) == "INVALID_ARGUMENT"
    assert _dump(store) == before


# ---------------------------------------------------------------- replay, reopen, block


def test_replay_of_confirmed_case_built_with_old_generation(store):
    built = built_case(store)
    store.advance("c1", "intake", expected_generation=2, new_generation=3)
    before = _dump(store)
    again = store.advance("c1", "case_built", expected_generation=1, step_id=STEP1, request_hash="h1", new_generation=2)
    assert again == built
    assert _dump(store) == before
    # A different request for the same revision is not a replay.
    assert code_of(
        store.advance, "c1", "case_built", expected_generation=3, step_id=STEP1, request_hash="h2", new_generation=4
    ) == "REOPEN_REQUIRED"
    assert code_of(
        store.advance, "c1", "case_built", expected_generation=1, step_id=STEP1, request_hash="h2", new_generation=4
    ) == "STALE_GENERATION"
    assert _dump(store) == before


def test_replay_works_in_any_later_state(store):
    built = built_case(store)
    store.advance("c1", "complete", expected_generation=2)
    store.advance("c1", "reopen", expected_generation=2)
    assert store.advance("c1", "case_built", expected_generation=1, step_id=STEP1, request_hash="h1", new_generation=2) == built


def test_reopen_rules(store):
    store.admit("c1", "p1", 1)
    store.advance("c1", "start_build", expected_generation=1, step_id=STEP1)
    assert code_of(store.advance, "c1", "reopen", expected_generation=1) == "ILLEGAL_TRANSITION"  # nothing built yet
    store.advance("c1", "case_built", expected_generation=1, step_id=STEP1, request_hash="h", new_generation=2)
    cp = store.advance("c1", "reopen", expected_generation=2, new_generation=3)
    assert (cp.state, cp.analysis_revision, cp.generation) == ("REOPENED", 2, 3)
    assert code_of(store.advance, "c1", "reopen", expected_generation=3) == "ILLEGAL_TRANSITION"
    assert code_of(store.advance, "c1", "complete", expected_generation=3) == "ILLEGAL_TRANSITION"
    # The new revision builds again under its own step id.
    assert code_of(store.advance, "c1", "start_build", expected_generation=3, step_id=STEP1) == "ILLEGAL_TRANSITION"
    store.advance("c1", "start_build", expected_generation=3, step_id="case-build/v1/r2")
    store.advance("c1", "case_built", expected_generation=3, step_id="case-build/v1/r2", request_hash="h", new_generation=4)
    assert store.get("c1").case_built


def test_block_and_resume_return_to_the_state_before(store):
    built_case(store)
    cp = store.advance("c1", "block", expected_generation=2, detail=BLOCK)
    assert cp.state == "BLOCKED"
    rec = store.get("c1")
    assert rec.blocked == {"code": "RESEARCH_UNAVAILABLE", "route": "research", "retry_after": 60, "prior_state": "BUILDING_CASE"}
    assert code_of(store.advance, "c1", "block", expected_generation=2, detail=BLOCK) == "ILLEGAL_TRANSITION"
    for transition in ("start_build", "complete", "reopen"):
        kwargs = {"step_id": STEP1} if transition == "start_build" else {}
        assert code_of(store.advance, "c1", transition, expected_generation=2, **kwargs) == "ILLEGAL_TRANSITION"
    # Intake is recorded while blocked (the package already holds that generation).
    store.advance("c1", "intake", expected_generation=2, new_generation=3)
    assert store.get("c1").state == "BLOCKED" and store.get("c1").blocked["prior_state"] == "BUILDING_CASE"
    cp = store.advance("c1", "resume", expected_generation=3)
    assert cp.state == "BUILDING_CASE"
    rec = store.get("c1")
    assert (rec.state, rec.blocked, rec.generation) == ("BUILDING_CASE", None, 3)


def test_intake_refused_when_completed(store):
    built_case(store)
    store.advance("c1", "complete", expected_generation=2)
    assert code_of(store.advance, "c1", "intake", expected_generation=2, new_generation=3) == "ILLEGAL_TRANSITION"


def test_intake_refused_while_blocked_from_completed(store):
    """COMPLETED -> block -> intake -> resume must not be a way to new inputs without a reopen."""
    built_case(store)
    store.advance("c1", "complete", expected_generation=2)
    store.advance("c1", "block", expected_generation=2, detail=BLOCK)
    before = _dump(store)
    assert code_of(store.advance, "c1", "intake", expected_generation=2, new_generation=3) == "REOPEN_REQUIRED"
    assert _dump(store) == before
    store.advance("c1", "resume", expected_generation=2)
    rec = store.get("c1")
    assert (rec.state, rec.generation) == ("COMPLETED", 2)
    # The way to new inputs is a reopen.
    store.advance("c1", "reopen", expected_generation=2)
    store.advance("c1", "intake", expected_generation=2, new_generation=3)
    assert store.get("c1").generation == 3


def test_intake_while_blocked_from_other_states_still_recorded(store):
    store.admit("c1", "p1", 1)
    store.advance("c1", "block", expected_generation=1, detail=BLOCK)
    store.advance("c1", "intake", expected_generation=1, new_generation=2)
    rec = store.get("c1")
    assert (rec.state, rec.generation, rec.blocked["prior_state"]) == ("BLOCKED", 2, "VALIDATED")


def test_case_built_refuses_a_step_of_another_revision(store):
    """At revision 2 a case_built naming revision 1's step would rewrite what r1 confirmed."""
    built_case(store)
    store.advance("c1", "reopen", expected_generation=2)
    store.advance("c1", "start_build", expected_generation=2, step_id="case-build/v1/r2")
    before = _dump(store)
    for step in (STEP1, "case-build/v1/r3", "case-build/v2/r2"):
        assert code_of(
            store.advance, "c1", "case_built", expected_generation=2, step_id=step, request_hash="h9", new_generation=3
        ) == "ILLEGAL_TRANSITION", step
    assert code_of(
        store.advance, "c1", "case_built", expected_generation=2, step_id="garbage", request_hash="h9", new_generation=3
    ) == "INVALID_ARGUMENT"
    assert _dump(store) == before
    assert store.confirmed("c1", STEP1).request_hash == "h1"  # what revision 1 confirmed is untouched
    assert not store.get("c1").case_built
    # The replay of revision 1's own confirmed request is still a replay.
    assert store.advance(
        "c1", "case_built", expected_generation=1, step_id=STEP1, request_hash="h1", new_generation=2
    ).request_hash == "h1"
    assert _dump(store) == before
    cp = store.advance("c1", "case_built", expected_generation=2, step_id="case-build/v1/r2", request_hash="h2", new_generation=3)
    assert (cp.step_id, cp.analysis_revision, cp.generation) == ("case-build/v1/r2", 2, 3)


@pytest.mark.parametrize("new_generation", [0, 1, 2])
def test_case_built_needs_a_newer_generation(store, new_generation):
    store.admit("c1", "p1", 1)
    store.advance("c1", "intake", expected_generation=1, new_generation=2)
    store.advance("c1", "start_build", expected_generation=2, step_id=STEP1)
    before = _dump(store)
    assert code_of(
        store.advance, "c1", "case_built", expected_generation=2, step_id=STEP1, request_hash="h", new_generation=new_generation
    ) == "ILLEGAL_TRANSITION"
    assert _dump(store) == before
    assert store.advance("c1", "case_built", expected_generation=2, step_id=STEP1, request_hash="h", new_generation=3).generation == 3


def test_step_id_matches_the_plan():
    from pipeline import BUILDER_VERSION
    from pipeline.lifecycle import step_id_for
    from pipeline.plan import step_id_for as plan_step_id_for

    for revision in (1, 2, 17):
        assert step_id_for(revision) == plan_step_id_for(revision) == f"case-build/v{BUILDER_VERSION}/r{revision}"


# ---------------------------------------------------------------- storage guarantees


def test_log_is_append_only(store):
    built_case(store)
    conn = sqlite3.connect(store.workspace.store_path)
    try:
        for sql in ("UPDATE checkpoints SET request_hash = 'forged'", "DELETE FROM checkpoints"):
            with pytest.raises(sqlite3.IntegrityError, match="append-only"):
                conn.execute(sql)
    finally:
        conn.close()
    assert len(store.checkpoints("c1")) == 3


def test_busy_store_is_lock_timeout_and_changes_nothing(tmp_path):
    ws = Workspace(tmp_path)
    with CheckpointStore(ws) as s:
        s.admit("c1", "p1", 1)
    other = sqlite3.connect(ws.store_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with CheckpointStore(ws, busy_timeout=0.2) as s:
            started = time.monotonic()
            assert code_of(s.advance, "c1", "start_build", expected_generation=1, step_id=STEP1) == "LOCK_TIMEOUT"
            assert time.monotonic() - started >= 0.15
    finally:
        other.execute("ROLLBACK")
        other.close()
    with CheckpointStore(ws) as s:
        assert s.get("c1").state == "VALIDATED" and len(s.checkpoints("c1")) == 1


@pytest.mark.parametrize("below", ["", "sub"])
def test_a_workspace_that_is_a_file_is_a_coded_error_never_a_bare_oserror(tmp_path, below):
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    ws = Workspace(afile / below if below else afile)
    with pytest.raises(VianoError) as info:
        CheckpointStore(ws)
    assert info.value.code == "INVALID_ARGUMENT" and "not a directory" in info.value.message
    assert afile.read_bytes() == b"x"


def test_garbage_store_is_integrity_error(tmp_path):
    ws = Workspace(tmp_path)
    ws.store_path.write_bytes(b"this is not a database at all" * 200)
    assert code_of(CheckpointStore, ws) == "INTEGRITY_ERROR"
    assert ws.store_path.read_bytes() == b"this is not a database at all" * 200  # not reset


def test_truncated_store_is_integrity_error(tmp_path):
    ws = Workspace(tmp_path)
    with CheckpointStore(ws) as s:
        for i in range(40):
            s.admit(f"c{i}", "p" * 100, 1)
    data = ws.store_path.read_bytes()
    assert len(data) > 8192
    ws.store_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(VianoError) as info:
        with CheckpointStore(ws) as s:
            s.case_ids()
            s.checkpoints("c39")
    assert info.value.code == "INTEGRITY_ERROR"


def test_a_store_failing_its_integrity_check_is_named_on_one_line(tmp_path):
    """A page overwritten inside the store: quick_check's findings, on one
    line (no list repr escaped twice), naming the store file."""
    ws = Workspace(tmp_path)
    with CheckpointStore(ws) as s:
        for i in range(120):
            s.admit(f"c{i}", "p" * 100, 1)
    data = bytearray(ws.store_path.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[2 * page + 100 : 3 * page] = b"\xff" * (page - 100)  # inside a table page, past its header
    ws.store_path.write_bytes(bytes(data))
    with pytest.raises(VianoError) as info:
        with CheckpointStore(ws) as s:
            s.case_ids()
    assert info.value.code == "INTEGRITY_ERROR"
    assert info.value.path == "checkpoints.sqlite3"
    assert "['" not in str(info.value) and "\\" not in str(info.value), str(info.value)


def test_a_store_whose_header_forbids_writing_is_integrity_error_not_io(tmp_path):
    """A header's file-format write version above 2 (damage; a read version
    above 2 is "not a database" already) makes SQLite open the store read-only: every write said IO_ERROR "attempt to write a readonly
    database", on a file and filesystem that can be written. Found by a
    review's page-level damage sweep of the store."""
    ws = Workspace(tmp_path)
    with CheckpointStore(ws) as s:
        s.admit("c1", "p1", 1)
    data = bytearray(ws.store_path.read_bytes())
    assert data[18] in (1, 2)
    data[18] = 3
    ws.store_path.write_bytes(bytes(data))
    with pytest.raises(VianoError) as info:
        with CheckpointStore(ws) as s:
            s.admit("c2", "p2", 1)
    assert info.value.code == "INTEGRITY_ERROR" and info.value.path == "checkpoints.sqlite3"
    assert "header" in str(info.value)
    assert ws.store_path.read_bytes() == bytes(data)  # not reset


def test_foreign_sqlite_file_is_integrity_error(tmp_path):
    ws = Workspace(tmp_path)
    conn = sqlite3.connect(ws.store_path)
    conn.execute("CREATE TABLE cases (x)")
    conn.commit()
    conn.close()
    with pytest.raises(VianoError) as info:
        with CheckpointStore(ws) as s:
            s.get("c1")
    assert info.value.code == "INTEGRITY_ERROR"


# ---------------------------------------------------------------- races between real processes


def test_two_processes_race_advance(tmp_path):
    ws = Workspace(tmp_path / "ws")
    with CheckpointStore(ws) as s:
        s.admit("c1", "p1", 1)
    rounds = 15
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = [
        subprocess.Popen([sys.executable, str(PROCS / "race_advance.py"), str(ws.root), "c1", who, str(rounds), str(sync)])
        for who in ("A", "B")
    ]
    try:
        time.sleep(0.3)
        for rnd in range(1, rounds + 1):
            (sync / f"go-{rnd}").touch()
            deadline = time.monotonic() + 30
            paths = [sync / f"res-{rnd}-{who}.json" for who in ("A", "B")]
            while not all(p.exists() for p in paths):
                assert all(p.poll() in (None, 0) for p in procs), "a racer died"
                assert time.monotonic() < deadline
                time.sleep(0.001)
            outcomes = sorted(json.loads(p.read_text())["outcome"] for p in paths)
            assert outcomes == ["STALE_GENERATION", "won"], (rnd, outcomes)
    finally:
        for proc in procs:
            if proc.wait(timeout=30) != 0:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0]
    with CheckpointStore(ws) as s:
        assert s.get("c1").generation == rounds + 1  # rose exactly once per round
        intakes = [c for c in s.checkpoints("c1") if c.kind == "intake"]
        assert [c.generation for c in intakes] == list(range(2, rounds + 2))


# ---------------------------------------------------------------- model-based


class Model:
    """The lifecycle rules of ARCHITECTURE.md section 4, written independently of the store."""

    def __init__(self):
        self.cases: dict[str, dict] = {}

    def admit(self, case_id):
        if case_id in self.cases:
            return "CASE_EXISTS"
        self.cases[case_id] = {"state": "VALIDATED", "rev": 1, "gen": 1, "prior": None, "built": {}, "log": 1}
        return None

    def advance(self, case_id, transition, expected, step, request_hash, new_gen):
        """``step`` is (builder version, revision) or None for a malformed step id."""
        if transition in ("start_build", "case_built") and step is None:
            return "INVALID_ARGUMENT", None  # checked before the case is even looked up
        c = self.cases.get(case_id)
        if c is None:
            return "UNKNOWN_CASE", None
        if transition == "case_built":
            for rev, (confirmed_step, rh) in c["built"].items():
                if confirmed_step == step and rh == request_hash:
                    return None, ("replay", rev)
        if expected != c["gen"]:
            return "STALE_GENERATION", None
        state, built_now = c["state"], c["rev"] in c["built"]
        # Only the current revision, built by this builder, may start or confirm a build.
        own_step = step == (BUILDER_VERSION, c["rev"])
        if transition == "start_build":
            if state not in ("VALIDATED", "REOPENED"):
                return "ILLEGAL_TRANSITION", None
            if not own_step:
                return "ILLEGAL_TRANSITION", None
            c["state"] = "BUILDING_CASE"
        elif transition == "case_built":
            if state != "BUILDING_CASE":
                return "ILLEGAL_TRANSITION", None
            if not own_step:
                return "ILLEGAL_TRANSITION", None
            if built_now:
                return "REOPEN_REQUIRED", None
            if new_gen <= c["gen"]:  # a built case is always a new generation
                return "ILLEGAL_TRANSITION", None
            c["built"][c["rev"]] = (step, request_hash)
            c["gen"] = new_gen
        elif transition == "intake":
            if state == "COMPLETED":
                return "ILLEGAL_TRANSITION", None
            if state == "BLOCKED" and c["prior"] == "COMPLETED":
                return "REOPEN_REQUIRED", None  # a completed case takes new inputs only after a reopen
            if new_gen <= c["gen"]:
                return "INVALID_ARGUMENT", None
            c["gen"] = new_gen
        elif transition == "reopen":
            if not (state == "COMPLETED" or (state == "BUILDING_CASE" and built_now)):
                return "ILLEGAL_TRANSITION", None
            c["state"], c["rev"] = "REOPENED", c["rev"] + 1
        elif transition == "block":
            if state == "BLOCKED":
                return "ILLEGAL_TRANSITION", None
            c["prior"], c["state"] = state, "BLOCKED"
        elif transition == "resume":
            if state != "BLOCKED":
                return "ILLEGAL_TRANSITION", None
            c["state"], c["prior"] = c["prior"], None
        elif transition == "complete":
            if not (state == "BUILDING_CASE" and built_now):
                return "ILLEGAL_TRANSITION", None
            c["state"] = "COMPLETED"
        c["log"] += 1
        return None, None


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="viano-lifecycle-")
        self.store = CheckpointStore(Workspace(self.dir))
        self.model = Model()
        self.logs: dict[str, list] = {}
        self.replays: dict[tuple, object] = {}

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @initialize()
    def first_case(self):
        assert self.model.admit("a") is None
        self.store.admit("a", "p", 1)

    @rule(case_id=st.sampled_from(["a", "b"]))
    def admit(self, case_id):
        expected = self.model.admit(case_id)
        if expected:
            with pytest.raises(VianoError) as info:
                self.store.admit(case_id, "p", 1)
            assert info.value.code == expected
        else:
            assert self.store.admit(case_id, "p", 1).state == "VALIDATED"

    @rule(
        case_id=st.sampled_from(["a", "b"]),
        transition=st.sampled_from(TRANSITIONS),
        gen_offset=st.sampled_from([0, 0, 0, 0, -1, 1]),
        step_kind=st.sampled_from(["current", "current", "current", "previous", "next", "other_builder", "garbage"]),
        request_hash=st.sampled_from(["h1", "h2"]),
        new_gen_offset=st.sampled_from([1, 1, 1, 0, -1]),
    )
    def advance(self, case_id, transition, gen_offset, step_kind, request_hash, new_gen_offset):
        c = self.model.cases.get(case_id)
        gen = c["gen"] if c else 1
        rev = c["rev"] if c else 1
        expected_gen = max(0, gen + gen_offset)
        step_rev = {"previous": rev - 1, "next": rev + 1}.get(step_kind, rev)
        version = "9" if step_kind == "other_builder" else BUILDER_VERSION
        if step_kind == "garbage":
            step_id, step = "case-build/latest", None
        else:
            step_id = f"case-build/v{version}/r{step_rev}"
            step = (version, step_rev) if step_rev >= 1 else None  # r0 is not a revision
        new_gen = max(0, gen + new_gen_offset)
        kwargs = {"expected_generation": expected_gen}
        if transition == "case_built":
            kwargs.update(step_id=step_id, request_hash=request_hash, new_generation=new_gen)
        elif transition == "start_build":
            kwargs.update(step_id=step_id)
        elif transition == "intake":
            kwargs.update(new_generation=new_gen)
        elif transition == "block":
            kwargs.update(detail=BLOCK)
        code, replay = self.model.advance(case_id, transition, expected_gen, step, request_hash, new_gen)
        if code:
            with pytest.raises(VianoError) as info:
                self.store.advance(case_id, transition, **kwargs)
            assert info.value.code == code, (transition, kwargs, info.value)
            return
        cp = self.store.advance(case_id, transition, **kwargs)
        if replay:
            assert cp == self.replays[(case_id, step_id, request_hash)]
        else:
            assert cp.transition == transition
            if transition == "case_built":
                self.replays[(case_id, step_id, request_hash)] = cp

    # Random single steps rarely line up into a long legal path (COMPLETED,
    # then BLOCKED, ...), so this rule walks one with the right arguments and
    # draws only the last step's step id and new generation; every step is
    # still checked against the model, and random steps go on from there.
    PATHS = {
        "start": ("start_build",),
        "build": ("start_build", "case_built"),
        "complete_block_intake": ("start_build", "case_built", "complete", "block", "intake"),
        "reopen_start": ("reopen", "start_build"),
        "reopen_build": ("reopen", "start_build", "case_built"),
    }

    @rule(
        case_id=st.sampled_from(["a", "b"]),
        path=st.sampled_from(sorted(PATHS)),
        request_hash=st.sampled_from(["h1", "h2"]),
        step_kind=st.sampled_from(["current", "previous", "next", "other_builder", "garbage"]),
        new_gen_offset=st.sampled_from([1, 0, -1]),
    )
    def walk(self, case_id, path, request_hash, step_kind, new_gen_offset):
        *steps, last = self.PATHS[path]
        for transition in steps:
            self.advance(case_id, transition, gen_offset=0, step_kind="current", request_hash=request_hash, new_gen_offset=1)
        self.advance(case_id, last, gen_offset=0, step_kind=step_kind, request_hash=request_hash, new_gen_offset=new_gen_offset)

    @invariant()
    def store_matches_model(self):
        for case_id in ("a", "b"):
            c = self.model.cases.get(case_id)
            if c is None:
                assert not self.store.exists(case_id)
                continue
            rec = self.store.get(case_id)
            assert rec.state in STATES
            assert (rec.state, rec.analysis_revision, rec.generation) == (c["state"], c["rev"], c["gen"])
            assert rec.case_built == (c["rev"] in c["built"])
            assert (rec.blocked or {}).get("prior_state") == c["prior"]
            log = self.store.checkpoints(case_id)
            assert len(log) == c["log"]
            previous = self.logs.get(case_id, [])
            assert log[: len(previous)] == previous  # append-only: history never changes
            self.logs[case_id] = log


LifecycleMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_lifecycle_state_machine = LifecycleMachine.TestCase


_CREATE_UNDER_FILE_SIZE_LIMITS = r"""
import json, os, resource, shutil, signal, sys
from pipeline.errors import VianoError
from pipeline.lifecycle import CheckpointStore
from pipeline.workspace import Workspace

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit is then EFBIG, as a full disk is ENOSPC
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
base = sys.argv[1]
outcomes = {}
for limit in range(4096, 128 * 1024 + 1, 4096):
    root = os.path.join(base, str(limit))
    os.makedirs(root)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        CheckpointStore(Workspace(root)).close()
        outcomes[limit] = "ok"
    except VianoError as error:
        outcomes[limit] = error.code
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
print(json.dumps(outcomes))
"""


def test_a_store_that_cannot_be_written_when_first_made_is_io_error_never_corrupt(tmp_path):
    """Making a new store's schema, every write past a file size limit fails
    (as on a full disk). A COMMIT that fails that way has rolled back already;
    the ROLLBACK after it failed with "no transaction is active", which was
    reported as INTEGRITY_ERROR ("corrupt or not ours"). Each limit, in a
    real process of its own (file size limits are per process)."""
    run = subprocess.run([sys.executable, "-c", _CREATE_UNDER_FILE_SIZE_LIMITS, str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr
    outcomes = json.loads(run.stdout)
    assert set(outcomes.values()) == {"IO_ERROR", "ok"}, outcomes
    # Once a limit lets the store be made, every larger one does too.
    first_ok = min(int(limit) for limit, outcome in outcomes.items() if outcome == "ok")
    assert all(outcome == "ok" for limit, outcome in outcomes.items() if int(limit) >= first_ok), outcomes


@pytest.mark.parametrize(("euid", "blocks", "bavail", "bfree", "files", "favail", "ffree", "full"), [
    (1000, 1000, 10, 10, 100, 5, 5, True),        # 40 KiB left
    (1000, 1000, 500, 500, 100, 5, 5, False),     # 2 MiB left
    (0, 1000, 0, 500, 100, 5, 5, False),          # root may use the reserved blocks
    (1000, 1000, 0, 500, 100, 5, 5, True),        # others may not
    (1000, 1000, 500, 500, 100, 0, 0, True),      # no inode left
    (0, 1000, 500, 500, 100, 0, 3, False),        # root's reserved inodes
    (1000, 0, 0, 0, 0, 0, 0, False),              # sizes unknown (tmpfs size=0, some FUSE)
])
def test_out_of_space_judges_what_this_process_may_still_write(monkeypatch, euid, blocks, bavail, bfree, files, favail, ffree, full):
    import os
    from types import SimpleNamespace

    from pipeline import lifecycle

    found = SimpleNamespace(f_blocks=blocks, f_bavail=bavail, f_bfree=bfree, f_frsize=4096, f_files=files, f_favail=favail, f_ffree=ffree)
    monkeypatch.setattr(os, "statvfs", lambda directory: found)
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    assert lifecycle.out_of_space("/anywhere") is full


def test_a_store_read_without_its_shared_memory_on_a_full_disk_reports_apparent_damage_as_a_read_to_retry(tmp_path):
    from pipeline.errors import IntegrityError
    from pipeline.lifecycle import CheckpointStore

    store = CheckpointStore(Workspace(tmp_path / "ws"))
    try:
        damage = IntegrityError("INTEGRITY_ERROR", "database disk image is malformed", path="checkpoints.sqlite3")
        assert store._unsure(damage) is damage
        store._read_unsure = ("the disk is full", "free some space and run it again")
        unsure = store._unsure(damage)
        assert unsure.code == "IO_ERROR" and "could not be read consistently: the disk is full" in unsure.message
        assert "database disk image is malformed" in unsure.message and unsure.path == "checkpoints.sqlite3"
    finally:
        store.close()


def test_a_reader_on_a_full_disk_takes_the_normal_locked_read_when_it_works(tmp_path, monkeypatch):
    # An immutable read beside a writer that opened the store before the disk
    # filled may meet half-written pages (5 in 59,176 reads gave a false
    # INTEGRITY_ERROR in session 22's re-review): it is only the fallback.
    from pipeline import lifecycle

    ws = Workspace(tmp_path / "ws")
    lifecycle.CheckpointStore(ws).close()
    monkeypatch.setattr(lifecycle, "out_of_space", lambda directory: True)
    conn, unsure, _immutable = lifecycle._connect_read_only(ws.store_path, 1.0)
    conn.close()
    assert unsure is None
    store = lifecycle.CheckpointStore(ws, read_only=True)
    try:
        assert store._read_unsure is None
    finally:
        store.close()


def test_a_torn_schema_read_on_a_full_disk_is_a_read_to_retry(tmp_path, monkeypatch):
    # Half-written pages can also make the schema look foreign, not only
    # fail SQLite's own checks.
    from pipeline import lifecycle
    from pipeline.errors import IntegrityError

    ws = Workspace(tmp_path / "ws")
    lifecycle.CheckpointStore(ws).close()
    real = lifecycle._connect_read_only
    monkeypatch.setattr(lifecycle, "_connect_read_only", lambda path, timeout: (real(path, timeout)[0], ("the disk is full", "free some space"), True))

    def foreign(self):
        raise IntegrityError("INTEGRITY_ERROR", "checkpoint store has tables but no schema version: not ours")

    monkeypatch.setattr(lifecycle.CheckpointStore, "_check_schema", foreign)
    with pytest.raises(lifecycle.LifecycleError) as info:
        lifecycle.CheckpointStore(ws, read_only=True)
    assert info.value.code == "IO_ERROR" and "could not be read consistently" in info.value.message


def _bytes_read_opening(ws, read_only=False) -> int:
    """What one opening and closing of the store read through read() calls
    (/proc/self/io's rchar, page cache hits included)."""
    def rchar():
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))

    before = rchar()
    CheckpointStore(ws, read_only=read_only).close()
    return rchar() - before


def _a_store_of_many_cases(tmp_path) -> Workspace:
    ws = Workspace(tmp_path / "ws")
    with CheckpointStore(ws) as s:
        s.admit("c0", "0" * 64, 1)
        s.advance("c0", "start_build", expected_generation=1, step_id=STEP1)
    # Thousands of cases through the store's own calls would take a minute
    # of fsyncs; their rows, copied, are the same shape.
    conn = sqlite3.connect(ws.store_path, isolation_level=None)
    conn.execute("""WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3000)
        INSERT INTO cases SELECT 'c' || i, package_id, state, analysis_revision, generation, blocked, prior_state
        FROM cases, n WHERE case_id = 'c0'""")
    conn.execute("""WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3000)
        INSERT INTO checkpoints (case_id, transition, kind, step_id, request_hash, generation, analysis_revision, state,
        artifacts, detail, time) SELECT 'c' || i, transition, kind, step_id, request_hash, generation, analysis_revision,
        state, artifacts, detail, time FROM checkpoints, n WHERE case_id = 'c0' ORDER BY i, seq""")
    conn.close()
    assert ws.store_path.stat().st_size > 512 * 1024
    return ws


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_the_store_is_checked_whole_once_a_process_while_it_stays_unchanged(tmp_path, monkeypatch):
    """quick_check reads the whole store; a build opened it twice and status
    three times, each reading it again (a no-op build of a store with 20,000
    more cases took 0.25 s against 0.15)."""
    from pipeline import lifecycle

    ws = _a_store_of_many_cases(tmp_path)
    size = ws.store_path.stat().st_size
    monkeypatch.setattr(lifecycle, "_FOUND_SOUND", {}, raising=False)
    # Files written within the last two seconds are never taken as unchanged
    # (below); this store was just written.
    monkeypatch.setattr(lifecycle, "_SETTLED_NS", 0, raising=False)
    assert _bytes_read_opening(ws, read_only=True) >= size
    assert _bytes_read_opening(ws, read_only=True) < size / 10
    assert _bytes_read_opening(ws) < size / 10


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_a_store_written_moments_ago_is_checked_again(tmp_path, monkeypatch):
    """A change in the same clock tick as the last look could carry the same
    times: a store changed within the last seconds is checked at every opening."""
    from pipeline import lifecycle

    ws = _a_store_of_many_cases(tmp_path)
    size = ws.store_path.stat().st_size
    monkeypatch.setattr(lifecycle, "_FOUND_SOUND", {}, raising=False)
    assert _bytes_read_opening(ws) >= size
    assert _bytes_read_opening(ws) >= size


def _damage_a_page_in_place(ws) -> None:
    # A page in the middle: one of the checkpoints', which opening the store
    # reads only through quick_check.
    data = bytearray(ws.store_path.read_bytes())
    page = 4096
    middle = len(data) // page // 2 * page
    data[middle + 100 : middle + page] = b"\xff" * (page - 100)
    with open(ws.store_path, "r+b") as store_file:
        store_file.write(bytes(data))


def test_a_store_damaged_after_it_was_found_sound_or_while_open_is_still_refused(tmp_path, monkeypatch):
    """A page overwritten in place (same size, same inode) after this process
    found the store sound, or while a connection that found it sound was
    open (the memo took the files as they were at the close, damage and all,
    in its first version; session 24's re-review): the next opening checks."""
    from pipeline import lifecycle

    after, meanwhile = _a_store_of_many_cases(tmp_path / "after"), _a_store_of_many_cases(tmp_path / "meanwhile")
    monkeypatch.setattr(lifecycle, "_FOUND_SOUND", {})
    time.sleep(2.1)  # past _SETTLED_NS, so that a look is remembered
    CheckpointStore(after).close()
    assert lifecycle._found_sound_before(lifecycle._store_files_now(after.store_path))
    _damage_a_page_in_place(after)

    store = CheckpointStore(meanwhile, read_only=True)
    _damage_a_page_in_place(meanwhile)
    time.sleep(2.1)  # settled by the close, as the damage of a host's long-open store would be
    store.close()
    assert not lifecycle._found_sound_before(lifecycle._store_files_now(meanwhile.store_path))
    for ws in (after, meanwhile):
        with pytest.raises(VianoError) as info:
            CheckpointStore(ws, read_only=True)
        assert info.value.code == "INTEGRITY_ERROR" and "integrity check" in info.value.message


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_a_store_found_sound_is_checked_again_after_a_while(tmp_path, monkeypatch):
    """A change that leaves no time behind (a write through a shared mapping,
    damage below the filesystem) is not seen by the memo: a long-running
    host still checks its store again after a minute."""
    from pipeline import lifecycle

    ws = _a_store_of_many_cases(tmp_path)
    size = ws.store_path.stat().st_size
    monkeypatch.setattr(lifecycle, "_FOUND_SOUND", {})
    monkeypatch.setattr(lifecycle, "_SETTLED_NS", 0)
    monkeypatch.setattr(lifecycle, "_TRUSTED_FOR_NS", 0)
    assert _bytes_read_opening(ws) >= size
    assert _bytes_read_opening(ws) >= size

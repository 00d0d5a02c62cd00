"""End to end: recovery paths found by review — crashed publications leave
nothing that blocks later work, reuse survives policy changes, every failure
is one line, superseded inputs are visible."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.build import CaseBuilder
from pipeline.lifecycle import CheckpointStore
from pipeline.limits import CaseBuilderLimits
from pipeline.workspace import Workspace
from tests.conftest import FIXTURES, REPO, doit_env
from tests.e2e import kit
from tests.e2e.test_build import standard_package


def _admitted(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    source = standard_package(tmp_path / "src")
    result = kit.doit("admit", "case=c1", f"source={source}", workspace=ws)
    assert result.returncode == 0, result.stderr
    return ws


def _one_line_error(result, code: str) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith(code + ": ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@contextlib.contextmanager
def _case_lock_held_by_another_process(ws: Path, ready: Path):
    """A real process holding the case lock of c1 meanwhile; let go (killed) on the way out."""
    holder = subprocess.Popen([sys.executable, str(REPO / "tests" / "procs" / "lock_holder.py"), str(ws), "c1", str(ready)],
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the lock holder never took the lock"
            time.sleep(0.01)
        yield
    finally:
        holder.kill()
        holder.wait()


@contextlib.contextmanager
def _sqlite_held_by_another_process(database: Path, *mode: str):
    """A real process holding ``database``'s write lock (or, with "exclusive", every lock) meanwhile."""
    holder = subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "procs" / "hold_sqlite_write.py"),
                               str(database), *mode], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def _report_append(tmp_path: Path, name: str, listed: list[str]) -> Path:
    return kit.make_append(
        tmp_path / f"app-{name}",
        files={f"original/{name}.json": kit.report(f"Report {name}", observations=[{"text": f"seen {name}"}])},
        index=kit.index(reports=listed + [f"original/{name}.json"], reproductions=["original/repro.json"]),
    )


def test_build_crashed_before_its_manifest_does_not_block_an_append_and_rebuild(tmp_path):
    ws = _admitted(tmp_path)
    crashed = kit.doit("build", "case=c1", workspace=ws, env_extra={"VIANO_CRASH_AT": "publish:after-content"})
    assert crashed.returncode != 0
    orphan = kit.package_dir(ws, "c1") / "content" / "case" / "revisions" / "0001" / "case.json"
    assert orphan.exists()  # linked, but no manifest lists it
    appended = kit.doit("append", "case=c1", f"source={_report_append(tmp_path, 'r9', ['original/report-a.json'])}", workspace=ws)
    assert appended.returncode == 0, appended.stderr
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    manifest = json.loads(kit.manifests(ws, "c1")[-1].read_text())
    assert manifest["artifacts"]["case"] == "case/revisions/0001/case.json"
    case = json.loads(orphan.read_text())
    assert case["case"]["package_generation"] == 2


def test_append_crashed_before_its_manifest_can_be_retried_corrected(tmp_path):
    ws = _admitted(tmp_path)
    first = _report_append(tmp_path, "r9", ["original/report-a.json"])
    crashed = kit.doit("append", "case=c1", f"source={first}", workspace=ws, env_extra={"VIANO_CRASH_AT": "publish:after-content"})
    assert crashed.returncode != 0
    corrected = kit.make_append(
        tmp_path / "corrected",
        files={"original/r9.json": kit.report("Report r9, corrected", observations=[{"text": "seen r9 again"}])},
        index=kit.index(reports=["original/report-a.json", "original/r9.json"]),
    )
    retried = kit.doit("append", "case=c1", f"source={corrected}", workspace=ws)
    assert retried.returncode == 0, retried.stderr
    content = kit.package_dir(ws, "c1") / "content"
    assert b"corrected" in (content / "original" / "r9.json").read_bytes()
    assert [p.name for p in kit.manifests(ws, "c1")] == ["000001.json", "000002.json"]


def test_an_append_links_its_staged_copy_into_the_package_and_a_kill_after_that_is_retried(tmp_path):
    """The file an append stages is the one it publishes (one copy of a
    large log, not two): killed after linking it, the package holds the new
    file (not yet listed) and the staging tree no longer names it; the
    retry publishes the same bytes."""
    ws = _admitted(tmp_path)
    data = os.urandom(3 << 20)
    source = kit.make_append(tmp_path / "app", files={"original/runtime/big.log": data},
                             index=kit.index(runtime=["original/runtime/big.log"]))
    crashed = kit.doit("append", "case=c1", f"source={source}", workspace=ws, env_extra={"VIANO_CRASH_AT": "publish:after-content"})
    assert crashed.returncode != 0
    linked = kit.package_dir(ws, "c1") / "content" / "original" / "runtime" / "big.log"
    assert linked.read_bytes() == data and not list((ws / ".staging").rglob("big.log"))
    assert "original/runtime/big.log" not in json.loads(kit.manifests(ws, "c1")[-1].read_text())["files"]
    retried = kit.doit("append", "case=c1", f"source={source}", workspace=ws)
    assert retried.returncode == 0, retried.stderr
    assert linked.read_bytes() == data
    assert not list((ws / ".staging").rglob("big.log"))
    manifest = json.loads(kit.manifests(ws, "c1")[-1].read_text())
    assert manifest["files"]["original/runtime/big.log"] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0


@pytest.mark.parametrize("records", ["*.manifest.msgpack", "*.json"])
def test_cache_records_damaged_in_a_way_that_still_decodes_are_made_again_not_published(tmp_path, records):
    """One changed byte inside a string of a cached parsed manifest (the
    base of the next manifest) or of an input's record (the case's
    statements) decodes as well as before. Found by session 18's review: the
    project version so changed was published in a new manifest and case."""
    twins = {}
    for name in ("damaged", "clean"):
        ws = _admitted(tmp_path / name)
        assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
        assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
        source = _report_append(tmp_path / name, "r9", ["original/report-a.json"])
        assert kit.doit("append", "case=c1", f"source={source}", workspace=ws).returncode == 0
        twins[name] = ws
    changed = 0
    for path in (twins["damaged"] / ".cache").rglob(records):
        data = path.read_bytes()
        for old, new in ((b"2.4.1", b"2.4.2"), (b"The switch remains off", b"The switch remains on!")):
            if old in data:
                path.write_bytes(data.replace(old, new))
                changed += 1
                break
    assert changed
    shutil.rmtree(twins["clean"] / ".cache")
    for ws in twins.values():
        built = kit.doit("build", "case=c1", workspace=ws)
        assert built.returncode == 0, built.stderr
    published = {name: {k: v for k, v in kit.tree_digest(ws).items() if k.startswith("cases/")} for name, ws in twins.items()}
    assert published["damaged"] == published["clean"]


def test_a_returning_index_may_list_only_new_documents_and_inherits_the_rest(tmp_path):
    """Seed 001: a returning index can add only new reports without losing old
    statements, facts or provenance -- also within one revision."""
    ws = _admitted(tmp_path)
    first = kit.make_append(tmp_path / "a1", files={"original/r8.json": kit.report("r8", observations=[{"text": "eight"}])},
                            index=kit.index(reports=["original/r8.json"]))
    second = kit.make_append(tmp_path / "a2", files={"original/r9.json": kit.report("r9", observations=[{"text": "nine"}])},
                             index=kit.index(reports=["original/r9.json"]))
    appended = kit.doit("append", "case=c1", f"source={first}", workspace=ws)
    assert appended.returncode == 0, appended.stderr
    assert "inherited" in appended.stderr and "original/report-a.json" in appended.stderr
    assert kit.doit("append", "case=c1", f"source={second}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    case = json.loads((kit.package_dir(ws, "c1") / "content/case/revisions/0001/case.json").read_text())
    assert [r["path"] for r in case["inputs"]["reports"]] == [
        "original/report-a.json", "original/report-b.json", "original/r8.json", "original/r9.json"]
    assert [r["path"] for r in case["inputs"]["reproductions"]] == ["original/repro.json"]
    assert [r["path"] for r in case["database_context"]] == ["original/db.sql"]
    assert len(case["runtime_facts"]["facts"]) == 2
    assert not [g for g in case["data_quality"]["gaps"] if g["code"] == "SUPERSEDED_INPUT"]
    texts = [s["text"] for s in case["human_observations"]["observations"]]
    assert texts[-2:] == ["eight", "nine"]


def test_reuse_survives_lowered_limits_and_a_cleared_cache(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    published = kit.package_dir(ws, "c1") / "content/case/revisions/0001/case.json"
    before = published.read_bytes()
    shutil.rmtree(ws / ".cache")
    store = CheckpointStore(Workspace(ws))
    try:
        tight = dataclasses.replace(CaseBuilderLimits(), documents=1, inline_fact_value=10**6)
        result = CaseBuilder(store, tight).build("c1", "pkg-1")
    finally:
        store.close()
    assert result["status"] == "reused"
    assert published.read_bytes() == before
    assert len(kit.manifests(ws, "c1")) == 2


def test_the_python_api_hands_its_progress_lines_to_the_caller(tmp_path, capfd):
    """A library build reports what it would print (here, what an append
    added) to the callable it was given, and nothing to stderr."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:qa", "reason=more", workspace=ws).returncode == 0
    extra = kit.make_append(tmp_path / "more", files={"original/report-new.json": kit.report("new")},
                            index=kit.index(reports=["original/report-new.json"]))
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    capfd.readouterr()
    lines: list[str] = []
    store = CheckpointStore(Workspace(ws))
    try:
        result = CaseBuilder(store, progress=lines.append).build("c1")
    finally:
        store.close()
    assert result["status"] == "published"
    assert any(line.startswith("assemble: 1 new document(s) appended to the ") for line in lines), lines
    assert all("\n" not in line for line in lines)
    assert capfd.readouterr().err == ""


def test_status_says_how_many_checkpoints_it_shows_and_whose_numbers_they_are(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("admit", "case=c2", f"source={standard_package(tmp_path / 'src2')}", workspace=ws).returncode == 0
    status = kit.doit("status", "case=c2", workspace=ws).stdout
    # The second case's first checkpoint is the store's second.
    assert "checkpoints (all 1, latest last; # numbers the workspace's store):\n  #2 - admit" in status, status
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    for round_ in range(3):
        assert kit.doit("reopen", "case=c1", "by=human:qa", f"reason=round {round_}", workspace=ws).returncode == 0
        assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    status = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "checkpoints (the last 8 of 12, latest last; # numbers the workspace's store):" in status, status
    listed = status.split("latest last; # numbers the workspace's store):\n", 1)[1].split("build outlook")[0]
    assert len(listed.splitlines()) == 8


def _built_then_reopen_killed_after_publishing(tmp_path) -> Path:
    """A built case whose reopen (by human:alice, "new logs") was published,
    then killed before its checkpoint."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    crashed = kit.doit("reopen", "case=c1", "by=human:alice", "reason=new logs", workspace=ws,
                       env_extra={"VIANO_CRASH_AT": "publish:after-manifest-link"})
    assert crashed.returncode != 0
    return ws


def test_a_case_at_the_highest_analysis_revision_is_not_reopened(tmp_path):
    """2^53 - 1 is the highest revision a package may declare; a reopen past
    it would publish a manifest no reader of the workspace takes."""
    source = kit.make_package(tmp_path / "src", files={"original/r.json": kit.report("r", observations=[{"text": "seen"}])},
                              index=kit.index(reports=["original/r.json"]))
    manifest = json.loads((source / "manifest.json").read_text())
    manifest["analysis_revision"] = 2**53 - 1
    kit.write_json(source / "manifest.json", manifest)
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    before = kit.tree_digest(ws)
    refused = kit.doit("reopen", "case=c1", "by=human:alice", "reason=more logs", workspace=ws)
    assert "at analysis revision 9007199254740991" in _one_line_error(refused, "ILLEGAL_TRANSITION")
    assert kit.tree_digest(ws) == before
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0 and "INTEGRITY_ERROR" not in status.stdout + status.stderr, status.stdout + status.stderr
    shutil.rmtree(ws / ".cache")
    rebuilt = kit.doit("build", "case=c1", workspace=ws)
    assert rebuilt.returncode == 0 and "confirmed at generation 2" in rebuilt.stdout, rebuilt.stdout + rebuilt.stderr
    assert kit.tree_digest(ws) == before  # reused: no new generation


def test_a_crashed_reopen_keeps_who_and_why(tmp_path):
    ws = _built_then_reopen_killed_after_publishing(tmp_path)
    status = kit.doit("status", "case=c1", workspace=ws)
    assert "not yet taken in: 3..3" in status.stdout  # status only observes
    rebuilt = kit.doit("build", "case=c1", workspace=ws)  # rolls the reopen forward, then builds r2
    assert rebuilt.returncode == 0, rebuilt.stderr
    store = CheckpointStore(Workspace(ws))
    try:
        reopen = [c for c in store.checkpoints("c1") if c.transition == "reopen"][-1]
    finally:
        store.close()
    assert reopen.detail["by"] == "human:alice" and reopen.detail["reason"] == "new logs"


def test_a_reopen_retried_after_it_was_published_says_so_and_a_different_one_is_still_refused(tmp_path):
    # The user (or a CI step) retries the very same command.
    ws = _built_then_reopen_killed_after_publishing(tmp_path)
    retried = kit.doit("reopen", "case=c1", "by=human:alice", "reason=new logs", workspace=ws)
    assert retried.returncode == 0, retried.stderr
    assert "case c1 is already reopened by this request: analysis revision 2, generation 3, state REOPENED" in retried.stdout
    before = kit.tree_digest(ws)
    again = kit.doit("reopen", "case=c1", "by=human:alice", "reason=new logs", workspace=ws)
    assert again.returncode == 0 and "already reopened by this request" in again.stdout
    other = _one_line_error(kit.doit("reopen", "case=c1", "by=human:bob", "reason=new logs", workspace=ws), "ILLEGAL_TRANSITION")
    assert "REOPENED without a confirmed case" in other
    _one_line_error(kit.doit("reopen", "case=c1", "by=human:alice", "reason=other logs", workspace=ws), "ILLEGAL_TRANSITION")
    assert kit.tree_digest(ws) == before
    assert len(kit.manifests(ws, "c1")) == 3


def test_export_after_a_lost_checkpoint_rolls_forward(tmp_path):
    ws = _admitted(tmp_path)
    crashed = kit.doit("build", "case=c1", workspace=ws, env_extra={"VIANO_CRASH_AT": "build:after-publish"})
    assert crashed.returncode != 0
    dest = tmp_path / "out"
    exported = kit.doit("export", "case=c1", f"dest={dest}", workspace=ws)
    assert exported.returncode == 0, exported.stderr
    assert (dest / "case.json").exists()


def test_append_cannot_list_a_generated_output(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=x", workspace=ws).returncode == 0
    bad = kit.make_append(tmp_path / "bad", files={}, index=kit.index(reports=["case/revisions/0001/case.json"]))
    before = kit.tree_digest(ws / "cases")
    line = _one_line_error(kit.doit("append", "case=c1", f"source={bad}", workspace=ws), "REFERENCE_UNSAFE")
    assert line.endswith("(case-inputs.json#/reports/0)")
    assert kit.tree_digest(ws / "cases") == before


def test_export_to_unusable_destinations_is_one_line(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _one_line_error(kit.doit("export", "case=c1", f"dest={blocker}/sub", workspace=ws), "IO_ERROR")
    clash = tmp_path / "clash"
    (clash / "case.json").mkdir(parents=True)
    _one_line_error(kit.doit("export", "case=c1", f"dest={clash}", workspace=ws), "CONTENT_CONFLICT")


def test_a_corrupt_dep_file_is_discarded_not_fatal(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    dep = ws / ".cache" / "c1" / "doit.sqlite3"
    dep.write_bytes(b"this is not sqlite" * 100)
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert len(kit.manifests(ws, "c1")) == 2
    with contextlib.closing(sqlite3.connect(dep)) as connection:  # closed: Python 3.13 warns of an unclosed one
        assert connection.execute("PRAGMA quick_check").fetchone() == ("ok",)


def test_export_after_a_reopen_pairs_the_case_with_the_manifest_that_published_it(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    dest = tmp_path / "out"
    exported = kit.doit("export", "case=c1", f"dest={dest}", workspace=ws)
    assert exported.returncode == 0, exported.stderr
    assert "revision 2 has no case yet" in exported.stderr
    manifest = json.loads((dest / "manifest.json").read_text())
    case = json.loads((dest / "case.json").read_text())
    assert manifest["analysis_revision"] == case["case"]["analysis_revision"] == 1
    assert manifest["package_generation"] == 2 and manifest["artifacts"]["case"] == "case/revisions/0001/case.json"


def test_a_damaged_cache_record_is_repaired_not_blamed_on_the_published_case(tmp_path):
    """RELIABILITY 43 too: the change keeps size and mtime, and is still seen."""
    import os

    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    cached = ws / ".cache" / "c1" / "out" / "case.json"
    stat = cached.stat()
    data = bytearray(cached.read_bytes())
    data[10] = ord("X") if data[10] != ord("X") else ord("Y")
    cached.write_bytes(bytes(data))
    os.utime(cached, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    rebuilt = kit.doit("build", "case=c1", workspace=ws)
    assert rebuilt.returncode == 0, rebuilt.stderr
    # Seen by content despite the kept mtime: assemble's record of what it
    # wrote no longer matches, so it runs again and takes the published case.
    assert ".  assemble" in rebuilt.stderr
    published = kit.package_dir(ws, "c1") / "content/case/revisions/0001/case.json"
    assert cached.read_bytes() == published.read_bytes()  # repaired from the published case
    assert len(kit.manifests(ws, "c1")) == 2


@pytest.mark.parametrize("record", ["out/case_summary.md", "out/case.json", "plan.json"])
def test_a_cache_record_cut_short_before_publication_is_made_again_never_published(tmp_path, record):
    """A power loss can leave a cache file empty or cut short: they are renamed
    into place without an fsync. A summary cut short after render was
    published as it was; a cut case or plan stopped every later build with
    INTEGRITY_ERROR until the cache was deleted. Now the build makes the
    record again, and publishes what a build without the failure publishes."""
    clean = _admitted(tmp_path / "clean")
    assert kit.doit("build", "case=c1", workspace=clean).returncode == 0
    ws = _admitted(tmp_path / "cut")
    stopped = kit.doit("render", "case=c1", workspace=ws)  # everything but publish
    assert stopped.returncode == 0, stopped.stderr
    cut = ws / ".cache" / "c1" / record
    cut.write_bytes(cut.read_bytes()[: len(cut.read_bytes()) // 3])
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    if record.startswith("out/"):
        task = "assemble" if record.endswith("case.json") else "render"
        assert f"{task}: would run: the cached {'case' if task == 'assemble' else 'summary'} is not the one it wrote" in status.stdout
    rebuilt = kit.doit("build", "case=c1", workspace=ws)
    assert rebuilt.returncode == 0, rebuilt.stderr
    for name in ("case.json", "case_summary.md", "case-built.json"):
        relpath = f"content/case/revisions/0001/{name}"
        assert (kit.package_dir(ws, "c1") / relpath).read_bytes() == (kit.package_dir(clean, "c1") / relpath).read_bytes(), name
    assert len(kit.manifests(ws, "c1")) == 2
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0 and ".  assemble" not in again.stderr and ".  render" not in again.stderr, again.stderr


def test_a_plan_older_than_the_store_state_beside_it_is_planned_again(tmp_path):
    """The plan and the store state are renamed into the cache one after the
    other without an fsync. On a filesystem that does not keep the order of
    renames, a power loss can keep the new store state (whose plan key says
    "nothing changed") beside the plan of an earlier build. That plan must not
    be taken: the build plans again and publishes what a clean build does."""
    def reopened_and_appended(ws: Path) -> None:
        assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
        assert kit.doit("reopen", "case=c1", "by=human:qa", "reason=more", workspace=ws).returncode == 0
        appended = kit.doit("append", "case=c1", f"source={_report_append(ws.parent, 'r9', ['original/report-a.json'])}", workspace=ws)
        assert appended.returncode == 0, appended.stderr

    clean = _admitted(tmp_path / "clean")
    reopened_and_appended(clean)
    assert kit.doit("build", "case=c1", workspace=clean).returncode == 0
    ws = _admitted(tmp_path / "lost")
    reopened_and_appended(ws)
    plan = ws / ".cache" / "c1" / "plan.json"
    earlier_plan = plan.read_bytes()  # revision 1's, the one the build above wrote
    planned = kit.doit("validate_index", "case=c1", workspace=ws)
    assert planned.returncode == 0, planned.stderr
    assert plan.read_bytes() != earlier_plan
    plan.write_bytes(earlier_plan)  # the new store state survived; the new plan did not
    rebuilt = kit.doit("build", "case=c1", workspace=ws)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "revision 2" in rebuilt.stdout and ".  assemble" in rebuilt.stderr, rebuilt.stdout + rebuilt.stderr
    for name in ("case.json", "case_summary.md", "case-built.json"):
        relpath = f"content/case/revisions/0002/{name}"
        assert (kit.package_dir(ws, "c1") / relpath).read_bytes() == (kit.package_dir(clean, "c1") / relpath).read_bytes(), name
    assert len(kit.manifests(ws, "c1")) == len(kit.manifests(clean, "c1"))


def test_publish_run_on_its_own_refuses_a_cached_output_its_step_did_not_write(tmp_path):
    """``doit -s publish`` skips the steps before it, and with them their
    check of the cached outputs: publish checks them itself."""
    ws = _admitted(tmp_path)
    assert kit.doit("render", "case=c1", workspace=ws).returncode == 0
    summary = ws / ".cache" / "c1" / "out" / "case_summary.md"
    kept = summary.read_bytes()
    summary.write_bytes(kept[:100])
    before = kit.tree_digest(ws / "cases")
    alone = kit.doit("-s", "publish", "case=c1", workspace=ws)
    assert "INTEGRITY_ERROR: the cached case_summary.md is not the one render made from the build's case" in _one_line_error(alone, "INTEGRITY_ERROR")
    assert kit.tree_digest(ws / "cases") == before
    summary.write_bytes(kept)  # the bytes render wrote: publish takes them
    assert kit.doit("-s", "publish", "case=c1", workspace=ws).returncode == 0
    assert (kit.package_dir(ws, "c1") / "content/case/revisions/0001/case_summary.md").read_bytes() == kept


@pytest.mark.parametrize("stopped_after, stale", [("assemble", "case_summary.md"), ("validate_index", "case.json")])
def test_publish_run_on_its_own_refuses_outputs_of_an_earlier_build(tmp_path, stopped_after, stale):
    """After an append, a build stopped before render (or before assemble)
    leaves the previous revision's summary (or case) in the cache: intact,
    but not made from this build's case (or plan)."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:qa", "reason=more", workspace=ws).returncode == 0
    assert kit.doit("append", "case=c1", f"source={_report_append(tmp_path, 'extra', [])}", workspace=ws).returncode == 0
    assert kit.doit(stopped_after, "case=c1", workspace=ws).returncode == 0
    before = kit.tree_digest(ws / "cases")
    alone = kit.doit("-s", "publish", "case=c1", workspace=ws)
    assert f"INTEGRITY_ERROR: the cached {stale} is not the one" in _one_line_error(alone, "INTEGRITY_ERROR")
    assert kit.tree_digest(ws / "cases") == before
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    clean = _appended_and_rendered(tmp_path / "clean", publish=True)
    for name in ("case.json", "case_summary.md", "case-built.json"):
        relpath = f"content/case/revisions/0002/{name}"
        assert (kit.package_dir(ws, "c1") / relpath).read_bytes() == (kit.package_dir(clean, "c1") / relpath).read_bytes(), name


def test_threaded_api_builds_of_two_cases_each_publish_what_they_wrote(tmp_path):
    """Builds of two cases in two threads of one process (the Python API):
    each one's publish recognises the outputs it wrote, whatever the other
    wrote meanwhile."""
    import threading

    from pipeline import build as build_module

    ws = tmp_path / "ws"
    for case in ("c1", "c2"):
        source = standard_package(tmp_path / f"src-{case}")
        assert kit.doit("admit", f"case={case}", f"source={source}", workspace=ws).returncode == 0
    store, other_store = CheckpointStore(Workspace(ws)), CheckpointStore(Workspace(ws))
    real_render = build_module.step_render
    other = {}

    def render_then_let_the_other_case_build(root, case_id):
        real_render(root, case_id)
        if case_id == "c1":  # c2 writes its outputs between c1's render and c1's publish
            thread = threading.Thread(target=lambda: other.setdefault("c2", CaseBuilder(other_store).build("c2")))
            thread.start()
            thread.join()

    try:
        build_module.step_render = render_then_let_the_other_case_build
        first = CaseBuilder(store).build("c1")
    finally:
        build_module.step_render = real_render
        store.close()
        other_store.close()
    assert first["status"] == "published" and other["c2"]["status"] == "published"


def _appended_and_rendered(root: Path, *, publish: bool) -> Path:
    """Revision 2 of c1 after a reopen and an append of one report, built up
    to render (``publish``: the whole build), so that its cache holds every
    kind of record: the prior case's view and the splice state too."""
    ws = _admitted(root)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:qa", "reason=more", workspace=ws).returncode == 0
    assert kit.doit("append", "case=c1", f"source={_report_append(root, 'extra', [])}", workspace=ws).returncode == 0
    done = kit.doit("build" if publish else "render", "case=c1", workspace=ws)
    assert done.returncode == 0 and "new document(s) appended" in done.stderr, done.stderr
    return ws


def _one_of_each_kind(cache: Path) -> list[str]:
    """A cache file of each kind (named alike but for digests and keys)."""
    import re

    kinds = {}
    for path in sorted(cache.rglob("*")):
        relpath = path.relative_to(cache).as_posix()
        if path.is_file() and not relpath.startswith("doit.sqlite3"):
            kinds.setdefault(re.sub(r"[0-9a-f]{16,64}", "#", relpath), relpath)
    return sorted(kinds.values())


def test_every_kind_of_cache_record_cut_short_before_publication_is_made_again(tmp_path):
    """The power loss above, for each kind of record an append rebuild leaves
    before it publishes: every build still succeeds and publishes what a
    build without the cut publishes, byte for byte."""
    clean = _appended_and_rendered(tmp_path / "clean", publish=True)
    stopped = _appended_and_rendered(tmp_path / "stopped", publish=False)
    records = _one_of_each_kind(stopped / ".cache" / "c1")
    assert {"plan.json", "out/case.json", "out/case_summary.md", "content-stamps.json", "store-state.json"} <= set(records)
    assert any(".case-view." in r for r in records) and any(r.startswith("out/splice.") for r in records), records
    revision = "content/case/revisions/0002"
    for record in records:
        ws = tmp_path / "cut" / record.replace("/", "_")
        shutil.copytree(stopped, ws)
        cut = ws / ".cache" / "c1" / record
        data = cut.read_bytes()
        cut.write_bytes(data[: len(data) // 3])
        rebuilt = kit.doit("build", "case=c1", workspace=ws)
        assert rebuilt.returncode == 0, (record, rebuilt.stderr)
        for name in ("case.json", "case_summary.md", "case-built.json"):
            assert (kit.package_dir(ws, "c1") / revision / name).read_bytes() == (kit.package_dir(clean, "c1") / revision / name).read_bytes(), (record, name)
        shutil.rmtree(ws)


def test_reuse_survives_lowered_document_and_case_limits_at_a_later_revision(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0  # revision 2, prior case = revision 1
    shutil.rmtree(ws / ".cache")
    store = CheckpointStore(Workspace(ws))
    try:
        tight = dataclasses.replace(CaseBuilderLimits(), document_bytes=100, case_bytes=1000)
        result = CaseBuilder(store, tight).build("c1", "pkg-1")
    finally:
        store.close()
    assert result["status"] == "reused"


def test_case_builder_api_raises_case_build_error_for_every_failure(tmp_path):
    """Seed 001's usage: ``except CaseBuildError as error: error.code, error.path``."""
    from pipeline.errors import CaseBuildError

    ws = _admitted(tmp_path)
    store = CheckpointStore(Workspace(ws))
    try:
        try:
            CaseBuilder(store).build("no-such-case", "pkg-1")
        except CaseBuildError as error:
            assert error.code == "UNKNOWN_CASE"
        else:
            raise AssertionError("an unknown case must fail")
        result = CaseBuilder(store).build("c1", "pkg-1")
        assert result["status"] == "published"
    finally:
        store.close()


def test_after_a_reopen_two_returning_indexes_in_a_row_lose_nothing(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    first = json.loads((kit.package_dir(ws, "c1") / "content/case/revisions/0001/case.json").read_text())
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    for name in ("r8", "r9"):
        extra = kit.make_append(tmp_path / name, files={f"original/{name}.json": kit.report(name, observations=[{"text": name}])},
                                index=kit.index(reports=[f"original/{name}.json"]))
        assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    second = json.loads((kit.package_dir(ws, "c1") / "content/case/revisions/0002/case.json").read_text())
    assert [r["path"] for r in second["inputs"]["reports"]] == [
        "original/report-a.json", "original/report-b.json", "original/r8.json", "original/r9.json"]
    old_ids = {(s["provenance"]["source"], s["provenance"]["pointer"]): s["id"] for s in first["human_observations"]["observations"]}
    for statement in second["human_observations"]["observations"]:
        key = (statement["provenance"]["source"], statement["provenance"]["pointer"])
        if key in old_ids:
            assert statement["id"] == old_ids[key]
    assert [s["id"] for s in second["human_observations"]["observations"]][-2:] == ["O0005", "O0006"]


def _bad_start(tmp_path, index, extra_files=None):
    files = {
        "original/report-a.json": kit.report("Fine", observations=[{"text": "ok"}]),
        "original/runtime.log": "x\n",
        **(extra_files or {}),
    }
    source = kit.make_package(tmp_path / "src", files=files, index=index)
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode != 0
    return ws


def _correct(tmp_path, ws, reports):
    fix = kit.make_append(tmp_path / "fix", files={"original/r2.json": kit.report("Fixed", observations=[{"text": "fixed"}])},
                          index=kit.index(reports=reports + ["original/r2.json"]))
    appended = kit.doit("append", "case=c1", f"source={fix}", workspace=ws)
    assert appended.returncode == 0 and "Traceback" not in appended.stderr, appended.stderr
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    return json.loads((kit.package_dir(ws, "c1") / "content/case/revisions/0001/case.json").read_text())


def test_a_malformed_admitted_index_is_corrected_by_an_append(tmp_path):
    index = kit.index(reports=["original/report-a.json"])
    index["context"] = []  # wrong shape: the first build refuses it
    ws = _bad_start(tmp_path, index)
    case = _correct(tmp_path, ws, ["original/report-a.json"])
    # the malformed index names nothing to inherit; the current one lists what counts
    assert [r["path"] for r in case["inputs"]["reports"]] == ["original/report-a.json", "original/r2.json"]


def test_an_inherited_reproduction_with_a_missing_events_file_is_dropped_with_a_gap(tmp_path):
    repro = kit.reproduction(steps=["go"], events_ref="original/missing.log")
    index = kit.index(reports=["original/report-a.json"], reproductions=["original/p.json"])
    ws = _bad_start(tmp_path, index, {"original/p.json": repro})
    case = _correct(tmp_path, ws, [])
    assert case["reproduction"]["reproductions"] == []
    assert ("SUPERSEDED_INPUT", "original/p.json") in {(g["code"], g.get("source")) for g in case["data_quality"]["gaps"]}
    assert "original/p.json" in [r["path"] for r in case["inputs"]["unclassified"]]
    assert [r["path"] for r in case["inputs"]["reports"]] == ["original/report-a.json", "original/r2.json"]


def test_render_takes_the_cached_case_record_not_the_one_assemble_held_in_memory(tmp_path):
    """Render reuses assemble's dict only for the very bytes assemble wrote."""
    from pipeline import build

    ws = _admitted(tmp_path)
    build.step_validate_index(ws, "c1")
    plan = json.loads((ws / ".cache/c1/plan.json").read_text())
    for doc in plan["documents"]:
        build.step_read_input(ws, "c1", plan["package_id"], doc["path"], doc["sha256"], doc["size"], doc["contract"])
    for ref in plan["opaque"]:
        build.step_hash_context(ws, "c1", plan["package_id"], ref["path"], ref["sha256"], ref["size"])
    build.step_assemble(ws, "c1")
    cached = ws / ".cache/c1/out/case.json"
    case = json.loads(cached.read_text())
    case["bug"]["titles"][0]["text"] = "Changed after assembly"
    cached.write_text(json.dumps(case, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    build.step_render(ws, "c1")
    assert "Changed after assembly" in (ws / ".cache/c1/out/case_summary.md").read_text()


def test_a_cleared_prior_case_view_is_read_again_from_the_published_case(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    extra = _report_append(tmp_path, "r8", [])
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    twin = tmp_path / "twin"
    shutil.copytree(ws, twin)
    views = list((twin / ".cache").rglob("*.case-view.*.json"))
    assert views, "publication leaves the view the next revision reads"
    for view in views:
        view.unlink()
    # Once before planning, and once between planning and assembling.
    assert kit.doit("validate_index", "case=c1", workspace=twin).returncode == 0
    for view in (twin / ".cache").rglob("*.case-view.*.json"):
        view.unlink()
    results = [kit.doit("build", "case=c1", workspace=w) for w in (ws, twin)]
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    published = [(kit.package_dir(w, "c1") / "content/case/revisions/0002/case.json").read_bytes() for w in (ws, twin)]
    assert published[0] == published[1]


def test_a_reopen_reason_or_source_that_is_not_utf8_is_one_coded_line(tmp_path):
    import os

    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    before = kit.tree_digest(ws)
    for args in (["by=human:a", os.fsdecode(b"reason=bad\xffbyte")], [os.fsdecode(b"by=human:\xfe"), "reason=fine"]):
        result = kit.doit("reopen", "case=c1", *args, workspace=ws)
        line = _one_line_error(result, "INVALID_ARGUMENT")
        assert "not valid UTF-8" in line
    assert kit.tree_digest(ws) == before


def test_a_finished_build_whose_dep_file_cannot_be_saved_still_succeeds(tmp_path):
    """doit saves its dependency file after the last task; a failure there
    (here another process holds the file's write lock, as a full disk would
    fail the commit) is one warning line, not a traceback after a published case."""
    import subprocess
    import sys

    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    extra = _report_append(tmp_path, "r8", [])
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    with _sqlite_held_by_another_process(ws / ".cache" / "c1" / "doit.sqlite3"):
        built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    assert "Traceback" not in built.stderr
    assert "warning: IO_ERROR: the build's dependency file was not saved" in built.stderr
    assert "confirmed at generation" in built.stdout
    generations = len(kit.manifests(ws, "c1"))
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert len(kit.manifests(ws, "c1")) == generations  # repeats its checks, publishes nothing new


def test_a_failed_build_whose_dep_file_cannot_be_saved_ends_with_its_code_line(tmp_path):
    """The warning that doit's dependency file was not saved comes from
    doit's final save, after a failed step has reported: the code line was
    then followed by the warning. It is written last now, as the README says."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    # A step that fails once doit has opened its dep file (a refused
    # limits.json stops the build before that, with no dep file at all).
    assert kit.doit("append", "case=c1", f"source={kit.duplicate_key_append(tmp_path / 'bad')}", workspace=ws).returncode == 0
    with _sqlite_held_by_another_process(ws / ".cache" / "c1" / "doit.sqlite3"):
        failed = kit.doit("build", "case=c1", workspace=ws)
    assert "warning: IO_ERROR: the build's dependency file was not saved" in failed.stderr, failed.stderr
    line = _one_line_error(failed, "JSON_DUPLICATE_KEY")
    assert failed.stderr.splitlines()[-1] == line, failed.stderr


def test_a_build_whose_cache_cannot_be_made_is_one_coded_line(tmp_path):
    ws = _admitted(tmp_path)
    shutil.rmtree(ws / ".cache", ignore_errors=True)
    (ws / ".cache").write_text("not a directory")  # mkdir of the case's cache fails
    before = kit.tree_digest(ws / "cases")
    failed = kit.doit("build", "case=c1", workspace=ws)
    _one_line_error(failed, "IO_ERROR")
    assert kit.tree_digest(ws / "cases") == before
    (ws / ".cache").unlink()
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0


def test_a_build_removes_the_cache_temp_files_a_killed_build_left(tmp_path):
    ws = _admitted(tmp_path)
    killed = kit.doit("build", "case=c1", workspace=ws, env_extra={"VIANO_CRASH_AT": "build:after-publish"})
    assert killed.returncode != 0
    stale = ws / ".cache" / "c1" / "out" / ".case.json.999999.tmp"  # as a write killed mid-way leaves it
    stale.write_bytes(b"half a record")
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert not stale.exists()
    assert not list((ws / ".cache").rglob(".*.tmp"))


def test_a_later_revision_cannot_move_a_prior_case_input_to_another_role(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    reports = [r["path"] for r in json.loads(
        (kit.package_dir(ws, "c1") / "content/case/revisions/0001/case.json").read_text())["inputs"]["reports"]]
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    moved = kit.make_append(tmp_path / "moved", files={"original/note.txt": b"n"},
                            index=kit.index(attachments=[reports[0]]))
    before = kit.tree_digest(ws / "cases")
    # Refused by the append itself, before it writes a generation no build could use.
    line = _one_line_error(kit.doit("append", "case=c1", f"source={moved}", workspace=ws), "DUPLICATE_SOURCE")
    assert "is an input of the prior case as reports; a later revision cannot list it as attachments" in line
    assert "case-inputs.json#/attachments/0" in line
    assert kit.tree_digest(ws / "cases") == before


def test_an_append_cannot_add_a_name_that_merges_with_one_already_in_the_package(tmp_path):
    """What admission refuses within one source (NFC + case folding, file vs
    directory), an append refuses against the files already admitted."""
    ws = tmp_path / "ws"
    source = kit.make_package(tmp_path / "src", files={"original/caf\u00e9.txt": b"nfc", "original/r.json": kit.report("T")},
                              index=kit.index(reports=["original/r.json"]))
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    before = kit.tree_digest(ws / "cases")
    for name, clash in (("nfd", "original/cafe\u0301.txt"), ("case", "Original/R.json"), ("dir", "original/r.json/x")):
        extra = kit.make_append(tmp_path / name, files={clash: b"other"}, index=kit.index(reports=["original/r.json"]))
        result = kit.doit("append", "case=c1", f"source={extra}", workspace=ws)
        _one_line_error(result, "SOURCE_NAME_COLLISION")
        assert kit.tree_digest(ws / "cases") == before
    again = kit.make_append(tmp_path / "same", files={"original/caf\u00e9.txt": b"nfc", "original/new.txt": b"n"},
                            index=kit.index(reports=["original/r.json"]))
    appended = kit.doit("append", "case=c1", f"source={again}", workspace=ws)
    assert appended.returncode == 0, appended.stderr
    assert "1 new files, 1 already present" in appended.stdout


def test_ctrl_c_in_a_build_is_one_interrupted_line_and_a_retry_completes_it(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO, doit_env

    ws = _admitted(tmp_path)
    ready = tmp_path / "ready"
    with kit.paused_doit("doit_pausing.py", ["build:after-publish", str(ready)], ready, "build", "case=c1", workspace=ws) as child:
        child.send_signal(signal.SIGINT)  # published, not yet confirmed
        _, stderr = child.communicate(timeout=60)
    assert child.returncode != 0
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith("INTERRUPTED: ")
    retried = kit.doit("build", "case=c1", workspace=ws)
    assert retried.returncode == 0, retried.stderr
    assert len(kit.manifests(ws, "c1")) == 2  # admission + the one publication, confirmed by the retry


def test_sigterm_mid_publication_stops_at_once_and_the_next_build_publishes_once(tmp_path):
    """A cancelled CI job, ``docker stop`` or ``timeout`` sends SIGTERM: the
    command stops where it stands, as under SIGKILL (the README says so), and
    the next build rolls the half-published attempt forward."""
    import signal

    ws = _admitted(tmp_path)
    clean = _admitted(tmp_path / "clean")
    assert kit.doit("build", "case=c1", workspace=clean).returncode == 0
    ready = tmp_path / "ready"
    with kit.paused_doit("doit_pausing.py", ["publish:after-content", str(ready)], ready, "build", "case=c1", workspace=ws) as child:
        child.send_signal(signal.SIGTERM)  # files published, the manifest not yet linked
        _, stderr = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGTERM
    assert "Traceback" not in stderr, stderr
    retried = kit.doit("build", "case=c1", workspace=ws)
    assert retried.returncode == 0, retried.stderr
    assert len(kit.manifests(ws, "c1")) == 2  # admission + exactly one publication
    revision = Path("case", "revisions", "0001")
    for name in ("case.json", "case_summary.md"):
        assert (kit.package_dir(ws, "c1") / "content" / revision / name).read_bytes() == \
            (kit.package_dir(clean, "c1") / "content" / revision / name).read_bytes()


def test_an_append_whose_index_lists_a_path_twice_is_refused_before_anything_is_written(tmp_path):
    ws = _admitted(tmp_path)
    before = kit.tree_digest(ws / "cases")
    for name, index in (("two-roles", kit.index(reports=["original/n.json"], attachments=["original/n.json"])),
                        ("one-role", kit.index(reports=["original/n.json", "original/n.json"]))):
        extra = kit.make_append(tmp_path / name, files={"original/n.json": kit.report("N")}, index=index)
        line = _one_line_error(kit.doit("append", "case=c1", f"source={extra}", workspace=ws), "DUPLICATE_SOURCE")
        assert "original/n.json" in line and "case-inputs.json#/" in line
        assert kit.tree_digest(ws / "cases") == before


def test_status_into_a_pipe_that_closes_early_stops_quietly(tmp_path):
    import subprocess

    from tests.conftest import REPO, doit_env

    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    command = f"doit -f {REPO / 'dodo.py'} -d {REPO} status case=c1 workspace={ws} | head -c 1"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, env=doit_env())
    assert len(result.stdout) == 1
    assert result.stderr == "", result.stderr


def test_directories_a_crashed_writer_left_empty_are_removed_and_block_nothing(tmp_path):
    """A writer killed after making content directories, before any file
    landed in them, leaves them empty; a later file of that name must fit."""
    ws = _admitted(tmp_path)
    content = kit.package_dir(ws, "c1") / "content"
    (content / "newdir" / "sub").mkdir(parents=True)
    (content / "inputs" / "9").mkdir(parents=True)
    (content / "original" / "leftover").mkdir()
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0  # its roll-forward tidies up
    assert not (content / "newdir").exists() and not (content / "inputs" / "9").exists()
    assert not (content / "original" / "leftover").exists() and (content / "original").is_dir()
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    extra = kit.make_append(tmp_path / "file", files={"newdir": b"a file where the empty directory was"},
                            index=kit.index(reports=[]))
    appended = kit.doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert appended.returncode == 0, appended.stderr
    assert (content / "newdir").read_bytes() == b"a file where the empty directory was"


def test_the_append_note_never_prints_a_reference_raw(tmp_path):
    """References of the earlier index reach stderr in the append's note: a
    hostile one must not drive the terminal or forge a coded line."""
    hostile = "\x1b[31mRED\x1b[0m\nINTEGRITY_ERROR: fake line\u202e"
    ws = tmp_path / "ws"
    source = kit.make_package(tmp_path / "src", files={"original/r.json": kit.report("T"), "original/s.json": kit.report("S")},
                              index=kit.index(reports=["original/r.json", "original/s.json", hostile]))
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    extra = kit.make_append(tmp_path / "app", files={"original/n.json": kit.report("N")},
                            index=kit.index(reports=["original/r.json", "original/n.json"]))
    appended = kit.doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert appended.returncode == 0, appended.stderr
    assert "\x1b" not in appended.stderr and "\u202e" not in appended.stderr
    assert not any(line.startswith("INTEGRITY_ERROR") for line in appended.stderr.splitlines())
    note = [line for line in appended.stderr.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "1 input(s)" in note[0] and "original/s.json" in note[0]


def test_an_append_removes_the_staging_copies_killed_commands_left(tmp_path):
    ws = _admitted(tmp_path)
    dead = ws / ".staging" / "append-source-999999999-0123456789ab"  # no such process
    (dead / "files" / "original").mkdir(parents=True)
    (dead / "files" / "original" / "big.bin").write_bytes(b"x" * 4096)
    extra = _report_append(tmp_path, "r8", [])
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    assert not dead.exists()


def test_export_refuses_a_destination_inside_the_workspace(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    before = kit.tree_digest(ws, skip_cache=False)
    content = kit.package_dir(ws, "c1") / "content"
    for dest in (ws, content / "exported", ws / ".cache" / "c1", ws / "cases"):
        _one_line_error(kit.doit("export", "case=c1", f"dest={dest}", workspace=ws), "INVALID_ARGUMENT")
    assert kit.tree_digest(ws, skip_cache=False) == before
    assert kit.doit("export", "case=c1", f"dest={tmp_path / 'out'}", workspace=ws).returncode == 0


def test_relative_paths_are_taken_from_where_the_command_was_run(tmp_path):
    """doit changes into the dodo file's directory; source=, dest= and
    workspace= still mean what they say from the user's directory."""
    import subprocess

    from tests.conftest import REPO, doit_env

    here = tmp_path / "here"
    here.mkdir()
    kit.make_package(here / "pkg", files={"original/r.json": kit.report("T")}, index=kit.index(reports=["original/r.json"]))

    def run(*args):
        return subprocess.run(["doit", "-f", str(REPO / "dodo.py"), *args, "workspace=ws"],
                              cwd=here, capture_output=True, text=True, env=doit_env())

    for args in (("admit", "case=c1", "source=pkg"), ("build", "case=c1"), ("export", "case=c1", "dest=out")):
        result = run(*args)
        assert result.returncode == 0, (args, result.stderr)
    assert (here / "ws" / "checkpoints.sqlite3").exists() and (here / "out" / "case.json").exists()
    assert not (REPO / "ws").exists() and not (REPO / "out").exists()


def test_probes_after_a_reopen_say_which_revision_they_are_for(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert "has no case yet" not in kit.doit("probes", "case=c1", workspace=ws).stderr
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    probed = kit.doit("probes", "case=c1", workspace=ws)
    assert "note: revision 2 has no case yet; these probes are for revision 1's case" in probed.stderr


def test_export_to_a_filesystem_without_hard_links_still_never_overwrites(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO, doit_env

    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0

    def export(dest):
        return subprocess.run(
            [sys.executable, str(REPO / "tests" / "procs" / "doit_without_links.py"), "-f", str(REPO / "dodo.py"),
             "-d", str(REPO), "export", "case=c1", f"dest={dest}", f"workspace={ws}"],
            capture_output=True, text=True, env=doit_env(),
        )

    out = tmp_path / "usb"
    first = export(out)
    assert first.returncode == 0, first.stderr
    published = kit.package_dir(ws, "c1") / "content/case/revisions/0001"
    assert (out / "case.json").read_bytes() == (published / "case.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["case.json", "case_summary.md", "manifest.json"]  # no temp left
    assert export(out).returncode == 0  # identical files are accepted
    other = tmp_path / "other"
    other.mkdir()
    (other / "case.json").write_bytes(b"someone else's file")
    _one_line_error(export(other), "CONTENT_CONFLICT")
    assert (other / "case.json").read_bytes() == b"someone else's file"


def test_a_live_writer_s_staging_tree_is_kept_even_when_its_pid_is_not_visible(tmp_path):
    """Two containers sharing a workspace do not see each other's pids; the
    owner flock, not the pid in the tree's name, says whether a writer lives."""
    import subprocess
    import sys

    ws = _admitted(tmp_path)
    staging = ws / ".staging"
    staging.mkdir(exist_ok=True)
    name = "admit-other-999999999-0123456789ab"  # a pid no process here has
    writer = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time; from pathlib import Path; "
         "root = Path(sys.argv[1]); fd = os.open(root / (sys.argv[2] + '.owner'), os.O_RDWR | os.O_CREAT, 0o600); "
         "fcntl.flock(fd, fcntl.LOCK_EX); "
         "(root / sys.argv[2] / 'files').mkdir(parents=True); (root / sys.argv[2] / 'files' / 'half').write_bytes(b'x'); "
         "print('ready', flush=True); time.sleep(60)", str(staging), name],
        stdout=subprocess.PIPE, text=True, env=kit.doit_env(),
    )
    try:
        assert writer.stdout.readline().strip() == "ready"
        first = _report_append(tmp_path, "r8", [])
        assert kit.doit("append", "case=c1", f"source={first}", workspace=ws).returncode == 0
        assert (staging / name / "files" / "half").exists()  # alive: kept
    finally:
        writer.kill()
        writer.wait()
        writer.stdout.close()
    second = _report_append(tmp_path, "r9", [])
    assert kit.doit("append", "case=c1", f"source={second}", workspace=ws).returncode == 0
    assert not (staging / name).exists() and not (staging / (name + ".owner")).exists()  # dead: removed


def test_a_dep_file_another_process_holds_is_one_coded_line_and_kept(tmp_path):
    import subprocess
    import sys

    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    dep = ws / ".cache" / "c1" / "doit.sqlite3"
    with _sqlite_held_by_another_process(dep, "exclusive"):
        held = kit.doit("build", "case=c1", workspace=ws)
    _one_line_error(held, "LOCK_TIMEOUT")
    assert dep.exists()
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0


def test_every_command_on_a_workspace_that_is_a_file_says_so_alike(tmp_path):
    not_a_dir = tmp_path / "ws"
    not_a_dir.write_bytes(b"a file")
    source = kit.make_package(tmp_path / "src", files={"original/r.json": kit.report("T")}, index=kit.index(reports=["original/r.json"]))
    for args in (("admit", "case=c1", f"source={source}"), ("build", "case=c1"), ("status", "case=c1"),
                 ("append", "case=c1", f"source={source}"), ("reopen", "case=c1", "by=human:a", "reason=r"),
                 ("export", "case=c1", f"dest={tmp_path / 'out'}"), ("probes", "case=c1")):
        line = _one_line_error(kit.doit(*args, workspace=not_a_dir), "INVALID_ARGUMENT")
        assert "not a directory" in line, (args, line)
    assert not_a_dir.read_bytes() == b"a file" and not (tmp_path / "out").exists()


def test_export_to_a_dangling_symlink_says_what_it_is(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    dest = tmp_path / "link"
    dest.symlink_to(tmp_path / "nowhere")
    line = _one_line_error(kit.doit("export", "case=c1", f"dest={dest}", workspace=ws), "INVALID_ARGUMENT")
    assert "symbolic link to nothing" in line
    assert dest.is_symlink() and not (tmp_path / "nowhere").exists()


def test_two_threads_building_one_case_through_the_api(tmp_path):
    """The case lock is re-entrant per process, so it does not keep two threads
    of one process apart: their CaseBuilder builds take turns instead. One
    publishes, the other reuses; no cache record or in-flight content of one
    is removed by the other's cleanup (that failed with FileNotFoundError and
    IO_ERROR before)."""
    import threading

    from pipeline.errors import VianoError

    source = standard_package(tmp_path / "src")
    reference = None
    for attempt in range(6):
        ws = tmp_path / f"ws{attempt}"
        assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
        if attempt % 2:
            # A build stopped after planning: the case is BUILDING_CASE, so both
            # threads get past planning and read, assemble and render together.
            assert kit.doit("validate_index", "case=c1", workspace=ws).returncode == 0
        outcomes = []
        barrier = threading.Barrier(2)

        def build():
            store = CheckpointStore(Workspace(ws))
            try:
                barrier.wait()
                outcomes.append(("ok", CaseBuilder(store).build("c1", "pkg-1")["status"]))
            except VianoError as error:
                outcomes.append(("error", error.code, str(error)))
            except BaseException as error:  # anything else is the defect this test is about
                outcomes.append(("crash", repr(error)))
            finally:
                store.close()

        threads = [threading.Thread(target=build) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == [("ok", "published"), ("ok", "reused")], outcomes
        store = CheckpointStore(Workspace(ws))
        try:
            assert CaseBuilder(store).build("c1", "pkg-1")["status"] == "reused"
        finally:
            store.close()
        assert len(kit.manifests(ws, "c1")) == 2
        published = (kit.package_dir(ws, "c1") / "content/case/revisions/0001/case.json").read_bytes()
        reference = reference or published
        assert published == reference
        assert not list((ws / ".cache").rglob("*.tmp"))


def test_a_missing_published_manifest_stops_every_command_and_removes_nothing(tmp_path):
    """The store ahead of the manifests means a published manifest was lost.
    Rolling forward must not take what that generation published for a
    crashed writer's leftovers: a build once removed the published case."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    last = kit.manifests(ws, "c1")[-1]
    assert last.name == "000002.json"
    last.unlink()
    before = kit.tree_digest(ws / "cases")
    published = kit.package_dir(ws, "c1") / "content" / "case" / "revisions" / "0001" / "case.json"
    for command in (("build", "case=c1"), ("reopen", "case=c1", "by=human:t", "reason=r"), ("export", "case=c1", f"dest={tmp_path / 'out'}")):
        result = kit.doit(*command, workspace=ws)
        line = _one_line_error(result, "INTEGRITY_ERROR")
        assert "manifests/000002.json" in line and "generation 2" in line, line
        assert str(tmp_path) not in line, line
        assert kit.tree_digest(ws / "cases") == before, command
        assert published.exists()


def test_a_store_whose_case_row_is_behind_its_own_confirmation_is_refused_not_rolled_forward_forever(tmp_path):
    """RELIABILITY 41: a store changed by hand so that its case row is behind
    a confirmation it already holds. Rolling forward took the confirmation
    as a replay, so the generation never rose: every writing command looped
    forever holding the case lock."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    with contextlib.closing(sqlite3.connect(ws / "checkpoints.sqlite3")) as connection:
        connection.execute("UPDATE cases SET generation = 1")
        connection.commit()
    before = kit.tree_digest(ws / "cases")
    source = _report_append(tmp_path, "later", ["original/report-a.json", "original/report-b.json"])
    for command in (("build", "case=c1"), ("append", "case=c1", f"source={source}"),
                    ("reopen", "case=c1", "by=human:t", "reason=r"), ("export", "case=c1", f"dest={tmp_path / 'out'}")):
        result = kit.doit(*command, workspace=ws, timeout=60)
        line = _one_line_error(result, "INTEGRITY_ERROR")
        assert "contradicts itself" in line and "generation 1" in line and "(checkpoints.sqlite3)" in line, (command, line)
        assert kit.tree_digest(ws / "cases") == before, command
        assert not (tmp_path / "out").exists()


def _older_manifest_cut_short(ws: Path, tmp_path: Path) -> tuple[str, str]:
    first = kit.manifests(ws, "c1")[0]
    first.write_bytes(first.read_bytes()[:100])
    return "INTEGRITY_ERROR", "(manifests/000001.json)"


def _content_folder_linked(ws: Path, tmp_path: Path) -> tuple[str, str]:
    folder = kit.package_dir(ws, "c1") / "content" / "case"
    moved = tmp_path / "moved-case"
    folder.rename(moved)
    os.symlink(moved, folder)
    return "REFERENCE_UNSAFE", "crosses a symlink (case/revisions/0001/"


@pytest.mark.parametrize("damage", [_older_manifest_cut_short, _content_folder_linked])
def test_reopen_publishes_nothing_over_damage_the_next_build_would_stop_at(tmp_path, damage):
    """A reopen published a new generation over an earlier manifest cut short
    and over a linked folder of the content, both of which build and export
    refuse (RELIABILITY 28, 41): the damage was carried forward under a
    generation the next build could not build."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    code, where = damage(ws, tmp_path)
    before = kit.tree_digest(ws / "cases")
    before_outside = kit.tree_digest(tmp_path / "moved-case") if (tmp_path / "moved-case").exists() else None
    reopen = kit.doit("reopen", "case=c1", "by=human:t", "reason=r", workspace=ws)
    line = _one_line_error(reopen, code)
    assert where in line, line
    assert kit.tree_digest(ws / "cases") == before
    assert len(kit.manifests(ws, "c1")) == 2
    if before_outside is not None:
        assert kit.tree_digest(tmp_path / "moved-case") == before_outside


@pytest.mark.parametrize("damage", [_older_manifest_cut_short, _content_folder_linked])
def test_append_publishes_nothing_over_damage_the_next_build_would_stop_at(tmp_path, damage):
    """The same for an append after a reopen (the damage done after the reopen)."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:t", "reason=r", workspace=ws).returncode == 0
    source = _report_append(tmp_path, "later", ["original/report-a.json", "original/report-b.json"])
    code, where = damage(ws, tmp_path)
    before = kit.tree_digest(ws / "cases")
    append = kit.doit("append", "case=c1", f"source={source}", workspace=ws)
    line = _one_line_error(append, code)
    assert where.split(" (")[0] in line, line
    assert kit.tree_digest(ws / "cases") == before


SYMLINKABLE_PARTS = [
    "cases", "cases/c1", "cases/c1/packages", "cases/c1/packages/pkg-1",
    "cases/c1/packages/pkg-1/content", "cases/c1/packages/pkg-1/manifests",
    ".cache", ".cache/c1", ".locks", "checkpoints.sqlite3",
]


@pytest.mark.parametrize("part", SYMLINKABLE_PARTS)
def test_a_symlinked_part_of_the_workspace_is_refused_by_every_command(tmp_path, part):
    """RELIABILITY 28 for the workspace's own directories: moved elsewhere and
    linked back, a part is followed by no command (a build once published
    the case through a linked content/ into wherever it pointed)."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    moved = outside / part.replace("/", "_")
    (ws / part).rename(moved)
    os.symlink(moved, ws / part)
    before_outside = kit.tree_digest(outside, skip_cache=False)
    before_ws = kit.tree_digest(ws)
    source = _report_append(tmp_path, "later", ["original/report-a.json", "original/report-b.json"])
    for command in (("build", "case=c1"), ("append", "case=c1", f"source={source}"),
                    ("reopen", "case=c1", "by=human:t", "reason=r"), ("export", "case=c1", f"dest={tmp_path / 'out'}")):
        result = kit.doit(*command, workspace=ws)
        line = _one_line_error(result, "REFERENCE_UNSAFE")
        assert f"({part})" in line or f"({part.split('/')[0]})" in line, (command, line)
        assert kit.tree_digest(outside, skip_cache=False) == before_outside, command
        assert kit.tree_digest(ws) == before_ws, command
        assert not (tmp_path / "out").exists()


def test_a_source_directory_that_holds_the_workspace_is_refused(tmp_path):
    """`source=.` from a directory whose service-data is the workspace would
    copy the workspace (other cases, the store, the cache) into the package."""
    from tests.conftest import REPO, doit_env

    source = standard_package(tmp_path / "src")
    admit = subprocess.run(["doit", "-f", str(REPO / "dodo.py"), "admit", "case=c1", "source=."],
                           cwd=source, capture_output=True, text=True, env=doit_env(), timeout=120)
    _one_line_error(admit, "INVALID_ARGUMENT")
    assert not (source / "service-data").exists()
    ws = source / "ws"
    admitted = kit.doit("admit", "case=c1", f"source={tmp_path / 'src'}", workspace=tmp_path / "elsewhere")
    assert admitted.returncode == 0, admitted.stderr
    for command in (("admit", "case=c2", f"source={source}"), ("append", "case=c1", f"source={tmp_path}")):
        target = ws if command[0] == "admit" else tmp_path / "elsewhere"
        before = kit.tree_digest(target) if target.exists() else None
        result = kit.doit(*command, workspace=target)
        _one_line_error(result, "INVALID_ARGUMENT")
        assert (kit.tree_digest(target) if target.exists() else None) == before


def test_a_command_waiting_for_the_case_lock_says_so_once(tmp_path):
    """A command queued behind another's case lock prints one line after a
    second instead of looking hung, then goes on when the lock is free."""
    ws = _admitted(tmp_path)
    with _case_lock_held_by_another_process(ws, tmp_path / "ready"):
        build = subprocess.Popen(["doit", "-f", str(REPO / "dodo.py"), "build", "case=c1", f"workspace={ws}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=doit_env())
        # The holder lets go only once the waiting command has said so (its
        # first stderr line), however slowly this machine starts it.
        first = build.stderr.readline()
    _, rest = build.communicate(timeout=120)
    err = first + rest
    assert build.returncode == 0, err
    waiting = [line for line in err.splitlines() if line.startswith("waiting for case c1:")]
    assert waiting == ["waiting for case c1: another command holds its lock (giving up after 60s)"], err
    assert first.startswith("waiting for case c1:"), err


def test_a_failed_build_whose_dep_file_cannot_forget_the_task_is_one_coded_line(tmp_path):
    """doit forgets a failed task's record at once; when the dep file cannot
    take that delete (here another process holds its write lock, as a full
    disk would refuse it) the build still ends with the task's own coded
    line and a warning, not a traceback, and the next build runs the task."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    bad = kit.duplicate_key_append(tmp_path / "bad")
    assert kit.doit("append", "case=c1", f"source={bad}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode != 0  # the dep file now holds records of this revision
    with _sqlite_held_by_another_process(ws / ".cache" / "c1" / "doit.sqlite3"):
        built = kit.doit("build", "case=c1", workspace=ws)
    line = _one_line_error(built, "JSON_DUPLICATE_KEY")
    assert "original/dup.json" in line
    assert "warning: IO_ERROR: the build's dependency file was not saved" in built.stderr
    again = kit.doit("build", "case=c1", workspace=ws)
    _one_line_error(again, "JSON_DUPLICATE_KEY")


@pytest.mark.parametrize("module", ["pipeline.doitcli", "pipeline.build"])
def test_ctrl_c_while_the_dodo_file_loads_is_one_interrupted_line(tmp_path, module):
    """Ctrl-C while the dodo file is still importing the pipeline (before
    doit_config ran) is one INTERRUPTED line too, not a traceback; also
    while it imports the module that held the handler (a review found that
    window, ~0.1-0.4 s into a command)."""
    import signal

    from pipeline.errors import ERROR_CODES

    ws = _admitted(tmp_path)
    ready = tmp_path / "ready"
    with kit.paused_doit("doit_pausing_import.py", [module, str(ready)], ready, "build", "case=c1", workspace=ws) as child:
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=60)
    assert child.returncode != 0
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.strip().splitlines() == [f"INTERRUPTED: {ERROR_CODES['INTERRUPTED']}"]


@pytest.mark.parametrize("moment", ["report", "exit"])
def test_ctrl_c_once_the_build_said_it_is_confirmed_changes_nothing(tmp_path, moment):
    """A Ctrl-C right after the confirmed line (or as the interpreter exits)
    was raised into doit's last bookkeeping, or killed the process silently
    by SIGINT: exit 130 after a printed success, with no INTERRUPTED line."""
    ws = _admitted(tmp_path)
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "procs" / "doit_interrupted_after.py"), moment,
         "-f", str(REPO / "dodo.py"), "-d", str(REPO), "build", "case=c1", f"workspace={ws}"],
        capture_output=True, text=True, env=doit_env(), timeout=120,
    )
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.startswith("case c1 revision 1: ") and "confirmed at generation 2" in result.stdout
    assert "Traceback" not in result.stderr and "INTERRUPTED" not in result.stderr, result.stderr
    assert len(kit.manifests(ws, "c1")) == 2


def test_a_build_that_cannot_write_its_dep_file_is_one_coded_line(tmp_path):
    """A file size limit of zero (as a full disk) refuses every write: doit
    cannot create its dependency file, which it calls corrupt, and the build
    then fails where it first writes; one warning and one coded line, no
    traceback, nothing published."""
    import resource

    ws = _admitted(tmp_path)
    before = kit.tree_digest(ws / "cases")
    result = subprocess.run(
        ["doit", "-f", str(REPO / "dodo.py"), "-d", str(REPO), "build", "case=c1", f"workspace={ws}"],
        capture_output=True, text=True, env=doit_env(), timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)),
    )
    assert "warning: IO_ERROR: the build's dependency file cannot be written" in result.stderr, result.stderr
    _one_line_error(result, "IO_ERROR")
    assert kit.tree_digest(ws / "cases") == before
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0


def test_status_after_a_publication_that_was_not_confirmed_says_the_build_confirms_it(tmp_path):
    ws = _admitted(tmp_path)
    crashed = kit.doit("build", "case=c1", workspace=ws, env_extra={"VIANO_CRASH_AT": "build:after-publish"})
    assert crashed.returncode != 0
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    assert "package generations not yet taken in: 2..2" in status.stdout, status.stdout
    assert ("  publish: would run: generation 2 published this case; the build confirms it and reuses it (no new generation)\n"
            in status.stdout), status.stdout
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert len(kit.manifests(ws, "c1")) == 2
    assert "  publish: up to date: case-build/v1/r1 confirmed" in kit.doit("status", "case=c1", workspace=ws).stdout


_CHAIN = ("assemble", "render", "publish")


def _foretold(status_stdout: str) -> set[str]:
    return {task for task in _CHAIN if f"  {task}: would run" in status_stdout}


def _set_recorded_stamp(ws: Path, stamp: str) -> None:
    """Stand in for a build by another builder version: the stamp doit
    recorded for the chain's stamped tasks (assemble, render)."""
    import sqlite3

    conn = sqlite3.connect(ws / ".cache" / "c1" / "doit.sqlite3")
    try:
        for task in ("assemble", "render"):
            (data,) = conn.execute("SELECT task_data FROM doit WHERE task_id = ?", (task,)).fetchone()
            record = json.loads(data)
            record["_values_:"]["_config_changed"] = stamp
            conn.execute("UPDATE doit SET task_data = ? WHERE task_id = ?", (json.dumps(record), task))
        conn.commit()
    finally:
        conn.close()


@pytest.mark.parametrize("before", [
    "build:validate-index", "build:assemble", "build:after-publish", "build:after-confirm",  # a build killed there
    "limits raised", "limits raised, killed after planning", "limits raised, validate_index alone",
    "another builder version",
    # a power loss that cut a cache file short
    "render, then the summary cut", "render, then the case cut", "render, then the plan cut",
    "built, then the summary cut", "built, then the case cut", "built, then the plan cut",
])
def test_status_foretells_exactly_which_of_assemble_render_publish_the_build_runs(tmp_path, before):
    """doit reruns a chain task when the files it depends on (the plan, the
    cached case and summary) or its stamp differ from what it recorded when
    the task last ran; status must say the same beforehand, whatever left the
    cache as it is."""
    ws = _admitted(tmp_path)
    if before.startswith("build:"):
        crashed = kit.doit("build", "case=c1", workspace=ws, env_extra={"VIANO_CRASH_AT": before})
        assert crashed.returncode != 0
    elif before.startswith("render,"):
        assert kit.doit("render", "case=c1", workspace=ws).returncode == 0
    else:
        assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    if before.endswith(" cut"):
        cache = ws / ".cache" / "c1"
        cut = {"summary": cache / "out/case_summary.md", "case": cache / "out/case.json", "plan": cache / "plan.json"}[before.split()[-2]]
        cut.write_bytes(cut.read_bytes()[:100])
    if before.startswith("limits raised"):
        (ws / "limits.json").write_text(json.dumps({"format": "viano-workspace-limits", "format_version": 1,
                                                    "case_builder": {"case_bytes": 16 << 20}}))
    if before == "limits raised, killed after planning":
        assert kit.doit("build", "case=c1", workspace=ws, env_extra={"VIANO_CRASH_AT": "build:assemble"}).returncode != 0
    if before == "limits raised, validate_index alone":
        assert kit.doit("validate_index", "case=c1", workspace=ws).returncode == 0
    if before == "another builder version":
        _set_recorded_stamp(ws, "0" * 32)
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    if before == "another builder version":
        assert "  assemble: would run: the builder's code changed since it last ran\n" in status.stdout, status.stdout
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    assert _foretold(status.stdout) == set(_executed(built)) & set(_CHAIN), (status.stdout, built.stderr)
    again = kit.doit("status", "case=c1", workspace=ws)
    assert _foretold(again.stdout) == set(), again.stdout
    assert not set(_executed(kit.doit("build", "case=c1", workspace=ws))) & set(_CHAIN)


def test_status_of_a_copied_workspace_says_its_records_name_another_path(tmp_path):
    """doit keys each file's state by its absolute path, so in a copy of a
    built workspace assemble, render and publish run again (publish reuses the
    confirmed case). status says why, not that the plan changed."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    copy = tmp_path / "copy"
    shutil.copytree(ws, copy, symlinks=True)
    status = kit.doit("status", "case=c1", workspace=copy)
    assert status.returncode == 0, status.stderr
    moved = "its record names the files at another path (the workspace was copied or moved since it last ran)"
    for task in _CHAIN:
        assert f"  {task}: would run: {moved}" in status.stdout, status.stdout
    assert "plan changed" not in status.stdout, status.stdout
    generations = len(kit.manifests(copy, "c1"))
    built = kit.doit("build", "case=c1", workspace=copy)
    assert built.returncode == 0, built.stderr
    assert _foretold(status.stdout) == set(_executed(built)) & set(_CHAIN), (status.stdout, built.stderr)
    assert len(kit.manifests(copy, "c1")) == generations
    assert _foretold(kit.doit("status", "case=c1", workspace=copy).stdout) == set()


def test_status_and_probes_take_the_checked_manifests_a_build_left_and_write_none(tmp_path, monkeypatch, capsys):
    """Planning loads every generation's manifest; checking each one again
    (decode, contract, every file entry) made status slower by the square of
    the appends (800 appends: 7 s). The observing commands take the checked
    manifests the cache holds, as a build does, and leave the cache as is."""
    from pipeline import commands, packages

    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    for name in ("more", "again"):
        assert kit.doit("reopen", "case=c1", "by=human:a", f"reason={name}", workspace=ws).returncode == 0
        extra = _report_append(tmp_path, name, ["original/report-a.json"])
        assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
        assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    before = kit.tree_digest(ws, skip_cache=False)
    checked = []
    real = packages._checked_manifest
    monkeypatch.setattr(packages, "_checked_manifest", lambda data, label: checked.append(label) or real(data, label))
    commands.cmd_status(case="c1", workspace=str(ws))
    commands.cmd_probes(case="c1", workspace=str(ws))
    assert "case: c1" in capsys.readouterr().out
    assert checked == []
    assert kit.tree_digest(ws, skip_cache=False) == before
    # Without the cache they are checked from their bytes, as before.
    shutil.rmtree(ws / ".cache")
    commands.cmd_status(case="c1", workspace=str(ws))
    assert len(checked) == len(kit.manifests(ws, "c1")) > 5


def test_status_names_a_chain_task_doit_was_told_to_ignore(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("ignore", "publish", "case=c1", workspace=ws).returncode == 0
    status = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "  publish: ignored (`doit ignore`): the build skips it" in status, status
    built = kit.doit("build", "case=c1", workspace=ws)
    assert "!! publish" in built.stderr, built.stderr
    assert kit.doit("forget", "publish", "case=c1", workspace=ws).returncode == 0
    status = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "  publish: would run: no record of its last run" in status, status
    assert "publish" in _executed(kit.doit("build", "case=c1", workspace=ws))


def test_status_plans_generations_the_store_has_not_taken_in_yet(tmp_path):
    """An append whose process died after publishing its manifest: the next
    build takes that generation in before it plans, and so does status."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    extra = _report_append(tmp_path, "late", ["original/report-a.json", "original/report-b.json"])
    crashed = kit.doit("append", "case=c1", f"source={extra}", workspace=ws, env_extra={"VIANO_CRASH_AT": "publish:after-manifest-link"})
    assert crashed.returncode != 0
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "package generations not yet taken in" in outlook, outlook
    assert "read_input:original/late.json: would run" in outlook, outlook
    assert "  assemble: would run" in outlook, outlook
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0 and "read_input:original/late.json" in built.stderr, built.stderr


def test_status_says_render_would_run_when_the_summary_is_not_the_cached_case_s(tmp_path):
    """assemble ran alone (or render failed, or a Ctrl-C came between them):
    the cached summary is the previous case's, so render would run."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    extra = _report_append(tmp_path, "more", ["original/report-a.json", "original/report-b.json"])
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    assert kit.doit("assemble", "case=c1", workspace=ws).returncode == 0
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "  assemble: up to date\n" in outlook, outlook
    assert "  render: would run: the cached summary is not the cached case's\n" in outlook, outlook
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0 and ".  render" in built.stderr, built.stderr
    assert "  render: up to date\n" in kit.doit("status", "case=c1", workspace=ws).stdout


@pytest.mark.parametrize("entry", ["out", "documents", "doit.sqlite3"])
def test_a_symlinked_entry_of_the_case_cache_is_refused(tmp_path, entry):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    moved = tmp_path / f"outside-{entry}"
    (ws / ".cache" / "c1" / entry).rename(moved)
    os.symlink(moved, ws / ".cache" / "c1" / entry)
    result = kit.doit("build", "case=c1", workspace=ws)
    line = _one_line_error(result, "REFERENCE_UNSAFE")
    assert f"(.cache/c1/{entry})" in line, line


def test_every_command_refuses_an_empty_workspace_variable_and_creates_no_default_one(tmp_path):
    # `workspace=$DIR` with DIR unset: the default ./service-data (here, the
    # directory the command runs in) may be another workspace than the one meant.
    source = kit.make_package(tmp_path / "src", files={"original/r.json": kit.report("T")}, index=kit.index(reports=["original/r.json"]))
    run_in = tmp_path / "cwd"
    run_in.mkdir()
    for args in (("admit", "case=c1", f"source={source}"), ("build", "case=c1"), ("status", "case=c1"),
                 ("append", "case=c1", f"source={source}"), ("reopen", "case=c1", "by=human:a", "reason=r"),
                 ("export", "case=c1", f"dest={tmp_path / 'out'}"), ("probes", "case=c1")):
        result = subprocess.run(["doit", "-f", str(REPO / "dodo.py"), *args, "workspace="],
                                capture_output=True, text=True, env=doit_env(), cwd=run_in, timeout=120)
        line = _one_line_error(result, "INVALID_ARGUMENT")
        assert "workspace= is empty" in line, (args, line)
    assert list(run_in.iterdir()) == [] and not (tmp_path / "out").exists()


def test_a_publication_note_that_cannot_be_written_fails_no_build_that_published(tmp_path):
    # The cache's published.json is only a note of what the store confirmed:
    # a build whose note cannot be written (here a directory stands in its
    # way) still succeeds, names the confirmed generation from the store, and
    # publishes nothing twice.
    ws = _admitted(tmp_path)
    first = kit.doit("build", "case=c1", workspace=ws)
    assert first.returncode == 0, first.stderr
    note = ws / ".cache" / "c1" / "out" / "published.json"
    note.unlink()
    note.mkdir()
    (note / "keep").write_text("x")
    before = kit.tree_digest(ws)
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stderr
    assert "warning: IO_ERROR: the build cache's note of the publication was not written" in again.stderr
    confirmed = [line for line in again.stdout.splitlines() if line.startswith("case c1 revision 1: ")]
    assert confirmed == [line for line in first.stdout.splitlines() if line.startswith("case c1 revision 1: ")]
    assert kit.tree_digest(ws) == before


def test_the_staging_tree_of_a_killed_admission_goes_with_the_next_command_that_changes_the_workspace(tmp_path):
    # A killed admission of one case leaves its (possibly huge) staging tree;
    # a build, reopen or export of another case clears it, status only looks.
    ws = _admitted(tmp_path)
    source = standard_package(tmp_path / "src2")
    killed = kit.doit("admit", "case=c2", f"source={source}", workspace=ws, env_extra={"VIANO_CRASH_AT": "admit:after-stage"})
    assert killed.returncode != 0
    left = sorted(p.name for p in (ws / ".staging").iterdir())
    assert any(name.startswith("admit-c2-") and not name.endswith(".owner") for name in left), left
    assert kit.doit("status", "case=c1", workspace=ws).returncode == 0
    assert sorted(p.name for p in (ws / ".staging").iterdir()) == left
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    assert not (ws / ".staging").exists() or list((ws / ".staging").iterdir()) == []
    assert not (ws / "cases" / "c2").exists()


def test_export_names_a_hostile_destination_on_one_escaped_line(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    dest = tmp_path / "out\nsecond line\x1b[31m\u202e"
    exported = kit.doit("export", "case=c1", f"dest={dest}", workspace=ws)
    assert exported.returncode == 0, exported.stderr
    lines = exported.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("exported case c1 revision 1"), lines
    assert "\x1b" not in exported.stdout and "\u202e" not in exported.stdout
    assert "\\n" in lines[0] and "\\x1b" in lines[0] and "\\u202e" in lines[0]
    assert sorted(p.name for p in dest.iterdir()) == ["case.json", "case_summary.md", "manifest.json"]


def _in_mount_namespace(script: str) -> subprocess.CompletedProcess:
    """Run ``script`` (sh) in a private mount namespace, where it may bind-mount
    (CI runs as root; elsewhere these tests are skipped, not failed)."""
    if os.geteuid() != 0:
        pytest.skip("mounts in a private namespace need root")
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=doit_env(), timeout=120)


def _doit_line(*args: str, workspace: Path) -> str:
    quoted = " ".join(shlex.quote(a) for a in ["doit", "-f", str(REPO / "dodo.py"), *args, f"workspace={workspace}"])
    return quoted


@pytest.mark.parametrize("mounted", ["", "cases", "cases/c1/packages/pkg-1/content"])
def test_export_refuses_the_workspace_or_a_folder_of_it_under_another_name(tmp_path, mounted):
    # A bind mount shows the workspace, or a folder in it, at another path:
    # realpath cannot see it. An export there would be content that the next
    # build removes as unlisted. (A folder's mount shares no identity with
    # the workspace's root: before session 19 that export went ahead.)
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    alias = tmp_path / "alias"
    alias.mkdir()
    dest = alias / "deeper" / "exported"
    before = kit.tree_digest(ws)
    result = _in_mount_namespace(f"mount --bind {shlex.quote(str(ws / mounted))} {shlex.quote(str(alias))} && "
                                 + _doit_line("export", "case=c1", f"dest={dest}", workspace=ws))
    _one_line_error(result, "INVALID_ARGUMENT")
    assert "is inside the workspace" in result.stderr
    assert kit.tree_digest(ws) == before
    # The same destination with nothing mounted there is exported to.
    exported = kit.doit("export", "case=c1", f"dest={dest}", workspace=ws)
    assert exported.returncode == 0, exported.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["case.json", "case_summary.md", "manifest.json"]


def test_export_refuses_a_folder_of_a_filesystem_mounted_inside_the_workspace(tmp_path):
    # The workspace on a filesystem of its own, a tmpfs mounted inside it and
    # one of that tmpfs's folders bound elsewhere: no ancestor of the
    # destination shares the workspace's device, which is where the first fix
    # stopped looking (found by the re-review).
    source = standard_package(tmp_path / "src")
    volume, alias = tmp_path / "volume", tmp_path / "alias"
    volume.mkdir()
    alias.mkdir()
    ws = volume / "ws"
    inner_mount = ws / "cases" / "c1" / "extra"
    q = shlex.quote
    result = _in_mount_namespace(
        f"mount -t tmpfs tmpfs {q(str(volume))} && "
        + _doit_line("admit", "case=c1", f"source={source}", workspace=ws) + " && "
        + _doit_line("build", "case=c1", workspace=ws) + " && "
        f"mkdir {q(str(inner_mount))} && mount -t tmpfs tmpfs {q(str(inner_mount))} && "
        f"mkdir {q(str(inner_mount / 'inner'))} && mount --bind {q(str(inner_mount / 'inner'))} {q(str(alias))} && "
        + _doit_line("export", "case=c1", f"dest={alias / 'out'}", workspace=ws)
        + f"; status=$?; ls -A {q(str(inner_mount / 'inner'))}; exit $status"
    )
    _one_line_error(result, "INVALID_ARGUMENT")
    assert "is inside the workspace" in result.stderr
    assert "out" not in result.stdout.split()  # ls: nothing was written into the mounted folder


def _assert_export_refused_after(setup: str, ws: Path, dest) -> None:
    """An export to ``dest`` right after ``setup`` (sh, in a mount namespace of
    its own) is refused as inside the workspace, which it leaves unchanged."""
    before = kit.tree_digest(ws)
    result = _in_mount_namespace(setup + " && " + _doit_line("export", "case=c1", f"dest={dest}", workspace=ws))
    _one_line_error(result, "INVALID_ARGUMENT")
    assert "is inside the workspace" in result.stderr
    assert kit.tree_digest(ws) == before


@pytest.mark.parametrize("hiding", ["covered", "moved"])
def test_export_sees_through_a_mount_that_another_hides(tmp_path, hiding):
    # The mount table lists mounts that a later one hides: a tmpfs at m/d/new
    # under a bind of the workspace's cases on m/d, or a tmpfs at m/d2 that a
    # moved bind of the cases lies on. Taking the longest listed mount point,
    # the first mount-table check exported into the workspace through both
    # (found by the second re-review).
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    m = tmp_path / "m"
    q = lambda path: shlex.quote(str(path))  # noqa: E731
    cases = ws / "cases"
    if hiding == "covered":
        (m / "d" / "new").mkdir(parents=True)
        setup = f"mount -t tmpfs none {q(m / 'd' / 'new')} && mount --bind {q(cases)} {q(m / 'd')}"
        dest = m / "d" / "new"
    else:
        (m / "stage").mkdir(parents=True)
        (m / "d2").mkdir()
        setup = (f"mount --bind {q(cases)} {q(m / 'stage')} && mount -t tmpfs none {q(m / 'd2')} && "
                 f"mount --move {q(m / 'stage')} {q(m / 'd2')}")
        dest = m / "d2" / "x"
    _assert_export_refused_after(setup, ws, dest)


def test_export_refuses_an_overlay_that_writes_into_the_workspace(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    lower, merged = tmp_path / "lower", tmp_path / "merged"
    lower.mkdir()
    merged.mkdir()
    q = lambda path: shlex.quote(str(path))  # noqa: E731
    setup = (f"mkdir {q(ws / 'up')} {q(ws / 'wk')} && mount -t overlay o -o "
             f"lowerdir={lower},upperdir={ws / 'up'},workdir={ws / 'wk'} {q(merged)}")
    result = _in_mount_namespace(setup + " && " + _doit_line("export", "case=c1", f"dest={merged / 'e'}", workspace=ws)
                                 + f"; status=$?; ls -A {q(ws / 'up')}; exit $status")
    _one_line_error(result, "INVALID_ARGUMENT")
    assert "is inside the workspace" in result.stderr
    assert "e" not in result.stdout.split()  # ls: nothing landed in the upper folder


@pytest.mark.parametrize("trick", ["magic-link", "mount-over-root"])
def test_export_walks_the_workspace_when_the_mount_table_disagrees_with_what_it_sees(tmp_path, trick):
    # Two ways the table misleads (found by the mount review): a /proc magic
    # link to a detached bind of the workspace's cases, which realpath reads as
    # "/"; and a tmpfs mounted over "/", which the process does not walk from.
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    alias = tmp_path / "alias"
    alias.mkdir()
    q = lambda path: shlex.quote(str(path))  # noqa: E731
    if trick == "magic-link":
        setup = f"mount --bind {q(ws / 'cases')} {q(alias)} && exec 7<{q(alias)} && umount -l {q(alias)}"
        dest = "/proc/self/fd/7/zz"
    else:
        setup = f"mount --bind {q(ws / 'cases')} {q(alias)} && mount -t tmpfs x / && cd {q(REPO)}"
        dest = str(alias / "zz")
    _assert_export_refused_after(setup, ws, dest)


def test_status_and_probes_only_read_the_store_and_work_on_a_read_only_workspace(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    # A clean close leaves no -wal or -shm file: the hardest case for a
    # read-only open of a WAL database.
    assert not (ws / "checkpoints.sqlite3-shm").exists()
    before = kit.tree_digest(ws)
    result = _in_mount_namespace(
        f"mount --bind -o ro {shlex.quote(str(ws))} {shlex.quote(str(ws))} && "
        + _doit_line("status", "case=c1", workspace=ws) + " && " + _doit_line("probes", "case=c1", workspace=ws)
    )
    assert result.returncode == 0, result.stderr
    assert "state: BUILDING_CASE" in result.stdout and "publish: up to date" in result.stdout
    assert kit.tree_digest(ws) == before


def test_status_never_writes_a_schema_into_an_empty_store(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "checkpoints.sqlite3").write_bytes(b"")
    for command in ("status", "probes"):
        _one_line_error(kit.doit(command, "case=c1", workspace=ws), "UNKNOWN_CASE")
    assert (ws / "checkpoints.sqlite3").read_bytes() == b""


def test_status_does_not_call_a_case_up_to_date_whose_published_file_is_gone(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    (kit.package_dir(ws, "c1") / "content" / "case" / "revisions" / "0001" / "case.json").unlink()
    before = kit.tree_digest(ws)
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    assert "publish: would fail: the confirmed case/revisions/0001/case.json is missing or changed in the package content" in status.stdout
    assert kit.tree_digest(ws) == before
    assert kit.doit("build", "case=c1", workspace=ws).returncode != 0  # as status said


def test_a_listed_input_gone_from_the_content_is_named_by_status_and_build(tmp_path):
    """A workspace copied while a command ran, or changed by hand: a file the
    manifest lists is gone. Status said "would run: to verify it again" and
    the build REFERENCE_MISSING, which points at the package's index
    (session 24's reviews); both now name the workspace's damage."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    content = kit.package_dir(ws, "c1") / "content"
    (content / "original" / "report-b.json").unlink()
    (content / "original" / "runtime.log").unlink()
    for attempt in range(2):
        # Also after a build failed on it, which leaves no cache record of the
        # file (status then said "would run: not read yet", publish "reuse").
        status = kit.doit("status", "case=c1", workspace=ws)
        assert status.returncode == 0, status.stderr
        for task in ("read_input:original/report-b.json", "hash_context:original/runtime.log"):
            assert (f"{task}: would fail: INTEGRITY_ERROR: the manifest lists this file but the package content no longer "
                    "holds it") in status.stdout, status.stdout
        assert "publish: would not run: the build stops at read_input:original/report-b.json, whose file is gone" in status.stdout
        line = _one_line_error(kit.doit("build", "case=c1", workspace=ws), "INTEGRITY_ERROR")
        assert "the manifest lists this file but the package content no longer holds it" in line, line


def test_status_with_a_later_step_ignored_still_foretells_the_gone_input(tmp_path):
    """An ignored render hid the gone input's outcome: status said assemble
    would run, while the build failed at the input's step (session 24's
    second re-review)."""
    ws = _admitted(tmp_path)
    assert kit.doit("ignore", "render", "case=c1", workspace=ws).returncode == 0
    (kit.package_dir(ws, "c1") / "content" / "original" / "report-b.json").unlink()
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "  assemble: would not run: the build stops at read_input:original/report-b.json, whose file is gone" in outlook, outlook
    assert "  render: ignored (`doit ignore`)" in outlook, outlook
    _one_line_error(kit.doit("build", "case=c1", workspace=ws), "INTEGRITY_ERROR")


def test_reopen_and_append_refuse_to_publish_over_a_package_missing_a_listed_file(tmp_path):
    """They read no earlier file, and went on publishing generations over a
    package a copy taken while a command ran had left without its files
    (session 24's re-review): refused, naming the file, nothing published."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    log = kit.package_dir(ws, "c1") / "content" / "original" / "runtime.log"
    kept = log.read_bytes()
    log.unlink()
    line = _one_line_error(kit.doit("reopen", "case=c1", "by=human:t", "reason=r", workspace=ws), "INTEGRITY_ERROR")
    assert "the manifest lists this file but the package content no longer holds it" in line and "(original/runtime.log)" in line
    assert len(kit.manifests(ws, "c1")) == 2
    log.write_bytes(kept)
    assert kit.doit("reopen", "case=c1", "by=human:t", "reason=r", workspace=ws).returncode == 0
    log.write_bytes(kept[:-1])  # cut short: not its size
    extra = kit.make_append(tmp_path / "extra", files={"original/later.json": kit.report("Later", observations=[{"text": "x"}])},
                            index=kit.index(reports=["original/later.json"]))
    line = _one_line_error(kit.doit("append", "case=c1", f"source={extra}", workspace=ws), "INTEGRITY_ERROR")
    assert "(original/runtime.log)" in line
    assert len(kit.manifests(ws, "c1")) == 3


def test_a_case_directory_without_its_store_row_is_named_as_such(tmp_path):
    # A killed admission after its rename and before its store row: commands
    # other than admit say what is there instead of "no case".
    ws = _admitted(tmp_path)
    source = standard_package(tmp_path / "src2")
    killed = kit.doit("admit", "case=c2", f"source={source}", workspace=ws, env_extra={"VIANO_CRASH_AT": "admit:after-rename"})
    assert killed.returncode != 0 and (ws / "cases" / "c2").is_dir()
    for args in (("status", "case=c2"), ("build", "case=c2"), ("export", "case=c2", f"dest={tmp_path / 'out'}")):
        line = _one_line_error(kit.doit(*args, workspace=ws), "UNKNOWN_CASE")
        assert "though cases/c2 exists (an interrupted admission, cleared by the next admit of c2" in line, (args, line)
    readmitted = kit.doit("admit", "case=c2", f"source={source}", workspace=ws)
    assert readmitted.returncode == 0, readmitted.stderr


def test_status_of_a_store_that_is_a_fifo_is_one_coded_line_at_once(tmp_path):
    # A read-only open of a FIFO waits for a writer that never comes.
    ws = _admitted(tmp_path)
    store = ws / "checkpoints.sqlite3"
    store.unlink()
    os.mkfifo(store)
    for command in ("status", "probes", "build"):
        line = _one_line_error(kit.doit(command, "case=c1", workspace=ws, timeout=60), "IO_ERROR")
        assert "not a regular file" in line, (command, line)


def test_status_on_a_read_only_workspace_refuses_a_log_it_cannot_read(tmp_path):
    # Opened as immutable (no shared-memory file can be made there), SQLite
    # would skip the write-ahead log and show an older state without a word.
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1]); c.execute('select 1 from cases').fetchall(); "
                               "print('ready', flush=True); time.sleep(60)", str(ws / "checkpoints.sqlite3")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert kit.doit("reopen", "case=c1", "by=human:a", "reason=r", workspace=ws).returncode == 0
    finally:
        holder.kill()  # its connection never merged the log: it stays
        holder.wait()
        holder.stdout.close()
    (ws / "checkpoints.sqlite3-shm").unlink()
    assert (ws / "checkpoints.sqlite3-wal").stat().st_size > 0
    result = _in_mount_namespace(f"mount --bind -o ro {shlex.quote(str(ws))} {shlex.quote(str(ws))} && "
                                 + _doit_line("status", "case=c1", workspace=ws))
    line = _one_line_error(result, "IO_ERROR")
    assert "write-ahead log" in line and "read-only filesystem" in line


@pytest.mark.parametrize("moment", ["as it links its summary", "after it linked its case"])
def test_a_file_put_in_the_destination_during_an_export_is_never_taken_for_its_own(tmp_path, monkeypatch, moment):
    # Another party puts a different case_summary.md in the destination after
    # the export looked: the export refuses (never overwrites) and takes back
    # its case.json, but their file stays. "after it linked its case": the
    # export used to skip a file it found there by then, unread, and report
    # a set that was not its own.
    from pipeline import packages
    from pipeline.commands import cmd_export
    from pipeline.errors import VianoError

    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    dest = tmp_path / "out"
    real = packages.write_durable
    trigger = "case_summary.md" if moment == "as it links its summary" else "case.json"

    def racing(directory, name, data):
        if name == trigger == "case_summary.md":
            (Path(directory) / name).write_bytes(b"theirs\n")
        found = real(directory, name, data)
        if name == trigger == "case.json":
            (Path(directory) / "case_summary.md").write_bytes(b"theirs\n")
        return found

    monkeypatch.setattr(packages, "write_durable", racing)
    with pytest.raises(VianoError) as info:
        cmd_export(case="c1", dest=str(dest), workspace=str(ws))
    assert info.value.code == "CONTENT_CONFLICT"
    assert sorted(p.name for p in dest.iterdir()) == ["case_summary.md"]
    assert (dest / "case_summary.md").read_bytes() == b"theirs\n"


@contextlib.contextmanager
def _directory_locked(directory: Path):
    """``directory`` flock-ed as another export would hold it (a descriptor of
    its own: flock keeps two open descriptions apart, in one process too)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_an_export_waits_while_another_export_writes_to_its_destination(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    dest = tmp_path / "out"
    dest.mkdir()
    with _directory_locked(dest):
        child = subprocess.Popen(
            ["doit", "-f", str(REPO / "dodo.py"), "export", "case=c1", f"dest={dest}", f"workspace={ws}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=doit_env(),
        )
        try:
            waiting = child.stderr.readline()  # its first line: it waits, having written nothing
            assert waiting.startswith(f"waiting for {dest}: another export is writing there"), waiting
            assert child.poll() is None and list(dest.iterdir()) == []
        except BaseException:
            child.kill()
            child.communicate()
            raise
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert "exported case c1 revision 1" in out
    assert sorted(p.name for p in dest.iterdir()) == ["case.json", "case_summary.md", "manifest.json"]


def test_an_export_gives_up_on_a_destination_held_too_long(tmp_path, monkeypatch):
    from pipeline import commands
    from pipeline.errors import VianoError

    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    dest = tmp_path / "out"
    dest.mkdir()
    monkeypatch.setattr(commands, "EXPORT_LOCK_TIMEOUT", 0.2)
    with _directory_locked(dest), pytest.raises(VianoError) as info:
        commands.cmd_export(case="c1", dest=str(dest), workspace=str(ws))
    assert info.value.code == "LOCK_TIMEOUT" and "another export" in str(info.value)
    assert list(dest.iterdir()) == []


def test_export_from_a_read_only_workspace(tmp_path):
    # An archived or read-only mounted workspace: nothing can be locked or
    # rolled forward there, and the confirmed case is exported as it stands.
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    dest = tmp_path / "out"
    before = kit.tree_digest(ws)
    result = _in_mount_namespace(f"mount --bind -o ro {shlex.quote(str(ws))} {shlex.quote(str(ws))} && "
                                 + _doit_line("export", "case=c1", f"dest={dest}", workspace=ws))
    assert result.returncode == 0, result.stderr
    assert "exported case c1 revision 1" in result.stdout
    published = kit.package_dir(ws, "c1") / "content" / "case" / "revisions" / "0001"
    assert (dest / "case.json").read_bytes() == (published / "case.json").read_bytes()
    assert (dest / "case_summary.md").read_bytes() == (published / "case_summary.md").read_bytes()
    assert kit.tree_digest(ws) == before


@pytest.mark.parametrize(("command", "names"), [(("reopen", "by=human:a", "reason=r"), "(checkpoints.sqlite3)"),
                                                (("append", "source=APPEND"), "(checkpoints.sqlite3)"),
                                                (("build",), "/.locks/c1.lock)")])
def test_a_writing_command_on_a_read_only_workspace_names_the_file_it_cannot_write(tmp_path, command, names):
    # And says why: SQLite's own word for a store it cannot write there was
    # "unable to open database file" (reopen and append, until session 22).
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    extra = _report_append(tmp_path, "extra", ["original/report-a.json", "original/report-b.json"])
    command = tuple(f"source={extra}" if argument == "source=APPEND" else argument for argument in command)
    before = kit.tree_digest(ws)
    result = _in_mount_namespace(f"mount --bind -o ro {shlex.quote(str(ws))} {shlex.quote(str(ws))} && "
                                 + _doit_line(*command, "case=c1", workspace=ws))
    line = _one_line_error(result, "IO_ERROR")
    assert line.endswith(names) and "read-only" in line.lower(), line
    assert kit.tree_digest(ws) == before


@pytest.mark.parametrize("output", ["case.json", "case_summary.md", "case-built.json"])
@pytest.mark.parametrize("damage", ["one byte flipped", "truncated", "appended to"])
def test_a_no_op_build_checks_the_published_outputs_and_names_their_damage(tmp_path, output, damage):
    # Seed 001: repeats check the case contract and summary before they reuse
    # them. A published output changed in place (same size or not) must not be
    # called confirmed by a no-op build with its cache, as it is not without.
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    target = kit.package_dir(ws, "c1") / "content" / "case" / "revisions" / "0001" / output
    data = bytearray(target.read_bytes())
    if damage == "truncated":
        del data[-1]
    elif damage == "appended to":
        data += b"\n"
    else:
        data[len(data) // 2] ^= 0x01
    target.chmod(0o644)
    target.write_bytes(bytes(data))
    before = kit.tree_digest(ws)
    status = kit.doit("status", "case=c1", workspace=ws)
    assert f"publish: would fail: the confirmed case/revisions/0001/{output} is missing or changed" in status.stdout
    # One message whatever the damage (a grown file read as "more than N bytes" misled).
    said = f"INTEGRITY_ERROR: content does not match the manifest's size and SHA-256 (case/revisions/0001/{output})"
    assert _one_line_error(kit.doit("build", "case=c1", workspace=ws), "INTEGRITY_ERROR") == said
    assert kit.tree_digest(ws) == before
    shutil.rmtree(ws / ".cache" / "c1")  # the cache-less build says the same
    assert _one_line_error(kit.doit("build", "case=c1", workspace=ws), "INTEGRITY_ERROR") == said
    if output != "case-built.json":  # (export copies the case and the summary, not the checkpoint artifact)
        exported = kit.doit("export", "case=c1", f"dest={tmp_path / 'out'}", workspace=ws)
        assert _one_line_error(exported, "INTEGRITY_ERROR") == said


def test_a_no_op_build_still_reuses_outputs_only_touched(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    content = kit.package_dir(ws, "c1") / "content"
    manifests = sorted(p.name for p in (content.parent / "manifests").iterdir())
    for output in ("case.json", "case_summary.md", "case-built.json"):
        os.utime(content / "case" / "revisions" / "0001" / output, ns=(1, 1))
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert "confirmed at generation 2" in again.stdout
    assert sorted(p.name for p in (content.parent / "manifests").iterdir()) == manifests


def _damage_in_place(path: Path) -> None:
    """Change one byte without changing the size (a bit flip; a rewrite by hand)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"e")  # inside a JSON string or a log line: still the same size
    data[at] = ord("E")
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def _executed(result) -> list[str]:
    return [line[3:] for line in result.stderr.splitlines() if line.startswith(".  ")]


@pytest.mark.parametrize(
    ("damaged", "after"),
    [
        ("original/report-a.json", "reopen"),  # inherited by the next revision (seed 001: hash-checked, re-read)
        ("original/report-a.json", "nothing"),  # a no-op of the confirmed case
        ("original/runtime.log", "nothing"),  # an opaque file: its REF is cached too
        ("original/case-inputs.json", "nothing"),  # the index: the cached plan is derived from it
    ],
)
def test_a_build_with_its_cache_finds_content_damaged_since_it_was_read(tmp_path, damaged, after):
    # Records derived from a content file are trusted by its sha256, so a file
    # changed in place after its record was made must still be found: the
    # build refuses it as a build without the cache does.
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    if after == "reopen":
        assert kit.doit("reopen", "case=c1", "by=human:qa", "reason=more", workspace=ws).returncode == 0
    _damage_in_place(kit.package_dir(ws, "c1") / "content" / damaged)
    status = kit.doit("status", "case=c1", workspace=ws)
    if damaged.endswith(".log"):  # an opaque file, which status does not hash
        assert f"hash_context:{damaged}: would run: to verify it again" in status.stdout, status.stdout
    elif damaged != "original/case-inputs.json":  # (an index is read by planning, which status does itself)
        # A document the build reads again is hashed by status too (since session 30).
        assert (f"read_input:{damaged}: would fail: INTEGRITY_ERROR: content does not match the manifest's size and "
                f"SHA-256 ({damaged})") in status.stdout, status.stdout
    before = kit.tree_digest(kit.package_dir(ws, "c1"))  # (the build may keep its start checkpoint)
    line = _one_line_error(kit.doit("build", "case=c1", workspace=ws), "INTEGRITY_ERROR")
    assert line.endswith(f"({damaged})")
    assert kit.tree_digest(kit.package_dir(ws, "c1")) == before
    shutil.rmtree(ws / ".cache" / "c1")
    line = _one_line_error(kit.doit("build", "case=c1", workspace=ws), "INTEGRITY_ERROR")
    assert line.endswith(f"({damaged})")


def test_a_touched_input_is_verified_again_once_and_so_is_every_input_of_a_restored_copy(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert _executed(kit.doit("build", "case=c1", workspace=ws)) == ["validate_index"]
    # Same bytes, new mtime: read and verified again, then trusted again.
    os.utime(kit.package_dir(ws, "c1") / "content" / "original" / "report-b.json", ns=(5, 5))
    touched = kit.doit("build", "case=c1", workspace=ws)
    assert touched.returncode == 0, touched.stderr
    assert _executed(touched) == ["validate_index", "read_input:original/report-b.json"]
    assert _executed(kit.doit("build", "case=c1", workspace=ws)) == ["validate_index"]
    # A workspace restored from a copy that kept the times (cp -a, rsync -a,
    # a backup): new change times, so every input is read and verified once
    # more (an archive that restores times could hide a change: RELIABILITY
    # 43), then trusted again.
    aside = tmp_path / "aside"
    ws.rename(aside)
    shutil.copytree(aside, ws, symlinks=True)
    restored = kit.doit("build", "case=c1", workspace=ws)
    assert restored.returncode == 0, restored.stderr
    assert "validate_index" in _executed(restored)
    assert {t for t in _executed(restored) if t.startswith(("read_input:", "hash_context:"))} == {
        "read_input:original/report-a.json", "read_input:original/report-b.json", "read_input:original/repro.json",
        "hash_context:original/db.sql", "hash_context:original/runtime.log", "hash_context:original/notes.txt",
        "hash_context:original/screen.png"}
    assert "confirmed" in restored.stdout
    assert _executed(kit.doit("build", "case=c1", workspace=ws)) == ["validate_index"]


@pytest.mark.parametrize("damaged", ["original/report-a.json", "original/db.sql"])
def test_a_change_whose_size_and_modification_time_were_put_back_is_found(tmp_path, damaged):
    """RELIABILITY 43: an input rewritten in place with its old size and its
    modification time put back (utime, or an archive restoring times) is
    INTEGRITY_ERROR with the cache as without it (the change time tells);
    it was reused as confirmed (found by a hostile-input audit)."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    path = kit.package_dir(ws, "c1") / "content" / damaged
    before = path.stat()
    _damage_in_place(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    line = _one_line_error(kit.doit("build", "case=c1", workspace=ws), "INTEGRITY_ERROR")
    assert line.endswith(f"({damaged})")


def test_a_build_started_before_its_case_was_admitted_holds_the_case_lock_once_it_exists(tmp_path):
    # doit loads the build's tasks (and takes the case lock for the whole
    # run) before the first step; a case admitted in between must not leave
    # the rest of that run, which writes the case's cache, without the lock.
    from pipeline.errors import VianoError
    from pipeline.workspace import case_lock

    ws = tmp_path / "ws"
    ws.mkdir()
    steps = tmp_path / "steps"
    steps.mkdir()
    child = kit.stepping_doit("build:validate-index,build:assemble", steps, "build", "case=c1", workspace=ws)
    try:
        kit.reach_step(child, steps, "build:validate-index")
        admitted = kit.doit("admit", "case=c1", f"source={standard_package(tmp_path / 'src')}", workspace=ws)
        assert admitted.returncode == 0, admitted.stderr
        (steps / "build:validate-index.go").touch()
        kit.reach_step(child, steps, "build:assemble")
        with pytest.raises(VianoError) as held:
            with case_lock(Workspace(ws), "c1", timeout=0.2):
                pass
        assert held.value.code == "LOCK_TIMEOUT"
        (steps / "build:assemble.go").touch()
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert "confirmed at generation 2" in out
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


def _interrupted_store_creation(ws: Path) -> None:
    """The store as a first admission killed while creating it leaves it: the
    switch to WAL written to the file's one page, its rollback journal not yet
    deleted (a hot journal, which only a writer may roll back)."""
    ws.mkdir(parents=True)
    store = ws / "checkpoints.sqlite3"
    connection = sqlite3.connect(store)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.close()
    header = (bytes.fromhex("d9d505f920a163d7") + (0).to_bytes(4, "big") + (0x16C32D62).to_bytes(4, "big")
              + (0).to_bytes(4, "big") + (512).to_bytes(4, "big") + (4096).to_bytes(4, "big"))
    (ws / "checkpoints.sqlite3-journal").write_bytes(header.ljust(512, b"\0"))


def test_status_after_an_interrupted_store_creation_says_no_case_and_admit_recovers(tmp_path):
    ws = tmp_path / "ws"
    _interrupted_store_creation(ws)
    before = kit.tree_digest(ws)
    for command in ("status", "probes"):
        _one_line_error(kit.doit(command, "case=c1", workspace=ws), "UNKNOWN_CASE")
    assert kit.tree_digest(ws) == before  # observers roll nothing back
    admitted = kit.doit("admit", "case=c1", f"source={standard_package(tmp_path / 'src')}", workspace=ws)
    assert admitted.returncode == 0, admitted.stderr
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0 and "state: VALIDATED" in status.stdout, status.stderr


def test_a_hot_journal_beside_a_store_with_cases_is_an_io_error_for_observers(tmp_path):
    ws = _admitted(tmp_path)
    store = ws / "checkpoints.sqlite3"
    assert store.stat().st_size > 4096
    header = (bytes.fromhex("d9d505f920a163d7") + (0).to_bytes(4, "big") + (0x16C32D62).to_bytes(4, "big")
              + (store.stat().st_size // 4096).to_bytes(4, "big") + (512).to_bytes(4, "big") + (4096).to_bytes(4, "big"))
    (ws / "checkpoints.sqlite3-journal").write_bytes(header.ljust(512, b"\0"))
    line = _one_line_error(kit.doit("status", "case=c1", workspace=ws), "IO_ERROR")
    assert "only a writing command (admit, append, build, reopen) on a writable mount can roll back" in line


def test_an_export_killed_before_a_file_is_in_place_leaves_no_temp_in_the_destination(tmp_path):
    # The destination is the user's directory: no roll-forward ever cleans
    # it, so nothing but finished files may appear there, even on SIGKILL.
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    out = tmp_path / "out"
    killed = kit.doit("export", "case=c1", f"dest={out}", workspace=ws, env_extra={"VIANO_CRASH_AT": "export:before-link"})
    assert killed.returncode == -9
    assert list(out.iterdir()) == []
    again = kit.doit("export", "case=c1", f"dest={out}", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in out.iterdir()) == ["case.json", "case_summary.md", "manifest.json"]


def test_the_retry_of_an_admission_killed_after_its_commit_clears_its_staging_tree(tmp_path):
    ws = tmp_path / "ws"
    source = standard_package(tmp_path / "src")
    killed = kit.doit("admit", "case=c1", f"source={source}", workspace=ws, env_extra={"VIANO_CRASH_AT": "admit:after-commit"})
    assert killed.returncode == -9
    assert [p.name for p in (ws / ".staging").iterdir()]  # the killed run's tree and owner file
    _one_line_error(kit.doit("admit", "case=c1", f"source={source}", workspace=ws), "CASE_EXISTS")
    assert not (ws / ".staging").exists() or list((ws / ".staging").iterdir()) == []


def test_a_folder_of_the_content_replaced_by_a_symlink_is_refused_with_the_cache_as_without(tmp_path):
    # RELIABILITY 28: a symlink on the way to a content file is REFERENCE_UNSAFE.
    # The cached records of the files under it must not hide it.
    reports = {"original/reports/a.json": kit.report("A", observations=[{"text": "seen"}]),
               "original/reports/b.json": kit.report("B")}
    source = kit.make_package(tmp_path / "src", files={**reports, "original/run.log": "line\n"},
                              index=kit.index(reports=list(reports)))
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    content = kit.package_dir(ws, "c1") / "content"
    copy = tmp_path / "elsewhere"
    shutil.copytree(content / "original" / "reports", copy)  # same bytes, same times
    shutil.rmtree(content / "original" / "reports")
    (content / "original" / "reports").symlink_to(copy)
    status = kit.doit("status", "case=c1", workspace=ws)
    line = _one_line_error(kit.doit("build", "case=c1", workspace=ws), "REFERENCE_UNSAFE")
    assert "original/reports/" in line
    # status names the refusal the build then gives (it said "would run: to verify it again")
    assert f"read_input:original/reports/a.json: would fail: {line}" in status.stdout, status.stdout
    assert "hash_context:original/run.log: up to date" in status.stdout
    shutil.rmtree(ws / ".cache" / "c1")
    _one_line_error(kit.doit("build", "case=c1", workspace=ws), "REFERENCE_UNSAFE")


def test_an_append_no_build_could_take_is_refused_before_anything_is_written(tmp_path):
    # What earlier indexes listed stays inherited and no later index drops
    # it, so an append past the whole build's document count would leave the
    # revision unbuildable for good (reopen needs a built case). Refused at
    # append time; one document fewer is accepted and builds.
    ws = _admitted(tmp_path)  # 2 reports + 1 reproduction + the index
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:qa", "reason=more", workspace=ws).returncode == 0

    def many(root: Path, count: int) -> Path:
        names = [f"new/r{i:03}.json" for i in range(count)]
        return kit.make_append(root, files={name: kit.report(name) for name in names}, index=kit.index(reports=names))

    before = kit.tree_digest(kit.package_dir(ws, "c1"))
    line = _one_line_error(kit.doit("append", "case=c1", f"source={many(tmp_path / 'too-many', 253)}", workspace=ws), "LIMIT_EXCEEDED")
    assert "after this append the build would read 257 structured documents (limit 256; a workspace's limits.json can raise" in line
    assert line.endswith("(case-inputs.json)")
    assert kit.tree_digest(kit.package_dir(ws, "c1")) == before
    assert kit.doit("append", "case=c1", f"source={many(tmp_path / 'just-enough', 252)}", workspace=ws).returncode == 0
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr


def test_status_says_when_another_command_holds_the_case_lock(tmp_path):
    ws = _admitted(tmp_path)
    assert "lock: held now" not in kit.doit("status", "case=c1", workspace=ws).stdout
    with _case_lock_held_by_another_process(ws, tmp_path / "ready"):
        status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    assert "lock: held now by another command (a build, append, reopen or admission is running)" in status.stdout
    assert "lock: held now" not in kit.doit("status", "case=c1", workspace=ws).stdout


def test_status_does_not_wait_on_a_fifo_planted_as_the_lock_file(tmp_path):
    """status only looks at the lock: a FIFO there (nothing writes to it)
    must not hold it up waiting for a writer."""
    ws = _admitted(tmp_path)
    lock = ws / ".locks" / "c1.lock"
    lock.unlink()
    os.mkfifo(lock)
    result = subprocess.run(["doit", "-f", str(REPO / "dodo.py"), "-d", str(REPO), "status", "case=c1", f"workspace={ws}"],
                            capture_output=True, text=True, env=doit_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    assert "state: VALIDATED" in result.stdout and "lock: held now" not in result.stdout


@pytest.mark.parametrize("folder", [".locks", ".cache", ".cache/c1"])
def test_status_refuses_a_symlinked_workspace_folder_as_every_command_does(tmp_path, folder):
    """A symlinked .cache was refused only once status had printed half its
    report (found by session 21's review); .locks was refused first."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    (ws / folder).rename(tmp_path / "elsewhere")
    (ws / folder).symlink_to(tmp_path / "elsewhere")
    for command in ("status", "build"):
        result = kit.doit(command, "case=c1", workspace=ws)
        line = _one_line_error(result, "REFERENCE_UNSAFE")
        assert line.endswith(f"({folder})"), line
        assert result.stdout == "", result.stdout  # no partial report before the refusal


@pytest.mark.parametrize("option", [["-n", "2"], ["--proc=2"], ["-n2"]])
def test_build_steps_in_worker_processes_are_refused_at_once(tmp_path, option):
    # doit's process workers run steps in forked children, which do not hold
    # the case lock and would wait for it in vain (60 s, then LOCK_TIMEOUT).
    ws = _admitted(tmp_path)
    before = kit.tree_digest(kit.package_dir(ws, "c1"))
    started = time.monotonic()
    result = subprocess.run(["doit", "-f", str(REPO / "dodo.py"), "-d", str(REPO), *option, "build", "case=c1", f"workspace={ws}"],
                            capture_output=True, text=True, env=doit_env(), timeout=120)
    assert time.monotonic() - started < 30
    line = _one_line_error(result, "INVALID_ARGUMENT")
    assert "build steps cannot run in several processes" in line
    assert kit.tree_digest(kit.package_dir(ws, "c1")) == before
    threads = subprocess.run(["doit", "-f", str(REPO / "dodo.py"), "-d", str(REPO), "-n", "2", "-P", "thread", "build",
                              "case=c1", f"workspace={ws}"], capture_output=True, text=True, env=doit_env(), timeout=120)
    assert threads.returncode == 0, threads.stderr


def test_a_build_with_thread_workers_always_ends_with_its_confirmed_line(tmp_path):
    # doit swaps sys.stdout for a capture around each action; two actions on
    # two threads could leave one's capture in place for good, and the
    # build's closing line went into it: exit 0, nothing on stdout (about
    # one build in two).
    ws = tmp_path / "ws"
    cases = [f"c{n}" for n in range(1, 7)]
    for case in cases:  # the sample: its steps overlap more often than the standard package's
        assert kit.doit("admit", f"case={case}", f"source={FIXTURES / 'sample'}", workspace=ws).returncode == 0
    # As a user's shell runs it: PYTHONUNBUFFERED unset (this machine's shells
    # set it, which hid the line lost unflushed; session 23's review as a user).
    env = {name: value for name, value in doit_env().items() if name != "PYTHONUNBUFFERED"}
    for case in cases:
        result = subprocess.run(["doit", "-f", str(REPO / "dodo.py"), "-d", str(REPO), "-n", "2", "-P", "thread", "build",
                                 f"case={case}", f"workspace={ws}"], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"case {case} revision 1: case/revisions/0001/case.json and "), (case, result.stdout)


def test_status_in_the_same_run_as_a_build_does_not_call_its_own_lock_another_commands(tmp_path):
    ws = _admitted(tmp_path)
    result = kit.doit("build", "status", "case=c1", workspace=ws)
    assert result.returncode == 0, result.stderr
    assert "state: BUILDING_CASE" in result.stdout and "lock: held now" not in result.stdout


def test_a_repeated_append_near_the_limits_still_says_there_is_nothing_to_append(tmp_path):
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:qa", "reason=more", workspace=ws).returncode == 0
    names = [f"new/r{i:03}.json" for i in range(252)]  # 256 documents with the index: the limit exactly
    source = kit.make_append(tmp_path / "app", files={n: kit.report(n) for n in names}, index=kit.index(reports=names))
    assert kit.doit("append", "case=c1", f"source={source}", workspace=ws).returncode == 0
    again = kit.doit("append", "case=c1", f"source={source}", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert "nothing to append" in again.stdout


def test_a_workspace_path_too_long_for_sqlite_says_so(tmp_path):
    """SQLite opens no file whose path is over ~503 bytes (512 with its
    journal's name): the store's IO_ERROR, and the dependency file's warning,
    name that cause instead of SQLite's bare "unable to open database file"."""
    deep = tmp_path.joinpath(*["w" * 200] * 3)
    deep.mkdir(parents=True)
    refused = kit.doit("admit", "case=c1", f"source={FIXTURES / 'sample'}", workspace=deep / "ws")
    assert refused.returncode == 1
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("IO_ERROR: checkpoint store I/O failure while opening: unable to open database file (its path is "), last
    assert "a shorter workspace path would do) (checkpoints.sqlite3)" in last, last
    # A path the store fits in, and a case id that takes the dependency file past it.
    room = 503 - len(os.fsencode(tmp_path / "ws2" / "checkpoints.sqlite3")) - 1  # what a folder between may take
    parts = ["x" * 200] * (room // 201) + ["x" * (room % 201 - 1)] if room % 201 > 1 else ["x" * 200] * (room // 201)
    ws = tmp_path.joinpath(*parts, "ws2")
    case_id = "c" * 120
    assert kit.doit("admit", f"case={case_id}", f"source={FIXTURES / 'sample'}", workspace=ws).returncode == 0
    built = kit.doit("build", f"case={case_id}", workspace=ws)
    assert built.returncode == 0, built.stderr
    assert "warning: IO_ERROR: the build's dependency file cannot be written (unable to open database file (its path is " in built.stderr
    assert "a shorter workspace path or case id would do)" in built.stderr, built.stderr


def test_a_cached_manifest_record_not_shaped_as_a_manifest_is_parsed_again(tmp_path):
    """status and probes take the checked manifests from the cache: a sealed
    record that is no manifest (a builder's bug, a forged seal) must not end
    them in a KeyError traceback; it is as if absent."""
    from pipeline.cache import BuildCache

    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    expected = {command: kit.doit(command, "case=c1", workspace=ws) for command in ("status", "probes")}
    cache = BuildCache(ws / ".cache" / "c1")
    records = sorted((ws / ".cache" / "c1").rglob("*.manifest.msgpack"))
    assert records
    for record in records:
        manifest = cache.read_msgpack(record, dict)
        del manifest["package_generation"]
        cache.write_msgpack(record, manifest)
    for command, before in expected.items():
        after = kit.doit(command, "case=c1", workspace=ws)
        assert after.returncode == 0 and "Traceback" not in after.stderr, after.stderr
        assert after.stdout == before.stdout


@pytest.mark.parametrize("record", ["plan.json", "content-stamps.json", "store-state.json", "out/case.json", "out/case_summary.md"])
def test_a_fifo_in_a_cache_records_place_holds_neither_status_nor_a_build(tmp_path, record):
    """status waited forever on a FIFO put where a cache record was, and so
    did a build on one in a cached output's place (found by session 21's
    review). Only a regular file is read; anything else is no record."""
    ws = _admitted(tmp_path)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    generations = len(kit.manifests(ws, "c1"))
    planted = ws / ".cache" / "c1" / record
    planted.unlink()
    os.mkfifo(planted)
    status = kit.doit("status", "case=c1", workspace=ws, timeout=60)
    assert status.returncode == 0 and "build outlook" in status.stdout, status.stderr
    built = kit.doit("build", "case=c1", workspace=ws, timeout=60)
    assert built.returncode == 0, built.stderr
    assert len(kit.manifests(ws, "c1")) == generations  # the confirmed case reused


def test_a_cached_output_unreadable_once_the_build_is_confirmed_is_no_traceback(tmp_path):
    """doit records what each task depended on after its action ran, outside
    any step of ours: a cached output that cannot be read then (a dying disk
    gave EIO; here a FIFO in its place) made doit's own traceback, exit 3,
    after the case was confirmed. Now the record says "changed", and the next
    build makes that output again."""
    ws = _admitted(tmp_path)
    steps = tmp_path / "steps"
    steps.mkdir()
    child = kit.stepping_doit("build:after-confirm", steps, "build", "case=c1", workspace=ws)
    try:
        kit.reach_step(child, steps, "build:after-confirm")
        summary = ws / ".cache" / "c1" / "out" / "case_summary.md"
        summary.unlink()
        os.mkfifo(summary)
        (steps / "build:after-confirm.go").touch()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert "Traceback" not in err, err
    assert child.returncode == 0, err
    assert "confirmed at generation 2" in out
    summary.unlink()
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    assert "  render: would run: no cached output" in status.stdout
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert "confirmed at generation 2" in again.stdout
    assert len(kit.manifests(ws, "c1")) == 2


def _small_volume(tmp_path: Path) -> tuple[Path, Path, list[str], str]:
    """A 30 MiB tmpfs for a workspace, as shell steps for :func:`_in_mount_namespace`:
    (volume, workspace, the steps that mount it and make the workspace with
    limits.json (no free-disk reserve, so that admissions fit), and a command
    that fills the volume but for ``FREE`` bytes, an environment variable, 0
    unless set; ``rm VOLUME/filler`` frees it again)."""
    volume, ws = tmp_path / "volume", tmp_path / "volume" / "ws"
    volume.mkdir()
    limits = json.dumps({"format": "viano-workspace-limits", "format_version": 1, "admission": {"free_disk_reserve": 0}})
    filler = tmp_path / "fill.py"
    filler.write_text(f"import os\nv = os.statvfs({str(volume)!r})\nfd = os.open({str(volume / 'filler')!r}, os.O_CREAT | os.O_WRONLY)\n"
                      "os.posix_fallocate(fd, 0, v.f_bavail * v.f_frsize - int(os.environ.get('FREE', '0')))\n")
    q = shlex.quote
    setup = [f"mount -t tmpfs -o size=30m tmpfs {q(str(volume))}", f"mkdir {q(str(ws))}",
             f"printf %s {q(limits)} > {q(str(ws / 'limits.json'))}"]
    return volume, ws, setup, f"{q(sys.executable)} {q(str(filler))}"


def test_status_export_and_probes_read_the_store_on_a_full_disk(tmp_path):
    """A build that failed for want of space leaves SQLite's shared-memory
    file short; readers must grow it and cannot ("disk I/O error"), so on a
    full disk status, export and probes of every case failed although the
    write-ahead log was empty. They now read the store without it."""
    _, ws, setup, fill = _small_volume(tmp_path)
    dest = tmp_path / "exported"
    source = standard_package(tmp_path / "src")
    script = " && ".join([
        *setup,
        _doit_line("admit", "case=c0", f"source={source}", workspace=ws) + " >/dev/null 2>&1",
        _doit_line("build", "case=c0", workspace=ws) + " >/dev/null 2>&1",
        _doit_line("admit", "case=c1", f"source={source}", workspace=ws) + " >/dev/null 2>&1",
        "FREE=40960 " + fill,
        "{ " + _doit_line("build", "case=c1", workspace=ws) + " >/dev/null 2>&1; echo build=$?; }",
        "{ " + _doit_line("status", "case=c0", workspace=ws) + "; echo status=$?; }",
        "{ " + _doit_line("probes", "case=c0", workspace=ws) + "; echo probes=$?; }",
        "{ " + _doit_line("export", "case=c0", f"dest={dest}", workspace=ws) + "; echo export=$?; }",
    ])
    result = _in_mount_namespace(script)
    assert "build=1" in result.stdout, (result.stdout, result.stderr)  # the disk is full indeed
    assert "status=0" in result.stdout and "state: BUILDING_CASE" in result.stdout, (result.stdout, result.stderr)
    assert "probes=0" in result.stdout and "export=0" in result.stdout, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "disk I/O error" not in result.stderr, result.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["case.json", "case_summary.md", "manifest.json"]


def test_status_on_a_full_disk_refuses_a_log_it_cannot_read(tmp_path):
    # As on a read-only filesystem: read without the shared-memory file, SQLite
    # would skip the write-ahead log and show an older state without a word.
    _, ws, setup, fill = _small_volume(tmp_path)
    source = standard_package(tmp_path / "src")
    holder = tmp_path / "hold.py"  # a connection that never merges the log: it stays
    holder.write_text("import sqlite3, sys, time\nc = sqlite3.connect(sys.argv[1]); c.execute('select 1 from cases').fetchall()\n"
                      "open(sys.argv[2], 'w').close(); time.sleep(60)\n")
    q = shlex.quote
    ready = tmp_path / "ready"
    script = " && ".join([
        *setup,
        _doit_line("admit", "case=c1", f"source={source}", workspace=ws) + " >/dev/null 2>&1",
        _doit_line("build", "case=c1", workspace=ws) + " >/dev/null 2>&1",
        f"{{ {q(sys.executable)} {q(str(holder))} {q(str(ws / 'checkpoints.sqlite3'))} {q(str(ready))} & }}",
        f"while [ ! -e {q(str(ready))} ]; do sleep 0.05; done",
        _doit_line("reopen", "case=c1", "by=human:a", "reason=r", workspace=ws) + " >/dev/null 2>&1",
        "kill $!", "{ wait; true; }", f"test -s {q(str(ws / 'checkpoints.sqlite3-wal'))}",
        # With its shared-memory file in place a reader needs no space (and reads
        # the log); without it, one must be made, which a full disk refuses.
        "{ " + _doit_line("status", "case=c1", workspace=ws) + " >/dev/null; echo before=$?; }",
        f"rm {q(str(ws / 'checkpoints.sqlite3-shm'))}",
        fill,
        "{ " + _doit_line("status", "case=c1", workspace=ws) + "; s=$?; echo status=$s; exit $s; }",
    ])
    result = _in_mount_namespace(script)
    assert "before=0" in result.stdout and "status=1" in result.stdout, (result.stdout, result.stderr)
    line = _one_line_error(result, "IO_ERROR")
    assert "write-ahead log" in line and "full filesystem" in line, line


@pytest.mark.parametrize("command", ["build", "append", "reopen"])
def test_a_publication_the_full_store_could_not_record_says_it_is_published(tmp_path, command):
    """The manifest is the commit point: when the store cannot record the
    generation after it (a full disk), the refusal says the work is kept and
    the next command takes it in, rather than a bare IO_ERROR."""
    volume, ws, setup, fill = _small_volume(tmp_path)
    steps = tmp_path / "steps"
    steps.mkdir()
    source = standard_package(tmp_path / "src")
    extra = kit.make_append(tmp_path / "extra", files={"original/n.json": kit.report("N")},
                            index=kit.index(reports=["original/n.json"]))
    arguments = {"build": ["build", "case=c1"], "append": ["append", "case=c1", f"source={extra}"],
                 "reopen": ["reopen", "case=c1", "by=human:a", "reason=r"]}[command]
    published = {"build": 2, "append": 2, "reopen": 3}[command]
    point = "publish:after-manifest-link"
    q = shlex.quote
    stepping = " ".join(q(a) for a in [sys.executable, str(REPO / "tests" / "procs" / "doit_stepping.py"), point,
                                       str(steps), "-f", str(REPO / "dodo.py"), "-d", str(REPO), *arguments, f"workspace={ws}"])
    script = " && ".join([
        *setup,
        _doit_line("admit", "case=c1", f"source={source}", workspace=ws) + " >/dev/null 2>&1",
        *([_doit_line("build", "case=c1", workspace=ws) + " >/dev/null 2>&1"] if command == "reopen" else []),
        f"{{ {stepping} >/dev/null 2>{q(str(tmp_path / 'err'))} & }}",
        f"while [ ! -e {q(str(steps / (point + '.ready')))} ]; do sleep 0.05; done",
        fill,
        f"touch {q(str(steps / (point + '.go')))}",
        "{ wait $!; echo first=$?; }",
        # Export reads the last recorded case on a full disk, but not past a
        # publication the store has yet to take in.
        "{ " + _doit_line("export", "case=c1", f"dest={tmp_path / 'out'}", workspace=ws) + " 2>&1 | tail -1; }",
        f"rm {q(str(volume / 'filler'))}",
        "{ " + _doit_line(*arguments, workspace=ws) + "; echo again=$?; }",
        f"ls {q(str(ws / 'cases' / 'c1' / 'packages' / 'pkg-1' / 'manifests'))}",
    ])
    result = _in_mount_namespace(script)
    failed = (tmp_path / "err").read_text().strip().splitlines()[-1]
    assert "first=1" in result.stdout, (result.stdout, result.stderr, failed)
    assert failed.startswith("IO_ERROR: "), failed
    assert f"generation {published} was published before this, and the next command on case c1 that can write the store takes it in" in failed, failed
    assert f"generation {published} is published and not yet taken in, which needs the store written" in result.stdout, result.stdout
    assert not (tmp_path / "out").exists()
    assert "again=0" in result.stdout, (result.stdout, result.stderr)
    listed = re.findall(r"^[0-9]+\.json$", result.stdout, re.M)
    assert listed == [f"{n:06d}.json" for n in range(1, published + 1)], result.stdout  # taken in, not published again


def test_commands_that_write_the_store_refuse_a_full_disk_with_a_line(tmp_path):
    """A full disk fails a writer anyway, and where blocks are under 4 KiB
    SQLite could die by SIGBUS in its shared-memory file (no line at all):
    the store is not opened for writing there."""
    _, ws, setup, fill = _small_volume(tmp_path)
    source = standard_package(tmp_path / "src")
    commands = {"reopen": ["reopen", "case=c1", "by=human:a", "reason=r"], "build": ["build", "case=c1"]}
    script = " && ".join([
        *setup,
        _doit_line("admit", "case=c1", f"source={source}", workspace=ws) + " >/dev/null 2>&1",
        _doit_line("build", "case=c1", workspace=ws) + " >/dev/null 2>&1",
        fill,
        *("{ " + _doit_line(*arguments, workspace=ws) + f" 2>&1 | tail -1; }}" for arguments in commands.values()),
        "{ " + _doit_line("status", "case=c1", workspace=ws) + " | grep '^generation'; }",
    ])
    result = _in_mount_namespace(script)
    lines = result.stdout.splitlines()
    refusals = [line for line in lines if line.startswith("IO_ERROR: ")]
    assert len(refusals) == 2, result.stdout + result.stderr
    assert all("filesystem is full" in line and "(checkpoints.sqlite3)" in line for line in refusals), refusals
    assert "generation: 2" in lines, result.stdout  # nothing was recorded


def test_a_tmpfs_without_a_size_limit_is_not_taken_for_a_full_disk(tmp_path):
    # statvfs reports no blocks for a tmpfs mounted with size=0 (no limit).
    volume, ws, source = tmp_path / "volume", tmp_path / "volume" / "ws", standard_package(tmp_path / "src")
    volume.mkdir()
    script = " && ".join([
        f"mount -t tmpfs -o size=0,nr_inodes=0 tmpfs {shlex.quote(str(volume))}",
        _doit_line("admit", "case=c1", f"source={source}", workspace=ws),
        _doit_line("build", "case=c1", workspace=ws),
        _doit_line("status", "case=c1", workspace=ws),
    ])
    result = _in_mount_namespace(script)
    assert result.returncode == 0, result.stderr
    assert "confirmed at generation 2" in result.stdout and "state: BUILDING_CASE" in result.stdout

"""``doit status`` on a damaged workspace says what the next ``doit build``
does: the step that fails, with the build's own error line, and the steps
after it not running. Each case runs the real status, then the real build,
and compares the two."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.e2e import kit
from tests.e2e.test_build import standard_package

LATER = ("assemble", "render", "publish")


def _built(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    source = standard_package(tmp_path / "src")
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    return ws


def _outlook(ws: Path) -> dict[str, list[str]]:
    """task -> its outlook rows (validate_index has two when it would fail)."""
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    rows: dict[str, list[str]] = {}
    for line in status.stdout.split("build outlook (task: would run? why):\n", 1)[1].splitlines():
        task, _, outlook = line.strip().partition(": ")
        rows.setdefault(task, []).append(outlook)
    return rows


def _failed_build(ws: Path) -> tuple[list[str], str]:
    """(the tasks the build ran, the last one failing; its one error line)."""
    result = kit.doit("build", "case=c1", workspace=ws)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    ran = [line[3:] for line in result.stderr.splitlines() if line.startswith(".  ")]  # doit reports to stderr here
    return ran, result.stderr.strip().splitlines()[-1]


def _symlink_to_a_copy(path: Path, elsewhere: Path) -> None:
    copy = elsewhere / path.name  # outside the workspace
    shutil.copy2(path, copy)  # the same bytes and times
    path.unlink()
    path.symlink_to(copy)


def _fifo(path: Path, _elsewhere: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _grown(path: Path, _elsewhere: Path) -> None:
    with path.open("ab") as handle:
        handle.write(b"x")


def _empty_folder(path: Path, _elsewhere: Path) -> None:
    path.unlink()
    path.mkdir()


def _changed_at_its_size(path: Path, _elsewhere: Path) -> None:
    kept = path.stat()
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # inside the closing whitespace or brace: still the same size
    path.write_bytes(bytes(data))
    os.utime(path, ns=(kept.st_atime_ns, kept.st_mtime_ns))  # the change time still moves


@pytest.mark.parametrize(("damage", "task", "code"), [
    (_symlink_to_a_copy, "read_input:original/report-b.json", "REFERENCE_UNSAFE"),
    (_symlink_to_a_copy, "hash_context:original/runtime.log", "REFERENCE_UNSAFE"),
    (_fifo, "read_input:original/report-b.json", "REFERENCE_UNSAFE"),
    (_grown, "hash_context:original/runtime.log", "INTEGRITY_ERROR"),
    (_empty_folder, "read_input:original/report-b.json", "INTEGRITY_ERROR"),
    (_changed_at_its_size, "read_input:original/report-b.json", "INTEGRITY_ERROR"),
])
def test_status_names_the_step_that_refuses_a_damaged_input_as_the_build_does(tmp_path, damage, task, code):
    """A listed input replaced by a symlink to the same bytes: status said
    "would run: to verify it again" and publish "up to date (reuse)", then
    after the failed build "not read yet"; the build refused it with
    REFERENCE_UNSAFE at that input's step. Likewise a FIFO, a file grown past
    its listed size, and an empty folder (which the build's roll-forward
    removes, so the file is gone)."""
    ws = _built(tmp_path)
    damage(kit.package_dir(ws, "c1") / "content" / task.partition(":")[2], tmp_path)
    for attempt in range(2):  # also after a build failed on it
        before = kit.tree_digest(ws, skip_cache=False)
        rows = _outlook(ws)
        assert kit.tree_digest(ws, skip_cache=False) == before  # status only looks
        ran, line = _failed_build(ws)
        assert ran[-1] == task and line.startswith(f"{code}: "), (ran, line)
        if damage is _empty_folder:
            assert rows[task] == ["would fail: INTEGRITY_ERROR: the manifest lists this file but the package content no longer "
                                  "holds it (restore the workspace from a copy taken while no command ran)"], rows
            why = "whose file is gone"
        elif damage is _changed_at_its_size:
            assert rows[task] == [f"would fail: {line}"], rows
            why = "which finds its bytes changed"
        else:
            assert rows[task] == [f"would fail: {line}"], rows
            why = "which refuses its file"
        for later in LATER:
            assert rows[later] == [f"would not run: the build stops at {task}, {why}"], rows


def _without_cache(ws: Path) -> Path:
    shutil.rmtree(ws / ".cache")
    return ws


def _moved(ws: Path) -> Path:
    # doit's records name the files at the old path: assemble and render run.
    moved = ws.parent / "moved"
    ws.rename(moved)
    return moved


def _in_place(ws: Path) -> Path:
    return ws


@pytest.mark.parametrize(("output", "then", "task"), [
    ("case.json", _without_cache, "assemble"),
    ("case.json", _moved, "assemble"),
    ("case_summary.md", _without_cache, "render"),
    ("case-built.json", _without_cache, "validate_index"),
    ("case-built.json", _in_place, "publish"),
    ("case.json", _in_place, "publish"),
])
def test_status_names_the_step_a_damaged_published_output_stops_the_build_at(tmp_path, output, then, task):
    """A published output of the confirmed case removed: status said
    "publish: would fail" (with no code), while a build that ran assemble or
    render (the cache cleared, the workspace moved) failed there, and one that
    planned again failed at validate_index; with the case-built record gone
    and the plan kept, status also said "assemble: would run", which the build
    skipped. Status now names the step the build fails at and its error."""
    ws = _built(tmp_path)
    path = f"case/revisions/0001/{output}"
    (kit.package_dir(ws, "c1") / "content" / path).unlink()
    ws = then(ws)
    for attempt in range(2):  # also after a build failed on it
        rows = _outlook(ws)
        ran, line = _failed_build(ws)
        assert ran[-1] == task and line.startswith("INTEGRITY_ERROR: ") and line.endswith(f"({path})"), (ran, line)
        if task == "validate_index":
            assert rows["validate_index"][1:] == [f"would fail: {line}"], rows
            assert not any(later in rows for later in LATER), rows
            continue
        assert rows[task] == [f"would fail: the confirmed {path} is missing or changed in the package content: {line}"], rows
        for later in LATER[LATER.index(task) + 1:]:
            assert rows[later] == [f"would not run: the build stops at {task}"], rows
        for earlier in LATER[:LATER.index(task)]:
            assert not rows[earlier][0].startswith(("would fail", "would not run")), rows
        if then is _in_place:
            assert rows["assemble"] == ["up to date"] and "assemble" not in ran, (rows, ran)


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _emptied(path: Path) -> None:
    path.write_bytes(b"")


def _files(ws: Path) -> dict:
    """The workspace's files, but the store's WAL and shared-memory files,
    which SQLite may make or change for a reader (README, status)."""
    return {path: digest for path, digest in kit.tree_digest(ws, skip_cache=False).items() if not path.endswith(("-wal", "-shm"))}


CACHE_DAMAGE = {
    "plan removed": lambda cache: (cache / "plan.json").unlink(),
    "case removed": lambda cache: (cache / "out" / "case.json").unlink(),
    "summary removed": lambda cache: (cache / "out" / "case_summary.md").unlink(),
    "case and summary removed": lambda cache: [(cache / "out" / name).unlink() for name in ("case.json", "case_summary.md")],
    "dependency file emptied": lambda cache: _emptied(cache / "doit.sqlite3"),
    "dependency file cut short": lambda cache: _cut(cache / "doit.sqlite3"),
    "document records cut short": lambda cache: [_cut(record) for record in (cache / "documents").glob("*/*.report.*.json")],
}


@pytest.mark.parametrize("appended", [False, True], ids=["built", "reopened and appended"])
@pytest.mark.parametrize("damage", list(CACHE_DAMAGE))
def test_status_says_which_steps_run_after_the_cache_is_damaged(tmp_path, damage, appended):
    """Session 30's differential review: status said assemble would run where
    validate_index writes the same plan again (assemble skipped), render
    would run after an assemble that writes the same case again, read_input
    would run for a damaged record doit does not look at, and, for an empty
    or cut dependency file, that nothing would run where the build discards
    it and runs every step."""
    ws = _built(tmp_path)
    if appended:
        assert kit.doit("reopen", "case=c1", "by=human:qa", "reason=more", workspace=ws).returncode == 0
        source = kit.make_append(tmp_path / "later", files={"original/report-c.json": kit.report("Later", observations=[{"text": "seen"}])},
                                 index=kit.index(reports=["original/report-a.json", "original/report-b.json", "original/report-c.json"],
                                                 reproductions=["original/repro.json"]))
        assert kit.doit("append", "case=c1", f"source={source}", workspace=ws).returncode == 0
    CACHE_DAMAGE[damage](ws / ".cache" / "c1")
    before = _files(ws)
    outlook = _outlook(ws)
    assert _files(ws) == before  # status changes nothing
    predicted = {task for task, rows in outlook.items() if task != "validate_index" and rows[0].startswith("would run")}
    assert all(rows[0].startswith(("would run", "up to date", "always runs")) for rows in outlook.values()), outlook
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    ran = {line[3:] for line in built.stderr.splitlines() if line.startswith(".  ")} - {"validate_index", "build"}
    assert predicted == ran, (outlook, built.stderr)

"""End to end: a checkpoint store is tied to the package it records.

Each step that takes a generation in records the SHA-256 of that
generation's manifest; a store copied from another workspace (same case and
package ids, another history) is refused by every command, with nothing
changed, while an older copy of the workspace's own store is rolled forward.
"""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
from pathlib import Path

import pytest

from pipeline.lifecycle import CheckpointStore
from pipeline.workspace import Workspace
from tests.e2e import kit
from tests.e2e.test_build import standard_package

STORE = "checkpoints.sqlite3"


def _ok(result) -> None:
    assert result.returncode == 0, result.stderr


def _admitted(ws: Path, source: Path) -> Path:
    _ok(kit.doit("admit", "case=c1", f"source={source}", workspace=ws))
    return ws


def _append(ws: Path, root: Path, name: str) -> None:
    source = kit.make_append(
        root / name,
        files={f"original/{name}.json": kit.report(f"Report {name}", observations=[{"text": f"seen {name}"}])},
        index=kit.index(reports=[f"original/{name}.json"]),
    )
    _ok(kit.doit("append", "case=c1", f"source={source}", workspace=ws))


def _move_store(source_ws: Path, target_ws: Path) -> None:
    # Every command has ended, so the write-ahead log is merged into the file.
    for suffix in ("-wal", "-shm"):
        (target_ws / (STORE + suffix)).unlink(missing_ok=True)
        assert not (source_ws / (STORE + suffix)).exists()
    shutil.copyfile(source_ws / STORE, target_ws / STORE)


def _manifest_sha256(ws: Path, generation: int) -> str:
    return hashlib.sha256(kit.manifests(ws, "c1")[generation - 1].read_bytes()).hexdigest()


def _one_integrity_line(result) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.rstrip("\n").splitlines()[-1]
    assert line.startswith("INTEGRITY_ERROR: "), result.stderr
    return line


def test_a_store_copied_from_another_workspace_is_refused_by_every_command_with_nothing_changed(tmp_path):
    source = standard_package(tmp_path / "src")
    # Two workspaces admitted from one source: byte-identical generation 1,
    # then histories of their own (generation 2 and 3 differ).
    ws1 = _admitted(tmp_path / "ws1", source)
    ws2 = _admitted(tmp_path / "ws2", source)
    assert _manifest_sha256(ws1, 1) == _manifest_sha256(ws2, 1)
    _append(ws1, tmp_path / "a1", "r8")
    _ok(kit.doit("build", "case=c1", workspace=ws1))
    _append(ws2, tmp_path / "a2", "r9")
    _append(ws2, tmp_path / "a3", "r10")
    assert len(kit.manifests(ws1, "c1")) == len(kit.manifests(ws2, "c1")) == 3
    _move_store(ws1, ws2)
    before = kit.tree_digest(ws2)

    another = kit.make_append(tmp_path / "a4", files={"original/r11.json": kit.report("r11")},
                              index=kit.index(reports=["original/r11.json"]))
    commands = [
        ("build", "case=c1"),
        ("status", "case=c1"),
        ("append", "case=c1", f"source={another}"),
        ("reopen", "case=c1", "by=human:ann", "reason=why"),
        ("export", "case=c1", f"dest={tmp_path / 'out'}"),
        ("probes", "case=c1"),
    ]
    for command in commands:
        result = kit.doit(*command, workspace=ws2)
        line = _one_integrity_line(result)
        assert "not this workspace's record of case c1" in line and "generation 3" in line, (command, line)
        assert "manifests/000003.json" in line and "copied from another workspace" in line, (command, line)
        assert kit.tree_digest(ws2) == before, command
    assert not (tmp_path / "out").exists()

    # The workspace's own store put back: everything works again.
    _ok(kit.doit("build", "case=c1", workspace=ws1))


def test_an_older_copy_of_the_workspaces_own_store_is_rolled_forward(tmp_path):
    ws = _admitted(tmp_path / "ws", standard_package(tmp_path / "src"))
    shutil.copyfile(ws / STORE, tmp_path / "store-after-admission")
    _append(ws, tmp_path / "a1", "r8")
    _ok(kit.doit("build", "case=c1", workspace=ws))
    published = kit.tree_digest(ws)
    (ws / STORE).unlink()
    shutil.copyfile(tmp_path / "store-after-admission", ws / STORE)

    result = kit.doit("build", "case=c1", workspace=ws)
    _ok(result)
    assert "confirmed" in result.stdout
    assert len(kit.manifests(ws, "c1")) == 3  # the publication confirmed, no generation added
    assert {k: v for k, v in kit.tree_digest(ws).items() if k != STORE} == {
        k: v for k, v in published.items() if k != STORE}
    with CheckpointStore(Workspace(ws), create=False) as store:
        assert [store.recorded_manifest("c1", g) for g in (1, 2, 3)] == [
            (g, _manifest_sha256(ws, g)) for g in (1, 2, 3)]


def test_a_store_made_before_the_manifest_record_is_read_and_written(tmp_path):
    """A store whose checkpoints have no manifest column (made by an earlier
    builder): status reads it as it is, the next writer adds the column,
    and what was recorded before stays unrecorded, never refused."""
    ws = _admitted(tmp_path / "ws", standard_package(tmp_path / "src"))
    _ok(kit.doit("build", "case=c1", workspace=ws))
    with sqlite3.connect(ws / STORE) as conn:
        conn.execute("ALTER TABLE checkpoints DROP COLUMN manifest_sha256")
    conn.close()

    status = kit.doit("status", "case=c1", workspace=ws)
    _ok(status)
    assert "state: BUILDING_CASE" in status.stdout
    with sqlite3.connect(ws / STORE) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(checkpoints)")]
    conn.close()
    assert "manifest_sha256" not in columns  # status only observes

    _ok(kit.doit("reopen", "case=c1", "by=human:ann", "reason=more", workspace=ws))
    _append(ws, tmp_path / "a1", "r8")
    _ok(kit.doit("build", "case=c1", workspace=ws))
    with CheckpointStore(Workspace(ws), create=False) as store:
        recorded = [store.recorded_manifest("c1", g) for g in (1, 2, 3, 4, 5)]
    assert recorded[:2] == [None, None]
    assert recorded[2:] == [(g, _manifest_sha256(ws, g)) for g in (3, 4, 5)]


@pytest.mark.parametrize("generation", [1, 2])
def test_a_store_copied_at_the_same_generation_with_another_manifest_is_refused(tmp_path, generation):
    """Two workspaces whose packages differ from the admission on (or only
    from generation 2) and stand at the same generation."""
    ws1 = _admitted(tmp_path / "ws1", standard_package(tmp_path / "src1"))
    other_source = standard_package(tmp_path / "src2")
    if generation == 1:
        (other_source / "original" / "db.sql").write_text("-- another dump\n")
    ws2 = _admitted(tmp_path / "ws2", other_source)
    if generation == 2:
        _append(ws1, tmp_path / "a1", "r8")
        _append(ws2, tmp_path / "a2", "r9")
    _move_store(ws1, ws2)
    before = kit.tree_digest(ws2)
    line = _one_integrity_line(kit.doit("build", "case=c1", workspace=ws2))
    assert f"generation {generation}" in line
    assert kit.tree_digest(ws2) == before


def _forget_digest_of(ws: Path, generation: int) -> None:
    """The store as a builder before the record leaves it when it takes
    ``generation`` in: no digest for it (the log's guard is lifted for the
    edit and put back)."""
    with sqlite3.connect(ws / STORE) as conn:
        (guard,) = conn.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'checkpoints_append_only_update'").fetchone()
        conn.execute("DROP TRIGGER checkpoints_append_only_update")
        conn.execute("UPDATE checkpoints SET manifest_sha256 = NULL WHERE generation = ?", (generation,))
        conn.execute(guard)
    conn.close()


def test_a_copied_store_whose_latest_generation_has_no_digest_is_judged_by_an_earlier_one(tmp_path):
    """A builder from before the record took ws1's generation 3 in; its
    generation 2 still has a digest, which ws2's manifest does not have."""
    source = standard_package(tmp_path / "src")
    ws1 = _admitted(tmp_path / "ws1", source)
    ws2 = _admitted(tmp_path / "ws2", source)
    _append(ws1, tmp_path / "a1", "r8")
    _ok(kit.doit("build", "case=c1", workspace=ws1))
    _forget_digest_of(ws1, 3)
    _append(ws2, tmp_path / "a2", "r9")
    _append(ws2, tmp_path / "a3", "r10")
    _move_store(ws1, ws2)
    before = kit.tree_digest(ws2)
    for command in ("build", "status", "probes", "export"):
        args = [command, "case=c1"] + ([f"dest={tmp_path / 'out'}"] if command == "export" else [])
        line = _one_integrity_line(kit.doit(*args, workspace=ws2))
        assert "generation 2 as a manifest" in line and "manifests/000002.json" in line, (command, line)
        assert kit.tree_digest(ws2) == before, command
    # In its own workspace the same store, with the same gap, still works.
    _ok(kit.doit("build", "case=c1", workspace=ws1))
    _ok(kit.doit("status", "case=c1", workspace=ws1))


@pytest.mark.parametrize("command", ["status", "probes"])
def test_a_store_ahead_of_the_manifests_is_said_so_by_the_commands_that_only_observe(tmp_path, command):
    ws = _admitted(tmp_path / "ws", standard_package(tmp_path / "src"))
    _ok(kit.doit("build", "case=c1", workspace=ws))
    # The package loses its generation 2 (its manifest), the store keeps it.
    kit.manifests(ws, "c1")[-1].unlink()
    before = kit.tree_digest(ws)
    line = _one_integrity_line(kit.doit(command, "case=c1", workspace=ws))
    assert "records generation 2 but the package's manifests end at generation 1" in line, line
    assert kit.tree_digest(ws) == before


def test_probes_with_a_store_behind_the_published_case_read_that_case(tmp_path):
    """A build killed between its manifest and its checkpoint has published
    its case (the manifest is the commit point): probes, which only observe,
    read it as they do once the store has confirmed it (they said NOT_BUILT)."""
    ws = _admitted(tmp_path / "ws", standard_package(tmp_path / "src"))
    crashed = kit.doit("build", "case=c1", workspace=ws, env_extra={"VIANO_CRASH_AT": "build:after-publish"})
    assert crashed.returncode != 0
    assert len(kit.manifests(ws, "c1")) == 2
    with CheckpointStore(Workspace(ws), create=False) as store:
        assert store.get("c1").generation == 1  # not confirmed yet
    before = kit.tree_digest(ws)
    behind = kit.doit("probes", "case=c1", workspace=ws)
    assert kit.tree_digest(ws) == before  # probes only observe
    _ok(kit.doit("build", "case=c1", workspace=ws))  # confirms it
    confirmed = kit.doit("probes", "case=c1", workspace=ws)
    assert (behind.returncode, behind.stdout, behind.stderr) == (confirmed.returncode, confirmed.stdout, confirmed.stderr)
    assert confirmed.stdout.strip() and "NOT_BUILT" not in behind.stderr


@pytest.mark.parametrize("loss", ["missing", "empty", "without its tables"])
def test_a_lost_store_beside_admitted_cases_is_never_made_anew(tmp_path, loss):
    """RELIABILITY 41: a checkpoint store deleted, cut to nothing or replaced
    by an empty database while cases are admitted is INTEGRITY_ERROR for every
    command, admissions of new cases included, with nothing written: a new
    store holding only the new case stranded every admitted one (found by a
    hostile-input audit)."""
    source = standard_package(tmp_path / "src")
    ws = _admitted(tmp_path / "ws", source)
    _ok(kit.doit("build", "case=c1", workspace=ws))
    if loss == "missing":
        (ws / STORE).unlink()
    elif loss == "empty":
        (ws / STORE).write_bytes(b"")
    else:
        (ws / STORE).unlink()
        sqlite3.connect(ws / STORE).execute("PRAGMA user_version = 7").connection.close()
    before = kit.tree_digest(ws)  # the cache is disposable: doit may record the failed run there
    store_files = sorted(p.name for p in ws.glob(STORE + "*"))
    for command in (("admit", "case=c5", f"source={source}"), ("build", "case=c1"), ("status", "case=c1"),
                    ("append", "case=c1", f"source={source}"), ("export", "case=c1", f"dest={tmp_path / 'out'}"),
                    ("probes", "case=c1")):
        line = _one_integrity_line(kit.doit(*command, workspace=ws))
        assert f"the checkpoint store is {loss} but the workspace holds admitted cases (c1)" in line, (command, line)
        assert kit.tree_digest(ws) == before, command
        assert sorted(p.name for p in ws.glob(STORE + "*")) == store_files, command  # no log made beside it either
    assert not (tmp_path / "out").exists() and not (ws / "cases" / "c5").exists()


def test_a_first_admission_beside_an_interrupted_one_still_makes_the_store(tmp_path):
    """The only case directory holds an admission marker (a killed first
    admission): no case was ever recorded, so the store is made."""
    source = standard_package(tmp_path / "src")
    ws = tmp_path / "ws"
    killed = kit.doit("admit", "case=c2", f"source={source}", workspace=ws, env_extra={"VIANO_CRASH_AT": "admit:after-rename"})
    assert killed.returncode != 0 and (ws / "cases" / "c2").is_dir()
    (ws / STORE).unlink(missing_ok=True)
    for suffix in ("-wal", "-shm"):
        (ws / (STORE + suffix)).unlink(missing_ok=True)
    _admitted(ws, source)
    _ok(kit.doit("admit", "case=c2", f"source={source}", workspace=ws))
    _ok(kit.doit("build", "case=c2", workspace=ws))

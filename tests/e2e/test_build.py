"""End to end through the real `doit` command: build, reuse, incremental rebuild."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.jsoncanon import resolve_pointer
from tests.conftest import REPO, doit_env
from tests.e2e import kit


def standard_package(root: Path) -> Path:
    reports = {
        "original/report-a.json": kit.report(
            "Switch stays off",
            summary="Pressing the switch does nothing",
            observations=[
                {"text": "The switch remains off", "author": "Tester A", "observed_at": "2026-11-01T10:00:00+01:00",
                 "claim": {"key": "switch.state", "value": "off"}},
                {"text": "No log line appears"},
            ],
            comments=[{"text": "Seen on two devices", "claim": {"key": "switch.state", "value": "on"}}],
            hypotheses=[{"text": "Perhaps a timing issue"}],
            expected=[{"text": "The switch turns on", "claim": {"key": "switch.target", "value": "on"}}],
            complete=False,
            entities=[{"type": "component", "id": 42, "roles": ["focus"]}],
        ),
        "original/report-b.json": kit.report(
            "Switch <b>off</b> again",
            observations=[{"text": "It is on, actually", "claim": {"key": "switch.state", "value": "on"}}],
            entities=[{"type": "component", "id": "42", "roles": ["mentioned"]}],
        ),
    }
    repro = kit.reproduction(
        steps=["Open the panel", "Press the switch"],
        observations=[{"text": "Panel shows OFF"}],
        facts=[{"name": "firmware", "value": "1.2.3"}, {"name": "blob", "value": "x" * 20000}],
        events_ref="original/runtime.log",
        attachments=["original/screen.png"],
    )
    files = {
        **reports,
        "original/repro.json": repro,
        "original/runtime.log": "event\n" * 5000,
        "original/screen.png": b"\x89PNG fake",
        "original/db.sql": "create table t(x);\n",
        "original/notes.txt": "unlisted notes",
    }
    idx = kit.index(reports=list(reports), reproductions=["original/repro.json"], database=["original/db.sql"])
    return kit.make_package(root, files=files, index=idx)


@pytest.fixture
def admitted(tmp_path):
    ws = tmp_path / "ws"
    source = standard_package(tmp_path / "src")
    result = kit.doit("admit", "case=c1", f"source={source}", workspace=ws)
    assert result.returncode == 0, result.stderr
    return ws


def _case(ws: Path, revision=1) -> dict:
    path = kit.package_dir(ws, "c1") / "content" / "case" / "revisions" / f"{revision:04d}" / "case.json"
    return json.loads(path.read_text(encoding="utf-8"))


def test_build_publishes_case_summary_and_checkpoint(admitted):
    ws = admitted
    result = kit.doit("build", "case=c1", workspace=ws)
    assert result.returncode == 0, result.stderr
    assert "confirmed at generation 2" in result.stdout
    content = kit.package_dir(ws, "c1") / "content" / "case" / "revisions" / "0001"
    assert sorted(p.name for p in content.iterdir()) == ["case-built.json", "case.json", "case_summary.md"]
    assert [p.name for p in kit.manifests(ws, "c1")] == ["000001.json", "000002.json"]
    manifest = json.loads(kit.manifests(ws, "c1")[-1].read_text())
    assert manifest["artifacts"]["case"] == "case/revisions/0001/case.json"
    case = _case(ws)
    assert case["format"] == "viano-case" and case["builder_version"] == "1"
    assert case["case"]["package_generation"] == 1
    status = kit.doit("status", "case=c1", workspace=ws)
    assert "state: BUILDING_CASE" in status.stdout
    assert "publish: up to date" in status.stdout
    # The artifact paths status prints are relative to the content directory it names.
    content = kit.package_dir(ws, "c1") / "content"
    assert f"content: {content}\n" in status.stdout
    assert "artifact case: case/revisions/0001/case.json" in status.stdout and (content / "case/revisions/0001/case.json").is_file()


def test_every_provenance_pointer_resolves_to_its_text(admitted):
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    case = _case(ws)
    content = kit.package_dir(ws, "c1") / "content"
    statements = []
    for block in ("observations", "comments", "tester_hypotheses"):
        statements += case["human_observations"][block]
    statements += case["expected_behavior"]["statements"]
    assert len(statements) >= 6
    for statement in statements:
        prov = statement["provenance"]
        source = json.loads((content / prov["source"]).read_text(encoding="utf-8"))
        assert resolve_pointer(source, prov["pointer"])["text"] == statement["text"]
    for item in case["bug"]["titles"] + case["bug"]["summaries"]:
        source = json.loads((content / item["provenance"]["source"]).read_text(encoding="utf-8"))
        assert resolve_pointer(source, item["provenance"]["pointer"]) == item["text"]
    for fact in case["runtime_facts"]["facts"]:
        source = json.loads((content / fact["provenance"]["source"]).read_text(encoding="utf-8"))
        target = resolve_pointer(source, fact["provenance"]["pointer"])
        assert target["name"] == fact["name"]
        if "value" in fact:
            assert target["value"] == fact["value"]
        else:
            assert resolve_pointer(source, fact["value_ref"]["pointer"]) == target["value"]
    for entity in case["entities"]:
        for src in entity["sources"]:
            source = json.loads((content / src["source"]).read_text(encoding="utf-8"))
            assert str(resolve_pointer(source, src["pointer"])["id"]) == entity["id"]


def test_case_content_rules(admitted):
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    case = _case(ws)
    ids = [s["id"] for s in case["human_observations"]["observations"]]
    assert ids == ["O0001", "O0002", "O0003", "O0004"]
    assert [s["id"] for s in case["human_observations"]["tester_hypotheses"]] == ["T0001"]
    conflicts = case["data_quality"]["claim_conflicts"]
    assert [(c["block"], c["key"]) for c in conflicts] == [("human_observations", "switch.state")]
    assert {v["id"] for v in conflicts[0]["values"]} == {"O0001", "O0003"}  # the comment's claim never counts
    assert case["entities"] == [{
        "type": "component", "id": "42", "roles": ["focus", "mentioned"],
        "sources": [{"kind": "tester_report", "source": "original/report-a.json", "pointer": "/entities/0"},
                    {"kind": "tester_report", "source": "original/report-b.json", "pointer": "/entities/0"}],
    }]
    facts = case["runtime_facts"]["facts"]
    assert facts[0]["value"] == "1.2.3" and "value_ref" not in facts[0]
    assert "value" not in facts[1] and facts[1]["value_ref"] == {"source": "original/repro.json", "pointer": "/facts/1/value"}
    assert case["expected_behavior"]["completeness"] == "reported_partial"
    assert case["research"]["request"] is not None and re.fullmatch(r"[0-9a-f]{64}", case["research"]["request_hash"])
    assert [r["path"] for r in case["inputs"]["unclassified"]] == ["original/notes.txt"]
    assert [r["path"] for r in case["database_context"]] == ["original/db.sql"]
    repro = case["reproduction"]["reproductions"][0]
    assert repro["id"] == "R0001" and repro["events_ref"]["path"] == "original/runtime.log"
    assert repro["observation_ids"] == ["O0004"]


def test_noop_rebuild_reuses_and_creates_no_generation(admitted):
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    before = kit.tree_digest(ws)
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert ".  read_input" not in again.stderr and ".  hash_context" not in again.stderr
    assert ".  publish" not in again.stderr
    assert kit.tree_digest(ws) == {k: v for k, v in before.items()} or _only_store_changed(before, kit.tree_digest(ws))
    assert len(kit.manifests(ws, "c1")) == 2


def _reopen_and_append_a_report(ws: Path, folder: Path, path: str) -> None:
    """Reopen the built case c1 and append one new report at ``path``."""
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    extra = kit.make_append(folder, files={path: kit.report("Later", observations=[{"text": "Later look"}])},
                            index=kit.index(reports=[path]))
    appended = kit.doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert appended.returncode == 0, appended.stderr


#: The per-file tasks of standard_package's case.
_PER_FILE_TASKS = {
    "read_input:original/report-a.json", "read_input:original/report-b.json", "read_input:original/repro.json",
    "hash_context:original/runtime.log", "hash_context:original/screen.png", "hash_context:original/db.sql",
    "hash_context:original/notes.txt",
}


def _json_report(result) -> list[tuple[str, str]]:
    """(task, result) of every task doit's JSON reporter lists: the tasks the run declared."""
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout[result.stdout.index('{"tasks"'):])
    return [(task["name"], task["result"]) for task in report["tasks"]]


def test_a_build_declares_only_the_per_file_tasks_that_have_work(tmp_path, admitted):
    ws = admitted
    first = dict(_json_report(kit.doit("--reporter=json", "build", "case=c1", workspace=ws)))
    assert {name for name in first if ":" in name} == _PER_FILE_TASKS
    assert {first[name] for name in _PER_FILE_TASKS} == {"success"}
    # A no-op: every per-file target exists, so doit is not given those tasks at all.
    noop = _json_report(kit.doit("--reporter=json", "build", "case=c1", workspace=ws))
    assert [name for name, _ in noop if ":" in name] == []
    assert {"read_input", "hash_context", "assemble", "publish"} <= {name for name, _ in noop}
    # --always-execute still runs every one of them, as doit's own option promises.
    always = dict(_json_report(kit.doit("-a", "--reporter=json", "build", "case=c1", workspace=ws)))
    assert {name for name in always if ":" in name} == _PER_FILE_TASKS
    # The other commands see every task: an up-to-date one is still one doit knows.
    info = kit.doit("info", "read_input:original/report-a.json", "case=c1", workspace=ws)
    assert info.returncode == 0 and "up-to-date" in info.stdout, info.stdout + info.stderr
    listed = kit.doit("list", "--all", "case=c1", workspace=ws)
    assert listed.returncode == 0 and "read_input:original/report-a.json" in listed.stdout, listed.stdout
    # After an append, only the new document's task is declared, and it runs.
    _reopen_and_append_a_report(ws, tmp_path / "extra", "original/report-c.json")
    appended = _json_report(kit.doit("--reporter=json", "build", "case=c1", workspace=ws))
    assert [(name, result) for name, result in appended if ":" in name] == [("read_input:original/report-c.json", "success")]
    assert ("publish", "success") in appended


def test_a_doit_config_file_that_says_always_runs_every_per_file_task(tmp_path, admitted):
    """doit takes ``always`` from doit.cfg (or pyproject.toml's [tool.doit])
    in its working folder as from ``-a`` (found by session 20's review)."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    folder = tmp_path / "configured"
    folder.mkdir()
    (folder / "doit.cfg").write_text("[run]\nalways = True\n", encoding="utf-8")
    always = subprocess.run(["doit", "-f", str(REPO / "dodo.py"), "--reporter=json", "build", "case=c1", f"workspace={ws}"],
                            cwd=folder, capture_output=True, text=True, env=doit_env(), timeout=120)
    ran = dict(_json_report(always))
    assert {name for name, result in ran.items() if ":" in name and result == "success"} == _PER_FILE_TASKS


def test_a_per_file_task_named_on_the_command_line_is_declared(admitted):
    """Named, an up-to-date per-file task is reported up to date, not as run
    (found by session 20's review)."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    for args in (["read_input:original/report-a.json"], ["-s", "hash_context:original/db.sql"]):
        named = _json_report(kit.doit("--reporter=json", *args, "case=c1", workspace=ws))
        assert (args[-1], "up-to-date") in named


_ANOTHER_PROGRAM = """
import sys
from doit.doit_cmd import DoitMain
dodo, ws, command = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = ["another-program"]  # its own command line says nothing of doit's
sys.exit(DoitMain().run(["-f", dodo, *command, "case=c1", f"workspace={ws}"]))
"""


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["-a", "--reporter=json", "build"], "every per-file task run"),
        (["list", "--all"], "read_input:original/report-a.json"),
        (["info", "read_input:original/report-a.json"], "up-to-date"),
    ],
)
def test_doit_run_inside_another_program_sees_every_per_file_task(admitted, command, expected):
    """doit's API in another program (found by session 20's review: the
    command line it looked at was the program's own)."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    result = subprocess.run([sys.executable, "-c", _ANOTHER_PROGRAM, str(REPO / "dodo.py"), str(ws), *command],
                            cwd=REPO, capture_output=True, text=True, env=doit_env(), timeout=120)
    if command[-1] == "build":
        ran = dict(_json_report(result))
        assert {name for name, outcome in ran.items() if ":" in name and outcome == "success"} == _PER_FILE_TASKS
    else:
        assert result.returncode == 0 and expected in result.stdout, result.stdout + result.stderr


def test_records_gone_after_doit_passed_over_their_tasks_are_made_again_by_assemble(tmp_path, admitted):
    """The cache is disposable: a record removed after doit judged its task
    (up to date, or just run) is made again in assemble, whole or spliced
    (found by session 20's review: the build failed with INTEGRITY_ERROR)."""
    ws = admitted
    clean = tmp_path / "clean"
    assert kit.doit("admit", "case=c1", f"source={standard_package(tmp_path / 'src2')}", workspace=clean).returncode == 0
    assert kit.doit("build", "case=c1", workspace=clean).returncode == 0
    _reopen_and_append_a_report(clean, tmp_path / "clean-app", "original/report-y.json")
    assert kit.doit("build", "case=c1", workspace=clean).returncode == 0

    def build_removing_records_at_assemble(*patterns: str) -> subprocess.CompletedProcess:
        steps = tmp_path / f"steps-{len(list(tmp_path.glob('steps-*')))}"
        steps.mkdir()

        def remove_records() -> None:
            for pattern in patterns:
                removed = [path for path in (ws / ".cache" / "c1").glob(pattern) if path.is_file()]
                assert removed, pattern
                for path in removed:
                    path.unlink()

        return kit.run_paused_at("build:assemble", steps, "build", "case=c1", workspace=ws, while_paused=remove_records)

    # A first build assembles the whole case: every input and opaque record removed.
    first = build_removing_records_at_assemble("documents/*/*.i16384.json", "opaque/*.json")
    assert first.returncode == 0, first.stderr
    assert all(path.is_file() for path in (ws / ".cache" / "c1" / "opaque").iterdir())
    _reopen_and_append_a_report(ws, tmp_path / "app", "original/report-y.json")
    # An append rebuild splices: the new report's record and the opaque ones removed.
    second = build_removing_records_at_assemble("documents/*/*.report.*.json", "opaque/*.json")
    assert second.returncode == 0, second.stderr
    assert " new document(s) appended to the " in second.stderr, second.stderr
    revisions = kit.package_dir(ws, "c1") / "content" / "case" / "revisions"
    clean_revisions = kit.package_dir(clean, "c1") / "content" / "case" / "revisions"
    for name in ("0001/case.json", "0001/case_summary.md", "0002/case.json", "0002/case_summary.md"):
        assert (revisions / name).read_bytes() == (clean_revisions / name).read_bytes(), name


def test_a_workspace_reached_by_a_link_and_by_its_target_keeps_one_build_record(tmp_path, admitted):
    """doit records dependencies by absolute path: without resolving the
    root, each switch between the two paths ran assemble, render and
    publish again, and status (through the other path) said they would not."""
    ws = admitted
    link = tmp_path / "link-to-ws"
    link.symlink_to(ws, target_is_directory=True)
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    for path in (link, ws, link):
        status = kit.doit("status", "case=c1", workspace=path)
        assert "  assemble: up to date\n  render: up to date\n" in status.stdout, status.stdout
        again = kit.doit("build", "case=c1", workspace=path)
        assert again.returncode == 0, again.stderr
        assert [line for line in again.stderr.splitlines() if line.startswith(".  ")] == [".  validate_index"], again.stderr
    assert len(kit.manifests(ws, "c1")) == 2


def _only_store_changed(before, after):
    return {k for k in set(before) | set(after) if before.get(k) != after.get(k)} <= {"checkpoints.sqlite3"}


def test_deleting_cache_changes_no_output(admitted):
    import shutil

    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    first = _case(ws)
    shutil.rmtree(ws / ".cache")
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert "confirmed at generation 2" in again.stdout
    assert len(kit.manifests(ws, "c1")) == 2
    assert _case(ws) == first


def _prior_views(ws: Path) -> list[Path]:
    return sorted((ws / ".cache" / "c1" / "documents").glob("*/*.case-view.*.json"))


@pytest.mark.parametrize("drop_view", [False, True], ids=["view-left-by-reopen", "view-derived-by-the-build"])
def test_append_then_reopen_keeps_ids_and_rereads_only_new(tmp_path, admitted, drop_view):
    ws = admitted
    # append before the first build: the returning index lists only the new
    # report; everything the earlier index listed is inherited
    extra = kit.make_append(
        tmp_path / "app1",
        files={"original/report-c.json": kit.report("Third", observations=[{"text": "Third look"}])},
        index=kit.index(reports=["original/report-c.json"]),
    )
    result = kit.doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert result.returncode == 0, result.stderr
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    first = _case(ws)
    by_key = {(s["provenance"]["source"], s["provenance"]["pointer"]): s["id"] for s in first["human_observations"]["observations"]}
    assert by_key[("original/repro.json", "/observations/0")] == "O0004"  # earlier ids unchanged
    assert by_key[("original/report-c.json", "/observations/0")] == "O0005"  # new ones after them
    assert [r["path"] for r in first["database_context"]] == ["original/db.sql"]  # context inherited too
    # now the case is confirmed: append needs a reopen; after it, the returning
    # index lists only the new report and inherits the rest from the prior case
    extra2 = kit.make_append(
        tmp_path / "app2",
        files={"original/report-d.json": kit.report("Fourth", observations=[{"text": "Fourth look"}])},
        index=kit.index(reports=["original/report-d.json"]),
    )
    refused = kit.doit("append", "case=c1", f"source={extra2}", workspace=ws)
    assert refused.returncode != 0 and "REOPEN_REQUIRED" in refused.stderr
    assert _prior_views(ws) == []  # a build does not derive a view of what it publishes
    reopened = kit.doit("reopen", "case=c1", "by=human:alice", "reason=new evidence", workspace=ws)
    assert reopened.returncode == 0, reopened.stderr
    # the reopen leaves the view of the case it closes, for the next builds
    first_sha = hashlib.sha256((kit.package_dir(ws, "c1") / "content/case/revisions/0001/case.json").read_bytes()).hexdigest()
    assert [p.name.split(".")[0] for p in _prior_views(ws)] == [first_sha]
    if drop_view:
        for view in _prior_views(ws):
            view.unlink()
    assert kit.doit("append", "case=c1", f"source={extra2}", workspace=ws).returncode == 0
    # every manifest so far is kept parsed (builds keep what they load, the
    # build, reopen and append commands what they publish), or, where
    # planning read only its outline, that: planning decodes none
    records = {p.name.split(".")[0] for p in (ws / ".cache" / "c1" / "documents").glob("*/*.manifest*.msgpack")}
    assert {hashlib.sha256(m.read_bytes()).hexdigest() for m in kit.manifests(ws, "c1")} <= records
    rebuilt = kit.doit("build", "case=c1", workspace=ws)
    assert rebuilt.returncode == 0, rebuilt.stderr
    read = re.findall(r"^\.  read_input:(.*)$", rebuilt.stderr, re.M)
    assert read == ["original/report-d.json"]
    assert "hash_context" not in rebuilt.stderr.replace("-- hash_context", "")
    second = _case(ws, revision=2)
    for statement in second["human_observations"]["observations"]:
        key = (statement["provenance"]["source"], statement["provenance"]["pointer"])
        if key in by_key:
            assert statement["id"] == by_key[key]
    assert second["inputs"]["prior_case"]["path"] == "case/revisions/0001/case.json"
    assert [p.name.split(".")[0] for p in _prior_views(ws)] == [first_sha]
    # rebuilding the published revision 2 is a no-op that still sees its prior case
    noop = kit.doit("build", "case=c1", workspace=ws)
    assert noop.returncode == 0, noop.stderr
    assert ".  publish" not in noop.stderr and ".  assemble" not in noop.stderr
    assert len(kit.manifests(ws, "c1")) == 6
    assert {s["id"] for s in second["human_observations"]["observations"]} == {"O0001", "O0002", "O0003", "O0004", "O0005", "O0006"}
    # The next reopen leaves revision 2's view and takes away revision 1's,
    # which no build reads again (one a revision stayed behind: 43 MB of
    # them at 300 cycles, session 25's review).
    assert kit.doit("reopen", "case=c1", "by=human:alice", "reason=more", workspace=ws).returncode == 0
    second_sha = hashlib.sha256((kit.package_dir(ws, "c1") / "content/case/revisions/0002/case.json").read_bytes()).hexdigest()
    assert [p.name.split(".")[0] for p in _prior_views(ws)] == [second_sha]
    third = kit.doit("build", "case=c1", workspace=ws)
    assert third.returncode == 0 and _case(ws, revision=3)["inputs"]["prior_case"]["path"] == "case/revisions/0002/case.json"


def test_export_copies_outputs_and_refuses_to_overwrite(tmp_path, admitted):
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    dest = tmp_path / "out" / "nested"
    assert kit.doit("export", "case=c1", f"dest={dest}", workspace=ws).returncode == 0
    assert sorted(p.name for p in dest.iterdir()) == ["case.json", "case_summary.md", "manifest.json"]
    assert kit.doit("export", "case=c1", f"dest={dest}", workspace=ws).returncode == 0  # identical: fine
    (dest / "case.json").write_text("{}")
    refused = kit.doit("export", "case=c1", f"dest={dest}", workspace=ws)
    assert refused.returncode != 0 and "CONTENT_CONFLICT" in refused.stderr
    assert (dest / "case.json").read_text() == "{}"


@pytest.mark.parametrize("args, code, location", [
    (("admit", "case=c2", "source=/does/not/exist"), "SOURCE_NOT_FOUND", "/does/not/exist"),
    (("append", "case=c1", "source=/does/not/exist"), "SOURCE_NOT_FOUND", "/does/not/exist"),
    (("export", "case=c1", f"dest={kit.REPO / 'README.md'}"), "INVALID_ARGUMENT", str(kit.REPO / "README.md")),
    (("export", "case=c1", f"dest={kit.REPO / 'README.md' / 'sub'}"), "IO_ERROR", str(kit.REPO / "README.md" / "sub")),
])
def test_a_refused_path_is_the_location_of_its_error(admitted, args, code, location):
    # The README's form: "CODE: message (location)", the path in the location
    # rather than inside the message (found by a docs audit in session 19).
    if args[0] == "export":
        assert kit.doit("build", "case=c1", workspace=admitted).returncode == 0
    result = kit.doit(*args, workspace=admitted)
    line = result.stderr.splitlines()[-1]
    assert line.startswith(code + ": ") and line.endswith(f" ({location})"), line
    assert location not in line[: -len(location) - 3], line


@pytest.mark.parametrize("args, code", [
    (("build", "case=../x"), "UNSAFE_ID"),
    (("build", "case=nope"), "UNKNOWN_CASE"),
    (("status",), "INVALID_ARGUMENT"),
    (("admit", "case=c2"), "INVALID_ARGUMENT"),
    (("admit", "case=c2", "source=/does/not/exist"), "SOURCE_NOT_FOUND"),
    (("reopen", "case=c1", "by=robot", "reason=x"), "INVALID_ARGUMENT"),
    (("reopen", "case=c1", "by=agent:x\n", "reason=x"), "INVALID_ARGUMENT"),  # no trailing newline
    (("reopen", "case=c1", "by=human:a\u2028b", "reason=x"), "INVALID_ARGUMENT"),  # no Unicode line break
    (("reopen", "case=c1", "by=human:a\x85b", "reason=x"), "INVALID_ARGUMENT"),  # nor a C1 control
    (("reopen", "case=c1", "by=human:a", "reason=x"), "ILLEGAL_TRANSITION"),
    (("export", "case=c1", "dest=/tmp/viano-never"), "NOT_BUILT"),
])
def test_bad_variables_are_one_line_errors_and_change_nothing(admitted, args, code):
    ws = admitted
    before = kit.tree_digest(ws, skip_cache=False)
    result = kit.doit(*args, workspace=ws)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if re.match(r"^[A-Z_]+: ", line)]
    assert len(lines) == 1 and lines[0].startswith(code + ": "), result.stderr
    assert kit.tree_digest(ws, skip_cache=False) == before


def test_failed_build_keeps_files_and_a_corrected_append_resumes(tmp_path):
    ws = tmp_path / "ws"
    source = standard_package(tmp_path / "src")
    (source / "original" / "report-b.json").write_bytes(b'{"format":"viano-bug-report","format_version":1,"title":"x","title":"y"}')
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    before = kit.tree_digest(ws / "cases")
    failed = kit.doit("build", "case=c1", workspace=ws)
    assert failed.returncode != 0
    assert "JSON_DUPLICATE_KEY: duplicate key 'title' (original/report-b.json#/title)" in failed.stderr
    assert kit.tree_digest(ws / "cases") == before
    status = kit.doit("status", "case=c1", workspace=ws)
    assert "state: BUILDING_CASE" in status.stdout  # the start checkpoint is kept
    assert ("  assemble: would fail: JSON_DUPLICATE_KEY: duplicate key 'title' (from read_input:original/report-b.json)\n"
            "  render: would not run: the build stops at assemble\n") in status.stdout, status.stdout
    assert ("read_input:original/report-b.json: up to date, refused: the build would fail with JSON_DUPLICATE_KEY"
            in status.stdout), status.stdout
    fix = kit.make_append(
        tmp_path / "fix",
        files={"original/report-b2.json": kit.report("Corrected", observations=[{"text": "Fixed"}])},
        index=kit.index(reports=["original/report-a.json", "original/report-b2.json"], reproductions=["original/repro.json"]),
    )
    assert kit.doit("append", "case=c1", f"source={fix}", workspace=ws).returncode == 0
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "read_input:original/report-b.json: up to date, refused (JSON_DUPLICATE_KEY" in outlook  # inherited now
    assert "  assemble: would run: no cached output" in outlook, outlook
    assert "drops it with a SUPERSEDED_INPUT gap" in outlook
    resumed = kit.doit("build", "case=c1", workspace=ws)
    assert resumed.returncode == 0, resumed.stderr
    case = _case(ws)
    assert "original/report-b.json" in [r["path"] for r in case["inputs"]["unclassified"]]
    assert {"code": "SUPERSEDED_INPUT", "source": "original/report-b.json"}.items() <= next(
        g for g in case["data_quality"]["gaps"] if g.get("source") == "original/report-b.json").items()
    assert [r["path"] for r in case["inputs"]["index_history"]] == ["original/case-inputs.json", "inputs/2/case-inputs.json"]


def test_a_report_attachment_outside_the_package_fails_then_an_index_without_it_drops_it(tmp_path):
    """A report's attachment is a content path (ARCHITECTURE section 12): one
    the package lacks is REFERENCE_MISSING at the report and pointer, with
    every file kept; an append whose index no longer lists the report
    resumes, the inherited report dropped with a SUPERSEDED_INPUT gap."""
    ws = tmp_path / "ws"
    source = standard_package(tmp_path / "src")
    broken = kit.report("Attached", observations=[{"text": "x"}])
    broken["attachments"] = ["original/screen.png", "original/never-sent.png"]
    kit.write_json(source / "original" / "report-b.json", broken)
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    before = kit.tree_digest(ws / "cases")
    failed = kit.doit("build", "case=c1", workspace=ws)
    assert failed.returncode != 0
    assert ("REFERENCE_MISSING: reference 'original/never-sent.png' is not in the package "
            "(original/report-b.json#/attachments/1)") in failed.stderr, failed.stderr
    assert kit.tree_digest(ws / "cases") == before
    fix = kit.make_append(tmp_path / "fix", files={"original/report-b2.json": kit.report("Corrected")},
                          index=kit.index(reports=["original/report-a.json", "original/report-b2.json"], reproductions=["original/repro.json"]))
    assert kit.doit("append", "case=c1", f"source={fix}", workspace=ws).returncode == 0
    resumed = kit.doit("build", "case=c1", workspace=ws)
    assert resumed.returncode == 0, resumed.stderr
    case = _case(ws)
    assert case["bug"]["attachments"] == []
    assert ("SUPERSEDED_INPUT", "original/report-b.json") in {(g["code"], g.get("source")) for g in case["data_quality"]["gaps"]}


def _research_listed_as_report(tmp_path: Path) -> tuple[dict, dict]:
    """A research result whose sibling request.json is listed as a report."""
    import hashlib

    report = kit.report("T", observations=[{"text": "x"}])
    canonical = json.dumps(report, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    files = {
        "original/r.json": report,
        "original/research/request.json": canonical,
        "original/research/result.json": {
            "format": "viano-research-result", "format_version": 1, "provider": {"name": "t", "version": "1"},
            "request_hash": hashlib.sha256(canonical.encode()).hexdigest(), "scope": "intended_behavior",
            "status": "partial", "statements": [{"text": "s", "citations": [0]}],
            "sources": [{"url": "https://e.org", "title": "S", "retrieved_at": "2026-01-01T00:00:00Z", "excerpt": "e"}],
        },
    }
    index = kit.index(reports=["original/r.json", "original/research/request.json"],
                      expected_research=["original/research/result.json"])
    return files, index


def test_research_request_listed_as_a_report_is_not_a_request(tmp_path):
    # A request.json in another role is read in that role only, so the result
    # has no request: one coded line, never a traceback (a regression once).
    files, index = _research_listed_as_report(tmp_path)
    ws = tmp_path / "ws"
    source = kit.make_package(tmp_path / "src", files=files, index=index)
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    before = kit.tree_digest(ws / "cases")
    result = kit.doit("build", "case=c1", workspace=ws)
    assert result.returncode != 0
    assert "RESEARCH_INVALID" in result.stderr and "original/research/result.json" in result.stderr
    assert "Traceback" not in result.stderr and "KeyError" not in result.stderr
    assert kit.tree_digest(ws / "cases") == before  # every file and manifest byte-identical


def test_inherited_research_whose_request_is_listed_as_a_report_is_dropped(tmp_path):
    files, index = _research_listed_as_report(tmp_path)
    ws = tmp_path / "ws"
    source = kit.make_package(tmp_path / "src", files=files, index=index)
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode != 0
    # The correcting append lists only the report: the result is inherited, fails
    # its pairing, and is dropped with a gap instead of stopping the build.
    extra = kit.make_append(tmp_path / "fix", files={"original/r2.json": kit.report("U", observations=[{"text": "y"}])},
                            index=kit.index(reports=["original/r.json", "original/r2.json"]))
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    result = kit.doit("build", "case=c1", workspace=ws)
    assert result.returncode == 0, result.stderr
    case = _case(ws)
    gaps = [(g["code"], g.get("source")) for g in case["data_quality"]["gaps"]]
    assert ("SUPERSEDED_INPUT", "original/research/result.json") in gaps
    assert case["research"]["results"] == []


def test_two_research_results_of_one_folder_share_their_request(tmp_path):
    """Both results of one request folder are built, their request read once:
    it was planned once per result, two read_input tasks of one name, and
    doit aborted every build without a code line (found by a seed audit)."""
    import hashlib

    from pipeline.build import CaseBuilder
    from pipeline.lifecycle import CheckpointStore
    from pipeline.workspace import Workspace

    source = kit.make_package(tmp_path / "src", files={"original/r.json": kit.report("T", expected=[{"text": "on"}])},
                              index=kit.index(reports=["original/r.json"]))
    workspaces = {how: tmp_path / how for how in ("cli", "api")}
    for ws in workspaces.values():
        assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
        assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    request = _case(workspaces["cli"])["research"]["request"]
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    request_hash = hashlib.sha256(canonical).hexdigest()
    folder = f"research/{request_hash}"

    def result(status: str) -> dict:
        return {
            "format": "viano-research-result", "format_version": 1, "provider": {"name": "t", "version": "1"},
            "request_hash": request_hash, "scope": "intended_behavior", "status": status,
            "statements": [{"text": f"The switch turns on ({status})", "citations": [0]}],
            "sources": [{"url": "https://e.org", "title": "S", "retrieved_at": "2026-01-01T00:00:00Z", "excerpt": "on"}],
        }

    extra = kit.make_append(
        tmp_path / "research",
        files={f"{folder}/request.json": canonical, f"{folder}/result.json": result("complete"),
               f"{folder}/result2.json": result("partial")},
        index=kit.index(reports=["original/r.json"], expected_research=[f"{folder}/result.json", f"{folder}/result2.json"]),
    )
    for ws in workspaces.values():
        assert kit.doit("reopen", "case=c1", "by=human:a", "reason=research", workspace=ws).returncode == 0
        assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    built = kit.doit("build", "case=c1", workspace=workspaces["cli"])
    assert built.returncode == 0, built.stderr
    assert built.stderr.count(f".  read_input:{folder}/request.json") == 1, built.stderr
    with CheckpointStore(Workspace(workspaces["api"]), create=False) as store:
        CaseBuilder(store).build("c1", "pkg-1")
    case = _case(workspaces["cli"], revision=2)
    assert [entry["path"] for entry in case["research"]["results"]] == [f"{folder}/result.json", f"{folder}/result2.json"]
    assert {entry["request"]["path"] for entry in case["research"]["results"]} == {f"{folder}/request.json"}
    published = "content/case/revisions/0002/case.json"
    assert (kit.package_dir(workspaces["cli"], "c1") / published).read_bytes() == (
        kit.package_dir(workspaces["api"], "c1") / published).read_bytes()


def test_a_research_result_names_its_request_file_in_the_case(tmp_path):
    """request.json is listed in no index role; the case still names it, with
    the result it answers, and the summary shows its path."""
    import hashlib

    ws = tmp_path / "ws"
    source = kit.make_package(tmp_path / "src", files={"original/r.json": kit.report("T", observations=[{"text": "x"}])},
                              index=kit.index(reports=["original/r.json"]))
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    request = _case(ws)["research"]["request"]
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    request_hash = hashlib.sha256(canonical).hexdigest()
    folder = f"research/{request_hash}"
    result = {
        "format": "viano-research-result", "format_version": 1, "provider": {"name": "t", "version": "1"},
        "request_hash": request_hash, "scope": "intended_behavior", "status": "complete",
        "statements": [{"text": "The switch turns on", "citations": [0]}],
        "sources": [{"url": "https://e.org", "title": "S", "retrieved_at": "2026-01-01T00:00:00Z", "excerpt": "on"}],
    }
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=research", workspace=ws).returncode == 0
    extra = kit.make_append(tmp_path / "research", files={f"{folder}/request.json": canonical, f"{folder}/result.json": result},
                            index=kit.index(reports=["original/r.json"], expected_research=[f"{folder}/result.json"]))
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    case = _case(ws, revision=2)
    [entry] = case["research"]["results"]
    assert entry["request"] == {"path": f"{folder}/request.json", "sha256": request_hash, "size": len(canonical)}
    assert entry["request_hash"] == request_hash
    summary = (kit.package_dir(ws, "c1") / "content/case/revisions/0002/case_summary.md").read_text(encoding="utf-8")
    assert "request\\.json" in summary


def _nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def test_the_deepest_claim_values_the_reader_accepts_build_and_probe(tmp_path):
    """A case holds supplied values deeper than their documents (a claim
    conflict adds two levels); reading the published case must accept that."""
    from pipeline.jsoncanon import DEFAULT_MAX_DEPTH

    deepest = DEFAULT_MAX_DEPTH - 4  # a claim value starts 4 containers down in a report
    files = {
        "original/a.json": kit.report("A", observations=[{"text": "a", "claim": {"key": "k", "value": _nested(deepest)}}]),
        "original/b.json": kit.report("B", observations=[{"text": "b", "claim": {"key": "k", "value": _nested(deepest - 1)}}]),
    }
    ws = tmp_path / "ws"
    source = kit.make_package(tmp_path / "src", files=files, index=kit.index(reports=["original/a.json", "original/b.json"]))
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    assert [c["key"] for c in _case(ws)["data_quality"]["claim_conflicts"]] == ["k"]
    probed = kit.doit("probes", "case=c1", workspace=ws)
    assert "JSON_TOO_DEEP" not in probed.stderr and "Traceback" not in probed.stderr, probed.stderr
    assert probed.stdout.strip()


def test_floats_in_supplied_values_are_published_as_the_stdlib_writes_them(tmp_path):
    """Encoding skips its float walk when every fragment was measured float-free
    when read; a float anywhere must still take the reference (stdlib) path,
    whose exponent spelling msgspec does not share (1e+16 against 1e16)."""
    ws = tmp_path / "ws"
    floats = [1e16, 0.1, -2.5e-07, 1.0, 123456789012345680.0]
    files = {
        "original/r.json": kit.report("Floats", observations=[
            {"text": f"reading {i}", "claim": {"key": f"k{i}", "value": value}} for i, value in enumerate(floats)
        ]),
        "original/plain.json": kit.report("No floats", observations=[{"text": "x", "claim": {"key": "n", "value": 10**15}}]),
        "original/p.json": kit.reproduction(facts=[{"name": "ratio", "value": {"nested": [3.5e-300, 2]}}]),
    }
    idx = kit.index(reports=["original/plain.json", "original/r.json"], reproductions=["original/p.json"])
    source = kit.make_package(tmp_path / "src", files=files, index=idx)
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    result = kit.doit("build", "case=c1", workspace=ws)
    assert result.returncode == 0, result.stderr
    published = (kit.package_dir(ws, "c1") / "content/case/revisions/0001/case.json").read_bytes()
    value = json.loads(published)
    assert published == (json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    assert b"1e+16" in published and b"-2.5e-07" in published
    claims = [o["claim"]["value"] for o in value["human_observations"]["observations"] if o["claim"]["key"].startswith("k")]
    assert claims == floats


def test_a_damaged_prior_case_is_found_although_its_view_is_cached(tmp_path, admitted):
    """The cached view stands for the prior case's published bytes, which are
    still checked against the manifest when a build plans with the view."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    assert len(_prior_views(ws)) == 1  # left by the reopen
    extra = kit.make_append(
        tmp_path / "app",
        files={"original/report-z.json": kit.report("Later", observations=[{"text": "Later look"}])},
        index=kit.index(reports=["original/report-z.json"]),
    )
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    prior = kit.package_dir(ws, "c1") / "content/case/revisions/0001/case.json"
    prior.chmod(0o644)
    data = bytearray(prior.read_bytes())
    at = data.index(b"Switch stays off")
    data[at] = ord("s")
    prior.write_bytes(bytes(data))
    before = kit.tree_digest(ws)
    result = kit.doit("build", "case=c1", workspace=ws)
    assert result.returncode != 0
    assert "INTEGRITY_ERROR" in result.stderr and "case/revisions/0001/case.json" in result.stderr
    assert len(_prior_views(ws)) == 1
    assert {k: v for k, v in kit.tree_digest(ws).items() if "/manifests/" in k} == {k: v for k, v in before.items() if "/manifests/" in k}


def _plan_records(ws: Path) -> dict:
    cache = ws / ".cache" / "c1"
    return {name: ((cache / name).stat().st_ino, (cache / name).read_bytes()) for name in ("plan.json", "store-state.json")}


def _assert_planned_once(ws: Path) -> None:
    """After a publication the next no-op build plans nothing (its records stay
    the very files publication left), and planning again anyway gives the same plan."""
    left = _plan_records(ws)
    noop = kit.doit("build", "case=c1", workspace=ws)
    assert noop.returncode == 0, noop.stderr
    assert re.findall(r"^\.  (\S+)", noop.stderr, re.M) == ["validate_index"]
    assert _plan_records(ws) == left
    (ws / ".cache" / "c1" / "store-state.json").unlink()
    replanned = kit.doit("build", "case=c1", workspace=ws)
    assert replanned.returncode == 0, replanned.stderr
    assert re.findall(r"^\.  (\S+)", replanned.stderr, re.M) == ["validate_index"]
    again = _plan_records(ws)
    assert again["plan.json"][1] == left["plan.json"][1]
    assert json.loads(kit.unsealed(again["store-state.json"][1])) == json.loads(kit.unsealed(left["store-state.json"][1]))


def test_publication_leaves_the_plan_current_for_the_next_build(tmp_path, admitted):
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert json.loads(kit.unsealed(_plan_records(ws)["store-state.json"][1]))["reuse"] is True
    _assert_planned_once(ws)
    _reopen_and_append_a_report(ws, tmp_path / "app", "original/report-y.json")
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0 and ".  publish" in built.stderr, built.stderr
    _assert_planned_once(ws)



def test_the_build_after_an_append_takes_the_plan_the_append_left(tmp_path, admitted):
    """``doit append`` plans the build it calls for; that build plans
    nothing, and its plan and outputs are byte for byte what planning anew gives."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    _reopen_and_append_a_report(ws, tmp_path / "app", "original/report-y.json")
    fresh = tmp_path / "fresh"
    shutil.copytree(ws, fresh, symlinks=True)
    (fresh / ".cache" / "c1" / "plan-ahead.json").unlink()
    built = kit.doit_through("doit_without_planning.py", "build", "case=c1", workspace=ws)
    assert built.returncode == 0 and ".  publish" in built.stderr, built.stderr
    assert kit.doit_through("doit_without_planning.py", "build", "case=c1", workspace=fresh).returncode != 0
    replanned = kit.doit("build", "case=c1", workspace=fresh)
    assert replanned.returncode == 0, replanned.stderr
    assert _plan_records(ws)["plan.json"][1] == _plan_records(fresh)["plan.json"][1]
    revision = kit.package_dir(ws, "c1").relative_to(ws) / "content/case/revisions/0002"
    for name in ("case.json", "case_summary.md", "case-built.json"):
        assert (ws / revision / name).read_bytes() == (fresh / revision / name).read_bytes(), name
    _assert_planned_once(ws)


@pytest.mark.parametrize("change", ["limits", "index touched", "prior case touched", "record damaged", "another append"])
def test_a_plan_left_by_an_append_is_not_taken_once_what_it_derives_from_changed(tmp_path, admitted, change):
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    _reopen_and_append_a_report(ws, tmp_path / "app", "original/report-y.json")
    content = kit.package_dir(ws, "c1") / "content"
    ahead = ws / ".cache" / "c1" / "plan-ahead.json"
    assert ahead.is_file()
    if change == "limits":
        kit.write_json(ws / "limits.json", {"format": "viano-workspace-limits", "format_version": 1,
                                            "case_builder": {"inline_fact_value": 20000}})
    elif change == "index touched":
        index = max(content.glob("inputs/*/case-inputs.json"), key=lambda path: int(path.parent.name))
        os.utime(index, ns=(index.stat().st_atime_ns, index.stat().st_mtime_ns + 10**9))
    elif change == "prior case touched":
        prior = content / "case/revisions/0001/case.json"
        os.utime(prior, ns=(prior.stat().st_atime_ns, prior.stat().st_mtime_ns + 10**9))
    elif change == "record damaged":
        data = bytearray(ahead.read_bytes())
        data[len(data) // 2] ^= 1
        ahead.write_bytes(bytes(data))
    else:
        extra = kit.make_append(tmp_path / "app2", files={"original/report-z.json": kit.report("Later still")},
                                index=kit.index(reports=["original/report-z.json"]))
        ahead.rename(tmp_path / "kept")
        assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
        (tmp_path / "kept").replace(ahead)  # the first append's plan, for a package that moved on
    unplanned = kit.doit_through("doit_without_planning.py", "build", "case=c1", workspace=ws)
    assert unplanned.returncode != 0 and "PLANNED_FROM_THE_PACKAGE" in unplanned.stderr, unplanned.stderr
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    case = _case(ws, revision=2)
    assert any(ref["path"] == "original/report-y.json" for ref in case["inputs"]["reports"])
    if change == "another append":
        assert any(ref["path"] == "original/report-z.json" for ref in case["inputs"]["reports"])


def test_a_build_run_opens_the_store_once_and_closes_it(tmp_path, admitted):
    """validate_index keeps its store connection open for publish in the same
    run, and publish takes the store as validate_index rolled it forward; it
    is closed before the process forks (publish then opens the store and
    rolls it forward itself) and when a run stops early, so no run leaves
    the store's write-ahead log behind."""
    ws = admitted
    store_files = lambda: sorted(path.name for path in ws.glob("checkpoints.sqlite3*"))  # noqa: E731
    built = kit.doit_through("doit_counting_stores.py", "build", "case=c1", workspace=ws)
    assert built.returncode == 0 and ".  publish" in built.stderr, built.stderr
    assert "stores opened: 1\nroll-forwards: 1\n" in built.stderr  # publish trusts validate_index's
    assert store_files() == ["checkpoints.sqlite3"]
    _reopen_and_append_a_report(ws, tmp_path / "app", "original/report-y.json")
    forked = kit.doit_through("doit_counting_stores.py", "fork", "build", "case=c1", workspace=ws)
    assert forked.returncode == 0 and ".  publish" in forked.stderr, forked.stderr
    assert "child sees run stores: 0\n" in forked.stderr and "stores opened: 2\nroll-forwards: 2\n" in forked.stderr
    assert store_files() == ["checkpoints.sqlite3"]
    _reopen_and_append_a_report(ws, tmp_path / "app2", "original/report-z.json")
    content = kit.package_dir(ws, "c1") / "content"
    damaged = content / "original/report-z.json"
    damaged.chmod(0o644)
    damaged.write_bytes(damaged.read_bytes().replace(b"Later", b"Lader"))
    failed = kit.doit_through("doit_counting_stores.py", "build", "case=c1", workspace=ws)
    assert failed.returncode != 0 and "INTEGRITY_ERROR" in failed.stderr, failed.stderr
    assert "stores opened: 1\n" in failed.stderr
    assert store_files() == ["checkpoints.sqlite3"]

@pytest.mark.parametrize("as_zip", [False, True])
def test_a_repeated_append_needs_no_room_for_a_copy_of_its_files(tmp_path, admitted, as_zip):
    """A repeat is found from the files where they are: a CI step run again on
    a disk that filled up since its first run said IO_ERROR (no space left)
    or INSUFFICIENT_DISK every time, for the copy it would not have kept.
    The reserve a workspace asks for stands in for the full disk here."""
    ws = admitted
    files = {"original/report-r.json": kit.report("Retried", observations=[{"text": "Once"}]), "original/extra.log": "x\n" * 1000}
    extra = kit.make_append(tmp_path / "app", files=files, index=kit.index(reports=["original/report-r.json"]))
    if as_zip:
        extra = Path(shutil.make_archive(str(tmp_path / "app-zip"), "zip", extra))
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    (ws / "limits.json").write_text(json.dumps({"format": "viano-workspace-limits", "format_version": 1,
                                                "admission": {"free_disk_reserve": 2**53 - 1}}))
    before = kit.tree_digest(ws)
    again = kit.doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert "nothing to append to case c1" in again.stdout
    assert kit.tree_digest(ws) == before
    # Bytes changed at the same size are hashed, found new, and then need the copy.
    changed = kit.make_append(tmp_path / "app2", files={**files, "original/extra.log": "y\n" * 1000},
                              index=kit.index(reports=["original/report-r.json"]))
    refused = kit.doit("append", "case=c1", f"source={changed}", workspace=ws)
    assert refused.returncode != 0 and "INSUFFICIENT_DISK" in refused.stderr, refused.stderr
    assert kit.tree_digest(ws) == before


def test_a_repeated_append_changes_nothing(tmp_path, admitted):
    """A retried append (the same index and files) publishes no generation;
    a different index or changed bytes are still an append or a conflict."""
    ws = admitted
    files = {"original/report-r.json": kit.report("Retried", observations=[{"text": "Once"}]), "original/extra.log": "x\n" * 1000}
    extra = kit.make_append(tmp_path / "app", files=files, index=kit.index(reports=["original/report-r.json"]))
    first = kit.doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert first.returncode == 0, first.stderr
    before = kit.tree_digest(ws)
    status_before = kit.doit("status", "case=c1", workspace=ws).stdout
    again = kit.doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert "nothing to append to case c1" in again.stdout and "generation 2" in again.stdout
    assert kit.tree_digest(ws) == before
    assert kit.doit("status", "case=c1", workspace=ws).stdout == status_before  # no checkpoint either
    # the same files under another index are an append
    other = kit.make_append(tmp_path / "app2", files=files, index=kit.index(reports=["original/report-r.json"], database=["original/db.sql"]))
    assert kit.doit("append", "case=c1", f"source={other}", workspace=ws).returncode == 0
    assert len(kit.manifests(ws, "c1")) == 3
    # and changed bytes under a known name are refused as before
    changed = kit.make_append(tmp_path / "app3", files={**files, "original/extra.log": "y\n" * 1000},
                              index=kit.index(reports=["original/report-r.json"], database=["original/db.sql"]))
    refused = kit.doit("append", "case=c1", f"source={changed}", workspace=ws)
    assert refused.returncode != 0 and "CONTENT_CONFLICT" in refused.stderr
    assert len(kit.manifests(ws, "c1")) == 3
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    # a job step retried after its build: still nothing to append, and the build reuses
    after_build = kit.tree_digest(ws)
    retried = kit.doit("append", "case=c1", f"source={other}", workspace=ws)
    assert retried.returncode == 0 and "nothing to append" in retried.stdout, retried.stderr
    assert kit.tree_digest(ws) == after_build
    manifests_before = len(kit.manifests(ws, "c1"))
    rebuilt = kit.doit("build", "case=c1", workspace=ws)
    assert rebuilt.returncode == 0 and ".  publish" not in rebuilt.stderr, rebuilt.stderr
    assert len(kit.manifests(ws, "c1")) == manifests_before
    # while anything new still needs a reopen
    new = kit.make_append(tmp_path / "app4", files={"original/late.log": "late\n"},
                          index=kit.index(reports=["original/report-r.json"], database=["original/db.sql"]))
    refused = kit.doit("append", "case=c1", f"source={new}", workspace=ws)
    assert refused.returncode != 0 and "REOPEN_REQUIRED" in refused.stderr
    assert kit.tree_digest(ws) == after_build


def test_the_plan_stays_current_when_an_earlier_index_named_the_output(tmp_path):
    """An earlier index that lists the build's own output path (unusable, so
    not inherited) must not make the plan change once that output exists."""
    ws = tmp_path / "ws"
    source = kit.make_package(tmp_path / "src", files={"original/r.json": kit.report("T", observations=[{"text": "x"}])},
                              index=kit.index(reports=["original/r.json"], attachments=["case/revisions/0001/case.json"]))
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode != 0  # the attachment is not there
    fix = kit.make_append(tmp_path / "fix", files={"original/r2.json": kit.report("U", observations=[{"text": "y"}])},
                          index=kit.index(reports=["original/r.json", "original/r2.json"]))
    assert kit.doit("append", "case=c1", f"source={fix}", workspace=ws).returncode == 0
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0 and ".  publish" in built.stderr, built.stderr
    case = _case(ws)
    assert "case/revisions/0001/case.json" not in json.dumps(case["data_quality"])
    _assert_planned_once(ws)


def test_a_build_process_ends_without_teardown_noise(admitted):
    """doit holds the case lock for its whole run; it is released at exit
    before the interpreter clears modules, so no 'Exception ignored' line
    appears, whichever order the modules are torn down in (here a wrapper
    script times a step, which changed that order enough to show it)."""
    import subprocess
    import sys

    script = (
        "import sys, pipeline.build as build\n"
        "step = build.step_validate_index\n"
        "def timed(*args, **kwargs):\n"
        "    return step(*args, **kwargs)\n"
        "build.step_validate_index = timed\n"
        "from doit.__main__ import main\n"
        "sys.argv = ['doit'] + sys.argv[1:]\n"
        "main()\n"
    )
    for _ in range(2):  # the build, then a no-op
        result = subprocess.run(
            [sys.executable, "-c", script, "-f", str(kit.REPO / "dodo.py"), "build", "case=c1", f"workspace={admitted}"],
            capture_output=True, text=True, cwd=kit.REPO, env=kit.doit_env(),
        )
        assert result.returncode == 0, result.stderr
        assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_confirmed_revision_refuses_new_appends_before_copying_anything(tmp_path, admitted):
    """Only a repeat can pass a confirmed revision, and whether it may be one
    is known from the index bytes and the file sizes: anything else is
    REOPEN_REQUIRED before the source is decoded or staged."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    before = kit.tree_digest(ws)
    broken = kit.make_append(tmp_path / "broken", files={"original/big.bin": b"x" * 300_000}, index={})
    (broken / "case-inputs.json").write_text("{not json", encoding="utf-8")
    fresh = kit.make_append(tmp_path / "fresh", files={"original/big.bin": b"y" * 300_000},
                            index=kit.index(reports=["original/report-a.json"]))
    for source in (broken, fresh):
        result = kit.doit("append", "case=c1", f"source={source}", workspace=ws)
        assert result.returncode != 0 and result.stderr.startswith("REOPEN_REQUIRED"), result.stderr
        assert kit.tree_digest(ws) == before  # nothing staged, not even for a moment's trace


def _revision_outputs(ws: Path, revision: int) -> tuple[bytes, bytes]:
    folder = kit.package_dir(ws, "c1") / "content" / "case" / "revisions" / f"{revision:04d}"
    return (folder / "case.json").read_bytes(), (folder / "case_summary.md").read_bytes()


def _splice_states(ws: Path) -> list[Path]:
    return sorted((ws / ".cache" / "c1" / "out").glob("splice.*.msgpack"))


def _append_rebuild(root: Path, damage: str | None) -> tuple[str, tuple[bytes, bytes]]:
    """Admit, build, reopen, append a report and a reproduction, damage what
    ``damage`` names, rebuild: the rebuild's stderr and outputs."""
    ws = root / "ws"
    source = standard_package(root / "src")
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert len(_splice_states(ws)) == 1
    assert kit.doit("reopen", "case=c1", "by=human:alice", "reason=more", workspace=ws).returncode == 0
    extra = kit.make_append(
        root / "app",
        files={
            # a conflicting claim, an entity merged with an earlier one, a declaration
            "original/report-c.json": kit.report(
                "Third", observations=[{"text": "Off again", "claim": {"key": "switch.state", "value": "off"}}],
                expected=[{"text": "It stays on", "claim": {"key": "switch.target", "value": "off"}}], complete=True,
                entities=[{"type": "component", "id": 42, "roles": ["again"]}],
            ),
            "original/repro-2.json": kit.reproduction(steps=["Wait"], observations=[{"text": "Still off"}],
                                                      facts=[{"name": "uptime", "value": 3.5}]),
        },
        index=kit.index(reports=["original/report-c.json"], reproductions=["original/repro-2.json"]),
    )
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    if damage == "no-state":
        _splice_states(ws)[0].unlink()
    elif damage == "state":
        _splice_states(ws)[0].write_bytes(b"\x81\xa5units\x01")  # decodes, but is no state
    elif damage == "cached-case":
        cached = ws / ".cache" / "c1" / "out" / "case.json"
        cached.write_bytes(cached.read_bytes().replace(b"Switch stays off", b"Switch stays of "))
    rebuilt = kit.doit("build", "case=c1", workspace=ws)
    assert rebuilt.returncode == 0, rebuilt.stderr
    return rebuilt.stderr, _revision_outputs(ws, 2)


def test_an_append_rebuild_splices_the_previous_case_and_matches_a_whole_build(tmp_path):
    """The append rebuild after a reopen assembles only the new inputs and
    splices the previous build's records in front: byte for byte what
    assembling the case whole gives. Without the carried state, with a
    damaged one or with a cached output changed since, it assembles whole."""
    runs = {damage: _append_rebuild(tmp_path / str(damage), damage) for damage in (None, "no-state", "state", "cached-case")}
    for damage, (stderr, _) in runs.items():
        spliced = "assemble: 2 new document(s) appended to the 3 of the last assembly" in stderr
        assert spliced == (damage is None), (damage, stderr)
    outputs = {damage: run[1] for damage, run in runs.items()}
    assert outputs[None] == outputs["no-state"] == outputs["state"] == outputs["cached-case"]
    case = json.loads(outputs[None][0])
    conflicts = case["data_quality"]["claim_conflicts"]
    assert [(c["key"], len(c["values"])) for c in conflicts] == [("switch.state", 3), ("switch.target", 2)]
    assert case["entities"][0]["roles"] == ["focus", "mentioned", "again"]
    assert [r["id"] for r in case["reproduction"]["reproductions"]] == ["R0001", "R0002"]
    assert case["expected_behavior"]["completeness"] == "conflicting"


def test_content_paths_with_equal_and_percent_signs_build_and_show_in_status(tmp_path):
    """doit refuses '=' in a task name; a package may well hold
    'key=value.json'. Task names escape '%' and '=', the case keeps the paths."""
    listed = "original/run=2%/report=a.json"
    unlisted = "original/notes/key=value.txt"
    escaped = "original/run%3D2%25/report%3Da.json"
    source = kit.make_package(
        tmp_path / "src",
        files={listed: kit.report("Equal signs", observations=[{"text": "seen"}]), unlisted: b"plain bytes\n",
               "original/run%3D2%25/report%3Da.json": kit.report("The escaped spelling", observations=[{"text": "other"}])},
        index=kit.index(reports=[listed, escaped]),
    )
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    assert "read_input:original/run%3D2%25/report%3Da.json: would run" in status.stdout
    assert "read_input:original/run%253D2%2525/report%253Da.json: would run" in status.stdout
    assert "hash_context:original/notes/key%3Dvalue.txt: would run" in status.stdout
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    assert f"read_input:{escaped}" in built.stderr
    case_path = kit.package_dir(ws, "c1") / "content" / "case" / "revisions" / "0001" / "case.json"
    case = json.loads(case_path.read_text(encoding="utf-8"))
    assert [item["path"] for item in case["inputs"]["reports"]] == [listed, escaped]
    assert unlisted in [item["path"] for item in case["inputs"]["unclassified"]]
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0 and "read_input" not in again.stderr, again.stderr


def test_status_after_a_failed_build_says_assemble_would_fail_and_nothing_after_it_runs(tmp_path, admitted):
    """A failed build plans the new inputs before it fails; the refusal of
    the new input is cached, so status says assemble fails with it, as the
    next build does, and render and publish do not run."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert "  assemble: up to date\n  render: up to date\n" in kit.doit("status", "case=c1", workspace=ws).stdout
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    bad = kit.duplicate_key_append(tmp_path / "bad")
    assert kit.doit("append", "case=c1", f"source={bad}", workspace=ws).returncode == 0
    failed = kit.doit("build", "case=c1", workspace=ws)
    assert failed.returncode != 0 and "JSON_DUPLICATE_KEY" in failed.stderr
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "  assemble: would fail: JSON_DUPLICATE_KEY: " in outlook, outlook
    assert "  render: would not run: the build stops at assemble\n" in outlook, outlook
    assert "  publish: would not run: the build stops at assemble\n" in outlook, outlook
    again = kit.doit("build", "case=c1", workspace=ws)
    assert [line for line in again.stderr.splitlines() if line.startswith(".  ")] == [".  validate_index", ".  assemble"], again.stderr
    assert "JSON_DUPLICATE_KEY" in again.stderr


def test_status_after_a_refusal_foretells_the_build_when_the_refused_file_was_touched_or_its_read_ignored(tmp_path, admitted):
    """Found by session 18's re-review: a refused input whose stamp moved
    (touch, or a workspace restored with cp -a) is read again and refused
    again, and `doit ignore` on its read_input skips everything after it."""
    ws = admitted
    bad = kit.duplicate_key_append(tmp_path / "bad")
    assert kit.doit("append", "case=c1", f"source={bad}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode != 0
    refused = kit.package_dir(ws, "c1") / "content" / "original" / "dup.json"
    os.utime(refused, ns=(time.time_ns(), time.time_ns()))
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "would run: to verify it again" in outlook and "it was refused when last read: JSON_DUPLICATE_KEY" in outlook, outlook
    assert "  assemble: would fail: JSON_DUPLICATE_KEY: " in outlook, outlook
    assert "  render: would not run: the build stops at assemble\n" in outlook, outlook
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode != 0 and "JSON_DUPLICATE_KEY" in again.stderr
    ran = re.findall(r"^\.  (\S+)", again.stderr, re.M)
    assert ran[0] == "validate_index" and ran[-1] == "assemble" and any(t.startswith("read_input:") for t in ran), ran
    task = next(t for t in ran if t.startswith("read_input:"))
    assert kit.doit("ignore", task, "case=c1", workspace=ws).returncode == 0
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert f"  {task}: ignored (`doit ignore`)" in outlook, outlook
    for step in ("assemble", "render", "publish"):
        assert f"  {step}: ignored with {task} (`doit ignore`)" in outlook, outlook
    skipped = kit.doit("build", "case=c1", workspace=ws)
    assert skipped.returncode == 0, skipped.stderr
    assert {f"!! {t}" for t in (task, "assemble", "render", "publish")} <= set(skipped.stderr.splitlines()), skipped.stderr
    assert kit.doit("forget", task, "case=c1", workspace=ws).returncode == 0
    # The group, and validate_index, which every later step waits for (found by the last re-review).
    for gate in ("read_input", "validate_index"):
        assert kit.doit("ignore", gate, "case=c1", workspace=ws).returncode == 0
        outlook = kit.doit("status", "case=c1", workspace=ws).stdout
        for step in ("assemble", "render", "publish"):
            assert f"  {step}: ignored with {gate} (`doit ignore`)" in outlook, outlook
        skipped = kit.doit("build", "case=c1", workspace=ws)
        assert skipped.returncode == 0 and {f"!! {t}" for t in (gate, "assemble", "publish")} <= set(skipped.stderr.splitlines())
        marked = [gate] + re.findall(r"^  (\S+): ignored \(`doit ignore`\)", outlook, re.M)
        assert kit.doit("forget", *marked, "case=c1", workspace=ws).returncode == 0
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "  assemble: would fail: JSON_DUPLICATE_KEY: " in outlook, outlook


def test_hashing_a_large_context_file_reports_progress(tmp_path):
    """A context file of 64 MiB or more is hashed with a progress line every
    tenth (or 256 MiB), as admission reports its copies."""
    source = standard_package(tmp_path / "src")
    with open(source / "original" / "runtime.log", "ab") as handle:
        handle.truncate(65 << 20)  # the events file, grown to 65 MiB
    ws = tmp_path / "ws"
    admitted = kit.doit("admit", "case=c1", f"source={source}", workspace=ws)
    assert admitted.returncode == 0, admitted.stderr
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    lines = [line for line in built.stderr.splitlines() if line.startswith("hashing original/runtime.log")]
    assert lines[0] == f"hashing original/runtime.log ({65 << 20} bytes)", lines
    mebibytes = [int(line.removeprefix("hashing original/runtime.log: ").split(" / ")[0]) for line in lines[1:]]
    assert all(line.endswith(" / 65 MiB") for line in lines[1:]), lines
    assert len(mebibytes) == 10 and mebibytes == sorted(mebibytes) and mebibytes[-1] == 65, lines


@pytest.mark.parametrize("steps, reset", [
    (("validate_index",), "assemble"),  # a plan assemble never ran on, its record reset
    (("assemble",), "render"),  # a case render never ran on, its record reset
])
def test_a_record_reset_without_its_step_running_does_not_publish_the_previous_output(tmp_path, admitted, steps, reset):
    """Found by session 23's review of doit's own commands: `doit reset-dep`
    records a task's file dependencies as they are now and keeps the digest
    its step recorded of its output, so doit took the previous revision's
    cached case (or summary) for the new plan's (case's) and the build
    published it as revision 2, for ever. Each step now records what it made
    its output from, which the next build (and publish, and status) check."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    _reopen_and_append_a_report(ws, tmp_path / "extra", "original/report-later.json")
    undisturbed = tmp_path / "undisturbed"
    subprocess.run(["cp", "-a", str(ws), str(undisturbed)], check=True)
    for step in steps:
        assert kit.doit(step, "case=c1", workspace=ws).returncode == 0
    assert "processed " + reset in kit.doit("reset-dep", reset, "case=c1", workspace=ws).stdout
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert f"  {reset}: would run: " in outlook, outlook  # status saw it before: it judges by the files
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    assert f".  {reset}" in built.stderr.splitlines(), built.stderr
    assert kit.doit("build", "case=c1", workspace=undisturbed).returncode == 0
    revisions = Path("content") / "case" / "revisions"
    for name in ("case.json", "case_summary.md"):
        published = (kit.package_dir(ws, "c1") / revisions / "0002" / name).read_bytes()
        assert published == (kit.package_dir(undisturbed, "c1") / revisions / "0002" / name).read_bytes(), name
        assert published != (kit.package_dir(ws, "c1") / revisions / "0001" / name).read_bytes(), name
    assert b"Later look" in (kit.package_dir(ws, "c1") / revisions / "0002" / "case_summary.md").read_bytes()


def test_status_names_a_record_reset_without_its_step_running(admitted):
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    kit.write_json(ws / "limits.json", {"format": "viano-workspace-limits", "format_version": 1,
                                        "case_builder": {"inline_fact_value": 20000}})
    assert kit.doit("validate_index", "case=c1", workspace=ws).returncode == 0  # another plan, the same inputs
    assert kit.doit("reset-dep", "assemble", "case=c1", workspace=ws).returncode == 0
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert ("  assemble: would run: the cached case was not assembled from this plan (its record was reset "
            "without assembling, as by `doit reset-dep`)\n") in outlook, outlook
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0 and ".  assemble" in built.stderr.splitlines(), built.stderr
    assert len(kit.manifests(ws, "c1")) == 2  # the confirmed case reused: no new generation


def test_build_steps_run_for_a_named_target_hold_the_case_lock(tmp_path, admitted):
    """Found by session 23's review of doit's own commands: `doit <ws>/.cache/c1/out/case.json
    case=c1` names no build task, so the run took no case lock before doit
    started, and its read_input, assemble and render ran beside whatever
    else held the case."""
    from pipeline.workspace import Workspace, case_lock_held_elsewhere

    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    _reopen_and_append_a_report(ws, tmp_path / "extra", "original/report-later.json")
    steps = tmp_path / "steps"
    steps.mkdir()
    target = ws / ".cache" / "c1" / "out" / "case.json"

    def check_the_lock() -> None:  # read_input of the new report has run
        assert case_lock_held_elsewhere(Workspace(ws), "c1")

    run = kit.run_paused_at("build:assemble", steps, str(target), "case=c1", workspace=ws, while_paused=check_the_lock)
    err = run.stderr
    assert run.returncode == 0, err
    assert ".  read_input:original/report-later.json" in err.splitlines() and ".  assemble" in err.splitlines(), err
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0 and "confirmed at generation" in built.stdout, built.stderr


def test_the_build_task_alone_does_not_report_an_older_plan_as_confirmed(tmp_path, admitted):
    """`doit -s build` runs the report and none of the steps: after an
    append it said 'revision 1 ... confirmed at generation 4', the append's."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    _reopen_and_append_a_report(ws, tmp_path / "extra", "original/report-later.json")
    alone = kit.doit("-s", "build", "case=c1", workspace=ws)
    assert alone.returncode == 1 and alone.stdout == "", (alone.stdout, alone.stderr)
    assert alone.stderr.splitlines()[-1] == (
        "STALE_GENERATION: generation 4 of case c1 came after this build's plan (revision 1), and the steps did not run "
        "(`doit -s build` runs only the report): run `doit build case=c1`"), alone.stderr
    built = kit.doit("build", "case=c1", workspace=ws)
    assert "case c1 revision 2: " in built.stdout and "confirmed at generation 5" in built.stdout, built.stdout
    again = kit.doit("-s", "build", "case=c1", workspace=ws)
    assert again.returncode == 0 and again.stdout == built.stdout, (again.stdout, again.stderr)


@pytest.mark.parametrize("command", [("forget", "--all"), ("clean", "-a", "--forget")])
def test_doits_record_commands_without_a_task_name_act_on_the_cases_records(admitted, command):
    """They ran on records kept in memory, so `doit forget --all case=c1`
    said "forgetting all tasks" and forgot nothing (session 23's review)."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert "  assemble: up to date\n" in kit.doit("status", "case=c1", workspace=ws).stdout
    assert kit.doit(*command, "case=c1", workspace=ws).returncode == 0
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert "  assemble: would run: no record of its last run" in outlook, outlook
    rebuilt = kit.doit("build", "case=c1", workspace=ws)
    assert rebuilt.returncode == 0 and ".  assemble" in rebuilt.stderr.splitlines(), rebuilt.stderr
    assert len(kit.manifests(ws, "c1")) == 2  # the confirmed case reused


def test_doits_own_commands_give_no_traceback_for_an_unknown_task_or_a_reader_gone(admitted):
    """Session 23's review: `doit info nosuch` (or a per-file task before a
    build planned its file) was a KeyError traceback, and `doit list --all |
    head -1` a BrokenPipeError one."""
    ws = admitted
    for name in ("nosuch", "read_input:original/report-a.json"):
        info = kit.doit("info", name, "case=c1", workspace=ws)
        assert info.returncode == 3 and "Traceback" not in info.stderr, info.stderr
        assert info.stderr.strip().endswith(f"ERROR: '{name}' is not a task."), info.stderr
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("info", "read_input:original/report-a.json", "case=c1", workspace=ws).returncode == 0
    for command in (("list", "--all"), ("info", "assemble")):
        child = subprocess.Popen(["doit", "-f", str(REPO / "dodo.py"), *command, "case=c1", f"workspace={ws}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=doit_env(), cwd=REPO)
        child.stdout.readline()
        child.stdout.close()  # as `| head -1` does
        with child.stderr:
            err = child.stderr.read().decode()
        child.wait(timeout=60)
        assert "Traceback" not in err and "BrokenPipe" not in err, err
        assert child.returncode in (0, 1), (child.returncode, err)  # doit's info says 1 for a task that would run


def test_status_foretells_publish_when_the_cache_holds_an_older_builders_note(admitted):
    """Session 23's upgrade review: a workspace built before cache records
    were sealed holds an unsealed note of the publication, which the build
    does not take (publish runs, reusing the case), while status said
    `publish: up to date`."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    note = ws / ".cache" / "c1" / "out" / "published.json"
    note.write_bytes(kit.unsealed(note.read_bytes()))
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    assert ("  publish: would run: the build cache has no note of this publication (or one an older builder wrote); "
            "reuses case-build/v1/r1, confirmed for these inputs (no new generation)\n") in outlook, outlook
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0 and ".  publish" in built.stderr.splitlines(), built.stderr
    assert len(kit.manifests(ws, "c1")) == 2
    assert "  publish: up to date: " in kit.doit("status", "case=c1", workspace=ws).stdout


def test_what_the_builder_makes_follows_the_umask_so_a_group_can_share_a_workspace(tmp_path):
    """Session 23's review as ordinary users: the store (so its -wal/-shm),
    the dep file, lock files and the folders of a publication were 0644/0755
    whatever the umask, so a second user of a group-shared workspace
    (setgid folders, umask 002) met `Permission denied` on the lock."""
    import stat as stat_module

    ws = tmp_path / "ws"
    source = standard_package(tmp_path / "src")
    previous = os.umask(0o002)
    try:
        assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
        assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
        assert kit.doit("reopen", "case=c1", "by=human:b", "reason=more", workspace=ws).returncode == 0
        assert kit.doit("status", "case=c1", workspace=ws).returncode == 0
    finally:
        os.umask(previous)
    package = kit.package_dir(ws, "c1")
    shared = [ws / "checkpoints.sqlite3", ws / "checkpoints.sqlite3-wal", ws / "checkpoints.sqlite3-shm",
              ws / ".cache" / "c1" / "doit.sqlite3", ws / ".locks" / "c1.lock", ws / ".locks",
              package / "content" / "case" / "revisions" / "0001", package / "content" / "inputs" / "3", package / "manifests"]
    for path in shared:
        mode = stat_module.S_IMODE(path.stat().st_mode)
        assert mode & 0o020, (path, oct(mode))  # group-writable
    # Published content is never rewritten: written once, read by all.
    assert stat_module.S_IMODE((package / "content" / "case" / "revisions" / "0001" / "case.json").stat().st_mode) & 0o444 == 0o444


def test_a_named_target_with_process_workers_is_refused_at_once(tmp_path, admitted):
    """Session 23's re-review: each process worker took the case lock for
    itself, so the others waited 60 s for it and ended in LOCK_TIMEOUT."""
    ws = admitted
    target = ws / ".cache" / "c1" / "out" / "case.json"
    run = kit.doit("-n", "3", str(target), "case=c1", workspace=ws, timeout=45)
    assert run.returncode != 0 and "LOCK_TIMEOUT" not in run.stderr, run.stderr
    assert "INVALID_ARGUMENT: build steps cannot run in several processes (-n with process workers)" in run.stderr, run.stderr
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0


def test_the_build_task_alone_on_a_case_never_built_says_to_build_it(admitted):
    alone = kit.doit("-s", "build", "case=c1", workspace=admitted)
    assert alone.returncode == 1 and alone.stderr.splitlines()[-1] == (
        "NOT_BUILT: case c1 has no plan yet: the steps did not run (`doit -s build` runs only the report): "
        "run `doit build case=c1`"), alone.stderr


def test_the_build_task_alone_after_a_failed_build_says_to_build_it(tmp_path):
    """A build that failed after planning (here at read_input, on a
    duplicate key) leaves a plan and no confirmed case: `doit -s build` said
    INTEGRITY_ERROR ("the build published no confirmed case for its plan"),
    as if the workspace were damaged (session 29's review)."""
    ws = tmp_path / "ws"
    source = standard_package(tmp_path / "src")
    report = source / "original" / "report-a.json"
    report.write_text(report.read_text(encoding="utf-8").replace('"title":', '"title": "dup", "title":', 1), encoding="utf-8")
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    failed = kit.doit("build", "case=c1", workspace=ws)
    assert failed.returncode == 1 and "JSON_DUPLICATE_KEY" in failed.stderr, failed.stderr
    assert (ws / ".cache" / "c1" / "plan.json").exists()
    before = kit.tree_digest(ws)
    alone = kit.doit("-s", "build", "case=c1", workspace=ws)
    assert alone.returncode == 1 and alone.stdout == "", (alone.stdout, alone.stderr)
    assert alone.stderr.splitlines()[-1] == (
        "NOT_BUILT: case c1 revision 1 has no confirmed case for its plan: the steps did not run or did not finish "
        "(`doit -s build` runs only the report): run `doit build case=c1`"), alone.stderr
    assert kit.tree_digest(ws) == before


@pytest.mark.parametrize("step", ["assemble", "render", "publish"])
def test_a_step_run_alone_before_the_steps_it_needs_says_to_build(admitted, step):
    """`doit -s STEP` skips the steps before it: with no plan (or no cached
    case for render and publish) that was `IO_ERROR: No such file or
    directory (.../plan.json)`, an error of the machine (session 29's review)."""
    ws = admitted

    def refused_alone(lacking: str, maker: str) -> None:
        before = kit.tree_digest(ws)
        alone = kit.doit("-s", step, "case=c1", workspace=ws)
        assert alone.returncode == 1 and alone.stderr.splitlines()[-1] == (
            f"NOT_BUILT: case c1 has no {lacking} yet: {step} ran without {maker} (`doit -s {step}` runs only that step): "
            "run `doit build case=c1`"), alone.stderr
        assert kit.tree_digest(ws) == before

    refused_alone("plan", "validate_index")
    if step == "assemble":
        return
    assert kit.doit("validate_index", "case=c1", workspace=ws).returncode == 0
    refused_alone("assembled case", "assemble")
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0 and "confirmed at generation 2" in built.stdout, built.stderr


def test_a_build_whose_step_is_ignored_says_it_published_nothing(admitted):
    """Session 23's review: with a step marked by `doit ignore` the build
    exited 0 with only doit's `!!` lines, no word that nothing was built."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("ignore", "validate_index", "case=c1", workspace=ws).returncode == 0
    skipped = kit.doit("build", "case=c1", workspace=ws)
    assert skipped.returncode == 0 and skipped.stdout == "", skipped.stdout
    assert skipped.stderr.splitlines()[-1] == ("nothing was published: a step is ignored (`doit ignore`); "
                                               "`doit status` names it and `doit forget TASK` clears it"), skipped.stderr
    assert kit.doit("forget", "validate_index", "case=c1", workspace=ws).returncode == 0
    again = kit.doit("build", "case=c1", workspace=ws)
    assert "confirmed at generation 2" in again.stdout and "nothing was published" not in again.stderr, again.stderr
    # The report alone ignored: the steps run (and may publish); only the line is not said.
    assert kit.doit("ignore", "build", "case=c1", workspace=ws).returncode == 0
    report_ignored = kit.doit("build", "case=c1", workspace=ws)
    assert report_ignored.returncode == 0 and report_ignored.stdout == "", report_ignored.stdout
    assert report_ignored.stderr.splitlines()[-1] == (
        "the build's report is ignored (`doit ignore build`): `doit status` says what is confirmed, `doit forget build` clears it")


def test_status_agrees_with_the_build_on_a_summary_kept_from_an_older_builder(tmp_path):
    """A build reuses a confirmed case's published summary as it is, also
    where this builder renders the case otherwise (an upgrade that changed
    the summary's text): its render step is up to date. Status said "would
    run: the cached summary is not the cached case's" at every run, while
    every build said up to date (session 24's re-review)."""
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={standard_package(tmp_path / 'pkg')}", workspace=ws).returncode == 0
    older = kit.doit_through("doit_older_summary.py", "build", "case=c1", workspace=ws)
    assert older.returncode == 0, older.stderr
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    assert "render: up to date" in status.stdout, status.stdout
    rebuilt = kit.doit("build", "case=c1", workspace=ws)
    assert rebuilt.returncode == 0 and "-- render" in rebuilt.stderr, rebuilt.stderr
    assert len(kit.manifests(ws, "c1")) == 2
    assert "render: up to date" in kit.doit("status", "case=c1", workspace=ws).stdout


@pytest.mark.parametrize("step", ["assemble", "render"])
def test_status_names_the_steps_an_ignored_assemble_or_render_makes_doit_skip(tmp_path, step):
    """Found by session 24's README audit: with assemble (or render) ignored,
    status said the later steps "would run", while the build skipped them
    (`!!`) and published nothing."""
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={standard_package(tmp_path / 'pkg')}", workspace=ws).returncode == 0
    assert kit.doit("ignore", step, "case=c1", workspace=ws).returncode == 0
    outlook = kit.doit("status", "case=c1", workspace=ws).stdout
    later = ("render", "publish") if step == "assemble" else ("publish",)
    for task in later:
        assert f"  {task}: ignored with {step} (`doit ignore`)" in outlook, outlook
    skipped = kit.doit("build", "case=c1", workspace=ws)
    assert {f"!! {t}" for t in (step, *later)} <= set(skipped.stderr.splitlines()), skipped.stderr
    assert len(kit.manifests(ws, "c1")) == 1


def _watching_the_exit(ws: Path, *args: str, options: str, stdout=subprocess.PIPE) -> tuple[int, str, str]:
    """The real doit command line through ``tests/procs/doit_watching_its_exit.py``:
    its status, standard output and error, with the workspace's path as ``WS``."""
    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "procs" / "doit_watching_its_exit.py"), "-f", str(REPO / "dodo.py"), "-d", str(REPO),
         *args, f"workspace={ws}"],
        stdout=stdout, stderr=subprocess.PIPE, text=True, env=doit_env(VIANO_WATCH_EXIT=options), timeout=120,
    )
    same = lambda text: re.sub(r" at 0x[0-9a-f]+>", " at 0x...>", text.replace(str(ws), "WS"))  # noqa: E731
    return run.returncode, same(run.stdout or ""), same(run.stderr)


def test_a_command_line_run_exits_as_the_interpreter_would_without_its_teardown(tmp_path, admitted):
    """After the run, the process ends without the interpreter's teardown,
    and otherwise as the interpreter ends it: the same status and output,
    every exit function run, what they wrote flushed, a thread still running
    waited for; a standard output that cannot take the flush is left to the
    interpreter (each compared with a run that has the interpreter's exit)."""
    plain_ws, fast_ws = tmp_path / "plain", tmp_path / "fast"
    shutil.copytree(admitted, plain_ws, symlinks=True)
    shutil.copytree(admitted, fast_ws, symlinks=True)

    def both(*args, options="", stdout=subprocess.PIPE):
        plain = _watching_the_exit(plain_ws, *args, options=",".join(filter(None, ["plain", options])), stdout=stdout)
        fast = _watching_the_exit(fast_ws, *args, options=options, stdout=stdout)
        assert "torn down\n" in plain[2], plain  # the watch sees a teardown where there is one
        assert fast[:2] == plain[:2] and fast[2] == plain[2].replace("torn down\n", ""), (plain, fast)
        return fast

    status, out, err = both("build", "case=c1")
    assert status == 0 and ".  publish" in err and err.endswith("exit function ran\n"), err
    assert out.endswith("confirmed at generation 2 (request " + out.rsplit("(request ", 1)[1].split(")")[0] + ")\nsaid by an exit function\n"), out
    status, out, err = both("build", "case=c1", options="thread")
    assert status == 0 and err.endswith("thread done\nexit function ran\n"), err
    status, out, err = both("build", "case=nope")
    assert status == 1 and "UNKNOWN_CASE: no case nope in the workspace (WS)\n" in err and out == "said by an exit function\n", err
    with open("/dev/full", "w") as full:  # the build's line fails, and the command then drops its output
        status, out, err = both("build", "case=c1", stdout=full)
    assert status == 1 and "IO_ERROR: the standard output could not be written" in err and err.endswith("exit function ran\n"), err
    # A standard output whose flush fails at exit: the interpreter's exit, as ever (it says so and exits 120).
    plain = _watching_the_exit(plain_ws, "build", "case=c1", options="plain,unflushable")
    fast = _watching_the_exit(fast_ws, "build", "case=c1", options="unflushable")
    assert fast == plain and fast[0] == 120 and "torn down\n" in fast[2], (plain, fast)
    assert "Exception ignored" in fast[2] and "No space left on device" in fast[2], fast


def test_a_build_after_a_builder_upgrade_removes_the_older_builders_records(tmp_path, admitted):
    """Each builder code keeps its document records in a folder of its own
    under the case's cache; a build removes those of older code (left by
    builders before upgrades) but the most recently written, and publishes
    nothing new."""
    ws = admitted
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    documents = ws / ".cache" / "c1" / "documents"
    (current,) = documents.iterdir()
    before = kit.tree_digest(ws)
    shutil.copytree(current, documents / "fedcba9876543210")  # as the builder two upgrades ago left them
    os.utime(documents / "fedcba9876543210", ns=(10**18, 10**18))
    current.rename(documents / "0123456789abcdef")  # as the builder before the upgrade left them
    rebuilt = kit.doit("build", "case=c1", workspace=ws)
    assert rebuilt.returncode == 0 and ".  read_input:original/report-a.json" in rebuilt.stderr, rebuilt.stderr
    assert sorted(p.name for p in documents.iterdir()) == sorted([current.name, "0123456789abcdef"])  # the newest other stays
    assert kit.tree_digest(ws) == before and len(kit.manifests(ws, "c1")) == 2


def test_a_program_that_goes_on_after_doits_main_keeps_its_own_exit(tmp_path, admitted):
    """Only a process that ends with doit's ``main`` (its launcher, ``python -m
    doit``) exits without teardown: a program that runs ``main`` and goes on
    exits with its own status, and what it writes after is not lost."""
    after = tmp_path / "after.txt"
    program = (
        "import sys\n"
        "from doit.__main__ import main\n"
        f"sys.argv = ['doit', '-f', {str(REPO / 'dodo.py')!r}, 'build', 'case=c1', 'workspace={admitted}']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as stopped:\n"
        "    print('doit exited', stopped.code)\n"
        f"log = open({str(after)!r}, 'w')\n"
        "log.write('written after doit')\n"
        "sys.exit(5)\n"
    )
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=doit_env(), cwd=REPO, timeout=120)
    assert run.returncode == 5 and run.stdout.endswith("doit exited 0\n"), (run.returncode, run.stdout, run.stderr)
    assert ".  publish" in run.stderr and after.read_text() == "written after doit"


@pytest.mark.parametrize("options", [(), ("-n", "2", "-P", "thread")])
def test_json_reporter_keeps_stdout_one_json_document(admitted, options):
    """With ``--reporter=json`` doit's standard output is its JSON document
    alone: the build's own confirmation line goes to standard error (it was
    printed on stdout before the document, so stdout did not parse). With
    thread workers the document was missing altogether, exit 3, in 2 of 3
    runs: two actions' overlapping output captures left one's writer where
    the reporter had put its buffer."""
    ws = admitted
    for run in ("build", "no-op", "forced"):
        extra = ("--always-execute",) if run == "forced" else ()
        result = kit.doit(*options, "--reporter=json", *extra, "build", "case=c1", workspace=ws)
        assert result.returncode == 0, (run, result.stdout, result.stderr)
        document = json.loads(result.stdout)
        results = {task["name"]: task["result"] for task in document["tasks"]}
        assert results["build"] == "success" and results["publish"] in ("success", "up-to-date"), (run, results)
        assert "case c1 revision 1: " in result.stderr and "confirmed at generation 2" in result.stderr, (run, result.stderr)
        assert "confirmed at generation" not in result.stdout


def test_json_reporter_reports_a_refused_run_in_its_document(admitted):
    """Process workers are refused with their code inside the JSON document,
    and standard output is still that document alone."""
    result = kit.doit("-n", "2", "--reporter=json", "build", "case=c1", workspace=admitted)
    assert result.returncode == 1, result.stderr
    failed = [task for task in json.loads(result.stdout)["tasks"] if task["result"] == "fail"]
    assert [task["name"] for task in failed] == ["validate_index"]
    assert failed[0]["error"].startswith("INVALID_ARGUMENT: build steps cannot run in several processes")
    assert kit.manifests(admitted, "c1")[-1].name == "000001.json"


def test_status_after_a_target_run_names_it_among_the_reasons(admitted):
    """A target named on doit's command line keeps its run's records in
    memory, so status says assemble would run; its reason named only a
    crash or a change (session 29's review)."""
    ws = admitted
    target = ws / ".cache" / "c1" / "out" / "case.json"
    made = kit.doit(str(target), "case=c1", workspace=ws)
    assert made.returncode == 0 and target.exists(), made.stderr
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    assert ("assemble: would run: no record of its last run (a first build, a build stopped before it, the cache cleared or "
            "its dependency file damaged, or a run that kept its records in memory: a target named on doit's command line)"
            ) in status.stdout, status.stdout
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:qa", "reason=again", workspace=ws).returncode == 0
    made = kit.doit(str(target), "case=c1", workspace=ws)
    assert made.returncode == 0, made.stderr
    status = kit.doit("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    assert ("assemble: would run: the cached case is not the one it wrote (cut short by a crash, changed since, or "
            "written by a run that kept its records in memory: a target named on doit's command line)") in status.stdout, status.stdout

"""The append rebuild splice under real command sequences, through the real `doit`.

Every scenario runs the same commands in two workspaces side by side: ``A``
as a user would, ``B`` identical except that its splice state
(``.cache/<case>/out/splice.<code>.msgpack``) is removed before every
command, so ``B`` always assembles the case whole. After every command the
two must agree: exit code, the command's own output (error code lines
included, workspace paths aside), every published case.json and
case_summary.md byte for byte, the build's cached outputs (published or,
after `doit render`, not), and every package file and manifest.
Where the splice applies, ``A`` must also say it spliced (the stderr line
``assemble: N new document(s) appended to the M of the last assembly``, or
``assemble: no new document since the last assembly; its M carried forward``).

Pure-function properties of the splice are in tests/test_splice.py; this
file holds the build-level decisions (``_splice_start``, the carried
snapshot, the hand-off to render, the state left behind) to that invariant.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.jsoncanon import canonical_bytes, canonical_hash
from tests.conftest import REPO, doit_env
from tests.e2e import kit
from tests.e2e.test_build import standard_package

SPLICED = re.compile(
    r"^assemble: (?:(\d+) new document\(s\) appended to the (\d+) of the last assembly"
    r"|no new document since the last assembly; its (\d+) carried forward)$",
    re.M,
)
_PROGRESS = re.compile(r"^(\.  |-- )\S")  # doit's task lines: the same tasks run in A and B

_API_BUILD = """
import sys
from pathlib import Path
from pipeline.build import CaseBuilder
from pipeline.errors import VianoError
from pipeline.lifecycle import CheckpointStore
from pipeline.limits import CaseBuilderLimits
from pipeline.workspace import Workspace

store = CheckpointStore(Workspace(Path(sys.argv[1])))
try:
    result = CaseBuilder(store, CaseBuilderLimits(document_bytes=int(sys.argv[2]))).build("c1")
    print(result["status"], result["generation"])
except VianoError as error:
    print(error, file=sys.stderr)
    sys.exit(1)
finally:
    store.close()
"""


def _states(ws: Path) -> list[Path]:
    return sorted((ws / ".cache" / "c1" / "out").glob("splice.*.msgpack"))


def _drop_states(ws: Path) -> None:
    for path in _states(ws):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _revisions(ws: Path) -> dict[str, bytes]:
    """Every published case.json and case_summary.md, by revision folder."""
    root = kit.package_dir(ws, "c1") / "content" / "case" / "revisions"
    found = {}
    for path in sorted(root.glob("*/*")) if root.is_dir() else []:
        if path.name in ("case.json", "case_summary.md"):
            found[f"{path.parent.name}/{path.name}"] = path.read_bytes()
    return found


def _cache_out(ws: Path) -> Path:
    return ws / ".cache" / "c1" / "out"


def _first_difference(a: bytes, b: bytes) -> str:
    diff = difflib.unified_diff(
        a.decode("utf-8", "replace").splitlines(), b.decode("utf-8", "replace").splitlines(),
        "A (splice state kept)", "B (assembled whole)", lineterm="", n=1,
    )
    return "\n".join(line[:160] for line in list(diff)[:40])


class Twins:
    """Two workspaces driven through the same commands; B never has a splice state."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ws = {"A": root / "A", "B": root / "B"}

    def _run(self, name: str, args: tuple, api: int | None) -> subprocess.CompletedProcess:
        ws = self.ws[name]
        if api is None:
            return kit.doit(*args, workspace=ws)
        return subprocess.run(
            [sys.executable, "-c", _API_BUILD, str(ws), str(api)],
            capture_output=True, text=True, env=doit_env(), cwd=REPO, timeout=120,
        )

    def _normal(self, name: str, text: str) -> list[str]:
        text = text.replace(str(self.ws[name]), "<ws>")
        return [line for line in text.splitlines() if not SPLICED.match(line) and not _PROGRESS.match(line)]

    def run(self, *args: str, splice=None, damage=None, damage_both=False, api: int | None = None, ok: bool | None = True):
        """Run ``args`` (a doit command, or with ``api`` a CaseBuilder build
        with that document_bytes limit) in both workspaces and hold them equal.

        ``splice``: ``(new, carried)`` when A must splice exactly so, False
        when it must not, None to leave it open. ``damage(ws)`` is applied to
        A's workspace first (to both with ``damage_both``). ``ok``: the
        expected success (None: either, as long as A and B agree).
        """
        _drop_states(self.ws["B"])
        if damage is not None:
            damage(self.ws["A"])
            if damage_both:
                damage(self.ws["B"])
        with ThreadPoolExecutor(2) as pool:
            futures = {name: pool.submit(self._run, name, args, api) for name in ("A", "B")}
            results = {name: future.result() for name, future in futures.items()}
        a, b = results["A"], results["B"]
        where = f"{' '.join(args) or 'API build'}: A stderr:\n{a.stderr}\nB stderr:\n{b.stderr}"
        for result in (a, b):
            assert "Traceback" not in result.stderr, where
        assert a.returncode == b.returncode, where
        if ok is not None:
            assert (a.returncode == 0) == ok, where
        assert self._normal("A", a.stderr) == self._normal("B", b.stderr), where
        assert self._normal("A", a.stdout) == self._normal("B", b.stdout), where
        outputs_a, outputs_b = _revisions(self.ws["A"]), _revisions(self.ws["B"])
        assert sorted(outputs_a) == sorted(outputs_b), where
        for key in outputs_a:
            assert outputs_a[key] == outputs_b[key], f"{key} differs after {where}\n{_first_difference(outputs_a[key], outputs_b[key])}"
        for name in ("case.json", "case_summary.md"):  # also what `doit render` leaves unpublished
            cached_a, cached_b = (_cache_out(self.ws[n]) / name for n in ("A", "B"))
            assert cached_a.exists() == cached_b.exists(), where
            if cached_a.exists():
                data_a, data_b = cached_a.read_bytes(), cached_b.read_bytes()
                assert data_a == data_b, f"cached {name} differs after {where}\n{_first_difference(data_a, data_b)}"
        # Every package file and manifest (the store records times, so it is not compared bytewise).
        assert kit.tree_digest(self.ws["A"] / "cases") == kit.tree_digest(self.ws["B"] / "cases"), where
        assert not SPLICED.search(b.stderr), where  # B has no state: never spliced
        found = SPLICED.search(a.stderr)
        did = (int(found.group(1) or 0), int(found.group(2) or found.group(3))) if found else None
        if splice is False:
            assert did is None, where
        elif splice is not None:
            assert did == tuple(splice), where
        return a

    def case(self, revision: int) -> dict:
        path = kit.package_dir(self.ws["A"], "c1") / "content" / "case" / "revisions" / f"{revision:04d}" / "case.json"
        return json.loads(path.read_text(encoding="utf-8"))


def _append(root: Path, name: str, *, files: dict, index: dict) -> str:
    return f"source={kit.make_append(root / 'appends' / name, files=files, index=index)}"


def _reopen(twins: Twins, why: str = "more") -> None:
    twins.run("reopen", "case=c1", "by=human:alice", f"reason={why}")


def _damage_views(ws: Path, damaged) -> None:
    """Replace every cached prior-case view's bytes with ``damaged(bytes)``."""
    views = sorted((ws / ".cache" / "c1" / "documents").rglob("*.case-view.*.json"))
    assert views
    for view in views:
        view.write_bytes(damaged(view.read_bytes()))


def _one_reproduction_appended_after_a_reopen(tmp_path: Path) -> Twins:
    """The standard package admitted and built, reopened, one reproduction appended."""
    twins = Twins(tmp_path)
    twins.run("admit", "case=c1", f"source={standard_package(tmp_path / 'src')}")
    twins.run("build", "case=c1", splice=False)
    _reopen(twins)
    twins.run("append", "case=c1", _append(tmp_path, "r", files={"original/r2.json": kit.reproduction(steps=["s"])},
                                          index=kit.index(reproductions=["original/r2.json"])))
    return twins


# ---------------------------------------------------------------- sequences


def test_reproduction_appends_splice_across_every_reopen(tmp_path):
    """Reopen after reopen, each append splicing onto the previous revision's
    case: a reproduction that conflicts, merges an entity, carries a float,
    a value_ref fact and a nested value, references a new events file and a
    file that was unclassified so far; an append of opaque files and an index
    that only re-lists and adds context; a reopen built without any append;
    then a no-op build."""
    twins = Twins(tmp_path)
    source = standard_package(tmp_path / "src")
    twins.run("admit", "case=c1", f"source={source}")
    twins.run("build", "case=c1", splice=False)  # no state yet

    _reopen(twins)
    repro2 = kit.reproduction(
        steps=["Boot", "Toggle twice"],
        observations=[{"text": "Off once more", "claim": {"key": "switch.state", "value": "off"}},
                      {"text": "Nested", "claim": {"key": "switch.mode", "value": {"b": [1, 2.5, None], "a": True}}}],
        facts=[{"name": "uptime", "value": 3.5}, {"name": "big", "value": "y" * 20000},
               {"name": "nested", "value": {"z": [1.0, -0.5], "a": "x"}}],
        events_ref="original/runtime-2.log",
        attachments=["original/screen.png", "original/notes.txt"],
        entities=[{"type": "component", "id": 42, "roles": ["again"]}, {"type": "device", "id": "007"}],
    )
    twins.run("append", "case=c1", _append(tmp_path, "r2", files={
        "original/repro-2.json": repro2, "original/runtime-2.log": "tick\n" * 100,
    }, index=kit.index(reproductions=["original/repro-2.json"])))
    twins.run("build", "case=c1", splice=(1, 3))
    case = twins.case(2)
    assert [r["path"] for r in case["inputs"]["unclassified"]] == []  # notes.txt is an attachment now
    assert [c["key"] for c in case["data_quality"]["claim_conflicts"]] == ["switch.state"]

    _reopen(twins)
    # Only opaque files and an index: it re-lists an inherited reproduction
    # (same path, same bytes) and names context; no new document.
    twins.run("append", "case=c1", _append(tmp_path, "ctx", files={
        "original/extra.bin": b"\x00\x01opaque", "original/unlisted.txt": "unlisted",
        "original/repro.json": (source / "original" / "repro.json").read_bytes(),
    }, index=kit.index(reproductions=["original/repro-2.json", "original/repro.json"],
                       runtime=["original/runtime.log"], source=["original/extra.bin"])))
    twins.run("build", "case=c1", splice=(0, 4))
    assert [r["path"] for r in twins.case(3)["inputs"]["unclassified"]] == ["original/unlisted.txt"]

    _reopen(twins, "again")
    built = twins.run("build", "case=c1", splice=(0, 4))  # a reopen built without any append
    assert "assemble: no new document since the last assembly; its 4 carried forward\n" in built.stderr

    _reopen(twins, "third")
    repro3 = kit.reproduction(steps=["Wait"], observations=[{"text": "Still off", "claim": {"key": "switch.state", "value": "on"}}],
                              facts=[{"name": "uptime", "value": 4}], events_ref="original/runtime-2.log",
                              entities=[{"type": "device", "id": 7}])
    twins.run("append", "case=c1", _append(tmp_path, "r3", files={"original/repro-3.json": repro3},
                                          index=kit.index(reproductions=["original/repro-3.json"])))
    twins.run("build", "case=c1", splice=(1, 4))
    assert [r["id"] for r in twins.case(5)["reproduction"]["reproductions"]] == ["R0001", "R0002", "R0003"]
    twins.run("build", "case=c1", splice=False)  # a no-op: the confirmed case is reused


def test_report_attachments_splice_and_classify_what_they_name(tmp_path):
    """Reports' attachments (ARCHITECTURE section 12) through appends: a new
    report attaching a file that was unclassified so far and a file the
    reproduction attaches too, then a report attaching a file of its own
    append; each rebuild spliced and byte-identical to the whole build."""
    twins = Twins(tmp_path)
    twins.run("admit", "case=c1", f"source={standard_package(tmp_path / 'src')}")
    twins.run("build", "case=c1", splice=False)
    assert twins.case(1)["bug"]["attachments"] == []
    assert "original/notes.txt" in [r["path"] for r in twins.case(1)["inputs"]["unclassified"]]

    _reopen(twins)
    attaching = kit.report("Attached", observations=[{"text": "See the shots"}])
    attaching["attachments"] = ["original/notes.txt", "original/screen.png"]
    twins.run("append", "case=c1", _append(tmp_path, "a1", files={"original/report-c.json": attaching},
                                          index=kit.index(reports=["original/report-c.json"])))
    twins.run("build", "case=c1", splice=(1, 3))
    case = twins.case(2)
    got = [(a["path"], a["provenance"]["source"], a["provenance"]["pointer"]) for a in case["bug"]["attachments"]]
    assert got == [("original/notes.txt", "original/report-c.json", "/attachments/0"),
                   ("original/screen.png", "original/report-c.json", "/attachments/1")]
    assert "original/notes.txt" not in [r["path"] for r in case["inputs"]["unclassified"]]

    _reopen(twins, "again")
    second = kit.report("Second")
    second["attachments"] = ["original/shot-2.png"]
    twins.run("append", "case=c1", _append(tmp_path, "a2", files={"original/report-d.json": second, "original/shot-2.png": b"\x89PNG"},
                                          index=kit.index(reports=["original/report-d.json"])))
    # Spliced: the new revision takes its prior case's inputs in the order
    # the indexes listed them (report-c after the reproduction), so its
    # inventory begins with the previous build's.
    twins.run("build", "case=c1", splice=(1, 4))
    case = twins.case(3)
    assert [a["path"] for a in case["bug"]["attachments"]] == ["original/notes.txt", "original/screen.png", "original/shot-2.png"]
    summary = (kit.package_dir(twins.ws["A"], "c1") / "content/case/revisions/0003/case_summary.md").read_text(encoding="utf-8")
    assert "### Attachments (supplied with reports)\n\n| Path | SHA-256 | Size (bytes) | Attached by |\n" in summary
    assert "tester\\_report original\\/report\\-d\\.json#\\/attachments\\/0 |" in summary


# Builds a case as builders before session 17 did, for reports' attachments:
# an ignored top-level extension, neither checked nor listed.
_OLDER_BUILDER = """
import json
import sys
from pathlib import Path

import pipeline.reader as reader
from pipeline.build import CaseBuilder
from pipeline.lifecycle import CheckpointStore
from pipeline.workspace import Workspace

strict = reader.read_document


def read_document(data, name, **kwargs):
    if name == "report":
        document = json.loads(data)
        document.pop("attachments", None)
        data = json.dumps(document).encode()
    return strict(data, name, **kwargs)


reader.read_document = read_document
store = CheckpointStore(Workspace(Path(sys.argv[1])))
try:
    print(CaseBuilder(store).build("c1")["status"])
finally:
    store.close()
"""


def test_reports_a_prior_case_took_in_before_attachments_were_read_keep_their_statements(tmp_path):
    """A case confirmed by a builder that ignored reports' attachments, one
    report's a string and another's naming a file the package lacks: after a
    reopen the new revision keeps both reports (they are its prior case's
    inputs, which cannot be dropped or replaced), ignores their attachments
    with an IGNORED_ATTACHMENTS gap each, and holds a report it adds to the
    contract. The gaps are carried by the splice of the next revision."""
    source = standard_package(tmp_path / "src")
    for name, attachments in (("report-a.json", "see the screenshot"), ("report-b.json", ["original/never-sent.png"])):
        report = json.loads((source / "original" / name).read_text(encoding="utf-8"))
        report["attachments"] = attachments
        kit.write_json(source / "original" / name, report)
    twins = Twins(tmp_path)
    twins.run("admit", "case=c1", f"source={source}")
    for ws in twins.ws.values():
        built = subprocess.run([sys.executable, "-c", _OLDER_BUILDER, str(ws)], capture_output=True, text=True,
                               env=doit_env(), cwd=REPO, timeout=120)
        assert built.stdout == "published\n", built.stderr
        shutil.rmtree(ws / ".cache")  # its records were made by the emulated reader
    twins.run("build", "case=c1", splice=False)  # the confirmed case, reused
    status = twins.run("status", "case=c1")
    assert ("read_input:original/report-a.json: up to date, refused (SCHEMA_VIOLATION: report: 'see the screenshot' is not "
            "of type 'array'); the revision's case is reused as published, which reads no input\n") in status.stdout, status.stdout
    assert "would fail" not in status.stdout
    _reopen(twins)
    added = kit.report("Added", observations=[{"text": "new"}])
    added["attachments"] = ["original/screen.png"]
    twins.run("append", "case=c1", _append(tmp_path, "a1", files={"original/report-c.json": added},
                                          index=kit.index(reports=["original/report-c.json"])))
    status = twins.run("status", "case=c1")
    ignoring = "from the prior case, which did not list its attachments: the build keeps it and ignores them with an IGNORED_ATTACHMENTS gap"
    assert (f"read_input:original/report-a.json: up to date, refused for its attachments (SCHEMA_VIOLATION: report: "
            f"'see the screenshot' is not of type 'array'); {ignoring}\n") in status.stdout, status.stdout
    assert f"read_input:original/report-b.json: up to date; {ignoring}\n" in status.stdout, status.stdout
    twins.run("build", "case=c1")
    case = twins.case(2)
    gaps = [(g["code"], g.get("source")) for g in case["data_quality"]["gaps"]]
    assert [gap for gap in gaps if gap[0] == "IGNORED_ATTACHMENTS"] == [
        ("IGNORED_ATTACHMENTS", "original/report-a.json"), ("IGNORED_ATTACHMENTS", "original/report-b.json")]
    assert [t["provenance"]["source"] for t in case["bug"]["titles"]] == [
        "original/report-a.json", "original/report-b.json", "original/report-c.json"]
    assert [(a["path"], a["provenance"]["source"]) for a in case["bug"]["attachments"]] == [("original/screen.png", "original/report-c.json")]

    # A report this revision adds is held to the contract: never ignored.
    _reopen(twins, "again")
    wrong = kit.report("Wrong")
    wrong["attachments"] = "not a list"
    twins.run("append", "case=c1", _append(tmp_path, "a2", files={"original/report-d.json": wrong},
                                          index=kit.index(reports=["original/report-d.json"])))
    refused = twins.run("build", "case=c1", ok=False)
    assert "SCHEMA_VIOLATION: report: 'not a list' is not of type 'array' (original/report-d.json#/attachments)" in refused.stderr
    fixed = kit.report("Right")
    twins.run("append", "case=c1", _append(tmp_path, "a3", files={"original/report-e.json": fixed},
                                          index=kit.index(reports=["original/report-e.json"])))
    twins.run("build", "case=c1", splice=(1, 4))
    gaps = [(g["code"], g.get("source")) for g in twins.case(3)["data_quality"]["gaps"]]
    assert ("IGNORED_ATTACHMENTS", "original/report-a.json") in gaps and ("IGNORED_ATTACHMENTS", "original/report-b.json") in gaps
    assert ("SUPERSEDED_INPUT", "original/report-d.json") in gaps

    # The file report-b names, appended at last: its attachments stay ignored,
    # as the prior case decided (with or without the cache, which carries the
    # decision in its splice state, alike).
    _reopen(twins, "the file")
    twins.run("append", "case=c1", _append(tmp_path, "a4", files={"original/never-sent.png": b"\x89PNG late"},
                                          index=kit.index(attachments=["original/never-sent.png"])))
    twins.run("build", "case=c1", splice=(0, 5))
    case = twins.case(4)
    assert ("IGNORED_ATTACHMENTS", "original/report-b.json") in [(g["code"], g.get("source")) for g in case["data_quality"]["gaps"]]
    assert [a["provenance"]["source"] for a in case["bug"]["attachments"]] == ["original/report-c.json"]
    assert [r["path"] for r in case["inputs"]["attachments"]] == ["original/never-sent.png"]


def test_report_appends_rederive_completeness_request_entities_and_gaps(tmp_path):
    """What is derived across records, re-derived from the carried state and
    the new report each time: completeness (complete, then unspecified by an
    undeclared report, then conflicting), the research request appearing,
    claim conflicts, merged entities, UNNORMALIZED_KEY gaps against carried
    keys and types, and the first reproduction removing NO_REPRODUCTIONS."""
    twins = Twins(tmp_path)
    a = kit.report("Title A", summary="Summary A",
                   observations=[{"text": "o1", "claim": {"key": "caf\u00e9", "value": 1}}],
                   expected=[{"text": "e1", "claim": {"key": "target", "value": "on"}}], complete=True,
                   entities=[{"type": "component", "id": 7, "roles": ["focus"]}])
    source = kit.make_package(tmp_path / "src", files={"original/a.json": a}, index=kit.index(reports=["original/a.json"]))
    twins.run("admit", "case=c1", f"source={source}")
    twins.run("build", "case=c1", splice=False)
    assert twins.case(1)["research"]["request"] is None

    _reopen(twins)
    b = kit.report("Title B", observations=[{"text": "o2", "claim": {"key": "cafe\u0301", "value": 1}}],
                   expected=[{"text": "e2"}],
                   entities=[{"type": "component", "id": "7", "roles": ["again"]}, {"type": "Cafe\u0301", "id": "x"}])
    twins.run("append", "case=c1", _append(tmp_path, "b", files={"original/b.json": b}, index=kit.index(reports=["original/b.json"])))
    twins.run("build", "case=c1", splice=(1, 1))
    case = twins.case(2)
    assert case["expected_behavior"]["completeness"] == "unspecified"
    assert case["research"]["request"] is not None
    assert ("UNNORMALIZED_KEY", "original/b.json") in [(g["code"], g.get("source")) for g in case["data_quality"]["gaps"]]

    _reopen(twins)
    # Different bytes under an existing path: refused alike in A and B.
    twins.run("append", "case=c1", _append(tmp_path, "clash", files={"original/a.json": kit.report("Other")},
                                          index=kit.index(reports=["original/a.json"])), ok=False)
    c = kit.report("Title C", comments=[{"text": "c1"}], hypotheses=[{"text": "h1"}],
                   expected=[{"text": "e3", "claim": {"key": "target", "value": "off"}}], complete=False,
                   entities=[{"type": "Caf\u00e9", "id": "x"}])
    twins.run("append", "case=c1", _append(tmp_path, "c", files={"original/c.json": c}, index=kit.index(reports=["original/c.json"])))
    twins.run("build", "case=c1", splice=(1, 2))
    assert twins.case(3)["expected_behavior"]["completeness"] == "conflicting"

    _reopen(twins)
    d = kit.report("Title D", summary="Summary D")
    r = kit.reproduction(steps=["go"], observations=[{"text": "seen", "claim": {"key": "caf\u00e9", "value": 2}}])
    twins.run("append", "case=c1", _append(tmp_path, "d", files={"original/d.json": d, "original/r.json": r},
                                          index=kit.index(reports=["original/d.json"], reproductions=["original/r.json"])))
    # assemble alone splices; render then runs in another process, without
    # the hand-off: it renders whole and leaves no state.
    twins.run("assemble", "case=c1", splice=(2, 3))
    twins.run("build", "case=c1", splice=False)
    assert "NO_REPRODUCTIONS" not in [g["code"] for g in twins.case(4)["data_quality"]["gaps"]]
    assert _states(twins.ws["A"]) == []
    _reopen(twins)
    twins.run("append", "case=c1", _append(tmp_path, "e", files={"original/e.json": kit.report("Title E")},
                                          index=kit.index(reports=["original/e.json"])))
    twins.run("build", "case=c1", splice=False)  # no state: whole, and a state again


def test_failed_builds_then_corrected_appends_in_the_same_revision(tmp_path):
    """A new reproduction that fails its contract, one whose events file is
    missing, one over the document limit: each build fails alike, and the
    correcting append (listing only the correction) splices, the failed
    document inherited and dropped with a SUPERSEDED_INPUT gap, or kept once
    the file it names arrived."""
    twins = Twins(tmp_path)
    twins.run("admit", "case=c1", f"source={standard_package(tmp_path / 'src')}")
    twins.run("build", "case=c1", splice=False)

    _reopen(twins)
    bad = kit.reproduction(steps=["x"], observations=[{"text": "x", "bogus": 1}])
    twins.run("append", "case=c1", _append(tmp_path, "bad", files={"original/bad.json": bad},
                                          index=kit.index(reproductions=["original/bad.json"])))
    twins.run("build", "case=c1", ok=False)
    fixed = kit.reproduction(steps=["x"], observations=[{"text": "x"}], facts=[{"name": "n", "value": 1}])
    twins.run("append", "case=c1", _append(tmp_path, "fixed", files={"original/fixed.json": fixed},
                                          index=kit.index(reproductions=["original/fixed.json"])))
    twins.run("build", "case=c1", splice=(1, 3))
    gaps = [(g["code"], g.get("source")) for g in twins.case(2)["data_quality"]["gaps"]]
    assert ("SUPERSEDED_INPUT", "original/bad.json") in gaps

    _reopen(twins)
    waiting = kit.reproduction(steps=["y"], observations=[{"text": "waits"}], events_ref="original/later.log")
    twins.run("append", "case=c1", _append(tmp_path, "waiting", files={"original/waiting.json": waiting},
                                          index=kit.index(reproductions=["original/waiting.json"])))
    twins.run("build", "case=c1", ok=False)  # REFERENCE_MISSING
    other = kit.reproduction(steps=["z"], observations=[{"text": "other"}])
    twins.run("append", "case=c1", _append(tmp_path, "later", files={"original/other.json": other, "original/later.log": "late\n"},
                                          index=kit.index(reproductions=["original/other.json"])))
    twins.run("build", "case=c1", splice=(2, 4))
    assert "original/waiting.json" in [r["path"] for r in twins.case(3)["inputs"]["reproductions"]]

    _reopen(twins)
    huge = kit.reproduction(steps=["s" * (1024 * 1024 + 10)])
    twins.run("append", "case=c1", _append(tmp_path, "huge", files={"original/huge.json": huge},
                                          index=kit.index(reproductions=["original/huge.json"])))
    failed = twins.run("build", "case=c1", ok=False)
    assert "LIMIT_EXCEEDED" in failed.stderr
    small = kit.reproduction(steps=["s"], observations=[{"text": "small"}])
    twins.run("append", "case=c1", _append(tmp_path, "small", files={"original/small.json": small},
                                          index=kit.index(reproductions=["original/small.json"])))
    twins.run("build", "case=c1", splice=(1, 6))
    gaps = [(g["code"], g.get("source")) for g in twins.case(4)["data_quality"]["gaps"]]
    assert ("SUPERSEDED_INPUT", "original/huge.json") in gaps


def test_unpublished_render_then_appends_in_the_same_revision(tmp_path):
    """`doit render` leaves a state without a confirmed case, so later
    appends of the same revision splice onto documents that are inherited
    provisionally; an index that moves an inherited report to another role
    must not splice it in."""
    twins = Twins(tmp_path)
    files = {
        "original/a.json": kit.report("A", observations=[{"text": "oa", "claim": {"key": "k", "value": 1}}], expected=[{"text": "ea"}]),
        "original/b.json": kit.report("B", observations=[{"text": "ob", "claim": {"key": "k", "value": 2}}],
                                      entities=[{"type": "t", "id": 1}]),
        "original/r.json": kit.reproduction(steps=["go"], observations=[{"text": "or"}]),
    }
    source = kit.make_package(tmp_path / "src", files=files,
                              index=kit.index(reports=["original/a.json", "original/b.json"], reproductions=["original/r.json"]))
    twins.run("admit", "case=c1", f"source={source}")
    twins.run("render", "case=c1", splice=False)
    twins.run("append", "case=c1", _append(tmp_path, "move", files={"original/d.json": kit.report("D", expected=[{"text": "ed"}], complete=True)},
                                          index=kit.index(reports=["original/d.json"], attachments=["original/b.json"])))
    twins.run("render", "case=c1", splice=False)  # b is no report any more: its records must go
    # The third index re-lists an inherited report after the new one: it is read strictly now, in its old place.
    twins.run("append", "case=c1", _append(tmp_path, "e", files={"original/e.json": kit.report("E", observations=[{"text": "oe"}])},
                                          index=kit.index(reports=["original/e.json", "original/a.json"])))
    twins.run("build", "case=c1", splice=(1, 3))
    case = twins.case(1)
    assert [r["path"] for r in case["inputs"]["attachments"]] == ["original/b.json"]
    assert case["data_quality"]["claim_conflicts"] == []


def test_research_results_are_never_spliced(tmp_path):
    """A research result numbers its statements after every tester
    statement: the build with one, and every later build inheriting it, is
    assembled whole."""
    twins = Twins(tmp_path)
    source = kit.make_package(tmp_path / "src", files={"original/r.json": kit.report("T", expected=[{"text": "e"}])},
                              index=kit.index(reports=["original/r.json"]))
    twins.run("admit", "case=c1", f"source={source}")
    twins.run("build", "case=c1", splice=False)
    request = twins.case(1)["research"]["request"]
    canonical = canonical_bytes(request)  # stored as its canonical bytes, whose sha256 is the request hash
    request_hash = canonical_hash(request)
    folder = f"research/{request_hash}"
    result = {
        "format": "viano-research-result", "format_version": 1, "provider": {"name": "t", "version": "1"},
        "request_hash": request_hash, "scope": "intended_behavior", "status": "complete",
        "statements": [{"text": "It turns on", "citations": [0]}],
        "sources": [{"url": "https://e.org", "title": "S", "retrieved_at": "2026-01-01T00:00:00Z", "excerpt": "on"}],
    }
    _reopen(twins)
    twins.run("append", "case=c1", _append(tmp_path, "research", files={f"{folder}/request.json": canonical, f"{folder}/result.json": result},
                                          index=kit.index(expected_research=[f"{folder}/result.json"])))
    twins.run("build", "case=c1", splice=False)
    assert twins.case(2)["expected_behavior"]["status"] == "combined"
    _reopen(twins)
    twins.run("append", "case=c1", _append(tmp_path, "more", files={"original/s.json": kit.report("S", expected=[{"text": "e2"}])},
                                          index=kit.index(reports=["original/s.json"])))
    twins.run("build", "case=c1", splice=False)


def test_damaged_cache_falls_back_to_the_whole_assembly(tmp_path):
    """Before each append rebuild, A's cache is damaged one way (B's state is
    gone as always): the build gives what B gives, splicing only where the
    damage leaves the state and both outputs it was bound to intact."""
    twins = Twins(tmp_path)
    twins.run("admit", "case=c1", f"source={standard_package(tmp_path / 'src')}")
    twins.run("build", "case=c1", splice=False)
    saved: dict[str, bytes] = {}

    def keep_state(ws):
        [state] = _states(ws)
        saved["state"] = state.read_bytes()

    def stale_state(ws):  # the state an earlier build left, for outputs since replaced
        [state] = _states(ws)
        state.write_bytes(saved["state"])

    def forged_state(ws):  # decodes as a dict, binds nothing
        import msgspec

        [state] = _states(ws)
        state.write_bytes(msgspec.msgpack.encode({"case_id": "c1", "package_id": "pkg-1", "units": [[1, 2, 3]],
                                                  "carried": "x", "inline_fact_value": 16384}))

    def wrong_types_state(ws):  # every key there, none of the right type
        import msgspec

        [state] = _states(ws)
        value = msgspec.msgpack.decode(kit.unsealed(state.read_bytes()))
        value["carried"] = {**value["carried"], "next_floor": {"Z": "x"}, "entities": [1], "claims": {"O": [[1]], "E": 2}}
        state.write_bytes(kit.sealed(msgspec.msgpack.encode(value)))  # sealed again: only its types are wrong

    def truncate_state(ws):
        [state] = _states(ws)
        state.write_bytes(state.read_bytes()[: len(state.read_bytes()) // 2])

    def delete_cached_case(ws):
        (_cache_out(ws) / "case.json").unlink()

    def alter_cached_summary(ws):
        summary = _cache_out(ws) / "case_summary.md"
        summary.write_bytes(summary.read_bytes() + b"\n")

    def delete_prior_views(ws):
        for view in (ws / ".cache" / "c1" / "documents").rglob("*.case-view.*.json"):
            view.unlink()

    damages = [
        (delete_prior_views, True, True),  # planning derives the view again: still spliced
        (delete_cached_case, False, False),
        (alter_cached_summary, False, False),
        (truncate_state, False, False),
        (forged_state, False, False),
        (wrong_types_state, False, False),
        (stale_state, False, False),
    ]
    carried = 3
    for number, (damage, both, splice) in enumerate(damages, start=2):
        _reopen(twins, damage.__name__)
        repro = kit.reproduction(steps=[f"step {number}"], observations=[{"text": f"seen {number}",
                                 "claim": {"key": "switch.state", "value": number}}], entities=[{"type": "component", "id": 42}])
        twins.run("append", "case=c1", _append(tmp_path, f"d{number}", files={f"original/d{number}.json": repro},
                                              index=kit.index(reproductions=[f"original/d{number}.json"])))
        twins.run("build", "case=c1", damage=damage, damage_both=both, splice=(1, carried) if splice else False)
        carried += 1
        if damage is truncate_state:
            keep_state(twins.ws["A"])  # this build's state: stale by the time stale_state puts it back
    # Every fallback left a good state again: the next append rebuild splices.
    _reopen(twins, "last")
    twins.run("append", "case=c1", _append(tmp_path, "last", files={"original/last.json": kit.reproduction(steps=["last"])},
                                          index=kit.index(reproductions=["original/last.json"])))
    twins.run("build", "case=c1", splice=(1, carried))


# ------------------------------------------------- found by review, fixed since


def test_a_lowered_document_limit_drops_an_inherited_document_in_the_spliced_build_too(tmp_path):
    """An inherited (provisional) document over a lowered per-document limit
    is dropped with a SUPERSEDED_INPUT gap when the case is assembled whole
    (README, "Effective inventory"); a splice would carry its records as the
    earlier build made them, so the state is bound to every limit, not the
    inline fact limit alone. Reached through the Python API (doit always
    uses the default limits), after an unpublished `doit render` left a state
    within the revision."""
    twins = Twins(tmp_path)
    files = {"original/a.json": kit.report("Big", observations=[{"text": "x" * 3000}]),
             "original/b.json": kit.report("B", observations=[{"text": "b"}])}
    source = kit.make_package(tmp_path / "src", files=files, index=kit.index(reports=["original/a.json", "original/b.json"]))
    twins.run("admit", "case=c1", f"source={source}")
    twins.run("render", "case=c1", splice=False)
    twins.run("append", "case=c1", _append(tmp_path, "c", files={"original/c.json": kit.report("C")},
                                          index=kit.index(reports=["original/c.json"])))
    twins.run(api=2000)  # A: 1 new input spliced onto a.json and b.json; B: a.json dropped


def test_a_deeply_nested_state_file_falls_back_instead_of_crashing(tmp_path):
    """A 6 KB state file of nested MessagePack maps makes msgspec raise
    RecursionError: a cache record nested too deeply is a damaged record
    (INTEGRITY_ERROR inside the cache), and the build assembles whole
    instead of ending in a traceback on every build of the case."""
    twins = _one_reproduction_appended_after_a_reopen(tmp_path)

    def nest(ws):
        [state] = _states(ws)
        state.write_bytes(b"\x81\xa1a" * 2000 + b"\xc0")

    twins.run("build", "case=c1", damage=nest, splice=False)


def test_a_directory_in_place_of_the_state_file_does_not_fail_the_build(tmp_path):
    """The state is only a head start: when it can be neither written nor
    removed (a directory in its place), the build still succeeds, as it does
    when the memos beside it cannot be written."""
    twins = _one_reproduction_appended_after_a_reopen(tmp_path)

    def directory(ws):
        [state] = _states(ws)
        state.unlink()
        state.mkdir()
        (state / "x").write_bytes(b"x")

    twins.run("build", "case=c1", damage=directory, splice=False)


def test_a_corrupt_cached_input_record_is_read_again_with_or_without_the_state(tmp_path):
    """The splice never reads the carried documents' records; the whole
    assembly reads every one, and one that no longer decodes (doit does not
    rerun a read_input whose record exists) is read again from its verified
    input instead of failing the build: both succeed, with the same bytes."""
    twins = _one_reproduction_appended_after_a_reopen(tmp_path)

    def corrupt_report_records(ws):
        records = sorted((ws / ".cache" / "c1" / "documents").rglob("*.report.*.json"))
        assert records
        for record in records:
            record.write_bytes(record.read_bytes()[:-10])

    twins.run("build", "case=c1", damage=corrupt_report_records, damage_both=True)


def test_a_damaged_prior_case_view_is_derived_again_with_or_without_the_state(tmp_path):
    """The splice seldom reads the prior case's view; the whole assembly and
    planning always do. A view that no longer decodes (the plan reused from
    an earlier validate_index) is derived again from the verified prior case
    instead of failing every later build: both succeed, with the same bytes."""
    twins = _one_reproduction_appended_after_a_reopen(tmp_path)
    twins.run("validate_index", "case=c1")

    twins.run("build", "case=c1", damage=lambda ws: _damage_views(ws, lambda data: data[:-10]), damage_both=True)
    # B assembled whole, reading the view: derived again and left whole. (A
    # spliced without needing it; a later reader derives it the same way.)
    for view in (twins.ws["B"] / ".cache" / "c1" / "documents").rglob("*.case-view.*.json"):
        json.loads(kit.unsealed(view.read_bytes()))


def test_planning_derives_a_damaged_prior_case_view_again(tmp_path):
    """The view `doit reopen` leaves, damaged before the next build plans:
    planning derives it again from the verified prior case (as for a missing
    one) instead of failing with INTEGRITY_ERROR on every build."""
    twins = Twins(tmp_path)
    twins.run("admit", "case=c1", f"source={standard_package(tmp_path / 'src')}")
    twins.run("build", "case=c1", splice=False)
    _reopen(twins)

    twins.run("append", "case=c1", _append(tmp_path, "r", files={"original/r2.json": kit.reproduction(steps=["s"])},
                                          index=kit.index(reproductions=["original/r2.json"])),
              damage=lambda ws: _damage_views(ws, lambda data: b"{" * 3), damage_both=True)
    twins.run("build", "case=c1")
    for ws in twins.ws.values():
        for view in (ws / ".cache" / "c1" / "documents").rglob("*.case-view.*.json"):
            json.loads(kit.unsealed(view.read_bytes()))  # planning left it whole again


def test_a_refusal_read_under_a_lowered_limit_is_not_reused_under_the_default(tmp_path):
    """A document an API build refused for its size under a lowered
    ``document_bytes`` is read again by a later `doit build` under the
    default limit, exactly as with an empty cache (found by the second
    review: records were named without the size bound, so the refusal was
    reused and the document dropped). A: the cache deleted first; B: the
    cache as the API build left it."""
    twins = Twins(tmp_path)
    files = {"original/a.json": kit.report("A", observations=[{"text": "a"}]),
             "original/b.json": kit.report("Big", observations=[{"text": "x" * 3000}])}
    source = kit.make_package(tmp_path / "src", files=files, index=kit.index(reports=["original/a.json", "original/b.json"]))
    twins.run("admit", "case=c1", f"source={source}")
    bad = kit.reproduction(steps=["x"], observations=[{"text": "x", "bogus": 1}])
    twins.run("append", "case=c1", _append(tmp_path, "bad", files={"original/bad.json": bad},
                                          index=kit.index(reproductions=["original/bad.json"])))
    twins.run(api=2000, ok=False)  # bad.json fails the contract; b.json is over the 2000-byte limit
    twins.run("append", "case=c1", _append(tmp_path, "ok", files={"original/ok.json": kit.reproduction(steps=["y"])},
                                          index=kit.index(reproductions=["original/ok.json"])))
    twins.run("build", "case=c1", damage=lambda ws: shutil.rmtree(ws / ".cache"))
    assert "Big" in [t["text"] for t in twins.case(1)["bug"]["titles"]]


def test_status_on_a_published_unconfirmed_case_says_no_input_is_read(tmp_path):
    """A case an older builder published and was killed before confirming,
    beside this builder's refusal of one of its reports (attachments [5]):
    the next build confirms and reuses that case, reading no input into it,
    and status says so instead of predicting the refusal."""
    source = standard_package(tmp_path / "src")
    report = json.loads((source / "original" / "report-a.json").read_text(encoding="utf-8"))
    report["attachments"] = [5]
    kit.write_json(source / "original" / "report-a.json", report)
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    refused = kit.doit("build", "case=c1", workspace=ws)
    assert "SCHEMA_VIOLATION: report: 5 is not of type 'string' (original/report-a.json#/attachments/0)" in refused.stderr
    shutil.move(ws / ".cache", tmp_path / "cache-kept")  # this builder's records, the refusal among them
    older = subprocess.run([sys.executable, "-c", _OLDER_BUILDER, str(ws)], capture_output=True, text=True,
                           env={**doit_env(), "VIANO_CRASH_AT": "build:after-publish"}, cwd=REPO, timeout=120)
    assert older.returncode == -9, older.stderr  # killed after publishing, before confirming
    shutil.rmtree(ws / ".cache")
    shutil.move(tmp_path / "cache-kept", ws / ".cache")
    status = kit.doit("status", "case=c1", workspace=ws)
    assert ("read_input:original/report-a.json: up to date, refused (SCHEMA_VIOLATION: report: 5 is not of type 'string'); "
            "the revision's case is reused as published, which reads no input\n") in status.stdout, status.stdout
    assert "publish: would run: generation 2 published this case; the build confirms it and reuses it" in status.stdout
    built = kit.doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0 and "confirmed at generation 2" in built.stdout, built.stderr

"""A workspace's limits.json: read strictly, applied by every command, and the
way out of a revision whose case only the build finds too large."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

import contracts
from pipeline.errors import VianoError
from pipeline.limits import CaseBuilderLimits
from pipeline.workspace_limits import (
    LIMITS_FILE,
    MAX_LIMITS_BYTES,
    _SECTIONS,
    _plainly_valid,
    read_workspace_limits,
    workspace_limits_from,
)
from pipeline.zipscan import ZipLimits
from tests.conftest import FIXTURES, REPO
from tests.e2e.kit import doit, index, make_append, make_package, manifests, package_dir, report, tree_digest
from tests.test_contracts import any_documents, schema_accepts, valid_documents


def _limits(**sections) -> dict:
    return {"format": "viano-workspace-limits", "format_version": 1, **sections}


def _write(root: Path, value) -> None:
    (root / LIMITS_FILE).write_bytes(value if isinstance(value, bytes) else json.dumps(value).encode())


# -- the contract, the plain check and the dataclasses agree -----------------


def test_the_contract_names_exactly_the_limits_of_both_dataclasses():
    properties = contracts.SCHEMAS["workspace-limits"]["properties"]
    case_builder = {item.name for item in dataclasses.fields(CaseBuilderLimits)}
    admission = {item.name for item in dataclasses.fields(ZipLimits)}
    assert set(properties["case_builder"]["properties"]) == case_builder == set(_SECTIONS["case_builder"])
    assert set(properties["admission"]["properties"]) == admission == set(_SECTIONS["admission"])


def test_the_plain_check_takes_the_contract_s_ranges_and_the_case_builder_s_start_at_the_defaults():
    properties = contracts.SCHEMAS["workspace-limits"]["properties"]
    for section, limits in _SECTIONS.items():
        for name, bounds in limits.items():
            schema = properties[section]["properties"][name]
            if bounds is bool:
                assert schema == {"type": "boolean"}
                continue
            if "$ref" in schema:
                schema = contracts.SCHEMAS["workspace-limits"]["$defs"][schema["$ref"].rsplit("/", 1)[1]]
            assert (schema["minimum"], schema["maximum"]) == bounds, (section, name)
    defaults = CaseBuilderLimits()
    for name, (smallest, _largest) in _SECTIONS["case_builder"].items():
        assert smallest == getattr(defaults, name), name  # raised only, never lowered


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_documents(names=("workspace-limits",)))
def test_the_plain_check_accepts_every_valid_document(case):
    _name, document = case
    assert _plainly_valid(document), document


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_documents(names=("workspace-limits",)))
def test_the_plain_check_accepts_only_what_the_contract_accepts(case):
    _name, document = case
    if _plainly_valid(document):
        assert schema_accepts("workspace-limits", document), document


def test_the_limits_set_are_applied_and_the_rest_keep_their_defaults():
    limits = workspace_limits_from(json.dumps(_limits(
        case_builder={"case_bytes": 16 << 20, "documents": 300},
        admission={"max_entry_bytes": 1 << 30, "check_free_disk": False},
    )).encode())
    assert limits.case_builder == CaseBuilderLimits(case_bytes=16 << 20, documents=300)
    assert limits.admission() == ZipLimits(max_entry_bytes=1 << 30, check_free_disk=False)
    assert limits.changed() == [
        "case_builder.documents=300", "case_builder.case_bytes=16777216",
        "admission.check_free_disk=false", "admission.max_entry_bytes=1073741824",
    ]


def test_no_file_means_the_defaults(tmp_path):
    limits = read_workspace_limits(tmp_path)
    assert not limits.configured
    assert limits.case_builder == CaseBuilderLimits()
    assert limits.admission() == ZipLimits()
    assert read_workspace_limits(tmp_path / "not-yet-made").case_builder == CaseBuilderLimits()


@pytest.mark.parametrize(
    "content,code,pointer",
    [
        (_limits(case_builder={"case_byte": 1}), "SCHEMA_VIOLATION", "/case_builder/case_byte"),  # misspelt: never ignored
        (_limits(case_builder={"case_bytes": 0}), "SCHEMA_VIOLATION", "/case_builder/case_bytes"),
        # The case builder's limits are raised only, and only up to their ceilings.
        (_limits(case_builder={"case_bytes": 1000}), "SCHEMA_VIOLATION", "/case_builder/case_bytes"),
        (_limits(case_builder={"documents": 255}), "SCHEMA_VIOLATION", "/case_builder/documents"),
        (_limits(case_builder={"case_bytes": (64 << 20) + 1}), "SCHEMA_VIOLATION", "/case_builder/case_bytes"),
        (_limits(case_builder={"document_bytes": (2 << 20) + 1}), "SCHEMA_VIOLATION", "/case_builder/document_bytes"),
        (_limits(admission={"max_entries": 65537}), "SCHEMA_VIOLATION", "/admission/max_entries"),
        (_limits(admission={"manifest_bytes": (16 << 20) + 1}), "SCHEMA_VIOLATION", "/admission/manifest_bytes"),
        (_limits(case_builder={"case_bytes": True}), "SCHEMA_VIOLATION", "/case_builder/case_bytes"),
        (_limits(case_builder={"case_bytes": 1.0}), "SCHEMA_VIOLATION", "/case_builder/case_bytes"),
        (_limits(admission={"check_free_disk": 0}), "SCHEMA_VIOLATION", "/admission/check_free_disk"),
        (_limits(research={}), "SCHEMA_VIOLATION", "/research"),
        ({"format": "viano-workspace-limits", "format_version": 2}, "UNSUPPORTED_VERSION", "/format_version"),
        ({"format": "viano-package", "format_version": 1}, "UNSUPPORTED_VERSION", "/format"),
        (b'{"format":"viano-workspace-limits","format_version":1,"case_builder":{"case_bytes":1,"case_bytes":9}}',
         "JSON_DUPLICATE_KEY", "/case_builder/case_bytes"),
        (b'{"format":"viano-workspace-limits","format_version":1,"case_builder":{"case_bytes":9007199254740993}}',
         "JSON_NUMBER", "/case_builder/case_bytes"),
        (b"\xef\xbb\xbf{}", "JSON_ENCODING", None),
        (b"{", "JSON_SYNTAX", None),
    ],
)
def test_a_bad_limits_file_is_refused_with_its_code_and_pointer(tmp_path, content, code, pointer):
    _write(tmp_path, content)
    with pytest.raises(VianoError) as caught:
        read_workspace_limits(tmp_path)
    assert caught.value.code == code
    assert caught.value.path == LIMITS_FILE
    if pointer is not None:
        assert (caught.value.pointer or "") == pointer


def test_an_oversized_limits_file_is_refused_before_it_is_read(tmp_path):
    _write(tmp_path, b" " * (MAX_LIMITS_BYTES + 1))
    with pytest.raises(VianoError) as caught:
        read_workspace_limits(tmp_path)
    assert caught.value.code == "LIMIT_EXCEEDED"


def test_a_symlinked_limits_file_is_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(_limits(case_builder={"case_bytes": 1})))
    root = tmp_path / "ws"
    root.mkdir()
    (root / LIMITS_FILE).symlink_to(elsewhere)
    with pytest.raises(VianoError) as caught:
        read_workspace_limits(root)
    assert caught.value.code == "REFERENCE_UNSAFE"


def test_a_folder_named_limits_json_is_an_io_error(tmp_path):
    (tmp_path / LIMITS_FILE).mkdir()
    with pytest.raises(VianoError) as caught:
        read_workspace_limits(tmp_path)
    assert caught.value.code == "IO_ERROR"


def test_a_fifo_named_limits_json_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / LIMITS_FILE)
    # In a child with a deadline: a read that waited for a writer would hang the suite.
    child = subprocess.run(
        [sys.executable, "-c",
         "import sys; from pipeline.workspace_limits import read_workspace_limits\n"
         "from pipeline.errors import VianoError\n"
         "try:\n    read_workspace_limits(sys.argv[1])\nexcept VianoError as e:\n    print(e.code)\n",
         str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert child.stdout.strip() == "IO_ERROR", child.stderr


# -- every command applies them -----------------------------------------------


def _sample_case(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    assert doit("admit", "case=c1", f"source={FIXTURES / 'sample'}", workspace=ws).returncode == 0
    return ws


def _too_large_case(tmp_path: Path) -> Path:
    """A case only the build finds too large: one report within every input
    limit (~0.95 MiB) whose 75,000 one-letter observations make a ~16 MB case."""
    many = json.dumps(report("many small observations", observations=[{"text": "a"} for _ in range(75_000)]),
                      separators=(",", ":")).encode()
    assert len(many) < 1 << 20
    source = make_package(tmp_path / "pkg", files={"original/reports/many.json": many},
                          index=index(reports=["original/reports/many.json"]))
    ws = tmp_path / "ws"
    assert doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    return ws


def test_a_case_too_large_for_the_default_limit_builds_once_the_workspace_raises_it(tmp_path):
    """The way out of a revision whose case only the build finds too large:
    nothing is published under the default, the start checkpoint stays, and
    the same revision builds once limits.json raises the limits; without the
    file again the confirmed case is reused as it is, and exported and probed
    whole."""
    ws = _too_large_case(tmp_path)
    failed = doit("build", "case=c1", workspace=ws)
    assert failed.returncode != 0
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("LIMIT_EXCEEDED: case.json would be "), last
    assert last.endswith("limit 8388608 (a workspace's limits.json can raise case_builder.case_bytes up to 67108864) "
                         "(case/revisions/0001/case.json)"), last
    assert len(manifests(ws, "c1")) == 1  # nothing published
    assert "state: BUILDING_CASE" in doit("status", "case=c1", workspace=ws).stdout

    _write(ws, _limits(case_builder={"case_bytes": 32 << 20, "summary_bytes": 32 << 20}))
    status = doit("status", "case=c1", workspace=ws)
    assert "limits: limits.json: case_builder.case_bytes=33554432, case_builder.summary_bytes=33554432" in status.stdout
    built = doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    assert "confirmed at generation 2" in built.stdout
    case_json = package_dir(ws, "c1") / "content/case/revisions/0001/case.json"
    assert case_json.stat().st_size > 8 << 20
    published = tree_digest(package_dir(ws, "c1"))

    (ws / LIMITS_FILE).unlink()
    # Back at the defaults, which the confirmed case is over: status agrees
    # with the build that nothing would fail, and that the plan (which holds
    # the limits in force) changed, so assemble and publish run again and
    # publish reuses the confirmed case.
    status = doit("status", "case=c1", workspace=ws)
    assert "would fail:" not in status.stdout, status.stdout
    assert "  assemble: would run: same inputs, but the plan changed" in status.stdout, status.stdout
    assert "  publish: would run: the plan changed; reuses case-build/v1/r1" in status.stdout, status.stdout
    again = doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert "confirmed at generation 2" in again.stdout
    assert ".  assemble\n" in again.stderr and ".  publish\n" in again.stderr, again.stderr
    assert tree_digest(package_dir(ws, "c1")) == published
    status = doit("status", "case=c1", workspace=ws)
    assert "would fail:" not in status.stdout and "would run:" not in status.stdout, status.stdout
    exported = doit("export", "case=c1", f"dest={tmp_path / 'out'}", workspace=ws)
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out" / "case.json").read_bytes() == case_json.read_bytes()
    probes = doit("probes", "case=c1", workspace=ws)
    assert probes.returncode == 0, probes.stderr
    assert '"case_id": "c1:reproduce"' in probes.stdout


def test_a_build_reads_documents_up_to_the_configured_document_bound(tmp_path):
    """read_input takes its bound from the plan, so a raised document limit
    lets a document over the default through every step, not only planning."""
    big = report("big report", observations=[{"text": "x" * 1000} for _ in range(1100)])
    source = make_package(tmp_path / "pkg", files={"original/reports/big.json": big},
                          index=index(reports=["original/reports/big.json"]))
    ws = tmp_path / "ws"
    assert doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    refused = doit("build", "case=c1", workspace=ws)
    assert refused.stderr.strip().splitlines()[-1].startswith("LIMIT_EXCEEDED: document is ")
    _write(ws, _limits(case_builder={"document_bytes": 2 << 20}))
    built = doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    assert "read_input:original/reports/big.json" in built.stderr


def test_append_refuses_by_the_configured_document_count(tmp_path):
    """255 reports and the index are the default's 256 documents: a report
    more is refused unless the workspace raised the count."""
    reports = {f"original/reports/r{i:03d}.json": report(f"r{i}", observations=[{"text": "seen"}]) for i in range(255)}
    source = make_package(tmp_path / "pkg", files=reports, index=index(reports=sorted(reports)))
    ws = tmp_path / "ws"
    assert doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    extra = make_append(tmp_path / "more", files={"original/reports/b.json": report("b", observations=[{"text": "also"}])},
                        index=index(reports=["original/reports/b.json"]))
    before = tree_digest(ws)
    refused = doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("LIMIT_EXCEEDED: after this append the build would read 257 structured documents (limit 256; "
                           "a workspace's limits.json can raise case_builder.documents up to 4096); what earlier"), last
    assert tree_digest(ws) == before
    _write(ws, _limits(case_builder={"documents": 300}))
    appended = doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert appended.returncode == 0, appended.stderr


def test_admission_applies_the_configured_admission_limits(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    _write(ws, _limits(admission={"max_entry_bytes": 1024}))
    refused = doit("admit", "case=c1", f"source={FIXTURES / 'sample'}", workspace=ws)
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1].startswith("LIMIT_EXCEEDED: file is ")
    assert not (ws / "cases").exists()


def _tree(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_a_refused_limits_file_stops_every_command_with_its_code(tmp_path):
    ws = _sample_case(tmp_path)
    _write(ws, _limits(case_builder={"case_byte": 1}))
    before = _tree(ws)
    build = doit("build", "case=c1", workspace=ws)
    assert build.returncode != 0
    assert build.stderr.strip().splitlines()[-1].startswith("SCHEMA_VIOLATION: ")
    assert "(limits.json#/case_builder/case_byte)" in build.stderr
    assert _tree(ws) == before  # not even a dep file for the refused build
    status = doit("status", "case=c1", workspace=ws)
    assert "limits: limits.json is refused" in status.stdout
    assert "validate_index: would fail: SCHEMA_VIOLATION" in status.stdout
    for command in (("admit", "case=c2", f"source={FIXTURES / 'sample'}"), ("reopen", "case=c1", "by=human:t", "reason=r"),
                    ("export", "case=c1", f"dest={tmp_path / 'out'}"), ("probes", "case=c1")):
        refused = doit(*command, workspace=ws)
        assert refused.returncode != 0, command
        assert refused.stderr.strip().splitlines()[-1].startswith("SCHEMA_VIOLATION: "), (command, refused.stderr)


def test_the_python_api_takes_the_workspace_limits_unless_given_its_own(tmp_path):
    from pipeline.build import CaseBuilder
    from pipeline.errors import CaseBuildError
    from pipeline.lifecycle import CheckpointStore
    from pipeline.workspace import Workspace

    ws = _too_large_case(tmp_path)
    _write(ws, _limits(case_builder={"case_bytes": 32 << 20, "summary_bytes": 32 << 20}))
    store = CheckpointStore(Workspace(ws))
    try:
        with pytest.raises(CaseBuildError) as caught:
            CaseBuilder(store, CaseBuilderLimits()).build("c1")
        assert caught.value.code == "LIMIT_EXCEEDED"
        assert CaseBuilder(store).build("c1")["status"] == "published"
    finally:
        store.close()


def test_what_a_revision_inherits_does_not_depend_on_the_limits(tmp_path):
    """An earlier index over the default document limit (superseded by an
    append before any build) names its inputs whatever the limits, so a
    confirmed revision is reused after limits.json is removed again."""
    padded = json.dumps(index(reports=["original/reports/a.json"])).encode()
    padded = padded[:-1] + b" " * 1_500_000 + b"}"
    source = make_package(tmp_path / "pkg", files={"original/reports/a.json": report("a", observations=[{"text": "seen"}]),
                                                   "original/case-inputs.json": padded}, index=None)
    manifest = json.loads((source / "manifest.json").read_text())
    manifest["artifacts"] = {"case_inputs": "original/case-inputs.json"}
    (source / "manifest.json").write_text(json.dumps(manifest))
    extra = make_append(tmp_path / "more", files={"appended/reports/b.json": report("b", observations=[{"text": "also"}])},
                        index=index(reports=["appended/reports/b.json"]))
    ws = tmp_path / "ws"
    assert doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    _write(ws, _limits(case_builder={"document_bytes": 2 << 20}))
    built = doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    case = json.loads((package_dir(ws, "c1") / "content/case/revisions/0001/case.json").read_text())
    assert [ref["path"] for ref in case["inputs"]["reports"]] == ["original/reports/a.json", "appended/reports/b.json"]
    (ws / LIMITS_FILE).unlink()
    status = doit("status", "case=c1", workspace=ws)
    assert "would fail:" not in status.stdout, status.stdout
    again = doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0, again.stderr
    assert "confirmed at generation 3" in again.stdout


def test_an_append_takes_an_index_up_to_the_raised_document_limit(tmp_path):
    ws = _sample_case(tmp_path)
    padded = json.dumps(index(reports=["more/reports/b.json"])).encode()
    padded = padded[:-1] + b" " * 1_500_000 + b"}"
    extra = make_append(tmp_path / "more", files={"more/reports/b.json": report("b", observations=[{"text": "also"}])},
                        index=index(reports=["more/reports/b.json"]))
    (extra / "case-inputs.json").write_bytes(padded)
    refused = doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert refused.stderr.strip().splitlines()[-1].startswith("LIMIT_EXCEEDED: "), refused.stderr
    _write(ws, _limits(case_builder={"document_bytes": 2 << 20}))
    appended = doit("append", "case=c1", f"source={extra}", workspace=ws)
    assert appended.returncode == 0, appended.stderr


def test_the_hint_says_how_far_a_limit_can_be_raised_and_when_it_cannot():
    from pipeline.plan import raise_hint

    assert raise_hint("case_bytes", 8 << 20) == " (a workspace's limits.json can raise case_builder.case_bytes up to 67108864)"
    assert raise_hint("case_bytes", 64 << 20) == " (case_builder.case_bytes is at the most a workspace may set)"
    assert raise_hint("summary_bytes", 16 << 20).endswith("summary_bytes up to 67108864)")


def test_status_foretells_what_a_build_runs_after_the_limits_change_on_a_confirmed_revision(tmp_path):
    """Other limits in force change the plan assemble and publish depend on,
    not the inputs: status says both run, and that publish reuses the
    confirmed case; the build runs just those (no new generation), and then
    status and a further build agree nothing runs."""
    ws = _sample_case(tmp_path)
    assert doit("build", "case=c1", workspace=ws).returncode == 0
    published = tree_digest(package_dir(ws, "c1"))
    _write(ws, _limits(case_builder={"inline_fact_value": 64 << 10}))
    outlook = doit("status", "case=c1", workspace=ws).stdout
    assert ("  assemble: would run: same inputs, but the plan changed since it last ran (other limits in force, "
            "or a build stopped after planning)\n") in outlook, outlook
    assert "  render: up to date, unless assemble makes another case under the limits in force\n" in outlook, outlook
    assert "  publish: would run: the plan changed; reuses case-build/v1/r1, confirmed for these inputs (no new generation)\n" in outlook
    built = doit("build", "case=c1", workspace=ws)
    assert built.returncode == 0, built.stderr
    ran = {line[3:] for line in built.stderr.splitlines() if line.startswith(".  ")}
    assert {"assemble", "publish"} <= ran and "render" not in ran, built.stderr
    assert tree_digest(package_dir(ws, "c1")) == published  # reused: no new generation
    outlook = doit("status", "case=c1", workspace=ws).stdout
    assert "  assemble: up to date\n  render: up to date\n" in outlook, outlook
    assert "  publish: up to date: case-build/v1/r1 confirmed for these inputs" in outlook, outlook
    again = doit("build", "case=c1", workspace=ws)
    assert not {"assemble", "render", "publish"} & {line[3:] for line in again.stderr.splitlines() if line.startswith(".  ")}, again.stderr

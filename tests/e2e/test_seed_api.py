"""Seed 001's own Python example, run as written: its import names included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pipeline.assemble
import pipeline.build
import pipeline.errors
import pipeline.lifecycle
import pipeline.limits
import pipeline.packages
import pipeline.summary
import pipeline.workspace
from tests.e2e import kit

# Seed 001, "Artifact and checkpoint integration", verbatim.
SEED_EXAMPLE = '''
from viano_bug_analysis.case import CaseBuilder, CaseBuildError
from viano_bug_analysis.lifecycle import Workspace, CheckpointStore

store = CheckpointStore(Workspace("service-data"))
try:
    result = CaseBuilder(store).build("case-A", "stable-package")
except CaseBuildError as error:
    print(error.code, error.path, str(error))
'''


def _admit(tmp_path: Path, package_id: str) -> None:
    source = kit.make_package(
        tmp_path / "source", package_id=package_id,
        files={"original/report.json": kit.report("Switch stays off", observations=[{"text": "It stays off"}])},
        index=kit.index(reports=["original/report.json"]),
    )
    admitted = kit.doit("admit", "case=case-A", f"source={source}", workspace=tmp_path / "service-data")
    assert admitted.returncode == 0, admitted.stderr


def _run_seed_example(cwd: Path, epilogue: str = "") -> subprocess.CompletedProcess:
    # From a folder outside the repository: the names come from the installed project.
    return subprocess.run([sys.executable, "-c", SEED_EXAMPLE + epilogue], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_seed_example_builds_the_case_as_written(tmp_path):
    _admit(tmp_path, "stable-package")
    ran = _run_seed_example(tmp_path, "print(result['status'])\n")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[-1] == "published"
    case = tmp_path / "service-data/cases/case-A/packages/stable-package/content/case/revisions/0001/case.json"
    assert json.loads(case.read_text(encoding="utf-8"))["format"] == "viano-case"
    assert _run_seed_example(tmp_path, "print(result['status'])\n").stdout.splitlines()[-1] == "reused"


def test_the_seed_example_catches_a_refusal_with_its_code_and_path(tmp_path):
    _admit(tmp_path, "another-package")
    ran = _run_seed_example(tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("INVALID_ARGUMENT None INVALID_ARGUMENT: case case-A holds package another-package"), ran.stdout


def test_the_seed_names_are_the_pipeline_objects():
    from viano_bug_analysis import case, lifecycle

    assert case.CaseBuilder is pipeline.build.CaseBuilder
    assert case.CaseBuildError is pipeline.errors.CaseBuildError
    assert case.CaseBuilderLimits is pipeline.limits.CaseBuilderLimits
    assert case.CaseAssembler is pipeline.assemble.CaseAssembler
    assert case.render_summary is pipeline.summary.render_summary
    assert lifecycle.CheckpointStore is pipeline.lifecycle.CheckpointStore
    assert lifecycle.Workspace is pipeline.workspace.Workspace
    assert lifecycle.PackageWriter is pipeline.packages.PackageWriter

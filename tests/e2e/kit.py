"""Helpers for end-to-end tests: make bug packages, run the real `doit`."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from tests.conftest import REPO, doit_env


def write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False), encoding="utf-8")


def report(title: str, *, observations=(), comments=(), hypotheses=(), expected=(), complete=None, entities=(), summary=None):
    body = {"format": "viano-bug-report", "format_version": 1, "title": title}
    if summary is not None:
        body["summary"] = summary
    if observations:
        body["observations"] = list(observations)
    if comments:
        body["comments"] = list(comments)
    if hypotheses:
        body["tester_hypotheses"] = list(hypotheses)
    if expected:
        body["expected_behavior"] = list(expected)
    if complete is not None:
        body["expected_behavior_complete"] = complete
    if entities:
        body["entities"] = list(entities)
    return body


def reproduction(*, steps=(), observations=(), facts=(), events_ref=None, attachments=(), entities=()):
    body = {"format": "viano-reproduction", "format_version": 1}
    if steps:
        body["steps"] = list(steps)
    if observations:
        body["observations"] = list(observations)
    if facts:
        body["facts"] = list(facts)
    if events_ref is not None:
        body["events_ref"] = events_ref
    if attachments:
        body["attachments"] = list(attachments)
    if entities:
        body["entities"] = list(entities)
    return body


def make_package(root: Path, *, package_id="pkg-1", files: dict, index: dict | None, index_path="original/case-inputs.json") -> Path:
    """A directory package: manifest.json + files (dict path -> bytes|str|json value)."""
    root.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "viano-package",
        "format_version": 1,
        "package_id": package_id,
        "project": {"name": "demo-project", "version": "2.4.1"},
        "analysis_revision": 1,
    }
    if index is not None:
        manifest["artifacts"] = {"case_inputs": index_path}
        files = {**files, index_path: index}
    write_json(root / "manifest.json", manifest)
    for rel, value in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(value, bytes):
            target.write_bytes(value)
        elif isinstance(value, str):
            target.write_text(value, encoding="utf-8")
        else:
            write_json(target, value)
    return root


def make_append(root: Path, *, files: dict, index: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "case-inputs.json", index)
    for rel, value in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(value, bytes):
            target.write_bytes(value)
        elif isinstance(value, str):
            target.write_text(value, encoding="utf-8")
        else:
            write_json(target, value)
    return root


def zip_dir(source: Path, target: Path, *, reverse=False) -> Path:
    names = sorted(p for p in source.rglob("*") if p.is_file())
    if reverse:
        names.reverse()
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in names:
            archive.write(path, path.relative_to(source).as_posix())
    return target


def index(reports=(), reproductions=(), runtime=(), database=(), source=(), research=(), attachments=(), expected_research=None):
    body = {
        "format": "viano-case-inputs",
        "format_version": 1,
        "reports": list(reports),
        "reproductions": list(reproductions),
        "context": {"runtime": list(runtime), "database": list(database), "source": list(source), "research": list(research)},
        "attachments": list(attachments),
    }
    if expected_research is not None:
        body["expected_research"] = list(expected_research)
    return body


def doit_through(proc: str, *args: str, workspace: Path, timeout=120) -> subprocess.CompletedProcess:
    """The real doit command line run by ``tests/procs/PROC``, a wrapper that
    changes something in the builder first."""
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / "procs" / proc), "-f", str(REPO / "dodo.py"), "-d", str(REPO), *args,
         f"workspace={workspace}"],
        capture_output=True, text=True, env=doit_env(), timeout=timeout,
    )


def doit(*args: str, workspace: Path, env_extra: dict | None = None, timeout=120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run the real doit command from the repository."""
    env = doit_env(**(env_extra or {}))
    return subprocess.run(
        ["doit", "-f", str(REPO / "dodo.py"), "-d", str(cwd), *args, f"workspace={workspace}"],
        capture_output=True, text=True, env=env, timeout=timeout,
    )


def unsealed(record: bytes) -> bytes:
    """A cache record's bytes without its seal (the SHA-256 of them, at its end), which must hold."""
    payload = record[:-32]
    assert hashlib.sha256(payload).digest() == record[-32:], "the record's seal does not hold"
    return payload


def sealed(payload: bytes) -> bytes:
    """``payload`` as the build cache writes a record: with its seal."""
    return payload + hashlib.sha256(payload).digest()


def tree_digest(root: Path, *, skip_cache=True) -> dict:
    """path -> sha256 of every file under root (the workspace fingerprint)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if skip_cache and (rel == ".cache" or rel.startswith(".cache/")):
            continue
        if rel.endswith(("-wal", "-shm")):
            continue
        if path.is_file() and not path.is_symlink():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            out[rel + "/"] = "dir"
    return out


def package_dir(workspace: Path, case_id: str, package_id="pkg-1") -> Path:
    return workspace / "cases" / case_id / "packages" / package_id


def manifests(workspace: Path, case_id: str, package_id="pkg-1") -> list[Path]:
    return sorted((package_dir(workspace, case_id, package_id) / "manifests").glob("[0-9]*.json"))


def stepping_doit(points: str, steps: Path, *args: str, workspace: Path) -> subprocess.Popen:
    """The real doit run through ``tests/procs/doit_stepping.py``: at each of
    the comma-separated crash ``points`` it creates ``steps/<point>.ready``
    and waits for the test to create ``steps/<point>.go``."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "procs" / "doit_stepping.py"), points, str(steps),
         "-f", str(REPO / "dodo.py"), "-d", str(REPO), *args, f"workspace={workspace}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=doit_env(),
    )


def reach_step(child: subprocess.Popen, steps: Path, point: str, timeout: float = 60) -> None:
    """Wait until a :func:`stepping_doit` run stops at ``point``."""
    deadline = time.monotonic() + timeout
    while not (steps / f"{point}.ready").exists():
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.01)


def run_paused_at(point: str, steps: Path, *args: str, workspace: Path, while_paused) -> subprocess.CompletedProcess:
    """A :func:`stepping_doit` run that stops at ``point``, where
    ``while_paused()`` is called, then goes on to its end."""
    child = stepping_doit(point, steps, *args, workspace=workspace)
    try:
        reach_step(child, steps, point)
        while_paused()
        (steps / f"{point}.go").touch()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


@contextlib.contextmanager
def paused_doit(proc: str, proc_args: list[str], ready: Path, *args: str, workspace: Path):
    """The real doit run through ``tests/procs/<proc>`` (which pauses it and
    creates ``ready`` at a point of its own), yielded once it is paused
    there; killed on the way out if the test left it running."""
    child = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "procs" / proc), *proc_args,
         "-f", str(REPO / "dodo.py"), "-d", str(REPO), *args, f"workspace={workspace}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=doit_env(),
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.01)
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


def duplicate_key_append(root: Path) -> Path:
    """An append source adding a report with a duplicate key to standard_package's inventory."""
    return make_append(
        root,
        files={"original/dup.json": '{"format": "viano-bug-report", "format_version": 1, "title": "a", "title": "b"}'},
        index=index(reports=["original/report-a.json", "original/report-b.json", "original/dup.json"],
                    reproductions=["original/repro.json"]),
    )

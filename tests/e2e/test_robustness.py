"""End to end: determinism across machines' settings, crash injection at every
publication step, racing builds, and hostile JSON/reference inputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, REPO, doit_env
from tests.e2e import kit
from tests.e2e.test_build import standard_package


def _outputs(ws: Path) -> dict:
    base = kit.package_dir(ws, "c1")
    return {
        p.relative_to(base).as_posix(): p.read_bytes()
        for p in sorted(base.rglob("*")) if p.is_file()
    }


def test_same_inputs_give_identical_bytes_across_settings_and_input_order(tmp_path):
    source = standard_package(tmp_path / "src")
    archive = kit.zip_dir(source, tmp_path / "pkg.zip", reverse=True)
    runs = [
        (tmp_path / "ws1", source, {"TZ": "UTC", "LC_ALL": "C", "PYTHONHASHSEED": "1"}),
        (tmp_path / "ws2", archive, {"TZ": "Asia/Kolkata", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "4242"}),
    ]
    results = []
    for ws, src, env in runs:
        assert kit.doit("admit", "case=c1", f"source={src}", workspace=ws, env_extra=env).returncode == 0
        built = kit.doit("build", "case=c1", workspace=ws, env_extra=env)
        assert built.returncode == 0, built.stderr
        results.append(_outputs(ws))
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        assert results[0][name] == results[1][name], name
    case = results[0]["content/case/revisions/0001/case.json"]
    assert str(tmp_path).encode() not in case and os.uname().nodename.encode() not in case


CRASH_POINTS = [
    "publish:after-content",
    "publish:after-manifest-temp",
    "publish:after-manifest-link",
    "build:after-publish",
    "build:after-confirm",
]


@pytest.fixture(scope="module")
def reference_outputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    source = standard_package(tmp / "src")
    ws = tmp / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    return _outputs(ws)


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_at_each_publication_step_then_retry_publishes_exactly_once(tmp_path, point, reference_outputs):
    source = standard_package(tmp_path / "src")
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    crashed = kit.doit("build", "case=c1", workspace=ws, env_extra={"VIANO_CRASH_AT": point})
    assert crashed.returncode != 0  # killed by SIGKILL at the named point
    retried = kit.doit("build", "case=c1", workspace=ws)
    assert retried.returncode == 0, retried.stderr
    assert [p.name for p in kit.manifests(ws, "c1")] == ["000001.json", "000002.json"]
    outputs = _outputs(ws)
    leftovers = [name for name in outputs if name not in reference_outputs]
    assert leftovers == [], leftovers  # no temp or partial file remains visible
    assert outputs == reference_outputs
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0 and len(kit.manifests(ws, "c1")) == 2
    status = kit.doit("status", "case=c1", workspace=ws).stdout
    assert status.count(" complete ") == 1, status


def test_two_builds_started_together_publish_once(tmp_path, reference_outputs):
    source = standard_package(tmp_path / "src")
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    env = doit_env()
    command = ["doit", "-f", str(REPO / "dodo.py"), "-d", str(REPO), "build", "case=c1", f"workspace={ws}"]
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=180) + (p.returncode,) for p in procs]
    for out, err, code in results:
        assert code == 0 or err.strip().splitlines()[-1].split(":")[0] in ("LOCK_TIMEOUT", "STALE_GENERATION"), err
    assert any(code == 0 for _, _, code in results)
    assert len(kit.manifests(ws, "c1")) == 2
    assert _outputs(ws) == reference_outputs
    published = [err for _, err, _ in results if ".  publish" in err]
    status = kit.doit("status", "case=c1", workspace=ws).stdout
    assert status.count(" complete ") == 1, status  # exactly one case-built checkpoint
    # the second waits for the case lock, then finds the case confirmed: its
    # publish task is up to date, so exactly one process ran a publication
    assert len(published) == 1, [err for _, err, _ in results]


# ------------------------------------------------------------- hostile JSON

BAD_REPORTS = {
    "dup-nested": (b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"a","text":"b"}]}', "JSON_DUPLICATE_KEY", "/observations/0/text"),
    "dup-escaped": (b'{"format":"viano-bug-report","format_version":1,"title":"a","\\u0074itle":"b"}', "JSON_DUPLICATE_KEY", "/title"),
    "nan": (b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"a","claim":{"key":"k","value":NaN}}]}', "JSON_NUMBER", "/observations/0/claim/value"),
    "inf": (b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"a","claim":{"key":"k","value":1e400}}]}', "JSON_NUMBER", "/observations/0/claim/value"),
    "bigint": (b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"a","claim":{"key":"k","value":9007199254740993}}]}', "JSON_NUMBER", "/observations/0/claim/value"),
    "digits": (b'{"format":"viano-bug-report","format_version":1,"title":' + b"7" * 5000 + b"}", "JSON_NUMBER", "/title"),
    "deep": (b'{"format":"viano-bug-report","format_version":1,"x":' + b"[" * 2000 + b"]" * 2000 + b"}", "JSON_TOO_DEEP", None),
    "bom": (b'\xef\xbb\xbf{"format":"viano-bug-report","format_version":1}', "JSON_ENCODING", None),
    "utf16": ('{"format":"viano-bug-report","format_version":1}'.encode("utf-16-le"), "JSON_ENCODING", None),
    "bad-utf8": (b'{"format":"viano-bug-report","format_version":1,"title":"\xc3\x28"}', "JSON_ENCODING", None),
    "surrogate": (b'{"format":"viano-bug-report","format_version":1,"title":"\\ud800"}', "JSON_ENCODING", "/title"),
    "control": (b'{"format":"viano-bug-report","format_version":1,"title":"a\x01b"}', "JSON_SYNTAX", None),
    "trailing": (b'{"format":"viano-bug-report","format_version":1} {}', "JSON_SYNTAX", None),
    "naive-time": (b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"a","observed_at":"2026-01-01T10:00:00"}]}', "SCHEMA_VIOLATION", "/observations/0/observed_at"),
    "version-float": (b'{"format":"viano-bug-report","format_version":1.5}', "UNSUPPORTED_VERSION", "/format_version"),
    "version-2": (b'{"format":"viano-bug-report","format_version":2}', "UNSUPPORTED_VERSION", "/format_version"),
    "blank-text": (b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"  "}]}', "SCHEMA_VIOLATION", "/observations/0/text"),
    "unknown-nested": (b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"a","mood":"x"}]}', "SCHEMA_VIOLATION", "/observations/0/mood"),
    "oversize": (b'{"format":"viano-bug-report","format_version":1,"title":"' + b"x" * (1024 * 1024) + b'"}', "LIMIT_EXCEEDED", None),
}


def _hostile_package(tmp_path: Path, report_bytes: bytes | None = None, index=None) -> Path:
    files = {
        "original/report-a.json": kit.report("Fine", observations=[{"text": "ok"}]),
        "original/runtime.log": "x\n",
    }
    if report_bytes is not None:
        files["original/bad.json"] = report_bytes
    idx = index if index is not None else kit.index(reports=["original/report-a.json", "original/bad.json"])
    return kit.make_package(tmp_path / "src", files=files, index=idx)


def _assert_refused(tmp_path, source, code, path, pointer):
    ws = tmp_path / "ws"
    admitted = kit.doit("admit", "case=c1", f"source={source}", workspace=ws)
    assert admitted.returncode == 0, admitted.stderr
    before = kit.tree_digest(ws / "cases")
    result = kit.doit("build", "case=c1", workspace=ws)
    assert result.returncode != 0
    lines = [l for l in result.stderr.splitlines() if l.startswith(code + ": ")]
    assert len(lines) == 1, result.stderr
    where = path + (f"#{pointer}" if pointer is not None else "")
    assert lines[0].endswith(f"({where})"), lines[0]
    assert kit.tree_digest(ws / "cases") == before  # every file and manifest byte-identical
    assert len(kit.manifests(ws, "c1")) == 1


@pytest.mark.parametrize("name", sorted(BAD_REPORTS))
def test_hostile_report_is_refused_with_code_path_and_pointer(tmp_path, name):
    data, code, pointer = BAD_REPORTS[name]
    _assert_refused(tmp_path, _hostile_package(tmp_path, data), code, "original/bad.json", pointer)


BAD_REFERENCES = {
    "dotdot": ("../x", "REFERENCE_UNSAFE"),
    "absolute": ("/etc/passwd", "REFERENCE_UNSAFE"),
    "drive": ("C:/x", "REFERENCE_UNSAFE"),
    "backslash": ("original\\\\report-a.json", "REFERENCE_UNSAFE"),
    "empty": ("", "SCHEMA_VIOLATION"),  # the contract requires non-empty paths
    "percent": ("original/%2e%2e/report-a.json", "REFERENCE_MISSING"),
    "absent": ("original/nothing.json", "REFERENCE_MISSING"),
    "case-variant": ("original/Report-A.json", "REFERENCE_MISSING"),
}


@pytest.mark.parametrize("name", sorted(BAD_REFERENCES))
def test_hostile_index_reference_is_refused(tmp_path, name):
    ref, code = BAD_REFERENCES[name]
    idx = kit.index(reports=["original/report-a.json", ref])
    _assert_refused(tmp_path, _hostile_package(tmp_path, None, idx), code, "original/case-inputs.json", "/reports/1")


def test_repeated_source_within_a_role_is_refused(tmp_path):
    idx = kit.index(reports=["original/report-a.json", "original/report-a.json"])
    _assert_refused(tmp_path, _hostile_package(tmp_path, None, idx), "DUPLICATE_SOURCE", "original/case-inputs.json", "/reports/1")


def test_unknown_field_in_index_is_refused(tmp_path):
    idx = kit.index(reports=["original/report-a.json"])
    idx["reviewer"] = "x"
    _assert_refused(tmp_path, _hostile_package(tmp_path, None, idx), "SCHEMA_VIOLATION", "original/case-inputs.json", "/reviewer")


def test_tampered_content_is_an_integrity_error(tmp_path):
    source = _hostile_package(tmp_path, None, kit.index(reports=["original/report-a.json"]))
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    target = kit.package_dir(ws, "c1") / "content" / "original" / "report-a.json"
    target.write_bytes(target.read_bytes().replace(b"ok", b"OK"))
    result = kit.doit("build", "case=c1", workspace=ws)
    assert result.returncode != 0 and "INTEGRITY_ERROR" in result.stderr
    assert len(kit.manifests(ws, "c1")) == 1


def test_symlinked_content_is_refused(tmp_path):
    source = _hostile_package(tmp_path, None, kit.index(reports=["original/report-a.json"]))
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    content = kit.package_dir(ws, "c1") / "content"
    target = content / "original"
    target.rename(content / "moved")
    target.symlink_to(content / "moved")
    result = kit.doit("build", "case=c1", workspace=ws)
    assert result.returncode != 0 and "REFERENCE_UNSAFE" in result.stderr, result.stderr


def _refused_at_planning(tmp_path, source) -> str:
    """Admitted, then refused by the build's first step: the one coded line,
    with every file and manifest byte-identical and nothing published."""
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    before = kit.tree_digest(ws / "cases")
    result = kit.doit("build", "case=c1", workspace=ws)
    lines = [line for line in result.stderr.splitlines() if line.startswith("LIMIT_EXCEEDED: ")]
    assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert kit.tree_digest(ws / "cases") == before
    assert len(kit.manifests(ws, "c1")) == 1
    return lines[0]


def test_24_more_structured_documents_than_the_limit_are_refused_before_parsing(tmp_path):
    """RELIABILITY 24: 256 structured documents at most; the index counts."""
    reports = {f"original/r{i:03d}.json": kit.report(f"R{i}") for i in range(256)}
    source = kit.make_package(tmp_path / "src", files=reports, index=kit.index(reports=sorted(reports)))
    line = _refused_at_planning(tmp_path, source)
    assert "257 structured documents, limit 256 (a workspace's limits.json can raise case_builder.documents up to 4096)" in line, line


def test_24_structured_input_over_the_aggregate_limit_is_refused_before_parsing(tmp_path):
    """RELIABILITY 24: 8 MiB of structured JSON in all, each document within its own 1 MiB."""
    big = "x" * (1000 * 1000)
    reports = {f"original/r{i}.json": kit.report(f"R{i}", summary=big) for i in range(9)}
    source = kit.make_package(tmp_path / "src", files=reports, index=kit.index(reports=sorted(reports)))
    line = _refused_at_planning(tmp_path, source)
    assert "bytes of structured input, limit 8388608 (a workspace's limits.json can raise case_builder.aggregate_bytes up to 67108864)" in line, line


def test_24_a_document_over_its_limit_is_refused_before_parsing_and_says_where_to_raise_it(tmp_path):
    """RELIABILITY 24: 1 MiB a document."""
    reports = {"original/big.json": kit.report("R", summary="x" * (1024 * 1024))}
    source = kit.make_package(tmp_path / "src", files=reports, index=kit.index(reports=sorted(reports)))
    line = _refused_at_planning(tmp_path, source)
    assert line.startswith("LIMIT_EXCEEDED: document is ") and line.endswith(
        ", limit 1048576 (a workspace's limits.json can raise case_builder.document_bytes up to 2097152) (original/big.json)"), line


def test_42_an_input_changed_while_its_task_reads_it_is_an_integrity_error(tmp_path):
    """RELIABILITY 42: a report rewritten in place (same size) after the build
    opened it and before it read it: the bytes read do not match the
    manifest, INTEGRITY_ERROR, nothing published."""
    ws = tmp_path / "ws"
    source = standard_package(tmp_path / "src")
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    target = kit.package_dir(ws, "c1") / "content" / "original" / "report-a.json"
    ready, go = tmp_path / "ready", tmp_path / "go"
    with kit.paused_doit("doit_pausing_open.py", ["original/report-a.json", str(ready), str(go)], ready,
                         "build", "case=c1", workspace=ws) as child:
        data = bytearray(target.read_bytes())
        data[data.index(b"Switch")] = ord("s")  # one byte, same size
        fd = os.open(target, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes(data), 0)
        finally:
            os.close(fd)
        before = kit.tree_digest(ws / "cases")
        go.touch()
        _, stderr = child.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.startswith("INTEGRITY_ERROR: ")]
    assert child.returncode != 0 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].endswith("(original/report-a.json)"), lines[0]
    assert kit.tree_digest(ws / "cases") == before
    assert len(kit.manifests(ws, "c1")) == 1


def test_a_file_system_encoding_other_than_utf8_is_refused_before_anything_changes(tmp_path):
    """Under PYTHONUTF8=0 and the C locale Python names files in ASCII: a
    package's ``café.json`` was refused as not UTF-8 from a directory, and a
    traceback from a ZIP, a build or status (found by session 20's review)."""
    ws = tmp_path / "ws"
    source = kit.make_package(
        tmp_path / "src",
        files={"original/café.json": kit.report("Café", observations=[{"text": "It stays off"}])},
        index=kit.index(reports=["original/café.json"]),
    )
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    before = kit.tree_digest(ws, skip_cache=False)
    ascii_names = {"LC_ALL": "C", "PYTHONUTF8": "0"}
    commands = [
        ("admit", "case=c2", f"source={source}"),
        ("build", "case=c1"),
        ("status", "case=c1"),
        ("append", "case=c1", f"source={tmp_path / 'src'}"),
        ("export", "case=c1", f"dest={tmp_path / 'out'}"),
        # doit's own commands: they ran on a dep file in memory and said they
        # had ignored or forgotten (found by session 20's re-review).
        ("ignore", "read_input", "case=c1"),
        ("forget", "assemble", "case=c1"),
    ]
    for command in commands:
        refused = kit.doit(*command, workspace=ws, env_extra=ascii_names)
        assert refused.returncode == 3, (command, refused.stderr)
        assert refused.stderr.splitlines() == [
            "UNSUPPORTED_ENVIRONMENT: Python's file-system encoding is ascii, not UTF-8: "
            "run under a UTF-8 locale, or set PYTHONUTF8=1"
        ], (command, refused.stderr)
        assert refused.stdout == ""
    assert kit.tree_digest(ws, skip_cache=False) == before
    assert not (tmp_path / "out").exists()
    api = subprocess.run(
        ["python", "-c", "from pipeline.workspace import Workspace\n"
         "try:\n    Workspace('service-data')\nexcept Exception as error:\n    print(error.code)"],
        cwd=REPO, capture_output=True, text=True, env=doit_env(**ascii_names), timeout=60,
    )
    assert api.stdout == "UNSUPPORTED_ENVIRONMENT\n", api.stderr
    # Under the C locale alone Python uses UTF-8 itself: the build goes on.
    assert kit.doit("build", "case=c1", workspace=ws, env_extra={"LC_ALL": "C"}).returncode == 0


@pytest.mark.parametrize(
    "files",
    [
        {"case/x.txt": b"1", "inputs/y.txt": b"2"},  # two reserved paths
        {"original/a\u200b.txt": b"1", "original/b\u200c.txt": b"2"},  # two unsafe names
        {"original/A.txt": b"1", "original/a.txt": b"2", "original/B.txt": b"3", "original/b.txt": b"4"},  # two collisions
    ],
)
def test_a_zip_is_refused_for_the_same_problem_whatever_the_order_of_its_entries(tmp_path, files):
    """Found by session 20's determinism review: the first problem in the
    archive's own order was named, so the same files gave other refusals."""
    import zipfile

    source = kit.make_package(tmp_path / "src", files={**files, "original/r.json": kit.report("t")},
                              index=kit.index(reports=["original/r.json"]))
    names = sorted(path.relative_to(source).as_posix() for path in source.rglob("*") if path.is_file())
    refusals = set()
    for tag, order in (("forward", names), ("reverse", names[::-1])):
        archive = tmp_path / f"{tag}.zip"
        with zipfile.ZipFile(archive, "w") as writing:
            for name in order:
                writing.write(source / name, name)
        refused = kit.doit("admit", "case=c1", f"source={archive}", workspace=tmp_path / f"ws-{tag}")
        assert refused.returncode == 1, refused.stderr
        refusals.add(refused.stderr.replace(str(archive), "ARCHIVE"))
    assert len(refusals) == 1, refusals


_PEAK_RSS_OF_A_CHILD = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "sys.stderr.write(done.stderr)\n"
    "sys.stdout.write(done.stdout)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"  # KiB, of that one child
    "sys.exit(done.returncode)\n"
)


def _with_peak_rss(*args: str, workspace: Path) -> tuple[subprocess.CompletedProcess, int]:
    """A doit command run from a parent of its own, and its peak RSS in KiB
    (the last line that parent prints)."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS_OF_A_CHILD, "doit", "-f", str(REPO / "dodo.py"), *args, f"workspace={workspace}"],
        capture_output=True, text=True, env=doit_env(), timeout=300,
    )
    return done, int(done.stdout.split()[-1])


def _admitted_at_a_long_path(tmp_path: Path, document: dict, role: str, **files) -> tuple[Path, str]:
    """A package whose one document sits at a ~3.8 KB content path (16 parts,
    within what names may be), admitted: (workspace, that path)."""
    long_path = "/".join(["d" * 250] * 15) + "/document.json"
    source = kit.make_package(tmp_path / "src", files={long_path: document, **files}, index=kit.index(**{role: [long_path]}))
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    return ws, long_path


@pytest.mark.parametrize("role, document, files, refusal", [
    # One 0.4 MiB report attaching one file 30,000 times: each attachment
    # repeats the ~3.8 KB path in case.json, ~115 MB in all, made and encoded
    # whole (a checked copy left in the cache) before the 8 MiB limit was
    # checked: ~0.6 GB of memory, 4.8 GB for 1 MiB.
    ("reports", {"format": "viano-bug-report", "format_version": 1, "title": "t", "attachments": ["original/a"] * 30_000},
     {"original/a": b"x"}, "case.json would be at least ... (case/revisions/0001/case.json)"),
    # case.json names a reproduction's source once, the summary beside every
    # step: 30,000 one-letter steps make a 1.5 MB case and a ~115 MB summary
    # (95,000 steps: 1.5 GB of memory).
    ("reproductions", {"format": "viano-reproduction", "format_version": 1, "steps": ["x"] * 30_000},
     {}, "summary would be at least ... (case/revisions/0001/case_summary.md)"),
], ids=["case", "summary"])
def test_an_output_many_times_over_its_limit_is_refused_while_it_is_made(tmp_path, role, document, files, refusal):
    ws, _ = _admitted_at_a_long_path(tmp_path, document, role, **files)
    built, peak_kib = _with_peak_rss("build", "case=c1", workspace=ws)
    assert built.returncode == 1, built.stderr
    last = built.stderr.strip().splitlines()[-1]
    head, tail = refusal.split(" ... ")
    assert last.startswith(f"LIMIT_EXCEEDED: {head} ") and last.endswith(f" {tail}"), last
    assert peak_kib < 250 * 1024
    assert max(p.stat().st_size for p in (ws / ".cache").rglob("*") if p.is_file()) < 8 << 20  # nothing over the limit kept


def test_an_append_that_takes_the_case_over_its_limit_is_refused_as_a_whole_build_refuses_it(tmp_path):
    """The spliced rebuild named the exact size of the spliced case, the
    whole build a lower bound: one refusal, two lines. Now the whole
    assembly judges a spliced case over the limit."""
    def long_report(name: str, observations: int) -> tuple[str, dict]:
        path = "/".join([name[0] * 250] * 15) + f"/{name}.json"
        return path, {"format": "viano-bug-report", "format_version": 1, "title": "t", "observations": [{"text": "x"}] * observations}

    first, first_doc = long_report("alpha", 1900)  # a case of ~7.5 MB
    source = kit.make_package(tmp_path / "src", files={first: first_doc}, index=kit.index(reports=[first]))
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    second, second_doc = long_report("beta", 400)
    extra = kit.make_append(tmp_path / "more", files={second: second_doc}, index=kit.index(reports=[second]))
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    whole = tmp_path / "whole"
    shutil.copytree(ws, whole, symlinks=True)
    shutil.rmtree(whole / ".cache")
    spliced_build, whole_build = (kit.doit("build", "case=c1", workspace=w) for w in (ws, whole))
    assert spliced_build.returncode == whole_build.returncode == 1
    line = spliced_build.stderr.strip().splitlines()[-1]
    assert line.startswith("LIMIT_EXCEEDED: case.json would be ") and line.endswith("(case/revisions/0002/case.json)"), line
    assert line == whole_build.stderr.strip().splitlines()[-1]


def test_status_after_a_summary_refused_for_its_size_renders_no_more_than_the_cached_one(tmp_path):
    """A refused render leaves the previous build's summary cached; status
    compared it with a whole render of the new case every time (95,000
    steps: 1.5 GB of memory per status). A render sure to be longer than the
    cached summary is not it, and stops there."""
    ws, long_path = _admitted_at_a_long_path(tmp_path, {"format": "viano-reproduction", "format_version": 1, "steps": ["x"] * 10},
                                             "reproductions")
    assert kit.doit("build", "case=c1", workspace=ws).returncode == 0
    assert kit.doit("reopen", "case=c1", "by=human:a", "reason=more", workspace=ws).returncode == 0
    more = long_path.replace("document.json", "repro-2.json")
    extra = kit.make_append(tmp_path / "more", files={more: {"format": "viano-reproduction", "format_version": 1, "steps": ["x"] * 30_000}},
                            index=kit.index(reproductions=[more]))
    assert kit.doit("append", "case=c1", f"source={extra}", workspace=ws).returncode == 0
    refused = kit.doit("build", "case=c1", workspace=ws)
    assert "LIMIT_EXCEEDED: summary would be at least " in refused.stderr.strip().splitlines()[-1], refused.stderr
    status, peak_kib = _with_peak_rss("status", "case=c1", workspace=ws)
    assert status.returncode == 0, status.stderr
    assert "  render: would run: " in status.stdout, status.stdout
    assert peak_kib < 150 * 1024


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_standard_output_that_cannot_encode_a_name_gets_it_escaped(tmp_path, encoding):
    """Under PYTHONIOENCODING=ascii (or latin-1, as some CI runners have) a
    non-ASCII workspace path or file name in status or export output was a
    UnicodeEncodeError traceback with exit 2, after export had written
    everything (session 24's CI review). Escaped as on standard error."""
    source = kit.make_package(
        tmp_path / "pkg",
        files={"original/report.json": kit.report("t", observations=[{"text": "seen"}]), "original/logs/café ✓.log": "x\n"},
        index=kit.index(reports=["original/report.json"], runtime=["original/logs/café ✓.log"]),
    )
    ws = tmp_path / "wörk ✓"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    for command in (["build", "case=c1"], ["status", "case=c1"], ["export", "case=c1", f"dest={tmp_path / 'öut'}"],
                    ["probes", "case=c1"]):
        result = subprocess.run(
            ["doit", "-f", str(REPO / "dodo.py"), "-d", str(REPO), *command, f"workspace={ws}"],
            capture_output=True, env=doit_env(PYTHONIOENCODING=encoding), timeout=120,
        )
        stdout, stderr = result.stdout.decode(encoding), result.stderr.decode(encoding)
        assert result.returncode == 0, (command, stdout, stderr)
        assert "Traceback" not in stderr and "UnicodeEncodeError" not in stderr, stderr
        if command[0] == "status":
            assert "caf\\xe9 \\u2713.log" in stdout or "café \\u2713.log" in stdout, stdout
    assert {"case.json", "case_summary.md"} <= {p.name for p in (tmp_path / "öut").iterdir()}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_standard_output_that_cannot_be_written_is_named_and_the_work_stands(tmp_path):
    """A CI log on a full disk: the admission, build and export were done,
    but each said only `IO_ERROR: No space left on device`, as if it had
    failed; without PYTHONUNBUFFERED the exit status was 120 and two
    "Exception ignored" lines followed the coded one (session 24's CI review)."""
    source = standard_package(tmp_path / "pkg")
    ws = tmp_path / "ws"
    env = doit_env()
    env.pop("PYTHONUNBUFFERED", None)

    def run(*command):
        with open("/dev/full", "w") as full:
            return subprocess.run(["doit", "-f", str(REPO / "dodo.py"), "-d", str(REPO), *command, f"workspace={ws}"],
                                  stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=120)

    dest = tmp_path / "out"
    for command in (["admit", "case=c1", f"source={source}"], ["build", "case=c1"], ["export", "case=c1", f"dest={dest}"],
                    ["status", "case=c1"], ["probes", "case=c1"]):
        result = run(*command)
        assert result.returncode == 1, (command, result.returncode, result.stderr)
        assert result.stderr.splitlines()[-1] == ("IO_ERROR: the standard output could not be written (No space left on "
                                                 "device); what the command had done by then stands"), result.stderr
        assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(kit.manifests(ws, "c1")) == 2
    assert {"case.json", "case_summary.md"} <= {p.name for p in dest.iterdir()}


def test_a_build_whose_standard_error_reader_went_away_still_builds(tmp_path):
    """`doit build 2>&1 >log | tool` with the tool gone: the build stopped at
    its first step line, exit 1, nothing published and nothing said (session
    24's CI review). Its lines are only progress: the build goes on."""
    source = standard_package(tmp_path / "pkg")
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    read_end, write_end = os.pipe()
    os.close(read_end)  # before the child starts: every write to its stderr is EPIPE
    try:
        result = subprocess.run(["doit", "-f", str(REPO / "dodo.py"), "-d", str(REPO), "build", "case=c1", f"workspace={ws}"],
                                stdout=subprocess.PIPE, stderr=write_end, text=True, env=doit_env(), timeout=120)
    finally:
        os.close(write_end)
    assert result.returncode == 0
    assert "confirmed at generation 2" in result.stdout
    assert len(kit.manifests(ws, "c1")) == 2


@pytest.mark.parametrize("package, body, named", [
    ("pipeline", "# another project's\n", "pipeline/__init__.py"),
    ("contracts", "# another project's\n", "contracts/__init__.py"),
    ("contracts", "raise ImportError(\"cannot import name 'ArgSpec'\")\n", "ImportError: cannot import name 'ArgSpec'"),  # PyContracts
    ("pipeline", None, "a folder without __init__.py"),
])
def test_a_package_shadowing_the_builders_is_one_coded_line(tmp_path, package, body, named):
    """dodo.py copied into a repository that has a `pipeline` (or
    `contracts`) package of its own, which doit puts first on sys.path: a
    ModuleNotFoundError traceback with exit 3 (session 24's CI review); also
    one that fails as it loads, as PyContracts does on Python 3.11."""
    folder = tmp_path / "repo"
    (folder / package).mkdir(parents=True)
    if body is not None:
        (folder / package / "__init__.py").write_text(body)
    shutil.copy(REPO / "dodo.py", folder / "dodo.py")
    command = ["doit", "-f", str(folder / "dodo.py"), "status", "case=c1", f"workspace={tmp_path / 'ws'}"]
    result = subprocess.run(command, capture_output=True, text=True, env=doit_env(), timeout=120, cwd=folder)
    assert result.returncode == 3, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("UNSUPPORTED_ENVIRONMENT: the builder's packages are shadowed by others of "
                                                   f"the same name ("), lines
    assert named in lines[0], lines[0]
    closed = subprocess.run(command, stdout=subprocess.DEVNULL, env=doit_env(), timeout=120, cwd=folder,
                            preexec_fn=lambda: os.close(2))
    assert closed.returncode == 3  # with standard error closed too
    assert not (tmp_path / "ws").exists()


def test_a_build_started_with_standard_error_closed_still_builds(tmp_path):
    """`doit build 2>&-`: Python leaves sys.stderr None, and doit's reporter
    failed on it; the build exited 1 at its first step, publishing nothing
    and saying nothing (session 24's README audit)."""
    source = standard_package(tmp_path / "pkg")
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    command = ["doit", "-f", str(REPO / "dodo.py"), "-d", str(REPO), "build", "case=c1", f"workspace={ws}"]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=doit_env(), timeout=120,
                            preexec_fn=lambda: os.close(2))
    assert result.returncode == 0
    assert "confirmed at generation 2" in result.stdout
    assert len(kit.manifests(ws, "c1")) == 2
    refused = subprocess.run([*command[:-2], "status", "case=nosuch", f"workspace={ws}"], stdout=subprocess.PIPE,
                             env=doit_env(), timeout=120, preexec_fn=lambda: os.close(2))
    assert refused.returncode == 1  # the coded line has nowhere to go; the status stays


_API_BUILD_UNDER_A_CAP = """
import resource, sys
import pipeline.build as build
from pipeline.build import CaseBuilder
from pipeline.errors import CaseBuildError
from pipeline.lifecycle import CheckpointStore
from pipeline.workspace import Workspace

assemble = build.step_assemble

def capped_assemble(*args, **kwargs):
    with open("/proc/self/status") as status:
        cap = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return assemble(*args, **kwargs)

build.step_assemble = capped_assemble
store = CheckpointStore(Workspace(sys.argv[1]))
try:
    CaseBuilder(store, progress=lambda line: None).build("c1")
except CaseBuildError as error:
    print(error.code, error.message)
finally:
    store.close()
"""


def test_the_python_api_raises_out_of_memory_as_a_case_build_error(tmp_path):
    """Seed 001's API catches CaseBuildError; under a memory cap a host program
    got a bare MemoryError (session 30's README review)."""
    observations = [{"text": f"Observation {n} " + "word " * 30} for n in range(5000)]
    source = kit.make_package(tmp_path / "src", files={"original/report-a.json": kit.report("Big", observations=observations)},
                              index=kit.index(reports=["original/report-a.json"]))
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    capped = subprocess.run([sys.executable, "-c", _API_BUILD_UNDER_A_CAP, str(ws)], capture_output=True, text=True,
                            env=doit_env(), cwd=REPO, timeout=120)
    assert capped.returncode == 0, capped.stderr
    assert capped.stdout.startswith("OUT_OF_MEMORY the build ran out of memory"), (capped.stdout, capped.stderr)
    assert len(kit.manifests(ws, "c1")) == 1


def test_a_build_that_runs_out_of_memory_says_so_in_one_coded_line_and_publishes_nothing(tmp_path):
    """Under a memory cap (ulimit -v, a container's limit) a command ended in
    Python's MemoryError traceback (session 25's review of a long-lived
    case). The cap here is set as assemble starts (tests/procs), so the
    step's real allocations meet it."""
    observations = [{"text": f"Observation {n} " + "word " * 30} for n in range(5000)]
    source = kit.make_package(tmp_path / "src", files={"original/report-a.json": kit.report("Big", observations=observations)},
                              index=kit.index(reports=["original/report-a.json"]))
    ws = tmp_path / "ws"
    assert kit.doit("admit", "case=c1", f"source={source}", workspace=ws).returncode == 0
    capped = kit.doit_through("doit_out_of_memory.py", "build", "case=c1", workspace=ws)
    assert capped.returncode == 1, capped.stderr
    assert capped.stderr.splitlines()[-1] == (
        "OUT_OF_MEMORY: the command ran out of memory; what it had published stands and nothing is left half-written: "
        "run it again with more memory (a higher ulimit -v or container limit)"), capped.stderr
    assert "Traceback" not in capped.stderr and ".  assemble" in capped.stderr
    assert len(kit.manifests(ws, "c1")) == 1
    again = kit.doit("build", "case=c1", workspace=ws)
    assert again.returncode == 0 and "confirmed at generation 2" in again.stdout, again.stderr


def test_the_python_api_codes_arguments_no_file_can_be_made_of(tmp_path):
    """Bare ValueError, OSError, TypeError and AttributeError came out of the
    API for these (session 30's review); each is INVALID_ARGUMENT or IO_ERROR,
    and nothing is made on disk."""
    from pipeline.build import CaseBuilder
    from pipeline.errors import VianoError
    from pipeline.intake import admit
    from pipeline.lifecycle import CheckpointStore
    from pipeline.workspace import Workspace

    def code_of(call) -> str:
        with pytest.raises(VianoError) as refused:
            call()
        return refused.value.code

    assert code_of(lambda: Workspace(str(tmp_path / "a\x00b"))) == "INVALID_ARGUMENT"
    assert code_of(lambda: CheckpointStore(Workspace(str(tmp_path / ("a" * 300))))) == "IO_ERROR"
    assert code_of(lambda: CheckpointStore(Workspace(str(tmp_path / ("a" * 300))), create=False)) == "IO_ERROR"
    source = FIXTURES / "sample"
    ws = tmp_path / "ws"
    assert code_of(lambda: admit(str(tmp_path / "w\x00s"), "c1", source)) == "INVALID_ARGUMENT"
    assert code_of(lambda: admit(ws, "c1", str(source) + "\x00")) == "INVALID_ARGUMENT"
    assert code_of(lambda: admit(ws, "c1", source, progress=1)) == "INVALID_ARGUMENT"
    assert code_of(lambda: admit(ws, "c1", source, limits={})) == "INVALID_ARGUMENT"
    assert not ws.exists()
    admit(ws, "c1", source, progress=lambda *line: None)
    store = CheckpointStore(Workspace(ws))
    try:
        assert code_of(lambda: CaseBuilder(store).build(123)) == "INVALID_ARGUMENT"
        assert code_of(lambda: CaseBuilder(store).build(None)) == "INVALID_ARGUMENT"
        assert code_of(lambda: CaseBuilder(store).build("c1", 7)) == "INVALID_ARGUMENT"
    finally:
        store.close()
    assert len(kit.manifests(ws, "c1", package_id=json.loads((source / "manifest.json").read_text())["package_id"])) == 1


def test_the_python_api_refuses_an_unknown_case_before_making_its_lock_file(tmp_path):
    """A host given arbitrary ids left one lock file per id in .locks/, and a
    build through a store whose workspace was removed made the workspace
    folder again (session 30's review of the API)."""
    import shutil as shutil_

    from pipeline.build import CaseBuilder
    from pipeline.errors import CaseBuildError
    from pipeline.intake import admit
    from pipeline.lifecycle import CheckpointStore
    from pipeline.workspace import Workspace

    ws = tmp_path / "ws"
    admit(ws, "c1", FIXTURES / "sample", progress=lambda *line: None)
    store = CheckpointStore(Workspace(ws))
    try:
        locks = sorted(path.name for path in (ws / ".locks").iterdir())
        for n in range(20):
            with pytest.raises(CaseBuildError) as refused:
                CaseBuilder(store, progress=lambda line: None).build(f"nosuch-{n}")
            assert refused.value.code == "UNKNOWN_CASE"
        assert sorted(path.name for path in (ws / ".locks").iterdir()) == locks
        shutil_.rmtree(ws)
        with pytest.raises(CaseBuildError) as refused:
            CaseBuilder(store, progress=lambda line: None).build("c1")
        assert refused.value.code == "UNKNOWN_CASE"
        assert not ws.exists()
    finally:
        store.close()

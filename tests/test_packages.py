"""Tests for pipeline.packages: generations, verified reads, durable and racing publication."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from pipeline.errors import VianoError
from pipeline.jsoncanon import pretty_bytes
from pipeline.packages import (
    Package,
    PackageWriter,
    StagedFile,
    copy_durable,
    is_temp_name,
    write_durable,
)
from pipeline.workspace import Workspace

PROCS = Path(__file__).parent / "procs"
PROJECT = {"name": "demo", "version": "1.0"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshot(root: Path) -> dict[str, bytes]:
    """Every regular file under ``root`` with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
    }


def temps(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if is_temp_name(p.name)]


@pytest.fixture
def ws(tmp_path) -> Workspace:
    return Workspace(tmp_path / "ws")


@pytest.fixture
def pkg(ws) -> Package:
    """A package at generation 1 holding original/report.data."""
    package = Package(ws, "case-1", "pkg-1")
    PackageWriter(package).publish(
        0, {"original/report.data": b"report v1\n"}, project=PROJECT, analysis_revision=1
    )
    return package


# ---------------------------------------------------------------- publishing


def test_generation_one_and_two(pkg):
    assert pkg.current_generation() == 1
    m1 = pkg.manifest()
    assert m1 == {
        "format": "viano-package",
        "format_version": 1,
        "case_id": "case-1",
        "package_id": "pkg-1",
        "package_generation": 1,
        "analysis_revision": 1,
        "project": PROJECT,
        "artifacts": {},
        "files": {"original/report.data": {"sha256": sha(b"report v1\n"), "size": 10}},
    }
    index = b'{"format": "viano-case-inputs"}\n'
    m2 = PackageWriter(pkg).publish(1, {"inputs/2/case-inputs.json": index}, artifacts={"case_inputs": "inputs/2/case-inputs.json"})
    assert m2["package_generation"] == 2 and pkg.current_generation() == 2
    assert m2["files"]["original/report.data"] == m1["files"]["original/report.data"]
    assert m2["artifacts"] == {"case_inputs": "inputs/2/case-inputs.json"}
    assert m2["analysis_revision"] == 1
    assert (pkg.manifests_dir / "000001.json").read_bytes() == pretty_bytes(m1)
    assert (pkg.manifests_dir / "000002.json").read_bytes() == pretty_bytes(m2)
    assert pkg.manifest(1) == m1 and pkg.manifest() == m2
    assert pkg.read_verified("inputs/2/case-inputs.json", 1024) == index
    assert sorted(os.listdir(pkg.manifests_dir)) == ["000001.json", "000002.json"]
    assert temps(pkg.dir) == []


def test_manifest_is_a_copy(pkg):
    pkg.manifest()["files"].clear()
    assert pkg.manifest()["files"]


def _record_syncs_and_links(monkeypatch, *, fail: tuple[str, str] | None = None) -> list[tuple[str, str]]:
    """Record each ``os.fsync`` (the path of its descriptor) and ``os.link``
    (the new name), in order. ``fail``: (``"link"`` or ``"mkdir"``, name) fails
    that call once with ENOSPC, as a full disk would."""
    events: list[tuple[str, str]] = []
    failing = {fail} if fail else set()
    real = {name: getattr(os, name) for name in ("fsync", "link", "mkdir")}

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real["fsync"](fd)

    def link(src, dst, *args, **kwargs):
        if ("link", dst) in failing:
            failing.discard(("link", dst))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        events.append(("link", dst))
        return real["link"](src, dst, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if ("mkdir", path) in failing:
            failing.discard(("mkdir", path))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real["mkdir"](path, *args, **kwargs)

    for name, replacement in (("fsync", fsync), ("link", link), ("mkdir", mkdir)):
        monkeypatch.setattr(os, name, replacement)
    return events


def test_manifest_without_a_copy_is_the_kept_one_and_a_copy_is_not(pkg):
    kept = pkg.manifest(1, copy=False)
    assert pkg.manifest(1, copy=False) is kept
    copied = pkg.manifest(1)
    assert copied == kept and copied is not kept and copied["files"] is not kept["files"]


def test_files_into_one_folder_are_each_fsynced_before_their_link_and_the_folder_once_before_the_manifest(pkg, monkeypatch):
    """Three outputs into one new folder (what a build publishes): each file is
    durable before its name appears, the folder once after its last name and
    before the manifest that names them, and the new folder's parent too."""
    events = _record_syncs_and_links(monkeypatch)
    files = {f"case/revisions/0002/{name}": name.encode() * 100 for name in ("case.json", "case_summary.md", "case-built.json")}
    PackageWriter(pkg).publish(1, files)
    folder = os.fspath(pkg.content_dir / "case/revisions/0002")
    folder_syncs = [i for i, event in enumerate(events) if event == ("fsync", folder)]
    links = [i for i, event in enumerate(events) if event[0] == "link" and event[1] in {"case.json", "case_summary.md", "case-built.json"}]
    manifest_link = next(i for i, event in enumerate(events) if event == ("link", "000002.json"))
    assert len(folder_syncs) == 1 and len(links) == 3
    assert max(links) < folder_syncs[0] < manifest_link
    # Each temp fsynced before its own link: see the side-by-side test below.
    assert sum(1 for kind, path in events[: max(links)] if kind == "fsync" and os.path.dirname(path) == folder) == 3
    assert ("fsync", os.fspath(pkg.content_dir / "case/revisions")) in events[: manifest_link]
    assert snapshot(pkg.content_dir / "case/revisions/0002") == {name.rpartition("/")[2]: data for name, data in files.items()}



def test_a_builds_outputs_are_fsynced_side_by_side_each_before_its_own_link(pkg, monkeypatch):
    """The three outputs' fsyncs overlap (each file in a thread of its own):
    one after the other they cost a journal commit each. Still, each temp is
    fsynced before it is linked under its name, and the folder after every
    link; an interrupt or a failure comes out only once every thread is done."""
    import threading

    real_fsync, real_link = os.fsync, os.link
    synced_by: dict[str, int] = {}
    linked: dict[str, str] = {}
    order: list[str] = []

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        real_fsync(fd)
        synced_by[path] = threading.get_ident()
        order.append(path)

    def link(src, dst, *args, **kwargs):
        folder = os.readlink(f"/proc/self/fd/{kwargs['src_dir_fd']}") if kwargs.get("src_dir_fd") is not None else ""
        assert os.path.join(folder, src) in synced_by, f"{dst} linked before its temp was fsynced"
        linked[dst] = os.path.join(folder, src)
        order.append(f"link {dst}")
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    names = ("case.json", "case_summary.md", "case-built.json")
    files = {f"case/revisions/0002/{name}": name.encode() * 1000 for name in names}
    PackageWriter(pkg).publish(1, files)
    folder = os.fspath(pkg.content_dir / "case/revisions/0002")
    assert len({synced_by[linked[name]] for name in names}) == 3  # three threads
    assert max(order.index(f"link {name}") for name in names) < order.index(folder) < order.index("link 000002.json")
    assert snapshot(pkg.content_dir / "case/revisions/0002") == {name.rpartition("/")[2]: data for name, data in files.items()}

    # A failing write of one of them: its error, after the others finished.
    def failing_link(src, dst, *args, **kwargs):
        if dst == "case_summary.md":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", failing_link)
    more = {f"case/revisions/0003/{name}": name.encode() * 10 for name in names}
    with pytest.raises(VianoError) as failed:
        PackageWriter(pkg).publish(2, more)
    assert failed.value.code in {"IO_ERROR", "INSUFFICIENT_DISK"} and failed.value.path == "case/revisions/0003/case_summary.md"
    assert threading.active_count() == 1
    assert not [name for name in os.listdir(pkg.content_dir / "case/revisions/0003") if name.startswith(".tmp-")]
    monkeypatch.setattr(os, "link", real_link)
    assert PackageWriter(pkg).publish(2, more)["package_generation"] == 3

def test_a_retry_after_a_failed_publication_makes_what_it_left_durable_before_the_manifest(pkg, monkeypatch):
    """The first attempt fails on its second file after linking the first
    (the disk full): nothing it made was fsynced past that file. The retry
    adopts what it left, and fsyncs the folder and every folder above it
    before the manifest names them."""
    events = _record_syncs_and_links(monkeypatch, fail=("link", "case_summary.md"))
    files = {f"case/revisions/0002/{name}": name.encode() * 100 for name in ("case.json", "case_summary.md")}
    with pytest.raises(VianoError) as failed:
        PackageWriter(pkg).publish(1, files)
    assert failed.value.code in {"IO_ERROR", "INSUFFICIENT_DISK"}
    events.clear()
    PackageWriter(pkg).publish(1, files)
    manifest_link = events.index(("link", "000002.json"))
    synced = {path for kind, path in events[:manifest_link] if kind == "fsync"}
    content = pkg.content_dir
    for folder in ("case/revisions/0002", "case/revisions", "case", ""):
        assert os.path.normpath(os.fspath(content / folder)) in synced, folder
    assert pkg.manifest()["files"]["case/revisions/0002/case.json"]["size"] == len(files["case/revisions/0002/case.json"])


def test_a_retry_after_a_folder_could_not_be_made_makes_the_folders_above_it_durable(pkg, monkeypatch):
    """The first attempt made ``case`` and ``case/revisions`` and failed at
    ``0002`` (the disk full): a coded error, and the folders it made were
    never fsynced. The retry makes only ``0002``, and still fsyncs every
    folder above it that no manifest names anything in before the manifest."""
    events = _record_syncs_and_links(monkeypatch, fail=("mkdir", "0002"))
    files = {"case/revisions/0002/case.json": b"{}"}
    with pytest.raises(VianoError) as failed:
        PackageWriter(pkg).publish(1, files)
    assert failed.value.code in {"IO_ERROR", "INSUFFICIENT_DISK"}
    events.clear()
    manifest = PackageWriter(pkg).publish(1, files)
    assert manifest["package_generation"] == 2
    synced = {path for kind, path in events if kind == "fsync"}
    for folder in ("case/revisions/0002", "case/revisions", "case", ""):
        assert os.path.normpath(os.fspath(pkg.content_dir / folder)) in synced, folder


def test_stale_expected_generation_writes_nothing(pkg):
    before = snapshot(pkg.dir)
    for expected in (0, 2, 5):
        with pytest.raises(VianoError) as info:
            PackageWriter(pkg).publish(expected, {"new.txt": b"x"}, project=PROJECT if expected == 0 else None, analysis_revision=1)
        assert info.value.code == "GENERATION_CONFLICT"
        assert "generation 1" in info.value.message
    assert snapshot(pkg.dir) == before


def test_generation_one_needs_project(ws):
    with pytest.raises(VianoError) as info:
        PackageWriter(Package(ws, "c", "p")).publish(0, {"a": b"a"}, analysis_revision=1)
    assert info.value.code == "INVALID_ARGUMENT"


def test_project_only_at_generation_one(pkg):
    with pytest.raises(VianoError) as info:
        PackageWriter(pkg).publish(1, {}, project={"name": "other", "version": "2"})
    assert info.value.code == "INVALID_ARGUMENT"


def test_analysis_revision_carried_set_never_decreased(pkg):
    writer = PackageWriter(pkg)
    assert writer.publish(1, {})["analysis_revision"] == 1
    assert writer.publish(2, {}, analysis_revision=2)["analysis_revision"] == 2
    assert writer.publish(3, {})["analysis_revision"] == 2
    with pytest.raises(VianoError) as info:
        writer.publish(4, {}, analysis_revision=1)
    assert info.value.code == "INVALID_ARGUMENT"
    assert pkg.current_generation() == 4
    assert writer.publish(4, {}, analysis_revision=2**53 - 1)["analysis_revision"] == 2**53 - 1
    with pytest.raises(VianoError) as info:
        writer.publish(5, {}, analysis_revision=2**53)  # no manifest reader takes it
    assert info.value.code == "INVALID_ARGUMENT"
    assert pkg.current_generation() == 5


def test_artifact_pointers(pkg):
    writer = PackageWriter(pkg)
    m = writer.publish(1, {"case/revisions/0001/case.json": b"{}\n"}, artifacts={"case": "case/revisions/0001/case.json"})
    assert m["artifacts"] == {"case": "case/revisions/0001/case.json"}
    with pytest.raises(VianoError) as info:
        writer.publish(2, {}, artifacts={"case_summary": "case/revisions/0001/case_summary.md"})
    assert info.value.code == "REFERENCE_MISSING"
    with pytest.raises(VianoError) as info:
        writer.publish(2, {}, artifacts={"bogus": "original/report.data"})
    assert info.value.code == "INVALID_ARGUMENT"
    assert writer.publish(2, {}, artifacts={"case": None})["artifacts"] == {}
    assert pkg.current_generation() == 3


def test_content_conflict_and_identical_bytes(pkg):
    writer = PackageWriter(pkg)
    before = snapshot(pkg.dir)
    # A path already in the manifest: different bytes refused, nothing written.
    with pytest.raises(VianoError) as info:
        writer.publish(1, {"original/report.data": b"report v2\n", "original/other": b"o"})
    assert info.value.code == "CONTENT_CONFLICT" and info.value.path == "original/report.data"
    assert snapshot(pkg.dir) == before
    # Identical bytes are accepted and the file is untouched.
    m = writer.publish(1, {"original/report.data": b"report v1\n"})
    assert m["files"] == pkg.manifest(1)["files"]
    # A file on disk that no manifest names (e.g. left by a crashed writer):
    # identical bytes are adopted, different bytes refused.
    orphan = pkg.content_dir / "original" / "orphan.bin"
    orphan.write_bytes(b"orphan")
    with pytest.raises(VianoError) as info:
        writer.publish(2, {"original/orphan.bin": b"other"})
    assert info.value.code == "CONTENT_CONFLICT"
    assert orphan.read_bytes() == b"orphan"
    m = writer.publish(2, {"original/orphan.bin": b"orphan"})
    assert m["files"]["original/orphan.bin"] == {"sha256": sha(b"orphan"), "size": 6}


def test_file_where_directory_needed_is_a_conflict(pkg):
    with pytest.raises(VianoError) as info:
        PackageWriter(pkg).publish(1, {"original/report.data/x": b"x"})
    assert info.value.code == "CONTENT_CONFLICT"


def test_publish_refuses_unsafe_paths(pkg):
    before = snapshot(pkg.dir)
    for bad in ("../escape", "/abs", "a\\b", "original/.tmp-1-0123456789abcdef"):
        with pytest.raises(VianoError) as info:
            PackageWriter(pkg).publish(1, {bad: b"x"})
        assert info.value.code == "REFERENCE_UNSAFE"
    assert snapshot(pkg.dir) == before


def test_publish_never_follows_symlinked_content_dirs(pkg, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, pkg.content_dir / "evil")
    with pytest.raises(VianoError) as info:
        PackageWriter(pkg).publish(1, {"evil/x.txt": b"x"})
    assert info.value.code == "REFERENCE_UNSAFE"
    assert list(outside.iterdir()) == []


def test_path_sources_are_streamed_and_hashed(pkg, tmp_path):
    big = tmp_path / "runtime.bin"
    data = os.urandom(1 << 20) * 2 + b"tail"
    big.write_bytes(data)
    seen = []
    m = PackageWriter(pkg).publish(1, {"original/runtime.bin": big}, progress=lambda path, done: seen.append((path, done)))
    assert m["files"]["original/runtime.bin"] == {"sha256": sha(data), "size": len(data)}
    assert (pkg.content_dir / "original" / "runtime.bin").read_bytes() == data
    assert [done for _, done in seen] == [1 << 20, 2 << 20, len(data)]  # 1 MiB chunks, hashed once
    assert pkg.verify_file("original/runtime.bin") == (sha(data), len(data))


def _staged(ws: Workspace, data: bytes) -> StagedFile:
    """A staged copy on the workspace's filesystem, as an append leaves one."""
    staging = ws.root / ".staging" / "t"
    staging.mkdir(parents=True, exist_ok=True)
    path = staging / f"f{len(list(staging.iterdir()))}"
    path.write_bytes(data)
    return StagedFile(str(path), sha(data), len(data))


def test_a_staged_file_is_linked_into_place_not_copied(pkg, ws):
    data = os.urandom(3 << 20)
    staged = _staged(ws, data)
    inode = os.stat(staged.path).st_ino
    m = PackageWriter(pkg).publish(1, {"original/runtime.bin": staged})
    published = pkg.content_dir / "original" / "runtime.bin"
    assert m["files"]["original/runtime.bin"] == {"sha256": sha(data), "size": len(data)}
    assert os.stat(published).st_ino == inode  # one inode: no second copy
    assert not os.path.exists(staged.path)  # and no staging name left to write it through
    assert pkg.verify_file("original/runtime.bin") == (sha(data), len(data))
    assert temps(pkg.dir) == []


def test_a_staged_file_that_cannot_be_linked_is_copied_and_hashed_as_read(pkg, ws, monkeypatch):
    import pipeline.packages as packages

    real_link = os.link

    def no_hard_links(source, target, *args, **kwargs):
        if isinstance(source, str) and source.startswith("/proc/self/fd/"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_link(source, target, *args, **kwargs)

    monkeypatch.setattr(packages.os, "link", no_hard_links)
    data = b"staged on another filesystem\n"
    staged = _staged(ws, data)
    m = PackageWriter(pkg).publish(1, {"original/a.txt": staged})
    published = pkg.content_dir / "original" / "a.txt"
    assert m["files"]["original/a.txt"] == {"sha256": sha(data), "size": len(data)}
    assert os.stat(published).st_ino != os.stat(staged.path).st_ino
    assert published.read_bytes() == data
    monkeypatch.undo()
    assert temps(pkg.dir) == []


@pytest.mark.parametrize("when", ["after staging", "replaced after staging", "while linking"])
def test_a_staged_file_written_before_it_is_published_is_published_with_the_hash_of_what_it_holds(pkg, ws, monkeypatch, when):
    """Found by session 18's reviews: a staged file written again (same
    size, before or after its stamp, or while the link was held back) or
    replaced was published under the digest taken while staging, a manifest
    its content never met, and every later build refused the package. The
    linked file is hashed again, with no staging name left to write it by."""
    import pipeline.packages as packages

    staged = _staged(ws, b"A" * 4096)
    if when == "after staging":
        with open(staged.path, "r+b") as handle:
            handle.write(b"EVIL")
    elif when == "replaced after staging":
        os.unlink(staged.path)
        Path(staged.path).write_bytes(b"\0" * 4096)
    else:
        real_link = os.link

        def write_then_link(source, target, *args, **kwargs):
            if isinstance(source, str) and source.startswith("/proc/self/fd/"):
                with open(staged.path, "r+b") as handle:
                    handle.write(b"EVIL")
            return real_link(source, target, *args, **kwargs)

        monkeypatch.setattr(packages.os, "link", write_then_link)
    m = PackageWriter(pkg).publish(1, {"original/extra.log": staged})
    monkeypatch.undo()
    published = (pkg.content_dir / "original" / "extra.log").read_bytes()
    assert published != b"A" * 4096
    assert m["files"]["original/extra.log"] == {"sha256": sha(published), "size": 4096}
    assert pkg.verify_file("original/extra.log") == (sha(published), 4096)
    assert not os.path.exists(staged.path)
    assert temps(pkg.dir) == []


def test_a_staged_file_meets_an_existing_name_as_any_source(pkg, ws):
    same = _staged(ws, b"report v1\n")
    assert PackageWriter(pkg).publish(1, {"original/report.data": same})["package_generation"] == 2
    other = _staged(ws, b"report v2\n")
    with pytest.raises(VianoError) as info:
        PackageWriter(pkg).publish(2, {"original/report.data": other})
    assert info.value.code == "CONTENT_CONFLICT"


def test_path_source_must_be_a_regular_file(pkg, tmp_path):
    os.symlink(tmp_path, tmp_path / "link")
    for source, code in ((tmp_path / "missing", "SOURCE_NOT_FOUND"), (tmp_path / "link", "SOURCE_SPECIAL_FILE"), (tmp_path, "SOURCE_SPECIAL_FILE")):
        with pytest.raises(VianoError) as info:
            PackageWriter(pkg).publish(1, {"x": source})
        assert info.value.code == code
    assert temps(pkg.dir) == []


# ---------------------------------------------------------------- reading


def test_read_verified(pkg):
    assert pkg.read_verified("original/report.data", 100) == b"report v1\n"
    assert pkg.verify_file("original/report.data") == (sha(b"report v1\n"), 10)
    with pytest.raises(VianoError) as info:
        pkg.read_verified("original/report.data", 5)
    assert info.value.code == "LIMIT_EXCEEDED"


def test_read_refuses_paths_not_in_manifest(pkg):
    (pkg.content_dir / "original" / "stray").write_bytes(b"stray")
    for ref in ("original/stray", "original/REPORT.DATA", "nope"):
        with pytest.raises(VianoError) as info:
            pkg.read_verified(ref, 100)
        assert info.value.code == "REFERENCE_MISSING"
    with pytest.raises(VianoError) as info:
        pkg.read_verified("../pkg-1/content/original/report.data", 100)
    assert info.value.code == "REFERENCE_UNSAFE"


@pytest.mark.parametrize("tampered", [b"report v2\n", b"report v1\nmore", b"rep"])
def test_tampered_content_is_integrity_error(pkg, tampered):
    target = pkg.content_dir / "original" / "report.data"
    target.chmod(0o644)
    target.write_bytes(tampered)
    with pytest.raises(VianoError) as info:
        pkg.read_verified("original/report.data", 100)
    assert info.value.code == "INTEGRITY_ERROR" and info.value.path == "original/report.data"
    # Grown, shrunk or rewritten: one message for the same kind of damage.
    assert "content does not match the manifest's size and SHA-256" in str(info.value), str(info.value)
    with pytest.raises(VianoError) as info:
        pkg.verify_file("original/report.data")
    assert info.value.code == "INTEGRITY_ERROR"


def test_symlinked_component_is_unsafe(pkg, tmp_path):
    real = pkg.content_dir / "original"
    moved = tmp_path / "moved"
    real.rename(moved)
    os.symlink(moved, real)  # same bytes, reached through a symlink
    with pytest.raises(VianoError) as info:
        pkg.read_verified("original/report.data", 100)
    assert info.value.code == "REFERENCE_UNSAFE"
    with pytest.raises(VianoError) as info:
        pkg.verify_file("original/report.data")
    assert info.value.code == "REFERENCE_UNSAFE"


def test_symlinked_file_is_unsafe(pkg):
    target = pkg.content_dir / "original" / "report.data"
    copy = pkg.content_dir / "copy"
    copy.write_bytes(target.read_bytes())
    target.unlink()
    os.symlink(copy, target)
    with pytest.raises(VianoError) as info:
        pkg.read_verified("original/report.data", 100)
    assert info.value.code == "REFERENCE_UNSAFE"


# ---------------------------------------------------------------- corrupt manifests


def _fresh(pkg: Package) -> Package:
    return Package(pkg.workspace, pkg.case_id, pkg.package_id)  # no cache


@pytest.mark.parametrize(
    "mutate",
    [
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: b"",
        lambda data: data + b"{}",  # trailing data
        lambda data: b"\xef\xbb\xbf" + data,
        lambda data: data.replace(b'"package_generation": 2', b'"package_generation": 7'),
        lambda data: data.replace(b'"case_id": "case-1"', b'"case_id": "case-2"'),
        lambda data: data.replace(b'"format_version": 1', b'"format_version": 2'),
        lambda data: data.replace(b'"files": {', b'"extra": 1, "files": {'),
        lambda data: data.replace(b'"size": 10', b'"size": -1'),
        lambda data: data.replace(b'"size": 10', b'"size": 10, "size": 10'),
        lambda data: data.replace(b'"original/report.data"', b'"../report.data"'),
    ],
)
def test_corrupt_current_manifest_is_integrity_error(pkg, mutate):
    PackageWriter(pkg).publish(1, {"b": b"b"})
    path = pkg.manifests_dir / "000002.json"
    data = path.read_bytes()
    changed = mutate(data)
    assert changed != data
    path.chmod(0o644)
    path.write_bytes(changed)
    fresh = _fresh(pkg)
    assert fresh.current_generation() == 2  # never a silent fallback to generation 1
    with pytest.raises(VianoError) as info:
        fresh.manifest()
    assert info.value.code == "INTEGRITY_ERROR"
    assert info.value.path == "manifests/000002.json"
    with pytest.raises(VianoError) as info:
        PackageWriter(fresh).publish(2, {"c": b"c"})
    assert info.value.code == "INTEGRITY_ERROR"
    assert fresh.manifest(1) == pkg.manifest(1)


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_manifest_replaced_by_something_not_a_file_is_integrity_error_naming_it(pkg, kind):
    """A directory in its place opened, and the read said only "IO_ERROR: Is a
    directory", naming nothing (session 30's review)."""
    PackageWriter(pkg).publish(1, {"b": b"b"})
    path = pkg.manifests_dir / "000002.json"
    kept = path.read_bytes()
    path.chmod(0o644)
    path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        (pkg.manifests_dir.parent / "elsewhere.json").write_bytes(kept)
        os.symlink(pkg.manifests_dir.parent / "elsewhere.json", path)
    fresh = _fresh(pkg)
    for read in (fresh.manifest, lambda: fresh.manifest_sha256(2), lambda: PackageWriter(fresh).publish(2, {"c": b"c"})):
        with pytest.raises(VianoError) as info:
            read()
        assert (info.value.code, info.value.path) == ("INTEGRITY_ERROR", "manifests/000002.json")
        assert "not a plain file" in info.value.message


def test_generation_gap_is_integrity_error(pkg):
    (pkg.manifests_dir / "000003.json").write_bytes((pkg.manifests_dir / "000001.json").read_bytes())
    with pytest.raises(VianoError) as info:
        _fresh(pkg).current_generation()
    assert info.value.code == "INTEGRITY_ERROR"


def test_missing_generation(pkg, ws):
    with pytest.raises(VianoError) as info:
        pkg.manifest(2)
    assert info.value.code == "MANIFEST_MISSING"
    empty = Package(ws, "case-1", "nothing")
    assert empty.current_generation() == 0
    with pytest.raises(VianoError) as info:
        empty.manifest()
    assert info.value.code == "MANIFEST_MISSING"


def test_schema_violation_from_contracts_becomes_integrity_error(pkg):
    """A stored manifest that passes the structural checks but not its contract
    (here an unknown field inside project) is an integrity error with a pointer."""
    path = pkg.manifests_dir / "000001.json"
    document = json.loads(path.read_bytes())
    document["project"]["colour"] = "red"
    os.chmod(path, 0o644)
    path.write_bytes(json.dumps(document, indent=2, sort_keys=True).encode() + b"\n")
    with pytest.raises(VianoError) as info:
        _fresh(pkg).manifest()
    assert info.value.code == "INTEGRITY_ERROR"
    assert info.value.pointer == "/project/colour"


def test_real_contracts_accept_our_manifests(pkg):
    """Our manifests pass the package-manifest contract (schema and Struct)."""
    import msgspec

    import contracts
    from contracts.structs import STRUCTS

    contracts.validate("package-manifest", pkg.manifest(), path="m")
    msgspec.convert(pkg.manifest(), STRUCTS["package-manifest"])


# ---------------------------------------------------------------- durable helpers and fsync failure


def test_write_and_copy_durable(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    assert write_durable(d, "a.json", b"{}\n") == (sha(b"{}\n"), 3)
    assert write_durable(d, "a.json", b"{}\n") == (sha(b"{}\n"), 3)  # identical: accepted
    with pytest.raises(VianoError) as info:
        write_durable(d, "a.json", b"[]\n")
    assert info.value.code == "CONTENT_CONFLICT"
    src = tmp_path / "src"
    src.write_bytes(b"payload")
    assert copy_durable(d, "b", src) == (sha(b"payload"), 7)
    with pytest.raises(VianoError) as info:
        write_durable(d, "x/y", b"")
    assert info.value.code == "REFERENCE_UNSAFE"
    assert sorted(os.listdir(d)) == ["a.json", "b"]
    assert (d / "a.json").read_bytes() == b"{}\n"


@pytest.mark.parametrize("refusal", [errno.ENOENT, errno.EXDEV, errno.EACCES, errno.EPERM, errno.EINVAL])
def test_write_durable_takes_a_named_temp_where_the_unnamed_file_cannot_be_linked(tmp_path, monkeypatch, refusal):
    # Filesystems answer the /proc/self/fd link of an O_TMPFILE file in
    # several ways; none of them may fail an export that a named temp can do.
    real_link = os.link

    def link(src, dst, **kwargs):
        if str(src).startswith("/proc/self/fd/"):
            raise OSError(refusal, os.strerror(refusal))
        return real_link(src, dst, **kwargs)

    monkeypatch.setattr(os, "link", link)
    assert write_durable(tmp_path, "a.json", b"{}\n") == (sha(b"{}\n"), 3)
    assert os.listdir(tmp_path) == ["a.json"]


@pytest.mark.parametrize("failure", [errno.ENOSPC, errno.EIO])
def test_write_durable_reports_a_link_that_no_route_could_make(tmp_path, monkeypatch, failure):
    def link(src, dst, **kwargs):
        raise OSError(failure, os.strerror(failure))

    monkeypatch.setattr(os, "link", link)
    with pytest.raises(VianoError) as info:
        write_durable(tmp_path, "a.json", b"{}\n")
    assert info.value.code == "IO_ERROR"
    assert os.listdir(tmp_path) == []


def test_fsync_failure_is_io_error_for_every_fsync(ws, monkeypatch):
    """SQLite-style: fail the N-th fsync for N = 1, 2, ... until publish gets through."""
    real_fsync = os.fsync
    files = {"original/new.txt": b"new", "inputs/2/case-inputs.json": b"{}\n"}
    n = 0
    while True:
        n += 1
        assert n < 30, "publish never completed"
        package = Package(ws, "case-1", f"p{n}")
        PackageWriter(package).publish(0, {"original/report.data": b"v1"}, project=PROJECT, analysis_revision=1)
        before = snapshot(package.dir)
        count = [0]

        def failing_fsync(fd, _n=n):
            count[0] += 1
            if count[0] == _n:
                raise OSError(errno.EIO, "injected EIO")
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", failing_fsync)
        try:
            manifest = PackageWriter(package).publish(1, files)
        except VianoError as exc:
            failed = exc
        else:
            failed = None
        finally:
            monkeypatch.setattr(os, "fsync", real_fsync)
        if failed is None:
            assert count[0] < n  # no injected failure was reached
            assert manifest["package_generation"] == 2
            break
        assert failed.code == "IO_ERROR"
        assert count[0] == n  # the failed fsync was the last one: never retried
        assert temps(package.dir) == []
        after = snapshot(package.dir)
        for path, data in before.items():
            assert after[path] == data  # earlier files byte-identical
        fresh = _fresh(package)
        if fresh.current_generation() == 2:
            # Only the directory fsync after the manifest link can fail this late.
            assert "visible" in failed.message
            assert fresh.manifest()["files"]["original/new.txt"]["sha256"] == sha(b"new")
        else:
            assert fresh.current_generation() == 1
            assert PackageWriter(fresh).publish(1, files)["package_generation"] == 2  # a retry succeeds
    assert n >= 5  # content files, their directories and the manifest were all exercised


# ---------------------------------------------------------------- orphan cleanup


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_cleanup_orphans_removes_only_dead_writers_temps(pkg):
    dead = _dead_pid()
    orphan = pkg.manifests_dir / f".tmp-{dead}-0123456789abcdef"
    orphan.write_bytes(b'{"partial')
    content_orphan = pkg.content_dir / "original" / f".tmp-{dead}-fedcba9876543210"
    content_orphan.write_bytes(b"half")
    live = pkg.manifests_dir / f".tmp-{os.getpid()}-0123456789abcdef"
    live.write_bytes(b"in progress")
    other = pkg.manifests_dir / ".tmp-not-ours"
    other.write_bytes(b"x")
    assert PackageWriter(pkg).cleanup_orphans() == sorted(
        [f"manifests/{orphan.name}", f"content/original/{content_orphan.name}"]
    )
    assert not orphan.exists() and not content_orphan.exists()
    assert live.exists() and other.exists()


# ---------------------------------------------------------------- races between real processes


def test_two_processes_race_for_each_generation(pkg, tmp_path):
    """Both racers publish generation r+1 from r; publish holds the case lock, so
    they serialise and the second gets GENERATION_CONFLICT (its expected
    generation is stale), never a partial manifest or file."""
    rounds = 20
    sync = tmp_path / "sync"
    sync.mkdir()
    gen1 = (pkg.manifests_dir / "000001.json").read_bytes()
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROCS / "race_writer.py"), str(pkg.workspace.root), pkg.case_id, pkg.package_id, who, str(rounds), str(sync)]
        )
        for who in ("A", "B")
    ]
    winners = {}
    try:
        time.sleep(0.3)  # both interpreters are up and spinning before round 1
        for rnd in range(1, rounds + 1):
            (sync / f"go-{rnd}").touch()
            deadline = time.monotonic() + 30
            reports = {}
            while len(reports) < 2:
                for who in ("A", "B"):
                    path = sync / f"res-{rnd}-{who}.json"
                    if who not in reports and path.exists():
                        reports[who] = json.loads(path.read_text())
                for proc in procs:
                    assert proc.poll() in (None, 0), "a racer died"
                assert time.monotonic() < deadline, f"round {rnd} did not finish"
                time.sleep(0.001)
            outcomes = sorted(r["outcome"] for r in reports.values())
            assert outcomes == ["GENERATION_CONFLICT", "won"], (rnd, reports)
            (winner,) = [who for who, r in reports.items() if r["outcome"] == "won"]
            winners[rnd] = (winner, reports[winner]["manifest"])
    finally:
        for proc in procs:
            if proc.wait(timeout=30) != 0:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0]
    assert pkg.current_generation() == rounds + 1
    names = sorted(os.listdir(pkg.manifests_dir))
    assert names == [f"{g:06d}.json" for g in range(1, rounds + 2)]  # no temp, no partial manifest
    assert (pkg.manifests_dir / "000001.json").read_bytes() == gen1
    final = _fresh(pkg).manifest()
    for rnd, (winner, manifest) in winners.items():
        stored = (pkg.manifests_dir / f"{rnd + 1:06d}.json").read_bytes()
        assert stored == pretty_bytes(manifest)  # exactly the winner's manifest, unchanged since
        loser = "B" if winner == "A" else "A"
        assert f"round{rnd}/{winner}.bin" in final["files"]
        assert f"round{rnd}/{loser}.bin" not in final["files"]
        # The racers take turns under the case lock: the loser saw its stale
        # expected_generation before writing, so not even its content exists.
        assert not (pkg.content_dir / f"round{rnd}" / f"{loser}.bin").exists()
    assert temps(pkg.dir) == []


# ---------------------------------------------------------------- crashes of a real child process


CRASH_FILES = {"inputs/2/case-inputs.json": '{"format": "viano-case-inputs"}\n', "original/added.txt": "added\n"}


def _crash_child(pkg: Package, point: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("VIANO_CRASH_AT", None)
    if point:
        env["VIANO_CRASH_AT"] = point
    return subprocess.run(
        [sys.executable, str(PROCS / "crash_publish.py"), str(pkg.workspace.root), pkg.case_id, pkg.package_id, "1", json.dumps(CRASH_FILES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("point", ["publish:after-content", "publish:after-manifest-temp", "publish:after-manifest-link"])
def test_crash_at_each_publish_point(pkg, point):
    files = {path: text.encode() for path, text in CRASH_FILES.items()}
    artifacts = {"case_inputs": "inputs/2/case-inputs.json"}
    before = snapshot(pkg.dir)
    proc = _crash_child(pkg, point)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    after = snapshot(pkg.dir)
    for path, data in before.items():
        assert after[path] == data  # earlier generation byte-identical
    fresh = _fresh(pkg)
    writer = PackageWriter(fresh)
    if point == "publish:after-manifest-link":
        # The generation is published; the temp (a second name of it) is left.
        assert fresh.current_generation() == 2
        assert len(temps(pkg.manifests_dir)) == 1
        with pytest.raises(VianoError) as info:
            writer.publish(1, files, artifacts=artifacts)
        assert info.value.code == "GENERATION_CONFLICT"
        assert "at generation 2" in info.value.message
        adopted = writer.publish(1, files, artifacts=artifacts, accept_identical=True)
        assert adopted == fresh.manifest(2)
        # A different request is still refused even when adoption is allowed.
        with pytest.raises(VianoError) as info:
            writer.publish(1, {"original/added.txt": b"other\n"}, accept_identical=True)
        assert info.value.code == "GENERATION_CONFLICT"
    else:
        assert fresh.current_generation() == 1
        if point == "publish:after-manifest-temp":
            assert len(temps(pkg.manifests_dir)) == 1
        retried = writer.publish(1, files, artifacts=artifacts)  # rolls forward, adopting the content
        assert retried["package_generation"] == 2
    assert temps(pkg.dir) == []  # the crashed writer's temp was cleaned up
    assert _fresh(pkg).read_verified("original/added.txt", 100) == b"added\n"
    assert sorted(os.listdir(pkg.manifests_dir)) == ["000001.json", "000002.json"]
    # The published generation equals what an uncrashed writer produces.
    assert _fresh(pkg).manifest(2)["files"] == {
        **pkg.manifest(1)["files"],
        **{p: {"sha256": sha(b), "size": len(b)} for p, b in files.items()},
    }


def test_child_without_crash_point_publishes(pkg):
    proc = _crash_child(pkg, None)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == _fresh(pkg).manifest(2)


@pytest.mark.parametrize("theirs,code", [(b"mine", None), (b"theirs", "CONTENT_CONFLICT")])
def test_content_path_race_at_link(pkg, monkeypatch, theirs, code):
    """Another writer links the same content path between our check and our link."""
    real_link = os.link

    def racing_link(src, dst, *, src_dir_fd=None, dst_dir_fd=None, follow_symlinks=True):
        if dst == "raced.bin":
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dst_dir_fd)
            os.write(fd, theirs)
            os.close(fd)
        return real_link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(os, "link", racing_link)
    if code is None:
        m = PackageWriter(pkg).publish(1, {"raced.bin": b"mine"})
        assert m["files"]["raced.bin"] == {"sha256": sha(b"mine"), "size": 4}
    else:
        with pytest.raises(VianoError) as info:
            PackageWriter(pkg).publish(1, {"raced.bin": b"mine"})
        assert info.value.code == code and info.value.path == "raced.bin"
        assert pkg.current_generation() == 1
    assert (pkg.content_dir / "raced.bin").read_bytes() == theirs
    assert temps(pkg.dir) == []


# ---------------------------------------------------------------- publish holds the case lock


PAUSED_FILES = {"original/paused.txt": "paused\n", "inputs/2/case-inputs.json": '{"format": "viano-case-inputs"}\n'}


def _wait_for(path: Path, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert proc.poll() is None, f"{what} died: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{what} never got there"
        time.sleep(0.005)


def test_publish_paused_between_content_and_manifest_blocks_other_processes(pkg, tmp_path):
    """A writer between linking its content and linking its manifest holds the
    case lock, so another process's roll-forward (which removes content no
    manifest lists, under that lock) cannot delete the content from under it."""
    from pipeline.recovery import remove_unpublished_content
    from pipeline.workspace import case_lock

    ready, go = tmp_path / "ready", tmp_path / "go"
    child = subprocess.Popen(
        [sys.executable, str(PROCS / "pause_publish.py"), str(pkg.workspace.root), pkg.case_id, pkg.package_id, "1",
         json.dumps(PAUSED_FILES), "publish:after-content", str(ready), str(go)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    waiter = None
    try:
        _wait_for(ready, child, "the publishing child")
        # Exactly the dangerous moment: content linked, no manifest lists it yet.
        assert (pkg.content_dir / "original" / "paused.txt").read_bytes() == b"paused\n"
        assert _fresh(pkg).current_generation() == 1
        # Another process cannot take the case lock while the child publishes.
        with pytest.raises(VianoError) as info:
            with case_lock(pkg.workspace, pkg.case_id, timeout=0.3):
                pass
        assert info.value.code == "LOCK_TIMEOUT"

        # A roll-forward-like cleaner waiting for the lock in this process.
        seen = {}

        def cleaner():
            with case_lock(pkg.workspace, pkg.case_id, timeout=30):
                seen["generation"] = _fresh(pkg).current_generation()
                seen["removed"] = remove_unpublished_content(_fresh(pkg))

        import threading

        waiter = threading.Thread(target=cleaner)
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() and seen == {}  # still waiting for the child
        go.touch()
        out, err = child.communicate(timeout=30)
        waiter.join(timeout=30)
        assert not waiter.is_alive()
    finally:
        go.touch()
        if child.poll() is None:
            child.kill()
        child.wait()
    assert child.returncode == 0, err
    # The cleaner got the lock only after the manifest was linked, and found nothing to remove.
    assert seen == {"generation": 2, "removed": []}
    fresh = _fresh(pkg)
    manifest = fresh.manifest()
    assert manifest == json.loads(out)
    assert set(PAUSED_FILES) <= set(manifest["files"])
    for path, entry in manifest["files"].items():
        assert fresh.verify_file(path, manifest=manifest) == (entry["sha256"], entry["size"])
    assert temps(pkg.dir) == []


def test_publish_times_out_with_lock_timeout_and_writes_nothing(pkg, tmp_path):
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [sys.executable, str(PROCS / "lock_holder.py"), str(pkg.workspace.root), pkg.case_id, str(ready)]
    )
    try:
        _wait_for(ready, holder, "the lock holder")
        before = snapshot(pkg.dir)
        started = time.monotonic()
        with pytest.raises(VianoError) as info:
            PackageWriter(pkg).publish(1, {"original/late.txt": b"late"}, lock_timeout=0.3)
        assert info.value.code == "LOCK_TIMEOUT"
        assert 0.3 <= time.monotonic() - started < 5
        assert snapshot(pkg.dir) == before
    finally:
        holder.kill()
        holder.wait()
    assert PackageWriter(pkg).publish(1, {"original/late.txt": b"late"})["package_generation"] == 2


def test_publish_default_lock_wait_is_generous():
    import inspect

    from pipeline.packages import PUBLISH_LOCK_TIMEOUT

    assert PUBLISH_LOCK_TIMEOUT >= 60
    assert inspect.signature(PackageWriter.publish).parameters["lock_timeout"].default == PUBLISH_LOCK_TIMEOUT


def test_publish_inside_a_held_case_lock_is_reentrant(pkg):
    """Commands and build.hold_case_lock hold the lock around publish; the
    latter enters it and never leaves, and doit may publish from another thread."""
    import threading

    from pipeline.workspace import case_lock, held_case_locks

    with case_lock(pkg.workspace, pkg.case_id, timeout=1):
        m = PackageWriter(pkg).publish(1, {"a.txt": b"a"}, lock_timeout=0)
        assert m["package_generation"] == 2
    assert held_case_locks() == []

    forever = case_lock(pkg.workspace, pkg.case_id, timeout=1)
    forever.__enter__()  # the hold_case_lock pattern
    try:
        results = []
        t = threading.Thread(target=lambda: results.append(PackageWriter(pkg).publish(2, {"b.txt": b"b"}, lock_timeout=0)))
        t.start()
        t.join()
        assert [r["package_generation"] for r in results] == [3]
    finally:
        forever.__exit__(None, None, None)
    assert held_case_locks() == []


def test_staging_package_publishes_without_a_lock(ws, tmp_path):
    """A Package.at staging package has no workspace: publish takes no case lock."""
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, str(PROCS / "lock_holder.py"), str(ws.root), "case-1", str(ready)])
    try:
        _wait_for(ready, holder, "the lock holder")
        staged = Package.at(tmp_path / "staging" / "pkg-1", "case-1", "pkg-1")
        m = PackageWriter(staged).publish(0, {"x.txt": b"x"}, project=PROJECT, analysis_revision=1, lock_timeout=0)
        assert m["package_generation"] == 1
        assert staged.read_verified("x.txt", 10) == b"x"
    finally:
        holder.kill()
        holder.wait()


# --------------------------------------------------------------------------- verifying large content


def _big_file(path: Path, size: int) -> bytes:
    data = hashlib.sha256(str(size).encode()).digest() * (size // 32 + 1)
    data = data[:size]
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return data


def _hash_with(path: Path, monkeypatch, *, cached: bool) -> tuple[tuple[str, int], list[str]]:
    from pipeline import packages

    used = []
    real_direct, real_plain = packages._hash_direct, packages._hash_fd
    monkeypatch.setattr(packages, "DIRECT_HASH_MIN", 1 << 20)
    monkeypatch.setattr(packages, "_in_page_cache", lambda fd, size: cached)
    monkeypatch.setattr(packages, "_hash_direct", lambda *a: (used.append("direct"), real_direct(*a))[1])
    monkeypatch.setattr(packages, "_hash_fd", lambda *a: (used.append("plain"), real_plain(*a))[1])
    fd = os.open(path, os.O_RDONLY)
    try:
        return packages._hash_content(fd), used
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [(1 << 20) + 1, 3 << 20, (4 << 20) * 3, (4 << 20) * 3 + 4096, 9_437_184 + 123, 5])
def test_large_content_not_in_cache_is_hashed_with_direct_reads(tmp_path, monkeypatch, size):
    data = _big_file(tmp_path / "big.bin", size)
    found, used = _hash_with(tmp_path / "big.bin", monkeypatch, cached=False)
    assert found == (hashlib.sha256(data).hexdigest(), size)
    assert used == (["direct"] if size >= 1 << 20 else ["plain"])


def test_large_content_in_cache_takes_the_plain_read(tmp_path, monkeypatch):
    data = _big_file(tmp_path / "big.bin", 5 << 20)
    found, used = _hash_with(tmp_path / "big.bin", monkeypatch, cached=True)
    assert found == (hashlib.sha256(data).hexdigest(), len(data)) and used == ["plain"]


def test_page_cache_probe_tells_dropped_from_read_content(tmp_path):
    from pipeline import packages

    path = tmp_path / "big.bin"
    _big_file(path, 32 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        # DONTNEED is advice: a page still in another CPU's LRU batch, or
        # under writeback, is skipped (seen once in a full run). Asked again
        # a while later, the kernel drops it.
        for _attempt in range(50):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not packages._in_page_cache(fd, 32 << 20):
                break
            time.sleep(0.02)
        assert not packages._in_page_cache(fd, 32 << 20)
        while os.read(fd, 1 << 20):
            pass
        assert packages._in_page_cache(fd, 32 << 20)
    finally:
        os.close(fd)


def _readv_failing(monkeypatch, err: int, *, at_call: int) -> None:
    """``os.readv`` raising ``err`` on its ``at_call``-th call only."""
    real_readv, calls = os.readv, {"n": 0}

    def readv(fd, buffers):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise OSError(err, "injected")
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)


def test_direct_read_failure_is_raised_and_leaves_no_thread(tmp_path, monkeypatch):
    import threading

    _big_file(tmp_path / "big.bin", 20 << 20)
    _readv_failing(monkeypatch, errno.EIO, at_call=3)
    with pytest.raises(OSError) as info:
        _hash_with(tmp_path / "big.bin", monkeypatch, cached=False)
    assert info.value.errno == errno.EIO
    assert [t.name for t in threading.enumerate() if t.name.startswith("viano-verify")] == []


def test_direct_read_refused_starts_over_on_the_plain_read(tmp_path, monkeypatch):
    data = _big_file(tmp_path / "big.bin", 6 << 20)
    _readv_failing(monkeypatch, errno.EINVAL, at_call=2)
    found, used = _hash_with(tmp_path / "big.bin", monkeypatch, cached=False)
    assert found == (hashlib.sha256(data).hexdigest(), len(data))
    assert used == ["direct", "plain"]


def test_tampered_large_content_fails_verification(tmp_path, monkeypatch):
    from pipeline import packages

    content = tmp_path / "pkg" / "content"
    content.mkdir(parents=True)
    data = _big_file(content / "dump.bin", 6 << 20)
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    with open(content / "dump.bin", "r+b") as handle:
        handle.seek(5 << 20)
        handle.write(b"!")
        handle.flush()
        os.fsync(handle.fileno())
    package = Package.at(tmp_path / "pkg", "c1", "p1")
    monkeypatch.setattr(packages, "DIRECT_HASH_MIN", 1 << 20)
    monkeypatch.setattr(packages, "_in_page_cache", lambda fd, size: False)
    with pytest.raises(VianoError) as info:
        package.verify_file("dump.bin", manifest={"files": {"dump.bin": entry}})
    assert info.value.code == "INTEGRITY_ERROR" and info.value.path == "dump.bin"


def test_the_rename_used_without_hard_links_never_replaces_a_file(tmp_path):
    import os

    from pipeline.packages import _rename_noreplace

    (tmp_path / "temp").write_bytes(b"new")
    (tmp_path / "taken").write_bytes(b"old")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileExistsError):
            _rename_noreplace("temp", "taken", fd)
        assert (tmp_path / "taken").read_bytes() == b"old" and (tmp_path / "temp").exists()
        _rename_noreplace("temp", "free", fd)
    finally:
        os.close(fd)
    assert (tmp_path / "free").read_bytes() == b"new" and not (tmp_path / "temp").exists()


# ---------------------------------------------------------------- parsed manifests


def _manifest_sha(package: Package, generation: int) -> str:
    return sha((package.manifests_dir / f"{generation:06d}.json").read_bytes())


def test_parsed_manifests_are_kept_by_publishers_and_loaders_and_checked_where_it_matters(ws, pkg, monkeypatch):
    from pipeline import packages
    from pipeline.cache import BuildCache

    cache = BuildCache(ws.cache_dir("case-1"))
    keep_published = cache.parsed_manifests(keep_loaded=False)
    writer_side = Package(ws, "case-1", "pkg-1", parsed_manifests=keep_published)
    assert writer_side.manifest(1) == pkg.manifest(1)
    assert not cache.manifest_record(_manifest_sha(pkg, 1)).exists()  # loaded only: not kept
    PackageWriter(writer_side).publish(1, {"original/more.data": b"more\n"})
    assert cache.manifest_record(_manifest_sha(pkg, 2)).exists()  # published: kept

    reader = Package(ws, "case-1", "pkg-1", parsed_manifests=cache.parsed_manifests())
    expected = [Package(ws, "case-1", "pkg-1").manifest(g) for g in (1, 2)]
    assert reader.manifest(1) == expected[0]  # decoded, checked, and kept now
    assert cache.manifest_record(_manifest_sha(pkg, 1)).exists()

    def no_decoding(data, label):
        raise AssertionError(f"{label} was decoded again")

    monkeypatch.setattr(packages, "_checked_manifest", no_decoding)
    again = Package(ws, "case-1", "pkg-1", parsed_manifests=cache.parsed_manifests())
    assert [again.manifest(g) for g in (1, 2)] == expected
    monkeypatch.undo()

    # A record standing for other bytes still meets the file-name and identity check.
    cache.write_msgpack(cache.manifest_record(_manifest_sha(pkg, 2)), expected[0])
    with pytest.raises(VianoError) as caught:
        Package(ws, "case-1", "pkg-1", parsed_manifests=cache.parsed_manifests()).manifest(2)
    assert caught.value.code == "INTEGRITY_ERROR"
    # An unreadable record is as if absent: the manifest is decoded and the record rewritten.
    cache.manifest_record(_manifest_sha(pkg, 2)).unlink()
    cache.write(cache.manifest_record(_manifest_sha(pkg, 2)), b"\xc1 not msgpack")
    assert Package(ws, "case-1", "pkg-1", parsed_manifests=cache.parsed_manifests()).manifest(2) == expected[1]
    # A changed manifest file is never hidden by a record: its bytes have another sha256.
    path = pkg.manifests_dir / "000002.json"
    path.chmod(0o644)
    original = path.read_bytes()
    path.write_bytes(original.replace(b'"original/more.data"', b'"original/mire.data"'))
    changed = Package(ws, "case-1", "pkg-1", parsed_manifests=cache.parsed_manifests()).manifest(2)
    assert "original/mire.data" in changed["files"] and "original/more.data" not in changed["files"]
    path.write_bytes(original[: len(original) // 2])
    with pytest.raises(VianoError) as caught:
        Package(ws, "case-1", "pkg-1", parsed_manifests=cache.parsed_manifests()).manifest(2)
    assert caught.value.code == "INTEGRITY_ERROR"


_HASH_INTERRUPTED_AT_START = r"""
import json, os, signal, tempfile, threading, time
from pipeline import packages

real_start = threading.Thread.start

def start_then_interrupt(thread):
    real_start(thread)
    if thread.name == "viano-verify-read":
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C just as the reader starts

threading.Thread.start = start_then_interrupt
inside = threading.Event()
real_readv = os.readv

def slow_readv(fd, buffers):
    inside.set()
    try:
        time.sleep(0.2)  # the reader is busy with a buffer when the interrupt comes
        return real_readv(fd, buffers)
    finally:
        inside.clear()

os.readv = slow_readv
fd, path = tempfile.mkstemp()
os.write(fd, b"x" * (8 << 20))
os.lseek(fd, 0, os.SEEK_SET)
try:
    packages._hash_direct(fd, None, "x")
    outcome = "returned"
except BaseException as error:
    outcome = type(error).__name__
print(json.dumps({"outcome": outcome, "reader_busy_after": inside.is_set(),
                  "handler_restored": signal.getsignal(signal.SIGINT) is signal.default_int_handler}))
"""


def test_a_ctrl_c_while_the_direct_hash_starts_waits_for_its_reader():
    """hash_context's direct-read ring defers Ctrl-C like admission's copy:
    the interrupt is raised once the reader is done with the buffers and the
    descriptor the caller closes next (pipeline.interrupts)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    result = subprocess.run([sys.executable, "-c", _HASH_INTERRUPTED_AT_START], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"outcome": "KeyboardInterrupt", "reader_busy_after": False, "handler_restored": True}, outcome


def test_a_listed_file_gone_from_the_content_is_the_workspaces_damage(pkg):
    """Not the package's reference (REFERENCE_MISSING sent the user to their
    index): a workspace archived while a build published restored without
    the published files (session 24's CI review)."""
    (pkg.content_dir / "original" / "report.data").unlink()
    for read in (lambda: pkg.read_verified("original/report.data", 100), lambda: pkg.verify_file("original/report.data")):
        with pytest.raises(VianoError) as info:
            read()
        assert (info.value.code, info.value.path) == ("INTEGRITY_ERROR", "original/report.data")
        assert "no longer holds it" in info.value.message
    with pytest.raises(VianoError) as info:
        pkg.read_verified("original/never-listed", 100)
    assert info.value.code == "REFERENCE_MISSING"


def test_planning_a_long_lived_package_keeps_one_generations_file_entries(ws):
    """Planning reads every generation's manifest, and kept each whole: a
    case of 300 reopen/append/build cycles (900 manifests of ~1,800 entries)
    held 400 MB while planning, and met MemoryError under a cap (session
    25's review). Earlier generations are read for their outlines only."""
    import tracemalloc

    from pipeline.limits import CaseBuilderLimits
    from pipeline.plan import make_plan

    package = Package(ws, "case-1", "pkg-1")
    PackageWriter(package).publish(0, {f"original/logs/{n:04d}.log": b"x%d\n" % n for n in range(400)},
                                   project=PROJECT, analysis_revision=1)
    for generation in range(1, 121):
        PackageWriter(package).publish(generation, {f"original/more/{generation:04d}.log": b"y\n"})

    def peak_of(work):
        tracemalloc.start()
        try:
            work()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    one_manifest = peak_of(lambda: Package(ws, "case-1", "pkg-1").manifest(121, copy=False))
    fresh = Package(ws, "case-1", "pkg-1")
    plans = []
    planning = peak_of(lambda: plans.append(make_plan(fresh, 121, CaseBuilderLimits(), read_index=None, read_prior_case=None,
                                                      enforce_limits=False)))
    assert len(plans[0]["opaque"]) == 520 and plans[0]["snapshot_generation"] == 121
    # Kept whole, the 121 manifests peaked at 19 x one; their outlines at 1.1 x.
    assert planning < 4 * one_manifest, (planning, one_manifest)
    # An earlier manifest is still checked as it is read for its outline.
    forged = pretty_bytes({**fresh.manifest(5), "case_id": "case-2"})
    os.chmod(fresh.manifests_dir / "000005.json", 0o644)
    (fresh.manifests_dir / "000005.json").write_bytes(forged)
    with pytest.raises(VianoError) as refused:
        make_plan(Package(ws, "case-1", "pkg-1"), 121, CaseBuilderLimits(), read_index=None, read_prior_case=None,
                  enforce_limits=False)
    assert refused.value.code == "INTEGRITY_ERROR" and "does not belong here" in refused.value.message


def test_every_generations_manifest_name_is_read_back_as_that_generation():
    """From generation 1,000,000 on, manifest_name gives seven digits, which
    the six-digit pattern did not take: the package would have stood still
    at 999,999 (session 25's review)."""
    from pipeline.packages import _MANIFEST_RE, manifest_name

    for generation in (1, 42, 999_999, 1_000_000, 12_345_678):
        found = _MANIFEST_RE.fullmatch(manifest_name(generation))
        assert found is not None and int(found.group(1)) == generation
    for other in ("0000001.json", "00001.json", "1.json", "000001.json.tmp", "-00001.json"):
        assert _MANIFEST_RE.fullmatch(other) is None, other


def test_files_published_side_by_side_leave_no_thread_writing_after_an_interrupt(tmp_path, monkeypatch):
    """An interrupt raised while the second of three publishing threads was
    starting left the first one running after the call had raised; it wrote
    through the caller's folder descriptor, which the caller then closed, and
    whose number a host program's next open took: its case.json landed in the
    host's folder (session 30's review of the API)."""
    import threading

    from pipeline import packages

    real_publish = packages._publish_content

    def slow_for_the_threads(dir_fd, name, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)  # still writing when the interrupt reaches the caller
        return real_publish(dir_fd, name, *args, **kwargs)

    real_start = threading.Thread.start
    starts = []

    def start_then_interrupted(thread):
        real_start(thread)
        starts.append(thread)
        if len(starts) == 2:
            raise KeyboardInterrupt  # as if Ctrl-C landed in start()'s wait

    monkeypatch.setattr(packages, "_publish_content", slow_for_the_threads)
    monkeypatch.setattr(threading.Thread, "start", start_then_interrupted)
    folder = tmp_path / "folder"
    folder.mkdir()
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(KeyboardInterrupt):
            packages._publish_side_by_side(dir_fd, [("a", b"a" * 10), ("b", b"b" * 10), ("c", b"c" * 10), ("d", b"d" * 10)])
    finally:
        os.close(dir_fd)
    # The host opens another folder at once; it takes the closed number.
    host = tmp_path / "host"
    host.mkdir()
    host_fd = os.open(host, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert not [thread for thread in starts if thread.is_alive()]
        time.sleep(0.5)
        assert os.listdir(host) == []
        assert sorted(name for name in os.listdir(folder) if not name.startswith(".")) == ["b", "c"]
    finally:
        os.close(host_fd)

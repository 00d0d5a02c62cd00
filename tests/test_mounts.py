"""pipeline/mounts.py: a path's filesystem and place there, through bind mounts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline import commands
from pipeline.mounts import Mount, filesystem_location, lies_within, parse_mountinfo, read_mounts

# Root on 8:1; the workspace's cases bound at /mnt/alias; a tmpfs (0:50)
# mounted inside the workspace and one of its folders bound at /srv/b; an
# unrelated tmpfs at /tmp; a later mount lying over /data.
MOUNTINFO = "\n".join([
    "20 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw",
    "21 20 8:1 /work/ws/cases /mnt/alias rw - ext4 /dev/sda1 rw",
    "22 20 0:50 / /work/ws/cases/c1/extra rw - tmpfs tmpfs rw",
    "23 20 0:50 /inner /srv/b rw - tmpfs tmpfs rw",
    "24 20 0:51 / /tmp rw - tmpfs tmpfs rw",
    "25 20 8:1 /old /data rw - ext4 /dev/sda1 rw",
    "26 20 0:52 / /data rw - tmpfs tmpfs rw",
    r"27 20 8:1 /work/ws/cases /mnt/with\040space rw - ext4 /dev/sda1 rw",
    "garbage",
])
MOUNTS = parse_mountinfo(MOUNTINFO)


def test_mountinfo_lines_become_mounts_with_their_escapes_undone():
    assert MOUNTS[0] == Mount("8:1", "/", "/")
    assert MOUNTS[-1] == Mount("8:1", "/work/ws/cases", "/mnt/with space")
    assert len(MOUNTS) == 8  # the malformed line is skipped


@pytest.mark.parametrize("path, location", [
    ("/", ("8:1", "/")),
    ("/work/ws", ("8:1", "/work/ws")),
    ("/mnt/alias", ("8:1", "/work/ws/cases")),
    ("/mnt/alias/c1/out", ("8:1", "/work/ws/cases/c1/out")),
    ("/mnt/aliased", ("8:1", "/mnt/aliased")),  # a longer name is no child
    ("/srv/b/x", ("0:50", "/inner/x")),
    ("/data/x", ("0:52", "/x")),  # the later mount at one point lies over the earlier
])
def test_a_path_is_located_through_its_innermost_mount(path, location):
    assert filesystem_location(path, MOUNTS) == location


@pytest.mark.parametrize("path, inside", [
    ("/work/ws/x", True),
    ("/mnt/alias/c1/packages/p/content/out", True),  # a bind mount of a folder in the workspace
    ("/mnt/with space/out", True),
    ("/srv/b/out", True),  # a folder of a filesystem mounted inside the workspace
    ("/work/wsx/out", False),
    ("/work/out", False),
    ("/tmp/out", False),
    ("/mnt/aliased/out", False),
])
def test_a_path_lies_within_the_workspace_however_it_is_mounted(path, inside):
    assert lies_within(path, "/work/ws", MOUNTS) is inside


def test_this_machine_s_mount_table_locates_the_root():
    mounts = read_mounts()
    assert mounts is not None
    assert filesystem_location("/", mounts) is not None


def test_export_s_check_reads_the_mount_table_instead_of_walking_the_workspace(tmp_path, monkeypatch):
    # Walking every folder of a large workspace made each export seconds
    # slower (100,000 folders: 3.5 s against 0.34 s); the walk is only the
    # fallback where the mount table cannot be read.
    ws = tmp_path / "ws"
    (ws / "cases" / "c1").mkdir(parents=True)

    def no_walk(*_):
        raise AssertionError("walked the workspace")

    monkeypatch.setattr(commands, "_holds_folder_of", no_walk)
    assert commands._inside_workspace(tmp_path / "out", ws) is False
    assert commands._inside_workspace(ws / "cases" / "out", ws) is True


def test_without_a_mount_table_the_workspace_s_folders_are_walked(tmp_path, monkeypatch):
    import pipeline.mounts

    ws = tmp_path / "ws"
    (ws / "cases" / "c1" / "deep").mkdir(parents=True)
    monkeypatch.setattr(pipeline.mounts, "read_mounts", lambda: None)
    assert commands._inside_workspace(tmp_path / "elsewhere" / "out", ws) is False
    st = os.stat(ws / "cases" / "c1" / "deep")
    assert commands._holds_folder_of(ws, {(st.st_dev, st.st_ino)}) is True
    outside = os.stat(tmp_path)
    assert commands._holds_folder_of(ws, {(outside.st_dev, outside.st_ino)}) is False

"""pipeline/mounts.py: a path's filesystem and place there, through bind mounts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline import commands
from pipeline.mounts import Mount, filesystem_location, lies_within, parse_mountinfo, read_mounts

# Root (20) on 8:1, whose parent (1) is outside the table; the workspace's
# cases bound at /mnt/alias; a tmpfs (0:50) mounted inside the workspace and
# one of its folders bound at /srv/b; an unrelated tmpfs at /tmp; two
# mounts stacked on /data; a point with a space in it. Then the two ways a
# mount is hidden (found by the second re-review): a tmpfs at /m/d/new that
# a later bind of the workspace's cases on /m/d covers, and a bind of the
# cases moved (mount --move) on top of a tmpfs at /m/d2, its id older.
MOUNTINFO = "\n".join([
    "20 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw",
    "21 20 8:1 /work/ws/cases /mnt/alias rw - ext4 /dev/sda1 rw",
    "22 20 0:50 / /work/ws/cases/c1/extra rw - tmpfs tmpfs rw",
    "23 20 0:50 /inner /srv/b rw - tmpfs tmpfs rw",
    "24 20 0:51 / /tmp rw - tmpfs tmpfs rw",
    "25 20 8:1 /old /data rw - ext4 /dev/sda1 rw",
    "26 25 0:52 / /data rw - tmpfs tmpfs rw",
    r"27 20 8:1 /work/ws/cases /mnt/with\040space rw - ext4 /dev/sda1 rw",
    "30 20 0:60 / /m/d/new rw - tmpfs none rw",
    "31 20 8:1 /work/ws/cases /m/d rw - ext4 /dev/sda1 rw",
    "29 33 8:1 /work/ws/cases /m/d2 rw - ext4 /dev/sda1 rw",
    "33 20 0:61 / /m/d2 rw - tmpfs none rw",
    "garbage",
])
MOUNTS = parse_mountinfo(MOUNTINFO)


def test_mountinfo_lines_become_mounts_with_their_escapes_undone():
    assert MOUNTS[0] == Mount("20", "1", "8:1", "/", "/", "ext4", "rw")
    assert MOUNTS[7] == Mount("27", "20", "8:1", "/work/ws/cases", "/mnt/with space", "ext4", "rw")
    assert len(MOUNTS) == 12  # the malformed line is skipped


@pytest.mark.parametrize("path, location", [
    ("/", ("8:1", "/")),
    ("/work/ws", ("8:1", "/work/ws")),
    ("/mnt/alias", ("8:1", "/work/ws/cases")),
    ("/mnt/alias/c1/out", ("8:1", "/work/ws/cases/c1/out")),
    ("/mnt/aliased", ("8:1", "/mnt/aliased")),  # a longer name is no child
    ("/srv/b/x", ("0:50", "/inner/x")),
    ("/data/x", ("0:52", "/x")),  # the mount stacked on top is the one seen
    ("/m/d/new/x", ("8:1", "/work/ws/cases/new/x")),  # the tmpfs there is hidden
    ("/m/d2/x", ("8:1", "/work/ws/cases/x")),  # the moved mount lies on top
])
def test_a_path_is_located_as_the_kernel_walks_it(path, location):
    assert filesystem_location(path, MOUNTS) == location


@pytest.mark.parametrize("path, inside", [
    ("/work/ws/x", True),
    ("/mnt/alias/c1/packages/p/content/out", True),  # a bind mount of a folder in the workspace
    ("/mnt/with space/out", True),
    ("/srv/b/out", True),  # a folder of a filesystem mounted inside the workspace
    ("/m/d/new/out", True),
    ("/m/d2/out", True),
    ("/work/wsx/out", False),
    ("/work/out", False),
    ("/tmp/out", False),
    ("/mnt/aliased/out", False),
])
def test_a_path_lies_within_the_workspace_however_it_is_mounted(path, inside):
    assert lies_within(path, "/work/ws", MOUNTS) is inside


def test_a_mount_point_may_hold_any_character_but_a_line_feed():
    # splitlines() also cut at "\r", "\v", U+0085, U+2028 ... (second mount review)
    odd = "/mnt/a\rb\x0bc\x1cd\u0085e\u2028f"
    table = parse_mountinfo("20 1 8:1 / / rw - ext4 /dev/sda1 rw\n21 20 8:1 /work/ws/cases " + odd + " rw - ext4 x rw\n")
    assert [m.point for m in table] == ["/", odd]
    assert lies_within(odd + "/x", "/work/ws", table) is True
    assert lies_within("/mnt/a", "/work/ws", table) is False


def test_a_covered_mount_inside_the_workspace_does_not_count():
    # T at /work/ws/m, bound at /h, then U mounted over /work/ws/m: T is no
    # longer inside the workspace, so exporting into /h is allowed.
    table = parse_mountinfo("\n".join([
        "20 1 8:1 / / rw - ext4 /dev/sda1 rw",
        "21 20 0:70 / /work/ws/m rw - tmpfs T rw",
        "22 20 0:70 / /h rw - tmpfs T rw",
        "23 21 0:71 / /work/ws/m rw - tmpfs U rw",
    ]))
    assert lies_within("/h/e", "/work/ws", table) is False
    assert lies_within("/work/ws/m/e", "/work/ws", table) is True


def test_an_overlay_writing_into_the_workspace_counts_as_inside_it():
    # What is written through an overlay lands in its upperdir (found by the
    # mount review: an overlay whose upperdir was in the workspace let the
    # export write there). Its lower folders are only read.
    table = parse_mountinfo("\n".join([
        "20 1 8:1 / / rw - ext4 /dev/sda1 rw",
        "65 20 0:80 / /srv/merged rw,relatime - overlay o rw,lowerdir=/srv/low,upperdir=/work/ws/up,workdir=/work/ws/wk,uuid=on",
        r"66 20 0:81 / /srv/read rw,relatime - overlay o rw,lowerdir=/work/ws/cases,upperdir=/srv/u\054p,workdir=/srv/wk",
    ]))
    assert table[1].fstype == "overlay" and "upperdir=/work/ws/up" in table[1].options
    assert lies_within("/srv/merged/e", "/work/ws", table) is True
    assert lies_within("/srv/read/e", "/work/ws", table) is False


def test_a_table_without_one_root_mount_locates_nothing():
    # A chroot whose root is no mount point lists no mount at "/": the caller
    # falls back on walking the workspace.
    chrooted = parse_mountinfo("40 39 8:1 /srv/chroot/proc /proc rw - proc proc rw")
    assert filesystem_location("/wsc/cases", chrooted) is None
    assert lies_within("/alias/x", "/wsc", chrooted) is None


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


@pytest.mark.parametrize("table", [None, "40 39 8:1 /srv/chroot/proc /proc rw - proc proc rw"])
def test_without_a_mount_table_that_locates_both_the_workspace_s_folders_are_walked(tmp_path, monkeypatch, table):
    import pipeline.mounts

    ws = tmp_path / "ws"
    (ws / "cases" / "c1" / "deep").mkdir(parents=True)
    monkeypatch.setattr(pipeline.mounts, "read_mounts", lambda: table and parse_mountinfo(table))
    walked = []
    real_walk = commands._holds_folder_of
    monkeypatch.setattr(commands, "_holds_folder_of", lambda *a: walked.append(a) or real_walk(*a))
    assert commands._inside_workspace(tmp_path / "elsewhere" / "out", ws) is False
    assert walked
    st = os.stat(ws / "cases" / "c1" / "deep")
    assert commands._holds_folder_of(ws, {(st.st_dev, st.st_ino)}) is True
    outside = os.stat(tmp_path)
    assert commands._holds_folder_of(ws, {(outside.st_dev, outside.st_ino)}) is False

"""Where a path lies once mounts are counted: the filesystem and the path within it.

A bind mount shows a folder at a second path, and ``realpath`` cannot see
through it: ``/mnt/alias/x`` may be ``/work/ws/cases/x``. The kernel's
``/proc/self/mountinfo`` says, for every mount, which mount it sits on,
which filesystem it shows (``major:minor``), which folder of that
filesystem is its root, and where it is mounted. A path is resolved the way
the kernel walks it: from the root mount, one component at a time, crossing
into a mount that sits on the current one at that point (and into the top
of a stack of mounts there). A mount that a later mount on a parent folder
hides, or one left where ``mount --move`` took its place, is never reached.
An overlay whose upper (or work) folder lies inside a folder counts as
inside it: what is written through the overlay lands there. Linux only;
where the table cannot be read or does not cover a path (a chroot whose
root is no mount point), callers get ``None`` and fall back on what they can
check themselves.
"""

from __future__ import annotations

import posixpath
import re
from typing import NamedTuple

__all__ = ["Mount", "parse_mountinfo", "read_mounts", "filesystem_location", "lies_within"]

_MOUNTINFO = "/proc/self/mountinfo"
#: A mount table larger than this is not read (a container host may list
#: thousands of mounts; a line is ~100-300 bytes).
_MOUNTINFO_LIMIT = 16 * 1024 * 1024
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


class Mount(NamedTuple):
    mount_id: str
    parent_id: str  # the mount this one sits on (itself, or one not listed, for the root)
    device: str  # "major:minor" of the filesystem shown
    root: str  # the folder of that filesystem the mount shows
    point: str  # where it is mounted
    fstype: str = ""
    options: str = ""  # the filesystem's own (super) options, still escaped


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    return _OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order; malformed lines are skipped."""
    mounts = []
    # Lines end in "\n" only: a mount point may hold "\r", "\v", U+2028 and
    # other characters splitlines() would cut it at (mountinfo escapes only
    # space, tab, newline and backslash).
    for line in text.split("\n"):
        fields = line.split(" ")
        if len(fields) < 5 or ":" not in fields[2] or not fields[4].startswith("/"):
            continue
        # Optional fields end at a lone "-", then: type, source, options.
        tail = fields[fields.index("-", 6) + 1:] if "-" in fields[6:] else []
        fstype = tail[0] if tail else ""
        options = tail[2] if len(tail) > 2 else ""
        mounts.append(Mount(fields[0], fields[1], fields[2], _unescape(fields[3]), _unescape(fields[4]), fstype, options))
    return mounts


def read_mounts() -> list[Mount] | None:
    """This process's mounts, or ``None`` when they cannot be read."""
    try:
        with open(_MOUNTINFO, "rb") as handle:
            data = handle.read(_MOUNTINFO_LIMIT + 1)
    except OSError:
        return None
    if len(data) > _MOUNTINFO_LIMIT:
        return None
    mounts = parse_mountinfo(data.decode("utf-8", "surrogateescape"))
    return mounts or None


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _top_of(mount: Mount, point: str, on: dict[tuple[str, str], Mount]) -> Mount:
    """The mount seen at ``point``: ``mount``, or what is stacked on it there."""
    seen = {mount.mount_id}
    while (mount.mount_id, point) in on:
        mount = on[(mount.mount_id, point)]
        if mount.mount_id in seen:  # a malformed table: a cycle
            break
        seen.add(mount.mount_id)
    return mount


def _resolving(mounts: list[Mount]):
    """The root mount and the index (parent id, point) -> mount of the table."""
    ids = {mount.mount_id for mount in mounts}
    on: dict[tuple[str, str], Mount] = {}
    roots = []
    for mount in mounts:
        if mount.parent_id == mount.mount_id or mount.parent_id not in ids:
            if mount.point == "/":
                roots.append(mount)
            continue
        on[(mount.parent_id, mount.point)] = mount  # a later one at the same place lies over it
    if len(roots) != 1:
        return None, on
    return _top_of(roots[0], "/", on), on


def _mount_of(path: str, mounts: list[Mount], resolving=None) -> Mount | None:
    current, on = resolving or _resolving(mounts)
    if current is None:
        return None
    position = "/"
    for part in [p for p in path.split("/") if p]:
        position = position.rstrip("/") + "/" + part
        current = _top_of(current, position, on)
    return current


def filesystem_location(path: str, mounts: list[Mount]) -> tuple[str, str] | None:
    """``(device, path within that filesystem)`` of an absolute, resolved path,
    through the mounts the kernel's walk of it would cross; None when the
    table has no single root mount."""
    current = _mount_of(path, mounts)
    if current is None:
        return None
    rest = path[len(current.point.rstrip("/")):] if current.point != "/" else path
    inner = current.root.rstrip("/") + rest
    return current.device, inner or "/"


def lies_within(path: str, folder: str, mounts: list[Mount]) -> bool | None:
    """Whether the resolved ``path`` reaches into the resolved ``folder``: the
    same filesystem and a place within the folder there, or within a
    filesystem mounted inside the folder, by whatever mount it is reached.
    None when the table does not locate both."""
    here = filesystem_location(path, mounts)
    top = filesystem_location(folder, mounts)
    if here is None or top is None:
        return None
    regions = [top]
    resolving = _resolving(mounts)
    for mount in mounts:
        if mount.point != folder and _within(mount.point, folder) and _mount_of(mount.point, mounts, resolving) == mount:
            # Mounted inside the folder and seen there (not covered by another
            # mount), wherever else it is reached from.
            regions.append((mount.device, mount.root))
        elif mount.fstype == "overlay" and any(_within(upper, folder) for upper in _written_dirs(mount.options)):
            # Writes through an overlay land in its upper (and work) folder.
            regions.append((mount.device, "/"))
    device, inner = here
    return any(device == region_device and _within(inner, region_root) for region_device, region_root in regions)


def _written_dirs(options: str) -> list[str]:
    """An overlay's ``upperdir`` and ``workdir``, as absolute normalised paths
    (a relative one cannot be placed, and is left out)."""
    found = []
    for option in options.split(","):  # a comma inside a value is escaped (\054)
        key, _, value = option.partition("=")
        if key in ("upperdir", "workdir"):
            value = _unescape(value)
            if value.startswith("/"):
                found.append(posixpath.normpath(value))
    return found

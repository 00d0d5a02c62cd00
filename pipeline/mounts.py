"""Where a path lies once mounts are counted: the filesystem and the path within it.

A bind mount shows a folder at a second path, and ``realpath`` cannot see
through it: ``/mnt/alias/x`` may be ``/work/ws/cases/x``. The kernel's
``/proc/self/mountinfo`` says, for every mount, which filesystem it shows
(``major:minor``), which folder of that filesystem is its root, and where it
is mounted. From it, a resolved path becomes ``(filesystem, path within
it)``, and two paths that reach the same folder become comparable however
they were mounted. Linux only; where the file cannot be read, callers get
``None`` and fall back on what they can check themselves.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["Mount", "read_mounts", "filesystem_location", "lies_within"]

_MOUNTINFO = "/proc/self/mountinfo"
#: A mount table larger than this is not read (a container host may list
#: thousands of mounts; a line is ~100-300 bytes).
_MOUNTINFO_LIMIT = 16 * 1024 * 1024
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


class Mount(NamedTuple):
    device: str  # "major:minor" of the filesystem shown
    root: str  # the folder of that filesystem the mount shows
    point: str  # where it is mounted


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    return _OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order (a later mount at the same
    point lies over an earlier one); malformed lines are skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) < 5 or ":" not in fields[2]:
            continue
        mounts.append(Mount(fields[2], _unescape(fields[3]), _unescape(fields[4])))
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


def filesystem_location(path: str, mounts: list[Mount]) -> tuple[str, str] | None:
    """``(device, path within that filesystem)`` of an absolute, resolved path,
    through the innermost mount that holds it (the last of equals)."""
    best = None
    for mount in mounts:
        if _within(path, mount.point) and (best is None or len(mount.point) >= len(best.point)):
            best = mount
    if best is None:
        return None
    rest = path[len(best.point.rstrip("/")):]
    return best.device, (best.root.rstrip("/") + rest) or "/"


def lies_within(path: str, folder: str, mounts: list[Mount]) -> bool:
    """Whether the resolved ``path`` reaches into the resolved ``folder``: the
    same filesystem and a place within the folder there, or within a
    filesystem mounted inside the folder, by whatever mount it is reached."""
    here = filesystem_location(path, mounts)
    top = filesystem_location(folder, mounts)
    if here is None or top is None:
        return False
    regions = [top] + [(m.device, m.root) for m in mounts if m.point != folder and _within(m.point, folder)]
    device, inner = here
    return any(device == region_device and _within(inner, region_root) for region_device, region_root in regions)

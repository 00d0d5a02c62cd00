"""A workspace's own limits: the optional ``limits.json`` at its root.

The limits are policy, not format (seed 001, ARCHITECTURE.md section 10), so
the people running a workspace must be able to set them without writing
Python: a build whose canonical case comes out over ``case_bytes`` from inputs
within their own limits has no other way forward (inherited inputs never drop
out, and a reopen needs a built case). Every command on a workspace reads the
same file, so a build, the append that checks the build would fit, and
``status`` agree. Without the file every limit has its default.

The file is ``viano-workspace-limits`` v1 (``contracts/workspace-limits-v1``),
read like any other document: bounded, strict JSON, checked against its
contract, every refusal coded with its pointer. A limit left out keeps its
default; an unknown or misspelt one is refused, never ignored.

Read on every build, before anything else is planned, so it stays cheap: the
document is decoded with :mod:`json` (which doit has imported already), and a
plain check accepts what is obviously valid; anything else goes to the
contract's validator, which gives the precise refusal (the check and the
contract are held to the same verdicts by ``tests/test_workspace_limits.py``).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import fields
from typing import Any

from .errors import VianoError
from .jsoncanon import decode_strict, read_fd_at_most
from .limits import CaseBuilderLimits, KiB, MiB

__all__ = [
    "LIMITS_FILE",
    "MAX_LIMITS_BYTES",
    "PUBLISHED_CASE_CEILING",
    "PUBLISHED_SUMMARY_CEILING",
    "WorkspaceLimits",
    "ceiling",
    "read_workspace_limits",
    "workspace_limits_from",
]

LIMITS_FILE = "limits.json"
MAX_LIMITS_BYTES = 64 * KiB

_FORMAT = "viano-workspace-limits"
_MAX_SAFE_INTEGER = 2**53 - 1
# Section -> limit -> (smallest, largest) value it takes, or ``bool`` for a
# switch; the contract holds the same ranges (tests hold them equal). The case
# builder's start at their defaults: a lower limit would make inputs a
# revision already holds (an earlier index, a prior case) unreadable to its
# next build, or refuse outputs already published. Their ceilings keep every
# derived record within what the builder is built for: a report's cached
# fragment measured ~17 x the report's bytes for tiny statements, and cache
# records are bounded at 64 MiB. The admission limits may be lowered freely
# (they judge incoming sources only); two of them bound memory, so they have
# ceilings too.
_SECTIONS: dict[str, dict[str, Any]] = {
    "case_builder": {
        "document_bytes": (1 * MiB, 2 * MiB),
        "aggregate_bytes": (8 * MiB, 64 * MiB),
        "documents": (256, 4096),
        "case_bytes": (8 * MiB, 64 * MiB),
        "summary_bytes": (8 * MiB, 64 * MiB),
        "inline_fact_value": (16 * KiB, 1 * MiB),
    },
    "admission": {
        "max_entries": (1, 65536),
        "max_entry_bytes": (1, _MAX_SAFE_INTEGER),
        "max_total_bytes": (1, _MAX_SAFE_INTEGER),
        "max_ratio": (1, _MAX_SAFE_INTEGER),
        "ratio_min_bytes": (0, _MAX_SAFE_INTEGER),
        "manifest_bytes": (1, 16 * MiB),
        "check_free_disk": bool,
        "free_disk_reserve": (0, _MAX_SAFE_INTEGER),
    },
}
def ceiling(name: str) -> int:
    """The most a workspace may raise case builder limit ``name`` to."""
    return _SECTIONS["case_builder"][name][1]


#: The largest case.json and summary any workspace may have published: what
#: export and probes read a published output up to, whatever the limits now.
PUBLISHED_CASE_CEILING = _SECTIONS["case_builder"]["case_bytes"][1]
PUBLISHED_SUMMARY_CEILING = _SECTIONS["case_builder"]["summary_bytes"][1]


class WorkspaceLimits:
    """The limits every command on one workspace applies.

    A plain class, not a dataclass: every build imports this module, and
    making a dataclass costs about a millisecond at import."""

    __slots__ = ("case_builder", "admission_settings", "configured")

    def __init__(
        self,
        case_builder: CaseBuilderLimits | None = None,
        admission_settings: tuple[tuple[str, Any], ...] = (),
        configured: bool = False,
    ) -> None:
        self.case_builder = case_builder if case_builder is not None else CaseBuilderLimits()
        #: Only the admission limits the file sets: :meth:`admission` builds
        #: the ZipLimits, so a build never imports the ZIP scanner for them.
        self.admission_settings = admission_settings
        #: Whether a ``limits.json`` set them (else every limit is its default).
        self.configured = configured

    def admission(self):
        from .zipscan import ZipLimits

        return ZipLimits(**dict(self.admission_settings))

    def changed(self) -> list[str]:
        """``section.limit=value`` for every limit that is not its default, for ``status``."""
        from .zipscan import ZipLimits

        out = []
        defaults = CaseBuilderLimits()
        for item in fields(CaseBuilderLimits):
            value = getattr(self.case_builder, item.name)
            if value != getattr(defaults, item.name):
                out.append(f"case_builder.{item.name}={value}")
        zip_defaults = ZipLimits()
        for name, value in self.admission_settings:
            if value != getattr(zip_defaults, name):
                out.append(f"admission.{name}={str(value).lower() if isinstance(value, bool) else value}")
        return out


def _plainly_valid(document: Any) -> bool:
    """True only for a document the contract certainly accepts (decode_strict
    has already refused duplicates, bad numbers and the like)."""
    if type(document) is not dict or document.get("format") != _FORMAT:
        return False
    version = document.get("format_version")
    if type(version) is not int or version != 1:
        return False
    for key, section in document.items():
        if key in ("format", "format_version"):
            continue
        allowed = _SECTIONS.get(key)
        if allowed is None or type(section) is not dict:
            return False
        for name, value in section.items():
            if name not in allowed:
                return False
            bounds = allowed[name]
            if bounds is bool:
                if type(value) is not bool:
                    return False
            elif type(value) is not int or not bounds[0] <= value <= bounds[1]:
                return False
    return True


def workspace_limits_from(data: bytes) -> WorkspaceLimits:
    """The limits a ``limits.json`` of these bytes sets; coded refusals name ``limits.json``."""
    document = decode_strict(data, max_bytes=MAX_LIMITS_BYTES, path=LIMITS_FILE, error=VianoError)
    if not _plainly_valid(document):
        import contracts

        contracts.validate("workspace-limits", document, path=LIMITS_FILE, error=VianoError)
    case_builder = CaseBuilderLimits(**document.get("case_builder", {}))
    admission = tuple(sorted(document.get("admission", {}).items()))
    return WorkspaceLimits(case_builder, admission, configured=True)


def read_limits_bytes(root: os.PathLike | str) -> bytes | None:
    """The bytes of ``<root>/limits.json``, or None when there is none.

    Never through a symlink (the workspace follows none) and never a FIFO or
    device (opened without blocking, refused unless a regular file)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.join(os.fspath(root), LIMITS_FILE), flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise VianoError(
                "REFERENCE_UNSAFE", "the workspace's limits file is a symlink; the workspace never follows one", path=LIMITS_FILE
            ) from None
        if exc.errno == errno.ENOTDIR:
            return None  # the workspace root is not a directory: the command's own checks say so
        raise VianoError("IO_ERROR", f"cannot open the workspace's limits file: {exc.strerror}", path=LIMITS_FILE) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise VianoError("IO_ERROR", "the workspace's limits file is not a regular file", path=LIMITS_FILE)
        if info.st_size > MAX_LIMITS_BYTES:
            raise VianoError("LIMIT_EXCEEDED", f"{info.st_size} bytes, limit {MAX_LIMITS_BYTES}", path=LIMITS_FILE)
        try:
            return read_fd_at_most(fd, MAX_LIMITS_BYTES, label=LIMITS_FILE, error=VianoError)
        except OSError as exc:
            raise VianoError("IO_ERROR", f"cannot read the workspace's limits file: {exc.strerror}", path=LIMITS_FILE) from None
    finally:
        os.close(fd)


def read_workspace_limits(root: os.PathLike | str) -> WorkspaceLimits:
    """The limits of the workspace at ``root``: its ``limits.json``, else the defaults."""
    data = read_limits_bytes(root)
    if data is None:
        return WorkspaceLimits()
    return workspace_limits_from(data)

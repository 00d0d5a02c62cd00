"""Workspace layout, safe ids and references, the per-case lock, and symlink-proof opens.

Everything that turns an untrusted string into a filesystem location goes
through this module: ids through :func:`validate_id`, content paths through
:func:`check_reference`, and opens inside a package through
:func:`open_nofollow`, which walks the path one component at a time relative
to a directory descriptor so no symlink anywhere below the base is followed
(RELIABILITY.md 27-29). :func:`case_lock` serialises writers of one case on
one machine with ``flock`` (RELIABILITY.md 32-33).
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import functools
import fcntl
import os
import re
import stat
import sys
import threading
import time
import unicodedata
from pathlib import Path
from typing import Iterator

try:  # imported with the module: a process that has since switched users may read no module files
    import grp
    import pwd
except ImportError:  # pragma: no cover - not a Unix
    grp = pwd = None

from .errors import CaseBuildError, LifecycleError, VianoError
from .frozen import FrozenRecord

__all__ = [
    "ADMISSION_MARKER",
    "ID_PATTERN",
    "DEFAULT_WORKSPACE",
    "WORKSPACE_ENV",
    "validate_id",
    "check_reference",
    "Workspace",
    "case_lock",
    "held_case_locks",
    "refuse_symlinks",
    "open_nofollow",
    "open_dir_nofollow",
    "makedirs_nofollow",
]

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DEFAULT_WORKSPACE = "service-data"
WORKSPACE_ENV = "VIANO_WORKSPACE"

_DRIVE_RE = re.compile(r"[A-Za-z]:")
# Bidirectional formatting characters (Trojan Source, CVE-2021-42574): they
# make a path display differently from what it is.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
_MAX_COMPONENT_BYTES = 255  # NAME_MAX on every filesystem we care about
_MAX_REFERENCE_BYTES = 4096  # PATH_MAX

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


#: In ``cases/<id>/`` while an admission is not yet committed to the store:
#: only a directory carrying it may be removed as a crashed admission.
ADMISSION_MARKER = ".admission-pending"
STAGING_TREE_RE = re.compile(r"(?:admit|append)-(.+)-(\d+)-[0-9a-f]{12}")
"""A staging tree's name in ``.staging/`` (kind, id, pid, random part);
``<tree>.owner`` beside it is the lock its live writer holds."""
STAGING_OWNER_SUFFIX = ".owner"


def is_staging_name(name: str) -> bool:
    """Whether ``name`` in ``.staging/`` is a staging tree or its owner file."""
    return STAGING_TREE_RE.fullmatch(name.removesuffix(STAGING_OWNER_SUFFIX)) is not None


def validate_id(value: object, what: str = "id") -> str:
    """Return ``value`` if it matches ``^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$``, else ``UNSAFE_ID``.

    ``fullmatch`` (not ``$``) so a trailing newline is refused too.
    """
    if not isinstance(value, str) or ID_PATTERN.fullmatch(value) is None:
        shown = value if isinstance(value, str) else repr(value)
        raise VianoError("UNSAFE_ID", f"{what} {shown!r} is not a safe id", path=None)
    return value


@functools.lru_cache(maxsize=16384)  # every build checks every content path several times
def _reference_problem(ref: str) -> str | None:
    if ref == "":
        return "empty reference"
    if ref.startswith("/"):
        return "absolute reference"  # covers //host (UNC-style) as well
    if "\\" in ref:
        return "backslash in reference"
    if _DRIVE_RE.match(ref):
        return "drive letter in reference"
    # An ASCII name is unsafe here only for a control character, which is
    # exactly what makes ASCII text unprintable: one C-level test instead of
    # a table lookup per character (every build checks hundreds of paths).
    if not (ref.isascii() and ref.isprintable()):
        # Each distinct character judged once (a path of thousands of combining
        # marks repeats a few), the first unsafe one in the path reported.
        unsafe = {ch for ch in set(ref) if ch in _BIDI or unicodedata.category(ch) in _UNSAFE_CATEGORIES}
        if unsafe:
            first = next(ch for ch in ref if ch in unsafe)
            return f"control, bidi or surrogate character U+{ord(first):04X} in reference"
    if len(ref.encode("utf-8")) > _MAX_REFERENCE_BYTES:
        return "reference too long"
    for part in ref.split("/"):
        if part in ("", ".", ".."):
            return f"empty, '.' or '..' component in reference"
        if len(part.encode("utf-8")) > _MAX_COMPONENT_BYTES:
            return "reference component too long"
    return None


def check_reference(ref: object) -> str:
    """Return ``ref`` if it is a safe content path inside a package, else ``REFERENCE_UNSAFE``.

    Safe: a non-empty ``/``-separated relative path with no empty, ``.`` or
    ``..`` component, no backslash, no drive prefix (``C:``), no NUL, control,
    surrogate, line-separator or bidi characters. Nothing is decoded or
    normalised: ``%2e%2e`` is a literal (harmless) file name, and two spellings
    of one name are two different references.
    """
    if not isinstance(ref, str):
        raise CaseBuildError("REFERENCE_UNSAFE", f"reference must be a string, not {type(ref).__name__}")
    problem = _reference_problem(ref)
    if problem is not None:
        raise CaseBuildError("REFERENCE_UNSAFE", problem, path=ref)
    return ref


def user_path(value: str) -> Path:
    """A path given on the command line, relative to the directory the user ran
    the command in. doit changes into the dodo file's directory before any
    task runs (``doit -f path/to/dodo.py``), so ``os.getcwd()`` there is not it;
    doit keeps the directory it started in."""
    path = Path(value)
    if path.is_absolute():
        return path
    try:
        from doit import get_initial_workdir

        start = get_initial_workdir()
    except ImportError:  # used without doit (the Python API)
        start = None
    return Path(start or os.getcwd()) / path


def require_utf8_file_names() -> None:
    """Every name a package holds is UTF-8 (ZIP names flagged so, JSON
    paths, directory names checked on admission), and the workspace keeps it
    as those bytes. Python turns a name into bytes with its file-system
    encoding: under another one (a Latin-1 locale, or ``PYTHONUTF8=0`` under
    the C locale) ``café.json`` would be written as other bytes, refused as
    not UTF-8, or fail with a traceback. Refused at once instead, wherever a
    workspace is opened (every command and the Python API); Python chooses
    UTF-8 itself under the C and POSIX locales unless told not to."""
    encoding = sys.getfilesystemencoding()
    if codecs.lookup(encoding).name != "utf-8":
        raise VianoError(
            "UNSUPPORTED_ENVIRONMENT",
            f"Python's file-system encoding is {encoding}, not UTF-8: run under a UTF-8 locale, or set PYTHONUTF8=1",
        )


class Workspace(FrozenRecord):
    """Where one workspace lives and how its parts are laid out (ARCHITECTURE.md section 3).

    Pure path arithmetic: nothing here touches the disk. ``root`` is made
    absolute once so a later ``chdir`` cannot move the workspace.
    """

    __slots__ = ("root",)
    root: Path

    def __init__(self, root) -> None:
        require_utf8_file_names()
        # A str or os.PathLike naming a directory. Empty is refused, as
        # ``workspace=`` is on the command line: an unset variable in a
        # host's Workspace(os.environ.get("DIR", "")) would otherwise make
        # a store in whatever directory the host runs in.
        if isinstance(root, os.PathLike):
            root = os.fspath(root)
        if not isinstance(root, str):
            raise VianoError("INVALID_ARGUMENT", f"a workspace is a str or os.PathLike path, not {type(root).__name__}")
        if root.strip() == "":
            raise VianoError("INVALID_ARGUMENT", "the workspace path is empty or blank")
        if "\x00" in root:
            # No file name holds one: os calls raised a bare ValueError.
            raise VianoError("INVALID_ARGUMENT", "the workspace path holds a NUL character")
        object.__setattr__(self, "root", Path(os.path.abspath(root)))

    @classmethod
    def from_var(cls, value: str | None) -> "Workspace":
        """The workspace named by a command variable, else ``$VIANO_WORKSPACE``, else
        ``service-data``; a relative one is taken from where the command was run.

        ``workspace=`` given empty is refused (``INVALID_ARGUMENT``) rather than
        read as "the default": it is what ``workspace=$DIR`` gives when ``DIR``
        is unset, and the default may be another workspace than the one meant.
        An empty (or blank) ``$VIANO_WORKSPACE`` counts as unset, as shells treat it."""
        if value is not None and value.strip() == "":
            raise VianoError("INVALID_ARGUMENT", "workspace= is empty: leave it out for $VIANO_WORKSPACE or ./service-data")
        if value is None:
            configured = os.environ.get(WORKSPACE_ENV, "")
            value = configured if configured.strip() else DEFAULT_WORKSPACE
        # Resolved once: doit records each dependency by its absolute path, so
        # one workspace reached by a link and by its target would otherwise
        # keep two records, and every switch between them would rebuild the
        # case (and doit status foretell it wrongly).
        return cls(os.path.realpath(user_path(value)))

    @property
    def store_path(self) -> Path:
        return self.root / "checkpoints.sqlite3"

    @property
    def cases_dir(self) -> Path:
        return self.root / "cases"

    def case_dir(self, case_id: str) -> Path:
        return self.cases_dir / validate_id(case_id, "case id")

    def package_dir(self, case_id: str, package_id: str) -> Path:
        return self.case_dir(case_id) / "packages" / validate_id(package_id, "package id")

    def cache_dir(self, case_id: str) -> Path:
        return self.root / ".cache" / validate_id(case_id, "case id")

    def staging_dir(self) -> Path:
        return self.root / ".staging"

    def lock_path(self, case_id: str) -> Path:
        return self.root / ".locks" / f"{validate_id(case_id, 'case id')}.lock"


def refuse_symlinks(workspace: Workspace, *relpaths: str) -> None:
    """RELIABILITY 28 for the workspace's own tree: no part of any of
    ``relpaths`` (below the root) may be a symlink, or a command would read
    and write wherever it points (publish a case outside the workspace, take
    a lock file elsewhere). Checked part by part from the root, so a link is
    named where it stands; a part that does not exist yet ends the check (we
    make it, as a directory). ``REFERENCE_UNSAFE``. A check before use, not
    descriptor-relative opens: it keeps a misplaced or planted link from
    being used, not a writer racing this process inside the workspace. The
    root itself may be a symlink: that is where the user put the workspace."""
    seen: set[str] = set()
    for relpath in relpaths:
        done = ""
        for part in relpath.split("/"):
            done = f"{done}/{part}" if done else part
            if done in seen:
                continue
            seen.add(done)
            try:
                mode = os.lstat(os.path.join(workspace.root, done)).st_mode
            except OSError:
                break  # absent, or not ours to look at: whatever opens it next says so with its code
            if stat.S_ISLNK(mode):
                raise CaseBuildError(
                    "REFERENCE_UNSAFE", "a workspace directory or file is a symlink; the workspace never follows one", path=done
                )


# Locks this process holds: (resolved workspace root, case_id) -> [fd, depth].
# flock treats two descriptors of one file in one process as two owners, so a
# nested case_lock would wait on itself; instead the first entry takes the
# flock and later entries -- from any thread of this process -- only count.
# The descriptor belongs to the record, not to the entry that opened it: the
# flock is released when the *last* holder leaves, whichever thread that is.
# Re-entrancy is therefore per process, not per thread: two threads of one
# process do not exclude each other through case_lock (callers that need that
# must serialise their threads themselves). This is what lets
# ``build.hold_case_lock`` hold the lock for a process's lifetime while every
# command, step and PackageWriter.publish inside it still enters case_lock.
_held: dict[tuple[str, str], list[int]] = {}
_held_guard = threading.Lock()

#: Called once with ``(case_id, timeout)`` when a wait for a case lock has
#: lasted :data:`LOCK_NOTICE_AFTER` seconds. The command line sets it to a
#: line on stderr, so a command waiting for another does not look hung; a
#: library caller hears nothing unless it sets one.
lock_wait_notice = None
LOCK_NOTICE_AFTER = 1.0


def _forget_held_in_child() -> None:
    """After fork: the child holds no lock of ours. Its copies of the parent's
    descriptors share the parent's flock, so they are closed -- never unlocked,
    which would release the parent's lock too."""
    global _held_guard
    _held_guard = threading.Lock()
    for fd, _depth in _held.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_held_in_child)


def whose(st: os.stat_result) -> str:
    """'belongs to OWNER and group GROUP (mode M); ...': why this user may not
    write a file of a workspace another user made, and what would let it."""
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
        group = grp.getgrgid(st.st_gid).gr_name
    except (AttributeError, KeyError):
        owner, group = f"uid {st.st_uid}", f"gid {st.st_gid}"
    mode = stat.S_IMODE(st.st_mode)
    text = f"belongs to {owner} and group {group} (mode {mode:o}); "
    if mode & stat.S_IWGRP and st.st_gid != os.getegid() and st.st_gid not in os.getgroups():
        return text + f"this user is not in group {group}"
    # (The chown: a workspace restored from a CI cache or a backup by another
    # user, which a setup for sharing would not mend; session 24's review.)
    return text + ("a workspace shared by several users needs a common group, setgid folders and umask 002 from its "
                   "start; one restored or copied by another user needs chown -R to this user")


def _lock_key(workspace: Workspace, case_id: str) -> tuple[str, str]:
    # Resolved, so two spellings of one workspace (a symlink, a relative
    # path) share one record instead of deadlocking on each other.
    return (os.path.realpath(workspace.root), validate_id(case_id, "case id"))


def _join_held(key: tuple[str, str]) -> bool:
    """Count one more holder if this process already holds ``key``."""
    with _held_guard:
        entry = _held.get(key)
        if entry is None:
            return False
        entry[1] += 1
        return True


def _leave_held(key: tuple[str, str]) -> None:
    """One holder leaves; the last one unlocks and closes the descriptor."""
    with _held_guard:
        entry = _held[key]
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[key]
        fd = entry[0]
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def held_case_locks() -> list[tuple[str, str]]:
    """The (resolved workspace root, case_id) keys this process holds, sorted (for tests and diagnostics)."""
    with _held_guard:
        return sorted(_held)


def case_lock_held_elsewhere(workspace: Workspace, case_id: str) -> bool:
    """Whether the case lock is held right now, by a descriptor other than
    any this call opens (a build, append, reopen or admission running in
    another process). A look that takes nothing: a shared ``flock`` tried
    without waiting and let go at once; a missing or unreadable lock file is
    "no". A symlink on the way is ``REFERENCE_UNSAFE``, as for every command
    that takes the lock; a lock file that is not a regular file (a FIFO
    planted there) is opened without waiting for a writer and is "no"."""
    with _held_guard:
        if _lock_key(workspace, case_id) in _held:
            return False  # this process's own (``doit build status``): not another command's
    path = workspace.lock_path(case_id)
    refuse_symlinks(workspace, f".locks/{path.name}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (closing drops the shared lock if it was taken)
    return False


@contextlib.contextmanager
def case_lock(workspace: Workspace, case_id: str, timeout: float = 30.0) -> Iterator[None]:
    """Hold the exclusive per-case lock for the ``with`` body, or raise ``LOCK_TIMEOUT``.

    Uses ``flock`` on ``.locks/<case_id>.lock``: the kernel drops it when the
    holder dies (even by SIGKILL), and unlike ``lockf``/``fcntl`` record locks
    it is not silently released when any other descriptor of the file is
    closed. Waits by polling ``LOCK_NB`` with short sleeps until ``timeout``
    seconds have passed (at least one attempt is made). The lock file is
    never deleted: unlinking a lock file lets two processes lock two
    different inodes.

    Re-entrant **per process** (not per thread): while this process holds the
    lock of (workspace, case) -- through any thread, including a
    ``build.hold_case_lock`` that never exits -- a further ``case_lock`` of it
    yields at once. The flock is released when the last holder leaves. Other
    processes are excluded for as long as any holder remains.
    """
    key = _lock_key(workspace, case_id)
    if _join_held(key):
        try:
            yield
        finally:
            _leave_held(key)
        return

    path = workspace.lock_path(case_id)
    refuse_symlinks(workspace, f".locks/{path.name}")
    # 0666 less the umask: another user of a workspace shared through a group
    # takes the same lock file.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except PermissionError:
        where = path if path.exists() else path.parent if path.parent.exists() else workspace.root
        held = os.stat(where)
        what = f".locks/{path.name}" if where == path else ".locks" if where == path.parent else "the workspace folder"
        raise LifecycleError("IO_ERROR", f"this user may not take case {case_id}'s lock: {what} {whose(held)}", path=f".locks/{path.name}") from None
    owned = False  # True once the record owns fd (it is then closed by the last holder)
    try:
        started = time.monotonic()
        deadline = started + max(0.0, timeout)
        delay = 0.002
        noticed = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # Another thread of this process may have taken it meanwhile:
                # then we are a nested holder, not a waiter.
                if _join_held(key):
                    break
            else:
                with _held_guard:
                    # Nobody else of ours can hold it: we hold the flock.
                    _held[key] = [fd, 1]
                owned = True
                break
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise LifecycleError(
                    "LOCK_TIMEOUT", f"case {case_id} is locked by another writer; gave up after {timeout:g}s"
                )
            if not noticed and now - started >= LOCK_NOTICE_AFTER and lock_wait_notice is not None:
                noticed = True
                lock_wait_notice(case_id, timeout)
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)
    finally:
        if not owned:
            os.close(fd)
    try:
        yield
    finally:
        _leave_held(key)


def _unsafe_or_missing(parent_fd: int, name: str, relpath: str, exc: OSError) -> VianoError:
    """Classify a failed component open: symlink or special file -> unsafe, absent -> missing."""
    if exc.errno == errno.ELOOP:
        return CaseBuildError("REFERENCE_UNSAFE", "reference crosses a symlink", path=relpath)
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        try:
            st = os.lstat(name, dir_fd=parent_fd)
        except OSError:
            return CaseBuildError("REFERENCE_MISSING", "reference names a file that does not exist", path=relpath)
        if stat.S_ISLNK(st.st_mode):
            return CaseBuildError("REFERENCE_UNSAFE", "reference crosses a symlink", path=relpath)
        return CaseBuildError("REFERENCE_MISSING", "reference goes through a file that is not a directory", path=relpath)
    return CaseBuildError("IO_ERROR", f"cannot open reference: {os.strerror(exc.errno or 0)}", path=relpath)


def open_dir_nofollow(base_dir: Path | str, reldir: str = "", *, _label: str | None = None) -> int:
    """Open ``base_dir/reldir`` as a directory fd, following no symlink below ``base_dir``.

    ``base_dir`` itself is trusted (it is a workspace path we built); ``reldir``
    (``""`` for the base) is checked with :func:`check_reference`.
    """
    try:
        fd = os.open(base_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CaseBuildError("REFERENCE_MISSING", "base directory does not exist", path=_label or reldir or ".") from None
    if reldir == "":
        return fd
    check_reference(reldir)
    label = _label or reldir
    try:
        for part in reldir.split("/"):
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _unsafe_or_missing(fd, part, label, exc) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def makedirs_nofollow(dir_fd: int, reldir: str) -> tuple[int, list[int]]:
    """Create ``reldir`` below ``dir_fd`` one component at a time; return (fd of it, created-in fds).

    Existing components must be real directories (a symlink is
    ``REFERENCE_UNSAFE``, a file is ``CONTENT_CONFLICT``). The second value
    lists, for durability, descriptors of the parents in which a new
    directory was created; the caller fsyncs and closes them. ``dir_fd`` is
    not closed.
    """
    check_reference(reldir)
    created_in: list[int] = []
    fd = os.dup(dir_fd)
    try:
        for part in reldir.split("/"):
            made = False
            try:
                os.mkdir(part, 0o777, dir_fd=fd)  # less the umask, as Path.mkdir does
                made = True
            except FileExistsError:
                pass
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                err = _unsafe_or_missing(fd, part, reldir, exc)
                if err.code == "REFERENCE_MISSING":
                    err = CaseBuildError("CONTENT_CONFLICT", "a file stands where a directory is needed", path=reldir)
                raise err from None
            if made:
                created_in.append(fd)
            else:
                os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        for other in created_in:
            os.close(other)
        raise
    return fd, created_in


def open_nofollow(base_dir: Path | str, relpath: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """Open ``base_dir/relpath`` without following any symlink below ``base_dir``; return the fd.

    Every directory component is opened with ``O_NOFOLLOW|O_DIRECTORY``
    relative to its parent's descriptor, and the last with ``O_NOFOLLOW``, so
    a symlink anywhere on the way is ``REFERENCE_UNSAFE`` and an absent part
    is ``REFERENCE_MISSING``. For read-only opens the target must be a regular
    file or directory (a FIFO would block the open; a device is never
    content) -> ``REFERENCE_UNSAFE``. ``O_CLOEXEC`` is always added. With
    ``O_CREAT|O_EXCL`` an existing name raises ``FileExistsError`` unchanged.
    """
    check_reference(relpath)
    parent, _, name = relpath.rpartition("/")
    dir_fd = open_dir_nofollow(base_dir, parent, _label=relpath)
    try:
        if not flags & os.O_CREAT:
            try:
                st = os.lstat(name, dir_fd=dir_fd)
            except FileNotFoundError:
                raise CaseBuildError("REFERENCE_MISSING", "reference names a file that does not exist", path=relpath) from None
            if stat.S_ISLNK(st.st_mode):
                raise CaseBuildError("REFERENCE_UNSAFE", "reference is a symlink", path=relpath)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise CaseBuildError("REFERENCE_UNSAFE", "reference is a special file", path=relpath)
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        except FileExistsError:
            raise
        except OSError as exc:
            raise _unsafe_or_missing(dir_fd, name, relpath, exc) from None
    finally:
        os.close(dir_fd)

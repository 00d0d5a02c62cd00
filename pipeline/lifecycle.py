"""The CheckpointStore: per-case lifecycle state and an append-only checkpoint log in SQLite.

State machine (ARCHITECTURE.md section 4)::

    admit        (none)                                   -> VALIDATED
    start_build  VALIDATED | REOPENED                     -> BUILDING_CASE   (kind "start")
    case_built   BUILDING_CASE                            -> BUILDING_CASE   (kind "complete")
    reopen       BUILDING_CASE with a case built | COMPLETED -> REOPENED     (analysis_revision + 1)
    block        any but BLOCKED                          -> BLOCKED(code, route, retry_after)
    resume       BLOCKED                                  -> the state before the block
    complete     BUILDING_CASE with a case built          -> COMPLETED       (kind "completed")
    intake       any but COMPLETED (or BLOCKED from COMPLETED) -> unchanged (generation := new_generation)

"A case built" means a ``case_built`` checkpoint for the *current* analysis
revision; there is at most one per revision (a second one with another
request hash is ``REOPEN_REQUIRED``). ``start_build`` and ``case_built`` name
their step ``case-build/v<BUILDER_VERSION>/r<current analysis_revision>``
(:func:`step_id_for`); a step of another revision or builder version is
``ILLEGAL_TRANSITION`` (it would rewrite what that revision is recorded as
having confirmed), a malformed one ``INVALID_ARGUMENT``. A ``case_built``
always publishes a new generation, so its ``new_generation`` must be greater
than the case's.

Guarantees: every write is one ``BEGIN IMMEDIATE`` transaction that first
re-reads the case, so ``advance`` is a compare-and-swap on the generation;
a refused step (``STALE_GENERATION``, ``ILLEGAL_TRANSITION``, bad arguments)
changes nothing. The log is append-only, enforced by triggers that abort any
UPDATE or DELETE of it. The database runs in WAL mode with
``synchronous=FULL`` so a committed checkpoint survives a power cut. Clock
time is stored in the log only (``Checkpoint.time``) and never flows into case
output. One store object is one connection: use it from one thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import stat
import time
from datetime import datetime, timezone
from typing import Any, Iterable

from . import BUILDER_VERSION
from .errors import IntegrityError, LifecycleError, VianoError, coded_io_error
from .frozen import FrozenRecord
from .workspace import ADMISSION_MARKER, Workspace, refuse_symlinks, validate_id, whose

__all__ = [
    "STATES",
    "TRANSITIONS",
    "SCHEMA_VERSION",
    "CaseRecord",
    "Checkpoint",
    "CheckpointStore",
    "step_id_for",
]

STATES = ("VALIDATED", "BUILDING_CASE", "REOPENED", "BLOCKED", "COMPLETED")
TRANSITIONS = ("start_build", "case_built", "intake", "reopen", "block", "resume", "complete")
SCHEMA_VERSION = 1

#: The shape of a case-build step id: ``case-build/v<builder version>/r<revision>``.
_STEP_ID_RE = re.compile(r"case-build/v([0-9A-Za-z][0-9A-Za-z._-]{0,31})/r([1-9][0-9]{0,17})")


def step_id_for(analysis_revision: int) -> str:
    """The step id of building ``analysis_revision`` with this builder (same as ``plan.step_id_for``)."""
    return f"case-build/v{BUILDER_VERSION}/r{analysis_revision}"


_KIND = {
    "start_build": "start",
    "case_built": "complete",
    "intake": "intake",
    "reopen": "reopen",
    "block": "block",
    "resume": "resume",
    "complete": "completed",
}

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS cases (
    case_id           TEXT PRIMARY KEY,
    package_id        TEXT NOT NULL,
    state             TEXT NOT NULL CHECK (state IN {STATES!r}),
    analysis_revision INTEGER NOT NULL CHECK (analysis_revision >= 0),
    generation        INTEGER NOT NULL CHECK (generation >= 0),
    blocked           TEXT,
    prior_state       TEXT CHECK (prior_state IS NULL OR prior_state IN {STATES!r}),
    CHECK ((state = 'BLOCKED') = (prior_state IS NOT NULL AND blocked IS NOT NULL))
);
CREATE TABLE IF NOT EXISTS checkpoints (
    seq               INTEGER PRIMARY KEY AUTOINCREMENT,
    case_id           TEXT NOT NULL REFERENCES cases (case_id),
    transition        TEXT NOT NULL,
    kind              TEXT NOT NULL,
    step_id           TEXT,
    request_hash      TEXT,
    generation        INTEGER NOT NULL,
    analysis_revision INTEGER NOT NULL,
    state             TEXT NOT NULL CHECK (state IN {STATES!r}),
    artifacts         TEXT NOT NULL,
    detail            TEXT,
    time              TEXT NOT NULL,
    manifest_sha256   TEXT
);
CREATE INDEX IF NOT EXISTS checkpoints_by_step ON checkpoints (case_id, kind, step_id);
CREATE TRIGGER IF NOT EXISTS checkpoints_append_only_update BEFORE UPDATE ON checkpoints
BEGIN SELECT RAISE(ABORT, 'the checkpoint log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS checkpoints_append_only_delete BEFORE DELETE ON checkpoints
BEGIN SELECT RAISE(ABORT, 'the checkpoint log is append-only'); END;
"""

_CASE_COLUMNS = "case_id, package_id, state, analysis_revision, generation, blocked, prior_state"
_CP_COLUMNS = "seq, case_id, transition, kind, step_id, request_hash, generation, analysis_revision, state, artifacts, detail, time"
# Stores made before the column existed get it on their first writing open
# (older builders name their columns, so they still read and write such a
# store; their checkpoints leave it NULL, which nothing is compared with).
_ADD_MANIFEST_COLUMN = "ALTER TABLE checkpoints ADD COLUMN manifest_sha256 TEXT"
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# "A case built for the current revision", as one SQL expression over a cases row `c`.
_BUILT_SQL = (
    "EXISTS (SELECT 1 FROM checkpoints k WHERE k.case_id = c.case_id AND k.kind = 'complete' "
    "AND k.analysis_revision = c.analysis_revision)"
)


class CaseRecord(FrozenRecord):
    """One case as the store knows it: ``case_id``, ``package_id``, ``state``,
    ``analysis_revision``, ``generation``, ``blocked``, ``case_built``.

    ``blocked`` is ``{"code", "route", "retry_after", "prior_state"}`` while
    BLOCKED, else None. ``case_built`` tells whether the current analysis
    revision has a confirmed ``case_built`` checkpoint.
    """

    __slots__ = ("case_id", "package_id", "state", "analysis_revision", "generation", "blocked", "case_built")
    case_id: str
    package_id: str
    state: str
    analysis_revision: int
    generation: int
    blocked: dict | None
    case_built: bool


class Checkpoint(FrozenRecord):
    """One entry of the append-only log; ``state``/``generation``/``analysis_revision`` are after the step."""

    __slots__ = (
        "seq", "case_id", "transition", "kind", "step_id", "request_hash",
        "generation", "analysis_revision", "state", "artifacts", "detail", "time",
    )
    seq: int
    case_id: str
    transition: str
    kind: str
    step_id: str | None
    request_hash: str | None
    generation: int
    analysis_revision: int
    state: str
    artifacts: tuple[str, ...]
    detail: dict | None
    time: str


def _now() -> str:
    # The only clock read in the pipeline: stored in the log, never in case output.
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _db_error(exc: sqlite3.Error, what: str, store: "os.PathLike[str]") -> VianoError:
    """Map a sqlite3 failure to a stable code: busy -> LOCK_TIMEOUT, I/O -> IO_ERROR,
    interrupted -> INTERRUPTED (a host program's ``Connection.interrupt``: the
    transaction rolled back, nothing is corrupt), else INTEGRITY_ERROR.
    The error names ``store`` by its file name (sqlite3's own messages name none)."""
    path = os.path.basename(store)
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name == "SQLITE_INTERRUPT":
        return LifecycleError("INTERRUPTED", f"checkpoint store interrupted while {what}; nothing was recorded", path=path)
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return LifecycleError("LOCK_TIMEOUT", f"checkpoint store busy while {what}: {exc}", path=path)
    if name == "SQLITE_READONLY" and _header_says_unwritable(store):
        return IntegrityError(
            "INTEGRITY_ERROR",
            f"checkpoint store is damaged or not ours ({what}): its header names a file format SQLite will not write",
            path=path,
        )
    if name.startswith(("SQLITE_IOERR", "SQLITE_FULL", "SQLITE_CANTOPEN", "SQLITE_READONLY")):
        return LifecycleError("IO_ERROR", f"checkpoint store I/O failure while {what}: {exc}{path_too_long_for_sqlite(store)}", path=path)
    if isinstance(exc, sqlite3.ProgrammingError) and ("same thread" in str(exc) or "closed database" in str(exc)):
        # sqlite3's own checks, not damage: one store object is one connection,
        # for the thread that made it, until it is closed (a host's
        # CaseBuilder on a worker thread with a store made on the main one
        # was told the store was corrupt).
        return LifecycleError("INVALID_ARGUMENT", f"a CheckpointStore is used only by the thread that made it, and not "
                                                  f"after close() ({what}): make one in each thread", path=path)
    return IntegrityError("INTEGRITY_ERROR", f"checkpoint store is corrupt or not ours ({what}): {exc}", path=path)


#: SQLite's unix files take paths of at most 512 bytes with the terminating
#: NUL, its journal's name included ("-journal", 8 more).
_SQLITE_PATH_BYTES = 512 - 1 - len("-journal")


def path_too_long_for_sqlite(file: "os.PathLike[str] | str", remedy: str = "a shorter workspace path") -> str:
    """The cause to add to SQLite's "unable to open database file" when the
    file's absolute path is past what SQLite opens, else ``""``."""
    length = len(os.fsencode(os.path.abspath(file)))
    if length <= _SQLITE_PATH_BYTES:
        return ""
    return f" (its path is {length} bytes; SQLite opens no file whose path is over {_SQLITE_PATH_BYTES}: {remedy} would do)"


def _header_says_unwritable(store: "os.PathLike[str]") -> bool:
    """Whether the store's header makes SQLite open it read-only: its
    file-format write or read version (bytes 18 and 19) above 2, which no
    SQLite of today writes. Then "attempt to write a readonly database" is
    the file's damage, not a read-only file or filesystem."""
    try:
        with open(store, "rb") as handle:
            header = handle.read(20)
    except OSError:
        return False
    return len(header) == 20 and header.startswith(b"SQLite format 3\x00") and (header[18] > 2 or header[19] > 2)


def _connect_read_only(path, busy_timeout: float) -> tuple[sqlite3.Connection, tuple[str, str] | None, bool]:
    """A read-only connection, and, where it was opened as immutable while a
    writer may be at work (a full disk, a store or folder this user may not
    write),
    why and what to do about a read that looks damaged. A WAL database needs its shared-memory file, which a
    read-only filesystem cannot give when the last writer closed cleanly (and
    removed it), nor a full one when a writer left it short (SQLite's "disk
    I/O error"). Then the file is opened as immutable, which needs none but
    also reads no write-ahead log: refused when one holds changes not yet
    merged, which that read would silently miss. The normal, locked read
    always comes first: beside a writer that opened the store before the disk
    filled, an immutable read may meet half-written pages (see
    :meth:`CheckpointStore.__init__`). (A writer may still work through
    another mount of the same files; what it merges meanwhile an immutable
    read may miss too: status there is a snapshot.) The last value tells
    whether the connection is that immutable one."""
    uri = path.absolute().as_uri()
    if (not os.path.exists(f"{path}-shm") and not os.path.exists(f"{path}-journal") and not os.access(path, os.W_OK)
            and os.access(path, os.R_OK) and not on_read_only_filesystem(path.parent)):
        # (A journal beside it is a killed writer's transaction: the normal
        # read names it, below.)
        # A normal read would make the -wal and -shm files, as this user with
        # the store's mode, and could not remove them: the store's owner could
        # then write it no more (session 23's re-review). Read without them.
        no_access, read_only, full = True, False, False
    else:
        conn = sqlite3.connect(f"{uri}?mode=ro", timeout=busy_timeout, isolation_level=None, uri=True)
        no_access = None
    if no_access is None:
        try:
            conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            return conn, None, False
        except sqlite3.OperationalError as exc:
            conn.close()
            no_access, read_only, full = _why_no_normal_read(exc, path)
    if _wal_holds_changes(path):
        where = ("sits on a full filesystem (no space or no inodes left)" if full else "sits on a read-only filesystem" if read_only
                 else "this user may not write it or its folder")
        raise LifecycleError(
            "IO_ERROR", f"the checkpoint store has changes not yet merged from its write-ahead log and {where}, "
            "where they cannot be read", path=path.name,
        )
    unsure = (("the disk is full", "free some space and run it again") if full
              else ("this user may not write it or its folder", "run it again") if no_access else None)
    return sqlite3.connect(f"{uri}?mode=ro&immutable=1", timeout=busy_timeout, isolation_level=None, uri=True), unsure, True


def _why_no_normal_read(exc: sqlite3.OperationalError, path) -> tuple[bool, bool, bool]:
    """Why the normal read-only open failed, as (no access, read-only
    filesystem, full disk), where an immutable read may stand in for it;
    anything else is raised (a hot journal as its own coded error)."""
    error_name = getattr(exc, "sqlite_errorname", "")
    if error_name == "SQLITE_READONLY_ROLLBACK":
        # A hot rollback journal: a writer died inside a transaction, and
        # only a writer may roll it back. The store writes that journal only
        # while it is created (switching to WAL, before any table exists);
        # if the file is still that one page, it holds no case yet, and the
        # next admission rolls the switch back and creates it anew.
        if _at_most_one_page(path):
            raise LifecycleError("UNKNOWN_CASE", "the workspace's checkpoint store holds no case yet (its creation was interrupted)") from None
        raise LifecycleError(
            "IO_ERROR", "the checkpoint store holds a transaction a killed writer left, which only a writing "
            "command (admit, append, build, reopen) on a writable mount can roll back", path=path.name,
        ) from None
    read_only = error_name == "SQLITE_CANTOPEN" and on_read_only_filesystem(path.parent)
    full = not read_only and out_of_space(path.parent) and (
        error_name.startswith("SQLITE_IOERR") or error_name in ("SQLITE_CANTOPEN", "SQLITE_FULL"))
    # A user who may read the workspace but not write its folder (another
    # user's, or a group's with read access only) cannot make the
    # shared-memory file either: SQLite's "attempt to write a readonly
    # database" for a command that only reads (session 23's review).
    no_access = not (read_only or full) and error_name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN")) and not os.access(
        path.parent, os.W_OK)
    if not (read_only or full or no_access):
        raise exc
    return no_access, read_only, full


def _not_writable_here(path) -> str | None:
    """What of the store (its folder, the file, its -wal and -shm files)
    this process may not write, and whose it is; None if it may write all."""
    if os.geteuid() == 0:
        return None  # root writes all of it (a read-only filesystem is judged before)
    for part in (path.parent, path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        # Judged only on a file that stays the same file around the look:
        # other commands' connections make and remove -wal and -shm all the
        # while, and one gone at the look is no refusal (a writer racing
        # another's close was refused so).
        try:
            before = os.stat(part)
            if os.access(part, os.W_OK):
                continue
            after = os.stat(part)
        except FileNotFoundError:
            continue
        except OSError:
            return None  # SQLite says what is wrong
        if (before.st_dev, before.st_ino, before.st_ctime_ns) == (after.st_dev, after.st_ino, after.st_ctime_ns):
            what = "its folder" if part == path.parent else part.name
            return f"{what} {whose(after)}"
    return None


def _wal_holds_changes(path) -> bool:
    wal = path.with_name(path.name + "-wal")
    try:
        return wal.stat().st_size > 0
    except FileNotFoundError:
        return False


#: Less free space than this, for an unprivileged writer, counts as full for
#: SQLite's shared-memory file (it grows by 32 KiB at a time).
_NEARLY_FULL_BYTES = 1 << 20


def out_of_space(directory) -> bool:
    """Whether the filesystem of ``directory`` is (nearly) out of space or of
    inodes for this process (root may use the blocks a filesystem reserves).
    False when it cannot be told: no statvfs, or a filesystem that reports
    no sizes (a tmpfs with ``size=0`` or ``nr_inodes=0``, which means no
    limit; some FUSE and network filesystems)."""
    try:
        found = os.statvfs(directory)
    except OSError:
        return False
    privileged = hasattr(os, "geteuid") and os.geteuid() == 0
    free_blocks = found.f_bfree if privileged else found.f_bavail
    free_inodes = found.f_ffree if privileged else found.f_favail
    no_space = found.f_blocks > 0 and free_blocks * found.f_frsize < _NEARLY_FULL_BYTES
    no_inodes = found.f_files > 0 and free_inodes == 0
    return no_space or no_inodes


def _at_most_one_page(path) -> bool:
    """Whether the database file is no larger than one page (its page size,
    bytes 16-17 of the header, 1 meaning 65536): a store being created."""
    try:
        with open(path, "rb") as handle:
            header = handle.read(18)
            size = os.fstat(handle.fileno()).st_size
    except OSError:
        return False
    if len(header) < 18:
        return True
    page = int.from_bytes(header[16:18], "big")
    return size <= (65536 if page == 1 else page)


def on_read_only_filesystem(directory) -> bool:
    """Whether ``directory`` is on a filesystem mounted read-only (False when it cannot be told)."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def admitted_case_dirs(workspace: Workspace) -> list[str]:
    """The case directories whose admission committed: an admission renames
    its tree into ``cases/`` with a marker and removes the marker only after
    its store row committed, so each of these had a row in the store."""
    try:
        names = sorted(os.listdir(workspace.cases_dir))
    except OSError:
        return []
    found = []
    for name in names:
        try:
            if stat.S_ISDIR(os.lstat(workspace.cases_dir / name).st_mode) and not os.path.lexists(
                workspace.cases_dir / name / ADMISSION_MARKER
            ):
                found.append(name)
        except OSError:
            continue
    return found


def store_file_looks_lost(path) -> str | None:
    """What the store file alone says of a lost store: "missing", "empty"
    (0 bytes), "without its tables" (one page at most, which the schema
    outgrows); None when it may hold the schema, or a write-ahead log beside
    it may."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing"
    except OSError:
        return None
    try:
        if os.stat(f"{path}-wal").st_size > 0:
            return None
    except OSError:
        pass
    if size == 0:
        return "empty"
    return "without its tables" if _at_most_one_page(path) else None


def refuse_a_lost_store(workspace: Workspace, how: str) -> None:
    """``INTEGRITY_ERROR`` when the store is ``how`` ("missing", "empty",
    "without its tables") while the workspace holds admitted cases: their
    rows are lost, and making a store anew would strand every one of them
    (RELIABILITY 41: never a silent reset). Nothing is written."""
    admitted = admitted_case_dirs(workspace)
    if admitted:
        shown = ", ".join(admitted[:3]) + (f" and {len(admitted) - 3} more" if len(admitted) > 3 else "")
        raise IntegrityError(
            "INTEGRITY_ERROR",
            f"the checkpoint store is {how} but the workspace holds admitted cases ({shown}): it was lost or cut "
            "short, and is never made anew over them; restore it from a backup; nothing was changed",
            path=workspace.store_path.name,
        )


def _invalid(message: str) -> LifecycleError:
    return LifecycleError("INVALID_ARGUMENT", message)


def _is_int(value: Any) -> bool:
    return type(value) is int


# The store's files as an opening in this process saw them, where that
# opening found the store sound by PRAGMA quick_check and nothing changed the
# files while its connection was open (not even its own writes). A later
# opening that finds them so again, within a minute of that check, skips
# quick_check, which reads the whole store: a no-op build opens it twice and
# status three times, and with tens of thousands of cases each check cost
# ~0.1 s. A change to the files through their system calls (an edit, a copy
# over them, a cut, a time put back) gives them another change time, size or
# inode. Not seen: a write through a shared mapping into a page already
# written (no time changes) and damage below the filesystem; hence the
# minute, so that a long-running host still checks the store again. Files
# changed within two seconds before the look are not remembered: the kernel
# stamps times at a clock tick (some filesystems at a second or two), so a
# change right after the look could carry the same times.
_FOUND_SOUND: dict[tuple[int, int], tuple[tuple, int]] = {}
_SETTLED_NS = 2_000_000_000
_TRUSTED_FOR_NS = 60_000_000_000


def _store_files_now(path) -> tuple | None:
    """The store's and its write-ahead log's identity, size and times."""
    try:
        main = os.stat(path)
    except OSError:
        return None
    try:
        log = os.stat(f"{path}-wal")
    except FileNotFoundError:
        log_now = None
    except OSError:
        return None
    else:
        # An empty log holds no page; a reader makes one and leaves it. (SQLite
        # run as root gives a log the store's owner at every opening, which
        # stamps its change time: a store with frames in its log is then never
        # remembered, which only costs checks.)
        log_now = (log.st_ino, log.st_size, log.st_mtime_ns, log.st_ctime_ns) if log.st_size else None
    return (main.st_dev, main.st_ino, main.st_size, main.st_mtime_ns, main.st_ctime_ns, log_now)


def _found_sound_before(files: tuple | None) -> bool:
    remembered = _FOUND_SOUND.get(files[:2]) if files is not None else None
    return (remembered is not None and remembered[0] == files
            and time.monotonic_ns() - remembered[1] < _TRUSTED_FOR_NS)


def _remember_sound(path, files: tuple | None, looked_at_ns: int, checked: bool) -> None:
    """At a sound opening's close: ``files`` as that opening saw them (at
    ``looked_at_ns``), remembered if they are still so and were settled
    then; ``checked`` whether the opening ran quick_check (an opening that
    trusted the memo does not prolong it)."""
    if files is None:
        return
    log = files[5]
    settled = max(files[3], files[4], *(log[2:] if log else ())) < looked_at_ns - _SETTLED_NS
    if not (settled and _store_files_now(path) == files):
        _FOUND_SOUND.pop(files[:2], None)
    elif checked:
        _FOUND_SOUND[files[:2]] = (files, time.monotonic_ns())


class CheckpointStore:
    """Transactional lifecycle store at ``workspace.store_path`` (see the module docstring).

    ``create=False`` refuses to create a missing store (``UNKNOWN_CASE``), so
    read-only commands leave an empty workspace untouched.
    """

    def __init__(self, workspace: Workspace, *, busy_timeout: float = 30.0, create: bool = True, read_only: bool = False) -> None:
        """Open (and by default create) the workspace's store. ``read_only``
        is for the commands that only observe (status, probes): the file is
        opened read-only, its journal mode and schema are left as they are,
        and a store without the schema holds no case (``UNKNOWN_CASE``)."""
        if not isinstance(workspace, Workspace):
            raise LifecycleError("INVALID_ARGUMENT", f"CheckpointStore takes a Workspace (CheckpointStore(Workspace(path))), "
                                                     f"not {type(workspace).__name__}")
        self.workspace = workspace
        path = workspace.store_path
        try:
            refuse_symlinks(workspace, path.name, f"{path.name}-wal", f"{path.name}-shm")
            exists = path.exists()
        except OSError as error:
            # A path too long for the filesystem, say: pathlib's exists()
            # answers only "no such file" itself.
            raise coded_io_error(error, LifecycleError) from None
        if not exists:
            refuse_a_lost_store(workspace, "missing")
            if not create or read_only:
                raise LifecycleError("UNKNOWN_CASE", "the workspace has no checkpoint store yet")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # Made here rather than by SQLite (0644 whatever the umask), so
                # that the umask decides, as for every file of the workspace: a
                # workspace shared through a group (umask 002) needs its store,
                # and the -wal/-shm files SQLite gives the store's mode,
                # writable by the group.
                with contextlib.suppress(FileExistsError):
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666))
            except (FileExistsError, NotADirectoryError):
                # The workspace root, or a folder on its way, is a file: what
                # the commands say of it too, never a bare OSError.
                raise LifecycleError("INVALID_ARGUMENT", "the workspace is not a directory", path=os.fspath(path.parent)) from None
            except OSError as error:
                raise coded_io_error(error, LifecycleError) from None
        elif not stat.S_ISREG(os.stat(path).st_mode):
            # A FIFO would hold a read-only open until some writer came.
            raise LifecycleError("IO_ERROR", "the checkpoint store is not a regular file", path=path.name)
        elif os.stat(path).st_size == 0 and not os.path.exists(f"{path}-wal"):
            # SQLite takes an empty file for an empty database, and a writer
            # would give it a fresh schema. (With a write-ahead log beside it
            # the log may still hold every table.)
            refuse_a_lost_store(workspace, "empty")
        if not read_only and on_read_only_filesystem(path.parent):
            # SQLite's own word for it is "unable to open database file".
            raise LifecycleError("IO_ERROR", "the workspace's filesystem is read-only, where the checkpoint store cannot be written",
                                 path=path.name)
        unwritable = None if read_only else _not_writable_here(path)
        if unwritable is not None:
            # SQLite opens such a store read-only without a word and refuses
            # the first write ("attempt to write a readonly database"), after
            # a reopen or append had published its generation.
            raise LifecycleError("IO_ERROR", f"this user cannot write the checkpoint store: {unwritable}", path=path.name)
        if not read_only and out_of_space(path.parent):
            # A writer on a full disk fails anyway; and where blocks are
            # smaller than 4 KiB, SQLite's store into a shared-memory page the
            # disk never backed is SIGBUS, a death without a line.
            raise LifecycleError(
                "IO_ERROR", f"the workspace's filesystem is full (under {_NEARLY_FULL_BYTES >> 20} MiB or no inode left), "
                "where the checkpoint store cannot be written", path=path.name,
            )
        self._sound_look = None
        looked, looked_at = _store_files_now(path), time.time_ns()
        found_sound_before = _found_sound_before(looked)
        try:
            read_unsure, immutable = None, False
            if read_only:
                conn, read_unsure, immutable = _connect_read_only(path, busy_timeout)
            else:
                conn = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None)
        except sqlite3.Error as exc:
            raise _db_error(exc, "opening", path) from None
        self._conn = conn
        self._read_unsure = read_unsure
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            if not read_only and not conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
            ).fetchone():
                # Before the journal mode is set, which rewrites the header.
                refuse_a_lost_store(workspace, "without its tables")
            if not read_only:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = FULL")
                conn.execute("PRAGMA foreign_keys = ON")
            if not found_sound_before:
                problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
                if problems != ["ok"]:
                    # sqlite3's own findings on one line (not a list's repr, which
                    # the printer would escape a second time).
                    found = "; ".join(" ".join(str(problem).split()) for problem in problems[:3])
                    raise self._unsure(IntegrityError("INTEGRITY_ERROR", f"checkpoint store failed its integrity check: {found}", path=path.name))
            if read_only:
                self._check_schema()
            else:
                self._ensure_schema()
        except sqlite3.Error as exc:
            conn.close()
            raise self._unsure(_db_error(exc, "opening", path)) from None
        except VianoError as error:
            conn.close()
            raise self._unsure(error) from None
        except BaseException:
            conn.close()
            raise
        # An immutable read sees no write-ahead log, so its check did not
        # cover what the next normal opening reads.
        self._sound_look = None if immutable else (looked, looked_at, not found_sound_before)

    # ---------------------------------------------------------------- plumbing

    def close(self) -> None:
        """Close the connection (the last close also checkpoints the WAL into the database)."""
        try:
            self._conn.close()
        except sqlite3.ProgrammingError as exc:
            raise _db_error(exc, "closing", self.workspace.store_path) from None
        look, self._sound_look = self._sound_look, None
        if look is not None:
            _remember_sound(self.workspace.store_path, *look)

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_schema(self) -> None:
        """The schema is ours, or there is none yet (then no case is in the store)."""
        conn = self._conn
        has_meta = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
        if not has_meta:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables & {"cases", "checkpoints"}:
                raise IntegrityError("INTEGRITY_ERROR", "checkpoint store has tables but no schema version: not ours")
            refuse_a_lost_store(self.workspace, "without its tables")
            raise LifecycleError("UNKNOWN_CASE", "the workspace's checkpoint store holds no case yet")
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None or row[0] != str(SCHEMA_VERSION):
            raise IntegrityError("INTEGRITY_ERROR", f"checkpoint store has schema version {row[0] if row else None!r}, expected {SCHEMA_VERSION}")
        self._manifest_column = self._has_manifest_column()

    def _has_manifest_column(self) -> bool:
        return any(row[1] == "manifest_sha256" for row in self._conn.execute("PRAGMA table_info(checkpoints)"))

    def _ensure_schema(self) -> None:
        conn = self._conn
        self._manifest_column = True
        # Fast path without a write lock, so opening never waits for a busy writer.
        has_meta = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
        if has_meta:
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is not None and row[0] == str(SCHEMA_VERSION) and self._has_manifest_column():
                return
        conn.execute("BEGIN IMMEDIATE")
        try:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "meta" not in tables and tables & {"cases", "checkpoints"}:
                raise IntegrityError("INTEGRITY_ERROR", "checkpoint store has tables but no schema version: not ours")
            if "meta" not in tables:
                refuse_a_lost_store(self.workspace, "without its tables")
            # executescript() would COMMIT our BEGIN IMMEDIATE; run statement by statement.
            # (Trigger bodies hold "; END", never ";\n", so this split keeps them whole.)
            for statement in _SCHEMA.split(";\n"):
                if statement.strip():
                    conn.execute(statement)
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif row[0] != str(SCHEMA_VERSION):
                raise IntegrityError("INTEGRITY_ERROR", f"checkpoint store has schema version {row[0]!r}, expected {SCHEMA_VERSION}")
            if not self._has_manifest_column():
                conn.execute(_ADD_MANIFEST_COLUMN)
            conn.execute("COMMIT")
        except BaseException:
            # A COMMIT that failed for a full disk has rolled back already:
            # a ROLLBACK then fails too ("no transaction is active"), and
            # its error must not replace the one that says what happened.
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise

    def _write(self, body, what: str):
        """Run ``body(conn)`` in one BEGIN IMMEDIATE transaction; roll back on any error."""
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise _db_error(exc, what, self.workspace.store_path) from None
        try:
            result = body(conn)
        except BaseException as exc:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(exc, sqlite3.Error):
                raise _db_error(exc, what, self.workspace.store_path) from None
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise _db_error(exc, what, self.workspace.store_path) from None
        return result

    def _read(self, sql: str, args: tuple, what: str) -> list[tuple]:
        try:
            return self._conn.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise self._unsure(_db_error(exc, what, self.workspace.store_path)) from None

    def _unsure(self, error: VianoError) -> VianoError:
        """A store read as immutable on a full disk may have met pages a
        writer (one that opened it before the disk filled) was writing: what
        looks like damage there is reported as a read to retry, not as a
        damaged store (``INTEGRITY_ERROR`` stands once space is freed)."""
        if not (self._read_unsure and error.code == "INTEGRITY_ERROR"):
            return error
        cause, advice = self._read_unsure
        return LifecycleError(
            "IO_ERROR", f"the checkpoint store could not be read consistently: {cause}, so it was read without "
            f"its shared-memory file while a writer may be at work ({error.message}); {advice}",
            path=error.path,
        )

    # ---------------------------------------------------------------- decoding rows

    @staticmethod
    def _record(row: tuple) -> CaseRecord:
        case_id, package_id, state, revision, generation, blocked, prior_state, built = row
        if state not in STATES:
            raise IntegrityError("INTEGRITY_ERROR", f"case {case_id} has unknown state {state!r}")
        info = None
        if state == "BLOCKED":
            try:
                stored = json.loads(blocked)
            except (TypeError, ValueError):
                stored = None
            if not isinstance(stored, dict):
                raise IntegrityError("INTEGRITY_ERROR", f"case {case_id} has a corrupt block record")
            info = {"code": stored.get("code"), "route": stored.get("route"), "retry_after": stored.get("retry_after"),
                    "prior_state": prior_state}
        return CaseRecord(case_id, package_id, state, revision, generation, info, bool(built))

    @staticmethod
    def _checkpoint(row: tuple) -> Checkpoint:
        seq, case_id, transition, kind, step_id, request_hash, generation, revision, state, artifacts, detail, time = row
        try:
            arts = tuple(json.loads(artifacts))
            det = json.loads(detail) if detail is not None else None
        except (TypeError, ValueError):
            raise IntegrityError("INTEGRITY_ERROR", f"checkpoint {seq} of case {case_id} is corrupt") from None
        return Checkpoint(seq, case_id, transition, kind, step_id, request_hash, generation, revision, state, arts, det, time)

    def _get(self, conn: sqlite3.Connection, case_id: str) -> CaseRecord | None:
        row = conn.execute(
            f"SELECT {_CASE_COLUMNS}, {_BUILT_SQL} FROM cases c WHERE c.case_id = ?", (case_id,)
        ).fetchone()
        return None if row is None else self._record(row)

    def _confirmed(self, conn: sqlite3.Connection, case_id: str, step_id: str) -> Checkpoint | None:
        row = conn.execute(
            f"SELECT {_CP_COLUMNS} FROM checkpoints WHERE case_id = ? AND kind = 'complete' AND step_id = ? "
            "ORDER BY seq DESC LIMIT 1",
            (case_id, step_id),
        ).fetchone()
        return None if row is None else self._checkpoint(row)

    @staticmethod
    def _append(conn, case_id, transition, step_id, request_hash, generation, revision, state, artifacts, detail,
                manifest_sha256: str | None = None) -> Checkpoint:
        time = _now()
        arts = json.dumps(list(artifacts), ensure_ascii=False)
        det = None if detail is None else json.dumps(detail, sort_keys=True, ensure_ascii=False)
        cur = conn.execute(
            "INSERT INTO checkpoints (case_id, transition, kind, step_id, request_hash, generation, analysis_revision, "
            "state, artifacts, detail, time, manifest_sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (case_id, transition, _KIND.get(transition, transition), step_id, request_hash, generation, revision, state,
             arts, det, time, manifest_sha256),
        )
        return Checkpoint(cur.lastrowid, case_id, transition, _KIND.get(transition, transition), step_id, request_hash,
                          generation, revision, state, tuple(artifacts), detail, time)

    # ---------------------------------------------------------------- public API

    def admit(self, case_id: str, package_id: str, analysis_revision: int, generation: int = 1, *,
              manifest_sha256: str | None = None) -> CaseRecord:
        """Record a newly admitted case in VALIDATED; ``CASE_EXISTS`` if the id is taken.

        ``manifest_sha256``: the SHA-256 of the admitted generation's manifest
        bytes, which ties this store's record to the package it was made for
        (:meth:`recorded_manifest`)."""
        validate_id(case_id, "case id")
        validate_id(package_id, "package id")
        _check_manifest_sha256(manifest_sha256)
        if not _is_int(analysis_revision) or analysis_revision < 1:
            raise _invalid("analysis_revision must be an integer >= 1")
        if not _is_int(generation) or generation < 1:
            raise _invalid("generation must be an integer >= 1")

        def body(conn):
            if conn.execute("SELECT 1 FROM cases WHERE case_id = ?", (case_id,)).fetchone():
                raise LifecycleError("CASE_EXISTS", f"case {case_id} was already admitted")
            conn.execute(
                "INSERT INTO cases (case_id, package_id, state, analysis_revision, generation) VALUES (?, ?, ?, ?, ?)",
                (case_id, package_id, "VALIDATED", analysis_revision, generation),
            )
            self._append(conn, case_id, "admit", None, None, generation, analysis_revision, "VALIDATED", (), None,
                         manifest_sha256)
            return self._get(conn, case_id)

        return self._write(body, f"admitting {case_id}")

    def exists(self, case_id: str) -> bool:
        """True if the case was admitted."""
        validate_id(case_id, "case id")
        return bool(self._read("SELECT 1 FROM cases WHERE case_id = ?", (case_id,), "reading a case"))

    def get(self, case_id: str) -> CaseRecord:
        """The case's current record; ``UNKNOWN_CASE`` if it was never admitted."""
        validate_id(case_id, "case id")
        rows = self._read(f"SELECT {_CASE_COLUMNS}, {_BUILT_SQL} FROM cases c WHERE c.case_id = ?", (case_id,), "reading a case")
        if not rows:
            raise LifecycleError("UNKNOWN_CASE", f"no case {case_id} in this workspace")
        return self._record(rows[0])

    def case_ids(self) -> list[str]:
        """Every admitted case id, sorted."""
        return [row[0] for row in self._read("SELECT case_id FROM cases ORDER BY case_id", (), "listing cases")]

    def checkpoints(self, case_id: str) -> list[Checkpoint]:
        """The case's log in order (empty for an unknown case)."""
        validate_id(case_id, "case id")
        rows = self._read(f"SELECT {_CP_COLUMNS} FROM checkpoints WHERE case_id = ? ORDER BY seq", (case_id,), "reading checkpoints")
        return [self._checkpoint(row) for row in rows]

    def confirmed(self, case_id: str, step_id: str) -> Checkpoint | None:
        """The latest ``case_built`` (kind "complete") checkpoint of ``step_id``, or None."""
        validate_id(case_id, "case id")
        try:
            return self._confirmed(self._conn, case_id, step_id)
        except sqlite3.Error as exc:
            raise self._unsure(_db_error(exc, "reading checkpoints", self.workspace.store_path)) from None

    def recorded_manifest(self, case_id: str, generation: int) -> tuple[int, str] | None:
        """``(generation, sha256)``: the latest generation at or below
        ``generation`` whose manifest digest the store recorded when it took
        that generation in (admit, intake, reopen, case_built), or None when
        it recorded none (a store older than the record; a builder before
        session 16 leaves the digest out of the steps it records, so the
        latest one recorded may be an earlier generation's). The package's
        manifest of that generation must still have it: manifests are
        immutable, so another digest means the store was made for another
        copy of the package (a store copied from another workspace)."""
        validate_id(case_id, "case id")
        if not self._manifest_column:
            return None
        rows = self._read(
            "SELECT generation, manifest_sha256 FROM checkpoints WHERE case_id = ? AND generation <= ? "
            "AND manifest_sha256 IS NOT NULL ORDER BY generation DESC, seq LIMIT 1",
            (case_id, generation),
            "reading checkpoints",
        )
        if not rows:
            return None
        recorded_generation, digest = rows[0]
        if not isinstance(digest, str) or _SHA256_RE.fullmatch(digest) is None:
            raise IntegrityError("INTEGRITY_ERROR", f"case {case_id}'s record of generation {recorded_generation} is corrupt",
                                 path=self.workspace.store_path.name)
        return recorded_generation, digest

    def advance(
        self,
        case_id: str,
        transition: str,
        *,
        expected_generation: int,
        step_id: str | None = None,
        request_hash: str | None = None,
        new_generation: int | None = None,
        artifacts: Iterable[str] = (),
        detail: dict | None = None,
        manifest_sha256: str | None = None,
    ) -> Checkpoint:
        """Apply ``transition`` if the case is still at ``expected_generation``; return its checkpoint.

        Checks, in order, inside one transaction: unknown case ->
        ``UNKNOWN_CASE``; a ``case_built`` whose (step_id, request_hash) is
        already confirmed -> that checkpoint, whatever the generation or state
        (replay); generation moved -> ``STALE_GENERATION``; the state forbids
        the step -> ``ILLEGAL_TRANSITION``; another case already built for this
        revision -> ``REOPEN_REQUIRED``. A refusal changes nothing.

        Arguments: ``start_build`` needs ``step_id`` and ``case_built`` needs
        ``step_id``, ``request_hash`` and ``new_generation``; the step id must
        be :func:`step_id_for` of the case's current analysis revision (a
        malformed one is ``INVALID_ARGUMENT``, one of another revision or
        builder version ``ILLEGAL_TRANSITION``) and ``case_built``'s
        ``new_generation`` must be greater than the case's generation
        (else ``ILLEGAL_TRANSITION``); ``intake`` needs
        ``new_generation`` > the current one; ``reopen`` may take one;
        ``block`` needs ``detail={"code", "route", "retry_after"}`` (code a
        non-empty string, route a string, retry_after None, seconds >= 0 or a
        string); other transitions keep ``detail`` as a note (e.g. who reopened
        and why). ``manifest_sha256`` (optional) is the SHA-256 of
        ``new_generation``'s manifest bytes, for the steps that take a
        generation in (``intake``, ``case_built``, ``reopen`` with a
        ``new_generation``); see :meth:`recorded_manifest`.

        ``intake`` is allowed while BLOCKED -- the package already holds the
        published generation, and the store must not fall behind it; the case
        stays BLOCKED with the same prior state -- and refused when COMPLETED
        (``ILLEGAL_TRANSITION``: a completed case takes no new inputs until it
        is reopened), and when BLOCKED from COMPLETED (``REOPEN_REQUIRED``:
        blocking and resuming must not be a way around the reopen).
        """
        validate_id(case_id, "case id")
        if transition not in TRANSITIONS:
            raise _invalid(f"unknown transition {transition!r}")
        if not _is_int(expected_generation) or expected_generation < 0:
            raise _invalid("expected_generation must be an integer >= 0")
        if new_generation is not None and (not _is_int(new_generation) or new_generation < 0):
            raise _invalid("new_generation must be an integer >= 0")
        artifacts = tuple(artifacts)
        if not all(isinstance(a, str) for a in artifacts):
            raise _invalid("artifacts must be strings")
        if detail is not None:
            if not isinstance(detail, dict):
                raise _invalid("detail must be a JSON object")
            try:
                json.dumps(detail, allow_nan=False)
            except (TypeError, ValueError):
                raise _invalid("detail must be JSON-serialisable") from None
        if transition in ("start_build", "case_built"):
            if not isinstance(step_id, str) or _STEP_ID_RE.fullmatch(step_id) is None:
                raise _invalid(f"{transition} needs a step_id of the form case-build/v<version>/r<revision>, not {step_id!r}")
        if transition == "case_built":
            if not isinstance(request_hash, str) or not request_hash:
                raise _invalid("case_built needs a request_hash")
            if new_generation is None:
                raise _invalid("case_built needs new_generation")
        if transition == "intake" and new_generation is None:
            raise _invalid("intake needs new_generation")
        _check_manifest_sha256(manifest_sha256)
        if manifest_sha256 is not None and (transition not in ("intake", "case_built", "reopen") or new_generation is None):
            raise _invalid("manifest_sha256 goes with a step that takes in a new_generation (intake, case_built, reopen)")
        if transition == "block":
            _check_block(detail)

        def body(conn):
            rec = self._get(conn, case_id)
            if rec is None:
                raise LifecycleError("UNKNOWN_CASE", f"no case {case_id} in this workspace")
            if transition == "case_built":
                prior = self._confirmed(conn, case_id, step_id)
                if prior is not None and prior.request_hash == request_hash:
                    return prior  # replay of a confirmed request: nothing to do
            if rec.generation != expected_generation:
                raise LifecycleError(
                    "STALE_GENERATION",
                    f"case {case_id} is at generation {rec.generation}, not {expected_generation}",
                )
            state, revision, generation = rec.state, rec.analysis_revision, rec.generation
            blocked_json, prior_state = None, None

            def illegal(why: str = "") -> LifecycleError:
                return LifecycleError(
                    "ILLEGAL_TRANSITION", f"{transition} is not allowed from {rec.state}{why} (case {case_id})"
                )

            def check_step() -> None:
                # Only the current revision's step: confirming another
                # revision's would rewrite what that revision is recorded as
                # having built.
                if step_id != step_id_for(revision):
                    raise illegal(f" with step {step_id!r}: analysis revision {revision} builds as {step_id_for(revision)!r}")

            if transition == "start_build":
                if state not in ("VALIDATED", "REOPENED"):
                    raise illegal()
                check_step()
                state = "BUILDING_CASE"
            elif transition == "case_built":
                if state != "BUILDING_CASE":
                    raise illegal()
                check_step()
                if rec.case_built:
                    raise LifecycleError(
                        "REOPEN_REQUIRED",
                        f"analysis revision {revision} of case {case_id} already has a built case; reopen to change it",
                    )
                if new_generation <= generation:
                    raise illegal(f" with new_generation {new_generation}: a built case publishes a generation after {generation}")
                generation = new_generation
            elif transition == "intake":
                if state == "COMPLETED":
                    raise illegal()
                if state == "BLOCKED" and rec.blocked["prior_state"] == "COMPLETED":
                    raise LifecycleError(
                        "REOPEN_REQUIRED",
                        f"case {case_id} was COMPLETED before it was blocked; reopen it before it takes new inputs",
                    )
                if new_generation <= generation:
                    raise _invalid(f"intake needs a generation newer than {generation}")
                generation = new_generation
                if state == "BLOCKED":
                    blocked_json, prior_state = json.dumps(rec.blocked, sort_keys=True), rec.blocked["prior_state"]
            elif transition == "reopen":
                if not (state == "COMPLETED" or (state == "BUILDING_CASE" and rec.case_built)):
                    raise illegal("" if state != "BUILDING_CASE" else " before a case is built")
                if new_generation is not None:
                    if new_generation < generation:
                        raise _invalid(f"new_generation {new_generation} is older than the case's {generation}")
                    generation = new_generation
                state, revision = "REOPENED", revision + 1
            elif transition == "block":
                if state == "BLOCKED":
                    raise illegal()
                prior_state, state = state, "BLOCKED"
                blocked_json = json.dumps(
                    {"code": detail["code"], "route": detail["route"], "retry_after": detail.get("retry_after"),
                     "prior_state": prior_state},
                    sort_keys=True,
                )
            elif transition == "resume":
                if state != "BLOCKED":
                    raise illegal()
                state = rec.blocked["prior_state"]
            elif transition == "complete":
                if not (state == "BUILDING_CASE" and rec.case_built):
                    raise illegal("" if state != "BUILDING_CASE" else " before a case is built")
                state = "COMPLETED"

            conn.execute(
                "UPDATE cases SET state = ?, analysis_revision = ?, generation = ?, blocked = ?, prior_state = ? "
                "WHERE case_id = ?",
                (state, revision, generation, blocked_json, prior_state, case_id),
            )
            # A reopen without a new generation records no manifest.
            digest = manifest_sha256 if generation == new_generation else None
            return self._append(conn, case_id, transition, step_id, request_hash, generation, revision, state, artifacts,
                                detail, digest)

        return self._write(body, f"{transition} of {case_id}")


def _check_manifest_sha256(digest: str | None) -> None:
    if digest is not None and (not isinstance(digest, str) or _SHA256_RE.fullmatch(digest) is None):
        raise _invalid("manifest_sha256 must be a lower-case SHA-256 hex digest")


def _check_block(detail: dict | None) -> None:
    if detail is None:
        raise _invalid("block needs detail={code, route, retry_after}")
    unknown = set(detail) - {"code", "route", "retry_after", "by", "reason"}
    if unknown:
        raise _invalid(f"unknown block detail fields {sorted(unknown)}")
    if not isinstance(detail.get("code"), str) or not detail["code"]:
        raise _invalid("block needs a non-empty code")
    if not isinstance(detail.get("route"), str):
        raise _invalid("block needs a route string")
    retry = detail.get("retry_after")
    if not (retry is None or isinstance(retry, str) or (type(retry) in (int, float) and retry >= 0)):
        raise _invalid("retry_after must be None, seconds >= 0 or a string")

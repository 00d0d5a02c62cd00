"""CaseBuilder: the build steps as functions, shared by doit tasks and the Python API.

Each ``step_*`` function is one doit task action (module level, picklable) and
does its own I/O at the edge: it reads verified inputs, calls a pure core
(:func:`pipeline.assemble.assemble`, :func:`pipeline.summary.render_summary`)
and writes a cache record. Only :func:`step_publish` touches the package and
the CheckpointStore, under the case lock, and it is idempotent: a repeat with
the same request hash reuses the confirmed output and creates no generation,
and a crash after publication is confirmed on retry (see recovery.py).
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from . import BUILDER_VERSION
from .cache import BuildCache
from .errors import CaseBuildError, IntegrityError, VianoError, coded_io_error, one_line
from .doitcli import digest_of_version, file_version, remember_output
from .jsoncanon import EncodedTooLarge, decode_strict, encode_sorted, pretty_bytes, sha256_hex
from .limits import CaseBuilderLimits
from .plan import check_limits, make_plan, raise_hint, step_id_for

__all__ = [
    "CaseBuilder",
    "BuildResult",
    "hold_case_lock",
    "step_validate_index",
    "step_read_input",
    "step_hash_context",
    "step_assemble",
    "step_render",
    "step_publish",
    "publish_is_current",
    "document_readers",
    "leave_prior_view",
    "report_build",
]

_HELD: dict[tuple[str, str], object] = {}

# The store a doit run's validate_index opened, kept open for its publish
# (by workspace and case): opening the store checks it and starts a WAL
# session, and closing it checkpoints and removes the WAL (two fsyncs), a
# few milliseconds of an append rebuild each. Only in the main thread of a
# run that holds the case lock for its lifetime (the doit command line), so
# nothing else can change the store in between; closed before this process
# forks (a child must never use or close its parent's connection: SQLite's
# locks are the process's) and before the case lock is left at exit.
_RUN_STORES: dict[tuple[str, str], object] = {}

# The case assemble built in this process, with the bytes it wrote: render
# and publish run right after it in the same doit process, and decoding
# megabytes of JSON back into the very same dict costs each of them
# milliseconds. Matched by content, so a record changed in between is decoded.
_ASSEMBLED: list[tuple[bytes, dict]] = []
# What render needs of assemble to splice the summary and leave the state
# for the next append rebuild, by case cache directory (one build of a case
# at a time, under its lock; other cases may build in other threads): (case
# bytes, the part assembled or None when assembled whole, the previous
# summary, the state carried on, the inputs, the prior case's sources).
_SPLICING: dict[str, tuple[bytes, dict | None, bytes | None, dict | None, list, list]] = {}
# The outputs this process wrote to the cache, by path: (file version, bytes).
# A later step of the same run takes the very bytes object instead of reading
# megabytes back, as long as the file is still that version; publication then
# finds its digest already known (jsoncanon.sha256_hex).
_WRITTEN: dict[str, tuple[tuple, bytes]] = {}
_WRITTEN_GUARD = threading.Lock()  # builds of other cases may run in other threads


# The outputs this process wrote, by path: (file version, sha256). Unlike
# _WRITTEN it holds no bytes, so it keeps every case's (bounded): a build
# that publishes checks what it did not write itself (_check_outputs_as_written).
_WRITTEN_VERSIONS: dict[str, tuple[tuple, str]] = {}
_WRITTEN_VERSIONS_LIMIT = 256


def _write_output(cache: BuildCache, path: Path, data: bytes, made_from: str) -> None:
    """Write a step's output, remembering its digest and ``made_from``, the
    digest of the plan (case) or case (summary) it was made from."""
    cache.write(path, data, flush_on_replace=False)
    version = remember_output(path, data, made_from)
    with _WRITTEN_GUARD:
        _WRITTEN_VERSIONS.pop(os.fspath(path), None)
        _WRITTEN_VERSIONS[os.fspath(path)] = (version, sha256_hex(data))
        for stale in list(_WRITTEN_VERSIONS)[: max(0, len(_WRITTEN_VERSIONS) - _WRITTEN_VERSIONS_LIMIT)]:
            del _WRITTEN_VERSIONS[stale]
    # Only the run's own outputs are held: a process that builds case after
    # case (CaseBuilder) keeps those of one case directory at a time.
    with _WRITTEN_GUARD:
        for other in [p for p in _WRITTEN if os.path.dirname(p) != os.fspath(path.parent)]:
            del _WRITTEN[other]
        _WRITTEN[os.fspath(path)] = (version, data)


def _read_output(cache: BuildCache, path: Path, limit: int) -> bytes:
    """A cache output's bytes: the object this process wrote when the file
    is still that version, else read, bounded by the output's ``limit``."""
    with _WRITTEN_GUARD:
        held = _WRITTEN.get(os.fspath(path))
    if held is not None:
        try:
            if file_version(path) == held[0]:
                return held[1]
        except OSError:
            pass
    data, version = cache.read_bytes_and_version(path, limit)
    digest_of_version(version, data)  # known, or hashed once for every later look
    return data


def _made_before(read, case_id: str, step: str, lacking: str, maker: str):
    """``read()``, where a missing file means the step that makes it did not
    run before ``step`` (``doit -s STEP`` runs that step alone): said as
    ``NOT_BUILT`` with what to run, not as an ``IO_ERROR`` of the machine."""
    try:
        return read()
    except FileNotFoundError:
        raise CaseBuildError("NOT_BUILT", f"case {case_id} has no {lacking} yet: {step} ran without {maker} "
                                          f"(`doit -s {step}` runs only that step): run `doit build case={case_id}`") from None


def _case_from(data: bytes) -> dict:
    import msgspec

    for written, case in _ASSEMBLED:
        if written is data or written == data:
            return case
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as error:
        raise IntegrityError("INTEGRITY_ERROR", f"corrupt cache record: {error}", path="case.json") from None
_CASE_BUILT_FORMAT = "viano-case-built"


def _workspace(root):
    from .workspace import Workspace

    return Workspace(Path(root))


def _store(ws):
    from .lifecycle import CheckpointStore

    return CheckpointStore(ws)


def open_existing_store(ws, case_id: str, *, read_only: bool = False):
    """The store of a workspace that holds ``case_id``; never creates one
    (``read_only``: never writes to it either, for the commands that observe)."""
    from .errors import LifecycleError
    from .lifecycle import CheckpointStore

    if os.path.lexists(ws.root) and not os.path.isdir(ws.root):
        # As admission says it: a workspace that is a file holds no case.
        raise VianoError("INVALID_ARGUMENT", "the workspace is not a directory", path=os.fspath(ws.root))
    if not ws.store_path.exists():
        from .lifecycle import refuse_a_lost_store

        refuse_a_lost_store(ws, "missing")
        raise LifecycleError("UNKNOWN_CASE", f"no case {case_id} (the workspace has no store)", path=os.fspath(ws.root))
    try:
        store = CheckpointStore(ws, read_only=read_only)
    except LifecycleError as error:
        if error.code == "UNKNOWN_CASE":
            raise _unknown_case(ws, case_id) from None
        raise
    try:
        known = store.exists(case_id)
    except BaseException:
        store.close()
        raise
    if not known:
        store.close()
        raise _unknown_case(ws, case_id)
    return store


def _unknown_case(ws, case_id: str):
    from .errors import LifecycleError

    if os.path.lexists(ws.case_dir(case_id)):
        # A tree without its store row: a crashed admission's (the next
        # admit of the id clears it) or a store that lost the row.
        return LifecycleError(
            "UNKNOWN_CASE",
            f"no case {case_id} in the store, though cases/{case_id} exists (an interrupted admission, "
            f"cleared by the next admit of {case_id}, or a store that lost its row)",
            path=os.fspath(ws.root),
        )
    return LifecycleError("UNKNOWN_CASE", f"no case {case_id} in the workspace", path=os.fspath(ws.root))


def _package(ws, case_id, package_id, cache: BuildCache | None = None):
    from .packages import Package

    return Package(ws, case_id, package_id, parsed_manifests=cache.parsed_manifests() if cache is not None else None)


def hold_case_lock(ws, case_id: str, timeout: float = 60.0) -> None:
    """Take the case lock for the rest of this process (doit runs hold it so the
    dep database, the cache and publication are all behind one lock)."""
    from .workspace import case_lock

    key = (str(ws.root), case_id)
    if key in _HELD:
        return
    manager = case_lock(ws, case_id, timeout=timeout)
    manager.__enter__()
    if not _HELD:
        atexit.register(_release_held_locks)
    _HELD[key] = manager


def _keep_for_the_run(ws, case_id: str, store) -> bool:
    """Keep ``store`` open for the run's next step, where that is safe; whether it was kept."""
    key = (str(ws.root), case_id)
    if key not in _HELD or threading.current_thread() is not threading.main_thread():
        return False
    earlier = _RUN_STORES.pop(key, None)
    if earlier is not None and earlier is not store:
        earlier.close()
    _RUN_STORES[key] = store
    return True


def _store_kept_for_the_run(ws, case_id: str) -> tuple:
    """``(store, kept)``: the store validate_index kept open for this step
    (``kept``: this process has held the case lock since that step rolled
    the store forward), or a new one."""
    key = (str(ws.root), case_id)
    if key in _HELD and threading.current_thread() is threading.main_thread():
        kept = _RUN_STORES.pop(key, None)
        if kept is not None:
            return kept, True
    return _store(ws), False


def _close_run_stores() -> None:
    while _RUN_STORES:
        _key, store = _RUN_STORES.popitem()
        with contextlib.suppress(Exception):
            store.close()


def _release_held_locks() -> None:
    """Leave the locks :func:`hold_case_lock` took, at exit: while the modules
    are intact. doit runs freeze what is alive at exit
    (:func:`pipeline.doitcli.skip_the_exit_collections`), so no shutdown
    collection finalizes the lock's generator early; left to shutdown, it was
    closed while module globals were being cleared (in some teardown orders
    after ``_leave_held`` was gone), printing an 'Exception ignored'
    traceback. The kernel drops the flock at exit either way."""
    _close_run_stores()
    while _HELD:
        _key, manager = _HELD.popitem()
        try:
            manager.__exit__(None, None, None)
        except Exception:
            pass


def _lock_if_not_held_by_the_run(ws, case_id: str) -> None:
    from .doitcli import lock_if_not_held_by_the_run

    lock_if_not_held_by_the_run(ws, case_id)


@contextlib.contextmanager
def _locked(ws, case_id: str, timeout: float = 60.0):
    """The case lock, unless this process already holds it for its lifetime."""
    if (str(ws.root), case_id) in _HELD:
        yield
        return
    from .workspace import case_lock

    with case_lock(ws, case_id, timeout=timeout):
        yield


# Weak: a turn lives while a thread holds or waits for it, not for every
# case a long-running host ever built.
_TURNS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_TURNS_GUARD = threading.Lock()


def _start_afresh_in_child() -> None:
    """After fork: the child has only the forking thread. Turns and guards
    another thread held at the fork would never be let go there (every later
    build of that case waited 60 s for a thread that does not exist, then
    LOCK_TIMEOUT); the case locks the parent held by this process's record
    are not the child's (their descriptors are closed in the child:
    :func:`pipeline.workspace._forget_held_in_child`)."""
    global _TURNS, _TURNS_GUARD, _WRITTEN_GUARD
    _TURNS = weakref.WeakValueDictionary()
    _TURNS_GUARD = threading.Lock()
    _WRITTEN_GUARD = threading.Lock()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_close_run_stores, after_in_child=_start_afresh_in_child)


@contextlib.contextmanager
def _thread_turn(ws, case_id: str, timeout: float = 60.0):
    """One thread of this process at a time builds ``case_id`` through
    CaseBuilder (re-entrant within a thread); waiting longer than ``timeout``
    seconds is ``LOCK_TIMEOUT``, as waiting for another process's lock is."""
    from .errors import LifecycleError
    from .workspace import validate_id

    key = (os.path.realpath(ws.root), validate_id(case_id, "case_id"))
    with _TURNS_GUARD:
        turn = _TURNS.setdefault(key, threading.RLock())
    if not turn.acquire(timeout=timeout):
        raise LifecycleError("LOCK_TIMEOUT", f"case {case_id} is being built by another thread; gave up after {timeout:g}s")
    try:
        yield
    finally:
        turn.release()


def case_cache(ws, case_id: str) -> BuildCache:
    """The case's cache, refused where a part of it is a symlink (RELIABILITY 28)."""
    from .workspace import refuse_symlinks

    cache_dir = ws.cache_dir(case_id)
    refuse_symlinks(ws, f".cache/{cache_dir.name}")
    try:
        linked = [entry.name for entry in os.scandir(cache_dir) if entry.is_symlink()]
    except OSError:
        linked = []  # not made yet
    if linked:
        # Its records and outputs (out/, documents/, the dep file, ...) are
        # written where they stand.
        refuse_symlinks(ws, f".cache/{cache_dir.name}/{sorted(linked)[0]}")
    return BuildCache(cache_dir)


_PROGRESS_SINK: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("viano_build_progress", default=None)
"""Where a build's progress lines go: stderr (None), or what a
:class:`CaseBuilder` was given (set for the thread that runs its steps,
which is also the one that reports their progress)."""


def _progress(message: str) -> None:
    sink = _PROGRESS_SINK.get()
    if sink is not None:
        sink(message)
        return
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


# ----------------------------------------------------------------- steps


def document_readers(package, limits: CaseBuilderLimits, *, relaxed: bool = False, cache: BuildCache | None = None):
    """The verified readers planning needs: an index, and a prior case's view
    (:func:`pipeline.prior.prior_case_view`).

    ``relaxed`` (the revision already has a confirmed case) bounds each read by
    the size the manifest records instead of the current limits: the confirmed
    case read these very bytes, and a lowered limit must not block its reuse.
    New work is held to the limits by :func:`plan.check_limits` afterwards.
    With a ``cache``, a prior case's view is taken from it when an earlier
    step derived it from the same bytes, and left there otherwise.
    """
    from .reader import read_document

    def bound(path, manifest, limit):
        return max(limit, manifest["files"].get(path, {}).get("size", 0)) if relaxed else limit

    def read_index(path, manifest):
        limit = bound(path, manifest, limits.document_bytes)
        data = package.read_verified(path, limit, manifest=manifest)
        return read_document(data, "case-inputs", path=path, max_bytes=limit)

    views: dict[str, dict] = {}

    def read_prior_case(ref, manifest):
        """The prior case's view, from verified bytes or the cache."""
        if ref["sha256"] in views:
            return views[ref["sha256"]]
        limit = bound(ref["path"], manifest, limits.case_bytes)
        if ref["size"] > limit:
            raise CaseBuildError("LIMIT_EXCEEDED", f"prior case is {ref['size']} bytes, limit {limit}{raise_hint('case_bytes', limit)}",
                                 path=ref["path"])
        record = cache.prior_view(ref["path"], ref["sha256"]) if cache is not None else None
        if record is not None and record.exists():
            # The view stands for these published bytes: they are still
            # checked, so a damaged prior case is found here as without a view.
            package.verify_file(ref["path"], manifest=manifest)
            try:
                view = cache.read_json_fast(record)
            except IntegrityError:  # a damaged view: derived again below, like a missing one
                view = None
        else:
            view = None
        if view is None:
            view = _prior_view_from(package.read_verified(ref["path"], limit, manifest=manifest), ref["path"])
            if record is not None:
                cache.write_json_fast(record, view)
        views[ref["sha256"]] = view
        return view

    return read_index, read_prior_case


def _prior_view_from(data: bytes, path: str) -> dict:
    """The view of a prior case's verified bytes; refuses one this builder did not write."""
    import msgspec

    from .prior import prior_case_view

    # These bytes are our own publication, verified against the manifest's
    # sha256 just now; msgspec's strict JSON parse is enough.
    try:
        document = msgspec.json.decode(data)
    except msgspec.DecodeError as error:
        raise CaseBuildError("INCOMPATIBLE_CASE", f"prior case is not JSON: {error}", path=path) from None
    if (
        not isinstance(document, dict)
        or document.get("format") != "viano-case"
        or document.get("format_version") != 1
        or document.get("builder_version") != BUILDER_VERSION
    ):
        raise CaseBuildError("INCOMPATIBLE_CASE", "prior case is not viano-case v1 by builder 1", path=path)
    return prior_case_view(document)


def step_validate_index(workspace_root, case_id: str, limits: CaseBuilderLimits | None = None) -> dict:
    """validate_index: roll forward, plan the build, record the start checkpoint.

    Refuses a BLOCKED case, and a changed payload after the revision's case was
    confirmed (``REOPEN_REQUIRED``). Writes the plan to the cache.
    """
    from .recovery import roll_forward
    from .workspace import validate_id

    from .doitcli import lock_if_not_held_by_the_run
    from .faults import crashpoint

    case_id = validate_id(case_id, "case_id")
    ws = _workspace(workspace_root)
    crashpoint("build:validate-index")
    if limits is None:
        from .workspace_limits import read_workspace_limits

        limits = read_workspace_limits(ws.root).case_builder
    store = open_existing_store(ws, case_id)
    kept = False
    try:
        lock_if_not_held_by_the_run(ws, case_id)
        with _locked(ws, case_id):
                record = store.get(case_id)
                cache = case_cache(ws, case_id)
                package = _package(ws, case_id, record.package_id, cache)
                record = roll_forward(store, package, case_id)
                if record.state == "BLOCKED":
                    blocked = record.blocked or {}
                    raise CaseBuildError(
                        "ILLEGAL_TRANSITION",
                        f"case is BLOCKED ({blocked.get('code')}, route {blocked.get('route')}, retry after {blocked.get('retry_after')})",
                    )

                cache.remove_stale_temps()
                cache.remove_other_builders_records()
                key = _plan_key(package, record, limits)
                stamps = read_content_stamps(cache)
                recorded = dict(stamps)
                content_dir = os.fspath(package.content_dir)
                cached_state = _cached_store_state(cache)
                if record.state in ("BUILDING_CASE", "COMPLETED") and cached_state.get("plan_key") == key and cache.plan.exists():
                    # Nothing the plan derives from changed: same builder code, same
                    # store record, byte-identical snapshot manifest (which pins every
                    # input's sha256). Re-planning would read the same immutable bytes,
                    # unless one of them was damaged since it was last read.
                    plan = _cached_plan(cache, cached_state.get("plan_sha256"))
                    prior = plan["prior_case"] if plan is not None else None
                    if plan is not None and not _forget_changed_content(cache, content_dir, plan, stamps) and (
                        prior is None or cache.prior_view(prior["path"], prior["sha256"]).exists()
                    ):
                        return plan
                plan = _planned_ahead(cache, key, content_dir, stamps)
                # A plan left ahead was taken because no stamp moved: they were just compared.
                stamps_compared = plan is not None
                if plan is None:
                    plan = _fresh_plan(store, package, record, cache, limits)
                confirmed = store.confirmed(case_id, plan["step_id"])
                if confirmed is not None and confirmed.request_hash != plan["request_hash"]:
                    raise CaseBuildError(
                        "REOPEN_REQUIRED",
                        f"revision {plan['analysis_revision']} already has a confirmed case; reopen to build changed inputs",
                    )
                if record.state == "COMPLETED" and confirmed is None:
                    raise CaseBuildError("REOPEN_REQUIRED", "the case is COMPLETED; reopen it first")
                reuse = confirmed is not None
                if not reuse:
                    # Limits bound new work only: a confirmed case is reused as it
                    # is even after a limit was lowered (seed 001).
                    check_limits(plan, limits)
                if record.state in ("VALIDATED", "REOPENED"):
                    store.advance(
                        case_id,
                        "start_build",
                        expected_generation=record.generation,
                        step_id=plan["step_id"],
                        request_hash=plan["request_hash"],
                    )
                if confirmed is not None:
                    # Reuse: the confirmed case was built from an earlier snapshot; the
                    # generations since then added only generated outputs (excluded from
                    # the request hash), so planning that snapshot gives the same plan.
                    plan["snapshot_generation"] = _confirmed_snapshot_generation(package, plan)
                if not stamps_compared:
                    _forget_changed_content(cache, content_dir, plan, stamps)
                _keep_content_stamps(cache, plan, stamps, recorded)
                plan_bytes = encode_sorted(plan)
                cache.write(cache.plan, plan_bytes)
                # Kept apart from the plan: it changes with every publication, and the
                # plan is a file_dep of assemble, which must not rerun for that.
                record = store.get(case_id)
                cache.write_json(
                    cache.store_state,
                    {"store_generation": record.generation, "plan_key": _plan_key(package, record, limits), "reuse": reuse,
                     "plan_sha256": sha256_hex(plan_bytes)},
                )
                kept = not reuse and _keep_for_the_run(ws, case_id, store)
    finally:
        if not kept:
            store.close()
    return plan



def _fresh_plan(store, package, record, cache: BuildCache, limits: CaseBuilderLimits) -> dict:
    """Plan the build of ``record``'s snapshot from the package itself."""
    already_confirmed = store.confirmed(record.case_id, step_id_for(record.analysis_revision)) is not None
    read_index, read_prior_case = document_readers(package, limits, relaxed=already_confirmed, cache=cache)
    return make_plan(
        package, record.generation, limits,
        read_index=read_index, read_prior_case=read_prior_case, enforce_limits=False,
    )


# ``doit append`` plans the build it calls for while it still holds the case
# lock (:func:`plan_ahead`), and validate_index takes that plan when nothing
# it derives from changed since (the same key as its own cached plan: code,
# store record, snapshot manifest bytes, limits; the same content stamps).
# Planning reads every manifest, the indexes and the prior case's view: an
# append rebuild's largest step after the new document's own reading, and
# the append already had all of it at hand. The record is kept apart from
# the plan and the store state: those name the plan of the last build, which
# ``doit -s build`` and publication check the package against.


def plan_ahead(ws, case_id: str, store, limits: CaseBuilderLimits) -> None:
    """Leave the plan of the next build of ``case_id`` in its cache. Called
    with the case lock held, after a generation was published and recorded.
    Only a cache record: any problem (which the build then reports) leaves
    none, and the build plans as it would have."""
    try:
        cache = case_cache(ws, case_id)
    except (VianoError, OSError):
        return
    try:
        record = store.get(case_id)
        package = _package(ws, case_id, record.package_id, cache)
        if record.state == "BLOCKED" or record.generation != package.current_generation():
            return
        plan = _fresh_plan(store, package, record, cache, limits)
        stamps = read_content_stamps(cache)
        recorded = dict(stamps)
        _forget_changed_content(cache, os.fspath(package.content_dir), plan, stamps)
        _keep_content_stamps(cache, plan, stamps, recorded)
        cache.write_json(cache.plan_ahead, {"plan_key": _plan_key(package, record, limits), "plan": plan})
    except (VianoError, OSError, ValueError):
        with contextlib.suppress(OSError):
            cache.plan_ahead.unlink(missing_ok=True)


def _planned_ahead(cache: BuildCache, key: str, content_dir: str, stamps: dict) -> dict | None:
    """The plan :func:`plan_ahead` left for the store record and package as
    they stand now (``key``), unless a file it relies on moved since."""
    try:
        ahead = cache.read_json(cache.plan_ahead)
    except (OSError, ValueError, VianoError):
        return None
    if not isinstance(ahead, dict) or ahead.get("plan_key") != key or not isinstance(ahead.get("plan"), dict):
        return None
    plan = ahead["plan"]
    prior = plan["prior_case"]
    if _forget_changed_content(cache, content_dir, plan, stamps) or (
            prior is not None and not cache.prior_view(prior["path"], prior["sha256"]).exists()):
        return None
    return plan

# Content is immutable, and each record derived from a content file (a read
# input, an opaque REF, a prior case's view) is named by that file's sha256,
# so a build trusts the records instead of reading every input again. What
# that trust cannot see is damage: a file changed in place after its record
# was made. Seed 001 has inherited inputs hash-checked and re-read, and a
# build without the cache would do just that and refuse the damage. So every
# build compares each file the plan relies on with the stamp (size, mtime,
# type, and whether the folders on its way are real directories) it had when
# its records were last trusted, and forgets the records of
# any file whose stamp moved: the task that reads it runs again and verifies
# its bytes against the manifest (a touched file passes and is trusted again;
# a damaged one is INTEGRITY_ERROR, as without the cache). One lstat a file;
# no inode or change time, so a workspace copied with its times (cp -a,
# rsync -a, a backup) keeps its records. A change that keeps the size and
# the mtime (forged, or within one timestamp tick) is found only by a build
# without the cache.


def content_stamps_now(content_dir: str, paths) -> dict[str, list | None]:
    """Each path's stamp: ``[size, mtime_ns, ctime_ns, file type]`` from
    ``lstat`` (the change time too: ``utime`` can put a modification time
    back, an archive restores it, and only the change time then tells that
    the bytes were written since; RELIABILITY 43), or
    None when it is missing or a folder on its way is not a real directory
    (a symlink put there later: the reading task refuses it, as a build
    without the cache does). One ``lstat`` a file and one a distinct folder."""
    folders: set[str] = set()
    for path in paths:
        folder = path.rpartition("/")[0]
        while folder and folder not in folders:
            folders.add(folder)
            folder = folder.rpartition("/")[0]
    unreal = set()
    for folder in folders:
        try:
            if not stat.S_ISDIR(os.lstat(f"{content_dir}/{folder}").st_mode):
                unreal.add(folder)
        except OSError:
            unreal.add(folder)
    stamps = {}
    for path in paths:
        stamp = None
        if not (unreal and _under_any(path, unreal)):
            try:
                st = os.lstat(f"{content_dir}/{path}")
                stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, stat.S_IFMT(st.st_mode)]
            except OSError:
                pass
        stamps[path] = stamp
    return stamps


def _under_any(path: str, folders: set[str]) -> bool:
    folder = path.rpartition("/")[0]
    while folder:
        if folder in folders:
            return True
        folder = folder.rpartition("/")[0]
    return False


def _relied_on(plan: dict) -> dict[str, str]:
    """The content files the plan's records derive from, with their sha256."""
    files = {path: entry["sha256"] for path, entry in plan["files"].items()}
    prior = plan["prior_case"]
    if prior is not None:
        files[prior["path"]] = prior["sha256"]
    return files


def read_content_stamps(cache: BuildCache) -> dict:
    try:
        stamps = cache.read_json(cache.content_stamps)
    except (OSError, ValueError, VianoError):
        return {}
    return stamps if isinstance(stamps, dict) else {}


def _forget_changed_content(cache: BuildCache, content_dir: str, plan: dict, stamps: dict) -> bool:
    """Forget the records of each file the plan relies on whose stamp is not
    the one in ``stamps`` (updated to the current ones); whether there was any.
    A moved stamp of the prior case only makes the caller plan again:
    planning verifies the prior case's bytes before it uses its view."""
    changed = {}
    moved = False
    relied = _relied_on(plan)
    now = content_stamps_now(content_dir, relied)
    for path, sha256 in relied.items():
        stamp = now[path]
        if stamps.get(path) != stamp:
            stamps[path] = stamp
            moved = True
            if path in plan["files"]:
                changed[path] = sha256
    if changed:
        cache.forget_records_of(changed)
    return moved


def _keep_content_stamps(cache: BuildCache, plan: dict, stamps: dict, recorded: dict) -> None:
    kept = {path: stamps.get(path) for path in _relied_on(plan)}
    if kept == recorded:
        return
    try:
        cache.write_json(cache.content_stamps, kept)
    except OSError:
        pass  # the next build finds the stamps moved and reads those files again


def _plan_key(package, record, limits: CaseBuilderLimits) -> str:
    """What a plan is a function of: code, store record, snapshot manifest bytes, limits."""
    import hashlib

    from .doitcli import code_version

    manifest_digest = package.manifest_sha256(record.generation)
    parts = [code_version(), record.case_id, record.package_id, record.state, str(record.analysis_revision),
             str(record.generation), str(package.current_generation()), manifest_digest, repr(sorted(limits.to_dict().items()))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _cached_store_state(cache: BuildCache) -> dict:
    try:
        state = cache.read_json(cache.store_state)
    except (OSError, ValueError, VianoError):
        return {}
    return state if isinstance(state, dict) else {}


def _cached_plan(cache: BuildCache, expected_sha256) -> dict | None:
    """The cached plan, if it is the one the store state beside it was written
    with. Both are renamed into place without an fsync, and a filesystem that
    does not keep the order of renames can lose the plan's rename and keep the
    store state's after a power loss: an earlier build's plan, whose own store
    state said something else. None (plan again) for that, and for a plan cut
    short or damaged."""
    if not isinstance(expected_sha256, str):
        return None
    try:
        plan = cache.read_plan(sha256=expected_sha256)
    except (OSError, VianoError):
        return None
    return plan if isinstance(plan, dict) else None


def _confirmed_snapshot_generation(package, plan: dict) -> int:
    path = plan["outputs"]["case_built"]
    data = package.read_verified(path, 1024 * 1024)
    built = decode_strict(data, max_bytes=1024 * 1024, path=path, error=IntegrityError)
    return built["package_generation"]


def _planned(path: str, sha256: str, size: int) -> dict:
    """The one manifest entry a per-file task needs. The plan took it from the
    verified snapshot manifest, so re-loading every manifest per task (which
    costs milliseconds for a large package) adds no safety."""
    return {"files": {path: {"sha256": sha256, "size": size}}}


_FRAGMENT_ROLES = {"report": "report", "reproduction": "reproduction"}


def step_read_input(workspace_root, case_id, package_id, path, sha256, size, contract, limits=None, inline_fact_value=None) -> None:
    """read_input: verify one structured document against the manifest, decode
    it strictly, validate its contract, cache it by content hash: a report or
    reproduction as its fragment (all assemble needs of it, before ids), any
    other document as the parsed value."""
    from .assemble import document_fragment
    from .jsoncanon import float_free
    from .reader import read_document

    limits = limits or CaseBuilderLimits()
    inline = limits.inline_fact_value if inline_fact_value is None else inline_fact_value
    ws = _workspace(workspace_root)
    _lock_if_not_held_by_the_run(ws, case_id)
    package = _package(ws, case_id, package_id)
    cache = case_cache(ws, case_id)
    reusing = reuses_confirmed_case(cache)
    bound = max(size, limits.document_bytes) if reusing else limits.document_bytes
    # Integrity first, always strict: bytes that differ from the manifest are
    # never a "bad document" to drop, they are a damaged package.
    data = package.read_verified(path, max(bound, size), manifest=_planned(path, sha256, size))
    try:
        if size > bound:
            raise CaseBuildError("LIMIT_EXCEEDED", f"{size} bytes, limit {bound}{raise_hint('document_bytes', bound)}", path=path)
        document = read_document(data, contract, path=path, max_bytes=bound)
        role = _FRAGMENT_ROLES.get(contract)
        if role is None:
            record = {"document": document}
        else:
            fragment = document_fragment(role, path, document, inline)
            # Measured once here, so encoding the case need not walk it all again (pretty_bytes).
            record = {"fragment": fragment, "float_free": float_free(fragment)}
    except VianoError as error:
        # Recorded, not raised: a document inherited from an earlier index may be
        # dropped (SUPERSEDED_INPUT) by assemble; one the current index lists
        # raises this very error there. The record is a pure function of the
        # bytes, so caching the refusal is as sound as caching the document.
        record = {"rejected": error.to_dict()}
        if role_of_contract(contract) == "report" and str(error.pointer or "").startswith("/attachments"):
            without = _report_without_attachments(data, path, bound, inline)
            if without is not None:
                record["without_attachments"] = without
    cache.write_json(cache.input_record(path, sha256, contract, inline, over_read_bound(size, limits.document_bytes, reusing)), record)


def role_of_contract(contract: str) -> str | None:
    """The fragment role a document of ``contract`` is read into, if any."""
    return _FRAGMENT_ROLES.get(contract)


def _report_without_attachments(data: bytes, path: str, bound: int, inline: int) -> dict | None:
    """A report refused for its ``attachments`` alone, read as builders
    before session 17 read it: with ``attachments`` an ignored top-level
    extension. Kept beside the refusal for the one case that needs it, a
    report a prior case took in then (see :func:`_snapshot`); None when the
    report fails without its attachments too."""
    from .assemble import document_fragment
    from .jsoncanon import float_free

    try:
        document = decode_strict(data, max_bytes=bound, path=path)
        if not isinstance(document, dict):
            return None
        document.pop("attachments", None)
        import contracts

        contracts.validate("report", document, path=path)
    except VianoError:
        return None
    fragment = document_fragment("report", path, document, inline)
    return {"fragment": fragment, "float_free": float_free(fragment)}


def over_read_bound(size: int, document_bytes: int, reusing: bool) -> bool:
    """Whether read_input refuses a document of ``size`` for its size alone:
    over the document limit, unless a confirmed case is being reused (which
    reads the very bytes it was built from, whatever the limit is now)."""
    return not reusing and size > document_bytes


_HASH_PROGRESS_MIN = 64 << 20


def _hash_progress(label: str, size: int):
    """A line every 256 MiB or tenth of the file, as admission reports its copies."""
    step = max(1, min(256 << 20, size // 10))
    following = [step]

    def report(_label: str, done: int) -> None:
        if done >= following[0]:
            _progress(f"hashing {label}: {done >> 20} / {size >> 20} MiB")
            following[0] = (done // step + 1) * step

    return report


def step_hash_context(workspace_root, case_id, package_id, path, sha256, size) -> None:
    """hash_context: stream one opaque file, check its sha256/size, cache its REF."""
    ws = _workspace(workspace_root)
    _lock_if_not_held_by_the_run(ws, case_id)
    package = _package(ws, case_id, package_id)
    progress = None
    if size >= _HASH_PROGRESS_MIN:
        _progress(f"hashing {one_line(path)} ({size} bytes)")
        progress = _hash_progress(one_line(path), size)
    package.verify_file(path, manifest=_planned(path, sha256, size), progress=progress)
    cache = case_cache(ws, case_id)
    cache.write_json(cache.opaque(path, sha256, size), {"path": path, "sha256": sha256, "size": size})


def _snapshot(
    cache: BuildCache,
    plan: dict,
    carried: frozenset[str] = frozenset(),
    carried_refs: tuple[str, ...] | list[str] = (),
    prior_document: bool = True,
    reread=None,
    reread_prior=None,
    rehash=None,
) -> tuple[dict, bool]:
    """Gather the cached, verified inputs into the assembler's snapshot; also
    say whether it holds no float (then neither does the case it assembles).

    The documents named in ``carried`` (an append rebuild's earlier inputs,
    see :func:`_splice_start`) are not read: their entries say ``carried``,
    and ``carried_refs`` are the files their reproductions reference.
    Without ``prior_document`` the prior case is referenced but not read
    (its ids then come from the carried state). ``reread(doc)`` reads an
    input again whose cached record is damaged or missing, ``rehash(ref)``
    verifies an opaque file whose record is missing, ``reread_prior()``
    derives the prior case's view again (the cache is disposable: its
    records may go while a build runs, after doit passed over their tasks)."""
    from .jsoncanon import float_free

    documents = {}
    dropped = []
    fragments_float_free = True
    for doc in plan["documents"]:
        if doc["path"] in carried:
            documents[doc["path"]] = {**{k: doc[k] for k in ("path", "sha256", "size", "seq")}, "carried": True}
            continue
        # Assembly never runs for a reused case: its bound is the document limit.
        over = over_read_bound(doc["size"], plan["limits"]["document_bytes"], False)
        record_path = cache.input_record(doc["path"], doc["sha256"], doc["contract"], plan["limits"]["inline_fact_value"], over)
        try:
            record = cache.read_json_fast(record_path)
        except (FileNotFoundError, IntegrityError) as error:
            if reread is None:
                if isinstance(error, FileNotFoundError):
                    raise CaseBuildError("INTEGRITY_ERROR", "a planned document was not read", path=doc["path"]) from None
                raise
            reread(doc)
            record = cache.read_json_fast(record_path)
        ignored = False
        if doc.get("prior_listed_attachments") is False:
            # A report its prior case took in without listing its attachments:
            # built before reports' attachments were read (they were an ignored
            # extension then), or by a build that ignored them itself. It cannot
            # be dropped or replaced, so it is kept with its statements, as that
            # case has it, and its attachments stay ignored, as that case ignored
            # them, with an IGNORED_ATTACHMENTS gap: decided by the prior case
            # alone, never by which files the package holds by now, so every
            # later build and revision decides alike. A report the revision adds
            # is held to the contract.
            if "rejected" in record and "without_attachments" in record:
                record, ignored = record["without_attachments"], True
            elif "fragment" in record and record["fragment"].get("attachments"):
                record, ignored = {**record, "fragment": {**record["fragment"], "attachments": []}}, True
            if ignored:
                record = {**record, "attachments_ignored": True}
        if "rejected" in record:
            if not doc.get("lenient"):
                problem = record["rejected"]
                raise CaseBuildError(problem["code"], problem["message"], path=problem.get("path"), pointer=problem.get("pointer"))
            dropped.append(doc)
            continue
        if "fragment" in record:
            body = {"fragment": record["fragment"]}
            if record.get("attachments_ignored"):
                body["attachments_ignored"] = True
            fragments_float_free = fragments_float_free and record.get("float_free") is True
        else:
            body = {"document": record["document"]}
        documents[doc["path"]] = {**{k: doc[k] for k in ("path", "sha256", "size", "seq")}, **body}
    for ref in plan["opaque"]:
        if not cache.opaque(ref["path"], ref["sha256"], ref["size"]).exists():
            if rehash is None:
                raise CaseBuildError("INTEGRITY_ERROR", "a planned file was not hashed", path=ref["path"])
            rehash(ref)

    roles = plan["roles"]

    def docs(role):
        return [documents[ref["path"]] for ref in roles.get(role, []) if ref["path"] in documents]

    lenient = {d["path"] for d in plan["documents"] if d.get("lenient")}
    by_path = {d["path"]: d for d in plan["documents"]}

    def drop(path: str) -> None:
        if path in documents:
            del documents[path]
            dropped.append(by_path[path])

    # An inherited document is dropped (never fatal) for anything that would
    # stop the build: its references, and for research its request pairing.
    for document in docs("reports") + docs("reproductions"):
        if document.get("carried"):
            continue
        if document["path"] in lenient and not _references_resolve(_document_refs(document), plan["files"]):
            drop(document["path"])

    research = []
    for result in docs("expected_research"):
        sibling = result["path"].rsplit("/", 1)[0] + "/request.json" if "/" in result["path"] else "request.json"
        request = documents.get(sibling)
        # A sibling listed as a report or reproduction is held as a fragment:
        # not a request (README: a request.json in another role is not read as one).
        entry = {**result, "request": request if request is not None and "document" in request else None}
        if result["path"] in lenient:
            try:
                _check_research_pairs(plan, [entry])
                _check_research_citations(entry)
            except VianoError:
                drop(result["path"])
                if by_path.get(sibling, {}).get("role") == "research_request":
                    drop(sibling)
                continue
        research.append(entry)
    _check_research_pairs(plan, research)

    referenced = set()
    for value in plan["roles"].values():
        referenced.update(ref["path"] for ref in value)
    referenced.update(ref["path"] for ref in plan["index_history"])
    referenced.update(d["path"] for d in plan["documents"])
    referenced.update(carried_refs)
    for document in docs("reports") + docs("reproductions"):
        if document.get("carried"):
            continue
        body = _document_refs(document)
        if isinstance(body.get("events_ref"), str):
            referenced.add(body["events_ref"])
        for attachment in body.get("attachments", []) or []:
            if isinstance(attachment, str):
                referenced.add(attachment)
    unclassified = [ref for ref in plan["opaque"] if ref["path"] not in referenced]
    # Dropped inherited documents stay preserved and visible: unclassified (their
    # bytes were verified by read_input) with a SUPERSEDED_INPUT gap each.
    unclassified = sorted(
        unclassified + [{k: d[k] for k in ("path", "sha256", "size")} for d in dropped], key=lambda r: r["path"]
    )
    superseded = list(plan.get("superseded", [])) + [d["path"] for d in dropped if d["path"] not in plan.get("superseded", [])]

    prior = None
    if plan["prior_case"] is not None and not prior_document:
        prior = {**plan["prior_case"], "document": None}
    elif plan["prior_case"] is not None:
        # Planning left the prior case's view in the cache (its ids are all
        # assemble takes from it); a cache cleared since then is an error of
        # the same kind as a missing input record.
        view = cache.prior_view(plan["prior_case"]["path"], plan["prior_case"]["sha256"])
        if not view.exists():
            raise CaseBuildError("INTEGRITY_ERROR", "the prior case was not read", path=plan["prior_case"]["path"])
        try:
            document = cache.read_json_fast(view)
        except IntegrityError:
            if reread_prior is None:
                raise
            document = reread_prior()
        prior = {**plan["prior_case"], "document": document}

    snapshot = {
        "manifest": {
            "case_id": plan["case_id"],
            "package_id": plan["package_id"],
            "analysis_revision": plan["analysis_revision"],
            "package_generation": plan["snapshot_generation"],
            "project": plan["project"],
        },
        "request_hash": plan["request_hash"],
        "limits": {"inline_fact_value": plan["limits"]["inline_fact_value"], "case_bytes": plan["limits"]["case_bytes"]},
        "index": plan["index"],
        "index_history": plan["index_history"],
        "reports": docs("reports"),
        "reproductions": docs("reproductions"),
        "expected_research": research,
        "context": {name: roles.get(f"context.{name}", []) for name in ("runtime", "database", "source", "research")},
        "attachments": roles.get("attachments", []),
        "files": plan["files"],
        "unclassified": unclassified,
        "superseded": superseded,
        "prior_case": prior,
    }
    # The assembler makes no float of its own: every value of the case comes
    # from the snapshot or is a count, an id or a text it builds. The fragments
    # were measured when read; the rest (small) is measured here, but for the
    # prior case's view, of which the case takes only id strings (_Ids) and
    # the reference (path, sha256, size).
    def measured(key, value):
        if key in ("reports", "reproductions"):
            return all(float_free({k: v for k, v in entry.items() if k not in ("fragment", "carried")}) for entry in value)
        if key == "prior_case" and value is not None:
            return float_free({k: v for k, v in value.items() if k != "document"})
        return float_free(value)

    if carried:
        return snapshot, False  # not measured: the part assembled from it is small enough to measure itself
    rest_float_free = fragments_float_free and all(measured(key, value) for key, value in snapshot.items())
    return snapshot, rest_float_free


def _document_refs(entry: dict) -> dict:
    """A report's ``attachments``, or a reproduction's ``events_ref`` and
    ``attachments``, from its fragment or document."""
    body = entry.get("fragment") or entry["document"]
    return {"events_ref": body.get("events_ref"), "attachments": body.get("attachments")}


def _references_resolve(document: dict, files: dict) -> bool:
    """Whether a document's events_ref and attachments name safe, present files."""
    from .workspace import check_reference

    refs = [document.get("events_ref")] if document.get("events_ref") is not None else []
    refs += list(document.get("attachments") or [])
    for ref in refs:
        if not isinstance(ref, str) or ref not in files:
            return False
        try:
            check_reference(ref)
        except VianoError:
            return False
    return True


def _check_research_citations(result: dict) -> None:
    """Every citation index of a research result exists in its sources."""
    document = result["document"]
    sources = document.get("sources") or []
    for item in document.get("statements") or []:
        for cited in item.get("citations") or []:
            if not isinstance(cited, int) or isinstance(cited, bool) or not 0 <= cited < len(sources):
                raise CaseBuildError("RESEARCH_INVALID", "citation index does not exist in sources", path=result["path"])


def _check_research_pairs(plan: dict, research: list[dict]) -> None:
    """Seed 000: each result's sibling request.json is bound by hash, identity
    and a revision that is not in the future."""
    from .jsoncanon import canonical_bytes

    for result in research:
        request = result["request"]
        path = result["path"]
        if request is None:
            raise CaseBuildError("RESEARCH_INVALID", "research result has no sibling request.json", path=path)
        body = request["document"]
        # The stored request must be exactly its canonical bytes, so its file hash
        # is the request hash anyone can recompute (ARCHITECTURE.md section 7).
        if sha256_hex(canonical_bytes(body)) != request["sha256"]:
            raise CaseBuildError("RESEARCH_INVALID", "request.json is not stored as canonical JSON", path=request["path"])
        if result["document"].get("request_hash") != request["sha256"]:
            raise CaseBuildError("RESEARCH_INVALID", "result request_hash does not match request.json", path=path, pointer="/request_hash")
        if body.get("case_id") not in (None, plan["case_id"]) or body.get("package_id") not in (None, plan["package_id"]):
            raise CaseBuildError("RESEARCH_INVALID", "research request belongs to another case or package", path=request["path"])
        revision = body.get("analysis_revision")
        if isinstance(revision, int) and revision > plan["analysis_revision"]:
            raise CaseBuildError("RESEARCH_INVALID", "research request is from a future analysis revision", path=request["path"], pointer="/analysis_revision")


def step_assemble(workspace_root, case_id) -> None:
    """assemble: snapshot from cache -> pure assemble -> case contract -> cache."""
    from .assemble import CaseTooLarge, assemble, carry_forward, prior_numbering
    from .faults import crashpoint

    crashpoint("build:assemble")
    ws = _workspace(workspace_root)
    _lock_if_not_held_by_the_run(ws, case_id)
    cache = case_cache(ws, case_id)
    plan, plan_sha256 = _made_before(cache.read_plan_and_sha256, case_id, "assemble", "plan", "validate_index")
    _SPLICING.pop(os.fspath(cache.root), None)
    if reuses_confirmed_case(cache):
        # A confirmed case is taken as published (after its contract check),
        # never re-assembled: a changed limit or builder detail must not turn
        # a reuse into a different document.
        data = _published_bytes(ws, plan, "case", plan["limits"]["case_bytes"])
        _check_case_contract(None, data, plan["outputs"]["case"])
        _write_output(cache, cache.case_json, data, plan_sha256)
        return
    start = _splice_start(cache, plan)
    again = {
        "reread": _rereader(workspace_root, case_id, plan),
        "reread_prior": _prior_rereader(workspace_root, case_id, plan),
        "rehash": _rehasher(workspace_root, case_id, plan),
    }
    if start is not None and _assemble_spliced(cache, plan, plan_sha256, *start, **again):
        return
    snapshot, snapshot_float_free = _snapshot(cache, plan, **again)
    try:
        case = assemble(snapshot, owned=True)  # the snapshot's records were decoded for this call alone
    except CaseTooLarge as too_large:
        # Refused while its records were made, long before they would be encoded.
        raise CaseBuildError("LIMIT_EXCEEDED", f"{too_large}{raise_hint('case_bytes', too_large.limit)}",
                             path=plan["outputs"]["case"]) from None
    # The size first: the contract check of a case too large would keep a
    # record of it in the cache for nothing. Checked as it is encoded, so a
    # refused case is never copied whole for its trailing newline.
    try:
        data = pretty_bytes(case, known_float_free=snapshot_float_free, limit=plan["limits"]["case_bytes"])
    except EncodedTooLarge as too_large:
        _refuse_case_size(plan, too_large.size)
    _check_case_contract(case, data, plan["outputs"]["case"], cache)
    _write_output(cache, cache.case_json, data, plan_sha256)
    _ASSEMBLED[:] = [(data, case)]
    carried = carry_forward(None, case)
    prior_sources: list[str] = []
    if carried is not None and snapshot["prior_case"] is not None:
        floors, prior_sources = prior_numbering(snapshot["prior_case"]["document"])
        for ns, floor in floors.items():  # the prior's numbers count as used
            carried["next_floor"][ns] = max(floor, carried["next_floor"].get(ns, 0))
    _hand_to_render(cache, (data, None, None, carried, _units(snapshot), prior_sources))


def _hand_to_render(cache: BuildCache, entry: tuple) -> None:
    _SPLICING[os.fspath(cache.root)] = entry
    # Bounded: a render that never comes (a failed build) leaves its entry.
    # Dropping one a render still wants only makes that render whole. A list
    # first: other threads may change the dict meanwhile.
    for stale in list(_SPLICING)[:-4]:
        _SPLICING.pop(stale, None)


def _rereader(workspace_root, case_id: str, plan: dict):
    """Reads one planned input again, as its read_input task does, when its
    cached record is damaged: doit does not rerun a task whose record exists."""

    def reread(doc: dict) -> None:
        step_read_input(
            workspace_root, case_id, plan["package_id"], doc["path"], doc["sha256"], doc["size"], doc["contract"],
            CaseBuilderLimits(**plan["limits"]), inline_fact_value=plan["limits"]["inline_fact_value"],
        )

    return reread


def _rehasher(workspace_root, case_id: str, plan: dict):
    """Verifies one planned opaque file again, as its hash_context task does,
    when its record is missing."""

    def rehash(ref: dict) -> None:
        step_hash_context(workspace_root, case_id, plan["package_id"], ref["path"], ref["sha256"], ref["size"])

    return rehash


def _prior_rereader(workspace_root, case_id: str, plan: dict):
    """Derives the prior case's view again from its verified bytes, and
    leaves it in the cache, when the cached one is damaged."""

    def reread_prior() -> dict:
        prior = plan["prior_case"]
        ws = _workspace(workspace_root)
        data = _package(ws, case_id, plan["package_id"]).read_verified(prior["path"], max(plan["limits"]["case_bytes"], prior["size"]))
        if sha256_hex(data) != prior["sha256"]:
            raise CaseBuildError("INTEGRITY_ERROR", "the prior case is not the one planned", path=prior["path"])
        view = _prior_view_from(data, prior["path"])
        cache = case_cache(ws, case_id)
        cache.write_json_fast(cache.prior_view(prior["path"], prior["sha256"]), view)
        return view

    return reread_prior


def _refuse_case_size(plan: dict, size: int):
    """LIMIT_EXCEEDED for a case.json of exactly ``size`` bytes."""
    raise CaseBuildError("LIMIT_EXCEEDED", f"case.json would be {size} bytes, limit {plan['limits']['case_bytes']}"
                                            f"{raise_hint('case_bytes', plan['limits']['case_bytes'])}", path=plan["outputs"]["case"])


def _units(snapshot: dict) -> list[list[str]]:
    """The reports and reproductions a case was assembled from, in inventory order."""
    docs = [("report", d) for d in snapshot["reports"]] + [("reproduction", d) for d in snapshot["reproductions"]]
    return [[role, d["path"], d["sha256"]] for role, d in sorted(docs, key=lambda pair: pair[1]["seq"])]


def _plan_units(plan: dict) -> list[tuple[str, dict]]:
    by_path = {d["path"]: d for d in plan["documents"]}
    roles = plan["roles"]
    docs = [("report", by_path.get(r["path"])) for r in roles.get("reports", [])]
    docs += [("reproduction", by_path.get(r["path"])) for r in roles.get("reproductions", [])]
    if any(d is None for _, d in docs):
        return []
    return sorted(docs, key=lambda pair: pair[1]["seq"])


def _splice_start(cache: BuildCache, plan: dict) -> tuple | None:
    """What an append rebuild can splice from: the state the previous build
    left (:func:`pipeline.assemble.carry_forward`) and its two outputs, when
    they are still the bytes it describes, the earlier build's inputs begin
    this build's inventory unchanged, and ids would come out as it numbered
    them (the same prior case, or its own case as the prior). Else None: the
    case is assembled whole, which is always right, only slower."""
    if plan["roles"].get("expected_research"):
        return None
    try:
        state = cache.read_msgpack(cache.splice_state, dict)
        earlier_units = state["units"]
        prior = plan["prior_case"]
        prior_sha256 = prior["sha256"] if prior is not None else None
        if (
            state["case_id"] != plan["case_id"]
            or state["package_id"] != plan["package_id"]
            or state["limits"] != plan["limits"]
            or prior_sha256 not in (state["prior_sha256"], state["case_sha256"])
        ):
            return None
        units = _plan_units(plan)
        if len({d["path"] for _, d in units}) != len(units) or len(units) < len(earlier_units):
            return None
        if [[role, d["path"], d["sha256"]] for role, d in units[: len(earlier_units)]] != earlier_units:
            return None
        # The sources the prior case numbers: the same prior's, or the
        # previous case's own when it is the prior (a new revision).
        if prior_sha256 == state["prior_sha256"]:
            prior_sources = state["prior_sources"]
        else:
            prior_sources = [path for _, path, _ in earlier_units]
        needs_prior = bool({d["path"] for _, d in units[len(earlier_units) :]} & set(prior_sources))
        carried = state["carried"]
        if any(path not in plan["files"] for path in carried["referenced"]):
            return None
        previous_case = _read_output(cache, cache.case_json, plan["limits"]["case_bytes"])
        previous_summary = _read_output(cache, cache.summary, plan["limits"]["summary_bytes"])
        if sha256_hex(previous_case) != state["case_sha256"] or sha256_hex(previous_summary) != state["summary_sha256"]:
            return None
    except (OSError, VianoError, KeyError, TypeError, AttributeError):
        return None
    return carried, frozenset(path for _, path, _ in earlier_units), previous_case, previous_summary, prior_sources, needs_prior


def _assemble_spliced(
    cache: BuildCache,
    plan: dict,
    plan_sha256: str,
    carried: dict,
    carried_paths: frozenset,
    previous_case: bytes,
    previous_summary: bytes,
    prior_sources: list[str],
    needs_prior: bool,
    reread,
    reread_prior,
    rehash,
) -> bool:
    """Assemble only the documents after the carried ones and splice the
    previous case's records in front (:mod:`pipeline.splice`). False when the
    result cannot be trusted to be the whole case's bytes, or the new records
    fail the contract (the whole assembly then names the failing record by
    its place in the whole case)."""
    from .assemble import assemble, carry_forward
    from .splice import splice_case

    try:
        snapshot, _ = _snapshot(cache, plan, carried_paths, carried["referenced"], prior_document=needs_prior, reread=reread, reread_prior=reread_prior,
                                rehash=rehash)
        part = assemble(snapshot, owned=True, carried=carried)
        part_bytes = pretty_bytes(part)
        data = splice_case(previous_case, part_bytes)
        # Every record of an appended list is checked on its own and no
        # constraint relates two of them (pipeline.casecheck): the part's
        # check is the whole case's, given the previous case passed.
        _check_case_contract(part, part_bytes, plan["outputs"]["case"])
        following = carry_forward(carried, part)
    except OSError:
        raise
    except Exception:
        # A shortcut only: whatever stops it (an input the whole assembly
        # refuses with its code and pointer, a carried state that does not
        # fit, bytes not shaped as expected) is met again, or not at all,
        # by assembling the case whole.
        return False
    if len(data) > plan["limits"]["case_bytes"]:
        # The whole assembly refuses it, with the line a build without the
        # splice gives (its bound may stop it before the exact size is known).
        return False
    _write_output(cache, cache.case_json, data, plan_sha256)
    _ASSEMBLED.clear()
    _hand_to_render(cache, (data, part, previous_summary, following, _units(snapshot), prior_sources))
    # Documents only: the carried count is of documents, and an appended
    # log or other opaque file is listed by the part without being read.
    added = len(snapshot["reports"]) + len(snapshot["reproductions"]) - len(carried_paths)
    if added:
        _progress(f"assemble: {added} new document(s) appended to the {len(carried_paths)} of the last assembly")
    else:  # a reopen built before anything was appended, or only opaque files were
        _progress(f"assemble: no new document since the last assembly; its {len(carried_paths)} carried forward")
    return True


def reuses_confirmed_case(cache: BuildCache) -> bool:
    """Whether this build takes the revision's confirmed case as published (validate_index decides)."""
    try:
        return bool(cache.read_json(cache.store_state).get("reuse"))
    except (OSError, VianoError):
        return False


def _published_bytes(ws, plan: dict, key: str, limit: int) -> bytes:
    """A confirmed output, verified against the manifest that published it."""
    package = _package(ws, plan["case_id"], plan["package_id"])
    path = plan["outputs"][key]
    return package.read_verified(path, max(limit, package.manifest()["files"].get(path, {}).get("size", 0)))


def _check_case_contract(case: dict | None, data: bytes, path: str, cache: BuildCache | None = None) -> None:
    """The case must meet its own contract. The msgspec Struct decides quickly;
    jsonschema runs only when it refuses, to name the precise pointer. With
    a ``cache``, records the last check passed are not converted again
    (:mod:`pipeline.casecheck`)."""
    import msgspec

    import contracts
    from contracts.case_structs import decode_case

    try:
        if case is None:
            decode_case(data)
        else:
            # The dict is what data encodes (pretty_bytes is exact); converting
            # it skips parsing a megabytes-large document once more.
            from .casecheck import check_case

            known = _read_checked_records(cache) if cache is not None else frozenset()
            passed = check_case(case, known)
            if cache is not None:
                _keep_checked_records(cache, known, passed)
    except (msgspec.ValidationError, msgspec.DecodeError):
        if case is None:
            case = msgspec.json.decode(data)
        contracts.validate("case", case, path=path)
        raise CaseBuildError("SCHEMA_VIOLATION", "the case does not meet case-v1", path=path)


def _read_checked_records(cache: BuildCache) -> frozenset[bytes]:
    """The records the last check passed, or none when absent, unreadable or
    checked by another msgspec (whose Structs might decide otherwise)."""
    import msgspec

    try:
        version, keys = cache.read_msgpack(cache.checked_records, tuple[str, list[bytes]])
    except (OSError, VianoError):
        return frozenset()
    return frozenset(keys) if version == msgspec.__version__ else frozenset()


def _keep_checked_records(cache: BuildCache, known: frozenset[bytes], passed: set[bytes]) -> None:
    """Leave this check's records for the next one, unless they differ from
    what it was given by less than an eighth: an append adds a few records,
    which the next check converts again more cheaply than the set is rewritten."""
    import msgspec

    if len(passed - known) * 8 <= len(passed) and len(known - passed) * 8 <= len(known):
        return
    try:
        cache.write_msgpack(cache.checked_records, (msgspec.__version__, sorted(passed)))
        cache.remove_other_versions(cache.checked_records)
    except OSError:
        pass  # only a head start for the next check


def step_render(workspace_root, case_id) -> None:
    """render: the summary from case.json only (pure render_summary)."""
    from .summary import EscapeMemo, LineMemo, SummaryTooLarge, render_summary

    ws = _workspace(workspace_root)
    _lock_if_not_held_by_the_run(ws, case_id)
    cache = case_cache(ws, case_id)
    plan = _made_before(cache.read_plan, case_id, "render", "plan", "validate_index")
    limit = plan["limits"]["summary_bytes"]
    # Written by assemble, checked against case-v1.
    case_bytes = _made_before(lambda: _read_output(cache, cache.case_json, plan["limits"]["case_bytes"]),
                              case_id, "render", "assembled case", "assemble")
    if reuses_confirmed_case(cache):
        _write_output(cache, cache.summary, _published_bytes(ws, plan, "case_summary", plan["limits"]["summary_bytes"]),
                      sha256_hex(case_bytes))
        return
    splicing = _SPLICING.pop(os.fspath(cache.root), None)
    if splicing is not None and splicing[0] is not case_bytes and splicing[0] != case_bytes:
        splicing = None  # the cached case changed since assemble wrote it
    data = None
    if splicing is not None and splicing[1] is not None:
        from .splice import SpliceError, splice_summary

        try:
            data = splice_summary(splicing[2], render_summary(splicing[1], limit=limit).encode("utf-8"))
        except (SpliceError, SummaryTooLarge):
            data = None
        if data is not None and len(data) > limit:
            data = None  # the whole render names it, as a build without the splice would
    if data is None:
        case = _case_from(case_bytes)
        memo = EscapeMemo(_read_escape_memo(cache))
        lines = LineMemo(_read_line_memo(cache))
        try:
            data = render_summary(case, memo, lines, limit=limit).encode("utf-8")
        except SummaryTooLarge as too_large:
            # Refused while its lines were made, long before the whole was encoded.
            raise CaseBuildError("LIMIT_EXCEEDED", f"{too_large}{raise_hint('summary_bytes', limit)}",
                                 path=plan["outputs"]["case_summary"]) from None
        for kept, path in ((memo, cache.escape_memo), (lines, cache.line_memo)):
            if kept.worth_keeping():
                try:
                    cache.write_msgpack(path, kept.used)
                    cache.remove_other_versions(path)
                except OSError:
                    pass  # only a head start for the next render
    if len(data) > plan["limits"]["summary_bytes"]:
        raise CaseBuildError("LIMIT_EXCEEDED", f"summary would be {len(data)} bytes, limit {plan['limits']['summary_bytes']}"
                                                f"{raise_hint('summary_bytes', plan['limits']['summary_bytes'])}", path=plan["outputs"]["case_summary"])
    _write_output(cache, cache.summary, data, sha256_hex(case_bytes))
    _leave_splice_state(cache, plan, case_bytes, data, splicing)


def _leave_splice_state(cache: BuildCache, plan: dict, case_bytes: bytes, summary_bytes: bytes, splicing: tuple | None) -> None:
    """The state the next append rebuild splices from, bound to the two
    outputs by their digests; removed when this build leaves none (a state
    left for older outputs would be refused by its digests anyway)."""
    path = cache.splice_state
    carried = splicing[3] if splicing is not None else None
    try:
        if carried is None:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return
        prior = plan["prior_case"]
        cache.write_msgpack(
            path,
            {
                "case_id": plan["case_id"],
                "package_id": plan["package_id"],
                "limits": plan["limits"],
                "prior_sha256": prior["sha256"] if prior is not None else None,
                "case_sha256": sha256_hex(case_bytes),
                "summary_sha256": sha256_hex(summary_bytes),
                "units": splicing[4],
                "prior_sources": splicing[5],
                "carried": carried,
            },
        )
    except (OSError, TypeError, ValueError, OverflowError):
        with contextlib.suppress(OSError):  # only a head start for the next rebuild
            path.unlink(missing_ok=True)
        return
    with contextlib.suppress(OSError):  # states of other builder code: never read again
        cache.remove_other_versions(path)


def _read_line_memo(cache: BuildCache) -> dict[bytes, str]:
    """The previous render's statement lines, or none when absent or unreadable."""
    try:
        return cache.read_msgpack(cache.line_memo, dict[bytes, str])
    except (OSError, VianoError):
        return {}


def _read_escape_memo(cache: BuildCache) -> dict[str, str]:
    """The previous render's escapes, or none when absent or unreadable."""
    try:
        return cache.read_msgpack(cache.escape_memo, dict[str, str])
    except (OSError, VianoError):
        return {}


def _case_built(plan: dict, case_bytes: bytes, summary_bytes: bytes) -> bytes:
    outputs = plan["outputs"]
    return pretty_bytes(
        {
            "format": _CASE_BUILT_FORMAT,
            "format_version": 1,
            "builder_version": BUILDER_VERSION,
            "case_id": plan["case_id"],
            "package_id": plan["package_id"],
            "analysis_revision": plan["analysis_revision"],
            "package_generation": plan["snapshot_generation"],
            "step_id": plan["step_id"],
            "request_hash": plan["request_hash"],
            "case": {"path": outputs["case"], "sha256": sha256_hex(case_bytes), "size": len(case_bytes)},
            "case_summary": {"path": outputs["case_summary"], "sha256": sha256_hex(summary_bytes), "size": len(summary_bytes)},
        }
    )


class BuildResult(dict):
    """What a build did: ``status`` is ``published`` or ``reused``."""


def step_publish(workspace_root, case_id) -> BuildResult:
    """publish: case.json, summary and case-built.json as one new generation,
    then the ``case_built`` checkpoint with compare-and-swap on the generation.

    Idempotent: an already-confirmed identical request is reused (no new
    generation); a publication whose checkpoint was lost is confirmed.
    """
    from .faults import crashpoint
    from .packages import PackageWriter
    from .recovery import recording_what_was_published, roll_forward

    ws = _workspace(workspace_root)
    cache = case_cache(ws, case_id)
    plan, plan_sha256 = _made_before(cache.read_plan_and_sha256, case_id, "publish", "plan", "validate_index")
    case_bytes = _made_before(lambda: _read_output(cache, cache.case_json, plan["limits"]["case_bytes"]),
                              case_id, "publish", "assembled case", "assemble")
    summary_bytes = _made_before(lambda: _read_output(cache, cache.summary, plan["limits"]["summary_bytes"]),
                                 case_id, "publish", "rendered summary", "render")
    built_bytes = _case_built(plan, case_bytes, summary_bytes)
    outputs = plan["outputs"]
    with _locked(ws, case_id):
        store, kept = _store_kept_for_the_run(ws, case_id)
        try:
            package = _package(ws, case_id, plan["package_id"], cache)
            # Kept: validate_index rolled this store forward and cleared what
            # crashed writers left, and no writer has had the lock since.
            record = store.get(case_id) if kept else roll_forward(store, package, case_id)
            confirmed = store.confirmed(case_id, plan["step_id"])
            if confirmed is not None:
                if confirmed.request_hash != plan["request_hash"]:
                    raise CaseBuildError("REOPEN_REQUIRED", "this revision already has a confirmed case with other inputs")
                verified = _repair_from_published(package, outputs, cache, case_bytes, summary_bytes)
                result = BuildResult(status="reused", generation=record.generation, **outputs)
            else:
                if record.generation != cache.read_json(cache.store_state)["store_generation"]:
                    raise CaseBuildError("STALE_GENERATION", "the package changed since the build was planned; run the build again")
                _check_outputs_as_written(cache, case_bytes, summary_bytes)
                writer = PackageWriter(package)
                manifest = writer.publish(
                    record.generation,
                    {outputs["case"]: case_bytes, outputs["case_summary"]: summary_bytes, outputs["case_built"]: built_bytes},
                    artifacts={"case": outputs["case"], "case_summary": outputs["case_summary"]},
                )
                crashpoint("build:after-publish")
                with recording_what_was_published(case_id, manifest["package_generation"]):
                    store.advance(
                        case_id,
                        "case_built",
                        expected_generation=record.generation,
                        new_generation=manifest["package_generation"],
                        step_id=plan["step_id"],
                        request_hash=plan["request_hash"],
                        artifacts=[outputs["case"], outputs["case_summary"], outputs["case_built"]],
                        manifest_sha256=package.manifest_sha256(manifest["package_generation"]),
                    )
                crashpoint("build:after-confirm")
                result = BuildResult(status="published", generation=manifest["package_generation"], **outputs)
                verified = {
                    path: [len(data), sha256_hex(data)]
                    for path, data in ((outputs["case"], case_bytes), (outputs["case_summary"], summary_bytes), (outputs["case_built"], built_bytes))
                }
                _plan_stays_current(cache, package, store.get(case_id), plan, plan_sha256)
        finally:
            store.close()
    try:
        # ``verified``: the outputs as this step published or verified them,
        # which the next no-op build checks the published files against.
        note = {"request_hash": plan["request_hash"], "step_id": plan["step_id"], **result, "verified": verified}
        cache.write_json(cache.published, note)
    except OSError as error:
        # The case is published and confirmed; this is only the cache's note
        # of it. Without it the next build checks the store again, and
        # report_build reads the confirmation from the store.
        with contextlib.suppress(OSError):
            cache.published.unlink(missing_ok=True)
        _progress(f"warning: IO_ERROR: the build cache's note of the publication was not written ({one_line(error.strerror or str(error))}); "
                  "the case is published and confirmed")
    return result


def _check_outputs_as_written(cache: BuildCache, case_bytes: bytes, summary_bytes: bytes) -> None:
    """Publish only outputs that assemble made from this plan and render from
    this case, with this builder's code. In a build they are the bytes this
    process wrote, or doit has just checked them against what those steps
    recorded; a publish run on its own (``doit -s publish``) reads them from
    the cache, where a power loss may have cut them short and an earlier
    run may have left another revision's: checked against the same records
    here: the digest each step recorded of its output and of what it made
    it from (not doit's record of the file it depends on, which ``doit
    reset-dep`` rewrites without the step running). Refused, nothing is
    written; ``doit build`` makes them again."""
    from doit.tools import config_changed

    from .doitcli import OUTPUT_DIGEST, SOURCE_DIGEST, chain_stamp

    case_digest = sha256_hex(case_bytes)
    # What each output must have been made from, as its step recorded its
    # last run: the case from this plan, the summary from this case.
    unsure = []
    if not _written_here(cache.case_json, case_bytes):
        unsure.append((cache.case_json, "assemble", case_digest, sha256_hex(cache.read_bytes(cache.plan))))
    if not _written_here(cache.summary, summary_bytes):
        unsure.append((cache.summary, "render", sha256_hex(summary_bytes), case_digest))
    if not unsure:
        return
    records = cache.doit_records(tuple(task for _, task, *_ in unsure)) or {}
    calc_digest = getattr(config_changed(chain_stamp()), "_calc_digest", None)  # how doit 0.36-0.37 stamp
    stamp = calc_digest() if callable(calc_digest) else None
    for path, task, digest, source_digest in unsure:
        record = records.get(task) or {}
        values = record.get("_values_:")
        if not (
            isinstance(values, dict)
            and values.get(OUTPUT_DIGEST) == digest
            and values.get(SOURCE_DIGEST) == source_digest
            and (stamp is None or values.get("_config_changed") == stamp)
        ):
            raise CaseBuildError("INTEGRITY_ERROR", f"the cached {path.name} is not the one {task} made from the build's "
                                                    f"{'plan' if task == 'assemble' else 'case'} (cut short by a crash, changed since, "
                                                    "or from another build); run `doit build`, which makes it again", path=path.name)


def _written_here(path: Path, data: bytes) -> bool:
    """Whether ``data`` is the output this process wrote to ``path``, still there
    (also when other cases' builds ran in other threads meanwhile)."""
    with _WRITTEN_GUARD:
        held = _WRITTEN_VERSIONS.get(os.fspath(path))
    if held is None:
        return False
    try:
        return file_version(path) == held[0] and sha256_hex(data) == held[1]
    except OSError:
        return False


def _plan_stays_current(cache: BuildCache, package, record, plan: dict, plan_sha256: str) -> None:
    """Record that the plan is current for the store as publication left it.

    Planning again now would give the very same plan (generated outputs are
    no input, superseded or not, and the confirmed snapshot is the planned
    one; tests hold the two equal, also when an earlier index named this
    very output), now marked as a reuse. Without this record the first
    no-op build after every publication would plan again, which reads every
    manifest and imports the readers, to find out nothing changed. Only a
    cache record: if it cannot be written, that build plans again.
    """
    try:
        limits = CaseBuilderLimits(**plan["limits"])
        cache.write_json(
            cache.store_state,
            {"store_generation": record.generation, "plan_key": _plan_key(package, record, limits), "reuse": True,
             "plan_sha256": plan_sha256},
        )
    except (OSError, VianoError, TypeError):
        pass  # the record left by planning names the old generation: planning runs again


def leave_prior_view(ws, case_id: str, package) -> None:
    """Cache the view (pipeline.prior) the next revision's builds read of the
    case that ``package``'s current manifest names, unless it is there.

    ``doit reopen`` calls this, under the case lock, as it opens the next
    revision: only a next revision reads the view, so a build does not derive
    it for every case it publishes, and the first build after the reopen (an
    append's) does not have to verify and decode the whole prior case. Only a
    cache record: any failure leaves that decode to the build, which reports
    what it finds. Planning checks the case's size against the limits before
    it looks in the cache, so a view cached here bypasses no limit.
    """
    try:
        manifest = package.manifest()
        path = manifest.get("artifacts", {}).get("case")
        entry = manifest["files"].get(path) if isinstance(path, str) else None
        if entry is None:
            return
        cache = case_cache(ws, case_id)
        view = cache.prior_view(path, entry["sha256"])
        if not view.exists():
            from .workspace_limits import read_workspace_limits

            limits = read_workspace_limits(ws.root).case_builder
            _read_index, read_prior_case = document_readers(package, limits, relaxed=True, cache=cache)
            read_prior_case({"path": path, "sha256": entry["sha256"], "size": entry["size"]}, manifest)
        if view.exists():
            # The new revision's builds read this one; the earlier revisions'
            # views are never read again.
            cache.remove_other_prior_views(view)
    except (OSError, VianoError):
        pass


def _repair_from_published(package, outputs: dict, cache: BuildCache, case_bytes: bytes, summary_bytes: bytes) -> dict:
    """A reuse re-checks the three published outputs against the manifest and
    repairs the local cache from them ("repairs local metadata", seed 001): a
    damaged cache record is rewritten, never blamed on the published file.
    Returns ``{path: [size, sha256]}`` of the outputs it verified."""
    manifest = package.manifest()
    verified = {}
    for key, cached, target in (
        ("case", case_bytes, cache.case_json),
        ("case_summary", summary_bytes, cache.summary),
        ("case_built", None, None),
    ):
        path = outputs[key]
        entry = manifest["files"].get(path)
        if entry is None:
            raise IntegrityError("INTEGRITY_ERROR", "confirmed case output is missing from the manifest", path=path)
        published = package.read_verified(path, entry["size"], manifest=manifest)
        verified[path] = [entry["size"], entry["sha256"]]
        if target is not None and published != cached:
            cache.write(target, published)
    return verified


def _confirmed_for(ws, case_id: str, plan: dict):
    """The store's confirmation of the plan's request, or None."""
    store = _store(ws)
    try:
        confirmed = store.confirmed(case_id, plan["step_id"])
    finally:
        store.close()
    return confirmed if confirmed is not None and confirmed.request_hash == plan["request_hash"] else None


def publish_is_current(workspace_root, case_id) -> bool:
    """doit ``uptodate`` for publish: the cached output is the confirmed one."""
    ws = _workspace(workspace_root)
    cache = case_cache(ws, case_id)
    try:
        plan = cache.read_plan()
    except (OSError, VianoError):
        return False
    return publication_noted(ws, case_id, cache, plan) and _confirmed_for(ws, case_id, plan) is not None


def publication_noted(ws, case_id: str, cache: BuildCache, plan: dict) -> bool:
    """Whether the cache's note of the last publication is of ``plan``'s
    case, its published outputs verified as they are now: with the store's
    confirmation, what :func:`publish_is_current` asks (``doit status`` asks
    this of the plan the build will make, and the store itself read-only)."""
    try:
        published = cache.read_json(cache.published)
    except (OSError, VianoError):
        return False
    if published.get("request_hash") != plan.get("request_hash"):
        return False
    # A published output gone or changed (it is never rewritten, so only
    # damage changes it): run publish, whose reuse verifies the outputs
    # against the manifest and names the damage, instead of calling the case
    # confirmed ("repeats check the case contract and summary", seed 001).
    # Their sizes and digests as publish last verified them; hashing the
    # three costs a no-op ~2 ms for a case of 1.7 MB and a summary of 1.1 MB.
    verified = published.get("verified")
    if not isinstance(verified, dict):
        return False  # a note from before the check: publish verifies and writes it
    package = _package(ws, case_id, plan["package_id"])
    for key in ("case", "case_summary", "case_built"):
        path = plan["outputs"][key]
        expected = verified.get(path)
        if not (isinstance(expected, list) and len(expected) == 2 and package.holds(path, expected[0], expected[1])):
            return False
    return True


def report_build(workspace_root, case_id) -> None:
    """The ``build`` task's own output: one line naming the confirmed case."""
    ws = _workspace(workspace_root)
    cache = case_cache(ws, case_id)
    if not cache.plan.exists():
        # Only the report ran (`doit -s build`), and no build ever planned.
        raise CaseBuildError("NOT_BUILT", f"case {case_id} has no plan yet: the steps did not run "
                                          f"(`doit -s build` runs only the report): run `doit build case={case_id}`")
    plan = cache.read_plan()
    try:
        published = cache.read_json(cache.published)
    except (OSError, VianoError):
        published = None
    if published is None or published.get("request_hash") != plan["request_hash"]:
        # The note was not written (see step_publish): the store has it.
        confirmed = _confirmed_for(ws, case_id, plan)
        if confirmed is None:
            # Only a run without the steps gets here (`doit -s build`, or the
            # steps of a failed build not run again): in a build the report
            # follows publish, which confirmed the plan's case or failed.
            _refuse_a_report_of_an_older_plan(ws, case_id, cache, plan, 0)
            raise CaseBuildError(
                "NOT_BUILT",
                f"case {case_id} revision {plan['analysis_revision']} has no confirmed case for its plan: the steps did not run "
                f"or did not finish (`doit -s build` runs only the report): run `doit build case={case_id}`",
            )
        published = {"case": plan["outputs"]["case"], "case_summary": plan["outputs"]["case_summary"], "generation": confirmed.generation}
    _refuse_a_report_of_an_older_plan(ws, case_id, cache, plan, published["generation"])
    from .doitcli import say
    from .interrupts import ignore_interrupts_from_now

    # Flushed at once (say): with thread workers doit may leave its capture
    # in sys.stdout's place, and then nothing flushes this stream at exit
    # (the line was lost in 1 to 5 of 6 such builds wherever
    # PYTHONUNBUFFERED is unset).
    say(
        f"case {case_id} revision {plan['analysis_revision']}: {published['case']} and "
        f"{published['case_summary']} confirmed at generation {published['generation']} "
        f"(request {plan['request_hash'][:16]})\n"
    )
    ignore_interrupts_from_now()  # the build is confirmed and says so; a Ctrl-C now would only contradict it


def _refuse_a_report_of_an_older_plan(ws, case_id: str, cache: BuildCache, plan: dict, reported_generation: int) -> None:
    """The build task alone (``doit -s build``, or ``single`` in a doit
    config) runs none of the steps: after an append or a reopen its plan is
    the previous build's, and it said that revision was "confirmed at
    generation N", N the append's (found by session 23's review). A generation
    past both the plan's and the reported one was never taken in by a build."""
    try:
        planned = cache.read_json(cache.store_state)["store_generation"]
    except (OSError, VianoError, KeyError, TypeError):
        planned = 0
    current = _package(ws, case_id, plan["package_id"], cache).current_generation()
    if isinstance(planned, int) and current > max(planned, reported_generation):
        raise CaseBuildError(
            "STALE_GENERATION",
            f"generation {current} of case {case_id} came after this build's plan (revision {plan['analysis_revision']}), "
            f"and the steps did not run (`doit -s build` runs only the report): run `doit build case={case_id}`",
        )


class CaseBuilder:
    """Python API: ``CaseBuilder(store).build(case_id, package_id)`` runs the
    same steps as ``doit build`` in-process (no incremental cache reuse beyond
    what the steps themselves check)."""

    def __init__(self, store, limits: CaseBuilderLimits | None = None, progress: Callable[[str], None] | None = None) -> None:
        from .lifecycle import CheckpointStore

        if not isinstance(store, CheckpointStore):
            raise CaseBuildError("INVALID_ARGUMENT", f"CaseBuilder takes a CheckpointStore, not {type(store).__name__}")
        if limits is not None and not isinstance(limits, CaseBuilderLimits):
            raise CaseBuildError("INVALID_ARGUMENT", f"limits= takes a CaseBuilderLimits, not {type(limits).__name__}")
        if progress is not None and not callable(progress):
            raise CaseBuildError("INVALID_ARGUMENT", f"progress= takes a callable, not {type(progress).__name__}")
        self.store = store
        #: None: the workspace's own (its ``limits.json``, else the defaults), read per build.
        self.limits = limits
        #: Each progress line of a build (hashing a large file, what an append
        #: added), without its newline; None: written to stderr, as the command does.
        self.progress = progress

    def build(self, case_id: str, package_id: str | None = None) -> BuildResult:
        """Build (or reuse) the case; every failure is a :class:`CaseBuildError`
        carrying the original code, path and pointer (seed 001's API catches
        exactly that type)."""
        from .plan import LIMITS_FROM_CALLER

        # A wrong kind said UNSAFE_ID: case_id '123' is not a safe id, for a
        # str that would be one (session 30's review of the API).
        for name, value in (("case_id", case_id), ("package_id", package_id)):
            if not isinstance(value, str) and not (name == "package_id" and value is None):
                raise CaseBuildError("INVALID_ARGUMENT", f"{name} is a str, not {type(value).__name__}")
        token = _PROGRESS_SINK.set(self.progress)
        from_caller = LIMITS_FROM_CALLER.set(self.limits is not None)
        try:
            return self._build(case_id, package_id)
        except CaseBuildError:
            raise
        except VianoError as error:
            raise CaseBuildError(error.code, error.message, path=error.path, pointer=error.pointer) from error
        except OSError as error:
            # The environment failed: the code the command line gives it too.
            raise coded_io_error(error, CaseBuildError) from error
        except MemoryError:
            # As the command line says it (doitcli.guarded): a host program
            # under a memory cap catches CaseBuildError, not MemoryError.
            raise CaseBuildError("OUT_OF_MEMORY", "the build ran out of memory; what it had published stands and nothing "
                                                  "is left half-written: build again with more memory") from None
        finally:
            LIMITS_FROM_CALLER.reset(from_caller)
            _PROGRESS_SINK.reset(token)

    def _build(self, case_id: str, package_id: str | None) -> BuildResult:
        ws = self.store.workspace
        # The case lock is re-entrant per process (doit holds it for its whole
        # run), so it does not keep this process's other threads out; builds
        # of one case through this API take turns here, as processes do there.
        # An unknown case is refused before its lock file is made, as the
        # command line refuses it: a host given arbitrary ids left one lock
        # file per id in .locks/, and a removed workspace was made again.
        from .workspace import validate_id

        open_existing_store(ws, validate_id(case_id, "case_id"), read_only=True).close()
        with _thread_turn(ws, case_id), _locked(ws, case_id):
            if package_id is not None:
                # Before the build's start is recorded: a call refused for its
                # argument changes nothing (it moved the case to BUILDING_CASE).
                # An unknown case is validate_index's to name, as without one.
                # Read through a store of this thread's own: self.store may
                # have been made on another (the steps open their own too).
                try:
                    looked = open_existing_store(ws, case_id, read_only=True)
                    try:
                        held = looked.get(case_id).package_id
                    finally:
                        looked.close()
                except VianoError as error:
                    if error.code != "UNKNOWN_CASE":
                        raise
                    held = package_id
                if package_id != held:
                    raise CaseBuildError("INVALID_ARGUMENT", f"case {case_id} holds package {held}, not {one_line(str(package_id))}")
            limits = self.limits
            if limits is None:
                from .workspace_limits import read_workspace_limits

                limits = read_workspace_limits(ws.root).case_builder
            plan = step_validate_index(ws.root, case_id, limits)
            if package_id is not None and package_id != plan["package_id"]:
                raise CaseBuildError("INVALID_ARGUMENT", f"case {case_id} holds package {plan['package_id']}, not {package_id}")
            for doc in plan["documents"]:
                step_read_input(ws.root, case_id, plan["package_id"], doc["path"], doc["sha256"], doc["size"], doc["contract"], limits,
                                plan["limits"]["inline_fact_value"])
            for ref in plan["opaque"]:
                step_hash_context(ws.root, case_id, plan["package_id"], ref["path"], ref["sha256"], ref["size"])
            step_assemble(ws.root, case_id)
            step_render(ws.root, case_id)
            return step_publish(ws.root, case_id)

"""Roll a case's store record forward to generations its package already has.

Every command that changes a package publishes the manifest first (the
package's commit point) and records the new generation in the
CheckpointStore second. A crash between the two leaves the store one or more
generations behind. :func:`roll_forward` finishes that second step from what
the published manifests say, so a retry never creates another generation:

* a generation holding this revision's ``case-built.json`` is a case
  publication -> confirm it (``case_built``) with its own step id and hash;
* a generation that raises ``analysis_revision`` by one is a reopen (its
  ``inputs/<generation>/reopen.json`` says who asked and why);
* anything else is an intake (append, enrich).

Callers hold the case lock.
"""

from __future__ import annotations

import contextlib
import os
import stat

from .errors import IntegrityError, VianoError
from .jsoncanon import decode_strict
from .plan import case_paths_for
from .workspace import ADMISSION_MARKER, is_staging_name

__all__ = ["roll_forward", "recording_what_was_published", "remove_unpublished_content", "check_store_is_the_packages"]

_CASE_BUILT_LIMIT = 1024 * 1024
_MANIFEST_PARSE_LIMIT = 64 * 1024 * 1024


@contextlib.contextmanager
def recording_what_was_published(case_id: str, generation: int):
    """Around the checkpoint of a generation just published: when the store
    cannot be written (a full disk), the refusal says the work is not lost.
    The manifest is the commit point, and the next command on the case takes
    the generation in (:func:`roll_forward`); a bare ``IO_ERROR`` read as if
    nothing had been done."""
    try:
        yield
    except VianoError as error:
        if error.code != "IO_ERROR":
            raise
        raise type(error)(
            error.code,
            f"{error.message}; generation {generation} was published before this, and the next command on case "
            f"{case_id} that can write the store takes it in",
            path=error.path,
            pointer=error.pointer,
        ) from None


def roll_forward(store, package, case_id: str):
    """Take in every published generation the store has not recorded yet, and
    remove what crashed writers left behind (temp files, unpublished content).

    A store ahead of the manifests means a published manifest went missing:
    ``INTEGRITY_ERROR`` before anything is touched, because everything the
    lost generations published would otherwise look unpublished and be
    removed."""
    record = store.get(case_id)
    current = check_store_is_the_packages(package, record.generation, store.recorded_manifest(case_id, record.generation))
    _remove_manifest_temps(package)
    remove_dead_staging(package.workspace)
    # The store row exists, so an admission marker left by a crash between the
    # commit and its removal is stale; clearing it keeps a later loss of the
    # store from mistaking this case for a crashed admission. (Checked before
    # importing intake: that import costs a no-op rebuild ~12 ms.)
    if os.path.lexists(package.workspace.case_dir(case_id) / ADMISSION_MARKER):
        from .intake import clear_admission_marker

        clear_admission_marker(package.workspace, case_id)
    while record.generation < current:
        target = record.generation + 1
        previous = package.manifest(record.generation)
        manifest = package.manifest(target)
        revision = record.analysis_revision
        outputs = case_paths_for(revision)
        if manifest["analysis_revision"] == revision + 1:
            detail = {"recovered": True}
            note = f"inputs/{target}/reopen.json"
            if note in manifest["files"] and note not in previous["files"]:
                data = package.read_verified(note, _CASE_BUILT_LIMIT, manifest=manifest)
                recorded = decode_strict(data, max_bytes=_CASE_BUILT_LIMIT, path=note, error=IntegrityError)
                detail = {"by": recorded.get("by"), "reason": recorded.get("reason"), "recovered": True}
            store.advance(case_id, "reopen", expected_generation=record.generation, new_generation=target,
                          detail=detail, manifest_sha256=package.manifest_sha256(target))
        elif outputs["case_built"] in manifest["files"] and outputs["case_built"] not in previous["files"]:
            data = package.read_verified(outputs["case_built"], _CASE_BUILT_LIMIT, manifest=manifest)
            built = decode_strict(data, max_bytes=_CASE_BUILT_LIMIT, path=outputs["case_built"], error=IntegrityError)
            if record.state == "VALIDATED" or record.state == "REOPENED":
                store.advance(case_id, "start_build", expected_generation=record.generation,
                              step_id=built["step_id"], request_hash=built["request_hash"])
            store.advance(
                case_id,
                "case_built",
                expected_generation=record.generation,
                new_generation=target,
                step_id=built["step_id"],
                request_hash=built["request_hash"],
                artifacts=[outputs["case"], outputs["case_summary"], outputs["case_built"]],
                manifest_sha256=package.manifest_sha256(target),
            )
        else:
            store.advance(case_id, "intake", expected_generation=record.generation, new_generation=target,
                          manifest_sha256=package.manifest_sha256(target))
        record = store.get(case_id)
        if record.generation != target:
            # advance() takes a confirmation it already holds as a replay and
            # changes nothing: a store whose case row is behind its own
            # checkpoints would otherwise be rolled forward forever, under
            # the case lock every other writer waits for.
            from .packages import manifest_name

            raise IntegrityError(
                "INTEGRITY_ERROR",
                f"the checkpoint store contradicts itself: its record of case {case_id} is at generation "
                f"{record.generation}, yet it already holds the confirmation that manifests/{manifest_name(target)} "
                "publishes (a store changed by hand?); no published file was changed",
                path=package.workspace.store_path.name if package.workspace is not None else None,
            )
    remove_unpublished_content(package)
    return record


def check_store_is_the_packages(package, generation: int, recorded: tuple[int, str] | None) -> int:
    """Refuse a store whose record of the case is not this package's; return
    the package's current generation.

    * The store at a generation beyond the package's manifests: a published
      manifest went missing (everything the lost generations published would
      otherwise look unpublished, and a roll-forward would remove it).
    * ``recorded``, ``(generation, sha256)`` from
      :meth:`CheckpointStore.recorded_manifest`, not the package's manifest
      of that generation: a published manifest never changes, so the store
      was made for another copy of the package (a store copied from another
      workspace with the same case and package ids, another history); taking
      it for this one's would show its checkpoints as this package's and
      refuse builds for a confirmation this package never had. None (a store
      older than the record) is compared with nothing.

    Both are ``INTEGRITY_ERROR`` before anything is touched."""
    from .packages import manifest_name

    current = package.current_generation()
    if generation > current:
        raise IntegrityError(
            "INTEGRITY_ERROR",
            f"the checkpoint store records generation {generation} but the package's manifests end at "
            f"generation {current}: a published manifest is missing; nothing was changed",
            path=f"manifests/{manifest_name(current + 1)}",
        )
    if recorded is None:
        return current
    recorded_generation, recorded_sha256 = recorded
    found = package.manifest_sha256(recorded_generation)
    if found != recorded_sha256:
        raise IntegrityError(
            "INTEGRITY_ERROR",
            f"the checkpoint store is not this workspace's record of case {package.case_id}: it took in generation "
            f"{recorded_generation} as a manifest with SHA-256 {recorded_sha256[:16]}..., and "
            f"manifests/{manifest_name(recorded_generation)} here has {found[:16]}... (a store copied from another "
            "workspace?); nothing was changed",
            path=package.workspace.store_path.name if package.workspace is not None else None,
        )
    return current


def remove_dead_staging(workspace) -> None:
    """Remove the staging trees of admissions and appends that were killed
    (they may hold gigabytes), here as the next admit or append does: a
    tree's writer lives while it holds its owner lock, so no live writer's
    tree goes. The admission module is imported only when the workspace's
    staging directory holds a staging name (a rebuild does not pay for it).
    A live writer's tree (a long admission of another case) costs a build
    that import meanwhile, ~18 ms."""
    staging = workspace.staging_dir()
    try:
        # Never through a link: it would clear trees wherever it points.
        if not stat.S_ISDIR(os.lstat(staging).st_mode) or not any(map(is_staging_name, os.listdir(staging))):
            return
    except OSError:
        return  # none (the usual case), or not readable: nothing to clear here
    from .intake import remove_stale_staging

    remove_stale_staging(staging)


def remove_unpublished_content(package) -> list[str]:
    """Remove content files no manifest lists: what a writer linked into
    ``content/`` before it crashed, ahead of its manifest (RELIABILITY 37).

    Such a file was never published (the manifest link is the commit point),
    so removing it rewrites nothing; leaving it would make a later, different
    publication of the same path fail with CONTENT_CONFLICT forever. The
    directories such a writer made are removed too once empty: a manifest
    lists files only, and an empty ``newdir/`` would block a later file named
    ``newdir`` the same way. Only safe under the case lock, where no other
    writer of this package is between its content and its manifest. Symlinks
    and other non-regular entries are left alone (reads refuse them anyway).
    """
    generation = package.current_generation()
    root = package.content_dir
    walked = list(os.walk(root, followlinks=False))
    empty_leaf = any(not dirnames and not names for dirpath, dirnames, names in walked if dirpath != str(root))
    if generation and not empty_leaf and sum(len(names) for _, _, names in walked) <= _listed_count(package, generation):
        # Published files never go away, so no more names than the manifest
        # lists (and no empty directory) means nothing unpublished is here;
        # the common case skips the per-file lstat and the manifest load.
        return []
    present = []
    for dirpath, _dirnames, names in walked:
        for name in names:
            full = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(full).st_mode):
                present.append(os.path.relpath(full, root).replace(os.sep, "/"))
    listed = set(package.manifest(generation)["files"]) if generation else set()
    removed = []
    for rel in present:
        if rel not in listed:
            os.unlink(os.path.join(root, rel))
            removed.append(rel)
    touched = {os.path.dirname(os.path.join(root, rel)) for rel in removed}
    for dirpath, _dirnames, _names in reversed(walked):  # deepest first
        if dirpath != str(root) and not os.listdir(dirpath):
            os.rmdir(dirpath)
            removed.append(os.path.relpath(dirpath, root).replace(os.sep, "/") + "/")
            touched.discard(dirpath)
            touched.add(os.path.dirname(dirpath))
    if removed:
        _fsync_dirs(touched)
    return sorted(removed)


def _remove_manifest_temps(package) -> None:
    """Temp manifests of writers that died (under the case lock no writer of
    this package is alive; content temps go with the unpublished content)."""
    from .packages import is_temp_name

    try:
        names = os.listdir(package.manifests_dir)
    except FileNotFoundError:
        return
    stale = [name for name in names if is_temp_name(name)]
    for name in stale:
        os.unlink(package.manifests_dir / name)
    if stale:
        _fsync_dirs({str(package.manifests_dir)})


def _listed_count(package, generation: int) -> int:
    """How many files the manifest lists, from a plain parse of its bytes (any
    doubt answers -1, which forces the validated path)."""
    import json

    from .packages import manifest_name

    try:
        with open(package.manifests_dir / manifest_name(generation), "rb") as handle:
            # Sized from fstat: read(limit) would allocate the whole limit first.
            size = os.fstat(handle.fileno()).st_size
            if size > _MANIFEST_PARSE_LIMIT:
                return -1
            files = json.loads(handle.read(size + 1)).get("files")
        return len(files) if isinstance(files, dict) else -1
    except (OSError, ValueError, AttributeError, RecursionError):
        return -1


def _fsync_dirs(directories) -> None:
    for directory in sorted(directories):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

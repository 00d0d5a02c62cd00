"""The lifecycle commands behind ``doit admit|append|reopen|export|status|probes``.

Each ``cmd_*`` takes the raw doit variables (strings or None), validates them
(a bad variable is a one-line error with a code and changes nothing), does its
I/O under the case lock, and prints its result on stdout. Long work reports
progress on stderr.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from pathlib import Path

from .errors import AdmissionError, CaseBuildError, LifecycleError, VianoError, coded_io_error, one_line
from .jsoncanon import CASE_MAX_DEPTH, MAX_SAFE_INTEGER, decode_strict, pretty_bytes, sha256_hex
from .workspace import user_path
from .workspace_limits import PUBLISHED_CASE_CEILING, PUBLISHED_SUMMARY_CEILING, read_workspace_limits

__all__ = [
    "cmd_admit",
    "cmd_append",
    "cmd_reopen",
    "cmd_export",
    "cmd_status",
    "cmd_probes",
    "OPERATOR_SOURCE_RE",
]

#: ARCHITECTURE.md section 12: human:NAME, agent:SESSION[:parent=CASE_ID], system:ORIGIN.
OPERATOR_SOURCE_RE = re.compile(
    r"^(human:[^\s:][^\x00-\x1f\x7f-\x9f\u2028\u2029]{0,127}"
    r"|agent:[A-Za-z0-9][A-Za-z0-9._-]{0,127}(:parent=[A-Za-z0-9][A-Za-z0-9._-]{0,127})?"
    r"|system:[A-Za-z0-9][A-Za-z0-9._-]{0,127})$"
)
_REASON_LIMIT = 4096


def _coded(command):
    """A command whose environment fails (disk full, permissions) raises
    ``IO_ERROR`` in-process too, as ``doitcli.guarded`` reports it on the
    command line. A reader gone away (``doit status | head``) stays a
    ``BrokenPipeError``: the command line ends quietly then."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except BrokenPipeError:
            raise
        except OSError as error:
            raise coded_io_error(error) from None

    return run


def _required(value, name: str) -> str:
    if value is None or str(value).strip() == "":
        raise VianoError("INVALID_ARGUMENT", f"missing variable {name}=...")
    return str(value)


def _required_text(value, name: str) -> str:
    """A required variable that is recorded as text (JSON, the store): bytes
    that are not UTF-8 arrive from the command line as lone surrogates."""
    text = _required(value, name)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise VianoError("INVALID_ARGUMENT", f"{name}= is not valid UTF-8 text") from None
    return text


def _context(case_var, workspace_var):
    from .workspace import Workspace, validate_id

    case_id = validate_id(_required(case_var, "case"), "case_id")
    ws = Workspace.from_var(workspace_var)
    return case_id, ws


def _existing_store(ws, case_id, *, read_only: bool = False):
    from .build import open_existing_store

    return open_existing_store(ws, case_id, read_only=read_only)


@contextlib.contextmanager
def _caught_up(ws, store, case_id: str):
    """Hold the case lock with the store rolled forward to every published
    generation: ``(record, package)`` as the next change must see them."""
    from .build import case_cache
    from .packages import Package
    from .recovery import roll_forward
    from .workspace import case_lock

    with case_lock(ws, case_id):
        record = store.get(case_id)
        # The manifest a command publishes is left parsed for the next build.
        parsed = case_cache(ws, case_id).parsed_manifests(keep_loaded=False)
        package = Package(ws, case_id, record.package_id, parsed_manifests=parsed)
        yield roll_forward(store, package, case_id), package


def _observed(ws, case_id: str):
    """``(record, package)`` as the store last recorded them, read without
    taking the case lock or writing anything (status, probes, a read-only
    workspace)."""
    from .packages import Package
    from .recovery import check_store_is_the_packages

    store = _existing_store(ws, case_id, read_only=True)
    try:
        record = store.get(case_id)
        recorded = store.recorded_manifest(case_id, record.generation)
    finally:
        store.close()
    package = Package(ws, case_id, record.package_id, parsed_manifests=_parsed_manifests_to_read(ws, case_id))
    check_store_is_the_packages(package, record.generation, recorded)
    return record, package


def _parsed_manifests_to_read(ws, case_id: str):
    """The manifests earlier commands left checked in the case's cache, for a
    command that only observes: it reads them and writes none (it publishes
    nothing). Planning loads every generation's manifest, each listing every
    file, so checking them all again made status slower by the square of the
    appends (800 appends: 7 s). None where the cache is refused (a symlink):
    the outlook says so where it reads the cache."""
    from .build import case_cache

    try:
        return case_cache(ws, case_id).parsed_manifests(keep_loaded=False)
    except VianoError:
        return None


def _out(line: str) -> None:
    from .doitcli import say

    say(line + "\n")


def _progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# ------------------------------------------------------------------ admit


@_coded
def cmd_admit(case=None, source=None, workspace=None) -> None:
    """Admit a ZIP or directory bug package as a new case (state VALIDATED)."""
    from .intake import admit

    case_id, ws = _context(case, workspace)
    source_path = user_path(_required(source, "source"))
    if not source_path.exists() and not source_path.is_symlink():
        raise AdmissionError("SOURCE_NOT_FOUND", "the source does not exist", path=source)
    manifest = admit(ws, case_id, source_path, limits=read_workspace_limits(ws.root).admission())
    total = sum(entry["size"] for entry in manifest["files"].values())
    _out(
        f"admitted case {case_id}: package {manifest['package_id']}, generation 1, "
        f"{len(manifest['files'])} files, {total} bytes, state VALIDATED"
    )


# ------------------------------------------------------------------ append


@_coded
def cmd_append(case=None, source=None, workspace=None) -> None:
    """Add new files and a returning case-inputs index as a new generation."""
    from .build import plan_ahead
    from .intake import read_append_source, refuse_source_holding
    from .packages import PackageWriter
    from .plan import step_id_for
    from .reader import read_document

    case_id, ws = _context(case, workspace)
    source_path = user_path(_required(source, "source"))
    if not source_path.exists() and not source_path.is_symlink():
        raise AdmissionError("SOURCE_NOT_FOUND", "the source does not exist", path=source)
    configured = read_workspace_limits(ws.root)
    limits = configured.case_builder
    store = _existing_store(ws, case_id)
    try:
        with _caught_up(ws, store, case_id) as (record, package):
            if record.state == "BLOCKED":
                raise LifecycleError("ILLEGAL_TRANSITION", "the case is BLOCKED; resume it before appending")
            confirmed = record.state == "COMPLETED" or store.confirmed(case_id, step_id_for(record.analysis_revision))

            def reopen_required() -> LifecycleError:
                return LifecycleError(
                    "REOPEN_REQUIRED",
                    f"revision {record.analysis_revision} has a confirmed case; reopen the case before appending",
                )

            def only_a_repeat(index_bytes: bytes, sizes: dict[str, int]) -> None:
                # A confirmed revision takes nothing new: refuse before copying
                # a byte unless this can only be a repeat (same index bytes,
                # every file already there with its size); hashes decide later.
                if confirmed and not _may_be_held(package.manifest(record.generation), index_bytes, sizes):
                    raise reopen_required()

            refuse_source_holding(source_path, ws.root)
            current = package.manifest(record.generation)
            staged = read_append_source(
                source_path, _append_source_limits(configured), staging_dir=ws.staging_dir(), before_staging=only_a_repeat,
                may_be_held=lambda index_bytes, sizes: _may_be_held(current, index_bytes, sizes),
                held=lambda index_bytes, digests: _already_held(current, index_bytes, digests),
            )
            try:
                index_bytes = staged.index_bytes
                read_document(index_bytes, "case-inputs", path="case-inputs.json", max_bytes=limits.document_bytes)
                manifest = package.manifest(record.generation)
                generation = record.generation + 1
                index_path = f"inputs/{generation}/case-inputs.json"
                files = dict(staged.files)
                if index_path in files:
                    raise AdmissionError("RESERVED_PATH", f"{index_path} is written by append itself", path=index_path)
                returning = decode_strict(index_bytes, max_bytes=limits.document_bytes)
                _check_no_name_collides(files, manifest)
                _check_returning_index(returning, files, manifest)
                _check_prior_roles_kept(returning, package, manifest, record.analysis_revision, limits)
                if _already_held(manifest, index_bytes, staged.digests):
                    # A repeated append (a retried CI step, also after its
                    # build): a generation would change nothing a build reads,
                    # and the user meant none.
                    _out(
                        f"nothing to append to case {case_id}: its index and all {len(staged.files)} files are "
                        f"already in generation {record.generation}"
                    )
                    return
                if confirmed:
                    raise reopen_required()
                _check_the_build_would_fit(package, manifest, record.generation, returning, index_bytes, staged.files, index_path, limits)
                dropped = _no_longer_listed(package, manifest, returning, limits)
                _refuse_damage_a_build_would_meet(package, manifest, record.generation)
                files = {**staged.staged_files(), index_path: index_bytes}
                new_manifest = PackageWriter(package).publish(
                    record.generation, files, artifacts={"case_inputs": index_path}
                )
                from .recovery import recording_what_was_published

                with recording_what_was_published(case_id, new_manifest["package_generation"]):
                    store.advance(
                        case_id, "intake", expected_generation=record.generation,
                        new_generation=new_manifest["package_generation"],
                        manifest_sha256=package.manifest_sha256(new_manifest["package_generation"]),
                    )
                plan_ahead(ws, case_id, store, limits)
            finally:
                staged.cleanup()
    finally:
        store.close()
    new = sum(1 for path in staged.files if path not in manifest["files"])
    _out(
        f"appended to case {case_id}: generation {new_manifest['package_generation']}, "
        f"{new} new files, {len(staged.files) - new} already present, index {index_path}"
    )
    if dropped:
        _progress(
            f"note: {len(dropped)} input(s) the previous index listed and this one does not stay inherited, "
            f"as do those of every earlier index and of the prior case (an inherited document that fails "
            f"its contract is dropped with a SUPERSEDED_INPUT gap; doit status lists what the build reads): "
            + ", ".join(one_line(path) for path in dropped[:5]) + (" ..." if len(dropped) > 5 else "")
        )


def _may_be_held(manifest: dict, index_bytes: bytes, sizes: dict[str, int]) -> bool:
    """What :func:`_already_held` would find from sizes alone (no content read)."""
    import hashlib

    current = manifest.get("artifacts", {}).get("case_inputs")
    entries = manifest["files"]
    if not current or current not in entries or entries[current]["size"] != len(index_bytes):
        return False
    if entries[current]["sha256"] != hashlib.sha256(index_bytes).hexdigest():
        return False
    return all(path in entries and entries[path]["size"] == size for path, size in sizes.items())


def _already_held(manifest: dict, index_bytes: bytes, digests: dict[str, tuple[str, int]]) -> bool:
    """Whether the package already holds this append: the current index has
    exactly these bytes, and every file is present with the same bytes (as
    hashed while it was staged)."""
    import hashlib

    current = manifest.get("artifacts", {}).get("case_inputs")
    entries = manifest["files"]
    if not current or current not in entries or any(path not in entries for path in digests):
        return False
    if entries[current]["size"] != len(index_bytes) or entries[current]["sha256"] != hashlib.sha256(index_bytes).hexdigest():
        return False
    return all((entries[path]["sha256"], entries[path]["size"]) == digest for path, digest in digests.items())


def _listed(index) -> list[str]:
    from .plan import _index_roles

    found = []
    for _, _, listed in _index_roles(index):
        found.extend(ref for ref in listed if isinstance(ref, str) and ref not in found)
    return found


def _no_longer_listed(package, manifest: dict, returning: dict, limits) -> list[str]:
    """Inputs the current index lists that the returning one does not (a user
    who meant to add to the inventory learns it here, not from a thinner case)."""
    current = manifest.get("artifacts", {}).get("case_inputs")
    if not current:
        return []
    try:
        before = decode_strict(package.read_verified(current, limits.document_bytes, manifest=manifest),
                               max_bytes=limits.document_bytes, path=current)
    except VianoError:
        return []
    from .workspace import check_reference

    def usable(ref: str) -> bool:  # the build skips an unusable reference; it is not inherited
        try:
            check_reference(ref)
        except VianoError:
            return False
        return True

    after = set(_listed(returning))
    return [ref for ref in _listed(before) if ref not in after and usable(ref)]


def _check_no_name_collides(new_files: dict, manifest: dict) -> None:
    """Admission refuses names that one case-insensitive or normalising
    filesystem would merge (NFC + case folding, file vs directory); an append
    must not bring in what admission would have refused beside the files
    already there. A path already in the package is not new (identical bytes
    are accepted, different bytes are a CONTENT_CONFLICT when published)."""
    from .zipscan import NameRegistry

    registry = NameRegistry("SOURCE_NAME_COLLISION", "SOURCE_NAME_COLLISION")
    for path in sorted(manifest["files"]):
        try:
            registry.add(tuple(path.split("/")), False, path)
        except AdmissionError:
            pass  # admitted before this check existed: what is there stays appendable
    for path in sorted(new_files):
        if path not in manifest["files"]:
            registry.add(tuple(path.split("/")), False, path)


def _check_returning_index(index: dict, new_files: dict, manifest: dict) -> None:
    """Every path a returning index lists is either new in this append or already
    in the package (then it is inherited, re-read from its immutable original),
    and is listed once: the build would refuse the index otherwise
    (DUPLICATE_SOURCE), so the append refuses it before anything is written."""
    from .plan import _index_roles, is_generated
    from .workspace import check_reference

    seen: dict[str, str] = {}
    # The build's own walk of an index (role names, order), on a validated
    # index whose lists hold only strings, so positions are the index's own.
    for role, prefix, listed in _index_roles(index):
        for position, ref in enumerate(listed):
            pointer = f"{prefix}/{position}"
            try:
                check_reference(ref)
            except VianoError as exc:
                raise CaseBuildError(exc.code, exc.message, path="case-inputs.json", pointer=pointer) from None
            if is_generated(ref):
                raise CaseBuildError(
                    "REFERENCE_UNSAFE", f"{ref!r} is written by the builder, not an input",
                    path="case-inputs.json", pointer=pointer,
                )
            if ref not in new_files and ref not in manifest["files"]:
                raise CaseBuildError(
                    "REFERENCE_MISSING", f"{ref!r} is neither in this append nor in the package",
                    path="case-inputs.json", pointer=pointer,
                )
            if ref in seen:
                where = "twice in " + role if seen[ref] == role else f"as {seen[ref]} and as {role}"
                raise CaseBuildError("DUPLICATE_SOURCE", f"{ref!r} is listed {where}", path="case-inputs.json", pointer=pointer)
            seen[ref] = role


def _check_prior_roles_kept(index: dict, package, manifest: dict, revision: int, limits) -> None:
    """A returning index may not move an input of the prior case to another
    role (the build refuses it, see plan.role_change_error); refused here,
    before the append writes a generation that no build could then use."""
    from .build import document_readers
    from .plan import GENERATED_RE, _index_roles, prior_case_roles, role_change_error

    prior_path = manifest.get("artifacts", {}).get("case")
    if not prior_path or GENERATED_RE.fullmatch(prior_path) is None or int(prior_path.split("/")[2]) >= revision:
        return
    entry = manifest["files"][prior_path]
    _, read_prior_case = document_readers(package, limits)
    view = read_prior_case({"path": prior_path, "sha256": entry["sha256"], "size": entry["size"]}, manifest)
    prior_role: dict[str, str] = {}
    for role, refs in prior_case_roles(view):
        for ref in refs:
            prior_role.setdefault(ref["path"], role)
    for role, prefix, listed in _index_roles(index):
        for position, path in enumerate(listed):
            if prior_role.get(path, role) != role:
                raise role_change_error(path, prior_role[path], role, "case-inputs.json", f"{prefix}/{position}")


def _append_source_limits(configured):
    """The admission limits for an append source. Its ``case-inputs.json`` is
    an index, which the build holds to ``document_bytes``: a workspace that
    raised that limit takes indexes that large without raising
    ``manifest_bytes`` too (the index is read against its contract, within
    ``document_bytes``, right after staging)."""
    import dataclasses

    admission = configured.admission()
    if admission.manifest_bytes < configured.case_builder.document_bytes:
        admission = dataclasses.replace(admission, manifest_bytes=configured.case_builder.document_bytes)
    return admission


def _check_the_build_would_fit(
    package, manifest: dict, generation: int, index: dict, index_bytes: bytes, files: dict, index_path: str, limits
) -> None:
    """Refuse an append after which no build of the revision could meet the
    limits of the whole build (how many structured documents, how many bytes
    of them): what earlier indexes listed stays inherited, and no later index
    can drop it, so such an append would leave the revision unbuildable for
    good, a failure no corrected append could resume (seed 001). Planned from
    sizes, for the generation this append would publish, before anything is
    written. Any other problem of that plan is the build's to report."""
    import hashlib

    from .build import document_readers
    from .plan import check_aggregate_limits, check_index_history, make_plan

    entries = dict(manifest["files"])
    for path, staged in files.items():
        if path not in entries:
            # Only sizes count here; the digest is the build's business.
            entries[path] = {"sha256": "0" * 64, "size": os.stat(staged).st_size}
    entries[index_path] = {"sha256": hashlib.sha256(index_bytes).hexdigest(), "size": len(index_bytes)}
    proposed = {
        **manifest,
        "files": entries,
        "package_generation": generation + 1,
        "artifacts": {**manifest.get("artifacts", {}), "case_inputs": index_path},
    }
    read_index, read_prior_case = document_readers(package, limits)
    try:
        plan = make_plan(package, generation, limits, read_index=read_index, read_prior_case=read_prior_case,
                         enforce_limits=False, proposed=(proposed, index))
    except VianoError:
        return
    try:
        check_aggregate_limits(plan, limits)
        check_index_history(plan, limits)
    except VianoError as error:
        # "N things, limit L (hint)" -> "N things (limit L; hint)"
        what, _, hint = error.message.partition(" (")
        hint = f"; {hint[:-1]}" if hint.endswith(")") else ""
        raise CaseBuildError(
            "LIMIT_EXCEEDED",
            f"after this append the build would read {what.replace(', limit', ' (limit')}{hint}); what earlier "
            "indexes listed stays inherited, so nothing was appended",
            path="case-inputs.json",
        ) from None


# ------------------------------------------------------------------ reopen


def _refuse_damage_a_build_would_meet(package, manifest: dict, generation: int) -> None:
    """Reopen and append publish without reading earlier files: refuse, before
    a generation goes on top of it, damage the next build would stop at
    (a listed file gone or behind a symlink, an earlier manifest it plans from
    that no longer reads), instead of carrying it forward."""
    package.refuse_missing_listed_files(manifest)
    for earlier in range(1, generation):
        package.manifest_outline(earlier)


@_coded
def cmd_reopen(case=None, by=None, reason=None, workspace=None) -> None:
    """Open a new analysis revision on a built or completed case."""
    from .build import leave_prior_view
    from .packages import PackageWriter
    from .plan import step_id_for

    case_id, ws = _context(case, workspace)
    source = _required_text(by, "by")
    if not OPERATOR_SOURCE_RE.fullmatch(source):
        raise VianoError("INVALID_ARGUMENT", "by= must be human:NAME, agent:SESSION[:parent=CASE] or system:ORIGIN")
    text = _required_text(reason, "reason")
    if len(text) > _REASON_LIMIT:
        raise VianoError("INVALID_ARGUMENT", f"reason is longer than {_REASON_LIMIT} characters")
    read_workspace_limits(ws.root)  # a refused limits.json stops every command alike
    store = _existing_store(ws, case_id)
    try:
        with _caught_up(ws, store, case_id) as (record, package):
            if record.state == "REOPENED" and _reopened_by(store, case_id, source, text):
                # This very reopen is in already (a retry after a failure
                # that came once it was published): say so, as a repeated
                # append does, instead of refusing a second reopen.
                _out(
                    f"case {case_id} is already reopened by this request: analysis revision {record.analysis_revision}, "
                    f"generation {record.generation}, state REOPENED"
                )
                return
            built = store.confirmed(case_id, step_id_for(record.analysis_revision))
            if not (record.state == "COMPLETED" or (record.state == "BUILDING_CASE" and built is not None)):
                raise LifecycleError(
                    "ILLEGAL_TRANSITION",
                    f"reopen needs a built or completed case; {case_id} is {record.state}"
                    + ("" if built else " without a confirmed case"),
                )
            if record.analysis_revision >= MAX_SAFE_INTEGER:
                # Revision 2**53 would be published in a manifest that every
                # reader of this workspace (this builder's included) refuses.
                raise LifecycleError(
                    "ILLEGAL_TRANSITION",
                    f"{case_id} is at analysis revision {record.analysis_revision}, the highest a manifest can hold "
                    f"(2^53 - 1); it cannot be reopened",
                )
            _refuse_damage_a_build_would_meet(package, package.manifest(record.generation), record.generation)
            generation = record.generation + 1
            note = {
                "format": "viano-reopen",
                "format_version": 1,
                "by": source,
                "reason": text,
                "from_revision": record.analysis_revision,
                "to_revision": record.analysis_revision + 1,
            }
            new_manifest = PackageWriter(package).publish(
                record.generation,
                {f"inputs/{generation}/reopen.json": pretty_bytes(note)},
                analysis_revision=record.analysis_revision + 1,
            )
            from .recovery import recording_what_was_published

            with recording_what_was_published(case_id, new_manifest["package_generation"]):
                store.advance(
                    case_id, "reopen", expected_generation=record.generation,
                    new_generation=new_manifest["package_generation"],
                    detail={"by": source, "reason": text},
                    manifest_sha256=package.manifest_sha256(new_manifest["package_generation"]),
                )
            leave_prior_view(ws, case_id, package)
    finally:
        store.close()
    _out(
        f"reopened case {case_id}: analysis revision {new_manifest['analysis_revision']}, "
        f"generation {new_manifest['package_generation']}, state REOPENED"
    )


def _reopened_by(store, case_id: str, source: str, reason: str) -> bool:
    """Whether the case's last checkpoint is a reopen by ``source`` for ``reason``."""
    checkpoints = store.checkpoints(case_id)
    last = checkpoints[-1] if checkpoints else None
    return (
        last is not None
        and last.transition == "reopen"
        and isinstance(last.detail, dict)
        and last.detail.get("by") == source
        and last.detail.get("reason") == reason
    )


# ------------------------------------------------------------------ export


@_coded
def cmd_export(case=None, dest=None, workspace=None) -> None:
    """Copy the current case.json, case_summary.md and manifest to ``dest``."""
    case_id, ws = _context(case, workspace)
    destination = user_path(_required(dest, "dest"))
    # Published outputs are read up to the largest any workspace may have
    # published (limits bound new work only); a refused limits.json still
    # stops this command as every other.
    read_workspace_limits(ws.root)
    # The workspace holds only what the pipeline writes: a file exported into
    # a package's content would be taken for a crashed writer's and removed,
    # and one anywhere else would be left for nothing to account for.
    if _inside_workspace(destination, ws.root):
        raise VianoError("INVALID_ARGUMENT", "dest is inside the workspace", path=dest)

    from .lifecycle import on_read_only_filesystem, out_of_space

    if on_read_only_filesystem(ws.root) or not _may_write_the_store_and_lock(ws, case_id):
        # Nothing can be locked or rolled forward there (an archived
        # workspace, a read-only mount, another user's workspace this one
        # may only read): the store's last confirmed state is exported as it
        # stands.
        record, package = _observed(ws, case_id)
    else:
        try:
            store = _existing_store(ws, case_id)
            try:
                with _caught_up(ws, store, case_id) as (record, package):
                    pass  # a publication whose checkpoint was lost is confirmed first
            finally:
                store.close()
        except VianoError as error:
            # On a full disk likewise, once the store could not be written;
            # but not past a publication the store has yet to take in (it
            # may be this revision's case), which needs the store written.
            if error.code != "IO_ERROR" or not out_of_space(ws.root):
                raise
            record, package = _observed(ws, case_id)
            if package.current_generation() > record.generation:
                raise VianoError(
                    "IO_ERROR", f"{error.message}; generation {package.current_generation()} is published and not yet "
                    "taken in, which needs the store written: free some space and export again", path=error.path,
                ) from None
    current = package.manifest(record.generation)
    case_path = current.get("artifacts", {}).get("case")
    if not case_path:
        raise CaseBuildError("NOT_BUILT", f"case {case_id} has no built case document yet")
    # Export the case with the manifest that published it: after a reopen the
    # current manifest belongs to a revision that has no case yet, and pairing
    # it with the earlier case would mislabel the export.
    manifest = _publishing_manifest(package, record.generation, case_path)
    artifacts = manifest["artifacts"]
    outputs = {
        "case.json": package.read_verified(artifacts["case"], PUBLISHED_CASE_CEILING, manifest=manifest),
        "case_summary.md": package.read_verified(artifacts["case_summary"], PUBLISHED_SUMMARY_CEILING, manifest=manifest),
        "manifest.json": pretty_bytes(manifest),
    }
    if destination.exists() and not destination.is_dir():
        raise VianoError("INVALID_ARGUMENT", "dest exists and is not a directory", path=dest)
    if destination.is_symlink() and not destination.exists():
        raise VianoError("INVALID_ARGUMENT", "dest is a symbolic link to nothing", path=dest)
    try:
        destination.mkdir(parents=True, exist_ok=True)
        with _export_lock(destination, dest):
            _write_export(destination, outputs)
    except OSError as error:
        raise VianoError("IO_ERROR", f"cannot export: {error.strerror or error}", path=dest) from None
    _out(
        f"exported case {case_id} revision {manifest['analysis_revision']} "
        f"(published at generation {manifest['package_generation']}) to {one_line(os.fspath(destination), 600)}"
    )
    if current["analysis_revision"] != manifest["analysis_revision"]:
        _progress(
            f"note: revision {current['analysis_revision']} has no case yet; "
            f"this is the case of revision {manifest['analysis_revision']}"
        )


#: How long an export waits for another export to the same destination.
EXPORT_LOCK_TIMEOUT = 30.0


def _may_write_the_store_and_lock(ws, case_id: str) -> bool:
    """Whether this user may take the case lock and write the store (export
    rolls a lost confirmation forward under the lock): not in a workspace of
    another user's that it may only read."""
    lock = ws.lock_path(case_id)  # case_id checked by _context
    paths = (ws.root, ws.store_path, lock.parent, lock)
    return all(os.access(path, os.W_OK) for path in paths if os.path.lexists(path))


@contextlib.contextmanager
def _export_lock(destination: Path, dest: str):
    """Exports to one destination take turns: ``flock`` on the directory itself.

    Without it, two exports of different revisions started together could
    each find a file missing, and one find the other's ``case.json`` already
    linked, take it for its own and add its own summary and manifest: a
    mixed set, both reporting success. The lock is on the directory, so no
    lock file is left in it; the kernel drops it when an export dies. Where
    the filesystem has no ``flock`` for a directory (some network
    filesystems), the export goes on uncoordinated, as it did before.
    """
    import fcntl
    import time

    fd = os.open(destination, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        started = time.monotonic()
        noticed = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError:
                break  # no flock here: uncoordinated, as documented
            waited = time.monotonic() - started
            if waited >= EXPORT_LOCK_TIMEOUT:
                raise VianoError(
                    "LOCK_TIMEOUT",
                    f"another export to {one_line(dest, 600)} is still writing; gave up after {EXPORT_LOCK_TIMEOUT:g}s",
                )
            if not noticed and waited >= 1.0:
                noticed = True
                _progress(f"waiting for {one_line(dest, 600)}: another export is writing there")
            time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def _write_export(destination: Path, outputs: dict[str, bytes]) -> None:
    """Write the export's files that are not there yet, never overwriting one."""
    from .packages import write_durable

    written: list[Path] = []
    attempted: tuple[Path, bytes] | None = None
    try:
        for name, data in outputs.items():
            _refuse_to_overwrite(destination / name, data)
        for name, data in outputs.items():
            # Checked again as each is written: something other than an
            # export may have put a file there since.
            if _refuse_to_overwrite(destination / name, data):
                continue
            attempted = (destination / name, data)
            write_durable(destination, name, data)
            written.append(destination / name)
            attempted = None
    except BaseException:
        # The three files are one export: a failure part way (a full disk)
        # takes back what this run wrote, so none of a set is left alone;
        # under the lock, so no other export takes one of them for its own.
        if attempted is not None:
            # A failure after its link (the directory's fsync) leaves it
            # there; a file another process put there meanwhile differs, or
            # is what this run wrote anyway.
            path, data = attempted
            with contextlib.suppress(OSError):
                if path.is_file() and not path.is_symlink() and _holds(path, data):
                    written.append(path)
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        raise


def _refuse_to_overwrite(target: Path, data: bytes) -> bool:
    """Whether ``target`` already holds ``data``; ``CONTENT_CONFLICT`` if it
    holds anything else, or is not a regular file."""
    if target.is_symlink() or (target.exists() and not target.is_file()):
        raise CaseBuildError("CONTENT_CONFLICT", "not a regular file; not overwritten", path=str(target))
    if not target.exists():
        return False
    if not _holds(target, data):
        raise CaseBuildError("CONTENT_CONFLICT", "exists with different content; not overwritten", path=str(target))
    return True


def _inside_workspace(destination: Path, workspace_root: Path) -> bool:
    """Whether ``destination`` lies in the workspace: by path once links are
    resolved; by identity (device and inode) of every existing ancestor
    against the workspace's root; then, since a bind mount shows a folder at
    a second path, by the mount table (the same filesystem and a place within
    the workspace there, or within a filesystem mounted inside it). Where
    the table cannot be read, does not locate both paths, or disagrees with
    what ``stat`` sees (a mount over ``/``, a ``/proc`` magic link), the
    workspace's folders are walked for the ancestors' identities instead."""
    from .mounts import filesystem_location, lies_within, read_mounts

    resolved, root = os.path.realpath(destination), os.path.realpath(workspace_root)
    if resolved == root or resolved.startswith(root.rstrip(os.sep) + os.sep):
        return True
    try:
        root_st = os.stat(workspace_root)
    except OSError:
        return False  # no workspace there: the command refuses the case anyway
    ancestors = set()
    nearest = None  # the nearest existing ancestor, as the path reaches it
    probe = Path(os.path.abspath(destination))
    while True:
        try:
            st = os.stat(probe)
        except OSError:
            pass  # not made yet: its parents decide
        else:
            ancestors.add((st.st_dev, st.st_ino))
            nearest = nearest or (probe, st)
        if probe.parent == probe:
            break
        probe = probe.parent
    if (root_st.st_dev, root_st.st_ino) in ancestors:
        return True
    mounts = read_mounts()
    located = lies_within(resolved, root, mounts) if mounts is not None else None
    if located:
        return True
    if located is False and nearest is not None:
        near_path, near_st = nearest
        try:
            real_st = os.stat(os.path.realpath(near_path))
        except OSError:
            real_st = None

        def device(st) -> str:
            return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"

        here = filesystem_location(os.path.realpath(near_path), mounts)
        top = filesystem_location(root, mounts)
        agrees = (real_st is not None and (real_st.st_dev, real_st.st_ino) == (near_st.st_dev, near_st.st_ino)
                  and here is not None and here[0] == device(near_st) and top is not None and top[0] == device(root_st))
        if agrees:
            return False
    return _holds_folder_of(workspace_root, ancestors)


def _holds_folder_of(workspace_root: Path, identities: set) -> bool:
    pending = [str(workspace_root)]
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    try:
                        if not entry.is_dir(follow_symlinks=False):
                            continue
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # gone meanwhile: nothing to export into
                    if (st.st_dev, st.st_ino) in identities:
                        return True
                    pending.append(entry.path)
        except OSError:
            continue  # unreadable: what it holds cannot be written through it either
    return False


def _holds(target: Path, data: bytes) -> bool:
    """Whether the existing ``target`` holds exactly ``data``: sizes first, so a
    huge file there is never read whole to learn it differs."""
    if target.stat().st_size != len(data):
        return False
    with open(target, "rb") as handle:
        return handle.read(len(data) + 1) == data


def _publishing_manifest(package, generation: int, case_path: str) -> dict:
    """The manifest of the generation that first listed ``case_path``.

    Searched from ``generation`` down: a manifest keeps every file of the one
    before it, so the case is listed from its publication on, which is
    nearly always the newest generation or the one before. (Searched up from
    generation 1, a case of 900 generations read them all: 1.2 s and 400 MB.)"""
    first = None
    for candidate in range(generation, 0, -1):
        manifest = package.manifest(candidate, copy=False)
        if case_path not in manifest["files"]:
            break
        first = candidate
    if first is None:
        raise CaseBuildError("INTEGRITY_ERROR", "no manifest lists the current case", path=case_path)
    return package.manifest(first)


# ------------------------------------------------------------------ status


def _limits_line(ws) -> str:
    from .workspace_limits import LIMITS_FILE, read_workspace_limits

    try:
        limits = read_workspace_limits(ws.root)
    except VianoError as error:
        return f"{LIMITS_FILE} is refused, and with it every command on this workspace: {one_line(str(error))}"
    if not limits.configured:
        return f"the defaults (no {LIMITS_FILE} in the workspace)"
    changed = limits.changed()
    return f"{LIMITS_FILE}: " + (", ".join(changed) if changed else "every limit at its default")


@_coded
def cmd_status(case=None, workspace=None) -> None:
    """Print state, revision, generation, artifacts, checkpoints and the build outlook."""
    from .build import case_cache
    from .packages import Package
    from .recovery import check_store_is_the_packages
    from .status import build_outlook
    from .workspace import case_lock_held_elsewhere

    case_id, ws = _context(case, workspace)
    store = _existing_store(ws, case_id, read_only=True)  # status only observes
    try:
        record = store.get(case_id)
        checkpoints = store.checkpoints(case_id)
        recorded = store.recorded_manifest(case_id, record.generation)
    finally:
        store.close()
    package = Package(ws, case_id, record.package_id, parsed_manifests=_parsed_manifests_to_read(ws, case_id))
    check_store_is_the_packages(package, record.generation, recorded)
    manifest = package.manifest(record.generation)
    # Looked at before the first line: a refusal (a symlinked .locks, or a
    # symlinked .cache, which the outlook reads) must not leave a partial
    # report on stdout.
    held_elsewhere = case_lock_held_elsewhere(ws, case_id)
    case_cache(ws, case_id)
    _out(f"case: {case_id}")
    _out(f"package: {record.package_id}")
    # Where the artifact paths below are (they are relative to it).
    _out(f"content: {one_line(os.fspath(package.content_dir), 600)}")
    _out(f"state: {record.state}")
    if held_elsewhere:
        _out("lock: held now by another command (a build, append, reopen or admission is running); "
             "what follows may change when it ends")
    if record.blocked:
        _out(f"blocked: {record.blocked}")
    _out(f"analysis_revision: {record.analysis_revision}")
    _out(f"generation: {record.generation}")
    latest = package.current_generation()
    if latest != record.generation:
        _out(f"package generations not yet taken in: {record.generation + 1}..{latest} (the next command rolls them forward)")
    for key in sorted(manifest.get("artifacts", {})):
        _out(f"artifact {key}: {manifest['artifacts'][key]}")
    _out(f"files: {len(manifest['files'])}")
    _out(f"limits: {_limits_line(ws)}")
    shown = checkpoints[-8:]
    # The numbers are the workspace store's sequence, shared by all its cases.
    _out(f"checkpoints ({'all ' if len(shown) == len(checkpoints) else f'the last {len(shown)} of '}{len(checkpoints)},"
         " latest last; # numbers the workspace's store):")
    for checkpoint in shown:
        _out(
            f"  #{checkpoint.seq} {checkpoint.step_id or '-'} {checkpoint.kind} "
            f"generation={checkpoint.generation} request={(checkpoint.request_hash or '-')[:16]}"
        )
    _out("build outlook (task: would run? why):")
    for task, reason in build_outlook(ws, case_id, record, package):
        _out(f"  {one_line(task)}: {one_line(reason, 600)}")


# ------------------------------------------------------------------ probes


@_coded
def cmd_probes(case=None, workspace=None) -> int:
    """Print the two probe candidates for an unresolved built case, or say none."""
    from .probes import probes_command_output

    case_id, ws = _context(case, workspace)
    read_workspace_limits(ws.root)  # a refused limits.json stops every command alike
    _record, package = _observed(ws, case_id)
    # The latest manifest, not the store's generation: the manifest is the
    # commit point, so a case published by a build killed before its
    # checkpoint is published (the next writing command confirms it), and
    # status and export already count it.
    manifest = package.manifest(package.current_generation())
    path = manifest.get("artifacts", {}).get("case")
    if not path:
        raise CaseBuildError("NOT_BUILT", f"case {case_id} has no built case document yet")
    data = package.read_verified(path, PUBLISHED_CASE_CEILING, manifest=manifest)
    document = decode_strict(data, max_bytes=PUBLISHED_CASE_CEILING, max_depth=CASE_MAX_DEPTH, path=path)
    built_revision = int(path.split("/")[2])
    revision = manifest["analysis_revision"]
    if built_revision < revision:
        _progress(f"note: revision {revision} has no case yet; these probes are for revision {built_revision}'s case")
    text, code = probes_command_output(document, path, sha256_hex(data))
    from .doitcli import say

    say(text if text.endswith("\n") else text + "\n")
    return code

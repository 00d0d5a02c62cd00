"""What ``doit status`` foresees of a damaged workspace: a listed input or a
published output gone, or refused as a build's step opens it. Each verdict is
the error the build's own step raises (the same functions name it), so
status and build agree; an intact workspace costs no system call more than
the stamps status takes anyway (one lstat a file) and the hashing of the
three published outputs it did before.
"""

from __future__ import annotations

import os
import stat

from .errors import IntegrityError, VianoError

__all__ = ["damaged_outputs", "fail_at_damaged_output", "gone", "kept_plan", "refused_on_opening"]


def gone(content_dir, path: str, stamp_now) -> bool:
    """Whether a file the plan reads is gone from the content, which no
    reading mends (status said it would be verified again, or after a failed
    build "not read yet"; session 24's reviews). An empty folder in its
    place is gone too: the build's roll-forward removes empty folders before
    the step looks for the file (one holding files is left, and refused as
    not a regular file: :func:`refused_on_opening`)."""
    full = os.path.join(content_dir, path)
    if stamp_now is not None:
        return stat.S_ISDIR(stamp_now[3]) and _empty_folder(full)
    return not os.path.lexists(full)


def _empty_folder(path: str) -> bool:
    try:
        return not os.listdir(path)
    except OSError:
        return False


def refused_on_opening(package, ref: dict, stamp_now) -> str | None:
    """The refusal a listed input's reading step meets before it reads a byte
    (a symlink or special file in its place or on its way, another size), as
    the build words it, or None. Status said "would run: to verify it again"
    or "up to date" and publish "reuse" while the build failed there
    (REFERENCE_UNSAFE for a file replaced by a symlink to the same bytes).
    A regular file of its planned size, as the stamp already taken says, is
    not opened: an up-to-date status costs no system call more."""
    if stamp_now is not None and stat.S_ISREG(stamp_now[3]) and stamp_now[0] == ref["size"]:
        return None
    problem = package.open_problem(ref["path"], ref["size"])
    return None if problem is None else str(problem)


def changed_document(package, doc: dict) -> str | None:
    """The refusal a structured input's reading step meets when its bytes are
    not the ones its manifest lists (changed in place at the same size), as
    the build words it, or None. Only for a document the build reads again
    (bounded by the document limit): status said "would run" and the build
    failed with INTEGRITY_ERROR, also after that failure."""
    try:
        package.read_verified(doc["path"], doc["size"])
    except VianoError as error:
        return str(error)
    except OSError:
        return None  # not foreseen here: the step itself says what it is
    return None


def damaged_outputs(package, plan: dict) -> dict[str, tuple[str, str, str]]:
    """Each published output of the plan's revision whose file is gone or not
    the size and SHA-256 its manifest says, by its key in the plan's outputs:
    (path, the error assemble or render meets reading it, the one publish
    meets). Only a damaged file is read again, to name its error."""
    try:
        files = package.manifest()["files"]
    except VianoError:
        return {}  # the manifest itself fails: the rows above say so
    damaged = {}
    for key in ("case", "case_summary", "case_built"):
        path = plan["outputs"][key]
        entry = files.get(path)
        if entry is not None and package.holds(path, entry["size"], entry["sha256"]):
            continue
        try:
            package.read_verified(path, entry["size"] if entry is not None else 0)
            continue  # mended since it was looked at
        except VianoError as error:
            problem = str(error)
        if entry is None:  # publish looks it up itself (build._repair_from_published)
            damaged[key] = (path, problem, str(IntegrityError("INTEGRITY_ERROR", "confirmed case output is missing from the manifest", path=path)))
        else:
            damaged[key] = (path, problem, problem)
    return damaged


# The steps of a reused case that take its published outputs, each verified
# against the manifest, and which outputs each takes, in build order.
TAKES_PUBLISHED = (("assemble", ("case",)), ("render", ("case_summary",)), ("publish", ("case", "case_summary", "case_built")))


def fail_at_damaged_output(rows: list[tuple[str, str]], damaged: dict) -> list[tuple[str, str]]:
    """The rows with the first step that runs and takes a damaged published
    output failing, and the steps after it not running. Status said publish
    would fail while a build whose assemble or render ran (the cache cleared,
    the workspace moved) failed there; publish, which always verifies all
    three, runs whenever one is damaged (its note of them no longer holds)."""
    outlook = dict(rows)
    for at, (task, keys) in enumerate(TAKES_PUBLISHED):
        key = next((key for key in keys if key in damaged), None)
        if key is None or not (task == "publish" or outlook[task].startswith("would run")):
            continue
        path, read_problem, publish_problem = damaged[key]
        problem = publish_problem if task == "publish" else read_problem
        outlook[task] = f"would fail: the confirmed {path} is missing or changed in the package content: {problem}"
        for later, _ in TAKES_PUBLISHED[at + 1:]:
            outlook[later] = f"would not run: the build stops at {task}"
        break
    return [(task, outlook[task]) for task, _ in rows]


def kept_plan(cache, package, record, limits) -> dict | None:
    """The cached plan validate_index returns without planning (nothing it
    derives from changed, as :func:`pipeline.build.step_validate_index`
    judges it), or None. Asked only when planning again would fail."""
    from .build import _cached_plan, _cached_store_state, _plan_key, _relied_on, content_stamps_now, read_content_stamps

    try:
        if record.state not in ("BUILDING_CASE", "COMPLETED") or record.generation != package.current_generation():
            return None  # the build's roll-forward moves the record first: another plan key
        state = _cached_store_state(cache)
        if state.get("plan_key") != _plan_key(package, record, limits) or not cache.plan.exists():
            return None
    except (OSError, VianoError):
        return None
    plan = _cached_plan(cache, state.get("plan_sha256"))
    if plan is None:
        return None
    stamps, relied = read_content_stamps(cache), _relied_on(plan)
    now = content_stamps_now(os.fspath(package.content_dir), relied)
    prior = plan["prior_case"]
    if any(stamps.get(path) != now[path] for path in relied) or (
            prior is not None and not cache.prior_view(prior["path"], prior["sha256"]).exists()):
        return None
    return plan

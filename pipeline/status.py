"""The build outlook shown by ``doit status``: which tasks would run, and why.

It mirrors the up-to-date rules the doit tasks use (content-addressed cache
records, the request hash, the confirmed checkpoint) without running or
changing anything: planning here records no start checkpoint.
"""

from __future__ import annotations

import os

from .cache import BuildCache
from .doitcli import OUTPUT_DIGEST, SOURCE_DIGEST
from .errors import VianoError
from .jsoncanon import encode_sorted
from .plan import check_limits, make_plan, step_id_for
from .status_damage import changed_document, damaged_outputs, fail_at_damaged_output, gone, kept_plan, refused_on_opening
from .workspace_limits import PUBLISHED_CASE_CEILING, PUBLISHED_SUMMARY_CEILING

__all__ = ["build_outlook"]


def _cached_bytes(path, limit: int) -> bytes | None:
    from .jsoncanon import read_bounded

    try:
        # Sized from fstat: read(limit + 1) would allocate the whole limit first.
        return read_bounded(path, limit)
    except (OSError, VianoError):
        return None


def _cached_case(cache: BuildCache, limit: int) -> dict | None:
    """The cached case, None if it cannot be read."""
    import msgspec

    data = _cached_bytes(cache.case_json, limit)
    try:
        case = msgspec.json.decode(data) if data is not None else None
    except (ValueError, RecursionError, msgspec.DecodeError):
        return None
    return case if isinstance(case, dict) else None


def _rendered_from(case: dict, cache: BuildCache, limit: int) -> bool:
    """Whether the cached summary is the render of this case (render is pure)."""
    from .summary import SummaryTooLarge, render_summary

    data = _cached_bytes(cache.summary, limit)
    try:
        # A render sure to be longer than the cached summary is not it: the
        # bound stops a case whose summary would be far over its limit (a
        # failed render leaves the previous summary cached) at that size.
        return data is not None and render_summary(case, limit=len(data)).encode("utf-8") == data
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, SummaryTooLarge):
        return False


def _is_the_published_summary(package, plan: dict, cache: BuildCache, limit: int) -> bool:
    """Whether the cached summary is the one the package publishes for this
    revision. A build that reuses a confirmed case keeps its published
    summary as it is, also where this builder would render it otherwise (a
    summary changed by an upgrade): its render step is up to date then, and
    status says so too (it said "would run" at every status, while every build
    said up to date; session 24's re-review)."""
    import hashlib

    data = _cached_bytes(cache.summary, limit)
    try:
        entry = package.manifest()["files"].get(plan["outputs"]["case_summary"])
    except (VianoError, KeyError, TypeError, AttributeError):
        return False
    return (data is not None and isinstance(entry, dict) and entry.get("size") == len(data)
            and entry.get("sha256") == hashlib.sha256(data).hexdigest())


def _unconfirmed_publication(package, record, plan: dict) -> int | None:
    """The generation after the store's that published this very case (its
    ``case-built.json`` names this step and request) while the process that
    wrote it died before confirming it, or None."""
    from .jsoncanon import decode_strict

    built = plan["outputs"]["case_built"]
    try:
        for generation in range(record.generation + 1, package.current_generation() + 1):
            manifest = package.manifest(generation)
            if built not in manifest["files"]:
                continue
            data = package.read_verified(built, 1 << 20, manifest=manifest)
            record_of = decode_strict(data, max_bytes=1 << 20, path=built)
            if record_of.get("step_id") == plan["step_id"] and record_of.get("request_hash") == plan["request_hash"]:
                return generation
    except (OSError, VianoError):
        return None
    return None


_FAILS_THE_BUILD = "up to date, refused: the build would fail with "

_VERIFY_AGAIN = "would run: to verify it again (its size, modification or change time is not what it was when it was read)"
_GONE = ("would fail: INTEGRITY_ERROR: the manifest lists this file but the package content no longer holds it "
         "(restore the workspace from a copy taken while no command ran)")


_ATTACHMENTS_IGNORED = "from the prior case, which did not list its attachments: the build keeps it and ignores them with an IGNORED_ATTACHMENTS gap"


def _read_input_outlook(cache: BuildCache, record, doc: dict, reused: bool) -> str:
    """What the build would make of one structured input, from its cached record:
    a document refused when it was read stays refused (the record is a pure
    function of its bytes), and stops the build unless it is only inherited
    or the revision's confirmed case is reused (which reads no input into it)."""
    if not record.exists():
        return "would run: not read yet (new input, or the cache was cleared)"
    try:
        kept = cache.read_json(record)
        refused = kept.get("rejected")
    except (OSError, VianoError, AttributeError):
        # doit sees its target there and does not run the task; assemble
        # reads the file again when it next needs the record.
        return "up to date; its cache record is damaged: assemble reads the file again when it next needs it"
    ignored = doc.get("prior_listed_attachments") is False and not reused
    if not refused:
        fragment = kept.get("fragment")
        if ignored and isinstance(fragment, dict) and fragment.get("attachments"):
            return f"up to date; {_ATTACHMENTS_IGNORED}"
        return "up to date"
    problem = f"{refused.get('code')}: {refused.get('message')}"
    if reused:
        return f"up to date, refused ({problem}); the revision's case is reused as published, which reads no input"
    if ignored and "without_attachments" in kept:
        return f"up to date, refused for its attachments ({problem}); {_ATTACHMENTS_IGNORED}"
    if doc.get("lenient"):
        return f"up to date, refused ({problem}); inherited, so the build drops it with a SUPERSEDED_INPUT gap"
    return f"{_FAILS_THE_BUILD}{problem}"


def _plan_as_written(cache, package, record, limits, plan: dict, reused: bool) -> dict:
    """The plan as the build's validate_index would write it: a revision
    whose case is reused (confirmed, or published and confirmed by the
    build's roll-forward first) also records the snapshot its case was built
    from, read from its published case-built.json. Where that cannot be read,
    validate_index fails with the reason raised here, unless it keeps the
    cached plan as it is, reading nothing (status said "assemble: would run"
    and "publish: would fail", while the build failed at validate_index, or
    skipped assemble, and failed at publish)."""
    if not reused:
        return plan
    from .build import _confirmed_snapshot_generation

    try:
        return {**plan, "snapshot_generation": _confirmed_snapshot_generation(package, plan)}
    except VianoError:
        kept = kept_plan(cache, package, record, limits)
        if kept is None:
            raise
        return kept


def _file_state(data: bytes) -> list:
    """A file's state as the content-hash checker records it: [size, sha256]."""
    import hashlib

    return [len(data), hashlib.sha256(data).hexdigest()]


def _current_stamp() -> str | None:
    """The digest doit's ``config_changed`` makes of the chain's stamp now,
    or None where this doit computes it some other way."""
    from doit.tools import config_changed

    from .doitcli import chain_stamp

    digest = getattr(config_changed(chain_stamp()), "_calc_digest", None)
    return digest() if callable(digest) else None


def _rerun_reason(record: dict | None, stamp: str | None, deps: dict[str, list | None],
                  made_from: tuple[str, list | None] | None = None) -> str | None:
    """Why doit would run a task again, judged by its record, or None.
    ``deps`` maps each file it depends on to the state it will have (None:
    not known now, not judged); ``made_from`` is (reason key, state) of the
    file assemble or render made its output from, whose digest the step
    recorded itself (:func:`pipeline.doitcli.output_as_written`)."""
    if record is None:
        return ("no record of its last run (a first build, a build stopped before it, the cache cleared or its dependency file damaged, or a run that kept "
                "its records in memory: a target named on doit's command line)")
    values = record.get("_values_:") if isinstance(record.get("_values_:"), dict) else {}
    recorded_stamp = values.get("_config_changed")
    if stamp is not None and recorded_stamp is not None and recorded_stamp != stamp:
        return "the builder's code changed since it last ran"
    for name, state in deps.items():
        if state is not None and name not in record:
            # doit keys a file's state by its absolute path: a record without
            # this path was made with the workspace elsewhere.
            return _MOVED
        if state is not None and record.get(name) != state:
            return name
    if made_from is not None and made_from[1] is not None and values.get(SOURCE_DIGEST) != made_from[1][1]:
        return made_from[0]
    return None


_MOVED = "its record names the files at another path (the workspace was copied or moved since it last ran)"


_NOT_AS_WRITTEN = ("the cached {} is not the one it wrote (cut short by a crash, changed since, or written by a run "
                   "that kept its records in memory: a target named on doit's command line)")


def _not_as_written(record: dict | None, state: list | None) -> bool:
    """Whether doit runs assemble or render again because its cached output
    is not the bytes whose digest it recorded (:func:`pipeline.doitcli.output_as_written`).
    No record, no recorded digest or no output: the other reasons say it."""
    values = record.get("_values_:") if record is not None else None
    if state is None or not isinstance(values, dict) or OUTPUT_DIGEST not in values:
        # A record from a builder before this check: its stamp differs too,
        # and the builder's code change is the reason status gives.
        return False
    return values[OUTPUT_DIGEST] != state[1]


def _restored_state(records: dict, path: str, digest: str) -> list:
    """The state doit will record of ``path`` once it holds again the bytes
    whose SHA-256 is ``digest``: as a later task recorded it, when one did."""
    for task in ("render", "publish"):  # the tasks that depend on a cached output
        state = (records.get(task) or {}).get(path)
        if isinstance(state, list) and len(state) == 2 and state[1] == digest:
            return state
    return [None, digest]


def build_outlook(ws, case_id: str, record, package) -> list[tuple[str, str]]:
    from .build import document_readers, open_existing_store

    from .workspace_limits import read_workspace_limits

    rows = [("validate_index", "always runs (takes in new generations, re-checks every index)")]
    if record.state == "BLOCKED":
        rows.append(("build", "would fail: ILLEGAL_TRANSITION (the case is BLOCKED)"))
        return rows
    try:
        limits = read_workspace_limits(ws.root).case_builder
    except VianoError as error:
        rows.append(("validate_index", f"would fail: {error}"))
        return rows
    # Planned as the build plans: a revision with a confirmed case is read
    # at the sizes its manifest records and held to the limits only for new
    # work, so limits lower than the ones it was built under (limits.json
    # removed) do not make the outlook predict a failure the build won't have.
    store = open_existing_store(ws, case_id, read_only=True)
    try:
        already_confirmed = store.confirmed(case_id, step_id_for(record.analysis_revision)) is not None
    finally:
        store.close()
    read_index, read_prior_case = document_readers(package, limits, relaxed=already_confirmed)
    # The build takes in generations the store has not recorded yet before
    # it plans; so does this outlook (without recording them).
    try:
        planned_generation = max(record.generation, package.current_generation())
    except VianoError:
        planned_generation = record.generation
    try:
        plan = make_plan(package, planned_generation, limits, read_index=read_index, read_prior_case=read_prior_case,
                         enforce_limits=False)
        store = open_existing_store(ws, case_id, read_only=True)
        try:
            confirmed = store.confirmed(case_id, plan["step_id"])
        finally:
            store.close()
        if confirmed is None:
            check_limits(plan, limits)
    except VianoError as error:
        rows.append(("validate_index", f"would fail: {error}"))
        return rows
    from .build import case_cache, content_stamps_now, over_read_bound, publication_noted, read_content_stamps, reuses_confirmed_case

    cache = case_cache(ws, case_id)
    from .doitcli import subtask_name

    reusing = reuses_confirmed_case(cache)
    # The revision's case is reused (no input read into it) when confirmed for
    # these inputs, or published and only its confirmation lost.
    published = _unconfirmed_publication(package, record, plan) if confirmed is None else None
    reused = published is not None or (confirmed is not None and confirmed.request_hash == plan["request_hash"])
    stamps = read_content_stamps(cache)
    try:
        written = _plan_as_written(cache, package, record, limits, plan, reused)
    except VianoError as error:
        rows.append(("validate_index", f"would fail: {error}"))
        return rows
    now = content_stamps_now(os.fspath(package.content_dir), [*(d["path"] for d in plan["documents"]), *(r["path"] for r in plan["opaque"])])
    refusals = []  # (task, problem) of each input whose cached refusal stops the build at assemble
    # (task, why) of each input whose own step fails (gone, or refused as it
    # is opened), which stops the build before assemble; in task order.
    stops = []
    for doc in plan["documents"]:
        over = over_read_bound(doc["size"], plan["limits"]["document_bytes"], reusing)
        input_record = cache.input_record(doc["path"], doc["sha256"], doc["contract"], plan["limits"]["inline_fact_value"], over)
        task = f"read_input:{subtask_name(doc['path'])}"
        if gone(package.content_dir, doc["path"], now[doc["path"]]):
            stops.append((task, "whose file is gone"))
            rows.append((task, _GONE))
            continue
        refused = refused_on_opening(package, doc, now[doc["path"]])
        if refused is not None:
            stops.append((task, "which refuses its file"))
            rows.append((task, f"would fail: {refused}"))
            continue
        moved = input_record.exists() and stamps.get(doc["path"]) != now[doc["path"]]
        if (moved or not input_record.exists()) and (changed := changed_document(package, doc)) is not None:
            stops.append((task, "which finds its bytes changed"))
            rows.append((task, f"would fail: {changed}"))
            continue
        outlook = _read_input_outlook(cache, input_record, doc, reused) if input_record.exists() else None
        if outlook is not None and outlook.startswith(_FAILS_THE_BUILD):
            # Read again after its stamp moved, the bytes the manifest pins
            # give the same refusal (or INTEGRITY_ERROR for other bytes).
            refusals.append((task, outlook.removeprefix(_FAILS_THE_BUILD)))
        if moved:
            if outlook is not None and outlook.startswith(_FAILS_THE_BUILD):
                outlook = f"{_VERIFY_AGAIN}; it was refused when last read: {outlook.removeprefix(_FAILS_THE_BUILD)}"
            else:
                outlook = _VERIFY_AGAIN
        elif outlook is None:
            outlook = _read_input_outlook(cache, input_record, doc, reused)
        rows.append((task, outlook))
    for ref in plan["opaque"]:
        task = f"hash_context:{subtask_name(ref['path'])}"
        if gone(package.content_dir, ref["path"], now[ref["path"]]):
            stops.append((task, "whose file is gone"))
            outlook = _GONE
        elif (refused := refused_on_opening(package, ref, now[ref["path"]])) is not None:
            stops.append((task, "which refuses its file"))
            outlook = f"would fail: {refused}"
        elif not cache.opaque(ref["path"], ref["sha256"], ref["size"]).exists():
            outlook = "would run: not hashed yet (new file, or the cache was cleared)"
        elif stamps.get(ref["path"]) != now[ref["path"]]:
            outlook = _VERIFY_AGAIN
        else:
            outlook = "up to date"
        rows.append((task, outlook))
    try:
        cached_plan = cache.read_plan() if cache.plan.exists() else None
    except (OSError, VianoError):
        cached_plan = None
    # A plan that cannot be read (cut short by a power loss) is planned
    # again by validate_index, which writes the plan judged below.
    # So is a plan that is gone: either way the plan judged below is the one
    # assemble's record is compared with (status said "assemble: would run"
    # where the build wrote the same plan again and skipped it).
    plan_unreadable = cached_plan is None
    # A failed build has planned these inputs already; the cached case is
    # current only if it was assembled from them, and the cached summary
    # only if it is that case's render.
    # Cache records are the builder's own: bounded by what any workspace may
    # have built, not by the limits in force now.
    case = _cached_case(cache, PUBLISHED_CASE_CEILING) if cache.case_json.exists() else None
    same_inputs = (
        (plan_unreadable or (cached_plan is not None and cached_plan.get("request_hash") == plan["request_hash"]))
        and isinstance(case, dict)
        and isinstance(case.get("case"), dict)
        and case["case"].get("request_hash") == plan["request_hash"]
    )
    # assemble, render and publish run again when the files they depend on
    # differ from what doit recorded when they last ran (or their stamp, the
    # builder's code, does). The plan file holds more than the inputs (the
    # limits in force among them), and a build stopped after planning leaves
    # a new plan that assemble never ran on: so the plan validate_index would
    # write now is compared with doit's record, not with the cached file.
    plan_state = _file_state(encode_sorted(written))
    subtasks = tuple(task for task, _ in rows if task.startswith(("read_input:", "hash_context:")))
    gates = ("validate_index", "read_input", "hash_context")  # what the later steps wait for
    records = cache.doit_records(("assemble", "render", "publish", *gates, *subtasks))
    stamp = _current_stamp()
    plan_path, case_path, summary_path = str(cache.plan), str(cache.case_json), str(cache.summary)
    case_bytes = _cached_bytes(cache.case_json, PUBLISHED_CASE_CEILING) if cache.case_json.exists() else None
    case_state = _file_state(case_bytes) if case_bytes is not None else None
    summary_bytes = _cached_bytes(cache.summary, PUBLISHED_SUMMARY_CEILING) if cache.summary.exists() else None
    summary_state = _file_state(summary_bytes) if summary_bytes is not None else None
    restored_case = False
    summary_cut = records is not None and _not_as_written(records.get("render"), summary_state)
    if records is None:
        # doit's record unreadable: judge by the cached plan file alone.
        plan_changed = same_inputs and not plan_unreadable and cached_plan != written
        assemble_why = "plan" if plan_changed else None
        render_why = None
        publish_why = "plan" if plan_changed else None
    else:
        assemble_why = _rerun_reason(records.get("assemble"), stamp, {plan_path: plan_state}, ("assembled_from", plan_state))
        assembled = records.get("assemble")
        recorded_output = isinstance(assembled, dict) and OUTPUT_DIGEST in (assembled.get("_values_:") or {})
        if assemble_why is None and recorded_output and (case_state is None or _not_as_written(assembled, case_state)):
            # assemble runs again only because its case was cut, changed or
            # removed: from the same plan and code it writes again the bytes
            # it recorded, which the later tasks are judged against.
            case_state = _restored_state(records, case_path, records["assemble"]["_values_:"][OUTPUT_DIGEST])
            restored_case = True
        render_why = _rerun_reason(records.get("render"), stamp, {case_path: case_state}, ("rendered_from", case_state))
        if summary_cut and render_why is None:
            # Likewise render, from the case it last rendered.
            summary_state = _restored_state(records, summary_path, records["render"]["_values_:"][OUTPUT_DIGEST])
        publish_why = _rerun_reason(records.get("publish"), None, {plan_path: plan_state, case_path: case_state, summary_path: summary_state})
    if publish_why is None and confirmed is not None and not publication_noted(ws, case_id, cache, plan):
        # publish's own uptodate: the cache's note of the publication (a note
        # of an older builder, unsealed, is none; found by session 23's review).
        publish_why = "note"
    reasons = {
        plan_path: "same inputs, but the plan changed since it last ran (other limits in force, or a build stopped after planning)",
        case_path: "the cached case changed since it last ran",
        summary_path: "the cached summary changed since it last ran",
        "plan": "same inputs, but the plan changed since the last build (other limits in force)",
        # doit's record of the file was made current without the step
        # running (`doit reset-dep`); the step's own note of its source says so.
        "note": "the build cache has no note of this publication (or one an older builder wrote)",
        "assembled_from": "the cached case was not assembled from this plan (its record was reset without assembling, as by `doit reset-dep`)",
        "rendered_from": "the cached summary was not rendered from the cached case (its record was reset without rendering, as by `doit reset-dep`)",
    }
    if not cache.case_json.exists():
        rows.append(("assemble", "would run: no cached output"))
    elif restored_case or (records is not None and _not_as_written(records.get("assemble"), case_state)):
        rows.append(("assemble", f"would run: {_NOT_AS_WRITTEN.format('case')}"))
    elif not same_inputs:
        rows.append(("assemble", "would run: inputs changed since the last case was assembled"))
    elif assemble_why is not None:
        rows.append(("assemble", f"would run: {reasons.get(assemble_why, assemble_why)}"))
    else:
        rows.append(("assemble", "up to date"))
    if not cache.summary.exists():
        rows.append(("render", "would run: no cached output"))
    elif summary_cut:
        rows.append(("render", f"would run: {_NOT_AS_WRITTEN.format('summary')}"))
    elif restored_case:
        # The cut case cannot be read, but the one assemble writes again can be
        # judged by what render recorded of it.
        rows.append(("render", f"would run: {reasons.get(render_why, render_why)}" if render_why is not None else "up to date"))
    elif not same_inputs:
        rows.append(("render", "would run: after assemble"))
    elif not (_rendered_from(case, cache, PUBLISHED_SUMMARY_CEILING)
              or reused and _is_the_published_summary(package, plan, cache, PUBLISHED_SUMMARY_CEILING)):
        rows.append(("render", "would run: the cached summary is not the cached case's"))
    elif render_why is not None:
        rows.append(("render", f"would run: {reasons.get(render_why, render_why)}"))
    elif assemble_why is not None:
        rows.append(("render", "up to date, unless assemble makes another case under the limits in force"))
    else:
        rows.append(("render", "up to date"))
    if published is not None and publish_why is not None:
        rows.append(("publish", f"would run: generation {published} published this case; the build confirms it and reuses it (no new generation)"))
    elif published is not None:
        rows.append(("publish", f"up to date: generation {published} published this case; the next command confirms it (no new generation)"))
    elif confirmed is None:
        rows.append(("publish", f"would run: no confirmed case for {plan['step_id']}"))
    elif confirmed.request_hash == plan["request_hash"]:
        if publish_why is not None:
            why = "the plan changed" if publish_why in (plan_path, "plan") else reasons.get(publish_why, publish_why)
            rows.append(("publish", f"would run: {why}; reuses {plan['step_id']}, confirmed for these inputs (no new generation)"))
        else:
            rows.append(("publish", f"up to date: {plan['step_id']} confirmed for these inputs (reuse, no new generation)"))
    else:
        rows.append(("publish", "would fail: REOPEN_REQUIRED (inputs changed after the case was confirmed)"))
    if reused:
        # A damaged published output stops a reuse at the first step taking it.
        rows = fail_at_damaged_output(rows, damaged_outputs(package, plan))
    ignored = [task for task in (*gates, *subtasks, "assemble", "render") if records and (records.get(task) or {}).get("ignore:")]
    first = stops[0][0] if stops else None
    if stops and not (ignored and (ignored[0] == "validate_index" or first == ignored[0] or first.startswith(f"{ignored[0]}:"))):
        # The failing file's own step runs (nothing before it is ignored) and
        # fails the build there, whatever is ignored after it.
        stop = f"would not run: the build stops at {first}, {stops[0][1]}"
        rows = [(task, stop if task in ("assemble", "render", "publish") else outlook) for task, outlook in rows]
    elif ignored:
        # doit skips the tasks that wait for an ignored one as well: every
        # step after validate_index, a group's own subtasks, and assemble,
        # render and publish after any input's task.
        cause = ignored[0]
        forget = " ".join(ignored[:3]) + (" ..." if len(ignored) > 3 else "")
        after = f"ignored with {cause} (`doit ignore`): the build skips it and publishes nothing until `doit forget {forget}`"

        def skipped(task: str) -> bool:
            if cause == "validate_index":
                return task != "validate_index"
            if cause in ("assemble", "render"):
                # (Until session 24 these said "would run", the build "!!".)
                return task in ("render", "publish") if cause == "assemble" else task == "publish"
            return task in ("assemble", "render", "publish") or task.startswith(f"{cause}:")

        rows = [(task, after) if skipped(task) else (task, outlook) for task, outlook in rows]
    elif refusals:
        # assemble raises the first refusal it meets; nothing after it runs.
        task, problem = refusals[0]
        stops = {
            "assemble": f"would fail: {problem} (from {task}"
            + (f", and {len(refusals) - 1} more refused input(s))" if len(refusals) > 1 else ")"),
            "render": "would not run: the build stops at assemble",
            "publish": "would not run: the build stops at assemble",
        }
        rows = [(task, stops.get(task, outlook)) for task, outlook in rows]
    return [(task, _IGNORED) if records and (records.get(task) or {}).get("ignore:") else (task, outlook) for task, outlook in rows]


_IGNORED = "ignored (`doit ignore`): the build skips it and publishes nothing until `doit forget` clears it"

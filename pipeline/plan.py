"""The build plan: which inputs a build reads, in which roles, under which hash.

:func:`make_plan` is the ``validate_index`` step. It looks only at the
snapshot generation the CheckpointStore has taken in, reads every case-inputs
index the package has had (generation order), checks every reference, applies
the size/count limits from manifest sizes before anything is parsed, and
derives the request hash and step id (ARCHITECTURE.md section 5). The result
is plain JSON so it can be cached and handed to the other tasks.

Inventory rule (seed 001; decided details in the README): the prior case's
role inventory (after a reopen; hash-checked against the manifest and re-read
from the immutable originals), then the roles of every earlier index of this
revision (inherited provisionally: a returning index may list only new
documents), then the current index; a path counts at its first appearance.
An inherited document that fails its contract is dropped with a
SUPERSEDED_INPUT gap unless the current index lists it again, which is how a
corrected append resumes a build that failed on a bad document.
"""

from __future__ import annotations

import contextvars
import heapq
import re

from . import BUILDER_VERSION
from .errors import CaseBuildError, VianoError
from .jsoncanon import canonical_hash
from .limits import CaseBuilderLimits

__all__ = [
    "CONTEXT_ROLES",
    "GENERATED_RE",
    "CONTROL_RE",
    "make_plan",
    "step_id_for",
    "case_paths_for",
    "is_generated",
    "plan_from_manifests",
    "check_limits",
]

CONTEXT_ROLES = ("runtime", "database", "source", "research")
_DOCUMENT_ROLES = (("reports", "report"), ("reproductions", "reproduction"))
#: Outputs the builder itself publishes; never payload, never in a request hash.
GENERATED_RE = re.compile(r"case/revisions/[0-9]{4,}/(case\.json|case_summary\.md|case-built\.json)")  # fullmatch only


#: Lifecycle records the builder writes beside the inputs (who reopened and why).
CONTROL_RE = re.compile(r"inputs/[0-9]+/reopen\.json")  # fullmatch only


def is_generated(path: str) -> bool:
    """Builder-written outputs and control records: never payload, never hashed
    into a request, never unclassified inputs."""
    return GENERATED_RE.fullmatch(path) is not None or CONTROL_RE.fullmatch(path) is not None


def step_id_for(analysis_revision: int) -> str:
    return f"case-build/v{BUILDER_VERSION}/r{analysis_revision}"


def case_paths_for(analysis_revision: int) -> dict:
    base = f"case/revisions/{analysis_revision:04d}"
    return {
        "case": f"{base}/case.json",
        "case_summary": f"{base}/case_summary.md",
        "case_built": f"{base}/case-built.json",
    }


def _ref(path: str, files: dict) -> dict:
    entry = files[path]
    return {"path": path, "sha256": entry["sha256"], "size": entry["size"]}


def _check_listed(ref, files: dict, index_path: str, pointer: str) -> str:
    from .workspace import check_reference

    try:
        check_reference(ref)
    except CaseBuildError as exc:
        raise CaseBuildError(exc.code, exc.message, path=index_path, pointer=pointer) from None
    except VianoError as exc:  # of another family; anything else (MemoryError, a host's own) is not a refusal
        code = exc.code
        raise CaseBuildError(code, f"unsafe reference {ref!r}", path=index_path, pointer=pointer) from None
    if ref not in files:
        raise CaseBuildError("REFERENCE_MISSING", f"{ref!r} is not in the package manifest", path=index_path, pointer=pointer)
    if is_generated(ref):
        raise CaseBuildError("REFERENCE_UNSAFE", f"{ref!r} is a generated case output", path=index_path, pointer=pointer)
    return ref


def prior_case_roles(document: dict) -> list[tuple[str, list]]:
    """(role, [REF]) for every role of a prior case's input inventory."""
    inputs = document.get("inputs", {})
    return [
        ("reports", inputs.get("reports", [])),
        ("reproductions", inputs.get("reproductions", [])),
        ("expected_research", inputs.get("expected_research", [])),
        ("attachments", inputs.get("attachments", [])),
        ("context.runtime", document.get("runtime_facts", {}).get("context", [])),
        ("context.database", document.get("database_context", [])),
        ("context.source", document.get("source_context", [])),
        ("context.research", document.get("research", {}).get("supplied", [])),
    ]


def role_change_error(path: str, previous: str, role: str, where: str, pointer: str) -> CaseBuildError:
    """The prior case's roles are its published inventory: a later revision
    may add to them, never move a record to another role."""
    return CaseBuildError(
        "DUPLICATE_SOURCE",
        f"{path!r} is an input of the prior case as {previous}; a later revision cannot list it as {role}",
        path=where,
        pointer=pointer,
    )


def _index_roles(index) -> list[tuple[str, str, list]]:
    """(role, pointer prefix, listed paths) for every role of one index.

    Total over any JSON value (a malformed index yields no roles or empty
    ones), because earlier indexes are walked before anyone validated them."""
    if not isinstance(index, dict):
        return []

    def listed(container, key):
        value = container.get(key, []) if isinstance(container, dict) else []
        return [ref for ref in value if isinstance(ref, str)] if isinstance(value, list) else []

    roles = [
        ("reports", "/reports", listed(index, "reports")),
        ("reproductions", "/reproductions", listed(index, "reproductions")),
        ("expected_research", "/expected_research", listed(index, "expected_research")),
    ]
    context = index.get("context", {})
    for name in CONTEXT_ROLES:
        roles.append((f"context.{name}", f"/context/{name}", listed(context, name)))
    roles.append(("attachments", "/attachments", listed(index, "attachments")))
    return roles


def _revision_indexes(manifests: list[dict], revision: int) -> list[str]:
    """The indexes manifests of ``revision`` pointed to, in generation order."""
    found: list[str] = []
    for manifest in manifests:
        path = manifest.get("artifacts", {}).get("case_inputs")
        if manifest.get("analysis_revision") == revision and path and path not in found:
            found.append(path)
    return found


def _usable_reference(ref, files: dict) -> bool:
    from .workspace import check_reference

    if not isinstance(ref, str) or ref not in files or is_generated(ref):
        return False
    try:
        check_reference(ref)
    except VianoError:  # a refusal: an earlier index's bad entry is just not inherited
        # (Only a refusal: a MemoryError or a host program's exception caught
        # here dropped a good input, and the case without it was published.)
        return False
    return True


def plan_from_manifests(
    *,
    manifests: list[dict],
    indexes: dict[str, dict],
    prior_case: dict | None,
    limits: CaseBuilderLimits,
    earlier_indexes: dict[str, dict] | None = None,
    enforce_limits: bool = True,
) -> dict:
    """Pure part of planning: from the manifests 1..g (ascending), the parsed
    current index by path, the prior case (``{"ref": REF, "document": case}``)
    and the leniently read earlier indexes (for SUPERSEDED_INPUT gaps).

    ``enforce_limits=False`` plans without applying the size/count limits, so a
    confirmed case can be recognised and reused after a limit was lowered
    (limits are policy and never rewrite or block a confirmed case).
    """
    snapshot = manifests[-1]
    files = snapshot["files"]
    revision = snapshot["analysis_revision"]

    history: list[str] = []
    for manifest in manifests:
        path = manifest.get("artifacts", {}).get("case_inputs")
        if path and path not in history:
            history.append(path)

    role_of: dict[str, str] = {}
    ordered: dict[str, list[str]] = {}
    prior_path = prior_case["ref"]["path"] if prior_case is not None else None
    from_prior: set[str] = set()

    def take(role: str, path: str, where: str, pointer: str) -> None:
        previous = role_of.get(path)
        if previous is not None and previous != role:
            if path in from_prior:
                raise role_change_error(path, previous, role, where, pointer)
            raise CaseBuildError("DUPLICATE_SOURCE", f"{path!r} is listed as {previous} and as {role}", path=where, pointer=pointer)
        if previous is None:
            role_of[path] = role
            ordered.setdefault(role, []).append(path)
            if where == prior_path:
                from_prior.add(path)

    if prior_case is not None:
        prior_path = prior_case["ref"]["path"]
        for role, refs in prior_case_roles(prior_case["document"]):
            for position, ref in enumerate(refs):
                path = ref["path"]
                entry = files.get(path)
                if entry is None or entry["sha256"] != ref["sha256"] or entry["size"] != ref["size"]:
                    raise CaseBuildError(
                        "INTEGRITY_ERROR",
                        f"inherited input {path!r} no longer matches the prior case inventory",
                        path=prior_path,
                    )
                take(role, path, prior_path, "")

    current = snapshot.get("artifacts", {}).get("case_inputs")
    # Earlier indexes of this revision: their inputs are inherited, so a
    # returning index may list only new documents (seed 001). They are taken
    # provisionally: read leniently, an unsafe or absent reference is skipped,
    # and a document that fails to read is dropped with a SUPERSEDED_INPUT gap
    # unless the current index lists it again. That keeps "corrected sources
    # and a new index" able to resume a build that failed on a bad document.
    provisional: set[str] = set()
    superseded: list[str] = []
    for index_path in _revision_indexes(manifests, revision):
        if index_path == current:
            continue
        earlier = (earlier_indexes or {}).get(index_path)
        if not isinstance(earlier, dict):
            continue  # unreadable: it stays in index_history, its entries are not inherited
        for role, _prefix, listed in _index_roles(earlier):
            for ref in listed:
                if ref in provisional and role_of[ref] != role:
                    # A later index's explicit role for an inherited path wins,
                    # whether or not that index is still the current one.
                    ordered[role_of[ref]].remove(ref)
                    role_of[ref] = role
                    ordered.setdefault(role, []).append(ref)
                    continue
                if not _usable_reference(ref, files) or ref in role_of:
                    # A builder output is no input, superseded or not; it is in
                    # the files only once published, and counting it then would
                    # make the plan change with the publication it plans.
                    if ref in files and ref not in role_of and ref not in superseded and not is_generated(ref):
                        superseded.append(ref)
                    continue
                role_of[ref] = role
                ordered.setdefault(role, []).append(ref)
                provisional.add(ref)

    for index_path in [current] if current else []:
        index = indexes[index_path]
        for role, prefix, listed in _index_roles(index):
            seen: set[str] = set()
            for position, ref in enumerate(listed):
                pointer = f"{prefix}/{position}"
                if ref in seen:
                    raise CaseBuildError(
                        "DUPLICATE_SOURCE", f"{ref!r} is listed twice in {role}", path=index_path, pointer=pointer
                    )
                seen.add(ref)
                _check_listed(ref, files, index_path, pointer)
                if ref in provisional:
                    provisional.discard(ref)  # the current index vouches for it: read strictly
                    if role_of[ref] != role:  # and its role is the current index's
                        ordered[role_of[ref]].remove(ref)
                        role_of[ref] = role
                        ordered.setdefault(role, []).append(ref)
                    continue
                take(role, ref, index_path, pointer)

    # seq is the global first-appearance order (all roles of index 1, then of
    # index 2, ...), so records of appended documents always number after
    # every earlier record, whatever their role.
    contracts = {role: contract for role, contract in (*_DOCUMENT_ROLES, ("expected_research", "research-result"))}
    inventory = list(role_of.items())
    attached: set = set()
    if from_prior:
        inventory = _prior_in_listing_order(inventory, from_prior, _first_listed(history, indexes, earlier_indexes or {}))
        attached = _attached_by(prior_case["document"])
    documents = []
    seq = 0
    for path, role in inventory:
        if role in contracts:
            document = {**_ref(path, files), "role": role, "contract": contracts[role], "seq": seq,
                        "lenient": path in provisional, "prior": path in from_prior}
            if path in from_prior and role == "reports":
                # Whether the prior case listed this report's attachments: if it
                # did not (its builder ignored them, or it ignored them itself),
                # the build keeps them ignored (build._snapshot).
                document["prior_listed_attachments"] = path in attached
            documents.append(document)
            seq += 1
    # Research results carry a sibling request.json that must be read and
    # checked too: once, however many results of one folder share it (a
    # document twice would be two read_input tasks of one name, which doit
    # refuses), and strictly if any result that needs it is read strictly.
    siblings: dict[str, bool] = {}
    for doc in [d for d in documents if d["role"] == "expected_research"]:
        sibling = doc["path"].rsplit("/", 1)[0] + "/request.json" if "/" in doc["path"] else "request.json"
        if sibling not in files:
            if doc.get("lenient"):
                continue  # inherited: assemble drops a result without its request
            raise CaseBuildError(
                "RESEARCH_INVALID", "research result has no sibling request.json", path=doc["path"]
            )
        if sibling not in role_of:
            siblings[sibling] = siblings.get(sibling, True) and doc.get("lenient", False)
    for sibling, lenient in siblings.items():
        documents.append({**_ref(sibling, files), "role": "research_request", "contract": "research-request", "seq": seq,
                          "lenient": lenient})
        seq += 1


    structured = set(history) | {d["path"] for d in documents}
    payload = sorted(p for p in files if not is_generated(p))
    opaque = [_ref(p, files) for p in payload if p not in structured]

    roles_hashed = {
        "index": [[p, files[p]["sha256"]] for p in history],
        **{
            role: [[p, files[p]["sha256"]] for p in paths]
            for role, paths in sorted(ordered.items())
        },
    }
    unclassified_hashed = [[p, files[p]["sha256"]] for p in payload if p not in role_of and p not in history]
    request_hash = canonical_hash(
        {
            "builder_version": BUILDER_VERSION,
            "analysis_revision": revision,
            "roles": roles_hashed,
            "unclassified": unclassified_hashed,
        }
    )

    plan = {
        "builder_version": BUILDER_VERSION,
        "case_id": snapshot["case_id"],
        "package_id": snapshot["package_id"],
        "analysis_revision": revision,
        "snapshot_generation": snapshot["package_generation"],
        "project": snapshot["project"],
        "step_id": step_id_for(revision),
        "outputs": case_paths_for(revision),
        "request_hash": request_hash,
        "index": _ref(current, files) if current else None,
        "index_history": [_ref(p, files) for p in history],
        "roles": {role: [_ref(p, files) for p in paths] for role, paths in sorted(ordered.items())},
        "documents": documents,
        "opaque": opaque,
        "files": {p: files[p] for p in payload},
        "prior_case": prior_case["ref"] if prior_case else None,
        "superseded": superseded,
        "limits": limits.to_dict(),
    }
    if enforce_limits:
        check_limits(plan, limits)
    return plan


def _attached_by(prior_document) -> set:
    """The reports whose attachments a prior case (or its view) lists."""
    bug = prior_document.get("bug") if isinstance(prior_document, dict) else None
    attachments = bug.get("attachments") if isinstance(bug, dict) else None
    if not isinstance(attachments, list):
        return set()
    return {
        item["provenance"].get("source")
        for item in attachments
        if isinstance(item, dict) and isinstance(item.get("provenance"), dict)
    }


def _first_listed(history: list[str], indexes: dict, earlier_indexes: dict) -> dict[tuple[str, str], int]:
    """Each (path, role)'s place in the order the package's indexes first
    list it so: every index in generation order (those of earlier revisions
    too), each with its reports, then its reproductions, then its other
    roles. By role too: a listing in a role the input does not have is not
    where it was taken in (an input listed as a report, refused, and listed
    again later as a reproduction)."""
    first: dict[tuple[str, str], int] = {}
    for path in history:
        index = indexes[path] if path in indexes else earlier_indexes.get(path)
        for role, _prefix, listed in _index_roles(index):
            for ref in listed:
                first.setdefault((ref, role), len(first))
    return first


def _prior_in_listing_order(
    inventory: list[tuple[str, str]], from_prior: set[str], first: dict[tuple[str, str], int]
) -> list[tuple[str, str]]:
    """The inventory with the prior case's inputs interleaved across roles as
    the indexes first listed them, as the revisions before built them.

    A case lists its reports and its reproductions apart, so taken from it
    alone every inherited report would come before every inherited
    reproduction: a report appended after a reproduction would move ahead of
    it in the next revision, and that revision's records would no longer
    begin with the previous build's (an append rebuild could not splice).
    Within each role the prior case's order is kept exactly (reproduction ids
    follow it); only which role's next input comes next is taken from the
    indexes. An input no index lists (never, for a case this builder wrote)
    comes after those that are listed, in the prior case's order.

    Not exact for an input an earlier revision's index listed in the same
    role without taking it in (refused, then dropped), which a later revision
    took in: its first listing is earlier than where it was taken in, so the
    next revision may move it forward (ids stay; that revision's first build
    is assembled whole instead of spliced)."""
    unlisted = len(first)
    queues: dict[str, list[tuple[int, int, str, str]]] = {}
    rest = []
    for position, (path, role) in enumerate(inventory):
        if path in from_prior:
            queues.setdefault(role, []).append((first.get((path, role), unlisted), position, path, role))
        else:
            rest.append((path, role))
    # heapq.merge takes the smallest head each time and keeps each queue's own order.
    return [(path, role) for _key, _position, path, role in heapq.merge(*queues.values())] + rest


#: True while a build runs with limits its caller gave (``CaseBuilder(store,
#: limits)``), which no limits.json changes.
LIMITS_FROM_CALLER: contextvars.ContextVar[bool] = contextvars.ContextVar("viano_limits_from_caller", default=False)


def raise_hint(name: str, limit: int) -> str:
    """Where a refused build's limit can be raised (a workspace's limits.json), or that it cannot."""
    from .workspace_limits import ceiling

    if LIMITS_FROM_CALLER.get():
        return f" (CaseBuilderLimits.{name}, as given to CaseBuilder)"

    top = ceiling(name)
    if limit >= top:
        return f" (case_builder.{name} is at the most a workspace may set)"
    return f" (a workspace's limits.json can raise case_builder.{name} up to {top})"


def check_limits(plan: dict, limits: CaseBuilderLimits) -> None:
    """CaseBuilderLimits, from manifest sizes, before anything is parsed."""
    current = plan["index"]
    if current and current["size"] > limits.document_bytes:
        raise CaseBuildError("LIMIT_EXCEEDED", f"index is {current['size']} bytes, limit {limits.document_bytes}"
                             f"{raise_hint('document_bytes', limits.document_bytes)}", path=current["path"])
    check_aggregate_limits(plan, limits)
    for doc in plan["documents"]:
        if doc["size"] > limits.document_bytes and not doc.get("lenient"):
            # (an inherited one: read_input refuses it and assemble drops it with a gap)
            raise CaseBuildError("LIMIT_EXCEEDED", f"document is {doc['size']} bytes, limit {limits.document_bytes}"
                                 f"{raise_hint('document_bytes', limits.document_bytes)}", path=doc["path"])
    prior = plan.get("prior_case")
    if prior is not None and prior["size"] > limits.case_bytes:
        raise CaseBuildError("LIMIT_EXCEEDED", f"prior case is {prior['size']} bytes, limit {limits.case_bytes}{raise_hint('case_bytes', limits.case_bytes)}",
                             path=prior["path"])


def check_aggregate_limits(plan: dict, limits: CaseBuilderLimits) -> None:
    """The limits of the whole build: how many structured documents it reads
    (the current index counts as one) and their bytes."""
    current = plan["index"]
    counted = len(plan["documents"]) + (1 if current else 0)
    if counted > limits.documents:
        raise CaseBuildError("LIMIT_EXCEEDED", f"{counted} structured documents, limit {limits.documents}{raise_hint('documents', limits.documents)}",
                             path=current["path"] if current else None)
    structured_bytes = current["size"] if current else 0
    for doc in plan["documents"]:
        if doc["size"] <= limits.document_bytes or not doc.get("lenient"):
            structured_bytes += doc["size"]
    if structured_bytes > limits.aggregate_bytes:
        raise CaseBuildError("LIMIT_EXCEEDED", f"{structured_bytes} bytes of structured input, limit {limits.aggregate_bytes}"
                             f"{raise_hint('aggregate_bytes', limits.aggregate_bytes)}",
                             path=current["path"] if current else None)


def check_index_history(plan: dict, limits: CaseBuilderLimits) -> None:
    """Every index the package has had is read by every build (to know what
    it listed), so ``doit append`` keeps their total within the aggregate
    limit. Only appends are held to it: a build is not, so that a package
    whose earlier indexes already total more (appended before this check)
    still builds."""
    total = sum(ref["size"] for ref in plan["index_history"])
    if total > limits.aggregate_bytes:
        current = plan["index"]
        raise CaseBuildError("LIMIT_EXCEEDED", f"{total} bytes of indexes in all, limit {limits.aggregate_bytes}"
                             f"{raise_hint('aggregate_bytes', limits.aggregate_bytes)}",
                             path=current["path"] if current else None)


def make_plan(
    package,
    snapshot_generation: int,
    limits: CaseBuilderLimits,
    *,
    read_index,
    read_prior_case,
    enforce_limits: bool = True,
    proposed: tuple[dict, dict] | None = None,
) -> dict:
    """I/O edge of planning: load manifests 1..g, every index, the prior case.

    ``read_index(path, manifest) -> dict`` and ``read_prior_case(ref, manifest)
    -> dict`` read, verify and validate one document each. ``proposed``, a
    manifest g+1 not published yet and its parsed current index, plans the
    build that generation would get (``doit append`` checks it before it
    publishes; the new files need only their sizes there).
    """
    # Read only, here and in plan_from_manifests (the plan shares their file
    # entries, and nothing changes a plan's nested values after it is made).
    # Of the generations before the snapshot only their outlines are read
    # (revision and artifacts): their file entries grew a long-lived case's
    # planning by generations x files.
    manifests = [package.manifest_outline(g) for g in range(1, snapshot_generation)]
    if snapshot_generation >= 1:
        manifests.append(package.manifest(snapshot_generation, copy=False))
    if proposed is not None:
        manifests.append(proposed[0])
    snapshot = manifests[-1]
    indexes: dict[str, dict] = {}
    for manifest in manifests:
        path = manifest.get("artifacts", {}).get("case_inputs")
        if path and path not in snapshot["files"]:
            raise CaseBuildError("REFERENCE_MISSING", "the manifest's case_inputs is not in the package", path=path)
    current = snapshot.get("artifacts", {}).get("case_inputs")
    if current and proposed is not None:
        indexes[current] = proposed[1]
    elif current:
        indexes[current] = read_index(current, snapshot)
    # The prior case is the newest case published for an earlier revision. It
    # is searched for from the newest manifest down, because once this
    # revision's own case is published, artifacts.case points at that one.
    prior = None
    for manifest in reversed(manifests):
        prior_path = manifest.get("artifacts", {}).get("case")
        if not prior_path or GENERATED_RE.fullmatch(prior_path) is None:
            continue
        if int(prior_path.split("/")[2]) < snapshot["analysis_revision"]:
            ref = _ref(prior_path, snapshot["files"])
            prior = {"ref": ref, "document": read_prior_case(ref, snapshot)}
            break
    earlier = {}
    for manifest in manifests:
        path = manifest.get("artifacts", {}).get("case_inputs")
        if path and path != current and path not in earlier:
            earlier[path] = _read_leniently(package, path, snapshot, limits)
    return plan_from_manifests(
        manifests=manifests, indexes=indexes, prior_case=prior, limits=limits,
        earlier_indexes=earlier, enforce_limits=enforce_limits,
    )


#: How large an earlier index may be and still name what it listed. Fixed,
#: not the document limit in force: what a revision inherits must not change
#: when a workspace's limits.json raises that limit (or is removed again), or
#: a confirmed revision would plan other inputs and need a reopen to be
#: reused. The ceiling a workspace may raise ``document_bytes`` to.
EARLIER_INDEX_BYTES = 2 * 1024 * 1024


def _read_leniently(package, path: str, manifest: dict, limits: CaseBuilderLimits):
    """An earlier, superseded index, only to name what it listed. It may be the
    very index a correction replaced, so a malformed one is skipped, not fatal."""
    from .errors import VianoError
    from .jsoncanon import decode_strict

    from .reader import read_document

    try:
        data = package.read_verified(path, EARLIER_INDEX_BYTES, manifest=manifest)
        # Held to its contract like any index: one that fails it (wrong version,
        # wrong shapes) names nothing to inherit, exactly like an unreadable one.
        return read_document(data, "case-inputs", path=path, max_bytes=EARLIER_INDEX_BYTES)
    except VianoError:
        return None

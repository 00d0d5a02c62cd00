"""Pure case assembly: a validated snapshot in, the canonical case dict out.

:func:`assemble` is the heart of the builder (seed 001, ARCHITECTURE.md
sections 6-7, docs/internals.md "assemble.py" and "The case document"). It
performs no I/O, reads no clock, uses no randomness and never iterates a dict
whose insertion order could differ between runs: every list in the output
follows a documented input order (inventory ``seq``, then document order), and
dict-valued inputs (``files``, ``context``) are only looked up by key. The
same snapshot therefore yields byte-identical :func:`pipeline.jsoncanon.pretty_bytes`
on any machine, locale, time zone and hash seed.

Nothing is interpreted. Statements are copied verbatim with provenance
(``kind``, ``source`` content path, RFC 6901 ``pointer`` to the statement
object); categories come only from the producer's field names; comments and
tester hypotheses never take part in claim-conflict or fact inference;
opaque context stays a reference ``{path, sha256, size}``.

Decisions pinned here (each one is also stated where it is implemented):

* **Ids.** ``O``/``C``/``T``/``E``/``F`` records keep the id the prior case gave
  the same ``(source, pointer)``; new records are numbered after the highest
  number of their namespace in the prior case, in inventory order (``seq``)
  then document order. External research statements are numbered after all
  tester statements of the same build, in ``expected_research`` list order.
  Numbers never shrink or get reused, so appending inputs never renumbers.
  ``R`` ids follow the reproductions' inventory order (append-only, hence stable).
* **Completeness** is derived from explicit ``expected_behavior_complete``
  declarations only, plus explicit expected-behaviour claim conflicts (see
  :func:`_completeness`).
* **Claim conflicts** list every statement carrying a conflicting key (all of
  its values, in order), with ``pointer`` = the statement object's pointer.
* **Entity ids**: integers become decimal strings (``42`` and ``"42"`` of one
  type are one entity; ``"042"`` is another). Booleans and floats (even
  ``42.0``, as in ``contracts``) are not integers: ``SCHEMA_VIOLATION``.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from . import BUILDER_VERSION
from .errors import CaseBuildError, VianoError
from .jsoncanon import canonical_bytes, canonical_hash, json_copy, json_pointer
from .research_request import build_research_request

try:  # the workspace module owns the rule; fall back to an equivalent check
    from .workspace import check_reference as _workspace_check_reference
except ImportError:  # pragma: no cover - only while workspace.py is absent
    _workspace_check_reference = None

__all__ = [
    "CaseTooLarge",
    "CASE_FORMAT",
    "CASE_FORMAT_VERSION",
    "COMPLETENESS_VALUES",
    "DEFAULT_INLINE_FACT_VALUE",
    "GAP_CODES",
    "assemble",
    "CaseAssembler",
    "APPENDED_LISTS",
    "carry_forward",
    "check_reference",
    "prior_numbering",
    "document_fragment",
]

CASE_FORMAT = "viano-case"
CASE_FORMAT_VERSION = 1
DEFAULT_INLINE_FACT_VALUE = 16 * 1024

COMPLETENESS_VALUES = ("missing", "unspecified", "reported_complete", "reported_partial", "conflicting")

#: code -> fixed message. Messages carry no supplied text, so they are safe anywhere.
GAP_CODES: dict[str, str] = {
    "MISSING_INDEX": "the package declares no case-inputs index; no report or reproduction roles are known",
    "NO_REPORTS": "no bug report was supplied",
    "NO_REPRODUCTIONS": "no reproduction was supplied",
    "NO_EXPECTED_BEHAVIOR": "no expected behaviour was supplied",
    "SUPERSEDED_INPUT": "an earlier index of this revision listed this input but it could not be inherited (it fails its contract or the reference is unusable) and the current index does not list it; it is kept as an unclassified input",
    "UNNORMALIZED_KEY": "a claim key or entity type here equals another one after Unicode NFC normalisation but not code point for code point; they are kept apart, not merged",
    "IGNORED_ATTACHMENTS": "this report came from the prior case, which did not list its attachments (its builder ignored reports' attachments); the report is kept and its attachments stay ignored, unchecked and unlisted",
}

_NAMESPACES = ("O", "C", "T", "E", "F")
_REPORT_BLOCKS = (("observations", "O"), ("comments", "C"), ("tester_hypotheses", "T"), ("expected_behavior", "E"))
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_DRIVE_RE = re.compile(r"^[A-Za-z]:")


# --------------------------------------------------------------------------- references


def _local_check_reference(ref: Any) -> str:
    """Equivalent of ``pipeline.workspace.check_reference`` (docs/internals.md)."""
    if not isinstance(ref, str) or ref == "":
        raise CaseBuildError("REFERENCE_UNSAFE", "reference must be a non-empty string", path=None)
    if ref.startswith("/") or "\\" in ref or _DRIVE_RE.match(ref):
        raise CaseBuildError("REFERENCE_UNSAFE", "reference is absolute or uses a backslash or drive", path=ref)
    for ch in ref:
        if ch in _BIDI or unicodedata.category(ch) == "Cc":
            raise CaseBuildError("REFERENCE_UNSAFE", "reference holds a control or bidi character", path=ref)
    for part in ref.split("/"):
        if part in ("", ".", ".."):
            raise CaseBuildError("REFERENCE_UNSAFE", "reference has an empty, '.' or '..' part", path=ref)
    return ref


def check_reference(ref: Any) -> str:
    """Validate a content path; ``REFERENCE_UNSAFE`` (path = the ref) if not safe."""
    if _workspace_check_reference is not None:
        if not isinstance(ref, str):
            raise CaseBuildError("REFERENCE_UNSAFE", "reference must be a non-empty string")
        return _workspace_check_reference(ref)
    return _local_check_reference(ref)


def _resolve_ref(ref: Any, files: dict, where: str, pointer: str) -> dict:
    """Turn a content path (or a REF dict) into ``{path, sha256, size}`` from ``files``.

    ``where`` is the referring document and ``pointer`` the reference's place in
    it; both errors name them, never the untrusted reference as the path.
    """
    path = ref.get("path") if isinstance(ref, dict) else ref
    try:
        check_reference(path)
    except VianoError as exc:
        raise CaseBuildError("REFERENCE_UNSAFE", f"unsafe reference: {exc.message}", path=where, pointer=pointer) from None
    entry = files.get(path)
    if not isinstance(entry, dict):
        from .plan import is_generated

        if is_generated(path):
            # In the package, but the builder's own output or record: never an
            # input (as an index naming it is refused at append).
            raise CaseBuildError("REFERENCE_UNSAFE", f"reference {path!r} is written by the builder, not an input",
                                 path=where, pointer=pointer)
        raise CaseBuildError("REFERENCE_MISSING", f"reference {path!r} is not in the package", path=where, pointer=pointer)
    return {"path": path, "sha256": entry["sha256"], "size": entry["size"]}


def _ref(value: dict) -> dict:
    """A REF copied down to exactly its three fields."""
    return {"path": value["path"], "sha256": value["sha256"], "size": value["size"]}


# --------------------------------------------------------------------------- ids


class _Ids:
    """Stable record ids by ``(namespace, source, pointer)``.

    Prior ids are reused; a new record gets ``max(prior number in its
    namespace, numbers handed out so far) + 1``. Callers request ids in
    inventory order then document order, which is therefore the numbering
    order of new records.
    """

    def __init__(self, prior_document: Any) -> None:
        self._prior: dict[tuple[str, str, str], str] = {}
        self._next = {ns: 1 for ns in _NAMESPACES}
        self._given: set[tuple[str, str, str]] = set()
        if prior_document is not None:
            self._load(prior_document)

    def _load(self, doc: Any) -> None:
        if not isinstance(doc, dict) or doc.get("format") != CASE_FORMAT or doc.get("format_version") != CASE_FORMAT_VERSION:
            raise CaseBuildError("INCOMPATIBLE_CASE", "prior case is not viano-case format_version 1")
        try:
            groups = [
                ("O", doc["human_observations"]["observations"]),
                ("C", doc["human_observations"]["comments"]),
                ("T", doc["human_observations"]["tester_hypotheses"]),
                ("E", doc["expected_behavior"]["statements"]),
                ("F", doc["runtime_facts"]["facts"]),
            ]
            used: set[str] = set()
            prior = self._prior
            for ns, records in groups:
                highest = self._next[ns] - 1
                for record in records:
                    rid = record["id"]
                    prov = record["provenance"]
                    # ^[OCTEF][0-9]{4,}, ASCII digits, in the namespace (no regex: thousands per rebuild).
                    digits = rid[1:] if isinstance(rid, str) else ""
                    if len(digits) < 4 or rid[0] != ns or not digits.isascii() or not digits.isdigit() or rid in used:
                        raise CaseBuildError("INCOMPATIBLE_CASE", f"prior case has a malformed or repeated id {rid!r}")
                    key = (ns, prov["source"], prov["pointer"])
                    if key in prior:
                        raise CaseBuildError("INCOMPATIBLE_CASE", "prior case gives one source pointer two ids")
                    used.add(rid)
                    prior[key] = rid
                    number = int(digits)
                    if number > highest:
                        highest = number
                self._next[ns] = highest + 1
        except (KeyError, TypeError) as exc:
            raise CaseBuildError("INCOMPATIBLE_CASE", f"prior case lacks a required block ({exc})") from None

    def raise_floor(self, ns: str, floor: int) -> None:
        """New records of ``ns`` are numbered from ``floor`` at least."""
        if floor > self._next[ns]:
            self._next[ns] = floor

    def get(self, ns: str, source: str, pointer: str) -> str:
        key = (ns, source, pointer)
        if key in self._given:  # a source listed twice would otherwise duplicate ids
            raise CaseBuildError("DUPLICATE_SOURCE", "the same document is listed twice", path=source)
        self._given.add(key)
        rid = self._prior.get(key)
        if rid is None:
            rid = f"{ns}{self._next[ns]:04d}"
            self._next[ns] += 1
        return rid


# --------------------------------------------------------------------------- records


def _entity_id(value: Any, source: str, pointer: str) -> str:
    """Entity ids as strings: ints become decimal strings; bools and floats are refused."""
    if isinstance(value, bool):
        raise CaseBuildError("SCHEMA_VIOLATION", "an entity id must be a string or an integer, not a boolean", path=source, pointer=pointer)
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    raise CaseBuildError("SCHEMA_VIOLATION", "an entity id must be a string or an integer", path=source, pointer=pointer)


class CaseTooLarge(Exception):
    """The records assembled so far already take more than the case's byte
    limit: ``at_least`` is a lower bound of the case.json they would make."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"case.json would be at least {at_least} bytes, limit {limit}")
        self.at_least = at_least
        self.limit = limit


class _CaseBudget:
    """A running lower bound of the case.json bytes, checked as records are made.

    One small input can make a huge case: every record repeats its document's
    content path (up to ~4 KB) and a report may attach one short file a
    hundred thousand times, so a 1 MiB report made a 1 GB case (4.8 GB of
    memory) before its size was checked. Each record is charged the length of
    strings it is sure to hold in the output (source, pointer, text; a code
    point is at least one byte), so the bound never passes the real size and
    a case within its limit is never refused here; the exact check follows
    the encoding. Without a limit (a snapshot that names none) nothing is
    charged."""

    __slots__ = ("used", "limit")

    def __init__(self, limit: int | None) -> None:
        self.used = 0
        self.limit = limit

    def charge(self, *texts: Any, extra: int = 0) -> None:
        """Charge the lengths of ``texts`` (a value that is not a string, which
        only an unvalidated snapshot can hold, is charged nothing) and ``extra``."""
        if self.limit is None:
            return
        self.used += extra + sum(len(text) for text in texts if isinstance(text, str))
        if self.used > self.limit:
            raise CaseTooLarge(self.used, self.limit)


class _Entities:
    """Entities merged by (explicit type, string id), in first-appearance order."""

    def __init__(self, earlier: list[dict] = ()) -> None:
        self._by_key: dict[tuple[str, str], dict] = {}
        # Each entity's roles as a set beside its list: the schema bounds
        # neither, and a list scan per role made a merge quadratic (110,000
        # roles in one 1 MiB report: 142 s).
        self._roles: dict[tuple[str, str], set[str]] = {}
        self._order: list[tuple[str, str]] = []
        for record in earlier:  # a carried case's entities, merged first as they were
            key = (record["type"], record["id"])
            self._by_key[key] = json_copy(record)
            self._roles[key] = set(record["roles"])
            self._order.append(key)

    def add(self, fragment_entities: list[dict], source: str, kind: str, budget: _CaseBudget) -> None:
        """Merge one document's entities (as :func:`_fragment_entities` lists
        them); each source keeps the provenance kind of its document."""
        for entity in fragment_entities:
            budget.charge(source, entity["pointer"])
            key = (entity["type"], entity["id"])
            record = self._by_key.get(key)
            if record is None:
                record = {"type": key[0], "id": key[1], "roles": [], "sources": []}
                self._by_key[key] = record
                self._roles[key] = set()
                self._order.append(key)
            seen = self._roles[key]
            for role in entity["roles"]:
                if role not in seen:
                    seen.add(role)
                    record["roles"].append(role)
            record["sources"].append({"kind": kind, "source": source, "pointer": entity["pointer"]})

    def result(self) -> list[dict]:
        return [self._by_key[key] for key in self._order]


def _claim_conflicts(block: str, statements: list[dict]) -> list[dict]:
    """Explicit claims with one key but different canonical JSON values.

    Every statement carrying such a key is listed (value, id, source,
    statement pointer) in statement order; keys in first-appearance order.
    Natural-language text is never compared.
    """
    by_key: dict[str, list[dict]] = {}
    order: list[str] = []
    for statement in statements:
        claim = statement.get("claim")
        if claim is None:
            continue
        if claim["key"] not in by_key:
            by_key[claim["key"]] = []
            order.append(claim["key"])
        by_key[claim["key"]].append(statement)
    conflicts = []
    for key in order:
        group = by_key[key]
        if len({canonical_bytes(s["claim"]["value"]) for s in group}) > 1:
            conflicts.append(
                {
                    "block": block,
                    "key": key,
                    "values": [
                        {
                            "value": json_copy(s["claim"]["value"]),
                            "id": s["id"],
                            "source": s["provenance"]["source"],
                            "pointer": s["provenance"]["pointer"],
                        }
                        for s in group
                    ],
                }
            )
    return conflicts


def _completeness(
    declarations: list[dict], has_statements: bool, has_claim_conflict: bool, undeclared_statements: bool = False
) -> str:
    """Expected-behaviour completeness from explicit declarations only.

    ``true`` and ``false`` both declared -> ``conflicting``; otherwise any
    ``false`` -> ``reported_partial``; ``true`` -> ``reported_complete`` only
    when every report that supplies expected behaviour declared it complete
    (seed 000: "only explicit expected_behavior_complete: true is sufficient",
    so one report's ``true`` does not cover another report's undeclared
    expectations: that is ``unspecified``); no declaration -> ``unspecified``
    when tester statements exist, else ``missing``. Decision: an explicit claim conflict inside the tester's
    expected behaviour (same claim key, different canonical values) also makes
    it ``conflicting`` whatever was declared — a reporter cannot call
    contradictory expectations complete, and seed 000 requires research for
    contradictory declarations. Prose is never read for either purpose.
    """
    values = {d["value"] for d in declarations}
    if (True in values and False in values) or has_claim_conflict:
        return "conflicting"
    if False in values:
        return "reported_partial"
    if True in values:
        return "unspecified" if undeclared_statements else "reported_complete"
    return "unspecified" if has_statements else "missing"


def _by_seq(docs: list[dict]) -> list[dict]:
    # sorted() is stable: equal seq values (never produced by the builder) keep list order.
    return sorted(docs, key=lambda d: d["seq"])


# --------------------------------------------------------------------------- research results


def _check_research(result_doc: dict, manifest: dict) -> None:
    """The pure part of seed 000's sibling-request check: hash, identity, revision."""
    path = result_doc["path"]
    request = result_doc.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("document"), dict):
        raise CaseBuildError("RESEARCH_INVALID", "research result has no sibling request", path=path)
    document = result_doc["document"]
    if document.get("request_hash") != canonical_hash(request["document"]):
        raise CaseBuildError("RESEARCH_INVALID", "request_hash does not match the sibling request", path=path, pointer="/request_hash")
    req = request["document"]
    if req.get("case_id") != manifest["case_id"] or req.get("package_id") != manifest["package_id"]:
        raise CaseBuildError("RESEARCH_INVALID", "research request belongs to another case or package", path=request.get("path"))
    revision = req.get("analysis_revision")
    if not isinstance(revision, int) or isinstance(revision, bool) or revision > manifest["analysis_revision"]:
        raise CaseBuildError("RESEARCH_INVALID", "research request is for a future analysis revision", path=request.get("path"))


def _external_statements(result_doc: dict, ids: _Ids) -> tuple[list[dict], dict]:
    """Statements of one research result (origin external_research) and its RESULT entry."""
    path = result_doc["path"]
    document = result_doc["document"]
    sources = document.get("sources") or []
    statements = []
    for index, item in enumerate(document.get("statements") or []):
        pointer = json_pointer(["statements", index])
        citations = []
        for cindex, cited in enumerate(item.get("citations") or []):
            if isinstance(cited, bool) or not isinstance(cited, int) or not 0 <= cited < len(sources):
                raise CaseBuildError(
                    "RESEARCH_INVALID", "citation index does not exist in sources", path=path, pointer=json_pointer(["statements", index, "citations", cindex])
                )
            src = sources[cited]
            citations.append({"url": src["url"], "title": src["title"], "retrieved_at": src["retrieved_at"], "excerpt": src["excerpt"]})
        statement = {
            "id": ids.get("E", path, pointer),
            "text": item["text"],
            "provenance": {"kind": "external_research", "source": path, "pointer": pointer},
            "origin": "external_research",
            "citations": citations,
        }
        statements.append(statement)
    entry = {
        "path": path,
        "sha256": result_doc["sha256"],
        "request_hash": document["request_hash"],
        # The sibling request.json is listed in no index role: named here, it
        # is preserved in the case with the result it answers.
        "request": _ref(result_doc["request"]),
        "provider": json_copy(document["provider"]),
        "status": document["status"],
        "statement_ids": [s["id"] for s in statements],
    }
    return statements, entry


# --------------------------------------------------------------------------- fragments


def _fragment_statement(item: dict, kind: str, source: str, pointer: str) -> dict:
    """A statement as :func:`_statement` makes it, less its id."""
    out = {"text": item["text"], "provenance": {"kind": kind, "source": source, "pointer": pointer}}
    for field in ("author", "observed_at"):
        if field in item:
            out[field] = item[field]
    if "claim" in item:
        out["claim"] = {"key": item["claim"]["key"], "value": json_copy(item["claim"]["value"])}
    return out


def _fragment_entities(document: dict, source: str) -> list[dict]:
    entities = []
    for index, entity in enumerate(document.get("entities") or []):
        entities.append(
            {
                "type": entity["type"],
                "id": _entity_id(entity["id"], source, json_pointer(["entities", index, "id"])),
                "roles": list(entity.get("roles") or []),
                "pointer": json_pointer(["entities", index]),
            }
        )
    return entities


def document_fragment(role: str, source: str, document: dict, inline_fact_value: int = DEFAULT_INLINE_FACT_VALUE) -> dict:
    """Everything the case takes from one report or reproduction, before ids.

    A pure function of the document, its content path and the inline fact
    limit, so the build derives it once per input (``read_input``) and caches
    it: appending one report then re-derives nothing from the other inputs,
    and an oversized fact value is measured once and never carried again.
    :func:`assemble` gives every record its id in inventory order, exactly as
    if it walked the documents themselves.
    """
    fragment: dict[str, Any] = {"role": role, "inline_fact_value": inline_fact_value}
    if role == "report":
        for field in ("title", "summary"):
            if field in document:
                fragment[field] = document[field]
        fragment["blocks"] = [
            [
                ns,
                [
                    _fragment_statement(item, "tester_report", source, json_pointer([field, index]))
                    for index, item in enumerate(document.get(field) or [])
                ],
            ]
            for field, ns in _REPORT_BLOCKS
        ]
        if "expected_behavior_complete" in document:
            fragment["declaration"] = document["expected_behavior_complete"]
        fragment["attachments"] = json_copy(list(document.get("attachments") or []))
    elif role == "reproduction":
        fragment["observations"] = [
            _fragment_statement(item, "reproduction", source, json_pointer(["observations", index]))
            for index, item in enumerate(document.get("observations") or [])
        ]
        facts = []
        for index, item in enumerate(document.get("facts") or []):
            pointer = json_pointer(["facts", index])
            fact = {"name": item["name"], "provenance": {"kind": "reproduction", "source": source, "pointer": pointer}}
            # Decision: the limit applies to the value's canonical JSON bytes; at the limit it stays inline.
            if len(canonical_bytes(item["value"])) > inline_fact_value:
                fact["value_ref"] = {"source": source, "pointer": json_pointer(["facts", index, "value"])}
            else:
                fact["value"] = json_copy(item["value"])
            facts.append(fact)
        fragment["facts"] = facts
        fragment["steps"] = [{"text": text, "pointer": json_pointer(["steps", i])} for i, text in enumerate(document.get("steps") or [])]
        fragment["events_ref"] = json_copy(document.get("events_ref"))
        fragment["attachments"] = json_copy(list(document.get("attachments") or []))
    else:
        raise ValueError(f"no fragment for role {role!r}")
    fragment["entities"] = _fragment_entities(document, source)
    return fragment


def _fragment_of(role: str, doc: dict, limit: int) -> dict:
    fragment = doc.get("fragment")
    if fragment is None:
        return document_fragment(role, doc["path"], doc["document"], limit)
    if fragment.get("role") != role or fragment.get("inline_fact_value") != limit:
        raise CaseBuildError("INTEGRITY_ERROR", "a cached input fragment was made for another role or inline limit", path=doc["path"])
    return fragment


def _owned_statement(rid: str, fragment_statement: dict) -> dict:
    """:func:`_copied_statement` for a fragment nobody else holds: the same
    statement, made by giving the fragment's own dict its id."""
    fragment_statement["id"] = rid
    return fragment_statement


def _copied_statement(rid: str, fragment_statement: dict) -> dict:
    out = {"id": rid, "text": fragment_statement["text"], "provenance": dict(fragment_statement["provenance"])}
    for field in ("author", "observed_at"):
        if field in fragment_statement:
            out[field] = fragment_statement[field]
    if "claim" in fragment_statement:
        claim = fragment_statement["claim"]
        out["claim"] = {"key": claim["key"], "value": json_copy(claim["value"])}
    return out


def _as_is(value: Any) -> Any:
    return value


# --------------------------------------------------------------------------- assemble


def assemble(snapshot: dict, *, owned: bool = False, carried: dict | None = None) -> dict:
    """Build the canonical case document (docs/internals.md) from ``snapshot``.

    Pure and deterministic; raises :class:`CaseBuildError` with a stable code
    (``REFERENCE_UNSAFE``, ``REFERENCE_MISSING``, ``RESEARCH_INVALID``,
    ``INCOMPATIBLE_CASE``, ``DUPLICATE_SOURCE``, ``SCHEMA_VIOLATION``) and the
    referring document's path and pointer. The snapshot is never mutated and
    the result shares no mutable object with it, unless ``owned``: then the
    caller gives up the snapshot's cached fragments, whose statements, fact
    values and steps become the case's own (the same case, without copying
    thousands of records the caller would discard anyway).

    With ``carried`` (what :func:`carry_forward` kept of an earlier build
    whose inventory is the start of this one's), the documents marked
    ``carried`` in the snapshot are not walked again: the case's record
    lists (:data:`APPENDED_LISTS`) hold only the other documents' records,
    numbered as the whole case numbers them, and everything derived across
    records (entities, claim conflicts, completeness, the research request,
    gaps) is derived from the carried state and the new records together.
    :func:`pipeline.splice.splice_case` puts the earlier build's records in
    front; the result is byte for byte the case assembled whole.
    """
    if carried is not None and snapshot.get("expected_research"):
        # External statements are numbered after every tester statement: not appendable.
        raise ValueError("a carried assembly takes no research results")
    statement_from = _owned_statement if owned else _copied_statement
    take = _as_is if owned else json_copy
    manifest = snapshot["manifest"]
    files = snapshot.get("files") or {}
    limit = (snapshot.get("limits") or {}).get("inline_fact_value", DEFAULT_INLINE_FACT_VALUE)
    budget = _CaseBudget((snapshot.get("limits") or {}).get("case_bytes"))
    prior = snapshot.get("prior_case")
    ids = _Ids(prior.get("document") if prior else None)
    earlier = carried or _NOTHING_CARRIED
    for ns, floor in earlier["next_floor"].items():
        # The numbers the carried documents used, as if they were walked again.
        ids.raise_floor(ns, floor)

    reports = _by_seq(list(snapshot.get("reports") or []))
    reproductions = _by_seq(list(snapshot.get("reproductions") or []))
    inventory = sorted([("report", d) for d in reports] + [("reproduction", d) for d in reproductions], key=lambda pair: pair[1]["seq"])

    titles: list[dict] = []
    summaries: list[dict] = []
    attachments: list[dict] = []
    ignored_attachments: list[str] = list(earlier["ignored_attachments"])
    blocks: dict[str, list[dict]] = {"O": [], "C": [], "T": [], "E": []}
    declarations: list[dict] = []
    entities = _Entities(earlier["entities"])
    facts: list[dict] = []
    repro_records: list[dict] = []

    # One pass in inventory order, document order inside: this is the id numbering order.
    for role, doc in inventory:
        if doc.get("carried"):
            continue
        source = doc["path"]
        fragment = _fragment_of(role, doc, limit)
        if role == "report":
            for field, target in (("title", titles), ("summary", summaries)):
                if field in fragment:
                    budget.charge(source, fragment[field])
                    target.append({"text": fragment[field], "provenance": {"kind": "tester_report", "source": source, "pointer": "/" + field}})
            for ns, statements in fragment["blocks"]:
                for item in statements:
                    budget.charge(source, item["provenance"]["pointer"], item["text"])
                    statement = statement_from(ids.get(ns, source, item["provenance"]["pointer"]), item)
                    if ns == "E":
                        statement["origin"] = "tester"
                    blocks[ns].append(statement)
            if "declaration" in fragment:
                declarations.append({"value": fragment["declaration"], "source": source, "pointer": "/expected_behavior_complete"})
            if doc.get("attachments_ignored"):
                ignored_attachments.append(source)
            for index, ref in enumerate(fragment["attachments"]):
                pointer = json_pointer(["attachments", index])
                resolved = _resolve_ref(ref, files, source, pointer)
                budget.charge(source, pointer, resolved["path"], extra=64)  # and the file's SHA-256
                attachments.append({**resolved, "provenance": {"kind": "tester_report", "source": source, "pointer": pointer}})
        else:
            observation_ids = []
            for item in fragment["observations"]:
                budget.charge(source, item["provenance"]["pointer"], item["text"])
                statement = statement_from(ids.get("O", source, item["provenance"]["pointer"]), item)
                blocks["O"].append(statement)
                observation_ids.append(statement["id"])
            fact_ids = []
            for item in fragment["facts"]:
                budget.charge(source, item["provenance"]["pointer"], item["name"])
                fact = {"id": ids.get("F", source, item["provenance"]["pointer"]), "name": item["name"], "provenance": take(item["provenance"])}
                if "value_ref" in item:
                    fact["value_ref"] = take(item["value_ref"])
                else:
                    fact["value"] = take(item["value"])
                facts.append(fact)
                fact_ids.append(fact["id"])
            events = fragment["events_ref"]
            # Each step's pointer is in the output beside its text: a reproduction of
            # one-letter steps is mostly pointers (2 M steps, a 184 MB case, was
            # encoded whole before its size was known).
            budget.charge(source, *(part for step in fragment["steps"] for part in (step["pointer"], step["text"])))
            # The events reference first: it names the first refusal, as before.
            events_resolved = None if events is None else _resolve_ref(events, files, source, "/events_ref")
            repro_attachments = [
                _resolve_ref(ref, files, source, json_pointer(["attachments", i])) for i, ref in enumerate(fragment["attachments"])
            ]
            for resolved in repro_attachments:
                budget.charge(resolved["path"], extra=64)
            repro_records.append(
                {
                    "source": source,
                    "steps": take(fragment["steps"]),
                    "observation_ids": observation_ids,
                    "fact_ids": fact_ids,
                    "events_ref": events_resolved,
                    "attachments": repro_attachments,
                }
            )
        entities.add(fragment["entities"], source, "tester_report" if role == "report" else "reproduction", budget)

    # R ids follow inventory order of reproductions (append-only, hence stable).
    first_r = earlier["reproductions"] + 1
    reproduction_list = [{"id": f"R{n:04d}", **record} for n, record in enumerate(repro_records, start=first_r)]

    claimed = {ns: [*(_claim_statement(row) for row in earlier["claims"][ns]), *blocks[ns]] for ns in ("O", "E")}
    observation_conflicts = _claim_conflicts("human_observations", claimed["O"])
    expected_conflicts = _claim_conflicts("expected_behavior", claimed["E"])
    tester_statements = blocks["E"]
    all_declarations = [*earlier["declarations"], *declarations]
    declared_sources = {d["source"] for d in all_declarations}
    tester_sources = [*earlier["tester_sources"], *(st["provenance"]["source"] for st in tester_statements)]
    undeclared = any(source not in declared_sources for source in tester_sources)
    completeness = _completeness(all_declarations, bool(tester_sources), bool(expected_conflicts), undeclared)

    index_ref = snapshot.get("index")
    index_path = index_ref["path"] if index_ref else None
    context = snapshot.get("context") or {}

    def context_refs(role: str) -> list[dict]:
        return [_resolve_ref(ref, files, index_path, json_pointer(["context", role, i])) for i, ref in enumerate(context.get(role) or [])]

    case = {
        "format": CASE_FORMAT,
        "format_version": CASE_FORMAT_VERSION,
        "builder_version": BUILDER_VERSION,
        "case": {
            "case_id": manifest["case_id"],
            "package_id": manifest["package_id"],
            "analysis_revision": manifest["analysis_revision"],
            "package_generation": manifest["package_generation"],
            "project": json_copy(manifest["project"]),
            "request_hash": snapshot["request_hash"],
        },
        "bug": {"titles": titles, "summaries": summaries, "attachments": attachments},
        "human_observations": {"observations": blocks["O"], "comments": blocks["C"], "tester_hypotheses": blocks["T"]},
        "expected_behavior": {
            "completeness": completeness,
            "declarations": declarations,
            "statements": list(tester_statements),
            "status": "tester" if tester_sources else None,
            "sufficiency": "complete" if completeness == "reported_complete" else "partial",
        },
        "reproduction": {"reproductions": reproduction_list},
        "entities": entities.result(),
        "runtime_facts": {"facts": facts, "context": context_refs("runtime")},
        "database_context": context_refs("database"),
        "source_context": context_refs("source"),
        "research": {"request": None, "request_hash": None, "results": [], "supplied": context_refs("research")},
        "data_quality": {"gaps": [], "claim_conflicts": observation_conflicts + expected_conflicts},
        "inputs": {
            "index": _ref(index_ref) if index_ref else None,
            "index_history": [_ref(r) for r in snapshot.get("index_history") or []],
            "reports": [_ref(d) for d in reports],
            "reproductions": [_ref(d) for d in reproductions],
            "expected_research": [_ref(d) for d in snapshot.get("expected_research") or []],
            "attachments": [_resolve_ref(ref, files, index_path, json_pointer(["attachments", i])) for i, ref in enumerate(snapshot.get("attachments") or [])],
            "unclassified": [_ref(r) for r in snapshot.get("unclassified") or []],
            "prior_case": _ref(prior) if prior else None,
        },
    }

    # The request is built before external statements exist, so enrichment never changes it.
    request = build_research_request(case, earlier)
    case["research"]["request"] = request
    case["research"]["request_hash"] = None if request is None else canonical_hash(request)

    external: list[dict] = []
    results: list[dict] = []
    for result_doc in snapshot.get("expected_research") or []:
        _check_research(result_doc, manifest)
        statements, entry = _external_statements(result_doc, ids)
        external.extend(statements)
        results.append(entry)
    expected = case["expected_behavior"]
    expected["statements"].extend(external)  # appended: tester statements are never replaced
    if tester_statements and external:
        expected["status"] = "combined"
    elif external:
        expected["status"] = "external_research"
    # Seed 000: historical research stays in the case as traceable input but is
    # never asserted current. Only a complete result for *this* request (same
    # hash) makes expectations sufficient, and never while the tester's own
    # expectations carry an explicit claim conflict (research cannot clear it).
    current = case["research"]["request_hash"]
    if not expected_conflicts and any(e["status"] == "complete" and e["request_hash"] == current for e in results):
        expected["sufficiency"] = "complete"
    case["research"]["results"] = results

    gaps = case["data_quality"]["gaps"]
    if index_ref is None:
        gaps.append(_gap("MISSING_INDEX"))
    if not reports:
        gaps.append(_gap("NO_REPORTS"))
    if not reproductions:
        gaps.append(_gap("NO_REPRODUCTIONS"))
    if not expected["statements"] and not tester_sources:
        gaps.append(_gap("NO_EXPECTED_BEHAVIOR"))
    for path in snapshot.get("superseded", []):
        gaps.append({**_gap("SUPERSEDED_INPUT"), "source": path})
    for path in ignored_attachments:
        gaps.append({**_gap("IGNORED_ATTACHMENTS"), "source": path})
    for path in _unnormalized_sources([*claimed["O"], *claimed["E"], *external], case["entities"]):
        gaps.append({**_gap("UNNORMALIZED_KEY"), "source": path})
    return case


def _nfc(text: str) -> str:
    """NFC of Unicode 14.0: the same gaps on every Python (imported here: most keys are ASCII)."""
    from .unicode14 import nfc

    return nfc(text)


def _unnormalized_sources(statements: list[dict], entities: list[dict]) -> list[str]:
    """Sources holding a claim key or entity type that differs from another
    only by Unicode normalisation (``café`` composed vs decomposed). Keys are
    compared code point for code point (nothing is normalised or merged:
    that would interpret supplied data), so such near-twins are shown as a gap
    instead of silently never meeting."""
    first_form: dict[tuple[str, str], str] = {}
    flagged: dict[str, None] = {}  # ordered, and a member test that does not scan
    normalized: dict[str, str] = {}  # each distinct text once: an entity's type repeats per source
    named = [("claim", s["claim"]["key"], s["provenance"]["source"]) for s in statements if s.get("claim")]
    named += [("entity", e["type"], src["source"]) for e in entities for src in e["sources"]]
    for kind, text, source in named:
        if text.isascii():
            form = text
        else:
            form = normalized.get(text)
            if form is None:
                form = normalized[text] = _nfc(text)
        seen = first_form.setdefault((kind, form), text)
        if seen != text:
            flagged.setdefault(source)
    return list(flagged)


class CaseAssembler:
    """Seed 001's name for the pure assembler: ``CaseAssembler.assemble(snapshot)``."""

    assemble = staticmethod(assemble)


def _gap(code: str) -> dict:
    return {"code": code, "message": GAP_CODES[code]}


# --------------------------------------------------------------------------- carried state

#: The case's record lists that an append only extends (a new document's
#: records come after every earlier one's, see :func:`assemble`); the records
#: of a carried assembly. Everything else in a case is derived whole.
APPENDED_LISTS: tuple[tuple[str, str], ...] = (
    ("bug", "titles"),
    ("bug", "summaries"),
    ("bug", "attachments"),
    ("human_observations", "observations"),
    ("human_observations", "comments"),
    ("human_observations", "tester_hypotheses"),
    ("expected_behavior", "declarations"),
    ("expected_behavior", "statements"),
    ("reproduction", "reproductions"),
    ("runtime_facts", "facts"),
)

_NOTHING_CARRIED: dict = {
    "next_floor": {},
    "reproductions": 0,
    "entities": [],
    "claims": {"O": [], "E": []},
    "declarations": [],
    "tester_sources": [],
    "titles": [],
    "summaries": [],
    "expectations": [],
    "referenced": [],
    "ignored_attachments": [],
}

_ID_LISTS = (
    ("O", "human_observations", "observations"),
    ("C", "human_observations", "comments"),
    ("T", "human_observations", "tester_hypotheses"),
    ("E", "expected_behavior", "statements"),
    ("F", "runtime_facts", "facts"),
)


def prior_numbering(prior_document: dict) -> tuple[dict[str, int], list[str]]:
    """What a prior case (or its view) gives ids: the number each namespace's
    new records start from, and the sources it holds records of. A carried
    assembly needs the prior case itself only when a new document is one of
    those sources; else these stand in for it."""
    floors: dict[str, int] = {}
    sources: set[str] = set()
    for ns, block, field in _ID_LISTS:
        for record in prior_document[block][field]:
            number = int(record["id"][1:]) + 1
            if number > floors.get(ns, 0):
                floors[ns] = number
            sources.add(record["provenance"]["source"])
    return floors, sorted(sources)


def _claim_statement(row: list) -> dict:
    rid, key, value, source, pointer = row
    return {"id": rid, "claim": {"key": key, "value": value}, "provenance": {"source": source, "pointer": pointer}}


def carry_forward(carried: dict | None, case: dict) -> dict:
    """What a later :func:`assemble` with ``carried`` needs of this build: the
    state ``carried`` described plus what ``case`` (assembled with it) added.

    Small next to the case: entities and declarations whole, claims as rows,
    the texts the research request repeats, the highest id numbers, the count
    of reproductions and the files they reference. Plain JSON-like values
    (the build keeps them as MessagePack). A case with research results has
    no carried state (``None``): its external statements are numbered after
    every tester statement, so it cannot be extended by appending.
    """
    if case["research"]["results"]:
        return None
    earlier = carried or _NOTHING_CARRIED
    floor = dict(earlier["next_floor"])
    for ns, block, field in _ID_LISTS:
        for record in case[block][field]:
            number = int(record["id"][1:]) + 1
            if number > floor.get(ns, 0):
                floor[ns] = number
    claims = {ns: list(earlier["claims"][ns]) for ns in ("O", "E")}
    for ns, statements in (("O", case["human_observations"]["observations"]), ("E", case["expected_behavior"]["statements"])):
        claims[ns] += [
            [s["id"], s["claim"]["key"], s["claim"]["value"], s["provenance"]["source"], s["provenance"]["pointer"]]
            for s in statements
            if "claim" in s
        ]
    tester = case["expected_behavior"]["statements"]
    # A set (kept sorted): the files the carried documents reference, whatever
    # order or how many times they were named in.
    referenced = set(earlier["referenced"])
    referenced.update(attachment["path"] for attachment in case["bug"]["attachments"])
    for record in case["reproduction"]["reproductions"]:
        if record["events_ref"] is not None:
            referenced.add(record["events_ref"]["path"])
        referenced.update(ref["path"] for ref in record["attachments"])
    return {
        "next_floor": floor,
        "reproductions": earlier["reproductions"] + len(case["reproduction"]["reproductions"]),
        "entities": case["entities"],
        "claims": claims,
        "declarations": [*earlier["declarations"], *case["expected_behavior"]["declarations"]],
        "tester_sources": [*earlier["tester_sources"], *(s["provenance"]["source"] for s in tester)],
        "titles": [*earlier["titles"], *(t["text"] for t in case["bug"]["titles"])],
        "summaries": [*earlier["summaries"], *(t["text"] for t in case["bug"]["summaries"])],
        "expectations": [*earlier["expectations"], *([s["id"], s["text"]] for s in tester)],
        "referenced": sorted(referenced),
        "ignored_attachments": [g["source"] for g in case["data_quality"]["gaps"] if g["code"] == "IGNORED_ATTACHMENTS"],
    }

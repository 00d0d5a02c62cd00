"""The bounded, versioned research request derived from a case (seed 000).

:func:`build_research_request` is pure. It returns ``None`` when the tester
declared the expected behaviour complete (the only sufficient declaration),
and otherwise a ``viano-research-request`` v1 document holding exactly:
identities (``case_id``, ``package_id``), ``analysis_revision``, the project
metadata, report titles/summaries (in report order), entity types/ids, the tester's expectations
(``E`` ids and text), the completeness that made research necessary, and the
scope ``intended_behavior``.

Deliberately absent: the package generation (enrichment publishes a new
generation, and the request must not change because of it), request hashes,
paths, observations, comments, hypotheses, facts and every local source,
database or runtime payload or reference. External sources establish intended
behaviour only, never the state of the local implementation. Report text stays
untrusted data; a provider enforces the intended-behaviour policy itself.

The request hash is ``jsoncanon.canonical_hash(request)``: the SHA-256 hex of
its canonical bytes, which is also exactly how ``request.json`` is stored.
"""

from __future__ import annotations

import copy

__all__ = ["REQUEST_FORMAT", "REQUEST_FORMAT_VERSION", "REQUEST_SCOPE", "build_research_request"]

REQUEST_FORMAT = "viano-research-request"
REQUEST_FORMAT_VERSION = 1
REQUEST_SCOPE = "intended_behavior"


def build_research_request(case_without_research: dict, earlier: dict | None = None) -> dict | None:
    """The research request for ``case_without_research``, or ``None`` if not needed.

    ``case_without_research`` is an assembled case whose expected behaviour
    holds tester statements only (external statements are ignored if present,
    so the request never depends on earlier research). ``earlier`` holds what
    records an append rebuild did not re-derive contribute (``titles``,
    ``summaries``: texts; ``expectations``: ``[id, text]`` pairs), in order
    before the case's own (:func:`pipeline.assemble.assemble` with ``carried``).
    """
    case = case_without_research
    expected = case["expected_behavior"]
    if expected["completeness"] == "reported_complete":
        return None
    identity = case["case"]
    earlier = earlier or {}
    return {
        "format": REQUEST_FORMAT,
        "format_version": REQUEST_FORMAT_VERSION,
        "case_id": identity["case_id"],
        "package_id": identity["package_id"],
        "analysis_revision": identity["analysis_revision"],
        "project": copy.deepcopy(identity["project"]),
        "scope": REQUEST_SCOPE,
        "completeness": expected["completeness"],
        "bug": {
            "titles": [*earlier.get("titles", ()), *(t["text"] for t in case["bug"]["titles"])],
            "summaries": [*earlier.get("summaries", ()), *(t["text"] for t in case["bug"]["summaries"])],
        },
        "entities": [{"type": e["type"], "id": e["id"]} for e in case["entities"]],
        "tester_expectations": [
            *({"id": rid, "text": text} for rid, text in earlier.get("expectations", ())),
            *({"id": s["id"], "text": s["text"]} for s in expected["statements"] if s.get("origin", "tester") == "tester"),
        ],
    }

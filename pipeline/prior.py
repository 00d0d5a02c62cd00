"""What a build reads of the prior case: its *view*.

A reopened revision's build needs two things from the prior case: the input
inventory it inherits (:func:`pipeline.plan.plan_from_manifests`, with the
reports whose attachments it listed) and the ids it keeps
(:class:`pipeline.assemble._Ids`). Both read a few megabytes'
document for a few hundred kilobytes of it, once when planning and once when
assembling, on every rebuild of the revision. The view is exactly those
fields, with every shape the consumers check left as it is (a non-object
block, a missing key), so they reach the same result or raise the same error
on the view as on the whole document; a property test holds them together.

The view is a pure function of the published bytes, so the cache keeps it
under their sha256 like any other derived record.
"""

from __future__ import annotations

from typing import Any

__all__ = ["prior_case_view"]

# Top-level fields taken whole: the format checks and the inherited inventory.
_WHOLE = ("format", "format_version", "builder_version", "inputs", "database_context", "source_context")

# Blocks taken in part: (block, fields taken whole, lists of id-bearing records).
_PARTS = (
    # Which reports' attachments the prior case listed (planning: a report it
    # took in whose attachments it did not list keeps them ignored).
    ("bug", (), ("attachments",)),
    ("human_observations", (), ("observations", "comments", "tester_hypotheses")),
    ("expected_behavior", (), ("statements",)),
    ("runtime_facts", ("context",), ("facts",)),
    ("research", ("supplied",), ()),
)


def prior_case_view(document: Any) -> Any:
    """The fields of a prior case that planning and id assignment read."""
    if not isinstance(document, dict):
        return document
    view = {key: document[key] for key in _WHOLE if key in document}
    for block, whole, id_lists in _PARTS:
        if block not in document:
            continue
        value = document[block]
        if not isinstance(value, dict):
            view[block] = value
            continue
        part = {key: value[key] for key in whole if key in value}
        for name in id_lists:
            if name in value:
                records = value[name]
                part[name] = [_id_part(record) for record in records] if isinstance(records, list) else records
        view[block] = part
    return view


def _id_part(record: Any) -> Any:
    """What an id-bearing record contributes: its id and where it came from."""
    if not isinstance(record, dict):
        return record
    part = {"id": record["id"]} if "id" in record else {}
    if "provenance" in record:
        provenance = record["provenance"]
        part["provenance"] = (
            {key: provenance[key] for key in ("source", "pointer") if key in provenance}
            if isinstance(provenance, dict)
            else provenance
        )
    return part

"""The build's check of the case against its contract, record by record.

msgspec checks a list of records one record at a time, against the list's
record Struct, and no constraint of the case relates two records of these
lists (nor a record to anything outside it). So the check of a whole case is
the check of its *shell* (the case with its long record lists emptied) plus
one check per record. A rebuild after an append meets again nearly every
record the previous build checked: records are remembered by their exact
encoding, and a remembered record is not converted again. That was most of
the check's ~11 ms in an append rebuild of a case at the default limits.

Pure: the remembered keys come in and go out as values; the build keeps them
in its cache (:func:`pipeline.build._check_case_contract`), under the builder
code and the msgspec version that checked them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from contracts import case_structs as cs

__all__ = ["RECORD_LISTS", "check_case", "record_key"]

# (block, field, record Struct): the case's lists that grow with its inputs.
RECORD_LISTS: tuple[tuple[str, str, type], ...] = (
    ("bug", "titles", cs.Text),
    ("bug", "summaries", cs.Text),
    ("bug", "attachments", cs.Attachment),
    ("human_observations", "observations", cs.Observation),
    ("human_observations", "comments", cs.Comment),
    ("human_observations", "tester_hypotheses", cs.TesterHypothesis),
    ("expected_behavior", "statements", cs.ExpectedStatement),
    ("reproduction", "reproductions", cs.Reproduction),
    ("runtime_facts", "facts", cs.Fact),
    ("data_quality", "claim_conflicts", cs.ClaimConflict),
    ("inputs", "reports", cs.Ref),
    ("inputs", "reproductions", cs.Ref),
    ("inputs", "unclassified", cs.Ref),
)

_encode = msgspec.json.Encoder(order="sorted").encode


def record_key(kind: type, record: Any) -> bytes | None:
    """What a record is remembered by: its Struct's name and its JSON
    encoding with sorted keys. For values as JSON decoding makes them (what
    a build's case holds) equal keys are equal records; beyond JSON they
    need not be (NaN encodes as null, a tuple as a list), so the keys are
    for cases made of decoded JSON only. None when a record has no encoding
    (a lone surrogate): such a record is always checked."""
    try:
        return _encode((kind.__name__, record))
    except (TypeError, ValueError, OverflowError):  # UnicodeEncodeError is a ValueError
        return None


def check_case(case: Any, known: set[bytes] | frozenset[bytes]) -> set[bytes]:
    """Check ``case`` against case-v1 (:class:`contracts.case_structs.Case`),
    converting only records whose key is not in ``known``; raise
    ``msgspec.ValidationError`` exactly when the whole case would fail.

    Returns the keys of every record of the case: what the next check can
    take as known. A case whose blocks are not where the shell expects them
    is checked whole (it fails; the keys are never used).
    """
    if type(case) is not dict:
        msgspec.convert(case, cs.Case)
        return set()
    shell = dict(case)
    pending: dict[type, list] = {}
    keys: set[bytes] = set()
    for block, field, kind in RECORD_LISTS:
        part = case.get(block)
        records = part.get(field) if type(part) is dict else None
        if type(records) is not list:
            msgspec.convert(case, cs.Case)
            return set()
        if shell[block] is part:
            shell[block] = dict(part)
        shell[block][field] = []
        for record in records:
            key = record_key(kind, record)
            if key is None or key not in known:
                pending.setdefault(kind, []).append(record)
            if key is not None:
                keys.add(key)
    msgspec.convert(shell, cs.Case)
    for kind, records in pending.items():
        msgspec.convert(records, list[kind])
    return keys

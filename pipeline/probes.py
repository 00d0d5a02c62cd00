"""Bounded probe candidates for unresolved outcomes (ARCHITECTURE.md section 9).

An *unresolved outcome* is ``{id, original_prompt, failure_summary,
evidence_artifact_ref}``, all non-blank strings. From it,
:func:`build_additional_cases` derives exactly two candidate cases:

``<id>:reproduce``
    the original prompt, stripped -- does the outcome reproduce as is?
``<id>:address-failure``
    the original prompt, a blank line, then ``Address this observed
    unresolved condition without assuming it is true: <failure summary>`` --
    the condition is stated as an observation to examine, never as a fact.

Candidates are plain dicts ``{case_id, prompt, evidence_artifact_ref,
verification}``. They are *returned only*: nothing here writes, schedules or
activates them. ``verification`` is always present and always ``None``: a
candidate carries no verification spec, and someone must supply one (and the
independent verifier must support it) before any quality can be claimed.

Bounds: the original prompt is cut at :data:`ORIGINAL_PROMPT_LIMIT` and the
failure summary at :data:`FAILURE_SUMMARY_LIMIT` characters (after
stripping), each cut marked in the text itself (``[truncated: N characters in
all]``), so every candidate prompt is at most :data:`MAX_PROMPT_CHARS`
characters and a cut is never silent. The cut is deterministic.

:func:`unresolved_from_case` turns a built case (case.json) into such an
outcome when the case is not resolved, and :func:`probes_command_output` is
what ``doit probes case=ID`` prints.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from .errors import VerificationError, one_line

__all__ = [
    "ORIGINAL_PROMPT_LIMIT",
    "FAILURE_SUMMARY_LIMIT",
    "MAX_PROMPT_CHARS",
    "ADDRESS_FAILURE_LEAD",
    "UNRESOLVED_FIELDS",
    "build_additional_cases",
    "unresolved_from_case",
    "probes_command_output",
]

ORIGINAL_PROMPT_LIMIT = 4000
FAILURE_SUMMARY_LIMIT = 3500
ADDRESS_FAILURE_LEAD = "Address this observed unresolved condition without assuming it is true: "
#: Upper bound of any candidate prompt: prompt + blank line + lead + summary.
MAX_PROMPT_CHARS = ORIGINAL_PROMPT_LIMIT + 2 + len(ADDRESS_FAILURE_LEAD) + FAILURE_SUMMARY_LIMIT
UNRESOLVED_FIELDS = ("id", "original_prompt", "failure_summary", "evidence_artifact_ref")
_TITLE_LIMIT = 300
_SHA256_RE = re.compile(r"^[0-9a-f]{64}(?![\s\S])")
_RECORD_ID_RE = re.compile(r"^([A-Z])([0-9]{1,30})(?![\s\S])")
_ID_LIMIT = 40


def _bounded(text: str, limit: int) -> str:
    """``text`` if it fits, else a prefix plus a marker, exactly ``limit`` characters in all."""
    if len(text) <= limit:
        return text
    marker = f" [truncated: {len(text)} characters in all]"
    return text[: limit - len(marker)] + marker


def _invalid(message: str, field: str | None = None) -> VerificationError:
    return VerificationError("INVALID_UNRESOLVED_EVIDENCE", message, pointer=None if field is None else "/" + field)


def build_additional_cases(unresolved: Mapping[str, Any]) -> list[dict]:
    """Exactly two bounded, inactive probe candidates from one unresolved outcome.

    Fails closed with ``INVALID_UNRESOLVED_EVIDENCE`` when ``unresolved`` is not
    a mapping, holds a field other than :data:`UNRESOLVED_FIELDS`, or any of
    those is missing, not a string, or blank (empty or whitespace only).
    ``id`` and ``evidence_artifact_ref`` are carried unchanged; the prompt
    and the summary are stripped and bounded.
    """
    if not isinstance(unresolved, Mapping):
        raise _invalid("unresolved evidence must be an object")
    unknown = sorted(str(k) for k in unresolved if k not in UNRESOLVED_FIELDS)
    if unknown:
        raise _invalid("unknown field " + ", ".join(repr(one_line(k, 60)) for k in unknown[:5]))
    for field in UNRESOLVED_FIELDS:
        value = unresolved.get(field)
        if not isinstance(value, str):
            raise _invalid(f"{field} is missing or not a string", field)
        if not value.strip():
            raise _invalid(f"{field} is blank", field)
    outcome_id = unresolved["id"]
    ref = unresolved["evidence_artifact_ref"]
    prompt = _bounded(unresolved["original_prompt"].strip(), ORIGINAL_PROMPT_LIMIT)
    summary = _bounded(unresolved["failure_summary"].strip(), FAILURE_SUMMARY_LIMIT)
    return [
        {
            "case_id": f"{outcome_id}:reproduce",
            "prompt": prompt,
            "evidence_artifact_ref": ref,
            "verification": None,
        },
        {
            "case_id": f"{outcome_id}:address-failure",
            "prompt": f"{prompt}\n\n{ADDRESS_FAILURE_LEAD}{summary}",
            "evidence_artifact_ref": ref,
            "verification": None,
        },
    ]


def _block(case: Mapping, name: str) -> Mapping:
    value = case.get(name)
    return value if isinstance(value, Mapping) else {}


def _texts(statements: Any) -> list[str]:
    if not isinstance(statements, list):
        return []
    return [s["text"] for s in statements if isinstance(s, Mapping) and isinstance(s.get("text"), str) and s["text"].strip()]


def _original_prompt(case_id: str, titles: list[str]) -> str:
    """Deterministic prompt: the case id, then each reported title on its own line, in case order.

    Titles are folded onto one line each (control characters escaped, at most
    300 characters) so a title cannot add structure to the prompt.
    """
    head = f"Analyse bug case {case_id} from its canonical case record."
    if not titles:
        return head + " No title was reported."
    lines = [head, "Reported titles:"]
    lines += [f"- {one_line(title.strip(), _TITLE_LIMIT)}" for title in titles]
    return "\n".join(lines)


def _record_id_order(record_id: str) -> tuple:
    """Natural order of record ids: ``O0002`` < ``O0010`` < ``O10000``; anything else after, by text."""
    match = _RECORD_ID_RE.match(record_id)
    if match:
        return (0, match.group(1), int(match.group(2)), record_id)
    return (1, "", 0, record_id)


def _shown_id(record_id: str) -> str:
    """One record id for the ``ids=`` list: one line, bounded, and unable to forge a list separator."""
    return one_line(record_id, _ID_LIMIT).replace(",", "\\x2c").replace(" ", "\\x20").replace(";", "\\x3b")


def _quoted(text: str, limit: int) -> str:
    """A supplied string (claim key, content path) as a JSON string literal, so
    it cannot forge further ``; ...`` entries of the summary. Folded onto one
    printable line first, then quoted: quoting first and folding after
    doubled the backslash before an escaped quote, which then closed the
    literal early (``a\\"; gap ...``)."""
    import json

    return json.dumps(one_line(text[:limit], limit + 64), ensure_ascii=False)


def _conflict_ids(conflict: Mapping) -> set[str]:
    values = conflict.get("values")
    if not isinstance(values, list):
        return set()
    return {v["id"] for v in values if isinstance(v, Mapping) and isinstance(v.get("id"), str) and v["id"].strip()}


def _reasons(case: Mapping) -> list[str]:
    """What keeps the case unresolved, named by code and record id or source, in a fixed order.

    Order: expected-behaviour completeness, then claim conflicts sorted by
    (block, key), each naming the record ids of every conflicting value
    (``claim_conflict human_observations key="switch.state" ids=O0001,O0003``;
    ids in natural order, each once; ``ids=none`` if the case lists none),
    then data-quality gaps sorted by (code, source); identical entries are
    named once. Messages, values and hypotheses are never quoted: the summary
    names conditions, it does not interpret them.
    """
    reasons: list[str] = []
    completeness = _block(case, "expected_behavior").get("completeness")
    if completeness != "reported_complete":
        shown = completeness if isinstance(completeness, str) else "absent"
        reasons.append(f"expected_behavior.completeness={one_line(shown, 60)}")
    quality = _block(case, "data_quality")
    conflicts = quality.get("claim_conflicts") if isinstance(quality.get("claim_conflicts"), list) else []
    named: dict[tuple[str, str], set[str]] = {}
    for c in conflicts:
        if isinstance(c, Mapping):
            ids = named.setdefault((str(c.get("block", "")), str(c.get("key", ""))), set())
            ids |= _conflict_ids(c)
    for (block, key), ids in sorted(named.items()):
        shown_ids = ",".join(_shown_id(i) for i in sorted(ids, key=_record_id_order)) or "none"
        reasons.append(f"claim_conflict {one_line(block, 80)} key={_quoted(key, 120)} ids={shown_ids}")
    gaps = quality.get("gaps") if isinstance(quality.get("gaps"), list) else []
    gap_names = sorted(
        {
            (str(g.get("code", "")), str(g["source"]) if isinstance(g.get("source"), str) else "")
            for g in gaps
            if isinstance(g, Mapping)
        }
    )
    for code, source in gap_names:
        reasons.append(f"gap {one_line(code, 80)}" + (f" source={_quoted(source, 200)}" if source else ""))
    return reasons


def unresolved_from_case(case: Mapping, *, case_path: str, case_sha256: str) -> dict | None:
    """The unresolved outcome of a built case, or ``None`` when nothing is unresolved.

    A case is unresolved when ``expected_behavior.completeness`` is not
    ``reported_complete``, or ``data_quality`` lists claim conflicts or gaps.
    The outcome is ``{id: case id, original_prompt, failure_summary,
    evidence_artifact_ref: "<case_path>@sha256:<case_sha256>"}`` with the
    reasons joined by ``"; "`` (see :func:`_reasons`). ``case_sha256`` must
    be 64 lower-case hex digits and ``case_path`` non-blank
    (``INVALID_ARGUMENT``); a case without ``case.case_id`` is
    ``INVALID_UNRESOLVED_EVIDENCE``.
    """
    if not isinstance(case_path, str) or not case_path.strip():
        raise VerificationError("INVALID_ARGUMENT", "case_path is blank")
    if not isinstance(case_sha256, str) or not _SHA256_RE.match(case_sha256):
        raise VerificationError("INVALID_ARGUMENT", "case_sha256 must be 64 lower-case hex digits")
    if not isinstance(case, Mapping):
        raise _invalid("the case must be an object")
    case_id = _block(case, "case").get("case_id")
    if not isinstance(case_id, str) or not case_id.strip():
        raise _invalid("the case has no case.case_id", "case/case_id")
    reasons = _reasons(case)
    if not reasons:
        return None
    return {
        "id": case_id,
        "original_prompt": _original_prompt(case_id, _texts(_block(case, "bug").get("titles"))),
        "failure_summary": "; ".join(reasons),
        "evidence_artifact_ref": f"{case_path}@sha256:{case_sha256}",
    }


def probes_command_output(case: Mapping, case_path: str, case_sha256: str) -> tuple[str, int]:
    """What ``doit probes case=ID`` prints, and its exit status (0 on success).

    With something unresolved: pretty JSON (sorted keys, two-space indent,
    trailing newline) ``{"candidates": [two candidates], "unresolved": {...}}``.
    Otherwise one line: ``case <id>: nothing unresolved; no probe candidates``.
    Errors propagate as :class:`VerificationError` for the caller to report.
    """
    unresolved = unresolved_from_case(case, case_path=case_path, case_sha256=case_sha256)
    if unresolved is None:
        case_id = _block(case, "case").get("case_id")
        return f"case {one_line(str(case_id), 140)}: nothing unresolved; no probe candidates\n", 0
    document = {"candidates": build_additional_cases(unresolved), "unresolved": unresolved}
    return json.dumps(document, sort_keys=True, indent=2, ensure_ascii=False) + "\n", 0

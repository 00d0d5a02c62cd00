"""Operational limits of the case builder (seed 001, ARCHITECTURE.md section 10).

These are policy, not format: changing a default never rewrites a case that
was already confirmed, because a confirmed case is reused by its request hash
and its bytes are never regenerated in place.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CaseBuilderLimits", "MiB", "KiB"]

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True, kw_only=True)
class CaseBuilderLimits:
    """Bounds checked from manifest sizes before any structured input is parsed."""

    document_bytes: int = 1 * MiB  #: one index, report or reproduction
    aggregate_bytes: int = 8 * MiB  #: all structured input JSON of one build
    documents: int = 256  #: structured input documents of one build
    case_bytes: int = 8 * MiB  #: a prior or the new canonical case.json
    summary_bytes: int = 8 * MiB  #: the rendered case_summary.md
    inline_fact_value: int = 16 * KiB  #: canonical JSON size above which a fact uses value_ref

    def __post_init__(self) -> None:
        # Refused when made, not midway through a build (a str compared
        # with a size there was a TypeError).
        from .errors import CaseBuildError

        for name, value in self.to_dict().items():
            if type(value) is not int or value < 1:
                raise CaseBuildError("INVALID_ARGUMENT", f"CaseBuilderLimits.{name} must be a positive int, not {value!r}"[:300])

    def to_dict(self) -> dict:
        return {
            "document_bytes": self.document_bytes,
            "aggregate_bytes": self.aggregate_bytes,
            "documents": self.documents,
            "case_bytes": self.case_bytes,
            "summary_bytes": self.summary_bytes,
            "inline_fact_value": self.inline_fact_value,
        }

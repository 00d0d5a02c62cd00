"""msgspec Structs mirroring the verification request/response schemas.

The JSON Schemas (``verification-request-v1.schema.json`` and
``verification-response-v1.schema.json``) are the contract; these Structs are
the typed form the verifier works with after validation. Type-level rules
(required fields, unknown fields, non-blank strings, integer bounds, the mode
enum) live in both places; the cross-field rules (field_path versus mode,
pointer syntax) are in the schema and in
``pipeline.verifier._cross_field_problem``. The verifier accepts a request on
this Struct path alone and consults the schema only to name the first error,
so ``tests/test_verifier.py`` holds parity tests (listed and generated
documents) proving both take the same decisions.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = [
    "EXACT_TEXT",
    "JSON_FIELD_EQUALS",
    "MODES",
    "SUPPORTED",
    "UNSUPPORTED",
    "Verification",
    "VerificationRequest",
    "VerificationResponse",
]

EXACT_TEXT = "EXACT_TEXT"
JSON_FIELD_EQUALS = "JSON_FIELD_EQUALS"
MODES = (EXACT_TEXT, JSON_FIELD_EQUALS)
SUPPORTED = "SUPPORTED"
UNSUPPORTED = "UNSUPPORTED"

_NonBlank = Annotated[str, msgspec.Meta(pattern=r"\S")]
_Millis = Annotated[int, msgspec.Meta(ge=0, le=1000)]
_Micros = Annotated[int, msgspec.Meta(ge=0, le=2**53 - 1)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base: unknown fields are errors, instances are immutable."""


class Verification(_Strict, kw_only=True):
    """The task-owned rubric: how to compare the response with the expected text.

    ``field_path`` defaults to ``""`` (absent) and is meaningful only for
    ``JSON_FIELD_EQUALS``, where it is a top-level key or, when it starts with
    ``/``, an RFC 6901 pointer.
    """

    mode: Literal["EXACT_TEXT", "JSON_FIELD_EQUALS"]
    field_path: str = ""
    expected_text: _NonBlank
    minimum_quality_millis: _Millis


class VerificationRequest(_Strict, kw_only=True):
    """One verification: a task response and the spec it must satisfy."""

    case_id: _NonBlank
    response_text: _NonBlank
    evidence_artifact_ref: _NonBlank
    latency_micros: _Micros
    verification: Verification


class VerificationResponse(_Strict, kw_only=True):
    """The verifier's answer; ``evidence`` is ``verification:<sha256 hex>``."""

    result: Literal["SUPPORTED", "UNSUPPORTED"]
    quality_score_millis: _Millis
    evidence: Annotated[str, msgspec.Meta(pattern=r"^verification:[0-9a-f]{64}(?![\s\S])")]

"""msgspec Structs mirroring the input contracts in this package.

The JSON Schemas are the contracts of record; these Structs restate them so
the reader can check a document at C speed (``pipeline/reader.py``). A parity
test (``tests/test_contracts.py``) holds the two together: over documents that
:func:`pipeline.jsoncanon.decode_strict` can produce, a Struct accepts exactly
what its schema accepts.

How each schema rule is restated:

* ``additionalProperties: false`` -> ``forbid_unknown_fields=True`` on
  :class:`Base`; the top-level report and reproduction turn it off, because
  their unknown top-level fields are extensions (ARCHITECTURE.md section 12).
* optional members default to :data:`msgspec.UNSET`, so an explicit ``null``
  is refused exactly as the schema's ``type`` refuses it.
* a nonblank string is ``min_length=1`` plus the pattern ``\\S``; both sides
  run Python's ``re.search``, so they agree on what whitespace is.
* an anchored pattern ends in ``(?![\\s\\S])``, not ``$``: end of input in
  ECMA-262 (the schemas' dialect) and in Python's ``re`` alike, whose ``$``
  would also match before a final newline (``\\Z`` is not ECMA-262).
* ``integer`` is a JSON integer: msgspec refuses ``1.0`` and ``true`` for
  ``int`` just as the contracts' validator does.
* ``date-time`` is checked in ``__post_init__`` with the very function the
  schemas' format checker calls (:func:`contracts.date_time.is_date_time`)
  instead of msgspec's ``datetime``, whose parser accepts naive times and
  differs on details.
* "any JSON" (a claim's or fact's ``value``) is :data:`typing.Any`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from contracts.date_time import is_date_time

__all__ = [
    "MAX_SAFE_INTEGER",
    "Base",
    "Claim",
    "Statement",
    "Entity",
    "BugReport",
    "Fact",
    "Reproduction",
    "CaseContext",
    "CaseInputs",
    "Project",
    "SourceArtifacts",
    "SourceFile",
    "PackageSource",
    "FileRecord",
    "ManifestArtifacts",
    "PackageManifest",
    "RequestBug",
    "RequestEntity",
    "TesterExpectation",
    "ResearchRequest",
    "Provider",
    "ResearchStatement",
    "ResearchSource",
    "ResearchResult",
    "CaseBuilderLimitSettings",
    "AdmissionLimitSettings",
    "WorkspaceLimits",
    "STRUCTS",
    "is_date_time",
]

MAX_SAFE_INTEGER = 2**53 - 1

Nonblank = Annotated[str, Meta(min_length=1, pattern=r"\S")]
NonEmpty = Annotated[str, Meta(min_length=1)]
SafeInt = Annotated[int, Meta(ge=-MAX_SAFE_INTEGER, le=MAX_SAFE_INTEGER)]
Positive = Annotated[int, Meta(ge=1, le=MAX_SAFE_INTEGER)]
Size = Annotated[int, Meta(ge=0, le=MAX_SAFE_INTEGER)]
Sha256 = Annotated[str, Meta(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}(?![\s\S])")]
Paths = tuple[NonEmpty, ...]


class Base(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options fixed once for every contract Struct: strict, immutable, by keyword."""


# -- bug report (urn:viano:report-v1) -----------------------------------


class Claim(Base):
    """A structured claim: a key and any JSON value (conflicts are keyed on it)."""

    key: Nonblank
    value: Any


class Statement(Base):
    """A human statement: nonblank text, optional author, time and claim."""

    text: Nonblank
    author: Nonblank | UnsetType = UNSET
    observed_at: str | UnsetType = UNSET
    claim: Claim | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.observed_at is not UNSET and not is_date_time(self.observed_at):
            raise ValueError("observed_at is not a timezone-aware RFC 3339 date-time")


class Entity(Base):
    """An entity named by the producer: explicit type, string or integer id."""

    type: Nonblank
    id: NonEmpty | SafeInt
    roles: tuple[Nonblank, ...] | UnsetType = UNSET


class BugReport(Base, forbid_unknown_fields=False):
    """``viano-bug-report`` v1; unknown top-level fields are ignored extensions."""

    format: Literal["viano-bug-report"]
    format_version: Literal[1]
    title: Nonblank | UnsetType = UNSET
    summary: Nonblank | UnsetType = UNSET
    observations: tuple[Statement, ...] | UnsetType = UNSET
    comments: tuple[Statement, ...] | UnsetType = UNSET
    tester_hypotheses: tuple[Statement, ...] | UnsetType = UNSET
    expected_behavior: tuple[Statement, ...] | UnsetType = UNSET
    expected_behavior_complete: bool | UnsetType = UNSET
    entities: tuple[Entity, ...] | UnsetType = UNSET
    attachments: Paths | UnsetType = UNSET


# -- reproduction (urn:viano:reproduction-v1) --------------------------------


class Fact(Base):
    """A supplied fact: a name and any JSON value (never independently verified)."""

    name: Nonblank
    value: Any


class Reproduction(Base, forbid_unknown_fields=False):
    """``viano-reproduction`` v1; unknown top-level fields are ignored extensions."""

    format: Literal["viano-reproduction"]
    format_version: Literal[1]
    steps: tuple[Nonblank, ...] | UnsetType = UNSET
    observations: tuple[Statement, ...] | UnsetType = UNSET
    events_ref: NonEmpty | UnsetType = UNSET
    attachments: Paths | UnsetType = UNSET
    facts: tuple[Fact, ...] | UnsetType = UNSET
    entities: tuple[Entity, ...] | UnsetType = UNSET


# -- case-inputs index (urn:viano:case-inputs-v1) ----------------------------


class CaseContext(Base):
    """Opaque context roles; every file stays an opaque reference."""

    runtime: Paths | UnsetType = UNSET
    database: Paths | UnsetType = UNSET
    source: Paths | UnsetType = UNSET
    research: Paths | UnsetType = UNSET


class CaseInputs(Base):
    """``viano-case-inputs`` v1: the explicit role index (absent role = empty)."""

    format: Literal["viano-case-inputs"]
    format_version: Literal[1]
    reports: Paths | UnsetType = UNSET
    reproductions: Paths | UnsetType = UNSET
    context: CaseContext | UnsetType = UNSET
    attachments: Paths | UnsetType = UNSET
    expected_research: Paths | UnsetType = UNSET


# -- package source manifest (urn:viano:package-source-v1) -------------------


class Project(Base):
    """The project a package belongs to; identity comes only from manifests."""

    name: Nonblank
    version: Nonblank
    repository: Nonblank | UnsetType = UNSET
    revision: Nonblank | UnsetType = UNSET


class SourceArtifacts(Base):
    """Artifact pointers a package source may declare."""

    case_inputs: NonEmpty | UnsetType = UNSET


class SourceFile(Base):
    """A listed content file, optionally pinned by hash and size."""

    path: NonEmpty
    sha256: Sha256 | UnsetType = UNSET
    size: Size | UnsetType = UNSET


class PackageSource(Base):
    """``manifest.json`` at the root of an admitted package."""

    format: Literal["viano-package"]
    format_version: Literal[1]
    package_id: NonEmpty
    project: Project
    analysis_revision: Positive
    artifacts: SourceArtifacts | UnsetType = UNSET
    files: tuple[NonEmpty | SourceFile, ...] | UnsetType = UNSET


# -- stored manifest (urn:viano:package-manifest-v1) -------------------------


class FileRecord(Base):
    """A content file's hash and size in the stored inventory."""

    sha256: Sha256
    size: Size


class ManifestArtifacts(Base):
    """Pointers to the current index, case and summary of a package."""

    case_inputs: NonEmpty | UnsetType = UNSET
    case: NonEmpty | UnsetType = UNSET
    case_summary: NonEmpty | UnsetType = UNSET


class PackageManifest(Base):
    """``manifests/NNNNNN.json``: one immutable manifest per package generation."""

    format: Literal["viano-package"]
    format_version: Literal[1]
    case_id: NonEmpty
    package_id: NonEmpty
    package_generation: Positive
    analysis_revision: Positive
    project: Project
    artifacts: ManifestArtifacts
    files: dict[NonEmpty, FileRecord]


# -- research request (urn:viano:research-request-v1) ------------------------


class RequestBug(Base):
    """Report titles and summaries, verbatim."""

    titles: tuple[Nonblank, ...]
    summaries: tuple[Nonblank, ...]


class RequestEntity(Base):
    """An entity's type and (string) id; no content."""

    type: Nonblank
    id: NonEmpty


class TesterExpectation(Base):
    """A tester's expected-behaviour statement by its stable E id."""

    id: NonEmpty
    text: Nonblank


class ResearchRequest(Base):
    """``viano-research-request`` v1: what a provider is asked."""

    format: Literal["viano-research-request"]
    format_version: Literal[1]
    case_id: NonEmpty
    package_id: NonEmpty
    analysis_revision: Positive
    project: Project
    scope: Literal["intended_behavior"]
    completeness: Literal["missing", "unspecified", "reported_partial", "conflicting"]
    bug: RequestBug
    entities: tuple[RequestEntity, ...]
    tester_expectations: tuple[TesterExpectation, ...]


# -- research result (urn:viano:research-result-v1) --------------------------


class Provider(Base):
    """Who answered."""

    name: Nonblank
    version: Nonblank


class ResearchStatement(Base):
    """An intended-behaviour statement and the indices of its sources."""

    text: Nonblank
    citations: tuple[Size, ...]


class ResearchSource(Base):
    """A cited source as retrieved by the provider."""

    url: Nonblank
    title: Nonblank
    retrieved_at: str
    excerpt: Nonblank

    def __post_init__(self) -> None:
        if not is_date_time(self.retrieved_at):
            raise ValueError("retrieved_at is not a timezone-aware RFC 3339 date-time")


class ResearchResult(Base):
    """``viano-research-result`` v1: a provider's whole answer."""

    format: Literal["viano-research-result"]
    format_version: Literal[1]
    provider: Provider
    request_hash: Sha256
    scope: Literal["intended_behavior"]
    status: Literal["complete", "partial", "not_found"]
    statements: tuple[ResearchStatement, ...]
    sources: tuple[ResearchSource, ...]


# -- workspace limits (urn:viano:workspace-limits-v1) ------------------------


def _within(low: int, high: int):
    return Annotated[int, Meta(ge=low, le=high)]


class CaseBuilderLimitSettings(Base):
    """Raises of :class:`pipeline.limits.CaseBuilderLimits` (absent = default),
    from the default up to the ceiling the builder is built for."""

    document_bytes: _within(1 << 20, 2 << 20) | UnsetType = UNSET
    aggregate_bytes: _within(8 << 20, 64 << 20) | UnsetType = UNSET
    documents: _within(256, 4096) | UnsetType = UNSET
    case_bytes: _within(8 << 20, 64 << 20) | UnsetType = UNSET
    summary_bytes: _within(8 << 20, 64 << 20) | UnsetType = UNSET
    inline_fact_value: _within(16 << 10, 1 << 20) | UnsetType = UNSET


class AdmissionLimitSettings(Base):
    """Overrides of :class:`pipeline.zipscan.ZipLimits` (absent = default)."""

    max_entries: _within(1, 65536) | UnsetType = UNSET
    max_entry_bytes: Positive | UnsetType = UNSET
    max_total_bytes: Positive | UnsetType = UNSET
    max_ratio: Positive | UnsetType = UNSET
    ratio_min_bytes: Size | UnsetType = UNSET
    manifest_bytes: _within(1, 16 << 20) | UnsetType = UNSET
    check_free_disk: bool | UnsetType = UNSET
    free_disk_reserve: Size | UnsetType = UNSET


class WorkspaceLimits(Base):
    """``viano-workspace-limits`` v1: a workspace's ``limits.json``."""

    format: Literal["viano-workspace-limits"]
    format_version: Literal[1]
    case_builder: CaseBuilderLimitSettings | UnsetType = UNSET
    admission: AdmissionLimitSettings | UnsetType = UNSET


#: contract name -> the Struct mirroring it.
STRUCTS: dict[str, type[msgspec.Struct]] = {
    "report": BugReport,
    "reproduction": Reproduction,
    "case-inputs": CaseInputs,
    "package-source": PackageSource,
    "package-manifest": PackageManifest,
    "research-request": ResearchRequest,
    "research-result": ResearchResult,
    "workspace-limits": WorkspaceLimits,
}

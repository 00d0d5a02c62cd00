"""msgspec Structs mirroring ``case-v1.schema.json`` (the canonical case document).

Decoding a case with :data:`CASE_DECODER` gives typed, immutable access to it
and refuses unknown fields exactly as the schema's ``additionalProperties:
false`` does. The JSON Schema stays the contract of record; a parity test
keeps the two in step. ``date-time`` fields are checked in ``__post_init__``
with the input Structs' test (:func:`contracts.date_time.is_date_time`). Optional fields
default to ``msgspec.UNSET`` so re-encoding omits them rather than writing
``null``: a fact's ``value`` may legitimately be ``null``, which is not the
same as an absent value that is replaced by ``value_ref``.
"""

# No ``from __future__ import annotations``: msgspec would evaluate every
# annotation string with ``compile`` at class creation, which cost each build
# that checks a case ~2 ms of import; the classes are defined bottom-up, so
# no annotation needs deferring.
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from contracts.date_time import is_date_time

__all__ = [
    "CASE_FORMAT",
    "CASE_FORMAT_VERSION",
    "CASE_DECODER",
    "Base",
    "Ref",
    "Provenance",
    "SourcePointer",
    "Text",
    "Claim",
    "Observation",
    "Comment",
    "TesterHypothesis",
    "Citation",
    "ExpectedStatement",
    "Declaration",
    "ExpectedBehavior",
    "Step",
    "Reproduction",
    "ReproductionBlock",
    "EntitySource",
    "Entity",
    "Fact",
    "RuntimeFacts",
    "Provider",
    "ResearchResult",
    "Research",
    "Gap",
    "ConflictValue",
    "ClaimConflict",
    "DataQuality",
    "Inputs",
    "Project",
    "CaseIdentity",
    "Attachment",
    "Bug",
    "HumanObservations",
    "Case",
    "decode_case",
]

CASE_FORMAT = "viano-case"
CASE_FORMAT_VERSION = 1

#: End of input in both ECMA-262 (the schemas' regex dialect) and Python ``re``
#: (which msgspec and jsonschema run): ``$`` would also match before a final
#: newline in Python, so ``"O0001\n"`` would pass; ``\Z`` is not ECMA-262.
_END = r"(?![\s\S])"

Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}(?![\s\S])")]
ContentPath = Annotated[str, Meta(min_length=1)]
Pointer = Annotated[str, Meta(pattern=r"^(/([^~/]|~[01])*)+(?![\s\S])")]
NonBlank = Annotated[str, Meta(pattern=r"\S")]
Size = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]


def _id(letter: str) -> Any:
    return Annotated[str, Meta(pattern=f"^{letter}[0-9]{{4,}}" + _END)]


ObservationId = _id("O")
CommentId = _id("C")
HypothesisId = _id("T")
ExpectedId = _id("E")
FactId = _id("F")
ReproductionId = _id("R")
ConflictId = _id("[OE]")


class Base(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options fixed once for every case Struct: strict, immutable, keyword-only.

    msgspec applies ``kw_only`` to the fields a class itself defines, so every
    subclass repeats ``kw_only=True``; the other options are inherited.
    """


class Ref(Base, kw_only=True):
    """An opaque content reference: a package path with its hash and size."""

    path: ContentPath
    sha256: Sha256
    size: Size


class Provenance(Base, kw_only=True):
    """Where a record came from: kind, content path and RFC 6901 pointer."""

    kind: Literal["tester_report", "reproduction", "external_research"]
    source: ContentPath
    pointer: Pointer


class SourcePointer(Base, kw_only=True):
    """A place in a source document (entity sources, fact ``value_ref``)."""

    source: ContentPath
    pointer: Pointer


class Text(Base, kw_only=True):
    """A report title or summary; the pointer names the string itself."""

    text: str
    provenance: Provenance


class Claim(Base, kw_only=True):
    """An explicit structured claim supplied with a statement."""

    key: str
    value: Any


class _Statement(Base, kw_only=True):
    text: NonBlank
    provenance: Provenance
    author: str | UnsetType = UNSET
    observed_at: str | UnsetType = UNSET
    claim: Claim | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.observed_at is not UNSET and not is_date_time(self.observed_at):
            raise ValueError("observed_at is not a timezone-aware RFC 3339 date-time")


class Observation(_Statement, kw_only=True):
    """A human observation from a report or a reproduction."""

    id: ObservationId


class Comment(_Statement, kw_only=True):
    """A report comment; never used for claims or facts."""

    id: CommentId


class TesterHypothesis(_Statement, kw_only=True):
    """A tester hypothesis; supplied data, never promoted to a fact."""

    id: HypothesisId


class Citation(Base, kw_only=True):
    """One external source cited by a research statement."""

    url: Annotated[str, Meta(min_length=1)]
    title: str
    retrieved_at: str
    excerpt: str

    def __post_init__(self) -> None:
        if not is_date_time(self.retrieved_at):
            raise ValueError("retrieved_at is not a timezone-aware RFC 3339 date-time")


class ExpectedStatement(_Statement, kw_only=True):
    """An expected-behaviour statement, by the tester or from external research."""

    id: ExpectedId
    origin: Literal["tester", "external_research"]
    citations: list[Citation] | UnsetType = UNSET


class Declaration(Base, kw_only=True):
    """An explicit ``expected_behavior_complete`` declaration of one report."""

    value: bool
    source: ContentPath
    pointer: Pointer


class ExpectedBehavior(Base, kw_only=True):
    """Expected behaviour: completeness, declarations, statements, status, sufficiency."""

    completeness: Literal["missing", "unspecified", "reported_complete", "reported_partial", "conflicting"]
    declarations: list[Declaration]
    statements: list[ExpectedStatement]
    status: Literal["tester", "external_research", "combined"] | None
    sufficiency: Literal["complete", "partial"]


class Step(Base, kw_only=True):
    """A reproduction step and its pointer."""

    text: str
    pointer: Pointer


class Reproduction(Base, kw_only=True):
    """One reproduction document: steps, its observation/fact ids, opaque references."""

    id: ReproductionId
    source: ContentPath
    steps: list[Step]
    observation_ids: list[ObservationId]
    fact_ids: list[FactId]
    events_ref: Ref | None
    attachments: list[Ref]


class ReproductionBlock(Base, kw_only=True):
    """The ``reproduction`` block."""

    reproductions: list[Reproduction]


class EntitySource(Base, kw_only=True):
    """Where an entity was declared: the document's provenance kind, path and pointer.

    ``kind`` is always written now; cases confirmed before it was added lack
    it and must still be reused as published, so the contract allows that."""

    source: ContentPath
    pointer: Pointer
    kind: Literal["tester_report", "reproduction"] | UnsetType = UNSET


class Entity(Base, kw_only=True):
    """An explicitly typed entity with string id, merged roles and every source."""

    type: str
    id: str
    roles: list[str]
    sources: Annotated[list[EntitySource], Meta(min_length=1)]


class Fact(Base, kw_only=True):
    """A supplied fact: exactly one of ``value`` and ``value_ref``."""

    id: FactId
    name: str
    provenance: Provenance
    value: Any | UnsetType = UNSET
    value_ref: SourcePointer | UnsetType = UNSET

    def __post_init__(self) -> None:
        if (self.value is UNSET) == (self.value_ref is UNSET):
            raise ValueError("a fact has exactly one of value and value_ref")


class RuntimeFacts(Base, kw_only=True):
    """Supplied facts plus the opaque runtime context references."""

    facts: list[Fact]
    context: list[Ref]


class Provider(Base, kw_only=True):
    """Research provider identity."""

    name: str
    version: str


class ResearchResult(Base, kw_only=True):
    """One research result included in the case."""

    path: ContentPath
    sha256: Sha256
    request_hash: Sha256
    provider: Provider
    status: Literal["complete", "partial", "not_found"]
    statement_ids: list[ExpectedId]
    # The sibling request.json (written since it was added; see EntitySource.kind).
    request: Ref | UnsetType = UNSET


class Research(Base, kw_only=True):
    """The research request (or null), its hash, included results and supplied research files."""

    request: dict[str, Any] | None
    request_hash: Sha256 | None
    results: list[ResearchResult]
    supplied: list[Ref]


class Gap(Base, kw_only=True):
    """A data-quality gap."""

    code: Literal["MISSING_INDEX", "NO_REPORTS", "NO_REPRODUCTIONS", "NO_EXPECTED_BEHAVIOR", "SUPERSEDED_INPUT", "UNNORMALIZED_KEY", "IGNORED_ATTACHMENTS"]
    message: str
    source: ContentPath | UnsetType = UNSET


class ConflictValue(Base, kw_only=True):
    """One value of a conflicting claim and the statement that carries it."""

    value: Any
    id: ConflictId
    source: ContentPath
    pointer: Pointer


class ClaimConflict(Base, kw_only=True):
    """Same explicit claim key, different canonical JSON values, within one block."""

    block: Literal["human_observations", "expected_behavior"]
    key: str
    values: Annotated[list[ConflictValue], Meta(min_length=2)]


class DataQuality(Base, kw_only=True):
    """Gaps and claim conflicts."""

    gaps: list[Gap]
    claim_conflicts: list[ClaimConflict]


class Inputs(Base, kw_only=True):
    """Every input the case was built from, as opaque references."""

    index: Ref | None
    index_history: list[Ref]
    reports: list[Ref]
    reproductions: list[Ref]
    expected_research: list[Ref]
    attachments: list[Ref]
    unclassified: list[Ref]
    prior_case: Ref | None


class Project(Base, kw_only=True):
    """Project metadata, from the manifest only."""

    name: str
    version: str
    repository: str | UnsetType = UNSET
    revision: str | UnsetType = UNSET


class CaseIdentity(Base, kw_only=True):
    """The ``case`` block: identity, revision, generation and request hash."""

    case_id: str
    package_id: str
    analysis_revision: Positive
    package_generation: Positive
    project: Project
    request_hash: Sha256


class Attachment(Base, kw_only=True):
    """A file a report attaches: its opaque reference and where the report names it."""

    path: ContentPath
    sha256: Sha256
    size: Size
    provenance: Provenance


class Bug(Base, kw_only=True):
    """Report titles and summaries, and the files reports attach.

    ``attachments`` is always written; cases confirmed before it existed
    lack it and must still be reused as published, so the contract allows that."""

    titles: list[Text]
    summaries: list[Text]
    attachments: list[Attachment] | UnsetType = UNSET


class HumanObservations(Base, kw_only=True):
    """Observations, comments and tester hypotheses, kept separate."""

    observations: list[Observation]
    comments: list[Comment]
    tester_hypotheses: list[TesterHypothesis]


class Case(Base, kw_only=True):
    """The canonical case document, ``viano-case`` format_version 1."""

    format: Literal["viano-case"]
    format_version: Literal[1]
    builder_version: Literal["1"]
    case: CaseIdentity
    bug: Bug
    human_observations: HumanObservations
    expected_behavior: ExpectedBehavior
    reproduction: ReproductionBlock
    entities: list[Entity]
    runtime_facts: RuntimeFacts
    database_context: list[Ref]
    source_context: list[Ref]
    research: Research
    data_quality: DataQuality
    inputs: Inputs


CASE_DECODER = msgspec.json.Decoder(Case)


def decode_case(data: bytes | str) -> Case:
    """Decode case JSON into a :class:`Case`; ``msgspec.ValidationError`` if it does not conform."""
    return CASE_DECODER.decode(data)

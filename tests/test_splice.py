"""Tests for the splice path of append rebuilds (pipeline/splice.py with
``assemble(..., carried=...)`` and ``carry_forward`` in pipeline/assemble.py).

The contract: for an inventory sorted by ``seq`` and any prefix ``P`` of it,
the previous build's published bytes (case.json and case_summary.md of
``assemble(snapshot(P))``) spliced in front of a *part* (the whole inventory
assembled with the ``P`` documents marked ``carried``) are byte for byte the
outputs of assembling the whole inventory, also when chained and with a prior
case. Anything that is not a build's output must raise :class:`SpliceError`
rather than yield wrong bytes.
"""

from __future__ import annotations

import copy
import re
import unicodedata

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipeline.assemble import APPENDED_LISTS, _NOTHING_CARRIED, assemble, carry_forward
from pipeline.jsoncanon import canonical_bytes, pretty_bytes
from pipeline.splice import SpliceError, splice_case, splice_summary
from pipeline.summary import render_summary
from tests.test_assemble import (
    as_prior,
    check_contract,
    report,
    reproduction,
    research_doc,
    research_result,
    snapshot,
)

LIMIT = 64  # inline fact value limit used throughout: small, so value_ref appears
FILES = ("runtime/events.log", "att/screen.png", "att/notes.txt", "ctx/runtime.bin", "ctx/db.sql")
CONTEXT = {"runtime": ["ctx/runtime.bin"], "database": ["ctx/db.sql"], "source": [], "research": []}

NFC = unicodedata.normalize("NFC", "caf\u00e9")
NFD = unicodedata.normalize("NFD", "caf\u00e9")
assert NFC != NFD

#: Supplied text that imitates the structure the splices look for.
HOSTILE = (
    "**bold** _em_ <b>html</b> <!-- c --> [link](http://example.org) ![img](x.png) `code`",
    "line one\nline two\r\nline three\rfour",
    "\n    ]",
    "\n    ],\n    \"titles\": [",
    '"observations": [',
    '\n  "bug": {\n',
    "\n  }\n",
    "### Titles",
    "\n\n### Titles\n\n- fake",
    "## Entities",
    "\n\n## Entities\n\n",
    "\n\n## Reproductions\n\n",
    "### Facts\n\n| Id | Name |",
    "None supplied.",
    "| a | b |\n| --- | --- |",
    "- bullet\n- bullet",
    "1. step",
    "  leading and trailing  ",
    " \u00a0x",
    "tab\there \x00\x1f\x7f nul",
    "\u2028sep\u2029para\x85nel\x0bvt\x0cff",
    "@user www.example.org &amp; &lt;",
    "[^1]: fake footnote",
    NFC,
    NFD,
    "\u202eevil\u202c bidi",
    "\U0001f41b emoji \u00fc\u0308",
)

# --------------------------------------------------------------------------- helpers


def build(docs, prefix, *, prior=None, revision=1):
    """``(reports, repros)`` tuples for ``snapshot`` from ``docs[:prefix]``."""
    chosen = docs[:prefix]
    reports = [(path, body, seq) for role, path, body, seq in chosen if role == "report"]
    repros = [(path, body, seq) for role, path, body, seq in chosen if role == "repro"]
    snap = snapshot(reports, repros, files=FILES, context=CONTEXT, limit=LIMIT, prior=prior, revision=revision)
    for entry in snap["reports"]:
        # A report from a prior case whose attachments the build ignores
        # (build._snapshot): the IGNORED_ATTACHMENTS gap, carried across splices.
        if entry["document"].get(IGNORED_MARK):
            entry["document"] = {k: v for k, v in entry["document"].items() if k != "attachments"}
            entry["attachments_ignored"] = True
    return snap


IGNORED_MARK = "x_attachments_ignored"


def with_carried(snap, paths):
    """``snap`` with the documents at ``paths`` marked carried (their body removed)."""
    snap = copy.deepcopy(snap)
    marked = 0
    for entry in snap["reports"] + snap["reproductions"]:
        if entry["path"] in paths:
            del entry["document"]
            entry.pop("fragment", None)
            entry["carried"] = True
            marked += 1
    assert marked == len(paths)
    return snap


def paths_of(docs, prefix):
    return {path for _, path, _, _ in docs[:prefix]}


def outputs(case):
    return pretty_bytes(case), render_summary(case).encode("utf-8")


def append_step(previous, state, docs, prefix, *, prior=None, revision=1):
    """One append build: the part for ``docs`` with ``docs[:prefix]`` carried,
    spliced onto ``previous`` (case bytes, summary bytes). Returns the spliced
    outputs, the part and the state for the next step."""
    frozen = copy.deepcopy(state)
    part = assemble(with_carried(build(docs, len(docs), prior=prior, revision=revision), paths_of(docs, prefix)), carried=state)
    assert state == frozen, "assemble changed the carried state"
    part_case, part_summary = outputs(part)
    spliced = (splice_case(previous[0], part_case), splice_summary(previous[1], part_summary))
    following = carry_forward(state, part)
    assert state == frozen, "carry_forward changed the state it extends"
    return spliced, part, following


def assert_same(spliced, whole):
    """Byte identity, with a readable first difference on failure."""
    for got, want, name in ((spliced[0], whole[0], "case.json"), (spliced[1], whole[1], "case_summary.md")):
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(
                f"{name} differs at byte {at} (spliced {len(got)} bytes, whole {len(want)} bytes):\n"
                f"spliced: {got[max(0, at - 200):at + 200]!r}\nwhole:   {want[max(0, at - 200):at + 200]!r}"
            )


def check_identity(docs, prefix, *, first_prior=None, append_prior=None, revision=1):
    """The contract for one prefix; returns the whole case."""
    case1 = assemble(build(docs, prefix, prior=first_prior))
    state = carry_forward(None, case1)
    assert state is not None
    spliced, part, _ = append_step(outputs(case1), state, docs, prefix, prior=append_prior, revision=revision)
    whole = assemble(build(docs, len(docs), prior=append_prior, revision=revision))
    assert_same(spliced, outputs(whole))
    # Everything outside the record lists is the part's own, derived whole.
    for block, field in APPENDED_LISTS:
        assert part[block][field] == whole[block][field][len(whole[block][field]) - len(part[block][field]):]
    for key in ("entities", "research", "data_quality", "inputs", "case"):
        assert part[key] == whole[key], key
    return whole


def check_chain(docs, first, second, *, prior=None, revision=1):
    """Two appends: ``docs[:first]`` built whole, then ``docs[:second]`` and
    all of ``docs`` spliced, each onto the previous spliced outputs."""
    case1 = assemble(build(docs, first, prior=prior))
    state1 = carry_forward(None, case1)
    spliced1, _, state2 = append_step(outputs(case1), state1, docs[:second], first, prior=prior, revision=revision)
    assert state2 is not None
    assert_same(spliced1, outputs(assemble(build(docs, second, prior=prior, revision=revision))))
    spliced2, _, state3 = append_step(spliced1, state2, docs, second, prior=prior, revision=revision)
    assert_same(spliced2, outputs(assemble(build(docs, len(docs), prior=prior, revision=revision))))
    # The state after two steps is the state after one step over the same documents.
    direct = carry_forward(None, assemble(build(docs, len(docs), prior=prior, revision=revision)))
    assert canonical_bytes(state3) == canonical_bytes(direct)


# --------------------------------------------------------------------------- strategies

# Supplied text is non-blank (the input schemas require a non-whitespace character).
_text = st.one_of(st.sampled_from(HOSTILE), st.text(min_size=1, max_size=12).filter(lambda s: re.search(r"\S", s)))
_scalar = st.one_of(
    st.integers(-3, 3),
    st.integers(-(2**53) + 1, 2**53 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.5, 1.0, 1e16, -0.0, 2.5e-8]),
    _text,
    st.booleans(),
    st.none(),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=6,
)
# Few keys and few values: claims on one key conflict across documents often.
_claim = st.fixed_dictionaries(
    {
        "key": st.sampled_from(["lamp.state", "k", NFC, NFD, "### Titles"]),
        "value": st.one_of(st.sampled_from([0, 1, 1.5, "on", "off", [1, [2]], {"a": {"b": None}}]), _value),
    }
)
_statement = st.fixed_dictionaries(
    {"text": _text},
    optional={"author": _text, "observed_at": st.just("2026-03-14T07:00:12+01:00"), "claim": _claim},
)
_entity = st.fixed_dictionaries(
    {"type": st.sampled_from(["component", "user", NFC, NFD]), "id": st.sampled_from([1, "1", 2, "x", "042"])},
    optional={"roles": st.lists(st.sampled_from(["focus", "observed", "### Titles"]), max_size=2)},
)


@st.composite
def _report(draw):
    body = {}
    for field in ("title", "summary"):
        if draw(st.booleans()):
            body[field] = draw(_text)
    for field in ("observations", "comments", "tester_hypotheses", "expected_behavior"):
        # absent, empty or some statements
        choice = draw(st.integers(0, 3))
        if choice == 1:
            body[field] = []
        elif choice > 1:
            body[field] = draw(st.lists(_statement, min_size=1, max_size=3))
    complete = draw(st.sampled_from([None, True, False]))
    if complete is not None:
        body["expected_behavior_complete"] = complete
    if draw(st.integers(0, 2)):
        body["entities"] = draw(st.lists(_entity, max_size=3))
    if draw(st.booleans()):
        # Repeats allowed: each is its own attachment record, with its own pointer.
        body["attachments"] = draw(st.lists(st.sampled_from(["att/screen.png", "att/notes.txt"]), max_size=3))
    if draw(st.integers(0, 4)) == 0:
        body[IGNORED_MARK] = True
    return report(**body)


_fact = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["exit_code", "payload", "### Facts", "\n    ]"]),
        "value": st.one_of(
            _value,
            st.just("y" * (LIMIT + 1)),  # over the limit: value_ref
            st.just(list(range(40))),
            st.just("z" * (LIMIT - 2)),  # canonical bytes exactly at the limit: inline
        ),
    }
)


@st.composite
def _repro(draw):
    body = {
        "steps": draw(st.lists(_text, max_size=3)),
        "observations": draw(st.lists(_statement, max_size=2)),
        "facts": draw(st.lists(_fact, max_size=3)),
    }
    if draw(st.booleans()):
        body["events_ref"] = "runtime/events.log"
    body["attachments"] = draw(st.lists(st.sampled_from(["att/screen.png", "att/notes.txt"]), max_size=2, unique=True))
    if draw(st.booleans()):
        body["entities"] = draw(st.lists(_entity, max_size=2))
    return reproduction(**body)


@st.composite
def _inventory(draw, max_docs=6):
    """``[(role, path, body, seq)]`` sorted by ``seq``; paths deliberately not
    in seq order, seqs with gaps, reports and reproductions interleaved."""
    count = draw(st.integers(0, max_docs))
    roles = draw(st.lists(st.sampled_from(["report", "repro"]), min_size=count, max_size=count))
    seqs = sorted(draw(st.lists(st.integers(0, 1000), min_size=len(roles), max_size=len(roles), unique=True)))
    names = draw(st.permutations(range(len(roles))))
    docs = []
    for role, seq, name in zip(roles, seqs, names):
        body = draw(_report() if role == "report" else _repro())
        folder = "reports" if role == "report" else "repro"
        docs.append((role, f"original/{folder}/d{name}.json", body, seq))
    return docs


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

# --------------------------------------------------------------------------- the identity, property-based


@SETTINGS
@given(_inventory())
def test_every_prefix_spliced_equals_the_whole_build(docs):
    nothing = copy.deepcopy(_NOTHING_CARRIED)
    for prefix in range(len(docs) + 1):
        whole = check_identity(docs, prefix)
    assert _NOTHING_CARRIED == nothing
    # What the examples cover (pytest --hypothesis-show-statistics).
    event(f"completeness: {whole['expected_behavior']['completeness']}")
    for gap in sorted({g["code"] for g in whole["data_quality"]["gaps"]}):
        event(f"gap: {gap}")
    if whole["data_quality"]["claim_conflicts"]:
        event("claim conflict")
    if any("value_ref" in f for f in whole["runtime_facts"]["facts"]):
        event("value_ref")
    if any(len(e["sources"]) > 1 for e in whole["entities"]):
        event("merged entity")


@SETTINGS
@given(_inventory(), st.data())
def test_every_prefix_spliced_equals_the_whole_build_with_one_prior_case(docs, data):
    """Both builds use the same prior case, built from an arbitrary earlier
    selection of the documents (its ids are reused for the same source pointers)."""
    chosen = data.draw(st.lists(st.sampled_from(range(len(docs))), unique=True) if docs else st.just([]))
    earlier = [docs[i] for i in sorted(chosen)]
    prior = as_prior(assemble(build(earlier, len(earlier))))
    for prefix in range(len(docs) + 1):
        check_identity(docs, prefix, first_prior=prior, append_prior=prior)


@SETTINGS
@given(_inventory())
def test_every_prefix_spliced_equals_the_whole_build_of_the_next_revision(docs):
    """The append build is a new analysis revision whose prior case is the
    first build's own case."""
    for prefix in range(len(docs) + 1):
        case1 = assemble(build(docs, prefix))
        check_identity(docs, prefix, append_prior=as_prior(case1), revision=2)


@SETTINGS
@given(_inventory(max_docs=7), st.data())
def test_two_appends_chained(docs, data):
    first = data.draw(st.integers(0, len(docs)))
    second = data.draw(st.integers(first, len(docs)))
    check_chain(docs, first, second)
    # Every build with one prior case (the first build's documents built
    # before), the appends as the next analysis revision.
    prior = as_prior(assemble(build(docs, first)))
    check_chain(docs, first, second, prior=prior, revision=2)


# --------------------------------------------------------------------------- the identity, one hostile inventory

HOSTILE_DOCS = [
    ("report", "original/reports/z-first.json", report(
        title="### Titles", summary="line one\nline two\r\nline three\rfour",
        observations=[
            {"text": "\n    ]", "author": '\n    ],\n    "titles": [', "observed_at": "2026-01-02T03:04:05+01:00",
             "claim": {"key": NFC, "value": {"nested": [1, 2.5, "\n    ]", {"x": None}]}}},
            {"text": '"observations": [', "claim": {"key": "lamp.state", "value": "off"}},
        ],
        comments=[{"text": "## Entities", "claim": {"key": "lamp.state", "value": "on"}}],
        tester_hypotheses=[{"text": "**bold** <b>html</b> [link](http://example.org) `code`"}],
        expected_behavior=[{"text": "\n\n## Entities\n\n", "claim": {"key": "speed", "value": 1.5}}],
        expected_behavior_complete=True,
        entities=[{"type": "component", "id": 42, "roles": ["focus"]}, {"type": NFC, "id": "x"}],
        attachments=["att/screen.png", "att/screen.png"],
    ), 3),
    ("repro", "original/repro/a.json", reproduction(
        steps=["\n\n## Reproductions\n\n", "### Facts\n\n| Id | Name |", "1. step"],
        observations=[{"text": "None supplied.", "claim": {"key": "lamp.state", "value": "on"}}],
        facts=[{"name": "big", "value": "y" * (LIMIT + 1)}, {"name": "\n    ]", "value": [1, {"b": 2}]},
               {"name": "edge", "value": "z" * (LIMIT - 2)}],
        events_ref="runtime/events.log", attachments=["att/screen.png"],
        entities=[{"type": "component", "id": "42", "roles": ["observed", "focus"]}],
    ), 7),
    ("report", "original/reports/m.json", report(
        observations=[], comments=[], tester_hypotheses=[], expected_behavior=[],
        entities=[],
    ), 8),
    ("report", "original/reports/b.json", report(
        title='\n  "bug": {\n', summary="| a | b |\n| --- | --- |",
        observations=[{"text": "tab\there \x00\x1f\x7f nul", "claim": {"key": NFD, "value": 3}}],
        expected_behavior=[{"text": "- bullet\n- bullet", "claim": {"key": "speed", "value": 2}},
                           {"text": "\u2028sep\u2029para\x85nel\x0bvt\x0cff"}],
        expected_behavior_complete=False,
        entities=[{"type": NFD, "id": "x", "roles": ["### Titles"]}, {"type": "component", "id": 42, "roles": ["new"]}],
    ), 12),
    ("repro", "original/repro/0.json", reproduction(
        steps=[], observations=[], facts=[], attachments=[],
    ), 13),
    ("repro", "original/repro/c.json", reproduction(
        steps=["\n  }\n", "\u202eevil\u202c bidi"],
        observations=[{"text": "\U0001f41b emoji \u00fc\u0308", "author": "@user www.example.org &amp; &lt;"}],
        facts=[{"name": "exit_code", "value": 3}, {"name": "big", "value": list(range(40))}],
        attachments=["att/notes.txt", "att/screen.png"],
    ), 20),
    ("report", "original/reports/a.json", report(
        title="[^1]: fake footnote", expected_behavior=[{"text": NFD}],
        entities=[{"type": "user", "id": 7}], attachments=["att/notes.txt"],
    ), 21),
    ("report", "original/reports/legacy.json", report(
        title="kept", observations=[{"text": "kept too"}], attachments=["att/never-sent.png"], **{IGNORED_MARK: True},
    ), 22),
]


def test_the_hostile_inventory_exercises_what_the_splice_must_survive():
    """The fixed inventory below really holds the hard parts, so the identity
    tests over it mean something."""
    whole = assemble(build(HOSTILE_DOCS, len(HOSTILE_DOCS)))
    check_contract(whole)
    gaps = [g["code"] for g in whole["data_quality"]["gaps"]]
    assert "UNNORMALIZED_KEY" in gaps
    assert {c["key"] for c in whole["data_quality"]["claim_conflicts"]} == {"lamp.state", "speed"}
    assert any("value_ref" in f for f in whole["runtime_facts"]["facts"])
    assert any(f["name"] == "edge" and "value" in f for f in whole["runtime_facts"]["facts"])
    merged = [e for e in whole["entities"] if (e["type"], e["id"]) == ("component", "42")]
    assert len(merged) == 1 and len(merged[0]["sources"]) == 3 and merged[0]["roles"] == ["focus", "observed", "new"]
    assert whole["expected_behavior"]["completeness"] == "conflicting"
    assert all(whole[block][field] for block, field in APPENDED_LISTS)
    assert {"code": "IGNORED_ATTACHMENTS", "source": "original/reports/legacy.json"}.items() <= next(
        g for g in whole["data_quality"]["gaps"] if g["code"] == "IGNORED_ATTACHMENTS").items()
    assert "original/reports/legacy.json" in {t["provenance"]["source"] for t in whole["bug"]["titles"]}


@pytest.mark.parametrize("prefix", range(len(HOSTILE_DOCS) + 1))
def test_hostile_inventory_every_prefix(prefix):
    check_identity(HOSTILE_DOCS, prefix)
    prior = as_prior(assemble(build(HOSTILE_DOCS[1:4], 3)))
    check_identity(HOSTILE_DOCS, prefix, first_prior=prior, append_prior=prior)
    check_identity(HOSTILE_DOCS, prefix, append_prior=as_prior(assemble(build(HOSTILE_DOCS, prefix))), revision=2)


def test_hostile_inventory_parts_are_valid_cases_and_chain():
    case1 = assemble(build(HOSTILE_DOCS, 2))
    state = carry_forward(None, case1)
    part = assemble(with_carried(build(HOSTILE_DOCS, len(HOSTILE_DOCS)), paths_of(HOSTILE_DOCS, 2)), carried=state)
    check_contract(part)  # a part is a whole, valid case
    assert [t["provenance"]["source"] for t in part["bug"]["titles"]] == [
        "original/reports/b.json", "original/reports/a.json", "original/reports/legacy.json"]
    for first in range(len(HOSTILE_DOCS) + 1):
        for second in range(first, len(HOSTILE_DOCS) + 1):
            check_chain(HOSTILE_DOCS, first, second)


def test_no_carried_documents_with_the_empty_state_is_the_whole_build():
    snap = build(HOSTILE_DOCS, len(HOSTILE_DOCS))
    assert pretty_bytes(assemble(snap, carried=copy.deepcopy(_NOTHING_CARRIED))) == pretty_bytes(assemble(snap))


# --------------------------------------------------------------------------- research request differences


def _eb_report(text, complete=None, *, claim=None, title=None):
    statement = {"text": text, **({"claim": claim} if claim is not None else {})}
    fields = {"expected_behavior": [statement]}
    if complete is not None:
        fields["expected_behavior_complete"] = complete
    if title is not None:
        fields["title"] = title
    return report(**fields)


REQUEST_CASES = {
    # first build reported_complete (no request); the append makes one necessary
    "complete_then_undeclared": (
        [("report", "r/1", _eb_report("turns on", True, title="T1"), 0)],
        [("report", "r/2", _eb_report("stays on", title="T2"), 1)],
        "reported_complete", "unspecified",
    ),
    "complete_then_partial": (
        [("report", "r/1", _eb_report("turns on", True, title="T1"), 0)],
        [("report", "r/2", _eb_report("stays on", False), 1)],
        "reported_complete", "conflicting",
    ),
    "complete_then_claim_conflict": (
        [("report", "r/1", _eb_report("turns on", True, claim={"key": "k", "value": 1}), 0)],
        [("report", "r/2", _eb_report("turns off", True, claim={"key": "k", "value": 2}), 1)],
        "reported_complete", "conflicting",
    ),
    # the reverse: a request before the append, none after it
    "missing_then_complete": (
        [("report", "r/1", report(title="T1", summary="S1", entities=[{"type": "component", "id": 1}]), 0),
         ("repro", "p/1", reproduction(steps=["s"]), 1)],
        [("report", "r/2", _eb_report("turns on", True, title="T2"), 2)],
        "missing", "reported_complete",
    ),
    "declared_without_statements_then_complete": (
        [("report", "r/1", report(title="T1", expected_behavior_complete=True), 0)],
        [("report", "r/2", _eb_report("turns on", True), 1)],
        "reported_complete", "reported_complete",
    ),
    "unspecified_stays_with_more_expectations": (
        [("report", "r/1", _eb_report("turns on", title="T1"), 0)],
        [("report", "r/2", _eb_report("stays on", title="T2"), 1), ("repro", "p/1", reproduction(steps=["s"]), 2)],
        "unspecified", "unspecified",
    ),
}


@pytest.mark.parametrize("name", sorted(REQUEST_CASES))
def test_research_request_differences_are_derived_whole(name):
    first, appended, before, after = REQUEST_CASES[name]
    docs = first + appended
    case1 = assemble(build(docs, len(first)))
    assert case1["expected_behavior"]["completeness"] == before
    assert (case1["research"]["request"] is None) == (before == "reported_complete")
    whole = check_identity(docs, len(first))
    assert whole["expected_behavior"]["completeness"] == after
    request = whole["research"]["request"]
    if after == "reported_complete":
        assert request is None and whole["research"]["request_hash"] is None
    else:
        # The request repeats the carried documents' texts and expectations too.
        titles = [t["text"] for t in whole["bug"]["titles"]]
        assert request["bug"]["titles"] == titles
        assert [e["id"] for e in request["tester_expectations"]] == [
            s["id"] for s in whole["expected_behavior"]["statements"]]
        assert request["completeness"] == after
    for prior_mode in ("same", "next_revision"):
        if prior_mode == "same":
            prior = as_prior(case1)
            check_identity(docs, len(first), first_prior=prior, append_prior=prior)
        else:
            check_identity(docs, len(first), append_prior=as_prior(case1), revision=2)


# --------------------------------------------------------------------------- SpliceError


@pytest.fixture(scope="module")
def spliced_pair():
    """(previous outputs, part outputs, whole outputs) for a split whose every
    appended list is non-empty on both sides."""
    docs = HOSTILE_DOCS
    prefix = 2
    case1 = assemble(build(docs, prefix))
    part = assemble(with_carried(build(docs, len(docs)), paths_of(docs, prefix)), carried=carry_forward(None, case1))
    whole = assemble(build(docs, len(docs)))
    previous, own, expected = outputs(case1), outputs(part), outputs(whole)
    assert splice_case(previous[0], own[0]) == expected[0]
    assert splice_summary(previous[1], own[1]) == expected[1]
    return previous, own, expected


def _raises_or_is_right(call, expected):
    try:
        got = call()
    except SpliceError:
        return "raised"
    assert got == expected, "wrong bytes returned without SpliceError"
    return "right"


@pytest.mark.parametrize("output, splice", [(0, splice_case), (1, splice_summary)], ids=["case", "summary"])
def test_a_truncated_previous_output_raises_or_is_still_exact(spliced_pair, output, splice):
    """Cut anywhere, the previous case.json or summary either raises or (cut
    after the last block a splice takes of it) gives the exact output."""
    previous, own, expected = spliced_pair
    seen = {"raised": 0, "right": 0}
    for cut in range(len(previous[output])):
        seen[_raises_or_is_right(lambda: splice(previous[output][:cut], own[output]), expected[output])] += 1
    assert seen["raised"] > 0


def test_a_truncated_part_raises(spliced_pair):
    """The part's bytes are a build's output too. Cut short after their last
    record list (here: without the closing ``}``; the summary without its
    last section) they are not, and the splice must refuse them rather than
    return a truncated case or summary."""
    previous, own, _ = spliced_pair
    with pytest.raises(SpliceError):
        splice_case(previous[0], own[0][:-2])  # b"}\n" cut off
    with pytest.raises(SpliceError):
        splice_summary(previous[1], own[1][: own[1].index(b"\n\n## Input files\n\n")])


def _in_block(data, block, old, new):
    """``data`` with the first ``old`` inside the top-level ``block`` replaced."""
    at = data.index(f'\n  "{block}": {{\n'.encode())
    end = data.index(b"\n  }", at)
    inner = data[at:end]
    assert old in inner
    return data[:at] + inner.replace(old, new, 1) + data[end:]


@pytest.mark.parametrize("block, field", APPENDED_LISTS)
def test_a_case_without_one_appended_list_raises(spliced_pair, block, field):
    previous, own, expected = spliced_pair
    key = f'\n    "{field}": '.encode()
    opened = f'\n  "{block}": {{\n'.encode()
    for broken in (
        _in_block(previous[0], block, key, b'\n    "renamed": '),  # the list is gone
        previous[0].replace(opened, b'\n  "other": {\n', 1),  # its block is gone
        _in_block(previous[0], block, key + b"[", key + b"{"),  # not a list
    ):
        assert broken != previous[0]
        assert _raises_or_is_right(lambda: splice_case(broken, own[0]), expected[0]) == "raised"
        assert _raises_or_is_right(lambda: splice_case(previous[0], broken), expected[0]) == "raised"
    for broken in (_in_block(own[0], block, key, b'\n    "renamed": '), own[0].replace(opened, b'\n  "other": {\n', 1)):
        with pytest.raises(SpliceError):
            splice_case(previous[0], broken)


def test_an_unclosed_list_raises(spliced_pair):
    previous, own, _ = spliced_pair
    key = b'\n    "titles": [\n'
    at = previous[0].index(key)
    close = previous[0].index(b"\n    ]", at)
    unclosed = previous[0][:close] + previous[0][close + len(b"\n    ]"):]  # bug/titles never closed
    with pytest.raises(SpliceError):
        splice_case(unclosed, own[0])


def test_non_build_case_bytes_raise(spliced_pair):
    previous, own, _ = spliced_pair
    import json

    compact = canonical_bytes(json.loads(previous[0]))  # the same case, not pretty
    four = (json.dumps(json.loads(previous[0]), sort_keys=True, indent=4, ensure_ascii=False) + "\n").encode()
    tabs = previous[0].replace(b"\n  ", b"\n\t")
    for bad in (b"", b"{}\n", compact, four, tabs, previous[1]):
        with pytest.raises(SpliceError):
            splice_case(bad, own[0])
        with pytest.raises(SpliceError):
            splice_case(previous[0], bad)


SPLICED_HEADINGS = (
    b"### Titles", b"### Summaries", b"### Observations (supplied by testers)", b"### Comments (supplied by testers)",
    b"### Tester hypotheses (supplied by testers; hypotheses, not facts)", b"### Completeness declarations",
    b"### Expected-behaviour statements", b"## Reproductions", b"## Entities", b"### Facts",
)


@pytest.mark.parametrize("heading", SPLICED_HEADINGS)
def test_a_summary_missing_a_heading_raises(spliced_pair, heading):
    previous, own, expected = spliced_pair
    marker = b"\n\n" + heading + b"\n\n"
    assert previous[1].count(marker) == 1 and own[1].count(marker) == 1
    assert _raises_or_is_right(lambda: splice_summary(previous[1].replace(marker, b"\n\n", 1), own[1]), expected[1]) == "raised"
    with pytest.raises(SpliceError):
        splice_summary(previous[1], own[1].replace(marker, b"\n\n", 1))


def test_a_summary_with_a_repeated_heading_raises_or_is_still_exact(spliced_pair):
    """A heading the renderer writes once, written twice: not a build's
    summary. The splice must not take the (empty) text between the two as
    the earlier records."""
    previous, own, expected = spliced_pair
    wrong = []
    for heading in SPLICED_HEADINGS:
        marker = b"\n\n" + heading + b"\n\n"
        for which, args in (("previous", (previous[1].replace(marker, marker + marker, 1), own[1])),
                            ("part", (previous[1], own[1].replace(marker, marker + marker, 1)))):
            try:
                got = splice_summary(*args)
            except SpliceError:
                continue
            if got != expected[1]:
                wrong.append((which, heading.decode()))
    assert not wrong, f"wrong summary bytes returned without SpliceError for a repeated heading in: {wrong}"


def test_non_build_summary_bytes_raise(spliced_pair):
    previous, own, _ = spliced_pair
    for bad in (b"", b"# Case summary\n", previous[0], previous[1].replace(b"\n\n", b"\r\n\r\n")):
        with pytest.raises(SpliceError):
            splice_summary(bad, own[1])
        with pytest.raises(SpliceError):
            splice_summary(previous[1], bad)


def test_a_table_without_rows_raises():
    """A completeness table in the part that is only its header line."""
    docs = [("report", "r/1", _eb_report("a", True), 0), ("report", "r/2", _eb_report("b", False), 1)]
    case1 = assemble(build(docs, 1))
    part = assemble(with_carried(build(docs, 2), {"r/1"}), carried=carry_forward(None, case1))
    own = render_summary(part).encode()
    header = b"| Value | Source |"
    at = own.index(b"\n\n### Completeness declarations\n\n") + len(b"\n\n### Completeness declarations\n\n")
    assert own[at:].startswith(header)
    end = own.index(b"\n\n", at)
    with pytest.raises(SpliceError):
        splice_summary(render_summary(case1).encode(), own[:at] + header + own[end:])


# --------------------------------------------------------------------------- carried state and research


def _researched_case():
    base = snapshot([("r", report(title="t", expected_behavior=[{"text": "e"}]), 0)])
    request = assemble(base)["research"]["request"]
    assert request is not None
    result = research_result(request, statements=[{"text": "turns on", "citations": [0]}])
    researched = snapshot([("r", report(title="t", expected_behavior=[{"text": "e"}]), 0)],
                          expected_research=[research_doc(request, result)])
    return researched, assemble(researched)


def test_carry_forward_gives_no_state_for_a_case_with_research_results():
    snap, case = _researched_case()
    assert case["research"]["results"]
    assert carry_forward(None, case) is None
    earlier = carry_forward(None, assemble(snapshot([("q", report(title="u"), 0)])))
    assert earlier is not None
    assert carry_forward(earlier, case) is None
    # The same documents without research do carry.
    plain = assemble({**snap, "expected_research": []})
    assert carry_forward(None, plain) is not None
    # A hand-made case dict with results is refused the same way.
    made = copy.deepcopy(plain)
    made["research"]["results"] = [{"path": "x", "statement_ids": []}]
    assert carry_forward(None, made) is None


def test_a_carried_assembly_refuses_research_results():
    snap, _ = _researched_case()
    state = carry_forward(None, assemble(snapshot([("r", report(title="t", expected_behavior=[{"text": "e"}]), 0)])))
    carried_snap = with_carried(snap, {"r"})
    with pytest.raises(ValueError):
        assemble(carried_snap, carried=state)
    with pytest.raises(ValueError):
        assemble(snap, carried=copy.deepcopy(_NOTHING_CARRIED))
    # Without research the same carried snapshot assembles.
    assemble({**carried_snap, "expected_research": []}, carried=state)


def test_the_carried_state_is_small_and_plain():
    """No record lists travel in the state: only what derived parts need."""
    case1 = assemble(build(HOSTILE_DOCS, len(HOSTILE_DOCS)))
    state = carry_forward(None, case1)
    assert set(state) == set(_NOTHING_CARRIED)
    assert state["reproductions"] == len(case1["reproduction"]["reproductions"])
    assert state["next_floor"] == {"O": 7, "C": 2, "T": 2, "E": 5, "F": 6}
    assert state["titles"] == [t["text"] for t in case1["bug"]["titles"]]
    assert state["ignored_attachments"] == ["original/reports/legacy.json"]
    assert state["referenced"] == ["att/notes.txt", "att/screen.png", "runtime/events.log"]
    assert state["declarations"] == case1["expected_behavior"]["declarations"]
    assert state["entities"] == case1["entities"]
    canonical_bytes(state)  # JSON-encodable as it is


@pytest.mark.parametrize("which", ["previous", "part"])
def test_a_case_with_a_list_key_twice_raises(spliced_pair, which):
    """A build's case holds each key once per object; bytes with a second
    ``titles`` in ``bug`` are not a build's, and must not be spliced."""
    previous, own, expected = spliced_pair
    key = b'\n    "titles": '
    doubled = {name: data[: data.index(key)] + b'\n    "titles": [],' + data[data.index(key):] for name, data in (("previous", previous[0]), ("part", own[0]))}
    with pytest.raises(SpliceError):
        if which == "previous":
            splice_case(doubled["previous"], own[0])
        else:
            splice_case(previous[0], doubled["part"])


def test_the_closing_line_is_found_however_many_brackets_come_before_it():
    """After a few ``]`` one by one, the rest is one search for the whole
    line: the same place as the first ``]`` after a newline and four spaces,
    for any text (seven reports of 1,000,000 ``]`` made an append rebuild
    step through each in Python)."""
    import random

    from pipeline.splice import SpliceError, _closing_bracket

    def first_closing_line(data: bytes, start: int, end: int) -> int | None:
        for at in range(start, end):
            if data[at:at + 1] == b"]" and at >= 5 and data[at - 5:at] == b"\n    ":
                return at - 5
        return None

    rng = random.Random(21)
    pieces = [b"]", b"]]]]", b"\n    ", b"\n    ]", b"\n        ]", b"x", b" ", b"\n"]
    for _ in range(3000):
        data = b"".join(rng.choice(pieces) for _ in range(rng.choice([5, 40, 200])))
        start, end = sorted(rng.sample(range(len(data) + 1), 2)) if len(data) > 1 else (0, len(data))
        expected = first_closing_line(data, start, end)
        if expected is None:
            with pytest.raises(SpliceError):
                _closing_bracket(data, start, end)
        else:
            assert _closing_bracket(data, start, end) == expected, (data, start, end)
    many = b"[\n" + b"]" * 100_000 + b"\n    ]"
    assert _closing_bracket(many, 1, len(many)) == len(many) - 6

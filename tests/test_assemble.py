"""Tests for the pure case assembler (pipeline/assemble.py) and the research request.

Snapshots are synthetic and built inline, exactly per seed 001's report and
reproduction contracts and docs/internals.md's snapshot shape.
"""

from __future__ import annotations

import copy
import json

import msgspec
import pytest

import contracts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.case_structs import CASE_FORMAT, CASE_FORMAT_VERSION, Case, decode_case
from pipeline.assemble import CaseTooLarge, assemble
from pipeline.errors import CaseBuildError
from pipeline.jsoncanon import canonical_bytes, canonical_hash, pretty_bytes, resolve_pointer
from pipeline.research_request import build_research_request

HASH = "ab" * 32

# --------------------------------------------------------------------------- builders


def report(**fields):
    return {"format": "viano-bug-report", "format_version": 1, **fields}


def reproduction(**fields):
    return {"format": "viano-reproduction", "format_version": 1, **fields}


def doc(path, document, seq):
    data = canonical_bytes(document)
    return {"path": path, "sha256": canonical_hash(document), "size": len(data), "document": document, "seq": seq}


def ref(path, size=10):
    return {"path": path, "sha256": canonical_hash(path), "size": size}


def snapshot(reports=(), reproductions=(), *, index=True, files=(), context=None, attachments=(), unclassified=(),
             expected_research=(), prior=None, limit=16384, revision=1, generation=1):
    """A snapshot whose ``files`` inventory holds every document and every extra path."""
    reports = [doc(p, d, s) for p, d, s in reports]
    reproductions = [doc(p, d, s) for p, d, s in reproductions]
    inventory = {}
    for item in reports + reproductions + list(expected_research):
        inventory[item["path"]] = {"sha256": item["sha256"], "size": item["size"]}
    for path in files:
        r = ref(path)
        inventory[path] = {"sha256": r["sha256"], "size": r["size"]}
    index_ref = ref("original/case-inputs.json") if index else None
    if index_ref:
        inventory[index_ref["path"]] = {"sha256": index_ref["sha256"], "size": index_ref["size"]}
    return {
        "manifest": {
            "case_id": "case-A",
            "package_id": "pkg-1",
            "analysis_revision": revision,
            "package_generation": generation,
            "project": {"name": "demo", "version": "1.0"},
        },
        "request_hash": HASH,
        "limits": {"inline_fact_value": limit},
        "index": index_ref,
        "index_history": [index_ref] if index_ref else [],
        "reports": reports,
        "reproductions": reproductions,
        "expected_research": list(expected_research),
        "context": context or {"runtime": [], "database": [], "source": [], "research": []},
        "attachments": list(attachments),
        "files": inventory,
        "unclassified": list(unclassified),
        "prior_case": prior,
    }


def as_prior(case):
    data = pretty_bytes(case)
    return {"path": "case/revisions/0001/case.json", "sha256": canonical_hash(case), "size": len(data), "document": case}


def documents(snap):
    out = {d["path"]: d["document"] for d in snap["reports"] + snap["reproductions"]}
    out.update({d["path"]: d["document"] for d in snap["expected_research"]})
    return out


def all_statements(case):
    h = case["human_observations"]
    return h["observations"] + h["comments"] + h["tester_hypotheses"] + case["expected_behavior"]["statements"]


def schema_validator():
    return contracts.validator("case")


def check_contract(case):
    errors = sorted(schema_validator().iter_errors(case), key=lambda e: list(e.absolute_path))
    assert not errors, [(list(e.absolute_path), e.message) for e in errors]
    decoded = decode_case(pretty_bytes(case))
    assert isinstance(decoded, Case)
    # Struct round trip is lossless.
    assert json.loads(msgspec.json.encode(decoded)) == json.loads(pretty_bytes(case))


RICH_REPORT = report(
    title="A generic observed problem",
    summary="Switch stays off",
    observations=[
        {"text": "The switch remains off", "author": "Tester A", "observed_at": "2026-01-02T03:04:05+01:00"},
        {"text": "Lamp is dark", "claim": {"key": "lamp.state", "value": "off"}},
    ],
    comments=[{"text": "Seen twice", "claim": {"key": "lamp.state", "value": "on"}}],
    tester_hypotheses=[{"text": "Perhaps a timing issue", "claim": {"key": "lamp.state", "value": "blinking"}}],
    expected_behavior=[{"text": "The switch turns on", "author": "Tester A"}],
    expected_behavior_complete=False,
    entities=[{"type": "component", "id": 42, "roles": ["focus"]}],
    extension_field={"ignored": True},
)

RICH_REPRO = reproduction(
    steps=["open the app", "press the switch"],
    observations=[{"text": "Nothing happens", "author": "Bot", "claim": {"key": "lamp.state", "value": "off"}}],
    events_ref="original/events.bin",
    attachments=["original/screen.png"],
    facts=[{"name": "exit_code", "value": 3}, {"name": "payload", "value": {"a": [1, 2]}}],
    entities=[{"type": "component", "id": "42", "roles": ["observed", "focus"]}, {"type": "user", "id": 7}],
)


def rich_snapshot(**kw):
    return snapshot(
        [("original/report.data", RICH_REPORT, 0)],
        [("original/reproduction.data", RICH_REPRO, 1)],
        files=["original/events.bin", "original/screen.png", "original/runtime.bin", "original/db.sql",
               "original/src.tar", "original/research.pdf", "original/index-attachment.txt"],
        context={"runtime": ["original/runtime.bin"], "database": ["original/db.sql"], "source": ["original/src.tar"],
                 "research": ["original/research.pdf"]},
        attachments=["original/index-attachment.txt"],
        unclassified=[ref("original/unknown.bin", 5)],
        **kw,
    )


# --------------------------------------------------------------------------- identity and blocks


def test_identity_project_and_revision_come_only_from_the_manifest():
    rep = report(title="t", case_id="evil", package_id="evil", project={"name": "evil"}, analysis_revision=99)
    snap = snapshot([("r.json", rep, 0)], revision=3, generation=5)
    case = assemble(snap)
    assert case["format"] == CASE_FORMAT and case["format_version"] == CASE_FORMAT_VERSION
    assert case["builder_version"] == "1"
    assert case["case"] == {"case_id": "case-A", "package_id": "pkg-1", "analysis_revision": 3, "package_generation": 5,
                            "project": {"name": "demo", "version": "1.0"}, "request_hash": HASH}
    check_contract(case)


def test_blocks_are_separate_with_provenance_and_verbatim_author_time():
    case = assemble(rich_snapshot())
    h = case["human_observations"]
    assert [s["text"] for s in h["observations"]] == ["The switch remains off", "Lamp is dark", "Nothing happens"]
    assert [s["id"] for s in h["observations"]] == ["O0001", "O0002", "O0003"]
    assert [s["id"] for s in h["comments"]] == ["C0001"]
    assert [s["id"] for s in h["tester_hypotheses"]] == ["T0001"]
    assert [s["id"] for s in case["expected_behavior"]["statements"]] == ["E0001"]
    first = h["observations"][0]
    assert first["author"] == "Tester A" and first["observed_at"] == "2026-01-02T03:04:05+01:00"
    assert "author" not in h["observations"][1] and "observed_at" not in h["observations"][1]
    assert first["provenance"] == {"kind": "tester_report", "source": "original/report.data", "pointer": "/observations/0"}
    assert h["observations"][2]["provenance"] == {"kind": "reproduction", "source": "original/reproduction.data", "pointer": "/observations/0"}
    assert case["expected_behavior"]["statements"][0]["origin"] == "tester"
    assert case["bug"]["titles"] == [{"text": "A generic observed problem",
                                      "provenance": {"kind": "tester_report", "source": "original/report.data", "pointer": "/title"}}]
    assert case["bug"]["summaries"][0]["provenance"]["pointer"] == "/summary"
    check_contract(case)


def test_every_provenance_pointer_resolves_to_its_source():
    snap = rich_snapshot(limit=4)
    case = assemble(snap)
    docs = documents(snap)
    for statement in all_statements(case):
        prov = statement["provenance"]
        target = resolve_pointer(docs[prov["source"]], prov["pointer"])
        assert target["text"] == statement["text"]
        if "claim" in statement:
            assert target["claim"] == statement["claim"]
    for text in case["bug"]["titles"] + case["bug"]["summaries"]:
        assert resolve_pointer(docs[text["provenance"]["source"]], text["provenance"]["pointer"]) == text["text"]
    for fact in case["runtime_facts"]["facts"]:
        target = resolve_pointer(docs[fact["provenance"]["source"]], fact["provenance"]["pointer"])
        assert target["name"] == fact["name"]
        if "value" in fact:
            assert target["value"] == fact["value"]
        else:
            assert resolve_pointer(docs[fact["value_ref"]["source"]], fact["value_ref"]["pointer"]) == target["value"]
    for entity in case["entities"]:
        for source in entity["sources"]:
            target = resolve_pointer(docs[source["source"]], source["pointer"])
            assert target["type"] == entity["type"] and str(target["id"]) == entity["id"]
    for repro in case["reproduction"]["reproductions"]:
        for step in repro["steps"]:
            assert resolve_pointer(docs[repro["source"]], step["pointer"]) == step["text"]
    for decl in case["expected_behavior"]["declarations"]:
        assert resolve_pointer(docs[decl["source"]], decl["pointer"]) is decl["value"]
    for conflict in case["data_quality"]["claim_conflicts"]:
        for value in conflict["values"]:
            assert resolve_pointer(docs[value["source"]], value["pointer"])["claim"]["value"] == value["value"]


def test_observations_follow_inventory_order_not_role():
    snap = snapshot(
        [("b/report2", report(observations=[{"text": "r2"}]), 2), ("a/report1", report(observations=[{"text": "r1"}]), 0)],
        [("c/repro", reproduction(observations=[{"text": "p1"}, {"text": "p2"}]), 1)],
    )
    case = assemble(snap)
    obs = case["human_observations"]["observations"]
    assert [(s["id"], s["text"]) for s in obs] == [("O0001", "r1"), ("O0002", "p1"), ("O0003", "p2"), ("O0004", "r2")]
    assert case["reproduction"]["reproductions"][0]["observation_ids"] == ["O0002", "O0003"]
    assert [r["path"] for r in case["inputs"]["reports"]] == ["a/report1", "b/report2"]


def test_reproduction_ids_follow_inventory_order_with_steps_facts_and_refs():
    snap = snapshot(
        [],
        [("z/second", reproduction(facts=[{"name": "n", "value": None}]), 5),
         ("a/first", reproduction(steps=["s1"], events_ref="ev.bin", attachments=["att.png"]), 1)],
        files=["ev.bin", "att.png"],
    )
    case = assemble(snap)
    repros = case["reproduction"]["reproductions"]
    assert [(r["id"], r["source"]) for r in repros] == [("R0001", "a/first"), ("R0002", "z/second")]
    assert repros[0]["steps"] == [{"text": "s1", "pointer": "/steps/0"}]
    assert repros[0]["events_ref"] == {"path": "ev.bin", **snap["files"]["ev.bin"]}
    assert repros[0]["attachments"] == [{"path": "att.png", **snap["files"]["att.png"]}]
    assert repros[1]["events_ref"] is None and repros[1]["attachments"] == []
    assert repros[1]["fact_ids"] == ["F0001"]
    assert case["runtime_facts"]["facts"][0] == {"id": "F0001", "name": "n", "value": None,
                                                  "provenance": {"kind": "reproduction", "source": "z/second", "pointer": "/facts/0"}}
    check_contract(case)


# --------------------------------------------------------------------------- ids


def test_prior_ids_are_kept_and_new_records_numbered_after_the_highest():
    first = snapshot([("r1", report(observations=[{"text": "a"}, {"text": "b"}], comments=[{"text": "c"}]), 0)])
    case1 = assemble(first)
    # Pretend a later prior case had already used O0007 (e.g. a record whose source was dropped).
    prior = copy.deepcopy(case1)
    prior["human_observations"]["observations"][1]["id"] = "O0007"
    second = snapshot(
        [("r1", report(observations=[{"text": "a"}, {"text": "b"}], comments=[{"text": "c"}]), 0),
         ("r2", report(observations=[{"text": "d"}], comments=[{"text": "e"}]), 1)],
        prior=as_prior(prior),
    )
    case2 = assemble(second)
    assert [s["id"] for s in case2["human_observations"]["observations"]] == ["O0001", "O0007", "O0008"]
    assert [s["id"] for s in case2["human_observations"]["comments"]] == ["C0001", "C0002"]
    assert case2["inputs"]["prior_case"] == {k: second["prior_case"][k] for k in ("path", "sha256", "size")}


def test_incompatible_prior_case_is_rejected():
    snap = snapshot([("r1", report(title="x"), 0)])
    case = assemble(snap)
    for mutate in (lambda c: c.update(format_version=2),
                   lambda c: c["human_observations"].pop("comments"),
                   lambda c: c["human_observations"]["observations"].append(
                       {"id": "X1", "text": "t", "provenance": {"kind": "tester_report", "source": "s", "pointer": "/x"}})):
        bad = copy.deepcopy(case)
        mutate(bad)
        with pytest.raises(CaseBuildError) as err:
            assemble(snapshot([("r1", report(title="x"), 0)], prior=as_prior(bad)))
        assert err.value.code == "INCOMPATIBLE_CASE"


@pytest.mark.parametrize("bad_id", ["O12", "O001", "C0002", "X0001", "O\u0660\u0661\u0662\u0663", "O0001\n", "O+001", 7, None, ""])
def test_a_prior_id_that_is_not_its_namespace_letter_and_four_ascii_digits_is_incompatible(bad_id):
    observed = report(observations=[{"text": "a"}, {"text": "b"}])
    case = assemble(snapshot([("r1", observed, 0)]))
    case["human_observations"]["observations"][1]["id"] = bad_id
    with pytest.raises(CaseBuildError) as err:
        assemble(snapshot([("r1", observed, 0)], prior=as_prior(case)))
    assert err.value.code == "INCOMPATIBLE_CASE"


def test_prior_ids_are_kept_and_new_ones_follow_the_highest():
    observed = report(observations=[{"text": "a"}, {"text": "b"}])
    case = assemble(snapshot([("r1", observed, 0)]))
    case["human_observations"]["observations"][0]["id"] = "O00012"
    case["human_observations"]["observations"][1]["id"] = "O0003"
    again = assemble(snapshot([("r1", observed, 0), ("r2", report(observations=[{"text": "c"}]), 1)], prior=as_prior(case)))
    assert [o["id"] for o in again["human_observations"]["observations"]] == ["O00012", "O0003", "O0013"]
    repeated = copy.deepcopy(case)
    repeated["human_observations"]["observations"][1]["id"] = "O00012"
    with pytest.raises(CaseBuildError) as err:
        assemble(snapshot([("r1", observed, 0)], prior=as_prior(repeated)))
    assert err.value.code == "INCOMPATIBLE_CASE"


def test_same_document_listed_twice_is_a_duplicate_source():
    snap = snapshot([("r1", report(observations=[{"text": "a"}]), 0), ("r1", report(observations=[{"text": "a"}]), 1)])
    with pytest.raises(CaseBuildError) as err:
        assemble(snap)
    assert err.value.code == "DUPLICATE_SOURCE" and err.value.path == "r1"


_statement_st = st.fixed_dictionaries({"text": st.sampled_from(["a", "b", "c"])},
                                      optional={"claim": st.fixed_dictionaries({"key": st.sampled_from(["k1", "k2"]),
                                                                                "value": st.integers(0, 2)})})
_report_st = st.builds(
    lambda o, c, t, e, ents: report(observations=o, comments=c, tester_hypotheses=t, expected_behavior=e, entities=ents),
    st.lists(_statement_st, max_size=3), st.lists(_statement_st, max_size=2), st.lists(_statement_st, max_size=2),
    st.lists(_statement_st, max_size=2),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["component", "user"]), "id": st.sampled_from([1, "1", 2]),
                                    "roles": st.lists(st.sampled_from(["focus", "observed"]), max_size=2)}), max_size=2),
)
_repro_st = st.builds(
    lambda o, f: reproduction(observations=o, facts=f),
    st.lists(_statement_st, max_size=2),
    st.lists(st.fixed_dictionaries({"name": st.sampled_from(["x", "y"]), "value": st.integers()}), max_size=2),
)
_docs_st = st.lists(st.one_of(st.tuples(st.just("report"), _report_st), st.tuples(st.just("repro"), _repro_st)), max_size=5)


def _snap_from(docs):
    reports = [(f"doc/{i}", d, i) for i, (role, d) in enumerate(docs) if role == "report"]
    repros = [(f"doc/{i}", d, i) for i, (role, d) in enumerate(docs) if role == "repro"]
    return snapshot(reports, repros)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_docs_st, _docs_st)
def test_appending_documents_never_changes_earlier_records(old_docs, new_docs):
    first = _snap_from(old_docs)
    case1 = assemble(first)
    second = _snap_from(old_docs + new_docs)
    second["prior_case"] = as_prior(case1)
    case2 = assemble(second)
    check_contract(case2)

    def records(case):
        out = {}
        for statement in all_statements(case):
            out[(statement["provenance"]["source"], statement["provenance"]["pointer"])] = statement
        for fact in case["runtime_facts"]["facts"]:
            out[(fact["provenance"]["source"], fact["provenance"]["pointer"])] = fact
        for repro in case["reproduction"]["reproductions"]:
            out[(repro["source"], "R")] = {k: v for k, v in repro.items()}
        return out

    old, new = records(case1), records(case2)
    for key, record in old.items():
        assert new[key] == record
    # ids are unique per namespace
    ids = [r["id"] for r in new.values()]
    assert len(ids) == len(set(ids))
    # entities only grow: earlier roles and sources stay as a prefix
    new_entities = {(e["type"], e["id"]): e for e in case2["entities"]}
    for entity in case1["entities"]:
        grown = new_entities[(entity["type"], entity["id"])]
        assert grown["roles"][: len(entity["roles"])] == entity["roles"]
        assert grown["sources"][: len(entity["sources"])] == entity["sources"]


# --------------------------------------------------------------------------- entities


def test_integer_and_string_entity_ids_merge_roles_and_sources():
    case = assemble(rich_snapshot())
    assert case["entities"] == [
        {"type": "component", "id": "42", "roles": ["focus", "observed"],
         "sources": [{"kind": "tester_report", "source": "original/report.data", "pointer": "/entities/0"},
                     {"kind": "reproduction", "source": "original/reproduction.data", "pointer": "/entities/0"}]},
        {"type": "user", "id": "7", "roles": [],
         "sources": [{"kind": "reproduction", "source": "original/reproduction.data", "pointer": "/entities/1"}]},
    ]


def test_entities_of_different_types_or_ids_stay_apart():
    rep = report(entities=[{"type": "a", "id": 1, "roles": []}, {"type": "b", "id": "1", "roles": ["x"]},
                           {"type": "a", "id": "01", "roles": []}, {"type": "a", "id": "1", "roles": ["y"]}])
    case = assemble(snapshot([("r", rep, 0)]))
    assert [(e["type"], e["id"], e["roles"]) for e in case["entities"]] == [("a", "1", ["y"]), ("b", "1", ["x"]), ("a", "01", [])]


@pytest.mark.parametrize("bad", [True, False, 1.0, None, [1]])
def test_boolean_or_float_entity_id_is_not_an_integer(bad):
    with pytest.raises(CaseBuildError) as err:
        assemble(snapshot([("r", report(entities=[{"type": "a", "id": "x"}, {"type": "a", "id": bad, "roles": []}]), 0)]))
    assert err.value.code == "SCHEMA_VIOLATION" and err.value.path == "r" and err.value.pointer == "/entities/1/id"


# --------------------------------------------------------------------------- completeness


@pytest.mark.parametrize(
    ("declared", "statements", "expected"),
    [
        ([True, False], True, "conflicting"),
        ([False, True], False, "conflicting"),
        ([True], True, "reported_complete"),
        ([True, True], False, "reported_complete"),
        ([False], True, "reported_partial"),
        ([None], True, "unspecified"),
        ([None], False, "missing"),
        ([], False, "missing"),
    ],
)
def test_completeness_from_explicit_declarations(declared, statements, expected):
    reports = []
    for i, value in enumerate(declared):
        fields = {"expected_behavior": [{"text": f"e{i}"}]} if statements else {}
        if value is not None:
            fields["expected_behavior_complete"] = value
        reports.append((f"r{i}", report(**fields), i))
    case = assemble(snapshot(reports))
    eb = case["expected_behavior"]
    assert eb["completeness"] == expected
    assert eb["declarations"] == [{"value": v, "source": f"r{i}", "pointer": "/expected_behavior_complete"}
                                  for i, v in enumerate(declared) if v is not None]
    assert eb["sufficiency"] == ("complete" if expected == "reported_complete" else "partial")
    check_contract(case)


def test_expected_behavior_claim_conflict_makes_completeness_conflicting():
    rep = report(expected_behavior=[{"text": "on", "claim": {"key": "s", "value": 1}},
                                    {"text": "off", "claim": {"key": "s", "value": 2}}],
                 expected_behavior_complete=True)
    case = assemble(snapshot([("r", rep, 0)]))
    assert case["expected_behavior"]["completeness"] == "conflicting"
    assert case["expected_behavior"]["sufficiency"] == "partial"
    assert case["research"]["request"] is not None


# --------------------------------------------------------------------------- claim conflicts


def test_claim_conflicts_are_listed_with_source_references():
    case = assemble(rich_snapshot())
    assert case["data_quality"]["claim_conflicts"] == []  # report "off" and reproduction "off" agree
    rep = report(observations=[{"text": "a", "claim": {"key": "k", "value": {"x": 1, "y": [1]}}},
                               {"text": "b", "claim": {"key": "other", "value": 1}}],
                 expected_behavior=[{"text": "e1", "claim": {"key": "k", "value": 1}}])
    repro = reproduction(observations=[{"text": "c", "claim": {"key": "k", "value": {"y": [1], "x": 1.0}}},
                                       {"text": "d", "claim": {"key": "k", "value": {"x": 2, "y": [1]}}}])
    case = assemble(snapshot([("r", rep, 0)], [("p", repro, 1)]))
    assert case["data_quality"]["claim_conflicts"] == [
        {"block": "human_observations", "key": "k", "values": [
            {"value": {"x": 1, "y": [1]}, "id": "O0001", "source": "r", "pointer": "/observations/0"},
            {"value": {"y": [1], "x": 1.0}, "id": "O0003", "source": "p", "pointer": "/observations/0"},
            {"value": {"x": 2, "y": [1]}, "id": "O0004", "source": "p", "pointer": "/observations/1"},
        ]},
    ]
    check_contract(case)


def test_equal_canonical_values_do_not_conflict():
    rep = report(observations=[{"text": "a", "claim": {"key": "k", "value": {"a": 1, "b": 2}}},
                               {"text": "b", "claim": {"key": "k", "value": {"b": 2.0, "a": 1}}}])
    assert assemble(snapshot([("r", rep, 0)]))["data_quality"]["claim_conflicts"] == []


def test_expected_behavior_conflicts_stay_within_their_block():
    rep = report(observations=[{"text": "a", "claim": {"key": "k", "value": 1}}],
                 expected_behavior=[{"text": "b", "claim": {"key": "k", "value": 2}},
                                    {"text": "c", "claim": {"key": "k", "value": 3}}])
    conflicts = assemble(snapshot([("r", rep, 0)]))["data_quality"]["claim_conflicts"]
    assert [(c["block"], [v["id"] for v in c["values"]]) for c in conflicts] == [("expected_behavior", ["E0001", "E0002"])]


def test_comments_and_hypotheses_never_produce_conflicts():
    rep = report(observations=[{"text": "a", "claim": {"key": "k", "value": 1}}],
                 comments=[{"text": "b", "claim": {"key": "k", "value": 2}}],
                 tester_hypotheses=[{"text": "c", "claim": {"key": "k", "value": 3}},
                                    {"text": "d", "claim": {"key": "h", "value": 4}},
                                    {"text": "e", "claim": {"key": "h", "value": 5}}],
                 expected_behavior=[{"text": "f", "claim": {"key": "h", "value": 6}}])
    case = assemble(snapshot([("r", rep, 0)]))
    assert case["data_quality"]["claim_conflicts"] == []
    assert case["runtime_facts"]["facts"] == []
    # the claims are still kept, verbatim, on their statements
    assert case["human_observations"]["tester_hypotheses"][0]["claim"] == {"key": "k", "value": 3}


# --------------------------------------------------------------------------- facts


def test_fact_value_inline_at_the_limit_and_value_ref_just_over():
    at_limit = "x" * 8  # canonical JSON: 10 bytes with quotes
    over = "x" * 9
    repro = reproduction(facts=[{"name": "at", "value": at_limit}, {"name": "over", "value": over}])
    case = assemble(snapshot([], [("p", repro, 0)], limit=10))
    at, big = case["runtime_facts"]["facts"]
    assert at["value"] == at_limit and "value_ref" not in at
    assert big["value_ref"] == {"source": "p", "pointer": "/facts/1/value"} and "value" not in big
    assert resolve_pointer(repro, big["value_ref"]["pointer"]) == over  # nothing truncated
    check_contract(case)


def test_null_fact_value_stays_a_real_value():
    case = assemble(snapshot([], [("p", reproduction(facts=[{"name": "n", "value": None}]), 0)]))
    assert case["runtime_facts"]["facts"][0]["value"] is None
    fact = decode_case(pretty_bytes(case)).runtime_facts.facts[0]
    assert fact.value is None and fact.value_ref is msgspec.UNSET


# --------------------------------------------------------------------------- references, context, gaps


@pytest.mark.parametrize(("field", "value", "pointer"), [
    ("events_ref", "../outside", "/events_ref"),
    ("events_ref", "/abs/path", "/events_ref"),
    ("attachments", ["ok.png", "a\\b"], "/attachments/1"),
    ("attachments", ["C:evil"], "/attachments/0"),
])
def test_unsafe_reference_is_refused_with_referring_path_and_pointer(field, value, pointer):
    snap = snapshot([], [("p", reproduction(**{field: value}), 0)], files=["ok.png"])
    with pytest.raises(CaseBuildError) as err:
        assemble(snap)
    assert (err.value.code, err.value.path, err.value.pointer) == ("REFERENCE_UNSAFE", "p", pointer)


def test_absent_reference_is_missing():
    snap = snapshot([], [("p", reproduction(attachments=["gone.png"]), 0)])
    with pytest.raises(CaseBuildError) as err:
        assemble(snap)
    assert (err.value.code, err.value.path, err.value.pointer) == ("REFERENCE_MISSING", "p", "/attachments/0")


@pytest.mark.parametrize("builder_file", ["case/revisions/0001/case.json", "case/revisions/0002/case-built.json", "inputs/3/reopen.json"])
def test_a_reference_to_what_the_builder_writes_is_unsafe_not_missing(builder_file):
    # Those files are in the package (its manifest lists them), so "not in
    # the package" would be false; they are never inputs.
    snap = snapshot([], [("p", reproduction(events_ref=builder_file), 0)])
    with pytest.raises(CaseBuildError) as err:
        assemble(snap)
    assert (err.value.code, err.value.path, err.value.pointer) == ("REFERENCE_UNSAFE", "p", "/events_ref")
    assert "written by the builder" in err.value.message


def test_absent_index_attachment_names_the_index():
    snap = snapshot([("r", report(title="t"), 0)], attachments=["gone.txt"])
    with pytest.raises(CaseBuildError) as err:
        assemble(snap)
    assert (err.value.code, err.value.path, err.value.pointer) == ("REFERENCE_MISSING", "original/case-inputs.json", "/attachments/0")


def test_report_attachments_are_opaque_references_with_their_report_and_pointer():
    """ARCHITECTURE section 12: reports' attachments are content paths, as a
    reproduction's are. Each becomes its own record in document order, a
    file attached twice included, pointing at the string that names it."""
    first = report(title="t", attachments=["shot.png", "log.txt", "shot.png"])
    second = report(attachments=["log.txt"])
    snap = snapshot([("r1", first, 0), ("r2", second, 1)], files=["shot.png", "log.txt"])
    case = assemble(snap)
    check_contract(case)
    got = case["bug"]["attachments"]
    assert [(a["path"], a["provenance"]["source"], a["provenance"]["pointer"]) for a in got] == [
        ("shot.png", "r1", "/attachments/0"), ("log.txt", "r1", "/attachments/1"),
        ("shot.png", "r1", "/attachments/2"), ("log.txt", "r2", "/attachments/0"),
    ]
    for attachment in got:
        assert attachment["provenance"]["kind"] == "tester_report"
        assert {k: attachment[k] for k in ("sha256", "size")} == {k: snap["files"][attachment["path"]][k] for k in ("sha256", "size")}
        source = {"r1": first, "r2": second}[attachment["provenance"]["source"]]
        assert resolve_pointer(source, attachment["provenance"]["pointer"]) == attachment["path"]
    # Nothing else is inferred from them: no statement, no entity, no fact.
    assert case["entities"] == [] and case["runtime_facts"]["facts"] == []


def test_a_report_without_attachments_has_none_in_the_case():
    case = assemble(snapshot([("r", report(title="t"), 0)]))
    assert case["bug"]["attachments"] == []
    check_contract(case)


@pytest.mark.parametrize(("value", "code", "pointer"), [
    (["../outside"], "REFERENCE_UNSAFE", "/attachments/0"),
    (["ok.png", "/abs"], "REFERENCE_UNSAFE", "/attachments/1"),
    (["ok.png", "gone.png"], "REFERENCE_MISSING", "/attachments/1"),
    (["case/revisions/0001/case.json"], "REFERENCE_UNSAFE", "/attachments/0"),
])
def test_a_report_attachment_that_does_not_resolve_names_the_report_and_pointer(value, code, pointer):
    snap = snapshot([("r", report(title="t", attachments=value), 0)], files=["ok.png"])
    with pytest.raises(CaseBuildError) as err:
        assemble(snap)
    assert (err.value.code, err.value.path, err.value.pointer) == (code, "r", pointer)


def test_context_blocks_unclassified_and_supplied_research_stay_opaque():
    snap = rich_snapshot()
    case = assemble(snap)
    files = snap["files"]

    def r(p):
        return {"path": p, **files[p]}

    assert case["runtime_facts"]["context"] == [r("original/runtime.bin")]
    assert case["database_context"] == [r("original/db.sql")]
    assert case["source_context"] == [r("original/src.tar")]
    assert case["research"]["supplied"] == [r("original/research.pdf")]
    assert case["research"]["results"] == []
    assert all(s["origin"] == "tester" for s in case["expected_behavior"]["statements"])
    assert case["inputs"]["attachments"] == [r("original/index-attachment.txt")]
    assert case["inputs"]["unclassified"] == [ref("original/unknown.bin", 5)]
    assert case["inputs"]["index"] == snap["index"] and case["inputs"]["index_history"] == [snap["index"]]
    assert case["data_quality"]["gaps"] == []
    check_contract(case)


def test_missing_index_gives_gaps_not_an_error():
    case = assemble(snapshot(index=False))
    assert [g["code"] for g in case["data_quality"]["gaps"]] == ["MISSING_INDEX", "NO_REPORTS", "NO_REPRODUCTIONS", "NO_EXPECTED_BEHAVIOR"]
    assert case["inputs"]["index"] is None and case["expected_behavior"]["completeness"] == "missing"
    assert case["expected_behavior"]["status"] is None
    check_contract(case)


def test_gaps_when_applicable():
    case = assemble(snapshot([("r", report(title="t"), 0)]))
    assert [g["code"] for g in case["data_quality"]["gaps"]] == ["NO_REPRODUCTIONS", "NO_EXPECTED_BEHAVIOR"]
    case = assemble(snapshot([], [("p", reproduction(), 0)]))
    assert [g["code"] for g in case["data_quality"]["gaps"]] == ["NO_REPORTS", "NO_EXPECTED_BEHAVIOR"]


# --------------------------------------------------------------------------- research


def research_result(request, *, status="partial", statements=None, sources=None):
    sources = sources if sources is not None else [
        {"url": "https://example.org/spec", "title": "Spec", "retrieved_at": "2026-01-01T00:00:00Z", "excerpt": "turns on"}]
    return {
        "format": "viano-research-result", "format_version": 1,
        "provider": {"name": "test", "version": "1"},
        "request_hash": canonical_hash(request), "scope": "intended_behavior", "status": status,
        "statements": statements if statements is not None else [{"text": "The switch turns on within 1 s", "citations": [0]}],
        "sources": sources,
    }


def research_doc(request, result, seq=100):
    h = canonical_hash(request)
    item = doc(f"research/{h}/result.json", result, seq)
    item["request"] = doc(f"research/{h}/request.json", request, seq)
    return item


def test_research_request_shape_and_hash():
    case = assemble(rich_snapshot())
    request = case["research"]["request"]
    assert request == {
        "format": "viano-research-request", "format_version": 1,
        "case_id": "case-A", "package_id": "pkg-1", "analysis_revision": 1,
        "project": {"name": "demo", "version": "1.0"}, "scope": "intended_behavior",
        "completeness": "reported_partial",
        "bug": {"titles": ["A generic observed problem"], "summaries": ["Switch stays off"]},
        "entities": [{"type": "component", "id": "42"}, {"type": "user", "id": "7"}],
        "tester_expectations": [{"id": "E0001", "text": "The switch turns on"}],
    }
    assert case["research"]["request_hash"] == canonical_hash(request)
    text = canonical_bytes(request).decode()
    for local in ("runtime.bin", "db.sql", "src.tar", "events.bin", "exit_code", "Nothing happens", "timing", "package_generation"):
        assert local not in text
    contracts.validate("research-request", request)


def test_no_research_request_when_reported_complete():
    rep = report(expected_behavior=[{"text": "on"}], expected_behavior_complete=True)
    case = assemble(snapshot([("r", rep, 0)]))
    assert case["research"]["request"] is None and case["research"]["request_hash"] is None
    assert build_research_request(case) is None
    check_contract(case)


def test_research_request_does_not_depend_on_generation():
    a = assemble(rich_snapshot(generation=1))["research"]
    b = assemble(rich_snapshot(generation=7))["research"]
    assert a["request"] == b["request"] and a["request_hash"] == b["request_hash"]


def test_research_results_are_appended_with_stable_e_ids_and_citations():
    base = rich_snapshot()
    before = assemble(base)
    request = before["research"]["request"]
    result = research_result(request, statements=[{"text": "Turns on", "citations": [0]}, {"text": "Lamp lit", "citations": []}])
    enriched = rich_snapshot(expected_research=[research_doc(request, result)], prior=as_prior(before))
    case = assemble(enriched)
    eb = case["expected_behavior"]
    assert eb["statements"][0] == before["expected_behavior"]["statements"][0]  # tester kept, never replaced
    ext = eb["statements"][1:]
    assert [(s["id"], s["origin"], s["text"]) for s in ext] == [("E0002", "external_research", "Turns on"),
                                                               ("E0003", "external_research", "Lamp lit")]
    assert ext[0]["provenance"] == {"kind": "external_research", "source": enriched["expected_research"][0]["path"], "pointer": "/statements/0"}
    assert ext[0]["citations"] == [result["sources"][0]] and ext[1]["citations"] == []
    assert eb["status"] == "combined" and eb["completeness"] == "reported_partial" and eb["sufficiency"] == "partial"
    assert case["research"]["request"] == request and case["research"]["request_hash"] == before["research"]["request_hash"]
    assert case["research"]["results"] == [{
        "path": enriched["expected_research"][0]["path"], "sha256": enriched["expected_research"][0]["sha256"],
        "request_hash": canonical_hash(request),
        "request": {k: enriched["expected_research"][0]["request"][k] for k in ("path", "sha256", "size")},
        "provider": {"name": "test", "version": "1"}, "status": "partial", "statement_ids": ["E0002", "E0003"]}]
    assert case["research"]["results"][0]["request"]["path"].endswith("/request.json")
    assert case["inputs"]["expected_research"] == [{k: enriched["expected_research"][0][k] for k in ("path", "sha256", "size")}]
    docs = documents(enriched)
    for s in ext:
        assert resolve_pointer(docs[s["provenance"]["source"]], s["provenance"]["pointer"])["text"] == s["text"]
    check_contract(case)

    # A later tester report gets the next E number; external ids stay.
    more = rich_snapshot(expected_research=[research_doc(request, result)], prior=as_prior(case))
    more["reports"].append(doc("original/report2.data", report(expected_behavior=[{"text": "also"}]), 2))
    more["files"]["original/report2.data"] = {"sha256": more["reports"][-1]["sha256"], "size": more["reports"][-1]["size"]}
    later = assemble(more)
    assert [(s["id"], s["origin"]) for s in later["expected_behavior"]["statements"]] == [
        ("E0001", "tester"), ("E0004", "tester"), ("E0002", "external_research"), ("E0003", "external_research")]


def test_complete_research_makes_external_only_expected_behavior_sufficient():
    base = snapshot([("r", report(title="t"), 0)])
    request = assemble(base)["research"]["request"]
    result = research_result(request, status="complete")
    case = assemble(snapshot([("r", report(title="t"), 0)], expected_research=[research_doc(request, result)]))
    eb = case["expected_behavior"]
    assert eb["status"] == "external_research" and eb["sufficiency"] == "complete" and eb["completeness"] == "missing"
    assert "NO_EXPECTED_BEHAVIOR" not in [g["code"] for g in case["data_quality"]["gaps"]]
    check_contract(case)


def test_research_cannot_clear_claim_conflicts():
    rep = report(expected_behavior=[{"text": "a", "claim": {"key": "k", "value": 1}}, {"text": "b", "claim": {"key": "k", "value": 2}}])
    request = assemble(snapshot([("r", rep, 0)]))["research"]["request"]
    case = assemble(snapshot([("r", rep, 0)], expected_research=[research_doc(request, research_result(request, status="complete"))]))
    assert case["expected_behavior"]["completeness"] == "conflicting"
    assert len(case["data_quality"]["claim_conflicts"]) == 1


def test_research_result_with_wrong_hash_or_citation_is_invalid():
    request = assemble(snapshot([("r", report(title="t"), 0)]))["research"]["request"]
    bad_hash = research_result(request)
    bad_hash["request_hash"] = "0" * 64
    bad_cite = research_result(request, statements=[{"text": "x", "citations": [3]}])
    other_case = dict(request, case_id="other")
    cases = [
        (research_doc(request, bad_hash), "/request_hash"),
        (research_doc(request, bad_cite), "/statements/0/citations/0"),
        (research_doc(other_case, research_result(other_case)), None),
        (research_doc(dict(request, analysis_revision=5), research_result(dict(request, analysis_revision=5))), None),
    ]
    for item, pointer in cases:
        with pytest.raises(CaseBuildError) as err:
            assemble(snapshot([("r", report(title="t"), 0)], expected_research=[item]))
        assert err.value.code == "RESEARCH_INVALID" and err.value.pointer == pointer


# --------------------------------------------------------------------------- determinism and contract


def _reorder(value):
    """The same JSON with every dict's keys inserted in reverse order."""
    if isinstance(value, dict):
        return {k: _reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reorder(v) for v in value]
    return value


def test_deterministic_and_independent_of_key_insertion_order():
    snap = rich_snapshot(limit=4)
    frozen = copy.deepcopy(snap)
    one = pretty_bytes(assemble(snap))
    assert pretty_bytes(assemble(snap)) == one
    assert snap == frozen  # the snapshot is not mutated
    assert pretty_bytes(assemble(_reorder(snap))) == one
    assert canonical_bytes(assemble(copy.deepcopy(snap))) == canonical_bytes(json.loads(one))


def test_output_shares_no_mutable_objects_with_the_snapshot():
    snap = rich_snapshot()
    case = assemble(snap)
    case["runtime_facts"]["facts"][1]["value"]["a"].append(99)
    case["case"]["project"]["name"] = "changed"
    assert snap["reproductions"][0]["document"]["facts"][1]["value"] == {"a": [1, 2]}
    assert snap["manifest"]["project"]["name"] == "demo"


def test_rich_case_validates_and_decodes():
    case = assemble(rich_snapshot(limit=4))
    check_contract(case)
    decoded = decode_case(pretty_bytes(case))
    assert decoded.case.case_id == "case-A"
    assert decoded.runtime_facts.facts[1].value_ref.pointer == "/facts/1/value"


def test_schema_and_structs_refuse_what_the_contract_forbids():
    case = assemble(rich_snapshot())
    validator = schema_validator()
    bad = copy.deepcopy(case)
    bad["human_observations"]["observations"][0]["observed_at"] = "2026-01-02T03:04:05"  # naive: format checker active
    assert not validator.is_valid(bad)
    bad = copy.deepcopy(case)
    bad["extra"] = 1
    assert not validator.is_valid(bad)
    with pytest.raises(msgspec.ValidationError):
        decode_case(pretty_bytes(bad))
    bad = copy.deepcopy(case)
    bad["runtime_facts"]["facts"][0]["value_ref"] = {"source": "p", "pointer": "/facts/0/value"}
    assert not validator.is_valid(bad)
    with pytest.raises(msgspec.ValidationError):
        decode_case(pretty_bytes(bad))


def test_structs_mirror_the_schema():
    """Parity: every Struct has exactly its schema object's properties and required set."""
    from contracts import case_structs as cs

    schema = contracts.SCHEMAS["case"]
    defs = schema["$defs"]
    props = schema["properties"]
    eb = props["expected_behavior"]["properties"]
    pairs = {
        cs.Ref: defs["ref"], cs.Provenance: defs["provenance"], cs.SourcePointer: defs["source_pointer"],
        cs.Text: defs["text"], cs.Claim: defs["claim"], cs.Observation: defs["observation"],
        cs.Comment: defs["comment"], cs.TesterHypothesis: defs["hypothesis"], cs.Citation: defs["citation"],
        cs.ExpectedStatement: defs["expected_statement"], cs.Fact: defs["fact"], cs.Reproduction: defs["reproduction"],
        cs.Entity: defs["entity"], cs.ResearchResult: defs["research_result"], cs.Gap: defs["gap"],
        cs.ClaimConflict: defs["claim_conflict"], cs.ConflictValue: defs["claim_conflict"]["properties"]["values"]["items"],
        cs.Provider: defs["research_result"]["properties"]["provider"], cs.Case: schema,
        cs.CaseIdentity: props["case"], cs.Bug: props["bug"], cs.HumanObservations: props["human_observations"],
        cs.ExpectedBehavior: props["expected_behavior"], cs.Declaration: eb["declarations"]["items"],
        cs.Step: defs["reproduction"]["properties"]["steps"]["items"], cs.ReproductionBlock: props["reproduction"],
        cs.RuntimeFacts: props["runtime_facts"], cs.Research: props["research"], cs.DataQuality: props["data_quality"],
        cs.Inputs: props["inputs"],
    }
    for struct, obj in pairs.items():
        fields = msgspec.structs.fields(struct)
        assert {f.name for f in fields} == set(obj["properties"]), struct
        assert {f.name for f in fields if f.required} == set(obj["required"]), struct
        assert obj["additionalProperties"] is False, struct


@pytest.mark.parametrize("ref", ["ok/file.txt", "", "/abs", "a/../b", "a//b", "./a", "a\\b", "C:x", "a\x00b", "a\nb",
                                 "a\u202eb", "%2e%2e/x", 7])
def test_local_reference_check_agrees_with_workspace(ref):
    from pipeline import assemble as module
    from pipeline.workspace import check_reference as workspace_check

    def outcome(check):
        try:
            return check(ref)
        except CaseBuildError as exc:
            return exc.code

    assert outcome(module._local_check_reference) == outcome(workspace_check)


def test_claim_keys_and_entity_types_differing_only_by_normalisation_are_a_gap_not_merged():
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    first = ("original/a.json", {
        "format": "viano-bug-report", "format_version": 1,
        "observations": [{"text": "one", "claim": {"key": composed, "value": 1}}],
        "entities": [{"type": composed, "id": "1"}],
    }, 0)
    second = ("original/b.json", {
        "format": "viano-bug-report", "format_version": 1,
        "observations": [{"text": "two", "claim": {"key": decomposed, "value": 2}}],
        "entities": [{"type": decomposed, "id": "1"}],
    }, 1)
    case = assemble(snapshot(reports=[first, second]))
    assert case["data_quality"]["claim_conflicts"] == []  # compared code point for code point
    assert len(case["entities"]) == 2  # not merged
    gaps = [g for g in case["data_quality"]["gaps"] if g["code"] == "UNNORMALIZED_KEY"]
    assert [g["source"] for g in gaps] == ["original/b.json"]


def test_research_for_an_older_request_is_history_not_sufficiency():
    """Seed 000: historical research is traceable input, never asserted current."""
    old = report(title="t", expected_behavior=[{"text": "old expectation"}])
    old_request = assemble(snapshot([("r", old, 0)]))["research"]["request"]
    result = research_result(old_request, status="complete")
    new = report(title="t", expected_behavior=[{"text": "old expectation"}, {"text": "a new one"}])
    case = assemble(snapshot([("r", new, 0)], expected_research=[research_doc(old_request, result)]))
    assert case["research"]["request_hash"] != case["research"]["results"][0]["request_hash"]
    assert case["expected_behavior"]["sufficiency"] == "partial"
    current = assemble(snapshot([("r", new, 0)]))["research"]["request"]
    fresh = assemble(snapshot([("r", new, 0)], expected_research=[research_doc(current, research_result(current, status="complete"))]))
    assert fresh["expected_behavior"]["sufficiency"] == "complete"


def test_complete_research_never_makes_conflicting_expectations_sufficient():
    rep = report(expected_behavior=[{"text": "a", "claim": {"key": "k", "value": 1}}, {"text": "b", "claim": {"key": "k", "value": 2}}])
    request = assemble(snapshot([("r", rep, 0)]))["research"]["request"]
    case = assemble(snapshot([("r", rep, 0)], expected_research=[research_doc(request, research_result(request, status="complete"))]))
    assert case["expected_behavior"]["sufficiency"] == "partial"


def test_one_reports_complete_declaration_does_not_cover_anothers_undeclared_expectations():
    declared = report(expected_behavior=[{"text": "a"}], expected_behavior_complete=True)
    undeclared = report(expected_behavior=[{"text": "b"}])
    case = assemble(snapshot([("a", declared, 0), ("b", undeclared, 1)]))
    assert case["expected_behavior"]["completeness"] == "unspecified"
    assert case["research"]["request"] is not None
    both = assemble(snapshot([("a", declared, 0), ("b", report(expected_behavior=[{"text": "b"}], expected_behavior_complete=True), 1)]))
    assert both["expected_behavior"]["completeness"] == "reported_complete" and both["research"]["request"] is None


# --------------------------------------------------------------------------- fragments

_rich_statement_st = st.fixed_dictionaries(
    {"text": st.text(max_size=8)},
    optional={
        "author": st.text(max_size=4),
        "observed_at": st.just("2026-03-14T07:00:12+01:00"),
        "claim": st.fixed_dictionaries({"key": st.sampled_from(["k1", "k2"]),
                                        "value": st.one_of(st.integers(0, 2), st.text(max_size=30), st.lists(st.booleans(), max_size=2),
                                                           st.floats(allow_nan=False, allow_infinity=False))}),
    },
)
_rich_report_st = st.builds(
    lambda title, o, e, complete, ents: report(
        **({"title": title} if title is not None else {}), observations=o, expected_behavior=e,
        **({"expected_behavior_complete": complete} if complete is not None else {}), entities=ents),
    st.one_of(st.none(), st.text(max_size=5)), st.lists(_rich_statement_st, max_size=3), st.lists(_rich_statement_st, max_size=2),
    st.one_of(st.none(), st.booleans()),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["component", "user"]), "id": st.sampled_from([1, "1", 2]),
                                    "roles": st.lists(st.sampled_from(["focus", "observed"]), max_size=2)}), max_size=2),
)
_rich_repro_st = st.builds(
    lambda steps, o, f, events: reproduction(steps=steps, observations=o, facts=f, **({"events_ref": events} if events else {})),
    st.lists(st.text(max_size=5), max_size=2), st.lists(_rich_statement_st, max_size=2),
    st.lists(st.fixed_dictionaries({"name": st.sampled_from(["x", "y"]),
                                    "value": st.one_of(st.integers(), st.text(max_size=40), st.none(),
                                                       st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=2))}), max_size=3),
    st.sampled_from([None, "runtime/events.log"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.tuples(st.just("report"), _rich_report_st), st.tuples(st.just("repro"), _rich_repro_st)), max_size=6),
       st.integers(2, 40))
def test_cached_fragments_assemble_exactly_like_documents(docs, limit):
    from pipeline.assemble import document_fragment

    reports = [(f"doc/{i}", d, i) for i, (role, d) in enumerate(docs) if role == "report"]
    repros = [(f"doc/{i}", d, i) for i, (role, d) in enumerate(docs) if role == "repro"]
    plain = snapshot(reports, repros, files=["runtime/events.log"], limit=limit)
    cached = copy.deepcopy(plain)
    for role, key in (("report", "reports"), ("reproduction", "reproductions")):
        for entry in cached[key]:
            fragment = document_fragment(role, entry["path"], entry.pop("document"), limit)
            entry["fragment"] = json.loads(json.dumps(fragment))  # as the build cache stores it
    expected = pretty_bytes(assemble(plain))
    assert pretty_bytes(assemble(cached)) == expected
    # The build hands its freshly decoded fragments over (owned=True): same case.
    assert pretty_bytes(assemble(copy.deepcopy(cached), owned=True)) == expected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.tuples(st.just("report"), _rich_report_st), st.tuples(st.just("repro"), _rich_repro_st)), max_size=6),
       st.integers(2, 40))
def test_the_assembler_makes_no_float_of_its_own(docs, limit):
    """The build skips the float walk when its snapshot holds no float
    (pipeline.build._snapshot); that is sound only if assemble adds none."""
    from pipeline.jsoncanon import float_free

    reports = [(f"doc/{i}", d, i) for i, (role, d) in enumerate(docs) if role == "report"]
    repros = [(f"doc/{i}", d, i) for i, (role, d) in enumerate(docs) if role == "repro"]
    snap = snapshot(reports, repros, files=["runtime/events.log"], limit=limit)
    case = assemble(snap)
    if float_free(snap):
        assert float_free(case)
        assert pretty_bytes(case, known_float_free=True) == pretty_bytes(case)
    assert pretty_bytes(case) == (json.dumps(case, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def test_a_fragment_made_for_another_inline_limit_is_refused():
    from pipeline.assemble import document_fragment

    snap = snapshot(reproductions=[("doc/r", reproduction(facts=[{"name": "x", "value": "y" * 50}]), 0)], limit=100)
    snap["reproductions"][0]["fragment"] = document_fragment("reproduction", "doc/r", snap["reproductions"][0].pop("document"), 10)
    with pytest.raises(CaseBuildError) as caught:
        assemble(snap)
    assert caught.value.code == "INTEGRITY_ERROR" and caught.value.path == "doc/r"


def _with_floats(value):
    """``value`` with every number turned into a float and a float added to every object."""
    if isinstance(value, dict):
        return {**{k: _with_floats(v) for k, v in value.items()}, "x-float": 0.5}
    if isinstance(value, list):
        return [_with_floats(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value) + 0.25
    return value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.tuples(st.just("report"), _rich_report_st), st.tuples(st.just("repro"), _rich_repro_st)), max_size=5),
       st.integers(2, 40))
def test_the_prior_case_gives_the_case_no_float(docs, limit):
    """The build leaves the prior case's view out of its float walk
    (pipeline.build._snapshot): sound only if assemble takes nothing but id
    strings from it, whatever else the prior document holds."""
    from pipeline.jsoncanon import float_free
    from pipeline.prior import prior_case_view

    reports = [(f"doc/{i}", d, i) for i, (role, d) in enumerate(docs) if role == "report"]
    repros = [(f"doc/{i}", d, i) for i, (role, d) in enumerate(docs) if role == "repro"]
    first = assemble(snapshot(reports, repros, files=["runtime/events.log"], limit=limit))
    floated = _with_floats(first)
    # ids and provenance stay as they were: they are what _Ids reads and checks.
    for block, name in (("human_observations", "observations"), ("human_observations", "comments"),
                        ("human_observations", "tester_hypotheses"), ("expected_behavior", "statements"), ("runtime_facts", "facts")):
        floated[block][name] = [{**f, "id": o["id"], "provenance": o["provenance"]} for f, o in zip(floated[block][name], first[block][name])]
    floated["format_version"] = first["format_version"]
    for document in (floated, prior_case_view(floated)):
        second = snapshot(reports, repros, files=["runtime/events.log"], limit=limit, revision=2, generation=3,
                          prior=as_prior(first) | {"document": document})
        rest = {k: v for k, v in second.items() if k != "prior_case"}
        if float_free(rest):
            case = assemble(second)
            assert float_free(case)
            assert pretty_bytes(case, known_float_free=True) == pretty_bytes(case)


@pytest.mark.parametrize("path, generated", [
    ("case/revisions/0001/case.json", True),
    ("case/revisions/0012/case_summary.md", True),
    ("inputs/3/reopen.json", True),
    ("case/revisions/0001/case.json\n", False),  # Python's `$` would match before the newline
    ("inputs/3/reopen.json\n", False),
    ("case/revisions/001/case.json", False),
    ("original/case/revisions/0001/case.json", False),
])
def test_only_exact_output_and_control_paths_count_as_generated(path, generated):
    from pipeline.plan import is_generated

    assert is_generated(path) is generated


# --------------------------------------------------------------------------- the case's byte budget


def _attaching(count: int, path_length: int):
    """One report whose content path is ``path_length`` long, attaching one file ``count`` times."""
    path = "/".join(["d" * 250] * (path_length // 251)) + "/report.json"
    return snapshot([(path, report(title="t", attachments=["original/a"] * count), 0)], files=["original/a"])


def test_a_case_over_its_byte_limit_is_refused_while_its_records_are_made():
    """A 1 MiB report attaching one short file a quarter of a million times
    from a ~4 KB content path made a 1 GB case in memory before its size was
    checked; the bound stops it once the records pass the limit."""
    snap = _attaching(20_000, 3_800)  # ~80 MB of case.json
    snap["limits"]["case_bytes"] = 8 << 20
    with pytest.raises(CaseTooLarge) as refused:
        assemble(snap)
    assert refused.value.limit == 8 << 20
    assert (8 << 20) < refused.value.at_least < (8 << 20) + 8192  # stopped at the record that passed it
    del snap["limits"]["case_bytes"]  # a snapshot that names no limit (the seed's CaseAssembler) is not bounded
    assert len(assemble(snap)["bug"]["attachments"]) == 20_000


def test_a_reproduction_of_one_letter_steps_is_charged_its_pointers_too():
    """Each step's pointer is in case.json beside its text: 2 M one-letter
    steps (8 MiB of input) made a 184 MB case, encoded whole (1.1 GB of
    memory) before its size was known, as the bound charged only the texts."""
    snap = snapshot(reproductions=[("original/p.json", reproduction(steps=["x"] * 200_000), 0)])
    snap["limits"]["case_bytes"] = 1 << 20  # the texts alone are 200,000 bytes; with the pointers ~2.3 MB
    with pytest.raises(CaseTooLarge) as refused:
        assemble(snap)
    assert refused.value.at_least > 1 << 20
    del snap["limits"]["case_bytes"]
    assert len(pretty_bytes(assemble(snap))) > refused.value.at_least  # the bound stays below the real size


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_docs_st, st.integers(min_value=1, max_value=4), st.integers(min_value=0, max_value=3), st.integers(min_value=0, max_value=40))
def test_the_byte_bound_never_refuses_a_case_within_its_limit(docs, depth, attached, slack):
    """The bound charges only what the output surely holds, so a case is
    refused by it only when case.json would really be larger than the limit:
    assembling at exactly its own size (or more) passes, and the exact check
    after encoding stays the judge of the rest."""
    placed = [("/".join(["p" * 60] * depth) + f"/doc{i}", {**d, "attachments": ["original/a"] * attached} if role == "report" else d, i)
              for i, (role, d) in enumerate(docs)]
    snap = snapshot([p for p, (role, _) in zip(placed, docs) if role == "report"],
                    [p for p, (role, _) in zip(placed, docs) if role == "repro"], files=["original/a"])
    whole = pretty_bytes(assemble(snap))
    snap["limits"]["case_bytes"] = len(whole) + slack
    assert pretty_bytes(assemble(snap)) == whole


def test_an_entity_with_many_roles_keeps_each_role_once_in_first_appearance_order():
    roles = [f"r{i}" for i in range(5000)]
    snap = snapshot([("original/a.json", report(title="t", entities=[{"type": "t", "id": 1, "roles": roles + roles[::-1]}]), 0),
                     ("original/b.json", report(title="t", entities=[{"type": "t", "id": "1", "roles": ["new", *roles[:10]]}]), 1)])
    (entity,) = assemble(snap)["entities"]
    assert entity["roles"] == [*roles, "new"]


@pytest.mark.parametrize("with_limit", [False, True])
def test_the_byte_bound_charges_nothing_for_a_value_an_unvalidated_snapshot_holds_that_is_no_string(with_limit):
    """The Python API takes snapshots the contract never saw: a title, text,
    step or fact name that is no string assembled before the bound existed
    and must still (it raised TypeError from len())."""
    snap = snapshot([("original/a.json", report(title=123, observations=[{"text": 5}]), 0)],
                    [("original/b.json", reproduction(steps=[1, 2], facts=[{"name": 7, "value": 1}]), 1)])
    if with_limit:
        snap["limits"]["case_bytes"] = 8 << 20
    case = assemble(snap)
    assert case["bug"]["titles"][0]["text"] == 123 and [s["text"] for s in case["reproduction"]["reproductions"][0]["steps"]] == [1, 2]

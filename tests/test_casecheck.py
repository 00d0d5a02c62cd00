"""The build's record-by-record case check (pipeline/casecheck.py) decides
exactly as converting the whole case to the contract's Struct does."""

from __future__ import annotations

import copy

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.case_structs import Case, Observation
from pipeline.assemble import assemble
from pipeline.casecheck import RECORD_LISTS, check_case, record_key
from tests.test_assemble import _rich_repro_st, _rich_report_st, snapshot


def _case(docs, limit=40):
    reports = [(f"doc/{i}", d, i) for i, (role, d) in enumerate(docs) if role == "report"]
    repros = [(f"doc/{i}", d, i) for i, (role, d) in enumerate(docs) if role == "repro"]
    return assemble(snapshot(reports, repros, files=["runtime/events.log"], limit=limit))


def _keys(case) -> set[bytes]:
    return {record_key(kind, r) for block, field, kind in RECORD_LISTS for r in case[block][field]} - {None}


def _passing_keys(case) -> frozenset[bytes]:
    """What an earlier check could have remembered: keys of records that pass."""
    keys = set()
    for block, field, kind in RECORD_LISTS:
        for record in case[block][field]:
            try:
                msgspec.convert(record, kind)
            except msgspec.ValidationError:
                continue
            keys.add(record_key(kind, record))
    return frozenset(keys - {None})


def _whole_fails(case) -> bool:
    try:
        msgspec.convert(case, Case)
    except msgspec.ValidationError:
        return True
    return False


_docs_st = st.lists(st.one_of(st.tuples(st.just("report"), _rich_report_st), st.tuples(st.just("repro"), _rich_repro_st)),
                    min_size=1, max_size=5)

# Damage a check must find, in a record of each long list and in the shell.
_MUTATIONS = [
    lambda c: c["human_observations"]["observations"].append({"id": "X0001", "text": "t", "provenance": {"kind": "tester_report", "source": "s", "pointer": "/x"}}),
    lambda c: c["human_observations"]["comments"].append({"id": "C0009", "text": " ", "provenance": {"kind": "tester_report", "source": "s", "pointer": "/x"}}),
    lambda c: c["human_observations"]["tester_hypotheses"].append({"id": "T0009", "text": "t", "provenance": {"kind": "tester_report", "source": "s", "pointer": "x"}}),
    lambda c: c["expected_behavior"]["statements"].append({"id": "E0009", "text": "t", "origin": "oracle", "provenance": {"kind": "tester_report", "source": "s", "pointer": "/x"}}),
    lambda c: c["bug"]["titles"].append({"text": "t", "provenance": {"kind": "tester_report", "source": "s", "pointer": "/x"}, "extra": 1}),
    lambda c: c["runtime_facts"]["facts"].append({"id": "F0009", "name": "n", "provenance": {"kind": "reproduction", "source": "s", "pointer": "/x"}}),
    lambda c: c["reproduction"]["reproductions"].append({"id": "R1", "source": "s", "steps": [], "observation_ids": [], "fact_ids": [], "events_ref": None, "attachments": []}),
    lambda c: c["inputs"]["reports"].append({"path": "p", "sha256": "AB" * 32, "size": 1}),
    lambda c: c["inputs"]["unclassified"].append({"path": "p", "sha256": "ab" * 32, "size": -1}),
    lambda c: c["data_quality"]["claim_conflicts"].append({"id": "O0001", "block": "human_observations", "key": "k", "values": []}),
    lambda c: c["case"].update(case_id=5),
    lambda c: c.update(format_version=2),
    lambda c: c["entities"].append({"type": "t", "id": "1", "roles": [], "sources": []}),
    lambda c: c.pop("research"),
    lambda c: c["human_observations"].pop("comments"),
    lambda c: c.update(bug=[]),
    # A record the earlier check passed, changed in place: its key changes with it.
    lambda c: [o.update(id="X" + o["id"]) for o in c["human_observations"]["observations"][:1]] or c["case"].update(case_id=5),
    lambda c: [s.update(text=" ") for s in c["expected_behavior"]["statements"][:1]] or c.update(format_version=2),
    lambda c: [f.pop("name") for f in c["runtime_facts"]["facts"][:1]] or c["inputs"]["reports"].append(7),
    lambda c: [r["steps"].append({"text": "x"}) for r in c["reproduction"]["reproductions"][:1]] or c.pop("entities"),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_docs_st, _docs_st, st.integers(0, len(_MUTATIONS)))
def test_the_record_check_decides_as_the_whole_case_check(docs, other_docs, mutation):
    case = _case(docs)
    other = _case(other_docs)
    if mutation < len(_MUTATIONS):
        _MUTATIONS[mutation](case)
    for known in (frozenset(), _passing_keys(_case(docs)), _passing_keys(other)):
        if _whole_fails(case):
            with pytest.raises(msgspec.ValidationError):
                check_case(copy.deepcopy(case), known)
        else:
            assert check_case(case, known) == _keys(case)


def test_a_record_remembered_as_checked_is_not_converted_again():
    """What makes a rebuild cheap, and why the remembered keys are cache
    records of the builder code and msgspec version that checked them."""
    case = _case([("report", {"format": "viano-bug-report", "format_version": 1, "observations": [{"text": "a"}]})])
    bad = {"id": "O0002", "text": "", "provenance": {"kind": "tester_report", "source": "s", "pointer": "/x"}}
    case["human_observations"]["observations"].append(bad)
    with pytest.raises(msgspec.ValidationError):
        check_case(case, frozenset())
    remembered = record_key(Observation, bad)
    assert remembered in check_case(case, frozenset({remembered}))


def test_a_record_with_no_encoding_is_always_checked():
    # The strict reader refuses lone surrogates, so no built case holds one;
    # the check still must not trust what it cannot remember.
    case = _case([("report", {"format": "viano-bug-report", "format_version": 1, "observations": [{"text": "a"}]})])
    case["human_observations"]["observations"][0]["text"] = "a\ud800"
    assert not _whole_fails(case)
    keys = check_case(case, frozenset())
    assert len(keys) == len(_keys(case)) and all(b"\\ud800" not in k for k in keys)
    case["human_observations"]["observations"][0]["id"] = "X0001"
    with pytest.raises(msgspec.ValidationError):
        check_case(case, frozenset(keys))


def test_unreadable_or_other_msgspec_checked_records_are_none(tmp_path):
    from pipeline.build import _keep_checked_records, _read_checked_records
    from pipeline.cache import BuildCache

    cache = BuildCache(tmp_path / "c")
    assert _read_checked_records(cache) == frozenset()
    _keep_checked_records(cache, frozenset(), {b"a", b"b"})
    assert _read_checked_records(cache) == {b"a", b"b"}
    _keep_checked_records(cache, frozenset({b"a", b"b"}), {b"a", b"b", b"c"})  # drift 1/3: rewritten
    assert _read_checked_records(cache) == {b"a", b"b", b"c"}
    cache.write_msgpack(cache.checked_records, ("0.0.1", [b"a"]))
    assert _read_checked_records(cache) == frozenset()
    cache.write(cache.checked_records, b"\xc1 not msgpack")
    assert _read_checked_records(cache) == frozenset()

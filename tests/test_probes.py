"""Probe candidates: exact shape, fail-closed rules, bounds, and unresolved cases."""

from __future__ import annotations

import copy
import json

import pytest

from pipeline import probes
from pipeline.errors import VerificationError, one_line

SHA = "ab" * 32
PATH = "cases/c1/packages/p1/content/case/revisions/0001/case.json"


def outcome(**overrides) -> dict:
    value = {
        "id": "outcome-1",
        "original_prompt": "  compute answer \n",
        "failure_summary": " the answer was not verified ",
        "evidence_artifact_ref": "artifact-outcome-1",
    }
    value.update(overrides)
    return value


def test_exact_shape():
    assert probes.build_additional_cases(outcome()) == [
        {
            "case_id": "outcome-1:reproduce",
            "prompt": "compute answer",
            "evidence_artifact_ref": "artifact-outcome-1",
            "verification": None,
        },
        {
            "case_id": "outcome-1:address-failure",
            "prompt": "compute answer\n\nAddress this observed unresolved condition without assuming it is true: "
            "the answer was not verified",
            "evidence_artifact_ref": "artifact-outcome-1",
            "verification": None,
        },
    ]


def test_candidates_are_fresh_data_and_input_is_untouched():
    value = outcome()
    before = copy.deepcopy(value)
    first = probes.build_additional_cases(value)
    second = probes.build_additional_cases(value)
    assert value == before
    assert first == second and first is not second
    assert json.loads(json.dumps(first)) == first  # JSON-ready


@pytest.mark.parametrize("field", probes.UNRESOLVED_FIELDS)
@pytest.mark.parametrize("bad", ["", "   ", "\t\n", "\u3000", None, 7, ["x"], "missing"])
def test_fail_closed_on_each_blank_or_missing_field(field, bad):
    value = outcome()
    if bad == "missing":
        del value[field]
    else:
        value[field] = bad
    with pytest.raises(VerificationError) as caught:
        probes.build_additional_cases(value)
    assert caught.value.code == "INVALID_UNRESOLVED_EVIDENCE"
    assert caught.value.pointer == "/" + field


@pytest.mark.parametrize("value", [None, "outcome", ["id"], outcome(extra="x")])
def test_fail_closed_on_malformed_evidence(value):
    with pytest.raises(VerificationError) as caught:
        probes.build_additional_cases(value)
    assert caught.value.code == "INVALID_UNRESOLVED_EVIDENCE"


def test_prompts_are_bounded_and_cuts_are_marked():
    long_prompt = "p" * 50_000
    long_summary = "s" * 50_000
    reproduce, address = probes.build_additional_cases(outcome(original_prompt=long_prompt, failure_summary=long_summary))
    assert len(reproduce["prompt"]) == probes.ORIGINAL_PROMPT_LIMIT
    assert reproduce["prompt"].endswith("[truncated: 50000 characters in all]")
    assert len(address["prompt"]) == probes.MAX_PROMPT_CHARS
    assert address["prompt"].startswith(reproduce["prompt"] + "\n\n" + probes.ADDRESS_FAILURE_LEAD)
    assert address["prompt"].endswith("[truncated: 50000 characters in all]")


def test_prompts_at_the_limit_are_not_cut():
    prompt = "p" * probes.ORIGINAL_PROMPT_LIMIT
    reproduce, _ = probes.build_additional_cases(outcome(original_prompt=prompt))
    assert reproduce["prompt"] == prompt


# --------------------------------------------------------------------------- from a built case


def built_case(**changes) -> dict:
    case = {
        "builder_version": "1",
        "case": {"case_id": "CASE-7", "package_id": "pkg", "analysis_revision": 1},
        "bug": {
            "titles": [{"id": "B1", "text": "Door stays open"}, {"id": "B2", "text": "Alarm\nsilent"}],
            "summaries": [{"id": "S1", "text": "summary text that is not part of the prompt"}],
        },
        "expected_behavior": {"completeness": "reported_complete", "statements": []},
        "data_quality": {"gaps": [], "claim_conflicts": []},
    }
    for dotted, value in changes.items():
        block, key = dotted.split("__")
        case[block][key] = value
    return case


def unresolved(case):
    return probes.unresolved_from_case(case, case_path=PATH, case_sha256=SHA)


def test_complete_case_is_not_unresolved():
    assert unresolved(built_case()) is None


@pytest.mark.parametrize("completeness", ["missing", "unspecified", "reported_partial", "conflicting"])
def test_incomplete_expected_behaviour_is_named(completeness):
    result = unresolved(built_case(expected_behavior__completeness=completeness))
    assert result["failure_summary"] == f"expected_behavior.completeness={completeness}"


def test_absent_completeness_is_unresolved():
    case = built_case()
    del case["expected_behavior"]
    assert unresolved(case)["failure_summary"] == "expected_behavior.completeness=absent"


def value(record_id, value, source="original/reports/report-1.json"):
    return {"value": value, "id": record_id, "source": source, "pointer": "/observations/0"}


def test_claim_conflict_is_named_by_block_key_and_record_ids():
    conflicts = [
        {
            "block": "human_observations",
            "key": "switch.state",
            "values": [value("O0003", "open"), value("O0001", "closed"), value("O0002", "open")],
        }
    ]
    result = unresolved(built_case(data_quality__claim_conflicts=conflicts))
    assert result["failure_summary"] == "claim_conflict human_observations key=\"switch.state\" ids=O0001,O0002,O0003"
    assert "open" not in result["failure_summary"]  # values are not quoted or interpreted
    assert "report-1" not in result["failure_summary"]


@pytest.mark.parametrize("key", ['a"; gap FORGED_GAP source="x', 'a\\"; gap FORGED_GAP source="x', 'a\\\\"; gap X', "k\n\u202e\\"])
def test_a_claim_key_cannot_close_its_literal_early(key):
    # The key is one JSON string literal in the summary, whatever quotes and
    # backslashes it holds: read back, it is the key folded onto one line,
    # and nothing after it looks like another entry.
    import json
    import re

    conflicts = [{"block": "human_observations", "key": key, "values": [value("O0001", 1), value("O0002", 2)]}]
    summary = unresolved(built_case(data_quality__claim_conflicts=conflicts))["failure_summary"]
    literal = json.JSONDecoder().raw_decode(summary, len("claim_conflict human_observations key="))
    assert literal[0] == one_line(key)
    assert summary[literal[1]:] == " ids=O0001,O0002"
    assert not re.search(r"[\x00-\x1f\u202e]", summary)


def test_conflict_ids_are_in_natural_order_each_once():
    conflicts = [
        {"block": "expected_behavior", "key": "k", "values": [value("E10000", 1), value("E0002", 2), value("E0010", 3)]},
        # the same key listed twice (the builder never does): its ids are merged, each named once
        {"block": "expected_behavior", "key": "k", "values": [value("E0002", 2), value("E0001", 4)]},
    ]
    result = unresolved(built_case(data_quality__claim_conflicts=conflicts))
    assert result["failure_summary"] == "claim_conflict expected_behavior key=\"k\" ids=E0001,E0002,E0010,E10000"


def test_conflict_ids_cannot_forge_structure():
    conflicts = [
        {"block": "human_observations", "key": "k", "values": [value("O1,O2; gap X", 1), value("O0001\nx", 2), {"value": 3}]},
        {"block": "human_observations", "key": "no-ids", "values": [{"value": 1}, {"value": 2}]},
    ]
    summary = unresolved(built_case(data_quality__claim_conflicts=conflicts))["failure_summary"]
    assert summary == (
        "claim_conflict human_observations key=\"k\" ids=O0001\\nx,O1\\x2cO2\\x3b\\x20gap\\x20X; "
        "claim_conflict human_observations key=\"no-ids\" ids=none"
    )
    assert "\n" not in summary


def test_gap_is_named_by_code_and_source():
    gaps = [
        {"code": "MISSING_INDEX", "message": "no case-inputs index; a long message"},
        {"code": "UNREADABLE", "message": "m", "source": "original/report.json"},
    ]
    result = unresolved(built_case(data_quality__gaps=gaps))
    assert result["failure_summary"] == "gap MISSING_INDEX; gap UNREADABLE source=\"original/report.json\""


def test_all_reasons_in_a_deterministic_order():
    gaps = [{"code": "Z_GAP", "message": "z"}, {"code": "MISSING_INDEX", "message": "m"}, {"code": "MISSING_INDEX", "message": "m"}]
    conflicts = [
        {"block": "human_observations", "key": "z.key", "values": [value("O0009", 1), value("O0004", 2)]},
        {"block": "expected_behavior", "key": "door.state", "values": [value("E0002", 1), value("E0001", 2)]},
        {"block": "human_observations", "key": "door.state", "values": [value("O0001", 1), value("O0003", 2)]},
    ]
    case = built_case(
        expected_behavior__completeness="reported_partial",
        data_quality__gaps=gaps,
        data_quality__claim_conflicts=conflicts,
    )
    expected = (
        "expected_behavior.completeness=reported_partial; "
        "claim_conflict expected_behavior key=\"door.state\" ids=E0001,E0002; "
        "claim_conflict human_observations key=\"door.state\" ids=O0001,O0003; "
        "claim_conflict human_observations key=\"z.key\" ids=O0004,O0009; "
        "gap MISSING_INDEX; gap Z_GAP"
    )
    assert unresolved(case)["failure_summary"] == expected
    shuffled = copy.deepcopy(case)
    shuffled["data_quality"]["gaps"].reverse()
    shuffled["data_quality"]["claim_conflicts"].reverse()
    for conflict in shuffled["data_quality"]["claim_conflicts"]:
        conflict["values"].reverse()
    assert unresolved(shuffled) == unresolved(case)


def test_outcome_fields_and_prompt():
    result = unresolved(built_case(expected_behavior__completeness="missing"))
    assert result == {
        "id": "CASE-7",
        "original_prompt": "Analyse bug case CASE-7 from its canonical case record.\n"
        "Reported titles:\n- Door stays open\n- Alarm\\nsilent",
        "failure_summary": "expected_behavior.completeness=missing",
        "evidence_artifact_ref": f"{PATH}@sha256:{SHA}",
    }
    reproduce, address = probes.build_additional_cases(result)
    assert reproduce["case_id"] == "CASE-7:reproduce"
    assert address["case_id"] == "CASE-7:address-failure"
    assert address["evidence_artifact_ref"] == f"{PATH}@sha256:{SHA}"


def test_prompt_without_titles():
    result = unresolved(built_case(bug__titles=[], expected_behavior__completeness="missing"))
    assert result["original_prompt"] == "Analyse bug case CASE-7 from its canonical case record. No title was reported."


@pytest.mark.parametrize(
    "path, sha, code",
    [("", SHA, "INVALID_ARGUMENT"), ("  ", SHA, "INVALID_ARGUMENT"), (PATH, "abc", "INVALID_ARGUMENT"), (PATH, SHA.upper(), "INVALID_ARGUMENT")],
)
def test_bad_path_or_digest(path, sha, code):
    with pytest.raises(VerificationError) as caught:
        probes.unresolved_from_case(built_case(), case_path=path, case_sha256=sha)
    assert caught.value.code == code


def test_case_without_id_fails_closed():
    case = built_case(expected_behavior__completeness="missing")
    del case["case"]["case_id"]
    with pytest.raises(VerificationError) as caught:
        unresolved(case)
    assert caught.value.code == "INVALID_UNRESOLVED_EVIDENCE"


# --------------------------------------------------------------------------- doit probes output


def test_command_output_with_candidates():
    text, code = probes.probes_command_output(built_case(expected_behavior__completeness="reported_partial"), PATH, SHA)
    assert code == 0
    document = json.loads(text)
    assert [c["case_id"] for c in document["candidates"]] == ["CASE-7:reproduce", "CASE-7:address-failure"]
    assert all(c["verification"] is None for c in document["candidates"])
    assert document["unresolved"]["id"] == "CASE-7"
    assert text == json.dumps(document, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def test_command_output_when_nothing_is_unresolved():
    assert probes.probes_command_output(built_case(), PATH, SHA) == (
        "case CASE-7: nothing unresolved; no probe candidates\n",
        0,
    )



def test_a_claim_key_cannot_forge_other_entries():
    """A supplied key is quoted as a JSON string, so '; gap ...' inside it stays inside it."""
    key = 'k ids=O0001; gap MISSING_INDEX source=none; x'
    case = {
        "case": {"case_id": "c"},
        "bug": {"titles": [], "summaries": []},
        "expected_behavior": {"completeness": "reported_complete"},
        "data_quality": {"gaps": [], "claim_conflicts": [
            {"block": "human_observations", "key": key, "values": [{"id": "O0002"}, {"id": "O0003"}]}]},
    }
    result = probes.unresolved_from_case(case, case_path="case/revisions/0001/case.json", case_sha256="a" * 64)
    summary = result["failure_summary"]
    assert summary == 'claim_conflict human_observations key="k ids=O0001; gap MISSING_INDEX source=none; x" ids=O0002,O0003'
    assert summary.count("claim_conflict") == 1

"""The limits of a whole build (plan.check_aggregate_limits), from sizes alone."""

from __future__ import annotations

import pytest

from pipeline.errors import CaseBuildError
from pipeline.limits import CaseBuilderLimits
from pipeline.plan import check_aggregate_limits, check_index_history, check_limits


def _ref(path: str, size: int) -> dict:
    return {"path": path, "sha256": "0" * 64, "size": size}


def _plan(documents: list[dict], history: list[dict], current: dict | None) -> dict:
    return {"documents": documents, "index_history": history, "index": current, "prior_case": None}


def test_appends_keep_the_indexes_of_a_package_within_the_aggregate_limit():
    # Each earlier index is read by every build to know what it listed
    # (RELIABILITY 24: the bytes a build parses are bounded), so appends of
    # large indexes are held to the aggregate limit; the build itself is not,
    # so a package appended before the check still builds.
    limits = CaseBuilderLimits(aggregate_bytes=500)
    history = [_ref("original/case-inputs.json", 300), _ref("inputs/2/case-inputs.json", 250)]
    check_index_history(_plan([], history[:1], history[0]), limits)  # 300
    with pytest.raises(CaseBuildError) as info:
        check_index_history(_plan([], history, history[1]), limits)  # 550
    assert info.value.code == "LIMIT_EXCEEDED"
    assert info.value.message == "550 bytes of indexes in all, limit 500 (a workspace's limits.json can raise case_builder.aggregate_bytes up to 67108864)"
    assert info.value.path == "inputs/2/case-inputs.json"
    check_aggregate_limits(_plan([], history, history[1]), limits)  # the build counts the current index only


def test_the_aggregate_counts_each_index_once_and_skips_inherited_documents_over_their_own_limit():
    limits = CaseBuilderLimits(aggregate_bytes=1000, document_bytes=500)
    current = _ref("original/case-inputs.json", 100)
    lenient_big = {**_ref("old.json", 600), "lenient": True}  # read_input refuses it; assemble drops it
    docs = [_ref("a.json", 400), _ref("b.json", 450), lenient_big]
    check_aggregate_limits(_plan(docs, [current], current), limits)  # 950
    with pytest.raises(CaseBuildError) as info:
        check_aggregate_limits(_plan([*docs, _ref("c.json", 100)], [current], current), limits)
    assert info.value.message == "1050 bytes of structured input, limit 1000 (a workspace's limits.json can raise case_builder.aggregate_bytes up to 67108864)"


def test_the_document_count_includes_the_current_index_and_names_it():
    limits = CaseBuilderLimits(documents=3)
    current = _ref("inputs/3/case-inputs.json", 10)
    check_aggregate_limits(_plan([_ref("a", 1), _ref("b", 1)], [current], current), limits)
    with pytest.raises(CaseBuildError) as info:
        check_limits(_plan([_ref("a", 1), _ref("b", 1), _ref("c", 1)], [current], current), limits)
    assert info.value.message == "4 structured documents, limit 3 (a workspace's limits.json can raise case_builder.documents up to 4096)"
    assert info.value.path == "inputs/3/case-inputs.json"


@pytest.mark.parametrize("failure", [MemoryError, KeyboardInterrupt, RuntimeError])
def test_only_a_refusal_of_a_reference_is_taken_as_one_while_planning(monkeypatch, failure):
    """Planning caught every exception around a reference check: a MemoryError
    or a host program's exception landing there dropped a good input from an
    earlier index (the case without it was published and then reused), or
    refused a valid package as REFERENCE_UNSAFE (session 30's review)."""
    from pipeline import plan, workspace

    files = {"original/report-1.json": {"sha256": "0" * 64, "size": 1}}
    assert plan._usable_reference("original/report-1.json", files)
    assert not plan._usable_reference("../escape.json", {"../escape.json": files["original/report-1.json"]})
    with pytest.raises(CaseBuildError) as refused:
        plan._check_listed("/absolute.json", files, "original/case-inputs.json", "/reports/0")
    assert (refused.value.code, refused.value.path, refused.value.pointer) == ("REFERENCE_UNSAFE", "original/case-inputs.json", "/reports/0")

    def failing(ref):
        raise failure()

    monkeypatch.setattr(workspace, "check_reference", failing)
    with pytest.raises(failure):
        plan._usable_reference("original/report-1.json", files)
    with pytest.raises(failure):
        plan._check_listed("original/report-1.json", files, "original/case-inputs.json", "/reports/0")

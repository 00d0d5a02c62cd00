"""The limits of a whole build (plan.check_aggregate_limits), from sizes alone."""

from __future__ import annotations

import pytest

from pipeline.errors import CaseBuildError
from pipeline.limits import CaseBuilderLimits
from pipeline.plan import check_aggregate_limits, check_limits


def _ref(path: str, size: int) -> dict:
    return {"path": path, "sha256": "0" * 64, "size": size}


def _plan(documents: list[dict], history: list[dict], current: dict | None) -> dict:
    return {"documents": documents, "index_history": history, "index": current, "prior_case": None}


def test_every_index_the_build_reads_counts_toward_the_structured_bytes():
    # Each earlier index is read to know what it listed (RELIABILITY 24: the
    # bytes a build parses are bounded), so appends of large indexes cannot
    # take a build past the aggregate limit unseen.
    limits = CaseBuilderLimits(aggregate_bytes=900)
    docs = [_ref("r.json", 400)]
    history = [_ref("original/case-inputs.json", 300), _ref("inputs/2/case-inputs.json", 250)]
    check_aggregate_limits(_plan(docs, history[:1], history[0]), limits)  # 700
    with pytest.raises(CaseBuildError) as info:
        check_aggregate_limits(_plan(docs, history, history[1]), limits)  # 950: the earlier index too
    assert info.value.code == "LIMIT_EXCEEDED"
    assert info.value.message == "950 bytes of structured input, limit 900"
    assert info.value.path == "inputs/2/case-inputs.json"


def test_the_aggregate_counts_each_index_once_and_skips_inherited_documents_over_their_own_limit():
    limits = CaseBuilderLimits(aggregate_bytes=1000, document_bytes=500)
    current = _ref("original/case-inputs.json", 100)
    lenient_big = {**_ref("old.json", 600), "lenient": True}  # read_input refuses it; assemble drops it
    docs = [_ref("a.json", 400), _ref("b.json", 450), lenient_big]
    check_aggregate_limits(_plan(docs, [current], current), limits)  # 950
    with pytest.raises(CaseBuildError) as info:
        check_aggregate_limits(_plan([*docs, _ref("c.json", 100)], [current], current), limits)
    assert info.value.message == "1050 bytes of structured input, limit 1000"


def test_the_document_count_includes_the_current_index_and_names_it():
    limits = CaseBuilderLimits(documents=3)
    current = _ref("inputs/3/case-inputs.json", 10)
    check_aggregate_limits(_plan([_ref("a", 1), _ref("b", 1)], [current], current), limits)
    with pytest.raises(CaseBuildError) as info:
        check_limits(_plan([_ref("a", 1), _ref("b", 1), _ref("c", 1)], [current], current), limits)
    assert info.value.message == "4 structured documents, limit 3"
    assert info.value.path == "inputs/3/case-inputs.json"

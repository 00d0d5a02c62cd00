"""The prior case's view (pipeline.prior) stands in for the whole prior case.

Planning and id assignment read the view instead of the published document;
these tests hold them to the same result, or the same error, on both, for
built cases and for damaged ones (a block missing, of the wrong shape, a
record without an id or provenance).
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.assemble import assemble
from pipeline.errors import CaseBuildError
from pipeline.jsoncanon import canonical_hash, pretty_bytes
from pipeline.limits import CaseBuilderLimits
from pipeline.plan import plan_from_manifests
from pipeline.prior import prior_case_view
from tests.test_assemble import _docs_st, _snap_from, as_prior, rich_snapshot

PRIOR_PATH = "case/revisions/0001/case.json"


def _outcome(function):
    try:
        return "ok", function()
    except CaseBuildError as error:
        return "error", (error.code, error.message, error.path, error.pointer)
    except (KeyError, TypeError, AttributeError) as error:
        # A consumer crashing is an outcome too: it must crash alike on both.
        return "crash", (type(error).__name__, str(error))


def _assembled_with(prior, read, docs):
    """Assembled with ``read`` as what was read of the published ``prior``."""
    snap = _snap_from(docs)
    snap["prior_case"] = {**as_prior(prior), "document": read}
    return pretty_bytes(assemble(snap))


def _planned_with(prior_document, files):
    manifest = {
        "case_id": "case-A", "package_id": "pkg-1", "analysis_revision": 2, "package_generation": 3,
        "project": {"name": "demo", "version": "1.0"}, "artifacts": {}, "files": files,
    }
    prior = {"ref": {"path": PRIOR_PATH, "sha256": "cd" * 32, "size": 1}, "document": prior_document}
    return plan_from_manifests(manifests=[manifest], indexes={}, prior_case=prior, limits=CaseBuilderLimits())


def _inventory_files(case):
    """The snapshot files every input the case lists still matches."""
    files = {}
    refs = [r for role in ("reports", "reproductions", "expected_research", "attachments") for r in case["inputs"][role]]
    refs += case["runtime_facts"]["context"] + case["database_context"] + case["source_context"] + case["research"]["supplied"]
    for ref in refs:
        files[ref["path"]] = {"sha256": ref["sha256"], "size": ref["size"]}
    return files


# Damage at a chosen place: each is a path into the case and what to put there
# (None removes the key).
_DAMAGE = [
    (("human_observations",), None),
    (("human_observations",), []),
    (("human_observations", "comments"), None),
    (("human_observations", "comments"), "text"),
    (("human_observations", "observations"), {"id": "O0001"}),
    (("human_observations", "observations", 0, "id"), None),
    (("human_observations", "observations", 0, "id"), "C0001"),
    (("human_observations", "observations", 0, "provenance"), None),
    (("human_observations", "observations", 0, "provenance"), ["source"]),
    (("human_observations", "observations", 0, "provenance", "pointer"), None),
    (("human_observations", "observations", 0), "O0001"),
    (("expected_behavior", "statements"), None),
    (("runtime_facts",), "facts"),
    (("runtime_facts", "facts"), None),
    (("runtime_facts", "context"), None),
    (("inputs",), None),
    (("inputs", "reports"), None),
    (("inputs", "reports", 0, "sha256"), "00" * 32),
    (("research",), None),
    (("research", "supplied"), None),
    (("database_context",), None),
    (("format_version",), 2),
    (("builder_version",), None),
]


def _damaged(case, where, value):
    damaged = copy.deepcopy(case)
    target = damaged
    for step in where[:-1]:
        try:
            target = target[step]
        except (KeyError, IndexError, TypeError):
            return None  # this case has nothing at that place
    last = where[-1]
    if isinstance(target, list) and (not isinstance(last, int) or last >= len(target)):
        return None
    if value is None:
        if isinstance(target, dict):
            target.pop(last, None)
        else:
            del target[last]
    else:
        target[last] = value
    return damaged


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_docs_st, _docs_st, st.sampled_from(_DAMAGE + [((), None)]))
def test_assembling_with_the_view_equals_assembling_with_the_whole_prior_case(old_docs, new_docs, damage):
    prior = assemble(_snap_from(old_docs))
    if damage[0]:
        prior = _damaged(prior, *damage)
        if prior is None:
            return
    whole = _outcome(lambda: _assembled_with(prior, prior, old_docs + new_docs))
    viewed = _outcome(lambda: _assembled_with(prior, prior_case_view(copy.deepcopy(prior)), old_docs + new_docs))
    assert viewed == whole


def test_every_damage_is_seen_alike_by_planning_and_id_assignment():
    """The rich case has every block filled, so each damage applies; planning
    and assembly each reach the same outcome on the view as on the whole."""
    prior = assemble(rich_snapshot())
    files = _inventory_files(prior)
    outcomes = set()
    for where, value in _DAMAGE:
        damaged = _damaged(prior, where, value)
        assert damaged is not None, where
        whole_plan = _outcome(lambda: _planned_with(damaged, files))
        view_plan = _outcome(lambda: _planned_with(prior_case_view(copy.deepcopy(damaged)), files))
        assert view_plan == whole_plan, where
        snap = rich_snapshot()
        whole_case = _outcome(lambda: pretty_bytes(assemble({**snap, "prior_case": {**as_prior(damaged), "document": damaged}})))
        view_case = _outcome(lambda: pretty_bytes(assemble({**snap, "prior_case": {**as_prior(damaged), "document": prior_case_view(damaged)}})))
        assert view_case == whole_case, where
        outcomes.add((whole_plan[0], whole_case[0]))
    # The damage list reaches both success and refusal, so the comparisons above
    # compared something on each side.
    assert {kind for kind, _ in outcomes} >= {"ok", "error"}
    assert {kind for _, kind in outcomes} >= {"ok", "error"}


def test_the_view_is_small_and_keeps_ids_and_inventory():
    prior = assemble(rich_snapshot())
    view = prior_case_view(prior)
    assert view["inputs"] == prior["inputs"]
    assert [r["id"] for r in view["human_observations"]["observations"]] == [r["id"] for r in prior["human_observations"]["observations"]]
    assert "text" not in view["human_observations"]["observations"][0]
    assert "entities" not in view
    # Of the bug block only where each attachment came from (planning reads
    # which reports' attachments the prior case listed); no titles, no text.
    assert view["bug"] == {"attachments": [{"provenance": {k: a["provenance"][k] for k in ("source", "pointer")}}
                                           for a in prior["bug"]["attachments"]]}
    assert len(pretty_bytes(view)) < len(pretty_bytes(prior))
    assert canonical_hash(prior_case_view(prior)) == canonical_hash(view)  # a pure function


def test_planning_refuses_a_prior_case_input_listed_in_another_role_with_the_append_s_words():
    """The build's side of the rule the append checks first: a later
    revision's index cannot move a prior-case input to another role."""
    prior = assemble(rich_snapshot())
    files = _inventory_files(prior)
    index_path = "inputs/3/case-inputs.json"
    files[index_path] = {"sha256": "ee" * 32, "size": 1}
    moved = prior["inputs"]["reports"][0]["path"]
    manifest = {
        "case_id": "case-A", "package_id": "pkg-1", "analysis_revision": 2, "package_generation": 3,
        "project": {"name": "demo", "version": "1.0"}, "artifacts": {"case_inputs": index_path}, "files": files,
    }
    index = {"format": "viano-case-inputs", "format_version": 1, "reports": [], "reproductions": [], "attachments": [moved]}
    prior_ref = {"ref": {"path": PRIOR_PATH, "sha256": "cd" * 32, "size": 1}, "document": prior_case_view(prior)}
    try:
        plan_from_manifests(manifests=[manifest], indexes={index_path: index}, prior_case=prior_ref, limits=CaseBuilderLimits())
    except CaseBuildError as error:
        assert error.code == "DUPLICATE_SOURCE"
        assert error.message == f"{moved!r} is an input of the prior case as reports; a later revision cannot list it as attachments"
        assert (error.path, error.pointer) == (index_path, "/attachments/0")
    else:
        raise AssertionError("a prior-case report listed as an attachment must be refused")
    index["attachments"] = []
    index["reports"] = [moved]  # the same role: inherited as it was
    plan = plan_from_manifests(manifests=[manifest], indexes={index_path: index}, prior_case=prior_ref, limits=CaseBuilderLimits())
    assert moved in [d["path"] for d in plan["documents"]]


def test_a_new_revision_takes_its_prior_case_inputs_in_the_order_the_indexes_listed_them():
    """Revision 1 listed report a and reproduction p, then (appended) report
    c; revision 2 appends report d. Its inventory is a, p, c, d: the prior
    case's inputs interleaved across roles as the indexes first listed them
    (a case lists reports and reproductions apart, which alone would give
    a, c, p), so it begins with revision 1's own inventory and an append
    rebuild can splice. The roles' own orders, and the request hash, are
    what they were."""
    def ref(path):
        return {"path": path, "sha256": "ab" * 32, "size": 3}

    prior_document = {
        "inputs": {"reports": [ref("r/a.json"), ref("r/c.json")], "reproductions": [ref("p/p.json")],
                   "expected_research": [], "attachments": []},
        "runtime_facts": {"context": []}, "database_context": [], "source_context": [], "research": {"supplied": []},
    }
    files = {path: {"sha256": "ab" * 32, "size": 3} for path in ("r/a.json", "r/c.json", "p/p.json", "r/d.json")}
    indexes = {
        "i1.json": {"format": "viano-case-inputs", "format_version": 1, "reports": ["r/a.json"], "reproductions": ["p/p.json"]},
        "inputs/2/case-inputs.json": {"format": "viano-case-inputs", "format_version": 1, "reports": ["r/c.json"]},
        "inputs/4/case-inputs.json": {"format": "viano-case-inputs", "format_version": 1, "reports": ["r/d.json"]},
    }
    files.update({path: {"sha256": "cd" * 32, "size": 9} for path in indexes})

    def manifest(generation, revision, index):
        return {"case_id": "case-A", "package_id": "pkg-1", "analysis_revision": revision, "package_generation": generation,
                "project": {"name": "demo", "version": "1.0"}, "artifacts": {"case_inputs": index}, "files": files}

    manifests = [manifest(1, 1, "i1.json"), manifest(2, 1, "inputs/2/case-inputs.json"), manifest(3, 2, "inputs/2/case-inputs.json"),
                 manifest(4, 2, "inputs/4/case-inputs.json")]
    prior = {"ref": {"path": PRIOR_PATH, "sha256": "cd" * 32, "size": 1}, "document": prior_document}
    current = "inputs/4/case-inputs.json"
    earlier = {path: index for path, index in indexes.items() if path != current}

    def plan(earlier_indexes):
        return plan_from_manifests(manifests=manifests, indexes={current: indexes[current]}, prior_case=prior,
                                   limits=CaseBuilderLimits(), earlier_indexes=earlier_indexes)

    listed = plan(earlier)
    assert [d["path"] for d in sorted(listed["documents"], key=lambda d: d["seq"])] == ["r/a.json", "p/p.json", "r/c.json", "r/d.json"]
    assert [r["path"] for r in listed["roles"]["reports"]] == ["r/a.json", "r/c.json", "r/d.json"]
    # Earlier indexes unreadable: the prior case's own order (reports first), and the same request.
    unread = plan({})
    assert [d["path"] for d in sorted(unread["documents"], key=lambda d: d["seq"])] == ["r/a.json", "r/c.json", "p/p.json", "r/d.json"]
    assert unread["roles"] == listed["roles"] and unread["request_hash"] == listed["request_hash"]
    # Which prior-case reports' attachments the prior case listed: none here
    # (it has no bug.attachments, as cases before session 17), then c's.
    flags = {d["path"]: d.get("prior_listed_attachments") for d in listed["documents"]}
    assert flags == {"r/a.json": False, "r/c.json": False, "p/p.json": None, "r/d.json": None}
    prior_document["bug"] = {"attachments": [{"path": "x.png", "provenance": {"kind": "tester_report", "source": "r/c.json", "pointer": "/attachments/0"}}]}
    flags = {d["path"]: d.get("prior_listed_attachments") for d in plan(earlier)["documents"]}
    assert flags == {"r/a.json": False, "r/c.json": True, "p/p.json": None, "r/d.json": None}


def test_a_listing_in_another_role_does_not_place_a_prior_case_input():
    """Revision 1's first index listed x as a report (refused, then dropped
    by a corrected index listing a and p); revision 2 listed b, then x as a
    reproduction. Revision 3 keeps revision 2's order a, p, b, x: x is placed
    where it was listed as a reproduction, not where it was listed as a report."""
    def ref(path):
        return {"path": path, "sha256": "ab" * 32, "size": 3}

    prior_document = {
        "inputs": {"reports": [ref("r/a.json"), ref("r/b.json")], "reproductions": [ref("p/p.json"), ref("x.json")],
                   "expected_research": [], "attachments": []},
        "runtime_facts": {"context": []}, "database_context": [], "source_context": [], "research": {"supplied": []},
    }
    files = {path: {"sha256": "ab" * 32, "size": 3} for path in ("r/a.json", "r/b.json", "p/p.json", "x.json", "r/c.json")}
    indexes = {
        "i1.json": {"format": "viano-case-inputs", "format_version": 1, "reports": ["r/a.json", "x.json"]},
        "inputs/2/case-inputs.json": {"format": "viano-case-inputs", "format_version": 1, "reports": ["r/a.json"], "reproductions": ["p/p.json"]},
        "inputs/5/case-inputs.json": {"format": "viano-case-inputs", "format_version": 1, "reports": ["r/b.json"], "reproductions": ["x.json"]},
        "inputs/8/case-inputs.json": {"format": "viano-case-inputs", "format_version": 1, "reports": ["r/c.json"]},
    }
    files.update({path: {"sha256": "cd" * 32, "size": 9} for path in indexes})

    def manifest(generation, revision, index):
        return {"case_id": "case-A", "package_id": "pkg-1", "analysis_revision": revision, "package_generation": generation,
                "project": {"name": "demo", "version": "1.0"}, "artifacts": {"case_inputs": index}, "files": files}

    manifests = [manifest(1, 1, "i1.json"), manifest(2, 1, "inputs/2/case-inputs.json"),
                 manifest(5, 2, "inputs/5/case-inputs.json"), manifest(8, 3, "inputs/8/case-inputs.json")]
    current = "inputs/8/case-inputs.json"
    plan = plan_from_manifests(
        manifests=manifests, indexes={current: indexes[current]},
        prior_case={"ref": {"path": PRIOR_PATH, "sha256": "cd" * 32, "size": 1}, "document": prior_document},
        limits=CaseBuilderLimits(), earlier_indexes={path: index for path, index in indexes.items() if path != current},
    )
    assert [d["path"] for d in sorted(plan["documents"], key=lambda d: d["seq"])] == ["r/a.json", "p/p.json", "r/b.json", "x.json", "r/c.json"]

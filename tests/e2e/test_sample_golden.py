"""The bundled sample through the real `doit`: golden bytes and provenance.

To accept an intended change of the case format or the summary layout, run
``VIANO_WRITE_GOLDEN=1 python -m pytest tests/e2e/test_sample_golden.py`` and
review the diff of ``fixtures/golden/sample/`` like any other code change.
"""

from __future__ import annotations

import json
import os

import pytest

from pipeline.jsoncanon import resolve_pointer
from tests.conftest import FIXTURES
from tests.e2e import kit

GOLDEN = FIXTURES / "golden" / "sample"


@pytest.fixture(scope="module")
def sample_build(tmp_path_factory):
    ws = tmp_path_factory.mktemp("sample") / "ws"
    admitted = kit.doit("admit", "case=sample", f"source={FIXTURES / 'sample'}", workspace=ws)
    assert admitted.returncode == 0, admitted.stderr
    built = kit.doit("build", "case=sample", workspace=ws)
    assert built.returncode == 0, built.stderr
    manifest = json.loads(kit.manifests(ws, "sample", "hub-switch-2031")[-1].read_text(encoding="utf-8"))
    content = kit.package_dir(ws, "sample", "hub-switch-2031") / "content"
    return content, manifest


@pytest.mark.parametrize("name", ["case.json", "case_summary.md", "case-built.json"])
def test_sample_outputs_match_golden_bytes(sample_build, name):
    content, _ = sample_build
    produced = (content / "case" / "revisions" / "0001" / name).read_bytes()
    golden = GOLDEN / name
    if os.environ.get("VIANO_WRITE_GOLDEN") == "1":
        golden.write_bytes(produced)
    assert produced == golden.read_bytes()


def test_sample_statements_trace_to_their_sources(sample_build):
    content, _ = sample_build
    case = json.loads((content / "case" / "revisions" / "0001" / "case.json").read_text(encoding="utf-8"))
    checked = 0
    records = []
    for block in ("observations", "comments", "tester_hypotheses"):
        records += case["human_observations"][block]
    records += [s for s in case["expected_behavior"]["statements"] if s["origin"] == "tester"]
    for record in records:
        source = json.loads((content / record["provenance"]["source"]).read_text(encoding="utf-8"))
        target = resolve_pointer(source, record["provenance"]["pointer"])
        assert target["text"] == record["text"]
        for optional in ("author", "observed_at", "claim"):
            assert target.get(optional) == record.get(optional)
        checked += 1
    assert checked >= 10
    hypotheses = {s["text"] for s in case["human_observations"]["tester_hypotheses"]}
    facts = {json.dumps(f.get("value"), sort_keys=True) for f in case["runtime_facts"]["facts"]}
    assert hypotheses and not any(json.dumps(h) in facts for h in hypotheses)  # never promoted to facts


def _parsers():
    from markdown_it import MarkdownIt
    from mdit_py_plugins.footnote import footnote_plugin

    linkify = MarkdownIt("gfm-like")
    linkify.linkify.set({"fuzzy_email": True, "fuzzy_link": True})
    return {
        "commonmark": MarkdownIt("commonmark"),
        "gfm-like+linkify": linkify,
        "gfm+footnotes": MarkdownIt("commonmark").enable(["table", "strikethrough"]).use(footnote_plugin),
    }


@pytest.mark.parametrize("parser", ["commonmark", "gfm-like+linkify", "gfm+footnotes"])
def test_sample_summary_renders_hostile_text_inert(sample_build, parser):
    content, _ = sample_build
    summary = (content / "case" / "revisions" / "0001" / "case_summary.md").read_text(encoding="utf-8")
    tokens = _parsers()[parser].parse(summary)
    kinds = set()
    stack = list(tokens)
    while stack:
        token = stack.pop()
        kinds.add(token.type)
        stack.extend(token.children or [])
    assert not kinds & {"html_inline", "html_block", "link_open", "image", "code_inline", "em_open", "strong_open", "s_open"}
    if parser != "commonmark":
        assert "table_open" in kinds  # the tables parse as tables

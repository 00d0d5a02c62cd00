"""Tests for pipeline/summary.py: inert escaping, fixed layout, determinism.

The escaper is checked with a real CommonMark parser (markdown-it-py), and,
when linkify-it-py / mdit-py-plugins are installed, also with GFM-like
linkify and the footnote plugin (RELIABILITY.md 48-50).
"""

from __future__ import annotations

import copy
import hashlib
import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt
import cmarkgfm
from cmarkgfm.cmark import Options as CmarkOptions

from pipeline import summary
from pipeline.summary import (
    LINE_BREAK_MARKER,
    NONE_FOUND,
    NONE_SUPPLIED,
    SECTION_HEADINGS,
    escape_inline,
    render_summary,
    visible_text,
)

# Both are in the test extra: GFM autolinks need linkify-it-py, footnotes
# need mdit-py-plugins. Importing them unconditionally keeps the hostile
# linkify/footnote checks from silently dropping out of CI.
import linkify_it  # noqa: F401
from mdit_py_plugins.footnote import footnote_plugin

HAVE_LINKIFY = True


def _parsers() -> dict[str, MarkdownIt]:
    parsers = {
        "commonmark": MarkdownIt("commonmark"),
        "gfm-tables": MarkdownIt("commonmark").enable(["table", "strikethrough"]),
    }
    if HAVE_LINKIFY:
        gfm = MarkdownIt("gfm-like")
        gfm.linkify.set({"fuzzy_email": True, "fuzzy_link": True, "fuzzy_ip": True})
        parsers["gfm-like+linkify"] = gfm
    if footnote_plugin is not None:
        footnotes = MarkdownIt("commonmark").enable(["table", "strikethrough"])
        parsers["gfm+footnotes"] = footnotes.use(footnote_plugin)
    return parsers


PARSERS = _parsers()

#: Inline token types that supplied text must never produce.
FORBIDDEN_INLINE = {
    "html_inline",
    "link_open",
    "image",
    "em_open",
    "strong_open",
    "s_open",
    "code_inline",
    "footnote_ref",
    "hardbreak",
    "softbreak",
}
FORBIDDEN_BLOCK = {"html_block", "code_block", "fence", "blockquote_open", "hr"}


def _walk(tokens):
    for token in tokens:
        yield token
        if token.children:
            yield from _walk(token.children)


def _is_text(child) -> bool:
    """Text, or the one code span the escaper makes: a run of ``@``."""
    return child.type == "text" or (child.type == "code_inline" and set(child.content) == {"@"})


def _inline_text(inline) -> str:
    """Plain text of an inline token (its only children should be text)."""
    return "".join(c.content for c in inline.children if _is_text(c))


def _paragraph_text(md: MarkdownIt, source: str) -> str:
    """Parse ``source`` as a whole document that must be one inert paragraph."""
    tokens = md.parse(source)
    types = [t.type for t in tokens]
    assert types == ["paragraph_open", "inline", "paragraph_close"], (source, types)
    children = tokens[1].children
    bad = [c.type for c in children if not _is_text(c)]
    assert not bad, (source, bad)
    return _inline_text(tokens[1])


def _table_cells(md: MarkdownIt, source: str) -> list[list[str]]:
    """Rows of cell texts of the single table in ``source``."""
    tokens = md.parse(source)
    assert tokens[0].type == "table_open", [t.type for t in tokens]
    rows: list[list[str]] = []
    for token in tokens:
        assert token.type not in FORBIDDEN_BLOCK
        if token.type == "tr_open":
            rows.append([])
        elif token.type == "inline":
            assert all(_is_text(c) for c in token.children), [c.type for c in token.children]
            rows[-1].append(_inline_text(token))
    return rows


# --- the escaper -------------------------------------------------------------

# Text with a heavy share of Markdown-active characters, line breaks and odd
# whitespace, plus arbitrary unicode (surrogates included).
MARKDOWNY = st.sampled_from(
    list("\\`*_~|#<>[]()!&;:/.@-+=^\"'{}$%?,") + ["\n", "\r\n", "\r", "\u2028", "\u2029", "\x0b",
    "\x0c", "\x85", "\t", " ", "    ", "\u00a0", "\u3000", "\x00", "\x1b", "\u202e", "www.", "http://",
    "https://", "mailto:", "&lt;", "&#60;", "&amp;", "<script>", "[^1]", "\n- ", "\n1. ", "\n===",
    "\n---", "```", "<https://a.b>", "example.com", "a@b.co", "javascript:", "![x](y)", "[x](y)"]
)
TEXT = st.one_of(
    st.text(),
    st.lists(st.one_of(MARKDOWNY, st.text(max_size=3)), max_size=25).map("".join),
)


@pytest.mark.parametrize("name", sorted(PARSERS))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT)
def test_escaped_paragraph_is_inert_and_verbatim(name, text):
    escaped = escape_inline(text)
    assert "\n" not in escaped and "\r" not in escaped
    escaped.encode("utf-8")  # always valid UTF-8
    md = PARSERS[name]
    # Prefix keeps an all-whitespace text a paragraph; the suffix keeps
    # trailing whitespace from being the paragraph's end.
    shown = _paragraph_text(md, "x " + escaped + " y")
    assert shown == "x " + visible_text(text) + " y"
    if visible_text(text).strip():
        assert _paragraph_text(md, escaped) == visible_text(text)


@pytest.mark.parametrize("name", sorted(n for n in PARSERS if n != "commonmark"))
@settings(max_examples=200, deadline=None)
@given(cells=st.lists(TEXT, min_size=1, max_size=4))
def test_escaped_cells_keep_the_table_shape(name, cells):
    header = "| " + " | ".join(f"h{i}" for i in range(len(cells))) + " |"
    sep = "|" + " --- |" * len(cells)
    row = "| " + " | ".join(escape_inline(c) for c in cells) + " |"
    rows = _table_cells(PARSERS[name], "\n".join([header, sep, row]) + "\n")
    assert rows[1] == [visible_text(c) for c in cells]


def _github_html(source: str) -> str:
    """cmark-gfm, GitHub's own renderer: its autolink extension links e-mail
    addresses in the unescaped text, which markdown-it's linkify does not."""
    return cmarkgfm.github_flavored_markdown_to_html(source, options=CmarkOptions.CMARK_OPT_FOOTNOTES)


def _github_text(fragment: str, tags: set[str]) -> str:
    found = set(re.findall(r"</?([A-Za-z][A-Za-z0-9]*)", fragment))
    assert found <= tags, (fragment, found - tags)
    assert "<!--" not in fragment and "href" not in fragment and "src=" not in fragment, fragment
    return html.unescape(re.sub(r"</?[A-Za-z][A-Za-z0-9]*>", "", fragment))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT)
def test_github_renders_an_escaped_string_as_inert_text(text):
    rendered = _github_html("x " + escape_inline(text) + " y").strip()
    assert _github_text(rendered, {"p", "code"}) == "x " + visible_text(text) + " y"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cells=st.lists(TEXT, min_size=1, max_size=3))
def test_github_renders_escaped_cells_as_inert_text(cells):
    header = "| " + " | ".join(f"h{i}" for i in range(len(cells))) + " |"
    sep = "|" + " --- |" * len(cells)
    row = "| " + " | ".join(escape_inline(c) for c in cells) + " |"
    rendered = _github_html("\n".join([header, sep, row]) + "\n")
    body = rendered.split("<tbody>", 1)[1]
    shown = [_github_text(cell, {"code"}) for cell in re.findall(r"<td>(.*?)</td>", body, re.S)]
    assert shown == [visible_text(c) for c in cells]


def test_github_links_an_unescaped_address_but_not_an_escaped_one():
    """The check above can fail: GitHub links a bare address, even backslash-escaped."""
    assert "mailto:" in _github_html("admin@evil.example")
    assert "mailto:" in _github_html("admin\\@evil\\.example")
    assert "mailto:" not in _github_html(escape_inline("admin@evil.example"))


def _reference_escape(text: str) -> str:
    """The escaper's definition, written plainly (the module takes faster routes)."""
    import string

    from pipeline.summary import _LINE_BREAK_RE, LINE_BREAK_MARKER, _visible_table

    shown = _LINE_BREAK_RE.sub(LINE_BREAK_MARKER, text).translate(_visible_table())
    core = shown.strip()
    ref = lambda c: f"&#x{ord(c):x};"
    if not core:
        return "".join(ref(c) for c in shown)
    start = len(shown) - len(shown.lstrip())
    end = start + len(core)
    punctuation = {ord(c): "\\" + c for c in string.punctuation}
    punctuation[ord("@")] = "@"
    escaped = re.sub("@+", lambda m: f"`{m.group()}`", core.translate(punctuation))
    return "".join(ref(c) for c in shown[:start]) + escaped + "".join(ref(c) for c in shown[end:])


@settings(max_examples=1500, deadline=None)
@given(text=st.one_of(TEXT, st.text(alphabet=st.characters(max_codepoint=0x3000)), st.text(alphabet=st.characters(min_codepoint=0x2000, max_codepoint=0xE000))))
def test_fast_escaper_equals_its_definition(text):
    assert summary._escape_inline.__wrapped__(text) == _reference_escape(text)


def test_visible_text_folding_rule():
    assert visible_text("a\r\nb\rc\nd\u2028e\u2029f\x0bg\x0ch\x85i") == LINE_BREAK_MARKER.join("abcdefghi")
    assert visible_text("\x00\x1b\x7f\x9b\u202e\ud800\t") == "\\x00\\x1b\\x7f\\x9b\\u202e\\ud800\t"
    assert visible_text("plain é 漢字 ☃") == "plain é 漢字 ☃"


RELIABILITY_48_50 = [
    "<script>alert(1)</script>",
    '<img src=x onerror="alert(1)">',
    "<iframe src='https://evil.example'></iframe>",
    "&lt;b&gt; &#60;b&#62; &#x3C; &amp; &copy;",
    "[x](javascript:alert(1))",
    "![img](https://evil.example/x.png)",
    "[ref]\n\n[ref]: https://evil.example",
    "<https://evil.example>",
    "<user@example.com>",
    "www.example.com",
    "visit https://example.com/path?q=1 now",
    "mail user@example.com",
    "example.com",
    "`code` ``x`` ```fence```",
    "```\ncode\n```",
    "*a* _b_ **c** __d__ ~~e~~ ~f~",
    "| a | b |\n|---|---|",
    "# heading",
    "    indented code",
    "\tindented with a tab",
    "line\n- item",
    "line\n1. item",
    "line\n===",
    "line\n---",
    "> quote",
    "see [^1]\n\n[^1]: fake footnote",
    "[^1]: fake definition",
    "trailing backslash \\",
    "hard  \nbreak",
    "\\*not emphasis\\*",
    "<!-- comment -->",
    "<?php ?>",
    "<![CDATA[x]]>",
    "$math$ {{ jinja }} ${x}",
    # Linkify also fires on these without escaping (IDN, full-width forms).
    "пример.рф",
    "ｗｗｗ.example.com",
    "http：//a.b",
    "user＠example.com",
    "ftp://x.y //example.com",
]


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", RELIABILITY_48_50)
def test_reliability_examples_render_as_literal_text(name, text):
    md = PARSERS[name]
    assert _paragraph_text(md, escape_inline(text)) == visible_text(text)
    html = md.render(escape_inline(text))
    assert "<a " not in html and "<img" not in html and "<script" not in html
    assert "<em" not in html and "<strong" not in html
    assert re.sub("<code>@+</code>", "", html).count("<code") == 0  # only the escaper's own @ spans


def test_linkify_would_fire_without_escaping():
    """Guards the linkify test itself: the parser does linkify raw text."""
    tokens = PARSERS["gfm-like+linkify"].parse("www.example.com")
    assert any(t.type == "link_open" for t in _walk(tokens))


def test_entities_stay_literal():
    assert escape_inline("&lt;") == "\\&lt\\;"
    assert PARSERS["commonmark"].render(escape_inline("&lt; &#60;")) == "<p>&amp;lt; &amp;#60;</p>\n"


def test_edge_whitespace_is_neither_indentation_nor_stripped():
    assert escape_inline("    x  ") == "&#x20;&#x20;&#x20;&#x20;x&#x20;&#x20;"
    assert escape_inline("") == ""
    assert escape_inline(" \t ") == "&#x20;&#x9;&#x20;"


def test_escape_inline_rejects_non_strings():
    with pytest.raises(TypeError):
        escape_inline(3)  # type: ignore[arg-type]


# --- whole summaries ---------------------------------------------------------


def _prov(kind, source, pointer):
    return {"kind": kind, "source": source, "pointer": pointer}


def _ref(path, size=10):
    return {"path": path, "sha256": "ab" * 32, "size": size}


def full_case(t=lambda s: s) -> dict:
    """A case following docs/internals.md; ``t`` maps every supplied string."""
    rep = t("reports/r1.json")
    repro = t("reproductions/p1.json")
    citation = {
        "url": t("https://example.org/spec"),
        "title": t("Spec"),
        "retrieved_at": t("2026-01-02T03:04:05Z"),
        "excerpt": t("The widget must be blue."),
    }
    return {
        "format": "viano-case",
        "format_version": 1,
        "builder_version": "1",
        "case": {
            "case_id": t("case-1"),
            "package_id": t("pkg-1"),
            "analysis_revision": 1,
            "package_generation": 2,
            "project": {"name": t("proj"), "version": t("1.0"), "repository": t("https://git/x")},
            "request_hash": t("cd" * 32),
        },
        "bug": {
            "titles": [{"text": t("Widget is red"), "provenance": _prov("tester_report", rep, t("/title"))}],
            "summaries": [{"text": t("It is red"), "provenance": _prov("tester_report", rep, t("/summary"))}],
            "attachments": [{**_ref(t("att/red.png")), "provenance": _prov("tester_report", rep, t("/attachments/0"))}],
        },
        "human_observations": {
            "observations": [
                {
                    "id": t("O0001"),
                    "text": t("I saw red"),
                    "author": t("ann"),
                    "observed_at": t("2026-01-01T00:00:00+01:00"),
                    "claim": {"key": t("color"), "value": t("red")},
                    "provenance": _prov("tester_report", rep, t("/observations/0")),
                },
                {
                    "id": t("O0002"),
                    "text": t("step showed red"),
                    "claim": {"key": t("color"), "value": {"rgb": [255, 0, 0], "s": t("x")}},
                    "provenance": _prov("reproduction", repro, t("/observations/0")),
                },
            ],
            "comments": [{"id": t("C0001"), "text": t("a comment"), "provenance": _prov("tester_report", rep, t("/comments/0"))}],
            "tester_hypotheses": [
                {"id": t("T0001"), "text": t("maybe the CSS"), "provenance": _prov("tester_report", rep, t("/tester_hypotheses/0"))}
            ],
        },
        "expected_behavior": {
            "completeness": "reported_partial",
            "declarations": [{"value": False, "source": rep, "pointer": t("/expected_behavior_complete")}],
            "statements": [
                {"id": t("E0001"), "text": t("should be blue"), "origin": "tester",
                 "provenance": _prov("tester_report", rep, t("/expected_behavior/0"))},
                {"id": t("E0002"), "text": t("blue per spec"), "origin": "external_research",
                 "citations": [citation, dict(citation, title=t("Other"))],
                 "provenance": _prov("external_research", t("research/aa/result.json"), t("/statements/0"))},
                {"id": t("E0003"), "text": t("also blue"), "origin": "external_research",
                 "citations": [citation],
                 "provenance": _prov("external_research", t("research/aa/result.json"), t("/statements/1"))},
            ],
            "status": "combined",
            "sufficiency": "complete",
        },
        "reproduction": {
            "reproductions": [
                {
                    "id": t("R0001"),
                    "source": repro,
                    "steps": [{"text": t("open it"), "pointer": t("/steps/0")}, {"text": t("look"), "pointer": t("/steps/1")}],
                    "observation_ids": [t("O0002")],
                    "fact_ids": [t("F0001")],
                    "events_ref": _ref(t("events/e.jsonl")),
                    "attachments": [_ref(t("att/shot.png")), _ref(t("att/log.txt"))],
                },
                {"id": t("R0002"), "source": repro, "steps": [], "observation_ids": [], "fact_ids": [],
                 "events_ref": None, "attachments": []},
            ]
        },
        "entities": [
            {"type": t("component"), "id": t("42"), "roles": [t("affected"), t("ui")],
             "sources": [{"kind": "tester_report", "source": rep, "pointer": t("/entities/0")},
                         {"kind": "reproduction", "source": repro, "pointer": t("/entities/1")}]}
        ],
        "runtime_facts": {
            "facts": [
                {"id": t("F0001"), "name": t("color"), "value": {"hex": t("#f00"), "n": 1.5},
                 "provenance": _prov("reproduction", repro, t("/facts/0"))},
                {"id": t("F0002"), "name": t("dump"), "value_ref": {"source": repro, "pointer": t("/facts/1/value")},
                 "provenance": _prov("reproduction", repro, t("/facts/1"))},
            ],
            "context": [_ref(t("context/runtime/r.log"))],
        },
        "database_context": [_ref(t("context/db/schema.sql"))],
        "source_context": [_ref(t("context/src/a.py")), _ref(t("context/src/b.py"))],
        "research": {
            "request": {
                "format": "viano-research-request", "format_version": 1, "case_id": "case-1",
                "package_id": "pkg-1", "analysis_revision": 1, "project": {"name": "proj", "version": "1.0"},
                "scope": "intended_behavior", "completeness": "reported_partial",
                "bug": {"titles": ["Widget is red"], "summaries": []}, "entities": [],
                "tester_expectations": [{"id": "E0001", "text": "should be blue"}],
            },
            "request_hash": t("ef" * 32),
            "results": [
                {"path": t("research/aa/result.json"), "sha256": t("12" * 32), "request_hash": t("ef" * 32),
                 "request": _ref(t("research/aa/request.json")),
                 "provider": {"name": t("prov"), "version": t("2")}, "status": "partial",
                 "statement_ids": [t("E0002"), t("E0003")]}
            ],
            "supplied": [_ref(t("context/research/notes.txt"))],
        },
        "data_quality": {
            "gaps": [{"code": "NO_REPRODUCTIONS", "message": t("no reproductions"), "source": rep},
                     {"code": "MISSING_INDEX", "message": t("no index")}],
            "claim_conflicts": [
                {"block": "human_observations", "key": t("color"),
                 "values": [{"value": t("red"), "id": t("O0001"), "source": rep, "pointer": t("/observations/0")},
                            {"value": {"rgb": [255, 0, 0]}, "id": t("O0002"), "source": repro, "pointer": t("/observations/0")}]}
            ],
        },
        "inputs": {
            "index": _ref(t("inputs/1/case-inputs.json")),
            "index_history": [_ref(t("inputs/1/case-inputs.json"))],
            "reports": [_ref(rep)],
            "reproductions": [_ref(repro)],
            "expected_research": [_ref(t("research/aa/result.json"))],
            "attachments": [],
            "unclassified": [_ref(t("misc/unknown.bin"))],
            "prior_case": None,
        },
    }


def empty_case() -> dict:
    return {
        "format": "viano-case",
        "format_version": 1,
        "builder_version": "1",
        "case": {"case_id": "c", "package_id": "p", "analysis_revision": 1, "package_generation": 1,
                 "project": {"name": "n", "version": "v"}, "request_hash": "00" * 32},
        "bug": {"titles": [], "summaries": [], "attachments": []},
        "human_observations": {"observations": [], "comments": [], "tester_hypotheses": []},
        "expected_behavior": {"completeness": "missing", "declarations": [], "statements": [],
                              "status": None, "sufficiency": "partial"},
        "reproduction": {"reproductions": []},
        "entities": [],
        "runtime_facts": {"facts": [], "context": []},
        "database_context": [],
        "source_context": [],
        "research": {"request": None, "request_hash": None, "results": [], "supplied": []},
        "data_quality": {"gaps": [{"code": "MISSING_INDEX", "message": "no index"}], "claim_conflicts": []},
        "inputs": {"index": None, "index_history": [], "reports": [], "reproductions": [],
                   "expected_research": [], "attachments": [], "unclassified": [], "prior_case": None},
    }


FOOTNOTE_REF = re.compile(r"\[\^(\d+)\](?!:)")
FOOTNOTE_DEF = re.compile(r"^\[\^(\d+)\]: ", re.MULTILINE)


def check_structure(markdown: str) -> list:
    """Integrity checks every summary must pass; returns the commonmark tokens."""
    assert markdown.endswith("\n") and not markdown.endswith("\n\n")
    markdown.encode("utf-8")
    # Headings: exactly the fixed set, in order, whatever the content.
    headings = [(len(m.group(1)), m.group(2)) for m in re.finditer(r"^(#+) (.*)$", markdown, re.MULTILINE)]
    assert headings == list(SECTION_HEADINGS)
    # Footnotes: every reference defined, every definition referenced, once each.
    refs = FOOTNOTE_REF.findall(markdown)
    defs = FOOTNOTE_DEF.findall(markdown)
    assert sorted(set(refs), key=int) == defs == [str(i) for i in range(1, len(defs) + 1)]
    for name, md in PARSERS.items():
        tokens = md.parse(markdown)
        for token in _walk(tokens):
            assert token.type not in FORBIDDEN_BLOCK, (name, token)
            if token.type == "footnote_ref":
                continue  # only ours: checked by the regexes above and below
            if token.type == "softbreak" and name == "commonmark":
                continue  # plain CommonMark reads our tables as multi-line paragraphs
            if _is_text(token):
                continue  # an escaped @ (see escape_inline)
            assert token.type not in FORBIDDEN_INLINE, (name, token)
        parsed_headings = [t for t in tokens if t.type == "heading_open"]
        assert len(parsed_headings) == len(SECTION_HEADINGS)
        if "table" in name or "gfm" in name:
            _check_tables(tokens)
        if name == "gfm+footnotes":
            n_refs = sum(t.type == "footnote_ref" for t in _walk(tokens))
            assert n_refs == len(refs)
            assert sum(t.type == "footnote_open" for t in tokens) == len(defs)
    # Every table line has the header's cell count (textual check too).
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("|" + " --- |"):
            width = line.count("---")
            j = i - 1
            while j < len(lines) and lines[j].startswith("|"):
                assert len(re.findall(r"(?<!\\)\|", lines[j])) - 1 == width, lines[j]
                j += 1
    return PARSERS["commonmark"].parse(markdown)


def _check_tables(tokens):
    width = None
    cells = 0
    for token in tokens:
        if token.type == "table_open":
            width = None
        elif token.type == "tr_open":
            cells = 0
        elif token.type in ("th_open", "td_open"):
            cells += 1
        elif token.type == "tr_close":
            if width is None:
                width = cells
            assert cells == width


def test_synthetic_cases_follow_the_case_contract():
    import contracts

    contracts.validate("case", full_case())
    contracts.validate("case", empty_case())


def test_full_case_structure_and_content():
    case = full_case()
    text = render_summary(case)
    check_structure(text)
    for needle in [
        "| Case id | case\\-1 |",
        "| Request hash | " + "cd" * 32 + " |",
        "O0001 (supplied by tester): I saw red (author: ann; observed at: 2026\\-01\\-01T00\\:00\\:00\\+01\\:00; "
        "claim: color = \\\"red\\\"; source: tester\\_report reports\\/r1\\.json#\\/observations\\/0)",
        "T0001 (tester hypothesis, not a fact): maybe the CSS",
        "E0002 (origin: external\\_research): blue per spec [^1] [^2] (source:",
        "E0003 (origin: external\\_research): also blue [^3] (source:",
        "[^1]: Title: Spec; URL: https\\:\\/\\/example\\.org\\/spec; retrieved at: 2026\\-01\\-02T03\\:04\\:05Z; "
        "excerpt: The widget must be blue\\.",
        "1. open it (source: reproductions\\/p1\\.json#\\/steps\\/0)",
        "| F0002 | dump | see reproductions\\/p1\\.json#\\/facts\\/1\\/value |",
        r'| F0001 | color | \{\"hex\"\:\"\#f00\"\,\"n\"\:1\.5\} |',
        "| NO\\_REPRODUCTIONS | no reproductions | reports\\/r1\\.json |",
        "| MISSING\\_INDEX | no index | \u2014 |",
        "| misc\\/unknown\\.bin | " + "ab" * 32 + " | 10 |",
        "| research\\/aa\\/result\\.json | " + "12" * 32 + " | research\\/aa\\/request\\.json | " + "ef" * 32
        + " | prov 2 | partial | yes | E0002, E0003 |",
    ]:
        assert needle in text, needle


def test_a_result_for_an_earlier_request_is_said_to_be_so():
    """Seed 000: historical research stays in the case, traceable, "not
    asserted current". After a reopen the result answered the previous
    revision's request; the summary listed its statements and its row like
    current ones, and only two 64-digit hashes told them apart (session 24's
    spec audit)."""
    case = full_case()
    case["research"]["request_hash"] = "ab" * 32
    text = render_summary(case)
    check_structure(text)
    assert ("E0002 (origin: external\\_research; from a result for an earlier research request): blue per spec"
            in text), text
    assert "E0003 (origin: external\\_research; from a result for an earlier research request): also blue" in text
    assert " | prov 2 | partial | no, an earlier one | E0002, E0003 |" in text
    assert "E0001 (tester statement)" in text  # tester statements are never so marked


def test_empty_case_says_none_supplied():
    text = render_summary(empty_case())
    check_structure(text)
    # Titles, summaries, report attachments, three tester lists,
    # declarations, statements, citations, reproductions, entities, facts,
    # runtime context, database, source, unclassified, results, supplied
    # research, inputs.
    assert text.count(f"\n\n{NONE_SUPPLIED}\n") == 19
    # Claim conflicts are the builder's own finding, not anybody's supply.
    assert text.count(f"\n\n{NONE_FOUND}\n") == 1
    assert "### Claim conflicts\n\nNone found.\n" in text
    assert "[^" not in text
    assert "| Research request | none |" in text
    # Facts are what reproductions supplied, and the summary says so.
    assert "## Runtime facts\n\nFacts as supplied in reproductions, not independently verified." in text


def test_deterministic_and_does_not_mutate():
    case = full_case()
    before = copy.deepcopy(case)
    first = render_summary(case)
    assert render_summary(copy.deepcopy(case)) == first
    assert render_summary(case).encode("utf-8") == first.encode("utf-8")
    assert case == before


def test_an_escape_memo_changes_no_output_and_carries_what_was_escaped():
    case = full_case()
    plain = render_summary(case)
    first = summary.EscapeMemo()
    assert render_summary(case, first) == plain
    long_texts = {t for t in first.used}
    assert "I saw red" in long_texts and all(len(t) >= summary.EscapeMemo.MIN_LENGTH for t in long_texts)
    assert all(first.used[t] == summary._escape_inline(t) for t in long_texts)
    assert first.worth_keeping() and first.missed == len(first.used)
    second = summary.EscapeMemo(dict(first.used))
    assert render_summary(case, second) == plain
    assert second.used == second.earlier and not second.worth_keeping()  # the build keeps the record as it is
    # Strings of an earlier render that this one does not show are not carried on.
    stale = summary.EscapeMemo({"gone from the case": "x", **first.used})
    assert render_summary(case, stale) == plain and "gone from the case" not in stale.used
    # A few strings more or fewer do not make the memo worth rewriting; many do.
    assert len(first.used) > 8
    few = summary.EscapeMemo(dict(list(first.used.items())[1:]))
    assert render_summary(case, few) == plain and few.missed == 1 and not few.worth_keeping()
    mostly_new = summary.EscapeMemo(dict(list(first.used.items())[: len(first.used) // 2]))
    render_summary(case, mostly_new)
    assert mostly_new.worth_keeping() and mostly_new.missed == len(first.used) - len(first.used) // 2
    mostly_stale = summary.EscapeMemo({**first.used, **{f"gone {i}": "x" for i in range(len(first.used))}})
    render_summary(case, mostly_stale)
    assert mostly_stale.worth_keeping() and mostly_stale.missed == 0
    assert summary._ACTIVE_MEMO.get() is None  # no memo is left active for later escapes


def test_a_line_memo_changes_no_output_and_carries_the_statement_lines():
    case = full_case()
    plain = render_summary(case)
    first = summary.LineMemo()
    assert render_summary(case, summary.EscapeMemo(), first) == plain
    statements = (case["human_observations"]["observations"] + case["human_observations"]["comments"]
                  + case["human_observations"]["tester_hypotheses"] + case["expected_behavior"]["statements"])
    assert len(first.used) == len(statements) and first.missed == len(statements) and first.worth_keeping()
    # Escapes of carried lines are not carried as well.
    both = summary.EscapeMemo()
    assert render_summary(case, both, summary.LineMemo()) == plain
    only_escapes = summary.EscapeMemo()
    render_summary(case, only_escapes)
    statement_texts = {s["text"] for s in statements if len(s["text"]) >= summary.EscapeMemo.MIN_LENGTH}
    assert statement_texts and statement_texts <= set(only_escapes.used)
    assert not statement_texts & set(both.used) and set(both.used) < set(only_escapes.used)
    assert all(line in plain for line in first.used.values())
    second = summary.LineMemo(dict(first.used))
    assert render_summary(case, None, second) == plain and second.missed == 0 and not second.worth_keeping()
    stale = summary.LineMemo({b'["","",{}]': "gone", **first.used})
    assert render_summary(case, summary.EscapeMemo(), stale) == plain and b'["","",{}]' not in stale.used
    # The memo is what the render takes a line from: a false pair shows (the
    # build vouches for its records as for every cache record).
    key = next(iter(first.used))
    forged = summary.LineMemo({**first.used, key: "FORGED LINE"})
    assert "FORGED LINE" in render_summary(case, None, forged)
    # Equal keys are equal statements: a changed statement is a new key.
    changed = copy.deepcopy(case)
    changed["human_observations"]["observations"][0]["text"] += " more"
    reused = summary.LineMemo(dict(first.used))
    assert render_summary(changed, None, reused) == render_summary(changed) and reused.missed == 1
    assert summary._ACTIVE_LINES.get() is None


def test_a_statement_with_no_encoding_is_rendered_not_remembered():
    case = full_case()
    case["human_observations"]["comments"][0]["text"] = "half \ud800 a pair"
    lines = summary.LineMemo()
    assert render_summary(case, None, lines) == render_summary(case)
    assert not any("ud800" in line or "\ud800" in line for line in lines.used.values())
    assert len(lines.used) == lines.missed  # everything else was remembered


def test_dict_order_does_not_matter():
    case = full_case()

    def reverse(value):
        if isinstance(value, dict):
            return {k: reverse(value[k]) for k in reversed(list(value))}
        if isinstance(value, list):
            return [reverse(v) for v in value]
        return value

    assert render_summary(reverse(case)) == render_summary(case)


def test_missing_required_field_is_an_error():
    case = empty_case()
    del case["entities"]
    with pytest.raises(KeyError):
        render_summary(case)


HOSTILE = st.sampled_from(RELIABILITY_48_50).flatmap(lambda s: st.just(s) | TEXT.map(lambda t: s + t))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hostile_strings_everywhere_keep_the_summary_well_formed(data):
    """Every supplied string replaced by hostile text: same layout, all inert."""
    supplied: list[str] = []

    def t(original: str) -> str:
        value = data.draw(st.one_of(HOSTILE, TEXT), label=original)
        supplied.append(value)
        return value

    case = full_case(t)
    text = render_summary(case)
    tokens = check_structure(text)
    shown = "\n".join(_inline_text(tok) for tok in _walk(tokens) if tok.type == "inline")
    for value in supplied:
        # Strings inside JSON values (claims, facts, results) appear in their
        # canonical JSON spelling.
        as_json = json.dumps(value, ensure_ascii=False)[1:-1]
        assert visible_text(value).strip() in shown or visible_text(as_json).strip() in shown
    # Footnote count is fixed by the case shape, not by the supplied text.
    assert FOOTNOTE_DEF.findall(text) == ["1", "2", "3"]


def test_same_bytes_under_other_hash_seed_locale_and_time_zone():
    tests_dir = Path(__file__).resolve().parent
    script = (
        "import hashlib, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
        "from test_summary import full_case; from pipeline.summary import render_summary; "
        "print(hashlib.sha256(render_summary(full_case()).encode()).hexdigest())"
    )
    expected = hashlib.sha256(render_summary(full_case()).encode()).hexdigest()
    for seed, tz, lc in (("0", "UTC", "C"), ("12345", "Asia/Kolkata", "C.UTF-8")):
        env = dict(os.environ, PYTHONHASHSEED=seed, TZ=tz, LC_ALL=lc)
        out = subprocess.run(
            [sys.executable, "-c", script, str(tests_dir.parent), str(tests_dir)],
            env=env, capture_output=True, text=True, check=True,
        )
        assert out.stdout.strip() == expected


def test_the_quick_search_finds_exactly_what_visible_text_changes():
    """_NEEDS_VISIBLE_RE is written out as ranges; it must match exactly the
    characters of the table and the line breaks, over all of Unicode."""
    from pipeline.summary import _LINE_BREAK_RE, _NEEDS_VISIBLE_RE, _visible_table

    table = _visible_table()
    for code in range(0x110000):
        char = chr(code)
        changed = code in table or _LINE_BREAK_RE.search(char) is not None
        assert (_NEEDS_VISIBLE_RE.search(char) is not None) == changed, hex(code)


def test_a_case_confirmed_before_report_attachments_renders_as_it_did():
    """A case without ``bug.attachments`` (confirmed before reports'
    attachments were read) renders without that section, so rendering it
    again gives the summary it was published with (status compares them)."""
    import json

    from tests.conftest import FIXTURES

    golden = FIXTURES / "golden" / "sample"
    case = json.loads((golden / "case.json").read_text(encoding="utf-8"))
    summary = (golden / "case_summary.md").read_text(encoding="utf-8")
    assert render_summary(case) == summary
    heading = "### Attachments (supplied with reports)\n\n"
    start = summary.index(heading)
    end = summary.index("\n\n## ", start) + 2
    del case["bug"]["attachments"]
    assert render_summary(case) == summary[:start] + summary[end:]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_summary_bound_never_stops_a_summary_within_its_limit(data):
    """The bound charges only locations the summary holds: rendering at
    exactly the summary's own size (in UTF-8 bytes) gives the same text."""
    case = full_case(lambda original: data.draw(st.one_of(HOSTILE, TEXT), label=original))
    text = render_summary(case)
    size = len(text.encode("utf-8"))
    assert render_summary(case, limit=size + data.draw(st.integers(0, 3))) == text


def test_a_summary_far_over_its_limit_is_stopped_while_its_lines_are_made():
    """case.json names a reproduction's source once, the summary on every step:
    95,000 one-letter steps at a 3.8 KB path made a 362 MB summary (1.5 GB of
    memory) from an 8 MB case before its size was checked."""
    from pipeline.summary import SummaryTooLarge

    case = full_case()
    source = "/".join(["s" * 250] * 15) + "/repro.json"
    (first, *_) = case["reproduction"]["reproductions"]
    first["source"] = source
    first["steps"] = [{"text": "x", "pointer": f"/steps/{i}"} for i in range(20_000)]  # ~76 MB of summary
    with pytest.raises(SummaryTooLarge) as stopped:
        render_summary(case, limit=8 << 20)
    assert (8 << 20) < stopped.value.at_least < (8 << 20) + 8192
    assert len(render_summary(case)) > 70 << 20  # without a limit, the whole render


def test_the_summary_bound_and_its_refusal_do_not_depend_on_the_line_memo():
    """A statement line taken from the carried line memo was not charged, so
    a rebuild refused a summary with its exact size where a build without
    the cache refused it with the bound (session 21's diff review)."""
    from pipeline.summary import SummaryTooLarge

    case = full_case()
    long_source = "/".join(["s" * 250] * 15) + "/report.json"
    observation = case["human_observations"]["observations"][0]
    case["human_observations"]["observations"] = [
        {**observation, "id": f"O{n:04d}", "provenance": {**observation["provenance"], "source": long_source, "pointer": f"/observations/{n}"}}
        for n in range(1, 3000)
    ]
    full = render_summary(case)
    carried = summary.LineMemo()
    render_summary(case, None, carried)
    limit = len(full.encode("utf-8")) // 2
    refusals = []
    for memo in (None, summary.LineMemo(dict(carried.used)), summary.LineMemo()):
        with pytest.raises(SummaryTooLarge) as refused:
            render_summary(case, None, memo, limit=limit)
        refusals.append(refused.value.at_least)
    assert len(set(refusals)) == 1 and limit < refusals[0] < limit + 8192, refusals
    assert render_summary(case, None, summary.LineMemo(dict(carried.used)), limit=len(full.encode("utf-8"))) == full

"""Render the canonical case as a deterministic, inert Markdown summary.

:func:`render_summary` turns a canonical case dict (docs/internals.md, "The
case document") into ``case_summary.md``. It is pure: no I/O, clock, locale,
environment or hash-seed dependence; the same case gives the same string, and
the input is never mutated. It adds no interpretation: every supplied string
is shown verbatim (escaped), labelled with its id and its provenance
``source#pointer``; an empty list is shown as "None supplied.", or as
"None found." for what the builder derives (gaps, claim conflicts).

Every supplied string (ids and paths included) goes through
:func:`escape_inline`, so nothing a tester or a research provider wrote can
become live Markdown or HTML (RELIABILITY.md 48-50):

* every ASCII punctuation character but ``@`` is backslash-escaped
  (CommonMark allows this for all of them), which defeats emphasis, code
  spans, links, images, raw HTML, entities (``&`` is escaped, so ``&lt;``
  stays the text "&lt;"), footnote references, table pipes, headings and list
  markers, and breaks ``www.``/``http://`` autolinks, which GFM recognises in
  the source text where the escaped ``.`` and ``:`` split them;
* each run of ``@`` becomes a code span: GFM (cmark-gfm, GitHub) links e-mail
  addresses after unescaping, in the text itself, so an escaped ``@`` would
  still be linked; in a code span it is shown as the same character;
* every line break (``\\r\\n``, ``\\r``, ``\\n``, ``\\v``, ``\\f``,
  ``\\x1c``-``\\x1e``, ``\\x85``, ``\\u2028``, ``\\u2029`` -- exactly the
  boundaries of :meth:`str.splitlines`) is folded into the visible marker
  :data:`LINE_BREAK_MARKER`, so one supplied string is one paragraph or cell;
* other control characters, bidirectional-override characters and lone
  surrogates are shown as Python-style escapes (``\\x00``, ``\\u202e``,
  ``\\udc80``), so the output is always valid UTF-8 and reads as it renders;
* whitespace at either end is written as numeric character references, so it
  is neither indentation (no code block) nor stripped by a parser.

:func:`visible_text` is the exact text a CommonMark reader shows for
``escape_inline(text)``; the tests hold the two together with a real parser.

Limits: the escaping targets CommonMark and GFM (tables, footnotes, autolink
extension); the tests render with markdown-it and with cmark-gfm. URLs in
citations are therefore inert text, not links.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
from typing import Any

from .jsoncanon import canonical_bytes

__all__ = [
    "EscapeMemo",
    "LineMemo",
    "LINE_BREAK_MARKER",
    "NONE_FOUND",
    "NONE_SUPPLIED",
    "SECTION_HEADINGS",
    "escape_inline",
    "render_summary",
    "visible_text",
]

#: What a supplied line break becomes (U+2424 SYMBOL FOR NEWLINE).
LINE_BREAK_MARKER = "\u2424"
#: The whole content of an empty section or list of supplied data.
NONE_SUPPLIED = "None supplied."
#: The whole content of an empty list the builder derives (gaps, claim
#: conflicts): nobody supplies those, so "None supplied." would misstate whose
#: finding the absence is.
NONE_FOUND = "None found."

#: The fixed headings, in output order (level, text). Always all present,
#: but for the report attachments section of a case confirmed before it existed.
SECTION_HEADINGS: tuple[tuple[int, str], ...] = (
    (1, "Case summary"),
    (2, "Case identity"),
    (2, "Bug"),
    (3, "Titles"),
    (3, "Summaries"),
    (3, "Attachments (supplied with reports)"),
    (2, "Supplied by testers"),
    (3, "Observations (supplied by testers)"),
    (3, "Comments (supplied by testers)"),
    (3, "Tester hypotheses (supplied by testers; hypotheses, not facts)"),
    (2, "Expected behaviour"),
    (3, "Completeness declarations"),
    (3, "Expected-behaviour statements"),
    (3, "Citations"),
    (2, "Reproductions"),
    (2, "Entities"),
    (2, "Runtime facts"),
    (3, "Facts"),
    (3, "Runtime context files"),
    (2, "Database context"),
    (2, "Source context"),
    (2, "Unclassified inputs"),
    (2, "Research"),
    (3, "Research results"),
    (3, "Supplied research files"),
    (2, "Data quality"),
    (3, "Gaps"),
    (3, "Claim conflicts"),
    (2, "Input files"),
)

_PREAMBLE = (
    "Generated deterministically from the canonical case document. Supplied "
    "text is reproduced verbatim and escaped, without interpretation; a line "
    f"break inside supplied text is shown as {LINE_BREAK_MARKER}."
)

_ABSENT = "\u2014"  # an optional field that is not present (em dash)

# \r\n first so that it folds into one marker.
_LINE_BREAK_RE = re.compile("\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def _char_escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


@functools.cache
def _visible_table() -> dict[int, str]:
    """What :func:`visible_text` shows in place of each invisible character.
    Built on first use: most renders never meet such a character, and its
    2,000 entries (every lone surrogate) cost an import about a millisecond."""
    table: dict[int, str] = {}
    controls = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]
    bidi = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    for code in controls + bidi + list(range(0xD800, 0xE000)):
        if code != 0x09:  # a tab is ordinary whitespace
            table[code] = _char_escape(code)
    return table


# A run of @ is matched whole: it becomes one code span (see _backslashed).
_PUNCTUATION_RE = re.compile("@+|[" + re.escape(string.punctuation.replace("@", "")) + "]")

# Anything visible_text would change: the table's characters and the line
# breaks (a test holds the two together). Most supplied text has none of it,
# and one search is several times cheaper than the substitution and translation.
_NEEDS_VISIBLE_RE = re.compile(
    "[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _backslashed(match: re.Match) -> str:
    found = match.group()
    # GitHub links e-mail addresses after unescaping, in any text: a\@b\.c and
    # a&#64;b.c both become mailto links. A code span keeps the @ out of the
    # text it scans and shows the same characters; a run of them is one span,
    # since two spans side by side would read as one with a longer fence.
    return f"`{found}`" if found[0] == "@" else "\\" + found


def visible_text(text: str) -> str:
    """The text a reader sees for ``escape_inline(text)``.

    Line breaks become :data:`LINE_BREAK_MARKER`; control, bidi-override and
    lone-surrogate characters become ``\\xNN``/``\\uNNNN``; all else is kept.
    """
    if _NEEDS_VISIBLE_RE.search(text) is None:
        return text
    return _LINE_BREAK_RE.sub(LINE_BREAK_MARKER, text).translate(_visible_table())


def _whitespace_ref(char: str) -> str:
    return f"&#x{ord(char):x};"


@functools.lru_cache(maxsize=1 << 16)
def _escape_inline(text: str) -> str:
    """:func:`escape_inline` itself, without the memo."""
    if not isinstance(text, str):
        raise TypeError(f"escape_inline expects str, not {type(text).__name__}")
    shown = visible_text(text)
    if shown and not shown[0].isspace() and not shown[-1].isspace():
        return _PUNCTUATION_RE.sub(_backslashed, shown)  # the common case: nothing to strip
    core = shown.strip()
    if not core:
        return "".join(_whitespace_ref(c) for c in shown)
    start = len(shown) - len(shown.lstrip())
    end = start + len(core)
    return (
        "".join(_whitespace_ref(c) for c in shown[:start])
        + _PUNCTUATION_RE.sub(_backslashed, core)
        + "".join(_whitespace_ref(c) for c in shown[end:])
    )


class _CarriedMemo:
    """Results of a pure function of a key, carried from one render to the next.

    ``earlier`` holds pairs an earlier render collected (the caller vouches
    for them, as for any cache record); :attr:`used` collects the pairs this
    render needed, which is what the next render should be given.
    """

    def __init__(self, earlier: dict | None = None) -> None:
        self.earlier = earlier or {}
        self.used: dict = {}
        self.missed = 0

    def _lookup(self, key, make):
        value = self.used.get(key)
        if value is None:
            value = self.earlier.get(key)
            if value is None:
                value = make()
                self.missed += 1
            self.used[key] = value
        return value

    def worth_keeping(self) -> bool:
        """Whether :attr:`used` should replace ``earlier`` for the next render:
        when it differs by more than an eighth either way. A rebuild after an
        append needs a few new pairs, and the next render can make those few
        again more cheaply than the memo can be rewritten."""
        stale = len(self.earlier) - (len(self.used) - self.missed)
        return self.missed * 8 > len(self.used) or stale * 8 > len(self.earlier)


class EscapeMemo(_CarriedMemo):
    """Escaped forms of long supplied strings, carried from one render to the next.

    Escaping is a pure function of the string, and the render of a rebuild
    after an append escapes again nearly every string the previous render did:
    megabytes of text, most of a render's time.
    """

    #: Shorter strings (ids, pointers, sizes) repeat and are cheap: the
    #: in-process cache covers them.
    MIN_LENGTH = 8

    def escape(self, text: str) -> str:
        return self._lookup(text, lambda: _escape_inline(text))


class LineMemo(_CarriedMemo):
    """Rendered statement lines, carried from one render to the next, keyed
    by the exact JSON encoding of what the line is made of (:func:`_line_key`).

    A statement's line is a pure function of the statement and its label, and
    a rebuild after an append renders again every statement the previous
    render did: a few thousand lines, most of what remains of a render.
    """


_ACTIVE_MEMO: contextvars.ContextVar[EscapeMemo | None] = contextvars.ContextVar("viano_escape_memo", default=None)
_ACTIVE_LINES: contextvars.ContextVar[LineMemo | None] = contextvars.ContextVar("viano_line_memo", default=None)


class SummaryTooLarge(Exception):
    """The summary rendered so far already holds more than ``limit`` bytes:
    ``at_least`` is a lower bound of its size."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"summary would be at least {at_least} bytes, limit {limit}")
        self.at_least = at_least
        self.limit = limit


class _SummaryBudget:
    """A running lower bound of the summary's bytes: the source locations,
    and the statement lines whole.

    Where case.json names a reproduction's source once, the summary names it
    on every step (and an escaped path can be twice as long), so a 475 KB
    reproduction of 95,000 steps at a 3.8 KB path rendered 362 MB (1.5 GB of
    memory) before the size was checked. Every location is text the summary
    holds (a character is at least a byte), so the bound never passes the
    real size; the exact check follows the encoding."""

    __slots__ = ("used", "limit")

    def __init__(self, limit: int) -> None:
        self.used = 0
        self.limit = limit

    def charge(self, size: int) -> None:
        self.used += size
        if self.used > self.limit:
            raise SummaryTooLarge(self.used, self.limit)


_ACTIVE_BUDGET: contextvars.ContextVar[_SummaryBudget | None] = contextvars.ContextVar("viano_summary_budget", default=None)


def escape_inline(text: str) -> str:
    """Escape one supplied string into inert single-line Markdown.

    The result is one paragraph or table cell whose rendered text is
    ``visible_text(text)``: no HTML, link, image, autolink, emphasis, code,
    heading, list, quote or footnote can arise from it, and no code either
    but one kind: every ASCII punctuation character is backslash-escaped,
    except ``@``, of which each run becomes a code span, because GitHub's
    e-mail autolinking runs on the unescaped text (see ``_backslashed``).
    """
    memo = _ACTIVE_MEMO.get()
    if memo is not None and type(text) is str and len(text) >= EscapeMemo.MIN_LENGTH:
        return memo.escape(text)
    return _escape_inline(text)


# --- value formatting -------------------------------------------------------


def _json_text(value: Any) -> str:
    """Canonical JSON text of ``value`` (sorted keys, compact, raw UTF-8)."""
    try:
        return canonical_bytes(value).decode("utf-8")
    except UnicodeEncodeError:  # lone surrogate: still shown, as an escape
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )


def _scalar(value: Any) -> str:
    """A supplied value: strings verbatim, anything else as canonical JSON."""
    if isinstance(value, str):
        return escape_inline(value)
    return escape_inline(_json_text(value))


def _loc(source: Any, pointer: Any) -> str:
    text = f"{_scalar(source)}#{_scalar(pointer)}"
    budget = _ACTIVE_BUDGET.get()
    if budget is not None:
        budget.charge(len(text))
    return text


def _prov(prov: dict) -> str:
    return f"{_scalar(prov['kind'])} {_loc(prov['source'], prov['pointer'])}"


def _size(value: Any) -> str:
    return _scalar(value)


# --- block builders ---------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> str:
    """A GFM table; every row has exactly the header's cell count."""
    width = len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * width]
    for row in rows:
        if len(row) != width:  # a programming error here, never data
            raise AssertionError(f"table row has {len(row)} cells, header {width}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _ref_table(refs: list) -> str:
    if not refs:
        return NONE_SUPPLIED
    return _table(
        ["Path", "SHA-256", "Size (bytes)"],
        [[_scalar(r["path"]), _scalar(r["sha256"]), _size(r["size"])] for r in refs],
    )


def _bullets(items: list[str]) -> str:
    # One join, no per-item copies: a case's bullets are megabytes of text.
    return "- " + "\n- ".join(items) if items else NONE_SUPPLIED


def _statement(s: dict, extra: str = "", refs: str = "") -> str:
    budget = _ACTIVE_BUDGET.get()
    if budget is None:
        return _remembered_or_rendered(s, extra, refs)
    # The whole line is charged, whether the line memo had it or not (its
    # location is not charged again): the bound, and the refusal a summary
    # too large gets, must not depend on what the cache holds.
    token = _ACTIVE_BUDGET.set(None)
    try:
        line = _remembered_or_rendered(s, extra, refs)
    finally:
        _ACTIVE_BUDGET.reset(token)
    budget.charge(len(line))
    return line


def _remembered_or_rendered(s: dict, extra: str, refs: str) -> str:
    lines = _ACTIVE_LINES.get()
    if lines is not None:
        key = _line_key(s, extra, refs)
        if key is not None:
            return lines._lookup(key, lambda: _line_escaping_unremembered(s, extra, refs))
    return _statement_line(s, extra, refs)


def _line_escaping_unremembered(s: dict, extra: str, refs: str) -> str:
    """A line the line memo will carry: the escapes made for it need not be
    carried too, and leaving them out keeps the escape memo a fraction of
    the size (what is left: titles, steps, facts, entities, paths)."""
    token = _ACTIVE_MEMO.set(None)
    try:
        return _statement_line(s, extra, refs)
    finally:
        _ACTIVE_MEMO.reset(token)


_line_encoder = None


def _line_key(s: dict, extra: str, refs: str) -> bytes | None:
    """The exact JSON encoding of a statement and its label: for the JSON
    values a case holds, equal keys are equal statements, hence equal lines.
    None when it has no encoding (a lone surrogate): that line is rendered,
    never remembered."""
    global _line_encoder
    if _line_encoder is None:
        import msgspec  # lazily: only a build's render carries lines

        # Sorted keys: a statement decoded from case.json (sorted) and one
        # assemble built in this process (insertion order) meet the same line.
        _line_encoder = msgspec.json.Encoder(order="sorted").encode
    try:
        return _line_encoder((extra, refs, s))
    except (TypeError, ValueError, OverflowError):  # UnicodeEncodeError is a ValueError
        return None


def _statement_line(s: dict, extra: str, refs: str) -> str:
    details = []
    if "author" in s:
        details.append(f"author: {_scalar(s['author'])}")
    if "observed_at" in s:
        details.append(f"observed at: {_scalar(s['observed_at'])}")
    if "claim" in s:
        claim = s["claim"]
        details.append(f"claim: {_scalar(claim['key'])} = {escape_inline(_json_text(claim['value']))}")
    details.append(f"source: {_prov(s['provenance'])}")
    return f"{_scalar(s['id'])}{extra}: {escape_inline(s['text'])}{refs} ({'; '.join(details)})"


def _heading(level: int, text: str) -> str:
    return "#" * level + " " + text


# --- sections ---------------------------------------------------------------


def _identity(case: dict) -> list[str]:
    ident = case["case"]
    rows = [
        ["Case id", _scalar(ident["case_id"])],
        ["Package id", _scalar(ident["package_id"])],
        ["Analysis revision", _scalar(ident["analysis_revision"])],
        ["Package generation", _scalar(ident["package_generation"])],
    ]
    project = ident["project"]
    known = ["name", "version", "repository", "revision"]
    for key in known + sorted(k for k in project if k not in known):
        if key in project:
            rows.append([f"Project {escape_inline(key)}", _scalar(project[key])])
    rows += [
        ["Request hash", _scalar(ident["request_hash"])],
        ["Format", f"{_scalar(case['format'])} version {_scalar(case['format_version'])}"],
        ["Builder version", _scalar(case["builder_version"])],
    ]
    return [_table(["Field", "Value"], rows)]


def _texts(items: list) -> str:
    return _bullets(
        [f"{escape_inline(t['text'])} (source: {_prov(t['provenance'])})" for t in items]
    )


def _bug(case: dict) -> list[str]:
    bug = case["bug"]
    blocks = [
        _heading(3, "Titles"),
        _texts(bug["titles"]),
        _heading(3, "Summaries"),
        _texts(bug["summaries"]),
    ]
    if "attachments" not in bug:
        # A case confirmed before reports' attachments were recorded: its
        # summary had no such section, and rendering it again gives that summary.
        return blocks
    attachments = bug["attachments"]
    return blocks + [
        _heading(3, "Attachments (supplied with reports)"),
        _table(
            ["Path", "SHA-256", "Size (bytes)", "Attached by"],
            [[_scalar(a["path"]), _scalar(a["sha256"]), _size(a["size"]), _prov(a["provenance"])] for a in attachments],
        )
        if attachments
        else NONE_SUPPLIED,
    ]


def _human(case: dict) -> list[str]:
    human = case["human_observations"]
    return [
        "Everything in this section was supplied by testers and is reproduced as written.",
        _heading(3, "Observations (supplied by testers)"),
        _bullets([_statement(s, " (supplied by tester)") for s in human["observations"]]),
        _heading(3, "Comments (supplied by testers)"),
        _bullets([_statement(s, " (supplied by tester)") for s in human["comments"]]),
        _heading(3, "Tester hypotheses (supplied by testers; hypotheses, not facts)"),
        _bullets(
            [_statement(s, " (tester hypothesis, not a fact)") for s in human["tester_hypotheses"]]
        ),
    ]


def _expected(case: dict) -> list[str]:
    eb = case["expected_behavior"]
    blocks = [
        _table(
            ["Field", "Value"],
            [
                ["Completeness", _scalar(eb["completeness"])],
                ["Sufficiency", _scalar(eb["sufficiency"])],
                ["Status", _scalar(eb["status"])],
            ],
        ),
        _heading(3, "Completeness declarations"),
    ]
    declarations = eb["declarations"]
    blocks.append(
        _table(
            ["Value", "Source"],
            [[_scalar(d["value"]), _loc(d["source"], d["pointer"])] for d in declarations],
        )
        if declarations
        else NONE_SUPPLIED
    )
    items: list[str] = []
    notes: list[str] = []
    # Seed 000: historical research stays in the case, "not asserted
    # current". Which results answer another request than this revision's is
    # in case.json (two hashes); said here so that it needs no comparing.
    answers_to_earlier = _statements_of_earlier_requests(case)
    for s in eb["statements"]:
        marks = []
        for citation in s.get("citations", []):
            number = len(notes) + 1
            marks.append(f" [^{number}]")
            notes.append(
                f"[^{number}]: Title: {_scalar(citation['title'])}; "
                f"URL: {_scalar(citation['url'])}; "
                f"retrieved at: {_scalar(citation['retrieved_at'])}; "
                f"excerpt: {_scalar(citation['excerpt'])}"
            )
        origin = s["origin"]
        label = " (tester statement)" if origin == "tester" else f" (origin: {_scalar(origin)})"
        if s["id"] in answers_to_earlier:
            label = label[:-1] + "; from a result for an earlier research request)"
        items.append(_statement(s, label, "".join(marks)))
    blocks += [
        _heading(3, "Expected-behaviour statements"),
        _bullets(items),
        _heading(3, "Citations"),
    ]
    if notes:
        blocks.append("Excerpts are quoted from the cited sources without interpretation.")
        blocks += notes  # one block each: a definition never swallows the next
    else:
        blocks.append(NONE_SUPPLIED)
    return blocks


def _statements_of_earlier_requests(case: dict) -> set:
    research = case["research"]
    return {
        statement_id
        for result in research["results"]
        if result["request_hash"] != research["request_hash"]
        for statement_id in result["statement_ids"]
    }


def _ids(values: list) -> str:
    return ", ".join(_scalar(v) for v in values) if values else NONE_SUPPLIED


def _reproductions(case: dict) -> list[str]:
    reproductions = case["reproduction"]["reproductions"]
    if not reproductions:
        return [NONE_SUPPLIED]
    blocks: list[str] = []
    for r in reproductions:
        source = r["source"]
        blocks.append(f"Reproduction {_scalar(r['id'])} (source: {_scalar(source)})")
        steps = r["steps"]
        blocks.append("Steps:")
        blocks.append(
            "\n".join(
                f"{i}. {escape_inline(step['text'])} (source: {_loc(source, step['pointer'])})"
                for i, step in enumerate(steps, 1)
            )
            if steps
            else NONE_SUPPLIED
        )
        blocks.append(f"Observation ids: {_ids(r['observation_ids'])}")
        blocks.append(f"Fact ids: {_ids(r['fact_ids'])}")
        blocks.append("Events:")
        events = r["events_ref"]
        blocks.append(_ref_table([events] if events is not None else []))
        blocks.append("Attachments:")
        blocks.append(_ref_table(r["attachments"]))
    return blocks


def _entities(case: dict) -> list[str]:
    entities = case["entities"]
    if not entities:
        return [NONE_SUPPLIED]
    rows = [
        [
            _scalar(e["type"]),
            _scalar(e["id"]),
            ", ".join(_scalar(role) for role in e["roles"]) or _ABSENT,
            "; ".join(_loc(s["source"], s["pointer"]) for s in e["sources"]) or _ABSENT,
        ]
        for e in entities
    ]
    return [_table(["Type", "Id", "Roles", "Sources"], rows)]


def _facts(case: dict) -> list[str]:
    rf = case["runtime_facts"]
    rows = []
    for f in rf["facts"]:
        if "value" in f:
            value = escape_inline(_json_text(f["value"]))
        else:
            ref = f["value_ref"]
            value = f"see {_loc(ref['source'], ref['pointer'])}"
        rows.append([_scalar(f["id"]), _scalar(f["name"]), value, _prov(f["provenance"])])
    return [
        # Seed 001: supplied facts, not independently verified technical findings.
        "Facts as supplied in reproductions, not independently verified. Values are shown as canonical JSON.",
        _heading(3, "Facts"),
        _table(["Id", "Name", "Value", "Source"], rows) if rows else NONE_SUPPLIED,
        _heading(3, "Runtime context files"),
        _ref_table(rf["context"]),
    ]


def _research(case: dict) -> list[str]:
    research = case["research"]
    request = research["request"]
    request_hash = research["request_hash"]
    blocks = [
        _table(
            ["Field", "Value"],
            [
                ["Research request", "none" if request is None else "present"],
                ["Request hash", _ABSENT if request_hash is None else _scalar(request_hash)],
                ["Results", _scalar(len(research["results"]))],
            ],
        ),
        _heading(3, "Research results"),
    ]
    rows = [
        [
            _scalar(r["path"]),
            _scalar(r["sha256"]),
            _scalar(r["request"]["path"]),
            _scalar(r["request_hash"]),
            f"{_scalar(r['provider']['name'])} {_scalar(r['provider']['version'])}",
            _scalar(r["status"]),
            "yes" if r["request_hash"] == request_hash else "no, an earlier one",
            _ids(r["statement_ids"]),
        ]
        for r in research["results"]
    ]
    blocks.append(
        _table(["Path", "SHA-256", "Request", "Request hash", "Provider", "Status", "For the current request",
                "Statement ids"], rows)
        if rows
        else NONE_SUPPLIED
    )
    blocks += [_heading(3, "Supplied research files"), _ref_table(research["supplied"])]
    return blocks


def _data_quality(case: dict) -> list[str]:
    dq = case["data_quality"]
    gaps = dq["gaps"]
    blocks = [_heading(3, "Gaps")]
    blocks.append(
        _table(
            ["Code", "Message", "Source"],
            [
                [
                    _scalar(g["code"]),
                    _scalar(g["message"]),
                    _scalar(g["source"]) if "source" in g else _ABSENT,
                ]
                for g in gaps
            ],
        )
        if gaps
        else NONE_FOUND
    )
    blocks.append(_heading(3, "Claim conflicts"))
    conflicts = dq["claim_conflicts"]
    if not conflicts:
        blocks.append(NONE_FOUND)
    for c in conflicts:
        blocks.append(f"Claim key {_scalar(c['key'])} in {_scalar(c['block'])}:")
        rows = [
            [escape_inline(_json_text(v["value"])), _scalar(v["id"]), _loc(v["source"], v["pointer"])]
            for v in c["values"]
        ]
        blocks.append(_table(["Value", "Id", "Source"], rows) if rows else NONE_SUPPLIED)
    return blocks


def _inputs(case: dict) -> list[str]:
    inputs = case["inputs"]
    rows = []
    for role, key in (
        ("index", "index"),
        ("index history", "index_history"),
        ("report", "reports"),
        ("reproduction", "reproductions"),
        ("expected research", "expected_research"),
        ("attachment", "attachments"),
        ("unclassified", "unclassified"),
        ("prior case", "prior_case"),
    ):
        value = inputs.get(key)
        refs = value if isinstance(value, list) else ([] if value is None else [value])
        rows += [[role, _scalar(r["path"]), _scalar(r["sha256"]), _size(r["size"])] for r in refs]
    if not rows:
        return [NONE_SUPPLIED]
    return [_table(["Role", "Path", "SHA-256", "Size (bytes)"], rows)]


def render_summary(
    case: dict, memo: EscapeMemo | None = None, lines: LineMemo | None = None, *, limit: int | None = None
) -> str:
    """Render ``case`` as Markdown; same case, same string; ends with one newline.

    ``case`` must have the pinned shape (a missing required field raises
    ``KeyError``); it is read only, never modified. A ``memo`` and ``lines``
    only save work: the string is the same with any memo whose pairs are true
    escapes and any line memo whose pairs are true lines. With ``limit``, a
    render that is sure to pass that many UTF-8 bytes stops with
    :class:`SummaryTooLarge` (one within it is never stopped).
    """
    token = _ACTIVE_MEMO.set(memo)
    line_token = _ACTIVE_LINES.set(lines)
    budget_token = _ACTIVE_BUDGET.set(None if limit is None else _SummaryBudget(limit))
    try:
        return _render(case)
    finally:
        _ACTIVE_BUDGET.reset(budget_token)
        _ACTIVE_LINES.reset(line_token)
        _ACTIVE_MEMO.reset(token)


def _render(case: dict) -> str:
    blocks: list[str] = [_heading(1, "Case summary"), _PREAMBLE]
    sections = (
        ("Case identity", _identity),
        ("Bug", _bug),
        ("Supplied by testers", _human),
        ("Expected behaviour", _expected),
        ("Reproductions", _reproductions),
        ("Entities", _entities),
        ("Runtime facts", _facts),
        ("Database context", lambda c: [_ref_table(c["database_context"])]),
        ("Source context", lambda c: [_ref_table(c["source_context"])]),
        ("Unclassified inputs", lambda c: [_ref_table(c["inputs"]["unclassified"])]),
        ("Research", _research),
        ("Data quality", _data_quality),
        ("Input files", _inputs),
    )
    for title, build in sections:
        blocks.append(_heading(2, title))
        blocks += build(case)
    # Blocks are separated by one blank line, so no block continues another.
    # The final newline joins the last (short) block, not a copy of the whole.
    blocks[-1] += "\n"
    return "\n\n".join(blocks)

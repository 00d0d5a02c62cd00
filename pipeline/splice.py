"""An append rebuild's outputs, spliced from the previous build's bytes.

After an append, a case differs from the previous build's in two ways only:
its record lists (:data:`pipeline.assemble.APPENDED_LISTS`) gain the new
documents' records at their ends, and the small parts derived across records
(identity, entities, conflicts, completeness, research request, gaps, inputs)
are derived again. :func:`pipeline.assemble.assemble` with ``carried`` makes
a *part*: a whole, valid case whose record lists hold the new records only.
Here the previous build's records are put in front of them, in the published
bytes of both outputs, so the rebuild never decodes, checks, encodes or
renders the records it already published. A property test holds the result
to the case and summary built whole, byte for byte.

The splices find lists and sections by their structure, which supplied text
cannot imitate: in ``case.json`` (two-space indent, sorted keys) a raw newline
occurs only between tokens, so a line with exactly ``n`` spaces of indent
then ``]`` closes the one open array at that depth; in the summary every
supplied string is escaped onto one line (:func:`pipeline.summary.escape_inline`),
so a line that is a heading is one of the renderer's own. Anything not where
it should be raises :class:`SpliceError`, and the build assembles whole.

Pure: bytes in, bytes out.
"""

from __future__ import annotations

from .assemble import APPENDED_LISTS
from .summary import NONE_SUPPLIED

__all__ = ["SpliceError", "splice_case", "splice_summary"]


class SpliceError(ValueError):
    """The bytes are not shaped as a build makes them: assemble whole instead."""


# In the order they occur in a pretty case: its keys are sorted, at every depth.
_IN_FILE_ORDER = tuple(sorted(APPENDED_LISTS))


def _list_spans(data: bytes) -> list[tuple[int, int, int, int]]:
    """Where each appended list of a pretty case sits, in file order:
    ``(start, end, inner_start, inner_end)``; ``data[start:end]`` is the
    array and ``data[inner_start:inner_end]`` its items (empty for ``[]``).
    One pass: each search starts where the previous list ended, and none
    scans a list's items but for the rare ``]`` (:func:`_closing_bracket`)."""
    if not (data.startswith(b"{\n") and data.endswith(b"\n}\n")):
        raise SpliceError("not a whole pretty case")
    spans = []
    cursor = 0
    block = None
    for name, field in _IN_FILE_ORDER:
        if name != block:
            opened = f'\n  "{name}": {{\n'.encode()
            at = data.find(opened, cursor)
            if at < 0:
                raise SpliceError(f"no block {name!r}")
            block, cursor = name, at + len(opened) - 1
        key = f'\n    "{field}": '.encode()
        at = data.find(key, cursor)
        # Found past the block's end (the line "  }"), it is another block's key.
        if at < 0 or data.find(b"\n  }", cursor, at) >= 0:
            raise SpliceError(f"no list {name}/{field}")
        start = at + len(key)
        if data.startswith(b"[]", start):
            spans.append((start, start + 2, start + 1, start + 1))
        elif data.startswith(b"[\n", start):
            close = _closing_bracket(data, start, len(data))
            spans.append((start, close + 6, start + 2, close))
        else:
            raise SpliceError(f"{name}/{field} is not a list")
        cursor = spans[-1][1]
        # Keys are unique and sorted in a build's case: what follows the list
        # is the block's end or a later key, never the same one again.
        if not data.startswith(b"\n  }", cursor):
            following = data[cursor : cursor + 7 + 128]  # ',\n    "' and the next key (case keys are short)
            if not following.startswith(b',\n    "') or following[7:].split(b'"', 1)[0] <= field.encode():
                raise SpliceError(f"{name}/{field} is not followed by a later key")
    return spans


def _closing_bracket(data: bytes, start: int, end: int) -> int:
    """Where the line ``    ]`` that closes an indent-4 array begins (at its
    newline). A single-byte search runs at memory speed and ``]`` is rare in
    a case; a search for the whole line would step through every indented
    line of a megabyte-long list. But text may be full of ``]`` (seven
    reports of 1,000,000 made an append rebuild take 3.4 s here, a whole
    build 0.5 s): after a few, one search for the whole line finishes."""
    at = start
    for _ in range(_BRACKETS_ONE_BY_ONE):
        at = data.find(b"]", at, end)
        if at < 0:
            raise SpliceError("a list is not closed")
        if data[at - 5 : at] == b"\n    ":
            return at - 5
        at += 1
    # A raw newline is only ever layout (strings hold it escaped), so the
    # line is found whole; from 5 bytes back, to take a "]" at ``at`` too.
    found = data.find(b"\n    ]", max(at - 5, 0), end)
    if found < 0:
        raise SpliceError("a list is not closed")
    return found


_BRACKETS_ONE_BY_ONE = 64


def splice_case(previous: bytes, part: bytes) -> bytes:
    """``part`` (a pretty case assembled with ``carried``) with the records of
    ``previous`` (the pretty case that state was carried from) in front of
    its own, in every appended list."""
    pieces = []
    cursor = 0
    # Views, not slices: the previous records are most of a megabytes-large
    # case, and the join below is then their only copy.
    previous_view = memoryview(previous)
    for (start, end, inner_start, inner_end), (_, _, earlier_start, earlier_end) in zip(_list_spans(part), _list_spans(previous)):
        earlier = previous_view[earlier_start:earlier_end]
        pieces.append(part[cursor:start])
        if not earlier:
            pieces.append(part[start:end])
        elif inner_start == inner_end:
            pieces += [b"[\n", earlier, b"\n    ]"]
        else:
            pieces += [b"[\n", earlier, b",\n", part[inner_start:inner_end], b"\n    ]"]
        cursor = end
    pieces.append(part[cursor:])
    return b"".join(pieces)


_NONE = NONE_SUPPLIED.encode()
_LAST_SECTION = b"\n\n## Input files\n\n"

# (heading line, what ends the block, how two blocks join): the summary's
# blocks that list one appended list's records, one line or block each, in
# the order the summary has them.
_SUMMARY_BLOCKS: tuple[tuple[bytes, bytes, str], ...] = (
    (b"### Titles", b"\n\n", "lines"),
    (b"### Summaries", b"\n\n", "lines"),
    (b"### Attachments (supplied with reports)", b"\n\n", "table"),
    (b"### Observations (supplied by testers)", b"\n\n", "lines"),
    (b"### Comments (supplied by testers)", b"\n\n", "lines"),
    (b"### Tester hypotheses (supplied by testers; hypotheses, not facts)", b"\n\n", "lines"),
    (b"### Completeness declarations", b"\n\n", "table"),
    (b"### Expected-behaviour statements", b"\n\n", "lines"),
    (b"## Reproductions", b"\n\n## Entities\n\n", "blocks"),
    (b"### Facts", b"\n\n", "table"),
)


def _block_spans(data: bytes) -> list[tuple[int, int]]:
    """Where each of :data:`_SUMMARY_BLOCKS` sits, in order: ``(start, end)``."""
    spans = []
    cursor = 0
    for heading, ends, kind in _SUMMARY_BLOCKS:
        marker = b"\n\n" + heading + b"\n\n"
        at = data.find(marker, cursor)
        if at < 0:
            raise SpliceError(f"no heading {heading!r}")
        start = at + len(marker)
        end = data.find(ends, start)
        if end <= start:  # a block is never empty: an empty list shows as "None supplied."
            raise SpliceError(f"{heading!r} does not end")
        if kind == "blocks" and (data.find(b"\n\n#", start, end) >= 0 or data[end + len(ends) : end + len(ends) + 1] in (b"#", b"\n", b"")):
            # A section of blocks holds no heading, and none follows its end marker.
            raise SpliceError(f"{heading!r} is not followed as in a summary")
        spans.append((start, end))
        cursor = end
    if data.find(_LAST_SECTION, cursor) < 0 or not data.endswith(b"\n"):
        raise SpliceError("the summary does not end as a summary does")
    return spans


def _joined(earlier: memoryview, own: bytes, kind: str) -> list:
    """The pieces of one block: the previous summary's rows, then the part's."""
    if earlier == _NONE:
        return [own]
    if own == _NONE:
        return [earlier]
    if kind == "lines":
        return [earlier, b"\n", own]
    if kind == "blocks":
        return [earlier, b"\n\n", own]
    # A table: the part's rows follow the earlier rows, under one header.
    header_end = own.find(b"\n", own.find(b"\n") + 1)
    if header_end < 0:
        raise SpliceError("a table without rows")
    return [earlier, own[header_end:]]


def splice_summary(previous: bytes, part: bytes) -> bytes:
    """The summary of the case :func:`splice_case` makes, from the summary
    of ``previous`` and that of ``part`` (UTF-8 bytes both)."""
    pieces = []
    cursor = 0
    previous_view = memoryview(previous)  # the join is the previous rows' only copy
    for (start, end), (earlier_start, earlier_end), (_, _, kind) in zip(_block_spans(part), _block_spans(previous), _SUMMARY_BLOCKS):
        pieces.append(part[cursor:start])
        pieces += _joined(previous_view[earlier_start:earlier_end], part[start:end], kind)
        cursor = end
    pieces.append(part[cursor:])
    return b"".join(pieces)

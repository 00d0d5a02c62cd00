"""The category table pinned to Unicode 14.0.0 and the decisions taken from it."""

from __future__ import annotations

import unicodedata

import pytest

from pipeline import unicode14
from pipeline.errors import one_line
from pipeline.zipscan import name_problem

_KEPT = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"}


def _running_category(ch: str) -> str:
    kind = unicodedata.category(ch)
    return kind if kind in _KEPT else ""


def test_the_table_is_unicode_14_where_this_python_has_it_and_later_versions_only_assign_more():
    moved = []
    for cp in range(0x110000):
        ch = chr(cp)
        pinned, running = unicode14.category(ch), _running_category(ch)
        if pinned == running:
            assert unicode14.is_printable(ch) is ch.isprintable(), hex(cp)
        else:
            moved.append((hex(cp), pinned, running))
            assert unicode14.is_printable(ch) is False, hex(cp)  # unassigned in 14.0
    if unicodedata.unidata_version == unicode14.UNICODE_VERSION:  # Python 3.11: the table is its own, derived again
        assert moved == []
    else:
        # 3.12 (15.0), 3.13 (15.1): only characters 14.0 left unassigned differ.
        assert moved and all(before == "Cn" for _, before, _ in moved), [m for m in moved if m[1] != "Cn"][:5]


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        # Unassigned in 14.0, format characters since 15.0: refused on 3.11 too (found by session 20's review).
        ("original/n\U00013439.txt", "character U+13439 unassigned in Unicode 14.0.0 in name"),
        ("original/n\U0001343f.txt", "character U+1343F unassigned in Unicode 14.0.0 in name"),
        # A letter 15.0 added (CJK extension H): refused on 3.12 and 3.13 too.
        ("original/\U00031350.txt", "character U+31350 unassigned in Unicode 14.0.0 in name"),
        ("original/a\u200bb.txt", "control or format character U+200B in name"),
        ("original/a\u2028b.txt", "control or format character U+2028 in name"),
        ("original/caf\u00e9 \U0001f600 \ue000.txt", None),  # assigned letters, an emoji, private use
    ],
)
def test_a_name_is_judged_by_unicode_14_on_every_python(name, problem):
    assert name_problem(name) == problem


def test_messages_escape_by_unicode_14_on_every_python():
    # U+1E030 (a Cyrillic modifier letter of 15.0): escaped on 3.11, and now on 3.12 and 3.13 alike.
    assert one_line("original/r\U0001e030.json") == "original/r\\U0001e030.json"
    assert one_line("caf\u00e9 \u00a0\u200b\x7f\ud800") == "caf\u00e9 \\xa0\\u200b\\x7f\\ud800"

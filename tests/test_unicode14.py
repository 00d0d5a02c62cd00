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


def test_every_character_in_a_name_is_judged_by_the_table():
    import pipeline.zipscan as zipscan

    names = [f"original/a{chr(cp)}b" for cp in range(0x80, 0x110000) if cp != 0x5C]  # a backslash is refused first
    expected = []
    for name in names:
        kind = unicode14.category(name[-2])
        if kind == "Cn":
            expected.append(f"character U+{ord(name[-2]):04X} unassigned in Unicode 14.0.0 in name")
        elif kind in {"Cc", "Cf", "Cs", "Zl", "Zp"}:
            expected.append(f"control or format character U+{ord(name[-2]):04X} in name")
        else:
            expected.append(None)
    assert [zipscan.name_problem(name) for name in names] == expected
    # Several refused characters: the first in the name is named, whatever its kind.
    assert zipscan.name_problem("original/\u00e9\U00013439\u200b\x01") == "character U+13439 unassigned in Unicode 14.0.0 in name"
    assert zipscan.name_problem("original/\u00e9\x01\U00013439") == "control or format character U+0001 in name"


def test_a_name_judges_each_distinct_character_once():
    """The re-review measured a scan per character at 6-8 x Python 3.11's
    time on 3.12 and 3.13 (65,536 names of 126 x U+00E9: 8-12 s); a name
    repeats a few characters, and each is judged once, then remembered."""
    import pipeline.zipscan as zipscan

    zipscan._refused_in_names.cache_clear()
    names = ["d/" + "\u00e9" * 126 + "%03d" % (i % 1000) for i in range(5000)]
    names += ["d/" + "\u4e2d\U0001f600" * 30 + str(i) for i in range(5000)]
    assert {zipscan.name_problem(name) for name in names} == {None}
    info = zipscan._refused_in_names.cache_info()
    assert info.misses <= 20 and info.hits >= 10000, info


def test_nfc_is_unicode_14s_on_every_python():
    # U+10EFD: unassigned in 14.0, combining class 220 since 15.0, where NFC
    # composes k + U+0301 across it (found by session 20's re-review).
    assert unicode14.nfc("k\U00010efd\u0301") == "k\U00010efd\u0301"
    assert unicode14.nfc("\u1e31\U00010efd") == "\u1e31\U00010efd"
    assert unicode14.nfc("cafe\u0301 \U00010efd e\u0301") == "caf\u00e9 \U00010efd \u00e9"


def test_nfc_split_at_unassigned_characters_is_the_whole_strings_nfc_under_14(monkeypatch):
    """On 3.11 the oracle is its own NFC (Unicode 14.0) for every text; on a
    later Python only for texts without a character 14.0 leaves unassigned
    (normalization is stable for assigned ones; the others are the fixed
    cases above)."""
    import random

    pool = ["e", "k", "\u0301", "\u0323", "\u1100", "\u1161", "\u11a8", "\u0b47", "\u0b3e", "\u00e9", "\u1e31",
            "\U00010efd", "\U00013439", "\U000323af", "\u0345", "\u05b0"]
    unassigned = {"\U00010efd", "\U00013439", "\U000323af"}
    rng = random.Random(20)
    texts = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 12))) for _ in range(20000)]
    if not unicode14.RUNNING_HAS_THESE_TABLES:
        texts = [text for text in texts if not unassigned & set(text)]
    assert len(texts) > 2000
    expected = [unicodedata.normalize("NFC", text) for text in texts]
    monkeypatch.setattr(unicode14, "RUNNING_HAS_THESE_TABLES", False)  # the split path, checked against the whole
    assert [unicode14.nfc(text) for text in texts] == expected


def test_claim_keys_that_differ_under_14_are_not_near_twins_on_any_python():
    from pipeline.assemble import _unnormalized_sources

    statements = [
        {"claim": {"key": "k\U00010efd\u0301", "value": "x"}, "provenance": {"source": "original/r1.json"}},
        {"claim": {"key": "\u1e31\U00010efd", "value": "x"}, "provenance": {"source": "original/r2.json"}},
        {"claim": {"key": "cafe\u0301", "value": "x"}, "provenance": {"source": "original/r3.json"}},
        {"claim": {"key": "caf\u00e9", "value": "x"}, "provenance": {"source": "original/r4.json"}},
    ]
    assert _unnormalized_sources(statements, []) == ["original/r4.json"]


_MARKS = [chr(c) for c in range(0x300, 0x370)] + ["\u0f71", "\u0f72", "\u0f74", "\u0f80", "\u0344", "\u0345", "\u1dc0",
                                                  "\u20d0", "\u302a", "\u3099", "\u309a", "\u05b0", "\u0591", "\u0e38"]
_LEADING = ["a", "e", "u", "\u0915", "\u304b", "\u30cf", "\uac00", "\u1100", "\u1161", "\u11a8", "\u00e9", "\u01d6", "\u1e09",
            "\u0f40", "\u0fb2", "\u0fb3", "\u05d0", "\u0f73", "\u0f75", "\u0f81"]


def test_nfc_of_long_runs_of_marks_is_unicodedatas_without_its_insertion_sort(monkeypatch):
    """CPython orders combining marks by insertion sort: quadratic in a run of
    marks out of order (a 500,000-mark claim key held a build 252 s of CPU).
    Runs over 30 are ordered first by a stable sort; the result must be
    unicodedata's own NFC, and the ordering must really be done here."""
    import random

    ordered_here = []
    real = unicode14._canonically_ordered
    monkeypatch.setattr(unicode14, "_canonically_ordered", lambda text: ordered_here.append(text) or real(text))
    rng = random.Random(21)
    for _ in range(1500):
        text = "".join(rng.choice(_MARKS if rng.random() < 0.85 else _LEADING) for _ in range(rng.choice([8, 35, 90, 300])))
        assert unicode14.normalize_nfc(text) == unicodedata.normalize("NFC", text), ascii(text)
    assert 100 < len(ordered_here) < 1500  # both paths taken
    ordered_here.clear()
    # The shapes that were quadratic: two classes alternating after one base,
    # and a Tibetan sign of class 0 that decomposes into two marks.
    for text in ("a" + "\u0301\u0316" * 2000, "\u0f73" * 4000):
        assert unicode14.normalize_nfc(text) == unicodedata.normalize("NFC", text)
    assert len(ordered_here) == 2
    # Short runs (all real text) go to unicodedata as they are.
    assert unicode14.normalize_nfc("cafe\u0301 \u1100\u1161\u11a8" * 100) == "caf\u00e9 \uac01" * 100
    assert len(ordered_here) == 2


def test_only_three_characters_of_class_0_decompose_into_marks():
    """The run counter counts these with the marks; a new one would be missed."""
    found = {chr(cp) for cp in range(0x110000)
             if unicode14.category(chr(cp)) != "Cn" and not unicodedata.combining(chr(cp))
             and unicodedata.combining(unicodedata.normalize("NFD", chr(cp))[:1] or "a")}
    assert found == set(unicode14._DECOMPOSE_TO_NON_STARTERS)


def test_a_message_looks_at_no_more_of_a_long_text_than_it_can_show(monkeypatch):
    """A name of thousands of characters was judged whole and then cut to 300
    (status of 4,000 such files: 37 s); the cut is the same, the tail unread."""
    import pipeline.errors as errors

    judged = []
    monkeypatch.setattr(errors, "_printable_beyond_ascii", lambda ch: judged.append(ch) or unicode14.is_printable(ch))
    text = "\u00e9\u0301\x01" * 100_000
    shown = one_line(text)
    assert len(shown) <= 300 and shown.endswith("...")
    assert shown.startswith("\u00e9\u0301\\x01\u00e9\u0301\\x01")
    assert len(judged) <= 300

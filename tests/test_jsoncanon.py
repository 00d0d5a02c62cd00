"""pipeline/jsoncanon.py: strict decoding (RELIABILITY.md 18-26) and canonical hashing.

One test per RELIABILITY item, each asserting the exact code and pointer.
"""

from __future__ import annotations

import hashlib
import json
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import contracts
from pipeline.errors import CaseBuildError, ResearchError, VianoError
from pipeline.jsoncanon import (
    MAX_SAFE_INTEGER,
    EncodedTooLarge,
    canonical_bytes,
    canonical_hash,
    decode_strict,
    json_pointer,
    PARSE_MAX_DEPTH,
    TooDeepToParse,
    parse_json_text,
    pretty_bytes,
    repeated_keys,
    strict_problem,
    read_bounded,
    resolve_pointer,
)

MiB = 1 << 20


def _fails(data: bytes, *, max_bytes: int = MiB, **kwargs):
    with pytest.raises(CaseBuildError) as info:
        decode_strict(data, max_bytes=max_bytes, path="in/x.json", **kwargs)
    assert info.value.path == "in/x.json"
    return info.value.code, info.value.pointer


# 18
def test_18_duplicate_keys_at_any_depth_however_spelled():
    assert _fails(b'{"a":1,"a":2}') == ("JSON_DUPLICATE_KEY", "/a")
    assert _fails(b'{"a":1,"\\u0061":2}') == ("JSON_DUPLICATE_KEY", "/a")
    assert _fails(b'{"x":[0,{"b":1,"c":{"d":1,"d":1}}]}') == ("JSON_DUPLICATE_KEY", "/x/1/c/d")
    assert _fails(b'{"a/b":{"~":1,"~":2}}') == ("JSON_DUPLICATE_KEY", "/a~1b/~0")
    # the first offender in document order is named
    assert _fails(b'{"p":{"q":1,"q":2},"r":1,"r":2}') == ("JSON_DUPLICATE_KEY", "/p/q")


# 19
@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_19_nan_and_infinity(literal):
    assert _fails(b'{"a":[1,{"b":' + literal + b"}]}") == ("JSON_NUMBER", "/a/1/b")


# 20
def test_20_numbers_outside_the_interoperable_range():
    assert _fails(b'{"f":1e400}') == ("JSON_NUMBER", "/f")
    assert _fails(b'{"f":-1e400}') == ("JSON_NUMBER", "/f")
    assert _fails(b'{"i":' + b"7" * 5000 + b"}") == ("JSON_NUMBER", "/i")
    assert _fails(b'{"i":9007199254740992}') == ("JSON_NUMBER", "/i")
    assert _fails(b'{"i":[-9007199254740992]}') == ("JSON_NUMBER", "/i/0")
    # The edges themselves are kept: the largest safe integers, the smallest
    # subnormal and a double near the largest.
    assert decode_strict(b"[9007199254740991,-9007199254740991,5e-324,1.5e308]", max_bytes=MiB) == [
        MAX_SAFE_INTEGER,
        -MAX_SAFE_INTEGER,
        5e-324,
        1.5e308,
    ]


@pytest.mark.parametrize("literal", [b"1e-400", b"-1E-400", b"1e-0400", b"0.00001e-320", b"0." + b"0" * 400 + b"1", b"2.4e-324"])
def test_20_a_nonzero_number_that_would_read_as_zero_is_refused(literal):
    # Replacing a supplied value by 0.0 would be as silent as reading 1e400 as infinity.
    assert _fails(b'{"f":[' + literal + b"]}") == ("JSON_NUMBER", "/f/0")


@pytest.mark.parametrize("literal", [b"0e-400", b"-0.0", b"0.000", b"1e-320", b"5e-324", b"2.5e-324", b"1e-300"])
def test_20_zero_and_subnormal_numbers_are_kept(literal):
    import json as stdlib_json

    assert decode_strict(b'{"f":' + literal + b"}", max_bytes=1 << 20) == {"f": stdlib_json.loads(literal)}


# 21
def test_21_depth_is_bounded_before_parsing():
    assert _fails(b"[" * 100_000 + b"]" * 100_000) == ("JSON_TOO_DEEP", None)
    assert _fails(b"[" * 65 + b"]" * 65) == ("JSON_TOO_DEEP", None)
    assert decode_strict(b"[" * 64 + b"]" * 64, max_bytes=MiB) is not None
    # brackets inside strings do not count
    assert decode_strict(b'{"s":"' + b"[" * 200 + b'"}', max_bytes=MiB) == {"s": "[" * 200}
    assert _fails(b"[" * 11 + b"]" * 11, max_depth=10) == ("JSON_TOO_DEEP", None)


# 22
def test_22_only_plain_utf8_without_lone_surrogates():
    assert _fails(b'\xef\xbb\xbf{"a":1}') == ("JSON_ENCODING", None)
    assert _fails('{"a":1}'.encode("utf-16")) == ("JSON_ENCODING", None)
    assert _fails('{"a":1}'.encode("utf-16-le")) == ("JSON_ENCODING", None)
    assert _fails('{"a":1}'.encode("utf-32")) == ("JSON_ENCODING", None)
    assert _fails(b'{"a":"\xff"}') == ("JSON_ENCODING", None)
    assert _fails(b'{"a":"\xed\xa0\x80"}') == ("JSON_ENCODING", None)  # an encoded surrogate
    assert _fails(b'{"a":["ok","\\ud800"]}') == ("JSON_ENCODING", "/a/1")
    assert _fails(b'{"a":{"\\udc00":1}}') == ("JSON_ENCODING", "/a/\\udc00")
    assert decode_strict(b'["\\ud83d\\ude00"]', max_bytes=MiB) == ["\U0001f600"]


# 23
def test_23_control_characters_and_trailing_data():
    assert _fails(b'{"a":"x\x01y"}') == ("JSON_SYNTAX", None)
    assert _fails(b'{"a":"x\ny"}') == ("JSON_SYNTAX", None)
    assert _fails(b'{"a":1} {"b":2}') == ("JSON_SYNTAX", None)
    assert _fails(b'{"a":1}x') == ("JSON_SYNTAX", None)
    assert _fails(b'{"a":1,}') == ("JSON_SYNTAX", None)
    assert _fails(b"") == ("JSON_SYNTAX", None)
    assert decode_strict(b' \t\r\n{"a":"x\\u0001y"}\n', max_bytes=MiB) == {"a": "x\x01y"}
    with pytest.raises(VianoError) as info:
        decode_strict(b'{"a": "x\ty"}', max_bytes=MiB)
    assert info.value.message == "Invalid control character at line 1 column 9"  # one "at", where it is


# 24
def test_24_size_is_checked_before_parsing(tmp_path):
    # Garbage over the limit is refused for its size, proving nothing was parsed.
    assert _fails(b"\xff" * 101, max_bytes=100) == ("LIMIT_EXCEEDED", None)
    assert decode_strict(b'"' + b"a" * 98 + b'"', max_bytes=100) == "a" * 98
    big = tmp_path / "big.json"
    big.write_bytes(b"[" + b"0," * 100 + b"0]")
    with pytest.raises(CaseBuildError) as info:
        read_bounded(big, 100, label="big.json")
    assert (info.value.code, info.value.path) == ("LIMIT_EXCEEDED", "big.json")
    assert read_bounded(big, os.path.getsize(big)) == big.read_bytes()


# 25
def test_25_schema_gaps_are_closed_on_decoded_documents():
    # decode_strict keeps 1.0 a float, so the contracts can refuse it as an integer ...
    document = decode_strict(b'{"format":"viano-bug-report","format_version":1.0}', max_bytes=MiB)
    assert type(document["format_version"]) is float
    with pytest.raises(CaseBuildError) as info:
        contracts.validate("report", document)
    assert (info.value.code, info.value.pointer) == ("UNSUPPORTED_VERSION", "/format_version")
    # ... and date-time is really checked.
    naive = decode_strict(
        b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"x","observed_at":"2024-01-01T10:00:00"}]}',
        max_bytes=MiB,
    )
    with pytest.raises(CaseBuildError) as info:
        contracts.validate("report", naive)
    assert (info.value.code, info.value.pointer) == ("SCHEMA_VIOLATION", "/observations/0/observed_at")


def test_the_error_type_is_the_callers():
    with pytest.raises(ResearchError) as info:
        decode_strict(b"{", max_bytes=10, error=ResearchError)
    assert info.value.code == "JSON_SYNTAX"
    with pytest.raises(TypeError):
        decode_strict("{}", max_bytes=10)


# 26 -- canonical form and hashing

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


def _shuffled(value, rng: random.Random):
    if isinstance(value, dict):
        items = [(k, _shuffled(v, rng)) for k, v in value.items()]
        rng.shuffle(items)
        return dict(items)
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, st.integers(0, 2**32), st.sampled_from([None, 0, 2, "\t"]), st.booleans())
def test_26_hash_is_invariant_under_key_order_and_whitespace(value, seed, indent, ascii_only):
    other = json.dumps(_shuffled(value, random.Random(seed)), indent=indent, ensure_ascii=ascii_only)
    decoded = decode_strict(other.encode("utf-8"), max_bytes=16 * MiB)
    assert canonical_bytes(decoded) == canonical_bytes(value)
    assert canonical_hash(decoded) == canonical_hash(value) == hashlib.sha256(canonical_bytes(value)).hexdigest()
    # the canonical bytes are themselves strict JSON that round-trips
    assert canonical_bytes(decode_strict(canonical_bytes(value), max_bytes=16 * MiB)) == canonical_bytes(value)


def test_26_canonical_form_details():
    assert canonical_bytes({"b": 1, "a": [1.0, 2.5, -0.0], "é": "温度"}) == '{"a":[1,2.5,0],"b":1,"é":"温度"}'.encode()
    assert canonical_hash({"x": 1}) == canonical_hash({"x": 1.0})
    with pytest.raises(ValueError):
        canonical_bytes({"x": float("nan")})


def test_non_ascii_is_written_raw():
    value = {"title": "Schalter löst nicht aus — 温度 \U0001f600"}
    assert "Schalter löst nicht aus — 温度 \U0001f600".encode() in canonical_bytes(value)
    assert b"\\u" not in canonical_bytes(value)
    pretty = pretty_bytes(value)
    assert "温度".encode() in pretty and b"\\u" not in pretty
    assert pretty.endswith(b"}\n") and b'\n  "title"' in pretty


def test_pointers_round_trip():
    document = {"a/b": {"~x": [10, {"": 1}]}}
    pointer = json_pointer(["a/b", "~x", 1, ""])
    assert pointer == "/a~1b/~0x/1/"
    assert resolve_pointer(document, pointer) == 1
    assert resolve_pointer(document, "") is document
    for bad in ("/nope", "/a~1b/~0x/01", "/a~1b/~0x/5", "x"):
        with pytest.raises(KeyError):
            resolve_pointer(document, bad)


_PRETTY_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(_PRETTY_VALUES)
def test_pretty_bytes_equals_the_stdlib_indented_form(value):
    reference = json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    assert pretty_bytes(value) == reference.encode("utf-8")


@settings(max_examples=300, deadline=None)
@given(_PRETTY_VALUES, st.integers(min_value=-3, max_value=3))
def test_pretty_bytes_with_a_limit_is_the_same_bytes_or_their_exact_size(value, off):
    """With ``limit``, a document within it is the very bytes made without
    one; a longer one is refused before the trailing newline's copy, with the
    length those bytes would have had."""
    whole = pretty_bytes(value)
    limit = max(1, len(whole) + off)
    if len(whole) <= limit:
        assert pretty_bytes(value, limit=limit) == whole
    else:
        with pytest.raises(EncodedTooLarge) as refused:
            pretty_bytes(value, limit=limit)
        assert (refused.value.size, refused.value.limit) == (len(whole), limit)


_NO_FLOAT_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.tuples(children) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(st.one_of(_NO_FLOAT_VALUES, JSON_VALUES))
def test_canonical_fast_path_equals_the_stdlib_reference(value):
    # canonical_bytes takes msgspec's sorted encoder for float-free values; the
    # stdlib with sorted keys and compact separators is the definition.
    try:
        reference = json.dumps(
            _normalise(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError):
            canonical_bytes(value)
        return
    assert canonical_bytes(value) == reference


def _normalise(value):
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_SAFE_INTEGER:
        return int(value)
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    return value


def test_canonical_fast_path_edge_cases():
    assert canonical_bytes({1: "a"}) == b'{"1":"a"}'  # non-str keys take the reference path
    assert canonical_bytes(["\x7f\u2028", "\x00"]) == b'["\x7f\xe2\x80\xa8","\\u0000"]'
    assert canonical_bytes({"b": [1e15, 1e16, 0.5]}) == b'{"b":[1000000000000000,1e+16,0.5]}'
    assert canonical_bytes([1e300]) == b"[1e+300]"
    with pytest.raises(UnicodeEncodeError):
        canonical_bytes({"\ud800": 1})
    with pytest.raises(TypeError):
        canonical_bytes({"x": {1, 2}})


@given(st.lists(st.binary(min_size=0, max_size=3000), min_size=1, max_size=12), st.lists(st.integers(0, 11), max_size=30))
def test_sha256_hex_is_the_digest_whatever_it_remembers(blobs, order):
    """sha256_hex remembers the digests of the last few large bytes objects
    by identity; any sequence of calls still gives each object's own digest,
    also for equal bytes in distinct objects and for bytearrays."""
    import hashlib

    from pipeline.jsoncanon import sha256_hex

    objects = [bytes(b) for b in blobs] + [bytes(blobs[0]), bytearray(blobs[0])]
    for index in order + list(range(len(objects))):
        data = objects[index % len(objects)]
        assert sha256_hex(data) == hashlib.sha256(data).hexdigest()


# parse_json_text / strict_problem: any valid JSON, and what strict decoding would say of it


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"a": [1, 2.5, "x", null, true]}', None),
        ("18446744073709551615", "JSON_NUMBER"),
        ("1e400", "JSON_NUMBER"),
        ("-1e-400", "JSON_NUMBER"),
        ('{"a": 1, "a": 1}', "JSON_DUPLICATE_KEY"),
        ('"\\udc00"', "JSON_ENCODING"),
        ("[" * 65 + "]" * 65, "JSON_TOO_DEEP"),
        ("[" * 64 + "]" * 64, None),
    ],
)
def test_parse_json_text_takes_valid_json_that_strict_decoding_refuses(text, problem):
    value = parse_json_text(text)
    assert strict_problem(value) == problem
    try:
        decode_strict(text.encode(), max_bytes=MiB)
    except CaseBuildError as exc:
        assert exc.code == problem
    else:
        assert problem is None


@given(st.recursive(st.none() | st.booleans() | st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER) | st.text(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3), max_leaves=12))
def test_parse_json_text_agrees_with_strict_decoding_on_strict_json(value):
    text = json.dumps(value, ensure_ascii=False)
    parsed = parse_json_text(text)
    assert strict_problem(parsed) is None
    assert canonical_bytes(parsed) == canonical_bytes(decode_strict(text.encode(), max_bytes=MiB))


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", '{"a": -Infinity}', "{", "[1,]", '"a" "b"', "", "\ufeff1"])
def test_parse_json_text_refuses_what_is_not_json(text):
    with pytest.raises(ValueError):
        parse_json_text(text)


def test_repeated_keys_names_every_key_given_twice():
    value = parse_json_text('{"a": 1, "b": 2, "a": 3, "c": 4, "b": 5, "a": 6}')
    assert repeated_keys(value) == {"a", "b"}
    assert repeated_keys(parse_json_text('{"a": 1}')) == set()
    assert repeated_keys([1]) == set()


def test_parse_json_text_stops_at_a_fixed_depth_before_parsing():
    assert PARSE_MAX_DEPTH == 512
    assert strict_problem(parse_json_text("[" * 512 + "]" * 512)) == "JSON_TOO_DEEP"
    for text in ("[" * 513 + "]" * 513, "[" * 100_000, '{"a": ' + "[" * 600):  # valid or not: undecided
        with pytest.raises(TooDeepToParse):
            parse_json_text(text)
    assert parse_json_text('["' + "[" * 5000 + '"]') == ["[" * 5000]  # brackets in strings do not count
    # ... nor in a string left open, which runs to the end: no JSON, not "too deep"
    with pytest.raises(ValueError):
        parse_json_text('"' + "[" * 600)
    with pytest.raises(ValueError):
        parse_json_text("[" * 10 + '"' + '\\"' * 5000 + "[" * 600)

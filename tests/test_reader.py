"""pipeline/reader.py: the fast path decides exactly as the slow path does.

``read_document`` must accept the same bytes as ``decode_strict`` +
``contracts.validate`` and return an identical value (same types, same key
order), and every rejection must carry the slow path's code and pointer. The
property test below serialises schema-generated documents (valid and
structurally mutated, from ``test_contracts``) with a hand-rolled encoder that
can inject every hostile form of RELIABILITY.md 18-25 at a random place.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import AdmissionError, VianoError
from pipeline.reader import _read_fast, read_document, read_document_slow, read_fast
from test_contracts import _locations, any_documents, schema_accepts, valid_documents

MiB = 1 << 20


def typed(value):
    """A comparison key that tells 1 from 1.0 from True, -0.0 from 0.0, and keeps key order."""
    kind = type(value)
    if kind is dict:
        return ("d", tuple((key, typed(item)) for key, item in value.items()))
    if kind is list:
        return ("l", tuple(typed(item) for item in value))
    if kind is float:
        return ("f", value.hex())
    return (kind.__name__, value)


def outcome(reader, data, name, max_bytes=MiB):
    try:
        return ("ok", typed(reader(data, name, path="in/doc.json", max_bytes=max_bytes)))
    except VianoError as exc:
        return ("error", type(exc).__name__, exc.code, exc.path, exc.pointer, exc.message)


def assert_parity(data, name, max_bytes=MiB):
    fast = outcome(read_document, data, name, max_bytes)
    slow = outcome(read_document_slow, data, name, max_bytes)
    assert fast == slow, (name, data[:300])
    return fast


# -- a JSON writer that can inject hostile forms -----------------------------

_HOSTILE_VALUES = [
    "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1E+309", "9007199254740992", "-9007199254740992",
    "9007199254740991", "-9007199254740991", "18446744073709551616", "1" * 400, "1.0", "1E2", "-0", "-0.0",
    "1e-400", "0.1e1", "123456789012345678", "1.7976931348623157e308", "2.2250738585072014e-308",
    '"\\ud800"', '"\\udc00"', '"x\\ud800\\u0041"', '"\\ud83d\\ude00"', '"\\uD83D\\uDE00"', '"a\\u003ab"',
    '"a\\u003Ab:c"', '"\\u0000"', '"raw\x01"', '"tab\there"', '"\\/"', "tru", "nul", "[1,]", "{}", "[]",
    '"2024-01-01T10:00:00"', '"2024-01-01T10:00:00+02:00"', '" "',
]


def _dump_string(text: str, ascii_only: bool) -> str:
    return json.dumps(text, ensure_ascii=ascii_only)


def _escape_key(key: str) -> str:
    return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c for c in key) + '"'


class _Writer:
    def __init__(self, target, injection, extra, ascii_only, spaced, escape_keys):
        self.target = target
        self.injection = injection
        self.extra = extra
        self.ascii_only = ascii_only
        self.colon = ": " if spaced else ":"
        self.comma = ", " if spaced else ","
        self.escape_keys = escape_keys

    def key(self, key, force_escape=False):
        if (self.escape_keys or force_escape) and key:
            return _escape_key(key)
        return _dump_string(key, self.ascii_only)

    def dump(self, value, parts=()) -> str:
        here = parts == self.target
        if here and self.injection == "value":
            return self.extra
        if here and self.injection == "deep":
            return "[" * self.extra + "]" * self.extra
        if isinstance(value, dict):
            items = [self.key(k) + self.colon + self.dump(v, parts + (k,)) for k, v in value.items()]
            if here and self.injection == "dup" and value:
                first = next(iter(value))
                # extra: 0 plain repeat, 1 key spelled with \u escapes, 2 a value whose
                # escaped colon would balance the dropped pair's structural one.
                spelled = self.key(first, force_escape=self.extra == 1)
                repeat = '"\\u003a"' if self.extra == 2 else json.dumps(value[first])
                items.append(spelled + self.colon + repeat)
            return "{" + self.comma.join(items) + "}"
        if isinstance(value, list):
            return "[" + self.comma.join(self.dump(v, parts + (i,)) for i, v in enumerate(value)) + "]"
        if isinstance(value, str):
            return _dump_string(value, self.ascii_only)
        return json.dumps(value)


@st.composite
def encoded_documents(draw):
    """(name, bytes, max_bytes, clean): a document serialised with optional hostile bytes."""
    name, document = draw(st.one_of(any_documents(), valid_documents()))
    parts, _ = draw(st.sampled_from(list(_locations(document))))
    injection = draw(st.sampled_from(["none", "none", "value", "value", "dup", "dup", "deep"]))
    extra = None
    if injection == "value":
        extra = draw(st.sampled_from(_HOSTILE_VALUES))
    elif injection == "deep":
        extra = draw(st.integers(55, 70))
    elif injection == "dup":
        extra = draw(st.integers(0, 2))
    writer = _Writer(parts, injection, extra, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 5)) == 0)
    text = writer.dump(document)
    framing = draw(st.sampled_from(["plain"] * 6 + ["ws", "bom", "trailing", "utf16", "badbyte", "truncate"]))
    data = text.encode("utf-8", "surrogatepass")
    if framing == "bom":
        data = b"\xef\xbb\xbf" + data
    elif framing == "trailing":
        data += draw(st.sampled_from([b" x", b"{}", b"\x00", b"\n\n"]))
    elif framing == "ws":
        data = b" \r\n\t" + data + b"\n"
    elif framing == "utf16":
        data = text.encode("utf-16", "surrogatepass")
    elif framing == "badbyte":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\x7f", b"\x00"])) + data[at:]
    elif framing == "truncate":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    max_bytes = draw(st.sampled_from([MiB] * 6 + [len(data), max(0, len(data) - 1)]))
    clean = injection == "none" and framing in ("plain", "ws") and max_bytes >= len(data) and not writer.escape_keys
    return name, data, max_bytes, clean, document


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(encoded_documents())
def test_fast_and_slow_paths_agree(case):
    name, data, max_bytes, clean, document = case
    result = assert_parity(data, name, max_bytes)
    if clean:
        # Well-formed bytes: the verdict is the schema's, and an accepted
        # document must have been vouched for by the fast path itself.
        assert (result[0] == "ok") == schema_accepts(name, document)
        if result[0] == "ok":
            assert _read_fast(data, name, max_bytes) is not None


NUMBER_LITERALS = st.from_regex(r"\A-?(0|[1-9][0-9]{0,40})(\.[0-9]{1,40})?([eE][+-]?[0-9]{1,3})?\Z")


@settings(max_examples=500, deadline=None)
@given(NUMBER_LITERALS)
def test_number_literals_parse_identically(literal):
    # msgspec's own number parser must give the very int/float json.loads does.
    data = b'{"format":"viano-reproduction","format_version":1,"facts":[{"name":"n","value":' + literal.encode() + b"}]}"
    assert_parity(data, "reproduction")


# -- hand-written hostile documents (RELIABILITY.md 18-25) ------------------

R = b'{"format":"viano-bug-report","format_version":1'
P = b'{"format":"viano-reproduction","format_version":1'


def _claim(value: bytes) -> bytes:
    return R + b',"observations":[{"text":"t","claim":{"key":"k","value":' + value + b"}}]}"


def _fact(value: bytes) -> bytes:
    return P + b',"facts":[{"name":"n","value":' + value + b"}]}"


HOSTILE = [
    # 18 duplicate keys, at any depth, however spelled
    ("report", R + b',"title":"a","title":"b"}', "JSON_DUPLICATE_KEY", "/title"),
    ("report", R + b',"a":1,"\\u0061":2}', "JSON_DUPLICATE_KEY", "/a"),
    ("report", R + b',"observations":[{"text":"x","text":"y"}]}', "JSON_DUPLICATE_KEY", "/observations/0/text"),
    ("report", _claim(b'{"a:b":1,"a\\u003ab":2}'), "JSON_DUPLICATE_KEY", "/observations/0/claim/value/a:b"),
    ("report", R + b',"x":{"y":{"z":1,"z":{"q":"1:2:3"}}}}', "JSON_DUPLICATE_KEY", "/x/y/z"),
    ("report", R + b',"format":"viano-bug-report"}', "JSON_DUPLICATE_KEY", "/format"),
    ("report", R + b',"a":1,"a":"\\u003a"}', "JSON_DUPLICATE_KEY", "/a"),
    ("report", R + b',"a":{"k":1},"a":"\\u003A"}', "JSON_DUPLICATE_KEY", "/a"),
    # 19 NaN / Infinity
    ("reproduction", _fact(b"NaN"), "JSON_NUMBER", "/facts/0/value"),
    ("reproduction", _fact(b"[Infinity]"), "JSON_NUMBER", "/facts/0/value/0"),
    ("reproduction", _fact(b"-Infinity"), "JSON_NUMBER", "/facts/0/value"),
    # 20 overflowing floats, huge integers, beyond +/-(2^53-1)
    ("reproduction", _fact(b"1e400"), "JSON_NUMBER", "/facts/0/value"),
    ("reproduction", _fact(b"[1.5,1e-400]"), "JSON_NUMBER", "/facts/0/value/1"),
    ("report", _claim(b'{"t":-0.' + b"0" * 330 + b'7}'), "JSON_NUMBER", "/observations/0/claim/value/t"),
    ("report", R + b',"x-ext":1E-999}', "JSON_NUMBER", "/x-ext"),
    ("reproduction", _fact(b"1" * 5000), "JSON_NUMBER", "/facts/0/value"),
    ("reproduction", _fact(b"9007199254740992"), "JSON_NUMBER", "/facts/0/value"),
    ("reproduction", _fact(b'{"n":-9007199254740992}'), "JSON_NUMBER", "/facts/0/value/n"),
    ("report", _claim(b"18446744073709551615"), "JSON_NUMBER", "/observations/0/claim/value"),
    ("report", R + b',"entities":[{"type":"c","id":9007199254740992}]}', "JSON_NUMBER", "/entities/0/id"),
    ("report", R + b',"x-ext":[1,2,9007199254740993]}', "JSON_NUMBER", "/x-ext/2"),
    # 21 depth
    ("report", b"[" * 100000 + b"]" * 100000, "JSON_TOO_DEEP", None),
    ("report", _claim(b"[" * 61 + b"]" * 61), "JSON_TOO_DEEP", None),
    ("reproduction", _fact(b"[" * 62 + b"]" * 62), "JSON_TOO_DEEP", None),
    ("report", R + b',"x":' + b"{}" * 0 + b"[" * 64 + b"]" * 64 + b"}", "JSON_TOO_DEEP", None),
    # 22 encodings
    ("report", b"\xef\xbb\xbf" + R + b"}", "JSON_ENCODING", None),
    ("report", (R + b"}").decode().encode("utf-16"), "JSON_ENCODING", None),
    ("report", (R + b"}").decode().encode("utf-16-le"), "JSON_ENCODING", None),
    ("report", R + b',"title":"\xff"}', "JSON_ENCODING", None),
    ("report", R + b',"title":"\xed\xa0\x80"}', "JSON_ENCODING", None),
    ("report", R + b',"title":"\\ud800"}', "JSON_ENCODING", "/title"),
    ("report", R + b',"x":{"\\udc00":1}}', "JSON_ENCODING", "/x/\\udc00"),
    # 23 control characters, trailing data, malformed
    ("report", R + b',"title":"a\x01b"}', "JSON_SYNTAX", None),
    ("report", R + b"} x", "JSON_SYNTAX", None),
    ("report", R + b"}{}", "JSON_SYNTAX", None),
    ("report", R + b",}", "JSON_SYNTAX", None),
    ("report", b"", "JSON_SYNTAX", None),
    # 24 size before parsing
    ("report", b"{" * (MiB + 1), "LIMIT_EXCEEDED", None),
    # 25 schema gaps
    ("report", R + b',"observations":[{"text":"x","observed_at":"2024-01-01T10:00:00"}]}', "SCHEMA_VIOLATION",
     "/observations/0/observed_at"),
    ("report", b'{"format":"viano-bug-report","format_version":1.0}', "UNSUPPORTED_VERSION", "/format_version"),
    ("report", b'{"format":"viano-bug-report","format_version":2}', "UNSUPPORTED_VERSION", "/format_version"),
    ("report", R + b',"observations":[{"text":"  "}]}', "SCHEMA_VIOLATION", "/observations/0/text"),
    ("report", R + b',"observations":[{"text":"x","mood":1}]}', "SCHEMA_VIOLATION", "/observations/0/mood"),
    ("case-inputs", b'{"format":"viano-case-inputs","format_version":1,"extra":[]}', "SCHEMA_VIOLATION", "/extra"),
    ("report", b"[]", "SCHEMA_VIOLATION", ""),
]


@pytest.mark.parametrize("name,data,code,pointer", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_documents(name, data, code, pointer):
    assert _read_fast(data, name, MiB) is None
    result = assert_parity(data, name)
    assert result[0] == "error"
    assert result[2] == code
    assert result[3] == "in/doc.json"
    if pointer is not None:
        assert result[4] == pointer


@pytest.mark.parametrize(
    "name,data",
    [
        ("report", _claim(b"[" * 60 + b"]" * 60)),  # depth exactly 64
        ("reproduction", _fact(b"[" * 61 + b"]" * 61)),
        ("report", R + b',"x":' + b"[" * 63 + b"]" * 63 + b"}"),
        ("reproduction", _fact(b"9007199254740991")),
        ("reproduction", _fact(b"-9007199254740991")),
        ("reproduction", _fact(b'"\\ud83d\\ude00 emoji \\u00e9 a:b"')),
        ("report", R + b',"title":"10:00:00 \xe6\xb8\xa9"}'),
        ("report", R + b',"observations":[{"text":"x","observed_at":"2024-01-01T10:00:00+02:00"}]}'),
    ],
)
def test_boundary_documents_are_accepted_by_the_fast_path(name, data):
    assert _read_fast(data, name, MiB) is not None
    assert assert_parity(data, name)[0] == "ok"


def test_contracts_without_a_struct_use_the_slow_path():
    with pytest.raises(VianoError) as info:
        read_document(b'{"format":"viano-case","format_version":1}', "case", path="c.json", max_bytes=MiB)
    assert info.value.code == "SCHEMA_VIOLATION"


def test_buffers_and_error_type():
    data = R + b',"title":"t","x-tool":{"a":[1,2.5,null]}}'
    expected = read_document_slow(data, "report", path=None, max_bytes=MiB)
    assert read_document(bytearray(data), "report", path=None, max_bytes=MiB) == expected
    assert read_document(memoryview(data), "report", path=None, max_bytes=MiB) == expected
    with pytest.raises(AdmissionError):
        read_document(R + b',"title":""}', "report", path=None, max_bytes=MiB, error=AdmissionError)
    with pytest.raises(TypeError):
        read_document("{}", "report", path=None, max_bytes=MiB)


def test_an_escaped_colon_stays_on_the_fast_path_and_still_reveals_a_dropped_pair():
    """``\\u003a`` decodes to a colon the re-encoding writes plainly: it is
    counted as one (until session 21 any such escape sent the whole document
    to the slow path, 12 s for 1 MiB), and after an escaped backslash it is
    text, not an escape (until session 22 that sent the document there: 7 s
    for 1 MiB). A dropped duplicate is never hidden."""
    head = b'{"format":"viano-bug-report","format_version":1,'
    for title in (b'"a\\u003ab"', b'"\\u003A\\u003a:"', b'"x"', b'"\\\\u003a"', b'"\\\\\\u003a"', b'"\\\\\\\\u003A\\\\"',
                  b'"u003a\\\\\\\\\\\\u003a"'):
        data = head + b'"title":' + title + b"}"
        assert read_fast(data, "report", 1 << 20) == json.loads(data), data
    for duplicate in (b'"title":"\\u003a","title":"b"}', b'"title":"a","title":"\\u003a"}', b'"t\\u003a":1,"t:":2,"title":"x"}',
                      # an escaped backslash's text beside the pair dropped
                      b'"title":"\\\\u003a","title":"b"}', b'"title":"a","title":"\\\\u003a\\\\u003A"}',
                      b'"t\\\\\\u003a":1,"t\\\\:":2,"title":"\\\\u003a"}'):
        assert read_fast(head + duplicate, "report", 1 << 20) is None, duplicate
        with pytest.raises(VianoError) as info:
            read_document(head + duplicate, "report", path=None, max_bytes=MiB)
        assert info.value.code == "JSON_DUPLICATE_KEY", duplicate

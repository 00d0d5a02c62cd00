"""contracts/: bundled schemas, the offline registry, validate(), and Struct parity.

The document strategies here are driven by the schemas themselves (every
keyword our contracts use), so a new field in a schema is generated, mutated
and parity-checked without touching this file. ``tests/test_reader.py`` reuses
them.
"""

from __future__ import annotations

import copy
import json
import socket
import urllib.request

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

import contracts
import contracts.schemas
from contracts.structs import MAX_SAFE_INTEGER, STRUCTS, is_date_time
from pipeline.errors import AdmissionError, CaseBuildError

INPUT_CONTRACTS = (
    "package-source",
    "package-manifest",
    "case-inputs",
    "report",
    "reproduction",
    "research-request",
    "research-result",
    "workspace-limits",
)

# -- schema-driven document strategies --------------------------------------

_DATE_TIMES_VALID = st.builds(
    lambda y, mo, d, h, mi, s, frac, zone, t: f"{y:04d}-{mo:02d}-{d:02d}{t}{h:02d}:{mi:02d}:{s:02d}{frac}{zone}",
    st.integers(1, 2100),
    st.integers(1, 12),
    st.integers(1, 28),
    st.integers(0, 23),
    st.integers(0, 59),
    st.integers(0, 59),
    st.sampled_from(["", ".5", ".123456"]),
    st.sampled_from(["Z", "z", "+02:00", "-05:30", "+00:00"]),
    st.sampled_from(["T", "t"]),
)
#: Near misses: naive, impossible days, year 0, bad offsets, space separator, newline.
DATE_TIMES_ANY = st.one_of(
    _DATE_TIMES_VALID,
    st.builds(
        lambda y, mo, d, sep, zone, tail: f"{y}-{mo:02d}-{d:02d}{sep}10:00:00{zone}{tail}",
        st.sampled_from(["0000", "2023", "2024", "1900", "2000", "99999"]),
        st.integers(0, 13),
        st.integers(0, 32),
        st.sampled_from(["T", "t", " ", "_"]),
        st.sampled_from(["", "Z", "+02:00", "+24:00", "+02", "-23:59", "+0200"]),
        st.sampled_from(["", "", "\n", " "]),
    ),
)

_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), max_codepoint=0x2FFFF)
    | st.sampled_from([":", '"', "\\", "/", "~", "\u00e9", "\u6e29", "\u2028", "\x00", "\x1f"]),
    max_size=12,
)
_BLANKISH = st.sampled_from(["", " ", "\t\n", "\u00a0", "\u3000", "x", " x ", "\u200b"])
_HEX = st.text("0123456789abcdef", min_size=64, max_size=64)
_SAFE_INT = st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER)

#: Arbitrary JSON as decode_strict can return it (safe integers, finite floats).
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | _SAFE_INT | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)


class _Schema:
    """A subschema plus the resolver to follow its ``$ref``s in the bundled registry."""

    def __init__(self, contents, resolver):
        self.contents = contents
        self.resolver = resolver

    def deref(self) -> "_Schema":
        node = self
        while isinstance(node.contents, dict) and "$ref" in node.contents:
            resolved = node.resolver.lookup(node.contents["$ref"])
            node = _Schema(resolved.contents, resolved.resolver)
        return node

    def sub(self, contents) -> "_Schema":
        return _Schema(contents, self.resolver)


def root_schema(name: str) -> _Schema:
    resolver = contracts.REGISTRY.resolver(base_uri=contracts.SCHEMA_IDS[name])
    resolved = resolver.lookup(contracts.SCHEMA_IDS[name])
    return _Schema(resolved.contents, resolved.resolver)


def _string_for(schema: dict, draw):
    if schema.get("format") == "date-time":
        return draw(_DATE_TIMES_VALID)
    if schema.get("minLength") == 64:
        return draw(_HEX)
    if schema.get("pattern") == "\\S":
        return draw(_TEXT.filter(lambda s: s.strip() and any(not c.isspace() for c in s)) | st.just("text"))
    return draw(_TEXT.filter(bool) | st.just("original/a.json"))


def valid_value(node: _Schema, draw, depth: int = 0):
    """Draw a value that ``node`` accepts (only the keywords our contracts use)."""
    node = node.deref()
    schema = node.contents
    if schema is True:
        return draw(JSON_VALUES)
    if "const" in schema:
        return copy.deepcopy(schema["const"])
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    if "anyOf" in schema:
        return valid_value(node.sub(draw(st.sampled_from(schema["anyOf"]))), draw, depth)
    kind = schema.get("type")
    if kind == "object":
        out = {}
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        for key, sub in props.items():
            if key in required or draw(st.booleans()):
                out[key] = valid_value(node.sub(sub), draw, depth + 1)
        extra = schema.get("additionalProperties", True)
        if isinstance(extra, dict):
            for _ in range(draw(st.integers(0, 2))):
                out[draw(_TEXT.filter(bool))] = valid_value(node.sub(extra), draw, depth + 1)
        elif extra is True and depth == 0 and draw(st.booleans()):
            out["x-extension"] = draw(JSON_VALUES)
        return out
    if kind == "array":
        return [valid_value(node.sub(schema["items"]), draw, depth + 1) for _ in range(draw(st.integers(0, 2)))]
    if kind == "string":
        return _string_for(schema, draw)
    if kind == "integer":
        return draw(st.integers(schema.get("minimum", -MAX_SAFE_INTEGER), schema.get("maximum", MAX_SAFE_INTEGER)))
    if kind == "boolean":
        return draw(st.booleans())
    raise AssertionError(f"strategy does not know {schema!r}")


def _locations(value, parts=()):
    yield parts, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _locations(item, parts + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _locations(item, parts + (index,))


_REPLACEMENTS = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 1, 1.0, 2.5, "", " ", "\u00a0", [], {}, 2**53 - 1, "x"]),
    DATE_TIMES_ANY,
    _BLANKISH,
    JSON_VALUES,
)


def mutate(document, draw):
    """One structural mutation at a random place: drop, replace, add unknown, append."""
    document = copy.deepcopy(document)
    places = list(_locations(document))
    parts, target = draw(st.sampled_from(places))
    action = draw(st.sampled_from(["drop", "replace", "unknown", "append"]))
    if not parts:
        if isinstance(document, dict) and action == "unknown":
            document["zz"] = draw(JSON_VALUES)
            return document
        return draw(_REPLACEMENTS)
    parent = document
    for part in parts[:-1]:
        parent = parent[part]
    last = parts[-1]
    if action == "drop":
        del parent[last]
    elif action == "replace":
        parent[last] = draw(_REPLACEMENTS)
    elif action == "unknown" and isinstance(target, dict):
        target[draw(st.sampled_from(["zz", "Text", "text ", "claim", "value"]))] = draw(_REPLACEMENTS)
    elif action == "append" and isinstance(target, list):
        target.append(draw(_REPLACEMENTS))
    else:
        parent[last] = draw(_REPLACEMENTS)
    return document


@st.composite
def valid_documents(draw, names=INPUT_CONTRACTS):
    name = draw(st.sampled_from(names))
    return name, valid_value(root_schema(name), draw)


@st.composite
def any_documents(draw, names=INPUT_CONTRACTS):
    """Valid documents, and documents with one to three mutations."""
    name, document = draw(valid_documents(names))
    for _ in range(draw(st.integers(0, 3))):
        document = mutate(document, draw)
    return name, document


def schema_accepts(name: str, document) -> bool:
    try:
        contracts.validate(name, document)
    except CaseBuildError as exc:
        assert exc.code in {"SCHEMA_VIOLATION", "UNSUPPORTED_VERSION"}
        return False
    return True


def struct_accepts(name: str, document) -> bool:
    try:
        msgspec.convert(document, STRUCTS[name])
    except msgspec.ValidationError:
        return False
    return True


# -- the bundle and the registry --------------------------------------------


def test_every_contract_is_bundled_with_its_urn_and_draft_2020_12():
    assert set(INPUT_CONTRACTS) <= set(contracts.SCHEMAS)
    for name, schema in contracts.SCHEMAS.items():
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert schema["$id"] == f"urn:viano:{name}-v1" == contracts.SCHEMA_IDS[name]
        Draft202012Validator.check_schema(schema)
        assert contracts.REGISTRY.contents(schema["$id"]) == schema


def test_every_input_contract_has_a_struct():
    assert set(STRUCTS) == set(INPUT_CONTRACTS)


def test_validator_is_built_once_with_the_registry_and_format_checker():
    first = contracts.validator("report")
    assert contracts.validator("report") is first
    assert first._registry is contracts.REGISTRY  # noqa: SLF001 - proving the wiring
    assert "date-time" in first.format_checker.checkers
    with pytest.raises(KeyError):
        contracts.validator("no-such-contract")


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to reach the network fails the test, and is recorded."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    return calls


def test_a_remote_ref_is_never_fetched(no_network):
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "urn:viano:test-remote-v1",
        "properties": {"x": {"$ref": "https://example.invalid/x.json"}},
    }
    checker = contracts.Validator(
        schema, registry=contracts.REGISTRY, format_checker=contracts.FORMAT_CHECKER
    )
    with pytest.raises(CaseBuildError) as info:
        contracts.schemas._validate_with(checker, "test-remote", {"x": 1}, path="t.json", error=CaseBuildError)  # noqa: SLF001
    assert info.value.code == "CONTRACT_INVALID"
    assert "example.invalid" in info.value.message
    import referencing.exceptions

    with pytest.raises(referencing.exceptions.NoSuchResource):
        contracts.REGISTRY.get_or_retrieve("https://example.invalid/x.json")
    assert no_network == []


def test_bundled_contracts_resolve_all_their_refs_offline(no_network):
    for name in contracts.SCHEMAS:
        if name in INPUT_CONTRACTS:
            for ref_target in json.dumps(contracts.SCHEMAS[name]).split('"$ref": "')[1:]:
                ref = ref_target.split('"', 1)[0]
                contracts.REGISTRY.resolver(base_uri=contracts.SCHEMA_IDS[name]).lookup(ref)
    assert no_network == []


# -- validate(): codes and pointers -----------------------------------------


def _report(**extra):
    return {"format": "viano-bug-report", "format_version": 1, **extra}


def _error(name, document):
    with pytest.raises(CaseBuildError) as info:
        contracts.validate(name, document, path="in.json")
    assert info.value.path == "in.json"
    return info.value.code, info.value.pointer


def test_date_time_format_is_really_checked():
    naive = _report(observations=[{"text": "x", "observed_at": "2024-01-01T10:00:00"}])
    assert _error("report", naive) == ("SCHEMA_VIOLATION", "/observations/0/observed_at")
    contracts.validate("report", _report(observations=[{"text": "x", "observed_at": "2024-01-01T10:00:00+02:00"}]))
    contracts.validate("report", _report(observations=[{"text": "x", "observed_at": "2024-01-01T10:00:00Z"}]))
    for bad in ("2024-02-30T10:00:00Z", "2024-01-01 10:00:00Z", "2024-01-01T10:00:00Z\n", "yesterday"):
        assert _error("report", _report(observations=[{"text": "x", "observed_at": bad}]))[0] == "SCHEMA_VIOLATION"


def test_format_version_must_be_the_integer_1():
    assert _error("report", _report(format_version=1.0)) == ("UNSUPPORTED_VERSION", "/format_version")
    assert _error("report", _report(format_version=True)) == ("UNSUPPORTED_VERSION", "/format_version")
    assert _error("report", _report(format_version=2)) == ("UNSUPPORTED_VERSION", "/format_version")
    assert _error("report", _report(format="viano-reproduction")) == ("UNSUPPORTED_VERSION", "/format")
    assert _error("report", {"format_version": 1}) == ("UNSUPPORTED_VERSION", "/format")
    assert _error("report", {"format": "viano-bug-report"}) == ("UNSUPPORTED_VERSION", "/format_version")
    assert _error("report", []) == ("SCHEMA_VIOLATION", "")


def test_integers_are_json_integers_everywhere():
    entity = _report(entities=[{"type": "component", "id": 42.0}])
    assert _error("report", entity) == ("SCHEMA_VIOLATION", "/entities/0/id")
    assert not struct_accepts("report", entity)
    contracts.validate("report", _report(entities=[{"type": "component", "id": 42}]))


def test_unknown_fields_top_level_of_reports_only():
    contracts.validate("report", _report(vendor_extension={"anything": [1, 2]}))
    contracts.validate("reproduction", {"format": "viano-reproduction", "format_version": 1, "x": None})
    nested = _report(observations=[{"text": "x", "mood": "sad"}])
    assert _error("report", nested) == ("SCHEMA_VIOLATION", "/observations/0/mood")
    index = {"format": "viano-case-inputs", "format_version": 1, "reports": [], "extra": 1}
    assert _error("case-inputs", index) == ("SCHEMA_VIOLATION", "/extra")
    context = {"format": "viano-case-inputs", "format_version": 1, "context": {"logs": []}}
    assert _error("case-inputs", context) == ("SCHEMA_VIOLATION", "/context/logs")


def test_blank_text_and_null_optionals_are_refused():
    assert _error("report", _report(observations=[{"text": " \t\n"}])) == ("SCHEMA_VIOLATION", "/observations/0/text")
    assert _error("report", _report(title=None)) == ("SCHEMA_VIOLATION", "/title")
    assert _error("report", _report(observations=[{"text": "x", "claim": {"key": "k"}}])) == (
        "SCHEMA_VIOLATION",
        "/observations/0/claim",
    )
    contracts.validate("report", _report(observations=[{"text": "x", "claim": {"key": "k", "value": None}}]))


def test_first_error_is_chosen_deterministically_indices_numerically():
    document = _report(observations=[{"text": "ok"}] * 10 + [{"text": ""}], comments=[{"text": " "}])
    document["observations"][2] = {"text": 3}
    assert _error("report", document) == ("SCHEMA_VIOLATION", "/comments/0/text")
    del document["comments"]
    assert _error("report", document) == ("SCHEMA_VIOLATION", "/observations/2/text")


def _every_error_reported_first(name: str, document) -> tuple[str, str] | None:
    """What validate() would report if every error were made: the first by
    (location, message) over all errors of a validator that checks every item."""
    schemas = contracts.schemas
    checker = _EVERY_ITEM_VALIDATOR(schemas.SCHEMAS[name], registry=schemas.REGISTRY, format_checker=schemas.FORMAT_CHECKER)
    errors = list(checker.iter_errors(document))
    if not errors:
        return None
    first = min(errors, key=lambda e: (schemas._path_key(schemas._error_parts(e)), e.message))
    return schemas.json_pointer(schemas._error_parts(first)), schemas._message(first)


#: The contracts' validator as it was before arrays and extra members were cut
#: short at the first that fails: every error is made.
_EVERY_ITEM_VALIDATOR = __import__("jsonschema").validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", lambda checker, value: type(value) is int),
)


def _reported(name: str, document) -> tuple[str, str] | None:
    try:
        contracts.validate(name, document)
    except CaseBuildError as exc:
        if exc.code == "UNSUPPORTED_VERSION":
            return "version"
        return exc.pointer, exc.message.split(": ", 1)[1]
    return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_documents(), st.integers(0, 3))
def test_checking_items_up_to_the_first_failing_reports_what_checking_all_would(case, copies):
    name, document = case
    if isinstance(document, dict):
        for value in document.values():  # longer arrays, so that later items fail too
            if isinstance(value, list) and value:
                value.extend(copy.deepcopy(value) * copies)
    reported = _reported(name, document)
    if reported != "version":
        assert reported == _every_error_reported_first(name, document), (name, document)


@pytest.mark.parametrize("name,head,item", [
    ("report", '{"format":"viano-bug-report","format_version":1,"observations":[', "1"),
    ("package-source", '{"format":"viano-package","format_version":1,"package_id":"p","project":{"name":"n","version":"v"},'
                       '"analysis_revision":1,"files":[', "1"),
    ("case-inputs", '{"format":"viano-case-inputs","format_version":1,"reports":[', '""'),
])
def test_an_array_of_bad_items_makes_the_errors_of_its_first_bad_item_only(name, head, item):
    # A megabyte of such items made one jsonschema error each (about 100 s and
    # 1.8 GB) to report the first.
    document = json.loads(head + ",".join([item] * 20000) + "]}")
    errors = list(contracts.validator(name).iter_errors(document))
    assert 1 <= len(errors) <= 2 and {tuple(e.absolute_path)[1] for e in errors} == {0}
    assert _error(name, document)[1].split("/")[2] == "0"


def test_every_error_of_the_first_failing_item_counts():
    # jsonschema finds the text's errors first; the author's comes first by location.
    document = _report(observations=[{"text": "ok"}, {"text": "", "author": 5}, {"text": 1}])
    assert _error("report", document) == ("SCHEMA_VIOLATION", "/observations/1/author")
    assert _reported("report", document) == _every_error_reported_first("report", document)


def test_extra_members_with_a_schema_are_checked_in_key_order_up_to_the_first_failing():
    entry = {"sha256": "0" * 64, "size": 1}
    files = {f"f{i:05d}": {"size": "x"} for i in range(20000, 0, -1)} | {"a": entry}
    document = {"format": "viano-package", "format_version": 1, "case_id": "c", "package_id": "p",
                "package_generation": 1, "analysis_revision": 1, "project": {"name": "n", "version": "v"},
                "artifacts": {}, "files": files}
    errors = list(contracts.validator("package-manifest").iter_errors(document))
    assert {tuple(e.absolute_path)[:2] for e in errors} == {("files", "f00001")}
    assert _error("package-manifest", document) == ("SCHEMA_VIOLATION", "/files/f00001")


def test_validate_raises_the_callers_error_type():
    with pytest.raises(AdmissionError) as info:
        contracts.validate("package-source", {"format": "viano-package", "format_version": 1}, error=AdmissionError)
    assert info.value.code == "SCHEMA_VIOLATION"


def test_seed_examples_are_valid():
    contracts.validate(
        "case-inputs",
        {
            "format": "viano-case-inputs",
            "format_version": 1,
            "reports": ["original/report.data"],
            "reproductions": ["original/reproduction.data"],
            "context": {"runtime": ["original/runtime.bin"], "database": [], "source": [], "research": []},
            "attachments": [],
            "expected_research": ["research/ab/result.json"],
        },
    )
    contracts.validate(
        "report",
        {
            "format": "viano-bug-report",
            "format_version": 1,
            "title": "A generic observed problem",
            "observations": [{"text": "The switch remains off", "author": "Tester A"}],
            "tester_hypotheses": [{"text": "Perhaps a timing issue"}],
            "expected_behavior": [{"text": "The switch turns on"}],
            "expected_behavior_complete": False,
            "entities": [{"type": "component", "id": "42", "roles": ["focus"]}],
        },
    )
    contracts.validate(
        "package-source",
        {
            "format": "viano-package",
            "format_version": 1,
            "package_id": "stable-package",
            "project": {"name": "demo", "version": "1.0"},
            "analysis_revision": 1,
            "artifacts": {"case_inputs": "original/case-inputs.json"},
            "files": ["original/report.data", {"path": "original/runtime.bin", "size": 3}],
        },
    )


def test_research_result_shape():
    result = {
        "format": "viano-research-result",
        "format_version": 1,
        "provider": {"name": "dir", "version": "1"},
        "request_hash": "a" * 64,
        "scope": "intended_behavior",
        "status": "partial",
        "statements": [{"text": "The switch turns on", "citations": [0]}],
        "sources": [{"url": "https://example.org/spec", "title": "Spec", "retrieved_at": "2024-01-01T00:00:00Z", "excerpt": "on"}],
    }
    contracts.validate("research-result", result)
    assert struct_accepts("research-result", result)
    naive = copy.deepcopy(result)
    naive["sources"][0]["retrieved_at"] = "2024-01-01T00:00:00"
    assert _error("research-result", naive) == ("SCHEMA_VIOLATION", "/sources/0/retrieved_at")
    assert not struct_accepts("research-result", naive)
    assert _error("research-result", dict(result, request_hash="a" * 63 + "\n"))[1] == "/request_hash"


# -- Struct parity ------------------------------------------------------------


#: The JSON Schema Test Suite's date-time cases (draft2020-12/optional/format/
#: date-time.json), plus the calendar and newline cases of our own.
DATE_TIME_CASES = [
    ("1963-06-19T08:30:06.283185Z", True),
    ("1963-06-19T08:30:06Z", True),
    ("1937-01-01T12:00:27.87+00:20", True),
    ("1990-12-31T15:59:50.123-08:00", True),
    ("1998-12-31T23:59:60Z", True),  # a leap second, UTC
    ("1998-12-31T15:59:60.123-08:00", True),  # a leap second, 23:59:60 in UTC
    ("1998-12-31T23:58:60Z", False),  # a leap second at the wrong minute
    ("1998-12-31T22:59:60Z", False),  # ... at the wrong hour
    ("1998-12-31T23:59:61Z", False),
    ("1990-02-31T15:59:59.123-08:00", False),
    ("1990-12-31T15:59:59-24:00", False),
    ("1963-06-19T08:30:06.28123+01:00Z", False),
    ("06/19/1963 08:30:06 PST", False),
    ("1963-06-19t08:30:06.283185z", True),
    ("2013-350T01:01:01", False),
    ("1963-6-19T08:30:06.283185Z", False),
    ("1963-06-1T08:30:06.283185Z", False),
    ("1963-06-1\u09eaT00:00:00Z", False),  # a Bengali digit
    ("1963-06-11T0\u09ea:00:00Z", False),
    ("2024-02-29T10:00:00Z", True),
    ("2023-02-29T10:00:00Z", False),
    ("0000-01-01T00:00:00Z", False),
    ("2024-04-31T00:00:00z", False),
    ("2024-12-31t23:59:59.999-23:59", True),
    ("2024-01-01T10:00:00", False),  # naive
    ("2024-01-01T24:00:00Z", False),
    ("2024-01-01T10:00:00Z\n", False),
    ("2024-01-01T10:00:00+01:00\n", False),
]


@pytest.mark.parametrize(("value", "valid"), DATE_TIME_CASES)
def test_date_time_cases_in_schema_struct_and_format_checker(value, valid):
    assert is_date_time(value) is valid
    assert contracts.FORMAT_CHECKER.conforms(value, "date-time") is valid
    report = {"format": "viano-bug-report", "format_version": 1, "observations": [{"text": "x", "observed_at": value}]}
    assert schema_accepts("report", report) is valid
    assert struct_accepts("report", report) is valid


def test_the_format_checker_is_draft_2020_12_s_but_for_date_time():
    ours, theirs = contracts.FORMAT_CHECKER.checkers, Draft202012Validator.FORMAT_CHECKER.checkers
    assert set(ours) == set(theirs) | {"date-time"}
    assert all(ours[name] == theirs[name] for name in theirs if name != "date-time")
    assert contracts.FORMAT_CHECKER.conforms("08:30:06Z", "time") == Draft202012Validator.FORMAT_CHECKER.conforms("08:30:06Z", "time")


def test_the_format_checker_leaves_other_types_to_the_schema():
    for value in (12, 13.7, {}, [], False, None):
        assert contracts.FORMAT_CHECKER.conforms(value, "date-time")


@given(DATE_TIMES_ANY)
def test_is_date_time_agrees_with_an_independent_rfc3339_check(value):
    # rfc3339-validator (a test dependency only) judges everything but leap
    # seconds, which it refuses: the upper-cased text, and no newline.
    from rfc3339_validator import validate_rfc3339

    assert is_date_time(value) == (validate_rfc3339(value.upper()) and "\n" not in value)


@given(
    st.integers(1, 9999), st.integers(1, 12), st.integers(1, 28), st.integers(0, 23), st.integers(0, 59),
    st.sampled_from(["Z", "+00:00", "-08:00", "+05:45", "+23:59", "-23:59", "+00:01", "-00:01"]),
)
def test_a_leap_second_is_valid_exactly_at_23_59_utc(year, month, day, hour, minute, zone):
    import datetime

    value = f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:60{zone}"
    local = datetime.datetime(2000, 1, 1, hour, minute, 59)
    offset = datetime.timedelta(0) if zone == "Z" else datetime.timedelta(
        hours=int(zone[1:3]), minutes=int(zone[4:6])) * (1 if zone[0] == "+" else -1)
    in_utc = local - offset
    assert is_date_time(value) is ((in_utc.hour, in_utc.minute) == (23, 59))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_documents())
def test_generated_valid_documents_pass_schema_and_struct(case):
    name, document = case
    assert schema_accepts(name, document), (name, document)
    assert struct_accepts(name, document), (name, document)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_documents())
def test_schema_and_struct_agree_on_mutated_documents(case):
    name, document = case
    assert schema_accepts(name, document) == struct_accepts(name, document), (name, document)


FIXED_PARITY = [
    ("report", _report(title="")),
    ("report", _report(title="\u3000")),
    ("report", _report(summary="\u200b")),  # zero-width space is not whitespace: nonblank
    ("report", _report(entities=[{"type": "c", "id": ""}])),
    ("report", _report(entities=[{"type": "c", "id": True}])),
    ("report", _report(entities=[{"type": "c", "id": 2**53}])),
    ("report", _report(entities=[{"type": "c", "id": -(2**53) + 1, "roles": []}])),
    ("report", _report(expected_behavior_complete=1)),
    ("report", _report(observations=[{"text": "x", "claim": {"key": "k", "value": {"deep": [[[2**60]]]}}}])),
    ("reproduction", {"format": "viano-reproduction", "format_version": 1, "events_ref": ""}),
    ("reproduction", {"format": "viano-reproduction", "format_version": 1, "facts": [{"name": "n"}]}),
    ("reproduction", {"format": "viano-reproduction", "format_version": 1, "attachments": "a"}),
    ("report", _report(attachments="a")),
    ("report", _report(attachments=[""])),
    ("report", _report(attachments=[1])),
    ("report", _report(attachments=["a", "a"])),
    ("report", _report(attachments=[])),
    ("package-manifest", {"format": "viano-package", "format_version": 1, "case_id": "c", "package_id": "p",
                          "package_generation": 1, "analysis_revision": 1, "project": {"name": "n", "version": "v"},
                          "artifacts": {}, "files": {"": {"sha256": "0" * 64, "size": 0}}}),
    ("package-manifest", {"format": "viano-package", "format_version": 1, "case_id": "c", "package_id": "p",
                          "package_generation": 0, "analysis_revision": 1, "project": {"name": "n", "version": "v"},
                          "artifacts": {}, "files": {}}),
    ("package-source", {"format": "viano-package", "format_version": 1, "package_id": "p",
                        "project": {"name": "n", "version": "v"}, "analysis_revision": 1,
                        "files": [{"path": "a", "sha256": "A" * 64}]}),
    ("research-request", {"format": "viano-research-request", "format_version": 1}),
]


@pytest.mark.parametrize("name,document", FIXED_PARITY)
def test_schema_and_struct_agree_on_edge_cases(name, document):
    assert schema_accepts(name, document) == struct_accepts(name, document)


def test_a_case_confirmed_before_entity_kinds_and_research_requests_is_still_a_case():
    """A confirmed case is reused as published (seed 001); cases written before
    entity sources carried ``kind``, research results named ``request`` and
    ``bug`` listed reports' attachments must still meet the contract, while
    the builder always writes all three now."""
    from contracts.case_structs import decode_case

    from tests.conftest import FIXTURES

    golden = json.loads((FIXTURES / "golden" / "sample" / "case.json").read_text(encoding="utf-8"))
    assert all("kind" in source for entity in golden["entities"] for source in entity["sources"])
    older = copy.deepcopy(golden)
    for entity in older["entities"]:
        for source in entity["sources"]:
            del source["kind"]
    assert golden["bug"]["attachments"]
    del older["bug"]["attachments"]  # before reports' attachments were recorded
    older["research"]["results"] = [{
        "path": "research/aa/result.json", "sha256": "12" * 32, "request_hash": "ef" * 32,
        "provider": {"name": "p", "version": "1"}, "status": "partial", "statement_ids": [],
    }]
    for document in (older, golden):
        contracts.validate("case", document, path="case.json")
        decode_case(json.dumps(document).encode())
    bad = copy.deepcopy(golden)
    bad["entities"][0]["sources"][0]["kind"] = "external_research"  # never an entity's kind
    with pytest.raises(CaseBuildError):
        contracts.validate("case", bad, path="case.json")
    with pytest.raises(msgspec.ValidationError):
        decode_case(json.dumps(bad).encode())


# -- anchored patterns end at the end of input --------------------------------
#
# JSON Schema patterns are ECMA-262 regexes, where ``$`` is the end of input;
# jsonschema and msgspec run them with Python's ``re.search``, where ``$`` also
# matches just before a final "\n". So every anchored pattern, in the schemas
# and in the Structs alike, ends in ``(?![\s\S])`` ("no character follows"),
# which means end of input in both dialects (``\Z`` is not ECMA-262).

END_OF_INPUT = r"(?![\s\S])"


def _schema_patterns(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            else:
                yield from _schema_patterns(value)
    elif isinstance(node, list):
        for item in node:
            yield from _schema_patterns(item)


def _struct_patterns(info, seen=None):
    """Every ``Meta(pattern=...)`` reachable from a msgspec type description."""
    import msgspec.inspect as mi

    seen = set() if seen is None else seen
    if isinstance(info, mi.StrType):
        if info.pattern is not None:
            yield info.pattern
    elif isinstance(info, mi.StructType):
        if info.cls in seen:
            return
        seen.add(info.cls)
        for field in info.fields:
            yield from _struct_patterns(field.type, seen)
    elif isinstance(info, mi.UnionType):
        for member in info.types:
            yield from _struct_patterns(member, seen)
    elif isinstance(info, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        yield from _struct_patterns(info.item_type, seen)
    elif isinstance(info, mi.TupleType):
        for member in info.item_types:
            yield from _struct_patterns(member, seen)
    elif isinstance(info, mi.DictType):
        yield from _struct_patterns(info.key_type, seen)
        yield from _struct_patterns(info.value_type, seen)


def _all_struct_patterns() -> set[str]:
    import msgspec.inspect as mi

    from contracts import case_structs, verifier_structs

    roots = [*STRUCTS.values(), case_structs.Case, verifier_structs.VerificationRequest,
             verifier_structs.VerificationResponse]
    return {pattern for root in roots for pattern in _struct_patterns(mi.type_info(root))}


def test_no_contract_or_struct_pattern_ends_at_dollar():
    schema_patterns = {p for schema in contracts.SCHEMAS.values() for p in _schema_patterns(schema)}
    struct_patterns = _all_struct_patterns()
    for pattern in schema_patterns | struct_patterns:
        assert "$" not in pattern, pattern
    anchored = {p for p in schema_patterns | struct_patterns if p.startswith("^") and p != "^/"}
    assert anchored, "the contracts have anchored patterns"
    for pattern in anchored:
        assert pattern.endswith(END_OF_INPUT), pattern
    # The Structs restate the schemas' patterns character for character.
    assert struct_patterns <= schema_patterns, struct_patterns - schema_patterns


def test_pipeline_copies_of_contract_patterns_are_the_contracts_own():
    from pipeline import probes, verifier
    from pipeline.errors import VerificationError

    schema_patterns = {p for schema in contracts.SCHEMAS.values() for p in _schema_patterns(schema)}
    sha256 = contracts.SCHEMAS["package-source"]["$defs"]["sha256"]["pattern"]
    assert probes._SHA256_RE.pattern == sha256 == contracts.SCHEMAS["case"]["$defs"]["ref"]["properties"]["sha256"]["pattern"]  # noqa: SLF001
    assert verifier._POINTER_RE.pattern in schema_patterns  # noqa: SLF001 - field_path of JSON_FIELD_EQUALS
    assert probes._RECORD_ID_RE.pattern.endswith(END_OF_INPUT)  # noqa: SLF001
    sha = "ab" * 32
    assert probes.unresolved_from_case({"case": {"case_id": "c"}}, case_path="case.json", case_sha256=sha) is not None
    for tail in ("\n", "\r\n"):
        with pytest.raises(VerificationError) as info:
            probes.unresolved_from_case({"case": {"case_id": "c"}}, case_path="case.json", case_sha256=sha + tail)
        assert info.value.code == "INVALID_ARGUMENT"


def _golden_case_with_a_research_result() -> dict:
    from tests.conftest import FIXTURES

    case = json.loads((FIXTURES / "golden" / "sample" / "case.json").read_text(encoding="utf-8"))
    case["research"]["results"] = [{
        "path": "research/aa/result.json", "sha256": "12" * 32, "request_hash": "ef" * 32,
        "request": {"path": "research/aa/request.json", "sha256": "34" * 32, "size": 2},
        "provider": {"name": "p", "version": "1"}, "status": "partial", "statement_ids": ["E0002"],
    }]
    return case


def _at(document, pointer: str):
    parts = [int(p) if p.isdigit() else p for p in pointer.split("/")[1:]]
    parent = document
    for part in parts[:-1]:
        parent = parent[part]
    return parent, parts[-1]


#: (pointer, the value there) for every anchored id and digest of the case contract.
CASE_ANCHORED = [
    ("/case/request_hash", None),
    ("/research/request_hash", None),
    ("/inputs/reports/0/sha256", None),
    ("/inputs/index/sha256", None),
    ("/reproduction/reproductions/0/events_ref/sha256", None),
    ("/research/results/0/sha256", None),
    ("/research/results/0/request_hash", None),
    ("/research/results/0/request/sha256", None),
    ("/research/results/0/statement_ids/0", "E0002"),
    ("/human_observations/observations/0/id", "O0001"),
    ("/human_observations/comments/0/id", "C0001"),
    ("/human_observations/tester_hypotheses/0/id", "T0001"),
    ("/expected_behavior/statements/0/id", "E0001"),
    ("/runtime_facts/facts/0/id", "F0001"),
    ("/reproduction/reproductions/0/id", "R0001"),
    ("/reproduction/reproductions/0/observation_ids/0", "O0006"),
    ("/reproduction/reproductions/0/fact_ids/0", "F0001"),
    ("/data_quality/claim_conflicts/0/values/0/id", "O0001"),
]


def _case_accepted(document) -> tuple[bool, bool]:
    from contracts.case_structs import decode_case

    try:
        contracts.validate("case", document, path="case.json")
        schema = True
    except CaseBuildError as exc:
        assert exc.code == "SCHEMA_VIOLATION"
        schema = False
    try:
        decode_case(json.dumps(document).encode())
        struct = True
    except msgspec.ValidationError:
        struct = False
    return schema, struct


@pytest.mark.parametrize("pointer,expected", CASE_ANCHORED, ids=[p for p, _ in CASE_ANCHORED])
def test_case_ids_and_digests_refuse_a_trailing_newline_in_schema_and_struct(pointer, expected):
    case = _golden_case_with_a_research_result()
    parent, key = _at(case, pointer)
    value = parent[key]
    assert isinstance(value, str) and (expected is None and len(value) == 64 or value == expected), value
    assert _case_accepted(case) == (True, True)
    for tail in ("\n", "\r\n"):
        parent[key] = value + tail
        assert _case_accepted(case) == (False, False), (pointer, tail)
    parent[key] = value
    assert _case_accepted(case) == (True, True)


def test_case_pointers_keep_their_meaning_a_token_may_end_in_a_newline():
    """A pointer's last token may hold any character, a newline too (RFC 6901):
    the new end anchor changes nothing there, in either engine."""
    case = _golden_case_with_a_research_result()
    for pointer in ("/human_observations/observations/0/provenance/pointer", "/entities/0/sources/0/pointer",
                    "/reproduction/reproductions/0/steps/0/pointer", "/runtime_facts/facts/2/value_ref/pointer"):
        parent, key = _at(case, pointer)
        value = parent[key]
        for candidate, accepted in ((value, True), (value + "\n", True), (value + "\r\n", True),
                                    ("/a~\n", False), ("x/a\n", False), ("\n/a", False)):
            parent[key] = candidate
            assert _case_accepted(case) == (accepted, accepted), (pointer, candidate)
        parent[key] = value


def _manifest(sha256: str) -> dict:
    return {"format": "viano-package", "format_version": 1, "case_id": "c", "package_id": "p",
            "package_generation": 1, "analysis_revision": 1, "project": {"name": "n", "version": "v"},
            "artifacts": {}, "files": {"a": {"sha256": sha256, "size": 0}}}


def _source(sha256: str) -> dict:
    return {"format": "viano-package", "format_version": 1, "package_id": "p", "project": {"name": "n", "version": "v"},
            "analysis_revision": 1, "files": [{"path": "a", "sha256": sha256}]}


def _result(sha256: str) -> dict:
    return {"format": "viano-research-result", "format_version": 1, "provider": {"name": "p", "version": "1"},
            "request_hash": sha256, "scope": "intended_behavior", "status": "not_found", "statements": [], "sources": []}


@pytest.mark.parametrize("name,make", [("package-manifest", _manifest), ("package-source", _source),
                                       ("research-result", _result)])
def test_input_digests_refuse_a_trailing_newline_in_schema_and_struct(name, make):
    for good in ("ab" * 32, "0" * 64):
        assert schema_accepts(name, make(good)) and struct_accepts(name, make(good))
        for bad in (good + "\n", good + "\r\n", good[:-1] + "\n", good[:-2] + "\r\n"):
            assert not schema_accepts(name, make(bad)), bad
            assert not struct_accepts(name, make(bad)), bad


def test_verification_evidence_refuses_a_trailing_newline_in_schema_and_struct():
    from contracts.verifier_structs import VerificationResponse

    checker = contracts.validator("verification-response")

    def accepted(evidence):
        document = {"result": "SUPPORTED", "quality_score_millis": 1000, "evidence": evidence}
        try:
            msgspec.convert(document, VerificationResponse)
            struct = True
        except msgspec.ValidationError:
            struct = False
        return checker.is_valid(document), struct

    good = "verification:" + "cd" * 32
    assert accepted(good) == (True, True)
    for tail in ("\n", "\r\n"):
        assert accepted(good + tail) == (False, False), tail


def test_verification_field_path_pointer_keeps_its_meaning():
    """field_path's pointer syntax is judged by the schema and by the verifier's
    fast path (Struct plus ``_POINTER_RE``); a trailing newline is part of the
    last token there, as before, and both still agree."""
    from pipeline import verifier
    from pipeline.errors import VerificationError

    def accepted(field_path):
        document = {"case_id": "c", "response_text": "{}", "evidence_artifact_ref": "r", "latency_micros": 0,
                    "verification": {"mode": "JSON_FIELD_EQUALS", "field_path": field_path,
                                     "expected_text": "x", "minimum_quality_millis": 0}}
        try:
            verifier.parse_request(json.dumps(document).encode())
            fast = True
        except VerificationError:
            fast = False
        return contracts.validator("verification-request").is_valid(document), fast

    for field_path, verdict in (("/a", True), ("/a\n", True), ("/a\r\n", True), ("/a~1b", True),
                                ("/a~\n", False), ("/a~2", False)):
        assert accepted(field_path) == (verdict, verdict), field_path


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="/~01a\n", max_size=14))
def test_the_pointer_pattern_means_what_it_meant_without_backtracking(text):
    """case-v1's pointer pattern takes "/" out of a token's characters, so it
    no longer backtracks exponentially on a long run of slashes (a pointer of
    24 slashes and a "~" took seconds, doubling with each slash); a "/" there
    could only ever start the next token, so it accepts what it accepted."""
    import re as regex

    from contracts import case_structs

    before = regex.compile(r"^(/([^~]|~[01])*)+(?![\s\S])")
    now = regex.compile(r"^(/([^~/]|~[01])*)+(?![\s\S])")
    assert bool(before.search(text)) == bool(now.search(text))
    schema_pattern = contracts.validator("case").schema["$defs"]["pointer"]["pattern"]
    assert schema_pattern == now.pattern
    assert regex.compile(case_structs.Pointer.__metadata__[0].pattern).pattern == now.pattern
    assert now.search("/" * 60 + "~") is None


#: Every date-time field of the case contract, by where the test puts one.
CASE_DATE_TIMES = [
    "/human_observations/observations/0/observed_at",
    "/human_observations/comments/0/observed_at",
    "/human_observations/tester_hypotheses/0/observed_at",
    "/expected_behavior/statements/0/observed_at",
    "/expected_behavior/statements/0/citations/0/retrieved_at",
]


def test_case_date_time_pointers_name_every_date_time_of_the_contract():
    def formats(node, found):
        if isinstance(node, dict):
            if node.get("format") == "date-time":
                found.append(node)
            for value in node.values():
                formats(value, found)
        elif isinstance(node, list):
            for value in node:
                formats(value, found)
        return found

    schema = contracts.SCHEMAS["case"]
    # One definition, referenced by each field: the fields above are all of them.
    assert formats(schema, []) == [schema["$defs"]["date_time"]]
    assert json.dumps(schema).count('"#/$defs/date_time"') == len(CASE_DATE_TIMES)


@pytest.mark.parametrize("pointer", CASE_DATE_TIMES)
def test_case_date_times_are_checked_alike_by_schema_and_struct(pointer):
    """The case Structs check date-times as the schema does, so the build's
    fast check (the Structs) refuses what the contract refuses: a naive time,
    an impossible date, a trailing newline."""
    case = _golden_case_with_a_research_result()
    case["expected_behavior"]["statements"][0]["citations"] = [
        {"url": "https://example.org/a", "title": "t", "retrieved_at": "2026-03-14T07:00:12Z", "excerpt": "e"}
    ]
    parent, key = _at(case, pointer)
    for value, accepted in (
        ("2026-03-14T07:00:12+01:00", True),
        ("2026-02-28t23:59:59.5z", True),
        ("2024-02-29T00:00:00Z", True),
        ("2026-03-14T07:00:12", False),
        ("2026-02-29T00:00:00Z", False),
        ("2026-13-01T00:00:00Z", False),
        ("2026-03-14T07:00:12Z\n", False),
        ("2026-03-14T07:00:12Z\r\n", False),
        ("", False),
    ):
        parent[key] = value
        assert _case_accepted(case) == (accepted, accepted), (pointer, value)


# ---------------------------------------------------------------- printed refusals


def _printed_refusal(document) -> str:
    with pytest.raises(CaseBuildError) as info:
        contracts.validate("report", document, path="r.json")
    return str(info.value)


def _report(**fields):
    return {"format": "viano-bug-report", "format_version": 1, "title": "t", "observations": [], **fields}


@pytest.mark.parametrize(("title", "shown"), [("  ", "'  '"), ("\t\n", "'\\t\\n'")])
def test_a_blank_string_is_said_to_be_blank_with_each_backslash_escaped_once(title, shown):
    printed = _printed_refusal(_report(title=title))
    assert printed == f"SCHEMA_VIOLATION: report: {shown} is blank: at least one non-whitespace character is required (r.json#/title)"


def test_a_format_refusal_shows_the_string_escaped_once():
    printed = _printed_refusal(_report(observations=[{"text": "a", "observed_at": "2026-01-01T00:00:00Z\n"}]))
    assert printed == ("SCHEMA_VIOLATION: report: '2026-01-01T00:00:00Z\\n' is not a valid date-time "
                       "(r.json#/observations/0/observed_at)")


def test_a_pattern_refusal_shows_the_contracts_pattern_as_written():
    errors = list(Draft202012Validator({"pattern": "^[0-9a-f]{64}(?![\\s\\S])"}).iter_errors("x\\y"))
    message = contracts.schemas._message(errors[0])
    assert message == "'x\\y' does not match the pattern ^[0-9a-f]{64}(?![\\s\\S])"
    long = list(Draft202012Validator({"pattern": "^a$"}).iter_errors("b" * 500))
    assert len(contracts.schemas._message(long[0])) < 200


@pytest.mark.parametrize("attachments,accepted", [
    (["original/shot.png"], True), ([], True), (["a", "a"], True),
    ("original/shot.png", False), ([""], False), ([1], False), ([None], False), (None, False),
])
def test_a_reports_attachments_are_content_path_strings(attachments, accepted):
    """ARCHITECTURE section 12: reports' ``attachments`` are a list of content
    paths, like a reproduction's; no longer an ignored extension."""
    document = _report(attachments=attachments)
    assert schema_accepts("report", document) is accepted
    assert struct_accepts("report", document) is accepted

"""The bundled JSON Schema contracts and the one way to validate against them.

(Imported lazily through the ``contracts`` package, so code that only needs
the msgspec Structs never pays for importing jsonschema.)

Every ``contracts/<name>-v1.schema.json`` shipped with this package is loaded
once, at import, through :mod:`importlib.resources` and registered in one
immutable :data:`REGISTRY` under its ``$id`` (``urn:viano:<name>-v1``). The
registry's retrieve function refuses every URI it does not hold, so a ``$ref``
to anything that is not bundled is a controlled error and never a network
fetch (jsonschema without an explicit ``registry=`` would fetch remote refs).

Validators are Draft 2020-12 with two guarantees a default validator lacks:

* ``date-time`` is really checked: the format checker is always passed, and
  its ``date-time`` is :func:`contracts.date_time.is_date_time`, the very
  test the Structs make (jsonschema's own needs an optional package and
  silently accepts any string without it; it also refuses leap seconds);
* ``integer`` means a JSON integer: ``1.0`` is not an integer here
  (RELIABILITY.md 25), although the JSON Schema data model calls it one.

:func:`validate` turns the first error (chosen deterministically) into a
:class:`~pipeline.errors.CaseBuildError` carrying an RFC 6901 pointer.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re
from typing import Any

import jsonschema.validators
import referencing
import referencing.exceptions
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from referencing.jsonschema import DRAFT202012

from contracts.date_time import is_date_time
from pipeline.errors import CaseBuildError, VianoError
from pipeline.jsoncanon import json_pointer

__all__ = [
    "FORMAT_CHECKER",
    "REGISTRY",
    "SCHEMA_IDS",
    "SCHEMAS",
    "FORMATS",
    "Validator",
    "schema_id",
    "validator",
    "validate",
]

_SUFFIX = "-v1.schema.json"
_ID_PREFIX = "urn:viano:"
_MAX_SCHEMA_BYTES = 4 << 20


def _conforms_to_date_time(instance: object) -> bool:
    # A format constrains strings only; other types are the schema's "type" to judge.
    return not isinstance(instance, str) or is_date_time(instance)


#: Draft 2020-12's format checker with the contracts' ``date-time``. (Its
#: checks are copied: ``FormatChecker(names)`` would look each name up in the
#: class-wide table, where some names hold another draft's check.)
FORMAT_CHECKER = jsonschema.FormatChecker(())
FORMAT_CHECKER.checkers = dict(Draft202012Validator.FORMAT_CHECKER.checkers)
FORMAT_CHECKER.checks("date-time")(_conforms_to_date_time)


def _is_json_integer(checker, instance: object) -> bool:
    # bool is an int subclass in Python and 1.0 is "integral" to jsonschema;
    # neither is a JSON integer for our contracts.
    return type(instance) is int


_ALL_ITEMS = Draft202012Validator.VALIDATORS["items"]
_ALL_ADDITIONAL_PROPERTIES = Draft202012Validator.VALIDATORS["additionalProperties"]


def _items_up_to_the_first_failing(validator, items, instance, schema):
    """``items``, but no item after the first one that fails is checked.

    :func:`validate` reports the error that comes first by location, and every
    error inside item ``k`` comes before any inside a later item: the rest
    cannot change what is reported, nor whether the document is valid. Without
    this, a megabyte of ``[1,1,1,...]`` where objects belong made jsonschema
    build half a million errors (about 100 s and 1.8 GB) to report one."""
    failing = None
    for error in _ALL_ITEMS(validator, items, instance, schema):
        index = error.relative_path[0] if error.relative_path else None
        if failing is None:
            failing = index
        elif index != failing:
            return
        yield error


def _additional_properties_up_to_the_first_failing(validator, additional, instance, schema):
    """``additionalProperties``, where a schema for them is checked member by
    member in key order and no member after the first failing one is checked
    (the reason is :func:`_items_up_to_the_first_failing`'s; jsonschema's own
    goes through them in set order, i.e. by the hash seed)."""
    if not (validator.is_type(instance, "object") and validator.is_type(additional, "object")):
        yield from _ALL_ADDITIONAL_PROPERTIES(validator, additional, instance, schema)
        return
    for extra in sorted(_additional(instance, schema)):
        errors = list(validator.descend(instance[extra], additional, path=extra))
        if errors:
            yield from errors
            return


def _additional(instance: dict, schema: dict) -> list[str]:
    """The members ``additionalProperties`` applies to (as Draft 2020-12 defines them)."""
    named = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    return [key for key in instance if key not in named and not any(re.search(pattern, key) for pattern in patterns)]


#: Draft 2020-12 with ``integer`` restricted to real integers (see module doc),
#: and arrays and extra members checked only up to the first that fails.
Validator = jsonschema.validators.extend(
    Draft202012Validator,
    validators={
        "items": _items_up_to_the_first_failing,
        "additionalProperties": _additional_properties_up_to_the_first_failing,
    },
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_json_integer),
)


def _refuse_retrieval(uri: str):
    """Registry retrieve hook: nothing outside the bundle is ever fetched."""
    raise referencing.exceptions.NoSuchResource(ref=uri)


def _load_bundle() -> tuple[dict[str, dict], referencing.Registry]:
    schemas: dict[str, dict] = {}
    resources = []
    for entry in sorted(importlib.resources.files("contracts").iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(_SUFFIX) or not entry.is_file():
            continue
        name = entry.name[: -len(_SUFFIX)]
        data = entry.read_bytes()
        if len(data) > _MAX_SCHEMA_BYTES:
            raise ImportError(f"contract {entry.name} is larger than {_MAX_SCHEMA_BYTES} bytes")
        schema = json.loads(data)
        expected_id = f"{_ID_PREFIX}{name}-v1"
        if schema.get("$id") != expected_id:
            raise ImportError(f"contract {entry.name} must have $id {expected_id!r}")
        if schema.get("$schema") != "https://json-schema.org/draft/2020-12/schema":
            raise ImportError(f"contract {entry.name} is not a Draft 2020-12 schema")
        schemas[name] = schema
        resources.append((expected_id, DRAFT202012.create_resource(schema)))
    registry = referencing.Registry(retrieve=_refuse_retrieval).with_resources(resources).crawl()
    return schemas, registry


SCHEMAS: dict[str, dict]
REGISTRY: referencing.Registry
SCHEMAS, REGISTRY = _load_bundle()

#: name -> ``$id``, for every bundled contract (``"report"`` -> ``"urn:viano:report-v1"``).
SCHEMA_IDS: dict[str, str] = {name: schema["$id"] for name, schema in SCHEMAS.items()}

#: name -> the ``format`` string its documents must declare (contracts without a
#: ``format`` constant are absent here and get no version pre-check).
FORMATS: dict[str, str] = {
    name: schema["properties"]["format"]["const"]
    for name, schema in SCHEMAS.items()
    if isinstance(schema.get("properties", {}).get("format"), dict) and "const" in schema["properties"]["format"]
}


def schema_id(name: str) -> str:
    """The ``$id`` of contract ``name``; ``KeyError`` if it is not bundled."""
    return SCHEMA_IDS[name]


@functools.cache
def validator(name: str) -> Draft202012Validator:
    """The validator of contract ``name``, built once with the bundled registry
    and the active format checker."""
    if name not in SCHEMAS:
        raise KeyError(f"no bundled contract named {name!r}")
    return Validator(
        SCHEMAS[name],
        registry=REGISTRY,
        format_checker=FORMAT_CHECKER,
    )


def _path_key(parts) -> tuple:
    # Mixed str/int paths do not compare; rank indices numerically, keys by text.
    return tuple((0, p, "") if isinstance(p, int) else (1, 0, p) for p in parts)


def _error_parts(error: ValidationError) -> list:
    """Where the error is, extended to the offending member for unknown fields."""
    parts = list(error.absolute_path)
    if error.validator == "additionalProperties" and error.validator_value is False and isinstance(error.instance, dict):
        known = error.schema.get("properties", {})
        extras = sorted(key for key in error.instance if key not in known and not error.schema.get("patternProperties"))
        if extras:
            parts.append(extras[0])
    return parts


def _version_problem(name: str, document: Any, path: str | None) -> CaseBuildError | None:
    expected = FORMATS.get(name)
    if expected is None or not isinstance(document, dict):
        return None
    declared = document.get("format")
    if declared != expected:
        return CaseBuildError(
            "UNSUPPORTED_VERSION",
            f"format must be {expected!r}, got {declared!r}" if "format" in document else f"format {expected!r} is missing",
            path=path,
            pointer="/format",
        )
    version = document.get("format_version")
    if type(version) is not int or version != 1:
        return CaseBuildError(
            "UNSUPPORTED_VERSION",
            f"{expected} format_version must be the integer 1, got {version!r}"
            if "format_version" in document
            else f"{expected} format_version is missing",
            path=path,
            pointer="/format_version",
        )
    return None


def _validate_with(
    checker: Draft202012Validator, name: str, document: Any, *, path: str | None, error: type[VianoError]
) -> None:
    problem = _version_problem(name, document, path)
    if problem is not None:
        raise error(problem.code, problem.message, path=path, pointer=problem.pointer)
    try:
        first = min(checker.iter_errors(document), key=lambda e: (_path_key(_error_parts(e)), e.message), default=None)
    except referencing.exceptions.Unresolvable as exc:
        raise error("CONTRACT_INVALID", f"contract {name} refers to {exc} which is not bundled", path=path) from None
    if first is None:
        return
    raise error(
        "SCHEMA_VIOLATION",
        f"{name}: {_message(first)}",
        path=path,
        pointer=json_pointer(_error_parts(first)),
    )


def _message(error) -> str:
    """jsonschema's message, but where it quotes a string: its repr()
    doubles every backslash and the printer (``errors.one_line``) escapes
    each once more, so a blank title's pattern and a time's line break came
    out with four backslashes for one. Such strings (a pattern or format
    failure's) are quoted plainly and left to the printer to escape once;
    the patterns are the contracts' own, shown as written."""
    if error.validator in ("pattern", "format") and isinstance(error.instance, str):
        shown = error.instance if len(error.instance) <= 120 else error.instance[:117] + "..."
        if error.validator == "format":
            return f"'{shown}' is not a valid {error.validator_value}"
        if error.validator_value == r"\S":
            return f"'{shown}' is blank: at least one non-whitespace character is required"
        return f"'{shown}' does not match the pattern {error.validator_value}"
    if error.validator == "not" and error.validator_value == {"pattern": r"\n"}:
        return "a line break is not allowed here"
    return error.message


def validate(name: str, document: Any, *, path: str | None = None, error: type[VianoError] = CaseBuildError) -> None:
    """Check ``document`` against contract ``name`` or raise ``error``.

    ``UNSUPPORTED_VERSION`` (pointer ``/format`` or ``/format_version``) when
    the declared format is not the contract's or format_version is not the
    integer 1; otherwise ``SCHEMA_VIOLATION`` with the RFC 6901 pointer of the
    first error ordered by (location, message), indices numerically, so the
    same document always reports the same error. Unknown fields are reported
    at the unknown member itself.
    """
    _validate_with(validator(name), name, document, path=path, error=error)


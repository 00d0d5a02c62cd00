"""Read one structured input document: strict JSON plus its contract, fast.

:func:`read_document` has exactly the semantics of the slow path
(:func:`~pipeline.jsoncanon.decode_strict` then :func:`contracts.validate`):
the same documents are accepted, the same Python value is returned, and every
rejection carries the slow path's code and pointer, because every rejection
*is* produced by the slow path. The fast path only ever says "accepted, here
is the value" or "not sure"; "not sure" runs the slow path.

The fast path (msgspec, C speed) and why each step is sufficient:

1. ``msgspec.json.decode`` (untyped) gives the value to return. It refuses
   everything decode_strict refuses at the byte level except what steps 3-5
   cover: BOM, NUL, invalid UTF-8, lone surrogates (escaped or encoded), raw
   control characters, trailing data, NaN/Infinity; every float goes
   through a hook that sends one that overflows (``1e400``) or underflows
   to zero (``1e-400``) to the slow path; it parses numbers to the same
   Python ``int``/``float`` values as :mod:`json`.
2. ``msgspec.convert`` into the contract's Struct (``contracts.structs``),
   which mirrors the schema and bounds every typed integer to +/-(2^53-1).
3. The only places where arbitrary JSON can sit (claim and fact values, and
   the ignored top-level extensions of reports and reproductions) are walked
   for integers beyond +/-(2^53-1) and nesting deeper than the depth limit;
   every typed part is shallow by construction.
4. Duplicate keys (msgspec, like :mod:`json`, keeps the last one silently):
   every key/value pair costs exactly one structural ``:``, and colons inside
   strings survive decoding unchanged, so re-encoding the decoded value gives
   fewer colons than the input if and only if some pair was dropped. The one
   way a colon can hide, the escape ``\\u003a`` (or ``\\u003A``), decodes
   to a colon that the re-encoding writes plainly, so each occurrence of
   those six bytes counts as one more colon expected. That count can only be
   too high (the bytes inside an escaped backslash, ``\\\\u003a``, are no
   escape); when it disagrees, the escapes are counted exactly (only those
   after an odd run of backslashes), so a dropped pair is never hidden and a
   report quoting escaped JSON stays on the fast path. (Until session 21 any
   escaped colon sent a document to the slow path: 12 s for 1 MiB instead of
   0.3 s; until session 22 an escaped backslash before ``u003a`` did: 7 s.)
5. A document over ``max_bytes`` goes to the slow path, which refuses it.
"""

from __future__ import annotations

from typing import Any

import msgspec

import contracts
from contracts.structs import MAX_SAFE_INTEGER, STRUCTS
from pipeline.errors import CaseBuildError, VianoError
from pipeline.jsoncanon import DEFAULT_MAX_DEPTH, decode_strict, float_literal_problem

__all__ = ["read_document", "read_document_slow", "read_fast"]



def _checked_float(literal: str) -> float:
    # Every float of the document passes here as its literal: msgspec itself
    # refuses 1e400 but reads 1e-400 as 0.0, which the slow path refuses.
    value = float(literal)
    if float_literal_problem(literal, value) is not None:
        raise ValueError("not sure: the slow path names the number")
    return value


_decode_untyped = msgspec.json.Decoder(float_hook=_checked_float).decode
_encode = msgspec.json.Encoder().encode

_STATEMENT_LISTS = {
    "report": ("observations", "comments", "tester_hypotheses", "expected_behavior"),
    "reproduction": ("observations",),
}
# Nesting above a free value: the document object is depth 1, so a top-level
# extension value starts at 1, a fact value (doc/facts[]/{}) at 3 and a claim
# value (doc/observations[]/{}/claim{}) at 4.
_EXTENSION_DEPTH = 1
_FACT_DEPTH = 3
_CLAIM_DEPTH = 4
_KNOWN_TOP = {name: frozenset(struct.__struct_fields__) for name, struct in STRUCTS.items()}
_ESCAPED_COLON = (b"\\u003a", b"\\u003A")


def _free_value_ok(value: Any, budget: int) -> bool:
    """Arbitrary JSON: integers within +/-(2^53-1), containers nested <= budget."""
    kind = type(value)
    if kind is int:
        return -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER
    if kind is dict:
        if budget <= 0:
            return False
        budget -= 1
        for item in value.values():
            if type(item) in _SCALARS_OK:
                continue
            if not _free_value_ok(item, budget):
                return False
        return True
    if kind is list:
        if budget <= 0:
            return False
        budget -= 1
        for item in value:
            if type(item) in _SCALARS_OK:
                continue
            if not _free_value_ok(item, budget):
                return False
        return True
    return True


_SCALARS_OK = frozenset({str, float, bool, type(None)})


def _free_values_ok(name: str, document: dict, max_depth: int) -> bool:
    lists = _STATEMENT_LISTS.get(name)
    if lists is None:
        return True
    for key in lists:
        for statement in document.get(key, ()):
            claim = statement.get("claim")
            if claim is not None:
                value = claim["value"]
                if type(value) not in _SCALARS_OK and not _free_value_ok(value, max_depth - _CLAIM_DEPTH):
                    return False
    if name == "reproduction":
        for fact in document.get("facts", ()):
            value = fact["value"]
            if type(value) not in _SCALARS_OK and not _free_value_ok(value, max_depth - _FACT_DEPTH):
                return False
    known = _KNOWN_TOP[name]
    for key, value in document.items():
        if key not in known and type(value) not in _SCALARS_OK:
            if not _free_value_ok(value, max_depth - _EXTENSION_DEPTH):
                return False
    return True


def _read_fast(data: bytes, name: str, max_bytes: int) -> dict | None:
    """The decoded document if the fast path can vouch for it, else None."""
    struct = STRUCTS.get(name)
    if struct is None or len(data) > max_bytes:
        return None
    try:
        document = _decode_untyped(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError):
        return None
    if type(document) is not dict:
        return None
    try:
        msgspec.convert(document, struct)
    except (msgspec.ValidationError, RecursionError):
        return None
    if not _free_values_ok(name, document, DEFAULT_MAX_DEPTH):
        return None
    colons = _encode(document).count(b":")
    plain = data.count(b":")
    if plain + data.count(_ESCAPED_COLON[0]) + data.count(_ESCAPED_COLON[1]) != colons:
        # Either a pair was dropped, or some of those six bytes follow an
        # escaped backslash (a report quoting escaped JSON): count exactly.
        if plain + _escaped_colons(data) != colons:
            return None  # a duplicate key was silently dropped
    return document


def _escaped_colons(data: bytes) -> int:
    """How many ``\\u003a``/``\\u003A`` in ``data`` are escapes: those after an
    odd run of backslashes (an even run is escaped backslashes, then text).
    Linear: each run is walked once, from the hex digits that end it."""
    count = 0
    for digits in (b"u003a", b"u003A"):
        at = data.find(digits)
        while at >= 0:
            start = at
            while start and data[start - 1] == 0x5C:  # backslash
                start -= 1
            count += (at - start) % 2
            at = data.find(digits, at + 5)
    return count


def read_fast(data: bytes, name: str, max_bytes: int) -> dict | None:
    """The fast path alone: the decoded document, or None for "not sure"."""
    return _read_fast(bytes(data), name, max_bytes)


def read_document_slow(
    data: bytes, name: str, *, path: str | None, max_bytes: int, error: type[VianoError] = CaseBuildError
) -> Any:
    """The reference semantics: :func:`decode_strict` then :func:`contracts.validate`."""
    document = decode_strict(data, max_bytes=max_bytes, path=path, error=error)
    contracts.validate(name, document, path=path, error=error)
    return document


def read_document(
    data: bytes, name: str, *, path: str | None, max_bytes: int, error: type[VianoError] = CaseBuildError
) -> dict:
    """Decode ``data`` strictly and check it against contract ``name``.

    Returns plain dicts/lists exactly as :func:`read_document_slow` would, or
    raises ``error`` with its code, ``path`` and pointer (``LIMIT_EXCEEDED``,
    ``JSON_*``, ``UNSUPPORTED_VERSION``, ``SCHEMA_VIOLATION``).
    """
    if isinstance(data, memoryview):
        data = data.tobytes()
    elif not isinstance(data, bytes):
        if not isinstance(data, bytearray):
            raise TypeError("read_document takes bytes")
        data = bytes(data)
    document = _read_fast(data, name, max_bytes)
    if document is not None:
        return document
    return read_document_slow(data, name, path=path, max_bytes=max_bytes, error=error)

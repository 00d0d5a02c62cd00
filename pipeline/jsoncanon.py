"""Strict JSON decoding, canonical encoding and SHA-256 helpers.

Every JSON document the project reads goes through :func:`decode_strict` (or a
fast path that falls back to it for the precise error), and every hash in the
project is taken over :func:`canonical_bytes`. Both the stdlib ``json`` module
and msgspec silently keep the last of duplicate keys, accept BOMs or lone
surrogates, or turn ``1e400`` into infinity; this module refuses all of those
(RELIABILITY.md 18-26) with stable codes and a JSON Pointer to the culprit.

Canonical form: UTF-8 (non-ASCII written raw, never ``\\u`` escaped), keys
sorted by code point, ``,``/``:`` separators, no NaN/Infinity; an integral
float within the safe-integer range is written as an integer (as RFC 8785
does), so ``1.0`` and ``1`` hash alike.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from typing import Any

from .errors import CaseBuildError, VianoError

__all__ = [
    "MAX_SAFE_INTEGER",
    "DEFAULT_MAX_DEPTH",
    "CASE_MAX_DEPTH",
    "decode_strict",
    "parse_json_text",
    "PARSE_MAX_DEPTH",
    "TooDeepToParse",
    "strict_problem",
    "repeated_keys",
    "canonical_bytes",
    "canonical_hash",
    "sha256_hex",
    "pretty_bytes",
    "EncodedTooLarge",
    "json_pointer",
    "escape_pointer_token",
    "resolve_pointer",
    "read_bounded",
    "read_fd_at_most",
]

MAX_SAFE_INTEGER = 2**53 - 1
DEFAULT_MAX_DEPTH = 64
# A case holds supplied values deeper than their documents did: a claim value
# sits under 4 containers in a report (doc/observations[]/{}/claim{}) and
# under 6 in a claim conflict (case/data_quality/claim_conflicts[]/{}/values[]/{}).
# Reading a published case must accept whatever the inputs could hold.
CASE_MAX_DEPTH = DEFAULT_MAX_DEPTH + 2
_MAX_INT_DIGITS = 16  # 2**53 has 16 digits; anything longer is out of range anyway

# A string literal, its closing quote optional: a string left open runs to the
# end of the text, so every quote is tried once and the scan stays linear (a
# required closing quote made each quote of an open string rescan the rest:
# 60 KiB of escaped quotes took 11 s of CPU).
_STRING_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_ESCAPED_SURROGATE_RE = re.compile(r"\\u[dD][89a-fA-F]")
_ARRAY_INDEX_RE = re.compile(r"0|[1-9][0-9]*", re.ASCII)


class _Problem:
    """Placed where a rejected value stood, so the walk can name its pointer."""

    __slots__ = ("code", "message")

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message


class _DuplicateKeyObject(dict):
    """An object that repeated ``duplicate``; keeps the pairs in source order."""

    def __init__(self, pairs: list[tuple[str, Any]], duplicate: str) -> None:
        super().__init__(pairs)
        self.pairs = pairs
        self.duplicate = duplicate


def escape_pointer_token(token: str | int) -> str:
    """Escape one reference token per RFC 6901 (``~`` -> ``~0``, ``/`` -> ``~1``)."""
    text = str(token)
    if "~" in text or "/" in text:
        return text.replace("~", "~0").replace("/", "~1")
    return text


def json_pointer(parts) -> str:
    """Build an RFC 6901 pointer from a sequence of keys and indices."""
    return "".join(["/" + escape_pointer_token(p) for p in parts])


def resolve_pointer(document: Any, pointer: str) -> Any:
    """Return the value at ``pointer`` (RFC 6901); ``KeyError`` if absent."""
    if pointer == "":
        return document
    if not pointer.startswith("/"):
        raise KeyError(pointer)
    current = document
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(current, dict):
            if token not in current:
                raise KeyError(pointer)
            current = current[token]
        elif isinstance(current, list):
            if not _ARRAY_INDEX_RE.fullmatch(token):
                raise KeyError(pointer)
            index = int(token)
            if index >= len(current):
                raise KeyError(pointer)
            current = current[index]
        else:
            raise KeyError(pointer)
    return current


def _max_depth_exceeded(text: str, max_depth: int) -> bool:
    """True if brackets outside strings nest deeper than ``max_depth``.

    Runs before parsing so a depth bomb never reaches the recursive parser.
    """
    if text.count("[") + text.count("{") <= max_depth:
        return False
    skeleton = _STRING_RE.sub("", text)
    depth = 0
    for ch in skeleton:
        if ch == "[" or ch == "{":
            depth += 1
            if depth > max_depth:
                return True
        elif ch == "]" or ch == "}":
            depth -= 1
    return False


def float_literal_problem(literal: str, value: float) -> str | None:
    """Why a JSON number ``literal`` that parses to ``value`` is outside what
    a double holds, or None. Beyond the largest double it would read as
    infinity; a nonzero number below the smallest subnormal (``1e-400``)
    would read as zero, a different value silently put in its place. Mere
    rounding (``0.1``, ``3.14159265358979323846``) is not a problem."""
    if not math.isfinite(value):
        return f"number {literal[:40]} overflows a double"
    if value == 0.0 and not literal.split("e", 1)[0].split("E", 1)[0].strip("-+0.") == "":
        return f"number {literal[:40]} underflows a double (it would read as zero)"
    return None


def _parse(text: str, *, constants_are_json: bool = True) -> tuple[Any, bool]:
    """Parse with hooks that mark, never raise; returns (document, had_problem).

    With ``constants_are_json=False``, ``NaN`` and ``Infinity`` raise
    ``ValueError`` as the malformed JSON they are (RFC 8259 has no such
    literals) instead of being marked."""
    flagged = [False]

    def pairs_hook(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                flagged[0] = True
                return _DuplicateKeyObject(pairs, key)
            seen.add(key)
        return dict(pairs)

    def bad_constant(name):
        if not constants_are_json:
            raise ValueError(f"{name} is not JSON")
        flagged[0] = True
        return _Problem("JSON_NUMBER", f"{name} is not a JSON number")

    def parse_int(digits):
        if len(digits.lstrip("-")) > _MAX_INT_DIGITS:
            flagged[0] = True
            return _Problem("JSON_NUMBER", "integer outside +/-(2^53-1)")
        value = int(digits)
        if abs(value) > MAX_SAFE_INTEGER:
            flagged[0] = True
            return _Problem("JSON_NUMBER", "integer outside +/-(2^53-1)")
        return value

    def parse_float(literal):
        value = float(literal)
        problem = float_literal_problem(literal, value)
        if problem is not None:
            flagged[0] = True
            return _Problem("JSON_NUMBER", problem)
        return value

    document = json.loads(
        text,
        object_pairs_hook=pairs_hook,
        parse_constant=bad_constant,
        parse_int=parse_int,
        parse_float=parse_float,
    )
    return document, flagged[0]


def _find_problem(value: Any, parts: list, check_surrogates: bool):
    """Depth-first, in document order: the first problem and its pointer parts."""
    if isinstance(value, _Problem):
        return value.code, value.message, parts
    if isinstance(value, str):
        if check_surrogates:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return "JSON_ENCODING", "string holds a lone surrogate", parts
        return None
    if isinstance(value, dict):
        pairs = value.pairs if isinstance(value, _DuplicateKeyObject) else value.items()
        seen = set()
        for key, item in pairs:
            if check_surrogates:
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return "JSON_ENCODING", "key holds a lone surrogate", parts + [key.encode("utf-8", "backslashreplace").decode()]
            if key in seen:
                return "JSON_DUPLICATE_KEY", f"duplicate key {key!r}", parts + [key]
            seen.add(key)
            found = _find_problem(item, parts + [key], check_surrogates)
            if found:
                return found
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _find_problem(item, parts + [index], check_surrogates)
            if found:
                return found
    return None


#: Deepest nesting :func:`parse_json_text` parses: far below the interpreter's
#: recursion limit, so whether a text parses never depends on how deep the
#: caller's own stack is.
PARSE_MAX_DEPTH = 512


class TooDeepToParse(Exception):
    """JSON text nested deeper than :data:`PARSE_MAX_DEPTH`: neither known to be
    JSON nor known not to be."""


def parse_json_text(text: str) -> Any:
    """The value of any RFC 8259 JSON text, including what :func:`decode_strict`
    refuses beyond the grammar: a repeated key, a number outside what a double
    holds exactly, a lone surrogate and deep nesting stay in the value (as
    markers that :func:`strict_problem` finds; an object with a repeated key
    keeps its pairs, see :func:`repeated_keys`). For a reader that needs only
    part of a document, such as one field of a response, when the rest may
    hold anything valid.

    Raises ``ValueError`` when ``text`` is not JSON (``NaN`` and ``Infinity``
    included) and :class:`TooDeepToParse` when brackets outside strings nest
    deeper than :data:`PARSE_MAX_DEPTH`, which says nothing about whether it
    is JSON.
    """
    if _max_depth_exceeded(text, PARSE_MAX_DEPTH):
        raise TooDeepToParse(f"nesting deeper than {PARSE_MAX_DEPTH}")
    return _parse(text, constants_are_json=False)[0]


def _deeper_than(value: Any, max_depth: int) -> bool:
    # Iterative, so a deep value costs no recursion of its own.
    pending = [(value, 0)]
    while pending:
        current, depth = pending.pop()
        if isinstance(current, (dict, list)):
            if depth >= max_depth:
                return True
            items = current.values() if isinstance(current, dict) else current
            pending.extend((item, depth + 1) for item in items)
    return False


def strict_problem(value: Any, max_depth: int = DEFAULT_MAX_DEPTH) -> str | None:
    """Why :func:`decode_strict` would refuse a value :func:`parse_json_text`
    gave (``JSON_TOO_DEEP``, ``JSON_DUPLICATE_KEY``, ``JSON_NUMBER`` or
    ``JSON_ENCODING``), or None when it is strict JSON, whose canonical form
    :func:`canonical_bytes` gives."""
    if _deeper_than(value, max_depth):
        return "JSON_TOO_DEEP"
    found = _find_problem(value, [], True)
    return found[0] if found else None


def repeated_keys(value: Any) -> frozenset:
    """The keys an object from :func:`parse_json_text` holds more than once."""
    if not isinstance(value, _DuplicateKeyObject):
        return frozenset()
    seen: set = set()
    repeated = set()
    for key, _ in value.pairs:
        (repeated if key in seen else seen).add(key)
    return frozenset(repeated)


def decode_strict(
    data: bytes,
    *,
    max_bytes: int,
    max_depth: int = DEFAULT_MAX_DEPTH,
    path: str | None = None,
    error: type[VianoError] = CaseBuildError,
) -> Any:
    """Decode one JSON document or raise ``error`` with a stable code.

    Rejects, in this order: more than ``max_bytes`` (``LIMIT_EXCEEDED``); a
    BOM, NUL bytes (UTF-16/32) or invalid UTF-8 (``JSON_ENCODING``); nesting
    deeper than ``max_depth`` (``JSON_TOO_DEEP``); malformed JSON, raw control
    characters or trailing data (``JSON_SYNTAX``); then, reported at the first
    offending pointer in document order, duplicate keys
    (``JSON_DUPLICATE_KEY``), NaN/Infinity, floats that overflow or underflow
    to zero, integers beyond +/-(2^53-1) (``JSON_NUMBER``), and lone
    surrogates (``JSON_ENCODING``).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError("decode_strict takes bytes")
    if len(data) > max_bytes:
        raise error("LIMIT_EXCEEDED", f"document is {len(data)} bytes, limit {max_bytes}", path=path)
    data = bytes(data)
    if data.startswith(b"\xef\xbb\xbf") or data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise error("JSON_ENCODING", "byte order mark; documents must be plain UTF-8", path=path)
    if b"\x00" in data:
        raise error("JSON_ENCODING", "NUL byte; UTF-16/32 or binary data is not accepted", path=path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error("JSON_ENCODING", f"invalid UTF-8 at byte {exc.start}", path=path) from None
    if _max_depth_exceeded(text, max_depth):
        raise error("JSON_TOO_DEEP", f"nesting deeper than {max_depth}", path=path)
    try:
        document, flagged = _parse(text)
    except json.JSONDecodeError as exc:
        # json's messages for control characters already end in "at".
        message = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
        raise error("JSON_SYNTAX", f"{message} at line {exc.lineno} column {exc.colno}", path=path) from None
    except (ValueError, RecursionError) as exc:  # belt and braces: never a bare traceback
        raise error("JSON_SYNTAX", str(exc), path=path) from None
    check_surrogates = _ESCAPED_SURROGATE_RE.search(text) is not None
    if flagged or check_surrogates:
        found = _find_problem(document, [], check_surrogates)
        if found:
            code, message, parts = found
            raise error(code, message, path=path, pointer=json_pointer(parts))
    return document


def _normalise_numbers(value: Any) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("NaN/Infinity cannot be encoded canonically")
        if value.is_integer() and abs(value) <= MAX_SAFE_INTEGER:
            return int(value)
        return value
    if isinstance(value, dict):
        return {k: _normalise_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalise_numbers(v) for v in value]
    return value


_sorted_encoder = None


def encode_sorted(value: Any) -> bytes:
    """Compact, sorted keys, raw UTF-8: for values :func:`float_free` accepts,
    byte for byte ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``."""
    global _sorted_encoder
    if _sorted_encoder is None:
        import msgspec  # lazily: a no-op rebuild never encodes, and the import costs ~15 ms

        _sorted_encoder = msgspec.json.Encoder(order="sorted").encode
    return _sorted_encoder(value)


def float_free(value: Any) -> bool:
    """Whether ``value`` is JSON made of str-keyed objects, arrays, strings,
    integers, booleans and null only: there msgspec's sorted compact encoding
    is byte for byte the stdlib's (same string escapes, same code point key
    order; a property test holds them together). Floats differ in exponent
    spelling (``1e+16`` against ``1e16``), so they take the reference path."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                return False
            if type(item) is not str and not float_free(item):
                return False
        return True
    if kind is list or kind is tuple:
        for item in value:
            if type(item) is not str and not float_free(item):
                return False
        return True
    return False


def canonical_bytes(value: Any) -> bytes:
    """The canonical encoding used for every hash: sorted, compact, UTF-8."""
    if float_free(value):
        return encode_sorted(value)
    return json.dumps(
        _normalise_numbers(value),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def json_copy(value: Any) -> Any:
    """A deep copy of a JSON value (dicts, lists, scalars), several times faster
    than :func:`copy.deepcopy`, which tracks identity for cycles JSON cannot have.
    Tuples come back as lists, as JSON would give them."""
    kind = type(value)
    if kind is dict:
        return {key: item if type(item) is str else json_copy(item) for key, item in value.items()}
    if kind is list or kind is tuple:
        return [item if type(item) is str else json_copy(item) for item in value]
    return value


def canonical_hash(value: Any) -> str:
    """SHA-256 hex of :func:`canonical_bytes`."""
    return hashlib.sha256(canonical_bytes(value)).hexdigest()


# A build hashes each output it publishes where it is written to the cache,
# for the checkpoint artifact and where the package writer writes it: the
# same bytes object three times over. The last few large ones are remembered
# with their digest; holding them keeps the identity test meaningful.
_REMEMBERED_DIGESTS: list[tuple[bytes, str]] = []
_REMEMBER_FROM = 1024
_REMEMBER_COUNT = 4


def sha256_hex(data: bytes) -> str:
    """SHA-256 hex of ``data``; a large ``bytes`` object hashed moments ago
    (one of the last few) is not hashed again."""
    if type(data) is not bytes or len(data) < _REMEMBER_FROM:
        return hashlib.sha256(data).hexdigest()
    for held, digest in _REMEMBERED_DIGESTS:
        if held is data:
            return digest
    digest = hashlib.sha256(data).hexdigest()
    _REMEMBERED_DIGESTS.append((data, digest))
    del _REMEMBERED_DIGESTS[:-_REMEMBER_COUNT]
    return digest


def remember_digest(data: bytes, digest: str) -> None:
    """Let :func:`sha256_hex` answer ``digest`` for this very ``data`` object,
    whose digest the caller knows already."""
    if type(data) is bytes and len(data) >= _REMEMBER_FROM and all(held is not data for held, _ in _REMEMBERED_DIGESTS):
        _REMEMBERED_DIGESTS.append((data, digest))
        del _REMEMBERED_DIGESTS[:-_REMEMBER_COUNT]


class EncodedTooLarge(ValueError):
    """:func:`pretty_bytes` was given a ``limit`` and the document is longer:
    ``size`` is its exact length (what ``len`` of the bytes would have been)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the document would be {size} bytes, limit {limit}")
        self.size = size
        self.limit = limit


def pretty_bytes(value: Any, *, known_float_free: bool = False, limit: int | None = None) -> bytes:
    """Published-document form: sorted keys, two-space indent, trailing newline.

    Byte-identical to ``json.dumps(value, sort_keys=True, indent=2,
    ensure_ascii=False) + "\n"`` (a property test holds them together), but
    about ten times faster: the stdlib falls back to its pure-Python encoder
    whenever ``indent`` is set, so we encode compactly in C and let msgspec
    re-indent the result, which copies every scalar token verbatim.
    ``known_float_free=True`` is the caller's word that ``value`` is made as
    :func:`float_free` requires, which spares walking it again.

    With ``limit``, a document longer than ``limit`` bytes is
    :class:`EncodedTooLarge` (with its exact size) before the trailing
    newline is added: adding it copies the whole document, and a refused one
    can be hundreds of MB (deeply nested values indent quadratically). The
    compact encoding is let go before that copy too, so at most the
    formatted document and its copy are held, never the compact one as well.
    """
    import msgspec  # lazily: a no-op rebuild never formats, and the import costs ~15 ms

    if known_float_free or float_free(value):
        compact = encode_sorted(value)
    else:
        compact = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    formatted = msgspec.json.format(compact, indent=2)
    del compact
    if limit is not None and len(formatted) + 1 > limit:
        raise EncodedTooLarge(len(formatted) + 1, limit)
    return formatted + b"\n"


def read_bounded(
    path: str | os.PathLike,
    limit: int,
    *,
    label: str | None = None,
    error: type[VianoError] = CaseBuildError,
    dir_fd: int | None = None,
) -> bytes:
    """Read a whole file of at most ``limit`` bytes, refusing larger ones first.

    The size is checked from ``fstat`` before any byte is read, and the read
    itself stops at ``limit + 1`` bytes, so a file that grows meanwhile is
    still refused rather than loaded.
    """
    # O_NONBLOCK: a FIFO put in the file's place must not hold the open (and
    # the command) until some writer comes; only a regular file is read.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error("IO_ERROR", "not a regular file", path=label)
        size = st.st_size
        if size > limit:
            raise error("LIMIT_EXCEEDED", f"{size} bytes, limit {limit}", path=label)
        return read_fd_at_most(fd, limit, label=label, error=error)
    finally:
        os.close(fd)


def read_fd_at_most(
    fd: int, limit: int, *, label: str | None, error: type[VianoError] = CaseBuildError, code: str = "LIMIT_EXCEEDED"
) -> bytes:
    """Read ``fd`` to its end, at most ``limit`` bytes: more is ``code`` (the
    file grew, or lies about its size). Stops at ``limit + 1`` bytes."""
    chunks = []
    remaining = limit + 1
    while remaining > 0:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    data = b"".join(chunks)
    if len(data) > limit:
        raise error(code, f"more than {limit} bytes", path=label)
    return data

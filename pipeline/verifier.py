"""The independent, stateless task verifier (ARCHITECTURE.md section 9).

A verification request names a task response and a rubric; the verifier says
whether the response satisfies it, with a quality score and an evidence digest
anyone can recompute. Nothing is stored and nothing is called: the same request
bytes always give the same response bytes (:func:`verify_request`).

Modes
-----
``EXACT_TEXT``
    ``response_text`` and ``expected_text`` are equal after stripping leading
    and trailing whitespace (``str.strip``: Unicode whitespace).
``JSON_FIELD_EQUALS``
    ``response_text`` must be a JSON *object* (RFC 8259: ``NaN`` or a syntax
    error make it "not JSON"); ``field_path`` is a literal top-level key, or
    an RFC 6901 pointer when it starts with ``/`` (array indices are ASCII
    digits without leading zeros; ``-`` never resolves). When
    ``expected_text`` is JSON, the field matches if both have the same
    canonical form (so ``42``, ``42.0`` and `` 42 `` agree, and ``"42"`` does
    not equal ``42``); otherwise the field must be a JSON string equal to the
    stripped ``expected_text`` (the field's own value is compared as is, never
    trimmed). A response that is not a JSON object, or lacks the field, is
    UNSUPPORTED -- never an error.

    Canonical JSON has no form for some valid JSON: integers beyond
    +/-(2^53-1), numbers a double cannot hold (``1e400``, ``1e-400``), a
    repeated key, a lone surrogate, nesting over 64 levels. Such a field or
    ``expected_text`` never matches (it is not compared as text either, so
    the string ``"18446744073709551615"`` does not pass for that number),
    and a path through a repeated key does not resolve. The rest of the
    response may hold anything valid: only the field is compared. Text
    whose brackets nest deeper than 512 levels (``PARSE_MAX_DEPTH``) is
    taken as neither JSON nor text: such a response or ``expected_text``
    never matches, wherever the verifier runs (a bound left to the
    interpreter's recursion limit made the verdict depend on the caller's
    stack depth).

Quality is ``minimum_quality_millis`` when SUPPORTED and ``0`` otherwise. The
evidence is ``verification:`` + SHA-256 hex of the canonical JSON of the
object ``{verifier, case_id, evidence_artifact_ref, mode, field_path,
matched}``; canonical JSON frames every field, so no two distinct tuples can
share a preimage (unlike joining the fields with a separator).

Request rules (all answered with ``INVALID_VERIFICATION_REQUEST``, HTTP 400):
the body is at most 64 KiB, strict UTF-8 JSON (no duplicate keys, NaN,
BOM...), conforms to ``contracts/verification-request-v1.schema.json``: no
unknown fields at any level; ``case_id``, ``response_text``,
``evidence_artifact_ref`` and ``expected_text`` not blank (empty or whitespace
only); ``latency_micros`` an integer >= 0; ``minimum_quality_millis`` an
integer 0-1000; ``mode`` one of the two modes; ``field_path`` required and
non-blank for ``JSON_FIELD_EQUALS``, and ignored for ``EXACT_TEXT`` (as the
README and the schema say); a ``JSON_FIELD_EQUALS`` ``field_path`` starting
with ``/`` must be a syntactically valid pointer (``~`` only as ``~0``/``~1``).

Server choice
-------------
``serve`` runs the WSGI app under **waitress** (a pure-Python, dependency-free
production WSGI server) rather than the stdlib: ``wsgiref`` is single-threaded,
speaks HTTP/1.0 without keep-alive and hands chunked bodies to the app
undecoded, so a "bounded threaded stdlib server" would mean writing our own
HTTP/1.1 framing. waitress gives a fixed worker pool (``threads``), a
connection cap, idle-channel timeouts (slow clients cannot pin workers; a
per-request deadline of ours closes one that never goes idle),
header-size limits, chunked decoding, and its own body backstop
(:data:`SERVER_BODY_BACKSTOP`, 1 MiB: past it waitress answers 413 before the
app runs and never buffers more). Below that backstop the *app* enforces the
64 KiB contract itself while reading ``wsgi.input`` in 16 KiB chunks, stopping
at 64 KiB + 1 bytes, and answers 400 with the JSON error body -- the app does
not trust ``Content-Length`` to be honest or present, so it is equally safe
under any WSGI server that terminates ``wsgi.input``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import signal
import socket
import stat
import sys
import threading
from typing import Any, Callable, Iterable

import msgspec

from contracts.verifier_structs import (
    EXACT_TEXT,
    JSON_FIELD_EQUALS,
    SUPPORTED,
    UNSUPPORTED,
    VerificationRequest,
    VerificationResponse,
)

from .errors import VerificationError, VianoError, one_line
from .jsoncanon import (
    canonical_bytes,
    decode_strict,
    json_pointer,
    TooDeepToParse,
    parse_json_text,
    repeated_keys,
    sha256_hex,
    strict_problem,
)

__all__ = [
    "VERIFIER_IDENTITY",
    "MAX_REQUEST_BYTES",
    "SERVER_BODY_BACKSTOP",
    "VERIFY_PATH",
    "INVALID_MESSAGE",
    "parse_request",
    "evaluate",
    "verification_evidence",
    "verify_request",
    "read_body",
    "application",
    "check_file",
    "create_server",
    "serve",
    "main",
]

#: Identity folded into every evidence digest; bump when matching semantics change.
#: 2: a JSON field is read from any valid JSON response, and valid JSON without
#: a canonical form never matches (1 took such a response as not JSON, and
#: such an ``expected_text`` as text).
VERIFIER_IDENTITY = "viano-verifier/2"
#: The contract's request-body limit, enforced while reading.
MAX_REQUEST_BYTES = 64 * 1024
#: waitress's own limit (413 past it). Larger than the contract on purpose so
#: that every contract violation up to here gets the JSON 400 from the app.
SERVER_BODY_BACKSTOP = 1024 * 1024
VERIFY_PATH = "/v1/task-evaluations/verify"
INVALID_MESSAGE = "invalid task verification request"
_CODE = "INVALID_VERIFICATION_REQUEST"
_READ_CHUNK = 16 * 1024
_REQUEST_SCHEMA = "verification-request"
_POINTER_RE = re.compile(r"^(/([^~/]|~[01])*)+(?![\s\S])")
_ARRAY_INDEX_RE = re.compile(r"0|[1-9][0-9]*")  # fullmatch only


# --------------------------------------------------------------------------- parsing


def _validator():
    """The shared, retrieval-free Draft 2020-12 validator of the request contract.

    ``contracts`` counts only real JSON integers as ``integer``: ``1.0`` for
    ``latency_micros`` is refused, as msgspec would refuse it.
    """
    import contracts

    return contracts.validator(_REQUEST_SCHEMA)


def _invalid(detail: str, pointer: str | None = None) -> VerificationError:
    return VerificationError(_CODE, f"{INVALID_MESSAGE}: {detail}", pointer=pointer)


def _describe(error) -> str:
    """A fixed, schema-derived message: never echoes the (untrusted) instance value."""
    keyword = error.validator
    value = error.validator_value
    if keyword == "required":
        missing = [name for name in value if isinstance(error.instance, dict) and name not in error.instance]
        return "missing required field " + ", ".join(missing)
    if keyword == "additionalProperties":
        allowed = set(error.schema.get("properties", {}))
        extra = sorted(k for k in error.instance if k not in allowed) if isinstance(error.instance, dict) else []
        # Quoted as given: the detail is folded onto one line once, where it
        # is reported (escaping here as well showed every backslash thrice).
        return "unknown field " + ", ".join(f'"{k[:60]}"' for k in extra[:5])
    if keyword == "pattern":
        if value == r"\S":
            return "must not be blank"
        return "must be an RFC 6901 pointer (~ only as ~0 or ~1)"
    if keyword == "enum":
        return "must be one of " + ", ".join(value)
    if keyword == "type":
        return f"must be of type {value}"
    if keyword == "minimum":
        return f"must be >= {value}"
    if keyword == "maximum":
        return f"must be <= {value}"
    return f"violates {keyword}"


def _first_schema_error(document: Any):
    # Deterministic choice: the first pointer in sorted order, then keyword.
    return min(_validator().iter_errors(document), key=lambda e: (json_pointer(e.absolute_path), e.validator), default=None)


def _cross_field_problem(request: VerificationRequest) -> str | None:
    """The rules a Struct cannot state: field_path against mode, pointer syntax."""
    spec = request.verification
    if spec.mode == JSON_FIELD_EQUALS and not spec.field_path.strip():
        return "/verification/field_path must not be blank for JSON_FIELD_EQUALS"
    if spec.mode == JSON_FIELD_EQUALS and spec.field_path.startswith("/") and not _POINTER_RE.match(spec.field_path):
        return "/verification/field_path must be an RFC 6901 pointer"
    return None


def parse_request(body: bytes) -> VerificationRequest:
    """Decode and validate one request body, or raise ``INVALID_VERIFICATION_REQUEST``.

    Order: size, strict JSON (encoding, syntax, duplicate keys, numbers,
    depth), then the contract. The contract is checked on a fast path (the
    msgspec Struct plus :func:`_cross_field_problem`); only a document the
    fast path refuses goes through the JSON Schema, whose first error (by
    pointer, then keyword) names the field. Both paths take the same
    decisions -- ``tests/test_verifier.py`` holds the parity tests -- and if
    they ever disagreed on a refusal, the request is still refused.
    """
    if len(body) > MAX_REQUEST_BYTES:
        raise _invalid(f"body exceeds {MAX_REQUEST_BYTES} bytes")
    try:
        document = decode_strict(body, max_bytes=MAX_REQUEST_BYTES, max_depth=16, error=VerificationError)
    except VianoError as exc:
        raise _invalid(f"{exc.code} {exc.message}", exc.pointer) from None
    try:
        request = msgspec.convert(document, VerificationRequest)
    except msgspec.ValidationError as exc:
        request, problem = None, one_line(str(exc), 200)
    else:
        problem = _cross_field_problem(request)
    if request is not None and problem is None:
        return request
    error = _first_schema_error(document)
    if error is not None:
        pointer = json_pointer(error.absolute_path)
        raise _invalid(f"{pointer or '/'} {_describe(error)}", pointer)
    raise _invalid(problem)


# --------------------------------------------------------------------------- evaluation

_MISSING = object()
#: Valid JSON that has no canonical form, or too deep to parse at all.
_UNCOMPARABLE = object()
_NOT_JSON = object()


def _member(current: Any, token: str) -> Any:
    if token in repeated_keys(current):
        return _UNCOMPARABLE
    return current.get(token, _MISSING)


def _resolve(document: Any, pointer: str) -> Any:
    """RFC 6901 resolution; ``_MISSING`` when any step does not exist."""
    current = document
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(current, dict):
            current = _member(current, token)
            if current is _MISSING or current is _UNCOMPARABLE:
                return current
        elif isinstance(current, list):
            if not _ARRAY_INDEX_RE.fullmatch(token) or int(token) >= len(current):
                return _MISSING
            current = current[int(token)]
        else:
            return _MISSING
    return current


def _parse_json(text: str) -> tuple[Any, bool]:
    """``(value, strict)``: the value of JSON text, and whether all of it is
    strict JSON; the value is ``_NOT_JSON`` or ``_UNCOMPARABLE`` where no
    value can be had. Strict decoding first: it is the common case, and a
    value it gives needs no check of its parts."""
    try:
        return decode_strict(text.encode("utf-8"), max_bytes=MAX_REQUEST_BYTES, error=VerificationError), True
    except VianoError:
        pass
    try:
        try:
            return parse_json_text(text), False
        except RecursionError:
            # Within PARSE_MAX_DEPTH, but the caller's own stack was deep:
            # parsed again on a fresh one, so the verdict never depends on it.
            return _on_a_fresh_stack(parse_json_text, text), False
    except ValueError:
        return _NOT_JSON, False
    except (TooDeepToParse, RecursionError):
        return _UNCOMPARABLE, False


def _on_a_fresh_stack(function: Callable[[str], Any], text: str) -> Any:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function(text)
        except BaseException as error:  # handed back to the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=run, name="verifier-parse")
    worker.start()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _matches(request: VerificationRequest) -> bool:
    spec = request.verification
    if spec.mode == EXACT_TEXT:
        return request.response_text.strip() == spec.expected_text.strip()
    document, strict = _parse_json(request.response_text)
    if not isinstance(document, dict):
        return False
    if spec.field_path.startswith("/"):
        value = _resolve(document, spec.field_path)
    else:
        value = _member(document, spec.field_path)
    if value is _MISSING:
        return False
    expected, expected_strict = _parse_json(spec.expected_text)
    if expected is _NOT_JSON:
        return isinstance(value, str) and value == spec.expected_text.strip()
    # Valid JSON that strict decoding refuses has no canonical form: an
    # expected_text wholly, a response in the field compared.
    if not expected_strict or value is _UNCOMPARABLE or (not strict and strict_problem(value) is not None):
        return False
    return canonical_bytes(value) == canonical_bytes(expected)


def verification_evidence(request: VerificationRequest, matched: bool) -> str:
    """``verification:<sha256>`` over the canonical JSON of the covered fields."""
    spec = request.verification
    covered = {
        "verifier": VERIFIER_IDENTITY,
        "case_id": request.case_id,
        "evidence_artifact_ref": request.evidence_artifact_ref,
        "mode": spec.mode,
        "field_path": spec.field_path,
        "matched": matched,
    }
    return "verification:" + sha256_hex(canonical_bytes(covered))


def evaluate(request: VerificationRequest) -> VerificationResponse:
    """Pure: the verdict for a validated request."""
    matched = _matches(request)
    return VerificationResponse(
        result=SUPPORTED if matched else UNSUPPORTED,
        quality_score_millis=request.verification.minimum_quality_millis if matched else 0,
        evidence=verification_evidence(request, matched),
    )


def _response_bytes(response: VerificationResponse) -> bytes:
    return canonical_bytes(msgspec.to_builtins(response))


def verify_request(body: bytes) -> bytes:
    """Request bytes in, canonical response bytes out; raises ``INVALID_VERIFICATION_REQUEST``."""
    return _response_bytes(evaluate(parse_request(body)))


def _error_body(exc: VianoError) -> bytes:
    return canonical_bytes({"error": INVALID_MESSAGE, "code": exc.code, "detail": one_line(exc.message)})


# --------------------------------------------------------------------------- WSGI

_JSON_HEADERS = [("Content-Type", "application/json"), ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff")]


def read_body(environ: dict, limit: int = MAX_REQUEST_BYTES) -> bytes | None:
    """Read the request body, never more than ``limit + 1`` bytes; ``None`` if over ``limit``.

    An honest ``Content-Length`` over the limit is refused without reading.
    A present ``Content-Length`` bounds the read (PEP 3333: never read past
    it), so a lying, smaller one just truncates the body (which then fails to
    parse); without one the stream is read to EOF only when the server marks
    it terminated (``wsgi.input_terminated``, e.g. a dechunked body), in
    ``_READ_CHUNK`` pieces, stopping at ``limit + 1``.
    """
    stream = environ["wsgi.input"]
    declared = (environ.get("CONTENT_LENGTH") or "").strip()
    if declared:
        if not declared.isascii() or not declared.isdigit():
            raise _invalid("malformed Content-Length")
        wanted = int(declared)
        if wanted > limit:
            return None
    elif environ.get("wsgi.input_terminated"):
        wanted = limit + 1
    else:
        return b""
    chunks = []
    received = 0
    while received < wanted:
        chunk = stream.read(min(_READ_CHUNK, wanted - received))
        if not chunk:
            break
        chunks.append(chunk)
        received += len(chunk)
    if received > limit:
        return None
    return b"".join(chunks)


def _reply(start_response: Callable, status: str, body: bytes, extra: Iterable[tuple[str, str]] = (), *, head: bool = False) -> list[bytes]:
    start_response(status, _JSON_HEADERS + [("Content-Length", str(len(body)))] + list(extra))
    # A HEAD response has the headers of the body but never the body: bytes
    # sent after it would be read as the start of the next response.
    return [] if head else [body]


def application(environ: dict, start_response: Callable) -> list[bytes]:
    """The WSGI app: ``POST /v1/task-evaluations/verify`` and nothing else."""
    head = environ.get("REQUEST_METHOD") == "HEAD"
    if environ.get("PATH_INFO", "") != VERIFY_PATH:
        return _reply(start_response, "404 Not Found", canonical_bytes({"error": "not found"}), head=head)
    if environ.get("REQUEST_METHOD") != "POST":
        return _reply(
            start_response,
            "405 Method Not Allowed",
            canonical_bytes({"error": "method not allowed"}),
            [("Allow", "POST")],
            head=head,
        )
    try:
        body = read_body(environ)
        if body is None:
            raise _invalid(f"body exceeds {MAX_REQUEST_BYTES} bytes")
        return _reply(start_response, "200 OK", verify_request(body))
    except VerificationError as exc:
        return _reply(start_response, "400 Bad Request", _error_body(exc))


# --------------------------------------------------------------------------- command line


def check_file(path: str) -> tuple[str, str, int]:
    """Verify one request file offline: ``(stdout, stderr, exit_code)``.

    Exit 0 when SUPPORTED, 1 when UNSUPPORTED, 2 when the request is invalid
    or unreadable (one ``CODE: message`` line on stderr). ``-`` reads stdin.
    """
    try:
        if path == "-":
            if sys.stdin is None:  # started with standard input closed
                return "", "INVALID_ARGUMENT: there is no standard input to read the request from\n", 2
            data = sys.stdin.buffer.read(MAX_REQUEST_BYTES + 1)
        else:
            # Non-blocking, so that opening a FIFO cannot wait for a writer;
            # anything but a regular file (a FIFO, a device) is refused.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with open(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return "", f"INVALID_ARGUMENT: the request is not a regular file ({one_line(path)})\n", 2
                data = handle.read(MAX_REQUEST_BYTES + 1)
    except OSError as exc:
        return "", f"INVALID_ARGUMENT: cannot read the request: {exc.strerror} ({one_line(path)})\n", 2
    try:
        response = evaluate(parse_request(data))
    except VerificationError as exc:
        return "", f"{exc}\n", 2
    return _response_bytes(response).decode("utf-8") + "\n", "", 0 if response.result == SUPPORTED else 1


MAX_THREADS = 64
"""Upper bound of ``--threads`` (the server accepts at most 64 connections anyway)."""
MAX_PORT = 65535


def _bad_argument(message: str) -> VerificationError:
    return VerificationError("INVALID_ARGUMENT", message)


def _check_listen_arguments(host: object, port: object, threads: object) -> None:
    """Refuse what waitress would reject with a traceback or silently reinterpret.

    waitress hands the port to ``getaddrinfo``, which wraps it modulo 65536
    (``99999`` would listen on 34463), so the range is checked here.
    """
    if not isinstance(host, str) or not host.strip():
        raise _bad_argument("--host must be a non-blank host name or address")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise _bad_argument(f"--port {one_line(str(port), 40)} is outside 0-{MAX_PORT} (0 picks a free port)")
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise _bad_argument(f"--threads {one_line(str(threads), 40)} is outside 1-{MAX_THREADS}")


REQUEST_DEADLINE = 30
"""Seconds a request may take to arrive, from its first byte to its last."""
MAX_REQUEST_DEADLINE = 3600


def create_server(host: str = "127.0.0.1", port: int = 0, *, threads: int = 4, request_deadline: int = REQUEST_DEADLINE):
    """A bound (not yet running) waitress server for :func:`application`.

    Bounds: ``threads`` workers, 64 connections, 16 KiB of headers, bodies
    below :data:`SERVER_BODY_BACKSTOP` kept in memory (at most 64 x 1 MiB),
    idle connections closed after 30 s, and a connection whose request has
    not arrived whole ``request_deadline`` seconds after its first byte
    closed (checked every second).

    Errors (:class:`VerificationError`): ``INVALID_ARGUMENT`` for a blank or
    unresolvable host (``256.1.1.1``), a port outside 0-65535, threads
    outside 1-:data:`MAX_THREADS` or a deadline outside
    1-:data:`MAX_REQUEST_DEADLINE`; ``IO_ERROR`` when the address cannot be
    bound (in use, not local, not permitted).
    """
    from waitress.server import create_server as _create

    _check_listen_arguments(host, port, threads)
    if isinstance(request_deadline, bool) or not isinstance(request_deadline, int) or not 1 <= request_deadline <= MAX_REQUEST_DEADLINE:
        raise _bad_argument(f"--request-deadline {one_line(str(request_deadline), 40)} is outside 1-{MAX_REQUEST_DEADLINE}")
    try:
        server = _create_waitress(_create, host, port, threads)
        _bound_request_time(server, request_deadline)
        return server
    except (ValueError, socket.gaierror):  # waitress: "Invalid host/port specified." (UnicodeError included)
        raise _bad_argument(f"--host {one_line(host, 100)} is not a valid host name or address") from None
    except OSError as exc:
        shown = f"[{host}]" if ":" in host else host
        reason = exc.strerror or str(exc)
        raise VerificationError("IO_ERROR", f"cannot listen on {one_line(shown, 100)}:{port}: {reason}") from None


def _create_waitress(_create, host: str, port: int, threads: int):
    return _create(
        application,
        host=host,
        port=port,
        threads=threads,
        connection_limit=64,
        channel_timeout=30,
        # waitress looks for idle connections every cleanup_interval (30 s by
        # default), so one idle for 30 s lasted up to 60 s.
        cleanup_interval=1,
        max_request_header_size=16 * 1024,
        max_request_body_size=SERVER_BODY_BACKSTOP,
        inbuf_overflow=SERVER_BODY_BACKSTOP + 1,
        clear_untrusted_proxy_headers=True,
        expose_tracebacks=False,
        ident="viano-verifier",
    )


def _bound_request_time(server, deadline: int) -> None:
    """Give every listening socket of ``server`` channels with a request deadline.

    waitress closes a connection only once it has been idle for
    ``channel_timeout``: a client that sends a byte now and then is never
    idle, and 64 of them would keep everyone else out for as long as they
    liked. A request must now arrive whole within ``deadline`` seconds of its
    first byte. (``create_server`` returns one server per address the host
    resolves to, or a holder of several.)
    """
    from waitress.server import BaseWSGIServer

    servers = [server] if isinstance(server, BaseWSGIServer) else [
        each for each in server.map.values() if isinstance(each, BaseWSGIServer)
    ]
    channel_class = _deadline_channel_class(deadline)
    for each in servers:
        each.channel_class = channel_class


def _deadline_channel_class(deadline: int):
    import time

    from waitress.channel import HTTPChannel

    class DeadlineChannel(HTTPChannel):
        # Both run on waitress's event-loop thread, which calls readable() on
        # every pass (at least once a second): no lock is needed.
        _arriving = None
        _arriving_since = 0.0

        def received(self, data):
            result = super().received(data)
            if self.request is not None and self.request is not self._arriving:
                self._arriving, self._arriving_since = self.request, time.monotonic()
            return result

        def readable(self):
            if (
                self.request is not None
                and self.request is self._arriving
                and not self.requests  # as waitress's idle check: never under a running task
                and time.monotonic() - self._arriving_since > deadline
            ):
                self.will_close = True  # writable() now says so, and handle_write closes it
                return False
            return super().readable()

    return DeadlineChannel


def listening_lines(server) -> list[str]:
    """``verifier listening on http://H:P``, once for each address listened on.

    A host name with several addresses (``localhost`` is often both
    ``127.0.0.1`` and ``::1``) gets a socket for each, and waitress returns a
    holder of them that has no single ``effective_host``.
    """
    addresses = getattr(server, "effective_listen", None) or [(server.effective_host, server.effective_port)]
    lines = []
    for host, port in addresses:
        shown = f"[{host}]" if ":" in str(host) else host
        lines.append(f"verifier listening on http://{shown}:{port}")
    return lines


def _stop(signum, frame):  # pragma: no cover - exercised through a subprocess
    raise SystemExit(0)


def serve(host: str, port: int, *, threads: int = 4, request_deadline: int = REQUEST_DEADLINE) -> int:
    """Serve until SIGTERM/SIGINT; prints ``verifier listening on http://H:P`` once bound."""
    server = create_server(host, port, threads=threads, request_deadline=request_deadline)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    for line in listening_lines(server):
        print(line, file=sys.stderr, flush=True)
    try:
        server.run()  # returns after SystemExit/KeyboardInterrupt, worker pool shut down
    finally:
        server.close()
    print("verifier stopped", file=sys.stderr, flush=True)
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors as one ``INVALID_ARGUMENT: ...`` line on stderr, exit 2 (like every other refusal)."""

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"INVALID_ARGUMENT: {one_line(message)} (see --help)\n")
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """``serve`` or ``check``; a refused argument is one ``CODE: message`` line on stderr and exit 2."""
    parser = _Parser(prog="python -m pipeline.verifier", description="Stateless task verifier.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="serve POST /v1/task-evaluations/verify over HTTP")
    serve_cmd.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    serve_cmd.add_argument("--port", type=int, default=8080, help="default 8080; 0 picks a free port")
    serve_cmd.add_argument("--threads", type=int, default=4, help="worker threads, 1-64 (default 4)")
    serve_cmd.add_argument(
        "--request-deadline", type=int, default=REQUEST_DEADLINE, metavar="SECONDS",
        help=f"a request must arrive whole this many seconds after its first byte, 1-{MAX_REQUEST_DEADLINE} (default {REQUEST_DEADLINE})",
    )
    check_cmd = commands.add_parser("check", help="verify one request file offline (exit 0/1/2)")
    check_cmd.add_argument("file", help="request JSON file, or - for stdin")
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            return serve(args.host, args.port, threads=args.threads, request_deadline=args.request_deadline)
        except VianoError as exc:
            sys.stderr.write(f"{exc}\n")
            return 2
    out, err, code = check_file(args.file)
    try:
        if sys.stdout is None:  # started with standard output closed
            raise OSError(errno.EBADF, "standard output is closed")
        sys.stdout.write(out)
        sys.stdout.flush()
    except OSError as exc:
        # The verdict never reached its reader (a full disk, a closed pipe):
        # neither 0 nor 1 may be claimed for it.
        err, code = f"IO_ERROR: cannot write the result: {exc.strerror or exc}\n", 2
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the flush at exit fails no more
            os.close(devnull)
    if sys.stderr is not None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(err)
            sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())

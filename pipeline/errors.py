"""One error type with stable codes (ARCHITECTURE.md section 11).

Every failure the project reports is a :class:`VianoError` (or a subclass used
only for ``except`` clauses) carrying an upper-case ``code`` from
:data:`ERROR_CODES`, the offending content ``path`` and JSON ``pointer`` where
known, and a one-line message. Codes are part of the public contract: tools
and tests match on them, so a code is never renamed or reused.
"""

from __future__ import annotations

import functools

__all__ = [
    "ERROR_CODES",
    "VianoError",
    "AdmissionError",
    "CaseBuildError",
    "IntegrityError",
    "LifecycleError",
    "ResearchError",
    "VerificationError",
    "one_line",
]

#: code -> one-line meaning. The README's error table says exactly this (a test holds them equal).
ERROR_CODES: dict[str, str] = {
    # command line and workspace
    "INVALID_ARGUMENT": "a command variable is missing, empty, unknown, repeated or malformed, an export destination lies in the workspace, the workspace is not a directory, a source directory holds the workspace, or a doit option the builder sets (`--backend`, `--db-file`, `--check_file_uptodate`) or process workers (`-n N` without `-P thread`) are given; in the Python API, an argument of the wrong kind or value, or a `CheckpointStore` used by another thread than the one that made it",
    "UNSAFE_ID": "a case or package id does not match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
    "UNKNOWN_CASE": "no such case in the workspace",
    "CASE_EXISTS": "a case with this id was already admitted",
    "SOURCE_NOT_FOUND": "the source path does not exist",
    "SOURCE_SPECIAL_FILE": "the source, or a file of a directory source, is a symlink, device, FIFO or socket",
    "SOURCE_CHANGED": "a file of a directory source changed (size or modification time) while it was admitted or appended",
    "INSUFFICIENT_DISK": "not enough free disk space for the admission",
    "IO_ERROR": "an operating-system I/O operation (write, fsync, link) failed, or a store or case lock this user may not write is refused before anything is written",
    "INTERRUPTED": "the command was stopped (Ctrl-C); nothing is left half-written, and the next command takes in what it had published",
    "OUT_OF_MEMORY": "the command ran out of memory (a memory cap such as ulimit -v or a container's limit); what it had published stands, nothing is left half-written, and the same command can be run again with more memory",
    "UNSUPPORTED_ENVIRONMENT": "Python's file-system encoding is not UTF-8 (a non-UTF-8 locale, or PYTHONUTF8=0 under the C locale): file names could not be kept as packages name them; or other packages named pipeline or contracts shadow the builder's (said by the dodo file, exit status 3)",
    # archive admission (RELIABILITY.md 1-17)
    "ZIP_INVALID": "not a ZIP archive, truncated, junk around it, or headers that disagree",
    "ZIP_UNSAFE_PATH": "an entry name is absolute, climbs out, is flagged UTF-8 but is not (a name without the flag is read as code page 437, as the ZIP format defines), holds backslashes, drive letters, NUL, control or bidi characters, characters Unicode 14.0 does not assign, or empty/. parts, or is too deep or long",
    "ZIP_DUPLICATE_NAME": "two entries share a name",
    "ZIP_NAME_COLLISION": "two entry names are equal after Unicode NFC and case folding, or a name is both a file and a directory",
    "ZIP_SPECIAL_FILE": "an entry is a symlink, FIFO or device",
    "ZIP_ENCRYPTED": "an entry is encrypted",
    "ZIP_UNSUPPORTED_METHOD": "an entry uses a compression method other than stored or deflate",
    "ZIP_OVERLAP": "entries overlap inside the archive (a non-recursive bomb)",
    "ZIP_TOO_LARGE": "an entry or the total exceeds the uncompressed size limit",
    "ZIP_RATIO": "an entry's compression ratio exceeds the limit",
    "ZIP_TOO_MANY_ENTRIES": "the archive holds more entries than allowed",
    "ZIP_CRC_MISMATCH": "an entry's content does not match its CRC-32",
    "RESERVED_PATH": "a package or append source holds content under a reserved prefix (case/, inputs/), or an append source holds a manifest.json",
    "SOURCE_UNSAFE_NAME": "a directory-source file name is not UTF-8 or holds control, bidi or NUL characters, characters Unicode 14.0 does not assign, empty/./.. parts, or is too long or deep",
    "SOURCE_NAME_COLLISION": "two directory-source names, or an appended name and one already in the package, are equal after Unicode NFC and case folding, or a name is both file and directory",
    "INDEX_MISSING": "an append source has no case-inputs.json at its root",
    # manifests and packages
    "MANIFEST_MISSING": "the package has no manifest.json",
    "MANIFEST_INVALID": "the manifest does not conform to viano-package v1",
    "MANIFEST_FILE_MISSING": "the manifest names a file the package does not hold",
    "GENERATION_CONFLICT": "another writer published this package generation first",
    "CONTENT_CONFLICT": "a content path already exists with different bytes",
    "INTEGRITY_ERROR": "stored bytes do not match the manifest, a stored record is corrupt, the checkpoint store recorded another copy of the package (a store from another workspace), or it is missing, empty or without its tables beside admitted cases",
    # strict JSON (RELIABILITY.md 18-26)
    "JSON_ENCODING": "not UTF-8 (BOM, UTF-16, invalid bytes or lone surrogates)",
    "JSON_SYNTAX": "malformed JSON, raw control characters or trailing data",
    "JSON_DUPLICATE_KEY": "an object repeats a key",
    "JSON_NUMBER": "NaN, Infinity, or a number outside the interoperable range: an integer beyond ±(2^53-1), a float that overflows a double (`1e400`) or a nonzero one that would read as zero (`1e-400`)",
    "JSON_TOO_DEEP": "nesting deeper than the depth limit",
    "LIMIT_EXCEEDED": "a size or count limit was exceeded: checked from sizes before parsing, and for the case and summary a build makes, while or once they are made",
    "SCHEMA_VIOLATION": "the document does not conform to its contract",
    "UNSUPPORTED_VERSION": "an unknown format or format_version",
    "CONTRACT_INVALID": "a bundled contract refers to a schema that is not bundled (nothing is ever fetched)",
    # references inside a package (RELIABILITY.md 27-29)
    "REFERENCE_UNSAFE": "a reference is absolute, climbs out, is empty, or crosses a symlink, or, in an append's index, names a file the builder writes (`case/revisions/…`, `inputs/N/reopen.json`; in an admitted package's index such a path, which the package cannot hold, is `REFERENCE_MISSING`); or a directory of the workspace is a symlink (an empty string where a report, reproduction or index holds a reference fails its contract first: `SCHEMA_VIOLATION`)",
    "REFERENCE_MISSING": "a reference names a file absent from the manifest",
    "DUPLICATE_SOURCE": "the same source is listed twice, within one index role or in two roles",
    # lifecycle (section 4)
    "ILLEGAL_TRANSITION": "the case's state does not allow this step",
    "STALE_GENERATION": "the case moved to another generation since the work was prepared",
    "LOCK_TIMEOUT": "the case lock was not acquired before the deadline, or another process holds the build's dependency file, or another export held the destination for 30 s",
    "REOPEN_REQUIRED": "the current revision has a confirmed case; reopen to change inputs",
    "NOT_BUILT": "the case has no built case document yet; or a build step or the build task was run alone (`doit -s ...`) before the steps it needs ran or finished",
    "INCOMPATIBLE_CASE": "a prior case document has an unsupported contract",
    # research (section 7)
    "RESEARCH_UNAVAILABLE": "reserved for the research provider (ARCHITECTURE section 7, not built yet): timed out, unreachable or no answer yet",
    "RESEARCH_INVALID": "the research result is malformed or does not match the request",
    # verifier and probes (section 9)
    "INVALID_VERIFICATION_REQUEST": "invalid task verification request",
    "INVALID_UNRESOLVED_EVIDENCE": "unresolved evidence has a blank or missing field",
}


@functools.lru_cache(maxsize=4096)  # a message repeats few distinct characters
def _printable_beyond_ascii(ch: str) -> bool:
    # By Unicode 14.0 on every Python, so a message is the same everywhere
    # (imported here: most messages are ASCII, and every process imports this module).
    from .unicode14 import is_printable

    return is_printable(ch)


def one_line(text: str, limit: int = 300) -> str:
    """Fold ``text`` onto one printable line of at most ``limit`` characters.

    Untrusted text (names from archives, report strings) may reach messages;
    control characters are shown as escapes so a message can never forge a
    second line of output or drive a terminal.
    """
    out = []
    length = 0
    for ch in text:
        if ch == "\\":
            piece = "\\\\"
        elif " " <= ch < "\x7f" or ch > "\x7f" and _printable_beyond_ascii(ch):
            piece = ch
        elif "\udc80" <= ch <= "\udcff":
            # A byte that is not UTF-8, as a file name carries it (surrogateescape): shown as the byte.
            piece = f"\\x{ord(ch) - 0xDC00:02x}"
        else:
            piece = ch.encode("unicode_escape").decode("ascii")
        out.append(piece)
        length += len(piece)
        if length > limit:
            # It will be cut: the rest is not looked at (a name of thousands
            # of characters, once per status row, took seconds).
            break
    if length <= limit:
        return "".join(out)
    # Cut between escapes, never inside one (a cut "\\x..." would read as another escape).
    kept, length = [], 0
    for piece in out:
        if length + len(piece) > limit - 3:
            break
        kept.append(piece)
        length += len(piece)
    return "".join(kept) + "..."


def coded_io_error(error: OSError, kind: type["VianoError"] | None = None) -> "VianoError":
    """An environment failure (disk full, permissions, a path that is not a
    directory) that no step named more precisely: ``IO_ERROR``, naming the file."""
    where = str(error.filename) if error.filename else None
    return (kind or VianoError)("IO_ERROR", error.strerror or str(error), path=where)


class VianoError(Exception):
    """Base of every project error: a stable ``code`` plus where it happened."""

    def __init__(self, code: str, message: str, *, path: str | None = None, pointer: str | None = None) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unregistered error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.path = path
        self.pointer = pointer

    def __str__(self) -> str:
        text = f"{self.code}: {one_line(self.message)}"
        if self.path is not None or self.pointer is not None:
            where = one_line(self.path or "")
            if self.pointer is not None:
                where += "#" + one_line(self.pointer)
            text += f" ({where})"
        return text

    def __reduce__(self):
        # Exception pickles as type(self)(*self.args), and args holds the
        # message alone: a coded error failing a build in a host's process
        # pool could not be sent back (the pool's result thread died).
        return (type(self), (self.code, self.message), dict(self.__dict__))

    def to_dict(self) -> dict:
        """A JSON-ready description, used by status output and tests."""
        return {"code": self.code, "message": self.message, "path": self.path, "pointer": self.pointer}


class AdmissionError(VianoError):
    """Raised while admitting or appending a package source."""


class CaseBuildError(VianoError):
    """Raised while reading inputs, assembling, rendering or publishing a case."""


class IntegrityError(VianoError):
    """Stored bytes disagree with what was recorded for them."""


class LifecycleError(VianoError):
    """Raised by the CheckpointStore and the case lock."""


class ResearchError(VianoError):
    """Raised by the research service and its providers."""


class VerificationError(VianoError):
    """Raised by the verifier and the probe builder."""

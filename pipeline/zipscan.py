"""ZIP inspection and verified streaming, without trusting :mod:`zipfile`.

CPython's ``zipfile`` (3.11.7 here) defends little: it renames ``../x`` to
``x`` on extraction, cuts names at NUL, keeps the last of duplicate names,
extracts symlinks as regular files and does not notice overlapping entries
(RELIABILITY.md 1-17). This module therefore parses the archive itself:

1. the end-of-central-directory record (and its ZIP64 form) is located at the
   exact end of the file; trailing data, a junk prefix, multi-disk archives and
   anything that is not a ZIP are ``ZIP_INVALID``; the entry count is checked
   against :attr:`ZipLimits.max_entries` *before* the directory is read;
2. every central-directory record is parsed, and its local header read; the
   byte span of each entry (local header + data + data descriptor) is computed
   and the spans must tile the bytes before the central directory exactly:
   overlap is ``ZIP_OVERLAP``, a gap or prefix is ``ZIP_INVALID``; local and
   central headers must agree on name, method, flags, CRC and sizes;
3. names are checked (:func:`name_problem`, :class:`NameRegistry`), then entry
   types, encryption, methods, declared sizes and compression ratios;
4. :func:`iter_entry` streams one entry, counting inflated bytes (declared
   sizes can lie) and verifying the CRC-32 and the exact length at the end.

Nothing is ever extracted by this module; the caller writes the chunks.
A ZIP inside the archive is just bytes.
"""

from __future__ import annotations

import functools
import os
import re
import stat
import struct
import unicodedata
import zlib
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from . import unicode14
from .errors import AdmissionError

__all__ = [
    "KiB",
    "MiB",
    "GiB",
    "ZipLimits",
    "ZipEntry",
    "ZipArchive",
    "MAX_NAME_DEPTH",
    "MAX_PART_BYTES",
    "MAX_NAME_BYTES",
    "name_problem",
    "fold_name",
    "NameRegistry",
]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

MAX_NAME_DEPTH = 16
"""More path parts than this is refused: no real package nests that deep, and
deep trees are a cheap way to exhaust path-length limits on other systems."""

MAX_PART_BYTES = 255
"""One path part longer than this (in UTF-8 bytes) cannot be created on ext4,
APFS or NTFS; refusing it at listing time beats failing half-way through."""

MAX_NAME_BYTES = 4096
"""PATH_MAX; also what :func:`pipeline.workspace.check_reference` accepts."""

CHUNK = 1 * MiB


#: Below this many bytes declared in all, a ZIP's entries are not held to the
#: ratio together: a sparse image under 1 MiB beside a note expands ~800:1 and
#: is harmless; what the aggregate check stops is disk taken by the GiB.
AGGREGATE_RATIO_MIN_BYTES = 64 * MiB


@dataclass(frozen=True, kw_only=True)
class ZipLimits:
    """Admission policy for package and append sources (ARCHITECTURE.md section 10).

    These are operational limits, not format rules; changing one never rewrites
    an admitted package. All sizes are uncompressed bytes.
    """

    max_entries: int = 4096
    """Entries per archive (or files per directory source). Real packages hold
    tens of files; 4096 leaves room for source excerpts while bounding the
    central directory we parse and the files we create."""

    max_entry_bytes: int = 4 * GiB
    """One file. Runtime logs and database dumps are legitimately large, and
    they are streamed and hashed in 1 MiB chunks, never loaded, so the cap
    guards disk, not memory."""

    max_total_bytes: int = 16 * GiB
    """All files together: four maximal dumps; bounds the disk an admission
    can take before the free-disk check even runs."""

    max_ratio: int = 200
    """Uncompressed:compressed ratio allowed for entries larger than
    :attr:`ratio_min_bytes`. Text logs compress 5-20:1, sparse dumps rarely
    beyond 100:1; deflate tops out near 1032:1, so 200:1 catches bombs with
    margin (Apache POI uses 100:1 above ~100 KB)."""

    ratio_min_bytes: int = 1 * MiB
    """Small entries are exempt from the ratio: a 1 KB file of zeros is
    harmless whatever its ratio. Not so many of them: the entries together
    are held to :attr:`max_ratio` too, once they declare more than
    :data:`AGGREGATE_RATIO_MIN_BYTES` (or this, if larger) in all (4,096
    entries of exactly 1 MiB of zeros, a ~4.7 MB archive, would otherwise
    take 4 GiB of disk)."""

    manifest_bytes: int = 1 * MiB
    """``manifest.json`` (and an append source's ``case-inputs.json``), like
    every structured document of seed 001."""

    check_free_disk: bool = True
    """Before extracting, require the total uncompressed size plus
    :attr:`free_disk_reserve` to be available on the workspace's filesystem,
    so a large admission fails up front instead of filling the disk."""

    free_disk_reserve: int = 256 * MiB
    """Headroom left free after an admission (SQLite, manifests, other work)."""


# --------------------------------------------------------------------- names

_DRIVE_RE = re.compile(r"^[A-Za-z]:")
_FORBIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_REFUSED_IN_NAMES = _FORBIDDEN_CATEGORIES | {"Cn"}  # unassigned in Unicode 14.0: later ones made some Cf
_ASCII_CONTROL_RE = re.compile("[\x00-\x1f\x7f]")


@functools.lru_cache(maxsize=1 << 16)
def _refused_in_names(ch: str) -> bool:
    return unicode14.category(ch) in _REFUSED_IN_NAMES


def name_problem(name: str) -> str | None:
    """Why ``name`` (a ``/``-separated relative path) is unsafe, or ``None``.

    Refused: empty; NUL; backslash; absolute (``/x``, ``//host/x``); a drive
    (``C:/x``, ``C:x``); an empty, ``.`` or ``..`` part; control, format (bidi,
    zero-width), surrogate or line/paragraph-separator characters, and
    characters Unicode 14.0 does not assign (later versions made some of them
    format characters; :mod:`pipeline.unicode14`); a part over
    :data:`MAX_PART_BYTES` UTF-8 bytes; more than :data:`MAX_NAME_DEPTH` parts
    or :data:`MAX_NAME_BYTES` in all. Everything accepted here is also a valid
    content reference for :func:`pipeline.workspace.check_reference`, which
    refuses a subset of the format characters refused here.
    A trailing ``/`` (a ZIP directory entry) must be stripped by the caller.
    """
    if not name:
        return "empty name"
    if "\x00" in name:
        return "NUL in name"
    if "\\" in name:
        return "backslash in name"
    if name.startswith("/"):
        return "absolute name"
    if _DRIVE_RE.match(name):
        return "drive letter in name"
    if name.isascii():
        # Of the refused categories ASCII has only Cc: C0 controls and DEL.
        control = _ASCII_CONTROL_RE.search(name)
        if control is not None:
            return f"control or format character U+{ord(control.group()):04X} in name"
    else:
        # By Unicode 14.0's categories on every Python (pipeline/unicode14.py):
        # whether a name is admitted must not depend on the Python that runs.
        # Each distinct character is judged once (a name repeats a few), and
        # the first refused one in the name is reported.
        refused = {ch for ch in set(name) if _refused_in_names(ch)}
        if refused:
            first = next(ch for ch in name if ch in refused)
            if unicode14.category(first) == "Cn":
                return f"character U+{ord(first):04X} unassigned in Unicode {unicode14.UNICODE_VERSION} in name"
            return f"control or format character U+{ord(first):04X} in name"
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        return f"longer than {MAX_NAME_BYTES} bytes"
    parts = name.split("/")
    if len(parts) > MAX_NAME_DEPTH:
        return f"deeper than {MAX_NAME_DEPTH} parts"
    for part in parts:
        if part in ("", ".", ".."):
            return f"empty, '.' or '..' part in name"
        if len(part.encode("utf-8")) > MAX_PART_BYTES:
            return f"a part longer than {MAX_PART_BYTES} bytes"
    return None


def fold_name(part: str) -> str:
    """The collision key of one path part: NFC, case-folded, NFC again."""
    if part.isascii():
        return part.lower()  # ASCII is its own NFC, and folds exactly as it lowers
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", part).casefold())


class NameRegistry:
    """Detects duplicate names and names that would merge on other systems.

    Two names collide when they are equal after NFC + case folding part by part
    (``Case.json``/``case.json``, NFC/NFD ``é``), when a file's name is also a
    directory prefix of another name (``a`` and ``a/b``), or when two spellings
    of one directory appear (``A/x`` and ``a/y``): on macOS or Windows each of
    these would silently become one file or one directory.
    """

    def __init__(self, duplicate_code: str, collision_code: str, error: type = AdmissionError) -> None:
        self._duplicate_code = duplicate_code
        self._collision_code = collision_code
        self._error = error
        self._exact: set[tuple[tuple[str, ...], bool]] = set()
        # folded parts -> (original parts, "file" | "dir")
        self._folded: dict[tuple[str, ...], tuple[tuple[str, ...], str]] = {}

    def add(self, parts: tuple[str, ...], is_dir: bool, display: str) -> None:
        """Register one name; raise on a duplicate or a collision."""
        key = (parts, is_dir)
        if key in self._exact:
            raise self._error(self._duplicate_code, "name appears twice", path=display)
        self._exact.add(key)
        folded = tuple(fold_name(p) for p in parts)
        for depth in range(1, len(parts) + 1):
            fkey = folded[:depth]
            original = parts[:depth]
            kind = "dir" if (depth < len(parts) or is_dir) else "file"
            seen = self._folded.get(fkey)
            if seen is None:
                self._folded[fkey] = (original, kind)
                continue
            seen_original, seen_kind = seen
            if seen_original != original:
                raise self._error(
                    self._collision_code,
                    f"name collides with {'/'.join(seen_original)!r} after Unicode NFC and case folding",
                    path=display,
                )
            if seen_kind != kind:
                raise self._error(
                    self._collision_code, "name is used both as a file and as a directory", path=display
                )


# ------------------------------------------------------------------- records

_EOCD = struct.Struct("<4sHHHHLLH")  # 22 bytes
_EOCD_SIG = b"PK\x05\x06"
_LOC64 = struct.Struct("<4sLQL")  # 20 bytes
_LOC64_SIG = b"PK\x06\x07"
_EOCD64 = struct.Struct("<4sQHHLLQQQQ")  # 56 bytes
_EOCD64_SIG = b"PK\x06\x06"
_CDIR = struct.Struct("<4sHHHHHHLLLHHHHHLL")  # 46 bytes
_CDIR_SIG = b"PK\x01\x02"
_LOCAL = struct.Struct("<4sHHHHHLLLHH")  # 30 bytes
_LOCAL_SIG = b"PK\x03\x04"
_DD_SIG = b"PK\x07\x08"

_FLAG_ENCRYPTED = 0x0001
_FLAG_DATA_DESCRIPTOR = 0x0008
_FLAG_STRONG_ENCRYPTION = 0x0040
_FLAG_UTF8 = 0x0800
_FLAG_MASKED_HEADERS = 0x2000
_STORED = 0
_DEFLATED = 8
_AES = 99


def _invalid(message: str, name: str | None = None) -> AdmissionError:
    return AdmissionError("ZIP_INVALID", message, path=name)


@dataclass(frozen=True)
class ZipEntry:
    """One member as the central directory and its local header agree it is."""

    name: str  #: decoded name without a directory's trailing ``/``
    parts: tuple[str, ...]
    is_dir: bool
    method: int
    flags: int
    crc: int
    compressed_size: int
    file_size: int
    header_offset: int
    data_offset: int  #: first byte of the compressed data
    mode: int  #: Unix mode from ``external_attr >> 16`` (0 if none)

    @property
    def stored(self) -> bool:
        """Held as is (method 0), not deflated."""
        return self.method == _STORED


@dataclass
class _Raw:
    name_bytes: bytes
    made_by: int
    flags: int
    method: int
    crc: int
    csize: int
    usize: int
    offset: int
    external_attr: int
    zip64: bool


class _Local(NamedTuple):
    """The fixed fields of a local header, as read."""

    flags: int
    method: int
    crc: int
    csize: int
    usize: int
    name_len: int
    extra_len: int
    data_offset: int


def _pread_exact(fd: int, size: int, offset: int, what: str) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise _invalid(f"archive truncated while reading {what}")
    return data


def _parse_zip64_extra(extra: bytes, need_usize: bool, need_csize: bool, need_offset: bool, need_disk: bool):
    """Return (usize, csize, offset, disk, found) from a ZIP64 extended field."""
    pos = 0
    found = False
    values: list[int] = []
    while pos < len(extra):
        if pos + 4 > len(extra):
            raise _invalid("malformed extra field")
        tag, size = struct.unpack_from("<HH", extra, pos)
        pos += 4
        if pos + size > len(extra):
            raise _invalid("malformed extra field")
        if tag == 0x0001 and not found:
            found = True
            body = extra[pos : pos + size]
            q = 0
            for need, width, fmt in (
                (need_usize, 8, "<Q"),
                (need_csize, 8, "<Q"),
                (need_offset, 8, "<Q"),
                (need_disk, 4, "<L"),
            ):
                if need:
                    if q + width > len(body):
                        raise _invalid("ZIP64 extra field too short")
                    values.append(struct.unpack_from(fmt, body, q)[0])
                    q += width
                else:
                    values.append(None)
        pos += size
    if not found:
        return None, None, None, None, False
    return values[0], values[1], values[2], values[3], True


class ZipArchive:
    """A ZIP file, fully inspected on construction; stream members with :meth:`iter_entry`.

    ``fd`` must be a readable file descriptor the caller owns (it is not
    closed here); all reads are positional (``pread``), so several threads
    may stream different entries.
    """

    def __init__(self, fd: int, limits: ZipLimits, *, label: str | None = None) -> None:
        self.fd = fd
        self.limits = limits
        self.label = label
        self.size = os.fstat(fd).st_size
        try:
            cd_offset, cd_size, count = self._read_end_records()
            raws = self._read_central_directory(cd_offset, cd_size, count)
            self.entries: list[ZipEntry] = self._check_layout(raws, cd_offset)
        except AdmissionError as error:
            if error.code == "ZIP_INVALID" and error.path is None and label is not None:
                # The archive as a whole is at fault (not a ZIP, cut short,
                # junk around it): the line names the archive, as the
                # archive's size refusals do.
                raise AdmissionError("ZIP_INVALID", error.message, path=label) from None
            raise
        self._check_names()
        self._check_policy()

    # -- structure ----------------------------------------------------------

    def _read_end_records(self) -> tuple[int, int, int]:
        size = self.size
        if size < _EOCD.size:
            raise _invalid("not a ZIP archive (too short)")
        tail_len = min(size, _EOCD.size + 0xFFFF)
        tail = _pread_exact(self.fd, tail_len, size - tail_len, "the end record")
        base = size - tail_len
        eocd_pos = None
        seen_signature = False
        idx = tail.rfind(_EOCD_SIG)
        while idx >= 0:
            seen_signature = True
            if idx + _EOCD.size <= len(tail):
                comment_len = struct.unpack_from("<H", tail, idx + 20)[0]
                if idx + _EOCD.size + comment_len == len(tail):
                    eocd_pos = base + idx
                    break
            idx = tail.rfind(_EOCD_SIG, 0, idx)
        if eocd_pos is None:
            if seen_signature:
                raise _invalid("data after the end of the archive, or a truncated archive")
            if _pread_exact(self.fd, len(_LOCAL_SIG), 0, "the first header") == _LOCAL_SIG:
                # Starts as a ZIP does: an interrupted download or copy, most likely.
                raise _invalid("a truncated ZIP archive (it starts like one but has no end-of-central-directory record)")
            raise _invalid("not a ZIP archive (no end-of-central-directory record)")
        (_, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, _) = _EOCD.unpack_from(
            tail, eocd_pos - base
        )
        directory_end = eocd_pos
        zip64 = False
        if eocd_pos >= _LOC64.size:
            loc = _pread_exact(self.fd, _LOC64.size, eocd_pos - _LOC64.size, "the ZIP64 locator")
            if loc[:4] == _LOC64_SIG:
                zip64 = True
        if zip64:
            _, loc_disk, eocd64_pos, disks = _LOC64.unpack(loc)
            if loc_disk != 0 or disks != 1:
                raise _invalid("multi-disk archives are not supported")
            if eocd64_pos + _EOCD64.size > eocd_pos - _LOC64.size:
                raise _invalid("ZIP64 end record out of place")
            rec = _pread_exact(self.fd, _EOCD64.size, eocd64_pos, "the ZIP64 end record")
            (sig, rec_size, _, _, disk, cd_disk, n_disk, n_total, cd_size, cd_offset) = _EOCD64.unpack(rec)
            if sig != _EOCD64_SIG or eocd64_pos + 12 + rec_size != eocd_pos - _LOC64.size:
                raise _invalid("ZIP64 end record malformed or followed by junk")
            directory_end = eocd64_pos
        elif 0xFFFF in (n_disk, n_total) or 0xFFFFFFFF in (cd_size, cd_offset):
            raise _invalid("ZIP64 values without a ZIP64 end record")
        if disk != 0 or cd_disk != 0 or n_disk != n_total:
            raise _invalid("multi-disk archives are not supported")
        # RELIABILITY 14: the count comes from the end record, before the directory is read.
        if n_total > self.limits.max_entries:
            raise AdmissionError(
                "ZIP_TOO_MANY_ENTRIES",
                f"archive declares {n_total} entries, limit {self.limits.max_entries}",
                path=self.label,
            )
        if cd_offset + cd_size != directory_end:
            # A junk prefix (self-extractor stub, concatenation) shifts every
            # offset; zipfile silently compensates, we refuse.
            raise _invalid("central directory is not where the end record says (junk before or inside the archive)")
        if cd_size < n_total * _CDIR.size:
            raise _invalid("central directory too small for its entry count")
        return cd_offset, cd_size, n_total

    def _read_central_directory(self, cd_offset: int, cd_size: int, count: int) -> list[_Raw]:
        directory = _pread_exact(self.fd, cd_size, cd_offset, "the central directory")
        raws: list[_Raw] = []
        pos = 0
        for _ in range(count):
            if pos + _CDIR.size > cd_size:
                raise _invalid("central directory truncated")
            (sig, made_by, _need, flags, method, _t, _d, crc, csize, usize, nlen, elen, clen,
             disk, _iattr, eattr, offset) = _CDIR.unpack_from(directory, pos)
            if sig != _CDIR_SIG:
                raise _invalid("bad central directory record signature")
            pos += _CDIR.size
            if pos + nlen + elen + clen > cd_size:
                raise _invalid("central directory record runs past the directory")
            name_bytes = directory[pos : pos + nlen]
            extra = directory[pos + nlen : pos + nlen + elen]
            pos += nlen + elen + clen
            u64, c64, o64, d64, has64 = _parse_zip64_extra(
                extra, usize == 0xFFFFFFFF, csize == 0xFFFFFFFF, offset == 0xFFFFFFFF, disk == 0xFFFF
            )
            if (usize == 0xFFFFFFFF or csize == 0xFFFFFFFF or offset == 0xFFFFFFFF or disk == 0xFFFF) and not has64:
                raise _invalid("ZIP64 sizes without a ZIP64 extra field", name_bytes.decode("utf-8", "replace"))
            usize = u64 if u64 is not None else usize
            csize = c64 if c64 is not None else csize
            offset = o64 if o64 is not None else offset
            disk = d64 if d64 is not None else disk
            if disk != 0:
                raise _invalid("entry on another disk")
            raws.append(_Raw(name_bytes, made_by, flags, method, crc, csize, usize, offset, eattr, has64))
        if pos != cd_size:
            raise _invalid("central directory holds more bytes than its entries")
        return raws

    def _decode_name(self, raw: _Raw) -> str:
        if b"\x00" in raw.name_bytes:
            # zipfile cuts .filename at the NUL (RELIABILITY 4): check the raw bytes.
            raise AdmissionError(
                "ZIP_UNSAFE_PATH", "NUL in entry name", path=raw.name_bytes.decode("utf-8", "surrogateescape")
            )
        if raw.flags & _FLAG_UTF8:
            try:
                return raw.name_bytes.decode("utf-8")
            except UnicodeDecodeError:
                raise AdmissionError(
                    "ZIP_UNSAFE_PATH",
                    "entry name flagged UTF-8 is not valid UTF-8",
                    path=raw.name_bytes.decode("utf-8", "surrogateescape"),  # shown as \xNN, escaped once
                ) from None
        return raw.name_bytes.decode("cp437")

    def _check_layout(self, raws: list[_Raw], cd_offset: int) -> list[ZipEntry]:
        """Read local headers; spans must tile [0, cd_offset); headers must agree."""
        locals_: list[_Local] = []
        spans: list[tuple[int, int, int]] = []
        for i, raw in enumerate(raws):
            display = raw.name_bytes.decode("utf-8", "surrogateescape")
            if raw.offset + _LOCAL.size > cd_offset:
                raise _invalid("local header offset points past the entries", display)
            header = _pread_exact(self.fd, _LOCAL.size, raw.offset, "a local header")
            (sig, _need, lflags, lmethod, _t, _d, lcrc, lcsize, lusize, nlen, elen) = _LOCAL.unpack(header)
            if sig != _LOCAL_SIG:
                raise _invalid("bad local header signature", display)
            data_offset = raw.offset + _LOCAL.size + nlen + elen
            data_end = data_offset + raw.csize
            if data_end > cd_offset:
                raise _invalid("entry data runs into the central directory", display)
            dd_len = 0
            if raw.flags & _FLAG_DATA_DESCRIPTOR:
                dd_len = self._data_descriptor_length(raw, data_end, cd_offset, display)
            spans.append((raw.offset, data_end + dd_len, i))
            locals_.append(_Local(lflags, lmethod, lcrc, lcsize, lusize, nlen, elen, data_offset))
        # RELIABILITY 11: overlapping spans are the non-recursive bomb; check
        # before comparing headers, whose disagreement would hide the cause.
        spans.sort()
        cursor = 0
        for start, end, i in spans:
            if start < cursor:
                raise AdmissionError(
                    "ZIP_OVERLAP",
                    "entry overlaps another entry's bytes",
                    path=raws[i].name_bytes.decode("utf-8", "surrogateescape"),
                )
            if start > cursor:
                raise _invalid(
                    "unaccounted bytes before an entry (junk prefix or hidden data)",
                    raws[i].name_bytes.decode("utf-8", "surrogateescape"),
                )
            cursor = end
        if cursor != cd_offset:
            raise _invalid("unaccounted bytes between the last entry and the central directory")
        entries = []
        for raw, (lflags, lmethod, lcrc, lcsize, lusize, nlen, elen, data_offset) in zip(raws, locals_):
            display = raw.name_bytes.decode("utf-8", "surrogateescape")
            lvar = _pread_exact(self.fd, nlen + elen, raw.offset + _LOCAL.size, "a local header name")
            lname, lextra = lvar[:nlen], lvar[nlen:]
            if lname != raw.name_bytes:
                raise _invalid("central directory and local header disagree on the name", display)
            if lmethod != raw.method:
                raise _invalid("central directory and local header disagree on the method", display)
            if lflags != raw.flags:
                raise _invalid("central directory and local header disagree on the flags", display)
            u64, c64, _o, _d, _ = _parse_zip64_extra(lextra, lusize == 0xFFFFFFFF, lcsize == 0xFFFFFFFF, False, False)
            lusize = u64 if u64 is not None else lusize
            lcsize = c64 if c64 is not None else lcsize
            if raw.flags & _FLAG_DATA_DESCRIPTOR:
                # Streaming writers leave these zero; if present they must agree too.
                for local, central in ((lcrc, raw.crc), (lcsize, raw.csize), (lusize, raw.usize)):
                    if local not in (0, central):
                        raise _invalid("central directory and local header disagree on CRC or sizes", display)
            elif (lcrc, lcsize, lusize) != (raw.crc, raw.csize, raw.usize):
                raise _invalid("central directory and local header disagree on CRC or sizes", display)
            name = self._decode_name(raw)
            is_dir = name.endswith("/")
            bare = name[:-1] if is_dir else name
            mode = raw.external_attr >> 16
            entries.append(
                ZipEntry(
                    name=bare,
                    parts=tuple(bare.split("/")),
                    is_dir=is_dir,
                    method=raw.method,
                    flags=raw.flags,
                    crc=raw.crc,
                    compressed_size=raw.csize,
                    file_size=raw.usize,
                    header_offset=raw.offset,
                    data_offset=data_offset,
                    mode=mode,
                )
            )
        return entries

    def _data_descriptor_length(self, raw: _Raw, data_end: int, cd_offset: int, display: str) -> int:
        """Length of the data descriptor after an entry; its values must match the directory."""
        # The size width (4 or 8 bytes) follows the local header's ZIP64 use,
        # which writers apply inconsistently; the values must match the
        # central directory either way, which settles it.
        for with_sig in (True, False):
            for width in (4, 8):
                length = (4 if with_sig else 0) + 4 + 2 * width
                if data_end + length > cd_offset:
                    continue
                blob = os.pread(self.fd, length, data_end)
                if len(blob) != length:
                    continue
                if with_sig:
                    if blob[:4] != _DD_SIG:
                        continue
                    blob = blob[4:]
                fmt = "<LQQ" if width == 8 else "<LLL"
                crc, csize, usize = struct.unpack(fmt, blob)
                if (crc, csize, usize) == (raw.crc, raw.csize, raw.usize):
                    return length
        raise _invalid("data descriptor missing or disagreeing with the central directory", display)

    # -- names and policy -----------------------------------------------------

    def _in_name_order(self) -> list:
        """The entries by name: a refusal names the first problem in name
        order, the same whatever order the archive lists its entries in."""
        return sorted(self.entries, key=lambda entry: (entry.name, entry.is_dir))

    def _check_names(self) -> None:
        registry = NameRegistry("ZIP_DUPLICATE_NAME", "ZIP_NAME_COLLISION")
        for entry in self._in_name_order():
            problem = name_problem(entry.name)
            if problem:
                raise AdmissionError("ZIP_UNSAFE_PATH", problem, path=entry.name + ("/" if entry.is_dir else ""))
            registry.add(entry.parts, entry.is_dir, entry.name + ("/" if entry.is_dir else ""))

    def _check_policy(self) -> None:
        limits = self.limits
        ordered = self._in_name_order()
        for entry in ordered:
            label = entry.name
            if entry.flags & (_FLAG_ENCRYPTED | _FLAG_STRONG_ENCRYPTION | _FLAG_MASKED_HEADERS) or entry.method == _AES:
                raise AdmissionError("ZIP_ENCRYPTED", "entry is encrypted", path=label)
            if entry.method not in (_STORED, _DEFLATED):
                raise AdmissionError(
                    "ZIP_UNSUPPORTED_METHOD", f"compression method {entry.method} (only stored and deflate)", path=label
                )
            ftype = stat.S_IFMT(entry.mode)
            if ftype not in (0, stat.S_IFREG, stat.S_IFDIR):
                kind = {
                    stat.S_IFLNK: "a symlink",
                    stat.S_IFIFO: "a FIFO",
                    stat.S_IFCHR: "a character device",
                    stat.S_IFBLK: "a block device",
                    stat.S_IFSOCK: "a socket",
                }.get(ftype, f"file type {ftype:o}")
                raise AdmissionError("ZIP_SPECIAL_FILE", f"entry is {kind}", path=label)
            if ftype == stat.S_IFDIR and not entry.is_dir:
                raise _invalid("entry has a directory mode but a file name", label)
            if entry.is_dir and entry.file_size != 0:
                raise _invalid("directory entry with content", label)
            if entry.method == _STORED and entry.compressed_size != entry.file_size:
                raise _invalid("stored entry whose sizes differ", label)
        total = 0
        for entry in ordered:
            if entry.file_size > limits.max_entry_bytes:
                raise AdmissionError(
                    "ZIP_TOO_LARGE",
                    f"entry declares {entry.file_size} bytes, limit {limits.max_entry_bytes}",
                    path=entry.name,
                )
            total += entry.file_size
        if total > limits.max_total_bytes:
            raise AdmissionError(
                "ZIP_TOO_LARGE", f"entries declare {total} bytes in all, limit {limits.max_total_bytes}", path=self.label
            )
        self.total_size = total
        for entry in ordered:
            if entry.file_size > limits.ratio_min_bytes and entry.file_size > limits.max_ratio * entry.compressed_size:
                ratio = entry.file_size / max(entry.compressed_size, 1)
                raise AdmissionError(
                    "ZIP_RATIO", f"compression ratio {ratio:.0f}:1 exceeds {limits.max_ratio}:1", path=entry.name
                )
        compressed = sum(entry.compressed_size for entry in self.entries)
        if total > max(limits.ratio_min_bytes, AGGREGATE_RATIO_MIN_BYTES) and total > limits.max_ratio * compressed:
            raise AdmissionError(
                "ZIP_RATIO",
                f"the entries together expand {total / max(compressed, 1):.0f}:1, more than {limits.max_ratio}:1",
                path=self.label,
            )

    # -- streaming -------------------------------------------------------------

    def find(self, name: str) -> ZipEntry | None:
        """The file entry named exactly ``name``, if any."""
        for entry in self.entries:
            if not entry.is_dir and entry.name == name:
                return entry
        return None

    def iter_entry(self, entry: ZipEntry, chunk_size: int = CHUNK) -> Iterator[bytes]:
        """Yield the entry's bytes in chunks of at most ``chunk_size``.

        Inflated bytes are counted as they come: more than the declared size
        stops at once (``ZIP_TOO_LARGE``). After the last chunk the exact
        length, the end of the deflate stream (no trailing bytes) and the
        CRC-32 are checked (``ZIP_INVALID`` / ``ZIP_CRC_MISMATCH``), so a
        consumer must exhaust the iterator before trusting what it wrote.
        """
        fd = self.fd
        remaining = entry.compressed_size
        offset = entry.data_offset
        declared = entry.file_size
        produced = 0
        crc = 0
        inflater = zlib.decompressobj(-15) if entry.method == _DEFLATED else None
        while True:
            if inflater is not None and inflater.unconsumed_tail:
                data = inflater.unconsumed_tail
            elif remaining > 0:
                data = os.pread(fd, min(chunk_size, remaining), offset)
                if not data:
                    raise _invalid("archive truncated inside an entry", entry.name)
                offset += len(data)
                remaining -= len(data)
            else:
                break
            if inflater is None:
                out = data
            else:
                if inflater.eof:
                    raise _invalid("bytes after the end of the deflate stream", entry.name)
                try:
                    out = inflater.decompress(data, chunk_size)
                except zlib.error as exc:
                    raise _invalid(f"corrupt deflate data ({exc})", entry.name) from None
            if out:
                produced += len(out)
                if produced > declared:
                    raise AdmissionError(
                        "ZIP_TOO_LARGE", f"entry inflates beyond its declared {declared} bytes", path=entry.name
                    )
                crc = zlib.crc32(out, crc)
                yield out
        if inflater is not None:
            if not inflater.eof:
                try:
                    tail = inflater.flush()
                except zlib.error as exc:
                    raise _invalid(f"corrupt deflate data ({exc})", entry.name) from None
                if tail:
                    produced += len(tail)
                    if produced > declared:
                        raise AdmissionError(
                            "ZIP_TOO_LARGE", f"entry inflates beyond its declared {declared} bytes", path=entry.name
                        )
                    crc = zlib.crc32(tail, crc)
                    yield tail
                if not inflater.eof:
                    raise _invalid("deflate stream ends early (truncated entry)", entry.name)
            if inflater.unused_data:
                raise _invalid("bytes after the end of the deflate stream", entry.name)
        if produced != declared:
            raise _invalid(f"entry holds {produced} bytes, declared {declared}", entry.name)
        if crc != entry.crc:
            raise AdmissionError("ZIP_CRC_MISMATCH", "content does not match its CRC-32", path=entry.name)

    def stored_reader(self, entry: ZipEntry) -> "StoredEntryReader":
        """A reader of a stored entry straight into the caller's buffers (see
        :class:`StoredEntryReader`); deflated entries go through
        :meth:`iter_entry`."""
        if not entry.stored:
            raise ValueError("only a stored entry is read into buffers")
        return StoredEntryReader(self.fd, entry)

    def read_entry(self, entry: ZipEntry, limit: int) -> bytes:
        """The whole (verified) entry, refused from its declared size if over ``limit``."""
        if entry.file_size > limit:
            raise AdmissionError("LIMIT_EXCEEDED", f"{entry.file_size} bytes, limit {limit}", path=entry.name)
        return b"".join(self.iter_entry(entry))


class StoredEntryReader:
    """A stored entry's bytes read into buffers the caller owns, CRC-32 as
    they come: what :meth:`ZipArchive.iter_entry` does for a stored entry,
    without a bytes object per chunk, and callable from another thread than
    the one that hashes and writes (zlib releases the GIL), so that the
    CRC-32 of a large member no longer adds to its SHA-256 on one core.

    Each call fills the start of ``buffer`` and returns how many bytes it
    holds (0 after the last). The same checks as :meth:`~ZipArchive.iter_entry`,
    with the same codes: more bytes than declared stop at once
    (``ZIP_TOO_LARGE``); :meth:`finish`, after the last call, checks the
    length (``ZIP_INVALID``) and the CRC-32 (``ZIP_CRC_MISMATCH``), so a
    consumer must call it before trusting what it wrote.
    """

    def __init__(self, fd: int, entry: ZipEntry) -> None:
        self.fd = fd
        self.entry = entry
        self.offset = entry.data_offset
        self.remaining = entry.compressed_size
        self.produced = 0
        self.crc = 0

    def __call__(self, buffer) -> int:
        if self.remaining == 0:
            return 0
        view = memoryview(buffer)
        if len(view) > self.remaining:
            view = view[: self.remaining]
        n = os.preadv(self.fd, [view], self.offset)
        if n == 0:
            raise _invalid("archive truncated inside an entry", self.entry.name)
        self.offset += n
        self.remaining -= n
        self.produced += n
        if self.produced > self.entry.file_size:
            raise AdmissionError(
                "ZIP_TOO_LARGE", f"entry inflates beyond its declared {self.entry.file_size} bytes", path=self.entry.name
            )
        self.crc = zlib.crc32(view[:n], self.crc)
        return n

    def finish(self) -> None:
        if self.remaining:
            raise _invalid("the entry was not read to its end", self.entry.name)
        if self.produced != self.entry.file_size:
            raise _invalid(f"entry holds {self.produced} bytes, declared {self.entry.file_size}", self.entry.name)
        if self.crc != self.entry.crc:
            raise AdmissionError("ZIP_CRC_MISMATCH", "content does not match its CRC-32", path=self.entry.name)

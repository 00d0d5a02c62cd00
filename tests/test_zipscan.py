"""ZIP inspection (pipeline.zipscan): names, layout, policy and verified streaming."""

from __future__ import annotations

import io
import os
import random
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import AdmissionError
from pipeline.zipscan import MiB, NameRegistry, ZipArchive, ZipLimits, fold_name, name_problem

HOSTILE = Path(__file__).resolve().parent.parent / "fixtures" / "hostile"


def _archive(tmp_path: Path, data: bytes, limits: ZipLimits = ZipLimits()) -> ZipArchive:
    path = tmp_path / "a.zip"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return ZipArchive(fd, limits, label="a.zip")
    except BaseException:
        os.close(fd)
        raise


def _zip(members: dict[str, bytes], **kw) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", **kw) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _code(excinfo) -> str:
    return excinfo.value.code


# ------------------------------------------------------------------ names


@pytest.mark.parametrize(
    "name",
    [
        "../x", "a/../../x", "/x", "//host/x", "C:/x", "C:x", "c:", "a\\..\\x", "a\x00b", "a\x1bb", "a\u202eb",
        "a\u200bb", "a\u2028b", "a//b", "./a", "a/.", "", "a/" + "b" * 256, "/".join(["d"] * 17),
    ],
)
def test_unsafe_names_are_refused(name):
    assert name_problem(name) is not None


@pytest.mark.parametrize("name", ["a", "original/report.json", "a/" + "b" * 255, "/".join(["d"] * 16), "café/naïve.txt", "%2e%2e/x", "a..b", ".hidden"])
def test_safe_names_pass(name):
    assert name_problem(name) is None


def test_fold_name_merges_nfc_nfd_and_case():
    assert fold_name("Caf\u00e9") == fold_name("cafe\u0301") == fold_name("CAFÉ")


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=40) | st.text(max_size=12))
def test_the_ascii_fast_paths_are_their_definitions(text):
    """fold_name and name_problem skip Unicode tables for ASCII names."""
    import unicodedata

    assert fold_name(text) == unicodedata.normalize("NFC", unicodedata.normalize("NFC", text).casefold())
    problem = name_problem(text)
    first_bad = next((ch for ch in text if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")), None)
    if problem is not None and "control or format" in problem:
        assert first_bad is not None and f"U+{ord(first_bad):04X}" in problem
    elif first_bad is not None:
        # an earlier check (empty, NUL, backslash, absolute, drive) spoke first
        assert problem is not None


@pytest.mark.parametrize(
    "first, second, code",
    [
        (("a",), ("a",), "DUP"),
        (("Case.json",), ("case.json",), "COLL"),
        (("caf\u00e9",), ("cafe\u0301",), "COLL"),
        (("notes",), ("notes", "a"), "COLL"),
        (("notes", "a"), ("notes",), "COLL"),
        (("A", "x"), ("a", "y"), "COLL"),
    ],
)
def test_name_registry(first, second, code):
    reg = NameRegistry("DUP", "COLL", error=_Err)
    reg.add(first, False, "/".join(first))
    with pytest.raises(_Err) as exc:
        reg.add(second, False, "/".join(second))
    assert exc.value.code == code


def test_name_registry_accepts_siblings_and_explicit_dirs():
    reg = NameRegistry("DUP", "COLL", error=_Err)
    reg.add(("a",), True, "a/")
    reg.add(("a", "b"), False, "a/b")
    reg.add(("a", "c"), False, "a/c")
    with pytest.raises(_Err):
        reg.add(("a",), True, "a/")  # the same directory entry twice is a duplicate


class _Err(Exception):
    def __init__(self, code, message, path=None):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------ valid archives


def test_zipfile_archives_are_read_and_streamed(tmp_path):
    members = {"manifest.json": b"{}", "original/a.txt": b"hello\n" * 1000, "original/empty": b""}
    for compression in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        archive = _archive(tmp_path, _zip(members, compression=compression))
        try:
            assert {e.name: e.file_size for e in archive.entries} == {k: len(v) for k, v in members.items()}
            for entry in archive.entries:
                assert b"".join(archive.iter_entry(entry, chunk_size=4096)) == members[entry.name]
        finally:
            os.close(archive.fd)


def test_directory_entries_and_comment(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(zipfile.ZipInfo("original/"), b"")
        zf.writestr("original/a.txt", b"x")
        zf.comment = b"PK\x05\x06 a comment holding the end signature"
    archive = _archive(tmp_path, buf.getvalue())
    assert [(e.name, e.is_dir) for e in archive.entries] == [("original", True), ("original/a.txt", False)]
    os.close(archive.fd)


def test_local_zip64_extra_and_data_descriptors(tmp_path):
    # force_zip64 writes ZIP64 sizes in the local header only.
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        with zf.open("big.bin", "w", force_zip64=True) as f:
            f.write(b"abc" * 10000)
    archive = _archive(tmp_path, buf.getvalue())
    assert b"".join(archive.iter_entry(archive.entries[0])) == b"abc" * 10000
    os.close(archive.fd)

    class Unseekable(io.RawIOBase):
        def __init__(self):
            self.data = bytearray()

        def writable(self):
            return True

        def write(self, b):
            self.data += b
            return len(b)

    for force_zip64 in (False, True):  # 4- and 8-byte data descriptor sizes
        sink = Unseekable()
        with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            with zf.open("streamed.txt", "w", force_zip64=force_zip64) as f:
                f.write(b"streamed\n" * 100)
            zf.writestr("second.txt", b"2")
        archive = _archive(tmp_path, bytes(sink.data))
        entry = archive.entries[0]
        assert entry.flags & 0x08
        assert b"".join(archive.iter_entry(entry)) == b"streamed\n" * 100
        assert b"".join(archive.iter_entry(archive.entries[1])) == b"2"
        os.close(archive.fd)


def test_empty_archive(tmp_path):
    archive = _archive(tmp_path, _zip({}))
    assert archive.entries == []
    os.close(archive.fd)


# ------------------------------------------------------------------ limits


def test_entry_count_limit_comes_from_the_end_record(tmp_path):
    data = _zip({f"f{i}": b"" for i in range(5)})
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, data, ZipLimits(max_entries=4))
    assert _code(exc) == "ZIP_TOO_MANY_ENTRIES"
    # the committed fixture declares 5000 entries but holds one: refused before the directory is read
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, (HOSTILE / "h14_too_many_entries.zip").read_bytes())
    assert _code(exc) == "ZIP_TOO_MANY_ENTRIES"


def test_ratio_applies_only_above_the_threshold(tmp_path):
    small = _zip({"zeros": b"\x00" * (MiB)}, compression=zipfile.ZIP_DEFLATED)
    archive = _archive(tmp_path, small)  # exactly 1 MiB: exempt
    os.close(archive.fd)
    big = _zip({"zeros": b"\x00" * (MiB + 1)}, compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, big)
    assert _code(exc) == "ZIP_RATIO"
    archive = _archive(tmp_path, big, ZipLimits(max_ratio=2000))
    os.close(archive.fd)


def test_small_entries_are_held_to_the_ratio_together(tmp_path):
    # Each entry is exempt (exactly ratio_min_bytes), but together they are a
    # bomb: a hostile review admitted 1,000 of them, 1 GB from a 1.1 MB ZIP.
    from pipeline.zipscan import AGGREGATE_RATIO_MIN_BYTES

    count = AGGREGATE_RATIO_MIN_BYTES // MiB + 1
    zeros = {f"original/z{i}": b"\x00" * MiB for i in range(count)}
    bomb = _zip(zeros, compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, bomb)
    assert _code(exc) == "ZIP_RATIO"
    assert "together" in str(exc.value)
    # Within the ratio together it passes.
    os.close(_archive(tmp_path, bomb, ZipLimits(max_ratio=2000)).fd)
    # Below the aggregate threshold, a sparse image beside a note is harmless
    # however far it expands (the first threshold, 1 MiB, refused this at 822:1).
    sparse = {"original/image.raw": b"\x00" * 1_000_000 + b"\x01" * 16, "original/note.txt": b"a" * 100_000}
    os.close(_archive(tmp_path, _zip(sparse, compression=zipfile.ZIP_DEFLATED)).fd)
    rng = random.Random(0)  # log-like lines: timestamps and counters compress ~5-20:1, not 1000:1
    text = {f"original/log{i}": "".join(f"2026-12-01T12:{rng.randrange(60):02d}:{rng.randrange(60):02d} worker {rng.randrange(9)} "
                                        f"request {rng.randrange(10**6)} took {rng.randrange(900)} ms\n"
                                        for _ in range(20_000)).encode()[:MiB] for i in range(3)}
    os.close(_archive(tmp_path, _zip(text, compression=zipfile.ZIP_DEFLATED)).fd)


def test_size_limits(tmp_path):
    data = _zip({"a": b"x" * 1000, "b": b"y" * 1000})
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, data, ZipLimits(max_entry_bytes=999))
    assert _code(exc) == "ZIP_TOO_LARGE"
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, data, ZipLimits(max_total_bytes=1999))
    assert _code(exc) == "ZIP_TOO_LARGE"


# ------------------------------------------------------------------ the bomb


def test_overlap_bomb_is_small_and_would_inflate_past_50_mib_naively():
    path = HOSTILE / "h11_overlap_bomb.zip"
    assert path.stat().st_size < 8 * 1024
    # What a reader without an overlap check inflates (CPython's zipfile did
    # so in 3.11.7 and 3.12.1; 3.13.0 refuses the archive when a member is opened):
    # every member's data from its local header on.
    total = 0
    with zipfile.ZipFile(path) as zf, open(path, "rb") as raw:
        for info in zf.infolist():
            raw.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<HH", raw.read(30)[26:30])
            raw.seek(info.header_offset + 30 + name_len + extra_len)
            data = raw.read(info.compress_size)
            if info.compress_type == zipfile.ZIP_STORED:
                total += len(data)
                continue
            inflater = zlib.decompressobj(-15)
            while data:
                total += len(inflater.decompress(data, MiB))
                data = inflater.unconsumed_tail
    assert total >= 50 * MiB


def test_overlap_bomb_is_refused_before_any_inflation(tmp_path):
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, (HOSTILE / "h11_overlap_bomb.zip").read_bytes())
    assert _code(exc) == "ZIP_OVERLAP"


# ------------------------------------------------------------------ streaming checks


def _stored_zip(name: bytes, content: bytes, *, declared: int | None = None, crc: int | None = None) -> bytes:
    declared = len(content) if declared is None else declared
    crc = zlib.crc32(content) if crc is None else crc
    local = struct.pack("<4sHHHHHLLLHH", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, len(content), declared, len(name), 0)
    body = local + name + content
    cd = struct.pack(
        "<4sHHHHHHLLLHHHHHLL", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, len(content), declared, len(name), 0, 0, 0, 0, 0, 0
    ) + name
    return body + cd + struct.pack("<4sHHHHLLH", b"PK\x05\x06", 0, 0, 1, 1, len(cd), len(body), 0)


def test_crc_mismatch_is_found_while_streaming(tmp_path):
    archive = _archive(tmp_path, _stored_zip(b"a", b"hello", crc=1))
    with pytest.raises(AdmissionError) as exc:
        list(archive.iter_entry(archive.entries[0]))
    assert _code(exc) == "ZIP_CRC_MISMATCH"
    os.close(archive.fd)


def test_stored_entry_with_differing_sizes_is_invalid(tmp_path):
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, _stored_zip(b"a", b"hello", declared=4))
    assert _code(exc) == "ZIP_INVALID"


@pytest.mark.parametrize("keep", [30, 400, 0.5])
def test_a_cut_archive_is_called_truncated_and_other_bytes_not_a_zip(tmp_path, keep):
    """A ZIP cut short (an interrupted download) loses its end record; its
    start still says ZIP, so the message says truncated, not "not a ZIP"."""
    whole = _zip({f"m{i}.txt": os.urandom(2000) for i in range(8)})
    cut = whole[: int(len(whole) * keep) if isinstance(keep, float) else keep]
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, cut)
    assert _code(exc) == "ZIP_INVALID"
    assert "a truncated ZIP archive" in str(exc.value), str(exc.value)
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, b"%PDF-1.7" + os.urandom(5000))
    assert _code(exc) == "ZIP_INVALID"
    assert "not a ZIP archive (no end-of-central-directory record)" in str(exc.value)


def test_truncated_deflate_stream(tmp_path):
    content = os.urandom(5000)
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    comp = (raw.compress(content) + raw.flush())[:-100]
    name = b"a"
    crc = zlib.crc32(content)
    local = struct.pack("<4sHHHHHLLLHH", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(comp), len(content), 1, 0)
    body = local + name + comp
    cd = struct.pack(
        "<4sHHHHHHLLLHHHHHLL", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, crc, len(comp), len(content), 1, 0, 0, 0, 0, 0, 0
    ) + name
    data = body + cd + struct.pack("<4sHHHHLLH", b"PK\x05\x06", 0, 0, 1, 1, len(cd), len(body), 0)
    archive = _archive(tmp_path, data)
    with pytest.raises(AdmissionError) as exc:
        list(archive.iter_entry(archive.entries[0]))
    assert _code(exc) == "ZIP_INVALID"
    os.close(archive.fd)


def test_a_name_s_bytes_that_are_not_utf8_are_shown_once_escaped(tmp_path):
    # Every refusal that names an entry shows its odd bytes as \xNN once (five
    # places escaped them as text, which the one-line message doubled).
    data = _zip({"original/aQb.txt": b"x"})
    data = data.replace(b"aQb.txt", b"a\x00\xff.txt")  # local and central name alike
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, data)
    assert _code(exc) == "ZIP_UNSAFE_PATH"
    assert str(exc.value).endswith("(original/a\\x00\\xff.txt)"), str(exc.value)


def test_nul_name_is_caught_although_zipfile_hides_it():
    path = HOSTILE / "h04_nul.zip"
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    assert "original/a.txt" in names  # zipfile cut the name at the NUL (RELIABILITY 4)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(AdmissionError) as exc:
            ZipArchive(fd, ZipLimits())
        assert exc.value.code == "ZIP_UNSAFE_PATH"
    finally:
        os.close(fd)


def test_zip64_end_records(tmp_path):
    data = _zip({"manifest.json": b"{}", "a.txt": b"abc"})
    eocd_pos = data.rindex(b"PK\x05\x06")
    _, _, _, _, count, cd_size, cd_offset, _ = struct.unpack_from("<4sHHHHLLH", data, eocd_pos)
    body = data[:eocd_pos]
    eocd64 = struct.pack("<4sQHHLLQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, len(body), 1)
    eocd = struct.pack("<4sHHHHLLH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    zip64 = body + eocd64 + locator + eocd
    with zipfile.ZipFile(io.BytesIO(zip64)) as zf:  # sanity: a real ZIP64 archive
        assert zf.read("a.txt") == b"abc"
    archive = _archive(tmp_path, zip64)
    assert [e.name for e in archive.entries] == ["manifest.json", "a.txt"]
    os.close(archive.fd)
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, zip64, ZipLimits(max_entries=1))
    assert _code(exc) == "ZIP_TOO_MANY_ENTRIES"
    # ZIP64 markers without the ZIP64 records
    with pytest.raises(AdmissionError) as exc:
        _archive(tmp_path, body + eocd)
    assert _code(exc) == "ZIP_INVALID"


def _drain_by_iter(archive: ZipArchive, entry) -> tuple:
    try:
        return ("ok", b"".join(archive.iter_entry(entry, chunk_size=4096)))
    except AdmissionError as error:
        return ("refused", error.code, str(error))


def _drain_by_reader(archive: ZipArchive, entry, buffer_size: int) -> tuple:
    reader = archive.stored_reader(entry)
    out = bytearray()
    buffer = bytearray(buffer_size)
    try:
        while True:
            n = reader(buffer)
            if n == 0:
                break
            out += buffer[:n]
        reader.finish()
    except AdmissionError as error:
        return ("refused", error.code, str(error))
    return ("ok", bytes(out))


@settings(max_examples=150, deadline=None)
@given(
    content=st.binary(max_size=3000),
    declared_delta=st.integers(-3, 3),
    crc_lies=st.booleans(),
    cut=st.integers(0, 40),
    buffer_size=st.sampled_from([1, 7, 512, 4096, 1 << 16]),
)
def test_the_stored_reader_gives_what_iter_entry_gives(tmp_path_factory, content, declared_delta, crc_lies, cut, buffer_size):
    """A stored entry read into buffers (what admission's pipelined copy does)
    yields the same bytes, or is refused with the same code and message, as
    streaming it: for declared sizes above and below the real one, a lying
    CRC-32 and an archive cut inside the entry's data."""
    import dataclasses

    tmp_path = tmp_path_factory.mktemp("stored")
    archive = _archive(tmp_path, _zip({"m.bin": content}, compression=zipfile.ZIP_STORED))
    try:
        true_entry = archive.entries[0]
        entry = dataclasses.replace(
            true_entry,
            file_size=max(0, true_entry.file_size + declared_delta),
            crc=(true_entry.crc ^ 1) if crc_lies else true_entry.crc,
        )
        if cut:
            # The archive ends inside (or right at the end of) the entry's data.
            with open(tmp_path / "a.zip", "r+b") as handle:
                handle.truncate(entry.data_offset + max(0, entry.compressed_size - cut))
        expected = _drain_by_iter(archive, entry)
        assert _drain_by_reader(archive, entry, buffer_size) == expected
        if not (declared_delta or crc_lies or (cut and entry.compressed_size)):
            assert expected == ("ok", content)
    finally:
        os.close(archive.fd)


def test_only_stored_entries_are_read_into_buffers(tmp_path):
    archive = _archive(tmp_path, _zip({"m.txt": b"x" * 1000}, compression=zipfile.ZIP_DEFLATED))
    try:
        assert not archive.entries[0].stored
        with pytest.raises(ValueError):
            archive.stored_reader(archive.entries[0])
    finally:
        os.close(archive.fd)

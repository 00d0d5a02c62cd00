"""The disposable build cache under ``<workspace>/.cache/<case_id>/``.

Nothing here is published: deleting the cache only makes the next build redo
work, and never changes an output, because every cached record is keyed by
the sha256 of the immutable content it was derived from. Cache files are
replaced atomically (temp + rename) so a crash never leaves a torn record;
that rename is fine here precisely because cache files are not append-only
content (published files are only ever created with ``os.link``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import sys
import threading
from pathlib import Path

import json

from .errors import IntegrityError

__all__ = ["BuildCache", "ParsedManifests", "is_file_state", "sound_doit_record"]

_CACHE_RECORD_LIMIT = 64 * 1024 * 1024
_DOIT_RECORD_BYTES = 1 << 20  # a task's record is a few hundred bytes; anything larger is not doit's

# The temp files this process's threads are writing now (see remove_stale_temps).
_IN_FLIGHT: set[str] = set()
_IN_FLIGHT_GUARD = threading.Lock()


def _new_guard_in_child() -> None:
    # Another thread may have held it at the fork. Its temp files stay in
    # flight: they are the parent's, still being written.
    global _IN_FLIGHT_GUARD
    _IN_FLIGHT_GUARD = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_guard_in_child)


class _computed_once:
    """``functools.cached_property`` without its lock: on Python 3.11 that is
    one lock per property, shared by every instance and held while the value
    is computed, so a fork while another thread held it left the child's
    next build waiting for ever (found by session 23's re-review). Two
    threads may both compute the value here; it is the same value."""

    def __init__(self, function) -> None:
        self.function = function
        self.name = function.__name__

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = self.function(instance)
        instance.__dict__[self.name] = value
        return value


def is_file_state(state) -> bool:
    """Whether ``state`` is what the content-hash checker records of a file:
    ``[size, sha256]``."""
    return (
        isinstance(state, (list, tuple))
        and len(state) == 2
        and type(state[0]) is int
        and isinstance(state[1], str)
    )


def sound_doit_record(record) -> bool:
    """Whether a task's record in the dep file has the shape doit (0.36-0.37)
    relies on: an object whose ``_values_:`` is an object and ``deps:`` a
    list of paths. doit reads those without looking (``values.get``,
    ``set(deps)``), so a record of another shape that still decodes (damage,
    another program's file) stopped every build with a traceback. The file
    states in it are the checker's to judge (:func:`is_file_state`)."""
    if not isinstance(record, dict):
        return False
    values, deps = record.get("_values_:"), record.get("deps:")
    if values is not None and not isinstance(values, dict):
        return False
    return deps is None or (isinstance(deps, list) and all(isinstance(path, str) for path in deps))


def _path_key(path: str) -> str:
    return hashlib.sha256(path.encode("utf-8")).hexdigest()[:16]


class BuildCache:
    """Paths and atomic writes for one case's intermediate task targets."""

    def __init__(self, case_cache_dir: Path) -> None:
        self.root = Path(case_cache_dir)

    @property
    def dep_file(self) -> Path:
        return self.root / "doit.sqlite3"

    def doit_records(self, tasks: tuple[str, ...]) -> dict[str, dict] | None:
        """What doit recorded for ``tasks`` when each last ran to the end of a
        build (the case's dependency file, opened read-only): the stamp, the
        values an action returned, and the size and SHA-256 of each file it
        depended on, which is what doit compares to decide whether the task
        runs again. ``{}`` where there is no file yet, or none a build would
        keep (empty, cut short or not a database: the build discards it and
        runs every task); None where it cannot be read (locked by a build
        that is saving it, on a read-only filesystem with a journal to
        replay, not doit's)."""
        import sqlite3

        path = self.dep_file
        try:
            if not path.is_file():
                return {}
            conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=0.5)
        except (OSError, sqlite3.Error):
            return None
        try:
            marks = ", ".join("?" for _ in tasks)
            rows = conn.execute(f"SELECT task_id, task_data FROM doit WHERE task_id IN ({marks})", tasks).fetchall()
            records = {}
            for task_id, data in rows:
                if not isinstance(data, (str, bytes)) or len(data) > _DOIT_RECORD_BYTES:
                    return None
                record = json.loads(data)
                if not sound_doit_record(record):
                    return None
                records[task_id] = record
            return records
        except sqlite3.OperationalError as error:
            # An empty file opens as an empty database, without doit's table.
            return {} if "no such table" in str(error) else None
        except sqlite3.DatabaseError:
            # Cut short ("malformed") or not a database: damage, not a lock.
            return {}
        except (sqlite3.Error, ValueError, RecursionError):
            return None
        finally:
            conn.close()

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def store_state(self) -> Path:
        return self.root / "store-state.json"

    @property
    def plan_ahead(self) -> Path:
        """The plan ``doit append`` leaves for the build after it (pipeline.build.plan_ahead)."""
        return self.root / "plan-ahead.json"

    @property
    def content_stamps(self) -> Path:
        """The size, mtime and type of each content file the plan relies on, as
        they stood when its records were last trusted (pipeline.build)."""
        return self.root / "content-stamps.json"

    def forget_records_of(self, changed: dict[str, str]) -> None:
        """Remove every record derived from these content files (``{path:
        sha256}``): input records, opaque REFs and prior-case views are named
        ``<sha256>.<...>.<path key>...``, so whatever reads them next reads
        and verifies the file again. One pass over each folder."""
        wanted = {(sha256, _path_key(path)) for path, sha256 in changed.items()}
        for folder in (self._documents, os.fspath(self.root / "opaque")):
            try:
                entries = list(os.scandir(folder))
            except FileNotFoundError:
                continue
            for entry in entries:
                parts = entry.name.split(".")
                if len(parts) >= 3 and any((parts[0], key) in wanted for key in parts[1:]):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    def prior_view(self, path: str, sha256: str) -> Path:
        """Where planning leaves a prior case's view (:mod:`pipeline.prior`)."""
        return Path(f"{self._documents}/{sha256}.case-view.{_path_key(path)}.json")

    def remove_other_prior_views(self, kept: Path) -> None:
        """Every prior case's view but ``kept``: a revision's builds read the
        view of the one case before it, and one view a revision stayed
        behind (43 MB of them at 300 reopen/append/build cycles)."""
        for stale in Path(self._documents).glob("*.case-view.*.json"):
            if stale.name != kept.name:
                stale.unlink(missing_ok=True)

    def input_record(self, path: str, sha256: str, contract: str, inline_fact_value: int, over_limit: bool = False) -> Path:
        """Where ``read_input`` leaves one structured input: the parsed document,
        or for reports and reproductions their fragment (see
        :func:`pipeline.assemble.document_fragment`), which measures fact values
        against the inline limit, so the limit is part of the name too. A
        document read over its size bound (:func:`pipeline.build.over_read_bound`)
        is only a refusal: its record is kept apart from the one read within it,
        so a lowered limit never leaves a refusal for a later build to reuse."""
        return Path(self.input_record_name(path, sha256, contract, inline_fact_value, over_limit))

    def input_record_name(self, path: str, sha256: str, contract: str, inline_fact_value: int, over_limit: bool = False) -> str:
        """:meth:`input_record` as a string: doit's creators ask for one per
        document on every run, and building a Path costs more than the name."""
        over = ".over" if over_limit else ""
        return f"{self._documents}/{sha256}.{contract}.{_path_key(path)}.i{int(inline_fact_value)}{over}.json"

    @_computed_once
    def _documents(self) -> str:
        return os.fspath(self.root / "documents" / self._code)

    @_computed_once
    def _code(self) -> str:
        from .doitcli import code_version

        return code_version()[:16]

    def parsed_manifests(self, *, keep_loaded: bool = True) -> "ParsedManifests":
        """Checked package manifests by the sha256 of their bytes (see :class:`pipeline.packages.Package`)."""
        return ParsedManifests(self, keep_loaded=keep_loaded)

    def manifest_record(self, sha256: str) -> Path:
        return Path(f"{self._documents}/{sha256}.manifest.msgpack")

    def manifest_outline_record(self, sha256: str) -> Path:
        return Path(f"{self._documents}/{sha256}.manifest-outline.msgpack")

    def opaque(self, path: str, sha256: str, size: int) -> Path:
        return Path(self.opaque_name(path, sha256, size))

    def opaque_name(self, path: str, sha256: str, size: int) -> str:
        return f"{self._root}/opaque/{sha256}.{size}.{_path_key(path)}.json"

    @_computed_once
    def _root(self) -> str:
        return os.fspath(self.root)

    @property
    def case_json(self) -> Path:
        return self.root / "out" / "case.json"

    @property
    def summary(self) -> Path:
        return self.root / "out" / "case_summary.md"

    @property
    def escape_memo(self) -> Path:
        """The escaped long strings of the last render (:class:`pipeline.summary.EscapeMemo`)."""
        return self._by_code("escapes")

    @property
    def line_memo(self) -> Path:
        """The statement lines of the last render (:class:`pipeline.summary.LineMemo`)."""
        return self._by_code("lines")

    @property
    def checked_records(self) -> Path:
        """The case records the last contract check passed (:mod:`pipeline.casecheck`)."""
        return self._by_code("checked")

    @property
    def splice_state(self) -> Path:
        """What the last build carries to the next append rebuild (:func:`pipeline.build._splice_start`)."""
        return self._by_code("splice")

    def _by_code(self, stem: str) -> Path:
        # Under the builder code that made it: another builder never reads it.
        return self.root / "out" / f"{stem}.{self._code}.msgpack"

    def remove_other_versions(self, current: Path) -> None:
        """Records like ``current`` made by other builder code: never read again."""
        stem = current.name.split(".", 1)[0]
        for stale in current.parent.glob(f"{stem}.*.msgpack"):
            if stale.name != current.name:
                stale.unlink(missing_ok=True)

    @property
    def published(self) -> Path:
        return self.root / "out" / "published.json"

    def write(self, path: Path, data: bytes, *, flush_on_replace: bool = True) -> None:
        """Atomically replace one cache record (never used for published files).

        ``flush_on_replace=False`` removes the old record before renaming the
        new one into place, for the build's megabyte-sized outputs: renaming
        over an existing file makes ext4 (``auto_da_alloc``) start writing the
        new file out there and then, which costs an append rebuild a few
        milliseconds and buys nothing, since these are checked against the
        digest their step recorded (:func:`pipeline.doitcli.output_as_written`)
        and made again when a power loss cut them short. A crash between the
        two leaves no record, which a build makes again."""
        path.parent.mkdir(parents=True, exist_ok=True)
        # Named by process and thread: the case lock is re-entrant per process,
        # so two threads of one process may write the same record at once.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with _IN_FLIGHT_GUARD:
            _IN_FLIGHT.add(os.fspath(tmp))
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
            if not flush_on_replace:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            os.replace(tmp, path)
        except BaseException as error:
            # A full disk must not keep the half-written copy holding space.
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(error, OSError) and error.filename is None:
                # A failed write() names no file; the IO_ERROR line must.
                error.filename = os.fspath(path)
            raise
        finally:
            with _IN_FLIGHT_GUARD:
                _IN_FLIGHT.discard(os.fspath(tmp))

    def remove_other_builders_records(self) -> int:
        """Remove the document records of older builder code (the folders
        beside this builder's under ``documents/``), which no build of this
        code reads; each upgrade of the builder left its own for good, ~2-8 MB
        a case at the default limits. The most recently written of them
        stays: two builders that take turns on one workspace (two Pythons, a
        rollback) would otherwise remove each other's at every build.
        ``documents/`` holds only those folders, so looking costs a build one
        short directory read. Under the case lock, as every cache writer is;
        returns how many were removed."""
        documents = Path(self._documents)
        try:
            others = [entry for entry in os.scandir(documents.parent)
                      if entry.name != documents.name and entry.is_dir(follow_symlinks=False)]
            if len(others) < 2:
                return 0
            others.sort(key=lambda entry: (entry.stat(follow_symlinks=False).st_mtime_ns, entry.name), reverse=True)
        except FileNotFoundError:
            return 0
        removed = 0
        for entry in others[1:]:
            shutil.rmtree(entry.path, ignore_errors=True)  # what cannot go is tried again by the next build
            removed += not os.path.lexists(entry.path)
        return removed

    def remove_stale_temps(self) -> int:
        """Remove the temp files of writes that never finished (a process
        killed mid-write). Only builds write the cache, each under the case
        lock, so the process that holds that lock knows every temp file is
        dead except those its own threads are writing (the lock is re-entrant
        per process), which are left. A pid in the name proves nothing: in a
        container every build may run as pid 1. Returns how many were removed."""
        with _IN_FLIGHT_GUARD:
            writing = set(_IN_FLIGHT)
        removed = 0
        folders = [self.root, self.root / "out", self.root / "opaque", Path(self._documents)]
        for folder in folders:
            try:
                entries = list(os.scandir(folder))
            except FileNotFoundError:
                continue
            for entry in entries:
                if (
                    entry.name.startswith(".")
                    and entry.name.endswith(".tmp")
                    and entry.path not in writing
                    and entry.is_file(follow_symlinks=False)
                ):
                    try:
                        os.unlink(entry.path)
                        removed += 1
                    except FileNotFoundError:
                        pass
        return removed

    def write_json(self, path: Path, value) -> None:
        # Sorted keys make equal records byte-equal, which the content-hash
        # checker relies on to skip tasks whose inputs did not change. A
        # record only has to be the same bytes for the same value under the
        # same builder code (its path names that code), not the canonical
        # bytes of a hash: msgspec writes floats in its own spelling (1e16,
        # where the stdlib writes 1e+16), and both decoders of read_json read
        # them back alike, so no walk checks a record for floats first.
        # Records hold JSON as the build makes it: string keys and finite
        # numbers only (inputs refuse NaN and Infinity; msgspec would write
        # them as null).
        from .jsoncanon import encode_sorted

        self.write(path, _sealed(encode_sorted(value)))

    def write_json_fast(self, path: Path, value) -> None:
        """:meth:`write_json` through msgspec, for records of hundreds of
        kilobytes that no task lists as a dependency (key order as built)."""
        import msgspec

        self.write(path, _sealed(msgspec.json.encode(value)))

    def read_json(self, path: Path):
        """Read one record we wrote ourselves (plain decoding: the strict reader's
        duplicate-key and number checks guard untrusted input, not our cache;
        the seal, damage).

        Through msgspec once something has imported it (every step but a
        no-op's validate_index has), else the stdlib: a rebuild reads the
        100 KiB plan once per step, and msgspec decodes it in a third of the
        time. Both give the same value for what :meth:`write_json` writes
        (UTF-8, no NaN or Infinity: inputs never hold them; a property test
        holds the two together), and both refuse a damaged record with a
        ``ValueError``."""
        decode = _json_decoder()
        return self._read(path, lambda data: decode(_unsealed(data, path.name)))

    def read_plan(self, *, sha256: str | None = None):
        """The plan, which validate_index writes as its bare bytes: doit
        compares them (a dependency of assemble and publish), and every build
        checks them against the sha256 kept with the store's state before
        any step trusts them. With ``sha256``, bytes without it are an
        ``IntegrityError`` (another build's plan, or one cut short)."""
        decode = _json_decoder()
        if sha256 is None:
            return self._read(self.plan, decode)

        def decode_if_same(data: bytes):
            if hashlib.sha256(data).hexdigest() != sha256:
                raise IntegrityError("INTEGRITY_ERROR", "cache record is not the one expected", path=self.plan.name)
            return decode(data)

        return self._read(self.plan, decode_if_same)

    def read_plan_and_sha256(self) -> tuple:
        """:meth:`read_plan`, with the sha256 of the bytes it decoded."""
        decode = _json_decoder()
        return self._read(self.plan, lambda data: (decode(data), hashlib.sha256(data).hexdigest()))

    def read_bytes(self, path: Path, limit: int | None = None) -> bytes:
        """One record's bytes, bounded like every record read (or by ``limit``
        when larger: an output as large as its own limit allows)."""
        return self._read(path, bytes, limit)

    def read_bytes_and_version(self, path: Path, limit: int | None = None) -> tuple[bytes, tuple]:
        """:meth:`read_bytes`, with the version of the file the bytes were read
        from (:func:`pipeline.doitcli.file_version`, from the same open file)."""
        version = []
        data = self._read(path, bytes, limit, version)
        return data, version[0]

    def read_json_fast(self, path: Path):
        """:meth:`read_json` through msgspec, for the records a build reads by the
        hundred or by the megabyte. Not the default: importing msgspec costs a
        no-op rebuild, which reads only small records, about 10 ms."""
        import msgspec

        return self._read(path, lambda data: msgspec.json.decode(_unsealed(data, path.name)))

    def read_msgpack(self, path: Path, kind):
        """A MessagePack record decoded as ``kind`` (a wrong shape is a corrupt record)."""
        import msgspec

        return self._read(path, lambda data: msgspec.msgpack.decode(_unsealed(data, path.name), type=kind))

    def write_msgpack(self, path: Path, value) -> None:
        import msgspec

        self.write(path, _sealed(msgspec.msgpack.encode(value)))

    def _read(self, path: Path, decode, limit: int | None = None, version: list | None = None):
        # O_NONBLOCK: a FIFO in a record's place must not hold the open (status
        # waited on one forever); only a regular file is a record.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        try:
            # Sized from fstat: asking read() for the limit would allocate it whole.
            bound = max(_CACHE_RECORD_LIMIT, limit or 0)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IntegrityError("INTEGRITY_ERROR", "cache record is not a regular file", path=path.name)
            size = st.st_size
            if version is not None:
                version.append((os.fspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
            if size > bound:
                raise IntegrityError("INTEGRITY_ERROR", "cache record too large", path=path.name)
            chunks = []
            remaining = size + 1  # one more byte tells a record that grew meanwhile
            while remaining > 0:
                chunk = os.read(fd, remaining)
                if not chunk:
                    break
                chunks.append(chunk)
                remaining -= len(chunk)
        finally:
            os.close(fd)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if len(data) > bound:
            raise IntegrityError("INTEGRITY_ERROR", "cache record too large", path=path.name)
        try:
            return decode(data)
        except ValueError as error:  # msgspec.DecodeError is a ValueError too
            raise IntegrityError("INTEGRITY_ERROR", f"corrupt cache record: {error}", path=path.name) from None
        except RecursionError:  # nesting deeper than a decoder follows: damaged too
            raise IntegrityError("INTEGRITY_ERROR", "corrupt cache record: nested too deeply", path=path.name) from None


# Every record but the plan and the outputs ends in the SHA-256 of the bytes
# before it. A record is named by what it was derived from, never by its own
# bytes, and several feed what a build publishes (a parsed manifest becomes
# the base of the next one; an input's record, the case's statements; the
# memos, the summary's lines). Damage that still decodes (one flipped byte
# in a string) would otherwise be published; sealed, it reads as a corrupt
# record, which is made again from the content it came from.
_SEAL_BYTES = 32


def _sealed(payload: bytes) -> bytes:
    return payload + hashlib.sha256(payload).digest()


def _unsealed(data: bytes, name: str) -> bytes:
    payload = data[:-_SEAL_BYTES]
    if len(data) < _SEAL_BYTES or hashlib.sha256(payload).digest() != data[-_SEAL_BYTES:]:
        raise IntegrityError("INTEGRITY_ERROR", "corrupt cache record: its bytes are not the ones written", path=name)
    return payload


def _json_decoder():
    msgspec = sys.modules.get("msgspec")
    return json.loads if msgspec is None else msgspec.json.decode


def _shaped_as_an_outline(outline: dict) -> bool:
    """Whether a cached record has an outline's shape (a forged or buggy one
    is made again from the manifest's bytes, never a traceback)."""
    artifacts = outline.get("artifacts")
    return (
        set(outline) == {"package_generation", "case_id", "package_id", "analysis_revision", "artifacts"}
        and all(type(outline[key]) is int for key in ("package_generation", "analysis_revision"))
        and all(type(outline[key]) is str for key in ("case_id", "package_id"))
        and type(artifacts) is dict
        and all(type(key) is str and type(value) is str for key, value in artifacts.items())
    )


def _shaped_as_a_manifest(manifest: dict) -> bool:
    """Whether a cached record has the stored manifest's shape, as its Struct
    decides (in C, a fraction of the full check it stands for)."""
    import msgspec

    from contracts.structs import STRUCTS

    try:
        msgspec.convert(manifest, STRUCTS["package-manifest"])
    except (msgspec.ValidationError, RecursionError):
        return False
    return True


class ParsedManifests:
    """A package's checked manifests as MessagePack records, under the sha256
    of the manifest's bytes (and the builder code, like every record here).
    Only a head start: a record that cannot be read is as if absent, and one
    that cannot be written is skipped."""

    def __init__(self, cache: BuildCache, *, keep_loaded: bool = True) -> None:
        """``keep_loaded=False`` keeps only manifests this process publishes:
        a command that fails leaves the workspace, cache included, as it was."""
        self.cache = cache
        self.keep_loaded = keep_loaded
        self._damaged: set[str] = set()

    def get(self, sha256: str) -> dict | None:
        try:
            manifest = self.cache.read_msgpack(self.cache.manifest_record(sha256), dict)
        except OSError:
            return None
        except IntegrityError:
            # Cut short by a power loss, say: written again by the put that
            # follows the parse, or every later command would parse it again.
            self._damaged.add(sha256)
            return None
        if not _shaped_as_a_manifest(manifest):
            # Sealed but not a manifest (a builder's bug, a record forged
            # with a valid seal): parsed again from the bytes, never a traceback.
            self._damaged.add(sha256)
            return None
        return manifest

    def get_outline(self, sha256: str) -> dict | None:
        """A manifest's outline (:func:`pipeline.packages.outline_of`), or None."""
        try:
            outline = self.cache.read_msgpack(self.cache.manifest_outline_record(sha256), dict)
        except (OSError, IntegrityError):
            return None  # made again from the manifest, and written again
        return outline if _shaped_as_an_outline(outline) else None

    def put_outline(self, sha256: str, outline: dict) -> None:
        if not self.keep_loaded:
            return
        try:
            self.cache.write_msgpack(self.cache.manifest_outline_record(sha256), outline)
        except OSError:
            pass

    def put(self, sha256: str, manifest: dict, *, published: bool = False) -> None:
        if not (published or self.keep_loaded):
            return
        record = self.cache.manifest_record(sha256)
        try:
            if sha256 in self._damaged or not record.exists():
                self.cache.write_msgpack(record, manifest)
                self._damaged.discard(sha256)
        except OSError:
            pass

"""The disposable build cache under ``<workspace>/.cache/<case_id>/``.

Nothing here is published: deleting the cache only makes the next build redo
work, and never changes an output, because every cached record is keyed by
the sha256 of the immutable content it was derived from. Cache files are
replaced atomically (temp + rename) so a crash never leaves a torn record;
that rename is fine here precisely because cache files are not append-only
content (published files are only ever created with ``os.link``).
"""

from __future__ import annotations

import os
from pathlib import Path

from .jsoncanon import canonical_bytes, decode_strict

__all__ = ["BuildCache"]

_CACHE_RECORD_LIMIT = 64 * 1024 * 1024


class BuildCache:
    """Paths and atomic writes for one case's intermediate task targets."""

    def __init__(self, case_cache_dir: Path) -> None:
        self.root = Path(case_cache_dir)

    @property
    def dep_file(self) -> Path:
        return self.root / "doit.sqlite3"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def store_state(self) -> Path:
        return self.root / "store-state.json"

    def document(self, sha256: str, contract: str) -> Path:
        return self.root / "documents" / f"{sha256}.{contract}.json"

    def opaque(self, sha256: str, size: int) -> Path:
        return self.root / "opaque" / f"{sha256}.{size}.json"

    @property
    def case_json(self) -> Path:
        return self.root / "out" / "case.json"

    @property
    def summary(self) -> Path:
        return self.root / "out" / "case_summary.md"

    @property
    def published(self) -> Path:
        return self.root / "out" / "published.json"

    def write(self, path: Path, data: bytes) -> None:
        """Atomically replace one cache record (never used for published files)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)

    def write_json(self, path: Path, value) -> None:
        self.write(path, canonical_bytes(value))

    def read_json(self, path: Path):
        return decode_strict(path.read_bytes(), max_bytes=_CACHE_RECORD_LIMIT, path=str(path.name))

"""BuildCache: atomic records that leave nothing behind when a write fails."""

from __future__ import annotations

import os

import pytest

from pipeline.cache import BuildCache


def test_a_failed_write_leaves_no_temp_file_and_the_old_record(tmp_path):
    cache = BuildCache(tmp_path / "c1")
    cache.write_json(cache.plan, {"a": 1})
    cache.plan.with_name("plan.json.blocked").mkdir()
    target = cache.root / "blocked"
    target.mkdir()
    (target / "inside").write_text("x")  # os.replace onto a non-empty directory fails
    with pytest.raises(OSError):
        cache.write(target, b"new")
    assert sorted(p.name for p in cache.root.iterdir()) == ["blocked", "plan.json", "plan.json.blocked"]
    assert cache.read_json(cache.plan) == {"a": 1}


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path):
    cache = BuildCache(tmp_path / "c1")
    cache.write_json(cache.plan, {"a": 1})
    cache.write(cache.case_json, b"{}")
    record = cache.input_record("original/r.json", "ab" * 32, "bug-report", 16384)
    cache.write_json(record, {"fragment": {}})
    stale = [cache.root / ".plan.json.4242.tmp", cache.case_json.with_name(".case.json.4242.tmp"),
             record.with_name(f".{record.name}.4242.tmp"), cache.root / "opaque" / ".x.json.7.tmp"]
    (cache.root / "opaque").mkdir()
    for path in stale:
        path.write_bytes(b"half")
    keep = cache.root / "out" / ".hidden-but-not-temp"
    keep.write_bytes(b"kept")
    assert cache.remove_stale_temps() == len(stale)
    assert not any(path.exists() for path in stale)
    assert keep.exists() and cache.read_json(cache.plan) == {"a": 1} and record.exists()
    assert cache.remove_stale_temps() == 0

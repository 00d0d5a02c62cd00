"""BuildCache: atomic records that leave nothing behind when a write fails."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cache import BuildCache
from pipeline.errors import VianoError


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
    record = cache.input_record("original/r.json", "ab" * 32, "report", 16384)
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


def test_a_dep_file_locked_by_another_process_is_not_taken_for_damage(tmp_path):
    """Only a damaged dep file is discarded; one another process holds is kept."""
    import sqlite3
    import subprocess
    import sys

    from pipeline.doitcli import _discard_if_corrupt

    dep = tmp_path / "doit.sqlite3"
    connection = sqlite3.connect(dep)
    connection.execute("create table doit (task_id text primary key, task_data text)")
    connection.commit()
    connection.close()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
         "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(60)", str(dep)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(VianoError) as held:
            _discard_if_corrupt(dep)
        assert held.value.code == "LOCK_TIMEOUT"
        assert dep.exists()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    dep.write_bytes(b"this is not sqlite" * 100)
    _discard_if_corrupt(dep)
    assert not dep.exists()


def test_an_unreadable_escape_memo_is_no_memo(tmp_path):
    from pipeline.build import _read_escape_memo

    cache = BuildCache(tmp_path)
    assert _read_escape_memo(cache) == {}  # absent
    cache.write_msgpack(cache.escape_memo, {"a long supplied text": "a long supplied text"})
    assert _read_escape_memo(cache) == {"a long supplied text": "a long supplied text"}
    for damaged in (b"\xc1garbage", b"", msgspec_bytes({"text": 3}), msgspec_bytes(["a", "b"])):
        cache.write(cache.escape_memo, damaged)
        assert _read_escape_memo(cache) == {}


def test_an_unreadable_line_memo_is_no_memo(tmp_path):
    from pipeline.build import _read_line_memo

    cache = BuildCache(tmp_path)
    assert _read_line_memo(cache) == {}
    cache.write_msgpack(cache.line_memo, {b'["","",{}]': "a line"})
    assert _read_line_memo(cache) == {b'["","",{}]': "a line"}
    for damaged in (b"\xc1garbage", b"", msgspec_bytes({"text": 3}), msgspec_bytes({"text": "str keys"}), msgspec_bytes(["a"])):
        cache.write(cache.line_memo, damaged)
        assert _read_line_memo(cache) == {}


def msgspec_bytes(value) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(value)


def test_escape_memos_of_other_builder_code_are_removed(tmp_path):
    cache = BuildCache(tmp_path)
    cache.write_msgpack(cache.escape_memo, {"a text of some length": "a text of some length"})
    other = cache.escape_memo.with_name("escapes.0123456789abcdef.msgpack")
    other.write_bytes(b"old")
    unrelated = cache.escape_memo.with_name("case.json")
    unrelated.write_bytes(b"{}")
    cache.remove_other_versions(cache.escape_memo)
    assert cache.escape_memo.exists() and unrelated.exists() and not other.exists()


def test_the_code_version_follows_the_unicode_tables(monkeypatch):
    import unicodedata

    from pipeline.doitcli import code_version

    mine = code_version.__wrapped__()
    assert code_version.__wrapped__() == mine == code_version()
    monkeypatch.setattr(unicodedata, "unidata_version", "0.0.1")
    assert code_version.__wrapped__() != mine


def test_temp_cleanup_spares_only_the_writes_in_flight_in_this_process(tmp_path):
    """Every build may run as the same pid (pid 1 in a container), so a temp
    file named with this process's pid may be a dead build's: only the temp
    files this process's threads are writing now are left alone."""
    from pipeline import cache as cache_module

    cache = BuildCache(tmp_path)
    cache.write(cache.case_json, b"{}")
    dead = cache.case_json.with_name(f".case.json.{os.getpid()}.12345.tmp")
    live = cache.case_json.with_name(f".case_summary.md.{os.getpid()}.67890.tmp")
    dead.write_bytes(b"half")
    live.write_bytes(b"being written")
    with cache_module._IN_FLIGHT_GUARD:
        cache_module._IN_FLIGHT.add(os.fspath(live))
    try:
        assert cache.remove_stale_temps() == 1
        assert not dead.exists() and live.exists()
    finally:
        with cache_module._IN_FLIGHT_GUARD:
            cache_module._IN_FLIGHT.discard(os.fspath(live))
    assert cache.remove_stale_temps() == 1 and not live.exists()
    cache.write(cache.summary, b"x")
    assert not cache_module._IN_FLIGHT  # a finished write is no longer in flight


def test_a_build_turn_is_reentrant_in_its_thread_and_times_out_for_others(tmp_path):
    import threading

    from pipeline.build import _thread_turn
    from pipeline.workspace import Workspace

    ws = Workspace(tmp_path)
    held, release, outcome = threading.Event(), threading.Event(), []

    def holder():
        with _thread_turn(ws, "c1"):
            with _thread_turn(ws, "c1"):  # nested in one thread: no deadlock
                held.set()
                release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    try:
        with _thread_turn(ws, "c1", timeout=0.2):
            outcome.append("entered")
    except VianoError as error:
        outcome.append(error.code)
    with _thread_turn(ws, "c2", timeout=0.2):  # another case is not held up
        outcome.append("other case")
    release.set()
    thread.join()
    with _thread_turn(ws, "c1", timeout=0.2):
        outcome.append("after")
    assert outcome == ["LOCK_TIMEOUT", "other case", "after"]


def test_doit_runs_end_without_collecting_what_is_left(tmp_path):
    """Shutdown's full collections over a built case cost tens of milliseconds:
    the doit integration freezes what is alive at exit, once per process."""
    import subprocess
    import sys

    script = (
        "import atexit, gc, os\n"
        "atexit.register(lambda: os.write(1, f'frozen={gc.get_freeze_count()}\\n'.encode()))\n"
        "from pipeline.doitcli import skip_the_exit_collections\n"
        "before = atexit._ncallbacks()\n"
        "skip_the_exit_collections(); skip_the_exit_collections()\n"
        "kept = [{'n': [i]} for i in range(50000)]\n"
        "print('registered', atexit._ncallbacks() - before)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines[:2] == ["registered", "1"]  # once, however often it is asked
    assert int(lines[2].split("=")[1]) >= 100000  # the list's dicts and lists among them


def test_a_dep_file_whose_folder_went_away_is_a_warning_and_the_build_goes_on(tmp_path, capsys):
    """The case's cache deleted while a build starts: sqlite cannot open the
    file there (its own OperationalError, which doit does not wrap). Found by
    session 18's review as a traceback; now the build runs without the record."""
    from doit.dependency import JSONCodec, SqliteDB

    from pipeline.doitcli import _read_the_dep_file_in_one_query

    _read_the_dep_file_in_one_query()
    db = SqliteDB(str(tmp_path / "gone" / "doit.sqlite3"), codec=JSONCodec())
    db.set("assemble", "_config_changed", "abc")
    assert db.get("assemble", "_config_changed") == "abc"
    db.dump()  # saves to memory and closes its connection
    assert capsys.readouterr().err == (
        "warning: IO_ERROR: the build's dependency file cannot be written (unable to open database file); "
        "the build goes on without it and the next build repeats its checks\n"
    )


def test_an_output_gone_before_its_digest_is_one_coded_line(tmp_path):
    from doit.exceptions import TaskFailed

    from pipeline.doitcli import output_digest

    failed = output_digest(tmp_path / "out" / "case.json")
    assert isinstance(failed, TaskFailed)
    assert failed.message.startswith("IO_ERROR: ") and "\n" not in failed.message


def test_the_dep_file_is_read_in_one_query_and_answers_as_doit_stored_it(tmp_path):
    """doit's sqlite3 backend queries the file once per task; the build's is
    read whole when opened (pipeline.doitcli._read_the_dep_file_in_one_query)."""
    from doit.dependency import JSONCodec, SqliteDB

    from pipeline.doitcli import _read_the_dep_file_in_one_query

    dep = str(tmp_path / "doit.sqlite3")
    _read_the_dep_file_in_one_query()
    first = SqliteDB(dep, codec=JSONCodec())
    for n in range(50):
        first.set(f"read_input:doc/{n}.json", "checker:", {"n": n, "names": ["a", "é"]})
    first.set("assemble", "_config_changed", "abc")
    first.dump()

    second = SqliteDB(dep, codec=JSONCodec())
    statements = []
    second._conn.set_trace_callback(statements.append)
    for n in range(50):
        assert second.in_(f"read_input:doc/{n}.json")
        assert second.get(f"read_input:doc/{n}.json", "checker:") == {"n": n, "names": ["a", "é"]}
    assert second.get("assemble", "_config_changed") == "abc"
    assert not second.in_("render") and second.get("render", "_config_changed") is None
    assert statements == []  # all of it answered from what opening read
    assert second._conn.execute("PRAGMA synchronous").fetchone()["synchronous"] == 0  # disposable: saved without syncs
    # What it saves stays readable record by record, as doit's own backend reads it.
    second.set("render", "_config_changed", "def")
    second.remove("read_input:doc/0.json")
    second.dump()
    plain = sqlite3.connect(dep)
    rows = dict(plain.execute("select task_id, task_data from doit"))
    plain.close()
    assert json.loads(rows["render"]) == {"_config_changed": "def"}
    assert "read_input:doc/0.json" not in rows and json.loads(rows["read_input:doc/1.json"])["checker:"]["n"] == 1


def test_the_one_query_dep_file_opens_under_doit_0_36_signature(tmp_path, monkeypatch):
    """doit 0.36's SqliteDB takes (name, codec) and no module_name; the
    adapted class passed module_name always, so every build under doit 0.36
    (which pyproject then allowed) ended in a TypeError traceback (session
    25's review; the floor is 0.37 now, for `clean --forget`, but a doit
    whose backend takes other arguments must not break the build). Stood in
    for by a subclass with 0.36's signature."""
    from doit import dependency
    from doit.dependency import JSONCodec

    from pipeline.doitcli import _read_the_dep_file_in_one_query

    class SqliteDB036(dependency.SqliteDB):
        def __init__(self, name, codec):
            super().__init__(name, codec)

    monkeypatch.setattr(dependency, "SqliteDB", SqliteDB036)
    _read_the_dep_file_in_one_query()
    assert getattr(SqliteDB036.__init__, "viano_one_query", False)
    dep = str(tmp_path / "doit.sqlite3")
    first = SqliteDB036(dep, codec=JSONCodec())
    first.set("assemble", "_config_changed", "abc")
    first.dump()
    assert SqliteDB036(dep, codec=JSONCodec()).get("assemble", "_config_changed") == "abc"
    # The fallback to a file in memory, when the folder is gone, too.
    assert SqliteDB036(str(tmp_path / "gone" / "doit.sqlite3"), codec=JSONCodec()).get("assemble", "x") is None


def test_no_cyclic_collection_runs_once_doit_has_loaded_the_dodo_file(tmp_path):
    """Between the steps doit loads and checks hundreds of tasks; collections
    it triggered traversed the build's live objects (~16 ms of an append
    rebuild). The collector stays off from the dodo file on."""
    built = _build_sample_watched(tmp_path / "ws", (
        "late = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and hasattr(sys.modules.get('dodo'), 'DOIT_CONFIG') and late.append(info))\n"
        "atexit.register(lambda: os.write(1, f'late-collections={len(late)}\\n'.encode()))\n"
    ))
    assert "late-collections=0" in built.stdout.splitlines()
    assert ".  publish" in built.stderr


def _build_sample_watched(ws: Path, watch: str):
    """Admit the sample into ``ws``, then build it with the real doit in a
    process that first runs ``watch`` (atexit, gc, hashlib, os and sys imported)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    doit = str(Path(sys.executable).with_name("doit"))
    admitted = subprocess.run([doit, "admit", "case=sample", f"source={repo / 'fixtures/sample'}", f"workspace={ws}"],
                              cwd=repo, capture_output=True, text=True)
    assert admitted.returncode == 0, admitted.stderr
    script = ("import atexit, gc, hashlib, os, sys\n" + watch
              + "sys.argv = ['doit', *sys.argv[1:]]\nfrom doit.__main__ import main\nmain()\n")
    built = subprocess.run([sys.executable, "-c", script, "build", "case=sample", f"workspace={ws}"],
                           cwd=repo, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return built


def test_a_build_hashes_each_output_it_publishes_once(tmp_path):
    """case.json and the summary were hashed three times each per build: for
    doit's dependency check, for case-built.json and by the package writer."""
    ws = tmp_path / "ws"
    built = _build_sample_watched(ws, (
        "sizes = []\n"
        "real_sha256, real_file_digest = hashlib.sha256, hashlib.file_digest\n"
        "def sha256(data=b'', **kw):\n"
        "    sizes.append(len(data)); return real_sha256(data, **kw)\n"
        "def file_digest(handle, name, **kw):\n"
        "    sizes.append(os.fstat(handle.fileno()).st_size); return real_file_digest(handle, name, **kw)\n"
        "hashlib.sha256, hashlib.file_digest = sha256, file_digest\n"
        "atexit.register(lambda: os.write(1, ('hashed ' + ' '.join(map(str, sizes)) + '\\n').encode()))\n"
    ))
    hashed = [int(n) for n in built.stdout.splitlines()[-1].split()[1:]]
    revision = next((ws / "cases/sample/packages").glob("*/content/case/revisions/0001"))
    for name in ("case.json", "case_summary.md"):
        assert hashed.count((revision / name).stat().st_size) == 1, name


def test_an_output_is_taken_from_memory_only_while_the_file_is_what_this_process_wrote(tmp_path):
    from pipeline.build import _WRITTEN, _read_output, _write_output

    cache = BuildCache(tmp_path / "c")
    first = b"{}" * 5000
    _write_output(cache, cache.case_json, first, "0" * 64)
    assert _read_output(cache, cache.case_json, 1 << 20) is first
    cache.write(cache.case_json, b"[]" * 5000)  # replaced behind the step's back (a new inode)
    assert _read_output(cache, cache.case_json, 1 << 20) == b"[]" * 5000
    _write_output(cache, cache.summary, b"# s\n", "0" * 64)
    cache.summary.unlink()
    with pytest.raises(FileNotFoundError):
        _read_output(cache, cache.summary, 1 << 20)
    # Only one case directory's outputs are held at a time.
    other = BuildCache(tmp_path / "c2")
    _write_output(other, other.case_json, b"{}", "0" * 64)
    assert [os.path.dirname(p) for p in _WRITTEN] == [os.fspath(other.case_json.parent)]


def test_an_output_larger_than_a_cache_record_is_read_up_to_its_own_limit(tmp_path, monkeypatch):
    import pipeline.cache
    from pipeline.build import _read_output

    monkeypatch.setattr(pipeline.cache, "_CACHE_RECORD_LIMIT", 1000)
    cache = BuildCache(tmp_path / "c")
    cache.write(cache.summary, b"x" * 5000)  # not written by this process: read from the file
    assert _read_output(cache, cache.summary, 5000) == b"x" * 5000
    with pytest.raises(VianoError) as too_large:
        _read_output(cache, cache.summary, 4999)
    assert too_large.value.code == "INTEGRITY_ERROR"


def test_a_dep_file_record_that_does_not_decode_makes_the_file_disposable(tmp_path):
    """quick_check sees the file's structure, not the JSON in its rows; such a
    row used to stop every build with a traceback once the file was read whole."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    doit = str(Path(sys.executable).with_name("doit"))
    ws = tmp_path / "ws"
    run = lambda *args: subprocess.run([doit, *args, "case=sample", f"workspace={ws}"], cwd=repo, capture_output=True, text=True)
    assert run("admit", f"source={repo / 'fixtures/sample'}").returncode == 0
    assert run("build").returncode == 0
    dep = ws / ".cache" / "sample" / "doit.sqlite3"
    # Bad JSON, nesting too deep to decode, and records that decode to no
    # object (on which doit itself fails when it reaches the task).
    for damage in ("{not json", "[" * 200000 + "]" * 200000, "5", "null", None):
        connection = sqlite3.connect(dep)
        connection.execute("insert or replace into doit values ('read_input:gone/old.json', ?)", (damage,))
        connection.commit()
        connection.close()
        again = run("build")
        assert again.returncode == 0, again.stderr
        assert "Traceback" not in again.stderr and "confirmed" in again.stdout
        plain = sqlite3.connect(dep)
        assert "read_input:gone/old.json" not in dict(plain.execute("select task_id, task_data from doit"))
        plain.close()
    assert run("build").returncode == 0


def test_dep_file_records_of_another_shape_make_the_file_disposable(tmp_path):
    """Records that decode to objects of another shape (damage sqlite cannot
    see, another program's file): doit reads their parts without looking, and
    a build stopped with its traceback, every build after too, until the file
    was removed by hand; status failed on a record nested too deep to decode.
    Found by a review's 2,100-trial sweep of the dep file."""
    import subprocess
    import sys

    from pipeline.cache import is_file_state, sound_doit_record

    repo = Path(__file__).resolve().parent.parent
    doit = str(Path(sys.executable).with_name("doit"))
    ws = tmp_path / "ws"
    run = lambda *args: subprocess.run([doit, *args, "case=sample", f"workspace={ws}"], cwd=repo, capture_output=True, text=True)
    assert run("admit", f"source={repo / 'fixtures/sample'}").returncode == 0
    built = run("build")
    assert built.returncode == 0
    dep = ws / ".cache" / "sample" / "doit.sqlite3"

    def values_not_an_object(record):
        return {**record, "_values_:": 5}

    def deps_not_a_list(record):
        return {**record, "deps:": 5} if "deps:" in record else record

    def deps_of_lists(record):
        return {**record, "deps:": [[1]]} if "deps:" in record else record

    def file_states_not_lists(record):
        return {key: (value if key.endswith(":") else 5) for key, value in record.items()}

    def nested_too_deep(record):
        return None  # stands for a record nested 50,000 deep, written as text below

    for damage in (values_not_an_object, deps_not_a_list, deps_of_lists, file_states_not_lists, nested_too_deep):
        connection = sqlite3.connect(dep)
        rows = connection.execute("select task_id, task_data from doit").fetchall()
        assert len(rows) > 3
        for task_id, data in rows:
            damaged = damage(json.loads(data))
            text = "[" * 50000 + "]" * 50000 if damaged is None else json.dumps(damaged)
            connection.execute("update doit set task_data = ? where task_id = ?", (text, task_id))
        connection.commit()
        connection.close()
        status = run("status")
        assert status.returncode == 0 and "Traceback" not in status.stderr, (damage.__name__, status.stderr)
        again = run("build")
        assert again.returncode == 0 and "Traceback" not in again.stderr, (damage.__name__, again.stderr)
        assert again.stdout == built.stdout  # the same confirmed case, nothing published again
        connection = sqlite3.connect(dep)
        records = [json.loads(data) for _, data in connection.execute("select task_id, task_data from doit")]
        connection.close()
        assert records and all(sound_doit_record(record) for record in records), damage.__name__
        assert all(is_file_state(value) for record in records for key, value in record.items() if key.startswith("/"))


def test_a_program_that_loads_the_dodo_configuration_in_process_keeps_its_collector(tmp_path):
    import subprocess
    import sys

    script = ("import gc\nfrom pipeline.doitcli import doit_config\n"
              "doit_config(None, None, argv=['doit', 'list'])\nprint(gc.isenabled())\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"]


def test_python_dash_m_doit_is_doits_command_line_too(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    (tmp_path / "dodo.py").write_text(
        "import gc, sys\nsys.path.insert(0, %r)\nfrom pipeline.doitcli import doit_config\n"
        "DOIT_CONFIG = doit_config(None, None)\n"
        "def task_show():\n    return {'actions': [lambda: print('collector', gc.isenabled()) or None], 'verbosity': 2}\n" % str(repo))
    result = subprocess.run([sys.executable, "-m", "doit", "show"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "collector False" in result.stdout


def test_remembered_file_digests_stay_bounded_and_right(tmp_path, monkeypatch):
    """The digests a process remembers (one per file version doit checks) are
    bounded, oldest dropped first, so a process that builds case after case
    does not keep them all; a dropped one is computed again, the same."""
    import hashlib

    from pipeline import doitcli

    monkeypatch.setattr(doitcli, "_DIGESTS", {})
    monkeypatch.setattr(doitcli, "_DIGESTS_LIMIT", 8)
    files = []
    for i in range(30):
        path = tmp_path / f"f{i}"
        path.write_bytes(b"x" * i)
        files.append(path)
        assert doitcli._sha256_file(path) == hashlib.sha256(b"x" * i).hexdigest()
        assert len(doitcli._DIGESTS) <= 8
    assert os.fspath(files[-1]) in {key[0] for key in doitcli._DIGESTS}
    assert os.fspath(files[0]) not in {key[0] for key in doitcli._DIGESTS}
    assert doitcli._sha256_file(files[0]) == hashlib.sha256(b"").hexdigest()
    version = doitcli.remember_file_digest(files[1], b"x")
    assert doitcli._DIGESTS[version] == hashlib.sha256(b"x").hexdigest()


def test_a_file_version_read_whole_shares_its_digest_between_doit_s_check_and_the_steps(tmp_path, monkeypatch):
    """What doit's check of an output hashed is not hashed again by a step that
    reads that very version, and the other way round; bytes of another
    version, or not the whole file, are hashed for what they are."""
    import hashlib

    from pipeline import doitcli, jsoncanon
    from pipeline.cache import BuildCache

    monkeypatch.setattr(doitcli, "_DIGESTS", {})
    monkeypatch.setattr(jsoncanon, "_REMEMBERED_DIGESTS", [])
    cache = BuildCache(tmp_path)
    path = tmp_path / "out.json"
    path.write_bytes(b"a" * 5000)
    checked = doitcli._sha256_file(path)  # doit's check of the output
    data, version = cache.read_bytes_and_version(path)
    monkeypatch.setattr(jsoncanon.hashlib, "sha256", None)  # any hashing now fails loudly
    assert doitcli.digest_of_version(version, data) == checked
    assert jsoncanon.sha256_hex(data) == checked
    monkeypatch.undo()
    monkeypatch.setattr(doitcli, "_DIGESTS", {})
    path.write_bytes(b"b" * 6000)  # a new version: read first, checked after
    data, version = cache.read_bytes_and_version(path)
    assert doitcli.digest_of_version(version, data) == hashlib.sha256(b"b" * 6000).hexdigest()
    assert doitcli._DIGESTS[version] == hashlib.sha256(b"b" * 6000).hexdigest()
    part = data[:100] + b"c" * 4000
    assert doitcli.digest_of_version(version, part) == hashlib.sha256(part).hexdigest()  # not the whole file
    assert doitcli._DIGESTS[version] == hashlib.sha256(b"b" * 6000).hexdigest()


# A record as write_json writes it: JSON without NaN/Infinity or lone surrogates
# (inputs never hold them; the strict reader refuses them).
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_RECORDS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_TEXT, inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=_RECORDS)
def test_read_json_gives_the_same_value_whichever_decoder_it_takes(tmp_path_factory, value):
    # read_json takes msgspec once it is imported, the stdlib before: a record
    # must read back the same either way, down to int against float.
    import msgspec

    cache = BuildCache(tmp_path_factory.mktemp("c"))
    path = cache.root / "r.json"
    cache.write_json(path, value)
    data = path.read_bytes()[:-32]  # without the seal

    def typed(v):
        if isinstance(v, dict):
            return {k: typed(x) for k, x in v.items()}
        if isinstance(v, list):
            return [typed(x) for x in v]
        return (type(v).__name__, v)

    assert typed(msgspec.json.decode(data)) == typed(json.loads(data)) == typed(json.loads(json.dumps(value)))
    assert typed(cache.read_json(path)) == typed(json.loads(data))


def test_read_json_refuses_a_damaged_record_with_either_decoder(tmp_path, monkeypatch):
    import sys

    # read_json decodes through msgspec once something has imported it, else
    # through the stdlib: imported here, the test holds both alone or in a run.
    import msgspec  # noqa: F401

    cache = BuildCache(tmp_path)
    path = tmp_path / "r.json"
    for damaged in (b'{"a": 1', b'{"a": 1}x', b"\xff", b""):
        path.write_bytes(damaged)
        with pytest.raises(VianoError) as info:
            cache.read_json(path)
        assert info.value.code == "INTEGRITY_ERROR"
        with monkeypatch.context() as patch:
            patch.delitem(sys.modules, "msgspec")
            with pytest.raises(VianoError) as info:
                cache.read_json(path)
            assert info.value.code == "INTEGRITY_ERROR"


def test_the_late_case_lock_is_taken_once_and_only_for_the_run_that_started_before_its_case(tmp_path):
    # doit_config marks a build whose case did not exist yet; the mark is used
    # once (a later CaseBuilder.build in the process must not take a lock that
    # lasts until exit) and cleared by the next doit_config. In a process of
    # its own: doit_config sets up process-wide handling for a doit run.
    import subprocess
    import sys

    script = """
import sys
import pipeline.build
from pipeline import doitcli
from pipeline.workspace import Workspace

taken = []
pipeline.build.hold_case_lock = lambda ws, case_id: taken.append(case_id)
ws = Workspace(sys.argv[1])
doitcli.doit_config("c1", str(ws.root), argv=["doit", "build", "case=c1"])
doitcli.lock_if_admitted_since_the_start(ws, "c2")
first = list(taken)
doitcli.lock_if_admitted_since_the_start(ws, "c1")
doitcli.lock_if_admitted_since_the_start(ws, "c1")
second = list(taken)
doitcli.doit_config("c1", str(ws.root), argv=["doit", "build", "case=c1"])
doitcli.doit_config(None, None, argv=["doit", "list"])
doitcli.lock_if_admitted_since_the_start(ws, "c1")
print(first, second, taken)
"""
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ws")], capture_output=True, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] ['c1'] ['c1']"


@pytest.mark.parametrize(
    ("variables", "argv", "problem"),
    [
        ({"case": "c1", "source": "x", "worksapce": "/w"}, ["doit", "admit", "case=c1", "source=x", "worksapce=/w"], "unknown variable 'worksapce'"),
        ({"case": "c1", "extra": "1"}, ["doit", "build", "case=c1", "extra=1"], "unknown variable 'extra'"),
        ({"case": "c2"}, ["doit", "build", "case=c1", "case=c2"], "variable 'case' is given twice"),
        ({"case": "c1", "workspace": "a=b"}, ["doit", "build", "case=c1", "workspace=a=b"], None),
        # A loader option's value is not a variable (doit parses those first).
        ({"case": "c1"}, ["doit", "-f", "eq/repo=main/dodo.py", "status", "case=c1"], None),
        ({"case": "c1", "by": "human:a", "reason": "x=y"}, ["doit", "reopen", "case=c1", "by=human:a", "reason=x=y"], None),
        ({}, ["doit", "list"], None),
        (None, ["host.py", "mode=fast"], None),  # dodo.py loaded by another program: doit parsed nothing
    ],
)
def test_argument_problems_are_named_before_anything_runs(variables, argv, problem):
    from pipeline.doitcli import argument_problem

    found = argument_problem(variables, argv)
    assert (found is None) if problem is None else (found is not None and found.startswith(problem)), found


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["doit", "--backend=json", "build", "case=c1"], "backend"),
        (["doit", "--backe", "dbm", "build", "case=c1"], "backend"),  # getopt takes a prefix only one option has
        (["doit", "--db-file=/tmp/other.db", "build", "case=c1"], "db-file"),
        (["doit", "--check_file_uptodate=timestamp", "build", "case=c1"], "check_file_uptodate"),
        (["doit", "forget", "--backend=json", "case=c1"], "backend"),
        (["doit", "-f", "dodo.py", "-d", ".", "--db=x", "build", "case=c1"], "db-file"),
        # Only run has --continue: for the other commands --c is --check_file_uptodate.
        (["doit", "list", "--c=timestamp"], "check_file_uptodate"),
        (["doit", "info", "--c", "timestamp", "assemble", "case=c1"], "check_file_uptodate"),
        (["doit", "--always-execute", "build", "case=c1"], None),
        (["doit", "--c", "build", "case=c1"], None),  # not a unique prefix for run: doit refuses it itself
        (["doit", "build", "case=c1", "--", "--backend=json"], None),
        # The value of an option that takes one is not an option.
        (["doit", "-o", "--backend", "build", "case=c1"], None),
        (["doit", "--output-file", "--db", "build", "case=c1"], None),
        (["doit", "list"], None),
        (["doit", "help", "build"], None),
        (["doit", "-f", "dodo.py", "-d", ".", "status", "case=c1"], None),
    ],
)
def test_options_that_would_replace_the_build_record_are_refused(argv, option):
    from pipeline.doitcli import replaced_build_record_option

    found = replaced_build_record_option(argv)
    assert (found is None) if option is None else found.startswith(f"--{option} is set by the builder"), found


class _Records:
    """doit's dependency manager as declares_subtask reads it."""

    class ContentHashChecker:
        pass

    def __init__(self, stored: dict):
        self.stored = stored
        self.checker = self.ContentHashChecker()

    def _get(self, task_name, key):
        return self.stored.get((task_name, key))


@pytest.mark.parametrize(
    ("selection", "stored", "exists", "declared"),
    [
        (None, {}, True, True),  # not in a doit run: list, info, forget, ignore, another program
        ((False, ("build",)), {}, True, False),  # a run passes over it: left out
        ((False, ("build",)), {}, False, True),  # its record is missing: it has work
        ((True, ("build",)), {}, True, True),  # -a, or always from a config file
        ((False, ("read_input:original/a.json",)), {}, True, True),  # named on the command line
        ((False, ("hash_context:original/*",)), {}, True, True),
        ((False, ("read_input",)), {}, True, False),  # the group alone names no file
        ((False, ("build",)), {("read_input:original/a.json", "ignore:"): "1"}, True, True),
        ((False, ("build",)), {("read_input:original/a.json", "checker:"): "MD5Checker"}, True, True),
        ((False, ("build",)), {("read_input:original/a.json", "checker:"): "ContentHashChecker"}, True, False),
    ],
)
def test_a_per_file_task_is_left_out_only_where_doit_would_pass_over_it(tmp_path, monkeypatch, selection, stored, exists, declared):
    from doit.globals import Globals

    from pipeline import doitcli

    target = tmp_path / "record.json"
    if exists:
        target.write_text("{}")
    monkeypatch.setattr(Globals, "dep_manager", _Records(stored))
    token = doitcli._RUN_SELECTION.set(selection)
    try:
        assert doitcli.declares_subtask("read_input:original/a.json", str(target)) is declared
    finally:
        doitcli._RUN_SELECTION.reset(token)


def test_a_backend_option_is_one_coded_line_and_leaves_the_dep_file_alone(tmp_path):
    repo = Path(__file__).resolve().parent.parent
    doit = str(Path(sys.executable).parent / "doit")
    ws = tmp_path / "ws"
    common = ["-f", str(repo / "dodo.py")]
    assert subprocess.run([doit, *common, "admit", "case=c1", f"source={repo / 'fixtures' / 'sample'}", f"workspace={ws}"],
                          capture_output=True, cwd=tmp_path).returncode == 0
    assert subprocess.run([doit, *common, "build", "case=c1", f"workspace={ws}"], capture_output=True, cwd=tmp_path).returncode == 0
    before = {p: p.read_bytes() for p in (ws / ".cache").rglob("*") if p.is_file()}
    for option in ("--backend=json", "--backend=dbm"):
        refused = subprocess.run([doit, *common, option, "build", "case=c1", f"workspace={ws}"], capture_output=True, text=True,
                                 cwd=tmp_path)
        assert refused.returncode == 3
        assert refused.stderr.splitlines() == [f"INVALID_ARGUMENT: --backend is set by the builder (one sqlite3 dep file per case, "
                                               "under the case lock, checked by content hash); leave it out"]
    assert {p: p.read_bytes() for p in (ws / ".cache").rglob("*") if p.is_file()} == before


def test_every_variable_dodo_reads_is_a_known_one():
    import ast
    import re

    from pipeline.doitcli import VARIABLES

    # Read, not imported: importing dodo.py sets up a doit run in this process.
    source = (Path(__file__).resolve().parent.parent / "dodo.py").read_text(encoding="utf-8")
    read = set(re.findall(r'get_var\("([a-z_]+)"\)', source))
    commands = next(node.value for node in ast.parse(source).body
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_COMMANDS")
    read |= {name for *_, extra in ast.literal_eval(commands) for name in extra}
    assert read == VARIABLES


def test_a_misspelled_variable_changes_nothing_anywhere(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [str(Path(sys.executable).parent / "doit"), "-f", str(repo / "dodo.py"), "admit", "case=c1",
         f"source={repo / 'fixtures' / 'sample'}", f"worksapce={tmp_path / 'ws'}"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        "INVALID_ARGUMENT: unknown variable 'worksapce' (the variables are by, case, dest, reason, source, workspace)"
    ]
    assert list(tmp_path.iterdir()) == []  # no ./service-data, no ws


def test_a_plan_read_with_its_expected_sha256_refuses_other_bytes(tmp_path):
    import hashlib

    cache = BuildCache(tmp_path / "cache")
    cache.write(cache.plan, b'{"step":1}')  # the plan is its bare bytes: doit compares them
    written = hashlib.sha256(cache.plan.read_bytes()).hexdigest()
    assert cache.read_plan(sha256=written) == {"step": 1}
    assert cache.read_plan_and_sha256() == ({"step": 1}, written)
    cache.write(cache.plan, b'{"step":2}')  # an equally valid plan, not the expected one
    with pytest.raises(VianoError) as refused:
        cache.read_plan(sha256=written)
    assert refused.value.code == "INTEGRITY_ERROR"
    assert cache.read_plan() == {"step": 2}


@pytest.mark.parametrize("kind", ["json", "json_fast", "msgpack"])
def test_a_record_damaged_in_a_way_that_still_decodes_is_refused(tmp_path, kind):
    """One flipped letter in a string decodes as well as the record did: the
    seal, not the decoder, tells it (a damaged parsed manifest was published)."""
    import msgspec

    cache = BuildCache(tmp_path / "cache")
    path = cache.root / "r"
    value = {"project": {"name": "demo", "version": "2.4.1"}, "n": [1, 2.5, "x"]}
    getattr(cache, f"write_{kind}")(path, value)
    read = (lambda: cache.read_msgpack(path, dict)) if kind == "msgpack" else (lambda: getattr(cache, f"read_{kind}")(path))
    assert read() == value
    data = path.read_bytes()
    damaged = data.replace(b"2.4.1", b"2.4.2")
    assert damaged != data
    payload = damaged[:-32]
    assert (msgspec.msgpack.decode(payload) if kind == "msgpack" else json.loads(payload))["project"]["version"] == "2.4.2"
    path.write_bytes(damaged)
    with pytest.raises(VianoError) as refused:
        read()
    assert refused.value.code == "INTEGRITY_ERROR" and "not the ones written" in refused.value.message
    for cut in (b"", data[:20], data[:-1]):
        path.write_bytes(cut)
        with pytest.raises(VianoError):
            read()


def test_a_record_write_that_fails_names_the_record(tmp_path):
    """A full disk fails the write() itself, whose OSError names no file: the
    build's IO_ERROR line named none ("IO_ERROR: No space left on device").
    Here a file size limit fails it the same way, in a real process."""
    import subprocess
    import sys

    script = (
        "import resource, signal, sys\n"
        "from pipeline.cache import BuildCache\n"
        "from pipeline.errors import coded_io_error\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "cache = BuildCache(sys.argv[1])\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        "    cache.write(cache.case_json, b'x' * 4096)\n"
        "except OSError as error:\n"
        "    print(coded_io_error(error))\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache")], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("IO_ERROR: ") and run.stdout.rstrip().endswith(f"({tmp_path / 'cache' / 'out' / 'case.json'})"), run.stdout
    assert not list((tmp_path / "cache" / "out").iterdir())  # no temp left holding space


def test_a_parsed_manifest_record_cut_short_is_written_again(tmp_path):
    """A record cut short (a power loss) reads as absent; the parse that
    follows must put it back whole, or every later command parses again."""
    cache = BuildCache(tmp_path / "cache")
    parsed = cache.parsed_manifests()
    digest = "ab" * 32
    manifest = {"format": "viano-package", "format_version": 1, "case_id": "c1", "package_id": "p1", "package_generation": 3,
                "analysis_revision": 1, "project": {"name": "demo", "version": "1"}, "artifacts": {},
                "files": {"original/a.json": {"sha256": "cd" * 32, "size": 10}}}
    parsed.put(digest, manifest)
    assert cache.parsed_manifests().get(digest) == manifest
    record = cache.manifest_record(digest)
    whole = record.read_bytes()
    record.write_bytes(whole[: len(whole) // 3])
    later = cache.parsed_manifests()  # the next command's
    assert later.get(digest) is None
    later.put(digest, manifest)
    assert record.read_bytes() == whole and cache.parsed_manifests().get(digest) == manifest


def test_an_output_is_up_to_date_only_with_the_source_its_step_made_it_from(tmp_path):
    """doit's record of a file dependency can be made current without the
    step running (`doit reset-dep`); the digest of the source the step made
    its output from, recorded with the output's, cannot."""
    import hashlib

    from pipeline.build import _write_output
    from pipeline.doitcli import OUTPUT_DIGEST, SOURCE_DIGEST, output_as_written, output_digest

    cache = BuildCache(tmp_path / "c")
    cache.write(cache.plan, b'{"plan": 1}')
    plan_digest = hashlib.sha256(b'{"plan": 1}').hexdigest()
    _write_output(cache, cache.case_json, b'{"case": 1}', plan_digest)
    values = output_digest(cache.case_json)
    assert values == {OUTPUT_DIGEST: hashlib.sha256(b'{"case": 1}').hexdigest(), SOURCE_DIGEST: plan_digest}
    assert output_as_written(None, values, cache.case_json, cache.plan)
    assert not output_as_written(None, {OUTPUT_DIGEST: values[OUTPUT_DIGEST]}, cache.case_json, cache.plan)
    cache.write(cache.plan, b'{"plan": 2}')  # planned again; assemble has not run on it
    assert not output_as_written(None, values, cache.case_json, cache.plan)
    cache.write(cache.case_json, b'{"case": 2}')  # an output this process did not write: no source to vouch for
    assert SOURCE_DIGEST not in output_digest(cache.case_json)


def test_document_records_of_older_builder_code_are_removed_but_the_newest(tmp_path):
    """The folders of records that older builder code left under
    ``documents/`` (none of them is read again) go, but for the most recently
    written one: two builders taking turns on a workspace keep their own."""
    cache = BuildCache(tmp_path / "c1")
    record = cache.input_record("original/a.json", "0" * 64, "report", 16384)
    documents = record.parent
    assert documents.parent == cache.root / "documents"
    assert cache.remove_other_builders_records() == 0  # no cache yet
    cache.write_json(record, {"kept": True})
    for age, older in enumerate(("0123456789abcdef", "fedcba9876543210", "00000000aaaaaaaa")):
        (documents.parent / older / "sub").mkdir(parents=True)
        (documents.parent / older / "record.json").write_text("{}")
        os.utime(documents.parent / older, ns=(10**18 - age * 10**9, 10**18 - age * 10**9))
    assert cache.remove_other_builders_records() == 2
    assert sorted(p.name for p in documents.parent.iterdir()) == sorted([documents.name, "0123456789abcdef"])
    assert cache.read_json(record) == {"kept": True}
    assert cache.remove_other_builders_records() == 0  # the newest other stays, build after build
    assert sorted(p.name for p in documents.parent.iterdir()) == sorted([documents.name, "0123456789abcdef"])


def test_the_content_hash_checker_sees_a_change_that_keeps_size_and_mtime(tmp_path):
    """RELIABILITY 43: doit's default checker trusts mtime, and an archive that
    restores mtimes can hide a change; ours compares the bytes' sha256."""
    from pipeline.doitcli import ContentHashChecker

    checker = ContentHashChecker()
    dep = tmp_path / "dep.json"
    dep.write_bytes(b'{"a": 1}')
    state = checker.get_state(str(dep), None)
    kept = os.stat(dep)
    assert not checker.check_modified(str(dep), kept, state)
    dep.write_bytes(b'{"a": 2}')  # same size
    os.utime(dep, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    changed = os.stat(dep)
    assert (changed.st_size, changed.st_mtime_ns) == (kept.st_size, kept.st_mtime_ns)
    assert checker.check_modified(str(dep), changed, state)
    # The same bytes written again, with a new mtime: not a change.
    dep.write_bytes(b'{"a": 1}')
    assert not checker.check_modified(str(dep), os.stat(dep), state)
    assert checker.get_state(str(dep), state) is None

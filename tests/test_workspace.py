"""Tests for pipeline.workspace: ids, references, layout, the flock case lock, nofollow opens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import VianoError
from pipeline.workspace import (
    Workspace,
    case_lock,
    check_reference,
    makedirs_nofollow,
    open_dir_nofollow,
    open_nofollow,
    validate_id,
)

PROCS = Path(__file__).parent / "procs"


# ---------------------------------------------------------------- ids


@pytest.mark.parametrize("good", ["a", "case-A", "A.b_c-9", "0" * 128])
def test_validate_id_accepts(good):
    assert validate_id(good, "case id") == good


@pytest.mark.parametrize(
    "bad", ["", "-a", ".hidden", "a/b", "a b", "a\n", "é", "0" * 129, "..", "a\\b", None, 7]
)
def test_validate_id_refuses(bad):
    with pytest.raises(VianoError) as info:
        validate_id(bad, "case id")
    assert info.value.code == "UNSAFE_ID"


# ---------------------------------------------------------------- references


@pytest.mark.parametrize(
    "good",
    ["original/report.data", "a", "a/b/c.txt", "%2e%2e/x", "%2e%2e", "..a", "a..", ".hidden", "a/C:x", "日本/ファイル"],
)
def test_check_reference_accepts(good):
    # %2e%2e is never URL-decoded: it is a literal (harmless) name.
    assert check_reference(good) == good


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "../x",
        "a/../b",
        "a/..",
        "..",
        ".",
        "./a",
        "a/./b",
        "/etc/passwd",
        "//host/share",
        "C:/x",
        "C:x",
        "c:",
        "a\\b",
        "..\\x",
        "a//b",
        "a/",
        "a\x00b",
        "a\nb",
        "a\tb",
        "a\x7fb",
        "a\u202eb",
        "a\u2066b",
        "a\u200fb",
        "a\u2028b",
        "x" * 256,
        "\ud800",
    ],
)
def test_check_reference_refuses(bad):
    with pytest.raises(VianoError) as info:
        check_reference(bad)
    assert info.value.code == "REFERENCE_UNSAFE"
    assert info.value.path == bad


@pytest.mark.parametrize("ref, first", [
    ("\u0301" * 3000 + "a\u202eb\x01c\u2028", "U+202E"),
    ("\u0301" * 3000 + "a\x01b\u202ec\u2028", "U+0001"),
    ("e\u0301/\u2028\u202e\x01", "U+2028"),
])
def test_a_reference_names_its_first_unsafe_character_however_long(ref, first):
    """Each distinct character is judged once (a 3.9 KB path of marks took
    1 ms per check, a status of 4,000 such files seconds); the message still
    names the first unsafe one in the path."""
    with pytest.raises(VianoError) as info:
        check_reference(ref)
    assert f"character {first} in reference" in info.value.message


def test_check_reference_refuses_non_string():
    with pytest.raises(VianoError) as info:
        check_reference(b"a")
    assert info.value.code == "REFERENCE_UNSAFE"


# ---------------------------------------------------------------- layout


def test_workspace_layout(tmp_path):
    ws = Workspace(tmp_path)
    assert ws.store_path == tmp_path / "checkpoints.sqlite3"
    assert ws.cases_dir == tmp_path / "cases"
    assert ws.case_dir("c1") == tmp_path / "cases" / "c1"
    assert ws.package_dir("c1", "p1") == tmp_path / "cases" / "c1" / "packages" / "p1"
    assert ws.cache_dir("c1") == tmp_path / ".cache" / "c1"
    assert ws.staging_dir() == tmp_path / ".staging"
    assert ws.lock_path("c1") == tmp_path / ".locks" / "c1.lock"
    assert not any(tmp_path.iterdir())  # pure path arithmetic
    with pytest.raises(VianoError) as info:
        ws.case_dir("../x")
    assert info.value.code == "UNSAFE_ID"


def test_workspace_from_var(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VIANO_WORKSPACE", raising=False)
    assert Workspace.from_var(None).root == tmp_path / "service-data"
    monkeypatch.setenv("VIANO_WORKSPACE", str(tmp_path / "env"))
    assert Workspace.from_var(None).root == tmp_path / "env"
    assert Workspace.from_var("rel").root == tmp_path / "rel"
    assert Workspace.from_var(str(tmp_path / "abs")).root == tmp_path / "abs"


@pytest.mark.parametrize("given", ["", " ", "\t"])
def test_an_empty_workspace_variable_is_refused_not_taken_for_the_default(tmp_path, monkeypatch, given):
    # workspace=$DIR with DIR unset must not quietly pick ./service-data.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VIANO_WORKSPACE", raising=False)
    with pytest.raises(VianoError) as info:
        Workspace.from_var(given)
    assert info.value.code == "INVALID_ARGUMENT"


def test_an_empty_environment_variable_counts_as_unset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VIANO_WORKSPACE", "")
    assert Workspace.from_var(None).root == tmp_path / "service-data"


# ---------------------------------------------------------------- open_nofollow


@pytest.fixture
def tree(tmp_path):
    base = tmp_path / "content"
    (base / "dir" / "sub").mkdir(parents=True)
    (base / "dir" / "sub" / "f.txt").write_bytes(b"hello")
    (base / "%2e%2e").write_bytes(b"literal")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    os.symlink(outside, base / "linkdir")
    os.symlink(outside / "secret", base / "dir" / "linkfile")
    os.symlink("sub", base / "dir" / "relink")
    return base


def _read(fd):
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


def test_open_nofollow_reads_plain_files(tree):
    assert _read(open_nofollow(tree, "dir/sub/f.txt")) == b"hello"
    assert _read(open_nofollow(tree, "%2e%2e")) == b"literal"


@pytest.mark.parametrize("ref", ["linkdir/secret", "dir/linkfile", "dir/relink/f.txt", "linkdir"])
def test_open_nofollow_refuses_symlinks(tree, ref):
    with pytest.raises(VianoError) as info:
        open_nofollow(tree, ref)
    assert info.value.code == "REFERENCE_UNSAFE"
    assert info.value.path == ref


@pytest.mark.parametrize("ref", ["nope", "dir/nope", "nope/x", "dir/sub/f.txt/x"])
def test_open_nofollow_missing(tree, ref):
    with pytest.raises(VianoError) as info:
        open_nofollow(tree, ref)
    assert info.value.code == "REFERENCE_MISSING"


def test_open_nofollow_refuses_fifo_without_blocking(tree):
    os.mkfifo(tree / "fifo")
    with pytest.raises(VianoError) as info:
        open_nofollow(tree, "fifo")
    assert info.value.code == "REFERENCE_UNSAFE"


def test_open_nofollow_checks_reference(tree):
    with pytest.raises(VianoError) as info:
        open_nofollow(tree, "../outside/secret")
    assert info.value.code == "REFERENCE_UNSAFE"


def test_open_nofollow_create(tree):
    fd = open_nofollow(tree, "dir/new.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    os.write(fd, b"x")
    os.close(fd)
    assert (tree / "dir" / "new.txt").read_bytes() == b"x"
    with pytest.raises(VianoError) as info:  # creating through a symlinked directory
        open_nofollow(tree, "linkdir/new", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    assert info.value.code == "REFERENCE_UNSAFE"
    assert not (tree.parent / "outside" / "new").exists()


def test_makedirs_nofollow(tree):
    base_fd = open_dir_nofollow(tree)
    try:
        fd, created = makedirs_nofollow(base_fd, "dir/a/b")
        os.close(fd)
        for other in created:
            os.close(other)
        assert len(created) == 2 and (tree / "dir" / "a" / "b").is_dir()
        with pytest.raises(VianoError) as info:
            makedirs_nofollow(base_fd, "linkdir/x")
        assert info.value.code == "REFERENCE_UNSAFE"
        assert not (tree.parent / "outside" / "x").exists()
        with pytest.raises(VianoError) as info:
            makedirs_nofollow(base_fd, "dir/sub/f.txt/x")
        assert info.value.code == "CONTENT_CONFLICT"
    finally:
        os.close(base_fd)


# ---------------------------------------------------------------- case_lock


def _start_holder(ws_root: Path, ready: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(PROCS / "lock_holder.py"), str(ws_root), "c1", str(ready)])
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert proc.poll() is None, "lock holder died"
        assert time.monotonic() < deadline, "lock holder never took the lock"
        time.sleep(0.01)
    return proc


def test_lock_timeout_then_sigkill_releases(tmp_path):
    ws = Workspace(tmp_path / "ws")
    holder = _start_holder(ws.root, tmp_path / "ready")
    try:
        marker = tmp_path / "ran"
        started = time.monotonic()
        with pytest.raises(VianoError) as info:
            with case_lock(ws, "c1", timeout=0.3):
                marker.write_text("should not happen")
        waited = time.monotonic() - started
        assert info.value.code == "LOCK_TIMEOUT"
        assert 0.3 <= waited < 5
        assert not marker.exists()  # nothing changed
        # Other cases are not affected by c1's lock.
        with case_lock(ws, "c2", timeout=0.3):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    # The kernel released the dead holder's flock.
    with case_lock(ws, "c1", timeout=5):
        marker.write_text("ran")
    assert marker.read_text() == "ran"


def test_lock_waiter_gets_lock_when_holder_dies_during_wait(tmp_path):
    ws = Workspace(tmp_path / "ws")
    holder = _start_holder(ws.root, tmp_path / "ready")
    killer = None
    try:
        import threading

        killer = threading.Timer(0.2, lambda: holder.send_signal(signal.SIGKILL))
        killer.start()
        with case_lock(ws, "c1", timeout=10):
            assert holder.wait(timeout=10) == -signal.SIGKILL
    finally:
        if killer is not None:
            killer.cancel()
        if holder.poll() is None:
            holder.kill()
        holder.wait()


_TRY_LOCK = (
    "import sys\n"
    "from pipeline.errors import VianoError\n"
    "from pipeline.workspace import Workspace, case_lock\n"
    "try:\n"
    "    with case_lock(Workspace(sys.argv[1]), sys.argv[2], timeout=float(sys.argv[3])):\n"
    "        print('got')\n"
    "except VianoError as exc:\n"
    "    print(exc.code)\n"
)


def _other_process_tries(ws: Workspace, case_id: str = "c1", timeout: float = 0.2) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _TRY_LOCK, str(ws.root), case_id, str(timeout)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_lock_is_reentrant_per_process_and_exclusive_across_processes(tmp_path):
    """Re-entrancy is per process, not per thread: a nested case_lock from any
    thread of the holding process joins at once; other processes wait until
    the last holder (whichever leaves last) is gone."""
    import threading

    from pipeline.workspace import held_case_locks

    ws = Workspace(tmp_path / "ws")
    inner_entered = threading.Event()
    leave_inner = threading.Event()
    results = []

    def other_thread():
        try:
            with case_lock(ws, "c1", timeout=0):  # timeout 0: would fail if it had to wait
                results.append("got")
                inner_entered.set()
                leave_inner.wait(30)
        except VianoError as exc:
            results.append(exc.code)
            inner_entered.set()

    with case_lock(ws, "c1", timeout=1):
        with case_lock(ws, "c1", timeout=0):  # nested in this thread: no self-deadlock
            pass
        assert held_case_locks() == [(os.path.realpath(ws.root), "c1")]
        t = threading.Thread(target=other_thread)
        t.start()
        assert inner_entered.wait(30)
        assert results == ["got"]
        assert _other_process_tries(ws) == "LOCK_TIMEOUT"
        assert _other_process_tries(ws, "c2") == "got"  # other cases are free
    # The outer holder has left but the other thread still holds it: still locked.
    assert held_case_locks() == [(os.path.realpath(ws.root), "c1")]
    assert _other_process_tries(ws) == "LOCK_TIMEOUT"
    leave_inner.set()
    t.join(30)
    assert held_case_locks() == []
    assert _other_process_tries(ws) == "got"  # released by the last holder
    with case_lock(ws, "c1", timeout=0):
        pass


def test_lock_nests_across_spellings_of_one_workspace(tmp_path):
    """The record is keyed by the resolved root: a symlinked or relative spelling nests."""
    real = tmp_path / "ws"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with case_lock(Workspace(real), "c1", timeout=1):
        with case_lock(Workspace(link), "c1", timeout=0):
            pass
        with case_lock(Workspace(os.path.relpath(real)), "c1", timeout=0):
            pass


def test_a_never_exited_lock_keeps_excluding_other_processes(tmp_path):
    """build.hold_case_lock enters case_lock and never leaves; nested entries come and go."""
    ws = Workspace(tmp_path / "ws")
    manager = case_lock(ws, "c1", timeout=1)
    manager.__enter__()
    try:
        for _ in range(3):
            with case_lock(ws, "c1", timeout=0):
                pass
        assert _other_process_tries(ws) == "LOCK_TIMEOUT"
    finally:
        manager.__exit__(None, None, None)
    assert _other_process_tries(ws) == "got"


def test_nested_lock_released_on_exception(tmp_path):
    from pipeline.workspace import held_case_locks

    ws = Workspace(tmp_path / "ws")
    with pytest.raises(RuntimeError):
        with case_lock(ws, "c1", timeout=1):
            with case_lock(ws, "c1", timeout=0):
                raise RuntimeError("boom")
    assert held_case_locks() == []
    assert _other_process_tries(ws) == "got"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_does_not_inherit_the_lock_record(tmp_path):
    """A child forked while the parent holds the lock holds nothing; closing its
    inherited descriptor does not release the parent's flock."""
    ws = Workspace(tmp_path / "ws")
    with case_lock(ws, "c1", timeout=1):
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                from pipeline.workspace import held_case_locks

                if held_case_locks() == []:
                    try:
                        with case_lock(ws, "c1", timeout=0.2):
                            code = 2  # got a lock its parent holds: wrong
                    except VianoError as exc:
                        code = 0 if exc.code == "LOCK_TIMEOUT" else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _other_process_tries(ws) == "LOCK_TIMEOUT"  # the parent still holds it
    assert _other_process_tries(ws) == "got"


def test_lock_uses_flock_not_record_locks(tmp_path):
    """Closing another descriptor of the lock file must not drop the lock (the lockf trap)."""
    ws = Workspace(tmp_path / "ws")
    holder_code = (
        "import os, sys, time\n"
        "from pipeline.workspace import Workspace, case_lock\n"
        "ws = Workspace(sys.argv[1])\n"
        "with case_lock(ws, 'c1', timeout=5):\n"
        "    os.close(os.open(ws.lock_path('c1'), os.O_RDONLY))\n"
        "    open(sys.argv[2], 'w').close()\n"
        "    time.sleep(60)\n"
    )
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", holder_code, str(ws.root), str(ready)])
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(VianoError) as info:
            with case_lock(ws, "c1", timeout=0.2):
                pass
        assert info.value.code == "LOCK_TIMEOUT"
    finally:
        proc.kill()
        proc.wait()


def test_the_ascii_shortcut_of_the_reference_check_is_the_character_table():
    """For ASCII names the check skips the Unicode table: the shortcut must
    refuse exactly the characters the table refuses, one at a time and
    inside a name."""
    import unicodedata

    from pipeline import workspace

    for code in range(128):
        ch = chr(code)
        unsafe = ch in workspace._BIDI or unicodedata.category(ch) in workspace._UNSAFE_CATEGORIES
        problem = workspace._reference_problem(f"a/b{ch}c")
        if ch in "/\\":
            continue  # refused (or split) by their own rules
        assert (problem is not None and problem.startswith("control")) == unsafe, repr(ch)

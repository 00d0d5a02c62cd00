"""doit integration: configuration, the content-hash checker, error reporting.

``dodo.py`` only declares tasks; everything doit-specific that needs logic
lives here:

* :func:`doit_config` — one sqlite3 dep file per case under
  ``<workspace>/.cache/<case_id>/`` (doit's default dbm backend falls back to
  ``dbm.dumb`` here and is unsafe across processes), taken behind the case
  lock for the whole run; commands that keep no task state use an in-memory
  database so they never touch the workspace.
* :class:`ContentHashChecker` — file_deps are judged by size and sha256, never
  by mtime (doit's md5 checker trusts an unchanged mtime, RELIABILITY.md 43).
* :class:`OneLineReporter` — a failed command prints ``CODE: message`` on one
  line to stderr; doit's tracebacks are kept for genuine bugs only.
* :func:`guarded` — runs a pipeline function so a :class:`VianoError` becomes
  a doit ``TaskFailed`` carrying that one line.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import errno
import functools
import gc
import hashlib
import importlib
import os
import re
import stat
import sys
import threading
from pathlib import Path

from doit.dependency import FileChangedChecker
from doit.exceptions import TaskFailed
from doit.reporter import ConsoleReporter

from .cache import is_file_state, sound_doit_record
from .errors import CaseBuildError, VianoError, coded_io_error, one_line
from .interrupts import ignore_interrupts_from_now, report_interrupts_on_one_line

__all__ = ["ContentHashChecker", "OneLineReporter", "guarded", "doit_config", "code_version", "subtask_name", "declares_subtask", "BUILD_TASKS"]

#: Tasks that read or write a case's build cache; only these take the lock.
BUILD_TASKS = ("build", "validate_index", "read_input", "hash_context", "assemble", "render", "publish")
_CODE_LINE = re.compile(r"^[A-Z][A-Z_]+: ")


class ContentHashChecker(FileChangedChecker):
    """A file_dep changed iff its size or sha256 changed (mtime is ignored).

    A file that cannot be read counts as changed, and is recorded so: doit
    calls these outside any step of ours (``get_state`` once a task's action
    has run, to record what it depended on), where an ``OSError`` (a dying
    disk's EIO, a FIFO put in a cached output's place) became doit's own
    traceback and exit status 3 after the build had been confirmed. The task
    then runs again next time, and its step meets the fault with its code."""

    def check_modified(self, file_path, file_stat, state):
        if not is_file_state(state):
            return True  # not a state this checker recorded: judge the file changed
        size, digest = state
        if file_stat.st_size != size:
            return True
        try:
            return _sha256_file(file_path) != digest
        except OSError:
            return True

    def get_state(self, dep, current_state):
        try:
            state = (os.path.getsize(dep), _sha256_file(dep))
        except OSError:
            return UNREADABLE_STATE
        if is_file_state(current_state) and tuple(current_state) == state:
            return None
        return state


#: What :class:`ContentHashChecker` records for a file it could not read: no
#: file state, so the next check judges the file changed.
UNREADABLE_STATE = "unreadable"


_DIGESTS: dict[tuple, str] = {}
# A doit run needs a few hundred (one per input record it checks); a process
# that builds case after case (CaseBuilder) would otherwise keep every one.
_DIGESTS_LIMIT = 4096
_DIGESTS_GUARD = threading.Lock()  # builds of other cases may run in other threads


def _new_guard_in_child() -> None:
    global _DIGESTS_GUARD
    _DIGESTS_GUARD = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_guard_in_child)


def _remember_digest(key: tuple, digest: str) -> None:
    with _DIGESTS_GUARD:
        _DIGESTS[key] = digest
        if len(_DIGESTS) > _DIGESTS_LIMIT:
            # Oldest first (insertion order): they belong to earlier builds.
            for stale in list(_DIGESTS)[: len(_DIGESTS) - _DIGESTS_LIMIT // 2]:
                del _DIGESTS[stale]


def _sha256_file(path) -> str:
    """The file's sha256, computed once per process and file version: doit asks
    for case.json and the plan once per task that depends on them. The key
    holds the inode and change time, and cache files are only ever replaced
    by rename (a new inode), so a rewritten file is hashed anew."""
    # O_NONBLOCK: a FIFO put in a cached output's place must not hold the
    # build; it is no output (an OSError: "not as written", so remade).
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        key = (os.fspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        digest = _DIGESTS.get(key)
        if digest is None:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
            _remember_digest(key, digest)
        return digest


#: The doit value under which assemble and render keep the digest of the
#: output they wrote (``_values_:`` in the case's dependency file).
OUTPUT_DIGEST = "output_sha256"
#: ... and the digest of what they made it from: the plan (assemble), the
#: case (render). doit's own record of a file_dep says only what the file
#: was when the task last *succeeded or was declared so*: ``doit reset-dep``
#: records the current plan beside the old case's digest, and without this
#: the next build published the previous revision's case as the new one.
SOURCE_DIGEST = "source_sha256"

_SOURCES: dict[tuple, str] = {}  # output file version -> digest of its source


def remember_output(path, data: bytes, source_digest: str) -> tuple:
    """:func:`remember_file_digest`, and that this version of ``path`` was
    made from the bytes whose sha256 is ``source_digest``, which
    :func:`output_digest` hands to doit with the output's own digest."""
    version = remember_file_digest(path, data)
    with _DIGESTS_GUARD:
        _SOURCES[version] = source_digest
        for stale in list(_SOURCES)[: max(0, len(_SOURCES) - 64)]:
            del _SOURCES[stale]
    return version


def output_digest(path) -> dict:
    """A doit action after assemble's or render's step: the digest of the
    output the step just wrote and of what it made it from, saved by doit
    with the task's success. The step has remembered both
    (:func:`remember_output`), so nothing is read. An output this process
    did not write (none: the step always writes) gets no source digest, so
    the next build makes it again. Gone already (the cache deleted while the
    build runs): one coded line."""
    try:
        version = file_version(path)
        values = {OUTPUT_DIGEST: _sha256_file(path)}
    except OSError as error:
        return TaskFailed(io_error_line(error))
    with _DIGESTS_GUARD:
        source = _SOURCES.get(version)
    if source is not None:
        values[SOURCE_DIGEST] = source
    return values


def output_as_written(task, values, path, source) -> bool:
    """doit ``uptodate`` for assemble and render: their cached output is still
    the bytes they wrote, made from the ``source`` file as it is now (the
    plan for the case, the case for the summary). doit looks at a target
    only for whether it exists, so a cached case or summary cut short by a
    power loss (cache files are renamed into place without an fsync) or
    changed by hand would otherwise be rendered and published as it is; and
    its record of the source can be reset without the output being made
    (``doit reset-dep``). Costs no read in a no-op: the later tasks'
    file_dep checks hash the same file versions anyway (memoised). The
    source first: after an append it has changed, and the output, which the
    step then replaces, is not read here at all (assemble reads the previous
    case once, to splice onto it)."""
    recorded, made_from = values.get(OUTPUT_DIGEST), values.get(SOURCE_DIGEST)
    if not isinstance(recorded, str) or not isinstance(made_from, str):
        return False
    try:
        return _sha256_file(source) == made_from and _sha256_file(path) == recorded
    except OSError:
        return False


def file_version(path) -> tuple:
    """What tells one version of a cache file from another: cache files are
    only ever replaced by rename (a new inode), and the key holds the inode
    and change time as well as the size."""
    st = os.stat(path)
    return (os.fspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def digest_of_version(version: tuple, data: bytes) -> str:
    """The sha256 of ``data``, read whole from the file version ``version``:
    taken from what this process hashed of that version already (doit's
    checks of assemble's and render's outputs hash them before the steps run),
    else computed and remembered for the checks still to come."""
    from .jsoncanon import remember_digest, sha256_hex

    digest = _DIGESTS.get(version) if len(data) == version[3] else None
    if digest is None:
        digest = sha256_hex(data)
        if len(data) == version[3]:
            _remember_digest(version, digest)
    remember_digest(data, digest)
    return digest


def remember_file_digest(path, data: bytes) -> tuple:
    """Record that ``path``, as it stands now, holds ``data``, and return
    that version's key (:func:`file_version`): a step that has just written
    a file doit checks as a dependency (case.json, the summary) already has
    its bytes, whose digest publication needs too, so doit's check does not
    read and hash the file again. Under the case lock nothing else writes the
    build's cache between the write and this call."""
    from .jsoncanon import sha256_hex

    version = file_version(path)
    _remember_digest(version, sha256_hex(data))
    return version


class OneLineReporter(ConsoleReporter):
    """Progress lines on stderr; failures as one ``CODE: message`` line."""

    desc = "viano: one-line errors"

    def __init__(self, outstream, options):
        super().__init__(sys.stderr, options)

    def execute_task(self, task):
        if task.actions and task.name[0] != "_" and task.name in BUILD_TASKS[1:] or ":" in task.name:
            self.write(f".  {task.title()}\n")

    def skip_uptodate(self, task):
        # Per-file tasks that are up to date stay quiet: a no-op rebuild of a
        # 256-document case would otherwise print hundreds of lines.
        if task.name[0] != "_" and task.name.split(":", 1)[0] not in ("read_input", "hash_context"):
            self.write(f"-- {task.title()}\n")

    def skip_ignore(self, task):
        super().skip_ignore(task)
        if task.name in ("publish", "build"):
            # doit skips publish, and the build's confirmed line, when a step
            # is ignored (`doit ignore`), and exits 0: said once, last, so
            # that a successful-looking run does not pass for a build.
            self._ignored_ends = getattr(self, "_ignored_ends", set()) | {task.name}

    def add_failure(self, task, fail):
        message = getattr(fail, "message", "") or ""
        if _CODE_LINE.match(message):
            self.failures.append({"task": task, "exception": fail, "viano": True, "line": message.splitlines()[0]})
        else:
            super().add_failure(task, fail)

    def complete_run(self):
        # The code lines are written here, last: doit saves its dependency
        # file between a failure and this call, and a save that fails (a
        # full disk) warns on stderr, which must not follow the code line.
        held = [f["line"] for f in self.failures if f.get("viano")]
        self.failures = [f for f in self.failures if not f.get("viano")]
        super().complete_run()
        for line in held:
            self.write(line + "\n")
        ignored_ends = getattr(self, "_ignored_ends", set())
        if "publish" in ignored_ends and not held:
            self.write("nothing was published: a step is ignored (`doit ignore`); "
                       "`doit status` names it and `doit forget TASK` clears it\n")
        elif "build" in ignored_ends and not held:
            self.write("the build's report is ignored (`doit ignore build`): `doit status` says what is confirmed, "
                       "`doit forget build` clears it\n")
        if _running_doit_command_line():
            ignore_interrupts_from_now()  # everything is said; exiting by SIGINT now would contradict it


def subtask_name(path: str) -> str:
    """The doit sub-task name of a content path: the path itself, with ``%``
    and ``=`` written ``%25`` and ``%3D``. doit refuses ``=`` in a task name
    (its command line takes ``name=value`` as a variable), while a package
    may hold ``key=value.txt``; the two escapes keep names one-to-one."""
    if "=" not in path and "%" not in path:
        return path
    return path.replace("%", "%25").replace("=", "%3D")


def guarded(target: str, *args, **kwargs):
    """Run ``module:function`` as a doit action; a VianoError becomes a
    one-line TaskFailed. Taking a dotted name keeps every action picklable."""
    module_name, _, name = target.partition(":")
    refused = refuse_other_processes(module_name)
    if refused is not None:
        return refused
    function = getattr(importlib.import_module(module_name), name)
    # The steps build hundreds of thousands of acyclic JSON objects; the cyclic
    # collector's repeated full passes over them cost a rebuild tens of
    # milliseconds and can free nothing. Memory stays bounded by the limits.
    collecting = gc.isenabled()
    gc.disable()
    try:
        function(*args, **kwargs)
    except VianoError as error:
        return TaskFailed(str(error))
    except BrokenPipeError:
        # The reader went away (``doit status | head``): stop writing quietly,
        # as command-line tools do, instead of reporting a failed write.
        # Later writes and the flush at exit go to /dev/null.
        _quiet_from_now_on()
        return None
    except OSError as error:
        # The environment failed (disk full, permissions, a path that is not a
        # directory): still one line with a code, never a traceback.
        return TaskFailed(io_error_line(error))
    except MemoryError:
        # Under a memory cap (ulimit -v, a container's limit) Python's
        # traceback was the last word. What was published stands: every
        # publication is linked into place whole.
        return TaskFailed("OUT_OF_MEMORY: the command ran out of memory; what it had published stands and nothing is "
                          "left half-written: run it again with more memory (a higher ulimit -v or container limit)")
    finally:
        if collecting:
            gc.enable()
    return None


def chain_stamp() -> dict:
    """What assemble and render are stamped with (``config_changed`` in the
    dodo file): a new builder rebuilds. ``doit status`` compares it with the
    stamp doit recorded when they last ran."""
    from . import BUILDER_VERSION

    return {"code": code_version(), "builder": BUILDER_VERSION}


@functools.cache
def code_version() -> str:
    """sha256 over the builder's own code and contracts, and the Unicode
    version of this Python (escaping, name checks and folding follow its
    character tables): a new builder, or a Python with other tables, rebuilds
    rather than reuse cache records made by the other."""
    import unicodedata

    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    digest = hashlib.sha256(f"unicode {unicodedata.unidata_version}\0".encode())
    # Plain os calls: every run (a no-op too) reads these ~40 files, and
    # pathlib's glob and read_bytes cost it twice the time.
    for folder in ("pipeline", "contracts"):
        base = os.path.join(root, folder)
        with os.scandir(base) as entries:
            names = sorted(e.name for e in entries if e.name.endswith((".py", ".json")) and e.is_file())
        for name in names:
            with open(os.path.join(base, name), "rb") as handle:
                digest.update(name.encode() + b"\0" + handle.read() + b"\0")
    return digest.hexdigest()


#: Every command-line variable a task of dodo.py reads (doit takes any
#: ``name=value`` argument as a variable and ignores the ones nobody reads).
VARIABLES = frozenset({"case", "workspace", "source", "by", "reason", "dest"})


def argument_problem(variables, argv) -> str | None:
    """What makes this command line's variables unusable, or None.

    ``variables``: the ``name=value`` pairs doit took from the command line
    (None when doit parsed none, e.g. dodo.py loaded by another program). A
    misspelled variable (``worksapce=``) would be ignored by doit, and the
    command would act on the default workspace; a repeated one would take
    its last value."""
    if variables is None:
        return None
    for name in sorted(variables):
        if name not in VARIABLES:
            return f"unknown variable {one_line(name, 60)!r} (the variables are {', '.join(sorted(VARIABLES))})"
        if sum(1 for arg in argv[1:] if arg.startswith(f"{name}=")) > 1:
            return f"variable {name!r} is given twice"
    return None


def replaced_build_record_option(argv) -> str | None:
    """doit's options that would replace how the build is recorded, or None.

    ``--backend``, ``--db-file`` and ``--check_file_uptodate`` override
    DOIT_CONFIG: another backend opens the case's sqlite3 dep file as its own
    (a traceback, or the dbm file RELIABILITY 35 rules out), another file
    leaves the case lock's protection, and doit's own checkers trust
    modification times (RELIABILITY 43). Found as doit finds them: its
    loader options first, its variables set aside, then the command's own
    options through getopt, which takes a prefix only one of that command's
    options has and the value after an option that takes one."""
    import getopt

    from doit.cmd_base import DodoTaskLoader, DoitCmdBase
    from doit.cmdparse import CmdOption, CmdParse
    from doit.doit_cmd import DoitMain

    def parser(options) -> tuple[str, list[str]]:
        found = CmdParse([CmdOption(option) for option in options])
        return found.get_short(), found.get_long()

    fixed = {f"--{option['long']}" for option in DoitCmdBase.base_options if option.get("long")}
    args = list(argv[1:])
    try:
        _, args = getopt.getopt(args, *parser(DodoTaskLoader.cmd_options))
    except getopt.GetoptError:
        pass  # doit, too, then reads the loader options with the command's
    args = [arg for arg in args if arg.startswith("-") or "=" not in arg]
    commands = {command.get_name(): command for command in DoitMain.DOIT_CMDS}
    command = commands.get(args[0]) if args else None
    if command is None:
        command = commands["run"]
    else:
        args = args[1:]
    if not issubclass(command, DoitCmdBase):
        return None  # no dep file of the builder's is opened
    try:
        found, _ = getopt.getopt(args, *parser((*DoitCmdBase.base_options, *DodoTaskLoader.cmd_options, *command.cmd_options)))
    except getopt.GetoptError:
        return None  # doit refuses the command line itself
    for option, _ in found:
        if option in fixed:
            return (f"{option} is set by the builder (one sqlite3 dep file per case, under the case lock, "
                    "checked by content hash); leave it out")
    return None


#: The pid of the process that took this run's case lock, in the environment
#: so that worker processes see it however they are started (fork or spawn).
_LOCKED_BY_ENV = "VIANO_CASE_LOCK_PID"


_SEVERAL_PROCESSES = ("build steps cannot run in several processes (-n with process workers): "
                      "the case lock is one process's; leave -n out or add -P thread")


def refuse_other_processes(module_name: str) -> TaskFailed | None:
    """Build steps run in the process that holds the case lock. doit's
    process workers (``-n N``, however it is spelled, or set in a doit
    config file) would run them in forked children, which do not hold it,
    and would wait for it in vain: refused at once instead (``-P thread``
    workers share the lock)."""
    holder = os.environ.get(_LOCKED_BY_ENV)
    if holder is not None and holder != str(os.getpid()) and module_name == "pipeline.build":
        return TaskFailed(f"INVALID_ARGUMENT: {_SEVERAL_PROCESSES}")
    return None


#: doit's commands that read or change its records of tasks (not ``run``,
#: which does so for the build tasks it names; ``list`` with ``--status``).
_RECORD_COMMANDS = ("forget", "ignore", "reset-dep", "clean", "info", "strace")


def _uses_the_case_records(argv) -> bool:
    """Whether this doit command line works on the case's dependency file
    (and so takes the case lock): a run naming a build task, and doit's
    record commands whatever tasks they name (``doit forget --all case=ID``
    said "forgetting all tasks" and forgot nothing, as it ran on records
    kept in memory; found by session 23's review). Not ``help``, nor a
    ``list`` without ``--status`` (``doit help build case=ID`` waited for a
    running build's lock)."""
    first, rest = _doit_command(argv)
    if first in _RECORD_COMMANDS:
        return True
    if first == "list":
        # --status, or a prefix of it getopt takes (--st...), or -s among short flags
        return any((len(arg) >= 4 and "--status".startswith(arg)) or (arg.startswith("-") and not arg.startswith("--") and "s" in arg)
                   for arg in rest)
    if first in ("help", "tabcompletion", "dumpdb"):
        return False
    # A run: explicit (``doit run build``), or implied, where the first is a
    # task's name or an option (``doit -n 2 -P thread build``: an option's
    # value counts as a name here, never a build task's).
    names = rest if first == "run" else [first, *rest] if first is not None else rest
    return any(name.split(":", 1)[0] in BUILD_TASKS for name in names if name[:1] != "-")


def _doit_command(argv) -> tuple[str | None, list[str]]:
    """The first of doit's arguments once it has taken its loader's leading
    options (``-f FILE``, ``-d DIR``, ``-k``; getopt, up to the first
    argument that is none) and the ``name=value`` variables, as doit finds
    its command there; and the arguments after it. (Not necessarily a
    command: ``doit build`` runs the task build.)"""
    import getopt

    try:
        _options, args = getopt.getopt(list(argv[1:]), "f:d:k", ["file=", "dir=", "seek-file"])
    except getopt.GetoptError:
        args = list(argv[1:])  # doit then takes no loader option either
    args = [arg for arg in args if arg[:1] == "-" or "=" not in arg]
    if args and args[0][:1] != "-":
        return args[0], args[1:]
    return None, args


def say_when_waiting_for_a_case_lock() -> None:
    """On doit's command line, a command that waits for another's case lock
    says so once (after a second) instead of looking hung until it gets the
    lock or gives up with ``LOCK_TIMEOUT``."""
    if not _running_doit_command_line():
        return
    from . import workspace

    def notice(case_id: str, timeout: float) -> None:
        sys.stderr.write(f"waiting for case {case_id}: another command holds its lock (giving up after {timeout:g}s)\n")
        sys.stderr.flush()

    workspace.lock_wait_notice = notice


def skip_the_exit_collections() -> None:
    """Freeze, at exit, what is still alive for the cyclic garbage collector.

    Interpreter shutdown runs full collections over every tracked object
    still alive: after a build that is the case and its caches, hundreds of
    thousands of objects. Shutdown after an append rebuild took 40-70 ms
    here, 10-15 ms frozen (the rebuild ~0.03 s faster in alternating runs). Nothing relies on the collector at exit:
    files, locks and databases are all closed explicitly before, and frozen
    objects are still freed by reference counting as modules are cleared;
    only garbage in reference cycles is left to the operating system. The
    rule that follows: a module-level resource that must be released at
    exit (the case lock a build holds) is released by an atexit hook, never
    left to finalization, which now runs while modules are being cleared."""
    if getattr(skip_the_exit_collections, "registered", False):
        return
    atexit.register(gc.freeze)
    skip_the_exit_collections.registered = True


def end_the_process_without_teardown() -> None:
    """Once a doit command-line run has returned its status, exit without
    tearing the interpreter down.

    Teardown frees, object by object, every module and everything still
    alive, with every file and lock already closed and every line already
    said: 10 M of the ~870 M instructions of an append rebuild of a case at
    the default limits, 14 M of a cold build's (callgrind; the cyclic
    collector is frozen at exit already, :func:`skip_the_exit_collections`,
    which stays for the exits left to the interpreter). So the exit after
    the run is the interpreter's, minus the freeing: its threads are joined and its
    exit functions all run, in their order (the case lock's release, the
    store's close, whatever else registered one); standard output and error
    are flushed; the process exits with the run's status, the one doit's
    ``main`` exits with (nothing runs between the two but returns: the
    status cannot change, and Ctrl-C is ignored once the run has reported,
    :func:`pipeline.interrupts.ignore_interrupts_from_now`). A standard
    stream whose flush fails is left to the interpreter, which reports it
    and exits 120, as it always did. Only where the process ends with doit's
    ``main`` (:func:`_the_process_ends_with_doits_main`), from its main
    thread: a program that runs doit in-process keeps its own exit. (mypy
    ends its command line the same way, for the same reason.)"""
    from doit.cmd_run import Run

    execute = Run._execute
    if getattr(execute, "viano_ends_the_process", False):
        return

    @functools.wraps(execute)
    def _execute(self, *args, **kwargs):
        status = execute(self, *args, **kwargs)
        if (threading.current_thread() is threading.main_thread() and type(status) is int and 0 <= status <= 255
                and _the_process_ends_with_doits_main()):
            # Registered last, so run first at exit, before any other exit function.
            atexit.unregister(_exit_as_the_interpreter_would)
            atexit.register(_exit_as_the_interpreter_would, status)
        return status

    _execute.viano_ends_the_process = True
    Run._execute = _execute


def _the_process_ends_with_doits_main() -> bool:
    """Whether nothing but the interpreter's exit follows doit's ``main``:
    ``python -m doit``, or a launcher script (the ``doit`` console script of
    pip, uv, ...) whose last statement, run now, is ``sys.exit(main())``
    with doit's ``main``. A program that calls ``main`` and goes on (a
    wrapper, a test run) keeps its own exit, status and teardown; so does a
    launcher that cannot be read or is shaped otherwise."""
    main_module = sys.modules.get("__main__")
    if getattr(getattr(main_module, "__spec__", None), "name", None) == "doit.__main__":
        return True
    doits_main = getattr(sys.modules.get("doit.__main__"), "main", None)
    frame = sys._getframe()
    while frame.f_back is not None:
        frame = frame.f_back
    if (doits_main is None or main_module is None or frame.f_globals is not vars(main_module)
            or frame.f_code.co_name != "<module>" or frame.f_globals.get("main") is not doits_main
            or frame.f_globals.get("sys") is not sys):
        return False
    try:
        import ast

        with open(frame.f_code.co_filename, "rb") as script:
            source = script.read(_LAUNCHER_BYTES + 1)
        if len(source) > _LAUNCHER_BYTES:
            return False
        body = ast.parse(source).body
    except (OSError, SyntaxError, ValueError):
        return False
    # The last statement, at the top level or as the last of a last
    # ``if __name__ == "__main__":`` (no try, loop or with around it).
    if body and isinstance(body[-1], ast.If) and not body[-1].orelse and ast.unparse(body[-1].test) in (
            "__name__ == '__main__'", "'__main__' == __name__"):
        body = body[-1].body
    last = body[-1] if body else None
    return (isinstance(last, ast.Expr) and ast.unparse(last) == "sys.exit(main())"
            and last.lineno == frame.f_lineno)


#: A launcher script is a few lines; anything larger is something else.
_LAUNCHER_BYTES = 4096


def _exit_as_the_interpreter_would(status: int) -> None:
    atexit.unregister(_exit_as_the_interpreter_would)
    # The other exit functions, last registered first, then cleared: what
    # the interpreter would run next (CPython's own call, in every version).
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except BaseException:
        return  # the interpreter flushes again, says what failed and exits 120
    os._exit(status)


def collect_no_cycles_during_the_run() -> None:
    """Leave the cyclic garbage collector off for the rest of a doit run.

    The build steps already run without it (:func:`guarded`); between them
    doit loads and checks hundreds of tasks, and every collection it triggers
    traverses the build's live objects: 50 collections, ~16 ms of an append
    rebuild and ~8 ms of a no-op here. A doit run is one short process whose
    memory the limits bound, and reference counting still frees everything
    but garbage in reference cycles, of which a run makes little; the
    collector is not needed until the process exits. Only under doit's
    command line: a program that loads the dodo file in-process (doit's API,
    a test) keeps its collector."""
    if _running_doit_command_line():
        gc.disable()


def _running_doit_command_line() -> bool:
    """The ``doit`` script imports ``doit.__main__``; ``python -m doit`` runs it as ``__main__``."""
    if "doit.__main__" in sys.modules:
        return True
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "doit.__main__"


#: The standard output doit's command line started with, taken as the dodo
#: file loads (before any action runs). doit swaps ``sys.stdout`` for a
#: capture while each action runs and puts back what it found after; with
#: thread workers (``-P thread``) two actions overlap, and the one that ends
#: last can put back the other's capture for good, so a line written to
#: ``sys.stdout`` after that was captured and never shown.
_command_line_stdout = None
#: Standard error as the command line started with it (after
#: :func:`_keep_going_without_stderr`), for the same reason.
_command_line_stderr = None
#: Whether the doit run now executing reports with doit's JSON reporter,
#: whose document must be the whole of standard output (a consumer parses
#: it): the command's own lines then go to standard error. A module global,
#: not a context variable: thread workers (``-P thread``) do not inherit
#: context, and process workers are forked after it is set.
_reporting_as_json = False


def command_line_stdout():
    """Where a command's own lines go: the command line's standard output, or
    ``sys.stdout`` when doit's command line is not what runs this."""
    return _command_line_stdout if _command_line_stdout is not None else sys.stdout


def _where_a_line_goes() -> tuple[object, str]:
    """The stream :func:`say` writes to, and its name for an error: standard
    error while doit's JSON reporter owns standard output."""
    if _reporting_as_json:
        return (_command_line_stderr if _command_line_stderr is not None else sys.__stderr__), "standard error"
    return command_line_stdout(), "standard output"


def say(text: str) -> None:
    """Write a command's own line(s) to :func:`command_line_stdout`, at once.

    A reader that went away is ``BrokenPipeError`` (:func:`guarded` ends
    quietly). Any other failing write (a CI log on a full disk) is
    ``IO_ERROR`` naming the standard output: it was doit's traceback-less
    ``IO_ERROR: No space left on device`` naming nothing, as if the command's
    work had failed, and the flush at exit then failed again (exit 120 and
    two "Exception ignored" lines after the coded one)."""
    out, name = _where_a_line_goes()
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as error:
        if _command_line_stdout is not None:
            with contextlib.suppress(OSError, ValueError):
                _quiet_from_now_on()
        reason = error.strerror or type(error).__name__
        raise VianoError("IO_ERROR", f"the {name} could not be written ({reason}); "
                                     "what the command had done by then stands") from None


def doit_config(case_var: str | None, workspace_var: str | None, argv=None) -> dict:
    """DOIT_CONFIG for this invocation (see module docstring)."""
    from .workspace import Workspace, require_utf8_file_names, validate_id

    try:
        # Every command, also those with no action of the builder's to say so
        # (ignore, forget, list, ...): before, these ran on a dep file in memory.
        require_utf8_file_names()
    except VianoError as error:
        sys.stderr.write(f"{error}\n")
        raise SystemExit(3) from None
    global _STARTED_BEFORE_ITS_CASE, _RUN_WITHOUT_ITS_LOCK, _command_line_stdout, _command_line_stderr
    _STARTED_BEFORE_ITS_CASE = _RUN_WITHOUT_ITS_LOCK = None
    if _running_doit_command_line():
        _fill_closed_standard_streams()
    _command_line_stdout = sys.stdout if _running_doit_command_line() else None
    _command_line_stderr = None
    if _command_line_stdout is not None:
        _escape_what_stdout_cannot_encode(_command_line_stdout)
        _keep_going_without_stderr()
        _command_line_stderr = sys.stderr
    os.environ.pop(_LOCKED_BY_ENV, None)
    report_interrupts_on_one_line()
    say_when_waiting_for_a_case_lock()
    skip_the_exit_collections()
    collect_no_cycles_during_the_run()
    argv = sys.argv if argv is None else argv
    from doit import doit_cmd

    problem = argument_problem(doit_cmd._CMDLINE_VARS, argv) or replaced_build_record_option(argv)  # doit's own split of the command line
    if problem is not None:
        sys.stderr.write(f"INVALID_ARGUMENT: {problem}\n")
        raise SystemExit(3)
    _note_what_each_run_selects()
    end_the_process_without_teardown()
    _guard_doits_own_commands()
    config = {
        "backend": "sqlite3",
        "dep_file": ":memory:",
        "check_file_uptodate": ContentHashChecker,
        "reporter": OneLineReporter,
        "default_tasks": [],
        "verbosity": 1,
    }
    wants_build = _uses_the_case_records(argv)
    if not case_var:
        return config
    try:
        case_id = validate_id(case_var, "case_id")
        ws = Workspace.from_var(workspace_var)
    except VianoError:
        return config  # the task action reports the bad variable with its code
    if not wants_build:
        # Build steps can run all the same: doit runs the task of a target
        # named on its command line (``doit <ws>/.cache/ID/out/case.json``).
        # Such a step takes the case lock then (:func:`lock_if_not_held_by_the_run`).
        _RUN_WITHOUT_ITS_LOCK = (str(ws.root), case_id, os.getpid())
        return config
    if not ws.store_path.exists() or not ws.case_dir(case_id).is_dir():
        # Unknown case: the action reports UNKNOWN_CASE, nothing is created;
        # unless the case is admitted before that action runs, which then
        # takes the lock this run could not (lock_if_admitted_since_the_start).
        _STARTED_BEFORE_ITS_CASE = (str(ws.root), case_id)
        return config
    from .workspace_limits import read_workspace_limits

    try:
        read_workspace_limits(ws.root)
    except VianoError:
        # A refused limits.json stops the build at its first step, which
        # says why; nothing of the workspace is made for it, a dep file
        # included.
        return config
    from .build import case_cache, hold_case_lock

    # Before doit starts, so any failure here is ours to report: one coded
    # line and doit's own exit status for a failed run, never a traceback.
    try:
        hold_case_lock(ws, case_id)
        os.environ[_LOCKED_BY_ENV] = str(os.getpid())
        cache_dir = case_cache(ws, case_id).root  # refuses a symlinked cache before doit opens its dep file there
        cache_dir.mkdir(parents=True, exist_ok=True)
        dep_file = cache_dir / "doit.sqlite3"
        _discard_if_corrupt(dep_file)
        with contextlib.suppress(FileExistsError):
            # 0666 less the umask (SQLite would make it 0644): the next build
            # of a workspace shared through a group may be another user's.
            os.close(os.open(dep_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666))
    except VianoError as error:
        sys.stderr.write(str(error) + "\n")
        raise SystemExit(3)
    except OSError as error:
        sys.stderr.write(io_error_line(error) + "\n")
        raise SystemExit(3)
    _tolerate_an_unsaved_dep_file()
    _read_the_dep_file_in_one_query()
    config["dep_file"] = str(dep_file)
    return config


_STARTED_BEFORE_ITS_CASE: tuple[str, str] | None = None
#: (workspace, case, pid) of a doit run that names no build task, so took no
#: case lock before doit started (:func:`doit_config`), in process ``pid``.
_RUN_WITHOUT_ITS_LOCK: tuple[str, str, int] | None = None
#: (always-execute, the task names selected) of the doit ``run`` under way in
#: this context, set by :func:`_note_what_each_run_selects`; None outside one.
_RUN_SELECTION: contextvars.ContextVar[tuple[bool, tuple[str, ...]] | None] = contextvars.ContextVar(
    "viano_run_selection", default=None
)
_PER_FILE_GROUPS = ("read_input", "hash_context")


def declares_subtask(task_name: str, target: str) -> bool:
    """Whether dodo.py gives doit this per-file task (``read_input:PATH`` or
    ``hash_context:PATH``: ``uptodate: [True]``, one target, no file_dep).

    A run judges such a task up to date by its target alone: the target
    exists, and no ``doit ignore`` mark or record of another file checker
    says otherwise (doit's ``Dependency.get_status``). Such a task is left
    out of a run, where doit would only check it and pass over it: each task
    given to doit costs a task object, a dispatch and a status check, ~30 ms
    of an append's rebuild for a 256-document case here. Declared all the
    same: in every command but ``run`` (list, info, forget, ignore, ...), in
    a run that executes everything (``-a``/``--always-execute``, or
    ``always`` from a doit config file) and in one that names a per-file
    task on its command line. A record that goes missing after this check
    is made again by assemble (:func:`pipeline.build._snapshot`)."""
    selection = _RUN_SELECTION.get()
    if selection is None or not os.path.exists(target):
        return True
    always, selected = selection
    if always or any(name.startswith(_PER_FILE_GROUPS) and ":" in name for name in selected):
        return True
    from doit.globals import Globals

    records = Globals.dep_manager
    stored = getattr(records, "_get", None)
    if records is None or stored is None:
        return True
    if stored(task_name, "ignore:"):
        return True  # doit skips it, and with it every step after it
    checker = stored(task_name, "checker:")
    return bool(checker) and checker != records.checker.__class__.__name__


def _guard_doits_own_commands() -> None:
    """doit's own commands that print (list, info, ...) end quietly when
    their reader goes away (``doit list --all | head -1`` was a
    BrokenPipeError traceback), and ``doit info`` of a task that is not one
    (an unknown name, or a per-file task before a build planned its file)
    is doit's ``ERROR: ... is not a task.`` as in its other commands (it was
    a KeyError traceback). Found by session 23's review."""
    import importlib

    from doit.cmd_base import check_tasks_exist

    for module_name, class_name in (("doit.cmd_info", "Info"), ("doit.cmd_list", "List"), ("doit.cmd_forget", "Forget"),
                                    ("doit.cmd_ignore", "Ignore"), ("doit.cmd_clean", "Clean"),
                                    ("doit.cmd_resetdep", "ResetDep"), ("doit.cmd_strace", "Strace"),
                                    ("doit.cmd_help", "Help")):
        try:
            command = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # another doit: left as it is
        execute = command.__dict__.get("_execute")
        if execute is None or getattr(execute, "viano_guarded", False):
            continue

        def guarded_execute(self, *args, __execute=execute, __checks_names=class_name == "Info", **kwargs):
            if __checks_names:
                names = kwargs.get("pos_args", args[0] if args else None)
                if isinstance(names, list) and len(names) == 1:
                    check_tasks_exist({task.name: task for task in self.task_list}, names)
            try:
                return __execute(self, *args, **kwargs)
            except BrokenPipeError:
                _quiet_from_now_on()
                return 0

        functools.update_wrapper(guarded_execute, execute)
        guarded_execute.viano_guarded = True
        command._execute = guarded_execute


def _fill_closed_standard_streams() -> None:
    """A command started with its standard output or error closed (``2>&-``)
    gets /dev/null there. Python leaves ``sys.stderr`` None then, and doit's
    reporter failed on it: the build exited 1 at its first step, publishing
    nothing and saying nothing (session 24's README audit). A descriptor left
    closed would also be the next file opened, which a later write to
    "standard error" would then land in."""
    import io

    for descriptor, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.fstat(descriptor)
        except OSError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            if devnull != descriptor:
                os.dup2(devnull, descriptor)
                os.close(devnull)
        if getattr(sys, name) is None:
            setattr(sys, name, io.TextIOWrapper(io.FileIO(descriptor, "w", closefd=False), encoding="utf-8",
                                                errors="backslashreplace", line_buffering=True))


def _escape_what_stdout_cannot_encode(stream) -> None:
    """Under an ASCII or Latin-1 standard output (``PYTHONIOENCODING``, a
    CI runner's locale), a path or file name the command printed raised
    UnicodeEncodeError after the work was done: status and export failed
    with doit's traceback (session 24's CI review). Written escaped instead,
    as Python writes standard error."""
    if getattr(stream, "errors", None) == "strict":
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")


class _StderrThatMayGo:
    """Standard error whose writes cannot fail the command: once the reader
    went away (``doit build 2>&1 >log | tool`` with the tool gone) or the
    disk under it filled, what follows goes to /dev/null. Its lines are
    progress and the coded line, which can no longer be shown; the build
    stopped at its first step line with exit 1, publishing nothing and
    saying nothing (session 24's CI review)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BlockingIOError:
            raise  # a non-blocking descriptor that is full for now: not gone
        except OSError:
            self._to_nowhere()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BlockingIOError:
            raise
        except OSError:
            self._to_nowhere()

    def _to_nowhere(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
        # What the failed write left in the stream's buffer goes there too.
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _keep_going_without_stderr() -> None:
    if sys.stderr is not None and not isinstance(sys.stderr, _StderrThatMayGo) and sys.stderr is sys.__stderr__:
        sys.stderr = _StderrThatMayGo(sys.stderr)


def _quiet_from_now_on() -> None:
    """The reader of the standard output went away: later writes, and the
    flush at exit, go to /dev/null (as command-line tools end)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, command_line_stdout().fileno())
    finally:
        os.close(devnull)


def _note_what_each_run_selects() -> None:
    """Let :func:`declares_subtask` see the options a doit run resolved
    (command line and config files alike) and the tasks it selected, by
    adapting doit's ``Run._execute`` (doit calls it with keyword arguments
    named after its signature, which ``functools.wraps`` keeps). Left as
    doit has it where it is not what this was written against (doit
    0.36-0.37): then every task is declared."""
    import inspect

    from doit.cmd_run import Run

    execute = Run._execute
    if getattr(execute, "viano_noted", False) or "always" not in inspect.signature(execute).parameters:
        return

    @functools.wraps(execute)
    def _execute(self, *args, **kwargs):
        bound = inspect.signature(execute).bind(self, *args, **kwargs)
        selected = tuple(name for name in (getattr(self, "sel_tasks", None) or ()) if isinstance(name, str))
        token = _RUN_SELECTION.set((bool(bound.arguments.get("always", False)), selected))
        global _reporting_as_json
        reporting_as_json_before, _reporting_as_json = _reporting_as_json, _is_doits_json_reporter(bound.arguments.get("reporter"))
        global _thread_workers
        thread_workers_before = _thread_workers
        _thread_workers = bound.arguments.get("par_type") == "thread" and (bound.arguments.get("num_process") or 0) > 0
        if _thread_workers:
            for task in getattr(self, "task_list", None) or ():
                if hasattr(getattr(task, "io", None), "capture"):
                    task.io.capture = False
        try:
            return execute(self, *args, **kwargs)
        finally:
            _RUN_SELECTION.reset(token)
            _reporting_as_json = reporting_as_json_before
            _thread_workers = thread_workers_before

    _execute.viano_noted = True
    Run._execute = _execute


#: Whether the doit run now executing has thread workers (``-n N -P
#: thread``). Then no action's output is captured: doit's capture swaps the
#: process-wide ``sys.stdout`` and ``sys.stderr`` for the action's own
#: writers and puts back what it found after, and two overlapping actions
#: can leave one's writers in place for good. Later output was then captured
#: and never shown, and with ``--reporter=json`` the reporter found a writer
#: where it had put its buffer: no JSON document and exit 3 (2 of 3 sample
#: builds with ``-n 2 -P thread`` here). Without capture doit swaps nothing
#: (or puts back the same stream), so the workers cannot race; the actions'
#: own lines (progress, on standard error) are then written as they are, also
#: at ``--verbosity 0``. Tasks declared before the run are changed by
#: :func:`_note_what_each_run_selects`, those created during it (the per-file
#: steps) declare :func:`io_of_a_run_task`.
_thread_workers = False


def io_of_a_run_task() -> dict:
    """The ``io`` a task created during a run declares (see
    :data:`_thread_workers`): doit's default, capture, except with thread workers."""
    return {"capture": not _thread_workers}


def _is_doits_json_reporter(reporter) -> bool:
    """``--reporter=json`` (a name from the command line or a config file) or
    doit's JSON reporter class itself, or one derived from it."""
    if reporter == "json":
        return True
    from doit.reporter import JsonReporter

    return isinstance(reporter, type) and issubclass(reporter, JsonReporter)


def lock_if_not_held_by_the_run(ws, case_id: str) -> None:
    """A build step run by doit for a target named on its command line (no
    build task named, so :func:`doit_config` took no case lock) takes the
    lock now, for the rest of the run: the cache it writes and reads, and the
    store, are behind it in every build (found by session 23's review: those
    steps ran beside a whole build's). Inside a doit run only: a later
    CaseBuilder.build in this process takes the lock for its own call."""
    if _RUN_WITHOUT_ITS_LOCK is not None and _RUN_WITHOUT_ITS_LOCK[:2] == (str(ws.root), case_id) and _RUN_SELECTION.get() is not None:
        from .build import hold_case_lock

        if _RUN_WITHOUT_ITS_LOCK[2] != os.getpid():
            # A process worker (-n N): it cannot share the lock the first one
            # would take, and would wait for it in vain (60 s, LOCK_TIMEOUT).
            raise CaseBuildError("INVALID_ARGUMENT", _SEVERAL_PROCESSES)
        hold_case_lock(ws, case_id)
        os.environ[_LOCKED_BY_ENV] = str(os.getpid())
    else:
        lock_if_admitted_since_the_start(ws, case_id)


def lock_if_admitted_since_the_start(ws, case_id: str) -> None:
    """A build run takes its case lock for the whole run before doit starts
    (:func:`doit_config`), but only when the case exists then. If it was
    admitted between that moment and the first build step, take the lock now,
    for the rest of the run: the steps after planning (reading inputs,
    assembling, rendering) count on it. That run keeps doit's dependency
    records in memory only; the next build checks its tasks again."""
    global _STARTED_BEFORE_ITS_CASE
    if _STARTED_BEFORE_ITS_CASE == (str(ws.root), case_id):
        from .build import hold_case_lock

        # Once: a later CaseBuilder.build of the case in this process must
        # not take a lock that lasts until the process exits.
        _STARTED_BEFORE_ITS_CASE = None
        hold_case_lock(ws, case_id)
        os.environ[_LOCKED_BY_ENV] = str(os.getpid())


def io_error_line(error: OSError) -> str:
    """``IO_ERROR: reason (file)`` on one line, for a failing environment."""
    return str(coded_io_error(error))


def _tolerate_an_unsaved_dep_file() -> None:
    """doit writes its dependency file once, after the last task. When that
    fails (disk full, a read-only file), the build's work is already done
    and published: the file is disposable cache whose transaction rolled
    back, so the next build only repeats its checks. Say so on one line
    instead of failing a finished build with a traceback."""
    import sqlite3

    from doit.dependency import SqliteDB

    if getattr(SqliteDB.dump, "viano_tolerant", False):
        return
    save = SqliteDB.dump
    forget = SqliteDB.remove

    def remove(self, task_id) -> None:
        # doit forgets a failed task's record at once, outside the final save;
        # a file that cannot take the delete (full disk, another writer) must
        # not turn the task's own coded failure into a traceback. The save
        # meets the same file and says so; a record left behind names the
        # task's earlier inputs, so the task runs again all the same.
        try:
            forget(self, task_id)
        except sqlite3.Error as error:
            self.viano_unsaved = error

    def dump(self) -> None:
        try:
            unsaved = getattr(self, "viano_unsaved", None)
            if unsaved is not None:
                raise unsaved
            save(self)
        except (sqlite3.Error, OSError) as error:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            sys.stderr.write(
                f"warning: IO_ERROR: the build's dependency file was not saved ({one_line(str(error))}); "
                "the next build repeats its checks\n"
            )

    dump.viano_tolerant = True
    SqliteDB.dump = dump
    SqliteDB.remove = remove


# sqlite's words for a file it cannot write (not for a locked or damaged one).
_UNWRITABLE = ("disk is full", "disk I/O error", "readonly database", "unable to open database file")


def _read_the_dep_file_in_one_query() -> None:
    """doit's sqlite3 backend asks the file for each task's record when the
    task is first checked: a query, and with it a lock and a hot-journal
    probe of the file, per task (~20 µs each here), 260 times over in a
    no-op rebuild. A build's file holds only its case's tasks and nothing
    else changes it while the build holds the case lock, so every record is
    read in one query when doit opens the file and the rest is answered from
    memory. The records stay as doit stores them; saving them does not wait
    for the disk. A record that does not decode (damage ``quick_check``
    cannot see) makes the whole file disposable: it is removed and opened
    afresh, so the build checks every task again instead of failing.

    Done by adapting doit's class, like the tolerant save above, rather than
    by a backend plugin: doit imports plugins before the dodo file, which
    would tie ``pipeline`` to the installed copy instead of the dodo file's.
    Only doit's own methods are replaced, and only where they are what this
    was written against (doit 0.36-0.37); otherwise doit's backend is kept.
    (One difference doit never shows: a record ``doit ignore`` sets on a
    task it has not checked is merged into the stored one, not replacing it;
    only ``doit forget`` clears an ignore, and it removes the whole record.)"""
    import sqlite3

    from doit import dependency
    from doit.dependency import SqliteDB

    DatabaseException = getattr(dependency, "DatabaseException", sqlite3.DatabaseError)
    if getattr(SqliteDB.__init__, "viano_one_query", False):
        return
    if not all(callable(getattr(SqliteDB, name, None)) for name in ("_sqlite3", "_get_task_data", "in_", "get", "set")):
        return  # another doit: its own backend, query per task
    open_file = SqliteDB.__init__
    get_one = SqliteDB._get_task_data
    has_one = SqliteDB.in_

    # doit 0.37 passes module_name; 0.36's takes no such argument, so only
    # what doit gave is handed on.
    def __init__(self, name, codec, **options):
        try:
            open_file(self, name, codec, **options)
        except (DatabaseException, sqlite3.OperationalError) as error:
            # (sqlite's own error when the folder went away meanwhile: the
            # cache deleted while the build starts.)
            # doit names any failure to create its table a corrupt file; one
            # that cannot be written (full disk, file size limit, read-only)
            # is no reason to stop a build: it runs without the record, and
            # the next build repeats its checks. A locked file is another
            # program's, as doit says.
            cause = str(error).rsplit("Original error:", 1)[-1]  # doit's text names the path too
            if not any(word in cause for word in _UNWRITABLE):
                raise
            from .lifecycle import path_too_long_for_sqlite

            sys.stderr.write(
                f"warning: IO_ERROR: the build's dependency file cannot be written ({one_line(cause.strip())}"
                f"{path_too_long_for_sqlite(name, 'a shorter workspace path or case id') if name != ':memory:' else ''}); "
                "the build goes on without it and the next build repeats its checks\n"
            )
            opened = getattr(self, "_conn", None)
            if opened is not None:  # connected before its table failed
                try:
                    opened.close()
                except sqlite3.Error:
                    pass
            open_file(self, ":memory:", codec, **options)
            return
        if not isinstance(getattr(self, "_cache", None), dict) or getattr(self, "_conn", None) is None:
            return
        try:
            rows = self._conn.execute("select task_id, task_data from doit").fetchall()
            damaged = not all(sound_doit_record(row["task_data"]) for row in rows)
        except sqlite3.OperationalError as error:
            if "locked" in str(error) or "busy" in str(error):
                raise  # another program holds a sound file: as doit itself would say
            damaged = True
        except (ValueError, RecursionError, sqlite3.DatabaseError):
            damaged = True  # a record that does not decode
        if damaged:
            # doit would fail on such a record whenever it reached its task;
            # the file is disposable cache.
            self._conn.close()
            for stale in (name, f"{name}-journal", f"{name}-wal", f"{name}-shm"):
                if os.path.exists(stale):
                    os.unlink(stale)
            open_file(self, name, codec, **options)
            rows = []
        # Disposable cache: a file a power cut leaves damaged is discarded by
        # the next build, which then checks every task again. Its save need
        # not wait for the disk (four syncs per run).
        self._conn.execute("PRAGMA synchronous = OFF")
        self._cache = {row["task_id"]: row["task_data"] for row in rows}
        self.viano_all_read = True

    def _get_task_data(self, task_id):
        # Every stored record was read on opening: a miss was never saved.
        return {} if getattr(self, "viano_all_read", False) else get_one(self, task_id)

    def in_(self, task_id):
        return task_id in self._cache if getattr(self, "viano_all_read", False) else has_one(self, task_id)

    __init__.viano_one_query = True
    SqliteDB.__init__ = __init__
    SqliteDB._get_task_data = _get_task_data
    SqliteDB.in_ = in_


def _discard_if_corrupt(dep_file: Path) -> None:
    """The dep file is disposable cache: a corrupt one is removed (under the
    case lock) so doit starts afresh, instead of failing every build."""
    import sqlite3

    if not dep_file.exists():
        return
    try:
        # Under the case lock no build of ours holds the file; a foreign holder
        # is answered in half a second rather than sqlite's default five.
        connection = sqlite3.connect(f"file:{dep_file}?mode=ro", uri=True, timeout=0.5)
        try:
            ok = connection.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        finally:
            connection.close()
    except sqlite3.OperationalError as error:
        # Busy or locked is another process using a sound file, not damage.
        # Under the case lock none of ours can be that process; doit would wait
        # and then call the file corrupt, so say what it is, on one line.
        if "locked" in str(error) or "busy" in str(error):
            raise VianoError("LOCK_TIMEOUT", "the build's dependency file is held by another process", path=dep_file.name) from None
        ok = False
    except sqlite3.DatabaseError:
        ok = False
    if not ok:
        dep_file.unlink()

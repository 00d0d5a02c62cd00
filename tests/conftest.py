"""Shared fixtures. Helpers add fixtures in their own test modules, not here."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
BIN = Path(sys.executable).parent

# A suite started in the background by a non-interactive shell (`cmd &`)
# inherits SIGINT ignored, and so would every process it starts (an ignored
# signal stays ignored across exec): the Ctrl-C tests would wait for an
# interrupt that never comes. A handled one is reset to the default on exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _compile_the_builder() -> None:
    """Write the builder's bytecode before any test starts a process.

    Most tests run the real ``doit`` in subprocesses, thousands in all. Where
    ``PYTHONDONTWRITEBYTECODE`` is set (this machine's shells and CI set it),
    each of them would compile every module of ``pipeline/`` from source
    again on a fresh clone, which made the e2e tests ~1.5 x slower. Bytecode
    already on disk is still read under that variable; py_compile writes it
    whatever the variable says. The builder's ``code_version`` hashes the
    sources only, so this changes no stamp.
    """
    import compileall

    try:
        for folder in ("pipeline", "contracts", "tests"):
            compileall.compile_dir(REPO / folder, quiet=2)
        compileall.compile_file(REPO / "dodo.py", quiet=2)
    except OSError:
        pass  # a read-only checkout: the processes compile in memory, as before


_compile_the_builder()


@pytest.fixture
def workspace_root(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


def doit_env(**extra: str) -> dict:
    """Environment for running the real `doit` in a subprocess from the repo."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("VIANO_WORKSPACE", None)
    env.pop("VIANO_CRASH_AT", None)
    env.update(extra)
    return env

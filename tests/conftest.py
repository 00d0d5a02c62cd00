"""Shared fixtures. Helpers add fixtures in their own test modules, not here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
BIN = Path(sys.executable).parent


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

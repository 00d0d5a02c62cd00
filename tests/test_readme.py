"""The README is part of the contract: its quick start and its code table stay true."""

from __future__ import annotations

import re

from pipeline.errors import ERROR_CODES
from tests.conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def test_every_error_code_is_listed_in_the_readme():
    listed = set(re.findall(r"^\| `([A-Z_]+)` \|", README, re.M))
    assert listed == set(ERROR_CODES)


def test_the_readme_gives_each_code_the_meaning_the_code_registry_gives():
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| (.*) \|$", README, re.M))
    assert {code: rows.get(code) for code in ERROR_CODES} == ERROR_CODES


def test_quick_start_is_two_commands_and_ci_runs_the_second():
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    block = quick.split("```sh", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2
    assert "doit admit" in commands[0] and "doit build" in commands[0] and "fixtures/sample" in commands[0]
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[1] in ci

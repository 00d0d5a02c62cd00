"""Which doit command lines work on a case's dependency file, and so take
its lock before doit starts (pipeline.doitcli._uses_the_case_records)."""

from __future__ import annotations

import pytest

from pipeline.doitcli import _doit_command, _uses_the_case_records


@pytest.mark.parametrize("argv, uses", [
    (["doit", "build", "case=c1"], True),
    (["doit", "run", "publish", "case=c1"], True),
    (["doit", "read_input:original/a.json", "case=c1"], True),
    (["doit", "-s", "build", "case=c1"], True),
    (["doit", "-n", "2", "-P", "thread", "build", "case=c1"], True),
    (["doit", "build", "status", "case=c1"], True),
    (["doit", "-f", "x/dodo.py", "-d", "/tmp/d=x", "forget", "--all", "case=c1"], True),  # '=' in a loader option's value
    (["doit", "case=c1", "forget", "--all"], True),
    (["doit", "--file=a", "info", "build", "case=c1"], True),
    (["doit", "-k", "list", "-s", "case=c1"], True),
    (["doit", "list", "--status", "case=c1"], True),
    (["doit", "list", "--stat", "case=c1"], True),  # a prefix getopt takes
    (["doit", "reset-dep", "case=c1"], True),
    (["doit", "clean", "-a", "--forget", "case=c1"], True),
    (["doit", "list", "--all", "case=c1"], False),
    (["doit", "help", "build", "case=c1"], False),  # waited for a running build's lock
    (["doit", "-d", "build", "status", "case=c1"], False),  # a folder named build
    (["doit", "status", "case=c1"], False),
    (["doit", "admit", "case=c1", "source=x"], False),
    (["doit", "/ws/.cache/c1/out/case.json", "case=c1"], False),  # a target: its steps lock for themselves
    (["doit"], False),
])
def test_which_command_lines_take_the_cases_records(argv, uses):
    assert _uses_the_case_records(argv) is uses


def test_the_command_is_found_past_doits_loader_options_as_doit_finds_it():
    assert _doit_command(["doit", "-f", "a=b/dodo.py", "-k", "info", "x", "case=1"]) == ("info", ["x"])
    assert _doit_command(["doit", "-s", "-f", "dodo.py", "build"]) == (None, ["-s", "-f", "dodo.py", "build"])  # getopt stops at -s

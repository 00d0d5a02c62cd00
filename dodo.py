"""Viano case builder: the doit tasks. Declarations only; logic is in pipeline/.

Commands (doit command-line variables; all take workspace=DIR, default
$VIANO_WORKSPACE or ./service-data):

    doit admit  case=ID source=PATH      admit a ZIP or directory bug package
    doit append case=ID source=PATH      add files and a returning index
    doit build  case=ID                  build case.json and case_summary.md
    doit reopen case=ID by=SOURCE reason=TEXT
    doit status case=ID
    doit export case=ID dest=DIR
    doit probes case=ID
"""

import os
import sys


def _shadowed(why: str) -> None:
    # Another package named pipeline or contracts earlier on sys.path (a
    # `pipeline/` folder beside a copied dodo.py, which doit puts first;
    # PyContracts): said here, as the builder's own code cannot load.
    line = (f"UNSUPPORTED_ENVIRONMENT: the builder's packages are shadowed by others of the same name ({why}): run doit "
            "with a dodo file that has no pipeline or contracts folder beside it other than the builder's\n")
    try:
        os.write(2, line.encode("utf-8", "backslashreplace"))  # (sys.stderr is None when standard error is closed)
    except OSError:
        pass  # closed: the status alone says it
    raise SystemExit(3)


def _folder_holding(package) -> str | None:
    where = getattr(package, "__file__", None)
    return os.path.dirname(os.path.dirname(os.path.abspath(where))) if where else None


try:
    import contracts
    import pipeline
except Exception as error:  # noqa: BLE001 - whatever a foreign package raises as it loads
    _shadowed(f"importing them failed: {type(error).__name__}: {error}")


def _named(package) -> str:
    return getattr(package, "__file__", None) or "a folder without __init__.py: " + ", ".join(getattr(package, "__path__", []))


if not hasattr(pipeline, "BUILDER_VERSION") or _folder_holding(pipeline) in (None, "") \
        or _folder_holding(pipeline) != _folder_holding(contracts):
    _shadowed(f"pipeline from {_named(pipeline)}, contracts from {_named(contracts)}")

from pipeline.interrupts import report_interrupts_on_one_line  # noqa: E402

# First, so that a Ctrl-C while the rest loads is one INTERRUPTED line too.
report_interrupts_on_one_line()

from doit import create_after, get_var  # noqa: E402
from doit.tools import config_changed  # noqa: E402

from pipeline.build import over_read_bound, publish_is_current, reuses_confirmed_case  # noqa: E402
from pipeline.cache import BuildCache  # noqa: E402
from pipeline.doitcli import (  # noqa: E402
    chain_stamp, declares_subtask, doit_config, guarded, output_as_written, output_digest, subtask_name, io_of_a_run_task,
)
from pipeline.errors import VianoError  # noqa: E402
from pipeline.limits import CaseBuilderLimits  # noqa: E402
from pipeline.workspace import Workspace, validate_id  # noqa: E402

CASE = get_var("case")
WORKSPACE = get_var("workspace")

DOIT_CONFIG = doit_config(CASE, WORKSPACE)


def _case_context():
    """(workspace root, case id, cache) or None when the variables are unusable
    (the task action then reports the problem with its code)."""
    try:
        case_id = validate_id(CASE, "case_id") if CASE else None
        workspace = Workspace.from_var(WORKSPACE)
    except VianoError:
        return None
    if case_id is None:
        return None
    return str(workspace.root), case_id, BuildCache(workspace.cache_dir(case_id))


def _command(function: str, doc: str, **variables):
    return {
        "doc": doc,
        "actions": [(guarded, [f"pipeline.commands:{function}"], variables)],
        "uptodate": [False],
        "verbosity": 2,
    }


def _unusable_variables():
    return {
        "actions": [(guarded, ["pipeline.commands:cmd_status"], {"case": CASE, "workspace": WORKSPACE})],
        "uptodate": [False],
        "verbosity": 2,
    }


# ------------------------------------------------------------- commands
#
# One creator yields every command (and one the whole build chain): doit reads
# each creator's source to order them, which costs a no-op rebuild ~1.5 ms per
# creator; the basenames and docs are the same as one creator per command.
# Each creator only returns the generator of a helper: doit tokenises the
# creator's whole body, so a body of one line saves every run 4-5 ms.

_COMMANDS = (
    ("admit", "cmd_admit", "Admit a bug package (ZIP or directory): doit admit case=ID source=PATH", ("source",)),
    ("append", "cmd_append", "Append files and a returning case-inputs index: doit append case=ID source=PATH", ("source",)),
    ("reopen", "cmd_reopen", "Open a new analysis revision: doit reopen case=ID by=SOURCE reason=TEXT", ("by", "reason")),
    ("status", "cmd_status", "Show state, revision, generation, artifacts, checkpoints, pending tasks: doit status case=ID", ()),
    ("export", "cmd_export", "Copy the current case.json, summary and manifest: doit export case=ID dest=DIR", ("dest",)),
    ("probes", "cmd_probes", "Print probe candidates for an unresolved built case: doit probes case=ID", ()),
)


def task_commands():
    """The lifecycle commands."""
    return _commands()


def _commands():
    for basename, function, doc, extra in _COMMANDS:
        variables = {"case": CASE, "workspace": WORKSPACE, **{name: get_var(name) for name in extra}}
        yield {"basename": basename, **_command(function, doc, **variables)}


# ------------------------------------------------------------- the build


_CHAIN_DOCS = {
    "build": "Build the case incrementally: doit build case=ID",
    "validate_index": "Check the case-inputs index and plan the build (runs on every build)",
    "assemble": "Assemble the canonical case from the plan and the cached inputs",
    "render": "Render case_summary.md from case.json",
    "publish": "Publish case.json, summary and case-built.json as one generation and confirm it",
}


def task_pipeline():
    """The build chain: validate_index, assemble, render, publish, build."""
    return _pipeline()


def _pipeline():
    context = _case_context()
    if context is None:
        for basename, doc in _CHAIN_DOCS.items():
            yield {"basename": basename, "doc": doc, **_unusable_variables()}
        return
    root, case_id, cache = context
    stamp = config_changed(chain_stamp())
    yield {
        "basename": "validate_index",
        "doc": _CHAIN_DOCS["validate_index"],
        "actions": [(guarded, ["pipeline.build:step_validate_index", root, case_id])],
        "targets": [str(cache.plan)],
        "uptodate": [False],
    }
    case_json, summary = str(cache.case_json), str(cache.summary)
    yield {
        "basename": "assemble",
        "doc": _CHAIN_DOCS["assemble"],
        "actions": [(guarded, ["pipeline.build:step_assemble", root, case_id]), (output_digest, [case_json])],
        "file_dep": [str(cache.plan)],
        "task_dep": ["read_input", "hash_context"],
        "targets": [case_json],
        "uptodate": [stamp, (output_as_written, [case_json, str(cache.plan)])],
    }
    yield {
        "basename": "render",
        "doc": _CHAIN_DOCS["render"],
        "actions": [(guarded, ["pipeline.build:step_render", root, case_id]), (output_digest, [summary])],
        "file_dep": [case_json],
        "targets": [summary],
        "uptodate": [stamp, (output_as_written, [summary, case_json])],
    }
    yield {
        "basename": "publish",
        "doc": _CHAIN_DOCS["publish"],
        "actions": [(guarded, ["pipeline.build:step_publish", root, case_id])],
        "file_dep": [str(cache.plan), str(cache.case_json), str(cache.summary)],
        "uptodate": [(publish_is_current, [root, case_id])],
    }
    yield {
        "basename": "build",
        "doc": _CHAIN_DOCS["build"],
        "actions": [(guarded, ["pipeline.build:report_build", root, case_id])],
        "task_dep": ["publish"],
        "uptodate": [False],
        "verbosity": 2,
    }


def _plan(cache):
    """The cached plan, or None when it cannot be read: cut short by a power
    loss, say; validate_index plans again, and the per-file tasks come then."""
    try:
        return cache.read_plan()
    except (OSError, VianoError):
        return None


@create_after(executed="validate_index")
def task_read_input():
    """Read, strictly decode and validate one structured input document"""
    return _read_inputs()


def _read_inputs():
    context = _case_context()
    if context is None or not context[2].plan.exists():
        return
    root, case_id, cache = context
    plan = _plan(cache)
    if plan is None:
        return
    inline = plan["limits"]["inline_fact_value"]
    limits = CaseBuilderLimits(**plan["limits"])
    reusing = reuses_confirmed_case(cache)
    for doc in plan["documents"]:
        # The target's name encodes content, path, contract, builder code and
        # whether the document is over its size bound: it exists exactly when
        # this input was read by this builder under the same bound.
        over = over_read_bound(doc["size"], plan["limits"]["document_bytes"], reusing)
        name = subtask_name(doc["path"])
        target = cache.input_record_name(doc["path"], doc["sha256"], doc["contract"], inline, over)
        if not declares_subtask(f"read_input:{name}", target):
            continue
        yield {
            "name": name,
            "actions": [(guarded, ["pipeline.build:step_read_input", root, case_id, plan["package_id"],
                                   doc["path"], doc["sha256"], doc["size"], doc["contract"]],
                         {"limits": limits, "inline_fact_value": inline})],
            "targets": [target],
            "uptodate": [True],
            "io": io_of_a_run_task(),
        }


@create_after(executed="validate_index")
def task_hash_context():
    """Stream and hash one opaque file (context, events, attachments, unclassified)"""
    return _hash_contexts()


def _hash_contexts():
    context = _case_context()
    if context is None or not context[2].plan.exists():
        return
    root, case_id, cache = context
    plan = _plan(cache)
    if plan is None:
        return
    for ref in plan["opaque"]:
        # Named by path, sha256 and size: the record exists exactly when this
        # file was verified (hashing does not change with the builder's code).
        name = subtask_name(ref["path"])
        target = cache.opaque_name(ref["path"], ref["sha256"], ref["size"])
        if not declares_subtask(f"hash_context:{name}", target):
            continue
        yield {
            "name": name,
            "actions": [(guarded, ["pipeline.build:step_hash_context", root, case_id, plan["package_id"],
                                   ref["path"], ref["sha256"], ref["size"]])],
            "targets": [target],
            "uptodate": [True],
            "io": io_of_a_run_task(),
        }



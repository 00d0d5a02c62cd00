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

from doit import create_after, get_var
from doit.tools import config_changed

from pipeline import BUILDER_VERSION
from pipeline.build import publish_is_current
from pipeline.cache import BuildCache
from pipeline.doitcli import code_version, doit_config, guarded
from pipeline.errors import VianoError
from pipeline.workspace import Workspace, validate_id

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


def task_admit():
    """Admit a bug package (ZIP or directory): doit admit case=ID source=PATH"""
    return _command("cmd_admit", task_admit.__doc__, case=CASE, source=get_var("source"), workspace=WORKSPACE)


def task_append():
    """Append files and a returning case-inputs index: doit append case=ID source=PATH"""
    return _command("cmd_append", task_append.__doc__, case=CASE, source=get_var("source"), workspace=WORKSPACE)


def task_reopen():
    """Open a new analysis revision: doit reopen case=ID by=SOURCE reason=TEXT"""
    return _command("cmd_reopen", task_reopen.__doc__, case=CASE, by=get_var("by"), reason=get_var("reason"), workspace=WORKSPACE)


def task_status():
    """Show state, revision, generation, artifacts, checkpoints, pending tasks: doit status case=ID"""
    return _command("cmd_status", task_status.__doc__, case=CASE, workspace=WORKSPACE)


def task_export():
    """Copy the current case.json, summary and manifest: doit export case=ID dest=DIR"""
    return _command("cmd_export", task_export.__doc__, case=CASE, dest=get_var("dest"), workspace=WORKSPACE)


def task_probes():
    """Print probe candidates for an unresolved built case: doit probes case=ID"""
    return _command("cmd_probes", task_probes.__doc__, case=CASE, workspace=WORKSPACE)


# ------------------------------------------------------------- the build


def task_build():
    """Build the case incrementally: doit build case=ID"""
    context = _case_context()
    if context is None:
        return {**_unusable_variables(), "doc": task_build.__doc__}
    root, case_id, _ = context
    return {
        "doc": task_build.__doc__,
        "actions": [(guarded, ["pipeline.build:report_build", root, case_id])],
        "task_dep": ["publish"],
        "uptodate": [False],
        "verbosity": 2,
    }


def task_validate_index():
    """Check every case-inputs index and plan the build (runs on every build)"""
    context = _case_context()
    if context is None:
        return _unusable_variables()
    root, case_id, cache = context
    return {
        "actions": [(guarded, ["pipeline.build:step_validate_index", root, case_id])],
        "targets": [str(cache.plan)],
        "uptodate": [False],
    }


def _plan(cache):
    return cache.read_json(cache.plan)


@create_after(executed="validate_index")
def task_read_input():
    """Read, strictly decode and validate one structured input document"""
    context = _case_context()
    if context is None or not context[2].plan.exists():
        return
    root, case_id, cache = context
    plan = _plan(cache)
    code = code_version()
    for doc in plan["documents"]:
        key = {"path": doc["path"], "sha256": doc["sha256"], "size": doc["size"], "contract": doc["contract"], "code": code}
        yield {
            "name": doc["path"],
            "actions": [(guarded, ["pipeline.build:step_read_input", root, case_id, plan["package_id"],
                                   doc["path"], doc["sha256"], doc["size"], doc["contract"]])],
            "targets": [str(cache.document(doc["path"], doc["sha256"], doc["contract"]))],
            "uptodate": [config_changed(key)],
        }


@create_after(executed="validate_index")
def task_hash_context():
    """Stream and hash one opaque file (context, events, attachments, unclassified)"""
    context = _case_context()
    if context is None or not context[2].plan.exists():
        return
    root, case_id, cache = context
    plan = _plan(cache)
    for ref in plan["opaque"]:
        key = {"path": ref["path"], "sha256": ref["sha256"], "size": ref["size"]}
        yield {
            "name": ref["path"],
            "actions": [(guarded, ["pipeline.build:step_hash_context", root, case_id, plan["package_id"],
                                   ref["path"], ref["sha256"], ref["size"]])],
            "targets": [str(cache.opaque(ref["path"], ref["sha256"], ref["size"]))],
            "uptodate": [config_changed(key)],
        }


def task_assemble():
    """Assemble the canonical case from the plan and the cached inputs"""
    context = _case_context()
    if context is None:
        return _unusable_variables()
    root, case_id, cache = context
    return {
        "actions": [(guarded, ["pipeline.build:step_assemble", root, case_id])],
        "file_dep": [str(cache.plan)],
        "task_dep": ["read_input", "hash_context"],
        "targets": [str(cache.case_json)],
        "uptodate": [config_changed({"code": code_version(), "builder": BUILDER_VERSION})],
    }


def task_render():
    """Render case_summary.md from case.json"""
    context = _case_context()
    if context is None:
        return _unusable_variables()
    root, case_id, cache = context
    return {
        "actions": [(guarded, ["pipeline.build:step_render", root, case_id])],
        "file_dep": [str(cache.case_json)],
        "targets": [str(cache.summary)],
        "uptodate": [config_changed({"code": code_version(), "builder": BUILDER_VERSION})],
    }


def task_publish():
    """Publish case.json, summary and case-built.json as one generation and confirm it"""
    context = _case_context()
    if context is None:
        return _unusable_variables()
    root, case_id, cache = context
    return {
        "actions": [(guarded, ["pipeline.build:step_publish", root, case_id])],
        "file_dep": [str(cache.plan), str(cache.case_json), str(cache.summary)],
        "uptodate": [(publish_is_current, [root, case_id])],
    }

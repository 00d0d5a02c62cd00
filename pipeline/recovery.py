"""Roll a case's store record forward to generations its package already has.

Every command that changes a package publishes the manifest first (the
package's commit point) and records the new generation in the
CheckpointStore second. A crash between the two leaves the store one or more
generations behind. :func:`roll_forward` finishes that second step from what
the published manifests say, so a retry never creates another generation:

* a generation holding this revision's ``case-built.json`` is a case
  publication -> confirm it (``case_built``) with its own step id and hash;
* a generation that only raises ``analysis_revision`` by one is a reopen;
* anything else is an intake (append, enrich).

Callers hold the case lock.
"""

from __future__ import annotations

from .errors import IntegrityError
from .jsoncanon import decode_strict
from .plan import case_paths_for

__all__ = ["roll_forward"]

_CASE_BUILT_LIMIT = 1024 * 1024


def roll_forward(store, package, case_id: str):
    """Take in every published generation the store has not recorded yet, and
    remove temp files that crashed writers left behind."""
    from .packages import PackageWriter

    PackageWriter(package).cleanup_orphans()
    record = store.get(case_id)
    current = package.current_generation()
    while record.generation < current:
        target = record.generation + 1
        previous = package.manifest(record.generation)
        manifest = package.manifest(target)
        revision = record.analysis_revision
        outputs = case_paths_for(revision)
        if manifest["analysis_revision"] == revision + 1 and manifest["files"] == previous["files"]:
            store.advance(case_id, "reopen", expected_generation=record.generation, new_generation=target,
                          detail={"recovered": True})
        elif outputs["case_built"] in manifest["files"] and outputs["case_built"] not in previous["files"]:
            data = package.read_verified(outputs["case_built"], _CASE_BUILT_LIMIT, manifest=manifest)
            built = decode_strict(data, max_bytes=_CASE_BUILT_LIMIT, path=outputs["case_built"], error=IntegrityError)
            if record.state == "VALIDATED" or record.state == "REOPENED":
                store.advance(case_id, "start_build", expected_generation=record.generation,
                              step_id=built["step_id"], request_hash=built["request_hash"])
            store.advance(
                case_id,
                "case_built",
                expected_generation=record.generation,
                new_generation=target,
                step_id=built["step_id"],
                request_hash=built["request_hash"],
                artifacts=[outputs["case"], outputs["case_summary"], outputs["case_built"]],
            )
        else:
            store.advance(case_id, "intake", expected_generation=record.generation, new_generation=target)
        record = store.get(case_id)
    return record

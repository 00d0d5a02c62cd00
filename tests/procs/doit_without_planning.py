"""Run the real doit command line with planning from the package made
impossible: a build that plans fails with PLANNED_FROM_THE_PACKAGE, one that
takes a plan made earlier (the cache's, or the one ``doit append`` left)
runs as usual.

Usage: doit_without_planning.py doit-arguments...
"""

import sys

import pipeline.build as build


def no_planning(*args, **kwargs):
    raise SystemExit("PLANNED_FROM_THE_PACKAGE")


build.make_plan = no_planning

from doit.__main__ import main  # noqa: E402 - after the patch, as the steps are looked up by name

sys.argv = ["doit", *sys.argv[1:]]
sys.exit(main())

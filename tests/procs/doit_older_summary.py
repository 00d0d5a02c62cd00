"""Run the real doit command line with a summary renderer that writes one
line more, as a builder of an older summary text would.

Usage: doit_older_summary.py doit-arguments...
"""

import sys

import pipeline.summary as summary

render = summary.render_summary


def older_render(case, *args, **kwargs):
    return render(case, *args, **kwargs) + "Rendered by an older builder.\n"


summary.render_summary = older_render

from doit.__main__ import main  # noqa: E402 - after the patch, as the pipeline imports it lazily

sys.argv = ["doit", *sys.argv[1:]]
sys.exit(main())

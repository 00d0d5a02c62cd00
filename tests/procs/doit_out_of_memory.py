"""Run the real doit command line with the address space capped as the
assemble step starts, at what the process has mapped then, as under
``ulimit -v`` or a container's limit that the step's work runs into.

Usage: doit_out_of_memory.py doit-arguments...
"""

import resource
import sys

import pipeline.build as build

assemble = build.step_assemble


def _size_now() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def capped_assemble(*args, **kwargs):
    cap = _size_now()
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return assemble(*args, **kwargs)


build.step_assemble = capped_assemble

from doit.__main__ import main  # noqa: E402 - after the patch, as the steps are looked up by name

sys.argv = ["doit", *sys.argv[1:]]
sys.exit(main())

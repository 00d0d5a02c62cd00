"""Run the real doit command line, counting the checkpoint-store connections
the process opens and its roll-forwards of the store; prints ``stores
opened: N`` and ``roll-forwards: N`` on standard error at exit.
With ``fork`` among the arguments, the read_input step forks a child that
exits at once (as a program running builds in-process may fork), and the
child reports whether it found any store connection of its parent open.

Usage: doit_counting_stores.py doit-arguments... [fork]
"""

import atexit
import os
import sys

import pipeline.build as build
import pipeline.lifecycle as lifecycle
import pipeline.recovery as recovery

opened = []
original_init = lifecycle.CheckpointStore.__init__


def counting_init(self, *args, **kwargs):
    opened.append(1)
    original_init(self, *args, **kwargs)


lifecycle.CheckpointStore.__init__ = counting_init
rolled = []
original_roll_forward = recovery.roll_forward


def counting_roll_forward(*args, **kwargs):
    rolled.append(1)
    return original_roll_forward(*args, **kwargs)


recovery.roll_forward = counting_roll_forward
atexit.register(lambda: os.write(2, f"stores opened: {len(opened)}\nroll-forwards: {len(rolled)}\n".encode()))

if "fork" in sys.argv[1:]:
    sys.argv.remove("fork")
    read_input = build.step_read_input

    def forking_read_input(*args, **kwargs):
        pid = os.fork()
        if pid == 0:
            os.write(2, f"child sees run stores: {len(build._RUN_STORES)}\n".encode())
            os._exit(0)
        os.waitpid(pid, 0)
        return read_input(*args, **kwargs)

    build.step_read_input = forking_read_input

from doit.__main__ import main  # noqa: E402 - after the patch, as the steps are looked up by name

sys.argv = ["doit", *sys.argv[1:]]
sys.exit(main())

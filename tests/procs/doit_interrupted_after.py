"""Run the real doit command line, sending this process SIGINT at a moment.

Usage: doit_interrupted_after.py WHEN doit-arguments...

WHEN is ``report`` (right after the build task printed its confirmed line)
or ``exit`` (late in the interpreter's exit, after doit returned): a Ctrl-C
pressed just as a build says it is done.
"""

import os
import signal
import sys

when = sys.argv[1]

if when == "report":
    import pipeline.build  # the dodo file's guarded action looks the function up here at call time

    confirm = pipeline.build.report_build

    def report_then_interrupt(*args, **kwargs):
        confirm(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

    pipeline.build.report_build = report_then_interrupt
elif when == "exit":
    class InterruptWhenCollected:
        # Collected as the interpreter clears its modules, after it has put
        # the default SIGINT action back for a Python handler: where a
        # Ctrl-C killed the process silently after a printed success.
        # What it calls is bound now: by then Python 3.13 has set this
        # module's globals (os, signal) to None.
        def __del__(self, kill=os.kill, pid=os.getpid(), sigint=signal.SIGINT):
            kill(pid, sigint)

    holder = type(sys)("viano_interrupt_at_exit")
    holder.late = InterruptWhenCollected()
    sys.modules[holder.__name__] = holder
else:
    sys.exit(f"unknown moment {when!r}")

from doit.__main__ import main  # noqa: E402

sys.argv = ["doit", *sys.argv[2:]]
sys.exit(main())

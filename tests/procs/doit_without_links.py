"""Run the real doit command line as on a filesystem without hard links.

Usage: doit_without_links.py doit-arguments...

``os.link`` answers EPERM, as link(2) does on FAT, exFAT and many SMB
shares; everything else is the real system (renameat2 included). Only this
process is affected.
"""

import errno
import os
import sys


def no_links(*args, **kwargs):
    raise PermissionError(errno.EPERM, "Operation not permitted")


os.link = no_links

from doit.__main__ import main  # noqa: E402 - after the patch

sys.argv = ["doit", *sys.argv[1:]]
sys.exit(main())

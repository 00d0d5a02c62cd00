"""What the side-by-side scripts (``ab_append.py``, ``ab_admit.py``) share:
the ``--base`` option and a temporary git worktree of that ref beside the
working tree."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent


def parser(doc: str) -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    found.add_argument("--base", required=True, help="git ref of the version to compare with the working tree")
    return found


@contextlib.contextmanager
def base_and_current(ref: str, prefix: str, parent: str | None = None) -> Iterator[tuple[Path, dict[str, Path]]]:
    """A temporary directory and the two source trees to compare: ``base``
    (``ref`` checked out in a worktree inside that directory) and
    ``current`` (this working tree). Both are removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    old_tree = root / "base-tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(old_tree), ref], check=True)
    try:
        yield root, {"base": old_tree, "current": REPO}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old_tree)], check=False)
        shutil.rmtree(root, ignore_errors=True)

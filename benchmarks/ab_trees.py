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
    ``current`` (a copy of this working tree's tracked files as they are
    now, beside it). Both are removed afterwards.

    The current version runs from a copy, not from the working tree: run
    from the working tree, the same code measured 1.10-1.12 x its own
    worktree copy here (session 18, ``--base HEAD``), a difference of where
    the files lie, which every comparison charged to the change."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    old_tree = root / "base-tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(old_tree), ref], check=True)
    try:
        new_tree = root / "current-tree"
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], check=True, capture_output=True).stdout
        for name in filter(None, listed.decode().split("\0")):
            source = REPO / name
            if source.is_file():
                (new_tree / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, new_tree / name)
        yield root, {"base": old_tree, "current": new_tree}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old_tree)], check=False)
        shutil.rmtree(root, ignore_errors=True)

"""``from viano_bug_analysis.lifecycle import Workspace, CheckpointStore`` (seed 001)."""

from pipeline.lifecycle import CheckpointStore
from pipeline.packages import PackageWriter
from pipeline.workspace import Workspace

__all__ = ["CheckpointStore", "PackageWriter", "Workspace"]

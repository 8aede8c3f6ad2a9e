"""Checkpoints of what the daemon holds for a namespace (snapshots sharing extents, or
copies in a directory), taken between steps while training goes on; restore; clean-up
after a crash; the files of a checkpoint directory and its manifest."""
from fuyoud.checkpoints.checkpointer import Checkpointer, CheckpointResult, recover

__all__ = ["CheckpointResult", "Checkpointer", "recover"]

"""Checkpoints and export: the client's part of a checkpoint (state.py) and the
trained weights as sharded safetensors (exporter.py)."""
from fuyou_client.checkpoints.state import client_state, load_client_state, restore_groups
from fuyou_client.checkpoints.exporter import Trained, export, load_exported

__all__ = ["client_state", "load_client_state", "restore_groups", "export", "Trained", "load_exported"]

"""Checkpoints and export: the client's part of a checkpoint (client_state.py) and the
trained weights as sharded safetensors (export.py)."""
from fuyou_client.checkpoints.client_state import client_state, load_client_state, restore_groups
from fuyou_client.checkpoints.export import Trained, export, load_exported

__all__ = ["client_state", "load_client_state", "restore_groups", "export", "Trained", "load_exported"]

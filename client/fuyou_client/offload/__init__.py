"""Parameter offload (offloader.py): a block's weights are in memory only while it computes, in
weight slots (slots.py)."""
from fuyou_client.offload.group import OffloadedGroup, Saved, SavedCast, Source, read_declined
from fuyou_client.offload.offloader import Offloader

__all__ = ["Offloader", "OffloadedGroup", "Source", "Saved", "SavedCast", "read_declined"]

"""Parameter offload (offloader.py): a block's weights are in memory only while it computes, in
weight slots (slots.py)."""
from fuyou_client.offload.offloader import OffloadedGroup, Offloader, Saved, SavedCast, Source, read_declined

__all__ = ["Offloader", "OffloadedGroup", "Source", "Saved", "SavedCast", "read_declined"]

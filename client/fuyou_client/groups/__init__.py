"""Layer groups and where their weights live: the placement rule and the objects' names
(placement.py), a group's memory (layer_group.py), its creation (creation.py) and its
master weights on the SSD array (masters.py)."""
from fuyou_client.groups.creation import Scratch, create
from fuyou_client.groups.layer_group import LayerGroup, land_new_weights

__all__ = ["LayerGroup", "create", "Scratch", "land_new_weights"]

"""The model as Fuyou sees it: its blocks and layer-group specs (blocks.py), the torch
param groups each parameter steps with (param_groups.py), and a model built on the meta
device made real one group at a time (materialize.py, init_record.py, weights_file.py)."""
from fuyou_client.model.blocks import GroupSpec, Part, block_list, find_blocks, flat_parts, mlp_layout, split
from fuyou_client.model.cuts import cut
from fuyou_client.model.materialize import Materializer, prepare
from fuyou_client.model.param_groups import TorchGroups, resolve

__all__ = ["GroupSpec", "Part", "split", "cut", "block_list", "find_blocks", "flat_parts", "mlp_layout", "TorchGroups", "resolve",
           "prepare", "Materializer"]

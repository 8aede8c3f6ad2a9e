"""Parallelism: the seam attach and the engine ask (seam.py: one process, data
parallelism), the torch.distributed world and its collectives (world.py), ZeRO-2-style
sharded gradients and weights (sharded.py) and collective checkpoints (checkpoints/)."""
from fuyou_client.parallel.seam import DataParallel, SingleProcess, of
from fuyou_client.parallel.world import Collectives, Shards, World

__all__ = ["of", "SingleProcess", "DataParallel", "World", "Shards", "Collectives"]

"""Parallelism: the seam attach and the engine ask (seam.py: one process, data
parallelism; remote.py: an optimizer host's worker), the torch.distributed world and its
collectives (world.py), ZeRO-2-style sharded gradients and weights (sharded.py),
collective checkpoints (checkpoints.py), the optimizer-host layout and commands (link.py)
and the heartbeats that name a lost rank (liveness.py)."""
from fuyou_client.parallel.link import Layout
from fuyou_client.parallel.remote import OptimizerHostWorker
from fuyou_client.parallel.seam import DataParallel, SingleProcess
from fuyou_client.parallel.world import Collectives, Shards, World

__all__ = ["of", "SingleProcess", "DataParallel", "OptimizerHostWorker", "World", "Shards", "Collectives"]


def of(process_group=None, optimizer_ranks=None):
    """The seam for attach(process_group=..., optimizer_ranks=...): a worker of an
    optimizer-host job, data parallelism in a world of more than one rank, else a single
    process. (With ``optimizer_ranks``, collective: every rank of the job calls it.)"""
    world = World.of(process_group)
    if optimizer_ranks is not None:
        layout = Layout.of(world, optimizer_ranks)
        if layout.is_optimizer:
            layout.world.agree(ValueError(
                f"rank {layout.world.rank} is one of optimizer_ranks {list(optimizer_ranks)}, but it called attach: "
                "an optimizer rank calls fuyou_client.serve_optimizer(model, optimizer, optimizer_ranks=...)"),
                "attach")
        return OptimizerHostWorker(layout)
    return SingleProcess() if world is None else DataParallel(world)

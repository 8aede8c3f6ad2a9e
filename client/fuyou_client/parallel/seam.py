"""The parallelism seam: what attach and the engine ask of "how many processes train this
model, and where its optimizer state lives", answered by one object per mode.

* ``SingleProcess``: one training process, its whole optimizer state in its host's daemon.
* ``DataParallel``: every rank of a torch.distributed world trains a replica; each rank's
  daemon holds its shard of every group's state (ZeRO-2 style: sharded.py), gradients
  are reduce-scattered to the shards and the new weights all-gathered; checkpoints are
  collective (checkpoints/). Every call below is made by every rank, in the same order.

* ``OptimizerHostWorker`` (remote.py): a worker of a job whose optimizer state is on
  dedicated optimizer ranks (engine/serve.py): the workers' summed gradients go to them
  shard by shard, the new weights come back the same way; it holds no state.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fuyou_client.checkpoints import client_state, export, load_client_state
from fuyou_client.gradients import Clipper
from fuyou_client.parallel import checkpoints as dp_checkpoints  # (sibling module, not the facade)
from fuyou_client.parallel import liveness
from fuyou_client.parallel import world as distributed
from fuyou_client.parallel.sharded import Sharded, ShardedClipper
from fuyou_client.parallel.world import Collectives, Shards, World


class SingleProcess:
    world = None
    data_parallel = False
    share = 1  # this process's part of each group's state
    holds_state = True  # its daemon holds optimizer state (an optimizer-host worker's holds none)
    strategy_kind = None  # the gradient strategy of every trained group, if the seam's (gradients/strategy.py)

    # -- attach ---------------------------------------------------------------------------
    def check_options(self, opts) -> None:
        pass

    def check_model(self, materializer) -> None:
        """``materializer``: a model on the meta device (model/materialize.py), or None."""

    def check_device(self, opts, device) -> None:
        pass

    def agree(self, error: BaseException | None, what: str) -> None:
        """A failure here is this process's to raise."""
        if error is not None:
            raise error

    def agree_on_model(self, groups, torch_groups) -> None:
        pass

    def namespace(self, namespace: str | None) -> str | None:
        return namespace

    def restore(self, session, model, groups, opts) -> dict | None:
        """The client state of ``opts.resume`` (a data-parallel run's checkpoint too, cut to
        one process), its optimizer state restored into ``session``; None without resume."""
        if opts.resume is None:
            return None
        if dp_checkpoints.is_world(opts.resume):
            return load_client_state(dp_checkpoints.restore(
                session, World(None, 0, 1, "none"), opts.resume, groups, opts.reshard, session.namespace))
        return load_client_state(session.restore(opts.resume).client_state)

    def joined(self, session) -> list | None:
        """(after the engine is built) Each rank's (host, daemon); None for one process."""
        return None

    def daemon_sharers(self, session) -> int:
        """(every rank, before the memory plan) How many of the job's processes share this
        process's daemon, this one included: each plans within its part of the daemon's budget."""
        return 1

    # -- the engine's parts ---------------------------------------------------------------
    def gradient_strategy(self, options, device, param_groups):
        """(with ``strategy_kind``) The gradient strategy of every trained group.
        ``param_groups``: () -> the torch param groups, as schedulers left them."""
        return None

    def shards(self, numel: int) -> Shards | None:
        """This process's share of a group of ``numel`` elements (None: all of it)."""
        return None

    def bind(self, session, group) -> None:
        """A trained layer group is created (in forward order)."""

    def fetch_gather(self, session, groups):
        """The offloader's ``gather`` (None: a fetch reads the whole group)."""
        return None

    def clipper(self, model, groups):
        return Clipper(model, groups)

    def refuse_train_step(self) -> None:
        pass

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, session, groups, param_groups, extra, directory, mode, timeout):
        return session.checkpoint(directory, timeout, mode, client_state(param_groups, extra))

    def export(self, trained, directory, dtype):
        return export(trained, directory, dtype)

    def held_parts(self, groups):
        """The parts whose daemon groups this process holds."""
        for g in groups:
            yield from g.spec.parts

    def close(self) -> None:
        pass


class DataParallel(SingleProcess):
    data_parallel = True
    strategy_kind = "sharded"

    def __init__(self, world: World):
        self.world = world
        self.share = world.size
        liveness.start(dist.get_rank())  # (the errors of a lost rank name it)
        self.collectives: Collectives | None = None
        self.sharding: Sharded | None = None
        self._job = None

    # -- attach ---------------------------------------------------------------------------
    def check_options(self, opts) -> None:
        """What this version does not do with data parallelism, refused on every rank alike."""
        if opts.session is not None:
            raise ValueError("with data parallelism attach opens each rank's session itself (in the job's namespace); "
                             "pass socket= rather than session=")

    def check_model(self, materializer) -> None:
        if materializer is not None:
            raise ValueError("a model on the meta device cannot be attached with data parallelism yet: build it on "
                             "the CPU on every rank (rank 0's weights are broadcast)")

    def check_device(self, opts, device) -> None:
        if opts.offload == "host" and not device.shares_host_memory:
            raise ValueError("attach(offload=\"host\") with data parallelism is not built yet: pass offload=True (each "
                             "fetch reads this rank's shard and gathers the rest on the device) or False")

    def agree(self, error: BaseException | None, what: str) -> None:
        """A failure on any rank is an error on every rank."""
        self.world.agree(error, what)

    def agree_on_model(self, groups, torch_groups) -> None:
        self.world.same("the model's layer groups and optimizer",
                        distributed.signature((spec, [torch_groups.spec(p.index) for p in spec.parts])
                                              for spec in groups))

    def namespace(self, namespace: str | None) -> str:
        self._job = distributed.job_id(self.world, namespace)
        return f"{self._job}.r{self.world.rank}"

    def restore(self, session, model, groups, opts) -> dict | None:
        """Rank 0's weights and buffers on every rank, or this rank's shards of a
        checkpoint; a failure anywhere is an error everywhere."""
        world = self.world
        error, state = None, None
        try:
            if opts.resume is not None:
                state = load_client_state(dp_checkpoints.restore(session, world, opts.resume, groups, opts.reshard,
                                                                 self._job))
        except BaseException as exc:  # noqa: BLE001 - agreed below
            error = exc
        world.agree(error, "resume")
        with torch.no_grad():
            world.broadcast([t.data for t in (*model.parameters(), *model.buffers())])
        if state is not None:  # the parameters take the masters, gathered from the ranks' shards
            dp_checkpoints.load_masters(session, world, [spec for spec in groups if spec.numel])
        return state

    def joined(self, session) -> list:
        self.world.agree(None, "attach")
        return self.world.gather(distributed.daemon_identity(session))

    def daemon_sharers(self, session) -> int:
        mine = distributed.daemon_identity(session)
        return sum(peer == mine for peer in self.world.gather(mine))

    # -- the engine's parts ---------------------------------------------------------------
    def gradient_strategy(self, options, device, param_groups) -> Sharded:
        self.collectives = Collectives(self.world, options.check_collectives)
        self.sharding = Sharded(self.world, self.collectives, options.reduce, device)
        return self.sharding

    def shards(self, numel: int) -> Shards:
        return Shards(numel, self.world.size, self.world.rank)

    def bind(self, session, group) -> None:
        self.sharding.bind(session, group)

    def fetch_gather(self, session, groups):
        return self.sharding.gather_fetch(session, {g.spec.name: g.shard.shards for g in groups
                                                    if g.offloaded is not None and g.shard})

    def clipper(self, model, groups):
        return ShardedClipper(self.sharding, groups)

    def refuse_train_step(self) -> None:
        raise RuntimeError("train_step is not built for data parallelism yet: train with the ordinary loop "
                           "(accumulation_steps=K for K micro-batches per step)")

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, session, groups, param_groups, extra, directory, mode, timeout):
        return dp_checkpoints.save(session, self.world, groups, param_groups, extra, directory, mode, timeout)

    def export(self, trained, directory, dtype):
        """(every rank) The masters gathered from the shards; rank 0 writes."""
        return export(trained, directory, dtype, masters=lambda session, spec: dp_checkpoints.gather_masters(
            session, self.world, self.collectives, spec))

    def held_parts(self, groups):
        for g in groups:
            yield from ((part for part, _, _ in g.shard.pieces) if g.shard is not None else g.spec.parts)

    def close(self) -> None:
        if self.collectives is not None:  # (after the last fetches: with offload they gather from the ranks)
            self.collectives.close()

"""The optimizer-host layout, and the link between the workers and one optimizer rank:
what both sides (remote.py: the workers; engine/serve.py: the optimizer ranks) agree on and
say to each other.

* ``Layout``: a torch.distributed group of W workers and M optimizer ranks
  (``optimizer_ranks``). Optimizer rank m owns a contiguous share of the layer groups,
  balanced by bytes (``owners``), and talks to the workers over a process group of its
  own, its *link*: the W workers and itself. Links are gloo groups whatever the group's
  backend: the optimizer rank has no GPU, so NCCL cannot reach it; a GPU worker's
  gradients and weights cross PCIe to its host memory and the network from there.
* ``Link``: every exchange on a link starts with a *command*: each member's header (four
  float64: the operation, the layer group's index, two arguments) is all-gathered; the
  workers' headers must be equal (workers that disagree, because one skipped a group or
  runs another schedule, are an error on every member naming the ranks, not a hang or
  mixed data) and the optimizer rank reads what to do from them. Then the operation's
  collectives (ops below) run between the same members.

The optimizer rank needs no model schedule of its own: it follows the commands in the
order the workers issue them (their engines' collective thread, world.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fuyou_client.parallel.world import CollectiveError, Shards, World

# The operations (header[0]); LISTEN is the optimizer rank's own header.
LISTEN, REDUCE, STEP, NORM, WEIGHTS, HYPER, CHECKPOINT, MASTERS, CLOSE, FETCH = range(10)
OP_NAMES = {LISTEN: "listen", REDUCE: "reduce", STEP: "step", NORM: "norm", WEIGHTS: "weights", HYPER: "hyper",
            CHECKPOINT: "checkpoint", MASTERS: "masters", CLOSE: "close", FETCH: "fetch"}

# A WEIGHTS reply's status (the first number of its small tensor).
OK, NONFINITE, FAILED, NOT_STEPPED = range(4)


@dataclass
class Layout:
    """Who is who in an optimizer-host job (the same on every rank)."""
    world: World  # the whole group: workers and optimizer ranks
    optimizer_ranks: tuple[int, ...]  # ranks of the group
    workers: tuple[int, ...]
    links: list  # per optimizer rank: its gloo process group with the workers (in optimizer_ranks' order)
    workers_group: object  # the workers' own gloo group (host memory: the shards' reduce-scatter and all-gather)

    @classmethod
    def of(cls, world: World | None, optimizer_ranks) -> "Layout":
        """The layout of ``world`` (every rank calls it: the links are created collectively)."""
        if world is None:
            raise ValueError("optimizer_ranks given, but there is no torch.distributed world of more than one rank: "
                             "start the workers and the optimizer ranks together (torchrun; docs/guide/"
                             "optimizer-host.md)")
        ranks = tuple(optimizer_ranks)
        # (every rank joins the agreement on the list before refusing it: a mismatch is an error, not a hang)
        world.same("optimizer_ranks", ranks)
        bad = [r for r in ranks if r >= world.size]
        if bad:
            raise ValueError(f"optimizer_ranks {list(ranks)} names rank {bad[0]}, but the group has {world.size} "
                             f"ranks (0 to {world.size - 1})")
        workers = tuple(r for r in range(world.size) if r not in ranks)
        if not workers:
            raise ValueError(f"every rank of the group is an optimizer rank ({list(ranks)}): at least one must be a "
                             "worker that trains the model")
        from fuyou_client.parallel import liveness
        liveness.start(dist.get_rank())  # (the errors of a lost rank name it)
        links = [dist.new_group([world.global_rank(r) for r in (*workers, o)], backend="gloo") for o in ranks]
        workers_group = dist.new_group([world.global_rank(r) for r in workers], backend="gloo")
        return cls(world, ranks, workers, links, workers_group)

    @property
    def is_optimizer(self) -> bool:
        return self.world.rank in self.optimizer_ranks

    @property
    def worker_count(self) -> int:
        return len(self.workers)

    def shards(self, numel: int) -> Shards:
        """How a layer group's flat vector is cut among the workers (this one's shard; the
        optimizer ranks' view: the first worker's)."""
        rank = self.workers.index(self.world.rank) if self.world.rank in self.workers else 0
        return Shards(numel, self.worker_count, rank)

    def owners(self, sizes: list[int]) -> list[int]:
        """Which optimizer rank (its index in ``optimizer_ranks``) owns each layer group,
        for groups of ``sizes`` elements in forward order: contiguous shares of about
        equal size, one group at least each."""
        m, n = len(self.optimizer_ranks), len(sizes)
        if n < m:
            raise ValueError(f"the model has {n} layer groups and there are {m} optimizer ranks: each optimizer rank "
                             "owns at least one group; use fewer optimizer ranks")
        weights = sizes if sum(sizes) else [1] * n
        edges = [0]
        for w in weights:
            edges.append(edges[-1] + w)
        starts = [0]
        for k in range(1, m):
            target = edges[-1] * k / m
            i = min(range(n + 1), key=lambda j: abs(edges[j] - target))
            starts.append(min(max(i, starts[-1] + 1), n - (m - k)))
        return [max(k for k in range(m) if starts[k] <= i) for i in range(n)]

    def link(self, index: int) -> "Link":
        return Link(self, index)


class Link:
    """The process group of optimizer rank ``index`` and the workers, seen from either side."""

    def __init__(self, layout: Layout, index: int):
        world = layout.world
        self.layout, self.index = layout, index
        self.group = layout.links[index]
        self.optimizer = world.global_rank(layout.optimizer_ranks[index])  # (global ranks: what dist's src/dst take)
        self.first_worker = world.global_rank(layout.workers[0])
        self.members = (*layout.workers, layout.optimizer_ranks[index])  # (group ranks, in the link's order)

    def __repr__(self) -> str:
        return f"optimizer rank {self.layout.optimizer_ranks[self.index]}"

    # -- commands ---------------------------------------------------------------------------
    def command(self, op: int, group: int = -1, a: float = 0.0, b: float = 0.0) -> None:
        """(worker) Tell the optimizer rank what comes next."""
        self._exchange(torch.tensor([op, group, a, b], dtype=torch.float64))

    def listen(self) -> tuple[int, int, float, float]:
        """(optimizer rank) The workers' next command: (op, group index, a, b)."""
        rows = self._exchange(torch.tensor([LISTEN, -1, 0.0, 0.0], dtype=torch.float64))
        op, group, a, b = rows[0].tolist()
        return int(op), int(group), a, b

    def _exchange(self, mine: torch.Tensor) -> torch.Tensor:
        rows = [torch.empty(4, dtype=torch.float64) for _ in self.members]
        dist.all_gather(rows, mine, group=self.group)
        workers = rows[:-1]
        differ = [i for i in range(1, len(workers)) if not _same(workers[i], workers[0])]
        if differ:
            r = differ[0]
            raise CollectiveError(
                f"the workers issued different commands to {self}: rank {self.members[0]} {describe(workers[0])}, "
                f"rank {self.members[r]} {describe(workers[r])}; every worker must run the same layer groups in the "
                "same order (a group some worker did not use in an iteration, different models, or control flow "
                "that differs by rank)")
        return workers

    # -- payloads ---------------------------------------------------------------------------
    def reduce(self, t: torch.Tensor) -> None:
        """The members' sum of ``t`` into the optimizer rank's ``t``."""
        dist.reduce(t, dst=self.optimizer, group=self.group)

    def broadcast(self, t: torch.Tensor) -> None:
        """The optimizer rank's ``t`` into every worker's."""
        dist.broadcast(t, src=self.optimizer, group=self.group)

    def gather(self, shard: torch.Tensor, parts: list | None = None) -> None:
        """Every member's ``shard`` into the optimizer rank's ``parts`` (one per member, in
        the link's order: the workers', then its own)."""
        dist.gather(shard, gather_list=parts, dst=self.optimizer, group=self.group)

    def scatter(self, shard: torch.Tensor, parts: list | None = None) -> None:
        """The optimizer rank's ``parts`` (one per member) into each member's ``shard``."""
        dist.scatter(shard, scatter_list=parts, src=self.optimizer, group=self.group)

    def from_first_worker(self, t: torch.Tensor) -> None:
        """The first worker's ``t`` into the other members' (the initial weights)."""
        dist.broadcast(t, src=self.first_worker, group=self.group)

    def sum(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)

    def object_from_optimizer(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=self.optimizer, group=self.group)
        return box[0]

    def object_from_first_worker(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=self.first_worker, group=self.group)
        return box[0]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a.tolist(), b.tolist()))


def describe(row: torch.Tensor) -> str:
    op, group, a, b = row.tolist()
    name = OP_NAMES.get(int(op), f"#{int(op)}")
    return f"{name}" + (f" of group #{int(group)}" if group >= 0 else "")


def scale_arg(scale: float | None) -> float:
    """A clipping coefficient as a header argument (NaN: none)."""
    return float("nan") if scale is None else float(scale)


def scale_of(arg: float) -> float | None:
    return None if math.isnan(arg) else arg

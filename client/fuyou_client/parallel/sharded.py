"""ZeRO-2-style gradients and weights for data parallelism (world.py has the world).

Each layer group's flat vector is cut into one shard per rank (``distributed.Shards``);
rank r's daemon holds the fp32 master weights, the moments and the step count of shard r
only (a daemon group per torch param group the shard meets, named as the part is).

* Gradients: when a group's gradients are final, its full flat gradient (padded with
  zeros to the shards' sum) is reduce-scattered so that this rank's shard of the mean
  lands in a shared-memory buffer the daemon reads, and the shard's step is submitted.
  With ``reduce="step"`` (the default) the micro-batches accumulate locally and the
  reduce-scatter comes once, after the last (DDP's ``no_sync``); with
  ``reduce="backward"`` each backward's gradients are reduce-scattered at once and the
  shard accumulates in fp32 in shared memory. Before a shard steps, the ranks agree that
  every shard of the group is finite: a non-finite gradient anywhere steps the group
  nowhere (its state kept on every rank) and raises NonFinite on every rank.
* Weights: the step writes the shard's new weights (the compute dtype) into a shared
  buffer; at the barrier a resident group's weights are all-gathered from the shards, in
  group order, on every rank. An offloaded block has no barrier gather: each of its
  fetches reads this rank's shard from the SSD array and gathers the rest
  (``gather_fetch``).
* Clipping: the global norm is the square root of an all-reduce of the shards' sums of
  squares (padding is zero: it adds nothing).

On a device with its own memory (a GPU; NCCL) the collectives run on the device's flat
tensors: only the shard crosses PCIe, down (gradients) and up (weights), on the
device's copy streams, ordered by events: 1/N of the bytes a single process moves.

Every collective goes through the engine's ``Collectives`` thread, in the order the
training thread asks (world.py).
"""
from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fuyou_client.parallel import world as distributed
from fuyou_client.parallel.world import Collectives, Shards, World
from fuyou_client.gradients.clipping import NormClipper
from fuyou_client.errors import NonFinite
from fuyou_client.gradients.strategy import GradientStrategy, Start
from fuyou_client.optim import StepInfo
from fuyou_client.connection.session import flatten
from fuyou_client.offload.group import read_declined

REDUCE_MODES = ("step", "backward")


@dataclass(eq=False)
class ShardState:
    shards: Shards
    pieces: list  # (part, lo, hi): the daemon groups of this rank's shard
    grads: object  # SharedBuffer: this rank's shard of the mean gradient (what the step reads)
    weights: object  # SharedBuffer: this rank's shard of the weights (what the step writes)
    device_grads: torch.Tensor | None = None  # a device with its own memory: the reduce-scatter's output there
    device_weights: torch.Tensor | None = None  # ... and the all-gather's input
    staging: object = None  # SharedBuffer: per-backward reduction on such a device, a micro-batch's shard
    reduced: Future | None = None  # the reduce-scatter(s) of this iteration's gradients so far


class Sharded(GradientStrategy):
    name = "sharded"
    lands_weights = True  # (the all-gather writes the parameters' memory)

    def __init__(self, world: World, collectives: Collectives, reduce: str, device):
        self.world = world
        self.collectives = collectives
        self.per_backward = reduce == "backward"
        self.device = device

    def shards(self, numel: int) -> Shards:
        return Shards(numel, self.world.size, self.world.rank)

    def host_buffer_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return self.shards(numel).padded * dtype.itemsize  # (the reduce-scatter reads the padding: zeros)

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.per_backward else dtype

    def bind(self, session, g) -> None:
        """The group's shard buffers, its weights' shard as they are now."""
        shards = self.shards(g.numel)
        weights = session.allocate(shards.per * g.dtype.itemsize)
        grads = session.allocate(shards.per * g.grad_dtype.itemsize)
        if g.offloaded is None:  # (an offloaded group's weights are on the SSD array: each fetch gathers them)
            full = self.full_weights(g)
            weights.tensor(g.dtype)[:shards.per].copy_(full[shards.rank * shards.per:(shards.rank + 1) * shards.per])
        g.shard = ShardState(shards, shards.pieces(g.spec.parts), grads, weights)
        if not self.device.shares_host_memory:
            g.shard.device_grads = self.device.empty(shards.per * g.dtype.itemsize).view(g.dtype)
            g.shard.device_weights = self.device.empty(shards.per * g.dtype.itemsize).view(g.dtype)
            if self.per_backward:
                g.shard.staging = session.allocate(shards.per * g.dtype.itemsize)

    # -- the group's flat vectors --------------------------------------------------------
    @staticmethod
    def full_weights(g) -> torch.Tensor:
        """The flat weights the parameters are views of (host or device)."""
        return (g.device_weights if g.device_weights is not None else g.weights.tensor(g.dtype))[:g.shard_padded]

    @staticmethod
    def full_grads(g) -> torch.Tensor:
        return (g.device_grads if g.device_grads is not None else g.grads.tensor(g.dtype))[:g.shard_padded]

    def _shard_grads(self, g) -> torch.Tensor:
        return g.shard.grads.tensor(g.grad_dtype)[:g.shard.shards.per]

    # -- gradients ---------------------------------------------------------------------
    def _reduce_scatter(self, g, first: bool, ready) -> None:
        """(collective thread) This rank's shard of the ranks' mean gradient, once the
        compute stream has made the gradients (``ready``): into the shard buffer, or (per
        backward) added to it in fp32. On a device with its own memory the collective runs
        there and only the shard is downloaded."""
        ready.synchronize()
        full, out, st = self.full_grads(g), self._shard_grads(g), g.shard
        if not self.per_backward:
            part = st.device_grads if st.device_grads is not None else out
            distributed.reduce_scatter(part, full, self.world.group)
            part.div_(self.world.size)
            if st.device_grads is not None:
                self.device.download(out, part).synchronize()
            return
        part = st.device_grads if st.device_grads is not None else torch.empty(st.shards.per, dtype=g.dtype)
        distributed.reduce_scatter(part, full, self.world.group)
        part.div_(self.world.size)
        if st.device_grads is not None:
            host = st.staging.tensor(g.dtype)[:st.shards.per]
            self.device.download(host, part).synchronize()
            part = host
        if first:
            out.copy_(part)
        else:
            out.add_(part)
        full.zero_()  # (the next backward accumulates afresh: the host holds the sum)

    def reduce(self, g) -> Future:
        """Issue the group's reduce-scatter (``reduce="step"``), once per iteration."""
        if g.shard.reduced is None:
            g.adopt_grads()
            ready = self.device.record()
            g.shard.reduced = self.collectives.submit(f"reduce-scatter {g.spec.name}",
                                                      lambda: self._reduce_scatter(g, True, ready))
        return g.shard.reduced

    def on_backward(self, g, first: bool) -> None:
        if self.per_backward:
            g.adopt_grads()
            ready = self.device.record()
            g.shard.reduced = self.collectives.submit(f"reduce-scatter {g.spec.name}",
                                                      lambda: self._reduce_scatter(g, first, ready))

    def before_step(self, g) -> None:
        if self.per_backward:
            self.on_backward(g, first=g.backwards == 0)

    def before_grad(self, g) -> None:
        """Before autograd adds to the group's gradients: the reduce-scatter that reads
        (and then zeroes) them is done."""
        if self.per_backward and g.shard.reduced is not None:
            g.shard.reduced.result()

    def submit(self, g, start: Start) -> Future:
        reduced = g.shard.reduced if self.per_backward else self.reduce(g)
        return flatten(self.collectives.submit(f"finite {g.spec.name}", lambda: self._step(g, start),
                                                   after=reduced))

    def _step(self, g, start: Start) -> Future:
        """(collective thread) Step the shard, if every rank's shard is finite."""
        ok = torch.tensor([int(bool(torch.isfinite(self._shard_grads(g)).all()))], dtype=torch.int32,
                          device=self.world.comm_device)
        distributed.all_reduce(ok, self.world.group, dist.ReduceOp.MIN)
        if not ok.item():  # (the step's outcome, not a failed collective: the stream goes on)
            refused: Future = Future()
            refused.set_exception(NonFinite(f"group {g.spec.name}: the mean gradient holds NaN or inf (on some "
                                            "rank's shard); not stepped on any rank, its state kept"))
            return refused
        if not g.shard.pieces:  # (a group smaller than the ranks before this one hold)
            done: Future = Future()
            done.set_result(StepInfo(0, 0.0, 0.0, 0.0, False))
            return done
        return start(g.shard.grads, g.shard.weights, [(part, lo - g.shard.shards.start) for part, lo, _ in
                                                       g.shard.pieces])

    def landing(self, g, stepped: Future) -> Future:
        """At the barrier, in group order: the group's weights gathered from the shards,
        once its step here is done (or failed: the shard then holds its old weights)."""
        if g.offloaded is not None:  # (the next fetch reads the new shards and gathers them)
            return stepped
        full, shard = self.full_weights(g), g.shard.weights.tensor(g.dtype)[:g.shard.shards.per]
        on_device = g.shard.device_weights

        def gather() -> None:
            if on_device is not None:  # (the shard up, then gathered on the device)
                self.device.upload(on_device, shard).synchronize()
            distributed.all_gather(full, shard if on_device is None else on_device, self.world.group)
        gathered = self.collectives.submit(f"all-gather {g.spec.name}", gather, after=stepped)  # (also if it failed)
        out: Future = Future()

        def done(f: Future) -> None:
            exc = f.exception()  # (the step's error, or the all-gather's)
            out.set_exception(exc) if exc is not None else out.set_result(stepped.result())
        gathered.add_done_callback(done)
        return out

    def gather_fetch(self, session, shards_of):
        """The offloader's ``gather``: once this rank's shard of an offloaded group has
        landed in a slot's host buffer (sources the daemon declined to serve are read
        first), the group's weights gathered from the ranks' shards into the slot: on the
        host, or (a device with its own memory) on the device, after only the shard went
        up. Returns the future the offloader waits for (with ``gathered``: nothing left to
        upload)."""
        on_host = self.device.shares_host_memory

        def gather(og, slot, fetch: Future) -> Future:
            shards = shards_of[og.name]
            lo, hi = shards.rank * shards.per, (shards.rank + 1) * shards.per

            def run():
                served = fetch.result() if fetch.exception() is None else None  # (a failure: after the gather)
                if isinstance(served, list):
                    read_declined(session, og.sources, served, slot.host)
                    served = [None if ok is False else ok for ok in served]
                flat = slot.host.tensor(og.dtype)
                if not on_host:  # (the slot's last compute is done with it; only the shard goes up)
                    device_flat = slot.device.view(og.dtype)
                    self.device.upload(device_flat[lo:hi], flat[lo:hi], after=slot.released).synchronize()
                    flat = device_flat
                distributed.all_gather(flat[:shards.padded], flat[lo:hi].clone(), self.world.group)
                return served
            return self.collectives.submit(f"all-gather weights {og.name}", run, after=fetch)
        return gather

    def zero(self, g, device) -> None:
        if g.shard.reduced is not None:
            try:
                g.shard.reduced.result()  # (it reads the gradients)
            except Exception:  # noqa: BLE001 - reported where the step waits for it
                pass
        g.shard.reduced = None  # (the next first backward overwrites the shard)
        self.full_grads(g).zero_()

    def sum_of_squares(self, g) -> torch.Tensor:
        """(after the reduce) This rank's shard's contribution to the squared norm."""
        return torch.linalg.vector_norm(self._shard_grads(g).float(), 2.0) ** 2


class ShardedClipper(NormClipper):
    """The global gradient norm across the ranks (collective: every rank calls it)."""
    made = "across the ranks"

    def __init__(self, strategy: Sharded, groups):
        self.strategy, self.groups = strategy, groups

    def total_norm(self) -> float:
        """Every touched group's gradients reduced (in reverse group order, as backward
        would), then the square root of the all-reduced sum of the shards' squares."""
        strategy = self.strategy
        touched = [g for g in self.groups if g.backwards > 0 or g.pending != len(g.spec.params)]
        for g in reversed(touched):
            if not strategy.per_backward:
                strategy.reduce(g)
        for g in touched:
            if g.shard.reduced is not None:
                g.shard.reduced.result()
        local = torch.zeros(1, dtype=torch.float32, device=strategy.world.comm_device)
        for g in touched:
            local += strategy.sum_of_squares(g).to(local.device)
        return math.sqrt(strategy.collectives.run("gradient norm", lambda: _all_reduce(local, strategy.world)))


def _all_reduce(t: torch.Tensor, world: World) -> float:
    distributed.all_reduce(t, world.group)
    return t.item()

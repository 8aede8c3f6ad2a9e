"""Where a layer group's gradients live between its backward and its step, and how they
reach the daemon: one interface, one class per strategy. The engine calls only this
interface (``on_backward``, ``before_step``, ``before_grad``, ``submit``, ``landing``,
``zero``, ``reclaim``, ``discard``, ``norm_grads``); a new way of moving gradients is
one more class (parallel/sharded.py: a reduce-scatter to a shard, for data parallelism).

* ``Resident``: a buffer per group, for the whole run (shared memory on the CPU; on a
  GPU device memory, downloaded into shared memory at the step). What accumulation
  over micro-batches and exact clipping need, and what resident groups use.
* ``Pooled``: offloaded groups without accumulation or clipping borrow a buffer from the
  GradientPool (pool.py) while in backward and while their step is in flight.
* ``HostAccumulated``: ``grad_accumulation="host"`` on a GPU: each backward's gradients
  leave the device at once into an fp32 accumulator in shared memory (host.py).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import torch

from fuyou_client.device.devices import Device, after
from fuyou_client.gradients.pool import GradientPool
from fuyou_client.gradients.host import HostAccumulation
from fuyou_client.connection.session import Session

# start(gradient buffer) -> the future of the step that reads it; ``start.scale``: the
# clipping coefficient it steps with (None: none)
Start = Callable[[object], Future]


class GradientStrategy:
    name = ""

    def host_buffer_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """The shared buffer a group keeps for its gradients from attach on (0: none)."""
        return numel * dtype.itemsize

    def keeps_device_grads(self) -> bool:
        """Whether, on a device with its own memory, the group keeps a flat gradient
        allocation there (its parameters' .grad are views of it)."""
        return True

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the gradients the step reads, for a group computing in ``dtype``."""
        return dtype

    def on_backward(self, g, first: bool) -> None:
        """A backward pass has produced all of the group's gradients (``first``: the first
        since the last step)."""

    def between_micro_batches(self, g) -> None:
        """train_step: a micro-batch's backward has produced the group's gradients, and more
        micro-batches add to them (its sum stays where the strategy keeps it)."""

    def before_step(self, g) -> None:
        """At ``engine.step()``, for a group whose last backward left some of its
        parameters without a gradient (so ``on_backward`` never came)."""

    def before_grad(self, g) -> None:
        """Before autograd adds a gradient to one of the group's parameters."""

    keeps_steps = False  # the strategy waits for its steps itself (``reclaim``), not the coordinator
    lands_weights = False  # its ``landing`` puts the new weights in the parameters (on the device too)

    def submit(self, g, start: Start) -> Future:
        """Send the group's step: ``start(buffer)`` issues it once the gradients are
        there. Returns the step's future; the step coordinator waits for it at the
        barrier, unless ``keeps_steps`` (then ``reclaim`` gives its outcome)."""
        raise NotImplementedError

    def landing(self, g, stepped: Future) -> Future:
        """At the barrier, in group order: what to wait for before the group's step is
        done (data parallelism: the weights gathered from the shards)."""
        return stepped

    def zero(self, g, device: Device) -> None:
        """Forget the group's gradients (engine.zero_grad)."""

    def reclaim(self) -> tuple[dict, list]:
        """After the barrier: the results ({group: StepInfo}) and errors of steps whose
        futures the strategy kept."""
        return {}, []

    def discard(self) -> None:
        """The iteration's gradients are thrown away (zero_grad, a step that failed)."""

    def norm_grads(self, g) -> list[torch.Tensor] | None:
        """Each parameter's gradient as clipping must see it, where that is not its .grad."""
        return None


class Resident(GradientStrategy):
    name = "resident"

    def __init__(self, device: Device):
        self.device = device

    def submit(self, g, start: Start) -> Future:
        g.adopt_grads()
        if g.device_grads is None:
            return start(g.grads)
        g.downloaded = self.device.download(g.grads.tensor(g.dtype)[:g.numel], g.device_grads)
        return after(self.device, g.downloaded, lambda: start(g.grads))

    def zero(self, g, device: Device) -> None:
        if g.device_grads is not None:
            device.wait(g.downloaded)  # the last download of these gradients has run
            g.device_grads.zero_()
        elif g.grads is not None:
            g.grads.tensor(torch.uint8).zero_()


class Pooled(GradientStrategy):
    name = "pooled"

    def __init__(self):
        self.pool: GradientPool | None = None  # once the groups' sizes are known (bind)

    def bind(self, session: Session, device: Device, classes: list[tuple[int, int]]) -> GradientPool:
        self.pool = GradientPool(session, device, classes)
        return self.pool

    def host_buffer_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return 0  # borrowed from the pool during backward

    def keeps_device_grads(self) -> bool:
        return False

    def on_backward(self, g, first: bool) -> None:
        self.pool.collect(g)  # (before the weights go: views need the parameters' shapes)

    def between_micro_batches(self, g) -> None:
        if g.spec.module is None and g.offloaded is not None:  # (a sub-block: a block's sub-blocks all add up at once)
            self.pool.park(g)

    def discard(self) -> None:
        if self.pool is not None:
            self.pool.drop_parked()

    keeps_steps = True  # (the pool waits for the step to take its buffer back)

    def submit(self, g, start: Start) -> Future:
        return self.pool.submit(g, start)

    def reclaim(self) -> tuple[dict, list]:
        return self.pool.reclaim_all() if self.pool is not None else ({}, [])


class HostAccumulated(GradientStrategy):
    name = "host"

    def __init__(self):
        self.acc: HostAccumulation | None = None  # once the groups' sizes are known (bind)

    def bind(self, session: Session, device: Device, nbytes: int, staging: int = 3) -> HostAccumulation:
        # (the fp32 copies waiting on the device for their download: the staging buffers' worth)
        self.acc = HostAccumulation(session, device, nbytes, staging, depth=min(2, staging - 1))
        return self.acc

    def host_buffer_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * 4  # the fp32 accumulator

    def keeps_device_grads(self) -> bool:
        return False

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def on_backward(self, g, first: bool) -> None:
        self.acc.add(g, first=first)  # off the device, into the host accumulator

    def between_micro_batches(self, g) -> None:
        if g.spec.module is None and g.offloaded is not None:  # (a sub-block: a block's sub-blocks all add up at once)
            self.acc.park(g)

    def before_grad(self, g) -> None:
        self.acc.unpark(g)  # (train_step: a sub-block's sum so far, back in .grad before its next gradient)

    def before_step(self, g) -> None:
        self.acc.add(g, first=g.backwards == 0)

    def submit(self, g, start: Start) -> Future:
        return self.acc.submit(g, start)

    def zero(self, g, device: Device) -> None:
        g.point_grads(None)  # the first backward overwrites the accumulator

    def discard(self) -> None:
        if self.acc is not None:
            self.acc.discard()

    def norm_grads(self, g) -> list[torch.Tensor]:
        self.acc.wait()
        return self.acc.views(g)

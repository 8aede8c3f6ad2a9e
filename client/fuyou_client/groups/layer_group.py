"""A layer group's memory in the training process: where its weights and gradients are,
on the host (shared memory the daemon reads and writes) and on the compute device, and
the copies between the two.

On the CPU (``device.shares_host_memory``) the parameters and gradients of a resident
group *are* views of shared memory: the daemon writes the new weights straight into the
parameters and reads the gradients where autograd accumulated them. On a GPU they are
device tensors (one flat allocation per group, the parameters views of it): gradients
are downloaded into shared memory on the download stream before the step is submitted
(on the device's helper thread, once the copy's event has fired: the training thread
goes on with backward), and the step's new weights are uploaded at the barrier, on the
upload stream, after the compute stream has finished with the old ones.

Offloaded groups (offload/offloader.py) have no resident weights. Pooled gradients have
no gradient buffers of their own: the gradient pool (gradients/pool.py) lends a group
``grads`` (and on a GPU ``device_grads``) from its backward's start to its step's end, and
only the pool sets them for such a group; the step coordinator (steps/) is the only one
to set ``future``, ``submitted``, ``pending`` and ``backwards``.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from fuyou_proto.contract import state_object

from fuyou_client.device import DONE, Device
from fuyou_client.gradients.strategy import GradientStrategy
from fuyou_client.model.blocks import GroupSpec, flat_parts, set_grad
from fuyou_client.offload.group import OffloadedGroup


@dataclass(eq=False)
class LayerGroup:
    spec: GroupSpec
    weights: object  # SharedBuffer of compute-dtype weights the step writes (resident groups)
    grads: object  # SharedBuffer of gradients the daemon reads (None while pooled and idle)
    dtype: torch.dtype
    device_weights: torch.Tensor | None = None  # flat, on a device with its own memory (resident)
    device_grads: torch.Tensor | None = None  # flat, on a device with its own memory
    offloaded: OffloadedGroup | None = None
    pending: int = 0  # gradients still to come in the current backward
    backwards: int = 0  # backward passes completed since the last step (gradient accumulation)
    future: Future | None = None
    submitted: bool = False  # this iteration's step was sent
    strategy: GradientStrategy | None = None  # where the gradients live until the step (gradients/strategy.py)
    uploaded: object = DONE  # event: the last upload of new weights into device_weights
    downloaded: object = DONE  # event: the last download of device_grads
    shard: object = None  # data parallelism: this rank's shard of the group (sharded.ShardState)
    shard_padded: int = 0  # data parallelism: the flat vectors' length, padded to the shards' sum
    chunked: frozenset[str] = frozenset()  # its parts the daemon steps in chunks
    created: Future | None = None  # its parts' creation in the daemon, still going on (upload with scratch)
    parked: object = None  # event: its gradient sum's download between train_step's micro-batches (gradients/pool.py)

    @property
    def numel(self) -> int:
        return self.spec.numel

    @property
    def offload(self) -> bool | str:
        """Where its weights are between uses (placement.py): True on the SSD array, "host"
        in a shared host buffer, False resident."""
        if self.offloaded is None:
            return False
        return "host" if self.offloaded.host is not None else True

    def settle(self) -> None:
        """Once its state is created (``created``): which parts are stepped in chunks, and the
        master weights where the daemon's layout puts them."""
        if self.created is None:
            return
        infos, self.created = self.created.result(), None
        self.chunked = frozenset(info.name for info in infos if info.chunked)
        if self.offloaded is not None:
            offsets = {info.name: info.weights_offset for info in infos}
            self.offloaded.sources = [dataclasses.replace(s, object_offset=offsets[s.part])
                                      if s.part in offsets and s.object == state_object(s.part) else s
                                      for s in self.offloaded.sources]

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``flat`` (the group's elements in parameter order) as one flat view per parameter."""
        return flat_parts(flat, self.shapes)

    def point_grads(self, flat: torch.Tensor | None) -> None:
        """Make the parameters' .grad views of ``flat`` (None: no gradients)."""
        with torch.no_grad():
            if flat is None:
                for _, p in self.spec.params:
                    p.grad = None
                return
            for (_, p), shape, part in zip(self.spec.params, self.shapes, self.views(flat)):
                p.grad = part.view(shape)

    def adopt_grads(self, flat: torch.Tensor | None = None) -> None:
        """Before a step reads the gradient buffer ``flat`` (default: the group's own):
        gradients autograd made outside it are copied in, and ``.grad`` points at the buffer
        again. That happens after torch's own ``zero_grad()`` (``model.zero_grad()``, as
        Hugging Face's Trainer calls it), which sets ``.grad`` to None, and to parameters
        that got a gradient before their buffer was theirs; a parameter still without one
        steps with a zero gradient, as after ``engine.zero_grad()``."""
        if flat is None:
            flat = self.device_grads if self.device_grads is not None else self.grads.tensor(self.dtype)
        with torch.no_grad():
            for (_, p), shape, view in zip(self.spec.params, self.shapes, self.views(flat)):
                if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                    continue
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad.reshape(-1))
                set_grad(p, view.view(shape))

    def host_weights_read(self):
        """The event of the last upload out of the host weights buffer the step writes
        (resident groups: into ``device_weights``; ``offload="host"``: into a slot)."""
        return self.offloaded.host_uploaded if self.offloaded is not None else self.uploaded

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype of the gradients the step reads."""
        return self.strategy.grad_dtype(self.dtype)

    @property
    def shapes(self) -> list[torch.Size]:
        """The trained parameters' shapes (an offloaded block's frozen ones follow them in its weights)."""
        if self.offloaded is not None:
            return self.offloaded.shapes[:len(self.spec.params)]
        return [p.shape for _, p in self.spec.params]


def flat_copy(params, out: torch.Tensor) -> None:
    """The parameters, flattened in order, into ``out`` (any device, any dtype)."""
    if out.device == params[0].device:
        torch.cat([p.detach().reshape(-1).to(out.dtype) for p in params], out=out)
    else:
        out.copy_(torch.cat([p.detach().reshape(-1).to(out.dtype) for p in params]))


def land_new_weights(device: Device, g: LayerGroup) -> None:
    """After a resident group's step (device with its own memory): its new weights from
    shared memory into the parameters, once the compute stream is done with the old ones;
    later compute waits for the copy."""
    if g.device_weights is None:
        return
    g.uploaded = device.upload(g.device_weights[:g.numel], g.weights.tensor(g.dtype)[:g.numel], after=device.record())
    device.wait(g.uploaded)

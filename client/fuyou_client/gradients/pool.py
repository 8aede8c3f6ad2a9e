"""Gradient buffers shared by the offloaded groups, so that gradients too take memory
only while a group is in backward or its optimizer step is in flight.

A group gets a buffer when its backward begins (its gradients are then views of it and
autograd accumulates straight into it) and gives it up with its step:

* on the CPU the buffer is shared memory, handed to the daemon as it is, and returns to
  the pool when the step is done;
* on a GPU it is device memory: at the step the gradients are downloaded (download
  stream) into a shared host buffer, the step goes to the daemon once that copy has run,
  and the device buffer is free again for the next group (whose zeroing waits for the
  download's event on the compute stream); the host buffer returns when the step is done.

When no host buffer is free the oldest step in flight is waited for: backpressure
instead of growth. Gradient accumulation and exact clipping need every gradient kept
until the step, so they use one resident buffer per group instead (groups/layer_group.py).
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import torch

from fuyou_client.device.devices import Device, after
from fuyou_client.connection.session import Session


class GradientPool:
    """Per size class (``classes``: (host count, device count, bytes), the memory plan's:
    blocks' or sub-blocks' gradients, and cut blocks' own groups', memory/budget.py), host
    buffers for the group in backward and the steps in flight (and a cut block's sums over
    train_step's micro-batches); on a device with its own memory at most
    ``memory.DEVICE_GRAD_BUFFERS`` device buffers (the group in backward, the one
    downloading), since a group's device buffer is free again once its download has run
    (milliseconds), not when its step ends: more would take the GPU memory a capped device
    computes with (more only where several groups are in backward at once). A group takes
    a buffer of the smallest class that holds it."""

    def __init__(self, session: Session, device: Device, classes: list[tuple[int, int, int]]):
        self._session, self._device = session, device
        self._sizes = sorted(nbytes for _, _, nbytes in classes)
        count = {nbytes: (n, d) for n, d, nbytes in classes}
        self._free = {b: [session.allocate(b) for _ in range(count[b][0])] for b in self._sizes}  # host (shared) buffers
        # (device buffer, its last download), on a device with its own memory
        self._device_free: dict[int, list[tuple[torch.Tensor, object]]] = {
            b: [] if device.shares_host_memory else [(device.empty(b), None) for _ in range(count[b][1])]
            for b in self._sizes}
        self._inflight: deque[tuple[Future, object, object]] = deque()  # (future, host buffer, group)
        self._parked: list = []  # groups whose sums wait on the host for the next micro-batch (park)
        self.parked_bytes = 0  # gradient bytes parked on the host (each comes back up once more before its step)
        self.results: dict[str, object] = {}  # group name -> StepInfo, since the last barrier
        self.errors: list[Exception] = []  # of steps that failed, raised at the barrier

    def _class(self, group) -> int:
        """The bytes of the smallest class holding the group's gradients."""
        nbytes = group.numel * group.dtype.itemsize
        return next(b for b in self._sizes if b >= nbytes)

    def _host_buffer(self, size: int):
        free = self._free[size]
        while not free and any(buf.size == size for _, buf, _ in self._inflight):
            self._reclaim_oldest()  # backpressure: wait for the steps in flight, oldest first
        if not free:  # more groups in backward at once than buffers (a model called twice): grow
            free.append(self._session.allocate(size))
        return free.pop()

    def _flat(self, group) -> torch.Tensor:
        """The group's gradient buffer as a flat tensor of its dtype."""
        if self._device.shares_host_memory:
            return group.grads.tensor(group.dtype)[:group.numel]
        return group.device_grads[:group.numel * group.dtype.itemsize].view(group.dtype)

    def assign(self, group) -> None:
        """Give ``group`` (layergroup.LayerGroup) a zeroed buffer and point its .grad tensors into it."""
        size = self._class(group)
        if self._device.shares_host_memory:
            if group.grads is not None:
                return
            group.grads = self._host_buffer(size)
        else:
            if group.device_grads is not None:
                return
            free = self._device_free[size]
            if not free:
                free.append((self._device.empty(size), None))
            buf, downloaded = free.pop(0)  # the longest free: its download has most likely run
            if downloaded is not None:
                self._device.wait(downloaded)  # its last group's gradients have left
            group.device_grads = buf
        flat = self._flat(group)
        if group.parked is not None:  # (its sum so far, parked on the host between micro-batches: back up)
            self._device.wait(self._device.upload(flat, group.grads.tensor(group.dtype)[:group.numel],
                                                  after=group.parked))
            group.parked = None
            self._parked = [g for g in self._parked if g is not group]
        else:
            flat.zero_()
        for (_, p), shape, part in zip(group.spec.params, group.shapes, group.views(flat)):
            if p.grad is None and p.data.shape == shape:  # (resident: it is, in backward)
                p.grad = part.view(shape)

    def collect(self, group) -> None:
        """Before submitting: gradients autograd created outside the buffer are copied in."""
        self.assign(group)
        group.adopt_grads(self._flat(group))

    def park(self, group) -> None:
        """Between train_step's micro-batches, on a device with its own memory: the group's
        gradient so far (a sub-block's: model/cuts.py) leaves the device into a host buffer
        the group keeps, and its device buffer is another group's; the next micro-batch's
        backward brings the sum up again before its first gradient (``assign``), so autograd
        adds on to it in torch's order (a tied weight's two uses too), and the device holds
        one sub-block's gradient at a time, not a block's."""
        if self._device.shares_host_memory or group.device_grads is None:
            return
        self.collect(group)
        size = self._class(group)
        if group.grads is None:
            group.grads = self._host_buffer(size)
        group.parked = self._device.download(group.grads.tensor(group.dtype)[:group.numel], self._flat(group))
        self.parked_bytes += group.numel * group.dtype.itemsize
        self._device_free[size].append((group.device_grads, group.parked))
        group.device_grads = None
        group.point_grads(None)  # (the device buffer is another group's from now on)
        self._parked.append(group)

    def drop_parked(self) -> None:
        """The iteration's gradients are thrown away: parked sums give their host buffers back."""
        for group in self._parked:
            group.parked.synchronize()
            self._free[group.grads.size].append(group.grads)
            group.grads, group.parked = None, None
        self._parked = []

    def submit(self, group, start) -> Future:
        """The group's gradients go to its step: ``start(host_buffer)`` issues it. Returns
        the step's future (the pool keeps it too: ``reclaim_all``)."""
        self.collect(group)
        if self._device.shares_host_memory:
            future = start(group.grads)
        else:
            size = self._class(group)
            host = group.grads if group.grads is not None else self._host_buffer(size)
            src = self._flat(group)
            downloaded = self._device.download(host.tensor(group.dtype)[:group.numel], src)
            self._device_free[size].append((group.device_grads, downloaded))
            group.device_grads = None
            group.point_grads(None)  # the device buffer is another group's from now on
            group.grads = host
            future = after(self._device, downloaded, lambda: start(host))
        self._inflight.append((future, group.grads, group))
        return future

    def _reclaim_oldest(self) -> None:
        future, buf, group = self._inflight.popleft()
        exc = future.exception()  # waits; the buffer comes back whatever happened
        if self._device.shares_host_memory:
            group.point_grads(None)
        group.grads = None
        self._free[buf.size].append(buf)
        if exc is not None:
            self.errors.append(exc)
        else:
            self.results[group.spec.name] = future.result()

    def reclaim_all(self) -> tuple[dict, list]:
        """Wait for every step in flight; returns (and forgets) {group name: StepInfo} and
        the errors of the steps that failed."""
        while self._inflight:
            self._reclaim_oldest()
        results, self.results = self.results, {}
        errors, self.errors = self.errors, []
        return results, errors

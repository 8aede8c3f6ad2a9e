"""Gradient accumulation in shared host memory: ``attach(grad_accumulation="host")``.

Accumulating over micro-batches (or clipping, which needs every gradient at once) in
``.grad`` keeps every group's gradients on the compute device until the step: as much
device memory as the weights themselves. With ``"host"``, on a device with its own
memory, each group's gradients leave the device as soon as a backward pass has finished
them:

* on the download stream each parameter's ``.grad`` goes, as it is, into the group's fp32
  accumulator in shared memory (the first backward since the last step of an fp32 group:
  straight into it), or into a staging buffer that the device's helper thread then adds
  into the accumulator, casting (``then`` runs calls in order, so a group's additions happen
  in backward order); the ``.grad`` is dropped at once (the caching allocator gets the
  memory back once the copy ran), and no flattened copy is made on the device;
* the step reads the accumulator as an fp32 gradient, once the group's last addition
  has run.

Device memory then holds only the gradients of the groups in backward and in the
download queue, which is at most ``depth`` deep: backward can produce gradients faster
than they cross to the host, and then waits (on an H100 with its memory capped at 4 GiB
an unbounded queue ran out of memory in the first backward). The host holds 4 bytes per
parameter, plus ``staging`` buffers of the largest group. Summation is in fp32 whatever the
compute dtype (torch accumulates bf16 gradients in bf16): for fp32 models it is the
same sequence of additions as torch's, so training is bitwise alike.

``train_step`` sums a group's micro-batches in ``.grad`` on the device, as torch does,
and sends the sum once; a sub-block's sum (``granularity="module"``: a block's modules
are in backward together) waits between micro-batches in its accumulator, in its own
dtype, and comes back into ``.grad`` before its next gradient (``park``, ``unpark``), so
that the device holds one sub-block's gradient at a time.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import torch

from fuyou_client.device.devices import DONE, Device, after
from fuyou_client.model.blocks import set_grad
from fuyou_client.connection.session import Session


class HostAccumulation:
    def __init__(self, session: Session, device: Device, nbytes: int, staging: int = 3, depth: int = 2):
        self._device, self._depth = device, depth
        self._downloads: deque = deque()  # events of downloads queued, oldest first
        self._free = [session.allocate(nbytes) for _ in range(staging)]
        self._busy: deque[tuple[Future, object]] = deque()  # (addition, its staging buffer)
        self._last: dict[str, object] = {}  # group -> event of its last download (its addition follows it)
        self._failed: BaseException | None = None  # the first addition that failed since the last discard()

    def _download(self, group, dst: torch.Tensor) -> object:
        """Each parameter's ``.grad`` (its dtype) into its range of ``dst`` (a missing one:
        zeros), the ``.grad`` dropped; the last copy's event."""
        event = DONE
        with torch.no_grad():
            for (_, p), part in zip(group.spec.params, group.views(dst)):
                if p.grad is not None:
                    event = self._device.download(part, p.grad.reshape(-1))
                else:
                    part.zero_()
                p.grad = None
        return event

    def add(self, group, first: bool) -> None:
        """``group``'s gradients (its parameters' ``.grad``) into its accumulator; ``first``:
        the first backward since the step (the accumulator is overwritten)."""
        n, dtype = group.numel, group.dtype
        acc = group.grads.tensor(torch.float32)[:n]
        if first and dtype == torch.float32:
            event = self._download(group, acc)
        else:
            buf = self._staging()
            staged = buf.tensor(dtype)[:n]
            event = self._download(group, staged)
            addition = self._device.then(event, (lambda: acc.copy_(staged)) if first else (lambda: acc.add_(staged)))
            # (noted on the helper thread as it fails, before any step queued behind it goes)
            addition.add_done_callback(self._note)
            self._busy.append((addition, buf))
        self._last[group.spec.name] = event
        # Backward can produce gradients faster than they cross to the host; each one
        # queued holds its .grad in device memory, so at most ``depth`` groups wait.
        self._downloads.append(event)
        while len(self._downloads) > self._depth:
            self._downloads.popleft().synchronize()

    def park(self, group) -> None:
        """train_step, between micro-batches: the group's sum so far (its ``.grad``, in its
        dtype) waits in its accumulator's buffer; ``unpark`` brings it back."""
        group.parked = self._download(group, group.grads.tensor(group.dtype)[:group.numel])

    def unpark(self, group) -> None:
        """Before the group's next gradient: its parked sum back into ``.grad`` on the device
        (autograd then adds on to it, in torch's order)."""
        if group.parked is None:
            return
        sums = group.views(group.grads.tensor(group.dtype)[:group.numel])
        event = group.parked
        with torch.no_grad():
            for (_, p), part, shape in zip(group.spec.params, sums, group.shapes):
                grad, event = self._device.upload_new(part.view(shape), after=event)
                set_grad(p, grad)
        self._device.wait(event)
        group.parked = None

    def _note(self, addition: Future) -> None:
        if addition.exception() is not None and self._failed is None:
            self._failed = addition.exception()

    def _staging(self):
        if not self._free:
            self._reclaim_oldest()  # backpressure: the host's additions set the pace
        return self._free.pop()

    def _reclaim_oldest(self) -> None:
        fut, buf = self._busy.popleft()
        fut.exception()  # (waits; a failure fails the steps, see submit)
        self._free.append(buf)

    def wait(self) -> None:
        """Until every addition asked for has run (the accumulators are complete); raises
        if one failed since the last discard()."""
        self._drain(raise_failed_downloads=True)
        if self._failed is not None:
            raise self._failed

    def discard(self) -> None:
        """Until every addition asked for has run, whatever failed; then forget them (the
        gradients are thrown away: zero_grad, or a step that failed)."""
        self._drain(raise_failed_downloads=False)  # (a failed download: its sum is thrown away)
        self._last.clear()
        self._failed = None

    def _drain(self, raise_failed_downloads: bool) -> None:
        for event in self._last.values():
            try:
                event.synchronize()
            except Exception:  # noqa: BLE001
                if raise_failed_downloads:
                    raise
        while self._busy:
            self._reclaim_oldest()

    def submit(self, group, start) -> Future:
        """The group's step, ``start(accumulator)``, once its last addition has run. After
        a failed addition no step of the iteration goes (a partial sum is never stepped):
        each fails with that error until discard()."""
        event = self._last.pop(group.spec.name, DONE)

        def go():
            if self._failed is not None:  # (additions queued before this one have run: same helper thread)
                raise RuntimeError(f"group {group.spec.name} not stepped: adding this iteration's gradients "
                                   f"failed: {self._failed!r}") from self._failed
            return start(group.grads)

        return after(self._device, event, go)  # (queued behind the group's additions)

    def views(self, group) -> list[torch.Tensor]:
        """The accumulated gradient of each of ``group``'s parameters (after ``wait()``)."""
        return [part.view(shape) for part, shape in zip(group.views(group.grads.tensor(torch.float32)), group.shapes)]

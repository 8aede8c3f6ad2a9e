"""Gradient buffers shared by the offloaded groups, so that gradients too take memory
only while a group is in backward or its optimizer step is in flight.

A group gets a buffer when its backward begins (its gradients are then views of it and
autograd accumulates straight into shared memory), gives it to the daemon with its
step, and the buffer returns to the pool when that step is done. When the pool is
empty the oldest step in flight is waited for: backpressure instead of growth.
Gradient accumulation and exact clipping need every gradient kept until the step, so
they use one resident buffer per group instead (see engine.py).
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future

from fuyou_client.session import Session


class GradientPool:
    def __init__(self, session: Session, count: int, nbytes: int):
        self._session, self._nbytes = session, nbytes
        self._free = [session.allocate(nbytes) for _ in range(count)]
        self._inflight: deque[tuple[Future, object, object]] = deque()  # (future, buffer, group)
        self.results: dict[str, object] = {}  # group name -> StepInfo, since the last barrier
        self.errors: list[Exception] = []  # of steps that failed, raised at the barrier

    def assign(self, group) -> None:
        """Give ``group`` (engine._Group) a zeroed buffer and point its .grad tensors into it."""
        if group.grads is not None:
            return
        if not self._free:
            if self._inflight:
                self._reclaim_oldest()  # backpressure: wait for the oldest step
            else:  # more groups in backward at once than buffers (a model called twice): grow
                self._free.append(self._session.allocate(self._nbytes))
        buf = self._free.pop()
        flat = buf.tensor(group.dtype)[:group.spec.numel]
        flat.zero_()
        offset = 0
        for (_, p), shape in zip(group.spec.params, group.offloaded.shapes):
            n = shape.numel()
            if p.grad is None and p.data.shape == shape:  # (resident: it is, in backward)
                p.grad = flat[offset:offset + n].view(shape)
            offset += n
        group.grads = buf

    def collect(self, group) -> None:
        """Before submitting: gradients autograd created outside the buffer are copied in."""
        self.assign(group)
        flat = group.grads.tensor(group.dtype)[:group.spec.numel]
        offset = 0
        for (_, p), shape in zip(group.spec.params, group.offloaded.shapes):
            n = shape.numel()
            view = flat[offset:offset + n]
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            offset += n

    def submitted(self, group, future: Future) -> None:
        self._inflight.append((future, group.grads, group))

    def _reclaim_oldest(self) -> None:
        future, buf, group = self._inflight.popleft()
        exc = future.exception()  # waits; the buffer comes back whatever happened
        for _, p in group.spec.params:
            p.grad = None
        group.grads = None
        self._free.append(buf)
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

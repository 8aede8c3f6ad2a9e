"""Master weights of a chunked group, read for backward and kept for the group's step.

Backward needs a block's weights shortly before the block's step reads its whole
state. For a group that fits one optimizer buffer, FetchWeights reads the whole state
ahead into a buffer that the step then uses (groups.py). A chunked group's state does
not fit one buffer, but its weights slot (4 bytes per parameter of the 16 a step holds)
often fits one or two: FetchWeights reads elements [0, covered) of the fp32 master
weights into as many spare buffers as it finds (one left free, as every read-ahead
leaves), serves the client from them, and keeps them; the group's next chunked step
copies each chunk's weights from there instead of reading them from the SSD again, and
gives each buffer back as soon as the chunks it covers have been copied. Four bytes per
parameter and iteration fewer, as for groups that fit a buffer.

The bytes were checked against the object's checksums when they were read; they are
used only by the step that follows at the same step count (a group whose step count
moved on, or that was replaced, drops them), and only by the daemon: the client gets a
copy.
"""
from __future__ import annotations

import torch

from fuyoud.optimizer.buffers import StateBuffers
from fuyoud.optimizer.chunks import GRANULE
from fuyoud.optimizer.layout import HEADER
from fuyoud.storage.store import ReadItem, Store


class HeldWeights:
    """fp32 master weights of elements [0, covered) at step count ``step``, ``per``
    elements in each of ``views`` (optimizer buffers, given back by ``release``)."""

    def __init__(self, buffers: StateBuffers, views: list[memoryview], per: int, covered: int, step: int):
        self.buffers, self.views, self.per, self.covered, self.step = buffers, list(views), per, covered, step
        self._released = [False] * len(self.views)

    @property
    def nbytes(self) -> int:
        return 4 * self.covered

    def piece(self, j: int) -> tuple[int, int]:
        """Elements [a, b) held in buffer ``j``."""
        return j * self.per, min((j + 1) * self.per, self.covered)

    def covers(self, a: int, b: int) -> bool:
        return b <= self.covered

    def copy(self, a: int, b: int, dst: memoryview) -> None:
        """The fp32 bytes of elements [a, b) (which ``covers``) into ``dst``."""
        out = torch.frombuffer(dst, dtype=torch.uint8)
        at = 0
        for j in range(a // self.per, (b - 1) // self.per + 1):
            lo, hi = self.piece(j)
            x, y = max(a, lo), min(b, hi)
            src = torch.frombuffer(self.views[j], dtype=torch.uint8)[4 * (x - lo):4 * (y - lo)]
            out[at:at + src.numel()].copy_(src)
            at += src.numel()

    def done_below(self, end: int) -> None:
        """Elements below ``end`` have been copied for the last time: give back the
        buffers that hold only such elements."""
        for j in range(len(self.views)):
            if not self._released[j] and self.piece(j)[1] <= end:
                self._release(j)

    def release(self) -> None:
        for j in range(len(self.views)):
            if not self._released[j]:
                self._release(j)

    def _release(self, j: int) -> None:
        self._released[j] = True
        self.buffers.release(self.views[j])


class ClientMasters:
    """The same for master weights the client holds: a chunked step given the fp32
    masters the client read for its backward (StepGroupRequest.masters) copies each
    chunk's from the client's shared buffer instead of reading them from the SSD. They
    were checked against the object's checksums when the client read them; the client
    answers for them until the step returns (a client can only hurt its own state, as
    with its gradients, and a master it changed into a NaN is refused with the step)."""

    def __init__(self, masters: torch.Tensor, step: int):
        self.masters, self.step, self.covered = masters, step, masters.numel()

    @property
    def nbytes(self) -> int:
        return 4 * self.covered

    def covers(self, a: int, b: int) -> bool:
        return b <= self.covered

    def copy(self, a: int, b: int, dst: memoryview) -> None:
        torch.frombuffer(dst, dtype=torch.float32)[:b - a].copy_(self.masters[a:b])

    def done_below(self, end: int) -> None:
        pass

    def release(self) -> None:
        pass


def read(store: Store, buffers: StateBuffers, namespace: str, name: str, numel: int, step: int,
         out: torch.Tensor) -> HeldWeights | None:
    """The master weights of a chunked group (state object ``namespace/name`` of
    ``numel`` parameters at step ``step``) into ``out`` (any float dtype), through as
    many spare optimizer buffers as hold them, at least one (one is left free, for
    a step that was not read ahead); those buffers are kept (the HeldWeights), the
    part they could not hold is read straight into an fp32 ``out``. None, having
    read nothing, when no buffer is spare, or when a 16-bit ``out`` is not wholly
    covered (its rest would need an fp32 buffer of its own)."""
    per = buffers.per_buffer // 4 // GRANULE * GRANULE
    want = -(-numel // per)
    views: list[memoryview] = []
    while len(views) < want:
        view = buffers.try_acquire(4 * per, leave=1, owner=namespace)  # (charged to the session)
        if view is None:
            break
        views.append(view)
    covered = min(numel, per * len(views))
    if not views or (covered < numel and out.dtype != torch.float32):
        for view in views:
            buffers.release(view)
        return None
    held = HeldWeights(buffers, views, per, covered, step)
    try:
        items = [ReadItem(namespace, name, view[:4 * (b - a)], HEADER + 4 * a)
                 for j, view in enumerate(views) for a, b in [held.piece(j)]]
        if covered < numel:  # (fp32: straight into the client's buffer)
            raw = memoryview(out.view(torch.uint8).numpy())
            items.append(ReadItem(namespace, name, raw[4 * covered:4 * numel], HEADER + 4 * covered))
        store.read(items)
        for j, view in enumerate(views):
            a, b = held.piece(j)
            out[a:b].copy_(torch.frombuffer(view, dtype=torch.float32)[:b - a])
    except BaseException:
        held.release()
        raise
    return held

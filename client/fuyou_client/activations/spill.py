"""Host memory that spills to the SSD array: the mechanism the activation swapper
(swapper.py) and block-major's store (blockmajor/store.py) share; each keeps its own
policy of what goes and when.

``Arena``: first-fit ranges of one shared buffer, 4 KiB aligned, so the daemon's
O_DIRECT transfers land in place. ``SsdTier``: a range written to a transient object
on the SSD array and read back into free arena space ahead of use, deleted once used
(without waiting), the rest deleted by ``reset`` (waiting), so nothing outlives a step,
and a killed client leaves nothing behind (transient objects die with the session).

The daemon keeps no checksums for transient objects (they are not crash-consistent), so
the tier takes a CRC32C of each range as it is written and checks it on the way back:
damaged bytes are a ``DataLoss`` naming what they were (the caller's label), never the
input of a recomputation or a backward. The CRC runs on the thread that writes (before
the write leaves) and on gRPC's completion thread for reads (it releases the GIL), so a
read's future is done only once its bytes are known good.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from crc32c import crc32c

from fuyou_client.errors import DataLoss
from fuyou_client.connection.session import In, Out, Session
from fuyou_proto.contract import PAGE as ALIGN


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Arena:
    """First-fit ranges of one shared buffer, 4 KiB aligned (so the daemon's O_DIRECT
    transfers land in place)."""

    def __init__(self, session: Session, size: int):
        self.size = size - size % ALIGN
        self.buffer = session.allocate(self.size)
        self._free = [(0, self.size)]  # sorted (offset, length)

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    def take(self, n: int) -> int | None:
        n = aligned(n)
        for i, (off, length) in enumerate(self._free):
            if length >= n:
                self._free[i:i + 1] = [(off + n, length - n)] if length > n else []
                return off
        return None

    def give(self, off: int, n: int) -> None:
        n = aligned(n)
        self._free.append((off, n))
        self._free.sort()
        merged = []
        for o, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((o, length))
        self._free = merged

    def view(self, off: int, nbytes: int) -> torch.Tensor:
        return self.buffer.tensor(torch.uint8)[off:off + nbytes]

    def free(self) -> None:
        self.buffer.free()


@dataclass(frozen=True)
class Spilled:
    """One transient object: its name, size and checksum, and what it holds (for errors)."""
    name: str
    nbytes: int
    crc: int
    label: str


class SsdTier:
    """Ranges of an ``Arena`` written to transient objects named ``prefix/N`` and read
    back, each checked against the CRC32C taken when it was written."""

    def __init__(self, session: Session, arena: Arena, prefix: str):
        self.session, self.arena, self.prefix = session, arena, prefix
        self._numbers = itertools.count()
        self._lock = threading.Lock()  # (writes may start on a device's helper thread)
        self._live: set[str] = set()  # written or being written, not yet deleted
        self._pending: list[Future] = []  # writes, reads and deletes in flight

    def _track(self, fut: Future) -> Future:
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(fut)
        return fut

    def write(self, offset: int, nbytes: int, label: str) -> Future:
        """Start writing ``arena[offset:offset+nbytes]`` (its bytes final now) to a new
        transient object; the future's result is its ``Spilled`` once committed."""
        view = self.arena.buffer.view[offset:offset + nbytes]
        spilled = Spilled(f"{self.prefix}/{next(self._numbers)}", nbytes, crc32c(view), label)
        with self._lock:
            self._live.add(spilled.name)
        inner = self.session.swap_out_async([Out(spilled.name, self.arena.buffer, offset, nbytes)])
        out: Future = Future()

        def done(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(spilled)
        inner.add_done_callback(done)
        return self._track(out)

    def read(self, spilled: Spilled, offset: int) -> Future:
        """Start reading ``spilled`` back into ``arena[offset:]``; the future is done once
        the bytes are there and match their checksum (else it raises ``DataLoss``)."""
        inner = self.session.swap_in_async([In(spilled.name, self.arena.buffer, offset, spilled.nbytes)])
        out: Future = Future()

        def done(f: Future) -> None:
            exc = f.exception()
            try:
                if exc is None:
                    got = crc32c(self.arena.buffer.view[offset:offset + spilled.nbytes])
                    if got != spilled.crc:
                        exc = DataLoss(
                            f"{spilled.label}, read back from the SSD array (transient object {spilled.name}, "
                            f"{spilled.nbytes} bytes), fails its CRC32C checksum ({got:#010x} read, "
                            f"{spilled.crc:#010x} written): the SSD array returned damaged bytes, and nothing was "
                            "computed from them")
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                exc = e
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(None)
        inner.add_done_callback(done)
        return self._track(out)

    def drop(self, spilled: Spilled) -> None:
        """Delete a used object, without waiting (``reset`` waits)."""
        with self._lock:
            self._live.discard(spilled.name)
        fut = self.session.delete_async(spilled.name)
        fut.add_done_callback(lambda f: f.exception())
        self._track(fut)

    def reset(self) -> None:
        """Wait for every transfer in flight, then delete every object not yet deleted."""
        with self._lock:
            pending, self._pending = self._pending, []
        for f in pending:
            f.exception()
        with self._lock:
            live, self._live = self._live, set()
        if live:
            self.session.delete(*sorted(live), missing_ok=True)

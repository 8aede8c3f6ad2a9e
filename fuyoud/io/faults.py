"""A fault-injecting engine: wraps a real engine and fails chosen requests.

The seam for failure tests (short transfers, EIO, ENOSPC, and "corrupt": a read that
succeeds but returns one flipped bit, as a failing SSD would) without patching internals:
build the daemon or the store with ``FaultyEngine(real_engine, [Fault(...)])``. Faults
can also be armed and cleared while it runs (``arm``, ``clear``).
"""
from __future__ import annotations

import errno
import threading
from dataclasses import dataclass
from typing import Sequence

from fuyoud.io.engine import IOEngine, IORequest, IOResult, Op


@dataclass
class Fault:
    kind: str  # "eio" | "enospc" | "short" | "corrupt"
    op: Op | None = None  # only requests of this direction (None: both)
    device: int | None = None  # only requests to this device (None: all)
    skip: int = 0  # let this many matching requests through first
    count: int = 1  # then fail this many (-1: all the following)

    def __post_init__(self) -> None:
        if self.kind not in ("eio", "enospc", "short", "corrupt"):
            raise ValueError(f"unknown fault kind {self.kind!r}")

    def matches(self, req: IORequest) -> bool:
        return (self.op is None or req.op == self.op) and (self.device is None or req.device == self.device)


class FaultyEngine(IOEngine):
    def __init__(self, inner: IOEngine, faults: Sequence[Fault] = ()):
        self.inner = inner
        self.name = inner.name
        self._faults = list(faults)
        self._lock = threading.Lock()
        self.injected = 0

    def arm(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def _fault_for(self, req: IORequest) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.count == 0 or not f.matches(req):
                    continue
                if f.skip > 0:
                    f.skip -= 1
                    continue
                if f.count > 0:
                    f.count -= 1
                self.injected += 1
                return f
        return None

    def execute(self, requests: Sequence[IORequest]) -> list[IOResult]:
        plan = [self._fault_for(r) for r in requests]
        # A short transfer really moves the first half of the bytes, then stops.
        moved = (None, "short", "corrupt")
        real = [IORequest(r.op, r.fd, r.offset, r.buf[:len(r.buf) // 2], r.device) if f and f.kind == "short" else r
                for r, f in zip(requests, plan) if (f.kind if f else None) in moved]
        results = iter(self.inner.execute(real) if real else [])
        out = []
        for r, f in zip(requests, plan):
            kind = f.kind if f else None
            if kind in moved:
                out.append(next(results))
                if kind == "corrupt" and len(r.buf):
                    r.buf[0] ^= 0x10  # the data arrived, one bit wrong
            else:
                out.append(IOResult(0, errno.EIO if kind == "eio" else errno.ENOSPC))
        return out

    def close(self) -> None:
        self.inner.close()

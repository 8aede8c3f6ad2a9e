"""A fault-injecting engine: wraps a real engine and fails chosen requests.

The seam for failure tests (short transfers, EIO, ENOSPC, and "corrupt": a read that
succeeds but returns one flipped bit, as a failing SSD would) without patching internals:
build the daemon or the store with ``FaultyEngine(real_engine, [Fault(...)])``. Faults
can also be armed and cleared while it runs (``arm``, ``clear``).

A daemon process (fuyoud as systemd runs it, in a soak) takes its faults from a file:
with ``FUYOUD_IO_FAULTS=PATH`` in its environment, its engine is wrapped (the log and
``io_engine_reason`` say so) and, whenever PATH changes (write a new file and rename it
over PATH), the faults it lists replace those armed::

    {"faults": [{"kind": "eio", "op": "write", "skip": 20, "count": 1},
                {"kind": "enospc", "op": "write", "count": -1}]}

``[]`` (or no file) arms none. Each fault injected is logged as a warning. Unset, the
engine is not wrapped at all.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from fuyoud.io.engine import IOEngine, IORequest, IOResult, Op

log = logging.getLogger(__name__)
ENV = "FUYOUD_IO_FAULTS"
OPS = {"read": Op.READ, "write": Op.WRITE}


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

    @classmethod
    def from_dict(cls, d: dict) -> "Fault":
        """``{"kind": "eio", "op": "write"|"read"|null, "device": 0, "skip": 0, "count": 1}``."""
        unknown = set(d) - {"kind", "op", "device", "skip", "count"}
        if unknown:
            raise ValueError(f"unknown fault keys {sorted(unknown)}")
        op = d.get("op")
        if op is not None and op not in OPS:
            raise ValueError(f"fault op must be read, write or null, not {op!r}")
        return cls(d["kind"], OPS.get(op), d.get("device"), int(d.get("skip", 0)), int(d.get("count", 1)))


class FaultFile:
    """The faults listed in a JSON file, read again whenever the file changes (its inode,
    size or modification time): ``changed()`` gives the new list, or None."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._seen: tuple | None = None

    def changed(self) -> list[Fault] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            key = None
        else:
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key == self._seen:
            return None
        self._seen = key
        if key is None:
            return []
        try:
            faults = [Fault.from_dict(d) for d in json.loads(self.path.read_text())["faults"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("%s: not a fault list (%s); faults cleared", self.path, exc)
            return []
        log.warning("faults armed from %s: %s", self.path, faults)
        return faults


class FaultyEngine(IOEngine):
    def __init__(self, inner: IOEngine, faults: Sequence[Fault] = (), source: FaultFile | None = None):
        """``source``: a file whose faults replace the armed ones whenever it changes."""
        self.inner = inner
        self.name = inner.name
        self._faults = list(faults)
        self._lock = threading.Lock()
        self._source = source
        self.injected = 0

    def arm(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def _refresh(self) -> None:
        """(once per batch) The file's faults, if it changed since."""
        if self._source is not None:
            with self._lock:
                armed = self._source.changed()
                if armed is not None:
                    self._faults = armed

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
                if self._source is not None:
                    log.warning("fault injected: %s into a %s of %d bytes at offset %d of device %d", f.kind,
                                req.op.name.lower(), len(req.buf), req.offset, req.device)
                return f
        return None

    def execute(self, requests: Sequence[IORequest]) -> list[IOResult]:
        self._refresh()
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

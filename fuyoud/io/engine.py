"""The I/O engine seam: every byte the daemon moves to or from an SSD goes through it.

An engine executes a batch of positioned reads and writes and reports, per request,
how many bytes moved or which errno stopped it. Engines continue short transfers
themselves; a request that still ends short (a read past end of file, say) is reported
with ``nbytes < len(buf)`` and the caller decides. Engines never raise for a failed
request: the store turns results into errors that name the device and the object.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence


class Op(enum.IntEnum):
    READ = 0
    WRITE = 1


@dataclass(frozen=True, slots=True)
class IORequest:
    """One positioned transfer between ``buf`` and ``fd`` at ``offset``.

    ``buf`` is a writable (for reads) contiguous memoryview. For O_DIRECT files its
    address, length and ``offset`` must be multiples of the logical block size (4096).
    ``device`` is an index into the store's devices, carried only for error reporting
    and metrics.
    """

    op: Op
    fd: int
    offset: int
    buf: memoryview
    device: int = 0


@dataclass(frozen=True, slots=True)
class IOResult:
    nbytes: int  # bytes transferred (may be short)
    errno: int = 0  # 0 on success, else the errno that stopped the transfer

    @property
    def ok(self) -> bool:
        return self.errno == 0


class IOEngine(ABC):
    """Executes batches of requests. Thread-safe: concurrent ``execute`` calls are allowed."""

    name: str = "abstract"

    @abstractmethod
    def execute(self, requests: Sequence[IORequest]) -> list[IOResult]:
        """Run every request (in any order, concurrently up to the engine's depth) and
        return one result per request, in request order. Blocks until all are done."""

    def close(self) -> None:  # pragma: no cover - default no-op
        pass

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

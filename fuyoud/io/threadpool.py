"""Thread-pool engine: blocking ``os.preadv``/``os.pwritev`` on a pool of threads.

The portable fallback where io_uring is unavailable. The syscalls release the GIL, so
``workers`` transfers really are in flight at once.
"""
from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from fuyoud.concurrency.threads import named
from .engine import IOEngine, IORequest, IOResult, Op


def _transfer(req: IORequest) -> IOResult:
    if req.offset < 0:  # as the io_uring shim does, even for an empty transfer
        return IOResult(0, errno.EINVAL)
    buf = req.buf.cast("B")  # byte-addressed, so the remainder can be sliced
    done = 0
    try:
        while done < len(buf):
            rest = buf[done:]
            if req.op == Op.READ:
                n = os.preadv(req.fd, [rest], req.offset + done)
            else:
                n = os.pwritev(req.fd, [rest], req.offset + done)
            if n == 0:  # end of file on a read; a write that moves nothing stops too
                break
            done += n
    except OSError as exc:
        return IOResult(done, exc.errno)
    return IOResult(done)


class ThreadPoolEngine(IOEngine):
    name = "threadpool"

    def __init__(self, workers: int = 16) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, **named("fuyou-io"))

    def execute(self, requests: Sequence[IORequest]) -> list[IOResult]:
        futures = [self._pool.submit(_transfer, r) for r in requests]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True)

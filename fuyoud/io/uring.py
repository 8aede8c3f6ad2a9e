"""io_uring engine: batches go to the kernel through the C shim in ``fuyoud._uring``.

The extension is optional (setup.py skips it where liburing is missing), so it is
imported lazily: importing this module always works, and ``available()`` says whether
the engine can actually be used here.
"""
from __future__ import annotations

import errno as _errno
import os
import threading
import weakref
from typing import Sequence

from .engine import IOEngine, IORequest, IOResult, Op


def _native():
    """The ``fuyoud._uring`` module (raises ImportError when it was not built)."""
    from .. import _uring

    return _uring


def available() -> tuple[bool, str]:
    """Whether the extension imports and a ring can be opened; else why not."""
    try:
        native = _native()
    except ImportError as exc:
        return False, f"fuyoud._uring not built: {exc}"
    err = native.ffi.new("int *")
    ring = native.lib.fy_ring_open(8, err)
    if ring == native.ffi.NULL:
        # EPERM under kernel.io_uring_disabled or a seccomp filter, ENOSYS on old kernels.
        name = _errno.errorcode.get(err[0], str(err[0]))
        return False, f"io_uring_queue_init failed: {name} ({os.strerror(err[0])})"
    native.lib.fy_ring_close(ring)
    return True, "ok"


class _Ring:
    """One thread's ring. ``lock`` is held while the ring runs a batch, so ``close()``
    never frees a ring under a running ``execute``."""

    __slots__ = ("ptr", "lock", "__weakref__")

    def __init__(self, ptr) -> None:
        self.ptr = ptr
        self.lock = threading.Lock()

    def release(self) -> None:
        with self.lock:
            if self.ptr is not None:
                _native().ffi.release(self.ptr)  # runs fy_ring_close now, not at GC
                self.ptr = None


class UringEngine(IOEngine):
    """Runs each ``execute`` batch on the calling thread's own ring, keeping up to
    ``queue_depth`` requests in flight. Rings are created lazily per thread; a ring is
    closed when its thread ends (the thread-local goes away) or on ``close()``."""

    name = "io_uring"

    def __init__(self, queue_depth: int = 32) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        ok, reason = available()
        if not ok:
            raise RuntimeError(f"io_uring engine unavailable: {reason}")
        self._native = _native()
        self.queue_depth = queue_depth
        self._local = threading.local()
        self._rings: weakref.WeakSet[_Ring] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False

    def _ring(self) -> _Ring:
        ring = getattr(self._local, "ring", None)
        if ring is not None and ring.ptr is not None:
            return ring
        ffi, lib = self._native.ffi, self._native.lib
        err = ffi.new("int *")
        ptr = lib.fy_ring_open(self.queue_depth, err)
        if ptr == ffi.NULL:
            raise OSError(err[0], f"io_uring_queue_init: {os.strerror(err[0])}")
        # ffi.gc closes the ring when the owning thread's local storage is dropped.
        ring = _Ring(ffi.gc(ptr, lib.fy_ring_close))
        with self._lock:
            if self._closed:
                ring.release()
                raise RuntimeError("UringEngine is closed")
            self._rings.add(ring)
        self._local.ring = ring
        return ring

    def execute(self, requests: Sequence[IORequest]) -> list[IOResult]:
        if self._closed:
            raise RuntimeError("UringEngine is closed")
        n = len(requests)
        if n == 0:
            return []
        ffi, lib = self._native.ffi, self._native.lib
        reqs = ffi.new("struct fy_req[]", n)
        # `bufs` holds the exports of the callers' buffers (an mmap cannot be closed or
        # resized meanwhile) until this call returns, i.e. after the batch is done.
        bufs = []
        for i, r in enumerate(requests):
            buf = ffi.from_buffer(r.buf, require_writable=(r.op == Op.READ))
            bufs.append(buf)
            c = reqs[i]
            c.fd = r.fd
            c.op = int(r.op)
            c.offset = r.offset
            c.buf = buf
            c.len = len(buf)
        ring = self._ring()
        with ring.lock:
            if ring.ptr is None:  # close() got here first
                raise RuntimeError("UringEngine is closed")
            rc = lib.fy_ring_run(ring.ptr, reqs, n, self.queue_depth)  # GIL released
        if rc < 0:
            # The ring itself failed; the shim already gave every unfinished request
            # the errno. Drop the ring: this thread's next batch opens a fresh one.
            ring.release()
        return [IOResult(reqs[i].done, reqs[i].err) for i in range(n)]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            rings = list(self._rings)
        for ring in rings:
            ring.release()

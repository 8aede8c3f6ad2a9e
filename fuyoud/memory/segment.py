"""Shared-memory segments: memfd files mapped by the daemon and by one client.

A segment belongs to exactly one session: its fd is only ever sent to that session
(over the session socket, SCM_RIGHTS), and every buffer inside it is that session's.
The daemon maps it MAP_SHARED and prefaults it; with ``lock`` it also mlocks the pages
so that swapping never moves them while the SSD reads or writes them (pinned memory).

Making and unmapping a large segment must not stall the daemon's other threads. Its
pages are allocated with fallocate on the memfd (no lock of the daemon's address space
taken), then mapped without MAP_POPULATE, and faulted in and locked POPULATE_CHUNK at a
time; closing unlocks and drops the page tables chunk by chunk before the unmap. In one
go (MAP_POPULATE, one mlock, one munmap) the kernel held the process's mmap lock for
the whole GB: every other thread's mmap (Python's and torch's allocations, a buffer's
first use) waited 0.2 s and more per GiB; chunked, at most a few ms (measured on the
project's machine: 178 -> 6 ms making 1 GiB, 201 -> 4 ms unmapping it).
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os

from fuyoud.errors import FailedPrecondition, ResourceExhausted


log = logging.getLogger(__name__)
_warned = False


def _warn_unlocked(segment_id: int, err: int) -> None:
    """lock = "auto" and mlock refused: said once (at warning), then per segment at debug."""
    global _warned
    if not _warned:
        _warned = True
        log.warning("mlock of shared segments is refused (%s): they stay unlocked and may be swapped out; raise "
                    "fuyoud's memlock limit (LimitMEMLOCK=) or set [memory] lock = \"no\" to silence this",
                    os.strerror(err))
    log.debug("mlock of segment %d refused: %s", segment_id, os.strerror(err))

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python 3.11's mmap module
POPULATE_CHUNK = 64 << 20  # bytes faulted in, locked or released at a time (see the module's doc)


def _chunks(size: int):
    return ((off, min(POPULATE_CHUNK, size - off)) for off in range(0, size, POPULATE_CHUNK))


def _madvise(buf: mmap.mmap, off: int, length: int, advice: int) -> int:
    """madvise through ctypes, which lets go of the GIL (mmap.madvise holds it: the
    daemon's other threads would wait for every chunk faulted in); 0 or the errno."""
    holder = ctypes.c_char.from_buffer(buf)
    try:
        if _libc.madvise(ctypes.addressof(holder) + off, length, advice) != 0:
            return ctypes.get_errno()
        return 0
    finally:
        del holder


def _prefault(m: mmap.mmap, off: int = 0, length: int | None = None) -> None:
    """Allocate the pages of [off, off+length) now (not on first use inside an I/O)."""
    length = len(m) - off if length is None else length
    if _madvise(m, off, length, MADV_POPULATE_WRITE):  # older kernels: touch each page
        for page in range(off, off + length, 4096):
            m[page] = 0


def mlock(buf: mmap.mmap) -> int:
    """mlock a mapping, a chunk at a time; returns 0 or the errno that refused it (then
    nothing of it stays locked)."""
    holder = ctypes.c_char.from_buffer(buf)
    try:
        base = ctypes.addressof(holder)
        for off, length in _chunks(len(buf)):
            if _libc.mlock(base + off, length) != 0:
                err = ctypes.get_errno()
                _libc.munlock(base, off)
                return err
        return 0
    finally:
        del holder


def _release(buf: mmap.mmap, locked: bool) -> None:
    """Unlock and drop the page tables of a mapping a chunk at a time, so that its unmap
    is short (the pages themselves are the memfd's: they go with its last reference)."""
    try:
        holder = ctypes.c_char.from_buffer(buf)
    except (TypeError, ValueError):  # (closed)
        return
    try:
        base = ctypes.addressof(holder)
        for off, length in _chunks(len(buf)):
            if locked:
                _libc.munlock(base + off, length)
            if _libc.madvise(base + off, length, mmap.MADV_DONTNEED) != 0:  # (refused: the unmap does it all)
                return
    finally:
        del holder


class Segment:
    """``pages`` is "hugetlb", "thp" or "none" (see hugepages.py)."""

    def __init__(self, segment_id: int, size: int, session_id: int, lock: bool | str, pages: str = "none"):
        self.id = segment_id
        self.size = size
        self.session_id = session_id
        self.pages = pages
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if pages == "hugetlb" else 0)
        self.fd = os.memfd_create(f"fuyou-seg-{segment_id}", flags)
        try:
            os.ftruncate(self.fd, size)
            # The size is fixed for the segment's life: the client may not shrink it under us.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            if pages != "thp":  # (the pages, allocated in the memfd: no address-space lock held)
                try:
                    os.posix_fallocate(self.fd, 0, size)
                except OSError as exc:  # (a full shm, a memory cgroup at its limit: said now, not a SIGBUS later)
                    raise ResourceExhausted(f"the host has no memory for a shared segment of {size} bytes: "
                                            f"{exc.strerror}") from None
            self.map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
            if pages == "thp":  # (advised before the first touch, so that the pages are born huge)
                self.map.madvise(mmap.MADV_HUGEPAGE)
            for off, length in _chunks(size):
                _prefault(self.map, off, length)
        except BaseException:
            os.close(self.fd)
            raise
        self.locked = False
        if lock and lock != "no":  # (True or "auto": try; "yes": a refusal is an error)
            err = mlock(self.map)
            self.locked = err == 0
            if err and lock == "yes":
                self.close()
                raise FailedPrecondition(
                    f"[memory] lock = \"yes\" and mlock of a {size}-byte segment was refused ({os.strerror(err)}): "
                    "raise fuyoud's memlock limit (LimitMEMLOCK= in fuyoud.service, ulimit -l) or set lock = \"auto\"")
            if err:
                _warn_unlocked(segment_id, err)

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self.map)[offset:offset + length]

    def close(self) -> None:
        os.close(self.fd)
        _release(self.map, self.locked)
        try:
            self.map.close()  # the client's mapping keeps its own pages alive
        except BufferError:
            # An I/O still holds a view (only possible while a reclaim races a transfer);
            # the mapping goes when the last view is dropped.
            log.warning("segment %d still referenced at close; unmapped later", self.id)


"""Shared-memory segments: memfd files mapped by the daemon and by one client.

A segment belongs to exactly one session: its fd is only ever sent to that session
(over the session socket, SCM_RIGHTS), and every buffer inside it is that session's.
The daemon maps it MAP_SHARED and prefaults it; with ``lock`` it also mlocks the pages
so that swapping never moves them while the SSD reads or writes them (pinned memory).
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os

from fuyoud.errors import FailedPrecondition


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


MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python 3.11's mmap module


def _prefault(m: mmap.mmap) -> None:
    """Allocate every page now (not on first use inside an I/O)."""
    try:
        m.madvise(MADV_POPULATE_WRITE)
    except OSError:  # older kernels: touch each page
        for off in range(0, len(m), 4096):
            m[off] = 0


def mlock(buf: mmap.mmap) -> int:
    """mlock a mapping; returns 0 or the errno that refused it."""
    holder = ctypes.c_char.from_buffer(buf)
    try:
        if _libc.mlock(ctypes.addressof(holder), len(buf)) != 0:
            return ctypes.get_errno()
        return 0
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
            if pages == "thp":
                # Advise before the first touch, so that the pages are born huge.
                self.map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
                self.map.madvise(mmap.MADV_HUGEPAGE)
                _prefault(self.map)
            else:
                self.map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
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
        try:
            self.map.close()  # also unlocks; the client's mapping keeps its own pages alive
        except BufferError:
            # An I/O still holds a view (only possible while a reclaim races a transfer);
            # the mapping goes when the last view is dropped.
            log.warning("segment %d still referenced at close; unmapped later", self.id)


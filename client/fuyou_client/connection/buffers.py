"""Shared buffers: ranges of the daemon's pinned memory, mapped into this process.

A SharedBuffer is a view of a memfd segment that the daemon mapped too: filling it or
reading it is plain memory access, and the daemon's I/O engine moves those same pages
to and from the SSD. ``tensor()`` gives a torch view (no copy).

A segment closed (its last buffer freed, or the session closed) gives its shared pages
back at once, even while a tensor view of it is still alive somewhere (in a reference
cycle until the next gc, say): its address range is then remapped to fresh private
zero pages (MAP_FIXED), so the daemon's memory is no longer mapped here, and a stale
view reads zeros instead of another tenant's bytes or a fault. The range itself goes
when the last view does.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import TYPE_CHECKING, Callable

from fuyou_proto import pb

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
MAP_FIXED, MAP_NORESERVE = 0x10, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value


def _replace_with_zero_pages(address: int, size: int) -> None:
    """Put private anonymous pages (read as zeros, allocated only if written) over
    [address, address+size): the shared mapping there is gone."""
    got = _libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0)
    if got in (None, MAP_FAILED) or got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"remapping a closed shared segment failed: {os.strerror(err)}")

if TYPE_CHECKING:
    import torch


class Segment:
    """This process's mapping of one shared segment."""

    def __init__(self, segment_id: int, size: int, fd: int):
        self.id = segment_id
        self.size = size
        try:
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.live_buffers = 0
        self.device = None  # the compute device it is registered with (cudaHostRegister)
        self.closed = False

    @property
    def address(self) -> int:
        from fuyou_proto.contract import buffer_address

        return buffer_address(self.map)

    def register(self, device) -> None:
        """Make the mapping usable for asynchronous copies by ``device`` (once)."""
        if self.device is None:
            device.register(self.address, self.size)
            self.device = device

    def close_registration(self) -> None:
        if self.device is not None:
            self.device.unregister(self.address)
            self.device = None

    def close(self) -> bool:
        """Unmap the segment's shared pages (see the module's doc); True when the range is
        unmapped too, False when a view still holds it (it holds zero pages now)."""
        if self.closed:
            return True
        self.close_registration()  # unregistered before it is unmapped
        address = self.address
        try:
            self.map.close()
            self.closed = True
            return True
        except BufferError:  # a view still uses the range: keep the range, drop the shared pages
            _replace_with_zero_pages(address, self.size)
            self.closed = True
            return False


class SharedBuffer:
    def __init__(self, release: "Callable[[SharedBuffer], None]", ref: pb.BufferRef, segment: Segment, size: int):
        self._release = release  # (the session's: the daemon frees the range, the segment may go)
        self.ref = ref
        self.size = size  # what was asked for; ref.length may be larger (page rounding)
        self.segment = segment
        self.view: memoryview | None = memoryview(segment.map)[ref.offset:ref.offset + size]

    def tensor(self, dtype=None, shape=None) -> "torch.Tensor":
        """A torch tensor over the buffer's bytes (uint8 by default), without copying."""
        import torch

        if self.view is None:
            raise ValueError("buffer was freed")
        t = torch.frombuffer(self.view, dtype=dtype or torch.uint8)
        return t.view(shape) if shape is not None else t

    def free(self) -> None:
        """Give the memory back to the daemon. Tensor views of it must not be used after."""
        if self.view is not None:
            try:
                self.view.release()
            except BufferError:  # a tensor still exports it: the mapping outlives it anyway
                pass
            self.view = None
            self._release(self)

    def __len__(self) -> int:
        return self.size

    def __enter__(self) -> "SharedBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        return f"SharedBuffer(segment={self.ref.segment}, offset={self.ref.offset}, size={self.size})"

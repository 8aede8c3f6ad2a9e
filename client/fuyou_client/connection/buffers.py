"""Shared buffers: ranges of the daemon's pinned memory, mapped into this process.

A SharedBuffer is a view of a memfd segment that the daemon mapped too: filling it or
reading it is plain memory access, and the daemon's I/O engine moves those same pages
to and from the SSD. ``tensor()`` gives a torch view (no copy).
"""
from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Callable

from fuyou_proto import pb

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
        self.close_registration()  # unregistered before it is unmapped
        try:
            self.map.close()
            return True
        except BufferError:  # a tensor view still uses it; it goes with the last view
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

"""An extent allocator over a linear address space [0, capacity).

Used for both the SSD data files (storage) and the shared-memory segments (memory):
best-fit over a sorted free list, every extent a multiple of ``alignment``, freed
extents coalesced with their neighbours. The free list is small in practice (objects
are large), so the O(n) best-fit scan is not a hot spot.
"""
from __future__ import annotations

import bisect

from fuyoud.units import align_up


class OutOfSpace(Exception):
    def __init__(self, wanted: int, largest: int, free: int):
        super().__init__(f"no free extent of {wanted} bytes (largest free {largest}, free in all {free})")
        self.wanted, self.largest, self.free = wanted, largest, free


class ExtentAllocator:
    def __init__(self, capacity: int, alignment: int = 4096):
        if capacity % alignment:
            raise ValueError(f"capacity {capacity} is not a multiple of {alignment}")
        self.capacity = capacity
        self.alignment = alignment
        self._starts: list[int] = [0] if capacity else []
        self._lengths: dict[int, int] = {0: capacity} if capacity else {}
        self.free_bytes = capacity

    @property
    def used_bytes(self) -> int:
        return self.capacity - self.free_bytes

    @property
    def largest_free(self) -> int:
        return max(self._lengths.values(), default=0)

    def size_of(self, nbytes: int) -> int:
        """What an allocation of ``nbytes`` really takes."""
        return align_up(max(nbytes, 1), self.alignment)

    def allocate(self, nbytes: int) -> int:
        """Return the offset of a new extent of ``size_of(nbytes)`` bytes (best fit)."""
        size = self.size_of(nbytes)
        best = None
        for start in self._starts:
            length = self._lengths[start]
            if length >= size and (best is None or length < self._lengths[best]):
                best = start
                if length == size:
                    break
        if best is None:
            raise OutOfSpace(size, self.largest_free, self.free_bytes)
        self._take(best, size)
        return best

    def reserve(self, offset: int, nbytes: int) -> None:
        """Mark a known extent as used (rebuilding the map from an index at start-up)."""
        size = self.size_of(nbytes)
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset + size > self._starts[i] + self._lengths[self._starts[i]]:
            raise ValueError(f"extent [{offset}, {offset + size}) is not free")
        start = self._starts[i]
        length = self._lengths.pop(start)
        del self._starts[i]
        if offset > start:
            self._insert(start, offset - start)
        if offset + size < start + length:
            self._insert(offset + size, start + length - offset - size)
        self.free_bytes -= size

    def free(self, offset: int, nbytes: int) -> None:
        size = self.size_of(nbytes)
        if offset % self.alignment or offset < 0 or offset + size > self.capacity:
            raise ValueError(f"bad extent [{offset}, {offset + size})")
        i = bisect.bisect_left(self._starts, offset)
        prev_end = self._starts[i - 1] + self._lengths[self._starts[i - 1]] if i > 0 else -1
        if prev_end > offset or (i < len(self._starts) and self._starts[i] < offset + size):
            raise ValueError(f"double free of extent [{offset}, {offset + size})")
        self.free_bytes += size
        if i < len(self._starts) and self._starts[i] == offset + size:  # merge with next
            size += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if prev_end == offset:  # merge with previous
            self._lengths[self._starts[i - 1]] += size
        else:
            self._insert(offset, size)

    def tail_free(self) -> int:
        """Free bytes at the very end of the space (joined by an ``extend``)."""
        last = self._starts[-1] if self._starts else None
        return self._lengths[last] if last is not None and last + self._lengths[last] == self.capacity else 0

    def extend(self, capacity: int) -> None:
        """Grow the address space to ``capacity`` (a data file that grew): the new room is
        free, joined to a free extent that ended at the old end."""
        if capacity % self.alignment or capacity < self.capacity:
            raise ValueError(f"cannot extend from {self.capacity} to {capacity} bytes")
        added, old = capacity - self.capacity, self.capacity
        self.capacity = capacity
        if not added:
            return
        self.free_bytes += added
        last = self._starts[-1] if self._starts else None
        if last is not None and last + self._lengths[last] == old:
            self._lengths[last] += added
        else:
            self._insert(old, added)

    def _take(self, start: int, size: int) -> None:
        length = self._lengths.pop(start)
        self._starts.remove(start)
        if length > size:
            self._insert(start + size, length - size)
        self.free_bytes -= size

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._lengths[start] = length

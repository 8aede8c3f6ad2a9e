"""The pinned shared-memory pool: segments per session, buffers inside them, budgets.

A buffer handle is (segment, offset, length, generation). Generations are unique for
the daemon's life, so a handle kept after Free (or forged) is refused rather than
aliasing whatever was allocated at that place since. Budgets count segment bytes (the
memory the host really gives up): per session and for the daemon as a whole.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable

from fuyou_proto.contract import PAGE, segment_bytes
from fuyoud.allocator import ExtentAllocator, OutOfSpace
from fuyoud.errors import InvalidArgument, OutOfMemoryBudget
from fuyoud.memory.segment import Segment
from fuyoud.units import align_up, format_size




@dataclass(frozen=True)
class BufferRef:
    segment: int
    offset: int
    length: int
    generation: int


@dataclass
class _Allocation:
    length: int
    generation: int


@dataclass
class _SegmentState:
    segment: Segment
    allocator: ExtentAllocator
    allocations: dict[int, _Allocation] = field(default_factory=dict)  # offset -> allocation


@dataclass
class PoolUsage:
    budget: int
    session_budget: int
    segment_size: int
    segments: int  # bytes in segments (what is pinned)
    allocated: int  # bytes handed out as buffers
    by_session: dict[int, int]  # segment bytes per session
    by_pages: dict[str, int]  # segment bytes per page kind ("hugetlb", "thp", "none")


class Pool:
    def __init__(self, budget: int, session_budget: int, segment_size: int, lock: bool | str,
                 pages: Callable[[int], str] = lambda size: "none",
                 segment_factory: Callable[..., Segment] = Segment):
        self.budget = budget
        self.session_budget = session_budget
        self.segment_size = segment_size
        self.lock_pages = lock
        self._make_segment = segment_factory
        self._pages = pages  # chooses the page kind of a new segment (hugepages.py)
        self._mutex = threading.Lock()
        self._segments: dict[int, _SegmentState] = {}
        self._by_session: dict[int, set[int]] = {}
        self._segment_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._pinned = 0

    # -- allocation -----------------------------------------------------------------
    def allocate(self, session_id: int, nbytes: int) -> tuple[BufferRef, Segment | None]:
        """Allocate ``nbytes`` for a session. Returns the handle and, when a new segment
        had to be created for it, that segment (whose fd the caller sends to the client)."""
        if nbytes <= 0:
            raise InvalidArgument(f"buffer size must be positive, got {nbytes}")
        size = align_up(nbytes, PAGE)
        with self._mutex:
            for seg_id in sorted(self._by_session.get(session_id, ())):
                ref = self._try_allocate(self._segments[seg_id], size)
                if ref is not None:
                    return ref, None
            seg_size = segment_bytes(size, self.segment_size)
            self._check_budget(session_id, seg_size, nbytes)
            segment = self._make_segment(next(self._segment_ids), seg_size, session_id, self.lock_pages,
                                         self._pages(seg_size))
            state = _SegmentState(segment, ExtentAllocator(seg_size, PAGE))
            self._segments[segment.id] = state
            self._by_session.setdefault(session_id, set()).add(segment.id)
            self._pinned += seg_size
            ref = self._try_allocate(state, size)
            assert ref is not None
            return ref, segment

    def _check_budget(self, session_id: int, seg_size: int, nbytes: int) -> None:
        held = self._session_bytes(session_id)
        if held + seg_size > self.session_budget:
            raise OutOfMemoryBudget(
                f"session pinned-memory budget spent: asked {format_size(nbytes)}, session holds "
                f"{format_size(held)} of {format_size(self.session_budget)}; free buffers or raise "
                "[memory.session_budget]")
        if self._pinned + seg_size > self.budget:
            raise OutOfMemoryBudget(
                f"daemon pinned-memory budget spent: asked {format_size(nbytes)}, "
                f"{format_size(self._pinned)} of {format_size(self.budget)} in use by all sessions; "
                "raise [memory.pinned_budget]")

    def _try_allocate(self, state: _SegmentState, size: int) -> BufferRef | None:
        try:
            offset = state.allocator.allocate(size)
        except OutOfSpace:
            return None
        alloc = _Allocation(size, next(self._generations))
        state.allocations[offset] = alloc
        return BufferRef(state.segment.id, offset, size, alloc.generation)

    def free(self, session_id: int, ref: BufferRef) -> None:
        with self._mutex:
            state, _ = self._lookup(session_id, ref)
            del state.allocations[ref.offset]
            state.allocator.free(ref.offset, ref.length)
            if not state.allocations:  # give the memory back as soon as a segment empties
                self._drop_segment(state)

    def release_session(self, session_id: int) -> int:
        """Drop every segment of a session; returns the bytes given back."""
        with self._mutex:
            freed = 0
            for seg_id in list(self._by_session.get(session_id, ())):
                state = self._segments[seg_id]
                freed += state.segment.size
                self._drop_segment(state)
            self._by_session.pop(session_id, None)
            return freed

    def _drop_segment(self, state: _SegmentState) -> None:
        seg = state.segment
        del self._segments[seg.id]
        self._by_session[seg.session_id].discard(seg.id)
        self._pinned -= seg.size
        seg.close()

    # -- lookups ----------------------------------------------------------------------
    def _lookup(self, session_id: int, ref: BufferRef) -> tuple[_SegmentState, _Allocation]:
        state = self._segments.get(ref.segment)
        if state is None or state.segment.session_id != session_id:
            # Same message for "no such segment" and "another session's": no probing.
            raise InvalidArgument(f"unknown buffer: segment {ref.segment} is not one of this session's")
        alloc = state.allocations.get(ref.offset)
        if alloc is None or alloc.generation != ref.generation:
            raise InvalidArgument(
                f"stale or unknown buffer handle (segment {ref.segment}, offset {ref.offset}, "
                f"generation {ref.generation}): it was freed or never allocated")
        if ref.length != alloc.length:
            raise InvalidArgument(f"buffer handle length {ref.length} does not match the allocation ({alloc.length})")
        return state, alloc

    def view(self, session_id: int, ref: BufferRef, offset: int, length: int | None) -> memoryview:
        """The bytes [offset, offset+length) of a session's buffer, validated."""
        with self._mutex:
            state, alloc = self._lookup(session_id, ref)
            if length is None:
                length = alloc.length - offset if offset <= alloc.length else -1
            if offset < 0 or length < 0 or offset + length > alloc.length:
                raise InvalidArgument(
                    f"range [{offset}, {offset + length}) is outside the buffer of {alloc.length} bytes")
            return state.segment.view(ref.offset + offset, length)

    def usage(self) -> PoolUsage:
        with self._mutex:
            allocated = sum(a.length for s in self._segments.values() for a in s.allocations.values())
            by_session = {sid: self._session_bytes(sid) for sid in self._by_session}
            by_pages = {"hugetlb": 0, "thp": 0, "none": 0}
            for s in self._segments.values():
                by_pages[s.segment.pages] += s.segment.size
            return PoolUsage(self.budget, self.session_budget, self.segment_size, self._pinned, allocated, by_session,
                             by_pages)

    def _session_bytes(self, session_id: int) -> int:
        return sum(self._segments[s].segment.size for s in self._by_session.get(session_id, ()))

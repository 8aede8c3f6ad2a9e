"""The pinned shared-memory pool: segments per session, buffers inside them, budgets,
reservations.

A buffer handle is (segment, offset, length, generation). Generations are unique for
the daemon's life, so a handle kept after Free (or forged) is refused rather than
aliasing whatever was allocated at that place since. Budgets count segment bytes (the
memory the host really gives up): per session and for the daemon as a whole.

A plan admitted is a plan held: a session may reserve bytes (``reserve``: a training
client's memory plan, at attach) and its allocations up to that many bytes are then
never refused for room others took. What a session holds against the daemon's budget is
the larger of its reservation and its segments; a reservation, or a segment beyond one,
that the budget cannot hold beside what the other sessions hold is refused with the
numbers and those sessions (``describe``: who they are, as the asking session may know).

The lock guards the bookkeeping only: a new segment's bytes are counted under it, but
the segment is created, pre-faulted and mlocked (page faults over hundreds of MB or GB)
after it is released, and segments are unmapped after it too, so that one session's
large allocation or release never stalls another's buffer lookups, its step or Status.

A released session is remembered (its id, for the daemon's life: ids are never reused):
an allocation or reservation for it is refused under the same lock that released it, so
a request that looked its session up just before the session closed (the client died
mid-call) can leave nothing behind, whichever side of the release it lands on.
"""
from __future__ import annotations

import itertools
import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from fuyou_proto.contract import PAGE, segment_bytes
from fuyoud.errors import InvalidArgument, OutOfMemoryBudget, Unauthenticated
from fuyoud.memory.allocator import ExtentAllocator, OutOfSpace
from fuyoud.memory.segment import Segment
from fuyoud.sessions.user_limits import PINNED, UserLimits
from fuyoud.units import align_up, format_size

SHOWN_HOLDERS = 4  # other sessions a refusal names (the largest holders)


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
    segments: int  # bytes in segments (what is pinned), those being created included
    allocated: int  # bytes handed out as buffers
    by_session: dict[int, int]  # segment bytes per session
    by_pages: dict[str, int]  # segment bytes per page kind ("hugetlb", "thp", "none")
    reserved: int = 0  # bytes sessions reserved beyond their segments: not free for the others
    reserved_by_session: dict[int, int] = field(default_factory=dict)  # each session's reservation


class Pool:
    def __init__(self, budget: int, session_budget: int, segment_size: int, lock: bool | str,
                 pages: Callable[[int], str] = lambda size: "none",
                 segment_factory: Callable[..., Segment] = Segment,
                 describe: Callable[[int, int], str] = lambda holder, asker: f"session {holder}",
                 limits: UserLimits | None = None):
        self.budget = budget
        self.limits = limits  # what one uid's sessions may hold together ([limits] user_pinned); None: no limit
        self.session_budget = session_budget
        self.segment_size = segment_size
        self.lock_pages = lock
        self._make_segment = segment_factory
        self._pages = pages  # chooses the page kind of a new segment (hugepages.py)
        self._describe = describe  # (holder session, asking session) -> how a refusal names the holder
        self._mutex = threading.Lock()
        self._segments: dict[int, _SegmentState] = {}
        self._by_session: dict[int, set[int]] = {}
        self._reserved: dict[int, int] = {}  # session -> bytes its plan reserved
        self._creating: dict[int, int] = defaultdict(int)  # session -> bytes of segments being created
        self._released: set[int] = set()  # sessions released: nothing more is allocated or reserved for them
        self._user: dict[int, int] = {}  # session -> its uid (given with its first reservation or allocation)
        self._segment_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._pinned = 0  # segment bytes, those being created included

    # -- what each session holds (the lock held) ---------------------------------------------
    def _mine(self, session_id: int) -> int:
        """Segment bytes of a session, those being created included."""
        return self._session_bytes(session_id) + self._creating.get(session_id, 0)

    def _held(self, session_id: int) -> int:
        """What a session holds against the daemon's budget: its reservation or its segments."""
        return max(self._reserved.get(session_id, 0), self._mine(session_id))

    def _holders(self) -> set[int]:
        return set(self._by_session) | set(self._reserved) | {s for s, n in self._creating.items() if n}

    def _others(self, session_id: int) -> dict[int, int]:
        """What every other session holds (non-zero only)."""
        return {s: h for s in self._holders() if s != session_id and (h := self._held(s))}

    def _refuse_released(self, session_id: int, what: str, user: int | None = None) -> None:  # (the lock held)
        if session_id in self._released:
            raise Unauthenticated(f"session {session_id} is closing or closed: nothing more can be {what} for it")
        if user is not None:
            self._user[session_id] = user

    def _users_others(self, session_id: int, uid: int | None) -> dict[int, int]:  # (the lock held)
        """What the other sessions of ``uid`` hold (non-zero only)."""
        return {} if uid is None else {s: h for s, h in self._others(session_id).items() if self._user.get(s) == uid}

    def user_usage(self, uid: int, session_id: int = 0) -> tuple[int, int]:
        """(the most ``uid``'s sessions may hold together, 0: no limit; what those other
        than ``session_id`` hold): what a client plans within (Status)."""
        with self._mutex:
            limit = self.limits.pinned if self.limits is not None else 0
            return limit, sum(self._users_others(session_id, uid).values())

    def _check_user(self, session_id: int, need: int, what: str) -> None:  # (the lock held)
        """Refuse what would take the session's uid past [limits] user_pinned: ``need`` is
        what the session would hold."""
        uid = self._user.get(session_id)
        if self.limits is None or not self.limits.pinned or uid is None:
            return
        others = self._users_others(session_id, uid)
        held = sum(others.values())
        if held + need <= self.limits.pinned:
            return
        top = sorted(others.items(), key=lambda kv: -kv[1])
        names = "; ".join(f"session {sid} {format_size(h)}" for sid, h in top[:SHOWN_HOLDERS]) + (
            f"; {len(top) - SHOWN_HOLDERS} more sessions" if len(top) > SHOWN_HOLDERS else "")
        holds = (f"would hold {format_size(held + need)} of pinned memory with this session's {what} "
                 f"(it would hold {format_size(need)})"
                 + (f", its other sessions holding {format_size(held)} ({names})" if others else ""))
        raise self.limits.refuse(PINNED, uid, holds,
                                 "end its other sessions or plan this one for less (a client plans within what "
                                 "Status says its user may still take)" if others else
                                 "plan this session for less, or have the operator raise the limit")

    def segment_fd(self, session_id: int, segment: Segment) -> int:
        """A duplicate of a new segment's fd, for sending to its client (the caller closes
        it): taken under the pool's lock, so a release that closes the segment cannot close
        the fd first and let its number name another file by the time it is sent."""
        with self._mutex:
            self._refuse_released(session_id, "sent")
            if segment.id not in self._segments:
                raise Unauthenticated(f"session {session_id} is closing or closed: its segment went")
            return os.dup(segment.fd)

    # -- reservations ---------------------------------------------------------------------------
    def reserve(self, session_id: int, nbytes: int, user: int | None = None) -> int:
        """Hold ``nbytes`` of the budget for a session (replacing its reservation; 0 gives
        it up): its allocations within them are never refused for room the others took.
        OutOfMemoryBudget, with what the others hold, when the budget cannot."""
        if nbytes < 0:
            raise InvalidArgument(f"a reservation must be >= 0 bytes, got {nbytes}")
        with self._mutex:
            self._refuse_released(session_id, "reserved", user)
            if nbytes > self.session_budget:
                raise OutOfMemoryBudget(
                    f"a reservation of {format_size(nbytes)} exceeds the session pinned-memory budget of "
                    f"{format_size(self.session_budget)} ([memory] session_budget)")
            mine, others = self._mine(session_id), self._others(session_id)
            if nbytes > mine and sum(others.values()) + nbytes > self.budget:
                raise OutOfMemoryBudget(self._no_room(session_id, f"reserve {format_size(nbytes)}", nbytes,
                                                      others))
            if nbytes > mine:
                self._check_user(session_id, nbytes, f"reservation of {format_size(nbytes)}")
            if nbytes:
                self._reserved[session_id] = nbytes
            else:
                self._reserved.pop(session_id, None)
            return nbytes

    def _no_room(self, session_id: int, what: str, need: int, others: dict[int, int]) -> str:
        """A refusal for room: the numbers, and who holds the rest."""
        held = sum(others.values())
        top = sorted(others.items(), key=lambda kv: -kv[1])
        names = [f"{self._describe(sid, session_id)} {format_size(h)}"
                 + (f" ({format_size(self._reserved[sid])} reserved by its plan)" if self._reserved.get(sid) else "")
                 for sid, h in top[:SHOWN_HOLDERS]]
        if len(top) > SHOWN_HOLDERS:
            names.append(f"{len(top) - SHOWN_HOLDERS} more sessions {format_size(sum(h for _, h in top[SHOWN_HOLDERS:]))}")
        now = self._held(session_id)
        head = (f"no room in fuyoud's pinned-memory budget to {what}: this session "
                + (f"holds {format_size(now)} and " if now else "")
                + f"would hold {format_size(need)}, and of the budget of {format_size(self.budget)} ")
        if not others:
            return head + ("no other session holds anything: the budget itself is too small; raise "
                           "[memory] pinned_budget")
        free = max(0, self.budget - held - now)
        return (head + f"other sessions hold {format_size(held)} ({'; '.join(names)}), {format_size(free)} is free. "
                "The budget is shared: their memory comes back as they end (`fuyouctl sessions` lists them); "
                + ("raise [memory] pinned_budget if this host has the memory for all of them" if need <= self.budget
                   else "this alone is more than the whole budget: raise [memory] pinned_budget"))

    # -- allocation -----------------------------------------------------------------
    def allocate(self, session_id: int, nbytes: int, user: int | None = None) -> tuple[BufferRef, Segment | None]:
        """Allocate ``nbytes`` for a session. Returns the handle and, when a new segment
        had to be created for it, that segment (whose fd the caller sends to the client).
        A new segment is made outside the pool's lock (see the module's doc)."""
        if nbytes <= 0:
            raise InvalidArgument(f"buffer size must be positive, got {nbytes}")
        size = align_up(nbytes, PAGE)
        with self._mutex:
            self._refuse_released(session_id, "allocated", user)
            for seg_id in sorted(self._by_session.get(session_id, ())):
                ref = self._try_allocate(self._segments[seg_id], size)
                if ref is not None:
                    return ref, None
            seg_size = segment_bytes(size, self.segment_size)
            self._check_budget(session_id, seg_size, nbytes)
            seg_id = next(self._segment_ids)
            self._creating[session_id] += seg_size
            self._pinned += seg_size
        segment = None
        try:
            segment = self._make_segment(seg_id, seg_size, session_id, self.lock_pages, self._pages(seg_size))
        finally:
            with self._mutex:
                self._creating[session_id] -= seg_size
                if not self._creating[session_id]:
                    del self._creating[session_id]
                ended = session_id in self._released  # (released while the segment was made)
                if segment is None or ended:
                    self._pinned -= seg_size
                else:
                    state = _SegmentState(segment, ExtentAllocator(seg_size, PAGE))
                    self._segments[segment.id] = state
                    self._by_session.setdefault(session_id, set()).add(segment.id)
                    ref = self._try_allocate(state, size)
                    assert ref is not None
        if ended and segment is not None:
            segment.close()
            raise Unauthenticated(f"session {session_id} ended while its buffer was being allocated")
        return ref, segment

    def _check_budget(self, session_id: int, seg_size: int, nbytes: int) -> None:  # (the lock held)
        mine = self._mine(session_id)
        if mine + seg_size > self.session_budget:
            raise OutOfMemoryBudget(
                f"session pinned-memory budget spent: asked {format_size(nbytes)}, session holds "
                f"{format_size(mine)} of {format_size(self.session_budget)}; free buffers or raise "
                "[memory.session_budget]")
        if mine + seg_size <= self._reserved.get(session_id, 0):
            return  # (within its reservation: held for it)
        others = self._others(session_id)
        if sum(others.values()) + mine + seg_size > self.budget:
            reserved = self._reserved.get(session_id, 0)
            what = f"allocate {format_size(nbytes)}" + (
                f" beyond the {format_size(reserved)} its plan reserved" if reserved else "")
            raise OutOfMemoryBudget(self._no_room(session_id, what, mine + seg_size, others))
        self._check_user(session_id, mine + seg_size, f"new segment of {format_size(seg_size)}")

    def _try_allocate(self, state: _SegmentState, size: int) -> BufferRef | None:
        try:
            offset = state.allocator.allocate(size)
        except OutOfSpace:
            return None
        alloc = _Allocation(size, next(self._generations))
        state.allocations[offset] = alloc
        return BufferRef(state.segment.id, offset, size, alloc.generation)

    def free(self, session_id: int, ref: BufferRef) -> None:
        gone = None
        with self._mutex:
            state, _ = self._lookup(session_id, ref)
            del state.allocations[ref.offset]
            state.allocator.free(ref.offset, ref.length)
            if not state.allocations:  # give the memory back as soon as a segment empties
                gone = self._drop_segment(state)
        if gone is not None:
            gone.close()  # (unmapped outside the lock)

    def release_session(self, session_id: int) -> int:
        """Drop every segment and the reservation of a session, and refuse it anything
        from now on (a segment being made for it is dropped once made); returns the bytes
        given back. Every segment is closed even if closing one fails (the first error is
        raised after)."""
        with self._mutex:
            self._released.add(session_id)
            gone = [self._drop_segment(self._segments[seg_id]) for seg_id in list(self._by_session.get(session_id, ()))]
            self._by_session.pop(session_id, None)
            self._reserved.pop(session_id, None)
            self._user.pop(session_id, None)
        failed = None
        for seg in gone:
            try:
                seg.close()
            except Exception as exc:  # noqa: BLE001 - the others are closed all the same
                failed = failed or exc
        if failed is not None:
            raise failed
        return sum(seg.size for seg in gone)

    def _drop_segment(self, state: _SegmentState) -> Segment:
        """(the lock held) Forget a segment; the caller closes it once the lock is released."""
        seg = state.segment
        del self._segments[seg.id]
        self._by_session[seg.session_id].discard(seg.id)
        self._pinned -= seg.size
        return seg

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
            reserved = sum(max(0, r - self._mine(sid)) for sid, r in self._reserved.items())
            return PoolUsage(self.budget, self.session_budget, self.segment_size, self._pinned, allocated, by_session,
                             by_pages, reserved, dict(self._reserved))

    def _session_bytes(self, session_id: int) -> int:
        return sum(self._segments[s].segment.size for s in self._by_session.get(session_id, ()))

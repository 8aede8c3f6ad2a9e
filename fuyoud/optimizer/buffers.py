"""Daemon-private buffers that hold optimizer state while it is read, stepped and written.

A fixed number of buffers (``[optimizer] buffers``, 6 by default) within a byte budget,
so the optimizer's memory is bounded whatever the model size: a step holds one buffer,
with the group's whole state when it fits (and a read-ahead of a group's state holds
another until its step); a group larger than a buffer is stepped in chunks through
scratch blocks and three stages (read, compute, write back: see chunks.py) in one
buffer, or in up to three, one per stage, taken without waiting while one stays free. A
buffer that more than CACHE_RESERVE free ones leave spare after a step keeps that group's
state until its next step (the state cache, groups.py), unless a step needs it first. Buffers
are private anonymous mappings on transparent huge pages (contiguous memory makes
O_DIRECT faster) and are kept between steps: mapping and faulting in hundreds of MB
per step would cost more than the step.

Several sessions share the pool (the ranks of a data-parallel job open one session each
with their host's daemon, and other jobs may train beside them), so who gets a buffer is
decided here, in two rules:

  * First come, first served. A step that finds no buffer waits in a queue, and
    release() hands the buffer to the first waiter itself and wakes only that one: no
    newcomer takes it in between, and no waiter starves behind later ones. try_acquire
    (read-ahead, weights held for backward, a chunked step's extra buffers) takes
    nothing while a step waits that a free buffer could serve, and a buffer is kept for
    the state cache only while no step waits for it (may_keep). No deadlock: a chunked
    step waits for its first buffer only and takes the others with try_acquire; what a
    step may hold while it waits (weights read for it), like read-aheads, was taken
    with try_acquire, which never takes the last free buffer; so one buffer at least is
    free, a step's that ends without waiting, or the state cache's, which gives it back.
  * A budget per session (``[optimizer] session_buffers``, 0: none beyond the pool):
    the buffers one session holds at once, its steps', read-aheads', held weights' and
    state cache's together. A session at its budget waits (try_acquire: None) even with
    buffers free; its waiting step does not hold up the other sessions' (the first
    waiter *within its budget* is served), and the state cache gives back one of the
    session's own kept buffers first. Read-aheads leave a buffer of the budget free, as
    they leave one of the pool, so a step that was not read ahead always proceeds.

Sessions are named by their namespace (``owner``): a namespace is held by one live
session at a time, and every group knows its own. Acquisitions without an owner (a
group's 4 KiB header read) are not charged to any session.
"""
from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

from fuyou_proto.contract import optimizer_buffer_bytes
from fuyoud.memory.hugepages import HUGE, huge_page_buffer
from fuyoud.units import align_up

RETRY_EVICT_S = 0.1  # a waiting step asks the state cache again this often (a kept buffer's group was busy)


class _Buffer:
    def __init__(self, size: int):
        self.size = size
        self.map, self.view = huge_page_buffer(size)


class _Waiter:
    """One acquire_blocking in the queue, served (``view`` set) by whoever frees a buffer."""
    __slots__ = ("nbytes", "owner", "view", "error", "turn")

    def __init__(self, nbytes: int, owner: str | None, lock: threading.Lock):
        self.nbytes, self.owner = nbytes, owner
        self.view: memoryview | None = None
        self.error: BaseException | None = None  # mapping its buffer failed
        self.turn = threading.Condition(lock)  # (one per waiter: only the one served is woken)


class StateBuffers:
    def __init__(self, count: int, budget: int, session_buffers: int = 0):
        if not 0 <= session_buffers <= count:
            raise ValueError(f"a session's budget of {session_buffers} buffers is not within 0..{count}")
        self.count = count
        self.per_buffer = optimizer_buffer_bytes(budget, count)
        self.session_buffers = session_buffers  # the most one session holds at once; 0: no limit
        self._free: list[_Buffer | None] = [None] * count  # None: not mapped yet
        self._owners: dict[int, tuple[_Buffer, str | None]] = {}  # id(view handed out) -> its buffer, session
        self._held: dict[str, int] = {}  # session (namespace) -> buffers it holds
        self._waiters: deque[_Waiter] = deque()  # acquire_blocking calls not served yet, in arrival order
        self._lock = threading.Lock()
        self.in_use = 0
        # Gives back a buffer kept by the state cache (only the named session's, when given).
        self.evict: Callable[[str | None], bool] | None = None

    def fits(self, nbytes: int) -> bool:
        """Whether one buffer holds ``nbytes``; larger groups are stepped in chunks."""
        return nbytes <= self.per_buffer

    def try_acquire(self, nbytes: int, leave: int = 0, owner: str | None = None) -> memoryview | None:
        """A buffer if more than ``leave`` are free and the session ``owner`` may hold
        ``leave`` more beside it, else None; None too while a step waits that a free
        buffer could serve (it comes first). Read-ahead leaves one free, so a step that
        was not read ahead can always proceed (read-ahead buffers are only given back
        when their group steps)."""
        with self._lock:
            if len(self._free) <= leave or not self._within_budget(owner, leave) or self._serviceable_waiter():
                return None
            return self._take(nbytes, owner)

    def acquire_blocking(self, nbytes: int, owner: str | None = None) -> memoryview:
        """A buffer of at least ``nbytes`` for session ``owner``; give it back with
        release(). Waits, behind the steps that came first, for a buffer and for room in
        the session's budget; meanwhile ``evict`` (the state cache's) is asked to give
        one back: only the session's own when its budget is what it waits for."""
        with self._lock:
            if self._free and self._within_budget(owner) and not self._serviceable_waiter():
                return self._take(nbytes, owner)
            waiter = _Waiter(nbytes, owner, self._lock)
            self._waiters.append(waiter)
        try:
            while True:
                with self._lock:
                    if waiter.view is not None or waiter.error is not None:
                        break
                    mine = None if self._within_budget(owner) else owner
                if self.evict is not None and self.evict(mine):
                    continue  # (handed to the first waiter, maybe this one)
                with self._lock:
                    if waiter.view is None and waiter.error is None:
                        waiter.turn.wait(RETRY_EVICT_S)
        except BaseException:
            with self._lock:
                if waiter.view is None:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
                    raise
            self.release(waiter.view)  # served meanwhile: on to the next
            raise
        if waiter.error is not None:
            raise waiter.error
        return waiter.view

    def may_keep(self, view: memoryview, reserve: int) -> bool:
        """Whether a step may keep ``view`` for the state cache: ``reserve`` buffers stay
        free, and no step waits that it would serve (one of the same session, at its
        budget, or any within its budget)."""
        with self._lock:
            owner = self._owners[id(view)][1]
            return len(self._free) >= reserve and not any(
                w.owner == owner or self._within_budget(w.owner) for w in self._waiters)

    def at_budget(self, owner: str | None, leave: int = 0) -> bool:
        """Whether the session's budget, not the pool, keeps it from taking a buffer and
        leaving ``leave`` of its budget."""
        with self._lock:
            return not self._within_budget(owner, leave)

    def spare(self) -> int:
        """Buffers free now."""
        with self._lock:
            return len(self._free)

    @property
    def waiting(self) -> int:
        """Steps waiting for a buffer now."""
        with self._lock:
            return len(self._waiters)

    def held(self) -> dict[str, int]:
        """Buffers each session holds now (for metrics)."""
        with self._lock:
            return dict(self._held)

    @contextmanager
    def acquire(self, nbytes: int, owner: str | None = None) -> Iterator[memoryview]:
        view = self.acquire_blocking(nbytes, owner)
        try:
            yield view
        finally:
            self.release(view)

    def _within_budget(self, owner: str | None, leave: int = 0) -> bool:
        """(lock held) Whether ``owner`` may take a buffer and still have ``leave`` of its budget."""
        return owner is None or not self.session_buffers or self._held.get(owner, 0) + leave < self.session_buffers

    def _serviceable_waiter(self) -> bool:
        """(lock held) Whether a queued step could take a free buffer (ahead of anyone else)."""
        return any(self._within_budget(w.owner) for w in self._waiters)

    def _take(self, nbytes: int, owner: str | None) -> memoryview:
        buf = self._free[-1]
        if buf is None or buf.size < nbytes:
            buf = _Buffer(align_up(nbytes, HUGE))  # grown once to the largest group seen
        self._free.pop()
        self.in_use += 1
        if owner is not None:
            self._held[owner] = self._held.get(owner, 0) + 1
        view = buf.view[:nbytes]
        self._owners[id(view)] = (buf, owner)
        return view

    def _serve(self) -> None:
        """(lock held) Free buffers to the first waiters within their budgets."""
        while self._free:
            waiter = next((w for w in self._waiters if self._within_budget(w.owner)), None)
            if waiter is None:
                return
            self._waiters.remove(waiter)
            try:
                waiter.view = self._take(waiter.nbytes, waiter.owner)
            except BaseException as exc:  # noqa: BLE001 - raised by the waiter, not the releaser
                waiter.error = exc
            waiter.turn.notify()

    def release(self, view: memoryview) -> None:
        with self._lock:
            buf, owner = self._owners.pop(id(view))
            self.in_use -= 1
            if owner is not None:
                left = self._held[owner] - 1
                if left:
                    self._held[owner] = left
                else:
                    del self._held[owner]
            self._free.append(buf)
            self._serve()

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(b.size for b in self._free if b is not None) + sum(b.size for b, _ in self._owners.values())

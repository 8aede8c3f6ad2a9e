"""Turns shared fairly between tenants: at most ``slots`` holders at once, and when
tenants wait, each is served in turn.

Tenants (owners: a namespace, which one live session holds) that share the daemon share
two things no budget divides: the SSD array's bandwidth and the optimizer's CPU. A
plain lock or queue serves whoever asks most often: a tenant with four transfers in
flight got four times the array of one with one. Here a holder that lets go hands its
slot to the next owner in a round (the owners with waiters, in the order they began
waiting; one turn each per round, FIFO within an owner), so while several tenants want
more than there is, each holds an equal share of the slots, whatever its number of
requests; a tenant alone takes every slot, as before.

Users: the transfer layer (storage/transfer.py: windows of an engine batch on the
array) and the optimizer (its compute: one kernel at a time).
"""
from __future__ import annotations

import threading
from collections import Counter, deque
from contextlib import contextmanager
from typing import Hashable, Iterator


class FairTurns:
    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._lock = threading.Lock()
        self._busy = 0
        self._waiting: dict[Hashable, deque[threading.Event]] = {}
        self._round: deque[Hashable] = deque()  # owners with waiters, next first
        self.granted: Counter = Counter()  # turns served per owner (for tests and metrics)

    @contextmanager
    def turn(self, owner: Hashable) -> Iterator[None]:
        self.acquire(owner)
        try:
            yield
        finally:
            self.release()

    def acquire(self, owner: Hashable) -> None:
        with self._lock:
            if self._busy < self.slots and not self._round:
                self._busy += 1
                self.granted[owner] += 1
                return
            event = threading.Event()
            queue = self._waiting.get(owner)
            if queue is None:
                queue = self._waiting[owner] = deque()
                self._round.append(owner)
            queue.append(event)
        event.wait()

    def release(self) -> None:
        with self._lock:
            if not self._round:
                self._busy -= 1
                return
            owner = self._round.popleft()
            queue = self._waiting[owner]
            event = queue.popleft()
            if queue:
                self._round.append(owner)  # (its next turn after every other owner's)
            else:
                del self._waiting[owner]
            self.granted[owner] += 1
        event.set()  # (the slot goes straight to it: nobody takes it in between)

    def waiting(self) -> dict[Hashable, int]:
        with self._lock:
            return {o: len(q) for o, q in self._waiting.items()}

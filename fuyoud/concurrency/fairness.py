"""Turns shared fairly between tenants: at most ``slots`` holders at once, and when
tenants wait, each is served in turn.

Tenants that share the daemon share two things no budget divides: the SSD array's
bandwidth and the optimizer's CPU. A plain lock or queue serves whoever asks most often:
a tenant with four transfers in flight got four times the array of one with one. Here a
holder that lets go hands its slot to the next in a round of two levels: the users with
waiters (in the order they began waiting; one turn each per round), and within a user
its training jobs with waiters (likewise); FIFO within a job. So while several users
want more than there is, each holds an equal share of the slots whatever its number of
requests, sessions or jobs, and a user's share is divided equally between its jobs; a
tenant alone takes every slot, as before.

Callers name the owner of a turn as they know it (a namespace); ``tenant`` maps it to
(user, job) (the daemon's: the uid of the session holding that namespace and the job of
a data-parallel rank's ``<job>.r<rank>``, fuyoud/sessions/user_limits.py). Without one,
each owner is a user of its own.

Users: the transfer layer (storage/transfer.py: windows of an engine batch on the
array) and the optimizer (its compute: one kernel at a time).
"""
from __future__ import annotations

import threading
from collections import Counter, deque
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator

Tenant = Callable[[Hashable], tuple[Hashable, Hashable]]  # owner -> (user, job)


class FairTurns:
    def __init__(self, slots: int, tenant: Tenant | None = None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.tenant: Tenant = tenant or (lambda owner: (owner, owner))
        self._lock = threading.Lock()
        self._busy = 0
        self._waiting: dict[tuple, deque[tuple[Hashable, threading.Event]]] = {}  # (user, job) -> FIFO
        self._users: deque[Hashable] = deque()  # users with waiters, next first
        self._jobs: dict[Hashable, deque[Hashable]] = {}  # a waiting user's jobs with waiters, next first
        self.granted: Counter = Counter()  # turns served per owner (for tests and metrics)

    @contextmanager
    def turn(self, owner: Hashable) -> Iterator[None]:
        self.acquire(owner)
        try:
            yield
        finally:
            self.release()

    def acquire(self, owner: Hashable) -> None:
        key = self.tenant(owner)  # (outside the lock: the daemon's looks its sessions up)
        with self._lock:
            if self._busy < self.slots and not self._users:
                self._busy += 1
                self.granted[owner] += 1
                return
            event = threading.Event()
            queue = self._waiting.get(key)
            if queue is None:
                queue = self._waiting[key] = deque()
                user, job = key
                jobs = self._jobs.get(user)
                if jobs is None:
                    jobs = self._jobs[user] = deque()
                    self._users.append(user)
                jobs.append(job)
            queue.append((owner, event))
        event.wait()

    def release(self) -> None:
        with self._lock:
            if not self._users:
                self._busy -= 1
                return
            user = self._users.popleft()
            jobs = self._jobs[user]
            job = jobs.popleft()
            queue = self._waiting[(user, job)]
            owner, event = queue.popleft()
            if queue:
                jobs.append(job)  # (its next turn after the user's other jobs')
            else:
                del self._waiting[(user, job)]
            if jobs:
                self._users.append(user)  # (its next turn after every other user's)
            else:
                del self._jobs[user]
            self.granted[owner] += 1
        event.set()  # (the slot goes straight to it: nobody takes it in between)

    def waiting(self) -> dict[Hashable, int]:
        """Waiters per owner."""
        with self._lock:
            return dict(Counter(owner for queue in self._waiting.values() for owner, _ in queue))

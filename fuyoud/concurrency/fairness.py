"""Turns shared fairly between tenants: at most ``slots`` holders at once, and when
tenants wait, each is served in turn.

Tenants that share the daemon share two things no budget divides: the SSD array's
bandwidth and the optimizer's CPU. A plain lock or queue serves whoever asks most often:
a tenant with four transfers in flight got four times the array of one with one. Here a
holder that lets go hands its slot on in a round of two levels: to the waiting user
served longest ago, and within it to its waiting job served longest ago; FIFO within a
job. So while several users want more than there is, each holds an equal share of the
slots whatever its number of requests, sessions or jobs, and a user's share is divided
equally between its jobs; a tenant alone takes every slot, as before.

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
        self._jobs: dict[Hashable, dict[Hashable, None]] = {}  # waiting users -> their jobs with waiters
        # When each user and each (user, job) was last served (a count of turns): the next turn
        # goes to the waiting user served longest ago, then its job served longest ago, so an
        # owner with one request in flight, back in the queue after its turn, is not put behind
        # one that never left it.
        self._user_served: dict[Hashable, int] = {}
        self._job_served: dict[tuple, int] = {}
        self._turns = 0
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
            if self._busy < self.slots and not self._jobs:
                self._busy += 1
                self._serve(owner, key)
                return
            event = threading.Event()
            queue = self._waiting.get(key)
            if queue is None:
                queue = self._waiting[key] = deque()
                self._jobs.setdefault(key[0], {})[key[1]] = None
            queue.append((owner, event))
        event.wait()

    def release(self) -> None:
        with self._lock:
            if not self._jobs:
                self._busy -= 1
                return
            user = min(self._jobs, key=lambda u: self._user_served.get(u, -1))
            jobs = self._jobs[user]
            job = min(jobs, key=lambda j: self._job_served.get((user, j), -1))
            queue = self._waiting[(user, job)]
            owner, event = queue.popleft()
            if not queue:
                del self._waiting[(user, job)], jobs[job]
                if not jobs:
                    del self._jobs[user]
            self._serve(owner, (user, job))
        event.set()  # (the slot goes straight to it: nobody takes it in between)

    def _serve(self, owner: Hashable, key: tuple) -> None:  # (the lock held)
        self._turns += 1
        self._user_served[key[0]] = self._job_served[key] = self._turns
        self.granted[owner] += 1
        for served, waiting in ((self._user_served, self._jobs), (self._job_served, self._waiting)):
            if len(served) > 64 + 4 * len(waiting):  # (who left before every waiter was served is forgotten:
                oldest = min((served.get(k, -1) for k in waiting), default=self._turns)  # it would go first anyway)
                for k in [k for k, t in served.items() if t < oldest and k not in waiting]:
                    del served[k]

    def waiting(self) -> dict[Hashable, int]:
        """Waiters per owner."""
        with self._lock:
            return dict(Counter(owner for queue in self._waiting.values() for owner, _ in queue))

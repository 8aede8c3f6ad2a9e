"""A fixed number of threads running jobs handed to them, in the order handed.

For work that may block (a session's reclaim waits for its in-flight requests) and must
not block the thread that hands it over (the session socket's one event loop): the
threads are started once, through the owner's ``Threads`` (so its ``join`` waits for
them), and never more, whatever the number of jobs; jobs wait in a queue. ``close``
lets the threads finish the jobs queued and end; a job handed after it is refused.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from fuyoud.concurrency.threads import Threads

log = logging.getLogger(__name__)


class Workers:
    def __init__(self, threads: Threads, count: int, name: str):
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self._threads = threads
        self.count = count
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._closed = False

    def start(self) -> None:
        """Start the threads (once)."""
        with self._lock:
            todo, self._started = self.count - self._started, self.count
        for _ in range(todo):
            self._threads.start(self._run, name=self.name)

    def submit(self, job: Callable, *args) -> None:
        """Run ``job(*args)`` on one of the threads (an exception it raises is logged)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed")
            self._jobs.put((job, args))

    def close(self) -> None:
        """No more jobs; the threads end once the queued ones are done."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in range(self._started):
                self._jobs.put(None)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, args = item
            try:
                job(*args)
            except Exception:  # noqa: BLE001 - one job's failure must not end the thread
                log.exception("%s: a job failed", self.name)

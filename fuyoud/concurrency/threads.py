"""Threads a part of the daemon starts, kept so that its owner can join them.

Every thread the daemon starts outside gRPC's own pool (the session socket's event loop
and its workers, the optimizer's read-aheads, housekeeping and the reaper) is started through a
``Threads`` of the part that owns it, and that part's ``close``/``join`` waits for them:
the daemon stops them all before it closes the store and the I/O engine, so no thread
reads or writes a data file's descriptor after it was closed (or reused for another
file). Once joined, a ``Threads`` starts nothing more (``start`` returns None).

Each thread the daemon starts, its thread pools' too (``named``), carries its name in the
kernel as well (``/proc/<pid>/task/*/comm``: what ``top -H``, ``ps -T`` and a count of the
daemon's threads by kind show), cut to the kernel's 15 characters.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel too (Linux; elsewhere nothing)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def named(prefix: str) -> dict:
    """The keywords that make a ThreadPoolExecutor's threads named ``prefix`` in Python and
    in the kernel."""
    return {"thread_name_prefix": prefix, "initializer": name_os_thread, "initargs": (prefix,)}


class Threads:
    def __init__(self, owner: str):
        self.owner = owner
        self._lock = threading.Lock()
        self._live: set[threading.Thread] = set()
        self._closed = False

    def start(self, target: Callable, *args, name: str) -> threading.Thread | None:
        """Start ``target(*args)`` on a new thread; None (nothing started) once joined."""
        def run() -> None:
            name_os_thread(name)
            try:
                target(*args)
            finally:
                with self._lock:
                    self._live.discard(thread)

        with self._lock:
            if self._closed:
                return None
            thread = threading.Thread(target=run, name=name, daemon=True)
            self._live.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._live.discard(thread)
            raise
        return thread

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._live)

    def join(self, timeout: float) -> list[str]:
        """Start nothing more and wait up to ``timeout`` seconds for every thread started;
        returns the names of those still running (logged)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
        while True:
            with self._lock:
                live = [t for t in self._live if t is not threading.current_thread()]
            if not live:
                return []
            left = deadline - time.monotonic()
            if left <= 0:
                names = sorted(t.name for t in live)
                log.error("%s: %d thread(s) still running after %.0f s: %s", self.owner, len(names), timeout,
                          ", ".join(names))
                return names
            live[0].join(left)

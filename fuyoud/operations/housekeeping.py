"""The daemon's once-a-second chores, on one thread: sample SSD throughput (for
`fuyouctl status`), run the systemd watchdog and persist the lifetime byte counters
every minute; and, on a thread of its own (the reaper), reap sessions whose process is
gone (every REAP_EVERY seconds: sessions/registry.py ``reap``).

The reaper has its own thread because a reap closes sessions, and a session's close
waits for what it still runs (a dead client's optimizer step in flight): the watchdog's
pings, which vouch for the serving path only, must not wait for that, or systemd would
kill a healthy daemon (WatchdogSec=). A reaper that hangs stops reaping and nothing else;
``stop`` reports it by name."""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from fuyoud.concurrency.threads import Threads
from fuyoud.operations.watchdog import Watchdog
from fuyoud.storage.store import Store

log = logging.getLogger(__name__)
TICK = 1.0
SAVE_EVERY = 60.0
REAP_EVERY = 2.0


class RateMeter:
    """Bytes per second over a sliding window of (time, counter) samples."""

    def __init__(self, window: float = 5.0):
        self.window = window
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque()
        self._lock = threading.Lock()

    def sample(self, now: float, read: int, written: int) -> None:
        with self._lock:
            self._samples.append((now, read, written))
            while len(self._samples) > 2 and now - self._samples[0][0] > self.window:
                self._samples.popleft()

    def rates(self) -> tuple[float, float]:
        with self._lock:
            if len(self._samples) < 2:
                return 0.0, 0.0
            (t0, r0, w0), (t1, r1, w1) = self._samples[0], self._samples[-1]
        dt = max(t1 - t0, 1e-9)
        return (r1 - r0) / dt, (w1 - w0) / dt


class Housekeeping:
    def __init__(self, store: Store, watchdog: Watchdog | None, reap: Callable[[], object] | None = None):
        self.store = store
        self.watchdog = watchdog
        self.reap = reap
        self.throughput = RateMeter()
        self._stop = threading.Event()
        self._threads = Threads("housekeeping")
        self._last_save = time.monotonic()

    def start(self) -> None:
        self._threads.start(self._run, name="housekeeping")
        if self.reap is not None:
            self._threads.start(self._reap_loop, name="reaper")

    def _run(self) -> None:
        period = min(TICK, self.watchdog.interval) if self.watchdog is not None else TICK
        while not self._stop.wait(period):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - chores must not kill the thread
                log.exception("housekeeping failed")

    def tick(self) -> None:
        now = time.monotonic()
        usage = self.store.usage()
        self.throughput.sample(now, usage.bytes_read, usage.bytes_written)
        if self.watchdog is not None:
            self.watchdog.tick(now)
        if now - self._last_save >= SAVE_EVERY:
            self._last_save = now
            self.store.save_lifetime()

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_EVERY):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - a failed reap must not end the reaper
                log.exception("reaping sessions failed")

    def stop(self, timeout: float = 60.0) -> list[str]:
        """End the chores and join their threads; returns the names of those still running
        after ``timeout`` seconds (a chore that hangs: a reap blocked in a session's close)."""
        self._stop.set()
        left = self._threads.join(timeout)
        if self.watchdog is not None:
            self.watchdog.close()
        return left

"""The daemon's once-a-second chores, on one thread: sample SSD throughput (for
`fuyouctl status`), run the systemd watchdog, reap sessions whose process is gone
(every REAP_EVERY seconds: sessions/registry.py ``reap``) and persist the lifetime byte counters
every minute."""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

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
        self._last_reap = time.monotonic()
        self.throughput = RateMeter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="housekeeping", daemon=True)
        self._last_save = time.monotonic()

    def start(self) -> None:
        self._thread.start()

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
        if self.reap is not None and now - self._last_reap >= REAP_EVERY:
            self._last_reap = now
            self.reap()
        if now - self._last_save >= SAVE_EVERY:
            self._last_save = now
            self.store.save_lifetime()

    def stop(self, timeout: float = 60.0) -> list[str]:
        """End the chores and join their thread; returns its name if it is still running
        after ``timeout`` seconds (a chore that hangs)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.watchdog is not None:
            self.watchdog.close()
        return [self._thread.name] if self._thread.is_alive() else []

"""One thread serving many descriptors: a ``selectors`` loop with timers and jobs posted
from other threads.

The thread that owns an ``EventLoop`` calls ``run_once`` over and over: it waits until a
watched descriptor is readable, a timer is due or another thread posted a job, and runs
their callbacks, on that thread, one at a time. Everything but ``post`` and ``wake`` is
for the owning thread only. A callback must not block (that is what the loop is for: a
part that must wait hands the work to ``Workers`` and posts the outcome back), and one
that raises is logged and the loop goes on.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import selectors
import time
from typing import Callable

log = logging.getLogger(__name__)


class Timer:
    """A callback due at a time (monotonic seconds); ``cancel`` before it is due and it
    never runs."""
    __slots__ = ("when", "callback", "args", "cancelled")

    def __init__(self, when: float, callback: Callable, args: tuple):
        self.when, self.callback, self.args = when, callback, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    def __init__(self):
        self._selector = selectors.DefaultSelector()
        try:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            self._selector.close()
            raise
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._posted: collections.deque = collections.deque()
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._compact_at = 64
        self._closed = False

    # -- the owning thread's ---------------------------------------------------------------
    def watch(self, fileobj, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever ``fileobj`` is readable (until ``unwatch``)."""
        self._selector.register(fileobj, selectors.EVENT_READ, callback)

    def unwatch(self, fileobj) -> None:
        """Stop watching ``fileobj`` (nothing happens if it was not watched)."""
        try:
            self._selector.unregister(fileobj)
        except (KeyError, ValueError):
            pass

    def call_at(self, when: float, callback: Callable, *args) -> Timer:
        """Call ``callback(*args)`` once ``time.monotonic()`` reaches ``when``."""
        timer = Timer(when, callback, args)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        if len(self._timers) >= self._compact_at:
            # (forget the cancelled ones, lest many short-lived timers pile up; amortized O(1))
            self._timers = [e for e in self._timers if not e[2].cancelled]
            heapq.heapify(self._timers)
            self._compact_at = 2 * len(self._timers) + 64
        return timer

    def run_once(self) -> None:
        """Wait for something to do, and do it."""
        timeout = None
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        if self._posted:
            timeout = 0.0
        elif self._timers:
            timeout = max(self._timers[0][0] - time.monotonic(), 0.0)
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                self._drain_wake()
            else:
                self._run(key.data)
        while self._posted:
            callback, args = self._posted.popleft()
            self._run(callback, *args)
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.cancelled = True  # (run: cancelling it later does nothing)
                self._run(timer.callback, *timer.args)

    @staticmethod
    def _run(callback: Callable, *args) -> None:
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - one callback's failure must not end the loop
            log.exception("event loop: a callback failed")

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Release the selector and the wake pipe (once no thread posts any more)."""
        if self._closed:
            return
        self._closed = True
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    # -- any thread's --------------------------------------------------------------------
    def post(self, callback: Callable, *args) -> None:
        """Have the loop's thread call ``callback(*args)`` soon."""
        self._posted.append((callback, args))
        self.wake()

    def wake(self) -> None:
        """End the loop's wait now (it then looks at what changed)."""
        if self._closed:  # (its descriptor may be another file's now)
            return
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # (full: the loop wakes all the same)

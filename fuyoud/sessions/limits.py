"""How many session-socket connections the daemon holds: at most MAX_CONNECTIONS in all
and MAX_CONNECTIONS_PER_UID of one uid (read with SO_PEERCRED at accept). A connection
beyond either is refused, told which limit it met (``refusal``, ``Refusals``), and
counted by that limit (TOTAL or PER_UID: a bounded label). The limits are constants; an
environment variable of the same name prefixed ``FUYOUD_`` sets one, read at start
(tests, or an operator's unit file); the per-uid default leaves room for any
data-parallel job.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import socket
import threading
import time

from fuyoud.concurrency.loop import EventLoop, Timer


def env_number(name: str, default, kind=float):
    """A limit from the environment: a positive number, else the start fails."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if not value > 0:
        raise ValueError(f"{name}={raw[:32]!r}: want a positive {'integer' if kind is int else 'number'}")
    return value


MAX_CONNECTIONS = env_number("FUYOUD_MAX_CONNECTIONS", 4096, int)  # connections held at once, all users
MAX_CONNECTIONS_PER_UID = env_number("FUYOUD_MAX_CONNECTIONS_PER_UID", 1024, int)  # ... one user's
# The limit a refused connection met: the label of fuyoud_session_connections_refused_total.
TOTAL, PER_UID = "total", "per_uid"
LIMITS = (TOTAL, PER_UID)


class ConnectionLimits:
    """The connections held, all and by uid (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._total = 0
        self._by_uid: collections.Counter = collections.Counter()

    def take(self, uid: int) -> str | None:
        """Count a new connection of ``uid``, or return the limit it would pass (then it is
        not counted)."""
        with self._lock:
            if self._total >= MAX_CONNECTIONS:
                return TOTAL
            if self._by_uid[uid] >= MAX_CONNECTIONS_PER_UID:
                return PER_UID
            self._total += 1
            self._by_uid[uid] += 1
            return None

    def give_back(self, uid: int) -> None:
        """A connection ``take`` counted has ended."""
        with self._lock:
            self._total -= 1
            self._by_uid[uid] -= 1
            if not self._by_uid[uid]:
                del self._by_uid[uid]

    @property
    def held(self) -> int:
        with self._lock:
            return self._total

    @staticmethod
    def refusal(limit: str, uid: int) -> str:
        """What a connection refused at ``limit`` is told."""
        if limit == TOTAL:
            return (f"fuyoud holds {MAX_CONNECTIONS} session-socket connections already, the most it serves at once "
                    "(FUYOUD_MAX_CONNECTIONS); try again once clients have ended")
        return (f"uid {uid} holds {MAX_CONNECTIONS_PER_UID} session-socket connections already, the most one user "
                "may (FUYOUD_MAX_CONNECTIONS_PER_UID): end idle clients (each fuyou_client session holds one) and try "
                "again")


class Refusals:
    """Connections refused, told why: each is kept until what its client sent first (its
    hello) arrives, then closed (closed at once, the client's send of its hello could
    fail before it read why), LINGER seconds at most, and at most KEPT at once (beyond,
    closed at once). Runs on the event loop's thread."""
    LINGER = 2.0
    KEPT = 64

    def __init__(self, events: EventLoop):
        self._events = events
        self._kept: dict[socket.socket, Timer] = {}

    def refuse(self, sock: socket.socket, message: str) -> None:
        """Send {"error": {"code": "RESOURCE_EXHAUSTED", "message": ...}} and hang up soon."""
        try:
            sock.send(json.dumps({"error": {"code": "RESOURCE_EXHAUSTED", "message": message}}).encode(),
                      socket.MSG_DONTWAIT)
        except OSError:
            sock.close()
            return
        if len(self._kept) >= self.KEPT:
            self._hang_up(sock)
            return
        self._kept[sock] = self._events.call_at(time.monotonic() + self.LINGER, self._hang_up, sock)
        self._events.watch(sock, functools.partial(self._hang_up, sock))

    def _hang_up(self, sock: socket.socket) -> None:
        timer = self._kept.pop(sock, None)
        if timer is not None:
            timer.cancel()
            self._events.unwatch(sock)
        try:
            while sock.recv(4096, socket.MSG_DONTWAIT):  # (read: closed unread, the client's reads fail)
                pass
        except OSError:
            pass
        sock.close()

    def close(self) -> None:
        for sock in list(self._kept):
            self._hang_up(sock)

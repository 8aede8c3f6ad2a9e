"""systemd's watchdog (WatchdogSec= in the unit).

systemd sets WATCHDOG_USEC (and WATCHDOG_PID) and restarts the service if it hears no
"WATCHDOG=1" within that time. A timer thread that pings unconditionally would keep a
wedged daemon alive, so each ping follows a probe of the serving path itself: a
grpc.health.v1 check through the control socket (it needs a free gRPC worker, so a
daemon whose workers are all stuck fails it), the session listener thread, and a read
of the index. A failed probe sends no ping and is logged; systemd then restarts us.
The pings run on the housekeeping thread and wait for nothing a client started: the
reaper (whose closes wait for a dead client's requests) has a thread of its own
(operations/housekeeping.py), and so do the session socket's closes (sessions/listener.py).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fuyoud.operations.sdnotify import notify

log = logging.getLogger(__name__)


def interval_from_env() -> float | None:
    """Seconds between pings (half of WATCHDOG_USEC, as sd_watchdog_enabled advises), or
    None when systemd asked for no watchdog or asked another process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None
    return value / 2e6 if value > 0 else None


class Watchdog:
    def __init__(self, control_socket: str, interval: float, checks: Callable[[], None]):
        self.interval = interval
        self._checks = checks
        self._channel = grpc.insecure_channel(f"unix:{control_socket}")
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._next = 0.0
        self.failing = False

    def probe(self) -> None:
        """Raises when the daemon is not serving."""
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=max(self.interval / 2, 0.2))
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
        self._checks()

    def tick(self, now: float | None = None) -> bool:
        """Probe and ping if a ping is due; True when one was sent."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return False
        self._next = now + self.interval
        try:
            self.probe()
        except Exception as exc:  # noqa: BLE001 - any failure means: do not vouch for the daemon
            if not self.failing:
                log.error("watchdog: the daemon is not serving (%s); withholding WATCHDOG=1", exc)
            self.failing = True
            return False
        if self.failing:
            log.warning("watchdog: serving again")
        self.failing = False
        return notify("WATCHDOG=1")

    def close(self) -> None:
        self._channel.close()

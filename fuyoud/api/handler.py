"""What every RPC method shares: the wrapper (admission, failpoint, timing, counting,
error translation), the servicer base that authenticates sessions, and ``Services``: the
parts of the daemon the RPC methods work on, handed over by server.py.

Admission (``Admission``): every request enters through it and is counted while it runs.
When the daemon stops, it closes: a request that arrives from then on is refused at
once with UNAVAILABLE ("fuyoud is shutting down", which the client raises as
DaemonUnavailable with how to resume), while those already running finish; the daemon
waits for them (``wait_idle``) before it ends the sessions and closes the store."""
from __future__ import annotations

import functools
import hmac
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import grpc

from fuyoud import failpoints
from fuyou_proto import ADMIN_METADATA_KEY, SESSION_METADATA_KEY
from fuyoud.errors import FuyouError, PermissionDenied, Unavailable
from fuyoud.sessions.registry import Session, SessionRegistry

if TYPE_CHECKING:
    from fuyoud.checkpoints.checkpointer import Checkpointer
    from fuyoud.memory.pool import Pool
    from fuyoud.operations.metrics import Metrics
    from fuyoud.optimizer.groups import Optimizer
    from fuyoud.operations.snapshot import Snapshot
    from fuyoud.storage.store import Store

log = logging.getLogger("fuyoud.service")
# gRPC sends a status message in the trailers, whose size is limited (8 KiB by default): a
# longer one is dropped and the client sees RESOURCE_EXHAUSTED "Stream removed" instead.
MAX_MESSAGE = 2048


def status_message(exc: Exception) -> str:
    """An error's message, cut to fit a gRPC status (values are echoed shortened already)."""
    text = str(exc)
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 20] + "... (message cut)"


SHUTTING_DOWN = ("fuyoud is shutting down (systemctl stop, SIGTERM): this request was refused before it started. "
                 "Everything committed is safe on the SSD array: once fuyoud runs again, continue with "
                 "attach(model, resume=DIR) from your last engine.save_checkpoint(DIR)")


class Admission:
    """The requests running now, and whether new ones are let in (see the module's doc)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._running: dict[int, str] = {}  # thread id -> method
        self._open = True

    def enter(self, method: str) -> None:
        with self._cond:
            if not self._open:
                raise Unavailable(SHUTTING_DOWN)
            self._running[threading.get_ident()] = method

    def leave(self) -> None:
        with self._cond:
            self._running.pop(threading.get_ident(), None)
            if not self._running:
                self._cond.notify_all()

    def close(self) -> None:
        """Let no new request in (those running go on)."""
        with self._cond:
            self._open = False

    def running(self) -> list[str]:
        with self._cond:
            return sorted(self._running.values())

    def wait_idle(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds for the running requests; returns the methods of
        those still running."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._running and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return sorted(self._running.values())


def handler(method):
    """Admit, failpoint, time, count and translate errors for one RPC method."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, request, context: grpc.ServicerContext):
        t0 = time.perf_counter()
        metrics = self.metrics
        admitted = False
        try:
            self.admission.enter(name)
            admitted = True
            failpoints.hit(f"rpc.{name}")
            return method(self, request, context)
        except FuyouError as exc:
            metrics.errors.labels(exc.kind).inc()
            context.abort(exc.code, status_message(exc))
        except Exception:
            metrics.errors.labels("internal").inc()
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the fuyoud log")
        finally:
            if admitted:
                self.admission.leave()
            metrics.requests.labels(name).inc()
            metrics.request_seconds.labels(name).observe(time.perf_counter() - t0)

    return wrapper


@dataclass(frozen=True)
class AdminAuth:
    """The operator's token (written to ``path``, readable by the daemon's user only)."""
    token: str
    path: Path

    def allows(self, context: grpc.ServicerContext) -> bool:
        given = dict(context.invocation_metadata()).get(ADMIN_METADATA_KEY)
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())


@dataclass(frozen=True)
class Services:
    """What the RPC methods work on."""
    store: "Store"
    pool: "Pool"
    optimizer: "Optimizer"
    sessions: SessionRegistry
    metrics: "Metrics"
    checkpointer: "Checkpointer"
    admin: AdminAuth
    snapshot: Callable[[], "Snapshot"]  # Status's reading of the daemon
    set_draining: Callable[[bool], None]
    admission: Admission


class ServicerBase:
    def __init__(self, services: Services):
        self.store, self.pool, self.optimizer = services.store, services.pool, services.optimizer
        self.sessions, self.metrics, self.checkpointer = services.sessions, services.metrics, services.checkpointer
        self.admin, self.snapshot, self.set_draining = services.admin, services.snapshot, services.set_draining
        self.admission = services.admission

    def _is_admin(self, context: grpc.ServicerContext) -> bool:
        return self.admin.allows(context)

    def _require_admin(self, context: grpc.ServicerContext, what: str) -> None:
        if not self._is_admin(context):
            raise PermissionDenied(
                f"{what} needs the admin token ({self.admin.path}, readable by the daemon's user): "
                "run fuyouctl as root or as that user")

    def _session(self, context: grpc.ServicerContext) -> Session:
        """The caller's session, from the x-fuyou-session metadata (UNAUTHENTICATED if none)."""
        token = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY)
        return self.sessions.authenticate(token)

"""What every RPC method shares: the wrapper (failpoint, timing, counting, error
translation) and the servicer base that authenticates sessions."""
from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

import grpc

from fuyoud import failpoints
from fuyou_proto import SESSION_METADATA_KEY
from fuyoud.errors import FuyouError
from fuyoud.sessions import Session

if TYPE_CHECKING:
    from fuyoud.server import Daemon

log = logging.getLogger("fuyoud.service")
# gRPC sends a status message in the trailers, whose size is limited (8 KiB by default): a
# longer one is dropped and the client sees RESOURCE_EXHAUSTED "Stream removed" instead.
MAX_MESSAGE = 2048


def status_message(exc: Exception) -> str:
    """An error's message, cut to fit a gRPC status (values are echoed shortened already)."""
    text = str(exc)
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 20] + "... (message cut)"


def handler(method):
    """Failpoint, time, count and translate errors for one RPC method."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, request, context: grpc.ServicerContext):
        t0 = time.perf_counter()
        metrics = self.daemon.metrics
        try:
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
            metrics.requests.labels(name).inc()
            metrics.request_seconds.labels(name).observe(time.perf_counter() - t0)

    return wrapper


class ServicerBase:
    def __init__(self, daemon: "Daemon"):
        self.daemon = daemon

    def _session(self, context: grpc.ServicerContext) -> Session:
        """The caller's session, from the x-fuyou-session metadata (UNAUTHENTICATED if none)."""
        token = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY)
        return self.daemon.sessions.authenticate(token)

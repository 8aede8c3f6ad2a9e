"""The daemon: assembles memory, storage, I/O, sessions, gRPC and metrics, and stops
them in the right order.

Construction (each part gets only the parts it uses, built before it): metrics, the
I/O engine, staging; the store (a full disk or a locked directory stops us before
anything listens), then the recovery of checkpoints a crash interrupted (it needs only
the store), the optimizer on the store, the session registry, the pinned memory (its
refusals name sessions as the registry describes them), the checkpointer. Start-up:
the admin token, the control socket (the RPC services), the session socket, metrics,
the housekeeping thread (throughput, watchdog, the reaper) and READY=1.
Shutdown (SIGTERM): STOPPING=1, refuse new sessions and new requests (UNAVAILABLE,
"fuyoud is shutting down": the client's DaemonUnavailable) while the sessions stay,
let the requests running finish within the grace period, stop gRPC, end every session,
join every thread the daemon started (the session socket's, the optimizer's
read-aheads, housekeeping), and only then sync and close the data files, the index and
the I/O engine. Each step runs even when an earlier one failed; a stop with failures
raises StopFailed naming them, once everything it could release is released (``wait``
returns either way). A start that fails part-way releases what it took (data files and
their locks, the index, the engine) before the error propagates.
"""
from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fuyou_proto import rpc
from fuyoud import __version__, failpoints
from fuyoud.api.admin import FuyouAdminServicer
from fuyoud.api.handler import Admission, AdminAuth, Services
from fuyoud.api.malformed import MalformedRequests
from fuyoud.api.service import FuyouServicer
from fuyoud.checkpoints.checkpointer import Checkpointer, recover
from fuyoud.concurrency.threads import Threads, named
from fuyoud.config import Config
from fuyoud.errors import FailedPrecondition, InvalidArgument
from fuyoud.io.engine import IOEngine
from fuyoud.io.select import choose_engine
from fuyoud.memory.hugepages import HugePagePolicy
from fuyoud.memory.pool import Pool
from fuyoud.memory.staging import StagingPool
from fuyoud.operations.housekeeping import Housekeeping
from fuyoud.operations.metrics import Metrics
from fuyoud.operations.sdnotify import notify
from fuyoud.operations.snapshot import Snapshot
from fuyoud.operations.watchdog import Watchdog, interval_from_env
from fuyoud.optimizer.buffers import StateBuffers
from fuyoud.optimizer.groups import Optimizer
from fuyoud.sessions import namespaces, peers
from fuyoud.sessions.limits import LIMITS
from fuyoud.sessions.listener import SessionListener
from fuyoud.sessions.registry import REASONS, Session, SessionRegistry
from fuyoud.sessions.user_limits import LIMITS as USER_LIMITS
from fuyoud.sessions.user_limits import UserLimits, tenant
from fuyoud.storage.device import Device
from fuyoud.storage.index import IndexDB
from fuyoud.storage.store import Store
from fuyoud.units import format_size

log = logging.getLogger("fuyoud")
SERVICE_NAME = "fuyou.v1.Fuyou"



# The steps of giving back what a closing session held (``Daemon._session_closed``): the
# label of fuyoud_session_close_errors_total (bounded), and what each does for the log.
CLOSE_STEPS = {"checkpoints": "removing the checkpoints it never committed",
               "optimizer": "forgetting its optimizer groups", "namespace": "deleting its unnamed namespace's state",
               "transient": "dropping its transient objects", "pool": "releasing its pinned memory"}


class StartFailed(RuntimeError):
    """The daemon could not start (the message says why)."""


class StopFailed(RuntimeError):
    """The daemon stopped, but a step of its shutdown failed (the message names each)."""


def _quietly(what: str, fn) -> None:
    """Undo one step of a start that failed: an error here is logged, never raised over
    the start's own."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        log.warning("while giving back what the failed start took: %s failed: %s", what, exc)


def _refuse_if_served(path: Path, kind: int) -> None:
    """A socket at ``path`` that answers belongs to a running fuyoud (one whose
    runtime_dir is this one's): taking it over would cut its clients off. A socket that
    does not answer is a dead daemon's, replaced as before."""
    if not path.is_socket():
        return
    probe = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(2.0)
        probe.connect(str(path))
    except OSError:
        return
    finally:
        probe.close()
    raise FailedPrecondition(f"another fuyoud is serving on {path}: stop it, or give this daemon another "
                             "[daemon] runtime_dir")

class Daemon:
    def __init__(self, config: Config, engine: IOEngine | None = None, store_outlives: bool = True):
        """``store_outlives``: False where the store is deleted when the daemon stops
        (``--remove-when-stopped``): Status says so, and "auto" checkpoints are copies."""
        self.config = config
        self.store_outlives = store_outlives
        self.owns_runtime_dir = False
        self.metrics = Metrics()
        self.metrics_url = ""
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self.admission = Admission()
        self.user_limits = UserLimits.from_config(config, lambda limit: self.metrics.user_limit_refusals.labels(limit).inc())
        with ExitStack() as undo:  # (a failure below gives back what was taken, in reverse order)
            self.engine, self.engine_reason = (engine, "given") if engine is not None else choose_engine(config.io)
            undo.callback(_quietly, "closing the I/O engine", self.engine.close)
            self.staging = StagingPool(config.memory.staging_size, config.io.chunk_size + 2 * 4096)
            self.huge_pages = HugePagePolicy(config.memory.huge_pages)
            self.store = self._open_store()
            undo.callback(_quietly, "closing the store", self.store.close)
            recover(self.store)
            namespaces.reclaim_left_behind(self.store)
            failpoints.hit("daemon.init")
            buffers = StateBuffers(config.optimizer.buffers, config.optimizer.buffer_budget,
                                   config.optimizer.session_buffers)
            self.optimizer = Optimizer(self.store, buffers, config.optimizer.state_cache, Threads("optimizer"),
                                       tenant=self._tenant)
            self.sessions = SessionRegistry(self._session_closed, self.store.index_db.namespace_owner,
                                            self.store.index_db.claim_namespace, config.daemon.admits,
                                            self.user_limits)
            self.pool = Pool(config.memory.pinned_budget, config.session_budget, config.memory.segment_size,
                             lock=config.memory.lock, pages=self.huge_pages.choose, describe=self.sessions.describe,
                             limits=self.user_limits)
            self.checkpointer = Checkpointer(self.store, self.optimizer, self.sessions, config.checkpoint_dirs,
                                             store_outlives)
            undo.pop_all()
        for reason in REASONS:  # (every reason exported from the start, at 0)
            self.metrics.sessions_closed.labels(reason)
        for name in CLOSE_STEPS:
            self.metrics.session_close_errors.labels(name)
        for limit in LIMITS:
            self.metrics.session_connections_refused.labels(limit)
        for limit in USER_LIMITS:
            self.metrics.user_limit_refusals.labels(limit)
        self._grpc: grpc.Server | None = None
        self._health = health.HealthServicer()
        self._listener: SessionListener | None = None
        self.housekeeping: Housekeeping | None = None
        self.admin_token = secrets.token_urlsafe(32)
        self.started = time.time()

    def _open_store(self) -> Store:
        cfg = self.config
        devices: list[Device] = []
        try:
            for i, d in enumerate(cfg.data_dirs):
                devices.append(Device(i, d, cfg.storage.capacity_per_device, cfg.storage.direct_io,
                                      cfg.storage.keep_free))
            index = IndexDB(cfg.daemon.state_dir / "index.sqlite")
            return Store(devices, index, self.engine, self.staging, cfg.io.chunk_size,
                         cfg.storage.stripe_size, observer=self.metrics.observe_io,
                         namespace_quota=cfg.storage.namespace_quota, limits=self.user_limits,
                         user_of=self._user_of, tenant=self._tenant)
        except BaseException:
            for dev in devices:
                dev.close()
            raise

    def _user_of(self, namespace: str) -> int | None:
        """The uid a namespace's bytes count against: its session's, else its recorded owner's."""
        sessions = getattr(self, "sessions", None)  # (None while the store recovers, before sessions exist)
        uid = sessions.uid_holding(namespace) if sessions is not None else None
        return uid if uid is not None else self.store.index_db.namespace_owner(namespace)

    def _tenant(self, namespace: str | None) -> tuple:
        """Whom a turn on the array or the optimizer is for: the namespace's (user, job)."""
        sessions = getattr(self, "sessions", None)
        uid = sessions.uid_holding(namespace) if sessions is not None and namespace is not None else None
        return tenant(uid, namespace or "")

    def _session_closed(self, session: Session, reason: str) -> None:
        """Give back what a session held. Each step runs whatever failed before it (a
        failure is logged and counted, fuyoud_session_close_errors_total{step}); the pool's
        release runs last, always: nothing retries a close, and pinned memory left behind
        would be refused to every other tenant until a restart. The failpoint
        ``session.close.<step>`` comes first in each step but the pool's."""
        def step(name: str, fn):
            try:
                if name != "pool":
                    failpoints.hit(f"session.close.{name}")
                return fn()
            except Exception:  # noqa: BLE001 - the next steps run all the same
                log.exception("session %d: closing it, %s failed", session.id, CLOSE_STEPS[name])
                self.metrics.session_close_errors.labels(name).inc()
                return 0

        freed = dropped = 0
        try:
            step("checkpoints", lambda: self.checkpointer.session_closed(session.id))
            step("optimizer", lambda: self.optimizer.forget(session.namespace))
            if session.ephemeral:  # (a namespace the daemon named: its state would be left on the SSDs for good)
                step("namespace", lambda: self._delete_unnamed(session))
            dropped = step("transient", lambda: self.store.drop_transient(session.id))
        finally:
            freed = step("pool", lambda: self.pool.release_session(session.id))
            self.metrics.sessions_closed.labels(reason).inc()
            self.metrics.reclaimed_bytes.inc(freed)
        log.info("session %d: reclaimed %s pinned, %d transient objects", session.id, format_size(freed), dropped)

    def _delete_unnamed(self, session: Session) -> None:
        count, size = namespaces.delete_state(self.store, session.namespace)
        if count:
            log.info("session %d: deleted the %d objects (%s) of its unnamed namespace %s", session.id,
                     count, format_size(size), session.namespace)

    def start(self) -> "Daemon":
        cfg = self.config.daemon
        cfg.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        for path, kind in ((cfg.control_path, socket.SOCK_STREAM), (cfg.session_path, socket.SOCK_SEQPACKET)):
            _refuse_if_served(path, kind)
        self.owns_runtime_dir = True  # (its sockets and admin token are this daemon's from here on)
        self._write_admin_token()
        for d in self.config.checkpoint_dirs:
            try:
                d.mkdir(parents=True, exist_ok=True, mode=0o750)
            except OSError as exc:
                log.warning("cannot create checkpoint directory %s: %s", d, exc)
        malformed = MalformedRequests(lambda method: self.metrics.errors.labels(InvalidArgument.kind).inc())
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers, **named("grpc")),
                             interceptors=[malformed], options=[("grpc.so_reuseport", 0)])
        services = Services(self.store, self.pool, self.optimizer, self.sessions, self.metrics, self.checkpointer,
                            AdminAuth(self.admin_token, self.admin_token_path), self.snapshot, self.set_draining,
                            self.admission)
        rpc.add_FuyouServicer_to_server(FuyouServicer(services), server)
        rpc.add_FuyouAdminServicer_to_server(FuyouAdminServicer(services), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        control = cfg.control_path
        if control.exists() or control.is_symlink():
            control.unlink()
        old = os.umask(0o777 & ~cfg.socket_mode)
        try:
            server.add_insecure_port(f"unix:{control}")
        finally:
            os.umask(old)
        if cfg.tcp_listen:
            server.add_insecure_port(cfg.tcp_listen)
        server.start()
        os.chown(control, -1, cfg.socket_gid)
        os.chmod(control, cfg.socket_mode)
        self._grpc = server
        self._listener = SessionListener(cfg.session_path, cfg.socket_mode, self.sessions, cfg.socket_gid,
                                         self.metrics.session_accept_errors_by,
                                         on_refused=self.metrics.session_connections_refused_by)
        self._listener.start()
        if self.config.metrics.enabled:
            self.metrics.attach(self.snapshot)
            self.metrics_url = self.metrics.serve(self.config.metrics.listen)
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        interval = interval_from_env()
        watchdog = Watchdog(str(control), interval, self._self_check) if interval else None
        self.housekeeping = Housekeeping(self.store, watchdog, reap=lambda: self.sessions.reap(peers.gone))
        self.housekeeping.start()
        if watchdog is not None:
            log.info("systemd watchdog: probing and pinging every %.1f s", interval)
        log.info("fuyoud %s serving on %s (sessions %s), I/O engine %s (%s), %d device(s), pinned budget %s, "
                 "%s%s", __version__, control, cfg.session_path, self.engine.name, self.engine_reason,
                 len(self.store.devices), format_size(self.pool.budget), self.huge_pages.describe(),
                 f", metrics {self.metrics_url}" if self.metrics_url else "")
        notify(f"READY=1\nSTATUS=serving on {control}\nMAINPID={os.getpid()}")
        return self

    def stop(self, grace: float = 10.0, join_timeout: float = 60.0) -> None:
        """Stop (see the module's doc): requests running get ``grace`` seconds to finish,
        then gRPC cancels them; the threads still running then get ``join_timeout`` more.
        Raises StopFailed, after releasing everything it could, if a step failed."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            problems: list[str] = []
            try:
                self._stop(grace, join_timeout, problems)
            finally:
                self._stopped.set()
                if problems:
                    log.error("stopped, with failures: %s", "; ".join(problems))
                else:
                    log.info("stopped")
            if problems:
                raise StopFailed("; ".join(problems))

    def _stop(self, grace: float, join_timeout: float, problems: list[str]) -> None:
        def step(what: str, fn) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - every step runs; the failures are reported together
                log.exception("stopping: %s failed", what)
                problems.append(f"{what} failed: {exc}")

        notify("STOPPING=1")
        log.info("stopping")
        self.sessions.accepting = False
        self.admission.close()  # (new requests: UNAVAILABLE "fuyoud is shutting down"; the sessions stay)
        self._health.enter_graceful_shutdown()
        still: list[str] = []  # what is still running after its time: the data files are then left open
        if self.housekeeping is not None:  # (first: no reaping, no watchdog probe of a daemon going away)
            step("stopping housekeeping", lambda: self._join("housekeeping", self.housekeeping.stop, join_timeout,
                                                             still))
        if self._listener is not None:
            step("closing the session socket", self._listener.stop_accepting)
        running = self.admission.wait_idle(grace)
        if running:
            log.warning("stopping: %d request(s) still running after the %.0f s grace period, cancelled: %s",
                        len(running), grace, ", ".join(running))
        if self._grpc is not None:
            step("stopping gRPC", lambda: self._grpc.stop(0).wait())
        # (gRPC's cancel does not stop a handler's thread: wait for our code to return)
        still.extend(f"request {m}" for m in self.admission.wait_idle(join_timeout))
        step("ending the sessions", lambda: self.sessions.close_all("daemon stopping"))
        if self._listener is not None:
            step("joining the session socket's threads", lambda: self._join("session socket", self._listener.close,
                                                                           join_timeout, still))
        step("joining the optimizer's read-aheads", lambda: self._join("optimizer", self.optimizer.close,
                                                                      join_timeout, still))
        if still:
            # A descriptor closed under a running transfer can be reused for another file: leave
            # the data files and the engine to the process's exit rather than risk that.
            problems.append(f"still running {join_timeout:.0f} s after gRPC stopped: {', '.join(still)}; the data "
                            "files and the I/O engine were left open (they close as the process exits)")
        else:
            step("closing the store", self.store.close)
            step("closing the I/O engine", self.engine.close)
        step("closing the metrics endpoint", self.metrics.close)
        if self.owns_runtime_dir:  # (not another daemon's, refused at start)
            step("removing the admin token", lambda: self.admin_token_path.unlink(missing_ok=True))

    @staticmethod
    def _join(what: str, close, timeout: float, still: list[str]) -> None:
        left = close(timeout)
        if left:
            still.extend(f"{what} thread {name}" for name in left)

    def snapshot(self) -> Snapshot:
        """The daemon's state now, for Status and the metrics collector."""
        rates = self.housekeeping.throughput.rates() if self.housekeeping else (0.0, 0.0)
        live = self.sessions.listed()  # (read before the pool: a session leaves it only once its memory is back)
        return Snapshot(__version__, os.getpid(), self.started, self.engine.name, self.engine_reason,
                        self.metrics_url, str(self.config.daemon.session_path), self.sessions.draining,
                        len(live), self.pool.usage(), self.staging.total_bytes,
                        self.optimizer.buffers.mapped_bytes, self.optimizer.cached_bytes(),
                        self.config.optimizer.buffer_budget, self.config.optimizer.buffers, self.store.usage(),
                        *rates, session_namespaces={s.id: s.namespace for s in live},
                        optimizer_buffers_held=self.optimizer.buffers.held(),
                        store_outlives_daemon=self.store_outlives)

    def set_draining(self, draining: bool) -> None:
        """Drain: refuse new sessions (the gRPC service reports NOT_SERVING) while the
        current ones go on."""
        self.sessions.draining = draining
        status = health_pb2.HealthCheckResponse.NOT_SERVING if draining else health_pb2.HealthCheckResponse.SERVING
        self._health.set(SERVICE_NAME, status)
        log.info("draining: %s, %d session(s) live", "on" if draining else "off", len(self.sessions.all()))

    @property
    def admin_token_path(self):
        return self.config.daemon.control_path.parent / "admin.token"

    def _write_admin_token(self) -> None:
        """The token of operator requests (drain, checkpoint of any session): readable by
        the daemon's own user (and root) only."""
        path = self.admin_token_path
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.admin_token + "\n")

    def _self_check(self) -> None:
        """The watchdog's checks beyond the gRPC health probe: raises if a part is dead."""
        if self._listener is None or not self._listener.alive:
            raise RuntimeError("the session listener thread is dead")
        self.store.index_db.get_meta("devices")

    def wait(self) -> None:
        self._stopped.wait()

    def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop cleanly. A failure to start raises
        ``StartFailed`` (what was started is stopped first); a stop that failed,
        ``StopFailed``."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        try:
            self.start()
        except Exception as exc:
            try:
                self.stop()
            except StopFailed as again:
                log.error("stopping after the failed start: %s", again)
            raise StartFailed(str(exc)) from exc
        while not stop.wait(1.0):
            pass
        self.stop()

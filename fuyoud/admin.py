"""The operator-facing RPCs: Status, ListSessions, Drain, Checkpoint, and the clients'
own Report. Mixed into the servicer (fuyoud/service.py).

Status and ListSessions need only access to the control socket (its mode and group
decide who has it), but the sessions they list are the caller's: every session for the
operator (admin token), the caller's own for a session (its token), none otherwise -
a tenant learns no other user's uid, pid or namespace. Drain, and Checkpoint of a
session other than the caller's own, need the admin token that the daemon writes to ``<runtime_dir>/admin.token``, readable
by its own user only: root and the daemon's user can act as operators, group members
who may train cannot.
"""
from __future__ import annotations

import hmac
import os
import time

import grpc

from fuyou_proto import ADMIN_METADATA_KEY, SESSION_METADATA_KEY, pb
from fuyoud import __version__
from fuyoud import checkpoint as ckpt
from fuyoud.errors import InvalidArgument, PermissionDenied
from fuyoud.handler import ServicerBase, handler
from fuyoud.sessions import Session

DEFAULT_CHECKPOINT_TIMEOUT = 60.0
MAX_CHECKPOINT_TIMEOUT = 7 * 86400.0


class AdminMethods(ServicerBase):
    def _is_admin(self, context: grpc.ServicerContext) -> bool:
        token = dict(context.invocation_metadata()).get(ADMIN_METADATA_KEY)
        return token is not None and hmac.compare_digest(token.encode(), self.daemon.admin_token.encode())

    def _require_admin(self, context: grpc.ServicerContext, what: str) -> None:
        if not self._is_admin(context):
            raise PermissionDenied(
                f"{what} needs the admin token ({self.daemon.admin_token_path}, readable by the daemon's user): "
                "run fuyouctl as root or as that user")

    def session_info(self, s: Session, pinned: dict[int, int]) -> pb.SessionInfo:
        groups = self.daemon.optimizer.loaded(s.namespace)
        persistent = sum(m.size for m in self.daemon.store.list(s.namespace) if m.persistent)
        return pb.SessionInfo(id=s.id, uid=s.uid, pid=s.pid, namespace=s.namespace, started=s.started,
                              last_active=s.last_active, pinned_bytes=pinned.get(s.id, 0),
                              model_params=sum(g.numel for g in groups), groups=len(groups),
                              step=max((g.step for g in groups), default=0), persistent_bytes=persistent)

    def _visible_sessions(self, context: grpc.ServicerContext) -> list[pb.SessionInfo]:
        """Every session for the operator, the caller's own for a session, else none."""
        if self._is_admin(context):
            visible = self.daemon.sessions.all()
        else:
            token = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY)
            visible = [s for s in self.daemon.sessions.all() if token is not None and
                       hmac.compare_digest(s.token.encode(), token.encode())]
        pinned = self.daemon.pool.usage().by_session
        return [self.session_info(s, pinned) for s in sorted(visible, key=lambda s: s.id)]

    @handler
    def Status(self, request, context):
        d = self.daemon
        pool = d.pool.usage()
        usage = d.store.usage()
        read_rate, write_rate = d.housekeeping.throughput.rates() if d.housekeeping else (0.0, 0.0)
        return pb.StatusReply(
            version=__version__, io_engine=d.engine.name, io_engine_reason=d.engine_reason,
            devices=[pb.DeviceStatus(index=i, path=p, capacity_bytes=c, used_bytes=u)
                     for i, (p, c, u) in enumerate(usage.devices)],
            pinned_budget_bytes=pool.budget, pinned_used_bytes=pool.segments,
            sessions=len(d.sessions.all()), objects=sum(usage.objects.values()), pid=os.getpid(),
            metrics_url=d.metrics_url, session_socket=str(d.config.daemon.session_path),
            bytes_read=usage.bytes_read, bytes_written=usage.bytes_written, draining=d.sessions.draining,
            read_bytes_per_second=read_rate, write_bytes_per_second=write_rate,
            uptime_seconds=int(time.time() - d.started), session_list=self._visible_sessions(context))

    @handler
    def ListSessions(self, request, context):
        return pb.ListSessionsReply(sessions=self._visible_sessions(context))

    @handler
    def Drain(self, request, context):
        self._require_admin(context, "drain")
        self.daemon.set_draining(not request.cancel)
        return pb.DrainReply(draining=self.daemon.sessions.draining, sessions=len(self.daemon.sessions.all()))

    @handler
    def Checkpoint(self, request, context):
        if self._is_admin(context):
            if not request.session_id:
                raise InvalidArgument("an operator's checkpoint names its session (session_id)")
            session, caller = self.daemon.sessions.by_id(request.session_id), None
        else:
            session = caller = self._session(context)
            if request.session_id not in (0, session.id):
                raise PermissionDenied(
                    f"session {session.id} may checkpoint only itself, not session {request.session_id} "
                    "(operators: fuyouctl checkpoint, with the admin token)")
        if request.timeout_seconds < 0:
            raise InvalidArgument(f"timeout_seconds must not be negative, got {request.timeout_seconds}")
        if not request.timeout_seconds <= MAX_CHECKPOINT_TIMEOUT:  # (also refuses NaN)
            raise InvalidArgument(f"timeout_seconds must be at most {MAX_CHECKPOINT_TIMEOUT:g}, "
                                  f"got {request.timeout_seconds}")
        with ckpt.location(self.daemon, request.directory, caller and caller.uid) as where:
            result = ckpt.checkpoint(self.daemon, session.namespace, session.uid, where,
                                     request.timeout_seconds or DEFAULT_CHECKPOINT_TIMEOUT, request.mode or "auto",
                                     request.client_state)
        self.daemon.metrics.observe_checkpoint(result.mode, result.seconds, result.bytes)
        return pb.CheckpointReply(directory=result.directory, namespace=result.namespace, objects=result.objects,
                                  bytes=result.bytes, step=result.step, seconds=result.seconds, mode=result.mode)

    @handler
    def Restore(self, request, context):
        session = self._session(context)
        with ckpt.location(self.daemon, request.directory, session.uid) as where:
            result = ckpt.restore(self.daemon, session, where)
        return pb.RestoreReply(namespace=result.namespace, step=result.step, objects=result.objects,
                               bytes=result.bytes, mode=result.mode, client_state=result.client_state,
                               seconds=result.seconds)

    @handler
    def DeleteCheckpoint(self, request, context):
        uid = None if self._is_admin(context) else self._session(context).uid
        with ckpt.location(self.daemon, request.directory, uid) as where:
            ckpt.delete(self.daemon, uid, where)
        return pb.Empty()

    @handler
    def Report(self, request, context):
        self._session(context)
        numbers = (request.iteration_seconds, request.exposed_optimizer_seconds)
        if not all(0 <= x < 1e9 for x in numbers):  # also refuses NaN
            raise InvalidArgument(f"report figures must be non-negative seconds, got {numbers}")
        self.daemon.metrics.observe_report(request)
        return pb.Empty()

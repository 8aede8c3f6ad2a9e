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
import time

import grpc

from fuyou_proto import SESSION_METADATA_KEY, pb
from fuyoud.errors import InvalidArgument, PermissionDenied
from fuyoud.handler import ServicerBase, handler
from fuyoud.sessions import Session

DEFAULT_CHECKPOINT_TIMEOUT = 60.0
MAX_CHECKPOINT_TIMEOUT = 7 * 86400.0


class AdminMethods(ServicerBase):
    def _is_admin(self, context: grpc.ServicerContext) -> bool:
        return self.admin.allows(context)

    def _require_admin(self, context: grpc.ServicerContext, what: str) -> None:
        if not self._is_admin(context):
            raise PermissionDenied(
                f"{what} needs the admin token ({self.admin.path}, readable by the daemon's user): "
                "run fuyouctl as root or as that user")

    def session_info(self, s: Session, pinned: dict[int, int]) -> pb.SessionInfo:
        groups = self.optimizer.loaded(s.namespace)
        persistent = sum(m.size for m in self.store.list(s.namespace) if m.persistent)
        return pb.SessionInfo(id=s.id, uid=s.uid, pid=s.pid, namespace=s.namespace, started=s.started,
                              last_active=s.last_active, pinned_bytes=pinned.get(s.id, 0),
                              model_params=sum(g.numel for g in groups), groups=len(groups),
                              step=max((g.step for g in groups), default=0), persistent_bytes=persistent)

    def _visible_sessions(self, context: grpc.ServicerContext) -> list[pb.SessionInfo]:
        """Every session for the operator, the caller's own for a session, else none."""
        if self._is_admin(context):
            visible = self.sessions.all()
        else:
            token = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY)
            visible = [s for s in self.sessions.all() if token is not None and
                       hmac.compare_digest(s.token.encode(), token.encode())]
        pinned = self.pool.usage().by_session
        return [self.session_info(s, pinned) for s in sorted(visible, key=lambda s: s.id)]

    @handler
    def Status(self, request, context):
        d = self.snapshot()
        usage = d.store
        return pb.StatusReply(
            version=d.version, io_engine=d.io_engine, io_engine_reason=d.io_engine_reason,
            devices=[pb.DeviceStatus(index=i, path=p, capacity_bytes=c, used_bytes=u)
                     for i, (p, c, u) in enumerate(usage.devices)],
            pinned_budget_bytes=d.pool.budget, pinned_used_bytes=d.pool.segments,
            sessions=d.sessions, objects=sum(usage.objects.values()), pid=d.pid,
            metrics_url=d.metrics_url, session_socket=d.session_socket,
            bytes_read=usage.bytes_read, bytes_written=usage.bytes_written, draining=d.draining,
            read_bytes_per_second=d.read_bytes_per_second, write_bytes_per_second=d.write_bytes_per_second,
            uptime_seconds=int(time.time() - d.started), session_list=self._visible_sessions(context))

    @handler
    def ListSessions(self, request, context):
        return pb.ListSessionsReply(sessions=self._visible_sessions(context))

    @handler
    def Drain(self, request, context):
        self._require_admin(context, "drain")
        self.set_draining(not request.cancel)
        return pb.DrainReply(draining=self.sessions.draining, sessions=len(self.sessions.all()))

    @handler
    def Checkpoint(self, request, context):
        if self._is_admin(context):
            if not request.session_id:
                raise InvalidArgument("an operator's checkpoint names its session (session_id)")
            session, caller = self.sessions.by_id(request.session_id), None
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
        with self.checkpointer.location(request.directory, caller and caller.uid) as where:
            result = self.checkpointer.checkpoint(session.namespace, session.uid, where,
                                     request.timeout_seconds or DEFAULT_CHECKPOINT_TIMEOUT, request.mode or "auto",
                                     request.client_state)
        self.metrics.observe_checkpoint(result.mode, result.seconds, result.bytes)
        return pb.CheckpointReply(directory=result.directory, namespace=result.namespace, objects=result.objects,
                                  bytes=result.bytes, step=result.step, seconds=result.seconds, mode=result.mode)

    @handler
    def Restore(self, request, context):
        session = self._session(context)
        with self.checkpointer.location(request.directory, session.uid) as where:
            result = self.checkpointer.restore(session, where)
        return pb.RestoreReply(namespace=result.namespace, step=result.step, objects=result.objects,
                               bytes=result.bytes, mode=result.mode, client_state=result.client_state,
                               seconds=result.seconds)

    @handler
    def DeleteCheckpoint(self, request, context):
        uid = None if self._is_admin(context) else self._session(context).uid
        with self.checkpointer.location(request.directory, uid) as where:
            self.checkpointer.delete(uid, where)
        return pb.Empty()

    @handler
    def Report(self, request, context):
        self._session(context)
        numbers = (request.iteration_seconds, request.exposed_optimizer_seconds)
        if not all(0 <= x < 1e9 for x in numbers):  # also refuses NaN
            raise InvalidArgument(f"report figures must be non-negative seconds, got {numbers}")
        self.metrics.observe_report(request)
        return pb.Empty()

"""The operator's service, FuyouAdmin: Status, ListSessions, Drain, ListNamespaces,
DeleteNamespace.

Status and ListSessions need only access to the control socket (its mode and group
decide who has it), but the sessions they list are the caller's: every session for the
operator (admin token), the caller's own for a session (its token), none otherwise -
a tenant learns no other user's uid, pid or namespace. Drain and the namespaces' calls
need the admin token that the daemon writes to ``<runtime_dir>/admin.token``, readable
by its own user only: root and the daemon's user can act as operators, group members who
may train cannot.
"""
from __future__ import annotations

import hmac
import time

import grpc

from fuyou_proto import SESSION_METADATA_KEY, pb, rpc
from fuyoud.api.handler import ServicerBase, handler
from fuyoud.sessions import namespaces
from fuyoud.sessions.registry import Session


class FuyouAdminServicer(ServicerBase, rpc.FuyouAdminServicer):
    def session_info(self, s: Session, pinned: dict[int, int], reserved: dict[int, int]) -> pb.SessionInfo:
        groups = self.optimizer.loaded(s.namespace)
        persistent = sum(m.size for m in self.store.list(s.namespace) if m.persistent)
        return pb.SessionInfo(id=s.id, uid=s.uid, pid=s.pid, namespace=s.namespace, started=s.started,
                              last_active=s.last_active, pinned_bytes=pinned.get(s.id, 0),
                              model_params=sum(g.numel for g in groups), groups=len(groups),
                              step=max((g.step for g in groups), default=0), persistent_bytes=persistent,
                              reserved_bytes=reserved.get(s.id, 0))

    def _visible_sessions(self, context: grpc.ServicerContext) -> list[pb.SessionInfo]:
        """Every session for the operator, the caller's own for a session, else none;
        those closing too, until their memory is back (it counts against the budget)."""
        visible = self.sessions.listed() if self._is_admin(context) else self._callers(context, self.sessions.listed())
        usage = self.pool.usage()
        return [self.session_info(s, usage.by_session, usage.reserved_by_session)
                for s in sorted(visible, key=lambda s: s.id)]

    @staticmethod
    def _callers(context: grpc.ServicerContext, sessions: list[Session]) -> list[Session]:
        """Of ``sessions``, the one whose token the call carries (none without one)."""
        token = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY)
        return [s for s in sessions if token is not None and hmac.compare_digest(s.token.encode(), token.encode())]

    @handler
    def Status(self, request, context):
        d = self.snapshot()
        usage = d.store
        caller = next(iter(self._callers(context, self.sessions.all())), None)
        user_budget, user_others = self.pool.user_usage(caller.uid, caller.id) if caller is not None else (0, 0)
        return pb.StatusReply(
            version=d.version, io_engine=d.io_engine, io_engine_reason=d.io_engine_reason,
            devices=[pb.DeviceStatus(index=i, path=p, capacity_bytes=c, used_bytes=u, available_bytes=a)
                     for i, (p, c, u, a) in enumerate(usage.devices)],
            pinned_budget_bytes=d.pool.budget, pinned_used_bytes=d.pool.segments,
            pinned_reserved_bytes=d.pool.reserved,
            session_budget_bytes=d.pool.session_budget, segment_bytes=d.pool.segment_size,
            optimizer_buffer_budget_bytes=d.optimizer_buffer_budget, optimizer_buffers=d.optimizer_buffers,
            sessions=d.sessions, objects=sum(usage.objects.values()), pid=d.pid,
            metrics_url=d.metrics_url, session_socket=d.session_socket,
            bytes_read=usage.bytes_read, bytes_written=usage.bytes_written, draining=d.draining,
            read_bytes_per_second=d.read_bytes_per_second, write_bytes_per_second=d.write_bytes_per_second,
            uptime_seconds=int(time.time() - d.started), session_list=self._visible_sessions(context),
            store_outlives_daemon=d.store_outlives_daemon, user_pinned_budget_bytes=user_budget,
            user_pinned_others_bytes=user_others)

    @handler
    def ListSessions(self, request, context):
        return pb.ListSessionsReply(sessions=self._visible_sessions(context))

    @handler
    def Drain(self, request, context):
        self._require_admin(context, "drain")
        self.set_draining(not request.cancel)
        return pb.DrainReply(draining=self.sessions.draining, sessions=len(self.sessions.listed()))

    @handler
    def ListNamespaces(self, request, context):
        self._require_admin(context, "listing namespaces")
        return pb.ListNamespacesReply(namespaces=[
            pb.NamespaceInfo(name=u.name, owned=u.owner is not None, uid=u.owner or 0, objects=u.objects,
                             bytes=u.bytes, snapshot_objects=u.snapshot_objects, snapshot_bytes=u.snapshot_bytes,
                             session_id=u.session_id, checkpoints=u.checkpoints, unnamed=u.unnamed)
            for u in namespaces.survey(self.store, self.sessions)])

    @handler
    def DeleteNamespace(self, request, context):
        self._require_admin(context, "deleting a namespace")
        count, size, kept = namespaces.delete(self.store, self.optimizer, self.sessions, request.namespace)
        return pb.DeleteNamespaceReply(objects=count, bytes=size, snapshot_objects=kept)

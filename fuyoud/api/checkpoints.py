"""The checkpoint RPCs of service Fuyou (Checkpoint, Restore, DeleteCheckpoint) and the
clients' Report; mixed into the servicer (service.py). A session acts on its own
namespace, in a directory it holds: it names the files it handed on its session socket
(``handed``), and the daemon reaches the directory only through them. Without them a
session's directory must be inside ``[daemon] checkpoint_dirs``, the daemon's own. With
the admin token an operator checkpoints any session (fuyouctl checkpoint) and deletes any
checkpoint, the daemon writing with its own rights."""
from __future__ import annotations

from fuyou_proto import pb
from fuyoud.api.handler import ServicerBase, handler
from fuyoud.errors import InvalidArgument, PermissionDenied

DEFAULT_CHECKPOINT_TIMEOUT = 60.0
MAX_CHECKPOINT_TIMEOUT = 7 * 86400.0


class CheckpointMethods(ServicerBase):
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
        with self._where(request, caller, new=True) as where:
            result = self.checkpointer.checkpoint(session.namespace, session.uid, where,
                                     request.timeout_seconds or DEFAULT_CHECKPOINT_TIMEOUT, request.mode or "auto",
                                     request.client_state, session.id)
        self.metrics.observe_checkpoint(result.mode, result.seconds, result.bytes)
        return pb.CheckpointReply(directory=result.directory, namespace=result.namespace, objects=result.objects,
                                  bytes=result.bytes, step=result.step, seconds=result.seconds, mode=result.mode,
                                  manifest=result.manifest if request.handed else b"")

    def _where(self, request, caller, new: bool):
        """The checkpoint's location: through the files the caller handed, or by path."""
        if request.handed:
            if caller is None:
                raise InvalidArgument("an operator's request names a directory, not handed files")
            return self.checkpointer.handed_location(request.directory, caller.handed.take(request.handed), new)
        return self.checkpointer.location(request.directory, caller and caller.uid)

    @handler
    def CommitCheckpoint(self, request, context):
        session = self._session(context)
        self.checkpointer.commit(session.id, request.directory)
        return pb.Empty()

    @handler
    def Restore(self, request, context):
        session = self._session(context)
        with self._where(request, session, new=False) as where:
            result = self.checkpointer.restore(session, where)
        return pb.RestoreReply(namespace=result.namespace, step=result.step, objects=result.objects,
                               bytes=result.bytes, mode=result.mode, client_state=result.client_state,
                               seconds=result.seconds)

    @handler
    def DeleteCheckpoint(self, request, context):
        caller = None if self._is_admin(context) else self._session(context)
        with self._where(request, caller, new=False) as where:
            self.checkpointer.delete(caller and caller.uid, where)
        return pb.Empty()

    @handler
    def Report(self, request, context):
        self._session(context)
        numbers = (request.iteration_seconds, request.exposed_optimizer_seconds)
        if not all(0 <= x < 1e9 for x in numbers):  # also refuses NaN
            raise InvalidArgument(f"report figures must be non-negative seconds, got {numbers}")
        self.metrics.observe_report(request)
        return pb.Empty()

"""Sessions: one per client process, with its uid/pid, token and namespace.

A session owns its shared-memory segments and its transient objects; persistent objects
belong to its namespace, which is held by at most one live session at a time and
belongs to the uid that first used it. Closing a session (CloseSession, EOF on the
session socket when the process dies, the reaper when its process is gone though the
socket stays open, the daemon stopping) releases everything it held, and where the daemon
named its namespace (the client named none) that namespace's persistent objects too:
nobody could come back to them (fuyoud/sessions/unnamed.py). Its snapshot checkpoints' objects
stay until the checkpoint is deleted.

A session that is closing is no longer usable (its token is refused from the moment the
close begins) but is still listed (``listed``: fuyouctl sessions, Status, the sessions
metric) until everything it held is given back, and its namespace opens to a new session
only then (``open`` waits for that, up to CLOSING_WAIT seconds): a job restarted right
after a crash is never refused for memory held by a session nobody can see, nor has its
groups forgotten by the old session's close.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from fuyoud.errors import (AlreadyExists, FailedPrecondition, NotFound, PermissionDenied, Unauthenticated,
                           Unavailable)
from fuyoud.sessions.handed import HandedFiles
from fuyoud.sessions.names import check_namespace, shown
from fuyoud.sessions.unnamed import refuse_unnamed, unnamed_namespace
from fuyoud.sessions.user_limits import SESSIONS, UserLimits

log = logging.getLogger(__name__)
CLOSING_WAIT = 30.0  # seconds ``open`` waits for a closing session to give its namespace back


@dataclass
class Session:
    id: int
    token: str
    uid: int
    pid: int
    namespace: str
    started: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.time)
    closed: bool = False  # closing or closed: its token is refused
    # The namespace's owner is recorded (persistently) once it holds persistent objects.
    namespace_claimed: bool = False
    # The daemon named the namespace (the client asked for none): nobody can come back to
    # it, so its objects, persistent ones too, go when the session closes.
    ephemeral: bool = False
    # Sends a segment's fd to the client (set by the session socket handler).
    send_segment: Callable | None = None
    # When its process started (peers.start_time at the handshake): a pid reused since is
    # another process.
    pid_start: int | None = None
    # Ends its session socket's connection (set by the session socket handler): a session
    # closed otherwise (reaped, CloseSession) leaves no thread waiting on it.
    disconnect: Callable[[], None] | None = None
    # Files the client handed for a request to come (sessions/handed.py): a checkpoint's.
    handed: HandedFiles = field(default_factory=HandedFiles)


# Why a session ended: the label of fuyoud_sessions_closed_total (bounded).
CLOSED = "closed"  # CloseSession: the client closed it
KILLED = "killed"  # its session socket ended without CloseSession: the process died (or exited without closing)
REAPED = "reaped"  # its process is gone though the socket stayed open (children that inherited it)
STOPPING = "stopping"  # the daemon stopped
REASONS = (CLOSED, KILLED, REAPED, STOPPING)


class SessionRegistry:
    def __init__(self, on_close: Callable[[Session, str], None],
                 namespace_owner: Callable[[str], int | None],
                 claim_namespace: Callable[[str, int], None],
                 admits: Callable[[int], bool] = lambda uid: True, limits: UserLimits | None = None):
        self._on_close = on_close
        self._limits = limits  # what one uid may hold ([limits]); None: no limit
        self._admits = admits
        self._namespace_owner = namespace_owner
        self._claim_namespace = claim_namespace
        self._lock = threading.Condition()  # (notified as a closing session is done)
        self._by_token: dict[str, Session] = {}
        self._by_namespace: dict[str, Session] = {}
        self._closing: dict[int, Session] = {}  # closed, what they held not given back yet: listed, not usable
        self._withheld: set[str] = set()  # namespaces the operator is deleting: no session may open them
        self._ids = itertools.count(1)
        self.accepting = True  # False once the daemon is stopping
        self.draining = False  # fuyouctl drain: no new sessions, current ones go on
        # This daemon's life, the prefix of each token it gives: a token of an earlier life
        # (a client of a daemon that stopped or died, calling the one started since on the
        # same socket) is told so (UNAVAILABLE), not taken for an unknown session.
        self.life = secrets.token_hex(4)

    def open(self, uid: int, pid: int, namespace: str | None, pid_start: int | None = None) -> Session:
        with self._lock:
            deadline = time.monotonic() + CLOSING_WAIT
            while True:
                if not self.accepting:
                    raise Unavailable("fuyoud is shutting down and accepts no new sessions")
                if not self._admits(uid):
                    raise PermissionDenied(f"uid {uid} may not use this fuyoud: add it to [daemon] allow_uids, or to "
                                           "the group in [daemon] allow_group (default: the sockets' group)")
                if self.draining:
                    raise Unavailable("fuyoud is draining (fuyouctl drain) and accepts no new sessions; "
                                      "`fuyouctl drain --cancel` reopens it")
                if namespace is not None:
                    refuse_unnamed(check_namespace(namespace))
                ending = self._closing_holder(namespace)
                if ending is None:
                    break
                # (its namespace is free once it has given back what it held: a restarted job waits for that)
                if not self._lock.wait(deadline - time.monotonic()) and self._closing_holder(namespace) is ending:
                    raise Unavailable(f"namespace {shown(namespace)} is held by session {ending.id} (pid "
                                      f"{ending.pid}), which is closing and has not given back what it held "
                                      f"after {CLOSING_WAIT:.0f} s: try again shortly")
            self._check_user_sessions(uid)
            sid = next(self._ids)
            ephemeral = namespace is None
            if ephemeral:
                namespace = unnamed_namespace(sid)
            owner = self._namespace_owner(namespace)
            if owner is not None and owner != uid and uid != 0:
                raise PermissionDenied(f"namespace {shown(namespace)} belongs to uid {owner}")
            if namespace in self._withheld:
                raise Unavailable(f"namespace {shown(namespace)} is being deleted by the operator "
                                  "(fuyouctl delete-namespace)")
            holder = self._by_namespace.get(namespace)
            if holder is not None:
                raise AlreadyExists(
                    f"namespace {shown(namespace)} is held by live session {holder.id} (pid {holder.pid})")
            session = Session(sid, f"{self.life}.{secrets.token_urlsafe(32)}", uid, pid, namespace,
                              namespace_claimed=owner is not None, ephemeral=ephemeral, pid_start=pid_start)
            self._by_token[session.token] = session
            self._by_namespace[namespace] = session
        log.info("session %d opened: uid %d pid %d namespace %s", sid, uid, pid, namespace)
        return session

    def _check_user_sessions(self, uid: int) -> None:  # (the lock held)
        """At most [limits] user_sessions sessions of one uid, those closing included."""
        if self._limits is None:
            return
        mine = sorted((s for s in [*self._by_token.values(), *self._closing.values()] if s.uid == uid),
                      key=lambda s: s.id)
        if len(mine) < self._limits.sessions:
            return
        closing = sum(s.closed for s in mine)
        shown_ = ", ".join(f"{s.id} (namespace {s.namespace}, pid {s.pid}{', closing' if s.closed else ''})"
                           for s in mine[:4]) + (f" and {len(mine) - 4} more" if len(mine) > 4 else "")
        raise self._limits.refuse(
            SESSIONS, uid, f"holds {len(mine)} sessions{f' ({closing} closing)' if closing else ''}: {shown_}",
            "end sessions it no longer uses (each fuyou_client process holds one; `fuyouctl sessions` lists them)")

    def uid_holding(self, namespace: str) -> int | None:
        """The uid of the session (live or closing) that holds ``namespace``, if any."""
        with self._lock:
            s = self._by_namespace.get(namespace) or self._closing_holder(namespace)
            return None if s is None else s.uid

    def claim_namespace(self, session: Session) -> None:
        """Record the session's uid as its namespace's owner, before its first persistent
        object (ephemeral namespaces of sessions that never persist anything leave no trace)."""
        if not session.namespace_claimed:
            self._claim_namespace(session.namespace, session.uid, session.ephemeral)
            session.namespace_claimed = True

    def authenticate(self, token: str | None) -> Session:
        session = self._by_token.get(token or "")
        life, dot, _ = (token or "").partition(".")
        if session is None and dot and life != self.life:
            raise Unavailable("fuyoud is not the one that opened this session: that one stopped and this one started "
                              "since (its sessions ended with it). Everything it committed is safe on the SSD array: "
                              "continue with attach(model, resume=DIR) from your last engine.save_checkpoint(DIR)")
        if session is None or session.closed:
            raise Unauthenticated("missing or unknown session token: open a session on the session socket first")
        session.last_active = time.time()
        return session

    def _closing_holder(self, namespace: str | None) -> Session | None:  # (the lock held)
        """The closing session whose namespace is ``namespace`` (None for an unnamed one:
        nobody else can ask for it)."""
        if namespace is None:
            return None
        return next((s for s in self._closing.values() if s.namespace == namespace), None)

    def close(self, session: Session, reason: str, kind: str = CLOSED) -> None:
        """End a session (once; later calls do nothing): ``reason`` for the log, ``kind``
        one of REASONS for the metrics. Its token is refused at once; it stays listed, and
        ``open`` waits to give its namespace to another, until ``on_close`` (which gives
        back what it held) returns, whether or not that raised."""
        assert kind in REASONS, kind
        with self._lock:
            if session.closed:
                return
            session.closed = True
            self._by_token.pop(session.token, None)
            self._by_namespace.pop(session.namespace, None)
            self._closing[session.id] = session
        log.info("session %d closing (%s)", session.id, reason)
        try:
            try:
                session.handed.close()
            except Exception:  # noqa: BLE001 - its memory goes back all the same
                log.exception("session %d: closing the files it handed failed", session.id)
            self._on_close(session, kind)
        finally:
            with self._lock:
                self._closing.pop(session.id, None)
                self._lock.notify_all()
            log.info("session %d closed (%s)", session.id, reason)
            if session.disconnect is not None:
                session.disconnect()

    def reap(self, gone: Callable[[int, int | None], bool]) -> list[Session]:
        """Close the sessions whose process is gone (``gone(pid, pid_start)``: peers.gone)
        though their session socket is still open; returns them."""
        reaped = [s for s in self.all() if gone(s.pid, s.pid_start)]
        for s in reaped:
            log.warning("session %d (pid %d, namespace %s): its process is gone but its session socket is still "
                        "open (a child process inherited it); reaping the session", s.id, s.pid, s.namespace)
            self.close(s, "its process is gone", REAPED)
        return reaped

    def by_id(self, session_id: int) -> Session:
        for s in self.all():
            if s.id == session_id:
                return s
        raise NotFound(f"no live session {session_id} (fuyouctl sessions lists them)")

    def describe(self, session_id: int, asker_id: int) -> str:
        """How a refusal given to session ``asker_id`` names session ``session_id``: its
        namespace and pid when both are one user's (or the asker is root); another user's
        session only by its id (a tenant learns no other user's pid or namespace)."""
        with self._lock:
            live = {s.id: s for s in self._by_token.values()}
        s, asker = live.get(session_id), live.get(asker_id)
        if s is None:
            return f"session {session_id} (ending)"
        if asker is not None and asker.uid in (s.uid, 0):
            return f"session {s.id} (namespace {s.namespace}, pid {s.pid})"
        return f"session {s.id} (another user's)"

    @contextmanager
    def withheld(self, namespace: str):
        """No session may open ``namespace`` inside this (the operator deletes its state);
        refused if a live session holds it now."""
        with self._lock:
            holder = self._by_namespace.get(namespace)
            if holder is not None:
                raise FailedPrecondition(f"namespace {shown(namespace)} is held by live session {holder.id} (pid "
                                         f"{holder.pid}): its state can be deleted once that session has ended")
            if namespace in self._withheld:
                raise FailedPrecondition(f"namespace {shown(namespace)} is being deleted already")
            self._withheld.add(namespace)
        try:
            yield
        finally:
            with self._lock:
                self._withheld.discard(namespace)

    def holds(self, namespace: str) -> bool:
        """Whether a live session holds ``namespace``."""
        with self._lock:
            return namespace in self._by_namespace

    def all(self) -> list[Session]:
        """The live sessions (usable: not closing)."""
        with self._lock:
            return list(self._by_token.values())

    def listed(self) -> list[Session]:
        """What the operator sees (fuyouctl sessions, Status, the sessions metric): the
        live sessions and those closing, whose memory is not given back yet; by id."""
        with self._lock:
            return sorted([*self._by_token.values(), *self._closing.values()], key=lambda s: s.id)

    def close_all(self, reason: str, kind: str = STOPPING) -> None:
        for s in self.all():
            self.close(s, reason, kind)

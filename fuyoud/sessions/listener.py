"""The session socket: who the client is, its shared memory, and when it dies.

gRPC over a unix socket can neither see the peer's credentials nor pass file
descriptors, so every client process also holds one connection to this plain AF_UNIX
SOCK_SEQPACKET socket (message boundaries kept, fds passed with SCM_RIGHTS):

    client -> daemon   {"hello": 1, "namespace": str | null, "client": str}
    daemon -> client   {"session": id, "token": str, "namespace": str, "version": str}
                    or {"error": {"code": "PERMISSION_DENIED", "message": str}}
    daemon -> client   {"segment": id, "size": n}  + the segment's memfd   (any time later)
    client -> daemon   {"hand": key, "names": [...], "last": bool} + fds  (files for a request
                       to come: a checkpoint's, which the client created; sessions/handed.py)

The daemon reads uid/pid with SO_PEERCRED. EOF (or any error) on the connection ends
the session: everything it held is reclaimed. A client that goes away at any point of
the handshake (before its hello, after it, before or after the reply) leaves no session
and no held namespace: a session registered for it is closed however the handshake
ends, and a hello that does not come within HANDSHAKE_TIMEOUT ends the connection.

The accept loop outlives the errors accept() can meet while the daemon runs: out of
file descriptors (EMFILE, ENFILE), of memory (ENOBUFS, ENOMEM), a connection aborted
before it was accepted. Each is logged (at most every LOG_EVERY seconds per errno) and
counted (``on_accept_error``, fuyoud_session_accept_errors_total), and the loop backs
off and retries: a daemon short of descriptors refuses nothing for good, and serves the
waiting clients once descriptors are free again. Every thread the listener starts is
tracked; ``close`` ends and joins them all.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Callable

from fuyoud import __version__, failpoints
from fuyoud.concurrency.threads import Threads
from fuyoud.errors import FuyouError
from fuyoud.sessions import peers
from fuyoud.sessions.handed import MAX_FDS_PER_MESSAGE
from fuyoud.sessions.registry import KILLED, Session, SessionRegistry

log = logging.getLogger(__name__)
MAX_MESSAGE = 64 * 1024
HANDSHAKE_TIMEOUT = 30.0  # seconds a connection may take to send its hello
LOG_EVERY = 10.0  # seconds between log lines of one accept errno
BACKOFF = (0.01, 1.0)  # seconds the accept loop waits after an error: first, at most
# Errnos named in the accept errors' metric (bounded labels); others are "other".
ACCEPT_ERRNOS = ("EMFILE", "ENFILE", "ENOBUFS", "ENOMEM", "ECONNABORTED", "EPROTO", "EPERM", "EINTR")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def send_message(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


class SessionListener:
    def __init__(self, path: Path, mode: int, registry: SessionRegistry, gid: int = -1,
                 on_accept_error: Callable[[str], None] = lambda errno_name: None):
        self.path = path
        self.registry = registry
        self._on_accept_error = on_accept_error
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            path.unlink()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            old = os.umask(0o777 & ~mode)  # no window in which the socket is more open than asked
            try:
                self._sock.bind(str(path))
            finally:
                os.umask(old)
            os.chown(path, -1, gid)
            os.chmod(path, mode)
            self._sock.listen(128)
        except BaseException:
            self._sock.close()
            raise
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads = Threads("session socket")
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_logged: dict[str, float] = {}
        self.accept_errors = 0

    def start(self) -> None:
        self._thread = self._threads.start(self._accept_loop, name="session-accept")

    def _accept_loop(self) -> None:
        delay = BACKOFF[0]
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._stopping:
                    return
                self._accept_failed(exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, BACKOFF[1])
                continue
            delay = BACKOFF[0]
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                self._conns.add(conn)
            try:
                started = self._threads.start(self._serve, conn, name="session-conn")
            except RuntimeError as exc:  # ("can't start new thread": out of memory or of tasks)
                started = None
                self._accept_failed(OSError(errno.EAGAIN, str(exc)), delay)
            if started is None:
                self._drop(conn)

    def _accept_failed(self, exc: OSError, delay: float) -> None:
        name = errno.errorcode.get(exc.errno or 0, "")
        label = name if name in ACCEPT_ERRNOS else "other"
        self.accept_errors += 1
        self._on_accept_error(label)
        now = time.monotonic()
        if now - self._last_logged.get(label, -LOG_EVERY) >= LOG_EVERY:
            self._last_logged[label] = now
            hint = (": raise fuyoud's descriptor limit (LimitNOFILE= in fuyoud.service, ulimit -n) or end idle "
                    "clients" if label in ("EMFILE", "ENFILE") else "")
            log.error("session socket: accept failed (%s)%s; %d failure(s) so far, retrying in %.2f s",
                      exc, hint, self.accept_errors, delay)

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        session: Session | None = None
        try:
            session = self._handshake(conn)
            if session is None:
                return
            # After the hello the client sends only hand-overs: serve them until EOF (its
            # death or close).
            while True:
                data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, MAX_FDS_PER_MESSAGE)
                if not data:
                    for fd in fds:
                        os.close(fd)
                    break
                self._hand_over(session, data, fds)
        except OSError as exc:
            log.debug("session socket error: %s", exc)
        finally:
            if session is not None:  # (registered, whether or not the reply reached the client)
                # (a session the client closed with CloseSession is closed already: nothing happens)
                self.registry.close(session, "session socket closed", KILLED)
            self._drop(conn)

    @staticmethod
    def _hand_over(session: Session, data: bytes, fds: list[int]) -> None:
        try:
            message = json.loads(data)
            if not isinstance(message, dict) or "hand" not in message:
                raise ValueError("not a hand-over")
        except ValueError:
            for fd in fds:
                os.close(fd)
            log.warning("session %d sent a message that is not a hand-over on its session socket; ignored", session.id)
            return
        try:
            session.handed.put(message, fds)
        except FuyouError as exc:  # (its descriptors are closed; the request that names it is told why)
            log.warning("session %d: hand-over refused: %s", session.id, exc)

    def _handshake(self, conn: socket.socket) -> Session | None:
        """Read the hello, open the session, reply. The session, once opened, is returned or
        closed here: a client that vanished before the reply reached it holds nothing."""
        pid, uid, _ = peer_credentials(conn)
        started = peers.start_time(pid)
        conn.settimeout(HANDSHAKE_TIMEOUT)
        try:
            hello = json.loads(conn.recv(MAX_MESSAGE) or b"null")
            if not isinstance(hello, dict) or hello.get("hello") != 1:
                raise ValueError("expected a hello message")
            namespace = hello.get("namespace")
            if namespace is not None and not isinstance(namespace, str):
                raise ValueError("namespace must be a string")
        except ValueError as exc:
            send_message(conn, {"error": {"code": "INVALID_ARGUMENT", "message": f"bad hello: {exc}"}})
            return None
        failpoints.hit("session.hello")
        try:
            session = self.registry.open(uid, pid, namespace, started)
        except FuyouError as exc:
            send_message(conn, {"error": {"code": exc.code.name, "message": str(exc)}})
            return None
        try:
            send_lock = threading.Lock()

            def send_segment(segment_id: int, size: int, fd: int) -> None:
                with send_lock:
                    send_message(conn, {"segment": segment_id, "size": size}, [fd])

            def disconnect() -> None:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            session.send_segment = send_segment
            session.disconnect = disconnect
            failpoints.hit("session.opened")
            send_message(conn, {"session": session.id, "token": session.token,
                                "namespace": session.namespace, "version": __version__})
            conn.settimeout(None)
        except BaseException:
            self.registry.close(session, "the client went away during the handshake", KILLED)
            raise
        return session

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop_accepting(self) -> None:
        """No new connections (the socket file goes); the sessions' connections stay."""
        self._stopping = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def close(self, timeout: float = 10.0) -> list[str]:
        """Stop accepting, end every connection (their sessions close as after EOF) and
        join every thread the listener started; returns the names of those still running
        after ``timeout`` seconds (none, unless a session's reclaim hangs)."""
        self.stop_accepting()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        left = self._threads.join(timeout)
        self._sock.close()
        return left

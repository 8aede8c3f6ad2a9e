"""The session socket: who the client is, its shared memory, and when it dies.

gRPC over a unix socket can neither see the peer's credentials nor pass file
descriptors, so every client process also holds one connection to this plain AF_UNIX
SOCK_SEQPACKET socket (message boundaries kept, fds passed with SCM_RIGHTS):

    client -> daemon   {"hello": 1, "namespace": str | null, "client": str}
    daemon -> client   {"session": id, "token": str, "namespace": str, "version": str}
                    or {"error": {"code": "PERMISSION_DENIED", "message": str}}
    daemon -> client   {"segment": id, "size": n}  + the segment's memfd   (any time later)

The daemon reads uid/pid with SO_PEERCRED. EOF (or any error) on the connection ends
the session: everything it held is reclaimed.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from pathlib import Path

from fuyoud import __version__
from fuyoud.errors import FuyouError
from fuyoud.sessions import Session, SessionRegistry

log = logging.getLogger(__name__)
MAX_MESSAGE = 64 * 1024


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
    def __init__(self, path: Path, mode: int, registry: SessionRegistry, gid: int = -1):
        self.path = path
        self.registry = registry
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            path.unlink()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o777 & ~mode)  # no window in which the socket is more open than asked
        try:
            self._sock.bind(str(path))
        finally:
            os.umask(old)
        os.chown(path, -1, gid)
        os.chmod(path, mode)
        self._sock.listen(128)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="session-accept", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stopping:
                    return
                raise
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="session-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        session: Session | None = None
        try:
            session = self._handshake(conn)
            if session is None:
                return
            # The client never sends anything else: block until EOF (its death or close).
            while conn.recv(MAX_MESSAGE):
                pass
        except OSError as exc:
            log.debug("session socket error: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            if session is not None:
                self.registry.close(session, "session socket closed")
            conn.close()

    def _handshake(self, conn: socket.socket) -> Session | None:
        pid, uid, _ = peer_credentials(conn)
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
        try:
            session = self.registry.open(uid, pid, namespace)
        except FuyouError as exc:
            send_message(conn, {"error": {"code": exc.code.name, "message": str(exc)}})
            return None
        send_lock = threading.Lock()

        def send_segment(segment_id: int, size: int, fd: int) -> None:
            with send_lock:
                send_message(conn, {"segment": segment_id, "size": size}, [fd])

        session.send_segment = send_segment
        send_message(conn, {"session": session.id, "token": session.token,
                            "namespace": session.namespace, "version": __version__})
        return session

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stopping = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

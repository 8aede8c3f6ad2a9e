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
    daemon -> client   {"handed": key} or {"handed": key, "error": {...}}  (its answer, once a
                       key is complete or refused: sessions/connection.py)

The daemon reads uid/pid with SO_PEERCRED. EOF (or any error) on the connection ends
the session: everything it held is reclaimed. A client that goes away at any point of
the handshake (before its hello, after it, before or after the reply) leaves no session
and no held namespace: a session registered for it is closed however the handshake
ends, and a hello that does not come within HANDSHAKE_TIMEOUT ends the connection.

Threads and descriptors are bounded, whatever the clients do. One thread (the event
loop: concurrency/loop.py) accepts, reads every connection's hello (with its deadline)
and later messages, and ends connections; what may block runs on two small fixed pools,
OPEN_WORKERS (4) threads for ``registry.open`` and the reply, CLOSE_WORKERS (4) for
``registry.close`` (a session's reclaim waits for its requests): neither stalls the
loop, nor each other. A connection has one such job at a time, and is read again only
once it is done: its hand-overs follow its session. The request threads send the
segments' descriptors (``session.send_segment``: blocking sends, a lock per connection).
A connection is refused at accept, with {"error": {"code": "RESOURCE_EXHAUSTED", ...}}
(the client raises ResourceExhausted) and counted (``on_refused``,
fuyoud_session_connections_refused_total{limit}), when the daemon holds MAX_CONNECTIONS
(4096) already (limit "total") or its uid MAX_CONNECTIONS_PER_UID (1024; "per_uid"):
sessions/limits.py. A silent connection holds its descriptor HANDSHAKE_TIMEOUT (30 s) at
most. An environment variable read at start sets each limit: FUYOUD_HANDSHAKE_TIMEOUT,
FUYOUD_MAX_CONNECTIONS, FUYOUD_MAX_CONNECTIONS_PER_UID (tests, or an operator's unit).

The loop outlives the errors accept() can meet while the daemon runs: out of file
descriptors (EMFILE, ENFILE), of memory (ENOBUFS, ENOMEM), a connection aborted early.
Each is logged (at most every LOG_EVERY seconds per errno) and counted
(``on_accept_error``, fuyoud_session_accept_errors_total), and accepting backs off and
retries (the connections already there are served meanwhile): a daemon short of
descriptors refuses nothing for good, and serves the waiting clients once descriptors
are free again. Every thread the listener starts is tracked; ``close`` ends and joins
them all.
"""
from __future__ import annotations

import errno
import functools
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from fuyoud import __version__, failpoints
from fuyoud.concurrency.loop import EventLoop, Timer
from fuyoud.concurrency.threads import Threads
from fuyoud.concurrency.workers import Workers
from fuyoud.errors import FuyouError
from fuyoud.sessions import peers
from fuyoud.sessions.connection import CLOSING, HELLO, OPENING, SERVING, Connection, peer_credentials
from fuyoud.sessions.handed import MAX_FDS_PER_MESSAGE
from fuyoud.sessions.limits import ConnectionLimits, Refusals, env_number
from fuyoud.sessions.registry import KILLED, Session, SessionRegistry

log = logging.getLogger(__name__)
MAX_MESSAGE = 64 * 1024
HANDSHAKE_TIMEOUT = env_number("FUYOUD_HANDSHAKE_TIMEOUT", 30.0)  # seconds a connection may take to send its hello
OPEN_WORKERS = 4  # threads running handshakes' registry.open and reply
CLOSE_WORKERS = 4  # threads running sessions' registry.close (their reclaim)
ACCEPTS_PER_TURN = 64  # connections accepted before the loop serves the others again
LOG_EVERY = 10.0  # seconds between log lines of one accept errno (or of one limit's refusals)
BACKOFF = (0.01, 1.0)  # seconds accepting waits after an error: first, at most
# Errnos named in the accept errors' metric (bounded labels); others are "other".
ACCEPT_ERRNOS = ("EMFILE", "ENFILE", "ENOBUFS", "ENOMEM", "ECONNABORTED", "EPROTO", "EPERM", "EINTR")

class SessionListener:
    def __init__(self, path: Path, mode: int, registry: SessionRegistry, gid: int = -1,
                 on_accept_error: Callable[[str], None] = lambda errno_name: None,
                 on_refused: Callable[[str], None] = lambda limit: None):
        self.path = path
        self.registry = registry
        self._on_accept_error = on_accept_error
        self._on_refused = on_refused
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
            self._sock.setblocking(False)  # (the loop accepts what is there, and waits for nothing)
            self._events = EventLoop()
        except BaseException:
            self._sock.close()
            raise
        self._limits = ConnectionLimits()
        self._lock = threading.Lock()  # guards _conns and _closing (close() reads them)
        self._conns: dict[socket.socket, Connection] = {}
        self._closing = False
        self._refusals = Refusals(self._events)
        self._threads = Threads("session socket")
        self._opens = Workers(self._threads, OPEN_WORKERS, "session-conn")
        self._closes = Workers(self._threads, CLOSE_WORKERS, "session-conn")
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._listening = False
        self._resume: Timer | None = None  # accepting again after an error
        self._delay = BACKOFF[0]
        self._last_logged: dict[str, float] = {}
        self.accept_errors = 0
        self.refused = 0

    def start(self) -> None:
        self._opens.start()
        self._closes.start()
        self._thread = self._threads.start(self._loop, name="session-accept")

    # -- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._listen(True)
            while True:
                if self._stopping:
                    self._listen(False)
                with self._lock:
                    if self._closing and not self._conns:
                        return
                self._events.run_once()
        finally:
            self._refusals.close()
            self._opens.close()
            self._closes.close()

    def _guarded(self, step: Callable[[Connection], None], c: Connection) -> None:
        """Run one step of a connection on the loop: a failure ends that connection (its
        session closes), never the loop."""
        try:
            step(c)
        except Exception:  # noqa: BLE001
            log.exception("session socket: serving a connection failed; ending it")
            try:
                self._end(c)
            except Exception:  # noqa: BLE001
                log.exception("session socket: ending a connection failed")
                c.shutdown()  # (its EOF comes back to the loop)

    def _listen(self, on: bool) -> None:
        if not on and self._resume is not None:
            self._resume.cancel()
            self._resume = None
        on = on and not self._stopping
        if on != self._listening:
            self._events.watch(self._sock, self._accept) if on else self._events.unwatch(self._sock)
            self._listening = on

    def _watch(self, c: Connection, on: bool) -> None:
        if on != c.watched:
            if on:
                self._events.watch(c.sock, functools.partial(self._guarded, self._readable, c))
            else:
                self._events.unwatch(c.sock)
            c.watched = on

    def _time_out(self, c: Connection, seconds: float | None) -> None:
        """End the connection in ``seconds`` unless it moves on (None: it did)."""
        if c.timer is not None:
            c.timer.cancel()
        c.timer = None if seconds is None else self._events.call_at(time.monotonic() + seconds, self._guarded,
                                                                    self._timed_out, c)

    def _timed_out(self, c: Connection) -> None:
        c.timer = None
        if c.state == HELLO:
            log.debug("session socket: no hello from pid %d within %g s; hanging up", c.pid, HANDSHAKE_TIMEOUT)
            self._drop(c)

    # -- accepting ----------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                self._listen(False)  # (the connections already there are served meanwhile)
                if self._stopping:
                    return
                self._accept_failed(exc, self._delay)
                self._resume = self._events.call_at(time.monotonic() + self._delay, self._listen, True)
                self._delay = min(self._delay * 2, BACKOFF[1])
                return
            self._delay = BACKOFF[0]
            try:
                self._admit(sock)
            except Exception:  # noqa: BLE001 - one connection's failure must not end the loop
                log.exception("session socket: taking a connection failed")
                sock.close()

    def _accept_failed(self, exc: OSError, delay: float) -> None:
        name = errno.errorcode.get(exc.errno or 0, "")
        label = name if name in ACCEPT_ERRNOS else "other"
        self.accept_errors += 1
        self._on_accept_error(label)
        if self._log_due(label):
            hint = (": raise fuyoud's descriptor limit (LimitNOFILE= in fuyoud.service, ulimit -n) or end idle "
                    "clients" if label in ("EMFILE", "ENFILE") else "")
            log.error("session socket: accept failed (%s)%s; %d failure(s) so far, retrying in %.2f s",
                      exc, hint, self.accept_errors, delay)

    def _log_due(self, what: str) -> bool:
        now = time.monotonic()
        if now - self._last_logged.get(what, -LOG_EVERY) >= LOG_EVERY:
            self._last_logged[what] = now
            return True
        return False

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        try:
            pid, uid, _ = peer_credentials(sock)
        except OSError as exc:
            log.debug("session socket: no credentials for a connection (%s)", exc)
            sock.close()
            return
        limit = self._limits.take(uid)
        if limit is not None:
            self._refuse(sock, pid, uid, limit)
            return
        c = Connection(sock, pid, uid, peers.start_time(pid))
        try:
            self._watch(c, True)
            self._time_out(c, HANDSHAKE_TIMEOUT)
        except BaseException:
            self._limits.give_back(uid)
            self._watch(c, False)
            raise
        with self._lock:
            self._conns[sock] = c
            if self._closing:  # (close() began after it came: it ends as the others)
                c.shutdown()

    def _refuse(self, sock: socket.socket, pid: int, uid: int, limit: str) -> None:
        self.refused += 1
        self._on_refused(limit)
        message = self._limits.refusal(limit, uid)
        if self._log_due(f"refused {limit}"):
            log.warning("session socket: refused a connection of uid %d (pid %d): %s; %d refused so far", uid, pid,
                        message, self.refused)
        self._refusals.refuse(sock, message)

    # -- a connection's messages ------------------------------------------------------
    def _readable(self, c: Connection) -> None:  # (watched only while HELLO or SERVING)
        self._read_hello(c) if c.state == HELLO else self._read_message(c)

    def _read_hello(self, c: Connection) -> None:
        try:
            data = c.sock.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            log.debug("session socket error: %s", exc)
            self._drop(c)
            return
        self._watch(c, False)
        self._time_out(c, None)
        try:
            hello = json.loads(data or b"null")
            if not isinstance(hello, dict) or hello.get("hello") != 1:
                raise ValueError("expected a hello message")
            namespace = hello.get("namespace")
            if namespace is not None and not isinstance(namespace, str):
                raise ValueError("namespace must be a string")
        except (ValueError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
            try:
                c.send_now({"error": {"code": "INVALID_ARGUMENT", "message": f"bad hello: {reason}"}})
            except OSError:
                pass
            self._drop(c)
            return
        c.state = OPENING
        try:
            self._opens.submit(self._open, c, namespace)
        except RuntimeError:  # (the workers are closed: the loop is ending)
            self._drop(c)

    def _read_message(self, c: Connection) -> None:
        """After the hello the client sends only hand-overs; EOF (its death or close) ends
        its session."""
        try:
            data, fds, _, _ = socket.recv_fds(c.sock, MAX_MESSAGE, MAX_FDS_PER_MESSAGE,
                                              socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            return
        except OSError as exc:
            log.debug("session socket error: %s", exc)
            data, fds = b"", []
        if data:
            self._hand_over(c, data, fds)
            return
        for fd in fds:
            os.close(fd)
        self._end(c)

    def _end(self, c: Connection) -> None:
        """The connection is over: its session (if any) closes on a close worker, then the
        connection goes."""
        if c.state in (OPENING, CLOSING):
            return  # (its job ends it)
        if c.session is None:
            self._drop(c)
            return
        self._watch(c, False)
        c.state = CLOSING
        try:
            self._closes.submit(self._close_session, c)
        except RuntimeError:  # (the workers are closed: the loop is ending; closed here then)
            self._close_session(c)

    def _drop(self, c: Connection) -> None:
        """Forget the connection and close it (its session, if any, is closed already)."""
        self._watch(c, False)
        self._time_out(c, None)
        with self._lock:
            counted = self._conns.pop(c.sock, None) is not None
        if counted:
            self._limits.give_back(c.uid)
        c.sock.close()

    @staticmethod
    def _hand_over(c: Connection, data: bytes, fds: list[int]) -> None:
        session = c.session
        try:
            message = json.loads(data)
            if not isinstance(message, dict) or "hand" not in message:
                raise ValueError("not a hand-over")
        except (ValueError, RecursionError):
            for fd in fds:
                os.close(fd)
            log.warning("session %d sent a message that is not a hand-over on its session socket; ignored", session.id)
            return
        done, error = False, None
        try:
            done = session.handed.put(message, fds)
        except FuyouError as exc:  # (its descriptors are closed; the client is told why)
            log.warning("session %d: hand-over refused: %s", session.id, exc)
            error = exc
        answer = c.hand_over_answer(message, done, error)
        if answer is not None:
            try:
                c.send_now(answer)
            except OSError as exc:  # (its socket is full: the client reads none of its messages)
                log.warning("session %d: cannot answer its hand-over on its session socket: %s", session.id, exc)

    # -- the workers' jobs --------------------------------------------------------------
    def _open(self, c: Connection, namespace: str | None) -> None:
        """(an open worker) The rest of the handshake; then the loop takes the connection back."""
        session = None
        try:
            session = self._handshake(c, namespace)
        except OSError as exc:  # (the client went away: its session, if any, is closed already)
            log.debug("session socket: handshake of pid %d failed: %s", c.pid, exc)
        except Exception:  # noqa: BLE001 - the connection ends; its session is closed already
            log.exception("session socket: handshake of pid %d failed", c.pid)
        finally:
            self._events.post(self._guarded, functools.partial(self._opened, session=session), c)

    def _opened(self, c: Connection, session: Session | None) -> None:
        c.session, c.state = session, SERVING  # (first: a failure below ends it as any serving connection)
        if session is None:
            self._drop(c)
        else:
            self._watch(c, True)  # (EOF already, if the client went away meanwhile: its session closes)

    def _close_session(self, c: Connection) -> None:
        """(a close worker) The client is gone: its session closes (a session the client
        closed with CloseSession is closed already: nothing happens); then the connection."""
        try:
            self.registry.close(c.session, "session socket closed", KILLED)
        finally:
            self._events.post(self._guarded, self._drop, c)

    def _handshake(self, c: Connection, namespace: str | None) -> Session | None:
        """Open the session and reply. The session, once opened, is returned or closed
        here: a client that vanished before the reply reached it holds nothing."""
        failpoints.hit("session.hello")
        try:
            session = self.registry.open(c.uid, c.pid, namespace, c.started)
        except FuyouError as exc:
            c.send_now({"error": {"code": exc.code.name, "message": str(exc)}})
            return None
        try:
            session.send_segment = lambda segment_id, size, fd: c.send({"segment": segment_id, "size": size}, [fd])
            session.disconnect = c.shutdown
            failpoints.hit("session.opened")
            c.send_now({"session": session.id, "token": session.token, "namespace": session.namespace,
                        "version": __version__})
        except BaseException:
            self.registry.close(session, "the client went away during the handshake", KILLED)
            raise
        return session

    # -- life ------------------------------------------------------------------------
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
        self._events.wake()

    def close(self, timeout: float = 10.0) -> list[str]:
        """Stop accepting, end every connection (their sessions close as after EOF) and
        join every thread the listener started; returns the names of those still running
        after ``timeout`` seconds (none, unless a session's reclaim hangs)."""
        self.stop_accepting()
        with self._lock:
            self._closing = True
            conns = list(self._conns.values())
        for c in conns:
            c.shutdown()
        self._events.wake()
        if self._thread is None:  # (never started: no loop ends the workers)
            self._opens.close()
            self._closes.close()
        left = self._threads.join(timeout)
        self._sock.close()
        if not left:
            self._events.close()
        return left

"""One connection to the session socket (sessions/listener.py): who is at the other end
(SO_PEERCRED), where its handshake is, and what the daemon sends on it.

Its socket stays blocking: the request threads send segments' descriptors on it and wait
for room (one message at a time); the event loop reads it only when it is readable
(MSG_DONTWAIT) and sends only what can go at once (``send_now``): the reply to the
hello, the answer to a hand-over. SOCK_SEQPACKET keeps each message whole whoever sends.
"""
from __future__ import annotations

import json
import socket
import struct
import threading

from fuyoud.errors import FuyouError

# Its states (only the loop changes them).
HELLO = "hello"  # waiting for its hello (a timer: the handshake timeout)
OPENING = "opening"  # an open worker runs its handshake (not read meanwhile)
SERVING = "serving"  # its session is live: hand-overs, then EOF
CLOSING = "closing"  # a close worker ends its session (not read meanwhile)
MAX_KEY = 64  # the longest hand-over key answered (sessions/handed.py KEY_RE)


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


class Connection:
    __slots__ = ("sock", "pid", "uid", "started", "state", "timer", "session", "watched", "_send_lock",
                 "_refused_keys")

    def __init__(self, sock: socket.socket, pid: int, uid: int, started: int | None):
        self.sock, self.pid, self.uid, self.started = sock, pid, uid, started
        self.state = HELLO
        self.timer = None  # (the loop's: when it times out)
        self.session = None  # (its Session, once opened)
        self.watched = False
        self._send_lock = threading.Lock()
        self._refused_keys: set[str] = set()  # hand-overs refused and answered, their last message to come

    def send(self, message: dict, fds: list[int] = ()) -> None:
        """Send, waiting for room (a request thread's: a segment and its descriptor)."""
        with self._send_lock:
            send_message(self.sock, message, fds)

    def send_now(self, message: dict) -> None:
        """Send without waiting: OSError (BlockingIOError too) where it cannot go at once."""
        self.sock.send(json.dumps(message).encode(), socket.MSG_DONTWAIT)

    def shutdown(self) -> None:
        """End the connection both ways (the loop then reads its EOF)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def hand_over_answer(self, message: dict, done: bool, error: FuyouError | None) -> dict | None:
        """What the daemon answers a hand-over message (sessions/handed.py), if anything:
        {"handed": key} once its key is complete; {"handed": key, "error": ...} for the
        first of its messages refused, and nothing for the others of that hand-over (the
        client waits for one answer per key)."""
        key, last = message.get("hand"), bool(message.get("last", True))
        if not isinstance(key, str) or len(key) > MAX_KEY:
            return None  # (nobody can wait for that key: it is refused as such)
        if error is None:
            self._refused_keys.discard(key)
            return {"handed": key} if done else None
        first = key not in self._refused_keys
        if last:
            self._refused_keys.discard(key)
        elif first:
            if len(self._refused_keys) >= 4 * MAX_KEY:  # (a client that never sends the last: forget them)
                self._refused_keys.clear()
            self._refused_keys.add(key)
        return {"handed": key, "error": {"code": error.code.name, "message": str(error)}} if first else None

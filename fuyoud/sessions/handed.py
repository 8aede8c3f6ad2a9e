"""Files a client handed its session over the session socket, for a request that follows.

A checkpoint is the user's: the client creates its directory and files with its own
rights and hands the daemon their descriptors (SCM_RIGHTS); the daemon reads and writes
only through them, never by path, so it can do nothing there the user could not
(docs/design/threat-model.md). The client sends, before the gRPC request that names
``key``, one or more messages (at most ``MAX_FDS_PER_MESSAGE`` descriptors each):

    client -> daemon   {"hand": key, "names": [str, ...], "last": bool}  + one fd per name

The daemon answers the last message of a key on the same socket (``{"handed": key}``, with
``"error"`` where it was refused), and the client sends its request only then: the socket
and the gRPC channel are not ordered with each other, and so no request waits for files
that may never come. The request takes what was handed under its key (``take``) and owns
the descriptors from then on. What is never taken goes when the session closes. A session
holds at most ``MAX_KEYS`` keys and ``MAX_FDS`` descriptors: beyond them a hand-over is
refused, and its descriptors closed at once.
"""
from __future__ import annotations

import os
import re
import threading

from fuyoud.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from fuyoud.sessions.names import shown

MAX_FDS_PER_MESSAGE = 250  # (the kernel's SCM_MAX_FD is 253)
MAX_FDS = 16384  # descriptors one session may have handed and not yet had taken
MAX_KEYS = 16
KEY_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class Handed:
    """One handed set: names in order and their descriptors (owned: ``close`` closes
    those not taken with ``pop``)."""

    def __init__(self, key: str):
        self.key = key
        self.names: list[str] = []
        self.fds: list[int] = []
        self.complete = False
        self.error: str | None = None

    def pop(self, name: str) -> int:
        """The descriptor handed as ``name`` (the caller owns it now)."""
        try:
            i = self.names.index(name)
        except ValueError:
            raise InvalidArgument(f"the client handed no file {shown(name)} under {shown(self.key)}") from None
        fd = self.fds[i]
        del self.names[i], self.fds[i]
        return fd

    def has(self, name: str) -> bool:
        return name in self.names

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.names, self.fds = [], []

    def __enter__(self) -> "Handed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HandedFiles:
    """What one session was handed and has not taken yet (thread-safe: the session socket's
    thread puts, a request's thread takes)."""

    def __init__(self):
        self._sets: dict[str, Handed] = {}
        self._lock = threading.Lock()  # (the socket's thread puts, a request's takes; nothing waits)
        self._closed = False

    def _count(self) -> int:
        return sum(len(h.fds) for h in self._sets.values())

    def put(self, message: dict, fds: list[int]) -> bool:
        """One hand-over message and its descriptors (owned from here: closed if refused);
        True when it completed its key (the daemon then answers the client)."""
        try:
            key, names, last = message.get("hand"), message.get("names"), message.get("last", True)
            if not isinstance(key, str) or not KEY_RE.match(key):
                raise InvalidArgument(f"bad hand-over key {shown(key, 32)}")
            if (not isinstance(names, list) or len(names) != len(fds) or len(names) > MAX_FDS_PER_MESSAGE
                    or not all(isinstance(n, str) and 0 < len(n) <= 64 for n in names)):
                self._fail(key, f"a hand-over message for {shown(key)} names {shown(names, 48)} with {len(fds)} "
                           "descriptors (one short name per descriptor, at most "
                           f"{MAX_FDS_PER_MESSAGE} a message)")
                raise InvalidArgument("bad hand-over message")
            with self._lock:
                if self._closed:
                    raise FailedPrecondition("session closed")
                handed = self._sets.get(key)
                if handed is None:
                    if len(self._sets) >= MAX_KEYS:
                        raise ResourceExhausted(f"more than {MAX_KEYS} hand-overs pending")
                    handed = self._sets[key] = Handed(key)
                if handed.complete or handed.error:
                    raise InvalidArgument(f"hand-over {shown(key)} is complete already")
                if self._count() + len(fds) > MAX_FDS:
                    handed.error = (f"the session handed more than {MAX_FDS} descriptors not yet used; hand fewer "
                                    "at a time")
                    raise ResourceExhausted(handed.error)
                handed.names.extend(names)
                handed.fds.extend(fds)
                fds = []
                handed.complete = bool(last)
                return handed.complete
        finally:
            for fd in fds:  # (refused: none of them is kept)
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _fail(self, key: str, error: str) -> None:
        with self._lock:
            handed = self._sets.get(key)
            if handed is None and len(self._sets) < MAX_KEYS and not self._closed:
                handed = self._sets[key] = Handed(key)
            if handed is not None:
                handed.error = error

    def take(self, key: str) -> Handed:
        """What was handed under ``key``, whole (the caller owns it: use it as a context
        manager); FailedPrecondition if nothing complete was (the client waits for the
        daemon's answer to its hand-over before it asks)."""
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise InvalidArgument(f"bad hand-over key {shown(key, 32)}")
        with self._lock:
            handed = self._sets.get(key)
            if handed is None or not (handed.complete or handed.error):
                raise FailedPrecondition(f"no files were handed under {shown(key)} on this session's socket (a "
                                         "client hands them, and waits for the daemon's answer, before its request)")
            del self._sets[key]
        if handed.error:
            handed.close()
            raise InvalidArgument(handed.error)
        return handed

    def close(self) -> None:
        """The session is over: every descriptor not taken is closed."""
        with self._lock:
            self._closed = True
            for handed in self._sets.values():
                handed.close()
            self._sets.clear()

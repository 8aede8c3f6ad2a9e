"""The processes at the other end of session sockets: whether one is still there.

SO_PEERCRED gives the pid of the process that opened a session (in the daemon's pid
namespace; 0 where that process is not visible from it). EOF on the session socket is
the usual sign of its death, but a process that forked without exec (a DataLoader
worker, multiprocessing's "fork") leaves the socket open in its children: the session
would outlive its process, and hold its namespace, for as long as they live. The
reaper (sessions.py ``reap``, run by housekeeping) asks here instead: a pid that no longer
exists, is a zombie, or is another process now (its start time differs from the one
read at the handshake: the pid was reused) is gone.
"""
from __future__ import annotations

import os


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, first);
    None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].decode(errors="replace").split()


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot), or None where unknown."""
    fields = _stat(pid) if pid > 0 else None
    try:
        return int(fields[19]) if fields else None  # (field 22 of the whole line)
    except (IndexError, ValueError):
        return None


def gone(pid: int, started: int | None) -> bool:
    """Whether process ``pid`` (started at ``started``, as ``start_time`` read it then)
    has ended. Unknown is not gone: a pid of 0 (not visible here), or a process of another
    user that /proc hides (hidepid) and kill(0) may not signal."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # (it exists: another user's)
    fields = _stat(pid)
    if fields is None:
        return False
    if fields[0] in ("Z", "X"):  # dead, not yet waited for by its parent
        return True
    return started is not None and start_time(pid) not in (None, started)

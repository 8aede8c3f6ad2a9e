"""Whether this user can reach a daemon's socket, told at once and with what to do (join
the daemon's group, start the daemon) rather than after gRPC's timeout."""
from __future__ import annotations

import grp
import os
import pwd
import socket
import time

from fuyou_client import errors

NO_SOCKET_WAIT_S = 1.0  # how long connecting waits for a socket that is not there yet


def _group_of(path: str) -> str:
    gid = os.stat(path).st_gid
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def denied(path: str, what: str) -> errors.PermissionDenied:
    """The error of a user whom the file system keeps away from a daemon's socket."""
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    try:
        group = _group_of(path)
    except OSError:
        group = "the daemon's group"
    return errors.PermissionDenied(
        f"permission denied on {path} ({what}): add user {user} to group {group} (`usermod -aG {group} {user}`, "
        "then log in again), or ask the operator to admit this user; root and the daemon's own user may "
        "always connect")


def _first_closed_dir(path: str) -> str:
    """The first directory on the way to ``path`` that this user may not enter."""
    d = os.path.dirname(os.path.abspath(path))
    parts = d.split("/")[1:]
    for i in range(1, len(parts) + 1):
        prefix = "/" + "/".join(parts[:i])
        if not os.access(prefix, os.X_OK):
            return prefix
    return d


def reachable(path: str, timeout: float) -> None:
    """Wait (briefly) for the socket of a daemon that is starting, and tell a user the file
    system keeps out, or a socket nobody listens on, at once rather than after gRPC's
    timeout."""
    deadline = time.monotonic() + min(timeout, NO_SOCKET_WAIT_S)
    while True:
        try:
            os.stat(path)
            break
        except FileNotFoundError:
            pass
        except PermissionError:  # a directory on the way that this user may not enter
            raise denied(_first_closed_dir(path), "a directory on the way to the socket") from None
        if time.monotonic() >= deadline:
            raise errors.DaemonUnavailable(
                f"no fuyoud answers at {path} (no socket there): start it with "
                "`systemctl start fuyoud` or `fuyoud`, or use fuyou_client.start_daemon()")
        time.sleep(0.05)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        try:
            probe.connect(path)
        except PermissionError:
            raise denied(path, "the daemon's control socket") from None
        except ConnectionRefusedError:
            raise errors.DaemonUnavailable(
                f"no fuyoud answers at {path}: the socket is there but nothing listens on it (a daemon that "
                "died?): start it with `systemctl start fuyoud` or `fuyoud`") from None
        except OSError:
            pass  # (anything else: let gRPC say what it finds)

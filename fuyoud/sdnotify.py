"""The systemd notification protocol (sd_notify): a datagram to $NOTIFY_SOCKET."""
from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send e.g. "READY=1"; returns False when not run under a notifying supervisor."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(path)
        sock.sendall(state.encode())
    return True

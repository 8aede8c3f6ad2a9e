"""The systemd notification protocol (sd_notify): a datagram to $NOTIFY_SOCKET."""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send e.g. "READY=1"; False when there is no supervisor listening (never raises:
    a vanished supervisor must not stop a clean shutdown)."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(path)
            sock.sendall(state.encode())
    except OSError as exc:
        log.debug("sd_notify %r to %s failed: %s", state, path, exc)
        return False
    return True

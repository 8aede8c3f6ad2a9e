"""Failpoints: named places where tests make the daemon misbehave on purpose.

The daemon reads them once, at import, from the environment:

    FUYOUD_FAILPOINTS="rpc.Status=hang,rpc.SwapOut=error"

Actions: ``hang`` (block the calling thread until the process ends), ``sleep(S)``
(block S seconds), ``error`` (raise an internal error), ``kill`` (SIGKILL the daemon at
that point: crash tests). Unset, ``hit`` costs one dictionary lookup. Names in use:
``rpc.<Method>`` (before a control request is served), ``session.hello`` (the session
socket read a client's hello) and ``session.opened`` (its session is registered, the
reply not sent yet), ``allocate.looked_up`` and ``reserve.looked_up`` (Allocate, Reserve: the
session looked up, the pool not asked yet), ``session.close.<step>`` (a closing session's
step starts: ``optimizer``, ``namespace``, ``transient``; server.py ``_session_closed``),
``optimizer.prefetch`` (a read-ahead of a group's state starts),
``checkpoint.*`` (checkpoints/checkpointer.py). Tests of an in-process daemon arm them with ``armed``.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from contextlib import contextmanager

log = logging.getLogger(__name__)
ENV = "FUYOUD_FAILPOINTS"
_ACTION = re.compile(r"^(hang|error|kill|sleep\((\d+(?:\.\d+)?)\))$")


class FailpointError(RuntimeError):
    """Raised by a failpoint set to ``error``."""


def parse(spec: str) -> dict[str, str]:
    points = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, action = part.partition("=")
        if not sep or not name or not _ACTION.match(action):
            raise ValueError(f"bad {ENV} entry {part!r}: want NAME=hang|error|kill|sleep(SECONDS)")
        points[name] = action
    return points


_points = parse(os.environ.get(ENV, ""))
if _points:
    log.warning("failpoints armed: %s", _points)


def hit(name: str) -> None:
    action = _points.get(name)
    if action is None:
        return
    log.warning("failpoint %s: %s", name, action)
    if action == "hang":
        threading.Event().wait()
    elif action == "error":
        raise FailpointError(f"failpoint {name}")
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        time.sleep(float(_ACTION.match(action).group(2)))


@contextmanager
def armed(**points: str):
    """Arm failpoints (``name=action``; dots in names written as ``__``) for the duration,
    in this process: the seam for tests of an in-process daemon."""
    names = {k.replace("__", "."): v for k, v in points.items()}
    parse(",".join(f"{k}={v}" for k, v in names.items()))  # (the same checks as the environment's)
    before = dict(_points)
    _points.update(names)
    try:
        yield
    finally:
        _points.clear()
        _points.update(before)

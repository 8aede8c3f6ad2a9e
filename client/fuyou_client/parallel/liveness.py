"""Which rank was lost: every rank of a job beats a counter in the job's rendezvous store
(the TCPStore at MASTER_ADDR:MASTER_PORT that torchrun or init_process_group made); when
a collective fails, ``lost`` names the ranks whose counters stopped, so that the error
says "rank 2 is lost" rather than gloo's "connection closed by peer 127.0.0.1:39646".

One beat thread per process, started by the first engine of a job, with a store client
of its own (the training thread's collectives never wait for it).
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("fuyou_client.parallel")

INTERVAL = 0.5  # seconds between beats
WATCH = 4 * INTERVAL  # how long ``lost`` watches the counters

_lock = threading.Lock()
_beating: dict = {}  # (host, port, rank) -> the beat thread
_stop = threading.Event()  # (at exit: no store call may be under way while the interpreter ends)


def _key(rank: int) -> str:
    return f"fuyou/alive/{rank}"


def _left(rank: int) -> str:
    return f"fuyou/left/{rank}"  # (set by a process that ends normally: gone, not lost)


def _store():
    """A client of the job's store of its own, or None (a group made without one)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=2))


def start(rank: int) -> None:
    """Beat for ``rank`` (this process's global rank) from now on (idempotent)."""
    where = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), rank)
    with _lock:
        if where in _beating or not all(where[:2]):
            return
        try:
            store = _store()
        except Exception as exc:  # noqa: BLE001 - only the naming of a lost rank depends on it
            log.info("no heartbeat (the job's store is unreachable: %s)", exc)
            return
        thread = threading.Thread(target=_beat, args=(store, rank), name="fuyou-heartbeat", daemon=True)
        if not _beating:
            atexit.register(_stop_all)
        _beating[where] = thread
        thread.start()


def _beat(store, rank: int) -> None:
    while not _stop.is_set():
        try:
            store.add(_key(rank), 1)
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing left to tell
            return
        _stop.wait(INTERVAL)
    try:
        store.set(_left(rank), "1")
    except Exception:  # noqa: BLE001 - as above
        pass


def _stop_all() -> None:
    _stop.set()
    for thread in list(_beating.values()):
        thread.join(timeout=3)


def lost(ranks, watch: float = WATCH) -> str:
    """Which of ``ranks`` (global ranks) stopped beating, as a phrase for an error message
    ("" when it cannot tell)."""
    try:
        store = _store()
        if store is None:
            return ""
        before = {r: store.add(_key(r), 0) for r in ranks}
        time.sleep(watch)
        after = {r: store.add(_key(r), 0) for r in ranks}
    except Exception:  # noqa: BLE001 - the store's host is the one lost
        return "the job's store is unreachable: the rank that hosts it (rank 0, or torchrun's agent) is lost"
    gone = [r for r in ranks if before[r] and after[r] == before[r]]  # (0: a rank that never beat)
    try:
        gone = [r for r in gone if not store.check([_left(r)])]  # (ended normally since: not lost)
    except Exception:  # noqa: BLE001 - the store went meanwhile: what was seen stands
        pass
    if not gone:
        return ""
    return f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} stopped answering (lost)"

"""Starting and stopping the daemon: a graceful stop lets the requests running finish and
refuses every other as DaemonUnavailable; every thread the daemon started is joined
before the store and the engine close; a start or a stop that fails releases what it
took and says why."""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import sqlite3
import threading
import time
from collections import Counter

import grpc
import pytest
import torch

import fuyou_client
from conftest import SMALL, in_process_config, random_bytes
from fuyou_client import AdamW, In, Out
from fuyoud import failpoints
from fuyoud.io.threadpool import ThreadPoolEngine
from fuyoud.server import Daemon, StopFailed
from fuyoud.storage.device import LOCK_FILE

MiB = 1 << 20
OURS = ("session-accept", "session-conn", "optim-prefetch", "housekeeping")


def test_a_stopping_daemon_finishes_what_runs_and_refuses_the_rest_as_daemon_unavailable(short_tmp):
    """Four clients swap in and out in a loop when SIGTERM comes, each with a SwapIn
    running in the daemon (a failpoint holds each for 3 s): those complete, every later
    call raises DaemonUnavailable (none SessionClosed, none a bare CANCELLED), and the
    daemon exits 0."""
    env = dict(os.environ, FUYOUD_FAILPOINTS="rpc.SwapIn=sleep(3)")
    d = fuyou_client.start_daemon(short_tmp / "state", config=SMALL, env=env)
    outcomes: Counter = Counter()
    spanning = []  # calls started before SIGTERM that completed after it
    signalled = threading.Event()
    lock = threading.Lock()
    sessions = [fuyou_client.connect(d.socket) for _ in range(4)]

    def client(s, seed):
        buf = s.allocate(8 * MiB)
        buf.view[:] = random_bytes(8 * MiB, seed)
        while True:
            before = signalled.is_set()
            try:
                s.swap_out_async([Out(f"o{seed}", buf)]).result(120)
                s.swap_in_many([In(f"o{seed}", buf)])
                kind = "ok"
            except fuyou_client.FuyouClientError as exc:
                kind = type(exc).__name__ + ("" if isinstance(exc, fuyou_client.DaemonUnavailable)
                                             else f": {exc}")
            with lock:
                outcomes[kind] += 1
                if kind == "ok" and not before and signalled.is_set():
                    spanning.append(seed)
            if kind != "ok":
                return

    threads = [threading.Thread(target=client, args=(s, i)) for i, s in enumerate(sessions)]
    try:
        for t in threads:
            t.start()
        # Every client's second SwapIn is in the daemon (each hit of the failpoint is logged).
        deadline = time.monotonic() + 120
        while d.log().count("failpoint rpc.SwapIn") < 2 * len(sessions):
            assert time.monotonic() < deadline, d.log()[-2000:]
            time.sleep(0.01)
        signalled.set()
        d.process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert d.process.wait(60) == 0, d.log()[-3000:]
    finally:
        for s in sessions:
            s.close()
        d.stop()
    assert set(outcomes) <= {"ok", "DaemonUnavailable"}, outcomes
    assert outcomes["DaemonUnavailable"] == len(sessions), outcomes  # (each client's last call)
    assert len(spanning) == len(sessions), f"calls running at SIGTERM did not all complete ({outcomes})"
    assert "stopped" in d.log() and "with failures" not in d.log()


def test_stop_joins_every_thread_before_the_store_closes(short_tmp, caplog):
    """A session still live at stop whose reclaim is slow (it deletes an unnamed
    namespace's state), and an optimizer read-ahead under way: stop() returns only once
    both are done, the store still open under them (a session-socket thread used to run
    its session's reclaim on after the index was closed)."""
    d = Daemon(in_process_config(short_tmp, ndirs=1))
    d.start()
    s = fuyou_client.connect(str(d.config.daemon.control_path))  # (no namespace: its state goes with it)
    namespace = s.namespace
    weights = s.allocate(64 * 1024)
    weights.tensor(torch.float32).normal_()
    for g in ("g0", "g1"):
        s.create_group(g, weights, AdamW(lr=1e-3))
    grads = s.allocate(64 * 1024)
    with caplog.at_level(logging.INFO), failpoints.armed(optimizer__prefetch="sleep(1)",
                                                         session__closing="sleep(1)"):
        s.step_group("g1", grads, 1e-3)  # (then the read-ahead of g0 starts, and sleeps)
        d.stop()
    alive = [t.name for t in threading.enumerate() if t.name in OURS]
    assert not alive, alive
    assert "deleted the 2 objects" in caplog.text and "stopped" in caplog.text
    assert "closed database" not in caplog.text and "with failures" not in caplog.text
    index = sqlite3.connect(f"file:{short_tmp / 'state' / 'index.sqlite'}?mode=ro", uri=True)
    assert index.execute("SELECT COUNT(*) FROM objects WHERE namespace = ?", (namespace,)).fetchone()[0] == 0
    index.close()
    s.close()


def _lock_is_free(directory) -> bool:
    fd = os.open(directory / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _closed(engine: ThreadPoolEngine) -> bool:
    """Whether the engine refuses work (it was closed)."""
    from fuyoud.io.engine import IORequest, Op

    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        engine.execute([IORequest(Op.READ, fd, 0, memoryview(bytearray(4096)))])
        return False
    except RuntimeError as exc:
        return "shutdown" in str(exc)
    finally:
        os.close(fd)


def test_a_failed_start_gives_back_the_data_files_their_locks_the_index_and_the_engine(short_tmp):
    cfg = in_process_config(short_tmp, ndirs=2)
    engine = ThreadPoolEngine(2)
    before = _fds()
    with failpoints.armed(daemon__init="error"), pytest.raises(failpoints.FailpointError):
        Daemon(cfg, engine=engine)
    assert all(_lock_is_free(dev) for dev in cfg.data_dirs)
    assert _fds() == before
    assert _closed(engine)
    # and a daemon starts on the same directories at once (it was "in use by another fuyoud")
    d = Daemon(cfg)
    d.start()
    d.stop()


def test_a_failed_stop_releases_the_rest_says_why_and_wait_returns(short_tmp):
    cfg = in_process_config(short_tmp, ndirs=2)
    engine = ThreadPoolEngine(2)
    d = Daemon(cfg, engine=engine)
    d.start()
    waiter = threading.Thread(target=d.wait)
    waiter.start()
    # The first data file's descriptor now fails its sync (EINVAL on a pipe: an EIO from a
    # dying disk does the same).
    r, w = os.pipe()
    os.dup2(r, d.store.devices[0].fd)
    os.close(r)
    os.close(w)
    with pytest.raises(StopFailed, match="closing the store failed: .*Invalid argument"):
        d.stop()
    waiter.join(30)
    assert not waiter.is_alive(), "wait() still blocks after stop()"
    assert all(_lock_is_free(dev) for dev in cfg.data_dirs)  # (the second data file too)
    assert _closed(engine)
    d.stop()  # (once stopped, nothing more)


class _RpcError(grpc.RpcError):
    """What a gRPC call raises, as the client's error mapping reads it."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_a_stream_reset_under_a_call_is_daemon_unavailable_and_fuyouds_own_internal_error_is_not():
    """A daemon killed or stopping mid-call can reset the call's stream: gRPC reports that as
    INTERNAL (the soak saw it once in a few runs, a job dying of InternalError); the client
    says DaemonUnavailable with how to resume. fuyoud's own INTERNAL (a bug, in its log)
    stays InternalError."""
    from fuyou_client import errors

    reset = errors.from_rpc_error(_RpcError(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"))
    assert isinstance(reset, fuyou_client.DaemonUnavailable) and "resume=DIR" in str(reset), reset
    own = errors.from_rpc_error(_RpcError(grpc.StatusCode.INTERNAL, "internal error in SwapIn; see the fuyoud log"))
    assert isinstance(own, errors.InternalError) and not isinstance(own, fuyou_client.DaemonUnavailable)

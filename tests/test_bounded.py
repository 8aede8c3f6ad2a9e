"""Bounded under a hostile client: connections to the session socket cost no thread each
and a silent one its descriptor only until the handshake timeout; one user's
connections beyond its cap are refused, said why and counted; and the systemd watchdog
keeps pinging while the reaper is blocked in a dead client's close. Real daemon
processes; the waits are liveness bounds, never timing assertions."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fuyou_client
from conftest import SMALL, merge, scrape, wait_until

HANDSHAKE_TIMEOUT = 4  # seconds (FUYOUD_HANDSHAKE_TIMEOUT): the silent connections outlive the checks made meanwhile


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def silent(path: str, n: int) -> list[socket.socket]:
    """``n`` connections to the session socket that never say hello."""
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.connect(path)
        out.append(s)
    return out


def round_trip(control_socket: str) -> None:
    """A normal client's work: connect, allocate, swap a small object out and back."""
    with fuyou_client.connect(control_socket) as s:
        buf = s.allocate(1 << 16)
        t = buf.tensor(torch.float32)
        t.copy_(torch.arange(t.numel(), dtype=torch.float32))
        s.swap_out("small", buf)
        t.zero_()
        s.swap_in("small", buf)
        assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32))


def test_silent_connections_cost_no_thread_and_their_descriptors_go_after_the_handshake_timeout(short_tmp):
    env = dict(os.environ, FUYOUD_HANDSHAKE_TIMEOUT=str(HANDSHAKE_TIMEOUT))
    with fuyou_client.start_daemon(short_tmp / "state", config=SMALL, env=env) as d:
        round_trip(d.socket)  # (what a client starts lazily in the daemon is started: the baseline)
        path = d.status().session_socket
        wait_until(lambda: d.status().sessions == 0, "that client's session ended")
        threads_before, fds_before = threads(d.pid), fds(d.pid)
        held = silent(path, 200)
        try:
            # (>= 190: a descriptor of the client before may close meanwhile)
            wait_until(lambda: fds(d.pid) >= fds_before + 190, "the 200 connections accepted")
            # One thread per connection used to hold each for HANDSHAKE_TIMEOUT at least.
            assert threads(d.pid) <= threads_before + 4, (threads_before, threads(d.pid))
            round_trip(d.socket)  # normal clients are served meanwhile
            # After the handshake timeout the daemon has hung up on every one of them.
            for s in held:
                s.settimeout(60)
                assert s.recv(100) == b""
            wait_until(lambda: fds(d.pid) < fds_before + 20, "the silent connections' descriptors closed")
            assert threads(d.pid) <= threads_before + 4
        finally:
            for s in held:
                s.close()
        round_trip(d.socket)


def test_connections_beyond_a_users_cap_are_refused_with_why_and_counted(short_tmp):
    env = dict(os.environ, FUYOUD_MAX_CONNECTIONS_PER_UID="8")
    with fuyou_client.start_daemon(short_tmp / "state", config=SMALL, env=env) as d:
        url, path = d.status().metrics_url, d.status().session_socket
        with fuyou_client.connect(d.socket) as live:  # (a session of this user, before its cap is reached)
            held = silent(path, 7)
            try:
                wait_until(lambda: d.status().sessions == 1, "the daemon serving")
                with pytest.raises(fuyou_client.ResourceExhausted, match="FUYOUD_MAX_CONNECTIONS_PER_UID"):
                    fuyou_client.connect(d.socket)
                # By hand: the reply to the hello is the refusal, then the daemon hangs up.
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw:
                    raw.connect(path)
                    raw.sendall(json.dumps({"hello": 1, "namespace": "x", "client": "test"}).encode())
                    raw.settimeout(60)
                    reply = json.loads(raw.recv(65536))
                    assert reply["error"]["code"] == "RESOURCE_EXHAUSTED"
                    assert "uid" in reply["error"]["message"] and "8" in reply["error"]["message"]
                    assert raw.recv(100) == b""
                m = scrape(url)
                assert m['fuyoud_session_connections_refused_total{limit="per_uid"}'] == 2
                # The session opened before keeps working meanwhile.
                buf = live.allocate(1 << 16)
                live.swap_out("kept", buf)
                live.swap_in("kept", buf)
            finally:
                for s in held:
                    s.close()
        assert "refused a connection of uid" in d.log()
        # Once its connections end, the user connects again.
        wait_until(lambda: _connects(d), "a connection accepted again once the others ended")
        round_trip(d.socket)
        assert scrape(url)['fuyoud_session_connections_refused_total{limit="per_uid"}'] >= 2


def _connects(d) -> bool:
    try:
        fuyou_client.connect(d.socket).close()
        return True
    except fuyou_client.ResourceExhausted:
        return False


# A client whose session socket a forked child inherits; the client is then killed and its
# child lives on holding the socket open: the session is the reaper's (no EOF comes).
FORKS = textwrap.dedent("""
    import os, sys, time, fuyou_client
    s = fuyou_client.connect(sys.argv[1], namespace="forked")
    s.swap_out("scratch", s.allocate(1 << 16))
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    time.sleep(600)
""")


def _pings(listener: socket.socket) -> int:
    """WATCHDOG=1 datagrams waiting on the notify socket now (read, not waited for)."""
    n = 0
    listener.setblocking(False)
    try:
        while True:
            n += listener.recv(4096).count(b"WATCHDOG=1")
    except BlockingIOError:
        return n


@pytest.mark.slow  # (waits for three watchdog pings while a reap hangs)
def test_the_watchdog_pings_on_while_a_reap_is_blocked_in_a_dead_clients_close(short_tmp):
    """The reaper ends a session whose process is gone; its close blocks (a failpoint where
    a dead client's in-flight step would hold it). The watchdog used to share the reaper's
    thread: its pings stopped and systemd killed a healthy daemon."""
    notify_path = short_tmp / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(60)
    cfg = short_tmp / "fuyoud.toml"
    cfg.write_text(fuyou_client.connection.to_toml(merge(SMALL, {
        "daemon": {"state_dir": str(short_tmp / "state"), "runtime_dir": str(short_tmp / "run")},
        "metrics": {"enabled": False}})))
    log_path = short_tmp / "fuyoud.log"
    env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), WATCHDOG_USEC="400000",
               FUYOUD_FAILPOINTS="session.close.optimizer=hang")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fuyoud", "--config", str(cfg)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    client = grandchild = None
    try:
        assert b"READY=1" in listener.recv(4096)
        sock = str(short_tmp / "run" / "fuyoud.sock")
        client = subprocess.Popen([sys.executable, "-c", FORKS, sock], stdout=subprocess.PIPE, text=True)
        grandchild = int(client.stdout.readline())
        client.kill()
        client.wait()
        wait_until(lambda: "failpoint session.close.optimizer: hang" in log_path.read_text(),
                   "the reaper blocked in the dead client's close", seconds=60)
        assert "reaping the session" in log_path.read_text()
        _pings(listener)  # (those sent before the reap blocked)
        seen = [0]

        def pinged() -> bool:
            seen[0] += _pings(listener)
            return seen[0] >= 3

        wait_until(pinged, "watchdog pings while the reap is blocked", seconds=30, poll=0.1)
        round_trip(sock)  # and the daemon serves
        assert proc.poll() is None
        assert "withholding WATCHDOG=1" not in log_path.read_text()
    finally:
        proc.kill()
        proc.wait()
        if client is not None and client.poll() is None:
            client.kill()
            client.wait()
        if grandchild is not None:
            try:
                os.kill(grandchild, 9)
            except ProcessLookupError:
                pass
        listener.close()


@pytest.mark.slow  # (a daemon of its own: about 5 s)
def test_the_daemons_threads_carry_their_names_in_the_kernel(short_tmp):
    """A count of the daemon's threads by name (/proc/<pid>/task/*/comm) says which pool a
    thread is of: the session socket's, gRPC's, the I/O engine's, housekeeping's."""
    import collections

    d = fuyou_client.start_daemon(short_tmp / "state", config=merge(SMALL, {"io": {"engine": "threadpool"}}))
    try:
        with fuyou_client.connect(d.socket) as s:
            s.swap_out("x", s.allocate(1 << 20))
            pid = s.status().pid
        names = collections.Counter(Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
                                     for t in os.listdir(f"/proc/{pid}/task"))
    finally:
        assert d.stop() == 0, d.log()
    for name in ("session-conn", "session-accept", "grpc", "fuyou-io", "housekeeping", "reaper"):
        assert names[name] >= 1, (name, names)

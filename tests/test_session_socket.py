"""The session socket's holes, closed: a client that dies at any point of the handshake
holds nothing; the accept loop outlives EMFILE; a session whose process is gone but
whose socket a child still holds is reaped; a killed client is counted as killed."""
from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap

import grpc
import pytest

import fuyou_client
from conftest import SMALL, in_process_config, merge, scrape, wait_until
from fuyou_proto import SESSION_METADATA_KEY
from fuyou_proto import fuyou_pb2 as pb
from fuyoud import failpoints
from fuyoud.server import Daemon

MiB = 1 << 20


@pytest.fixture
def daemon(short_tmp):
    d = Daemon(in_process_config(short_tmp, ndirs=1))
    d.start()
    yield d
    d.stop()


def closed(d: Daemon, reason: str) -> float:
    return d.metrics.registry.get_sample_value("fuyoud_sessions_closed_total", {"reason": reason}) or 0.0


# A client that dies (SIGKILL, its own) at one point of the handshake.
DIES = textwrap.dedent("""
    import json, os, signal, socket, sys
    point, path = sys.argv[1], sys.argv[2]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    if point != "connected":
        s.sendall(json.dumps({"hello": 1, "namespace": "job", "client": "test"}).encode())
    if point == "replied":
        assert "token" in json.loads(s.recv(65536))
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("point, armed", [
    ("connected", {}),  # before its hello
    ("hello", {"session__hello": "sleep(0.5)"}),  # hello sent, gone before the daemon read... it opens then
    ("hello", {"session__opened": "sleep(0.5)"}),  # gone once its session is registered, before the reply
    ("replied", {}),  # gone after the reply (EOF: the usual death)
])
def test_a_client_killed_at_any_point_of_the_handshake_leaves_no_session_and_no_held_namespace(daemon, point,
                                                                                                armed):
    path = str(daemon.config.daemon.session_path)
    with failpoints.armed(**armed):
        child = subprocess.run([sys.executable, "-c", DIES, point, path], timeout=60)
        assert child.returncode == -signal.SIGKILL
        if point != "connected":  # (a session is registered for it: it ends as killed)
            wait_until(lambda: closed(daemon, "killed") == 1, "the dead client's session closed")
    assert not daemon.sessions.all()
    # The namespace is free: a new client takes it (it was AlreadyExists until a restart).
    with fuyou_client.connect(str(daemon.config.daemon.control_path), namespace="job") as s:
        assert s.namespace == "job"
    assert closed(daemon, "killed") == (point != "connected") and closed(daemon, "closed") == 1


def test_a_silent_connection_is_dropped_after_the_handshake_timeout(daemon, monkeypatch):
    from fuyoud.sessions import listener as session_socket

    monkeypatch.setattr(session_socket, "HANDSHAKE_TIMEOUT", 0.3)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(str(daemon.config.daemon.session_path))
        s.settimeout(30)
        assert s.recv(100) == b""  # (the daemon hung up: no thread waits on it for ever)
    assert not daemon.sessions.all()


def _lowest_free_fd(pid: int) -> int:
    used = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
    return next(i for i in range(len(used) + 1) if i not in used)


def test_the_accept_loop_survives_emfile_and_says_so(short_tmp):
    """With its descriptor limit lowered so that accept() fails with EMFILE, the daemon
    logs it and counts it, and once descriptors are free the waiting client is served
    (the accept loop used to end at the first OSError: no session could ever start)."""
    with fuyou_client.start_daemon(short_tmp / "state", config=SMALL) as d:
        url = d.status().metrics_url
        hello = json.dumps({"hello": 1, "namespace": "late", "client": "test"}).encode()
        waiting = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        status = d.status()
        soft, hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
        try:
            resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(d.pid), hard))
            waiting.connect(status.session_socket)  # (in the backlog: accept() needs a descriptor)
            waiting.sendall(hello)
            wait_until(lambda: "accept failed ([Errno 24] Too many open files)" in d.log(), "EMFILE logged")
            wait_until(lambda: d.log().count("accept failed") >= 1 and "LimitNOFILE=" in d.log(), "the hint")
        finally:
            resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (soft, hard))
        waiting.settimeout(60)
        reply = json.loads(waiting.recv(65536))  # served once descriptors are there again
        assert reply["namespace"] == "late" and "token" in reply
        waiting.close()
        m = scrape(url)
        assert m['fuyoud_session_accept_errors_total{errno="EMFILE"}'] >= 1
        with fuyou_client.connect(d.socket) as s:  # and new sessions start as before
            s.swap_out("x", s.allocate(4096))


# A client whose session socket a forked child inherits: the client is then killed, its
# child lives on holding the socket open (a DataLoader worker started by fork, say).
FORKS = textwrap.dedent("""
    import os, sys, time, fuyou_client
    s = fuyou_client.connect(sys.argv[1], namespace="forked")
    buf = s.allocate(8 << 20)
    s.swap_out("scratch", buf)
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    time.sleep(600)
""")


def test_a_session_whose_process_is_gone_is_reaped_though_a_child_holds_its_socket(short_tmp):
    with fuyou_client.start_daemon(short_tmp / "state", config=SMALL) as d:
        url = d.status().metrics_url
        client = subprocess.Popen([sys.executable, "-c", FORKS, d.socket], stdout=subprocess.PIPE, text=True)
        grandchild = int(client.stdout.readline())
        try:
            assert d.status().sessions == 1
            client.kill()
            client.wait()
            # The session socket is still open (in the grandchild): no EOF. The reaper sees
            # that the session's process is gone and ends the session.
            wait_until(lambda: d.status().sessions == 0, "the session reaped")
            m = scrape(url)
            assert m['fuyoud_sessions_closed_total{reason="reaped"}'] == 1
            assert m['fuyoud_sessions_closed_total{reason="killed"}'] == 0
            assert m['fuyoud_objects{kind="transient"}'] == 0 and m["fuyoud_reclaimed_pinned_bytes_total"] >= 8 * MiB
            assert "its process is gone but its session socket is still open" in d.log()
            with fuyou_client.connect(d.socket, namespace="forked") as s:  # the namespace is free again
                assert s.namespace == "forked"
        finally:
            os.kill(grandchild, signal.SIGKILL)


def test_a_killed_client_is_counted_as_killed_and_a_closed_one_as_closed(short_tmp):
    script = "import sys, time, fuyou_client; s = fuyou_client.connect(sys.argv[1]); print('ok', flush=True); " \
             "time.sleep(600)"
    with fuyou_client.start_daemon(short_tmp / "state", config=SMALL) as d:
        url = d.status().metrics_url
        child = subprocess.Popen([sys.executable, "-c", script, d.socket], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ok"
        child.kill()
        child.wait()
        wait_until(lambda: d.status().sessions == 0, "the killed client's session ended")
        with fuyou_client.connect(d.socket):
            pass
        wait_until(lambda: d.status().sessions == 0, "the closed session ended")
        m = scrape(url)
        assert m['fuyoud_sessions_closed_total{reason="killed"}'] == 1
        assert m['fuyoud_sessions_closed_total{reason="closed"}'] == 1
        assert m['fuyoud_sessions_closed_total{reason="reaped"}'] == 0


def test_a_session_of_a_daemon_that_stopped_gets_daemon_unavailable_from_the_one_started_since(short_tmp):
    """A client whose daemon was restarted (as systemd does) calls the new one on the same
    socket with the old life's token: it is told the daemon restarted and how to resume
    (DaemonUnavailable), not that its session is unknown (SessionClosed); a token this
    daemon never gave is still SessionClosed."""
    cfg = merge(SMALL, {"storage": {"data_dirs": [str(short_tmp / "a")]}})
    first = fuyou_client.start_daemon(short_tmp / "state", config=cfg)
    s = fuyou_client.connect(first.socket, namespace="job")
    try:
        first.kill()
        first.stop()
        with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as second:
            assert second.socket == first.socket
            with pytest.raises(fuyou_client.DaemonUnavailable, match="not the one that opened this session.*resume="):
                s.objects()
            with fuyou_client.connect(second.socket, namespace="job") as fresh:  # (the namespace is free)
                assert fresh.objects() == []
                with pytest.raises(grpc.RpcError) as err:
                    fresh._stub.Stat(pb.StatRequest(name="x"), metadata=((SESSION_METADATA_KEY, "nonsense"),))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "unknown session token" in err.value.details()
    finally:
        with contextlib.suppress(fuyou_client.FuyouClientError):
            s.close()
        first.stop()

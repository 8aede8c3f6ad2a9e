"""Every byte given back on every path: a client that dies in the middle of an Allocate or
a Reserve leaves nothing held, a close whose steps fail still gives back the session's
pinned memory (and counts the failure), and a closing session stays listed until its
memory is back. Real daemon processes, failpoints (FUYOUD_FAILPOINTS) to hold them at
the racy places; the waits are liveness bounds, never timing assertions."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import grpc
import pytest

import fuyou_client
from conftest import SMALL, scrape, wait_until
from fuyou_proto import ADMIN_METADATA_KEY, SESSION_METADATA_KEY, pb, rpc

MiB = 1 << 20
PAUSE = "sleep(5)"  # (a failpoint holds the daemon there this long: the test acts meanwhile)


@contextlib.contextmanager
def daemon_with(points: str):
    root = Path(tempfile.mkdtemp(prefix="fy-rc-", dir="/tmp"))
    d = fuyou_client.start_daemon(root / "state", config=SMALL, env=dict(os.environ, FUYOUD_FAILPOINTS=points))
    try:
        yield d
    finally:
        code = d.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert code == 0, d.log()


class Raw:
    """A client by hand: the session socket's handshake and the stubs, so that a test can
    end the session by closing its socket (what the daemon sees when a client dies)."""

    def __init__(self, d, namespace: str | None = None):
        status = d.status()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(status.session_socket)
        self.sock.sendall(json.dumps({"hello": 1, "namespace": namespace, "client": "test"}).encode())
        reply = json.loads(self.sock.recv(65536))
        self.id, self.token = reply["session"], reply["token"]
        self.channel = grpc.insecure_channel(f"unix:{d.socket}")
        self.stub = rpc.FuyouStub(self.channel)
        self.metadata = ((SESSION_METADATA_KEY, self.token),)

    def call(self, method: str, request):
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=60)

    def close(self) -> None:
        self.sock.close()
        self.channel.close()


def listed(d) -> dict[int, pb.SessionInfo]:
    """ListSessions as the operator (the admin token the daemon wrote for its own user: ours)."""
    token = (Path(d.socket).parent / "admin.token").read_text().strip()
    with grpc.insecure_channel(f"unix:{d.socket}") as channel:
        reply = rpc.FuyouAdminStub(channel).ListSessions(pb.Empty(), metadata=((ADMIN_METADATA_KEY, token),),
                                                         timeout=30)
    return {s.id: s for s in reply.sessions}


def paused_at(d, point: str, times: int = 1) -> None:
    wait_until(lambda: d.log().count(f"failpoint {point}") >= times, f"the daemon at failpoint {point}")


def in_thread(fn):
    """Run ``fn`` in a thread; returns (thread, result dict: "error" or "value")."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except grpc.RpcError as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


def nothing_held(d) -> None:
    status = d.status()
    assert (status.pinned_used_bytes, status.pinned_reserved_bytes, status.sessions) == (0, 0, 0)
    assert listed(d) == {}
    metrics = scrape(status.metrics_url)
    assert not [k for k, v in metrics.items() if k.startswith(("fuyoud_session_pinned_bytes{",
                                                               "fuyoud_session_reserved_bytes{")) and v]


@pytest.mark.parametrize("method, point, request_", [
    ("Allocate", "allocate.looked_up", pb.AllocateRequest(size=8 * MiB)),
    pytest.param("Reserve", "reserve.looked_up", pb.ReserveRequest(bytes=64 * MiB), marks=pytest.mark.slow),
])
def test_a_session_closed_between_its_lookup_and_the_pool_keeps_nothing(method, point, request_):
    """The session is looked up, then closed (its memory released) before the pool is
    asked: the pool refuses the closed session, where it used to give a segment or a
    reservation to a session that was gone (held until a restart)."""
    with daemon_with(f"{point}={PAUSE}") as d:
        assert (d.status().pinned_used_bytes, d.status().pinned_reserved_bytes) == (0, 0)
        client = Raw(d)
        t, out = in_thread(lambda: client.call(method, request_))
        paused_at(d, point)  # (looked up: the daemon holds it before the pool)
        client.call("CloseSession", pb.Empty())  # (returns once the session's memory is released)
        t.join(60)
        assert not t.is_alive()
        client.close()
        nothing_held(d)
        err = out.get("error")  # (refused, as a closed session's requests are: SessionClosed)
        assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED, out
        assert f"session {client.id} is closing or closed" in err.details()


@pytest.mark.parametrize("step", ["optimizer", pytest.param("namespace", marks=pytest.mark.slow),
                                  pytest.param("transient", marks=pytest.mark.slow)])
def test_a_step_of_a_close_that_fails_still_gives_the_memory_back_and_is_counted(step):
    """Each step of a close fails in turn (a failpoint raising in it): the steps after it
    run, the session's pinned memory and reservation are released, the failure is logged
    and counted by step, and the close itself is counted."""
    with daemon_with(f"session.close.{step}=error") as d:
        client = Raw(d)  # (no namespace: the daemon names one, deleted at the close)
        client.call("Reserve", pb.ReserveRequest(bytes=32 * MiB))
        ref = client.call("Allocate", pb.AllocateRequest(size=12 * MiB))
        client.call("SwapOut", pb.SwapOutRequest(items=[
            pb.SwapOutItem(name="scratch", buffer=ref, length=MiB),
            pb.SwapOutItem(name="kept", buffer=ref, length=MiB, persistent=True)]))
        before = d.status()
        assert before.pinned_used_bytes >= 12 * MiB and before.sessions == 1
        client.close()  # (the client dies: EOF on its session socket)
        wait_until(lambda: d.status().sessions == 0, "the dead client's session closed")
        nothing_held(d)
        # The steps after the failed one ran: the unnamed namespace's state went (its
        # transient object with it), or when that failed the transient object.
        assert d.status().objects == (1 if step == "namespace" else 0)
        metrics = scrape(before.metrics_url)
        assert {s: metrics[f'fuyoud_session_close_errors_total{{step="{s}"}}']
                for s in ("optimizer", "namespace", "transient", "pool")} == {
            s: float(s == step) for s in ("optimizer", "namespace", "transient", "pool")}
        assert metrics['fuyoud_sessions_closed_total{reason="killed"}'] == 1
        assert metrics["fuyoud_reclaimed_pinned_bytes_total"] >= 12 * MiB
        assert f"session {client.id}: closing it, " in d.log() and f"failpoint session.close.{step}" in d.log()


@pytest.mark.slow  # (a close paused 5 s at a failpoint)
def test_a_closing_session_is_listed_until_its_memory_is_back():
    """A client dies (its session socket ends); the close pauses after its optimizer step.
    Meanwhile the session is refused (its token) but listed, in ListSessions, Status and
    the sessions metric, with the memory it still holds; a new client asking for its
    namespace gets it once the close is done, and then nothing of the dead one is left."""
    with daemon_with(f"session.close.transient={PAUSE}") as d:
        dead = Raw(d, namespace="job")
        dead.call("Allocate", pb.AllocateRequest(size=8 * MiB))
        dead.sock.close()  # (the client died: EOF on its session socket)
        paused_at(d, "session.close.transient")
        with pytest.raises(grpc.RpcError) as refused:
            dead.call("Allocate", pb.AllocateRequest(size=MiB))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = d.status()
        shown = listed(d)
        assert status.sessions == 1 and status.pinned_used_bytes >= 8 * MiB
        assert list(shown) == [dead.id] and shown[dead.id].namespace == "job"
        assert shown[dead.id].pinned_bytes >= 8 * MiB
        metrics = scrape(status.metrics_url)
        assert metrics["fuyoud_sessions"] == 1
        assert metrics[f'fuyoud_session_pinned_bytes{{session="{dead.id}"}}'] >= 8 * MiB
        # Its namespace opens to a new session once the close is done (not refused, not before).
        with fuyou_client.connect(d.socket, namespace="job") as again:
            status = d.status()
            assert list(listed(d)) == [again.id]
            assert status.sessions == 1 and status.pinned_used_bytes == 0
        dead.channel.close()
        nothing_held(d)

"""fuyoud end to end: a real daemon process, real sockets, real files, the public client."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

import fuyou_client
from conftest import SMALL, merge, private_daemon, random_bytes, scrape
from fuyou_client import In, Out
from fuyou_proto import pb

MiB = 1 << 20


@pytest.fixture(scope="module")
def shared():
    """One fuyoud (three data directories, as conftest's daemon) for the tests that look only
    at their own sessions' objects (a session without a namespace gets one of its own): a
    daemon each cost 3-4 s a test. The tests that count the daemon's sessions, objects or
    bytes take a new one (fresh_session)."""
    with private_daemon(SMALL, prefix="fy-d-", data_dirs=3) as d:
        yield d


@pytest.fixture
def session(shared):
    with fuyou_client.connect(shared.socket) as s:
        yield s


@pytest.fixture
def fresh_session(daemon):
    """A session of conftest's daemon, new for the test."""
    with fuyou_client.connect(daemon.socket) as s:
        yield s


def test_round_trips_through_the_public_api(session):
    buf = session.allocate(8 * MiB + 3)
    sizes = [1, 4096, 4097, 65537, 1 * MiB, 3 * MiB + 1, 8 * MiB + 3]
    for i, n in enumerate(sizes):
        data = random_bytes(n, i)
        buf.view[:n] = data
        info = session.swap_out(f"obj/{i}", buf, length=n)
        assert info.size == n and info.namespace == session.namespace
        buf.view[:n] = bytes(n)
        session.swap_in(f"obj/{i}", buf)
        assert bytes(buf.view[:n]) == data, n
    big = session.stat(f"obj/{len(sizes) - 1}")
    assert big.devices == 3  # striped over the three data directories
    assert [o.name for o in session.objects("obj/")] == sorted(f"obj/{i}" for i in range(len(sizes)))


def test_tensors_are_views_of_shared_memory(session):
    buf = session.allocate(4 * MiB)
    t = buf.tensor(torch.float32, (1024, 1024))
    t.copy_(torch.randn(1024, 1024))
    expected = t.clone()
    session.swap_out("w", buf)
    t.zero_()
    session.swap_in("w", buf)
    assert torch.equal(t, expected)


def test_batched_and_asynchronous_transfers(session):
    bufs = [session.allocate(300_000 + i) for i in range(4)]
    for i, b in enumerate(bufs):
        b.view[:] = random_bytes(len(b), i)
    fut = session.swap_out_async([Out(f"b{i}", b) for i, b in enumerate(bufs)])
    infos = fut.result(timeout=30)
    assert [i.size for i in infos] == [len(b) for b in bufs]
    outs = [session.allocate(len(b)) for b in bufs]
    session.swap_in_async([In(f"b{i}", o) for i, o in enumerate(outs)]).result(timeout=30)
    assert all(bytes(o.view) == bytes(b.view) for o, b in zip(outs, bufs))
    part = session.allocate(100)
    session.swap_in("b2", part, length=100, object_offset=1000)
    assert bytes(part.view) == bytes(bufs[2].view[1000:1100])


def test_errors_name_the_problem(session):
    keeper = session.allocate(4096)  # keeps the segment alive after buf is freed
    buf = session.allocate(4096)
    with pytest.raises(fuyou_client.ObjectNotFound, match="no object 'nope'"):
        session.swap_in("nope", buf)
    with pytest.raises(fuyou_client.InvalidArgument, match="outside the buffer"):
        session.swap_out("x", buf, offset=4000, length=200)
    session.swap_out("small", buf, length=10)
    with pytest.raises(fuyou_client.InvalidArgument, match="outside object"):
        session.swap_in("small", buf, length=20)
    with pytest.raises(fuyou_client.InvalidArgument, match="bad object name"):
        session.swap_out("/abs", buf)
    with pytest.raises(fuyou_client.ResourceExhausted, match="pinned-memory budget"):
        session.allocate(1 << 40)
    # Forged and stale handles, straight through the stub.
    stub, md = session.stub, session.metadata
    forged = pb.BufferRef(segment=buf.ref.segment, offset=buf.ref.offset, length=1 << 40, generation=buf.ref.generation)
    for ref in (forged, pb.BufferRef(segment=999, offset=0, length=4096, generation=1)):
        with pytest.raises(grpc.RpcError) as err:
            stub.SwapOut(pb.SwapOutRequest(items=[pb.SwapOutItem(name="f", buffer=ref, length=10)]), metadata=md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ref = buf.ref
    buf.free()
    with pytest.raises(grpc.RpcError) as err:
        stub.SwapIn(pb.SwapInRequest(items=[pb.SwapInItem(name="small", buffer=ref)]), metadata=md)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stale" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Stat(pb.StatRequest(name="small"), metadata=(("x-fuyou-session", "guess"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert session.stat("small").size == 10  # and the daemon still serves
    keeper.free()


def test_two_sessions_are_isolated(shared):
    with fuyou_client.connect(shared.socket, namespace="alice") as a, \
            fuyou_client.connect(shared.socket, namespace="bob") as b:
        ba, bb = a.allocate(1 * MiB), b.allocate(1 * MiB)
        ba.view[:] = random_bytes(MiB, 1)
        bb.view[:] = random_bytes(MiB, 2)
        fa = a.swap_out_async([Out("same-name", ba)])
        fb = b.swap_out_async([Out("same-name", bb)])
        fa.result(30), fb.result(30)
        ba.view[:] = bytes(MiB)
        a.swap_in("same-name", ba)
        assert bytes(ba.view) == random_bytes(MiB, 1)
        with pytest.raises(grpc.RpcError) as err:
            b.stub.Stat(pb.StatRequest(name="same-name", namespace="alice"), metadata=b.metadata)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:  # another session's buffer handle
            b.stub.SwapOut(pb.SwapOutRequest(items=[pb.SwapOutItem(name="steal", buffer=ba.ref)]),
                           metadata=b.metadata)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(fuyou_client.NamespaceBusy, match="held by live session"):
            fuyou_client.connect(shared.socket, namespace="alice")


@pytest.mark.slow  # (two daemons: about 8 s; test_checkpoint.py's snapshot resume restarts one too)
def test_persistent_objects_survive_a_restart_and_transient_ones_do_not(short_tmp):
    cfg = merge(SMALL, {"storage": {"data_dirs": [str(short_tmp / "a"), str(short_tmp / "b")]}})
    data = random_bytes(5 * MiB + 7)
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d:
        with fuyou_client.connect(d.socket, namespace="job") as s:
            buf = s.allocate(len(data))
            buf.view[:] = data
            s.swap_out("weights", buf, persistent=True)
            s.swap_out("activations", buf)
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d:
        with fuyou_client.connect(d.socket, namespace="job") as s:
            assert [o.name for o in s.objects()] == ["weights"]
            buf = s.allocate(len(data))
            s.swap_in("weights", buf)
            assert bytes(buf.view) == data


def test_a_restart_after_a_crash_reclaims_what_unnamed_sessions_left(short_tmp):
    """A daemon SIGKILLed with a live session that named no namespace: nobody can come back
    to that namespace, so the next start deletes what it held (and forgets its owner); a
    named namespace's objects stay."""
    cfg = merge(SMALL, {"storage": {"data_dirs": [str(short_tmp / "a")]}})
    index = short_tmp / "state" / "index.sqlite"
    owners = lambda: {r[0] for r in sqlite3.connect(f"file:{index}?mode=ro", uri=True).execute(  # noqa: E731
        "SELECT name FROM namespaces")}
    d = fuyou_client.start_daemon(short_tmp / "state", config=cfg)
    try:
        empty = sum(dev.used_bytes for dev in d.status().devices)
        named, anon = fuyou_client.connect(d.socket, namespace="job"), fuyou_client.connect(d.socket)
        for s in (named, anon):
            buf = s.allocate(3 * MiB)
            buf.view[:] = random_bytes(3 * MiB)
            s.swap_out("weights", buf, persistent=True)
        assert owners() == {"job", anon.namespace}
        d.kill()
    finally:
        d.stop()
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d:
        status = d.status()
        assert status.objects == 1 and sum(dev.used_bytes for dev in status.devices) == empty + 3 * MiB
        assert owners() == {"job"}
        assert "deleted the 1 objects (3.0 MiB) of " + anon.namespace in d.log()
        with fuyou_client.connect(d.socket, namespace="job") as s:
            assert [o.name for o in s.objects()] == ["weights"]


CHILD = textwrap.dedent("""
    import sys, time, fuyou_client
    s = fuyou_client.connect(sys.argv[1])
    buf = s.allocate(20 << 20)
    buf.view[:4] = b"data"
    s.swap_out("scratch", buf)
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_killed_client_is_reclaimed(daemon, fresh_session):
    survivor = fresh_session.allocate(MiB)
    survivor.view[:] = random_bytes(MiB, 5)
    fresh_session.swap_out("mine", survivor)
    child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.socket], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    status = fresh_session.admin_stub.Status(pb.StatusRequest())
    assert status.sessions == 2 and status.pinned_used_bytes >= 20 * MiB
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        status = fresh_session.admin_stub.Status(pb.StatusRequest())
        if status.sessions == 1:
            break
        time.sleep(0.05)
    assert status.sessions == 1
    assert status.objects == 1  # the child's transient object is gone, ours stays
    assert status.pinned_used_bytes < 20 * MiB
    metrics = scrape(status.metrics_url)
    assert metrics["fuyoud_reclaimed_pinned_bytes_total"] >= 20 * MiB
    out = fresh_session.allocate(MiB)
    fresh_session.swap_in("mine", out)
    assert bytes(out.view) == bytes(survivor.view)


def test_metrics_endpoint_and_health(fresh_session):
    buf = fresh_session.allocate(2 * MiB)
    fresh_session.swap_out("m", buf)
    fresh_session.swap_in("m", buf)
    status = fresh_session.admin_stub.Status(pb.StatusRequest())
    m = scrape(status.metrics_url)
    written = sum(v for k, v in m.items() if k.startswith('fuyoud_io_bytes_total{') and 'direction="write"' in k)
    read = sum(v for k, v in m.items() if k.startswith('fuyoud_io_bytes_total{') and 'direction="read"' in k)
    assert written >= 2 * MiB and read >= 2 * MiB
    assert m[f'fuyoud_io_engine{{engine="{status.io_engine}"}}'] == 1
    assert m["fuyoud_sessions"] == 1
    assert m['fuyoud_objects{kind="transient"}'] == 1
    assert m['fuyoud_pinned_bytes{state="allocated"}'] == 2 * MiB
    assert any(k.startswith("fuyoud_io_batch_duration_seconds_bucket") for k in m)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix:{fresh_session.socket_path}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="fuyou.v1.Fuyou"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_no_daemon_gives_a_clear_error(short_tmp):
    with pytest.raises(fuyou_client.DaemonUnavailable, match="no fuyoud answers"):
        fuyou_client.connect(str(short_tmp / "missing.sock"), timeout=0.5)


def test_notify_socket_start_and_sigterm_stop(short_tmp):
    """READY=1 once serving, STOPPING=1 on SIGTERM, exit code 0, sockets removed."""
    notify_path = short_tmp / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(60)
    cfg = short_tmp / "fuyoud.toml"
    cfg.write_text(fuyou_client.connection.to_toml(merge(SMALL, {
        "daemon": {"state_dir": str(short_tmp / "state"), "runtime_dir": str(short_tmp / "run")},
        "metrics": {"listen": "127.0.0.1:0"}})))
    proc = subprocess.Popen([sys.executable, "-m", "fuyoud", "--config", str(cfg)],
                            env=dict(os.environ, NOTIFY_SOCKET=str(notify_path)), stderr=subprocess.PIPE, text=True)
    try:
        assert b"READY=1" in listener.recv(4096)
        sock = short_tmp / "run" / "fuyoud.sock"
        assert oct(os.stat(sock).st_mode & 0o777) == oct(0o660)
        with fuyou_client.connect(str(sock)) as s:  # serving for real
            s.swap_out("x", s.allocate(4096))
            proc.send_signal(signal.SIGTERM)
            assert b"STOPPING=1" in listener.recv(4096)
            assert proc.wait(30) == 0
        assert not sock.exists() and not (short_tmp / "run" / "session.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    assert "stopped" in proc.stderr.read()


def test_sigusr1_logs_every_threads_stack_and_the_daemon_goes_on(shared, session):
    """What an operator sends a daemon that hangs (systemctl kill -s USR1 fuyoud)."""
    before = shared.log().count("run_until_signalled")
    shared.process.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while shared.log().count("run_until_signalled") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    dump = shared.log()[-20000:]
    assert "run_until_signalled" in dump and dump.count("Thread 0x") >= 2, dump[-2000:]
    assert session.status().pid == shared.pid


def test_a_full_disk_at_start_is_refused_clearly(short_tmp):
    with pytest.raises(fuyou_client.DaemonUnavailable, match="not enough space"):
        fuyou_client.start_daemon(short_tmp / "state", config=merge(SMALL, {"storage": {"capacity_per_device": "1000TiB"}}))


def test_a_second_daemon_on_a_live_daemons_sockets_is_refused_and_the_first_goes_on(short_tmp):
    """Two fuyouds given the same runtime_dir: the second one stops, saying why, instead
    of taking the first one's sockets and admin token over (which cut its clients off)."""
    with fuyou_client.start_daemon(short_tmp / "one", config=SMALL) as first:
        run = Path(first.socket).parent
        with pytest.raises(fuyou_client.DaemonUnavailable, match=f"cannot start: another fuyoud is serving on {run}"):
            fuyou_client.start_daemon(short_tmp / "two", config=merge(SMALL, {"daemon": {"runtime_dir": str(run)}}))
        with fuyou_client.connect(first.socket) as s:  # (the first still serves, its token still there)
            s.swap_out("x", s.allocate(4096))
        assert (run / "admin.token").exists()


@pytest.mark.slow  # (a daemon of its own; the engine itself is tested in test_io_engines.py and test_store.py)
def test_the_threadpool_engine_end_to_end(short_tmp):
    cfg = merge(SMALL, {"io": {"engine": "threadpool"}})
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d, fuyou_client.connect(d.socket) as s:
        assert s.daemon_status.io_engine == "threadpool"
        buf = s.allocate(3 * MiB + 5)
        buf.view[:] = random_bytes(len(buf), 9)
        s.swap_out("t", buf, offset=5, length=3 * MiB)
        out = s.allocate(3 * MiB)
        s.swap_in("t", out)
        assert bytes(out.view) == bytes(buf.view[5:])


@pytest.mark.slow  # (192 MiB through one I/O thread, then a restart: about 11 s)
def test_sigterm_lets_in_flight_swaps_finish(short_tmp):
    """A swap under way when SIGTERM arrives completes (and is durable) before exit 0."""
    # One I/O thread and small chunks: the swap takes long enough to be caught in flight.
    cfg = merge(SMALL, {"storage": {"capacity_per_device": "512MiB"},
                        "io": {"engine": "threadpool", "threads": 1, "chunk_size": "64KiB"}})
    data = random_bytes(192 * MiB, 4)
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d:
        with fuyou_client.connect(d.socket, namespace="ckpt") as s:
            buf = s.allocate(len(data))
            buf.view[:] = data
            used = lambda: sum(dev.used_bytes for dev in s.status().devices)  # noqa: E731
            before = used()
            fut = s.swap_out_async([Out("state", buf, persistent=True)])
            while used() == before:  # extents are allocated when the write starts
                time.sleep(0.001)
            d.process.send_signal(signal.SIGTERM)
            assert not fut.done(), "the swap finished before SIGTERM: nothing was tested"
            assert fut.result(60)[0].size == len(data)  # finished, not cut off
            assert d.process.wait(60) == 0
    with fuyou_client.start_daemon(short_tmp / "state", config=cfg) as d:
        with fuyou_client.connect(d.socket, namespace="ckpt") as s:
            out = s.allocate(len(data))
            s.swap_in("state", out)
            assert bytes(out.view) == data


@pytest.mark.slow  # (a parent process that starts a daemon, killed: about 8 s)
def test_a_private_daemon_stops_when_its_parent_dies_and_takes_its_temporary_directory(short_tmp):
    """A script that dies without stop() (SIGKILLed here; an exception is the same) leaves
    no daemon and no temporary state directory: the data files' space is free again (each
    crashed run left its whole state in /tmp before the daemon removed it itself)."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fuyou_client, time
        d = fuyou_client.start_daemon(config={SMALL!r})
        with fuyou_client.connect(d.socket) as s:
            buf = s.allocate(1 << 20)
            s.swap_out("w", buf)
        print(d.pid, d.state_dir, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    pid, state = parent.stdout.readline().split(maxsplit=1)
    pid, state = int(pid), Path(state.strip())
    assert (state / "data").is_dir()
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        shutil.rmtree(state, ignore_errors=True)
        pytest.fail("the private daemon outlived its parent")
    assert not state.exists(), "the temporary state directory outlived its daemon"


def test_a_private_daemon_started_from_a_thread_outlives_the_thread(short_tmp):
    """The daemon stops with the process that started it, not with the thread (a daemon
    started from a worker thread stopped when that thread ended: PR_SET_PDEATHSIG's)."""
    started = []
    thread = threading.Thread(target=lambda: started.append(fuyou_client.start_daemon(short_tmp / "state",
                                                                                      config=SMALL)))
    thread.start()
    thread.join()
    d = started[0]
    try:
        time.sleep(1.0)
        assert d.process.poll() is None, d.log()
        with fuyou_client.connect(d.socket) as s:
            assert s.status().pid == d.pid
    finally:
        assert d.stop() == 0


@pytest.mark.slow  # (a daemon started and killed in a child process: about 5 s)
def test_a_killed_private_daemons_temporary_directory_goes_when_its_process_ends(short_tmp):
    """The daemon removes its temporary directory as it stops; one killed outright (the OOM
    killer) cannot, so the process that started it does as it ends."""
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import fuyou_client
        d = fuyou_client.start_daemon(config={SMALL!r})
        d.process.kill()
        d.process.wait()
        print(d.state_dir, flush=True)
    """)], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    state = Path(child.stdout.strip())
    assert state.name.startswith("fuyoud-") and not state.exists()


def test_remove_when_stopped_takes_only_the_daemons_own_directories(tmp_path):
    """fuyoud --remove-when-stopped (start_daemon's, for its temporary directories) refuses
    any directory but the config's state_dir and runtime_dir, before it starts."""
    config = tmp_path / "fuyoud.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\nruntime_dir = "{tmp_path / "run"}"\n')
    other = tmp_path / "precious"
    other.mkdir()
    r = subprocess.run([sys.executable, "-m", "fuyoud", "--config", str(config), "--remove-when-stopped", str(other),
                        "--check-config"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "only the config's state_dir" in r.stderr and other.is_dir()
    r = subprocess.run([sys.executable, "-m", "fuyoud", "--config", str(config), "--remove-when-stopped",
                        str(tmp_path / "state"), "--check-config"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow  # (two daemons started and stopped: about 8 s)
def test_a_temporary_daemon_leaves_nothing_behind(short_tmp):
    """start_daemon() without a directory makes a temporary one, data files and all, and
    stop() removes it (the log stays readable); a directory you name is kept."""
    d = fuyou_client.start_daemon(config=SMALL)
    state = d.state_dir
    assert (state / "data").exists() and state.parent == Path(tempfile.gettempdir())
    assert d.stop() == 0
    assert not state.exists() and "stopped" in d.log()
    with fuyou_client.start_daemon(short_tmp / "kept", config=SMALL) as kept:
        pass
    assert (short_tmp / "kept" / "index.sqlite").exists() and kept.process.returncode == 0


def test_start_daemon_takes_a_state_directory_longer_than_a_socket_path(tmp_path):
    """Unix socket paths stop at 108 bytes: every socket goes to a short runtime directory
    when the state directory is deep (bench/scale.py's helper found notify.sock did not)."""
    state = tmp_path / ("x" * 110)
    d = fuyou_client.start_daemon(state, config={"storage": {"capacity_per_device": "64MiB"}})
    try:
        with fuyou_client.connect(d.socket) as s:
            assert s.status().pid == d.pid
    finally:
        assert d.stop() == 0

"""Operating a running fuyoud: fuyouctl, drain, checkpoints, the watchdog, logs, metrics."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

import fuyou_client
from conftest import SMALL, merge, scrape
from fuyou_proto import pb

MiB = 1 << 20


def fuyouctl(daemon, *args, check=True):
    proc = subprocess.run([sys.executable, "-m", "fuyouctl", "--socket", daemon.socket, *args],
                          capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


class Blocks(nn.Module):
    """A plain module with repeated blocks: attach() makes one optimizer group of each."""

    def __init__(self, width=64, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def train(engine, model, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 64, generator=gen)
        model(x).square().mean().backward()
        engine.step()
        engine.zero_grad()


def test_fuyouctl_status_and_sessions(daemon):
    model = Blocks()
    nparams = sum(p.numel() for p in model.parameters())
    with fuyou_client.attach(model, socket=daemon.socket, namespace="alice-run") as engine:
        train(engine, model, 2)
        out = fuyouctl(daemon, "status").stdout
        assert "I/O engine" in out and "serving" in out and "throughput" in out
        assert out.count("ssd") >= 3  # the device table: one row per data directory
        sessions = fuyouctl(daemon, "sessions").stdout
        header, row = sessions.splitlines()[:2]
        assert header.split()[:4] == ["ID", "UID", "PID", "NAMESPACE"]
        assert row.split()[1:4] == [str(os.getuid()), str(os.getpid()), "alice-run"]
        js = json.loads(fuyouctl(daemon, "sessions", "--json").stdout)["sessions"]
        assert len(js) == 1
        s = js[0]
        assert int(s["model_params"]) == nparams and s["groups"] == 5 and int(s["step"]) == 2
        assert int(s["pinned_bytes"]) > 0 and int(s["persistent_bytes"]) >= 12 * nparams
        assert time.time() - s["last_active"] < 60
        status = json.loads(fuyouctl(daemon, "status", "--json").stdout)
        assert status["sessions"] == 1 and len(status["devices"]) == 3 and len(status["session_list"]) == 1
    assert fuyouctl(daemon, "sessions").stdout.strip() == "no sessions"


def test_fuyouctl_namespaces_lists_and_deletes_state_but_not_checkpoints(daemon, short_tmp):
    """What each namespace holds on the array, and deleting a run's state when its session
    is over: refused while one holds it, the snapshot checkpoint kept (it still resumes)."""
    model = Blocks()
    nparams = sum(p.numel() for p in model.parameters())
    engine = fuyou_client.attach(model, socket=daemon.socket, namespace="run1")
    train(engine, model, 1)
    engine.save_checkpoint(short_tmp / "ck", mode="snapshot")
    listed = json.loads(fuyouctl(daemon, "namespaces", "--json").stdout)["namespaces"]
    assert [n["name"] for n in listed] == ["run1"]
    run1 = listed[0]
    assert run1["owned"] and run1["uid"] == os.getuid() and int(run1["session_id"]) == engine.session.id
    assert int(run1["bytes"]) >= 12 * nparams and int(run1["snapshot_bytes"]) >= 12 * nparams
    assert run1["checkpoints"] == 1
    held = fuyouctl(daemon, "delete-namespace", "run1", check=False)
    assert held.returncode == 1 and f"held by live session {engine.session.id}" in held.stderr
    engine.close()
    out = fuyouctl(daemon, "delete-namespace", "run1").stdout
    assert out.startswith(f"deleted run1: {run1['objects']} objects") and "snapshot checkpoints stay" in out
    table = fuyouctl(daemon, "namespaces").stdout.splitlines()
    assert table[0].split() == ["NAMESPACE", "OWNER", "OBJECTS", "STATE", "SNAPSHOTS", "CHECKPOINTS", "SESSION"]
    assert table[1].split()[:5] == ["run1", str(os.getuid()), "0", "0", "B"] and table[1].split()[-2:] == ["1", "-"]
    again = fuyou_client.attach(Blocks(), socket=daemon.socket, namespace="run2", resume=short_tmp / "ck")
    assert set(again.part_steps().values()) == {1}
    again.close()
    missing = fuyouctl(daemon, "delete-namespace", "nope", check=False)
    assert missing.returncode == 1 and "no namespace 'nope'" in missing.stderr
    wrong = short_tmp / "wrong.token"
    wrong.write_text("not-the-token")
    denied = fuyouctl(daemon, "--admin-token-file", str(wrong), "namespaces", check=False)
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    # A data-parallel job's ranks (<job>.r<rank>) at once, none while one runs.
    ranks = [fuyou_client.connect(daemon.socket, namespace=f"job.r{r}") for r in range(2)]
    for s in ranks:
        s.swap_out("state", s.allocate(MiB), persistent=True)
    running = fuyouctl(daemon, "delete-namespace", "--job", "job", check=False)
    assert running.returncode == 1 and "job 'job' is still running" in running.stderr
    assert "nothing was deleted" in running.stderr
    ranks[1].close()
    assert fuyouctl(daemon, "delete-namespace", "--job", "job", check=False).returncode == 1
    ranks[0].close()
    out = fuyouctl(daemon, "delete-namespace", "--job", "job").stdout.splitlines()
    assert [line.split(":")[0] for line in out] == ["deleted job.r0", "deleted job.r1"]
    names = [n["name"] for n in json.loads(fuyouctl(daemon, "namespaces", "--json").stdout)["namespaces"]]
    assert names == ["run1", "run2"]


@pytest.mark.slow  # (a daemon and fuyouctl calls: about 6 s; sessions are listed in test_fuyouctl_status_and_sessions)
def test_ranks_of_a_job_show_their_job_and_rank_together(daemon):
    """Sessions named <job>.r<rank> (one per rank of a data-parallel job) show JOB and
    RANK in `fuyouctl sessions`, listed together by job then rank; the metrics say the
    same in fuyoud_session_info (label training_job: Prometheus owns `job`), which joins
    with the other per-session series."""
    names = ["myjob.r1", "solo", "dp-1a2b3c4d.r0", "myjob.r0", "myjob.r10", "v1.2.r3"]
    opened = [fuyou_client.connect(daemon.socket, namespace=n) for n in names]
    try:
        lines = fuyouctl(daemon, "sessions").stdout.splitlines()
        header = lines[0].split()
        assert header[:6] == ["ID", "UID", "PID", "NAMESPACE", "JOB", "RANK"]
        job_at, rank_at, params_at = (lines[0].index(h) for h in ("JOB", "RANK", "PARAMS"))
        rows = [(line.split()[3], line[job_at:rank_at].strip(), line[rank_at:params_at].strip()) for line in lines[1:]]
        assert rows == [("solo", "", ""),  # no job: empty columns, listed first
                        ("dp-1a2b3c4d.r0", "dp-1a2b3c4d", "0"), ("myjob.r0", "myjob", "0"), ("myjob.r1", "myjob", "1"),
                        ("myjob.r10", "myjob", "10"), ("v1.2.r3", "v1.2", "3")]
        m = scrape(opened[0].admin_stub.Status(pb.StatusRequest()).metrics_url)
        info = {k: v for k, v in m.items() if k.startswith("fuyoud_session_info{")}
        assert len(info) == len(names) and set(info.values()) == {1.0}
        for s in opened:
            job, _, rank = s.namespace.rpartition(".r") if s.namespace != "solo" else ("", "", "")
            key = (f'fuyoud_session_info{{namespace="{s.namespace}",rank="{rank}",session="{s.id}",'
                   f'training_job="{job}"}}')
            assert key in info, (key, sorted(info))
            assert m[f'fuyoud_session_optimizer_buffers{{session="{s.id}"}}'] == 0
    finally:
        for s in opened:
            s.close()


@pytest.mark.slow  # (fuyouctl drain, waited for: about 9 s)
def test_drain_refuses_new_sessions_and_lets_current_ones_finish(daemon, short_tmp):
    with fuyou_client.connect(daemon.socket) as running:
        buf = running.allocate(MiB)
        out = fuyouctl(daemon, "drain").stdout
        assert "draining" in out and "1 session(s) still running" in out
        with pytest.raises(fuyou_client.DaemonUnavailable, match="draining"):
            fuyou_client.connect(daemon.socket)
        running.swap_out("still-works", buf)  # the current session goes on
        assert json.loads(fuyouctl(daemon, "status", "--json").stdout)["draining"] is True
        waiting = fuyouctl(daemon, "drain", "--wait", "--wait-timeout", "1", check=False)
        assert waiting.returncode == 1  # a session is still there
    assert fuyouctl(daemon, "drain", "--wait", "--wait-timeout", "30").returncode == 0
    fuyouctl(daemon, "drain", "--cancel")
    fuyou_client.connect(daemon.socket).close()

    wrong = short_tmp / "wrong.token"
    wrong.write_text("not-the-token\n")
    denied = fuyouctl(daemon, "--admin-token-file", str(wrong), "drain", check=False)
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr and "admin token" in denied.stderr
    token = Path(daemon.socket).parent / "admin.token"
    assert token.stat().st_mode & 0o777 == 0o600


def read_object(session, name, size):
    buf = session.allocate(size)
    session.swap_in(name, buf)
    return bytes(buf.view)


def check_checkpoint(directory: Path, session) -> dict:
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["format"] == "fuyou-checkpoint/1"
    for obj in manifest["objects"]:
        if manifest["mode"] == "copy":
            data = (directory / obj["file"]).read_bytes()
            assert len(data) == obj["size"] and zlib.crc32(data) == obj["crc32"]
        else:  # a snapshot: the object lives on in the array under its snapshot name
            assert read_object(session, obj["snapshot"], obj["size"])
    return manifest


@pytest.mark.slow  # (training with fuyouctl calls between steps: about 10 s; test_a_session_may_checkpoint_only_itself checkpoints too)
def test_checkpoint_of_a_training_session_while_it_trains(daemon, short_tmp):
    model = Blocks(depth=6)
    with fuyou_client.attach(model, socket=daemon.socket, namespace="ckpt") as engine:
        train(engine, model, 2)
        engine.session.swap_out("user/notes", engine.session.allocate(10_000), persistent=True)
        sid = int(json.loads(fuyouctl(daemon, "sessions", "--json").stdout)["sessions"][0]["id"])
        # Quiet point: the checkpoint holds exactly what the store holds.
        quiet = short_tmp / "quiet"
        out = fuyouctl(daemon, "checkpoint", "--mode", "copy", str(sid), str(quiet)).stdout
        assert "(copy)" in out and "at step 2" in out and str(quiet) in out
        manifest = check_checkpoint(quiet, engine.session)
        assert {g["name"] for g in manifest["groups"]} == {g.spec.name for g in engine.groups}
        assert {g["step"] for g in manifest["groups"]} == {2} and manifest["step"] == 2
        for obj in manifest["objects"]:
            assert (quiet / obj["file"]).read_bytes() == read_object(engine.session, obj["name"], obj["size"])
        assert "user/notes" in {o["name"] for o in manifest["objects"]}

        # While training goes on: every group in the checkpoint is at one step.
        stop = threading.Event()
        errors = []

        def keep_training():
            try:
                while not stop.is_set():
                    train(engine, model, 1, seed=7)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        trainer = threading.Thread(target=keep_training)
        trainer.start()
        try:
            busy = []
            for i, mode in enumerate(["copy", "snapshot", "copy", "snapshot"]):
                reply = engine.session.checkpoint(short_tmp / f"busy{i}", timeout=30, mode=mode)
                busy.append(check_checkpoint(Path(reply.directory), engine.session))
                assert reply.step == busy[-1]["step"] and reply.mode == busy[-1]["mode"] == mode
        finally:
            stop.set()
            trainer.join()
        assert not errors, errors
        for m in busy:
            assert len({g["step"] for g in m["groups"]}) == 1 and m["step"] >= 2

        # Bad requests: clear errors, nothing written.
        with pytest.raises(fuyou_client.FuyouClientError, match="already exists"):
            engine.session.checkpoint(quiet)
        with pytest.raises(fuyou_client.FuyouClientError, match="does not exist"):  # (relative: to the cwd)
            engine.session.checkpoint("no-such-parent/dir")
        refused = fuyouctl(daemon, "checkpoint", str(sid + 100), str(short_tmp / "nobody"), check=False)
        assert refused.returncode == 1 and "no live session" in refused.stderr
    assert not list(short_tmp.glob("*.partial-*"))
    m = scrape(daemon.status().metrics_url)
    assert m['fuyoud_checkpoint_duration_seconds_count{mode="copy"}'] == 3
    assert m['fuyoud_checkpoint_duration_seconds_count{mode="snapshot"}'] == 2
    assert m['fuyoud_checkpoint_bytes_total{mode="copy"}'] > 0


def test_a_session_may_checkpoint_only_itself(daemon, short_tmp):
    with fuyou_client.connect(daemon.socket) as a, fuyou_client.connect(daemon.socket) as b:
        a.swap_out("p", a.allocate(4096), persistent=True)
        b_id = b.id
        import grpc

        with pytest.raises(grpc.RpcError, match="may checkpoint only itself") as err:
            a.stub.Checkpoint(pb.CheckpointRequest(session_id=b_id, directory=str(short_tmp / "steal")),
                              metadata=a.metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not (short_tmp / "steal").exists()


def test_engine_reports_iterations_and_exposed_optimizer_time(daemon):
    model = Blocks()
    with fuyou_client.attach(model, socket=daemon.socket) as engine:
        train(engine, model, 4)
        time.sleep(0.5)  # reports are fire-and-forget
    m = scrape(daemon.status().metrics_url)
    assert m["fuyoud_client_iterations_total"] == 3  # iterations run from one step() to the next
    assert 0 < m["fuyoud_client_exposed_optimizer_seconds_total"] < m["fuyoud_client_iteration_seconds_total"]
    assert m["fuyoud_optimizer_step_seconds_count"] == 4 * 5


def start_raw(short_tmp, env_extra, config_extra=None):
    """fuyoud as a child with our own NOTIFY_SOCKET (kept open: watchdog pings land here)."""
    notify_path = short_tmp / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(60)
    cfg = short_tmp / "fuyoud.toml"
    cfg.write_text(fuyou_client.connection.to_toml(merge(SMALL, merge({
        "daemon": {"state_dir": str(short_tmp / "state"), "runtime_dir": str(short_tmp / "run")},
        "metrics": {"enabled": False}}, config_extra or {}))))
    proc = subprocess.Popen([sys.executable, "-m", "fuyoud", "--config", str(cfg)],
                            env=dict(os.environ, NOTIFY_SOCKET=str(notify_path), **env_extra),
                            stderr=subprocess.PIPE, text=True)
    assert b"READY=1" in listener.recv(4096)
    return proc, listener, short_tmp / "run" / "fuyoud.sock"


def pings(listener, seconds):
    listener.settimeout(0.1)
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            n += listener.recv(4096).count(b"WATCHDOG=1")
        except socket.timeout:
            pass
    return n


@pytest.mark.slow  # (waits for the watchdog to fall silent: about 7 s)
def test_watchdog_pings_while_serving_and_stops_when_stuck(short_tmp):
    # Two gRPC workers; Status requests hang at a failpoint: once both workers hang, the
    # watchdog's health probe cannot be served and the pings must stop.
    proc, listener, sock = start_raw(short_tmp, {"WATCHDOG_USEC": "400000", "FUYOUD_FAILPOINTS": "rpc.Status=hang"},
                                     {"daemon": {"grpc_workers": 2}})
    try:
        assert pings(listener, 1.5) >= 3  # every 0.2 s while healthy
        import grpc

        from fuyou_proto import rpc

        channel = grpc.insecure_channel(f"unix:{sock}")
        stub = rpc.FuyouAdminStub(channel)
        stuck = [stub.Status.future(pb.StatusRequest(), timeout=30) for _ in range(2)]
        time.sleep(0.5)
        assert pings(listener, 2.0) == 0
        assert all(not f.done() for f in stuck)
    finally:
        proc.kill()
        proc.wait()
        listener.close()
    log = proc.stderr.read()
    assert "withholding WATCHDOG=1" in log and "level=error" in log


def test_logs_are_one_line_per_event_and_hold_no_tokens(short_tmp):
    proc, listener, sock = start_raw(short_tmp, {})
    try:
        with fuyou_client.connect(str(sock)) as s:
            token = dict(s.metadata)["x-fuyou-session"]
            with pytest.raises(fuyou_client.ObjectNotFound):
                s.stat("missing")
        admin = (short_tmp / "run" / "admin.token").read_text().strip()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    lines = proc.stderr.read().splitlines()
    assert any("session 1 opened" in line for line in lines)
    for line in lines:
        assert line.startswith("ts=") and " level=" in line and " msg=" in line, line
    text = "\n".join(lines)
    assert token not in text and admin not in text


def test_journald_format_under_systemd(short_tmp):
    """With stderr being the journal ($JOURNAL_STREAM names it) lines carry <priority>."""
    log_path = short_tmp / "journal"
    with open(log_path, "w") as f:
        st = os.fstat(f.fileno())
        cfg = short_tmp / "c.toml"
        cfg.write_text('[daemon]\nlog_level = "debug"\n')
        code = subprocess.run(
            [sys.executable, "-c", "import logging, sys; from fuyoud.operations import logs; logs.setup('info'); "
             "logging.getLogger('fuyoud').warning('disk %s is slow', 'ssd0'); "
             "logging.getLogger('fuyoud').info('multi\\nline')"],
            stderr=f, env=dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}"), timeout=60).returncode
    assert code == 0
    lines = log_path.read_text().splitlines()
    assert lines == ['<4>level=warning logger=fuyoud msg="disk ssd0 is slow"',
                     '<6>level=info logger=fuyoud msg="multi\\nline"']


def test_sockets_mode_and_group(short_tmp):
    import grp

    group = grp.getgrgid(os.getgroups()[-1] if os.getgroups() else os.getgid()).gr_name
    proc, listener, sock = start_raw(short_tmp, {}, {"daemon": {"socket_group": group, "socket_mode": 0o660}})
    try:
        for path in (sock, short_tmp / "run" / "session.sock"):
            st = path.stat()
            assert st.st_mode & 0o777 == 0o660 and grp.getgrgid(st.st_gid).gr_name == group
    finally:
        proc.kill()
        proc.wait()
        listener.close()

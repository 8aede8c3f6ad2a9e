"""Hostile files: checkpoint manifests (JSON of every wrong shape, paths that leave the
directory, sizes that lie, symlinks, FIFOs, directories and hard links where files
belong, client states that are no pickle of plain data) and client-state bytes. The
daemon answers each restore with a clear error or restores only bytes from inside the
checkpoint; it never reads the secret file beside it, never hangs and stays up; the
client never runs code from a client state."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
import zlib
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fuyou_client
from conftest import in_process_config
from fuyou_client.checkpoints.state import client_state, load_client_state
from fuyoud.server import Daemon

SECRET = b"SECRET-OUTSIDE-THE-CHECKPOINT" * 142  # 4118 bytes
INSIDE = bytes(range(256)) * 16  # 4096 bytes: objects/000000.bin, a real file of the checkpoint
INSIDE_CRC = zlib.crc32(INSIDE)
EXPECTED = {"INVALID_ARGUMENT", "NOT_FOUND", "DATA_LOSS", "PERMISSION_DENIED", "FAILED_PRECONDITION",
            "RESOURCE_EXHAUSTED", "ALREADY_EXISTS"}


@pytest.fixture(scope="module")
def files_daemon():
    root = Path(tempfile.mkdtemp(prefix="fy-ff", dir="/tmp"))
    (root / "ckpts").mkdir()
    (root / "secret.bin").write_bytes(SECRET)
    daemon = Daemon(in_process_config(root, ndirs=1, storage__capacity_per_device="64MiB",
                                      daemon__checkpoint_dirs=[str(root / "ckpts")]))
    daemon.start()
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


# Names a manifest may give its files: the layout's, and everything else a hostile one tries.
FILES = ["objects/000000.bin", "objects/000001.bin", "objects/000002.bin", "objects/000003.bin",
         "objects/000004.bin", "objects/000009.bin", "../secret.bin", "objects/../../secret.bin", "/etc/passwd",
         "objects/000000.bin/..", "manifest.json", "objects", "", "objects/0.bin"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8),
                   st.sampled_from([0, 4096, 4095, len(SECRET), 2**50, -1, INSIDE_CRC, "4096", [4096]]))
OBJECT = st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.sampled_from(["w", "optim/rest", "snapshots/x", "", "/abs", "a" * 600, "\x00"]), VALUES),
    "file": st.one_of(st.sampled_from(FILES), VALUES),
    "size": st.one_of(st.sampled_from([4096, len(SECRET), 0, 4097]), VALUES),
    "version": VALUES,
    "crc32": st.one_of(st.just(INSIDE_CRC), VALUES),
    "snapshot": st.one_of(st.sampled_from(["snapshots/1/w", "w", "optim/rest", "../x"]), VALUES),
})
MANIFEST = st.fixed_dictionaries({}, optional={
    "format": st.one_of(st.just("fuyou-checkpoint/1"), VALUES),
    "mode": st.one_of(st.sampled_from(["copy", "snapshot", "auto"]), VALUES),
    "namespace": st.one_of(st.sampled_from(["ff", "other", "../x", "a" * 200]), VALUES),
    "step": st.one_of(st.just(1), VALUES),
    "groups": st.one_of(st.just([]), VALUES, st.lists(VALUES, max_size=2)),
    "objects": st.one_of(st.lists(OBJECT, max_size=3), VALUES),
})
VALID_OBJECT = {"name": "w", "file": "objects/000000.bin", "size": 4096, "version": 1, "crc32": INSIDE_CRC}


def near_valid(field: str, value, where: str) -> dict:
    """A valid copy manifest with one field of it, or of its object, replaced."""
    obj = dict(VALID_OBJECT)
    manifest = {"format": "fuyou-checkpoint/1", "mode": "copy", "namespace": "ff", "step": 1, "groups": [],
                "objects": [obj]}
    if where == "object":
        obj[field] = value
    elif where == "manifest":
        manifest[field] = value
    return manifest


NEAR_VALID = st.builds(near_valid, st.sampled_from(sorted(VALID_OBJECT) + ["mode", "namespace", "step"]),
                       st.one_of(st.sampled_from(FILES), VALUES), st.sampled_from(["object", "manifest", "none"]))
RAW = st.sampled_from([b"", b"\xff\xfe garbage", b"[" * 100_000, b'{"format": "fuyou-checkpoint/1"', b"null",
                       b'{"format": "fuyou-checkpoint/1", "step": 1' + b"1" * 5000 + b"}", b"NaN"])
CLIENT_STATE = st.sampled_from(["missing", "file", "symlink", "fifo", "dir", "huge"])


def lay_out(d: Path, root: Path, client: str) -> None:
    """A checkpoint directory whose objects/ holds one real file and every kind of trap."""
    objects = d / "objects"
    objects.mkdir(parents=True)
    (objects / "000000.bin").write_bytes(INSIDE)
    os.symlink(root / "secret.bin", objects / "000001.bin")
    (objects / "000002.bin").mkdir()
    os.mkfifo(objects / "000003.bin")
    os.link(root / "secret.bin", objects / "000004.bin")
    if client == "file":
        (d / "client_state.bin").write_bytes(b"opaque")
    elif client == "symlink":
        os.symlink("/dev/zero", d / "client_state.bin")
    elif client == "fifo":
        os.mkfifo(d / "client_state.bin")
    elif client == "dir":
        (d / "client_state.bin").mkdir()
    elif client == "huge":
        with open(d / "client_state.bin", "wb") as f:
            f.truncate(17 << 20)  # sparse: no disk


def test_hostile_manifests_read_nothing_outside_their_checkpoint(files_daemon):
    daemon, root = files_daemon
    sock = str(daemon.config.daemon.control_path)
    stats = {"restored": 0, "codes": {}}
    counter = iter(range(10**6))

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(MANIFEST, NEAR_VALID).map(lambda m: json.dumps(m).encode()) | RAW, CLIENT_STATE,
           st.sampled_from(["dir", "symlink-dir", "file"]))
    def fuzz(manifest, client, kind):
        d = root / "ckpts" / f"c{next(counter)}"
        target = d
        if kind == "symlink-dir":  # the checkpoint directory itself a symlink to one elsewhere
            target = root / f"elsewhere-{d.name}"
            os.symlink(target, d)
        if kind == "file":
            d.write_bytes(manifest)
        else:
            lay_out(target, root, client)
            (target / "manifest.json").write_bytes(manifest)
        with fuyou_client.connect(sock, namespace="ff") as s:
            try:
                reply = s.restore(d)
            except fuyou_client.FuyouClientError as exc:
                stats["codes"][exc.code] = stats["codes"].get(exc.code, 0) + 1
                assert exc.code in EXPECTED, (exc.code, str(exc))
                assert len(str(exc)) <= 2048 and "0x" not in str(exc)
            else:  # only what the checkpoint's own file holds, from a real directory
                stats["restored"] += 1
                assert kind == "dir" and reply.mode == "copy"
                buf = s.allocate(1 << 16)
                for info in s.objects():
                    s.swap_in(info.name, buf, length=info.size)
                    assert bytes(buf.view[:info.size]) == INSIDE[:info.size]
                    s.delete(info.name)
        if kind == "symlink-dir":
            os.unlink(d)
            shutil.rmtree(target)
        elif kind == "file":
            d.unlink()
        else:
            shutil.rmtree(d)

    fuzz()
    assert stats["restored"] > 0  # the strategy reaches valid manifests too
    with fuyou_client.connect(sock) as s:
        assert s.status().version  # still serving
    print(json.dumps(stats))


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/fuyou-client-state-exploit",))


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.binary(max_size=300),
                 st.sampled_from([pickle.dumps(_Exploit(), protocol=2), pickle.dumps({"format": 1, "lr": {"lr": "x"}}, protocol=2),
                                  pickle.dumps({"format": 1, "lr": {"lr": float("nan")}}, protocol=2),
                                  pickle.dumps({"format": 1, "groups": [{"betas": [0.9, "x"]}]}, protocol=2),
                                  pickle.dumps({"format": 1, "groups": [{"lr": 1.0, "foreach": False}]}, protocol=2),
                                  pickle.dumps({"format": 1, "groups": {"lr": 1.0}}, protocol=2)]),
                 st.builds(lambda cut: client_state_bytes()[:cut], st.integers(0, 2000))))
def test_hostile_client_states_are_refused_and_run_nothing(data):
    try:
        state = load_client_state(data)
    except ValueError as exc:
        assert "client state" in str(exc)
    else:
        assert set(state) == {"groups", "extra"}
    assert not os.path.exists("/tmp/fuyou-client-state-exploit")


def client_state_bytes() -> bytes:
    return client_state([{"lr": 0.001, "initial_lr": 0.01}], {"sched": {"last_epoch": 3}, "batch": 17})


def test_a_client_state_round_trips():
    state = load_client_state(client_state_bytes())
    assert state == {"groups": [{"lr": 0.001, "initial_lr": 0.01}], "extra": {"sched": {"last_epoch": 3}, "batch": 17}}


def test_oversized_values_come_back_as_short_errors(files_daemon):
    """A 100 KB name is refused by its length, in a message gRPC can carry."""
    daemon, _ = files_daemon
    from fuyou_proto import pb

    huge = "n" * 100_000
    with fuyou_client.connect(str(daemon.config.daemon.control_path)) as s:
        calls = [
            ("Stat", pb.StatRequest(name=huge), "512"),
            ("Stat", pb.StatRequest(namespace=huge, name="x"), "not this session's"),
            ("Delete", pb.DeleteRequest(names=[huge]), "512"),
            ("GetGroup", pb.GetGroupRequest(name=huge), "512"),
            ("Restore", pb.RestoreRequest(directory="/" + huge), ""),
            ("Checkpoint", pb.CheckpointRequest(directory="/tmp/" + huge, mode=huge), ""),
        ]
        for method, request, words in calls:
            with pytest.raises(grpc.RpcError) as err:
                getattr(s.stub, method)(request, metadata=s.metadata, timeout=10)
            code, details = err.value.code(), err.value.details()
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.FAILED_PRECONDITION), (method, code, details[:200])
            assert len(details) <= 2048 and words in details, (method, details[:200])
    with pytest.raises(fuyou_client.InvalidArgument, match="1-128 characters") as err:
        fuyou_client.connect(str(daemon.config.daemon.control_path), namespace="n" * 60_000)
    assert len(str(err.value)) < 400

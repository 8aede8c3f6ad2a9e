"""Checkpoints are the user's: the client creates the directory and its files and hands
fuyoud their descriptors, and the daemon writes and reads only through them
(client/fuyou_client/connection/checkpoint_files.py, fuyoud/checkpoints/handed.py). Here,
what a client may hand is checked: files not open for writing, not empty, not the count the
namespace needs, names outside the layout; descriptors never taken are closed with the
session; and the daemon says what its store's life is (no /proc read by the client).
The same under the host's daemon as another uid: tests/test_user_world.py."""
from __future__ import annotations

import os
import stat

import pytest

import fuyou_client
from conftest import SMALL, private_daemon
from fuyou_proto import pb


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(SMALL, prefix="fy-hand-") as d:
        yield d


def _stored(s, name="w/x", size=8192):
    buf = s.allocate(size)
    buf.view[:4] = b"abcd"
    s.swap_out(name, buf, persistent=True)


def _hand_and_checkpoint(s, tmp_path, files, directory="ck"):
    """Hand a partial directory and ``files`` ((name, fd) each) and ask for a copy."""
    partial = tmp_path / f"{directory}.partial-1"
    partial.mkdir()
    dir_fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY)
    try:
        s.hand("k1", ["dir", *(n for n, _ in files)], [dir_fd, *(fd for _, fd in files)])
    finally:
        os.close(dir_fd)
        for _, fd in files:
            os.close(fd)
    return s.call("Checkpoint", pb.CheckpointRequest(directory=str(tmp_path / directory), mode="copy", handed="k1"))


def test_a_checkpoint_is_the_callers_files_and_restores(daemon, tmp_path):
    with fuyou_client.connect(daemon.socket, namespace="hand-own") as s:
        _stored(s)
        reply = s.checkpoint(tmp_path / "ck", mode="copy")
        assert reply.mode == "copy" and reply.objects == 1
        files = [p for p in (tmp_path / "ck").rglob("*")]
        assert {p.relative_to(tmp_path / "ck").as_posix() for p in files} == {
            "manifest.json", "client_state.bin", "objects", "objects/000000.bin"}
        assert all(p.stat().st_uid == os.getuid() for p in files)
        assert all(stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600) for p in files)
        assert not list(tmp_path.glob("ck.partial-*"))
        s.delete("w/x")
        s.restore(tmp_path / "ck")
        out = s.allocate(8192)
        s.swap_in("w/x", out)
        assert bytes(out.view[:4]) == b"abcd"
        s.delete_checkpoint(tmp_path / "ck")
        assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("case", ["read-only", "not-empty", "appending", "too-few", "outside-layout"])
def test_what_a_client_hands_is_checked(daemon, tmp_path, case):
    with fuyou_client.connect(daemon.socket, namespace=f"hand-{case}") as s:
        _stored(s)
        path = tmp_path / "f.bin"
        flags = {"read-only": os.O_RDONLY, "appending": os.O_WRONLY | os.O_APPEND}.get(case, os.O_RDWR)
        fd = os.open(path, flags | os.O_CREAT, 0o600)
        if case == "not-empty":
            os.write(fd, b"x")
        name = "../escape" if case == "outside-layout" else "objects/000000.bin"
        files = [] if case == "too-few" else [(name, fd)]
        if case == "too-few":
            os.close(fd)
        with pytest.raises(fuyou_client.FuyouClientError) as info:
            _hand_and_checkpoint(s, tmp_path, files)
        want = {"read-only": "not open for writing", "appending": "not open for writing",
                "not-empty": "not a new, empty regular file", "too-few": "changed in between",
                "outside-layout": "not a file of a checkpoint"}[case]
        assert want in str(info.value)
        assert path.read_bytes() == (b"x" if case == "not-empty" else b"")  # (nothing written through it)


def test_a_hand_over_no_request_takes_is_closed_with_the_session(daemon, tmp_path):
    def open_fds():
        return len(os.listdir(f"/proc/{daemon.pid}/fd"))

    before = open_fds()
    s = fuyou_client.connect(daemon.socket, namespace="hand-left")
    fds = [os.open(tmp_path / f"{i}.bin", os.O_RDWR | os.O_CREAT, 0o600) for i in range(40)]
    try:
        s.hand("never-taken", [f"objects/{i:06d}.bin" for i in range(40)], fds)
    finally:
        for fd in fds:
            os.close(fd)
    s.status()  # (a round trip: the hand-over has been read by now, or is being read)
    s.close()
    for _ in range(200):
        if open_fds() <= before:
            break
        import time
        time.sleep(0.05)
    assert open_fds() <= before


def test_the_daemon_says_whether_its_store_outlives_it(tmp_path):
    temporary = fuyou_client.start_daemon(config=SMALL)  # (deletes its store when it stops)
    kept = fuyou_client.start_daemon(tmp_path / "state", config=SMALL)
    try:
        with fuyou_client.connect(temporary.socket) as s:
            assert s.status().store_outlives_daemon is False
        with fuyou_client.connect(kept.socket) as s:
            assert s.status().store_outlives_daemon is True
    finally:
        assert temporary.stop() == 0
        assert kept.stop() == 0

"""Isolation: a client of another uid (root setuids a child to nobody) is refused unless
configured, and once admitted reaches nothing of another user's."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

import fuyou_client
from conftest import SMALL, merge

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")

# Starts as root (the interpreter may live where nobody can read: a clone in a 0700 home
# directory), imports everything it will need (modules imported later, as grpc imports
# its channel module, would not be found once nobody), then drops to uid/gid 65534
# before it connects: SO_PEERCRED sees nobody. Each probe records what it got ("OK",
# or the error's class and message).
CLIENT = textwrap.dedent("""
    import importlib, json, os, pkgutil, sys
    import grpc, grpc._channel
    import fuyou_client, fuyou_proto
    from fuyou_proto import pb
    for pkg in (fuyou_client, fuyou_proto):
        for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if mod.name != "fuyou_proto.generate":
                importlib.import_module(mod.name)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    socket, root_dir, ckpt, token_path, mine, secret, state = sys.argv[1:8]
    out = {}
    def probe(name, fn):
        try:
            fn()
            out[name] = "OK"
        except fuyou_client.FuyouClientError as exc:
            out[name] = type(exc).__name__ + ": " + str(exc)
        except Exception as exc:
            out[name] = "error " + type(exc).__name__ + ": " + str(exc)
    try:
        s = fuyou_client.connect(socket)
    except fuyou_client.FuyouClientError as exc:
        print(json.dumps({"connect": str(exc)})); sys.exit(0)
    out["connect"] = "OK"
    buf = s.allocate(1 << 20)
    probe("own_object", lambda: (s.swap_out("x", buf, persistent=True), s.swap_in("x", buf)))
    probe("root_namespace", lambda: fuyou_client.connect(socket, namespace="rootns"))
    def other_ns():
        s.stub.Stat(pb.StatRequest(namespace="rootns", name="secret"), metadata=s.metadata)
    probe("other_namespace_stat", other_ns)
    def forged():
        ref = pb.BufferRef(segment=1, offset=0, length=4096, generation=1)
        s.stub.SwapIn(pb.SwapInRequest(items=[pb.SwapInItem(name="x", buffer=ref, length=4096)]),
                      metadata=s.metadata)
    probe("forged_handle", forged)
    probe("checkpoint_outside", lambda: s.checkpoint(root_dir + "/mine"))
    # (the raw request, naming a path the daemon would write with its own rights)
    probe("raw_checkpoint_outside", lambda: s.call("Checkpoint", pb.CheckpointRequest(directory=root_dir + "/mine")))
    probe("restore_roots", lambda: s.restore(ckpt))
    probe("drain", lambda: s.admin_stub.Drain(pb.DrainRequest(), metadata=s.metadata))
    probe("list_namespaces", lambda: s.admin_stub.ListNamespaces(pb.Empty(), metadata=s.metadata))
    probe("delete_namespace", lambda: s.admin_stub.DeleteNamespace(pb.DeleteNamespaceRequest(namespace="rootns"),
                                                                    metadata=s.metadata))
    probe("admin_token", lambda: open(token_path).read())
    probe("read_their_manifest", lambda: open(ckpt + "/manifest.json").read())
    probe("read_index", lambda: open(state + "/index.sqlite", "rb").read())
    def seen(reply):
        return sorted((x.uid, x.namespace) for x in reply)
    out["list_sessions"] = seen(s.admin_stub.ListSessions(pb.Empty(), metadata=s.metadata).sessions)
    out["status_sessions"] = seen(s.admin_stub.Status(pb.StatusRequest()).session_list)
    # Checkpoints of its own making, in the directory it may write under checkpoint_dirs:
    # file entries that leave the directory, a symlink, and another user's namespace.
    def crafted(name, objects, mode="copy", namespace=s.namespace, links=()):
        d = os.path.join(mine, name)
        os.makedirs(d + "/objects")
        for rel, target in links:
            os.symlink(target, os.path.join(d, rel))
        with open(d + "/manifest.json", "w") as f:
            json.dump({"format": "fuyou-checkpoint/1", "mode": mode, "namespace": namespace, "step": 1,
                       "groups": [], "objects": objects}, f)
        return d
    size = os.path.getsize(secret) if os.access(secret, os.R_OK) else 4096
    dots = "../" * 8 + secret.lstrip("/")
    escape = crafted("escape", [{"name": "loot", "file": dots, "size": 4096, "version": 1, "crc32": 0}])
    probe("restore_escape", lambda: s.restore(escape))
    sym = crafted("sym", [{"name": "loot", "file": "objects/000000.bin", "size": 4096, "version": 1, "crc32": 0}],
                  links=[("objects/000000.bin", secret)])
    probe("restore_symlink", lambda: s.restore(sym))
    theirs = crafted("theirs", [{"name": "secret", "snapshot": "secret", "size": 4096, "version": 1}],
                     mode="snapshot", namespace="rootns")
    probe("restore_their_namespace", lambda: s.restore(theirs))
    probe("delete_theirs", lambda: s.delete_checkpoint(ckpt))
    probe("loot", lambda: s.swap_in("loot", buf))
    # Its own checkpoint (recorded by the daemon) restores; a directory put in its place does not.
    own = os.path.join(mine, "own")
    probe("own_checkpoint", lambda: (s.checkpoint(own, mode="copy"), s.restore(own)))
    os.rename(own, own + ".moved")
    crafted("own", [{"name": "loot", "file": "objects/000000.bin", "size": 4096, "version": 1, "crc32": 0}])
    with open(own + "/objects/000000.bin", "wb") as f:
        f.write(bytes(4096))
    probe("restore_replaced", lambda: s.restore(own))
    probe("delete_own", lambda: s.delete_checkpoint(own + ".moved"))
    s.close()
    print(json.dumps(out))
""")


def run_as_nobody(socket, root_dir, ckpt, token_path, mine="-", secret="-", state="-"):
    args = (socket, root_dir, ckpt, token_path, mine, secret, state)
    proc = subprocess.run([sys.executable, "-c", CLIENT, *map(str, args)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start(short_tmp, **daemon):
    os.chmod(short_tmp, 0o755)  # let nobody reach the sockets (their own mode still decides)
    cfg = merge(SMALL, {"daemon": {"socket_group": "nogroup", **daemon}})
    d = fuyou_client.start_daemon(short_tmp / "state", config=cfg)
    (short_tmp / "state").chmod(0o755)  # (a private daemon's is 0700) the files' own modes must keep nobody out
    return d


@pytest.mark.slow  # (clients run as another uid, each a Python start: about 16 s; test_socket_access.py refuses one too)
@needs_root
def test_another_uid_is_refused_unless_configured(short_tmp):
    d = start(short_tmp, allow_group="root")
    try:
        got = run_as_nobody(d.socket, short_tmp, short_tmp / "none", short_tmp / "none")
        assert "uid 65534 may not use this fuyoud" in got["connect"] and "allow_uids" in got["connect"]
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.slow  # (a client as another uid tries every way in: about 13 s)
@needs_root
def test_an_admitted_uid_reaches_nothing_of_another_users(short_tmp):
    d = start(short_tmp, allow_uids=[NOBODY], checkpoint_dirs=[str(short_tmp / "ckpts")])
    try:
        with fuyou_client.connect(d.socket, namespace="rootns") as root:
            secret = root.allocate(4096)
            secret.view[:5] = b"hello"
            root.swap_out("secret", secret, persistent=True)
            root.checkpoint(short_tmp / "ckpts" / "root-ckpt", mode="copy")
        (short_tmp / "ckpts").chmod(0o755)  # an operator who gives each tenant a directory to write
        mine = short_tmp / "ckpts" / "nobody"
        mine.mkdir()
        os.chown(mine, NOBODY, NOBODY)
        secret = short_tmp / "secret.bin"
        secret.write_bytes(b"TOP SECRET" * 410)
        secret.chmod(0o600)
        with fuyou_client.connect(d.socket, namespace="rootns2"):  # a live session of root's while nobody looks
            got = run_as_nobody(d.socket, short_tmp, short_tmp / "ckpts" / "root-ckpt",
                                os.path.join(os.path.dirname(d.socket), "admin.token"), mine, secret,
                                short_tmp / "state")
        assert got["connect"] == "OK" and got["own_object"] == "OK"
        assert got["root_namespace"].startswith("PermissionDenied") and "belongs to uid 0" in got["root_namespace"]
        assert "PERMISSION_DENIED" in got["other_namespace_stat"] and "not this session's" in got["other_namespace_stat"]
        assert "not one of this session's" in got["forged_handle"]
        # The client writes a checkpoint with its user's rights (it may not write there); the
        # daemon writes by path only inside checkpoint_dirs.
        assert got["checkpoint_outside"].startswith("PermissionDenied") and "may not write" in got["checkpoint_outside"]
        assert (got["raw_checkpoint_outside"].startswith("PermissionDenied")
                and "checkpoint_dirs" in got["raw_checkpoint_outside"])
        assert got["restore_roots"].startswith("PermissionDenied") and "may not open" in got["restore_roots"]
        assert "PERMISSION_DENIED" in got["drain"] and "admin token" in got["drain"]
        for call in ("list_namespaces", "delete_namespace"):  # (another user's namespaces, named or not)
            assert "PERMISSION_DENIED" in got[call] and "admin token" in got[call], got[call]
        assert got["admin_token"].startswith("error PermissionError")
        # The daemon's files are its own: another user's checkpoint and the index are not readable.
        assert got["read_their_manifest"].startswith("error PermissionError"), got["read_their_manifest"]
        assert got["read_index"].startswith("error PermissionError"), got["read_index"]
        # Sessions are listed to their own users only (the operator sees all with the admin token).
        assert got["list_sessions"] == [[NOBODY, got["list_sessions"][0][1]]] and len(got["list_sessions"]) == 1
        assert got["status_sessions"] == []
        # A manifest of the tenant's own making reads nothing outside its directory, follows no
        # symlink, reaches no other namespace, and its errors tell nothing of what it pointed at.
        assert got["restore_escape"].startswith("InvalidArgument") and "objects/NNNNNN.bin" in got["restore_escape"]
        assert got["restore_symlink"].startswith("InvalidArgument") and "symlink" in got["restore_symlink"]
        assert got["restore_their_namespace"].startswith("PermissionDenied"), got["restore_their_namespace"]
        assert got["delete_theirs"].startswith("PermissionDenied") and "may not open" in got["delete_theirs"]
        assert got["loot"].startswith("ObjectNotFound")
        assert not any("0x" in v for v in got.values() if isinstance(v, str))
        assert got["own_checkpoint"] == "OK"
        # (the daemon recorded the checkpoint at that path: a manifest put there since is refused)
        assert got["restore_replaced"].startswith("DataLoss") and "changed since" in got["restore_replaced"]
        # (moved, it is a copy the daemon has no record of, in the tenant's own directory: the
        # tenant removes it as it could anyway)
        assert got["delete_own"] == "OK", got["delete_own"]
        with fuyou_client.connect(d.socket, namespace="rootns") as root:  # untouched
            out = root.allocate(4096)
            root.swap_in("secret", out)
            assert bytes(out.view[:5]) == b"hello"
    finally:
        assert d.stop() == 0, d.log()


def test_shared_memory_fds_go_only_to_their_own_session(daemon):
    """Segments are memfds passed over each session's own socket: another session's
    allocations never reach this one's socket."""
    import socket as socket_mod

    with fuyou_client.connect(daemon.socket) as a, fuyou_client.connect(daemon.socket) as b:
        mine = [a.allocate(4096)]
        theirs = [b.allocate(9 << 20) for _ in range(3)]  # each its own segment
        mine.append(a.allocate(9 << 20))
        assert set(a._segments) == {buf.ref.segment for buf in mine}
        assert set(b._segments) == {buf.ref.segment for buf in theirs}
        a._sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing else is waiting on a's socket
            socket_mod.recv_fds(a._sock, 4096, 4)
        a._sock.setblocking(True)


def test_files_the_daemon_writes_are_its_own_whatever_the_umask(short_tmp):
    """Under umask 0 (the most open a host could have), everything under the state, data
    and checkpoint directories after a run is the daemon's user's alone: regular files
    0600, directories writable by it only; the sockets keep their configured mode."""
    data = short_tmp / "ssd"
    old = os.umask(0)
    try:
        d = fuyou_client.start_daemon(short_tmp / "state", config=merge(SMALL, {"storage": {"data_dirs": [str(data)]}}))
    finally:
        os.umask(old)
    try:
        with fuyou_client.connect(d.socket, namespace="modes") as s:
            buf = s.allocate(1 << 20)
            s.create_group("g", buf, fuyou_client.AdamW())
            s.step_group("g", buf, lr=1e-3)
            s.swap_out("t", buf)  # a transient object too
            state = short_tmp / "state"
            s.checkpoint(state / "checkpoints" / "copy", mode="copy", client_state=b"x")
            s.checkpoint(state / "checkpoints" / "snap", mode="snapshot")
    finally:
        assert d.stop() == 0, d.log()
    seen = []
    for root in (short_tmp / "state", data):
        for path in [root, *root.rglob("*")]:
            st = path.lstat()
            seen.append(path.name)
            if stat.S_ISSOCK(st.st_mode):
                assert stat.S_IMODE(st.st_mode) == 0o660, path
            elif stat.S_ISDIR(st.st_mode):
                assert stat.S_IMODE(st.st_mode) & 0o022 == 0, f"{path}: {stat.filemode(st.st_mode)}"
            else:
                assert stat.S_ISREG(st.st_mode), path
                assert stat.S_IMODE(st.st_mode) & 0o077 == 0, f"{path}: {stat.filemode(st.st_mode)}"
    for name in ("index.sqlite", "fuyou.data", "manifest.json", "client_state.bin", "000000.bin"):
        assert name in seen

"""A user the file system keeps away from fuyoud's sockets is told so at once, with what
to do (run as root with a client that drops to uid nobody)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import fuyou_client
from conftest import SMALL, merge

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")

# Imports as root (the interpreter may live where nobody can read), drops to nobody,
# connects, and reports the error and how long it took.
CLIENT = textwrap.dedent("""
    import json, os, sys, time
    import fuyou_client
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    t0 = time.monotonic()
    try:
        fuyou_client.connect(sys.argv[1]).close()
        out = {"error": "none"}
    except fuyou_client.FuyouClientError as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out))
""")


def connect_as_nobody(sock: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CLIENT, sock], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_user_outside_the_sockets_group_is_told_at_once(short_tmp):
    os.chmod(short_tmp, 0o755)
    run = short_tmp / "run"  # (0755: the socket's own mode, 0660 in group root, is what refuses)
    d = fuyou_client.start_daemon(short_tmp / "state", config=merge(SMALL, {
        "daemon": {"socket_group": "root", "runtime_dir": str(run)}}))
    try:
        got = connect_as_nobody(d.socket)
        assert got["error"] == "PermissionDenied", got
        assert f"permission denied on {d.socket}" in got["message"] and "group root" in got["message"]
        assert "usermod -aG root nobody" in got["message"]
        # Not the 10 s that gRPC waits for a socket it cannot connect to: a generous bound,
        # only to show that nothing waits out a timeout.
        assert got["seconds"] < 3, got
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.slow  # (a client as another uid: about 8 s)
def test_a_runtime_directory_the_user_cannot_enter_is_named(short_tmp):
    os.chmod(short_tmp, 0o755)
    run = short_tmp / "closed" / "run"
    run.mkdir(parents=True)
    os.chmod(short_tmp / "closed", 0o700)
    d = fuyou_client.start_daemon(short_tmp / "state", config=merge(SMALL, {"daemon": {"runtime_dir": str(run)}}))
    try:
        got = connect_as_nobody(d.socket)
        assert got["error"] == "PermissionDenied", got
        assert f"permission denied on {short_tmp / 'closed'}" in got["message"], got
        assert got["seconds"] < 3, got
    finally:
        assert d.stop() == 0, d.log()

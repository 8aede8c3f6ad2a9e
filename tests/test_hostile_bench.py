"""bench/hostile.py end to end, tiny (one round, three steps, a few seconds of flood): the
promises its JSON makes, not its timings. The attacker is uid nobody (65534), so this
needs root, that uid and the group nogroup."""
from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fuyoud.config import DaemonSection

ROOT = Path(__file__).resolve().parents[1]


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the attacker runs as another user, uid 65534 (nobody)"
    try:
        pwd.getpwuid(65534)
        grp.getgrnam("nogroup")
    except KeyError:
        return "no uid 65534 (nobody) or no group nogroup on this host"
    ours = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, shutil.which(ours, path="/usr/bin:/usr/local/bin")):
        if python is None:
            continue
        try:
            subprocess.run([python, "-c", "pass"], user=65534, group=65534, extra_groups=[], cwd="/",
                           check=True, capture_output=True, timeout=60)
            return None
        except (PermissionError, subprocess.CalledProcessError):
            pass
    return f"uid 65534 can run neither {sys.executable} nor a system {ours}"


@pytest.mark.slow
@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_hostile_tenant_tiny(tmp_path):
    parent = Path(tempfile.mkdtemp(prefix="fy-hostile-test-"))  # (not tmp_path: uid nobody must traverse it)
    os.chmod(parent, 0o755)
    out = tmp_path / "hostile.json"
    try:
        subprocess.run([sys.executable, str(ROOT / "bench" / "hostile.py"), "--rounds", "1", "--steps", "3",
                        "--seconds", "3", "--dir", str(parent), "--json", str(out)], check=True, timeout=600)
        assert os.listdir(parent) == []  # the run's directory, the daemon's state and data files: gone
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    result = json.loads(out.read_text())
    assert result["command"].startswith("python bench/hostile.py") and result["host"] and result["date"]
    s = result["summary"]
    assert s["victim_errors"] == []
    assert s["losses_bitwise_as_alone"]
    before, after = s["resources"]["before"], s["resources"]["after"]
    for key in ("pinned_used_bytes", "pinned_reserved_bytes", "ssd_used_bytes", "objects", "sessions"):
        assert after[key] == before[key], key
    # Threads and descriptors: back to where they started but for the gRPC worker pool,
    # which grows as requests come, up to [daemon] grpc_workers threads, and keeps them,
    # each with its own io_uring ring once it did I/O (fuyoud/io/uring.py), plus the Status
    # call's connection. The daemon's own (Python) threads are counted; gRPC core's
    # event_engine threads and io_uring's iou-wrk ones, which those libraries size and
    # shrink themselves, are not. One more Python thread than the pool appears in the
    # first hostile round and no more after it (a 4-round run: 17 -> 34 -> 34 -> 34 -> 34).
    pool = DaemonSection.grpc_workers
    python = {k: s["resources"][k]["thread_names"].get("python", 0) for k in ("before", "after")}
    assert python["after"] <= python["before"] + pool + 1, (before, after)
    assert after["descriptors"] <= before["descriptors"] + pool + 1, (before, after)
    # The attacker met each limit of [limits], and the daemon counted it so.
    assert {"user_sessions", "user_pinned", "user_ssd"} <= set(s["attacker_refused_by"])
    counts = result["rounds"][0]["attacker"]["counts"]
    assert counts["sessions_admitted"] == 64 and counts.get("children_killed_mid_call", 0) > 0
    for limit in ("sessions", "pinned", "ssd"):
        assert result["metrics"][f'fuyoud_user_limit_refusals_total{{limit="{limit}"}}'] > 0

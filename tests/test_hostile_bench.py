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


ROOT = Path(__file__).resolve().parents[1]


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the attacker runs as another user, uid 65534 (nobody)"
    try:
        pwd.getpwuid(65534)
        grp.getgrnam("nogroup")
    except KeyError:
        return "no uid 65534 (nobody) or no group nogroup on this host"
    return None  # (the attacker starts as root, imports, then drops to nobody: any checkout will do)


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
    # A plan admitted is a plan held: the victim attached before the attacker ramped up, so
    # its plan together is its plan alone, literally, and the attacker got what it left.
    assert s["plan_as_alone"], (result["rounds"][0]["plan_alone"], result["rounds"][0]["plan_together"])
    budget, got = 1 << 30, s["attacker_got"]
    assert 0 < s["victim_reserved_bytes"] and got["sessions"] == 64
    assert 0 < got["pinned_reserved_bytes"] <= min(budget * 3 // 4, budget - s["victim_reserved_bytes"])
    before, after = s["resources"]["before"], s["resources"]["after"]
    for key in ("pinned_used_bytes", "pinned_reserved_bytes", "ssd_used_bytes", "objects", "sessions"):
        assert after[key] == before[key], key
    # Threads and descriptors: after the warm-up started the pools the daemon grows once and
    # keeps (gRPC's workers, an io_uring ring and an OpenMP pool each), every thread name and
    # every descriptor kind back to its count before (iou-wrk-*, io_uring's own transient
    # workers, are not compared), no slack.
    for part in ("threads", "descriptors"):
        for name, n in after[part].items():
            assert n <= before[part].get(name, 0), (part, name, before[part], after[part])
    assert s["above_before"] == {}
    # The attacker met the limits of [limits] (its pinned memory: the user's share or, where
    # the victim's plan holds more than the rest, the budget), and the daemon counted them.
    assert {"user_sessions", "user_ssd"} <= set(s["attacker_refused_by"])
    assert {"user_pinned", "pinned_budget"} & set(s["attacker_refused_by"])
    assert result["rounds"][0]["attacker"]["counts"].get("children_killed_mid_call", 0) > 0
    for limit in ("sessions", "ssd"):
        assert result["metrics"][f'fuyoud_user_limit_refusals_total{{limit="{limit}"}}'] > 0

"""bench/tenants.py end to end, small (two jobs of three steps, a 64 MiB arena): the real
run takes minutes; this keeps the script from rotting and holds its exactness check."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "tenants.py"


@pytest.mark.slow  # (five training processes one after another and two at once: about 60 s)
def test_tenants_bench_runs_end_to_end_small(tmp_path):
    out = tmp_path / "tenants.json"
    run = subprocess.run([sys.executable, str(BENCH), "--json", str(out), "--jobs", "2", "--steps", "3",
                          "--rounds", "1", "--layers", "2", "--width", "128", "--seq", "32", "--batch", "2",
                          "--arena-gib", "0.0625", "--dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    assert r["command"] and r["host"] and r["date"]
    two = r["results"]["2"]
    assert two["exact"] and set(two["jobs"]) == {"0", "1"}
    for job in two["jobs"].values():
        assert job["slowdown"] > 0 and job["losses_bitwise_as_alone"]
    assert "arena_seconds_together" in two["rounds"][0]["jobs"]["0"]
    assert [p.name for p in tmp_path.iterdir()] == ["tenants.json"]  # the daemon's state is gone

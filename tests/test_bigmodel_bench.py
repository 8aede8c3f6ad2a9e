"""bench/bigmodel.py end to end on a tiny model (``--over 0``): the real run needs tens of GB
of disk and many minutes, so it is not in the suite; this keeps the script from rotting."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bigmodel.py"


@pytest.mark.slow  # (bench/bigmodel.py in a subprocess: about 20 s)
def test_bigmodel_bench_runs_end_to_end_on_a_tiny_model(tmp_path):
    out = tmp_path / "big.json"
    run = subprocess.run([sys.executable, str(BENCH), "--json", str(out), "--width", "64", "--heads", "4",
                          "--layers", "3", "--vocab", "256", "--seq", "16", "--steps", "3", "--over", "0",
                          "--lr", "1e-2", "--bare-size", "8MiB", "--buffer-budget", "16MiB", "--pinned-budget",
                          "256MiB", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    for key in ("params", "state_bytes", "physical_memory_bytes", "state_over_memory", "peak_rss_over_state",
                "optimizer_over_ssd_bound", "ssd_bytes_per_param_per_iter", "losses"):
        assert key in r, key
    assert r["layers"] == 3 and len(r["losses"]) == 3 and r["losses"][-1] < r["losses"][0]
    assert r["ssd_bytes_per_param_per_iter"] > 0 and r["peak_rss_client_bytes"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["big.json"]  # the work files are gone


def test_bigmodel_bench_refuses_clearly_without_the_disk(tmp_path):
    run = subprocess.run([sys.executable, str(BENCH), "--json", str(tmp_path / "x.json"), "--over", "1000",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "free; this run needs" in run.stderr, run.stderr

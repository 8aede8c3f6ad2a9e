"""Load, short: 8 clients at once for a few seconds, every byte verified; a greedy
client is refused by its memory budget and SSD quota and does not starve the others
(bench/load.py runs it for minutes and reports throughput and latency)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import load  # noqa: E402


def test_eight_clients_verified_and_a_greedy_one_held_by_its_quotas():
    result = load.run(clients=8, seconds=3, rounds=1, directory=None)
    assert result["daemon_exit"] == 0
    for name in ("alone", "greedy"):
        p = result["phases"][name][0]
        assert not p["modest_errors"], p["modest_errors"]
        assert len(p["modest_ops"]) == 7 and min(p["modest_ops"]) > 0  # everyone made progress
    g = result["phases"]["greedy"][0]["greedy"]
    assert not g["errors"], g["errors"]
    assert "budget" in g["memory_refused"] and g["allocated"] <= 48 << 20
    assert "quota" in g["quota_refused"] and g["stored"] <= 96 << 20
    assert g["flood_bytes"] > 0

"""bench/scale.py end to end at a tiny size: the real run (a ~95M-parameter GPT-2 at N = 1, 2
and 4, three rounds) takes about a quarter of an hour, so it is not in the suite; this keeps the
script, its worker and their JSON from rotting. No timing is asserted (this machine is shared)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "scale.py"
KEYS = ("ssd_bytes_per_param_per_iter_per_rank", "network_bytes_per_param_per_iter_per_rank",
        "tcp_sent_bytes_per_param_per_iter_per_rank", "network_formula_ring_bytes_per_param_per_iter_per_rank",
        "network_formula_gloo_bytes_per_param_per_iter_per_rank", "step_over_ssd_bound", "exposed_optimizer_fraction",
        "pinned_bytes_per_session", "iter_s", "tokens_per_s", "targets")


def test_scale_bench_runs_end_to_end_on_a_tiny_model(tmp_path):
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, str(BENCH), "--json", str(out), "--layers", "2", "--width", "64",
                          "--vocab", "256", "--seq", "16", "--batch", "1", "--iters", "2", "--rounds", "1",
                          "--configs", "n1,n2,n2x2", "--bf16-configs", "", "--bare-size", "16MiB",
                          "--buffer-budget", "32MiB", "--pinned-budget", "512MiB", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    assert r["host"]["cpus"] >= 1 and "scale.py" in r["command"] and r["disk"]["read_gbps"] > 0
    configs = r["configs"]
    assert set(configs) == {"n1", "n2", "n2x2"}
    for name, m in configs.items():
        for key in KEYS:
            assert key in m, (name, key)
        n = m["ranks"]
        assert (n, m["daemons"]) == {"n1": (1, 1), "n2": (2, 1), "n2x2": (2, 2)}[name]
        # 24 bytes per parameter per iteration in all (state read and written), 1/N per rank; a tiny
        # model's headers and shard padding add a little.
        assert 0.9 * 24 / n < m["ssd_bytes_per_param_per_iter_per_rank"] < 1.5 * 24 / n, (name, m)
        assert m["tokens_per_s"] > 0 and 0 <= m["exposed_optimizer_fraction"] < 1 and m["step_over_ssd_bound"] > 0
        assert m["pinned_bytes_per_session"] > 0
        assert all(d["counters_agree_across_ranks"] for d in m["per_daemon_last"])
        if n == 1:
            assert m["tcp_sent_bytes_per_param_per_iter_per_rank"] == 0
        else:  # at least the ring's payload; gloo moves more (its reduce-scatter is an all-reduce)
            tcp = m["tcp_sent_bytes_per_param_per_iter_per_rank"]
            assert m["network_formula_ring_bytes_per_param_per_iter_per_rank"] <= tcp, (name, m)
            assert tcp < 1.5 * m["network_formula_gloo_bytes_per_param_per_iter_per_rank"], (name, m)
            assert m["tokens_per_s_over_n1"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["scale.json"]  # the work files are gone

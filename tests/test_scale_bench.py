"""bench/scale.py end to end at a tiny size: the real run (a ~95M-parameter GPT-2 at N = 1, 2
and 4, resident and offloaded, three rounds) takes about half an hour, so it is not in the suite;
this keeps the script, its worker and their JSON from rotting, with one offloaded configuration
(two simulated hosts, offload=True). No timing is asserted (this machine is shared)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "scale.py"
KEYS = ("ssd_bytes_per_param_per_iter_per_rank", "ssd_expected_bytes_per_param_per_iter_per_rank",
        "network_bytes_per_param_per_iter_per_rank", "tcp_sent_bytes_per_param_per_iter_per_rank",
        "network_formula_bytes_per_param_per_iter_per_rank", "network_formula_ring_bytes_per_param_per_iter_per_rank",
        "network_formula_gloo_bytes_per_param_per_iter_per_rank",
        "network_collectives_bytes_per_param_per_iter_per_rank",
        "fetch_gathers_per_iter", "step_over_ssd_bound", "exposed_optimizer_fraction", "pinned_bytes_per_session",
        "iter_s", "tokens_per_s", "targets")
SHAPES = {"n1": (1, 1, False), "n2": (2, 1, False), "n2x2o": (2, 2, True)}  # ranks, daemons, offload


@pytest.mark.slow  # (about a minute: three torchrun launches; `-m slow` runs it)
def test_scale_bench_runs_end_to_end_on_a_tiny_model(tmp_path):
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, str(BENCH), "--json", str(out), "--layers", "2", "--width", "64",
                          "--vocab", "256", "--seq", "16", "--batch", "1", "--iters", "2", "--rounds", "1",
                          "--configs", ",".join(SHAPES), "--bf16-configs", "", "--bare-size", "16MiB",
                          "--buffer-budget", "32MiB", "--pinned-budget", "512MiB", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    assert r["host"]["cpus"] >= 1 and "scale.py" in r["command"] and r["disk"]["read_gbps"] > 0
    assert set(r["formulas"]) == {"ssd_bytes_per_param_per_iter_per_rank", "network_bytes_per_param_per_iter_per_rank"}
    configs = r["configs"]
    assert set(configs) == set(SHAPES)
    for name, m in configs.items():
        for key in KEYS:
            assert key in m, (name, key)
        n = m["ranks"]
        assert (n, m["daemons"], m["offload"]) == SHAPES[name]
        ssd, expected = m["ssd_bytes_per_param_per_iter_per_rank"], m["ssd_expected_bytes_per_param_per_iter_per_rank"]
        if m["offload"]:
            # the state's 24 and forward's fetch of the blocks' weights, 4 x their share (the embeddings stay
            # resident), 1/N per rank; a tiny model's objects are under one 1 MiB checksum block, so a fetch
            # out of a state object reads the whole object to check it: far more than the design's 4
            assert 0 < m["offloaded_fraction"] < 1 and expected == pytest.approx((24 + 4 * m["offloaded_fraction"]) / n)
            assert 0.9 * expected < ssd < 1.5 * 28 / n, (name, m)
            assert m["weights_fetched_bytes_per_param_per_iter_per_rank"] > 0, (name, m)
            assert m["weights_served_bytes_per_param_per_iter_per_rank"] > 0, (name, m)  # backward's, read ahead
            assert m["targets"]["ssd_bytes_target"] == pytest.approx(28 / n)
        else:
            # 24 bytes per parameter per iteration in all (state read and written), 1/N per rank; a tiny
            # model's headers and shard padding add a little.
            assert expected == pytest.approx(24 / n) and 0.9 * 24 / n < ssd < 1.5 * 24 / n, (name, m)
            assert m["targets"]["ssd_bytes_target"] == pytest.approx(24 / n)
        assert m["tokens_per_s"] > 0 and 0 <= m["exposed_optimizer_fraction"] < 1 and m["step_over_ssd_bound"] > 0
        assert m["pinned_bytes_per_session"] > 0
        assert all(d["counters_agree_across_ranks"] for d in m["per_daemon_last"])
        tcp = m["tcp_sent_bytes_per_param_per_iter_per_rank"]
        formula = m["network_formula_bytes_per_param_per_iter_per_rank"]
        if n == 1:
            assert tcp == 0 and formula == 0 and m["fetch_gathers_per_iter"] == 0
            continue
        # the collectives the engine asked for are the formula's: one reduce-scatter per group ((N-1)/N of
        # its padded flat vector sent per rank: an all-to-all on gloo), one all-gather per resident group, one
        # per fetch of an offloaded block (forward's and backward's; the last block's only forward's)
        assert m["network_collectives_bytes_per_param_per_iter_per_rank"] == pytest.approx(formula, rel=1e-9)
        assert m["fetch_gathers_per_iter"] == m["fetch_gathers_per_iter_formula"]
        assert m["network_formula_ring_bytes_per_param_per_iter_per_rank"] == formula
        assert m["network_formula_gloo_bytes_per_param_per_iter_per_rank"] == formula
        if m["offload"]:
            assert m["fetch_gathers_per_iter"] == 2 * 2 - 1 and m["barrier_gathers_per_iter"] == 1  # (the rest group)
            assert formula > 8 * (n - 1) / n
        else:  # two fp32 vectors' worth, (N-1)/N each; the shards' padding adds a little at this size
            assert m["fetch_gathers_per_iter"] == 0
            assert 8 * (n - 1) / n <= formula < 1.1 * 8 * (n - 1) / n
        assert formula <= tcp < 1.5 * formula, (name, m)  # (TCP adds the barriers and gloo's headers)
        assert m["tokens_per_s_over_n1"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["scale.json"]  # the work files are gone

"""bench/optimizer.py and bench/train.py at tiny sizes, every AdamW state dtype side by side in one
run: the JSON keeps its fp32 top-level keys and adds ``by_state_dtype``, and the SSD bytes each
dtype moves per parameter fall fp32 > bf16 > int8 (bytes, not times: times are noise here)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
DTYPES = ("fp32", "bf16", "int8")


@pytest.mark.slow  # (bench/optimizer.py, three dtypes over three rounds: about 40 s)
def test_optimizer_bench_reports_every_state_dtype(short_tmp):
    out = short_tmp / "opt.json"
    run = subprocess.run([sys.executable, str(BENCH / "optimizer.py"), "--json", str(out), "--params", "2M",
                          "--groups", "4", "--rounds", "3", "--warmup", "1", "--ssd-size", "1GiB", "--no-peers",
                          "--dir", str(short_tmp)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    for key in ("fuyou_step_s", "ssd_bound_s", "fuyou_over_ssd_bound", "state_bytes", "correctness"):
        assert key in r, key
    # how, where and when, as tests/test_figures.py asks of a result a page cites; the command reruns it
    assert r["command"] == "python bench/optimizer.py " + " ".join(run.args[2:]) and r["host"] and r["date"]
    assert r["state_dtype"] == "fp32" and r["correctness"]["bitwise_equal"]
    by = r["by_state_dtype"]
    assert sorted(by) == sorted(DTYPES)
    for dt in DTYPES:
        for key in ("fuyou_step_s", "ssd_bound_s", "fuyou_over_ssd_bound", "fuyou_over_ssd_bound_paired",
                    "ssd_bytes_per_param_per_step", "expected_ssd_bytes_per_param_per_step", "state_bytes"):
            assert by[dt][key] is not None and by[dt][key] > 0, (dt, key)
    assert by["fp32"]["fuyou_step_s"] == r["fuyou_step_s"] and by["fp32"]["state_bytes"] == r["state_bytes"]
    measured = [by[dt]["ssd_bytes_per_param_per_step"] for dt in DTYPES]
    assert measured[0] > measured[1] > measured[2], measured
    # (a step's read-ahead of the next step's first group may land in either step's window: means over 3 rounds)
    assert measured[0] == pytest.approx(24, rel=0.1), measured
    assert [p.name for p in short_tmp.iterdir()] == ["opt.json"]  # the work files are gone


@pytest.mark.slow  # (bench/optimizer.py writes a 1 GiB file for its bound: about 22 s)
def test_optimizer_bench_takes_fewer_state_dtypes(short_tmp):
    out = short_tmp / "opt.json"
    run = subprocess.run([sys.executable, str(BENCH / "optimizer.py"), "--json", str(out), "--params", "1M",
                          "--groups", "1", "--rounds", "1", "--warmup", "0", "--ssd-size", "1GiB", "--no-peers",
                          "--state-dtypes", "int8", "--dir", str(short_tmp)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    assert r["state_dtype"] == "int8" and list(r["by_state_dtype"]) == ["int8"]
    assert r["by_state_dtype"]["int8"]["fuyou_step_s"] == r["fuyou_step_s"]


@pytest.mark.slow  # (bench/train.py, three dtypes: about 30 s)
def test_train_bench_reports_every_state_dtype(short_tmp):
    pytest.importorskip("transformers")
    out = short_tmp / "train.json"
    run = subprocess.run([sys.executable, str(BENCH / "train.py"), "--json", str(out), "--layers", "1", "--width",
                          "64", "--seq", "16", "--batch", "1", "--vocab", "128", "--steps", "2", "--warmup", "1",
                          "--rounds", "1", "--no-resident", "--dir", str(short_tmp)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    for key in ("fuyou_tokens_per_s", "ssd_bytes_per_param_per_iter", "exposed_optimizer_fraction",
                "expected_state_bytes_per_param_per_iter"):
        assert key in r, key
    by = r["by_state_dtype"]
    assert r["state_dtype"] == "fp32" and sorted(by) == sorted(DTYPES)
    for dt in DTYPES:
        for key in ("fuyou_tokens_per_s", "ssd_bytes_per_param_per_iter", "state_bytes_per_param_per_iter",
                    "expected_state_bytes_per_param_per_iter", "exposed_optimizer_fraction"):
            assert key in by[dt], (dt, key)
    assert by["fp32"]["ssd_bytes_per_param_per_iter"] == r["ssd_bytes_per_param_per_iter"]
    for key in ("ssd_bytes_per_param_per_iter", "expected_state_bytes_per_param_per_iter"):
        got = [by[dt][key] for dt in DTYPES]
        assert got[0] > got[1] > got[2], (key, got)
    assert [p.name for p in short_tmp.iterdir()] == ["train.json"]

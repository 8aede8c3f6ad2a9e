"""bench/gpu.py's own plumbing, on the CPU (``--cpu``): worker processes, interleaved
rounds, Fuyou through the stand-in for a device with its own memory (host weights and
host gradient accumulation, as on the GPU), ``--profile``'s traces, and the JSON keys
issue 7 asks for. Its numbers mean nothing here; they come from a GPU host. What this
catches is a run that breaks before it measures, which costs a GPU session its time."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_benchmark_runs_end_to_end_on_the_cpu(short_tmp):
    pytest.importorskip("transformers")
    out, prof = short_tmp / "gpu.json", short_tmp / "prof"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--cpu", "--json", str(out), "--dir", str(short_tmp),
         "--profile", str(prof), "--width", "128", "--seq", "32", "--cap", "16MiB", "--micro", "2", "--accum", "4",
         "--iters", "1", "--ssd-probe", "64MiB", "--host-budget", "256MiB", "--buffer-budget", "128MiB",
         "--weights", "host", "--grads", "host"],
        capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == {}
    for key in ("fuyou_tflops", "inmem_ceiling_tflops", "zero_infinity_tflops", "gpu_busy_fraction",
                "model_params", "gpu_cap_bytes", "ssd_read_GBps", "ssd_write_GBps"):
        assert key in res, key
    assert res["state_over_cap"] >= 4 and res["gpu_cap_bytes"] == 16 << 20
    assert res["fuyou_tflops"] > 0 and res["inmem_ceiling_tflops"] > 0 and res["zero_infinity_tflops"] is None
    assert [r["warmup"] for r in res["rounds"]] == [True, False]
    assert all("fuyou" in r and "ceiling" in r for r in res["rounds"])
    assert res["fuyou_info"]["micro"] == 2 and res["fuyou_info"]["micro_fallbacks"] == []
    for name in ("fuyou", "ceiling"):
        assert res["profiles"][name]["profile"]["micro_batches"] == 3
        with gzip.open(prof / f"{name}-trace.json.gz") as f:
            assert json.load(f)["traceEvents"]
        assert "Self CPU" in (prof / f"{name}-ops.txt").read_text()
    assert not list(short_tmp.glob("gpu-*"))  # the work directory is gone

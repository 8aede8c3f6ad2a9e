"""bench/dpo_memory.py at a tiny size: both cases run, the JSON has every figure the TRL page
quotes, with its command, host and date, and the two cases train to the same losses (memory
figures themselves are noise at this size: not asserted)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.slow  # (four tiny DPO runs, each in a new Python: about 40 s)
def test_dpo_memory_bench_runs_both_cases(short_tmp):
    pytest.importorskip("trl")
    out = short_tmp / "dpo.json"
    run = subprocess.run([sys.executable, str(BENCH / "dpo_memory.py"), "--json", str(out), "--layers", "2", "--width",
                          "128", "--steps", "2", "--rounds", "1", "--dir", str(short_tmp)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    for key in ("command", "host", "date", "reference_block_bytes", "client_peak_gib", "client_peak_saved_gib",
                "saved_over_reference_blocks", "daemon_peak_gib"):
        assert key in r, key
    assert set(r["client_peak_gib"]) == {"streamed", "in_memory"} and r["same_losses"]
    assert [p.name for p in short_tmp.iterdir()] == ["dpo.json"]  # (the work directory is gone)

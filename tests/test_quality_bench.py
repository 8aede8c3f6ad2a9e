"""bench/quality.py: the state dtypes' loss curves against fp32's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import quality  # noqa: E402


def test_the_comparison_is_relative_per_step_and_names_the_worst_step():
    base = {"losses": [4.0, 2.0, 1.0], "final_loss": 1.0, "mean_last_10": 2.0}
    run = {"losses": [4.0, 2.2, 0.99], "final_loss": 0.99, "mean_last_10": 2.1}
    c = quality.compare(run, base)
    assert c["largest_at_step"] == 2 and c["largest_step_difference"] == pytest.approx(0.1)
    assert c["final_vs_fp32"] == pytest.approx(-0.01) and c["mean_last_10_vs_fp32"] == pytest.approx(0.05)
    assert c["mean_step_difference"] == pytest.approx((0 + 0.1 + 0.01) / 3)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--width", "-1"], ["--state-dtypes", "bf16,fp32"],
                                  ["--state-dtypes", "fp32,fp16"], ["--state-dtypes", "fp32,int8,int8"]])
def test_bad_arguments_are_refused_before_any_run(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        quality.main(argv)
    err = capsys.readouterr().err
    expected = "must be a positive integer" if argv[0] != "--state-dtypes" else "fp32 first"
    assert exit_.value.code == 2 and expected in err, err


@pytest.mark.slow  # (three demo runs of two steps, each with its own fuyoud: about 45 s)
def test_the_bench_runs_each_state_dtype_and_says_how_where_and_when(tmp_path):
    out = tmp_path / "q.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "quality.py"), "--json", str(out), "--steps", "2",
                    "--layers", "1", "--width", "64"], check=True, capture_output=True, timeout=180)
    r = json.loads(out.read_text())
    assert r["command"] and r["host"] and r["date"]
    assert set(r["runs"]) == {"fp32", "bf16", "int8"} and set(r["vs_fp32"]) == {"bf16", "int8"}
    assert all(len(run["losses"]) == 2 for run in r["runs"].values())

"""bench/gpu_model.py, the model of an iteration on a capped GPU: it reproduces the one H100
run's times (bench/results/gpu-h100.json) and bounds its GPU busy share, its block-major
schedule moves the bytes that schedule says, and it predicts the issue's targets met on both
model families (the exposed step: what must follow the last gradients). Pure arithmetic on
the CPU (FLOPs are counted on the meta device): seconds, no GPU, no timing asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
pytest.importorskip("transformers")
import gpu_model as gm  # noqa: E402
from fuyou_client.sizing import iteration  # noqa: E402

RUN = gm.load(ROOT / "bench" / "results" / "gpu-h100.json")


@pytest.fixture(scope="module")
def rates():
    return gm.calibrate(RUN)


def test_today_reproduces_the_h100_run_within_5_percent(rates):
    """The micro-batch's time, the step's and the model TFLOPS within 5% (they are within
    3.5%). NVML's GPU busy share (0.442) is bounded, not reproduced: the model's own kernels
    run 0.322 of the iteration, so Fuyou's loop ran kernels beyond them (which, unknown
    without a profile: bench/gpu.py --profile), and those can only add to the model's; and
    they can have run only while the model has the compute stream waiting on the host path
    (0.444 of the iteration), else the micro-batch's time, which the model reproduces, would
    be longer: so NVML's share lies between the model's kernels' share and its compute
    stream's (0.376) plus those waits."""
    cal = gm.calibration(RUN, rates)
    assert set(cal["relative_error"]) == {"micro_batch_seconds", "step_seconds", "model_tflops", "gpu_busy"}
    assert cal["calibration_error"] == max(cal["relative_error"][k] for k in gm.TIMED) <= 0.05, cal
    low, high = cal["gpu_busy_bounds"]
    assert low == cal["model_kernel_share"] < cal["model"]["gpu_busy"] < high
    assert low <= RUN["results"]["fuyou"]["busy"] <= high and cal["gpu_busy_within_bounds"], cal
    # the model only reproduces the run if a download and an addition never overlap
    overlapped = gm.breakdown(replace(gm.recorded(RUN), overlap=True), rates)
    assert overlapped["micro_batch_seconds"] < 0.7 * RUN["results"]["fuyou"]["micro_batch_seconds"]


def test_every_second_of_an_iteration_is_accounted_for(rates):
    for name, b in gm.candidates(gm.recorded(RUN), rates).items():
        assert sum(b["seconds"].values()) == pytest.approx(b["iteration_seconds"], rel=1e-9), name
        assert b["seconds"]["gpu compute"] / b["iteration_seconds"] == pytest.approx(b["gpu_busy"]), name


def last_steps_seconds(cfg: gm.Config, rates) -> float:
    """What must follow the last gradients: block 0's state written, the rest group's state
    read and written (one transfer at a time on the SSD array), and their AdamW."""
    io = iteration.state_io(cfg.shape, cfg.product)
    block, rest = gm.params(cfg.width, cfg.seq)
    return (io[0][1] + io["rest"][1]) / rates.ssd_write / 1e9 + io["rest"][0] / rates.ssd_read / 1e9 + \
        (block + rest) / rates.adam


@pytest.mark.parametrize("width", [2048, 4096])
def test_block_major_reaches_0_8_of_the_ceiling(rates, width):
    """Block-major at the run's settings: 0.8 of the ceiling or more, GPU busy 0.9, no host
    additions, 9 GB of weights and gradients over PCIe; of the steps, only what must follow
    the last gradients is exposed (block 0's and the rest's), within 1 s for the run's
    2048-wide family. Not for the 4096-wide one at the run's SSD (2.1 GB/s read, 3.0 write):
    block 0 holds 201M parameters, whose 2.4 GB of state alone take 0.81 s to write once its
    gradient exists, and the rest's 0.86 GB 0.29 s more."""
    base = gm.recorded(RUN)
    base = replace(base, schedule="block-major", weights="host", width=width,
                   layers=gm.depth_for(width, base.seq, base.cap))
    block, rest = gm.params(width, base.seq)
    assert 16 * (base.layers * block + rest) >= 4 * base.cap  # bench/gpu.py's family: state 4x the cap
    best = gm.choose(base, rates)
    assert best["tokens"] >= 300_000 and best["fits_device"] and best["fits_host"]
    assert best["over_ceiling"] >= 0.8, best["over_ceiling"]
    assert best["gpu_busy"] >= 0.9 and best["host_additions"] == 0
    assert best["exposed_step_seconds"] <= last_steps_seconds(gm.Config(**best["config"]), rates)
    assert best["exposed_step_seconds"] <= 1.0 or width != 2048
    assert best["pcie_weights_and_gradients_bytes"] <= 9e9
    # still so if larger micro-batches were no faster per FLOP than the ceiling's
    assert gm.breakdown(gm.Config(**best["config"]), gm.at_ceiling_rate(rates))["over_ceiling"] >= 0.8


@pytest.mark.parametrize("weights", ["host", "ssd"])
def test_block_major_moves_the_bytes_its_schedule_says(rates, weights):
    L, K = 21, 64
    cfg = gm.Config(schedule="block-major", width=2048, layers=L, micro=8, accum=K, weights=weights)
    block, rest = gm.params(cfg.width, cfg.seq)
    ckpt = cfg.micro * cfg.seq * cfg.width * 2
    got = gm.breakdown(cfg, rates)
    b = got["bytes"]
    assert b["h2d: weights"] == 2 * L * 2 * block + 2 * rest  # up twice per block; the rest once, after its step
    assert b["d2h: gradients"] == L * 4 * block + 4 * rest  # down once per block
    assert got["host_additions"] == 0 and "host memory: additions" not in b
    # forward: every block's input and the last one's output down, the tail's input gradient down;
    # backward: each block's checkpoint and output gradient up, its input gradient down;
    # the tail's replay: the last output and block 0's input gradient up
    assert b["d2h: checkpoints"] == ((L + 1) * K + K + L * K) * ckpt
    assert b["h2d: checkpoints"] == ((L - 1) * K + 2 * L * K + 2 * K) * ckpt
    n = L * block + rest
    assert got["ssd_bytes_per_param"] == pytest.approx(24 + (4 * L * block / n if weights == "ssd" else 0), rel=1e-3)
    assert got["host_arena_bytes"] == (L + 2) * K * ckpt  # what blockmajor.Store reserves
    bf16 = gm.breakdown(gm.replace(cfg, grad_bytes=2), rates)["bytes"]
    assert bf16["d2h: gradients"] == L * 2 * block + 4 * rest


def test_today_adds_every_micro_batch_but_the_first(rates):
    cfg = replace(gm.recorded(RUN), accum=8)
    b = gm.breakdown(cfg, rates)
    groups = cfg.layers + 1
    assert b["host_additions"] == 7 * groups
    assert b["bytes"]["d2h: gradients"] == 8 * 4 * b["params"]
    assert b["ssd_bytes_per_param"] == pytest.approx(24, rel=1e-3)  # (12 B/param each way, and headers)


def test_json_has_the_keys_the_issue_asks_for(tmp_path):
    out = tmp_path / "model.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_model.py"), "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads(out.read_text())
    for key in ("calibration_error", "schedule", "predicted_tflops", "predicted_over_ceiling",
                "predicted_over_ceiling_wide", "schedules", "rates"):
        assert key in res, key
    assert res["schedule"] == "block-major" and res["calibration_error"] <= 0.05
    assert res["calibration"]["gpu_busy_within_bounds"] and len(res["calibration"]["gpu_busy_bounds"]) == 2
    assert res["predicted_over_ceiling"] >= 0.8 and res["predicted_over_ceiling_wide"] >= 0.8
    for b in res["schedules"].values():
        assert {"seconds", "bytes", "model_tflops", "gpu_busy", "exposed_step_seconds"} <= set(b)
    assert "block-major" in run.stdout and "step exposed" in run.stdout

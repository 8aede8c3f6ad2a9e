"""Fit the kernel model's free constants (sizing/kernels.py: GEMM_EDGE, LAUNCH_S) on every
in-GPU run recorded, and show how each run is reproduced.

    python bench/kernel_fit.py            # the fit and the table
    python bench/kernel_fit.py --check    # the table with kernels.py's constants as they are

The runs: bench/results/gpu-h100.json and bench/results/gpu-h200/gpu-bench-*.json, each
with its in-GPU cases (iteration.in_gpu_runs: the capped ceiling, 3 blocks of width 2048
at 2 x 1024 tokens, and in the newer runs Fuyou's 21-block model in GPU memory at 4, 8 or 16
sequences a micro-batch), fp32 parameters under bf16 autocast, recomputed; and, once a GPU
session has run gpu_session.sh's wide stage, bench/results/gpu-*/gpu-wide-*.json: the capped
ceiling alone at widths 4096 and 5120 (none recorded yet). Each GPU at its
shipped profile (datasheet peak and memory bandwidth, published GEMM and attention
efficiencies). Two observables a case: the time a kernel ran per micro-batch (NVML's
utilisation times the micro-batch's time: ``busy``) and the micro-batch's time.

GEMM_EDGE is the value that makes the largest relative error of ``busy`` over all cases
least (every other term of ``busy`` is counted or published); LAUNCH_S then the one that
makes the largest relative error of the micro-batch's time least (the idle time between
kernels is what it adds). The capped ceiling's idle time moved by a factor two between the
H200 calls (bench/results/gpu-h200/SESSION.md: its time by 24%, its busy time by 4%): the
host's issue time, not the GPU's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from fuyou_client.sizing import kernels
from fuyou_client.sizing.gpu_runs import in_gpu_runs, in_gpu_time, known_gpu

ROOT = Path(__file__).resolve().parent.parent
RUNS = [ROOT / "bench" / "results" / "gpu-h100.json",
        *sorted((ROOT / "bench" / "results" / "gpu-h200").glob("gpu-bench-*.json")),
        # the capped ceiling alone at wider blocks (gpu_session.sh's wide stage), where recorded
        *sorted((ROOT / "bench" / "results").glob("gpu-*/gpu-wide-*.json"))]


def cases() -> list[dict]:
    """Every recorded in-GPU case, with its run's file and GPU profile."""
    out = []
    for path in RUNS:
        run = json.loads(path.read_text())
        for case in in_gpu_runs(run):
            out.append(case | {"file": str(path.relative_to(ROOT)), "profile": known_gpu(run)})
    return out


def model(case: dict, **constants) -> kernels.Time:
    return in_gpu_time(kernels.GpuKernels.of(case["profile"], **constants), case)


def errors(all_cases: list[dict], edge: float, launch: float) -> list[tuple[float, float]]:
    """Per case: (relative error of busy, of the micro-batch's time)."""
    out = []
    for c in all_cases:
        t = model(c, gemm_edge=edge, launch_s=launch)
        out.append((t.busy / (c["busy"] * c["seconds"]) - 1, t.seconds / c["seconds"] - 1))
    return out


def _minimize(f, lo: float, hi: float, steps: int = 200) -> float:
    """The argument in [lo, hi] at which f (unimodal) is least: a grid, then golden sections."""
    grid = [lo + (hi - lo) * i / steps for i in range(steps + 1)]
    best = min(grid, key=f)
    a, b = max(lo, best - (hi - lo) / steps), min(hi, best + (hi - lo) / steps)
    for _ in range(60):
        m1, m2 = a + (b - a) * 0.382, a + (b - a) * 0.618
        a, b = (a, m2) if f(m1) <= f(m2) else (m1, b)
    return (a + b) / 2


def fit(all_cases: list[dict]) -> tuple[float, float]:
    edge = _minimize(lambda e: max(abs(b) for b, _ in errors(all_cases, e, 0.0)), 0.0, 4000.0)
    launch = _minimize(lambda c: max(abs(t) for _, t in errors(all_cases, edge, c)), 0.0, 1e-4)
    return edge, launch


def table(all_cases: list[dict], edge: float, launch: float) -> str:
    lines = [f"{'run':40} {'case':8} {'GPU':5} {'micro x blocks':>14} {'busy ms':>8} {'model':>8} {'error':>7} "
             f"{'time ms':>8} {'model':>8} {'error':>7}"]
    for c, (eb, et) in zip(all_cases, errors(all_cases, edge, launch)):
        t = model(c, gemm_edge=edge, launch_s=launch)
        lines.append(f"{c['file']:40} {c['case']:8} {c['profile'].name:5} {c['micro']:>9} x {c['layers']:<2} "
                     f"{c['busy'] * c['seconds'] * 1e3:8.2f} {t.busy * 1e3:8.2f} {eb:+7.1%} "
                     f"{c['seconds'] * 1e3:8.2f} {t.seconds * 1e3:8.2f} {et:+7.1%}")
    ceilings = [c for c in all_cases if c["case"] == "ceiling" and c["profile"].name == "h200"]
    if ceilings:
        median = statistics.median(c["seconds"] for c in ceilings)
        lines.append(f"the H200 ceilings' median time {median * 1e3:.2f} ms, the model's "
                     f"{model(ceilings[0], gemm_edge=edge, launch_s=launch).seconds * 1e3:.2f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="kernels.py's constants as they are, not fitted")
    args = ap.parse_args(argv)
    all_cases = cases()
    edge, launch = (kernels.GEMM_EDGE, kernels.LAUNCH_S) if args.check else fit(all_cases)
    print(f"GEMM_EDGE = {edge:.0f}  LAUNCH_S = {launch:.3g}  (HBM_EFFICIENCY {kernels.HBM_EFFICIENCY} assumed)")
    print(table(all_cases, edge, launch))
    return 0


if __name__ == "__main__":
    sys.exit(main())

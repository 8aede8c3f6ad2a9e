"""The optimizer state dtypes' training quality: the demo (examples/finetune.py) run once per
state dtype on the same model, batches and seed, its per-step losses compared with fp32's.

    python bench/quality.py [--json .fuyou/bench/quality.json] [--steps 120 --layers 4 --width 384]
                            [--state-dtypes fp32,bf16,int8]

Each run is its own process with its own private fuyoud; the runs go one after another
(they would share the cores). The JSON holds the command, the host and the date, each
run's losses, and per state dtype against fp32: the final loss, the mean of the last 10
steps, and the largest and mean per-step relative difference (docs/guide/state-dtype.md
cites it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import host_info

ROOT = Path(__file__).resolve().parent.parent


def compare(run: dict, base: dict) -> dict:
    """``run``'s losses against ``base``'s, step by step (relative differences)."""
    diffs = [abs(a - b) / abs(b) for a, b in zip(run["losses"], base["losses"])]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return {"final_vs_fp32": run["final_loss"] / base["final_loss"] - 1,
            "mean_last_10_vs_fp32": run["mean_last_10"] / base["mean_last_10"] - 1,
            "largest_step_difference": diffs[worst], "largest_at_step": worst + 1,
            "mean_step_difference": sum(diffs) / len(diffs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=ROOT / ".fuyou" / "bench" / "quality.json")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--state-dtypes", default="fp32,bf16,int8")
    args = ap.parse_args(argv)
    for name in ("steps", "layers", "width"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be a positive integer, not {getattr(args, name)}")
    dtypes = args.state_dtypes.split(",")
    if dtypes[0] != "fp32" or not set(dtypes) <= {"fp32", "bf16", "int8"} or len(set(dtypes)) != len(dtypes):
        ap.error(f"--state-dtypes: fp32 first, then any of bf16 and int8 once each (not {args.state_dtypes!r})")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="fuyou-quality-") as tmp:
        host = host_info(Path(tmp))  # (the file system the runs' daemons write to)
        for dtype in dtypes:
            losses = Path(tmp) / f"{dtype}.json"
            cmd = [sys.executable, str(ROOT / "examples" / "finetune.py"), "--state-dtype", dtype, "--steps",
                   str(args.steps), "--layers", str(args.layers), "--width", str(args.width), "--losses", str(losses),
                   "--out", str(Path(tmp) / f"out-{dtype}"), "--state-dir", str(Path(tmp) / f"state-{dtype}")]
            print(f"{dtype}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs[dtype] = json.loads(losses.read_text())
            runs[dtype].pop("argv", None)
            print(f"{dtype}: final loss {runs[dtype]['final_loss']:.4f}, mean of the last 10 "
                  f"{runs[dtype]['mean_last_10']:.4f}, {runs[dtype]['seconds']:.0f} s", flush=True)
    out = {"command": "python " + " ".join(["bench/quality.py", *(argv if argv is not None else sys.argv[1:])]),
           "host": host,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "runs": runs,
           "vs_fp32": {d: compare(runs[d], runs["fp32"]) for d in dtypes[1:]}}
    for d, c in out["vs_fp32"].items():
        print(f"{d} vs fp32: final {c['final_vs_fp32']:+.2%}, last 10 {c['mean_last_10_vs_fp32']:+.2%}, "
              f"largest step {c['largest_step_difference']:.2%} (step {c['largest_at_step']}), "
              f"mean step {c['mean_step_difference']:.2%}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

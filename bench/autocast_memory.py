"""Host memory of a forward and backward under torch.autocast with offloaded weights,
against the same without autocast.

    python bench/autocast_memory.py [--json PATH] [--layers 12] [--width 1024] [--rounds 2]

A GPT-2-shaped model (fp32 parameters, every block offloaded) attached to a private fuyoud
trains one step, then a second whose peak resident memory is sampled every 5 ms; each case
runs in a process of its own, the cases in interleaved rounds (order rotated): ``plain``
(fp32 compute) and ``autocast`` (bf16, ``torch.autocast("cpu")``), each with
``activations="keep"`` and ``"recompute"``. Reported: the median peak over the memory
before the step, and the bf16 copy of the blocks' weights it is compared with (what
autocast's copies held until backward before they were saved as markers and its cache
cleared per block: engine/hooks.py, offload/offloader.py SavedCast).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CASES = [(compute, act) for act in ("keep", "recompute") for compute in ("plain", "autocast")]

WORKER = """
import json, os, sys, threading, time
import torch, transformers
import fuyou_client
compute, act, layers, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
d = fuyou_client.start_daemon(config={"storage": {"capacity_per_device": "8GiB"}})
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=16,
                                                              vocab_size=1000, n_positions=64))
blocks = sum(p.numel() for p in model.transformer.h.parameters())
engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=1e-4), socket=d.socket, offload=True, activations=act)
x = torch.randint(0, 1000, (1, 32))
peak, stop = [0], threading.Event()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
def step():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == "autocast"):
        loss = model(x, labels=x).loss
    loss.backward()
    engine.step()
    engine.zero_grad()
step()
base = rss()
sampler = threading.Thread(target=sample)
sampler.start()
step()
stop.set()
sampler.join()
print(json.dumps({"block_params": blocks, "peak_over_base": peak[0] - base}))
engine.close(materialize=False)
d.stop()
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    runs: dict[str, list[int]] = {f"{c}-{a}": [] for c, a in CASES}
    block_params = 0
    for r in range(args.rounds):
        for compute, act in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:
            out = subprocess.run([sys.executable, "-c", WORKER, compute, act, str(args.layers), str(args.width)],
                                 capture_output=True, text=True, timeout=1200)
            if out.returncode != 0:
                raise SystemExit(f"{compute}-{act} failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            block_params = result["block_params"]
            runs[f"{compute}-{act}"].append(result["peak_over_base"])
    mib = 1 << 20
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print(f"blocks: {block_params / 1e6:.0f}M parameters, their bf16 copy {2 * block_params / mib:.0f} MiB")
    for name, value in medians.items():
        print(f"{name:20s} peak over the step's start {value / mib:7.0f} MiB (rounds: "
              f"{', '.join(f'{v / mib:.0f}' for v in runs[name])})")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "block_params": block_params, "runs": runs,
                                         "medians": medians}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

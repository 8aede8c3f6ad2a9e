"""Activations: swap / recompute / auto at a batch that "keep" cannot fit, against "keep"
at the largest batch that fits.

    python bench/activations.py [--json PATH] [--layers 8] [--width 256] [--seq 256]
                                [--batch 8] [--steps 4] [--rounds 3] [--host-frac 0.25]

One GPT-2-style model (random init, dropout 0.1) is measured with ``activations="keep"``
at ``--batch`` to learn its activation peak on the compute device; the device budget
is set to half of it, so "keep" does not fit at that batch. Then, on one private
fuyoud, four engines (each its own copy of the model and session) train in interleaved
iterations (order rotated per round, ``--steps`` timed iterations per case per round
after one untimed warm-up iteration; three for auto, which profiles its second):

* swap:      ``activations="swap"`` at ``--batch``, host arena ``--host-frac`` of the
             activation bytes (the rest goes to SSD);
* recompute: ``activations="recompute"`` at ``--batch``;
* auto:      ``activations="auto"``, ``device_budget`` = the budget, same arena;
* keep:      ``activations="keep"`` at the largest batch whose peak fits the budget.

Reported: median iteration seconds and seconds per sample of each case, activation
bytes to host and to SSD per iteration, auto's plan, and the target "auto is never
slower than the best uniform treatment (swap, recompute) by more than 5%".
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

import fuyou_client

TARGET = 1.05


def model(layers: int, width: int, seq: int):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=512,
                                  n_positions=seq, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def iterate(m, engine, batch: int, seq: int, i: int) -> float:
    x = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(i))
    t0 = time.perf_counter()
    m(x, labels=x).loss.backward()
    engine.step()
    engine.zero_grad()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--host-frac", type=float, default=0.25)
    ap.add_argument("--dir", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fy-act-", dir=args.dir or "/tmp"))
    daemon = fuyou_client.start_daemon(root / "state", config={
        "storage": {"capacity_per_device": "8GiB"}, "memory": {"pinned_budget": "6GiB"}})
    try:
        probe = model(args.layers, args.width, args.seq)
        engine = fuyou_client.attach(probe, socket=daemon.socket)
        iterate(probe, engine, args.batch, args.seq, 0)
        peak = engine.activations.stats.device_peak
        engine.close()
        budget = peak // 2
        per_sample = peak / args.batch
        keep_batch = max(1, int(budget // per_sample))
        host = max(1 << 20, int(peak * args.host_frac))
        print(f"keep at batch {args.batch}: activation peak {peak / 2**20:.1f} MiB; budget {budget / 2**20:.1f} MiB; "
              f"keep fits batch {keep_batch}; host arena {host / 2**20:.1f} MiB")
        cases = {
            "swap": dict(activations="swap", host_budget=host),
            "recompute": dict(activations="recompute"),
            "auto": dict(activations="auto", device_budget=budget, host_budget=host),
            "keep": dict(activations="keep"),
        }
        runs = {}
        for name, kw in cases.items():
            m = model(args.layers, args.width, args.seq)
            runs[name] = (m, fuyou_client.attach(m, socket=daemon.socket, **kw))
        batches = {name: (keep_batch if name == "keep" else args.batch) for name in cases}
        for name, (m, e) in runs.items():  # warm-up; auto profiles its second iteration, plans, runs once
            for w in range(3 if name == "auto" else 1):
                iterate(m, e, batches[name], args.seq, 100 + w)
        times = {name: [] for name in cases}
        traffic = {name: [0, 0] for name in cases}
        order = list(cases)
        for r in range(args.rounds):
            order = order[1:] + order[:1]
            for s in range(args.steps):
                for name in order:
                    m, e = runs[name]
                    stats = e.activations.stats
                    before = (stats.copied, stats.spilled)
                    times[name].append(iterate(m, e, batches[name], args.seq, 1000 * r + s))
                    traffic[name][0] += stats.copied - before[0]
                    traffic[name][1] += stats.spilled - before[1]
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {statistics.median(times[n][-args.steps:]):.3f} s" for n in cases))
        plan = runs["auto"][1].plan
        n_iter = args.rounds * args.steps
        med = {n: statistics.median(t) for n, t in times.items()}
        best_uniform = min(med["swap"], med["recompute"])
        result = {
            "model_params": sum(p.numel() for p in model(args.layers, args.width, args.seq).parameters()),
            "batch": args.batch, "keep_batch": keep_batch, "seq": args.seq,
            "device_budget_bytes": budget, "keep_peak_bytes_at_batch": peak, "host_budget_bytes": host,
            "swap_iter_s": med["swap"], "recompute_iter_s": med["recompute"], "auto_iter_s": med["auto"],
            "keep_iter_s": med["keep"],
            "seconds_per_sample": {n: med[n] / batches[n] for n in cases},
            "activation_bytes_to_host": {n: traffic[n][0] / n_iter for n in cases},
            "activation_bytes_to_ssd": traffic["swap"][1] / n_iter,
            "activation_bytes_to_ssd_by_case": {n: traffic[n][1] / n_iter for n in cases},
            "auto_plan": plan.treatments if plan else None,
            "auto_over_best_uniform": med["auto"] / best_uniform,
            "target_met": med["auto"] <= TARGET * best_uniform,
            "samples": times,
        }
        for _, e in runs.values():
            e.close()
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)  # 8 GiB of preallocated data files per device
    print(plan)
    print(f"median s/iteration: swap {med['swap']:.3f}, recompute {med['recompute']:.3f}, auto {med['auto']:.3f} "
          f"(batch {args.batch}); keep {med['keep']:.3f} (batch {keep_batch})")
    print(f"auto / best uniform = {result['auto_over_best_uniform']:.3f}; target <= {TARGET}: "
          f"{'MET' if result['target_met'] else 'NOT met'}")
    print(f"activation bytes per iteration to SSD (swap): {result['activation_bytes_to_ssd'] / 2**20:.1f} MiB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The ordinary loop against block-major order (``engine.train_step``), side by side on this machine.

    python bench/schedule.py [--json PATH] [--layers 8] [--width 512] [--seq 128] [--batch 2]
                             [--accum 8] [--rounds 3] [--swap-host-budget 1GiB] [--dir DIR]

One Hugging Face ``GPT2LMHeadModel`` (random init, seed 0, dropout off, vocabulary 512) is copied
into two engines on one private fuyoud, both ``offload=True`` (blocks' weights fetched from the SSD
array per use) with fp32 AdamW state on SSD:

* loop:        ``attach(accumulation_steps=--accum)``; per iteration ``--accum`` micro-batches of
               ``--batch`` sequences, ``loss.backward()`` each, then ``engine.step()``;
* block-major: ``attach()``; per iteration ``engine.train_step`` over the same micro-batches;
* block-major-swap: ``attach(swap_blocks=--layers, host_budget=--swap-host-budget)``: the same
               ``train_step`` with every block's activations swapped to host memory instead of
               the block being recomputed (blockmajor/swapped.py).

Both train on the same batches and must agree bitwise (their losses are compared every
iteration). Rounds run one iteration of each, interleaved (order rotated per round), after one
warm-up iteration each; after every iteration the script waits until the daemon is quiet, so
that one case's I/O does not spill into the other's time. Reported (medians over rounds):
seconds per iteration, tokens/s, the ratio block-major / loop, and the SSD bytes per parameter
per iteration (the daemon's reads + writes), and of it the weights read for the client (fetches
the daemon did not serve from its read-ahead of a step's state; those are counted apart). On a CPU the compute is
the same in both but for block-major's extra forward per block (it recomputes blocks from their
checkpointed inputs; the loop keeps activations; block-major-swap copies them to its arena and
back instead), and the loop fetches every block's weights twice per micro-batch where
block-major fetches them twice per iteration.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import fuyou_client
from common import host_info, quiet_counters
from fuyou_proto.units import parse_size


class Case:
    def __init__(self, name: str, model, daemon, accum: int, **options):
        self.name, self.model, self.accum = name, model, accum
        block_major = name.startswith("block-major")
        self.engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=1e-4, weight_decay=0.1), socket=daemon.socket,
                                          namespace=name, accumulation_steps=1 if block_major else accum, **options)
        self.block_major = block_major

    def iteration(self, micro_batches) -> dict:
        session, off = self.engine.session, self.engine.offloader
        (read0, written0), fetched0, served0 = quiet_counters(session), off.fetched_bytes, off.served_bytes
        t0 = time.perf_counter()
        loss = lambda x: self.model(x, labels=x).loss / len(micro_batches)  # noqa: E731
        if self.block_major:
            losses = self.engine.train_step(micro_batches, loss)
        else:
            out = []
            for x in micro_batches:
                value = loss(x)
                value.backward()
                out.append(value.detach())
            self.engine.step()
            self.engine.zero_grad()
            losses = torch.stack(out)
        seconds = time.perf_counter() - t0
        read, written = quiet_counters(session)  # (untimed: the daemon's trailing read-ahead and writes)
        stats = self.engine.train_step_stats if self.block_major else None
        return {"seconds": seconds, "losses": losses.tolist(), "ssd_bytes": (read - read0) + (written - written0),
                "weights_read": off.fetched_bytes - fetched0, "weights_served": off.served_bytes - served0,
                "activations_to_host": stats.activations_to_host if stats else 0,
                "activations_to_ssd": stats.activations_to_ssd if stats else 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--swap-host-budget", type=parse_size, default=1 << 30,
                    help="block-major-swap's host_budget (half of it holds the swapped activations)")
    ap.add_argument("--dir", type=Path, help="parent of the daemon's state (default: a temporary directory)")
    args = ap.parse_args(argv)
    import transformers

    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, vocab_size=512, n_positions=args.seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    params = sum(p.numel() for p in base.parameters())
    root = Path(tempfile.mkdtemp(prefix="fy-sched-", dir=args.dir))
    daemon = fuyou_client.start_daemon(root / "state", config={
        "storage": {"capacity_per_device": max(1 << 30, params * 16 * 4) // 4096 * 4096}})
    try:
        cases = [Case("loop", copy.deepcopy(base), daemon, args.accum),
                 Case("block-major", copy.deepcopy(base), daemon, args.accum),
                 Case("block-major-swap", copy.deepcopy(base), daemon, args.accum, swap_blocks=args.layers,
                      host_budget=args.swap_host_budget)]
        names = [c.name for c in cases]
        gen = torch.Generator().manual_seed(1)
        rounds = []
        for r in range(args.rounds + 1):
            micro_batches = [torch.randint(0, 512, (args.batch, args.seq), generator=gen) for _ in range(args.accum)]
            order = cases[r % len(cases):] + cases[:r % len(cases)]  # (rotated: each case first in turn)
            got = {c.name: c.iteration(micro_batches) for c in order}
            if any(got[n]["losses"] != got["loop"]["losses"] for n in names):
                raise SystemExit(f"round {r}: the orders' losses differ: {got}")
            print(f"round {r}{' (warm-up)' if r == 0 else ''}: "
                  + ", ".join(f"{n} {g['seconds']:.2f} s {g['ssd_bytes'] / params:.1f} B/param" for n, g in got.items()),
                  flush=True)
            if r > 0:
                rounds.append(got)
        tokens = args.accum * args.batch * args.seq

        def median(case: str, key: str) -> float:
            return statistics.median(g[case][key] for g in rounds)
        result = {
            # (what tests/test_figures.py asks of a result a page cites: how, where and when)
            "command": " ".join(["python bench/schedule.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "host": host_info(root),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "params": params, "tokens_per_iteration": tokens,
            "cases": {name: {"seconds": median(name, "seconds"), "tokens_per_s": tokens / median(name, "seconds"),
                             "ssd_bytes_per_param_per_iter": median(name, "ssd_bytes") / params,
                             "weights_read_bytes_per_param_per_iter": median(name, "weights_read") / params,
                             "weights_served_bytes_per_param_per_iter": median(name, "weights_served") / params,
                             "activations_to_host_bytes_per_iter": median(name, "activations_to_host"),
                             "activations_to_ssd_bytes_per_iter": median(name, "activations_to_ssd")}
                      for name in names},
            "block_major_over_loop_seconds": statistics.median(
                g["block-major"]["seconds"] / g["loop"]["seconds"] for g in rounds),
            "swap_over_recompute_seconds": statistics.median(
                g["block-major-swap"]["seconds"] / g["block-major"]["seconds"] for g in rounds),
            "swap_over_loop_seconds": statistics.median(
                g["block-major-swap"]["seconds"] / g["loop"]["seconds"] for g in rounds),
            "losses_bitwise_equal": True,
            "rounds": rounds,
        }
        print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        for c in cases:
            c.engine.close(materialize=False)
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

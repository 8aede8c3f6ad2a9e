"""Fuyou's first main job: a 1 GiB tensor to the SSD array and back, through fuyoud.

Starts a private fuyoud (embedded default config, state under .fuyou/demo) unless
--socket names a running one, fills a 1 GiB shared buffer with random data, swaps it
out to SSD and back in through the public client API, verifies every byte and prints
the throughput.

    python examples/swap_roundtrip.py [--size 1GiB] [--rounds 3] [--socket PATH]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

import fuyou_client
from fuyoud.units import format_size, parse_size

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB", help="tensor size (default 1GiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--socket", help="use the fuyoud at this control socket instead of a private one")
    ap.add_argument("--state-dir", default=str(ROOT / ".fuyou" / "demo"))
    args = ap.parse_args()
    nbytes = parse_size(args.size)

    daemon = None
    if args.socket is None:
        shutil.rmtree(args.state_dir, ignore_errors=True)
        print(f"starting fuyoud (state in {args.state_dir}) ...", flush=True)
        daemon = fuyou_client.start_daemon(args.state_dir, config={
            "storage": {"capacity_per_device": max(2 * nbytes + (256 << 20), 1 << 30) // 4096 * 4096},
            "memory": {"pinned_budget": max(nbytes + (256 << 20), 512 << 20) // 4096 * 4096},
        })
    try:
        with fuyou_client.connect(args.socket or daemon.socket) as session:
            st = session.daemon_status
            print(f"fuyoud {st.version}: I/O engine {st.io_engine} ({st.io_engine_reason}), "
                  f"{len(st.devices)} device(s)")
            buf = session.allocate(nbytes)
            tensor = buf.tensor(torch.float32) if nbytes % 4 == 0 else buf.tensor()
            torch.manual_seed(0)
            if tensor.dtype == torch.float32:
                tensor.normal_()
            else:
                tensor.random_(0, 256)
            reference = tensor.clone()
            writes, reads = [], []
            for r in range(args.rounds):
                t0 = time.perf_counter()
                session.swap_out("demo/tensor", buf)
                t1 = time.perf_counter()
                tensor.zero_()  # prove the bytes really come back from the SSD
                session.swap_in("demo/tensor", buf)
                t2 = time.perf_counter()
                if not torch.equal(tensor, reference):
                    print("FAILED: the tensor read back differs from what was written", file=sys.stderr)
                    return 1
                writes.append(nbytes / (t1 - t0) / 1e9)
                reads.append(nbytes / (t2 - t1) / 1e9)
                print(f"round {r + 1}: swap-out {writes[-1]:.2f} GB/s, swap-in {reads[-1]:.2f} GB/s, verified")
            info = session.stat("demo/tensor")
            print(f"{format_size(nbytes)} tensor swapped out and back {args.rounds}x, every byte verified "
                  f"(object on {info.devices} device(s)). Median: swap-out {statistics.median(writes):.2f} GB/s, "
                  f"swap-in {statistics.median(reads):.2f} GB/s")
            session.delete("demo/tensor")
    finally:
        if daemon is not None:
            daemon.stop()
            shutil.rmtree(args.state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

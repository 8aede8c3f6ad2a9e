"""Swap-out / swap-in throughput of fuyoud, side by side with fio and DeepSpeed's async I/O.

    python bench/io.py --json io.json [--size 1GiB] [--rounds 5] [--dir DIR]
                       [--block-size 1MiB] [--depth 32] [--warmup 2] [--keep]

Four cases, each writing and then reading ``--size`` bytes with O_DIRECT on the same file
system (a fresh directory under ``<repo>/.fuyou/bench`` or under ``--dir``):

* fuyou:     a private fuyoud (``fuyou_client.start_daemon``); ``session.swap_out`` of one
             shared buffer, then ``session.swap_in`` back into it, through the public client API.
* fio:       ``fio --direct=1 --ioengine=io_uring`` (libaio if io_uring fails), same block size
             and depth, separate write and read jobs on one preallocated file, fio's own buffers;
             the figure is fio's own bandwidth from ``--output-format=json``.
* limit:     the machine's limit as a bare loop sees it: fuyoud's io_uring engine called
             directly (no daemon, no gRPC) over a private 2 MiB-aligned huge-page buffer, same
             block size and depth, on a preallocated file.
* deepspeed: DeepSpeed's ``aio_handle`` (``sync_pwrite`` / ``sync_pread``) on a preallocated file
             with its own page-locked buffer (``new_cpu_locked_tensor``).

The disk is noisy, so the cases run interleaved: every round runs each case once (write then
read), the case order rotated per round, after ``--warmup`` untimed rounds (two by default:
fuyoud writes each new version of an object to fresh extents, so its first two swap-outs land
on never-written, fallocated space, whose unwritten-extent conversion slows them by up to 2x). Reported: median,
min, max and per-round GB/s (GB = 1e9 bytes), the ratios fuyou/fio and fuyou/deepspeed (of the
medians, and the median of the per-round paired ratios), and whether fuyou >= 1.2x the best peer.
A missing peer (fio absent, deepspeed not importable, its op does not build) is skipped with a
note and ``null`` in the JSON. Fuyou's read-back is checked against the written bytes at the end.
DeepSpeed's op builds on first use (minutes); it is cached in $TORCH_EXTENSIONS_DIR, by default
``<repo>/.fuyou/torch_extensions``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import fuyou_client
from fuyoud.units import parse_size
from common import BareLoop, gbps, host_info, preallocate, summarize

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
TARGET = 1.2


class Skip(Exception):
    """A peer that cannot run here; the message says why."""


class Fuyou:
    name = "fuyou"

    def __init__(self, args, workdir: Path, ref: torch.Tensor):
        self.size, self.ref = args.size, ref
        capacity = (args.size * 5 // 2 + MiB - 1) // MiB * MiB
        config = {"storage": {"data_dirs": [str(workdir / "fuyou-data")], "capacity_per_device": capacity},
                  "memory": {"pinned_budget": (args.size + 256 * MiB + 4095) // 4096 * 4096},
                  "io": {"queue_depth": args.depth, "chunk_size": args.block_size}}
        self.daemon = fuyou_client.start_daemon(workdir / "fuyou-state", config=config)
        try:
            self.session = fuyou_client.connect(self.daemon.socket)
            self.engine = self.session.daemon_status.io_engine
            self.engine_reason = self.session.daemon_status.io_engine_reason
            self.buf = self.session.allocate(args.size)
            self.tensor = self.buf.tensor()
            self.tensor.copy_(ref)
        except BaseException:
            self.daemon.stop()
            raise

    def write(self) -> float:
        t = time.perf_counter()
        self.session.swap_out("bench", self.buf)
        return time.perf_counter() - t

    def read(self) -> float:
        self.tensor.zero_()  # so a swap-in that moves nothing cannot pass the check
        t = time.perf_counter()
        self.session.swap_in("bench", self.buf)
        return time.perf_counter() - t

    def verify(self) -> bool:
        return torch.equal(self.tensor, self.ref)

    def close(self) -> None:
        del self.tensor
        self.buf.free()
        self.session.close()
        self.daemon.stop()


class Limit:
    """The bare-loop ceiling: the engine alone over the best buffer this machine offers."""
    name = "limit"

    def __init__(self, args, workdir: Path, ref: torch.Tensor):
        self.ref = ref
        self.loop = BareLoop(workdir / "limit.data", args.size, args.block_size, args.depth)
        self.loop.tensor.copy_(ref)

    def write(self) -> float:
        return self.loop.run(self.loop.WRITE)

    def read(self) -> float:
        self.loop.tensor.zero_()
        return self.loop.run(self.loop.READ)

    def verify(self) -> bool:
        return torch.equal(self.loop.tensor, self.ref)

    def close(self) -> None:
        self.loop.close()


class Fio:
    name = "fio"

    def __init__(self, args, workdir: Path, ref: torch.Tensor):
        self.fio = shutil.which("fio")
        if not self.fio:
            raise Skip("fio is not installed")
        self.size, self.path = args.size, workdir / "fio.data"
        preallocate(self.path, args.size)
        self.common = [f"--filename={self.path}", f"--size={args.size}", f"--bs={args.block_size}",
                       f"--iodepth={args.depth}", "--direct=1", "--numjobs=1", "--fallocate=none",
                       "--output-format=json"]
        self.version = subprocess.run([self.fio, "--version"], capture_output=True, text=True).stdout.strip()
        self.engine, errors = None, []
        for engine in ("io_uring", "libaio"):
            try:
                self.engine = engine
                self._job("read")
                break
            except Skip as exc:
                errors.append(str(exc))
        else:
            raise Skip("; ".join(errors))

    def _job(self, rw: str) -> float:
        cmd = [self.fio, f"--name=bench-{rw}", f"--rw={rw}", f"--ioengine={self.engine}", *self.common]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise Skip(f"fio {self.engine} {rw} failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-300:]}")
        job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
        side = job["write" if rw == "write" else "read"]
        if side["io_bytes"] != self.size:
            raise Skip(f"fio {rw} moved {side['io_bytes']} bytes, not {self.size}")
        return side["io_bytes"] / side["bw_bytes"]  # seconds, as fio measured them

    def write(self) -> float:
        return self._job("write")

    def read(self) -> float:
        return self._job("read")

    def close(self) -> None:
        pass


class DeepSpeed:
    name = "deepspeed"

    def __init__(self, args, workdir: Path, ref: torch.Tensor):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".fuyou" / "torch_extensions"))
        try:
            import deepspeed
            from deepspeed.ops.op_builder import AsyncIOBuilder
        except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
            raise Skip(f"deepspeed is not importable: {exc!r}") from None
        self.version = deepspeed.__version__
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            raise Skip("DeepSpeed's async_io op is not compatible here (libaio-dev missing?)")
        print(f"[deepspeed] loading the async_io op (builds on first use, minutes), "
              f"cache {os.environ['TORCH_EXTENSIONS_DIR']}", flush=True)
        t = time.perf_counter()
        try:
            module = builder.load(verbose=False)
        except Exception as exc:  # noqa: BLE001
            raise Skip(f"DeepSpeed's async_io op did not build: {exc!r}") from None
        self.load_s = time.perf_counter() - t
        self.size, self.ref, self.path = args.size, ref, str(workdir / "deepspeed.data")
        preallocate(Path(self.path), args.size)
        self.handle = module.aio_handle(args.block_size, args.depth, single_submit=False,
                                        overlap_events=True, intra_op_parallelism=1)
        self.buf = self.handle.new_cpu_locked_tensor(args.size, torch.empty(0, dtype=torch.uint8))
        self.buf.copy_(ref)

    def write(self) -> float:
        t = time.perf_counter()
        n = self.handle.sync_pwrite(self.buf, self.path)
        dt = time.perf_counter() - t
        if n < 0:
            raise RuntimeError(f"deepspeed sync_pwrite returned {n}")
        return dt

    def read(self) -> float:
        self.buf.zero_()
        t = time.perf_counter()
        n = self.handle.sync_pread(self.buf, self.path)
        dt = time.perf_counter() - t
        if n < 0:
            raise RuntimeError(f"deepspeed sync_pread returned {n}")
        return dt

    def verify(self) -> bool:
        return torch.equal(self.buf, self.ref)

    def close(self) -> None:
        self.handle.free_cpu_locked_tensor(self.buf)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, type=Path, help="where to write the results")
    ap.add_argument("--size", default="1GiB", type=parse_size, help="bytes per transfer (default 1GiB)")
    ap.add_argument("--rounds", default=5, type=int, help="timed rounds (default 5)")
    ap.add_argument("--warmup", default=2, type=int, help="untimed rounds first (default 2)")
    ap.add_argument("--dir", type=Path, help="parent of the bench directory (default <repo>/.fuyou/bench)")
    ap.add_argument("--block-size", default="1MiB", type=parse_size, help="I/O request size (default 1MiB)")
    ap.add_argument("--depth", default=32, type=int, help="queue depth (default 32)")
    ap.add_argument("--keep", action="store_true", help="keep the files it wrote")
    args = ap.parse_args(argv)
    if args.size % 4096 or args.block_size % 4096 or args.size % args.block_size:
        ap.error("--size and --block-size must be multiples of 4096, and --size of --block-size")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    parent = (args.dir or REPO / ".fuyou" / "bench").resolve()
    workdir = parent / f"io-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    workdir.mkdir(parents=True)
    print(f"bench dir {workdir}; {args.size / 2**30:g} GiB per transfer, bs {args.block_size // 1024} KiB, "
          f"depth {args.depth}, {args.warmup} warm-up + {args.rounds} rounds", flush=True)
    ref = torch.randint(0, 256, (args.size,), dtype=torch.uint8)  # what every case writes
    cases, notes = [], {}
    try:
        for cls in (Fuyou, Limit, Fio, DeepSpeed):
            try:
                cases.append(cls(args, workdir, ref))
                print(f"[{cls.name}] ready", flush=True)
            except Skip as exc:
                notes[cls.name] = str(exc)
                print(f"[{cls.name}] SKIPPED: {exc}", flush=True)
        if not cases or cases[0].name != "fuyou":
            raise SystemExit("the fuyou case did not start")

        times: dict[str, dict[str, list[float]]] = {c.name: {"write": [], "read": []} for c in cases}
        order_log = []
        for r in range(args.warmup + args.rounds):
            timed = r >= args.warmup
            k = r % len(cases)
            order = cases[k:] + cases[:k]
            if timed:
                order_log.append([c.name for c in order])
            label = f"round {r - args.warmup + 1}/{args.rounds}" if timed else f"warm-up {r + 1}/{args.warmup}"
            parts = []
            for case in order:
                w, rd = case.write(), case.read()
                if timed:
                    times[case.name]["write"].append(w)
                    times[case.name]["read"].append(rd)
                parts.append(f"{case.name} w {gbps(args.size, w):.2f} r {gbps(args.size, rd):.2f}")
            print(f"{label}: " + " | ".join(parts) + " GB/s", flush=True)

        verified = {c.name: c.verify() for c in cases if hasattr(c, "verify")}
        if not verified["fuyou"]:
            raise SystemExit("FAIL: fuyou's swap-in did not return the bytes that were swapped out")
        if verified.get("deepspeed") is False:
            print("WARNING: deepspeed's read-back differs from what it wrote", flush=True)
    finally:
        for case in cases:
            try:
                case.close()
            except Exception as exc:  # noqa: BLE001 - report, keep cleaning up
                print(f"[{case.name}] close failed: {exc!r}", flush=True)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    stats = {name: {d: summarize([gbps(args.size, t) for t in ts]) for d, ts in dirs.items()}
             for name, dirs in times.items()}
    print(f"\n{'case':<10} {'dir':<6} {'median':>7} {'min':>6} {'max':>6}  per-round GB/s")
    for name in ("fuyou", "limit", "fio", "deepspeed"):
        for d in ("write", "read"):
            if name not in stats:
                print(f"{name:<10} {d:<6} {'skipped':>7}")
                continue
            s = stats[name][d]
            print(f"{name:<10} {d:<6} {s['median']:7.2f} {s['min']:6.2f} {s['max']:6.2f}  "
                  + " ".join(f"{v:.2f}" for v in s["rounds"]))

    ratios, paired, best, target = {}, {}, {}, {}
    print()
    for d in ("write", "read"):
        fy = stats["fuyou"][d]
        for peer in ("limit", "fio", "deepspeed"):
            key = f"fuyou/{peer}_{d}"
            if peer not in stats:
                ratios[key] = paired[key] = None
                continue
            ratios[key] = fy["median"] / stats[peer][d]["median"]
            paired[key] = statistics.median(a / b for a, b in zip(fy["rounds"], stats[peer][d]["rounds"]))
            print(f"{key:<24} {ratios[key]:.2f}x  (median of paired per-round ratios {paired[key]:.2f}x)")
        peers = {p: stats[p][d]["median"] for p in ("fio", "deepspeed") if p in stats}
        if peers:
            p = max(peers, key=peers.get)
            ratio = fy["median"] / peers[p]
            best[d] = {"peer": p, "gbps": peers[p], "ratio": ratio}
            target[d] = ratio >= TARGET
            print(f"{d}: best peer {p} {peers[p]:.2f} GB/s; fuyou {fy['median']:.2f} GB/s = {ratio:.2f}x -> "
                  f"target >= {TARGET}x {'MET' if target[d] else 'NOT met'}")
        else:
            best[d] = target[d] = None
            print(f"{d}: no peer ran; nothing to compare with")

    def med(name: str, d: str):
        return stats[name][d]["median"] if name in stats else None

    fio = next((c for c in cases if c.name == "fio"), None)
    ds = next((c for c in cases if c.name == "deepspeed"), None)
    result = {
        **{f"{n}_{d}_gbps": med(n, d) for n in ("fuyou", "limit", "fio", "deepspeed") for d in ("write", "read")},
        "rounds": args.rounds, "warmup_rounds": args.warmup, "size_bytes": args.size,
        "block_size": args.block_size, "depth": args.depth, "gb": 1e9,
        "per_round": {n: {d: s["rounds"] for d, s in dirs.items()} for n, dirs in stats.items()},
        "per_round_seconds": times, "case_order": order_log, "stats": stats,
        "ratios": ratios, "paired_ratios": paired, "best_peer": best, "target": TARGET, "target_met": target,
        "fuyou_io_engine": cases[0].engine, "fuyou_io_engine_reason": cases[0].engine_reason,
        "fio_ioengine": fio.engine if fio else None,
        "fio_version": fio.version if fio else None, "deepspeed_version": ds.version if ds else None,
        "deepspeed_op_load_s": ds.load_s if ds else None, "verified": verified, "skipped": notes,
        "dir": str(workdir), "kept": args.keep, "host": host_info(parent),
        "argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load: many clients swapping and stepping at once, every byte verified, and one greedy
client that must not starve the others.

    python bench/load.py [--clients 8] [--seconds 60] [--json PATH] [--dir DIR]

One private fuyoud with a per-session pinned budget and a per-namespace SSD quota.
Two phases of ``--seconds`` each, run twice in alternation (alone, greedy, alone,
greedy): ``clients - 1`` modest clients alone, then the same with a greedy one. A modest
client loops: fill a 1 MiB shared buffer with fresh random bytes, swap it out (every
third object persistent), swap it back into another buffer and compare every byte;
every fifth round it steps its own small AdamW group. The greedy client first takes
shared memory until refused (its session budget), then writes 8 MiB objects until
refused (its namespace quota), then floods the daemon with 4 concurrent 8 MiB
swap-outs at a time for ``--seconds``, verifying what it reads back too. With the
greedy client, the modest ones go on until its flood is over, and each counts the round
trips it began and finished during the flood (``modest_ops_during_flood``): a starved
client finishes none there, however many it did before. The flood lasts a phase, so
those counts compare with each client's round trips in the phase alone before it
(``modest_during_flood_over_alone``).

Reported per phase: operations and verified bytes per second of the modest clients,
their round-trip latency p50/p99 (swap out + swap in), optimizer step latency, and the
greedy client's refusals; and the ratios greedy/alone of the modest clients' throughput
and p99. Quotas hold when the greedy client is refused and every modest client keeps
making progress with no error.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
CONFIG = {
    "storage": {"capacity_per_device": "512MiB", "stripe_size": "1MiB", "namespace_quota": "96MiB"},
    "memory": {"pinned_budget": "512MiB", "session_budget": "48MiB", "segment_size": "8MiB"},
    "io": {"chunk_size": "1MiB", "queue_depth": 32},
    "optimizer": {"buffer_budget": "64MiB", "buffers": 8},
    "daemon": {"grpc_workers": 32},
}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def modest(index: int, socket: str, seconds: float, out, until=None) -> None:
    """``until``: an event; the client goes on past ``seconds`` until it is set."""
    import torch

    import fuyou_client

    rng = random.Random(index)
    result = {"role": "modest", "index": index, "ops": 0, "bytes": 0, "errors": [], "rtt": [], "step": [],
              "done_at": [], "elapsed": 0.0}
    try:
        with fuyou_client.connect(socket) as s:
            src, dst = s.allocate(MiB), s.allocate(MiB)
            weights, grads = s.allocate(65536 * 4), s.allocate(65536 * 4)
            weights.tensor(torch.float32).normal_()
            grads.tensor(torch.float32).normal_()
            s.create_group("g", weights, fuyou_client.AdamW())
            start = time.monotonic()
            end, i = start + seconds, 0
            while time.monotonic() < end or (until is not None and not until.is_set()):
                begun = time.monotonic()  # (CLOCK_MONOTONIC: one clock for every process)
                payload = rng.randbytes(MiB)
                src.view[:] = payload
                t0 = time.perf_counter()
                s.swap_out(f"obj{i % 4}", src, persistent=i % 3 == 0)
                s.swap_in(f"obj{i % 4}", dst)
                result["rtt"].append(time.perf_counter() - t0)
                if bytes(dst.view) != payload:
                    result["errors"].append(f"round {i}: bytes read back differ")
                result["bytes"] += MiB
                if i % 5 == 0:
                    t0 = time.perf_counter()
                    s.step_group("g", grads, lr=1e-3)
                    result["step"].append(time.perf_counter() - t0)
                result["ops"] += 1
                result["done_at"].append((begun, time.monotonic()))
                i += 1
            result["elapsed"] = time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - reported
        result["errors"].append(f"{type(exc).__name__}: {exc}")
    out.put(result)


def greedy(socket: str, seconds: float, out, over=None) -> None:
    """``over``: an event set once the flood is over (or the client failed)."""
    import fuyou_client

    rng = random.Random(99)
    result = {"role": "greedy", "allocated": 0, "memory_refused": "", "stored": 0, "quota_refused": "",
              "flood_bytes": 0, "flood_rounds": 0, "flood_started": None, "flood_ended": None, "errors": []}
    try:
        with fuyou_client.connect(socket) as s:
            held = []
            try:
                while True:
                    held.append(s.allocate(8 * MiB))
                    result["allocated"] += 8 * MiB
            except fuyou_client.ResourceExhausted as exc:
                result["memory_refused"] = str(exc)
            buf = held[0]
            buf.view[:] = rng.randbytes(8 * MiB)
            try:
                for i in range(1000):
                    s.swap_out(f"hoard{i}", buf, persistent=True)
                    result["stored"] += 8 * MiB
            except fuyou_client.ResourceExhausted as exc:
                result["quota_refused"] = str(exc)
            for i in range(result["stored"] // (8 * MiB)):
                s.delete(f"hoard{i}")
            flood = held[:4]
            result["flood_started"] = time.monotonic()
            end = result["flood_started"] + seconds
            while time.monotonic() < end:
                futures = [s.swap_out_async([fuyou_client.Out(f"flood{j}", b)]) for j, b in enumerate(flood)]
                for f in futures:
                    f.result()
                back = held[4]
                s.swap_in("flood0", back)
                if bytes(back.view) != bytes(flood[0].view):
                    result["errors"].append("flood bytes read back differ")
                result["flood_bytes"] += 5 * 8 * MiB
                result["flood_rounds"] += 1
            result["flood_ended"] = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - reported
        result["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        if over is not None:
            over.set()
    out.put(result)


def phase(socket: str, clients: int, seconds: float, with_greedy: bool) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    over = ctx.Event() if with_greedy else None
    procs = [ctx.Process(target=modest, args=(i, socket, seconds, out, over)) for i in range(clients - 1)]
    if with_greedy:
        procs.append(ctx.Process(target=greedy, args=(socket, seconds, out, over)))
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 300) for _ in procs]
    for p in procs:
        p.join(60)
    mod = sorted((r for r in results if r["role"] == "modest"), key=lambda r: r["index"])
    rtt = [x for r in mod for x in r["rtt"]]
    steps = [x for r in mod for x in r["step"]]
    g = next((r for r in results if r["role"] == "greedy"), None)
    flood = (g["flood_started"], g["flood_ended"]) if g and g["flood_ended"] is not None else None
    return {
        "greedy": g,
        "modest_ops": [r["ops"] for r in mod],
        # (round trips begun and finished while the flood went on: a client the flood starves has none)
        "modest_ops_during_flood": [sum(flood[0] <= a and b <= flood[1] for a, b in r["done_at"]) for r in mod]
        if flood else None,
        "modest_errors": [e for r in mod for e in r["errors"]],
        "modest_verified_bytes_per_s": sum(r["bytes"] / r["elapsed"] for r in mod if r["elapsed"]),
        "modest_ops_per_s": sum(r["ops"] / r["elapsed"] for r in mod if r["elapsed"]),
        "rtt_p50_s": percentile(rtt, 0.5), "rtt_p99_s": percentile(rtt, 0.99),
        "step_p50_s": percentile(steps, 0.5), "step_p99_s": percentile(steps, 0.99),
    }


def run(clients: int, seconds: float, rounds: int, directory: Path | None) -> dict:
    import fuyou_client

    root = Path(tempfile.mkdtemp(prefix="fy-load-", dir=directory or "/tmp"))
    d = fuyou_client.start_daemon(root / "state", config=CONFIG)
    try:
        phases = {"alone": [], "greedy": []}
        for _ in range(rounds):
            phases["alone"].append(phase(d.socket, clients, seconds, False))
            phases["greedy"].append(phase(d.socket, clients, seconds, True))
        status = d.status()
    finally:
        code = d.stop()
        shutil.rmtree(root, ignore_errors=True)  # the daemon's preallocated data files
    med = {k: {m: statistics.median(p[m] for p in v) for m in
               ("modest_verified_bytes_per_s", "modest_ops_per_s", "rtt_p50_s", "rtt_p99_s", "step_p50_s", "step_p99_s")}
           for k, v in phases.items()}
    return {
        "clients": clients, "seconds_per_phase": seconds, "rounds": rounds, "daemon_exit": code,
        "engine": status.io_engine, "phases": phases, "median": med,
        "greedy_over_alone_throughput": med["greedy"]["modest_verified_bytes_per_s"]
        / med["alone"]["modest_verified_bytes_per_s"],
        "greedy_over_alone_rtt_p99": med["greedy"]["rtt_p99_s"] / med["alone"]["rtt_p99_s"],
        # (each modest client's round trips during the flood over its own in the phase alone
        # before it, per round: both counted over a phase's length, so the counts compare)
        "modest_during_flood_over_alone": [[d / a if a else 0.0 for d, a in zip(g["modest_ops_during_flood"] or [],
                                                                               al["modest_ops"])]
                                           for al, g in zip(phases["alone"], phases["greedy"])],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run(args.clients, args.seconds, args.rounds, args.dir)
    slim = {k: v for k, v in result.items() if k != "phases"}
    print(json.dumps(slim, indent=2))
    for name, runs in result["phases"].items():
        for p in runs:
            g = p["greedy"]
            print(f"{name:6}: modest {p['modest_verified_bytes_per_s'] / MiB:7.1f} MiB/s verified, "
                  f"rtt p50 {p['rtt_p50_s'] * 1e3:6.1f} ms p99 {p['rtt_p99_s'] * 1e3:6.1f} ms, "
                  f"errors {len(p['modest_errors'])}"
                  + (f"; greedy: {g['allocated'] // MiB} MiB before refused, {g['stored'] // MiB} MiB stored "
                     f"before refused, flood {g['flood_bytes'] / MiB / args.seconds:.0f} MiB/s" if g else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Tenants that share one fuyoud: two and four training jobs, alone and together.

    python bench/tenants.py [--json PATH] [--jobs 2 4] [--steps 10] [--rounds 2]
                            [--layers 4] [--width 256] [--seq 128] [--batch 4]
                            [--arena-gib 1.0] [--dir DIR]

Each job is its own training process (a Hugging Face ``GPT2LMHeadModel``, random init from
its own seed, dropout off, vocabulary 4096; ``attach`` with the defaults: blocks offloaded,
fp32 AdamW state on the SSD array; one torch thread each) on one private fuyoud. Job 0
also does what the guarantees page says must not stall anyone else: after its step
``--steps // 3`` it allocates a large arena (``--arena-gib`` of pinned shared memory,
written once), and after its step ``2 * --steps // 3`` it takes a copy checkpoint.

For N in ``--jobs``, in each of ``--rounds`` interleaved rounds: each of the N jobs runs alone
(one after the other), then all N run together (started at one signal). Meanwhile this
process calls the daemon's Status every 0.2 s and times each call. Reported per job:

* slowdown: its median step time together / alone (the first step, a warm-up, left out);
* share ratio: slowdown / N. N jobs on one host each get a fair share when each runs at
  most N times slower than alone (ratio <= 1; below 1 where jobs overlap what one alone
  leaves idle); the spread (largest slowdown / smallest) says whether the share is even;
* worst step: its slowest step together (warm-up left out), as a multiple of its median
  alone and of its median together: a stall behind another job's allocation or
  checkpoint shows here (the jobs other than job 0 are summarized apart);
* exactness: its losses together bitwise equal to alone (and across rounds).

Plus the slowest Status call, alone and together. Medians over rounds. The jobs' state is
in unnamed namespaces (deleted as each job ends), so runs leave nothing on the array.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


# -- one job (a training process) ------------------------------------------------------------
def worker(args) -> int:
    import torch
    import transformers

    import fuyou_client

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, vocab_size=4096, n_positions=args.seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=1e-4, weight_decay=0.1), socket=args.socket)
    gen = torch.Generator().manual_seed(1000 + args.seed)
    batches = [torch.randint(0, 4096, (args.batch, args.seq), generator=gen) for _ in range(args.steps)]
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    steps, losses, events, arena = [], [], {}, None
    for i, x in enumerate(batches):
        t0 = time.perf_counter()
        loss = model(x, labels=x).loss
        loss.backward()
        engine.step()
        engine.zero_grad()
        steps.append(time.perf_counter() - t0)
        losses.append(loss.item().hex())
        if args.arena_at == i:
            t = time.perf_counter()
            arena = engine.session.allocate(int(args.arena_gib * (1 << 30)))
            arena.tensor(torch.uint8).fill_(1)
            events["arena_seconds"] = time.perf_counter() - t
        if args.checkpoint_at == i:
            t = time.perf_counter()
            engine.save_checkpoint(Path(args.checkpoint_dir) / "ckpt", mode="copy")
            events["checkpoint_seconds"] = time.perf_counter() - t
    if arena is not None:
        arena.free()
    engine.close(materialize=False)
    Path(args.out).write_text(json.dumps({"steps": steps, "losses": losses, **events}))
    return 0


# -- the benchmark ---------------------------------------------------------------------------
class StatusProbe:
    """Times the daemon's Status every ``period`` seconds on a thread (one channel, opened
    before: what is timed is the call, not a connection)."""

    def __init__(self, daemon, period: float = 0.2):
        import grpc

        from fuyou_proto import pb, rpc

        self.period = period
        self._channel = grpc.insecure_channel(f"unix:{daemon.socket}")
        stub = rpc.FuyouAdminStub(self._channel)
        self._call = lambda: stub.Status(pb.StatusRequest(), timeout=600)
        self._call()
        self.seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.period):
            t0 = time.perf_counter()
            self._call()
            self.seconds.append(time.perf_counter() - t0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._channel.close()


def run_jobs(args, daemon, seeds: list[int], work: Path) -> dict[int, dict]:
    """Start one training process per seed, let them all attach, start them at once; their
    results by seed."""
    procs = {}
    for seed in seeds:
        ckpt = work / f"ckpt-{seed}"
        ckpt.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(HERE / "tenants.py"), "--worker", "--socket", daemon.socket, "--seed", str(seed),
               "--steps", str(args.steps), "--layers", str(args.layers), "--width", str(args.width),
               "--seq", str(args.seq), "--batch", str(args.batch), "--out", str(work / f"job-{seed}.json"),
               "--checkpoint-dir", str(ckpt)]
        if seed == 0:
            cmd += ["--arena-at", str(args.steps // 3), "--arena-gib", str(args.arena_gib),
                    "--checkpoint-at", str(2 * args.steps // 3)]
        procs[seed] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for seed, p in procs.items():
            line = p.stdout.readline().strip()
            if line != "ready":
                raise SystemExit(f"job {seed} did not attach (said {line!r}, exit {p.poll()})")
        for p in procs.values():
            p.stdin.write("go\n")
            p.stdin.flush()
        for seed, p in procs.items():
            if p.wait() != 0:
                raise SystemExit(f"job {seed} failed (exit {p.returncode})")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    out = {seed: json.loads((work / f"job-{seed}.json").read_text()) for seed in seeds}
    for seed in seeds:
        shutil.rmtree(work / f"ckpt-{seed}", ignore_errors=True)
    return out


def measure(args, daemon, n: int, work: Path) -> dict:
    """One round for N jobs: each alone, then all together."""
    alone, alone_status = {}, []
    for seed in range(n):
        with StatusProbe(daemon) as probe:
            alone.update(run_jobs(args, daemon, [seed], work))
        alone_status += probe.seconds
    with StatusProbe(daemon) as probe:
        together = run_jobs(args, daemon, list(range(n)), work)
    jobs = {}
    for seed in range(n):
        a, t = alone[seed], together[seed]
        a_med, t_med = statistics.median(a["steps"][1:]), statistics.median(t["steps"][1:])
        jobs[str(seed)] = {
            "alone_step_s": a_med, "together_step_s": t_med, "slowdown": t_med / a_med,
            "share_ratio": t_med / a_med / n,
            "worst_step_alone_s": max(a["steps"][1:]), "worst_step_together_s": max(t["steps"][1:]),
            "worst_over_median_alone": max(t["steps"][1:]) / a_med,
            "worst_over_median_together": max(t["steps"][1:]) / t_med,
            "losses_bitwise_as_alone": a["losses"] == t["losses"],
            "losses": t["losses"], "steps_alone_s": a["steps"], "steps_together_s": t["steps"],
            **{f"{k}_together": t[k] for k in ("arena_seconds", "checkpoint_seconds") if k in t},
        }
    slow = [j["slowdown"] for j in jobs.values()]
    return {"jobs": jobs, "spread": max(slow) / min(slow),
            "others_worst_over_median_alone": max(j["worst_over_median_alone"] for s, j in jobs.items() if s != "0"),
            "others_worst_over_median_together": max(j["worst_over_median_together"] for s, j in jobs.items()
                                                     if s != "0"),
            "status_max_s_alone": max(alone_status, default=0.0), "status_max_s_together": max(probe.seconds, default=0.0),
            "status_median_s_together": statistics.median(probe.seconds) if probe.seconds else 0.0}


def summarize(rounds: list[dict], n: int) -> dict:
    def med(f):
        return statistics.median(f(r) for r in rounds)

    jobs = {}
    for s in map(str, range(n)):
        jobs[s] = {k: med(lambda r, k=k: r["jobs"][s][k]) for k in
                   ("alone_step_s", "together_step_s", "slowdown", "share_ratio", "worst_step_together_s",
                    "worst_over_median_alone", "worst_over_median_together")}
        jobs[s]["losses_bitwise_as_alone"] = all(r["jobs"][s]["losses_bitwise_as_alone"] for r in rounds)
        jobs[s]["losses_same_every_round"] = len({tuple(r["jobs"][s]["losses"]) for r in rounds}) == 1
    return {"jobs": jobs, "share_ratio_max": max(j["share_ratio"] for j in jobs.values()),
            "spread": med(lambda r: r["spread"]),
            "others_worst_over_median_alone": med(lambda r: r["others_worst_over_median_alone"]),
            "others_worst_over_median_together": med(lambda r: r["others_worst_over_median_together"]),
            "status_max_s_together": max(r["status_max_s_together"] for r in rounds),
            "status_max_s_alone": max(r["status_max_s_alone"] for r in rounds),
            "exact": all(j["losses_bitwise_as_alone"] and j["losses_same_every_round"] for j in jobs.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--jobs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--arena-gib", type=float, default=1.0)
    ap.add_argument("--dir", type=Path, help="parent of the daemon's state (default: a temporary directory)")
    # (the training processes' own options)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--arena-at", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-at", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(HERE))
    import fuyou_client
    from common import host_info

    root = Path(tempfile.mkdtemp(prefix="fy-tenants-", dir=args.dir))
    arena = int(args.arena_gib * (1 << 30))
    daemon = fuyou_client.start_daemon(root / "state", config={
        "memory": {"pinned_budget": max(4 << 30, arena + (3 << 30)) // 4096 * 4096}})
    try:
        results = {}
        for n in args.jobs:
            rounds = []
            for r in range(args.rounds):
                got = measure(args, daemon, n, root / "work")
                rounds.append(got)
                print(f"{n} jobs, round {r}: slowdowns "
                      + ", ".join(f"{j['slowdown']:.2f}" for j in got["jobs"].values())
                      + f"; others' worst step {got['others_worst_over_median_together']:.2f}x their median "
                      f"together; "
                      f"Status at most {got['status_max_s_together'] * 1000:.0f} ms together", flush=True)
            results[str(n)] = {**summarize(rounds, n), "rounds": rounds}
        result = {
            "command": "python bench/tenants.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:])),
            "host": host_info(root),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                     if k in ("jobs", "steps", "rounds", "layers", "width", "seq", "batch", "arena_gib")},
            "results": results,
        }
        print(json.dumps({n: {k: v for k, v in r.items() if k != "rounds"} for n, r in results.items()}, indent=1))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        if not all(r["exact"] for r in results.values()):
            raise SystemExit("a job's losses together differ from alone")
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

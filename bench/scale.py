"""Data-parallel scaling through Fuyou on this machine: N ranks (torchrun, gloo, CPU) against one.

    python bench/scale.py [--json PATH] [--layers 8] [--width 768] [--vocab 50257] [--seq 128]
                          [--batch 2] [--iters 3] [--warmup 2] [--rounds 3]
                          [--configs n1,n2,n2x2,n4,n1o,n2o,n2x2o,n2h,n4h,n2ho,n4ho]
                          [--bf16-configs n2,n2x2,n2o]
                          [--dir DIR] [--budget-s 3600]

GPT-2 (transformers ``GPT2Config``, built locally: nothing is downloaded; default 8 layers of
width 768, vocabulary 50257, ~95M parameters), fp32, trained through
``attach(offload=False)`` (weights resident; the AdamW state on the SSD array, sharded over the
ranks) by bench/scale_worker.py, one process per rank, OMP_NUM_THREADS=1 each, ``--batch`` x
``--seq`` tokens per rank per iteration (weak scaling, as DDP). Configurations:

* n1:   one process, no torchrun (attach runs single-process), on daemon A;
* n2:   torchrun --nproc-per-node 2, both ranks on daemon A (one host);
* n2x2: two torchrun commands (--nnodes 2 --node-rank 0|1 --master-addr 127.0.0.1), rank 0 on
        daemon A, rank 1 on daemon B: two hosts simulated on one machine (one disk, one loopback);
* n4:   torchrun --nproc-per-node 4 on daemon A (skipped, and said so, when the memory or the
        time budget would not hold it);
* n1o, n2o, n2x2o, n4o: the same with ``attach(offload=True)``: the blocks' weights (not the
        embeddings, the "rest" group) are on the SSD array too; each fetch reads this rank's
        shard of the block's weights (fp32: the masters in place in the state object; backward's
        fetch served from the daemon's read-ahead of the state, which the step then uses) and
        all-gathers the rest.
* n2h, n4h: N workers and one more rank, the optimizer host (``serve_optimizer``; the worker
        script's ``--optimizer-rank``), all on daemon A: the workers hold no optimizer state
        (``attach(optimizer_ranks=[N])``); n2ho, n4ho: with ``offload=True``, no weights between
        uses either. The SSD figures are then all the optimizer host's (24 B/param whatever N:
        24/N per worker), the TCP figure what each worker sends (formula: its reduce-scatter and
        all-gathers as the sharded mode's, and its shard to the optimizer host, 1/N of a vector),
        and ``optimizer_host_*`` / ``worker_max_rss_bytes`` the hosts' resident memory.

A run that would end past ``--budget-s`` (judged by its configuration's last run) is skipped
and said so; the medians are then over fewer rounds (``rounds_run``).

The daemons are private (``fuyou_client.start_daemon``) with ``state_cache = false``, so every
step reads and writes its shard's whole state on the SSD array (direct I/O, the daemon's default)
instead of keeping the last group in memory. A daemon serving k ranks at once (A: 2 in n2, 4 in
n4) has k x ``--buffers-per-rank`` (6, the daemon's default for one client) optimizer buffers in
k x ``--buffer-budget``, each session at most its 6 (``session_buffers``): with the default's six
buffers shared by two ranks, backward's weight fetches found no spare buffer and were read a
second time by the client (n2o: 3 of each rank's 7 per iteration, +0.45 B/param/rank). Rounds
interleave the configurations (order rotated per round: this machine's disk and CPUs drift by
tens of percent within minutes); each round
first measures the disk with a bare io_uring loop (bench/common.BareLoop: read, durable write as
the daemon's commits sync, cached write) on the same file system. Each run does ``--warmup``
untimed iterations, then ``--iters`` timed back-to-back iterations (scale_worker.py says how the
window is bracketed). Figures per run, medians over rounds per configuration:

* ssd_bytes_per_param_per_iter_per_rank: the daemons' bytes read + written in the window (summed
  over distinct daemons) / parameters / iterations / N. Target with resident weights 24/N (fp32
  master weights and two moments read and written, 24 bytes per parameter in all, each rank's
  daemon holding 1/N), met within 2%; offloaded, at most 28/N within 2% (forward's fetch reads
  the weights once more: 4 bytes). As designed (``ssd_expected...``): (24 + 4 f)/N, f the
  offloaded blocks' share of the parameters (GPT-2 8x768: 0.594, the embeddings stay resident);
  a fetch out of a state object also reads the rest of the 1 MiB checksum blocks its range cuts
  (fuyoud/storage/checksums.py): under 1 MiB at each end, ~0.1 B/param here, a whole object for
  a tiny model's blocks. The client's own reads and the daemon's served fetches are reported.
* network_bytes_per_param_per_iter_per_rank: loopback tx bytes (/proc/net/dev, all processes of
  this machine) in the window / parameters / iterations / N; also the ranks' own TCP bytes sent
  (``ss``, immune to other loopback users), what the engine's collectives asked for (their calls
  counted in the worker) and the formula (FORMULAS; ``network_formula...``, whose ``ring`` and
  ``gloo`` keys are now equal): per rank a reduce-scatter sends (N-1)/N of the flat gradient (on
  gloo an all-to-all and a local sum, distributed.reduce_scatter), an all-gather (N-1)/N of the
  flat weights, so with resident weights 2 (N-1)/N vectors (8 (N-1)/N B/param in fp32, 4 (N-1)/N
  in bf16); offloaded, every fetch all-gathers the block (forward's and backward's, but the last
  block stays from forward into backward) in place of the barrier's gather: 2 + f (B-1)/B
  vectors with B blocks (2.52 here). Target <= 6 (N-1)/N.
* step_over_ssd_bound: iteration time / (bytes read at the bare read bandwidth + bytes written at
  the bare durable write bandwidth, both from the same round). Target <= 1.15.
* exposed_optimizer_fraction: time in ``engine.step()`` / iteration time (forward start to
  zero_grad end), averaged over ranks. Target <= 0.10 at N=2.
* pinned_bytes_per_session: the daemon's Status pinned_used_bytes / sessions, sampled after every
  timed iteration (max), averaged over the daemons.
* iter_s, tokens_per_s (N x batch x seq / iter_s) and, paired within each round, their ratios to
  n1; the daemons' CPU seconds per iteration and the StepInfo read / compute / write seconds.

Why fp32, and the bf16 check: the engine moves gradients and weights in the parameters' dtype, so
the network target (6 (N-1)/N: 1.5 flat vectors of fp32, 3 of bf16) is only reachable with 2-byte
parameters. But this CPU has no
AVX-512 / BF16 instructions: a bf16 matmul runs ~70x slower than fp32 here, so a bf16 model's
timings would measure that emulation, not Fuyou. The timed configurations are therefore fp32; the
``--bf16-configs`` runs (first round only, ``--bf16-batch`` x ``--bf16-seq`` tokens per rank, the
same model in bf16) measure only the bytes, which do not depend on the tokens; their timings are
in the JSON but not comparable.

Work files go to a fresh directory under ``<repo>/.fuyou/bench`` (or ``--dir``), removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fuyou_client
from common import BareLoop, gbps, host_info, summarize
from scale_figures import CONFIGS, OPTIMIZER_HOST, figures, judge, notes

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "scale_worker.py"
FORMULAS = {
    "ssd_bytes_per_param_per_iter_per_rank": (
        "(24 + 4 f) / N, f = the offloaded blocks' share of the parameters (0 with offload=False). 24: the optimizer "
        "state (fp32 masters and two moments, 12 B) read and written by every step. 4, offloaded: forward's fetch "
        "of each block reads the block's weights (fp32: the masters in place in the state object; bf16: the 2-byte "
        "weights object the step writes, 2 + 2); backward's fetch is served from the daemon's read-ahead of the "
        "state, which the step then uses, so it reads nothing more. Every rank's daemon holds and moves 1/N of it. "
        "Target: 24/N within 2% with resident weights; at most 28/N (f = 1) within 2% offloaded."),
    "network_bytes_per_param_per_iter_per_rank": (
        "s (N-1)/N x sum over layer groups of padded x (1 + a) / params, s the itemsize (fp32 4, bf16 2), padded the "
        "group's flat vector cut into N equal shards. 1: the gradient's reduce-scatter (on gloo an all-to-all of "
        "the chunks and a local sum: each rank sends N-1 of its N chunks, (N-1)/N of the vector, as a ring "
        "reduce-scatter would; gloo's own reduce-scatter sent an all-reduce's 2(N-1)/N). a: how many times the "
        "group's weights are all-gathered per iteration ((N-1)/N of the vector each, gloo's ring): a resident "
        "group once, after its step at the barrier; an offloaded block at every fetch instead (no barrier gather: "
        "the next fetch reads the new shards) - forward's and backward's, 2, except the last 1 + keep blocks, "
        "which stay resident from their forward into their backward, 1. Resident: 2 vectors, s 2 (N-1)/N (fp32 "
        "8 (N-1)/N, bf16 4 (N-1)/N). Offloaded, B equal blocks holding f of the parameters: 2 + f (B-1-keep)/B "
        "vectors (GPT-2 8x768: f = 0.594, B = 8, keep = 0: 2.52; fp32 10.08 (N-1)/N, bf16 5.04 (N-1)/N). "
        "Target: at most 6 (N-1)/N, i.e. 1.5 vectors in fp32, 3 in bf16; the loopback and TCP figures add the "
        "headers and the barriers' bytes."),
}
GiB = 1 << 30
now = time.perf_counter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mem_available() -> int:
    return next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemAvailable"))


def busy_cpu_s() -> float:
    """CPU seconds all processes of this machine have used since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def own_cpu_s(daemons: list) -> float:
    """CPU seconds of this script's finished children (the ranks, through torchrun) and daemons."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    tick = os.sysconf("SC_CLK_TCK")
    return ru.ru_utime + ru.ru_stime + sum(
        sum(int(x) for x in Path(f"/proc/{d.pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]) / tick
        for d in daemons)


def disk_bandwidth(directory: Path, size: int) -> dict:
    """The disk as a bare loop sees it, now: 1 MiB requests, 32 deep, O_DIRECT, huge-page buffer."""
    loop = BareLoop(directory / "bare.bin", size, 1 << 20, 32)
    try:
        loop.run(loop.WRITE, durable=True)  # (untimed: the fresh file's unwritten extents)
        durable = loop.run(loop.WRITE, durable=True)
        cached = loop.run(loop.WRITE)
        os.fdatasync(loop.fd)
        read = loop.run(loop.READ)
    finally:
        loop.close()
        (directory / "bare.bin").unlink(missing_ok=True)
    return {"read_gbps": gbps(size, read), "durable_write_gbps": gbps(size, durable),
            "cached_write_gbps": gbps(size, cached)}


def commands(config: str, args, dtype: str, out: Path, namespace: str) -> list[list[str]]:
    """The command line(s) of one run: one per simulated host."""
    ranks, hosts, offload = CONFIGS[config]
    batch, seq = (args.batch, args.seq) if dtype == "fp32" else (args.bf16_batch, args.bf16_seq)
    worker = [str(WORKER), "--out", str(out), "--layers", str(args.layers), "--width", str(args.width),
              "--vocab", str(args.vocab), "--seq", str(seq), "--batch", str(batch), "--dtype", dtype,
              "--state-dtype", args.state_dtype,
              "--warmup", str(args.warmup), "--iters", str(args.iters), "--namespace", namespace,
              *(["--offload"] if offload else [])]
    if ranks == 1:
        return [[sys.executable, *worker]]
    if config in OPTIMIZER_HOST:  # (the last rank is the optimizer host)
        worker += ["--optimizer-rank", str(ranks)]
    port = free_port()
    nproc = ranks // hosts + (config in OPTIMIZER_HOST)
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts), "--node-rank", str(h),
             "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
             *worker] for h in range(hosts)]


def launch(config: str, args, dtype: str, daemons: list, workdir: Path, tag: str) -> list[dict]:
    """Run one configuration to its end; every rank's JSON."""
    out = workdir / tag
    procs, logs = [], []
    t0, busy0, own0, load0 = now(), busy_cpu_s(), own_cpu_s(daemons), os.getloadavg()[0]
    for host, cmd in enumerate(commands(config, args, dtype, out, tag)):
        # (TMPDIR: torchrun's torchelastic_* directories go with the work directory)
        env = dict(os.environ, OMP_NUM_THREADS="1", FUYOUD_SOCKET=daemons[host].socket, TMPDIR=str(workdir))
        log = open(workdir / f"{tag}-host{host}.log", "wb")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                      start_new_session=True))
    deadline = time.monotonic() + args.run_timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # (our own child's session: torchrun and its ranks)
                p.wait()
        for log in logs:
            log.close()
    noise = {"others_cpus": (busy_cpu_s() - busy0 - (own_cpu_s(daemons) - own0)) / (now() - t0),
             "loadavg_1min": [load0, os.getloadavg()[0]]}
    ranks = CONFIGS[config][0]
    if any(p.returncode for p in procs) or len(list(out.glob("rank*.json"))) != ranks:
        tails = "\n".join(f"--- host {h}:\n" + (workdir / f"{tag}-host{h}.log").read_text(errors="replace")[-3000:]
                          for h in range(len(procs)))
        raise RuntimeError(f"{tag}: exit codes {[p.returncode for p in procs]}\n{tails}")
    host = json.loads((out / "optimizer.json").read_text()) if config in OPTIMIZER_HOST else None
    return [json.loads((out / f"rank{r}.json").read_text()) | {"noise": noise, "optimizer_host": host}
            for r in range(ranks)]


def code_version() -> dict:
    """Which client and daemon ran: the checkout's commit (and whether they had local edits),
    or, in an exported tree, the commit its ``.commit`` file names."""
    out = {"fuyou_client": fuyou_client.__file__}
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True,  # noqa: E731
                                        check=True).stdout.strip()
        out.update(commit=git("rev-parse", "HEAD"),
                   dirty=bool(git("status", "--porcelain", "--", "client", "fuyoud", "proto")))
    except (OSError, subprocess.CalledProcessError):
        marker = REPO / ".commit"
        out.update(commit=marker.read_text().strip() if marker.exists() else None, dirty=None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="where to write the results (default <repo>/.fuyou/bench-results/"
                    "scale-<time>.json)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=768, help="a multiple of 64")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank per iteration")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations before them (default 2: the\n"
                    "daemon's read-ahead follows the previous iteration's order, so the first\n"
                    "iterations' reads straddle iteration boundaries; from the third on they do not)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="n1,n2,n2x2,n4,n1o,n2o,n2x2o",
                    help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--bf16-configs", default="n2,n2x2,n2o",
                    help="bytes-only bf16 runs in the first round ('' for none)")
    ap.add_argument("--bf16-batch", type=int, default=1)
    ap.add_argument("--bf16-seq", type=int, default=16)
    ap.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                    help="AdamW's state dtype in every run (the SSD bytes' design is then 8 or 6 B/param per "
                         "read and per write, not 12)")
    ap.add_argument("--bare-size", default=str(GiB), help="bytes of the bare disk loop's file (default 1 GiB)")
    ap.add_argument("--buffer-budget", default="1GiB", help="[optimizer] buffer_budget per rank a daemon serves")
    ap.add_argument("--buffers-per-rank", type=int, default=6,
                    help="[optimizer] buffers per rank a daemon serves (its session_buffers: each rank its own)")
    ap.add_argument("--pinned-budget", default="8GiB", help="each daemon's [memory] pinned_budget")
    ap.add_argument("--run-timeout", type=float, default=900, help="seconds one run may take")
    ap.add_argument("--budget-s", type=float, default=3600,
                    help="a run that would end past this many seconds (its configuration's last run's time; N=4's\n"
                    "first, estimated from N=1's) is skipped, and said so")
    ap.add_argument("--dir", type=Path, help="parent of the bench directory (default <repo>/.fuyou/bench)")
    args = ap.parse_args(argv)
    split = lambda s: [c for c in s.split(",") if c]  # noqa: E731
    configs, bf16_configs = split(args.configs), split(args.bf16_configs)
    if not configs or any(c not in CONFIGS for c in configs + bf16_configs) or args.width % 64 \
            or min(args.iters, args.rounds, args.batch, args.seq, args.layers) < 1 or args.warmup < 0:
        ap.error(f"--configs from {','.join(CONFIGS)}; positive sizes; --width a multiple of 64")
    from fuyoud.units import parse_size
    code_at_start = code_version()  # (each run imports the checkout afresh: a commit mid-run shows here)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.json = args.json or REPO / ".fuyou" / "bench-results" / f"scale-{stamp}.json"
    parent = (args.dir or REPO / ".fuyou" / "bench").resolve()
    workdir = parent / f"scale-{stamp}-{os.getpid()}"
    workdir.mkdir(parents=True)
    # The model's size, as the workers will build it (for the array's capacity).
    params = 12 * args.layers * args.width ** 2 + (args.vocab + args.seq) * args.width + 13 * args.layers * args.width
    capacity = max(GiB, (params * 16 * 2 + 256 * (1 << 20)) // 4096 * 4096)
    tokens = args.batch * args.seq
    print(f"bench dir {workdir}; GPT-2 {args.layers}x{args.width}, vocab {args.vocab}: ~{params / 1e6:.1f}M params; "
          f"{args.batch}x{args.seq} tokens per rank; {args.warmup} warm-up + {args.iters} timed iterations per run, "
          f"{args.rounds} rounds of {','.join(configs)}; bf16 bytes check: {','.join(bf16_configs) or 'none'}",
          flush=True)
    daemons, runs, bf16_runs, disks, skipped, order_log = [], {c: [] for c in configs}, {}, [], [], []
    daemon_config: dict[str, dict] = {}
    t_start = now()
    # The daemons' state directories (sockets, index, log) under a short path: a unix socket's
    # path must stay under 108 bytes, and start_daemon binds its notify socket there as it is.
    # Their data (the SSD array) goes under the bench directory.
    short = Path(tempfile.mkdtemp(prefix="fy-scale-"))
    try:
        for name in ("A", "B") if any(CONFIGS[c][1] == 2 for c in configs + bf16_configs) else ("A",):
            # A daemon serving k ranks at once (n2: A two, n4: four) gets k times one rank's
            # buffers, each session at most its own: what the daemon's default (six buffers)
            # gives one client - backward's weight fetches served from its read-aheads, steps
            # in flight, a spare - for each of them, as a host's daemon would be sized.
            k = max(CONFIGS[c][0] // CONFIGS[c][1] for c in configs + bf16_configs)
            daemon_config[name] = {
                "storage": {"data_dirs": [str(workdir / f"daemon{name}-data")], "capacity_per_device": capacity},
                "memory": {"pinned_budget": args.pinned_budget},
                "optimizer": {"buffer_budget": k * parse_size(args.buffer_budget), "buffers": k * args.buffers_per_rank,
                              "session_buffers": args.buffers_per_rank, "state_cache": False}}
            daemons.append(fuyou_client.start_daemon(short / name, config=daemon_config[name]))
        for r in range(args.rounds):
            k = r % len(configs)
            order = configs[k:] + configs[:k]
            order_log.append(order)
            disk = disk_bandwidth(workdir, parse_size(args.bare_size))
            disks.append(disk)
            print(f"round {r + 1}/{args.rounds}: disk read {disk['read_gbps']:.2f} GB/s, durable write "
                  f"{disk['durable_write_gbps']:.2f}, cached write {disk['cached_write_gbps']:.2f}", flush=True)
            for c in order:
                n, one = CONFIGS[c][0], "n1o" if CONFIGS[c][2] and runs.get("n1o") else "n1"
                need, took = 0, runs[c][-1]["wall_s"] if runs.get(c) else None  # (its own last run's time)
                if n > 2 and runs.get(one):  # memory and (before its first run) time, from what N=1 needed
                    need = n * runs[one][-1]["max_rss_bytes"] * 1.2 + 2 * GiB
                    took = took or max(sum(s.values()) for s in runs[one][-1]["setup_s"]) + 1.5 * n * (
                        args.warmup + args.iters) * runs[one][-1]["iter_s"]
                why = (f"needs ~{need / GiB:.1f} GiB, {mem_available() / GiB:.1f} GiB available"
                       if mem_available() < need else f"would end past --budget-s {args.budget_s:.0f} s"
                       if took is not None and now() - t_start + took > args.budget_s else None)
                if why:
                    skipped.append({"config": c, "round": r + 1, "reason": why})
                    print(f"  {c}: SKIPPED ({why})", flush=True)
                    continue
                t = now()
                f = figures(c, "fp32", launch(c, args, "fp32", daemons, workdir, f"{c}-r{r + 1}"), disk, tokens)
                f.update(wall_s=now() - t, round=r + 1)
                runs[c].append(f)
                print(f"  {c}: iter {f['iter_s']:.3f} s, {f['tokens_per_s']:.0f} tok/s, exposed "
                      f"{f['exposed_optimizer_fraction']:.3f}, SSD {f['ssd_bytes_per_param_per_iter_per_rank']:.2f} "
                      f"B/param/rank, lo {f['network_bytes_per_param_per_iter_per_rank']:.2f} (tcp "
                      f"{f['tcp_sent_bytes_per_param_per_iter_per_rank']:.2f}, formula "
                      f"{f['network_formula_bytes_per_param_per_iter_per_rank']:.2f}) B/param/rank, step/bound "
                      f"{f['step_over_ssd_bound']:.2f}, pinned/session {f['pinned_bytes_per_session'] / GiB:.2f} GiB "
                      f"({f['wall_s']:.0f} s; other processes used {f['others_cpus']:.1f} CPUs)", flush=True)
            if r == 0:
                for c in bf16_configs:
                    t = now()
                    f = figures(c, "bf16", launch(c, args, "bf16", daemons, workdir, f"{c}-bf16"), disk,
                                args.bf16_batch * args.bf16_seq)
                    f["wall_s"] = now() - t
                    bf16_runs[c] = f
                    print(f"  {c} bf16 (bytes only): SSD {f['ssd_bytes_per_param_per_iter_per_rank']:.2f}, lo "
                          f"{f['network_bytes_per_param_per_iter_per_rank']:.2f} (tcp "
                          f"{f['tcp_sent_bytes_per_param_per_iter_per_rank']:.2f}) B/param/rank ({f['wall_s']:.0f} s)",
                          flush=True)
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(short, ignore_errors=True)
    wall = now() - t_start

    scalar = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    results, stats = {}, {}
    for c, rs in runs.items():
        if not rs:
            continue
        stats[c] = {k: summarize([f[k] for f in rs]) for k in rs[0] if scalar(rs[0][k])}
        results[c] = {k: s["median"] for k, s in stats[c].items()}
        results[c].update(config=c, dtype="fp32", offload=CONFIGS[c][2], rounds_run=len(rs),
                          per_daemon_last=rs[-1]["per_daemon"],
                          **{k: rs[0][k] for k in ("ranks", "daemons", "params", "iters")})  # (not medians: 2.0)
    paired = lambda c, b: [(f, g) for f in runs[c] for g in runs.get(b) or [] if g["round"] == f["round"]]  # noqa: E731
    for c, m in results.items():
        # Paired within the round: the same disk and CPU weather. An offloaded configuration's
        # N=1 is n1o (when it ran), and it is also paired with its resident counterpart.
        one = "n1o" if CONFIGS[c][2] and runs.get("n1o") else "n1"
        if CONFIGS[c][0] > 1 and paired(c, one):
            pairs = paired(c, one)
            m["n1_config"] = one
            m["tokens_per_s_over_n1"] = statistics.median(f["tokens_per_s"] / b["tokens_per_s"] for f, b in pairs)
            m["iter_s_over_n1"] = statistics.median(f["iter_s"] / b["iter_s"] for f, b in pairs)
            m["scaling_efficiency"] = m["tokens_per_s_over_n1"] / m["ranks"]
        if CONFIGS[c][2] and paired(c, c[:-1]):
            m["iter_s_over_resident"] = statistics.median(f["iter_s"] / b["iter_s"] for f, b in paired(c, c[:-1]))
        m["targets"] = judge(c, m)
    print(f"\n{'config':<6} {'N':>2} {'iter s':>7} {'tok/s':>6} {'x n1':>5} {'exposed':>7} {'SSD B':>6} "
          f"{'design':>6} {'target':>7} {'lo B':>5} {'tcp B':>5} {'formula':>7} {'target':>6} {'/bound':>6} "
          f"{'pinned/s':>8} {'dmn cpu':>7} {'others':>6}")
    for c, m in results.items():
        t = m["targets"]
        print(f"{c:<6} {m['ranks']:>2} {m['iter_s']:7.3f} {m['tokens_per_s']:6.0f} "
              f"{m.get('tokens_per_s_over_n1', 1.0):5.2f} {m['exposed_optimizer_fraction']:7.3f} "
              f"{m['ssd_bytes_per_param_per_iter_per_rank']:6.2f} {t['ssd_bytes_expected']:6.2f} "
              f"{'<=' if m['offload'] else '='}{t['ssd_bytes_target']:5.2f} "
              f"{m['network_bytes_per_param_per_iter_per_rank']:5.2f} "
              f"{m['tcp_sent_bytes_per_param_per_iter_per_rank']:5.2f} "
              f"{m['network_formula_bytes_per_param_per_iter_per_rank']:7.2f} "
              f"{m['network_target_bytes_per_param_per_iter_per_rank']:6.2f} {m['step_over_ssd_bound']:6.2f} "
              f"{m['pinned_bytes_per_session'] / GiB:7.2f}G {m['daemon_cpu_s_per_iter']:7.2f} {m['others_cpus']:6.2f}")
    print("(medians over rounds; bytes per parameter per iteration per rank; x n1 = tokens/s over n1's (an offloaded "
          "configuration's: n1o's), paired per round; design = (24 + 4 x the offloaded blocks' share of the "
          "parameters) / N; formula = the collectives' payload (FORMULAS); /bound = iteration over the SSD time at the "
          "bare read and durable write bandwidths; dmn cpu = the daemons' CPU s per iteration; others = CPUs other "
          "processes of this machine used during the runs)")
    for c, f in bf16_runs.items():
        print(f"{c} bf16 (bytes only): SSD {f['ssd_bytes_per_param_per_iter_per_rank']:.2f} B (design "
              f"{f['ssd_expected_bytes_per_param_per_iter_per_rank']:.2f}), lo "
              f"{f['network_bytes_per_param_per_iter_per_rank']:.2f}, "
              f"tcp {f['tcp_sent_bytes_per_param_per_iter_per_rank']:.2f}"
              f", formula {f['network_formula_bytes_per_param_per_iter_per_rank']:.2f}, target "
              f"{f['network_target_bytes_per_param_per_iter_per_rank']:.2f}")
    for s in skipped:
        print(f"skipped {s['config']} in round {s['round']}: {s['reason']}")
    for f in bf16_runs.values():  # (bytes only: its timings are the bf16 emulation's)
        f["targets"] = {k: v for k, v in judge(f["config"], f).items() if k.startswith(("ssd_bytes", "network"))}
    for c in configs:
        if not runs.get(c):
            results[c] = {"config": c, "skipped": True, "reasons": [s["reason"] for s in skipped if s["config"] == c]}
    print(f"wall {wall:.0f} s")

    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "argv": sys.argv,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "date": time.strftime("%Y-%m-%d"),
        "host": host_info(parent),
        "model": {"layers": args.layers, "width": args.width, "vocab": args.vocab, "dtype": "fp32",
                  "params": next((m["params"] for m in results.values() if "params" in m), None)},
        "tokens_per_rank_per_iter": tokens, "configs": results, "stats": stats, "runs": runs,
        "bf16_bytes_check": bf16_runs, "formulas": FORMULAS, "notes": notes(results, bf16_runs), "skipped": skipped,
        "code": code_version() | {"at_start": code_at_start}, "order": order_log,
        "disk": {"rounds": disks, **{k: statistics.median(d[k] for d in disks) for k in disks[0]}} if disks else {},
        "disk_reference": "../shared/MEASUREMENTS.md (2026-11-24): bare io_uring 3.5 GB/s write, 2.3 read; "
                          "0.55-0.8 GB/s written and synced",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "daemon_config": {name: c["optimizer"] for name, c in daemon_config.items()}, "wall_s": wall,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

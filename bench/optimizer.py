"""One out-of-core AdamW step with the state on SSD, against the disk's own bound and in-memory peers.

    python bench/optimizer.py --json optimizer.json [--params 500M] [--groups 16] [--rounds 3]
                              [--warmup 2] [--dir DIR] [--out bf16|fp32|none] [--ssd-size 2GiB]
                              [--inmem-steps 3] [--state-dtypes fp32,bf16,int8] [--keep]

Four kinds of cases on the same machine, interleaved round by round (case order rotated per round):

* fuyou:             a private fuyoud (``fuyou_client.start_daemon``) holding ``--groups`` AdamW
                     groups of ``--params`` fp32 parameters in all, their state (master weights,
                     exp_avg, exp_avg_sq: 12 bytes per parameter, plus a 4 KiB header per group) on
                     SSD. One step of the model = every group's ``step_group_async`` submitted at
                     once in backward order (g{G-1} ... g0), then waiting for all of them; the
                     figure is that wall-clock time. One shared gradient buffer (random, filled
                     once) and one bf16 output buffer (a slice per group) in shared memory. The
                     daemon's own per-group read / compute / write seconds and whether the state
                     was prefetched are recorded too. ``--warmup`` untimed steps first (fresh
                     preallocated extents are slow to write the first time; the daemon learns
                     the group order for prefetching from the first iteration).
                     One such case per AdamW state dtype of ``--state-dtypes`` (``fuyou`` for
                     fp32, ``fuyou_bf16``, ``fuyou_int8``), each on its own private daemon, all
                     in every round: the moments on SSD in fp32 (12 bytes of state per
                     parameter), bf16 (8) or block-wise int8 (6 + 8/256; fuyoud/optimizer/
                     layout.py). After each step (untimed) the script waits until that daemon is
                     quiet, so that no case's read-ahead spills into another's timing, and
                     takes the daemon's bytes_read / bytes_written deltas: the SSD bytes per
                     parameter per step, measured (their mean over the timed rounds; a step's
                     read-ahead of the next one's first group may fall in either window). The
                     daemons run without their state cache (``state_cache = false``), so every
                     step reads and writes its whole state.
* ssd_bound:         the disk's sequential write and read bandwidth on the same file system,
                     measured as bench/io.py's ``limit`` case does: fuyoud's io_uring engine
                     called directly over a private huge-page buffer, O_DIRECT, 1 MiB requests,
                     depth 32, on a preallocated file of ``--ssd-size`` bytes (written once
                     untimed first). ``ssd_bound_s = state_bytes / read_bw + state_bytes /
                     durable_write_bw``: the time the bytes one Fuyou step moves take at the
                     disk's own speed, one direction after the other (one disk serves both),
                     writes counted until an ``fdatasync`` has returned, as every step's new
                     state must be (it is synced before its commit). A virtual disk whose host
                     caches writes acknowledges a write pass several times faster than it
                     keeps one (2026-11-24: 3.7-4.2 GB/s against 0.55-0.8); the bound with the
                     cached write bandwidth is reported too (``ssd_cached_bound_s``). Also
                     measured, for information: both directions at once (one thread writes
                     half the file while another reads the other half), whose aggregate
                     bandwidth gives a stricter bound for a step whose reads and writes overlap.
* torch_inmem:       ``torch.optim.AdamW(fused=True)`` on the same parameters (same group
                     tensors) in memory: the compute floor. Allocated per round and freed after
                     (8 GB at 500M parameters); one untimed step, then ``--inmem-steps`` timed
                     steps, their median is the round's figure.
* kernel_<dtype>:    the daemon's own step kernel (``fuyoud.optimizer.kernels.step``, one call per
                     group, as the daemon runs it) on each dtype's state in memory: what the
                     CPU arithmetic alone costs, against torch_inmem (for fp32 it is the same
                     fused kernel; bf16 and int8 add decoding and encoding the moments).
* deepspeed_cpuadam: ``deepspeed.ops.adam.DeepSpeedCPUAdam`` likewise (skipped with a note when
                     DeepSpeed does not import or its cpu_adam op does not build; it builds on
                     first use, about a minute, cached in $TORCH_EXTENSIONS_DIR, by default
                     ``<repo>/.fuyou/torch_extensions``).

Reported: median, min, max and per-round seconds; the disk's bandwidths; the ratio
fuyou_step_s / ssd_bound_s (of the medians, and the median of the per-round paired ratios)
against the target ``fuyou_step_s <= 1.15 x ssd_bound_s``. The top-level keys are the fp32
case's (or, without fp32 in ``--state-dtypes``, the first dtype's; ``state_dtype`` says which);
``by_state_dtype`` maps each dtype to the same figures, each against its own SSD bound (its own
state bytes over the same rounds' measured bandwidths); the daemon's phase breakdown; memory
peaks (this process, the daemon, the whole host). After the timed rounds a second session steps
two small groups for a few iterations and compares the weights with ``torch.optim.AdamW(fused=
True)`` on the same initial weights, gradients and learning rates (expected: bitwise equal).
Everything under the bench directory (``<repo>/.fuyou/bench/optimizer-*`` or under ``--dir``) is
removed at the end unless ``--keep``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

import fuyou_client
from fuyoud.units import parse_size

from common import gbps, host_info, parse_state_dtypes, summarize
from optimizer_cases import (BETAS, EPS, LR, REPO, TARGET, WD, DeepSpeedCPUAdam, Fuyou, GiB_MIN, Kernel, KiB,
                             MemoryWatch, OUT_DTYPES, Skip, SsdBound, TorchInMem, align_up, case_name,
                             parse_count, state_bytes_of)


def verify(daemon_socket: str, steps: int = 5) -> dict:
    """Two small groups in their own session, stepped as the big ones are, against torch's fused AdamW."""
    sizes = [123457, 1 << 20]  # odd tail, and a page multiple
    lrs = [1e-3 * (0.8 ** i) for i in range(steps)]
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(n, generator=gen) for n in sizes]
    ref = [torch.nn.Parameter(w.clone()) for w in init]
    opt = torch.optim.AdamW(ref, lr=lrs[0], betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    infos = []
    with fuyou_client.connect(daemon_socket, namespace="bench-check") as s:
        weights, grads = [], []
        for i, (n, w0) in enumerate(zip(sizes, init)):
            w = s.allocate(n * 4)
            w.tensor(torch.float32).copy_(w0)
            s.create_group(f"c{i}", w, fuyou_client.AdamW(lr=lrs[0], betas=BETAS, eps=EPS, weight_decay=WD))
            weights.append(w)
            grads.append(s.allocate(n * 4))
        for k in range(steps):
            gs = [torch.randn(n, generator=gen) for n in sizes]
            for p, g, buf in zip(ref, gs, grads):
                p.grad = g.clone()
                buf.tensor(torch.float32).copy_(g)
            for group in opt.param_groups:
                group["lr"] = lrs[k]
            opt.step()
            futs = [s.step_group_async(f"c{i}", grads[i], lrs[k], out=weights[i]) for i in reversed(range(len(sizes)))]
            infos.extend(f.result(timeout=120) for f in futs)
        got = [w.tensor(torch.float32).clone() for w in weights]
    diffs = [(a - p.data).abs().max().item() for a, p in zip(got, ref)]
    return {"groups": sizes, "steps": steps, "bitwise_equal": all(torch.equal(a, p.data) for a, p in zip(got, ref)),
            "max_abs_diff": max(diffs), "ok": max(diffs) <= 1e-6,
            "prefetched_steps": sum(bool(i.prefetched) for i in infos), "group_steps": len(infos)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, type=Path, help="where to write the results")
    ap.add_argument("--params", default="500M", type=parse_count, help="parameters in all (default 500M)")
    ap.add_argument("--groups", default=16, type=int, help="parameter groups (default 16)")
    ap.add_argument("--rounds", default=3, type=int, help="timed rounds (default 3)")
    ap.add_argument("--warmup", default=2, type=int, help="untimed Fuyou steps first (default 2)")
    ap.add_argument("--dir", type=Path, help="parent of the bench directory (default <repo>/.fuyou/bench)")
    ap.add_argument("--out", default="bf16", choices=sorted(OUT_DTYPES),
                    help="dtype of the weights Fuyou writes back to shared memory (default bf16)")
    ap.add_argument("--ssd-size", default="2GiB", type=parse_size, help="ssd_bound file size (default 2GiB)")
    ap.add_argument("--block-size", default="1MiB", type=parse_size, help="ssd_bound request size (default 1MiB)")
    ap.add_argument("--depth", default=32, type=int, help="ssd_bound queue depth (default 32)")
    ap.add_argument("--inmem-steps", default=3, type=int, help="timed in-memory steps per round (default 3)")
    ap.add_argument("--capacity-factor", default=2.3, type=float,
                    help="daemon data file size / total state bytes (default 2.3)")
    ap.add_argument("--no-peers", action="store_true", help="skip the in-memory torch, kernel and DeepSpeed cases")
    ap.add_argument("--state-dtypes", default="fp32,bf16,int8", type=parse_state_dtypes,
                    help="AdamW state dtypes to run side by side, comma-separated (default fp32,bf16,int8)")
    ap.add_argument("--keep", action="store_true", help="keep the files it wrote")
    args = ap.parse_args(argv)
    if args.groups < 1 or args.params < args.groups:
        ap.error("need --groups >= 1 and --params >= --groups")
    if args.rounds < 1 or args.warmup < 0 or args.inmem_steps < 1:
        ap.error("need --rounds >= 1, --warmup >= 0, --inmem-steps >= 1")
    if args.ssd_size < GiB_MIN or args.ssd_size % args.block_size or args.block_size % 4096:
        ap.error("--ssd-size must be >= 1 GiB and a multiple of --block-size, itself a multiple of 4096")

    numel = align_up(-(-args.params // args.groups), 1024)  # per group; 4 KiB-aligned fp32 slots
    total_params = numel * args.groups
    dtypes = args.state_dtypes
    sbytes = {dt: args.groups * state_bytes_of(numel, dt) for dt in dtypes}
    primary = dtypes[0]  # fp32 whenever it runs: the top-level keys
    state_bytes = sbytes[primary]
    parent = (args.dir or REPO / ".fuyou" / "bench").resolve()
    workdir = parent / f"optimizer-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    workdir.mkdir(parents=True)
    print(f"bench dir {workdir}; {total_params / 1e6:.1f}M fp32 params in {args.groups} groups of "
          f"{numel / 1e6:.2f}M; state read + written per step: "
          + ", ".join(f"{dt} {sbytes[dt] / 1e9:.2f} GB" for dt in dtypes)
          + f"; {args.warmup} warm-up steps + {args.rounds} rounds; torch threads {torch.get_num_threads()}", flush=True)

    memwatch = MemoryWatch()
    fuyous: dict[str, Fuyou] = {}
    ssd = None
    cases: list = []
    notes: dict[str, str] = {}
    times: dict[str, list[float]] = {}
    details: dict[str, list[dict]] = {}
    ssd_w: list[float] = []
    ssd_r: list[float] = []
    ssd_mixed: list[float] = []
    ssd_wd: list[float] = []  # durable writes (with fdatasync)
    cached_bounds: dict[str, list[float]] = {dt: [] for dt in dtypes}
    bounds: dict[str, list[float]] = {dt: [] for dt in dtypes}
    mixed_bounds: dict[str, list[float]] = {dt: [] for dt in dtypes}
    warmups: dict[str, list[dict]] = {dt: [] for dt in dtypes}
    order_log: list[list[str]] = []
    check: dict | None = None
    daemon_mem: dict[str, dict[str, int]] = {}
    daemon_log_tail: dict[str, str] = {}
    daemon_info: dict[str, dict] = {}
    t_start = time.perf_counter()
    try:
        for dt in dtypes:
            fy = fuyous[dt] = Fuyou(args, workdir, numel, memwatch, dt)
            daemon_info[dt] = {"io_engine": fy.engine, "io_engine_reason": fy.engine_reason, "config": fy.config,
                               "create_groups_s": fy.create_s}
            print(f"[{fy.name}] daemon up, {args.groups} groups of {dt} state created in {fy.create_s:.1f} s "
                  f"({gbps(sbytes[dt], fy.create_s):.2f} GB/s); engine {fy.engine}", flush=True)
        for k in range(args.warmup):
            for dt, fy in fuyous.items():
                dt_s, d = fy.step()
                warmups[dt].append({"step_s": dt_s, **{key: v for key, v in d.items() if key != "per_group"}})
                print(f"[{fy.name}] warm-up step {k + 1}/{args.warmup}: {dt_s:.2f} s (read {d['read_s_sum']:.2f} / "
                      f"compute {d['compute_s_sum']:.2f} / write {d['write_s_sum']:.2f} s summed over groups, "
                      f"{d['prefetched']} prefetched, {d['ssd_bytes_per_param']:.2f} B/param)", flush=True)
        ssd = SsdBound(args, workdir)
        print(f"[ssd_bound] ready ({ssd.engine_name}, {args.ssd_size / 2**30:g} GiB file)", flush=True)
        cases = [*fuyous.values(), ssd]
        if args.no_peers:
            notes["torch_inmem"] = notes["deepspeed_cpuadam"] = "--no-peers"
            for dt in dtypes:
                notes[f"kernel_{dt}"] = "--no-peers"
        else:
            cases.append(TorchInMem(args, numel))
            cases.extend(Kernel(args, numel, dt) for dt in dtypes)
            try:
                cases.append(DeepSpeedCPUAdam(args, numel))
                print(f"[deepspeed_cpuadam] ready (op loaded in {cases[-1].load_s:.1f} s)", flush=True)
            except Skip as exc:
                notes["deepspeed_cpuadam"] = str(exc)
                print(f"[deepspeed_cpuadam] SKIPPED: {exc}", flush=True)
        times = {c.name: [] for c in cases}
        details = {c.name: [] for c in cases}

        for r in range(args.rounds):
            k = r % len(cases)
            order = cases[k:] + cases[:k]
            order_log.append([c.name for c in order])
            parts = []
            for case in order:
                if case is ssd:
                    w, rd, mx, wd = ssd.measure()
                    ssd_w.append(w)
                    ssd_r.append(rd)
                    ssd_mixed.append(mx)
                    ssd_wd.append(wd)
                    parts.append(f"ssd w {w:.2f} (durable {wd:.2f}) r {rd:.2f} r+w {mx:.2f} GB/s")
                    continue
                is_fuyou = isinstance(case, Fuyou)
                dt_s, d = case.step() if is_fuyou else case.round()
                times[case.name].append(dt_s)
                details[case.name].append(d)
                if is_fuyou:
                    parts.append(f"{case.name} {dt_s:.2f} s (r/c/w {d['read_s_sum']:.1f}/{d['compute_s_sum']:.1f}/"
                                 f"{d['write_s_sum']:.1f}, {d['prefetched']} pf, {d['ssd_bytes_per_param']:.2f} B/p)")
                else:
                    parts.append(f"{case.name} {dt_s:.3f} s")
            for dt in dtypes:
                bounds[dt].append(sbytes[dt] / (ssd_r[-1] * 1e9) + sbytes[dt] / (ssd_wd[-1] * 1e9))
                cached_bounds[dt].append(sbytes[dt] / (ssd_r[-1] * 1e9) + sbytes[dt] / (ssd_w[-1] * 1e9))
                mixed_bounds[dt].append(2 * sbytes[dt] / (ssd_mixed[-1] * 1e9))
            times["ssd_bound"].append(bounds[primary][-1])
            print(f"round {r + 1}/{args.rounds}: " + " | ".join(parts) + " | bound "
                  + " ".join(f"{dt} {bounds[dt][-1]:.2f}" for dt in dtypes) + " s", flush=True)

        daemon_mem = {dt: fy.daemon_memory() for dt, fy in fuyous.items()}
        check = verify(fuyous[primary].daemon.socket)
        print(f"[check] {check}", flush=True)
        for fy in fuyous.values():
            final_step = fy.session.group("g0").step
            if final_step != args.warmup + args.rounds:
                raise SystemExit(f"FAIL: {fy.name} group g0 is at step {final_step}, expected {args.warmup + args.rounds}")
    finally:
        for case in ([ssd] if ssd else []) + list(fuyous.values()) + [c for c in cases if not isinstance(c, (Fuyou, SsdBound))]:
            try:
                case.close()
            except Exception as exc:  # noqa: BLE001 - report, keep cleaning up
                print(f"[{case.name}] close failed: {exc!r}", flush=True)
        for dt, fy in fuyous.items():
            try:
                daemon_log_tail[dt] = fy.daemon.log()[-3000:]
            except OSError:
                pass
        memwatch.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    wall = time.perf_counter() - t_start

    stats = {name: summarize(v) for name, v in times.items() if v}
    ssd_stats = {"write": summarize(ssd_w), "read": summarize(ssd_r), "read_write_concurrent": summarize(ssd_mixed),
                 "durable_write": summarize(ssd_wd)}

    def med(name: str):
        return stats[name]["median"] if name in stats else None

    def figures(dt: str) -> dict:
        """One state dtype's figures, against its own SSD bound (its bytes, the rounds' bandwidths)."""
        name, sb = case_name(dt), sbytes[dt]
        fy_stats, bound, mixed = stats[name], summarize(bounds[dt]), summarize(mixed_bounds[dt])
        ratio = fy_stats["median"] / bound["median"]
        per_step = [d["ssd_bytes_per_param"] for d in details[name]]
        moved = sum(d["bytes_read"] + d["bytes_written"] for d in details[name])
        phases = {key: statistics.median(d[key] for d in details[name])
                  for key in ("read_s_sum", "compute_s_sum", "write_s_sum", "prefetched")}
        kernel = med(f"kernel_{dt}")
        return {
            "state_dtype": dt, "fuyou_step_s": fy_stats["median"], "ssd_bound_s": bound["median"],
            "fuyou_over_ssd_bound": ratio,
            "fuyou_over_ssd_bound_paired": statistics.median(a / b for a, b in zip(fy_stats["rounds"], bounds[dt])),
            "ssd_bound_of_median_bw_s": sb / (ssd_stats["read"]["median"] * 1e9)
            + sb / (ssd_stats["durable_write"]["median"] * 1e9),
            "ssd_cached_bound_s": statistics.median(cached_bounds[dt]),
            "fuyou_over_ssd_cached_bound": fy_stats["median"] / statistics.median(cached_bounds[dt]),
            "target": TARGET, "target_met": ratio <= TARGET,
            "state_bytes": sb, "bytes_read_per_step": sb, "bytes_written_per_step": sb,
            "state_bytes_per_param": fuyous[dt].layout_bytes_per_param,
            "expected_ssd_bytes_per_param_per_step": 2 * sb / total_params,
            "ssd_bytes_per_param_per_step": moved / total_params / len(per_step),
            "ssd_bytes_per_param_per_step_rounds": per_step,
            "ssd_concurrent_bound_s": mixed["median"], "fuyou_over_ssd_concurrent_bound": fy_stats["median"] / mixed["median"],
            "fuyou_phases_median": phases, "kernel_step_s": kernel,
            "kernel_over_torch_inmem": kernel / med("torch_inmem") if kernel and med("torch_inmem") else None,
            "fuyou_over_fp32": (fy_stats["median"] / med("fuyou")) if "fuyou" in stats else None,
            "fuyou_over_fp32_paired": (statistics.median(a / b for a, b in zip(fy_stats["rounds"], stats["fuyou"]["rounds"]))
                                       if "fuyou" in stats else None),
            "stats": {"fuyou": fy_stats, "ssd_bound": bound, "ssd_concurrent_bound": mixed},
            "fuyou_warmup": warmups[dt],
        }

    by_dtype = {dt: figures(dt) for dt in dtypes}
    top = by_dtype[primary]
    fy, ratio, paired, met = stats[case_name(primary)], top["fuyou_over_ssd_bound"], top["fuyou_over_ssd_bound_paired"], top["target_met"]
    phases = top["fuyou_phases_median"]

    print(f"\n{'case':<18} {'median s':>9} {'min':>7} {'max':>7}  per-round s")
    names = [case_name(dt) for dt in dtypes] + ["ssd_bound", "torch_inmem"] + [f"kernel_{dt}" for dt in dtypes] + ["deepspeed_cpuadam"]
    for name in names:
        if name not in stats:
            print(f"{name:<18} {'skipped':>9}  {notes.get(name, '')}")
            continue
        s = stats[name]
        print(f"{name:<18} {s['median']:9.3f} {s['min']:7.3f} {s['max']:7.3f}  "
              + " ".join(f"{v:.3f}" for v in s["rounds"]))
    print(f"\nssd write {ssd_stats['write']['median']:.2f} GB/s, durable write {ssd_stats['durable_write']['median']:.2f}, "
          f"read {ssd_stats['read']['median']:.2f} GB/s (medians; per round w {' '.join(f'{v:.2f}' for v in ssd_w)}, "
          f"durable {' '.join(f'{v:.2f}' for v in ssd_wd)}, r {' '.join(f'{v:.2f}' for v in ssd_r)}); the bound counts "
          "durable writes (every step's new state is synced before its commit), 'cached' the write pass without sync")
    print(f"ssd read+write at once (half the file each way): {ssd_stats['read_write_concurrent']['median']:.2f} GB/s "
          f"aggregate (per round {' '.join(f'{v:.2f}' for v in ssd_mixed)}); a stricter bound for a step that overlaps "
          f"them: {top['ssd_concurrent_bound_s']:.3f} s, {case_name(primary)} at {top['fuyou_over_ssd_concurrent_bound']:.3f}x "
          f"of it (informative, not the target)")
    print(f"\n{'state dtype':<11} {'step s':>7} {'bound s':>7} {'ratio':>6} {'paired':>6} {'cached':>6} {'B/param':>7} {'expect':>6} "
          f"{'read s':>6} {'comp s':>6} {'write s':>7} {'kernel s':>8} {'vs fp32':>7}")
    for dt, f in by_dtype.items():
        ph = f["fuyou_phases_median"]
        print(f"{dt:<11} {f['fuyou_step_s']:7.3f} {f['ssd_bound_s']:7.3f} {f['fuyou_over_ssd_bound']:6.3f} "
              f"{f['fuyou_over_ssd_bound_paired']:6.3f} {f['fuyou_over_ssd_cached_bound']:6.3f} "
              f"{f['ssd_bytes_per_param_per_step']:7.2f} "
              f"{f['expected_ssd_bytes_per_param_per_step']:6.2f} {ph['read_s_sum']:6.2f} {ph['compute_s_sum']:6.2f} "
              f"{ph['write_s_sum']:7.2f} " + (f"{f['kernel_step_s']:8.3f}" if f["kernel_step_s"] else f"{'-':>8}")
              + (f" {f['fuyou_over_fp32_paired']:7.3f}" if f["fuyou_over_fp32_paired"] else f" {'-':>7}"))
    print("(medians over rounds; bound = state bytes at the read and the durable write bandwidth; cached = step over "
          "the bound with cached writes; B/param = the daemon's bytes read + written per parameter per step, measured; "
          "expect = 2 x state bytes / params; phases summed over groups; kernel = kernels.step in memory; "
          "vs fp32 = median of paired per-round step-time ratios)")
    if "torch_inmem" in stats:
        print(f"{case_name(primary)} / torch_inmem = {fy['median'] / stats['torch_inmem']['median']:.1f}x")
    for dt, f in by_dtype.items():
        print(f"{case_name(dt)}_over_ssd_bound = {f['fuyou_over_ssd_bound']:.3f} (paired {f['fuyou_over_ssd_bound_paired']:.3f}); "
              f"target <= {TARGET}: {'MET' if f['target_met'] else 'NOT met'}")
    print(f"correctness vs torch.optim.AdamW(fused=True): bitwise_equal={check['bitwise_equal']} "
          f"max_abs_diff={check['max_abs_diff']:.3g} ({'ok' if check['ok'] else 'FAIL'})")
    peak = {"client_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB,
            "daemon_vmhwm_bytes": daemon_mem.get(primary, {}).get("VmHWM"),
            "daemons_vmhwm_bytes": {dt: m.get("VmHWM") for dt, m in daemon_mem.items()},
            "daemon_rss_peak_sampled_bytes": memwatch.daemon_rss_peak,
            "host_used_peak_bytes": memwatch.host_peak, "host_used_before_bytes": memwatch.baseline}
    print(f"memory peaks: this process {peak['client_maxrss_bytes'] / 2**30:.2f} GiB, daemons "
          + ", ".join(f"{dt} {(v or 0) / 2**30:.2f}" for dt, v in peak["daemons_vmhwm_bytes"].items())
          + f" GiB (VmHWM), host used {peak['host_used_peak_bytes'] / 2**30:.2f} "
          f"GiB (was {peak['host_used_before_bytes'] / 2**30:.2f}); wall {wall:.0f} s")

    ds = next((c for c in cases if c.name == "deepspeed_cpuadam"), None)
    result = {
        "fuyou_step_s": top["fuyou_step_s"], "ssd_bound_s": top["ssd_bound_s"], "torch_inmem_step_s": med("torch_inmem"),
        "deepspeed_cpuadam_step_s": med("deepspeed_cpuadam"), "fuyou_over_ssd_bound": ratio,
        "fuyou_over_ssd_bound_paired": paired, "ssd_bound_of_median_bw_s": top["ssd_bound_of_median_bw_s"],
        "target": TARGET, "target_met": met,
        "params": total_params, "params_requested": args.params, "groups": args.groups, "group_numel": numel,
        "rounds": args.rounds, "warmup_steps": args.warmup, "state_bytes": state_bytes,
        "bytes_read_per_step": state_bytes, "bytes_written_per_step": state_bytes,
        "ssd_bytes_per_param_per_step": top["ssd_bytes_per_param_per_step"],
        "ssd_read_gbps": ssd_stats["read"]["median"], "ssd_write_gbps": ssd_stats["write"]["median"], "gb": 1e9,
        "ssd_durable_write_gbps": ssd_stats["durable_write"]["median"],
        "ssd_cached_bound_s": top["ssd_cached_bound_s"], "fuyou_over_ssd_cached_bound": top["fuyou_over_ssd_cached_bound"],
        "ssd_read_write_concurrent_gbps": ssd_stats["read_write_concurrent"]["median"],
        "ssd_concurrent_bound_s": top["ssd_concurrent_bound_s"],
        "fuyou_over_ssd_concurrent_bound": top["fuyou_over_ssd_concurrent_bound"],
        "fuyou_phases_median": phases, "out_dtype": args.out, "lr": LR, "betas": BETAS, "eps": EPS,
        "weight_decay": WD, "state_dtype": primary, "state_dtypes": dtypes, "by_state_dtype": by_dtype,
        "stats": stats, "ssd_stats": ssd_stats,
        "per_round": {"seconds": times, "ssd_write_gbps": ssd_w, "ssd_read_gbps": ssd_r, "ssd_durable_write_gbps": ssd_wd,
                      "ssd_read_write_concurrent_gbps": ssd_mixed, "ssd_concurrent_bound_s": mixed_bounds[primary],
                      "ssd_bound_s_by_state_dtype": bounds, "details": details},
        "fuyou_warmup": warmups[primary], "case_order": order_log, "correctness": check, "memory": peak,
        "daemon": daemon_info.get(primary, {}), "daemons": daemon_info, "daemon_log_tail": daemon_log_tail.get(primary, ""),
        "ssd_bound_engine": ssd.engine_name if ssd else None, "ssd_bound_file_bytes": args.ssd_size,
        "block_size": args.block_size, "depth": args.depth, "inmem_steps": args.inmem_steps,
        "deepspeed_version": ds.version if ds else None, "deepspeed_op_load_s": ds.load_s if ds else None,
        "skipped": notes, "dir": str(workdir), "kept": args.keep, "wall_s": wall, "host": host_info(parent),
        "argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # (what tests/test_figures.py asks of a result a page cites: how, where and when)
        "command": " ".join(["python bench/optimizer.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

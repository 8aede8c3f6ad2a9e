"""One out-of-core AdamW step with the state on SSD, against the disk's own bound and in-memory peers.

    python bench/optimizer.py --json optimizer.json [--params 500M] [--groups 16] [--rounds 3]
                              [--warmup 2] [--dir DIR] [--out bf16|fp32|none] [--ssd-size 2GiB]
                              [--inmem-steps 3] [--keep]

Four cases on the same machine, interleaved round by round (case order rotated per round):

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
* ssd_bound:         the disk's sequential write and read bandwidth on the same file system,
                     measured as bench/io.py's ``limit`` case does: fuyoud's io_uring engine
                     called directly over a private huge-page buffer, O_DIRECT, 1 MiB requests,
                     depth 32, on a preallocated file of ``--ssd-size`` bytes (written once
                     untimed first). ``ssd_bound_s = state_bytes / read_bw + state_bytes /
                     write_bw``: the time the bytes one Fuyou step moves take at the disk's own
                     speed, one direction after the other (one disk serves both). Also measured,
                     for information: both directions at once (one thread writes half the file
                     while another reads the other half), whose aggregate bandwidth gives a
                     stricter bound for a step whose reads and writes overlap.
* torch_inmem:       ``torch.optim.AdamW(fused=True)`` on the same parameters (same group
                     tensors) in memory: the compute floor. Allocated per round and freed after
                     (8 GB at 500M parameters); one untimed step, then ``--inmem-steps`` timed
                     steps, their median is the round's figure.
* deepspeed_cpuadam: ``deepspeed.ops.adam.DeepSpeedCPUAdam`` likewise (skipped with a note when
                     DeepSpeed does not import or its cpu_adam op does not build; it builds on
                     first use, about a minute, cached in $TORCH_EXTENSIONS_DIR, by default
                     ``<repo>/.fuyou/torch_extensions``).

Reported: median, min, max and per-round seconds; the disk's bandwidths; the ratio
fuyou_step_s / ssd_bound_s (of the medians, and the median of the per-round paired ratios)
against the target ``fuyou_step_s <= 1.15 x ssd_bound_s``; the daemon's phase breakdown; memory
peaks (this process, the daemon, the whole host). After the timed rounds a second session steps
two small groups for a few iterations and compares the weights with ``torch.optim.AdamW(fused=
True)`` on the same initial weights, gradients and learning rates (expected: bitwise equal).
Everything under the bench directory (``<repo>/.fuyou/bench/optimizer-*`` or under ``--dir``) is
removed at the end unless ``--keep``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import fuyou_client
from fuyoud.units import parse_size
from common import BareLoop, gbps, host_info, summarize

REPO = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20
GiB_MIN = 1 << 30  # the smallest ssd_bound file
HUGE = 2 * MiB
HEADER = 4096  # the daemon's per-group state header (fuyoud/optimizer/groups.py)
TARGET = 1.15
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01
OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "none": None}


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def parse_count(text: str) -> int:
    """A parameter count: 500M, 1.5B, 2G, 100K, 123456789 (decimal suffixes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGbB]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 500M, 1.5B)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def state_bytes_of(numel: int) -> int:
    """An AdamW group's state object: header + weights, exp_avg, exp_avg_sq (4 KiB-aligned slots)."""
    return HEADER + 3 * align_up(numel * 4, 4096)


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * KiB
    return out


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * KiB
    except OSError:
        pass
    return out


class MemoryWatch:
    """Samples the host's used memory (MemTotal - MemAvailable) and the daemon's RSS."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.daemon_pid: int | None = None
        self.host_peak = 0
        self.daemon_rss_peak = 0
        self.baseline = meminfo()["MemTotal"] - meminfo()["MemAvailable"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memwatch", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        m = meminfo()
        self.host_peak = max(self.host_peak, m["MemTotal"] - m["MemAvailable"])
        if self.daemon_pid is not None:
            self.daemon_rss_peak = max(self.daemon_rss_peak, proc_status(self.daemon_pid).get("VmRSS", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class Skip(Exception):
    """A peer that cannot run here; the message says why."""


class Fuyou:
    name = "fuyou"

    def __init__(self, args, workdir: Path, numel: int, memwatch: MemoryWatch):
        self.args, self.numel, self.groups = args, numel, args.groups
        self.group_state = state_bytes_of(numel)
        self.state_bytes = self.groups * self.group_state
        self.out_dtype = OUT_DTYPES[args.out]
        self.out_width = self.out_dtype.itemsize if self.out_dtype is not None else 0
        capacity = align_up(int(self.state_bytes * args.capacity_factor), 4096)
        # Three buffers, each room for one group's state plus one fp32 weights slot (newer daemons
        # keep the new weights next to the state in the step's buffer; older ones map only the
        # state, so the slack costs them nothing: buffers are mapped at the size a step needs).
        per_buffer = align_up(self.group_state + align_up(numel * 4, 4096), HUGE)
        buffer_budget = align_up(int(3 * per_buffer * 1.1), HUGE)
        shared = align_up(numel * 4, HUGE) * 2 + align_up(self.groups * numel * self.out_width, HUGE)
        self.config = {
            "storage": {"data_dirs": [str(workdir / "fuyou-data")], "capacity_per_device": capacity},
            "memory": {"pinned_budget": align_up(shared + 256 * MiB, 4096), "segment_size": "64MiB"},
            "optimizer": {"buffer_budget": buffer_budget, "buffers": 3},
        }
        self.daemon = fuyou_client.start_daemon(workdir / "fuyou-state", config=self.config)
        memwatch.daemon_pid = self.daemon.pid
        self.session = None
        try:
            self.session = fuyou_client.connect(self.daemon.socket, namespace="bench")
            self.engine = self.session.daemon_status.io_engine
            self.engine_reason = self.session.daemon_status.io_engine_reason
            gen = torch.Generator().manual_seed(0)
            t = time.perf_counter()
            w = self.session.allocate(numel * 4)
            wt = w.tensor(torch.float32)
            wt.normal_(generator=gen)
            for i in range(self.groups):  # the same initial weights for every group: timing only
                self.session.create_group(f"g{i}", w, fuyou_client.AdamW(lr=LR, betas=BETAS, eps=EPS,
                                                                         weight_decay=WD))
            self.create_s = time.perf_counter() - t
            del wt
            w.free()
            self.grads = self.session.allocate(numel * 4)
            self.grads.tensor(torch.float32).normal_(generator=gen)
            self.out = self.session.allocate(self.groups * numel * self.out_width) if self.out_dtype else None
            self.steps_taken = 0
        except BaseException:
            self.close()
            raise

    def step(self) -> tuple[float, dict]:
        """One step of every group, submitted at once in backward order; (seconds, breakdown)."""
        n, s = self.numel, self.session
        t = time.perf_counter()
        futs = []
        for i in reversed(range(self.groups)):
            kw = {}
            if self.out is not None:
                kw = {"out": self.out, "out_offset": i * n * self.out_width, "out_dtype": self.out_dtype}
            futs.append(s.step_group_async(f"g{i}", self.grads, LR, **kw))
        infos = [f.result(timeout=1800) for f in futs]
        dt = time.perf_counter() - t
        self.steps_taken += 1
        if any(i.step != self.steps_taken for i in infos):
            raise RuntimeError(f"unexpected step counts {[i.step for i in infos]} (wanted {self.steps_taken})")
        detail = {
            "read_s_sum": sum(i.read_seconds for i in infos),
            "compute_s_sum": sum(i.compute_seconds for i in infos),
            "write_s_sum": sum(i.write_seconds for i in infos),
            "prefetched": sum(bool(i.prefetched) for i in infos),
            "per_group": [{"group": f"g{self.groups - 1 - k}", "read_s": round(i.read_seconds, 4),
                           "compute_s": round(i.compute_seconds, 4), "write_s": round(i.write_seconds, 4),
                           "prefetched": bool(i.prefetched)} for k, i in enumerate(infos)],
        }
        return dt, detail

    def daemon_memory(self) -> dict[str, int]:
        return proc_status(self.daemon.pid)

    def close(self) -> None:
        try:
            if self.session is not None:
                self.session.close()
        finally:
            self.daemon.stop()


class SsdBound:
    """The disk's sequential bandwidth as a bare io_uring loop sees it (bench/io.py's Limit)."""
    name = "ssd_bound"

    def __init__(self, args, workdir: Path):
        size, bs = args.ssd_size, args.block_size
        self.loop = BareLoop(workdir / "ssd-bound.data", size, bs, args.depth)
        self.engine_name, self.engine_reason = self.loop.engine.name, self.loop.engine_reason
        self.size = size
        self.loop.tensor.random_(0, 256, generator=torch.Generator().manual_seed(1))
        half = size // 2 // bs * bs  # the mixed pass: write the first half while reading the second
        reqs = self.loop.requests
        self.mixed = {self.loop.WRITE: reqs[self.loop.WRITE][:half // bs], self.loop.READ: reqs[self.loop.READ][half // bs:]}
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="ssd-mixed")  # one ring per thread, kept
        self.loop.run(self.loop.WRITE)  # untimed: turns the fallocated (unwritten) extents into written ones
        self.loop.run(self.loop.READ)

    def measure(self) -> tuple[float, float, float]:
        """(write GB/s, read GB/s) of one pass over the file each, then the aggregate GB/s of
        writing one half while reading the other (both directions at once, as Fuyou runs them)."""
        w = self.loop.run(self.loop.WRITE)
        r = self.loop.run(self.loop.READ)
        t = time.perf_counter()
        futs = [self.pool.submit(self.loop.run, op, reqs) for op, reqs in self.mixed.items()]
        for f in futs:
            f.result()
        mixed = time.perf_counter() - t
        nbytes = sum(len(q.buf) for reqs in self.mixed.values() for q in reqs)
        return gbps(self.size, w), gbps(self.size, r), gbps(nbytes, mixed)

    def close(self) -> None:
        self.pool.shutdown()
        del self.mixed
        self.loop.close()


def _inmem_tensors(numel: int, groups: int, seed: int) -> tuple[list[torch.nn.Parameter], float]:
    t = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(groups):
        p = torch.nn.Parameter(torch.empty(numel).normal_(generator=gen))
        p.grad = torch.empty(numel).normal_(generator=gen)
        params.append(p)
    return params, time.perf_counter() - t


class InMemory:
    """An in-memory optimizer over the same parameters: allocated for a round, freed after."""
    name = "?"

    def __init__(self, args, numel: int):
        self.args, self.numel = args, numel

    def make(self, params):
        raise NotImplementedError

    def round(self) -> tuple[float, dict]:
        params, setup_s = _inmem_tensors(self.numel, self.args.groups, seed=2)
        opt = self.make(params)
        try:
            t = time.perf_counter()
            opt.step()  # untimed: allocates and faults in the state
            first = time.perf_counter() - t
            times = []
            for _ in range(self.args.inmem_steps):
                t = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t)
        finally:
            del opt, params
            gc.collect()
        return statistics.median(times), {"steps_s": times, "first_step_s": first, "alloc_fill_s": setup_s}

    def close(self) -> None:
        pass


class TorchInMem(InMemory):
    name = "torch_inmem"

    def make(self, params):
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)


class DeepSpeedCPUAdam(InMemory):
    name = "deepspeed_cpuadam"

    def __init__(self, args, numel: int):
        super().__init__(args, numel)
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".fuyou" / "torch_extensions"))
        try:
            import deepspeed
            from deepspeed.ops.adam import DeepSpeedCPUAdam as cls
        except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
            raise Skip(f"deepspeed is not importable: {exc!r}") from None
        self.version, self.cls = deepspeed.__version__, cls
        print(f"[deepspeed_cpuadam] loading the cpu_adam op (builds on first use, about a minute), "
              f"cache {os.environ['TORCH_EXTENSIONS_DIR']}", flush=True)
        t = time.perf_counter()
        try:  # a tiny optimizer first, so a build failure is a skip, not a crash mid-round
            p = torch.nn.Parameter(torch.randn(1000))
            p.grad = torch.randn(1000)
            opt = cls([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
            opt.step()
        except Exception as exc:  # noqa: BLE001
            raise Skip(f"DeepSpeed's cpu_adam op did not build or run: {exc!r}") from None
        self.load_s = time.perf_counter() - t

    def make(self, params):
        return self.cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)


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
    ap.add_argument("--no-peers", action="store_true", help="skip the in-memory torch and DeepSpeed cases")
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
    state_bytes = args.groups * state_bytes_of(numel)
    parent = (args.dir or REPO / ".fuyou" / "bench").resolve()
    workdir = parent / f"optimizer-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    workdir.mkdir(parents=True)
    print(f"bench dir {workdir}; {total_params / 1e6:.1f}M fp32 params in {args.groups} groups of "
          f"{numel / 1e6:.2f}M; state {state_bytes / 1e9:.2f} GB read + written per step; "
          f"{args.warmup} warm-up steps + {args.rounds} rounds; torch threads {torch.get_num_threads()}", flush=True)

    memwatch = MemoryWatch()
    fuyou = ssd = None
    cases: list = []
    notes: dict[str, str] = {}
    times: dict[str, list[float]] = {}
    details: dict[str, list[dict]] = {}
    ssd_w: list[float] = []
    ssd_r: list[float] = []
    ssd_mixed: list[float] = []
    mixed_bounds: list[float] = []
    warmups: list[dict] = []
    order_log: list[list[str]] = []
    check: dict | None = None
    daemon_mem: dict[str, int] = {}
    daemon_log_tail = ""
    daemon_info: dict = {}
    t_start = time.perf_counter()
    try:
        fuyou = Fuyou(args, workdir, numel, memwatch)
        daemon_info = {"io_engine": fuyou.engine, "io_engine_reason": fuyou.engine_reason, "config": fuyou.config,
                       "create_groups_s": fuyou.create_s}
        print(f"[fuyou] daemon up, {args.groups} groups created in {fuyou.create_s:.1f} s "
              f"({gbps(state_bytes, fuyou.create_s):.2f} GB/s); engine {fuyou.engine}", flush=True)
        for k in range(args.warmup):
            dt, d = fuyou.step()
            warmups.append({"step_s": dt, **{key: v for key, v in d.items() if key != "per_group"}})
            print(f"[fuyou] warm-up step {k + 1}/{args.warmup}: {dt:.2f} s (read {d['read_s_sum']:.2f} / compute "
                  f"{d['compute_s_sum']:.2f} / write {d['write_s_sum']:.2f} s summed over groups, "
                  f"{d['prefetched']} prefetched)", flush=True)
        ssd = SsdBound(args, workdir)
        print(f"[ssd_bound] ready ({ssd.engine_name}, {args.ssd_size / 2**30:g} GiB file)", flush=True)
        cases = [fuyou, ssd]
        if args.no_peers:
            notes["torch_inmem"] = notes["deepspeed_cpuadam"] = "--no-peers"
        else:
            cases.append(TorchInMem(args, numel))
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
                    w, rd, mx = ssd.measure()
                    ssd_w.append(w)
                    ssd_r.append(rd)
                    ssd_mixed.append(mx)
                    parts.append(f"ssd w {w:.2f} r {rd:.2f} r+w {mx:.2f} GB/s")
                    continue
                dt, d = case.step() if case is fuyou else case.round()
                times[case.name].append(dt)
                details[case.name].append(d)
                if case is fuyou:
                    parts.append(f"fuyou {dt:.2f} s (r/c/w {d['read_s_sum']:.1f}/{d['compute_s_sum']:.1f}/"
                                 f"{d['write_s_sum']:.1f}, {d['prefetched']} pf)")
                else:
                    parts.append(f"{case.name} {dt:.3f} s")
            bound = state_bytes / (ssd_r[-1] * 1e9) + state_bytes / (ssd_w[-1] * 1e9)
            times["ssd_bound"].append(bound)
            mixed_bounds.append(2 * state_bytes / (ssd_mixed[-1] * 1e9))
            print(f"round {r + 1}/{args.rounds}: " + " | ".join(parts) + f" | bound {bound:.2f} s", flush=True)

        daemon_mem = fuyou.daemon_memory()
        check = verify(fuyou.daemon.socket)
        print(f"[check] {check}", flush=True)
        final_step = fuyou.session.group("g0").step
        if final_step != args.warmup + args.rounds:
            raise SystemExit(f"FAIL: group g0 is at step {final_step}, expected {args.warmup + args.rounds}")
    finally:
        for case in ([ssd] if ssd else []) + ([fuyou] if fuyou else []) + [c for c in cases if c not in (fuyou, ssd)]:
            try:
                case.close()
            except Exception as exc:  # noqa: BLE001 - report, keep cleaning up
                print(f"[{case.name}] close failed: {exc!r}", flush=True)
        if fuyou is not None:
            try:
                daemon_log_tail = fuyou.daemon.log()[-3000:]
            except OSError:
                pass
        memwatch.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    wall = time.perf_counter() - t_start

    stats = {name: summarize(v) for name, v in times.items() if v}
    ssd_stats = {"write": summarize(ssd_w), "read": summarize(ssd_r), "read_write_concurrent": summarize(ssd_mixed)}
    fy = stats["fuyou"]
    mixed_bound = summarize(mixed_bounds)
    mixed_ratio = fy["median"] / mixed_bound["median"]
    bound_of_medians = state_bytes / (ssd_stats["read"]["median"] * 1e9) + state_bytes / (ssd_stats["write"]["median"] * 1e9)
    ratio = fy["median"] / stats["ssd_bound"]["median"]
    paired = statistics.median(a / b for a, b in zip(fy["rounds"], stats["ssd_bound"]["rounds"]))
    met = ratio <= TARGET
    phases = {key: statistics.median(d[key] for d in details["fuyou"])
              for key in ("read_s_sum", "compute_s_sum", "write_s_sum", "prefetched")}

    print(f"\n{'case':<18} {'median s':>9} {'min':>7} {'max':>7}  per-round s")
    for name in ("fuyou", "ssd_bound", "torch_inmem", "deepspeed_cpuadam"):
        if name not in stats:
            print(f"{name:<18} {'skipped':>9}  {notes.get(name, '')}")
            continue
        s = stats[name]
        print(f"{name:<18} {s['median']:9.3f} {s['min']:7.3f} {s['max']:7.3f}  "
              + " ".join(f"{v:.3f}" for v in s["rounds"]))
    print(f"\nssd write {ssd_stats['write']['median']:.2f} GB/s, read {ssd_stats['read']['median']:.2f} GB/s (medians; "
          f"per round w {' '.join(f'{v:.2f}' for v in ssd_w)}, r {' '.join(f'{v:.2f}' for v in ssd_r)})")
    print(f"ssd read+write at once (half the file each way): {ssd_stats['read_write_concurrent']['median']:.2f} GB/s "
          f"aggregate (per round {' '.join(f'{v:.2f}' for v in ssd_mixed)}); a stricter bound for a step that overlaps "
          f"them: {mixed_bound['median']:.3f} s, fuyou at {mixed_ratio:.3f}x of it (informative, not the target)")
    print(f"fuyou moves {state_bytes / 1e9:.2f} GB read + {state_bytes / 1e9:.2f} GB written per step: "
          f"{gbps(2 * state_bytes, fy['median']):.2f} GB/s both ways together")
    print(f"fuyou daemon phases (median over rounds, summed over {args.groups} groups): read {phases['read_s_sum']:.2f} s, "
          f"compute {phases['compute_s_sum']:.2f} s, write {phases['write_s_sum']:.2f} s; "
          f"{phases['prefetched']:.0f}/{args.groups} groups prefetched")
    if "torch_inmem" in stats:
        print(f"fuyou / torch_inmem = {fy['median'] / stats['torch_inmem']['median']:.1f}x")
    print(f"\nfuyou_over_ssd_bound = {ratio:.3f} (median of paired per-round ratios {paired:.3f}); "
          f"target fuyou_step_s <= {TARGET} x ssd_bound_s: {'MET' if met else 'NOT met'}")
    print(f"correctness vs torch.optim.AdamW(fused=True): bitwise_equal={check['bitwise_equal']} "
          f"max_abs_diff={check['max_abs_diff']:.3g} ({'ok' if check['ok'] else 'FAIL'})")
    peak = {"client_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB,
            "daemon_vmhwm_bytes": daemon_mem.get("VmHWM"), "daemon_rss_peak_sampled_bytes": memwatch.daemon_rss_peak,
            "host_used_peak_bytes": memwatch.host_peak, "host_used_before_bytes": memwatch.baseline}
    print(f"memory peaks: this process {peak['client_maxrss_bytes'] / 2**30:.2f} GiB, daemon "
          f"{(peak['daemon_vmhwm_bytes'] or 0) / 2**30:.2f} GiB (VmHWM), host used {peak['host_used_peak_bytes'] / 2**30:.2f} "
          f"GiB (was {peak['host_used_before_bytes'] / 2**30:.2f}); wall {wall:.0f} s")

    def med(name: str):
        return stats[name]["median"] if name in stats else None

    ds = next((c for c in cases if c.name == "deepspeed_cpuadam"), None)
    result = {
        "fuyou_step_s": med("fuyou"), "ssd_bound_s": med("ssd_bound"), "torch_inmem_step_s": med("torch_inmem"),
        "deepspeed_cpuadam_step_s": med("deepspeed_cpuadam"), "fuyou_over_ssd_bound": ratio,
        "fuyou_over_ssd_bound_paired": paired, "ssd_bound_of_median_bw_s": bound_of_medians,
        "target": TARGET, "target_met": met,
        "params": total_params, "params_requested": args.params, "groups": args.groups, "group_numel": numel,
        "rounds": args.rounds, "warmup_steps": args.warmup, "state_bytes": state_bytes,
        "bytes_read_per_step": state_bytes, "bytes_written_per_step": state_bytes,
        "ssd_read_gbps": ssd_stats["read"]["median"], "ssd_write_gbps": ssd_stats["write"]["median"], "gb": 1e9,
        "ssd_read_write_concurrent_gbps": ssd_stats["read_write_concurrent"]["median"],
        "ssd_concurrent_bound_s": mixed_bound["median"], "fuyou_over_ssd_concurrent_bound": mixed_ratio,
        "fuyou_phases_median": phases, "out_dtype": args.out, "lr": LR, "betas": BETAS, "eps": EPS,
        "weight_decay": WD, "stats": stats, "ssd_stats": ssd_stats,
        "per_round": {"seconds": times, "ssd_write_gbps": ssd_w, "ssd_read_gbps": ssd_r,
                      "ssd_read_write_concurrent_gbps": ssd_mixed, "ssd_concurrent_bound_s": mixed_bounds,
                      "details": details},
        "fuyou_warmup": warmups, "case_order": order_log, "correctness": check, "memory": peak,
        "daemon": daemon_info, "daemon_log_tail": daemon_log_tail,
        "ssd_bound_engine": ssd.engine_name if ssd else None, "ssd_bound_file_bytes": args.ssd_size,
        "block_size": args.block_size, "depth": args.depth, "inmem_steps": args.inmem_steps,
        "deepspeed_version": ds.version if ds else None, "deepspeed_op_load_s": ds.load_s if ds else None,
        "skipped": notes, "dir": str(workdir), "kept": args.keep, "wall_s": wall, "host": host_info(parent),
        "argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

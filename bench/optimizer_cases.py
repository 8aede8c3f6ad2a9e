"""bench/optimizer.py's cases, each a class with the same rounds' interface: Fuyou (a
private fuyoud stepping the groups out of core), the SSD's own bound, and the in-memory
peers (torch's AdamW, the daemon's kernel without I/O, DeepSpeed's CPUAdam); with what
they share (sizes, the state's bytes, the memory watch). optimizer.py runs them side by
side and reports."""
from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import fuyou_client
from fuyoud.optimizer import kernels, lowp

try:
    from fuyoud.config import OptimizerSection
    OPTIMIZER_KEYS = set(OptimizerSection.__dataclass_fields__)
except ImportError:  # pragma: no cover
    OPTIMIZER_KEYS = set()
from common import BareLoop, gbps, quiet_counters

REPO = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20
GiB_MIN = 1 << 30  # the smallest ssd_bound file
HUGE = 2 * MiB
HEADER = 4096  # the daemon's per-group state header (fuyoud/optimizer/groups.py)
TARGET = 1.15
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01
OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "none": None}


def spec_of(state_dtype: str) -> kernels.OptimizerSpec:
    return kernels.OptimizerSpec("adamw", BETAS[0], BETAS[1], EPS, WD, state_dtype=state_dtype)


def case_name(state_dtype: str) -> str:
    return "fuyou" if state_dtype == "fp32" else f"fuyou_{state_dtype}"


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def parse_count(text: str) -> int:
    """A parameter count: 500M, 1.5B, 2G, 100K, 123456789 (decimal suffixes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGbB]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 500M, 1.5B)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def state_bytes_of(numel: int, state_dtype: str = "fp32") -> int:
    """An AdamW group's state object: header + weights, exp_avg, exp_avg_sq (+ the int8 moments'
    scales), 4 KiB-aligned slots (fuyoud/optimizer/layout.py)."""
    return spec_of(state_dtype).layout(numel).size


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
        self.daemon_pids: list[int] = []
        self.host_peak = 0
        self.daemon_rss_peak = 0
        self.baseline = meminfo()["MemTotal"] - meminfo()["MemAvailable"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memwatch", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        m = meminfo()
        self.host_peak = max(self.host_peak, m["MemTotal"] - m["MemAvailable"])
        if self.daemon_pids:  # the daemons together
            rss = sum(proc_status(pid).get("VmRSS", 0) for pid in self.daemon_pids)
            self.daemon_rss_peak = max(self.daemon_rss_peak, rss)

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
    def __init__(self, args, workdir: Path, numel: int, memwatch: MemoryWatch, state_dtype: str = "fp32"):
        self.args, self.numel, self.groups, self.state_dtype = args, numel, args.groups, state_dtype
        self.name = case_name(state_dtype)
        self.group_state = state_bytes_of(numel, state_dtype)
        self.layout_bytes_per_param = spec_of(state_dtype).layout(numel).bytes_per_param
        self.state_bytes = self.groups * self.group_state
        self.out_dtype = OUT_DTYPES[args.out]
        self.out_width = self.out_dtype.itemsize if self.out_dtype is not None else 0
        capacity = align_up(int(self.state_bytes * args.capacity_factor) + 64 * MiB, 4096)  # + room for verify()
        # Three buffers, each room for one group's state plus one fp32 weights slot (newer daemons
        # keep the new weights next to the state in the step's buffer; older ones map only the
        # state, so the slack costs them nothing: buffers are mapped at the size a step needs).
        # (at least 20 MiB: verify()'s 1M-parameter group steps whole)
        per_buffer = align_up(max(self.group_state + align_up(numel * 4, 4096), 20 * MiB), HUGE)
        buffer_budget = align_up(int(3 * per_buffer * 1.1), HUGE)
        shared = align_up(numel * 4, HUGE) * 2 + align_up(self.groups * numel * self.out_width, HUGE)
        self.config = {
            "storage": {"data_dirs": [str(workdir / f"{self.name}-data")], "capacity_per_device": capacity},
            "memory": {"pinned_budget": align_up(shared + 256 * MiB, 4096), "segment_size": "64MiB"},
            # No state cache (daemons that have one): every step reads and writes its whole state.
            "optimizer": {"buffer_budget": buffer_budget, "buffers": 3,
                          **({"state_cache": False} if "state_cache" in OPTIMIZER_KEYS else {})},
        }
        self.daemon = fuyou_client.start_daemon(workdir / f"{self.name}-state", config=self.config)
        memwatch.daemon_pids.append(self.daemon.pid)
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
                                                                         weight_decay=WD, state_dtype=state_dtype))
            self.create_s = time.perf_counter() - t
            del wt
            w.free()
            self.grads = self.session.allocate(numel * 4)
            self.grads.tensor(torch.float32).normal_(generator=gen)
            self.out = self.session.allocate(self.groups * numel * self.out_width) if self.out_dtype else None
            self.steps_taken = 0
            self.last = self.counters()
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
        cur = self.counters()  # untimed: waits for the daemon's trailing read-ahead too
        rd, wr = cur[0] - self.last[0], cur[1] - self.last[1]
        self.last = cur
        self.steps_taken += 1
        if any(i.step != self.steps_taken for i in infos):
            raise RuntimeError(f"unexpected step counts {[i.step for i in infos]} (wanted {self.steps_taken})")
        detail = {
            "read_s_sum": sum(i.read_seconds for i in infos),
            "compute_s_sum": sum(i.compute_seconds for i in infos),
            "write_s_sum": sum(i.write_seconds for i in infos),
            "prefetched": sum(bool(i.prefetched) for i in infos),
            "bytes_read": rd, "bytes_written": wr, "ssd_bytes_per_param": (rd + wr) / (n * self.groups),
            "per_group": [{"group": f"g{self.groups - 1 - k}", "read_s": round(i.read_seconds, 4),
                           "compute_s": round(i.compute_seconds, 4), "write_s": round(i.write_seconds, 4),
                           "prefetched": bool(i.prefetched)} for k, i in enumerate(infos)],
        }
        return dt, detail

    def counters(self) -> tuple[int, int]:
        """The daemon's (bytes_read, bytes_written) once it is quiet: unchanged over three 0.1 s waits."""
        return quiet_counters(self.session)

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

    def measure(self) -> tuple[float, float, float, float]:
        """(write GB/s, read GB/s) of one pass over the file each, the aggregate GB/s of
        writing one half while reading the other (both directions at once, as Fuyou runs
        them), and the durable write GB/s: a pass with its ``fdatasync`` (after an untimed
        one that drains what earlier cases left in the disk's cache; one after the cached
        write pass leaves the next case none)."""
        os.fdatasync(self.loop.fd)
        wd = self.loop.run(self.loop.WRITE, durable=True)
        w = self.loop.run(self.loop.WRITE)
        os.fdatasync(self.loop.fd)
        r = self.loop.run(self.loop.READ)
        t = time.perf_counter()
        futs = [self.pool.submit(self.loop.run, op, reqs) for op, reqs in self.mixed.items()]
        for f in futs:
            f.result()
        mixed = time.perf_counter() - t
        nbytes = sum(len(q.buf) for reqs in self.mixed.values() for q in reqs)
        os.fdatasync(self.loop.fd)
        return gbps(self.size, w), gbps(self.size, r), gbps(nbytes, mixed), gbps(self.size, wd)

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


class Kernel(InMemory):
    """The daemon's step kernel alone, one call per group, on a dtype's state in memory."""

    def __init__(self, args, numel: int, state_dtype: str):
        super().__init__(args, numel)
        self.state_dtype, self.spec = state_dtype, spec_of(state_dtype)
        self.name = f"kernel_{state_dtype}"

    def round(self) -> tuple[float, dict]:
        t = time.perf_counter()
        gen = torch.Generator().manual_seed(2)
        layout = self.spec.layout(self.numel)
        states, slots, grads = [], [], []
        for _ in range(self.args.groups):
            buf = torch.zeros(layout.size, dtype=torch.uint8)
            states.append(buf)
            ts = layout.tensors(memoryview(buf.numpy()))
            ts[0].normal_(generator=gen)
            slots.append(ts)
            grads.append(torch.empty(self.numel).normal_(generator=gen))
        setup_s = time.perf_counter() - t
        scratch = lowp.Scratch()
        try:
            times = []
            for k in range(self.args.inmem_steps + 1):  # the first untimed: faults the state in
                t = time.perf_counter()
                for ts, g in zip(slots, grads):
                    kernels.step(self.spec, k, ts, g, LR, scratch)
                times.append(time.perf_counter() - t)
            first = times.pop(0)
        finally:
            del states, slots, grads
            gc.collect()
        return statistics.median(times), {"steps_s": times, "first_step_s": first, "alloc_fill_s": setup_s}


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

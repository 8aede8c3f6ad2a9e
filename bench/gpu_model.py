"""A discrete-event model of one training iteration on a capped GPU: where its seconds go.

    python bench/gpu_model.py [--json PATH] [--from bench/results/gpu-h100.json]
                              [--width W --layers L --seq S --micro M --accum K --cap BYTES]
                              [--pcie GBps --ssd-read GBps --ssd-write GBps --host-add GBps ...]

A schedule, the order in which the client issues work, is replayed on in-order resources (the
GPU's compute stream, its H2D and D2H copy engines, the client's helper thread, the daemon's
SSD and CPU): an operation starts once its resource is free and its inputs are ready; buffer
pools (staging buffers, the download queue, weight slots, checkpoint buffers, the daemon's 3
optimizer buffers) hold work back as the client does; GPU and host memory bound what fits.
Each gap of the compute stream is charged to what it waited for; what follows its last work is
the exposed step. ``breakdown(Config(...))`` returns it all as a dict. docs/guide/gpu.md ("The
model of an iteration") describes the two schedules, "today" and "block-major".

Rates from the run's JSON (``--from``): the ceiling's time per micro-batch, busy share and
depth; SSD read and write bandwidth; the cap and Fuyou's measured device peak (which scales
this model's estimate of device memory); the host's memory. Assumed, overridable by flags:
PCIe 54 GB/s each way and 124 GB/s of memory traffic for an fp32 add on the host (measured in
that session: docs/performance.md); AdamW at 1.14e9 parameters/s (the daemon's kernel on the
2-core reference host); an HBM copy at 2.6 TB/s. The SSD does one transfer at a time (the
run's step is exactly its 12 B/param read plus 12 written at those bandwidths).

The GPU: FLOPs are counted with ``FlopCounterMode`` on one block of bench/gpu.py's family on
the meta device (recompute: a block's forward twice). A pass (forward 1, backward 2: about
their kernels) takes FLOPs / R + g, with R the ceiling's rate while a kernel ran and g its idle
time per pass; together they give its 15.68 ms per micro-batch. A larger micro-batch is faster
per FLOP only by amortising g (``at_ceiling_rate`` removes even that). ``busy``: the share of
time the compute stream holds work, kernels and g (the ceiling is 1.0 on this scale).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_cases import VOCAB, config as family  # noqa: E402 (bench/gpu.py's model family)

from fuyoud.units import parse_size  # noqa: E402

GB, GiB = 1e9, 1 << 30
RUN = HERE / "results" / "gpu-h100.json"
STATE_B = 12  # fp32 master, exp_avg, exp_avg_sq: read and written by each step


@dataclass(frozen=True)
class Config:
    """One iteration to model."""
    schedule: str = "block-major"  # or "today"
    width: int = 2048
    layers: int = 21
    seq: int = 1024
    micro: int = 2            # sequences per micro-batch
    accum: int = 256          # micro-batches per step (K)
    cap: int = 4 * GiB        # GPU memory
    weights: str = "host"     # resident (on the GPU) | host (uploaded per use) | ssd (read, then uploaded)
    overlap: bool = False     # today: a gradient download and a host addition may run at once
    grad_bytes: int = 4       # block-major: a block's gradient summed on the GPU (4: fp32, 2: bf16)
    grad_buffers: int = 2     # block-major: (1: the next block waits for the last one's download)
    host_state: tuple = ()    # block-major: groups ("first", "rest") whose state stays in host memory
    staging: int = 3          # today: hostgrads.py's staging buffers and download depth
    depth: int = 2
    prefetch: int = 2         # attach(prefetch=): weight slots are prefetch + 2 (today, offloaded)

    @property
    def tokens(self) -> int:
        return self.micro * self.seq * self.accum


@dataclass
class Rates:
    kernel_tflops: float      # hardware FLOP rate while a kernel runs
    pass_gap_s: float         # GPU idle per pass
    ceiling_tflops: float     # the ceiling's model TFLOPS: predictions are over it
    ceiling_hw_tflops: float  # the ceiling's hardware FLOPs per second, gaps included
    ssd_read: float           # GB/s
    ssd_write: float
    pcie_h2d: float = 54.0
    pcie_d2h: float = 54.0
    host_add: float = 124.0   # GB/s of memory traffic of an fp32 add (3 passes)
    adam: float = 1.14e9      # parameters/s
    hbm: float = 2600.0       # GB/s of a copy
    host_bytes: int = 126 * GiB
    device_factor: float = 1.0  # the run's measured device peak over this model's estimate of it
    sources: dict = field(default_factory=dict)

    def gpu_s(self, flops: float, passes: float) -> float:
        return flops / (self.kernel_tflops * 1e12) + passes * self.pass_gap_s


def params(width: int, seq: int) -> tuple[int, int]:
    """Parameters of one block and of the rest (embeddings, final norm, untied head)."""
    return 12 * width * width + 13 * width, (2 * VOCAB + seq) * width + 2 * width


def depth_for(width: int, seq: int, cap: int) -> int:
    """bench/gpu.py's depth: the smallest whose 16 B/param of state are at least 4x the cap."""
    block, rest = params(width, seq)
    return max(1, math.ceil((4 * cap / 16 - rest) / block))


@functools.lru_cache(maxsize=None)
def flops(width: int, seq: int, micro: int) -> dict:
    """Hardware FLOPs per micro-batch of a block's forward and backward and of the tail's,
    counted on the meta device (attention as matmuls over the full S x S)."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(family(width, 1, seq)).to(torch.bfloat16)
    x = torch.empty(micro, seq, width, dtype=torch.bfloat16, device="meta", requires_grad=True)
    labels = torch.zeros(micro * seq, dtype=torch.long, device="meta")
    out = {}
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731 (a block's hidden states)
    for name, forward in (("block", lambda: first(model.transformer.h[0](x)).float().sum()),
                          ("tail", lambda: torch.nn.functional.cross_entropy(
                              model.lm_head(model.transformer.ln_f(x)).float().view(-1, VOCAB), labels))):
        with FlopCounterMode(display=False) as count:
            loss = forward()
        out[f"{name}_fwd"] = count.get_total_flops()
        with FlopCounterMode(display=False) as count:
            loss.backward()
        out[f"{name}_bwd"] = count.get_total_flops()
    return out


def recorded(run: dict) -> Config:
    """The run's configuration, as "today"."""
    a = run["args"]
    return Config(schedule="today", width=a["width"], layers=run["model_layers"], seq=a["seq"], micro=a["micro"],
                  accum=a["accum"], cap=run["gpu_cap_bytes"], weights="resident")


def calibrate(run: dict) -> Rates:
    """Rates from a bench/gpu.py JSON; the others are the Rates defaults."""
    ceiling, info, args = run["results"]["ceiling"], run["ceiling_info"], run["args"]
    f = flops(args["width"], args["seq"], info.get("micro", args["micro"]))  # (newer runs: the ceiling's own)
    recompute = info["checkpointing"]
    hw = info["layers"] * (f["block_fwd"] * (1 + recompute) + f["block_bwd"]) + f["tail_fwd"] + f["tail_bwd"]
    passes = info["layers"] * (3 + recompute) + 3
    t, busy = ceiling["micro_batch_seconds"], ceiling["busy"]
    rates = Rates(kernel_tflops=hw / (busy * t) / 1e12, pass_gap_s=(1 - busy) * t / passes,
                  ceiling_tflops=ceiling["tflops"], ceiling_hw_tflops=hw / t / 1e12, ssd_read=run["ssd_read_GBps"],
                  ssd_write=run["ssd_write_GBps"], host_bytes=run["host"]["mem_total_bytes"])
    rates.device_factor = run["results"]["fuyou"]["peak_bytes"] / device_estimate(recorded(run))
    for key, name in (("pcie_h2d_GBps", "pcie_h2d"), ("pcie_d2h_GBps", "pcie_d2h"), ("host_add_GBps", "host_add")):
        if run.get(key):  # (probed in the same run by newer bench/gpu.py runs)
            setattr(rates, name, run[key])
    rates.sources = {
        "from the run's JSON": "results.ceiling micro_batch_seconds, busy, tflops; ceiling_info layers, "
                               "checkpointing; ssd_read_GBps, ssd_write_GBps; gpu_cap_bytes; results.fuyou "
                               "peak_bytes (device_factor); host mem_total_bytes",
        "assumed": "PCIe 54 GB/s each way and 124 GB/s of host memory traffic for an fp32 add (measured in that "
                   "session, docs/performance.md, not in the JSON); AdamW 1.14e9 params/s (the daemon's kernel on "
                   "the 2-core reference host); 2.6 TB/s for a copy in HBM"}
    return rates


def at_ceiling_rate(rates: Rates) -> Rates:
    """Every pass at the ceiling's average FLOP rate, whatever its size."""
    return replace(rates, kernel_tflops=rates.ceiling_hw_tflops, pass_gap_s=0.0)


def device_estimate(cfg: Config) -> float:
    """Peak bytes on the GPU, before ``device_factor``."""
    block, rest = params(cfg.width, cfg.seq)
    tokens = cfg.micro * cfg.seq
    ckpt = tokens * cfg.width * 2
    work = max(34 * tokens * cfg.width, 10 * tokens * VOCAB)  # a block with grad, or the tail's logits
    if cfg.schedule == "today":
        weights = 2 * (block * cfg.layers + rest) if cfg.weights == "resident" else \
            2 * rest + (cfg.prefetch + 2) * 2 * block
        grads = 2 * rest + 2 * block + (cfg.depth + 1) * 4 * block  # .grad, flattened copies queued
        return weights + grads + work + cfg.layers * ckpt
    # the rest's weights and fp32 gradients, 2 weight slots, the block gradients, 8 checkpoint buffers
    return 6 * rest + 2 * 2 * block + cfg.grad_buffers * cfg.grad_bytes * block + work + 8 * ckpt


class Timeline:
    """In-order resources: an operation starts when its resource has finished the one before and
    its inputs are ready ((time, cause) pairs). A gap of the GPU is charged to its inputs in the
    order they arrive, each for the time from the one before it to its own arrival."""

    def __init__(self):
        self.free: dict[str, float] = {}
        self.busy, self.stalls, self.bytes = Counter(), Counter(), Counter()

    def op(self, resource: str, seconds: float, *ready: tuple[float, str]) -> float:
        start = self.free.get(resource, 0.0)
        for when, cause in sorted(ready, key=lambda r: r[0]):
            if when > start:
                self.stalls[cause] += (when - start) * (resource == "gpu")
                start = when
        self.free[resource] = start + seconds
        self.busy[resource] += seconds
        return self.free[resource]

    def move(self, link: str, what: str, nbytes: float) -> None:
        self.bytes[f"{link}: {what}"] += nbytes


class Daemon:
    """fuyoud's steps: a group's state is read into one of ``buffers`` optimizer buffers once
    asked for and a buffer is free (reads in step order), stepped once its gradients are there,
    and written back. Groups in ``in_memory`` keep their state in host memory: AdamW only."""

    def __init__(self, t: Timeline, r: Rates, order: list, sizes: dict, in_memory=(), extra_write=0, buffers=3):
        self.t, self.r, self.sizes, self.extra, self.buffers = t, r, sizes, extra_write, buffers
        self.queue, self.in_memory = [g for g in order if g not in in_memory], set(in_memory)
        self.asked, self.read, self.written, self.ends = {}, {}, [], []

    def ask(self, group, when: float) -> None:
        self.asked.setdefault(group, when)
        while len(self.read) < min(len(self.queue), len(self.written) + self.buffers) \
                and self.queue[len(self.read)] in self.asked:
            i, g = len(self.read), self.queue[len(self.read)]
            free = self.written[i - self.buffers] if i >= self.buffers else 0.0
            self.t.move("ssd", "read state", STATE_B * self.sizes[g])
            self.read[g] = self.t.op("ssd", STATE_B * self.sizes[g] / self.r.ssd_read / GB, (self.asked[g], ""),
                                     (free, ""))

    def step(self, group, grads: float) -> float:
        n = self.sizes[group]
        if group in self.in_memory:
            self.ends.append(self.t.op("adam", n / self.r.adam, (grads, "")))
            return self.ends[-1]
        self.ask(group, grads)
        adam = self.t.op("adam", n / self.r.adam, (grads, ""), (self.read[group], ""))
        extra = self.extra * (group != "rest")  # (the rest's weights stay on the GPU)
        nbytes = (STATE_B + extra) * n
        self.t.move("ssd", "write state" + " and bf16 weights" * bool(extra), nbytes)
        self.written.append(self.t.op("ssd", nbytes / self.r.ssd_write / GB, (adam, "")))
        self.ends.append(self.written[-1])
        self.ask(group, grads)  # (its buffer is free: the next read may go)
        return self.ends[-1]


def _today(cfg: Config, r: Rates, t: Timeline) -> dict:
    """Today's client: per micro-batch a forward, then backward group by group; each group's
    gradients are flattened to fp32 on the compute stream, downloaded, and added into its host
    accumulator by the helper thread (the first micro-batch: straight into it). The training
    thread waits for the oldest addition when the staging buffers are taken, and for the oldest
    download when more than ``depth`` wait (hostgrads.py). ``overlap=False``: a download and an
    addition never run at once (how the run is reproduced; inferred, not observed). Then each
    group's step, and the new weights of resident groups up (engine.step())."""
    block, rest = params(cfg.width, cfg.seq)
    f = flops(cfg.width, cfg.seq, cfg.micro)
    fwd, bwd = r.gpu_s(f["block_fwd"], 1), r.gpu_s(f["block_fwd"] + f["block_bwd"], 3)
    sizes = {l: block for l in range(cfg.layers)} | {"rest": rest}
    order = [*reversed(range(cfg.layers)), "rest"]  # the groups in backward order
    download, add = ("d2h", "helper") if cfg.overlap else ("host path", "host path")
    resident = cfg.weights == "resident"
    cpu, why = 0.0, "start"  # the training thread: when it issues the next work, and what held it
    staged, queued, last, additions = deque(), deque(), {}, 0
    slots = deque([0.0] * (cfg.prefetch + 2))

    def gpu(seconds: float, upload: bool = False) -> float:
        ready = [(cpu, why)]
        if upload:  # offloaded: the block's bf16 weights up into a free slot first
            t.move("h2d", "weights", 2 * block)
            ready.append((t.op("h2d", 2 * block / r.pcie_h2d / GB, (slots.popleft(), "weight slots"), (cpu, why)),
                          "weights upload"))
        end = t.op("gpu", seconds, *ready)
        if upload:
            slots.append(end)
        return end

    for mb in range(cfg.accum):
        first = mb == 0  # downloads straight into the accumulators: no addition
        for _ in range(cfg.layers if not resident else 0):
            gpu(fwd, upload=True)
        gpu(r.gpu_s(f["tail_fwd"], 1) + (cfg.layers * fwd if resident else 0))
        gpu(r.gpu_s(f["tail_bwd"], 2))
        for g in order:
            if g != "rest":
                gpu(bwd, upload=not resident)
            n = sizes[g]
            flat = gpu(6 * n / r.hbm / GB)  # bf16 .grad -> one fp32 tensor
            if not first and len(staged) == cfg.staging:
                oldest = staged.popleft()
                if oldest > cpu:
                    cpu, why = oldest, "training thread: staging buffers (host additions)"
            t.move("d2h", "gradients", 4 * n)
            last[g] = done = t.op(download, 4 * n / r.pcie_d2h / GB, (flat, "compute"), (cpu, why))
            queued.append(done)
            if not first:
                last[g] = t.op(add, 12 * n / r.host_add / GB, (done, "download"))
                staged.append(last[g])
                additions += 1
                t.move("host memory", "additions", 12 * n)
            while len(queued) > cfg.depth:
                oldest = queued.popleft()
                if oldest > cpu:
                    cpu, why = oldest, "training thread: download queue" + \
                        " (downloads wait behind additions)" * (not cfg.overlap)
    daemon = Daemon(t, r, order, sizes)
    for g in order:  # each step goes once the group's last addition ran; the daemon reads ahead
        daemon.ask(g, last[g])
    end = steps = max(daemon.step(g, last[g]) for g in order)
    for g in order:  # engine.step(): the new weights of resident groups into the parameters
        if resident or g == "rest":
            t.move("h2d", "weights", 2 * sizes[g])
            end = t.op("h2d", 2 * sizes[g] / r.pcie_h2d / GB, (steps, ""))
    return {"micro_end": cpu, "end": max(end, t.free["gpu"]), "additions": additions}


def _block_major(cfg: Config, r: Rates, t: Timeline) -> dict:
    """engine.train_step (blockmajor.py): forward block by block over all K micro-batches, each
    block's input (a checkpoint) downloaded into the host arena as it is made and uploaded for
    its use, the next one ahead; the tail's forward and input gradient per micro-batch. Backward
    block by block in reverse: checkpoint and output gradient uploaded (the next micro-batch's
    ahead), the block recomputed, its input gradient downloaded; the block's gradient, summed on
    the GPU, downloaded once and its step sent at once (the daemon has read its state ahead).
    Then each micro-batch's tail is replayed for the head's and embeddings' gradients, and the
    iteration ends when every step has committed."""
    block, rest = params(cfg.width, cfg.seq)
    f = flops(cfg.width, cfg.seq, cfg.micro)
    L, K = cfg.layers, cfg.accum
    fwd, bwd = r.gpu_s(f["block_fwd"], 1), r.gpu_s(f["block_fwd"] + f["block_bwd"], 3)
    tail = r.gpu_s(f["tail_fwd"] + f["tail_bwd"] / 2, 2)  # forward + one of the head's two gradient matmuls
    ckpt = cfg.micro * cfg.seq * cfg.width * 2
    sizes = {l: block for l in range(L)} | {"rest": rest}
    order = [*reversed(range(L)), "rest"]
    in_memory = {0 if g == "first" else g for g in cfg.host_state}
    on_ssd = cfg.weights == "ssd"
    daemon = Daemon(t, r, order, sizes, in_memory, extra_write=2 * on_ssd)
    slots, grad_bufs = deque([0.0] * 2), deque([0.0] * cfg.grad_buffers)
    host_grads = deque([0.0] * (cfg.prefetch + 3))  # gradients.py's host buffers, each held until its step
    ups, downs = deque([0.0] * 4), deque([0.0] * 4)  # checkpoint buffers on the GPU: uploads, downloads
    arena = {}  # checkpoint -> when its host copy is there

    def weights(source: float) -> None:  # a block's bf16 weights up; its compute waits for them
        t.move("h2d", "weights", 2 * block)
        up = t.op("h2d", 2 * block / r.pcie_h2d / GB, (slots.popleft(), "weight slots"), (source, "weights fetch"))
        t.op("gpu", 0.0, (up, "weights upload"))

    def compute(seconds: float, inputs: list, outputs: list) -> None:
        ready = []
        for key in inputs:
            t.move("h2d", "checkpoints", ckpt)
            ready.append((t.op("h2d", ckpt / r.pcie_h2d / GB, (arena[key], "checkpoint download"),
                               (ups.popleft(), "checkpoint buffers")), "checkpoint upload"))
        ready += [(downs.popleft(), "checkpoint download backlog") for _ in outputs]
        end = t.op("gpu", seconds, *ready)
        ups.extend([end] * len(inputs))
        for key in outputs:
            t.move("d2h", "checkpoints", ckpt)
            arena[key] = t.op("d2h", ckpt / r.pcie_d2h / GB, (end, "compute"))
            downs.append(arena[key])

    fetched = {}
    for l in range(L if on_ssd else 0):  # forward's fetches: the bf16 weights the last steps wrote
        t.move("ssd", "read weights", 2 * block)
        fetched[l] = t.op("ssd", 2 * block / r.ssd_read / GB, (0.0, ""))
    for g in order:  # the daemon reads each group's state ahead, as its buffers free up
        daemon.ask(g, 0.0)
    for l in range(L):
        weights(fetched.get(l, 0.0))
        for k in range(K):  # block 0's input is the embeddings' output, made here
            compute(fwd, [("x", l, k)] if l else [], [("x", l, k)] * (l == 0) + [("x", l + 1, k)])
            if l == L - 1:  # the tail: forward and the gradient of its input
                compute(tail, [], [("g", l, k)])
        slots.append(t.free["gpu"])
    for l in reversed(range(L)):
        weights(daemon.read.get(l, 0.0) if on_ssd else 0.0)  # (from the state read ahead: no second read)
        t.op("gpu", 0.0, (grad_bufs.popleft(), "gradient download"))
        for k in range(K):
            compute(bwd, [("x", l, k), ("g", l, k)], [("g", l - 1, k)])
        slots.append(t.free["gpu"])
        t.move("d2h", "gradients", cfg.grad_bytes * block)
        t.op("gpu", 0.0, (host_grads.popleft(), "training thread: gradient host buffers (steps behind)"))
        grad_bufs.append(t.op("d2h", cfg.grad_bytes * block / r.pcie_d2h / GB, (t.free["gpu"], "compute")))
        host_grads.append(daemon.step(l, grad_bufs[-1]))
    for k in range(K):  # the tail again, for the head's and (from block 0's input gradient) embeddings' gradients
        compute(tail, [("x", L, k), ("g", -1, k)], [])
    t.move("d2h", "gradients", 4 * rest)
    end = daemon.step("rest", t.op("d2h", 4 * rest / r.pcie_d2h / GB, (t.free["gpu"], "compute")))
    t.move("h2d", "weights", 2 * rest)  # the new embeddings and head into the parameters
    end = t.op("h2d", 2 * rest / r.pcie_h2d / GB, (end, ""))
    step_s = block * (STATE_B / r.ssd_read + (STATE_B + 2 * on_ssd) / r.ssd_write) / GB
    return {"micro_end": None, "end": max([end, t.free["gpu"], *daemon.ends]), "additions": 0,
            "block_step_over_backward": step_s / (K * bwd)}


def breakdown(config: Config | dict, rates: Rates | None = None) -> dict:
    """Where each second of one iteration of ``config`` goes, and the bytes on each link
    (``rates`` default: calibrated on bench/results/gpu-h100.json)."""
    cfg = config if isinstance(config, Config) else Config(**config)
    r = rates or calibrate(load(RUN))
    t = Timeline()
    res = (_today if cfg.schedule == "today" else _block_major)(cfg, r, t)
    block, rest = params(cfg.width, cfg.seq)
    n = block * cfg.layers + rest
    seconds, gpu_end = res["end"], t.free["gpu"]
    tflops = 6 * n * cfg.tokens / seconds / 1e12
    pcie = {k: v for k, v in t.bytes.items() if k.startswith(("h2d", "d2h"))}
    ssd = sum(v for k, v in t.bytes.items() if k.startswith("ssd"))
    host = 3 * STATE_B * block + 2 * n * (cfg.weights == "host")  # the daemon's optimizer buffers, the weights
    peak = device_estimate(cfg) * r.device_factor
    if cfg.schedule == "today":
        fits, arena = peak <= cfg.cap, 0  # (the run's own peak, under its cap, is the estimate's scale)
        host += 4 * n + cfg.staging * 4 * block  # accumulators, staging buffers
    else:
        fits = peak <= 0.9 * cfg.cap  # (bench/gpu.py's searches leave 10% spare)
        arena = (cfg.layers + 2) * cfg.accum * cfg.micro * cfg.seq * cfg.width * 2  # as blockmajor.Store reserves
        host += arena + sum(16 * (block if g == "first" else rest) for g in cfg.host_state)
    out = {"config": dataclasses.asdict(cfg), "params": n, "tokens": cfg.tokens, "iteration_seconds": seconds,
           "model_tflops": tflops, "over_ceiling": tflops / r.ceiling_tflops, "gpu_busy": t.busy["gpu"] / seconds,
           "seconds": {"gpu compute": t.busy["gpu"],
                       **{f"gpu stalled: {k}": v for k, v in sorted(t.stalls.items()) if v > 0},
                       "step exposed": seconds - gpu_end},
           "bytes": dict(sorted(t.bytes.items())),
           "pcie_bytes": sum(pcie.values()),
           "pcie_weights_and_gradients_bytes": sum(v for k, v in pcie.items() if not k.endswith("checkpoints")),
           "ssd_bytes_per_param": ssd / n,
           # every byte over PCIe or to the SSD crosses host memory once; an addition 3 times; AdamW reads
           # gradient and state (16 B/param) and writes state and bf16 weights (14)
           "host_memory_traffic_bytes": sum(pcie.values()) + ssd + t.bytes["host memory: additions"] + 30 * n,
           "host_additions": res["additions"], "exposed_step_seconds": seconds - gpu_end,
           "device_peak_bytes": peak, "fits_device": fits,
           "host_arena_bytes": arena, "host_bytes_needed": host, "fits_host": host <= 0.9 * r.host_bytes}
    if res["micro_end"] is not None:  # as bench/gpu.py measures: to the last micro-batch's return, then the step
        out["micro_batch_seconds"] = res["micro_end"] / cfg.accum
        out["step_seconds"] = seconds - res["micro_end"]
    else:
        out["block_step_over_backward"] = res["block_step_over_backward"]  # > 1: the steps fall behind
    return out


@functools.lru_cache(maxsize=None)
def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def calibration(run: dict, rates: Rates) -> dict:
    """The model of "today" against the run: the relative error of each measured figure."""
    got, fuyou = breakdown(recorded(run), rates), run["results"]["fuyou"]
    pairs = {"micro_batch_seconds": (got["micro_batch_seconds"], fuyou["micro_batch_seconds"]),
             "step_seconds": (got["step_seconds"], fuyou["step_seconds"]),
             "model_tflops": (got["model_tflops"], fuyou["tflops"]), "gpu_busy": (got["gpu_busy"], fuyou["busy"])}
    errors = {k: abs(m / v - 1) for k, (m, v) in pairs.items()}
    return {"model": {k: m for k, (m, _) in pairs.items()}, "run": {k: v for k, (_, v) in pairs.items()},
            "relative_error": errors, "calibration_error": max(errors.values())}


def choose(base: Config, rates: Rates, min_tokens: int = 300_000, tolerance: float = 0.03) -> dict:
    """Block-major's micro-batch and K, from ``min_tokens`` to the base's tokens per step, fitting
    the GPU and the host: the smallest micro-batch within ``tolerance`` of the fastest (it leaves
    the GPU's memory more to spare, where its estimate is least sure), then the fastest."""
    fits = []
    for micro in (1, 2, 4, 8, 16, 32):
        k = math.ceil(min_tokens / (micro * base.seq))
        while k * micro * base.seq <= max(min_tokens, base.tokens):
            cfg = replace(base, schedule="block-major", micro=micro, accum=k)
            on_gpu = device_estimate(cfg) * rates.device_factor <= 0.9 * cfg.cap  # (before simulating it)
            if on_gpu and (got := breakdown(cfg, rates))["fits_host"]:
                fits.append(got)
            k = 1 << k.bit_length() if k & (k - 1) else 2 * k  # the next power of two
    if not fits:
        raise ValueError(f"no micro-batch of block-major fits {base.cap} bytes of GPU memory")
    best = max(b["model_tflops"] for b in fits)
    return min((b for b in fits if b["model_tflops"] >= (1 - tolerance) * best),
               key=lambda b: (b["config"]["micro"], -b["model_tflops"]))


def candidates(base: Config, rates: Rates, search: bool = True) -> dict:
    """Each schedule at ``base``'s model and tokens per step (block-major's micro-batch: chosen
    if ``search``, else the base's)."""
    today = replace(base, schedule="today", weights="resident", overlap=False)
    bm = replace(base, schedule="block-major", weights="host")
    bm = choose(bm, rates) if search else breakdown(bm, rates)
    cfg = Config(**bm["config"])
    return {"today": breakdown(today, rates),
            "today, download and add overlapped": breakdown(replace(today, overlap=True), rates),
            "large micro-batches (4x, weights in host memory)": breakdown(
                replace(today, weights="host", micro=base.micro * 4, accum=max(1, base.accum // 4)), rates),
            "block-major": bm,
            "block-major, weights on SSD": breakdown(replace(cfg, weights="ssd"), rates),
            "block-major, bf16 gradients, state of block 0 and the rest in host memory":
                breakdown(replace(cfg, grad_bytes=2, host_state=("first", "rest")), rates)}


def table(rows: dict) -> str:
    """Per schedule: its figures, its seconds by cause, its bytes by link."""
    lines = []
    for name, b in rows.items():
        c = b["config"]
        lines += [f"\n== {name}: {b['params'] / 1e9:.3f}B params ({c['width']} x {c['layers']}), {c['micro']} x "
                  f"{c['seq']} tokens x {c['accum']} = {b['tokens']:,} tokens/step, weights {c['weights']}"
                  + ("" if b["fits_device"] else "  ** does not fit the GPU **"),
                  f"   iteration {b['iteration_seconds']:.2f} s, {b['model_tflops']:.1f} model TFLOPS = "
                  f"{b['over_ceiling']:.3f}x ceiling, GPU busy {b['gpu_busy']:.3f}, host additions "
                  f"{b['host_additions']}" + (f", micro-batch {b['micro_batch_seconds'] * 1e3:.1f} ms, step "
                                              f"{b['step_seconds']:.2f} s" if "micro_batch_seconds" in b else "")]
        lines += [f"   {k:<62} {v:8.3f} s {v / b['iteration_seconds']:6.1%}" for k, v in b["seconds"].items()]
        lines += [f"   {k:<62} {v / GB:8.2f} GB" for k, v in b["bytes"].items()]
        lines += [f"   {'host memory traffic (PCIe, SSD, additions, AdamW)':<62} "
                  f"{b['host_memory_traffic_bytes'] / GB:8.2f} GB",
                  f"   SSD {b['ssd_bytes_per_param']:.1f} B/param; PCIe {b['pcie_bytes'] / GB:.1f} GB, of which "
                  f"weights and gradients {b['pcie_weights_and_gradients_bytes'] / GB:.2f}; GPU peak "
                  f"{b['device_peak_bytes'] / GiB:.2f} GiB; host {b['host_bytes_needed'] / GiB:.1f} GiB "
                  f"(arena {b['host_arena_bytes'] / GiB:.1f})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--from", dest="run", type=Path, default=RUN, help="the bench/gpu.py JSON to calibrate on")
    ap.add_argument("--width", type=int, help="(default: the run's; its depth: bench/gpu.py's for that width)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--micro", type=int, help="sequences per micro-batch (with --micro or --accum, block-major "
                                              "uses them rather than choosing)")
    ap.add_argument("--accum", type=int, help="micro-batches per step")
    ap.add_argument("--cap", type=parse_size, help="GPU memory (bytes, or 4GiB)")
    ap.add_argument("--wide-width", type=int, default=4096, help="the wider family predicted (default 4096)")
    overrides = {"pcie": ("pcie_h2d", "pcie_d2h"), "ssd-read": ("ssd_read",), "ssd-write": ("ssd_write",),
                 "host-add": ("host_add",), "adam": ("adam",), "kernel-tflops": ("kernel_tflops",),
                 "host-bytes": ("host_bytes",)}
    for flag, fields in overrides.items():
        ap.add_argument(f"--{flag}", type=parse_size if flag == "host-bytes" else float,
                        help=f"Rates.{fields[0]} (see its comment)")
    args = ap.parse_args(argv)
    run = load(args.run)
    rates = calibrate(run)
    for flag, fields in overrides.items():
        for name in fields * (getattr(args, flag.replace("-", "_")) is not None):
            setattr(rates, name, getattr(args, flag.replace("-", "_")))
    cal = calibration(run, rates)
    base = recorded(run)
    base = replace(base, **{k: v for k in ("width", "layers", "seq", "micro", "accum", "cap")
                            if (v := getattr(args, k)) is not None})
    if args.width and not args.layers:
        base = replace(base, layers=depth_for(base.width, base.seq, base.cap))
    wide = replace(base, width=args.wide_width, layers=depth_for(args.wide_width, base.seq, base.cap))
    try:
        rows = candidates(base, rates, search=args.micro is None and args.accum is None)
        wide = {"today": breakdown(wide, rates), "block-major": choose(replace(wide, schedule="block-major",
                                                                                    weights="host"), rates)}
    except ValueError as exc:
        ap.error(str(exc))
    bm, bw = rows["block-major"], wide["block-major"]
    flat = [breakdown(Config(**b["config"]), at_ceiling_rate(rates))["over_ceiling"] for b in (bm, bw)]
    print(f"calibration on {args.run.name}, today's schedule: " + ", ".join(
        f"{k} {cal['model'][k]:.4g} vs {cal['run'][k]:.4g} ({cal['relative_error'][k]:.1%})" for k in cal["model"]))
    print(table(rows) + "\n\nwider family (4x the cap in state):" + table(wide))
    print(f"\nblock-major (predicted, not measured): {bm['model_tflops']:.1f} TFLOPS = {bm['over_ceiling']:.3f}x "
          f"the ceiling's {rates.ceiling_tflops:.1f} ({flat[0]:.3f}x if larger micro-batches were no faster per "
          f"FLOP); wider family {bw['over_ceiling']:.3f}x ({flat[1]:.3f}x)")
    targets = {}
    for label, b in (("", bm), ("wide: ", bw)):
        for name, value, met in (
                ("over ceiling >= 0.8", b["over_ceiling"], b["over_ceiling"] >= 0.8),
                ("PCIe weights and gradients GB <= 9", b["pcie_weights_and_gradients_bytes"] / GB,
                 b["pcie_weights_and_gradients_bytes"] <= 9 * GB),
                ("host additions == 0", b["host_additions"], b["host_additions"] == 0),
                ("exposed step s <= 1", b["exposed_step_seconds"], b["exposed_step_seconds"] <= 1),
                ("GPU busy >= 0.9", b["gpu_busy"], b["gpu_busy"] >= 0.9),
                (f"host GiB needed (fits 90% of {rates.host_bytes / GiB:.0f})", b["host_bytes_needed"] / GiB,
                 b["fits_host"])):
            targets[label + name] = {"value": value, "met": bool(met)}
    print("targets: " + "; ".join(f"{k}: {t['value']:.3g} ({'met' if t['met'] else 'NOT met'})"
                                  for k, t in targets.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "calibration_error": cal["calibration_error"], "calibration": cal, "schedule": "block-major",
            "targets": targets,
            "predicted_tflops": bm["model_tflops"], "predicted_over_ceiling": bm["over_ceiling"],
            "predicted_over_ceiling_wide": bw["over_ceiling"], "predicted_wide_tflops": bw["model_tflops"],
            "predicted_over_ceiling_at_ceiling_rate": flat[0], "predicted_over_ceiling_wide_at_ceiling_rate": flat[1],
            "ceiling_tflops": rates.ceiling_tflops, "calibrated_on": os.path.relpath(args.run, HERE.parent),
            "rates": dataclasses.asdict(rates),
            "schedules": rows, "wide": wide,
            "note": "predictions of a model calibrated on one H100 run; block-major has not run on a GPU"},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

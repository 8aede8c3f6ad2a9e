"""A discrete-event model of one training iteration on a GPU: where its seconds go, and
the bytes on each link (PCIe each way, the SSD array).

A schedule, the order in which the client issues work, is replayed on in-order resources
(the GPU's compute stream, its H2D and D2H copy engines, the client's helper thread, the
daemon's SSD array and CPU): an operation starts once its resource is free and its inputs
are ready; buffer pools (staging buffers, the download queue, weight slots, checkpoint
buffers, the daemon's optimizer buffers) hold work back as the client does. Each gap of
the compute stream is charged to what it waited for; what follows its last work is the
exposed step. Two schedules (docs/design/iteration-model.md):

* ``"block-major"``: ``engine.train_step``: forward block by block over all K
  micro-batches, each block's input kept in the host arena; backward block by block in
  reverse, each block recomputed per micro-batch (or, for the ``swapped`` blocks, its
  saved activations brought back: swap_model.py), its gradient summed on the GPU and sent
  once, its step submitted at once (the daemon has read its state ahead);
* ``"loop"``: the ordinary loop, per micro-batch a forward and a backward group by group,
  each group's gradients downloaded and added on the host, every step after the last.

The GPU: a block's forward, its recomputed backward and the tail's passes take what
kernels.GpuKernels sums over their kernels from the model's shapes (each GEMM against the
GPU's peak with an efficiency rising with its dimensions, attention, the memory-bound
traffic, a floor per launch: docs/design/iteration-model.md); without one (``Rates.gpu``
None) every pass runs at one FLOP rate R plus an idle time g per pass. The SSD array does
one transfer at a time at its read or write rate; AdamW runs at the host's rate.

``simulate(shape, schedule, rates)`` returns it all as a dict. ``calibrate(run)`` reads the
rates of a bench/gpu.py result (its GPU as gpu_runs.measured_gpu measures it).
"""
from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from fuyou_client.sizing.gpu_runs import gpt2_family, measured_gpu
from fuyou_client.sizing.hardware import GpuProfile, HostError
from fuyou_client.sizing.kernels import GpuKernels
from fuyou_client.sizing.timeline import Daemon, Timeline
from fuyou_client.sizing.shape import ModelShape
from fuyou_client.sizing.swap_model import SwappedActivations, activation_bytes
from fuyou_proto.contract import state_object_bytes

GB, GiB = 1e9, 1 << 30
MERGE = 64  # block-major: micro-batches replayed one by one, at most (more are merged in runs)


@dataclass(frozen=True)
class Schedule:
    """One iteration's settings."""
    schedule: str = "block-major"  # or "loop"
    seq: int = 1024
    micro: int = 2            # sequences per micro-batch
    accum: int = 256          # micro-batches per step (K)
    weights: str = "ssd"      # the blocks': resident (on the GPU) | host (uploaded per use) | ssd (read, then uploaded)
    state_dtype: str = "fp32"
    compute_bytes: int = 2    # the compute dtype's (bf16 on a GPU)
    overlap: bool = False     # loop: a gradient download and a host addition may run at once
    grad_bytes: int = 4       # block-major: a block's gradient summed on the GPU (4: fp32, 2: bf16)
    grad_buffers: int = 2     # block-major: (1: the next block waits for the last one's download)
    host_state: tuple = ()    # block-major: groups ("first", "rest") whose state stays in host memory
    staging: int = 3          # loop: gradients/host.py's staging buffers and download depth
    depth: int = 2
    prefetch: int = 2         # weight slots are prefetch + 2 (loop, offloaded)
    served: bool = True       # block-major, weights on the SSD array: backward's weights come with the step's
    #                           read-ahead of the state (blocks that fit an optimizer buffer), else a read of their own
    parts: int = 0            # block-major, granularity="module": a block's sub-blocks (0: whole blocks)
    slots: int = 2            # weight slots (with parts: for sub-blocks; fewer than parts: they come again)
    swapped: int = 0          # block-major: blocks whose activations are swapped, not recomputed (swap_blocks)
    swap_arena: float = float("inf")  # block-major: host bytes for the swapped activations (beyond: the SSD array)

    @property
    def tokens(self) -> int:
        return self.micro * self.seq * self.accum


@dataclass
class Rates:
    ssd_read: float           # GB/s, the array
    ssd_write: float
    gpu: GpuKernels | None = None  # the GPU's time by kernel; None: the flat rate below
    precision: str = "bf16"   # the model's: "bf16" or "fp16" (Fuyou's clients) or "autocast" (fp32 parameters)
    kernel_tflops: float = 0.0  # (flat) hardware FLOP rate while a kernel runs
    pass_gap_s: float = 0.0   # (flat) GPU idle per pass
    pcie_h2d: float = 54.0
    pcie_d2h: float = 54.0
    host_add: float = 124.0   # GB/s of memory traffic of an fp32 add (3 passes)
    adam: float = 1.14e9      # parameters/s
    hbm: float = 2600.0       # GB/s of a copy
    optimizer_buffers: int = 3
    ceiling_tflops: float = 0.0  # (calibrated on a run: that run's in-GPU ceiling, model TFLOPS)
    ceiling_hw_tflops: float = 0.0
    host_bytes: int = 0
    sources: dict = field(default_factory=dict)

    def gpu_s(self, flops: float, passes: float) -> float:
        """(flat) ``flops`` in ``passes`` passes at the flat rate."""
        return flops / (self.kernel_tflops * 1e12) + passes * self.pass_gap_s

    def block_s(self, shape: ModelShape, s: "Schedule", which: str) -> float:
        """A block's ``"forward"``, recomputed ``"backward"`` (forward again, then the
        gradients) or ``"backward only"`` (a swapped block's: the gradients alone) for one
        micro-batch."""
        if self.gpu is not None:
            return self.gpu.block_seconds(shape, s.micro, s.seq, which, self.precision)
        f = shape.flops(s.seq, s.micro)
        if which == "backward only":
            return self.gpu_s(f["block_bwd"], 2)
        return self.gpu_s(f["block_fwd"], 1) if which == "forward" else self.gpu_s(f["block_fwd"] + f["block_bwd"], 3)

    def tail_s(self, shape: ModelShape, s: "Schedule", parts: tuple) -> float:
        """The tail's (final norm, head, loss) ``parts`` for one micro-batch: "forward",
        "input_grad" (backward to its input), "weight_grad" (the head's gradient)."""
        if self.gpu is not None:
            return self.gpu.tail_seconds(shape, s.micro, s.seq, parts, self.precision)
        f = shape.flops(s.seq, s.micro)
        return sum(self.gpu_s(f["tail_fwd"] if p == "forward" else f["tail_bwd"] / 2, 1) for p in parts)


def state_bytes(state_dtype: str, numel: int) -> int:
    return state_object_bytes("adamw", state_dtype, numel)


def recorded(run: dict) -> tuple[ModelShape, Schedule, int]:
    """A bench/gpu.py run's model, its configuration (the loop, resident weights) and its cap."""
    a = run["args"]
    return (gpt2_family(a["width"], run["model_layers"], a["seq"]),
            Schedule(schedule="loop", seq=a["seq"], micro=a["micro"], accum=a["accum"], weights="resident"),
            run["gpu_cap_bytes"])


def calibrate(run: dict) -> Rates:
    """Rates from a bench/gpu.py JSON: the kernel model of its GPU as its ceiling measured
    it (measured_gpu), the model's precision bf16 (Fuyou's runs); the ceiling's FLOP rate
    (the flat model's, and the ``over_ceiling`` scale); its SSD rates, host memory and
    (where probed) PCIe and host addition rates; the others are the Rates defaults."""
    ceiling, info, args = run["results"]["ceiling"], run["ceiling_info"], run["args"]
    shape = gpt2_family(args["width"], 1, args["seq"])
    f = shape.flops(args["seq"], info.get("micro", args["micro"]))  # (newer runs: the ceiling's own)
    recompute = info["checkpointing"]
    hw = info["layers"] * (f["block_fwd"] * (1 + recompute) + f["block_bwd"]) + f["tail_fwd"] + f["tail_bwd"]
    passes = info["layers"] * (3 + recompute) + 3
    t, busy = ceiling["micro_batch_seconds"], ceiling["busy"]
    gpu = measured_gpu(run, "the run")
    rates = Rates(gpu=gpu.kernels, kernel_tflops=hw / (busy * t) / 1e12, pass_gap_s=(1 - busy) * t / passes,
                  ceiling_tflops=ceiling["tflops"], ceiling_hw_tflops=hw / t / 1e12, ssd_read=run["ssd_read_GBps"],
                  ssd_write=run["ssd_write_GBps"], host_bytes=run["host"]["mem_total_bytes"], hbm=gpu.kernels.hbm / GB)
    for key, name in (("pcie_h2d_GBps", "pcie_h2d"), ("pcie_d2h_GBps", "pcie_d2h"), ("host_add_GBps", "host_add")):
        if run.get(key):  # (probed in the same run by newer bench/gpu.py runs)
            setattr(rates, name, run[key])
    rates.sources = {
        "from the run's JSON": "results.ceiling micro_batch_seconds, busy, tflops; ceiling_info layers, "
                               "checkpointing, micro; ssd_read_GBps, ssd_write_GBps; host mem_total_bytes",
        "the GPU": gpu.gemm_efficiency.source + "; datasheet: " + gpu.source,
        "assumed": "PCIe 54 GB/s each way and 124 GB/s of host memory traffic for an fp32 add (measured in that "
                   "session, docs/performance.md, not in the JSON); AdamW 1.14e9 params/s (the daemon's kernel on "
                   "the 2-core reference host)"}
    return rates


def from_gpu_run(path: str | os.PathLike) -> GpuProfile:
    """A profile measured here: the ceiling run of a bench/gpu.py result (its GPU's kernel
    speed and issue time per kernel, its PCIe where probed)."""
    try:
        run = json.loads(Path(path).read_text())
        return calibrate_gpu(run, str(path))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ZeroDivisionError, IndexError) as exc:
        raise HostError(f"--gpu-from {path}: not a readable bench/gpu.py result ({type(exc).__name__}: {exc})") from None


def calibrate_gpu(run: dict, source: str) -> GpuProfile:
    """A GpuProfile measured by a bench/gpu.py run."""
    return measured_gpu(run, source)


def at_ceiling_rate(rates: Rates) -> Rates:
    """Every pass at the ceiling's average FLOP rate, whatever its size (the flat model)."""
    return replace(rates, gpu=None, kernel_tflops=rates.ceiling_hw_tflops, pass_gap_s=0.0)


def state_io(shape: ModelShape, s: Schedule) -> dict:
    """Per group (block index, "rest"): the daemon's (bytes read, bytes written) for its
    step: its state, and for blocks whose weights are on the SSD array in a 16-bit dtype the
    new weights the step writes beside it."""
    block, rest = state_bytes(s.state_dtype, shape.block_params), state_bytes(s.state_dtype, shape.rest_params)
    extra = shape.block_params * s.compute_bytes if s.weights == "ssd" and s.compute_bytes != 4 else 0
    return {l: (block, block + extra) for l in range(shape.layers)} | {"rest": (rest, rest)}


def _loop(shape: ModelShape, s: Schedule, r: Rates, t: Timeline) -> dict:
    """The ordinary loop: per micro-batch a forward, then backward group by group; each
    group's gradients are flattened to fp32 on the compute stream, downloaded, and added into
    its host accumulator by the helper thread (the first micro-batch: straight into it). The
    training thread waits for the oldest addition when the staging buffers are taken, and for
    the oldest download when more than ``depth`` wait (gradients/host.py). ``overlap=False``: a
    download and an addition never run at once (how the H100 run is reproduced; inferred, not
    observed). Then each group's step, and the new weights of resident groups up."""
    block, rest, c = shape.block_params, shape.rest_params, s.compute_bytes
    fwd, bwd = r.block_s(shape, s, "forward"), r.block_s(shape, s, "backward")
    sizes = {l: block for l in range(shape.layers)} | {"rest": rest}
    order = [*reversed(range(shape.layers)), "rest"]  # the groups in backward order
    download, add = ("d2h", "helper") if s.overlap else ("host path", "host path")
    resident = s.weights == "resident"
    cpu, why = 0.0, "start"  # the training thread: when it issues the next work, and what held it
    staged, queued, last, additions = deque(), deque(), {}, 0
    slots = deque([0.0] * (s.prefetch + 2))

    def gpu(seconds: float, upload: bool = False) -> float:
        ready = [(cpu, why)]
        if upload:  # offloaded: the block's weights up into a free slot first (read from the SSD before)
            source = (cpu, why)
            if s.weights == "ssd":
                t.move("ssd", "read weights", c * block)
                source = (t.op("ssd", c * block / r.ssd_read / GB, (cpu, why)), "weights fetch")
            t.move("h2d", "weights", c * block)
            ready.append((t.op("h2d", c * block / r.pcie_h2d / GB, (slots.popleft(), "weight slots"), source),
                          "weights upload"))
        end = t.op("gpu", seconds, *ready)
        if upload:
            slots.append(end)
        return end

    for mb in range(s.accum):
        first = mb == 0  # downloads straight into the accumulators: no addition
        for _ in range(shape.layers if not resident else 0):
            gpu(fwd, upload=True)
        gpu(r.tail_s(shape, s, ("forward",)) + (shape.layers * fwd if resident else 0))
        gpu(r.tail_s(shape, s, ("input_grad", "weight_grad")))
        for g in order:
            if g != "rest":
                gpu(bwd, upload=not resident)
            n = sizes[g]
            flat = gpu(6 * n / r.hbm / GB)  # bf16 .grad -> one fp32 tensor
            if not first and len(staged) == s.staging:
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
            while len(queued) > s.depth:
                oldest = queued.popleft()
                if oldest > cpu:
                    cpu, why = oldest, "training thread: download queue" + \
                        " (downloads wait behind additions)" * (not s.overlap)
    daemon = Daemon(t, r, order, sizes, state_io(shape, s))
    for g in order:  # each step goes once the group's last addition ran; the daemon reads ahead
        daemon.ask(g, last[g])
    end = steps = max(daemon.step(g, last[g]) for g in order)
    for g in order:  # the new weights of resident groups into the parameters
        if resident or g == "rest":
            t.move("h2d", "weights", c * sizes[g])
            end = t.op("h2d", c * sizes[g] / r.pcie_h2d / GB, (steps, ""))
    return {"micro_end": cpu, "end": max(end, t.free["gpu"]), "additions": additions}


def _block_major(shape: ModelShape, s: Schedule, r: Rates, t: Timeline) -> dict:  # long: one timeline, pass by pass
    """engine.train_step (blockmajor/schedule.py): forward block by block over all K micro-batches, each
    block's input (a checkpoint) downloaded into the host arena as it is made and uploaded for
    its use, the next one ahead; the tail's forward and input gradient per micro-batch. Backward
    block by block in reverse: checkpoint and output gradient uploaded (the next micro-batch's
    ahead), the block recomputed, its input gradient downloaded; the block's gradient, summed on
    the GPU, downloaded once and its step sent at once (the daemon has read its state ahead).
    Then each micro-batch's tail is replayed for the head's and embeddings' gradients, and the
    iteration ends when every step has committed.

    The ``swapped`` blocks (blockmajor/swapped.py) run forward once, their activations going
    down as they are made (beyond ``swap_arena``, on to the SSD array), and in backward
    come back up (read back from the SSD array first where they spilled) for a backward
    without recomputation and without their kept input (swap_model.py).

    Blocks cut into ``parts`` sub-blocks (model/cuts.py) whose slots cannot hold them all
    come up again for every micro-batch of their forward and of their recomputation (read
    again from the SSD array in forward; served from the step's read-ahead in backward), and
    after a recomputation the sub-blocks the slots no longer hold come up again for the
    backward pass itself; between micro-batches each sub-block's gradient sum goes down and
    comes back up (gradients/pool.py's parking)."""
    block, rest, c = shape.block_params, shape.rest_params, s.compute_bytes
    # More than MERGE micro-batches are replayed as MERGE runs of m consecutive ones: each
    # run's compute, passes and checkpoint bytes are m micro-batches' (the totals exact; the
    # overlap of copies with compute only coarser, so never more optimistic)
    L, m = shape.layers, max(1, -(-s.accum // MERGE))
    K = -(-s.accum // m)
    fwd, bwd = m * r.block_s(shape, s, "forward"), m * r.block_s(shape, s, "backward")
    bwd_only = m * r.block_s(shape, s, "backward only")
    acts = SwappedActivations(t, r, L, s.swapped, K, activation_bytes(shape, m * s.micro * s.seq, c),
                              s.swap_arena)
    tail = m * r.tail_s(shape, s, ("forward", "input_grad"))  # forward + one of the head's two gradient matmuls
    ckpt = m * s.micro * s.seq * shape.width * c
    sizes = {l: block for l in range(L)} | {"rest": rest}
    order = [*reversed(range(L)), "rest"]
    in_memory = {0 if g == "first" else g for g in s.host_state}
    on_ssd = s.weights == "ssd"
    daemon = Daemon(t, r, order, sizes, state_io(shape, s), in_memory)
    slots, grad_bufs = deque([0.0] * (3 if s.parts else 2)), deque([0.0] * s.grad_buffers)
    host_grads = deque([0.0] * (s.prefetch + 3))  # gradients/pool.py's host buffers, each held until its step
    ups, downs = deque([0.0] * 4), deque([0.0] * 4)  # checkpoint buffers on the GPU: uploads, downloads
    arena = {}  # checkpoint -> when its host copy is there

    def weights(source: float, share: float = 1.0, why: str = "weights") -> None:  # up; compute waits for them
        t.move("h2d", why, share * c * block)
        up = t.op("h2d", share * c * block / r.pcie_h2d / GB, (slots.popleft(), "weight slots"),
                  (source, "weights fetch"))
        t.op("gpu", 0.0, (up, "weights upload"))

    cut = s.parts > 0
    again = cut and s.slots < s.parts  # (a block's sub-blocks do not all stay: each micro-batch brings them again)
    evicted = max(0, s.parts - s.slots) / s.parts if cut else 0.0  # (recomputed, then gone before backward)

    def again_up(what: str, read: bool) -> None:  # a cut block's sub-blocks, again for another micro-batch
        source = 0.0
        if read and on_ssd:
            t.move("ssd", "read weights again", c * block)
            source = t.op("ssd", c * block / r.ssd_read / GB, (0.0, ""))
        weights(source, 1.0, what)

    last = [0.0, 0.0]  # the last pass's (start, end) on the GPU

    def compute(seconds: float, inputs: list, outputs: list, extra: tuple = (), swapped=None) -> None:
        ready = list(extra)
        for key in inputs:
            t.move("h2d", "checkpoints", ckpt)
            ready.append((t.op("h2d", ckpt / r.pcie_h2d / GB, (arena[key], "checkpoint download"),
                               (ups.popleft(), "checkpoint buffers")), "checkpoint upload"))
        ready += [(downs.popleft(), "checkpoint download backlog") for _ in outputs]
        end = t.op("gpu", seconds, *ready)
        last[:] = [end - seconds, end]
        if swapped:  # (its activations start down with the compute, before its outputs)
            acts.forward(swapped, *last)
        ups.extend([end] * len(inputs))
        for key in outputs:
            t.move("d2h", "checkpoints", ckpt)
            arena[key] = t.op("d2h", ckpt / r.pcie_d2h / GB, (end, "compute"))
            downs.append(arena[key])

    fetched = {}
    for l in range(L if on_ssd else 0):  # forward's fetches: the weights the last steps wrote
        t.move("ssd", "read weights", c * block)
        fetched[l] = t.op("ssd", c * block / r.ssd_read / GB, (0.0, ""))
    for g in order:  # the daemon reads each group's state ahead, as its buffers free up
        daemon.ask(g, 0.0)
    for l in range(L):
        weights(fetched.get(l, 0.0))
        for k in range(K):  # block 0's input is the embeddings' output, made here
            if again and k:
                again_up("weights, sub-blocks again", read=True)
            compute(fwd, [("x", l, k)] if l else [], [("x", l, k)] * (l == 0) + [("x", l + 1, k)],
                    ((acts.free, "activation downloads"),) if l in acts else (), ("a", l, k) if l in acts else None)
            if again and k:
                slots.append(t.free["gpu"])
            if l == L - 1:  # the tail: forward and the gradient of its input
                compute(tail, [], [("g", l, k)])
        slots.append(t.free["gpu"])
    for l in reversed(range(L)):
        source = 0.0
        if on_ssd and s.served:
            source = daemon.read.get(l, 0.0)  # (from the state read ahead: no second read)
        elif on_ssd and l < L - 1:  # (the last block is still in its slot)
            t.move("ssd", "read weights", c * block)
            source = t.op("ssd", c * block / r.ssd_read / GB, (0.0, ""))
        weights(source)
        t.op("gpu", 0.0, (grad_bufs.popleft(), "gradient download"))
        for j in (l, l - 1):  # spilled activations back one block ahead (this one's, if not yet)
            acts.read_ahead(j, last[0])
        for k in range(K):
            if again and k:
                again_up("weights, sub-blocks again", read=False)  # (the recomputation's: served)
            if evicted and l not in acts:
                weights(0.0, evicted, "weights, sub-blocks again")  # (backward's, after the recomputation)
            if cut and k:  # (each sub-block's sum so far, parked on the host, up again; down after)
                t.move("h2d", "gradient sums", s.grad_bytes * block)
                t.op("gpu", 0.0, (t.op("h2d", s.grad_bytes * block / r.pcie_h2d / GB, (0.0, "")), "gradient sums"))
            if l in acts:  # its activations up ahead, then backward alone (no kept input, no recomputation)
                up = acts.upload(("a", l, k), tuple(last))
                compute(bwd_only, [("g", l, k)], [("g", l - 1, k)], ((up, "activations upload"),))
            else:
                compute(bwd, [("x", l, k), ("g", l, k)], [("g", l - 1, k)])
            slots.extend([t.free["gpu"]] * ((again and k > 0) + (evicted > 0 and l not in acts)))
            if cut and k < K - 1:
                t.move("d2h", "gradient sums", s.grad_bytes * block)
                t.op("d2h", s.grad_bytes * block / r.pcie_d2h / GB, (t.free["gpu"], "compute"))
        slots.append(t.free["gpu"])
        t.move("d2h", "gradients", s.grad_bytes * block)
        t.op("gpu", 0.0, (host_grads.popleft(), "training thread: gradient host buffers (steps behind)"))
        grad_bufs.append(t.op("d2h", s.grad_bytes * block / r.pcie_d2h / GB, (t.free["gpu"], "compute")))
        host_grads.append(daemon.step(l, grad_bufs[-1]))
    for k in range(K):  # the tail again, for the head's and (from block 0's input gradient) embeddings' gradients
        compute(tail, [("x", L, k), ("g", -1, k)], [])
    t.move("d2h", "gradients", 4 * rest)
    end = daemon.step("rest", t.op("d2h", 4 * rest / r.pcie_d2h / GB, (t.free["gpu"], "compute")))
    t.move("h2d", "weights", c * rest)  # the new embeddings and head into the parameters
    end = t.op("h2d", c * rest / r.pcie_h2d / GB, (end, ""))
    io = state_io(shape, s)[0]
    step_s = io[0] / r.ssd_read / GB + io[1] / r.ssd_write / GB
    n = len(acts.blocks)
    backward = K * ((L - n) * bwd + n * bwd_only) / L  # (a block's, over the micro-batches: their mean)
    return {"micro_end": None, "end": max([end, t.free["gpu"], *daemon.ends]), "additions": 0,
            "block_step_over_backward": step_s / backward, "swapped_blocks": n}


def executed_flops(shape: ModelShape, s: Schedule) -> float:
    """Hardware FLOPs of one iteration: what the GPU executes (ModelShape.flops's count of
    each pass), recomputation included. Both schedules run each block's forward, again
    before its backward, and its backward (block-major's swapped blocks: not again); the
    tail's forward and backward, block-major's tail forward once more (its replay for the
    head's and embeddings' gradients)."""
    f = shape.flops(s.seq, s.micro)
    tail = f["tail_fwd"] * (2 if s.schedule == "block-major" else 1) + f["tail_bwd"]
    swapped = min(s.swapped, shape.layers) if s.schedule == "block-major" else 0
    return s.accum * (shape.layers * (2 * f["block_fwd"] + f["block_bwd"]) - swapped * f["block_fwd"] + tail)


def simulate(shape: ModelShape, s: Schedule, r: Rates) -> dict:
    """Where each second of one iteration goes, and the bytes on each link."""
    t = Timeline()
    res = (_loop if s.schedule == "loop" else _block_major)(shape, s, r, t)
    n = shape.active_params  # (a mixture of experts: those a token passes through)
    seconds, gpu_end = res["end"], t.free["gpu"]
    pcie = {k: v for k, v in t.bytes.items() if k.startswith(("h2d", "d2h"))}
    ssd = sum(v for k, v in t.bytes.items() if k.startswith("ssd"))
    out = {"params": shape.params, "active_params": n, "tokens": s.tokens, "iteration_seconds": seconds,
           "model_tflops": 6 * n * s.tokens / seconds / 1e12, "hardware_flops": executed_flops(shape, s),
           "hardware_tflops": executed_flops(shape, s) / seconds / 1e12, "gpu_busy": t.busy["gpu"] / seconds,
           "seconds": {"gpu compute": t.busy["gpu"],
                       **{f"gpu stalled: {k}": v for k, v in sorted(t.stalls.items()) if v > 0},
                       "step exposed": seconds - gpu_end},
           "busy": {k: v / seconds for k, v in t.busy.items()},
           "bytes": dict(sorted(t.bytes.items())),
           "pcie_bytes": sum(pcie.values()),
           "pcie_weights_and_gradients_bytes": sum(v for k, v in pcie.items()
                                                   if not k.endswith(("checkpoints", "activations"))),
           "activation_bytes": {"pcie": sum(v for k, v in pcie.items() if k.endswith("activations")),
                                "ssd": sum(v for k, v in t.bytes.items() if k.endswith(" activations")
                                           and k.startswith("ssd"))},
           "ssd_bytes": ssd, "ssd_bytes_per_param": ssd / n,
           # every byte over PCIe or to the SSD crosses host memory once; an addition 3 times; AdamW reads
           # gradient and state (16 B/param) and writes state and 16-bit weights (14)
           "host_memory_traffic_bytes": sum(pcie.values()) + ssd + t.bytes["host memory: additions"] + 30 * n,
           "host_additions": res["additions"], "exposed_step_seconds": seconds - gpu_end}
    if res["micro_end"] is not None:  # as bench/gpu.py measures: to the last micro-batch's return, then the step
        out["micro_batch_seconds"] = res["micro_end"] / s.accum
        out["step_seconds"] = seconds - res["micro_end"]
    else:
        out["block_step_over_backward"] = res["block_step_over_backward"]  # > 1: the steps fall behind
        out["swapped_blocks"] = res["swapped_blocks"]
    return out

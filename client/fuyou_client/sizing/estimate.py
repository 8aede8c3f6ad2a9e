"""One training configuration on one host, estimated: bytes per memory tier, SSD capacity
and traffic, and (with a GPU) the step's time and what binds it.

* **Pinned host memory** is the memory plan ``attach`` computes (memory_plan.plan) for
  these layer groups under the daemon's pinned budget: the same function, not a copy.
* **Other host memory**: the daemon's optimizer buffers (``[optimizer] buffer_budget``)
  and each process's own: measured on the reference host's CPU runs
  (bench/results/bigmodel-*-cpu.json, within 10%: tests/test_sizing.py).
* **SSD traffic per iteration**, by cause, as the daemon counts it: the blocks' weights
  read in forward (and backward, where the master handoff keeps the step's read short
  and backward reads the weights itself), the optimizer state read and written, the
  weights the steps write for blocks kept in a 16-bit dtype, and block-major's inputs and
  swapped activations spilled beyond their host arenas.
* **Swapped activations** (``swap_blocks``: blocks whose saved activations train_step
  swaps instead of recomputing them): the host arena ``host_budget`` is split as
  train_step splits it, half for the kept inputs, the rest for the swapped activations
  (``arenas``); a swapped block's input leaves the arena after its forward.
* **Time**: the discrete-event model (iteration.py) with the GPU's and host's rates, the
  GPU's in the model's compute dtype (``Settings.compute``: bf16 or fp16; its bytes are 2
  per element either way). Two rates of FLOPs: model TFLOPS (6 x parameters x tokens per
  second, the work the model needs; a mixture of experts' active parameters, those a
  token passes through) and hardware TFLOPS (what the GPU executed,
  recomputation included: iteration.executed_flops).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fuyou_client.device import cuda_reserve
from fuyou_client.memory import DevicePlan, Work, plan_device
from fuyou_client.memory import budget as memory_plan
from fuyou_client.memory.device_plan import SAVED_ACTIVATIONS
from fuyou_client.model.cuts import large_atoms, rest_sub_blocks
from fuyou_client.sizing.hardware import COMPUTE, GB, TORCH_DTYPE, GiB, Host
from fuyou_client.sizing.iteration import Rates, Schedule, simulate, state_bytes
from fuyou_client.sizing.kernels import GEMM_EDGE, HBM_EFFICIENCY, layout, widths
from fuyou_client.sizing.shape import ModelShape
from fuyou_client.sizing.swap_model import activation_bytes
from fuyou_proto.contract import stepped_in_chunks

# Each process's own memory beside the shared buffers, at the peak of a step, measured on
# the reference host's CPU runs (bench/results/bigmodel-gpt2-2b-cpu.json and
# bigmodel-llama7b-int8-cpu.json, peak_rss_together_parts): the daemon's interpreter and
# libraries (anonymous and file pages) beside its optimizer buffers; the training process's
# interpreter, torch and transformers, plus the fp32 gradient of its largest parameter made
# by autograd before it is copied to shared memory (the embeddings: vocab x width).
DAEMON_BASE = 200_000_000
CLIENT_BASE = 660_000_000
CUDA_CONTEXT = 1 << 30  # assumed: a CUDA process's runtime and libraries in host memory
VERSIONS_IN_FLIGHT = 3  # new state versions written before the old ones go: the largest group's, this many


@dataclass(frozen=True)
class Settings:
    """What a plan chooses: the attach options and the training loop's shape."""
    seq: int
    micro_batch: int = 1  # sequences per micro-batch
    micro_batches: int = 1  # per optimizer step (train_step's list, or accumulation_steps)
    schedule: str = "block-major"  # engine.train_step; "loop": the ordinary loop
    state_dtype: str = "fp32"
    offload: bool | str = True  # the blocks' weights: True on the SSD array, "host" in pinned memory
    prefetch: int | None = None  # None: the memory plan's
    host_budget: int | None = None  # the host arena; None: the memory plan's default
    activations: str = "recompute"
    granularity: str = "block"  # what comes to the GPU at a time: "block", "module" (model/cuts.py) or "expert"
    compute: str = "bf16"  # the model's dtype on a GPU (attach computes in it): "bf16" or "fp16"
    swap_blocks: int = 0  # block-major: blocks whose activations are swapped instead of recomputed

    def __post_init__(self):
        if self.compute not in COMPUTE:
            raise ValueError(f"compute dtype must be one of {', '.join(COMPUTE)} (the model's dtype on the GPU), "
                             f"not {self.compute!r}")
        if isinstance(self.swap_blocks, bool) or not isinstance(self.swap_blocks, int) or self.swap_blocks < 0:
            raise ValueError(f"swap_blocks must be an integer of at least 0, not {self.swap_blocks!r}")
        if self.swap_blocks and self.schedule != "block-major":
            raise ValueError("swap_blocks is engine.train_step's (block-major): the ordinary loop's activations are "
                             "its activations= treatments")

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch * self.micro_batches

    def model_dtype(self, host: Host) -> str:
        """The dtype the plan assumed the model is in: attach computes in the model's own
        (the CPU runs in fp32)."""
        return TORCH_DTYPE[self.compute] if host.gpu is not None else "torch.float32"

    def attach_options(self) -> dict:
        """The ``attach`` keyword arguments these settings stand for (the model's dtype is not
        one: ``model_dtype``)."""
        out = {"offload": self.offload, "activations": self.activations}
        if self.prefetch is not None:
            out["prefetch"] = self.prefetch
        if self.host_budget is not None:
            out["host_budget"] = self.host_budget
        if self.schedule == "loop" and self.micro_batches > 1:
            out["accumulation_steps"] = self.micro_batches
        if self.granularity != "block":
            out["granularity"] = self.granularity
        if self.swap_blocks:
            out["swap_blocks"] = self.swap_blocks
        return out


@dataclass
class Estimate:
    shape: ModelShape
    settings: Settings
    host: Host
    memory: dict  # tier -> bytes: gpu, pinned, other_host, host_total, ssd_capacity
    needs: dict  # resource -> bytes this needs, against ``has``
    has: dict
    ssd: dict  # cause -> bytes per iteration
    plan: memory_plan.MemoryPlan | None
    time: dict | None = None  # the iteration model's output (with a GPU)
    binds: str = ""
    utilisation: dict = field(default_factory=dict)
    assumptions: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(self.needs[k] <= self.has[k] for k in self.needs)

    @property
    def short(self) -> dict:
        """Each resource this does not fit: (needed, has)."""
        return {k: (self.needs[k], self.has[k]) for k in self.needs if self.needs[k] > self.has[k]}

    @property
    def ssd_bytes(self) -> float:
        return sum(self.ssd.values())

    @property
    def ssd_bytes_per_param(self) -> float:
        return self.ssd_bytes / self.shape.params

    @property
    def seconds(self) -> float | None:
        return self.time["iteration_seconds"] if self.time else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.settings.tokens / self.seconds if self.time else None

    @property
    def activations(self) -> dict:
        """The swapped activations of one step: how many blocks swap, the bytes over PCIe
        (down and up) and to and from the SSD array (what spills beyond their arena)."""
        c = _compute_bytes(self.host)
        return {"swapped_blocks": swapped(self.shape, self.settings), "of_blocks": self.shape.layers,
                "pcie_bytes": 2 * swapped_activations(self.shape, self.settings, c),
                "arena": arenas(self.settings, self.plan.host_budget, kept_inputs(self.shape, self.settings, c))[1]
                if self.plan else 0,
                "ssd_bytes": self.ssd["spilled activations written"] + self.ssd["spilled activations read"]}

    @property
    def written_per_step(self) -> float:
        return sum(v for k, v in self.ssd.items() if "written" in k)

    def to_dict(self) -> dict:
        s = self.settings
        return {"model": dataclasses.asdict(self.shape) | {"params": self.shape.params},
                "settings": dataclasses.asdict(s) | {"tokens_per_step": s.tokens},
                "attach_options": s.attach_options(), "model_dtype": s.model_dtype(self.host), "fits": self.fits,
                "memory_bytes": self.memory, "needs_bytes": self.needs, "has_bytes": self.has,
                "ssd_bytes_per_iteration": self.ssd, "ssd_bytes_per_param": self.ssd_bytes_per_param,
                "ssd_written_per_1000_steps_per_device": 1000 * self.written_per_step / self.host.disks.count,
                "iteration_seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
                "model_tflops": self.time["model_tflops"] if self.time else None,
                "hardware_tflops": self.time["hardware_tflops"] if self.time else None,
                "gpu_busy": self.time["gpu_busy"] if self.time else None,
                "balance_tokens_per_step": self.time["balance_tokens"] if self.time else None,
                "binds": self.binds, "utilisation": self.utilisation,
                "swapped_activations_per_step": self.activations,
                "seconds_by_cause": self.time["seconds"] if self.time else None,
                "memory_plan": str(self.plan) if self.plan else None, "assumptions": self.assumptions}


def _compute_bytes(host: Host) -> int:
    return 2 if host.gpu is not None else 4  # bf16 on a GPU; the CPU runs compute in fp32


def chunked(numel: int, s: Settings, host: Host) -> bool:
    """Whether the daemon steps a group of ``numel`` parameters in chunks (its state and
    weights do not fit one optimizer buffer)."""
    return stepped_in_chunks(state_bytes(s.state_dtype, numel), numel, host.buffer_budget, host.buffers)


def cut_atoms(shape: ModelShape, s: Settings) -> tuple:
    """A block's atoms as ``s.granularity`` cuts it: its modules ("module"), with its fused
    experts in parts ("expert"); () for whole blocks or where they are unknown."""
    if s.granularity == "expert":
        return shape.expert_atoms or shape.block_atoms
    return shape.block_atoms if s.granularity == "module" else ()


def groups(shape: ModelShape, s: Settings, host: Host) -> list[memory_plan.GroupShape]:
    """The layer groups attach would plan (engine/build.py group_shapes), from the shape
    alone: one per block and the rest, or with ``granularity="module"`` each block's own
    group and sub-blocks, and the rest's (model/cuts.py, by the same rule)."""
    c = _compute_bytes(host)
    offload = s.offload if host.gpu is not None or s.offload is True else False  # ("host" on the CPU: resident)
    keeps = s.schedule == "loop" and s.micro_batches > 1  # gradients kept until the step
    # (kept until the step: on a GPU summed on the host, as the iteration model's loop does; else resident)
    strategy = ("host" if host.gpu is not None else "resident") if keeps else "pooled" if offload else "resident"

    def group(name: str, numel: int, off, kind: str) -> memory_plan.GroupShape:
        return memory_plan.GroupShape(name, numel, c, chunked=chunked(numel, s, host), offload=off, strategy=kind,
                                      held=bool(off) and cut and "." not in name and name != "rest",
                                      unit=name.split(".")[0] if cut and "." in name else "")
    cut = s.granularity != "block" and bool(offload) and bool(cut_atoms(shape, s))
    if not cut:
        blocks = [[("", shape.block_params)]]
        rest = [group("rest", shape.rest_params, False, "resident")]
    else:
        sizes = [n for n, _ in cut_atoms(shape, s)]
        large = large_atoms(sizes)
        blocks = [[("", sum(n for i, n in enumerate(sizes) if i not in large))]
                  + [(f".m{k}", sizes[i]) for k, i in enumerate(large, 1)]]
        subs = rest_sub_blocks(list(shape.rest_atoms))
        cut_out = {i for sub in subs for i in sub}
        rest = [group(f"rest.m{k}", sum(shape.rest_atoms[i][0] for i in sub), offload, strategy)
                for k, sub in enumerate(subs, 1)]
        rest.append(group("rest", sum(n for i, (n, _) in enumerate(shape.rest_atoms) if i not in cut_out), False,
                          "resident"))
    out = [group(f"block{i:04d}{suffix}", n, offload, strategy) for i in range(shape.layers) for suffix, n in blocks[0]]
    return out + [g for g in rest if g.numel]


def swapped(shape: ModelShape, s: Settings) -> int:
    """How many blocks swap their activations (block-major only)."""
    return min(s.swap_blocks, shape.layers) if s.schedule == "block-major" else 0


def kept_inputs(shape: ModelShape, s: Settings, c: int) -> int:
    """Block-major's kept entries for one step, as block_store.Plan counts them: each
    block's input, the last block's output and the tail's input gradient, per micro-batch;
    a swapped block's input leaves after its forward (not counted)."""
    if s.schedule != "block-major":
        return 0
    return (shape.layers - swapped(shape, s) + 2) * s.micro_batches * s.micro_batch * s.seq * shape.width * c


def swapped_activations(shape: ModelShape, s: Settings, c: int) -> int:
    """The swapped blocks' activations of one step (each goes down once and up once)."""
    return swapped(shape, s) * s.micro_batches * activation_bytes(shape, s.micro_batch * s.seq, c)


def arenas(s: Settings, host_budget: int, kept: int) -> tuple[int, int]:
    """The host arena's bytes for (kept inputs, swapped activations), as train_step splits
    ``host_budget``: all of it for the inputs without swapped blocks; else what the step's
    ``kept`` inputs take, at most half, and the rest for the activations."""
    if not s.swap_blocks:
        return host_budget, 0
    inputs = min(kept, host_budget // 2)
    return inputs, host_budget - inputs


def ssd_traffic(shape: ModelShape, s: Settings, host: Host, handoff: bool, arena: int, slots: int = 2) -> dict:
    """Bytes the SSD array moves per iteration, by cause (as the daemon counts them).
    ``slots``: the memory plan's weight slots (a block released keeps its weights in its slot
    until a fetch takes it: offload/offloader.py, so backward starts with the last blocks
    forward used, and the next micro-batch of an accumulation with the first ones)."""
    c, n, L = _compute_bytes(host), shape.block_params, shape.layers
    on_ssd = s.offload is True
    in_chunks = chunked(n, s, host)
    hands = on_ssd and handoff and c == 4 and in_chunks  # (memory_plan's handoff: chunked fp32 blocks)
    k = s.micro_batches if s.schedule == "loop" else 1
    block_state, rest_state = state_bytes(s.state_dtype, n), state_bytes(s.state_dtype, shape.rest_params)
    inputs_arena, acts_arena = arenas(s, arena, kept_inputs(shape, s, c))
    spill = max(0, kept_inputs(shape, s, c) - inputs_arena)
    acts_spill = max(0, swapped_activations(shape, s, c) - acts_arena)
    rest_read = 0
    if s.granularity != "block" and on_ssd:
        # a block's large modules (or expert parts) one by one; where the slots do not hold a whole
        # block's, train_step reads them again for each micro-batch's forward (backward's come from the
        # state read-ahead)
        atoms = cut_atoms(shape, s)
        parts = len(large_atoms([a for a, _ in atoms])) if atoms else 1
        again = s.micro_batches if s.schedule == "block-major" and slots < parts + 2 else k
        forward, backward = L * n * c * again, 0
        # the rest's sub-blocks, once each; the embeddings' again for a tied head (used at both ends)
        subs = rest_sub_blocks(list(shape.rest_atoms))
        tied = shape.vocab * shape.width * 2 > shape.rest_params  # (one vocabulary-sized matrix: the head is tied)
        rest_read = sum(shape.rest_atoms[i][0] * (2 if tied and shape.rest_atoms[i][1] else 1)
                        for sub in subs for i in sub) * c * k
    else:
        # backward's fetches: a plain read with the handoff, or where the block's state does not fit
        # an optimizer buffer (the daemon then holds what masters it can: counted as read here, an
        # upper bound); else served from the step's read-ahead of the state (the last micro-batch
        # of the loop; every block of block-major). Blocks still in their slots are read by neither.
        reused_backward = min(L - 1, max(0, slots - 1))
        reused_forward = min(L, slots)  # (from the second micro-batch of the loop's accumulation on)
        forward = (L * k - (k - 1) * reused_forward) * n * c if on_ssd else 0
        backward = (L - 1 - reused_backward) * n * c * ((k - 1) + (hands or in_chunks)) if on_ssd else 0
    return {"forward weights read": forward,
            "backward weights read": backward,
            "rest's weights read": rest_read,
            "optimizer state read": L * (block_state - 4 * n * hands) + rest_state,
            "optimizer state written": L * block_state + rest_state,
            "weights written by the steps": L * n * c if on_ssd and c != 4 else 0,
            "spilled inputs written": spill, "spilled inputs read": spill,
            "spilled activations written": acts_spill, "spilled activations read": acts_spill}


def rates(host: Host, compute: str = "bf16") -> Rates:
    """The iteration model's rates for this host, its GPU computing in ``compute``."""
    g = host.gpu
    k = g.kernels_for(compute)
    return Rates(gpu=k, precision=compute, ssd_read=host.disks.read_gbps, ssd_write=host.disks.write_gbps,
                 pcie_h2d=g.pcie_h2d.value, pcie_d2h=g.pcie_d2h.value, host_add=host.host_add.value,
                 adam=host.adam_rate, hbm=k.hbm / GB)


def estimate(shape: ModelShape, s: Settings, host: Host, simulate_time: bool = True) -> Estimate:
    c = _compute_bytes(host)
    limits = memory_plan.Limits(session_budget=host.pinned, optimizer_buffer_budget=host.buffer_budget,
                                optimizer_buffers=host.buffers, segment=host.segment)
    wanted = memory_plan.Wanted(s.prefetch, 0, s.host_budget, arena=True, swaps=s.activations == "swap",
                                shares_host_memory=host.gpu is None)
    shapes = groups(shape, s, host)
    try:
        plan = memory_plan.plan(shapes, limits, wanted)
    except memory_plan.DoesNotFit as exc:
        plan = exc.smallest
    device = device_plan(shape, s, host, shapes, plan)
    inputs_arena, acts_arena = arenas(s, plan.host_budget, kept_inputs(shape, s, c))
    arena_used = min(inputs_arena, kept_inputs(shape, s, c)) + min(acts_arena, swapped_activations(shape, s, c))
    pinned = plan.training - (plan.host_budget - arena_used)  # (an arena's untouched pages are not resident)
    daemon = DAEMON_BASE + host.buffer_budget
    client = CLIENT_BASE + 4 * shape.vocab * shape.width + (CUDA_CONTEXT if host.gpu else 0)
    ssd = ssd_traffic(shape, s, host, plan.handoff, plan.host_budget, plan.weight_slots)
    block_state = state_bytes(s.state_dtype, shape.block_params)
    stored = shape.layers * state_bytes(s.state_dtype, shape.block_params) + \
        state_bytes(s.state_dtype, shape.rest_params) + ssd["weights written by the steps"]
    capacity = {"state and weights": stored, "new versions in flight": VERSIONS_IN_FLIGHT * block_state,
                "spilled inputs": ssd["spilled inputs written"], "spilled activations": ssd["spilled activations written"]}
    memory = {"gpu": device.total(s.micro_batch * s.seq) if host.gpu else 0,
              "gpu_plan": str(device) if device else None,
              "pinned": pinned, "pinned_plan": plan.total, "daemon_own": daemon, "client_own": client,
              "host_total": pinned + daemon + client, "ssd_capacity": sum(capacity.values()),
              # a checkpoint on the array (engine.save_checkpoint, fuyouctl checkpoint): a copy of the
              # state and weights beside them; not needed to train (a snapshot shares extents, a copy
              # may go to another disk), so shown beside the fit, not in it
              "ssd_capacity_with_checkpoint": sum(capacity.values()) + stored,
              "ssd_capacity_parts": capacity}
    needs = {"pinned budget": plan.total, "host memory": memory["host_total"],
             "SSD capacity": memory["ssd_capacity"]}
    has = {"pinned budget": host.pinned, "host memory": int(0.9 * host.memory),
           "SSD capacity": int(0.95 * host.disks.count * host.disks.capacity)}
    if host.gpu is not None:
        needs["GPU memory"] = memory["gpu"]
        has["GPU memory"] = int(host.gpu.memory - cuda_reserve(host.gpu.memory))
    est = Estimate(shape, s, host, memory, needs, has, ssd, plan)
    est.assumptions = _assumptions(host, s.compute, shape)
    if host.gpu is not None and simulate_time:
        _time(est, host)
    return est


def device_plan(shape: ModelShape, s: Settings, host: Host, shapes: list, plan) -> DevicePlan | None:
    """The GPU's plan for these groups and this pinned plan: attach's own rules
    (memory/device_plan.py), the budget checked by the caller."""
    if host.gpu is None:
        return None
    work = Work(shape.width, shape.vocab, shape.layers, _compute_bytes(host), schedule=s.schedule,
                recompute=s.activations == "recompute", layout=layout(shape), mlp=widths(shape)[2])
    return plan_device(shapes, plan, work, None, granularity=s.granularity)


def _schedule(shape: ModelShape, s: Settings, host: Host, plan=None) -> Schedule:
    """The iteration model's settings for these: the memory plan's slots and gradient
    buffers where given; gradients on the GPU in the compute dtype (the parameters')."""
    weights = "ssd" if s.offload is True else "host" if s.offload == "host" else "resident"
    c = _compute_bytes(host)
    atoms = cut_atoms(shape, s) if s.offload else ()
    parts = len(large_atoms([n for n, _ in atoms])) if atoms else 0
    largest = max((n for n, _ in atoms), default=shape.block_params) if parts else shape.block_params
    extra = {} if plan is None else {"slots": plan.weight_slots, "grad_buffers": max(1, plan.device_grad_buffers)}
    if plan is not None:
        extra["swap_arena"] = arenas(s, plan.host_budget, kept_inputs(shape, s, c))[1]
    return Schedule(schedule=s.schedule, seq=s.seq, micro=s.micro_batch, accum=s.micro_batches, weights=weights,
                    state_dtype=s.state_dtype, compute_bytes=c, grad_bytes=c, parts=parts,
                    prefetch=s.prefetch if s.prefetch is not None else 2, served=not chunked(largest, s, host),
                    swapped=swapped(shape, s), **extra)


def _time(est: Estimate, host: Host) -> None:
    r = rates(host, est.settings.compute)
    t = simulate(est.shape, _schedule(est.shape, est.settings, host, est.plan), r)
    spill = est.ssd["spilled inputs written"]  # (the event model's arena is unbounded: add what spills)
    if spill:
        extra = spill / r.ssd_write / GB + spill / r.ssd_read / GB
        t["seconds"]["SSD: spilled inputs"] = extra
        t["iteration_seconds"] += extra
        t["model_tflops"] = 6 * est.shape.active_params * est.settings.tokens / t["iteration_seconds"] / 1e12
        t["hardware_tflops"] = t["hardware_flops"] / t["iteration_seconds"] / 1e12
        t["gpu_busy"] = t["seconds"]["gpu compute"] / t["iteration_seconds"]
    seconds = t["iteration_seconds"]
    ssd_seconds = sum(v for k, v in est.ssd.items() if "read" in k) / r.ssd_read / GB + \
        sum(v for k, v in est.ssd.items() if "written" in k) / r.ssd_write / GB
    use = {"GPU": t["gpu_busy"], "SSD": ssd_seconds / seconds,
           "PCIe": max(t["busy"].get("h2d", 0), t["busy"].get("d2h", 0)),
           "CPU optimizer": t["busy"].get("adam", 0),
           "host memory bandwidth": t["host_memory_traffic_bytes"] / seconds / GB / host.host_add.value}
    # the tokens per step at which the GPU's compute lasts as long as the SSD array's part
    # of a step (below it the SSD binds whatever the GPU); the inputs and activations spilled
    # beyond their arenas grow with the tokens, as the compute does (none: never)
    spilled = sum(v for k, v in est.ssd.items() if k.startswith("spilled") and "read" in k) / r.ssd_read / GB + \
        sum(v for k, v in est.ssd.items() if k.startswith("spilled") and "written" in k) / r.ssd_write / GB
    room = t["seconds"]["gpu compute"] - spilled
    t["balance_tokens"] = (ssd_seconds - spilled) * est.settings.tokens / room if room > 0 else None
    est.time, est.utilisation = t, use
    est.binds = max(use, key=use.get)


def _assumptions(host: Host, compute: str = "bf16", shape: ModelShape | None = None) -> list[str]:
    out = []
    if host.gpu is not None:
        g = host.gpu
        fam = layout(shape) if shape is not None else "gpt2"
        a, b = SAVED_ACTIVATIONS[fam]
        gemms = g.gemms(compute)
        out += [f"GPU {gemms.peak_tflops:g} dense {compute} TFLOPS, {g.hbm:,.0f} GB/s memory: {gemms.source}"
                + ("" if compute == "bf16" else f"; memory: {g.source}"),
                f"GPU GEMMs: {gemms.efficiency.value:.1%} of the peak when wide: {gemms.efficiency.source}; "
                f"an M x N x K one runs at 1 / (1 + E/K + E^2/(M N)) of that, E = {GEMM_EDGE:,.0f} fitted on the "
                f"recorded in-GPU runs (bench/kernel_fit.py)",
                f"GPU attention {g.attention_efficiency.value:.0%} of the peak (SDPA flash, causal): "
                f"{g.attention_efficiency.source}",
                f"GPU memory-bound kernels at {HBM_EFFICIENCY:.0%} of the bandwidth, assumed; their bytes counted on "
                f"the operators torch runs for a GPT-2- or Llama-style block in bf16 (bench/kernel_counts.py)"
                + ("" if compute == "bf16" else f"; {compute} moves the same bytes"),
                f"GPU launch at least {g.launch_s.value * 1e6:.0f} us a kernel: {g.launch_s.source}",
                f"PCIe {g.pcie_h2d.value:g} GB/s: {g.pcie_h2d.source}",
                f"GPU memory: attach's device plan (memory/device_plan.py), {cuda_reserve(g.memory) / GiB:.1f} GiB "
                "kept for CUDA (512 MiB + 5%, assumed); a block's activations what autograd saves for its backward, "
                f"{a:g} x width + {b:g} x MLP bytes per token at 16 bits ({fam}-style block, counted by "
                "bench/kernel_counts.py), the tail's logits 10 bytes per token and vocabulary entry",
                f"host memory of a CUDA process: {CUDA_CONTEXT / GiB:.0f} GiB assumed",
                "swapped activations: those bytes, down as autograd saves them and up while the backward before frees its own, within one "
                "block's activations on the GPU (assumed: streamed, a micro-batch the longer of its compute and its "
                "transfer); beyond what the kept inputs leave of host_budget to the SSD array"]
    d = host.disks
    out += [f"SSD {d.read.value:.3g} GB/s read each: {d.read.source}", f"SSD {d.write.value:.3g} GB/s write each: "
            f"{d.write.source}", f"AdamW {host.adam_rate:.3g} params/s: {host.adam.source}",
            f"host fp32 add {host.host_add.value:g} GB/s: {host.host_add.source}"]
    return out

"""Training on a GPU whose memory is capped: Fuyou, two in-GPU ceilings and ZeRO-Infinity, one run.

    python bench/gpu.py --json PATH [--cap 4GiB] [--width 2048] [--seq 1024] [--schedule block-major|loop]
                        [--micro N] [--accum N] [--weights resident|host|ssd] [--grads host|device]
                        [--cases ceiling,inmem,fuyou,zero] [--iters 2] [--zero-params cpu|nvme] [--zero-accum 4]
                        [--zero-micro N] [--host-budget 9GiB] [--dir DIR] [--no-zero] [--deadline S]
                        [--profile DIR] [--ssd-probe 4GiB] [--probe-bytes 1GiB] [--cpu] [--swap-blocks N]

One model family: Hugging Face ``GPT2LMHeadModel`` (width ``--width``, 128-wide heads, vocabulary
8192, untied head, sequence ``--seq``, dropout off, random tokens), bf16 compute, fp32 AdamW state.
Fuyou's model is the smallest depth whose weights + gradients + AdamW state (2 + 2 + 12 bytes per
parameter) are at least 4x ``--cap``. A step is ``--micro`` x ``--accum`` sequences for every case
(block-major's defaults 16 x 32, the loop's 2 x 256: 524,288 tokens at sequence 1024). Every case is
its own process; the capped ones set ``torch.cuda.set_per_process_memory_fraction`` to ``--cap``:

* **fuyou** (capped) on a private fuyoud whose shared memory (``--host-budget``, plus the
  block-major arena) and optimizer buffers (``--buffer-budget``) are well below the state: the fp32
  masters and moments live on SSD. ``--weights``: the blocks' bf16 weights on the GPU
  (``resident``: ``offload=False``, the default), in shared host memory uploaded per use
  (``host``: ``offload="host"``) or on SSD fetched per use (``ssd``: ``offload=True``).
  ``--schedule block-major`` (the default): ``attach(accumulation_steps=1, host_budget=arena)`` and
  one ``engine.train_step(micro_batches, loss_fn)`` per step over ``--accum`` micro-batches (each
  block forward over every micro-batch before the next block; backward block by block, each
  block's forward recomputed from its input per micro-batch, its gradient summed on the GPU, sent
  down once and stepped at once; the barrier at the end). The arena keeps each block's input and
  gradient per micro-batch in pinned host memory: (blocks + 2) x micro-batches x one hidden state
  (46 GiB at 21 blocks, 16 x 1024 tokens of width 2048, 32 micro-batches; the JSON's
  ``fuyou_info.arena_bytes``). ``--schedule loop``: the ordinary loop, ``attach(accumulation_steps=
  --accum, activations="recompute", grad_accumulation=--grads)`` (``--activations auto``: the
  planner's choice per block within ``--act-device-budget`` and ``--act-host-budget``), then
  ``engine.step()``. Before the rounds it fits its micro-batch: one forward and backward of
  ``--micro`` sequences (block-major: a train_step of two micro-batches) within 90% of the cap,
  halving the micro-batch (and doubling the micro-batches per step) on running out of memory.
* **ceiling** (capped): the largest depth of the family that trains entirely in the capped GPU
  memory with ``torch.optim.AdamW(fused=True)`` (fp32 parameters, ``torch.autocast`` bf16), and at
  that depth the fastest micro-batch of 1, 2, 4 ... ``--ceiling-micro-max`` sequences, without or
  with activation checkpointing, that fits 90% of the cap (the fastest of 3 micro-batches); as many
  micro-batches a step as keep the step's tokens. Out of memory in the run: the search again
  without that configuration.
* **inmem** (not capped): Fuyou's model, micro-batch and micro-batches per step (as fitted) with
  ``AdamW(fused=True)``, fp32 parameters, bf16 autocast and activation checkpointing (each block
  recomputed, as Fuyou does): the same work with no transfers at all (17.5 GB of state at 1.09B
  parameters fits an 80 GB GPU). Its ratio is ``fuyou_over_inmem_same_model``.
* **zero** (capped): DeepSpeed ZeRO-3 on Fuyou's model, bf16, activation checkpointing, the
  optimizer on NVMe, parameters in pinned CPU memory (``--zero-params nvme``: on NVMe, without
  prefetch; see gpu_zero.py for the configuration and what the NVMe variant costs). It runs
  ``--zero-accum`` micro-batches of ``--zero-micro`` (default min(--micro, 8)) per step, halving
  the micro-batch in a new process if its probe runs out of memory; its time per micro-batch and
  per step are measured apart and its throughput at the run's tokens per step is computed from
  them (``zero_infinity_tflops``; as run: ``zero_infinity_tflops_as_run``).

The cases run interleaved, one iteration (a step) of each per round after one warm-up round. In
each round the run itself also measures, in its own process (gpu_probes.py): the SSD's bare read
and write bandwidth (fuyoud's engine on a ``--ssd-probe`` file, 1 MiB requests, depth 32); PCIe
each way (one ``--probe-bytes`` copy between pinned host memory and the GPU, CUDA events, median
of 5); the host's fp32 add rate (``add_`` on two ``--probe-bytes`` fp32 tensors, 3 x bytes per add,
median of 5). Model TFLOPS = 6 x parameters x tokens / seconds. Hardware TFLOPS = FLOPs per token
x tokens / seconds, the FLOPs per token counted by ``torch.utils.flop_counter.FlopCounterMode``
around one real micro-batch of the warm-up round (its last; block-major: the whole warm-up
train_step, whose forward runs in a thread per micro-batch, counted on every thread with
FlopCounterMode's formulas; ZeRO-Infinity: those formulas without its module hooks). Counted:
matrix products and attention as the kernels ran them, recompute and block-major's replay of the
head included (causal attention counted whole); not counted: embedding lookups, element-wise
work, the optimizers. GPU busy fraction = the mean of NVML's utilisation (share of time a kernel
ran) sampled every 50 ms during the timed iterations. Medians over the timed rounds.

The JSON: per case ``results.<case>`` (tokens/s, TFLOPS and hardware TFLOPS with each round's
figure, FLOPs per token both ways, micro-batch and step seconds where separable, busy, peak
memory) and ``<case>_info`` (what ran: depth, micro-batch, fallbacks, the search, the config);
headline keys ``fuyou_tflops``, ``fuyou_hw_tflops``, ``inmem_ceiling_tflops``,
``inmem_ceiling_hw_tflops``, ``inmem_same_model_tflops`` (and ``_rounds``),
``inmem_same_model_hw_tflops``, ``zero_infinity_tflops``, ``zero_infinity_hw_tflops``,
``fuyou_over_ceiling``, ``fuyou_over_inmem_same_model``, ``fuyou_over_zero_infinity``,
``targets_met``, ``gpu_busy_fraction``, ``ssd_read_GBps``, ``ssd_write_GBps``, ``pcie_h2d_GBps``,
``pcie_d2h_GBps``, ``host_add_GBps``; each null one's reason in ``why_null``.

``--profile DIR``: after the rounds, one more step of fuyou, inmem and the ceiling under
torch.profiler (loop: the last 3 micro-batches and the step; block-major: the whole train_step):
traces, operator tables, kernel-busy share and longest gaps from the trace. ``--cpu``: the same
run on the CPU, Fuyou through the tests' stand-in for a device with its own memory, no cap, no
PCIe, no ZeRO-Infinity unless ``--cases`` names it (the test gives it a stand-in for DeepSpeed that
checks the calls): a smoke test of the run itself (tests/test_gpu_bench.py), whose numbers mean
nothing except the host add rate.

(Past ~500 lines on purpose: this description is a sixth of it; the rest is the run alone,
its options, the interleaved rounds and the report; the cases are in gpu_cases.py,
gpu_inmem.py and gpu_zero.py, their worker in gpu_worker.py, the probes in gpu_probes.py.)
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_cases import PROFILED, REPO, VOCAB, GiB  # noqa: E402 (the workers' side: gpu_worker.py and its cases)

from fuyoud.units import parse_size  # noqa: E402

STATE_BYTES_PER_PARAM = 16  # bf16 weights + bf16 gradients + fp32 masters, exp_avg, exp_avg_sq
TARGET_CEILING, TARGET_ZERO = 0.8, 3.0
CASES = ("ceiling", "inmem", "fuyou", "zero")
KEYS = {"ceiling": "inmem_ceiling", "inmem": "inmem_same_model", "fuyou": "fuyou", "zero": "zero_infinity"}
DEFAULTS = {"block-major": (16, 32), "loop": (2, 256)}  # (--micro, --accum)


def params_of(width: int, layers: int, seq: int) -> int:
    """GPT-2's parameter count (head not tied: DeepSpeed's NVMe prefetch trips over a tied
    one): blocks, token and position embeddings, head, final norm."""
    block = 12 * width * width + 13 * width
    return layers * block + (2 * VOCAB + seq) * width + 2 * width


def fuyou_depth(width: int, seq: int, cap: int) -> int:
    layers = 1
    while params_of(width, layers, seq) * STATE_BYTES_PER_PARAM < 4 * cap:
        layers += 1
    return layers


def arena_bytes(layers: int, micro: int, accum: int, seq: int, width: int, swap: int = 0) -> int:
    """train_step's host arena, large enough that nothing spills to the SSD array: (blocks + 2)
    x micro-batches slots of one bf16 hidden state, 4 KiB aligned (block_store.Store.reserve;
    beyond a smaller budget the inputs spill); the most that any micro-batch Fuyou's fit may
    halve to needs (fuyoud's pinned budget is set before the fit). With ``swap`` blocks
    swapping their activations (``attach(swap_blocks=)``): their inputs are not kept, and
    their activations (what the planner assumes an HF GPT-2 block saves:
    memory/device_plan.activation_bytes) take what the kept inputs leave, the inputs
    at most half (train_step's split); beyond it they go through the SSD array (counted)."""
    need, tokens = 0, micro * accum * seq
    while True:
        slot = -(-micro * seq * width * 2 // 4096) * 4096
        need = max(need, slot * (layers - swap + 2) * accum)
        if micro == 1:
            break
        micro, accum = micro // 2, accum * 2
    if not swap:
        return need
    from fuyou_client.memory.device_plan import activation_bytes
    acts = swap * tokens * activation_bytes("gpt2", width, 4 * width, 2)
    return max(need + acts, 2 * need)


# -- the run: workers side by side, interleaved rounds ------------------------------------------

class Worker:
    def __init__(self, name: str, spec: dict, log: Path):
        self.name, self.spec, self.log, self.started = name, spec, log, time.perf_counter()
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")  # (every case alike)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", name,
                                      "--spec", json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "w"), text=True, cwd=REPO, env=env)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        tail = self.log.read_text()[-3000:]
        raise RuntimeError(f"{self.name} worker exited ({self.proc.wait()}):\n{tail}")

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def ready(w: Worker, work: Path, fallbacks: list) -> tuple[Worker, dict]:
    """The worker's ready reply; a ZeRO-Infinity worker whose probe ran out of memory is
    started again with half the micro-batch and twice the micro-batches per step."""
    attempt = 1
    while True:
        info = w.read()
        if info.get("ready"):
            return w, info
        w.close()
        spec = w.spec
        if spec["zero_micro"] == 1:
            raise RuntimeError(f"{w.name}: one sequence does not fit: {info}")
        fallbacks.append({"micro": spec["zero_micro"], "error": info.get("micro_too_large")})
        attempt += 1
        w = Worker(w.name, dict(spec, zero_micro=spec["zero_micro"] // 2, zero_accum=spec["zero_accum"] * 2),
                   work / f"{w.name}-{attempt}.log")


def tflops(params: int, tokens: int, seconds: float) -> float:
    return 6 * params * tokens / seconds / 1e12


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="where to write the results (required)")
    ap.add_argument("--cap", default="4GiB", type=parse_size, help="GPU memory per capped case (default 4GiB)")
    ap.add_argument("--width", default=2048, type=int)
    ap.add_argument("--seq", default=1024, type=int)
    ap.add_argument("--schedule", default="block-major", choices=list(DEFAULTS),
                    help="Fuyou's schedule: one engine.train_step over the step's micro-batches (default), or the "
                         "ordinary loop of forward and backward per micro-batch and engine.step()")
    ap.add_argument("--micro", type=int, help="sequences per micro-batch (default 16 block-major, 2 loop)")
    ap.add_argument("--accum", type=int, help="micro-batches per step (default 32 block-major, 256 loop)")
    ap.add_argument("--ceiling-micro-max", default=32, type=int,
                    help="the largest micro-batch the capped ceiling's search tries (default 32)")
    ap.add_argument("--cases", help=f"which cases run (default {','.join(CASES)}; with --cpu all but zero)")
    ap.add_argument("--zero-params", default="cpu", choices=["cpu", "nvme"],
                    help="ZeRO-Infinity's parameters: pinned CPU memory (default) or NVMe (prefetch off, see "
                         "gpu_zero.py)")
    ap.add_argument("--zero-prefetch", type=int,
                    help="ZeRO's stage3_prefetch_bucket_size (default: one block on cpu, 0 on nvme)")
    ap.add_argument("--zero-accum", default=4, type=int, help="micro-batches per ZeRO-Infinity step (default 4)")
    ap.add_argument("--zero-micro", default=0, type=int,
                    help="sequences per ZeRO-Infinity micro-batch (default min(--micro, 8); halved on running out)")
    ap.add_argument("--iters", default=2, type=int, help="timed rounds after one warm-up round (default 2)")
    ap.add_argument("--host-budget", default="9GiB", type=parse_size,
                    help="fuyoud's pinned_budget besides the block-major arena (default 9GiB)")
    ap.add_argument("--buffer-budget", default="2560MiB", type=parse_size,
                    help="fuyoud's optimizer buffer_budget, three buffers (default 2560MiB)")
    ap.add_argument("--weights", default="resident", choices=["resident", "host", "ssd"],
                    help="Fuyou's blocks' weights: on the GPU (offload=False, the default), in host memory uploaded "
                         "per use (offload=\"host\") or on SSD fetched per use (offload=True)")
    ap.add_argument("--grads", default="host", choices=["host", "device"],
                    help="Fuyou's grad_accumulation (default host)")
    ap.add_argument("--activations", default="recompute", choices=["recompute", "auto"],
                    help="--schedule loop: every block recomputed in backward (default), or the planner's choice "
                         "per block of keep, swap (host arena, then SSD) or recompute, within the two budgets below")
    ap.add_argument("--swap-blocks", default=0, type=int, metavar="N",
                    help="--schedule block-major: N blocks (spread evenly) swap their activations to pinned host "
                         "memory instead of being recomputed (attach(swap_blocks=N)); the arena grows by their "
                         "activations (default 0: every block recomputed)")
    ap.add_argument("--act-device-budget", default="1GiB", type=parse_size,
                    help="loop with --activations auto: activation bytes on the GPU (default 1GiB)")
    ap.add_argument("--act-host-budget", default="1GiB", type=parse_size,
                    help="loop with --activations auto: the host arena for swapped activations (default 1GiB)")
    ap.add_argument("--dir", type=Path, help="parent of the work directory (default <repo>/.fuyou/bench)")
    ap.add_argument("--no-zero", action="store_true", help="skip ZeRO-Infinity")
    ap.add_argument("--deadline", default=0, type=float, help="stop starting rounds after this many seconds")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help=f"after the rounds, one more step of fuyou, inmem and the ceiling under torch.profiler "
                         f"(loop: the last {PROFILED} micro-batches and the step; block-major: the whole train_step): "
                         "gzipped Chrome traces, operator tables and the GPU's busy share from the trace, into DIR")
    ap.add_argument("--ssd-probe", default="4GiB", type=parse_size,
                    help="file size of the bare SSD bandwidth measurement in each round (default 4GiB)")
    ap.add_argument("--probe-bytes", default="1GiB", type=parse_size,
                    help="size of the PCIe copies and of the host add's operands in each round (default 1GiB)")
    ap.add_argument("--cpu", action="store_true",
                    help="a smoke test of the run itself on the CPU (Fuyou through the tests' stand-in for a "
                         "device with its own memory; no cap, no PCIe, ZeRO-Infinity only if --cases names it): its "
                         "numbers mean nothing")
    ap.add_argument("--cpu-oom-above", default=0, type=int, metavar="N",
                    help="with --cpu: a capped case's micro-batches of more than N sequences raise OutOfMemoryError "
                         "as if over the cap (the smoke test's way through the fits' and searches' fallbacks)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    if args.json is None:
        ap.error("--json is required")
    named = args.cases is not None
    args.cases = [c for c in (args.cases or ",".join(CASES)).split(",") if c]
    if set(args.cases) - set(CASES):
        ap.error(f"--cases: unknown {sorted(set(args.cases) - set(CASES))}; known: {','.join(CASES)}")
    if args.no_zero or (args.cpu and not named):  # (--cpu: zero only when named; it needs a DeepSpeed that runs there)
        args.cases = [c for c in args.cases if c != "zero"]
    if args.schedule == "block-major" and args.activations == "auto":
        ap.error("--activations auto applies to --schedule loop (train_step recomputes every block)")
    if args.swap_blocks and args.schedule != "block-major":
        ap.error("--swap-blocks is engine.train_step's (--schedule block-major)")
    if not 0 <= args.swap_blocks <= (layers := fuyou_depth(args.width, args.seq, args.cap)):
        ap.error(f"--swap-blocks must be 0 to the model's {layers} blocks, not {args.swap_blocks}")
    micro, accum = DEFAULTS[args.schedule]
    args.micro, args.accum = args.micro or micro, args.accum or accum
    args.zero_micro = args.zero_micro or min(args.micro, 8)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        from gpu_worker import worker
        worker(args.worker, json.loads(args.spec))
        return 0
    from common import BareLoop, host_info
    from gpu_probes import Probes

    started = time.perf_counter()
    work = (args.dir or REPO / ".fuyou" / "bench").resolve() / f"gpu-{os.getpid()}"
    work.mkdir(parents=True)
    layers = fuyou_depth(args.width, args.seq, args.cap)
    params = params_of(args.width, layers, args.seq)
    ceiling_max = max(1, max((L for L in range(1, layers) if params_of(args.width, L, args.seq) * STATE_BYTES_PER_PARAM <= args.cap),
                             default=1))
    arena = arena_bytes(layers, args.micro, args.accum, args.seq, args.width, args.swap_blocks) \
        if args.schedule == "block-major" else 0
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    spec = dict(cap=args.cap, width=args.width, seq=args.seq, micro=args.micro, accum=args.accum,
                schedule=args.schedule, arena_bytes=arena, swap_blocks=args.swap_blocks, ceiling_micro_max=args.ceiling_micro_max,
                zero_accum=args.zero_accum, zero_micro=args.zero_micro, zero_params=args.zero_params,
                zero_prefetch=args.zero_prefetch, layers=layers, params=params, host_budget=args.host_budget,
                buffer_budget=args.buffer_budget, weights=args.weights, grads=args.grads,
                activations=args.activations, act_device_budget=args.act_device_budget,
                act_host_budget=args.act_host_budget, cpu_oom_above=args.cpu_oom_above,
                dir=str(work), max_layers=ceiling_max, cpu=args.cpu,
                profile_dir=str(args.profile.resolve()) if args.profile else None)
    gpu = "CPU smoke test (--cpu)" if args.cpu else subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.strip()
    try:
        host = host_info(work)
    except OSError as exc:  # (findmnt missing)
        host = {"error": str(exc), "cpus": os.cpu_count()}
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("worker", "spec")}
    out = {"command": " ".join(["bench/gpu.py", *(argv if argv is not None else sys.argv[1:])]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": host, "gpu": gpu, "args": settings,
           "schedule": args.schedule,
           "gpu_cap_bytes": args.cap, "model_params": params, "model_layers": layers,
           "model_flops_per_token": 6 * params, "tokens_per_step": args.micro * args.accum * args.seq,
           "state_bytes": params * STATE_BYTES_PER_PARAM, "state_over_cap": params * STATE_BYTES_PER_PARAM / args.cap,
           "rounds": [], "errors": {}, "warnings": []}
    pinned = args.host_budget + args.buffer_budget + arena
    if pinned > 0.8 * host.get("mem_total_bytes", float("inf")):
        out["warnings"].append(f"fuyoud's pinned memory ({pinned / GiB:.1f} GiB, of which the block-major arena "
                               f"{arena / GiB:.1f} GiB) exceeds 80% of the host's {host['mem_total_bytes'] / GiB:.1f} "
                               "GiB: fewer tokens per step (--accum) or a smaller --micro")
        print(f"WARNING: {out['warnings'][-1]}", flush=True)
    probes = Probes(args.probe_bytes, cuda=not args.cpu)
    out["probe_info"] = probes.info()
    workers: dict[str, Worker] = {}
    fallbacks = out["zero_micro_fallbacks"] = []

    def start(w: Worker) -> None:
        try:
            w, info = ready(w, work, fallbacks)
            out[f"{w.name}_info"] = dict(info, start_seconds=time.perf_counter() - w.started)
            workers[w.name] = w
            print(f"{w.name}: ready in {time.perf_counter() - w.started:.0f} s {info}", flush=True)
        except RuntimeError as exc:
            out["errors"][w.name] = str(exc)
            print(exc, flush=True)

    # ZeRO-Infinity's set-up (DeepSpeed compiles, its state goes to NVMe) overlaps the others'. inmem
    # takes Fuyou's fitted micro-batch, so it starts after Fuyou is ready; the ceiling times its
    # candidates, so it starts last, with no other set-up but ZeRO's on the GPU (on the CPU at once).
    early = {name: Worker(name, spec, work / f"{name}.log") for name in ("fuyou", "zero", "ceiling")
             if name in args.cases and (name != "ceiling" or args.cpu)}
    if "fuyou" in early:
        start(early.pop("fuyou"))
    if "inmem" in args.cases:
        fitted = out.get("fuyou_info", {})
        start(Worker("inmem", dict(spec, micro=fitted.get("micro", args.micro), accum=fitted.get("accum", args.accum)),
                     work / "inmem.log"))
    if "ceiling" in args.cases:
        start(early.pop("ceiling", None) or Worker("ceiling", spec, work / "ceiling.log"))
    if "zero" in early:
        start(early.pop("zero"))
    disk = BareLoop(work / "ssd.dat", args.ssd_probe, 1 << 20, 32)
    try:
        for r in range(args.iters + 1 if workers else 0):
            if r and args.deadline and time.perf_counter() - started > args.deadline:
                break
            names = list(workers)
            if not names:
                break
            names = names[r % len(names):] + names[:r % len(names)]
            rnd = {"warmup": r == 0}
            for name in names:
                try:
                    rnd[name] = workers[name].ask("iter")
                    print(f"round {r} {name}: {rnd[name]}", flush=True)
                except (RuntimeError, OSError) as exc:
                    out["errors"][name] = str(exc)
                    print(f"round {r} {name}: {str(exc)[-2000:]}", flush=True)
                    workers.pop(name).close()
            rnd["ssd_write_GBps"] = args.ssd_probe / disk.run(disk.WRITE) / 1e9
            rnd["ssd_read_GBps"] = args.ssd_probe / disk.run(disk.READ) / 1e9
            rnd.update(probes.run())
            out["rounds"].append(rnd)
            save(out, args)
        for name in [n for n in ("fuyou", "inmem", "ceiling") if n in workers and args.profile]:
            try:
                out.setdefault("profiles", {})[name] = workers[name].ask("profile")
                print(f"profile {name}: {out['profiles'][name]}", flush=True)
            except (RuntimeError, OSError) as exc:
                out["errors"][f"{name}_profile"] = str(exc)
            save(out, args)
    finally:
        disk.close()
        probes.close()
        for w in workers.values():
            w.close()
        shutil.rmtree(work, ignore_errors=True)
    save(out, args)
    print_table(out)
    return 0


def save(out: dict, args) -> None:
    """The results so far, summarised, to --json (after every round: a run cut short keeps them)."""
    summarize(out, args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))


def summarize(out: dict, args) -> None:
    timed = [r for r in out["rounds"] if not r["warmup"]] or out["rounds"]
    res = {}
    for name in CASES:
        rows = [r[name] for r in timed if name in r]
        if not rows:
            continue
        n = rows[-1].get("params", out["ceiling_info"]["params"]) if name == "ceiling" else out["model_params"]
        model = [tflops(x.get("params", n), x["tokens"], x["seconds"]) for x in rows]
        hw = [x["hw_flops_per_token"] * x["tokens"] / x["seconds"] / 1e12 if x.get("hw_flops_per_token") else None
              for x in rows]
        res[name] = {"tokens_per_s": med([x["tokens"] / x["seconds"] for x in rows]),
                     "tflops": med(model), "tflops_rounds": model, "hw_tflops": med(hw), "hw_tflops_rounds": hw,
                     "model_flops_per_token": 6 * n, "hw_flops_per_token": rows[-1].get("hw_flops_per_token"),
                     "micro_batch_seconds": med([x["micro_seconds"] / x["micro_batches"] for x in rows
                                                 if x["micro_seconds"] is not None]),
                     "step_seconds": med([x["step_seconds"] for x in rows]),
                     "seconds": med([x["seconds"] for x in rows]),
                     "busy": med([x["busy"] for x in rows]),
                     "peak_bytes": max((x["peak_bytes"] or 0) for x in rows) or None,
                     "params": n, "micro": rows[-1]["micro"], "micro_batches_per_step": rows[-1]["micro_batches"]}
    if "zero" in res and res["zero"]["micro_batch_seconds"] is not None:  # at the run's tokens per step
        z = res["zero"]
        k = max(1, out["tokens_per_step"] // (z["micro"] * args.seq))
        seconds = k * z["micro_batch_seconds"] + z["step_seconds"]
        tokens = k * z["micro"] * args.seq
        z["modelled_at_accum"] = {"micro_batches_per_step": k, "seconds": seconds,
                                  "tflops": tflops(out["model_params"], tokens, seconds),
                                  "hw_tflops": z["hw_flops_per_token"] * tokens / seconds / 1e12
                                  if z["hw_flops_per_token"] else None}
    out["results"] = res
    f = res.get("fuyou", {})
    out["fuyou_tflops"], out["fuyou_hw_tflops"] = f.get("tflops"), f.get("hw_tflops")
    out["fuyou_tokens_per_s"] = f.get("tokens_per_s")
    out["gpu_busy_fraction"] = f.get("busy")
    for name in ("ceiling", "inmem"):
        out[f"{KEYS[name]}_tflops"] = res.get(name, {}).get("tflops")
        out[f"{KEYS[name]}_hw_tflops"] = res.get(name, {}).get("hw_tflops")
    out["inmem_same_model_tflops_rounds"] = res.get("inmem", {}).get("tflops_rounds")
    modelled = res.get("zero", {}).get("modelled_at_accum", {})
    out["zero_infinity_tflops"], out["zero_infinity_hw_tflops"] = modelled.get("tflops"), modelled.get("hw_tflops")
    out["zero_infinity_tflops_as_run"] = res.get("zero", {}).get("tflops")
    for key in ("ssd_read_GBps", "ssd_write_GBps", "pcie_h2d_GBps", "pcie_d2h_GBps", "host_add_GBps"):
        out[key] = med([r.get(key) for r in out["rounds"]])
    for key, other in (("fuyou_over_ceiling", "inmem_ceiling_tflops"),
                       ("fuyou_over_inmem_same_model", "inmem_same_model_tflops"),
                       ("fuyou_over_zero_infinity", "zero_infinity_tflops")):
        out[key] = out["fuyou_tflops"] / out[other] if out["fuyou_tflops"] and out[other] else None
    out["targets_met"] = {key: (out[key] >= target if out.get(key) is not None else None)
                          for key, target in (("fuyou_over_ceiling", TARGET_CEILING),
                                              ("fuyou_over_inmem_same_model", TARGET_CEILING),
                                              ("fuyou_over_zero_infinity", TARGET_ZERO))}
    out["why_null"] = why_null(out, args)


def why_null(out: dict, args) -> dict:
    """For each headline figure that is null, why."""
    def case(name: str) -> str:
        if name == "zero" and args.cpu and name not in args.cases:
            return "--cpu: ZeRO-Infinity needs CUDA and DeepSpeed (run with --cases naming zero only with a stand-in)"
        if name not in args.cases:
            return f"the {name} case was not run (--cases, --no-zero)"
        if name in out["errors"]:
            return f"the {name} case failed: errors.{name}"
        if f"{name}_info" in out and not any(name in r for r in out["rounds"]):
            return f"no round of the {name} case ran (--deadline, --iters)"
        return f"the {name} case has no such figure (see results.{name})"

    source = {f"{KEYS[n]}_{kind}": n for n in CASES for kind in ("tflops", "hw_tflops")}
    source.update(fuyou_tokens_per_s="fuyou", inmem_same_model_tflops_rounds="inmem",
                  zero_infinity_tflops_as_run="zero", gpu_busy_fraction="fuyou")
    ratios = {"fuyou_over_ceiling": "inmem_ceiling_tflops", "fuyou_over_inmem_same_model": "inmem_same_model_tflops",
              "fuyou_over_zero_infinity": "zero_infinity_tflops"}
    reasons = {}
    for key, value in list(out.items()):
        if value is not None:
            continue
        if key in ("pcie_h2d_GBps", "pcie_d2h_GBps", "gpu_busy_fraction") and args.cpu:
            reasons[key] = "--cpu: needs a CUDA device (PCIe copies, NVML utilisation)"
        elif key in source:
            reasons[key] = case(source[key])
        elif key in ratios:
            missing = [k for k in ("fuyou_tflops", ratios[key]) if out.get(k) is None]
            reasons[key] = "; ".join(f"{k}: {reasons.get(k, 'null')}" for k in missing)
        elif key.endswith("GBps"):
            reasons[key] = "no round ran"
    return reasons


def fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def print_table(out: dict) -> None:
    print(f"\n{out['gpu']}; cap {out['gpu_cap_bytes'] / GiB:.1f} GiB; model {out['model_params'] / 1e9:.3f}B params "
          f"({out['state_over_cap']:.2f}x the cap in weights+grads+AdamW state); schedule {out['schedule']}")
    print("SSD read {} write {} GB/s; PCIe h2d {} d2h {} GB/s; host fp32 add {} GB/s".format(
        *(fmt(out.get(k), ".2f") for k in ("ssd_read_GBps", "ssd_write_GBps", "pcie_h2d_GBps", "pcie_d2h_GBps",
                                            "host_add_GBps"))))
    for name, r in out.get("results", {}).items():
        print(f"{name:8s} params {r['params'] / 1e6:8.1f}M  micro {r['micro']:3d} x {r['micro_batches_per_step']:4d}  "
              f"{fmt(r['tokens_per_s'], '9.0f')} tok/s  {fmt(r['tflops'], '6.1f')} TFLOPS "
              f"(hw {fmt(r['hw_tflops'], '6.1f')})  "
              f"busy {fmt(r['busy'], '.2f')}  micro-batch {fmt(r['micro_batch_seconds'], '7.1f', 1e3)} ms  "
              f"step {fmt(r['step_seconds'], '6.2f')} s of {fmt(r['seconds'], '6.2f')} s  "
              f"peak {fmt(r['peak_bytes'], '.2f', 1 / GiB)} GiB")
    for key in ("fuyou_over_ceiling", "fuyou_over_inmem_same_model", "fuyou_over_zero_infinity",
                "zero_infinity_tflops"):
        print(f"{key}: {out.get(key)}")
    print(f"targets met (>= {TARGET_CEILING}x the ceilings, >= {TARGET_ZERO}x ZeRO-Infinity): {out['targets_met']}")
    for key, why in out.get("why_null", {}).items():
        print(f"null {key}: {why}")
    for name, err in out["errors"].items():
        print(f"ERROR {name}: {err[-1500:]}")


if __name__ == "__main__":
    sys.exit(main())

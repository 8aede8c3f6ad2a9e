"""Training on a GPU whose memory is capped: Fuyou, the in-GPU ceiling and ZeRO-Infinity, one run.

    python bench/gpu.py --json PATH [--cap 4GiB] [--width 2048] [--seq 1024] [--micro 2] [--accum 256]
                        [--weights resident|host] [--grads host|device] [--iters 2] [--zero-accum 4]
                        [--zero-micro N] [--host-budget 9GiB] [--dir DIR] [--no-zero] [--deadline S]
                        [--profile DIR] [--ssd-probe 4GiB] [--cpu]

One model family: Hugging Face ``GPT2LMHeadModel`` (width ``--width``, 128-wide heads, vocabulary
8192, untied head, sequence ``--seq``, dropout off, random tokens), bf16 compute, fp32 AdamW state. Every case
is its own process with ``torch.cuda.set_per_process_memory_fraction`` set to ``--cap`` bytes:

* **fuyou**: the smallest depth whose weights + gradients + AdamW state (2 + 2 + 12 bytes per
  parameter) are at least 4x the cap. ``attach(offload=False, accumulation_steps=--accum,
  activations="recompute", grad_accumulation="host")`` (``--weights host``: ``offload="host"``;
  ``--grads device``: ``grad_accumulation="device"``; ``--activations auto``: the planner's choice
  per block within ``--act-device-budget`` and ``--act-host-budget``) on a private fuyoud whose shared memory
  (``--host-budget``) and optimizer buffers (``--buffer-budget``) are well below the state: the fp32 masters and
  moments live on SSD; bf16 weights stay on the GPU; each micro-batch's gradients go to fp32
  accumulators in shared memory; each layer group's step runs in the daemon as soon as the last
  micro-batch's backward has finished it. Before the rounds it fits its micro-batch: one forward
  and backward of ``--micro`` sequences within 90% of the cap, halving the micro-batch (and
  doubling the micro-batches per step) on running out of memory.
* **ceiling**: the largest depth of the same family that trains entirely in the capped GPU memory
  with ``torch.optim.AdamW(fused=True)`` (fp32 parameters, ``torch.autocast`` bf16), first without
  and then with activation checkpointing; same micro-batch and accumulation.
* **zero**: DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to NVMe (ZeRO-Infinity),
  the fuyou case's model, bf16, activation checkpointing, tuned as its documentation says (aio block
  size 1 MiB, queue depth 32, pipelined optimizer reads and writes, pinned buffers, buckets small
  enough for the cap, parameters released after use; no prefetch, see its config). It runs
  ``--zero-accum`` micro-batches per step (a step of ``--accum`` micro-batches would take many
  minutes); its time per micro-batch and per step are measured apart, and its throughput at
  ``--accum`` is computed from them (reported as such, next to what it ran).

The cases run interleaved, one iteration (``--accum`` micro-batches and the step) of each per round
after one warm-up iteration, with the SSD's bare read and write bandwidth (fuyoud's engine on a
4 GiB file, 1 MiB requests, depth 32) measured in the same rounds. Model TFLOPS = 6 x parameters
x tokens / seconds (recompute not counted); GPU busy fraction = the mean of NVML's utilisation
(share of time a kernel ran) sampled every 50 ms during the timed iterations. Medians over rounds.

``--profile DIR``: after the rounds, one more step of Fuyou and of the ceiling with the last
micro-batches and the step under torch.profiler (traces, operator tables, kernel-busy share and
longest gaps from the trace). ``--cpu``: the same run on the CPU, Fuyou through the tests'
stand-in for a device with its own memory, no cap and no DeepSpeed: a smoke test of the run
itself (tests/test_gpu_bench.py), whose numbers mean nothing.
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

VOCAB, LR, WD, GiB = 8192, 1e-4, 0.1, 1 << 30
STATE_BYTES_PER_PARAM = 16  # bf16 weights + bf16 gradients + fp32 masters, exp_avg, exp_avg_sq
TARGET_CEILING, TARGET_ZERO = 0.8, 3.0
PROFILED = 3  # micro-batches before the step that --profile traces


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "": 1}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[:len(text) - len(unit)]) * units[unit])
    raise argparse.ArgumentTypeError(f"not a size: {text}")


def config(width: int, layers: int, seq: int):
    import transformers
    cfg = transformers.GPT2Config(n_embd=width, n_layer=layers, n_head=width // 128, vocab_size=VOCAB,
                                  n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


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


# -- workers: one process per case, driven over stdin/stdout ---------------------------------

class Busy:
    """NVML utilisation sampled every 50 ms while running (nothing on the CPU)."""

    def __init__(self, enabled: bool = True):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if enabled else None

    def _run(self) -> None:
        import torch
        while not self._stop.wait(0.05):
            self.samples.append(torch.cuda.utilization() / 100)

    def __enter__(self):
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def gpu_activity(prof) -> dict:
    """From a profile's device intervals: the share of its window in which a kernel ran,
    in which anything (kernel or copy) ran, and the longest gaps with no kernel."""
    from torch.autograd import DeviceType
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    start, end = spans[0][0], max(e for _, e, _ in spans)

    def union(intervals):
        if not intervals:
            return 0, []
        total, cur_s, cur_e, gaps = 0, None, None, []
        for s, e in intervals:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                    gaps.append((s - cur_e, cur_e))
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return total + (cur_e - cur_s), gaps

    copies = ("Memcpy", "Memset", "memcpy", "memset")
    kernels, gaps = union([(s, e) for s, e, n in spans if not n.startswith(copies)])
    anything, _ = union([(s, e) for s, e, _ in spans])
    window = end - start
    return {"window_ms": window / 1e3, "kernel_busy": kernels / window, "any_busy": anything / window,
            "longest_kernel_gaps_ms": [round(g / 1e3, 3) for g, _ in sorted(gaps, reverse=True)[:10]]}


class Case:
    def __init__(self, spec: dict):
        import torch
        self.spec, self.torch = spec, torch
        self.cuda = not spec.get("cpu")  # --cpu: the run's plumbing on the CPU (a smoke test, no figures)
        self.where = "cuda" if self.cuda else "cpu"
        self.gen = torch.Generator(device=self.where).manual_seed(1)
        self.micro, self.accum = spec["micro"], spec["accum"]  # (Fuyou may halve micro and double accum)
        self.info: dict = {}

    def batch(self):
        return self.torch.randint(0, VOCAB, (self.micro, self.spec["seq"]), device=self.where, generator=self.gen)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def cap(self, share: float = 1.0) -> None:
        torch = self.torch
        gc.collect()
        if not self.cuda:
            return
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(self.spec["cap"] * share / total)
        torch.cuda.reset_peak_memory_stats()

    def model(self, layers: int, dtype):
        import transformers
        torch = self.torch
        torch.manual_seed(0)
        with torch.device(self.where):
            m = transformers.GPT2LMHeadModel(config(self.spec["width"], layers, self.spec["seq"]))
        return m.to(dtype)

    def iteration(self, accum: int | None = None, profiler=None) -> dict:
        """One step of ``accum`` micro-batches (default: the case's). ``profiler``: started
        before the last PROFILED micro-batches, stopped after the step."""
        accum = accum or self.accum
        self.sync()
        marks, t0 = [], time.perf_counter()
        with Busy(self.cuda) as busy:
            for i in range(accum):
                if profiler is not None and i == max(0, accum - PROFILED):
                    profiler.start()
                self.micro_batch(self.batch())
                marks.append(time.perf_counter())
            self.step()
            self.sync()
        t1 = time.perf_counter()
        if profiler is not None:
            profiler.stop()
        return {"seconds": t1 - t0, "micro_seconds": marks[-1] - t0, "step_seconds": t1 - marks[-1],
                "micro_batches": accum, "micro": self.micro, "tokens": accum * self.micro * self.spec["seq"],
                "busy": statistics.mean(busy.samples) if busy.samples else None,
                "peak_bytes": self.torch.cuda.max_memory_allocated() if self.cuda else None,
                "last_loss": float(self.loss)}

    def profile(self, directory: Path) -> dict:
        """One more step, the last PROFILED micro-batches and the step under torch.profiler:
        a Chrome trace (gzipped) and the operators' totals in ``directory``, and the share
        of that window in which the GPU ran anything, from the trace's own intervals."""
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        prof = profile(activities=activities)
        result = self.iteration(profiler=prof)
        name = type(self).__name__.lower()
        trace = directory / f"{name}-trace.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        sort = "cuda_time_total" if self.cuda else "cpu_time_total"
        (directory / f"{name}-ops.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
        result["profile"] = dict(gpu_activity(prof) if self.cuda else {}, trace=f"{trace}.gz",
                                 micro_batches=min(PROFILED, result["micro_batches"]))
        return result


class Ceiling(Case):
    """The largest depth that trains in the capped GPU memory, with torch's AdamW."""

    def __init__(self, spec):
        super().__init__(spec)
        self.search(spec["max_layers"], [])

    def search(self, max_layers: int, tried: list) -> None:
        torch = self.torch
        self.net = self.opt = None
        self.cap(0.9)  # searched with 10% to spare: a long run needs more than the probe
        for layers in range(max_layers, 0, -1):
            for ckpt in (False, True):
                if self.fits(layers, ckpt):
                    self.cap()
                    self.info = {"layers": layers, "checkpointing": ckpt, "did_not_fit": tried,
                                 "params": sum(p.numel() for p in self.net.parameters())}
                    return
                tried.append({"layers": layers, "checkpointing": ckpt})
                self.net = self.opt = None
                gc.collect()
                torch.cuda.empty_cache()
        raise RuntimeError("not even one layer trains within the cap")

    def iteration(self, accum: int | None = None, profiler=None) -> dict:
        """On running out of memory in a long run, the next smaller model (reported)."""
        for _ in range(4):
            try:
                return dict(super().iteration(accum, profiler), **self.info)
            except self.torch.OutOfMemoryError:
                failed = dict(layers=self.info["layers"], checkpointing=self.info["checkpointing"], in_run=True)
            self.search(failed["layers"] - 1, self.info["did_not_fit"] + [failed])
        raise RuntimeError("the ceiling kept running out of memory")

    def fits(self, layers: int, ckpt: bool) -> bool:
        torch = self.torch
        try:
            self.net = self.model(layers, torch.float32)
            if ckpt:
                self.net.gradient_checkpointing_enable()
            self.opt = torch.optim.AdamW(self.net.parameters(), lr=LR, weight_decay=WD, fused=True)
            for _ in range(2):  # must fit: forward, backward, the optimizer's state and step, twice
                Case.iteration(self, 2)
            return True
        except torch.OutOfMemoryError:
            return False

    def micro_batch(self, x) -> None:
        with self.torch.autocast(self.where, dtype=self.torch.bfloat16):
            loss = self.net(x, labels=x).loss
        loss.backward()
        self.loss = loss.detach()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Fuyou(Case):
    def __init__(self, spec):
        super().__init__(spec)
        import fuyou_client
        self.fuyou, d = fuyou_client, Path(spec["dir"])
        state = spec["params"] * 12
        self.daemon = fuyou_client.start_daemon(d / "fuyou-state", config={
            "storage": {"data_dirs": [str(d / "fuyou-data")],
                        "capacity_per_device": max(GiB, int(state * 2.3) // GiB * GiB)},
            "memory": {"pinned_budget": spec["host_budget"]},
            "optimizer": {"buffer_budget": spec["buffer_budget"], "buffers": 3}})
        self.fallbacks: list[dict] = []
        self.attach()
        self.fit()
        self.info = {"layers": spec["layers"], "params": sum(p.numel() for p in self.net.parameters()),
                     "micro": self.micro, "accum": self.accum, "micro_fallbacks": self.fallbacks,
                     "daemon_host_bytes": spec["host_budget"] + spec["buffer_budget"],
                     "io_engine": self.engine.session.daemon_status.io_engine}

    def attach(self) -> None:
        spec, device = self.spec, None
        if not self.cuda:  # (--cpu: the CUDA code path, on the tests' stand-in for a device with its own memory)
            sys.path.insert(0, str(REPO / "tests"))
            from discrete_device import LateCopyDevice
            device = LateCopyDevice(max_delay=0.0)
        self.net = self.model(spec["layers"], self.torch.bfloat16)
        self.engine = self.fuyou.attach(
            self.net, self.fuyou.AdamW(lr=LR, weight_decay=WD), socket=self.daemon.socket, device=device,
            offload=False if spec["weights"] == "resident" else "host", accumulation_steps=self.accum,
            activations=spec["activations"], grad_accumulation=spec["grads"],
            device_budget=spec["act_device_budget"], host_budget=spec["act_host_budget"])
        self.cap()  # (attach briefly holds the weights twice on the device while it moves them)

    def iteration(self, accum: int | None = None, profiler=None) -> dict:
        result = super().iteration(accum, profiler)
        if self.engine.plan is not None:  # (--activations auto)
            result["activation_plan"] = str(self.engine.plan)
        return result

    def fit(self) -> None:
        """The largest micro-batch up to --micro whose forward and backward run in 90% of
        the cap (the ceiling's search keeps the same margin); each halving doubles the
        micro-batches per step, so that a step's tokens stay --micro x --accum."""
        while True:
            try:
                self.cap(0.9)
                self.micro_batch(self.batch())
                self.sync()
                self.engine.zero_grad()  # (the probe's gradients are discarded)
                self.cap()
                return
            except self.torch.OutOfMemoryError as exc:
                if self.micro == 1:
                    raise
                self.fallbacks.append({"micro": self.micro, "error": str(exc).splitlines()[0][:300]})
            try:
                self.engine.close()
            except Exception as exc:  # noqa: BLE001 - an engine that ran out of memory mid-backward
                self.fallbacks[-1]["close_error"] = repr(exc)[:300]
            self.net = self.engine = None
            self.micro, self.accum = self.micro // 2, self.accum * 2
            self.attach()

    def micro_batch(self, x) -> None:
        loss = self.net(x, labels=x).loss
        loss.backward()
        self.loss = loss.detach()

    def step(self) -> None:
        self.engine.step()
        self.engine.zero_grad()

    def close(self) -> None:
        self.engine.close()
        self.daemon.stop()


class Zero(Case):
    def __init__(self, spec):
        super().__init__(spec)
        self.micro = spec["zero_micro"] or spec["micro"]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
        import deepspeed
        import transformers
        torch, nvme = self.torch, Path(spec["dir"]) / "zero-nvme"
        nvme.mkdir(parents=True, exist_ok=True)
        largest = VOCAB * spec["width"]
        cfg = {
            "train_micro_batch_size_per_gpu": self.micro, "gradient_accumulation_steps": spec["zero_accum"],
            "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 1 << 30,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {
                "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": int(1e8),
                "reduce_bucket_size": int(5e7),  # (default 5e8: a 1 GB bf16 bucket does not fit the cap)
                # No prefetch: with NVMe parameters and activation checkpointing, DeepSpeed 0.19.8's
                # NVMe prefetch puts a parameter the trace lists twice into two swap buffers and
                # fails ("param ... already assigned swap buffer id", seen on the H100 with
                # prefetch 5e7); 0 skips that path (partitioned_param_coordinator.py).
                "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": int(1e5),
                # Parameters swapped in from NVMe each take one pinned buffer until released:
                # release them after use (reuse distance 0) and keep a block or two live.
                "stage3_max_live_parameters": int(1e8), "stage3_max_reuse_distance": 0,
                "offload_param": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True,
                                  "buffer_count": 32, "buffer_size": largest, "max_in_cpu": 0},
                "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True,
                                      "buffer_count": 4, "pipeline_read": True, "pipeline_write": True}},
            "aio": {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1,
                    "single_submit": False, "overlap_events": True},
        }
        self.cap()
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme", dtype=torch.bfloat16):
            torch.manual_seed(0)
            net = transformers.GPT2LMHeadModel(config(spec["width"], spec["layers"], spec["seq"]))
        net.gradient_checkpointing_enable()
        self.engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
        self.accum = spec["zero_accum"]
        self.info = {"layers": spec["layers"], "deepspeed": deepspeed.__version__, "config": cfg}

    def micro_batch(self, x) -> None:
        loss = self.engine(x, labels=x).loss
        self.engine.backward(loss)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # (counts the micro-batch; the boundary's step is step() below)
        self.loss = loss.detach()

    def step(self) -> None:
        self.engine.step()  # the optimizer step: state read from and written to NVMe


_replies = None  # the worker's channel to the run: its original stdout


def reply(obj) -> None:
    _replies.write("@@ " + json.dumps(obj) + "\n")
    _replies.flush()


def worker(name: str, spec: dict) -> None:
    global _replies
    _replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes to the worker's log, not into the channel
    case = {"ceiling": Ceiling, "fuyou": Fuyou, "zero": Zero}[name](spec)
    reply({"ready": True, **case.info})
    for line in sys.stdin:
        command = line.strip()
        if command == "iter":
            reply(case.iteration())
        elif command == "profile":
            reply(case.profile(Path(spec["profile_dir"])))
        else:
            break
    if hasattr(case, "close"):
        case.close()


# -- the run: workers side by side, interleaved rounds ------------------------------------------

class Worker:
    def __init__(self, name: str, spec: dict, log: Path):
        self.name, self.log, self.started = name, log, time.perf_counter()
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


def tflops(params: int, tokens: int, seconds: float) -> float:
    return 6 * params * tokens / seconds / 1e12


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="where to write the results (required)")
    ap.add_argument("--cap", default="4GiB", type=parse_size, help="GPU memory per case (default 4GiB)")
    ap.add_argument("--width", default=2048, type=int)
    ap.add_argument("--seq", default=1024, type=int)
    ap.add_argument("--micro", default=2, type=int, help="sequences per micro-batch (default 2)")
    ap.add_argument("--accum", default=256, type=int, help="micro-batches per step (default 256)")
    ap.add_argument("--zero-accum", default=4, type=int, help="micro-batches per ZeRO-Infinity step (default 4)")
    ap.add_argument("--zero-micro", default=0, type=int,
                    help="sequences per ZeRO-Infinity micro-batch (default: --micro)")
    ap.add_argument("--iters", default=2, type=int, help="timed rounds after one warm-up round (default 2)")
    ap.add_argument("--host-budget", default="9GiB", type=parse_size, help="fuyoud's pinned_budget (default 9GiB)")
    ap.add_argument("--buffer-budget", default="2560MiB", type=parse_size,
                    help="fuyoud's optimizer buffer_budget, three buffers (default 2560MiB)")
    ap.add_argument("--weights", default="resident", choices=["resident", "host"],
                    help="Fuyou's blocks' weights: on the GPU (offload=False, the default) or in host memory, "
                         "uploaded per use (offload=\"host\")")
    ap.add_argument("--grads", default="host", choices=["host", "device"],
                    help="Fuyou's grad_accumulation (default host)")
    ap.add_argument("--activations", default="recompute", choices=["recompute", "auto"],
                    help="Fuyou's activations: every block recomputed in backward (default), or the planner's "
                         "choice per block of keep, swap (host arena, then SSD) or recompute, within the two "
                         "budgets below")
    ap.add_argument("--act-device-budget", default="1GiB", type=parse_size,
                    help="with --activations auto: activation bytes on the GPU (default 1GiB)")
    ap.add_argument("--act-host-budget", default="1GiB", type=parse_size,
                    help="with --activations auto: the host arena for swapped activations (default 1GiB)")
    ap.add_argument("--dir", type=Path, help="parent of the work directory (default <repo>/.fuyou/bench)")
    ap.add_argument("--no-zero", action="store_true", help="skip ZeRO-Infinity")
    ap.add_argument("--deadline", default=0, type=float, help="stop starting rounds after this many seconds")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help=f"after the rounds, one more step of Fuyou and of the ceiling with their last {PROFILED} "
                         "micro-batches and the step under torch.profiler: gzipped Chrome traces, operator "
                         "tables and the GPU's busy share from the trace, into DIR")
    ap.add_argument("--ssd-probe", default="4GiB", type=parse_size,
                    help="file size of the bare SSD bandwidth measurement in each round (default 4GiB)")
    ap.add_argument("--cpu", action="store_true",
                    help="a smoke test of the run itself on the CPU (Fuyou through the tests' stand-in for a "
                         "device with its own memory; no cap, no ZeRO-Infinity): its numbers mean nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.spec))
        return 0
    if args.json is None:
        ap.error("--json is required")
    from common import BareLoop, host_info

    started = time.perf_counter()
    work = (args.dir or REPO / ".fuyou" / "bench").resolve() / f"gpu-{os.getpid()}"
    work.mkdir(parents=True)
    layers = fuyou_depth(args.width, args.seq, args.cap)
    params = params_of(args.width, layers, args.seq)
    ceiling_max = max(1, max((L for L in range(1, layers) if params_of(args.width, L, args.seq) * 16 <= args.cap),
                             default=1))
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    spec = dict(cap=args.cap, width=args.width, seq=args.seq, micro=args.micro, accum=args.accum,
                zero_accum=args.zero_accum, zero_micro=args.zero_micro, layers=layers, params=params, host_budget=args.host_budget,
                buffer_budget=args.buffer_budget, weights=args.weights, grads=args.grads,
                activations=args.activations, act_device_budget=args.act_device_budget,
                act_host_budget=args.act_host_budget,
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
    out = {"host": host, "gpu": gpu, "args": settings,
           "gpu_cap_bytes": args.cap, "model_params": params, "model_layers": layers,
           "state_bytes": params * STATE_BYTES_PER_PARAM, "state_over_cap": params * STATE_BYTES_PER_PARAM / args.cap,
           "rounds": [], "errors": {}}
    workers: dict[str, Worker] = {}
    starting = {name: Worker(name, spec, work / f"{name}.log")  # set-ups run at once (DeepSpeed compiles)
                for name in ["ceiling", "fuyou"] + ([] if args.no_zero or args.cpu else ["zero"])}
    for name, w in starting.items():
        try:
            info = w.read()
            out[f"{name}_info"] = dict(info, start_seconds=time.perf_counter() - w.started)
            workers[name] = w
            print(f"{name}: ready in {time.perf_counter() - w.started:.0f} s {info}", flush=True)
        except RuntimeError as exc:
            out["errors"][name] = str(exc)
            print(exc, flush=True)
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
            out["rounds"].append(rnd)
            save(out, args)
        for name in [n for n in ("fuyou", "ceiling") if n in workers and args.profile]:
            try:
                out.setdefault("profiles", {})[name] = workers[name].ask("profile")
                print(f"profile {name}: {out['profiles'][name]}", flush=True)
            except (RuntimeError, OSError) as exc:
                out["errors"][f"{name}_profile"] = str(exc)
            save(out, args)
    finally:
        disk.close()
        for w in workers.values():
            w.close()
        shutil.rmtree(work, ignore_errors=True)
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
    for name in ("ceiling", "fuyou", "zero"):
        rows = [r[name] for r in timed if name in r]
        if not rows:
            continue
        n = out["model_params"] if name != "ceiling" else rows[-1].get("params", out["ceiling_info"]["params"])
        res[name] = {"tokens_per_s": med([x["tokens"] / x["seconds"] for x in rows]),
                     "tflops": med([tflops(x.get("params", n), x["tokens"], x["seconds"]) for x in rows]),
                     "micro_batch_seconds": med([x["micro_seconds"] / x["micro_batches"] for x in rows]),
                     "step_seconds": med([x["step_seconds"] for x in rows]),
                     "busy": med([x["busy"] for x in rows]),
                     "peak_bytes": max((x["peak_bytes"] or 0) for x in rows) or None,
                     "params": n, "micro_batches_per_step": rows[0]["micro_batches"]}
    if "zero" in res:  # at Fuyou's tokens per step, from its measured micro-batch and step times
        z, micro = res["zero"], args.zero_micro or args.micro
        k = max(1, args.accum * args.micro // micro)
        tokens = k * micro * args.seq
        z["modelled_at_accum"] = {"micro_batches_per_step": k,
                                  "seconds": k * z["micro_batch_seconds"] + z["step_seconds"]}
        z["modelled_at_accum"]["tflops"] = tflops(out["model_params"], tokens, z["modelled_at_accum"]["seconds"])
    out["results"] = res
    f = res.get("fuyou", {})
    out["fuyou_tflops"] = f.get("tflops")
    out["fuyou_tokens_per_s"] = f.get("tokens_per_s")
    out["gpu_busy_fraction"] = f.get("busy")
    out["inmem_ceiling_tflops"] = res.get("ceiling", {}).get("tflops")
    out["zero_infinity_tflops"] = res["zero"]["modelled_at_accum"]["tflops"] if "zero" in res else None
    out["zero_infinity_tflops_as_run"] = res.get("zero", {}).get("tflops")
    out["ssd_read_GBps"] = med([r["ssd_read_GBps"] for r in out["rounds"]])
    out["ssd_write_GBps"] = med([r["ssd_write_GBps"] for r in out["rounds"]])
    if out["fuyou_tflops"] and out["inmem_ceiling_tflops"]:
        out["fuyou_over_ceiling"] = out["fuyou_tflops"] / out["inmem_ceiling_tflops"]
    if out["fuyou_tflops"] and out["zero_infinity_tflops"]:
        out["fuyou_over_zero_infinity"] = out["fuyou_tflops"] / out["zero_infinity_tflops"]


def print_table(out: dict) -> None:
    print(f"\n{out['gpu']}; cap {out['gpu_cap_bytes'] / GiB:.1f} GiB; model {out['model_params'] / 1e9:.3f}B params "
          f"({out['state_over_cap']:.2f}x the cap in weights+grads+AdamW state); SSD read {out['ssd_read_GBps']:.2f} "
          f"write {out['ssd_write_GBps']:.2f} GB/s")
    for name, r in out.get("results", {}).items():
        print(f"{name:8s} params {r['params'] / 1e6:8.1f}M  {r['tokens_per_s']:9.0f} tok/s  {r['tflops']:6.1f} TFLOPS  "
              f"busy {r['busy'] or 0:.2f}  micro {r['micro_batch_seconds'] * 1e3:7.1f} ms  "
              f"step {r['step_seconds']:6.2f} s  "
              f"peak {(r['peak_bytes'] or 0) / GiB:.2f} GiB")
    for key in ("fuyou_over_ceiling", "fuyou_over_zero_infinity", "zero_infinity_tflops"):
        print(f"{key}: {out.get(key)}")
    for name, err in out["errors"].items():
        print(f"ERROR {name}: {err[-1500:]}")


if __name__ == "__main__":
    sys.exit(main())

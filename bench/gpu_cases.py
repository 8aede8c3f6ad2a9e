"""bench/gpu.py's cases, each run in its own worker process: the in-GPU ceiling, Fuyou and
ZeRO-Infinity, driven over stdin ("iter", "profile") with one JSON reply line each (see
gpu.py for what each case is and how the run compares them)."""
from __future__ import annotations

import gc
import gzip
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB, LR, WD, GiB = 8192, 1e-4, 0.1, 1 << 30
PROFILED = 3  # micro-batches before the step that --profile traces


def config(width: int, layers: int, seq: int):
    import transformers
    cfg = transformers.GPT2Config(n_embd=width, n_layer=layers, n_head=width // 128, vocab_size=VOCAB,
                                  n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def checkpoint_activations(net) -> None:
    """HF activation checkpointing: transformers 5 renamed gradient_checkpointing_enable (now
    deprecated, warning once per call); older releases have only that name."""
    enable = getattr(net, "activation_checkpointing_enable", None) or net.gradient_checkpointing_enable
    enable()


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
                checkpoint_activations(self.net)
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
        checkpoint_activations(net)
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

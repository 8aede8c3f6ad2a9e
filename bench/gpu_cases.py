"""bench/gpu.py's cases, each run in its own worker process, driven over stdin ("iter",
"profile") with one JSON reply line each: what they share (the model, the timed iteration,
the FLOP count, the profile) and Fuyou. The in-GPU ceilings are in gpu_inmem.py,
ZeRO-Infinity in gpu_zero.py, the worker that runs one of them in gpu_worker.py (it imports
the three; they import only this module); gpu.py says what each case is and how the run
compares them."""
from __future__ import annotations

import gc
import gzip
import shutil
import statistics
import sys
import threading
import time
from contextlib import nullcontext
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


class MicroTooLarge(Exception):
    """A case's probe micro-batch ran out of memory within the cap: the run starts the
    case again with half the micro-batch (ZeRO-Infinity; DeepSpeed cannot be set up twice
    in one process)."""


class Flops:
    """Hardware FLOPs of real work, recompute included, as the kernels ran it:
    ``torch.utils.flop_counter.FlopCounterMode`` around the work. ``plain``: FlopCounterMode's
    own formulas (its ``flop_registry``) counted by a plain dispatch mode, without its module
    tracker, on the calling thread and on every thread a ``wrap``ped loss_fn runs in. For
    block-major: train_step's forward runs each micro-batch in a thread of its own, which a
    mode of the calling thread does not see (the mode is left on such a thread, which ends
    with the forward), and the tracker's hooks on leaf tensors make train_step's
    ``autograd.grad`` fail. For ZeRO-Infinity: the tracker's hooks on every module were never
    tried beside DeepSpeed's."""

    def __init__(self, plain: bool = False):
        from torch.utils.flop_counter import FlopCounterMode
        self.plain, self.counts, self.local = plain, [], threading.local()
        self.mode = _thread_flops(self.counts) if plain else FlopCounterMode(display=False)

    def __enter__(self):
        self.caller = threading.current_thread()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def wrap(self, fn):
        def counted(*args, **kwargs):
            if threading.current_thread() is not self.caller and not getattr(self.local, "on", False):
                self.local.on = True
                _thread_flops(self.counts).__enter__()
            return fn(*args, **kwargs)
        return counted if self.plain else fn

    def total(self) -> int:
        return sum(self.counts) if self.plain else self.mode.get_total_flops()


def _thread_flops(sink: list):
    """A dispatch mode adding FlopCounterMode's count of each operator into ``sink``."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class ThreadFlops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            count = flop_registry.get(func._overloadpacket)
            if count is not None:
                sink.append(count(*args, **kwargs, out_val=out))
            return out
    return ThreadFlops()


def counting(enabled: bool, plain: bool = False):
    """A Flops counter around real work, or nothing."""
    return Flops(plain) if enabled else nullcontext()


class Case:
    capped = True  # (its GPU memory is --cap)
    plain_flops = False  # (Flops)

    def __init__(self, spec: dict):
        import torch
        self.spec, self.torch = spec, torch
        self.cuda = not spec.get("cpu")  # --cpu: the run's plumbing on the CPU (a smoke test, no figures)
        self.where = "cuda" if self.cuda else "cpu"
        self.gen = torch.Generator(device=self.where).manual_seed(1)
        self.micro, self.accum = spec["micro"], spec["accum"]  # (fits and searches may change them)
        self.hw_per_token: float | None = None  # FlopCounterMode's count, from the first iteration
        self.info: dict = {}
        # --cpu --cpu-oom-above N: a capped case's micro-batches of more than N sequences run out of
        # memory (as if over the cap), so that the smoke test takes the fits' and searches' fallbacks
        self.oom_above = spec.get("cpu_oom_above", 0) if not self.cuda and self.capped else 0

    def batch(self):
        if self.oom_above and self.micro > self.oom_above:
            raise self.torch.OutOfMemoryError(f"--cpu-oom-above {self.oom_above}: {self.micro} sequences")
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

    def release(self) -> None:
        """What a case that ran out of memory held is freed (its tensors may sit in reference
        cycles with the exception's frames), and the cap lifted."""
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.set_per_process_memory_fraction(1.0)

    def model(self, layers: int, dtype):
        import transformers
        torch = self.torch
        torch.manual_seed(0)
        with torch.device(self.where):
            m = transformers.GPT2LMHeadModel(config(self.spec["width"], layers, self.spec["seq"]))
        return m.to(dtype)

    def result(self, seconds, micro_seconds, step_seconds, micro_batches: int, busy) -> dict:
        return {"seconds": seconds, "micro_seconds": micro_seconds, "step_seconds": step_seconds,
                "micro_batches": micro_batches, "micro": self.micro,
                "tokens": micro_batches * self.micro * self.spec["seq"],
                "busy": statistics.mean(busy.samples) if busy.samples else None,
                "peak_bytes": self.torch.cuda.max_memory_allocated() if self.cuda else None,
                "last_loss": float(self.loss), "hw_flops_per_token": self.hw_per_token}

    def iteration(self, accum: int | None = None, profiler=None, count: bool = False) -> dict:
        """One step of ``accum`` micro-batches (default: the case's). ``profiler``: started
        before the last PROFILED micro-batches, stopped after the step. ``count``: the last
        micro-batch under FlopCounterMode (its FLOPs per token become the case's)."""
        accum = accum or self.accum
        self.sync()
        marks, t0 = [], time.perf_counter()
        with Busy(self.cuda) as busy:
            for i in range(accum):
                if profiler is not None and i == max(0, accum - PROFILED):
                    profiler.start()
                x = self.batch()
                with counting(count and i == accum - 1, self.plain_flops) as flops:
                    self.micro_batch(x)
                if flops is not None:
                    self.hw_per_token = flops.total() / x.numel()
                marks.append(time.perf_counter())
            self.step()
            self.sync()
        t1 = time.perf_counter()
        if profiler is not None:
            profiler.stop()
        result = self.result(t1 - t0, marks[-1] - t0, t1 - marks[-1], accum, busy)
        if profiler is not None:
            result["profiled_micro_batches"] = min(PROFILED, accum)
        return result

    def profile(self, directory: Path) -> dict:
        """One more step under torch.profiler (the last PROFILED micro-batches and the step;
        block-major: the whole train_step): a Chrome trace (gzipped) and the operators'
        totals in ``directory``, and the share of that window in which the GPU ran
        anything, from the trace's own intervals."""
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
                                 micro_batches=result.pop("profiled_micro_batches"))
        return result


OFFLOAD = {"resident": False, "host": "host", "ssd": True}


class Fuyou(Case):
    def __init__(self, spec):
        super().__init__(spec)
        import fuyou_client
        self.fuyou, d = fuyou_client, Path(spec["dir"])
        self.block_major = spec["schedule"] == "block-major"
        state, arena = spec["params"] * 12, spec["arena_bytes"] if self.block_major else 0
        self.daemon = fuyou_client.start_daemon(d / "fuyou-state", config={
            "storage": {"data_dirs": [str(d / "fuyou-data")],
                        "capacity_per_device": max(GiB, int(state * 2.3) // GiB * GiB)},
            # (the engine's host arena, which its memory plan counts: train_step's, or the
            # activation swapper's of --act-host-budget in the loop)
            "memory": {"pinned_budget": spec["host_budget"] + (arena or spec["act_host_budget"])},
            "optimizer": {"buffer_budget": spec["buffer_budget"], "buffers": 3}})
        self.fallbacks: list[dict] = []
        self.attach()
        self.fit()
        self.info = {"layers": spec["layers"], "params": self.params, "schedule": spec["schedule"],
                     "offload": OFFLOAD[spec["weights"]], "grads": spec["grads"], "micro": self.micro,
                     "accum": self.accum, "micro_fallbacks": self.fallbacks, "arena_bytes": arena or None,
                     "swap_blocks": spec.get("swap_blocks", 0),
                     "daemon_host_bytes": spec["host_budget"] + spec["buffer_budget"] + (arena or spec["act_host_budget"]),
                     "io_engine": self.engine.session.daemon_status.io_engine}

    def attach(self) -> None:
        spec, device = self.spec, None
        if not self.cuda:  # (--cpu: the CUDA code path, on the tests' stand-in for a device with its own memory)
            sys.path.insert(0, str(REPO / "tests"))
            from discrete_device import LateCopyDevice
            device = LateCopyDevice(max_delay=0.0)
        self.net = self.model(spec["layers"], self.torch.bfloat16)
        self.params = sum(p.numel() for p in self.net.parameters())  # (before attach empties offloaded ones)
        if self.block_major:  # (train_step accumulates over its list itself and recomputes every block)
            mode = dict(accumulation_steps=1, host_budget=spec["arena_bytes"], swap_blocks=spec.get("swap_blocks", 0))
        else:
            mode = dict(accumulation_steps=self.accum, activations=spec["activations"],
                        device_budget=spec["act_device_budget"], host_budget=spec["act_host_budget"])
        self.engine = self.fuyou.attach(
            self.net, self.fuyou.AdamW(lr=LR, weight_decay=WD), socket=self.daemon.socket, device=device,
            offload=OFFLOAD[spec["weights"]], grad_accumulation=spec["grads"], **mode)
        if self.block_major and not hasattr(self.engine, "train_step"):
            raise RuntimeError("--schedule block-major needs engine.train_step, which this client lacks "
                               "(--schedule loop runs without it)")
        self.cap()  # (attach briefly holds the weights twice on the device while it moves them)

    def train_step(self, batches: list, flops: Flops | None = None):
        k, net = len(batches), self.net

        def loss_fn(x):
            return net(x, labels=x).loss / k
        return self.engine.train_step(batches, loss_fn if flops is None else flops.wrap(loss_fn))

    def iteration(self, accum: int | None = None, profiler=None, count: bool = False) -> dict:
        if self.block_major:
            result = self.block_major_iteration(accum or self.accum, profiler, count)
        else:
            result = super().iteration(accum, profiler, count)
        if self.engine.plan is not None:  # (--activations auto)
            result["activation_plan"] = str(self.engine.plan)
        return result

    def block_major_iteration(self, k: int, profiler, count: bool) -> dict:
        """One ``engine.train_step`` over ``k`` micro-batches (each block forward over all of
        them, backward likewise; its step submitted as its gradient is final; the step's
        barrier at the end): the micro-batches and the step are not separable in time."""
        batches = [self.batch() for _ in range(k)]
        store = getattr(self.engine, "_train_step_store", None)  # (its checkpoint traffic, if it says)
        moved = (store.bytes_down, store.bytes_up) if store is not None else None
        status0 = self.engine.session.status()
        self.sync()
        t0 = time.perf_counter()
        with Busy(self.cuda) as busy:
            if profiler is not None:
                profiler.start()
            with counting(count, plain=True) as flops:
                losses = self.train_step(batches, flops)
            self.sync()  # (train_step ends with the step's barrier and zero_grad)
        t1 = time.perf_counter()
        if profiler is not None:
            profiler.stop()
        if flops is not None:
            self.hw_per_token = flops.total() / (k * self.micro * self.spec["seq"])
        self.loss = losses[-1] * k  # (loss_fn divides by k)
        result = dict(self.result(t1 - t0, None, None, k, busy), via="engine.train_step",
                      losses=[float(v) for v in losses])
        if moved is not None:
            result["checkpoint_bytes_down"] = store.bytes_down - moved[0]
            result["checkpoint_bytes_up"] = store.bytes_up - moved[1]
        times, status1 = getattr(self.engine, "train_step_times", None), self.engine.session.status()
        if times is not None:  # (where the step's seconds went, the device synchronised at each boundary)
            result["phases"] = {"forward": times.forward, "backward": times.backward, "step": times.step}
        stats = self.engine.train_step_stats
        if stats is not None and self.spec.get("swap_blocks"):  # (the swapped blocks' activations, this step)
            result["activations"] = {k: getattr(stats, k) for k in (
                "activations_to_host", "activations_back", "activations_to_ssd", "activations_from_ssd")}
        result["ssd_read_bytes"] = status1.bytes_read - status0.bytes_read  # (the daemon's, this step)
        result["ssd_written_bytes"] = status1.bytes_written - status0.bytes_written
        if profiler is not None:
            result["profiled_micro_batches"] = k
        return result

    def fit(self) -> None:
        """The largest micro-batch up to --micro whose forward and backward (block-major: a
        train_step of two micro-batches) run in 90% of the cap (the ceiling's search keeps
        the same margin); each halving doubles the micro-batches per step, so that a step's
        tokens stay --micro x --accum."""
        while True:
            try:
                self.cap(0.9)
                if self.block_major:
                    self.train_step([self.batch(), self.batch()])  # (a step: it ends with zero_grad)
                else:
                    self.micro_batch(self.batch())
                    self.sync()
                    self.engine.zero_grad()  # (the probe's gradients are discarded)
                self.sync()
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
            self.release()  # (the model is built again on the GPU, as at first, before the cap)
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

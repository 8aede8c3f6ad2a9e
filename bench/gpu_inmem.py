"""bench/gpu.py's in-GPU cases: torch's fused AdamW with everything in GPU memory, the
largest model that fits the cap (``ceiling``, searching its depth and micro-batch) and
Fuyou's own model without the cap (``inmem``)."""
from __future__ import annotations

import gc
import time

from gpu_cases import LR, WD, Case, checkpoint_activations


class InGPU(Case):
    """Training entirely in GPU memory: torch.optim.AdamW(fused=True), fp32 parameters,
    torch.autocast bf16, optionally Hugging Face activation checkpointing."""
    built: tuple | None = None  # (layers, checkpointing) of self.net

    def build(self, layers: int, ckpt: bool) -> None:
        torch = self.torch
        self.net = self.opt = self.built = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        self.net = self.model(layers, torch.float32)
        if ckpt:
            checkpoint_activations(self.net)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=LR, weight_decay=WD, fused=True)
        self.built, self.hw_per_token = (layers, ckpt), None

    def micro_batch(self, x) -> None:
        with self.torch.autocast(self.where, dtype=self.torch.bfloat16):
            loss = self.net(x, labels=x).loss
        loss.backward()
        self.loss = loss.detach()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class InMem(InGPU):
    """Fuyou's model, micro-batch and tokens per step trained in GPU memory without the cap
    (the run passes Fuyou's fitted micro-batch), with activation checkpointing."""
    capped = False

    def __init__(self, spec):
        super().__init__(spec)
        self.build(spec["layers"], True)
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        self.info = {"layers": spec["layers"], "params": sum(p.numel() for p in self.net.parameters()),
                     "micro": self.micro, "accum": self.accum, "checkpointing": True, "capped": False}


class Ceiling(InGPU):
    """The largest depth that trains in the capped GPU memory, and at that depth the fastest
    micro-batch (with or without checkpointing) that fits; the step's tokens stay the run's."""

    def __init__(self, spec):
        super().__init__(spec)
        self.tokens_per_step = spec["micro"] * spec["accum"] * spec["seq"]
        self.failed: list[tuple] = []  # (layers, checkpointing, micro) that ran out of memory in a run
        self.search(spec["max_layers"])

    def micros(self):
        top = min(self.spec["ceiling_micro_max"], max(1, self.tokens_per_step // self.spec["seq"]))
        m = 1
        while m <= top:
            yield m
            m *= 2

    def search(self, max_layers: int) -> None:
        """Per depth from ``max_layers`` down: without and with checkpointing, micro-batches
        of 1, 2, 4... sequences until one does not fit 90% of the cap (a long run needs more
        than the probe); the first depth where any fits is the ceiling, with its fastest."""
        tried = []
        self.cap(0.9)
        for layers in range(max_layers, 0, -1):
            fitted = []
            for ckpt in (False, True):
                for micro in self.micros():
                    if any(f[:2] == (layers, ckpt) and f[2] <= micro for f in self.failed):
                        break
                    rate = self.trial(layers, ckpt, micro)
                    tried.append({"layers": layers, "checkpointing": ckpt, "micro": micro, "tokens_per_s": rate})
                    if rate is None:
                        break
                    fitted.append((rate, ckpt, micro))
            if fitted:
                _, ckpt, micro = max(fitted)
                if self.built != (layers, ckpt):
                    self.build(layers, ckpt)
                self.micro, self.accum = micro, max(1, self.tokens_per_step // (micro * self.spec["seq"]))
                self.cap()
                self.info = {"layers": layers, "checkpointing": ckpt, "micro": self.micro, "accum": self.accum,
                             "params": sum(p.numel() for p in self.net.parameters()), "tried": tried,
                             "failed_in_run": [list(f) for f in self.failed]}
                return
        raise RuntimeError(f"not even one layer trains within the cap: {tried}")

    def trial(self, layers: int, ckpt: bool, micro: int) -> float | None:
        """Tokens/s of ``micro``-sequence micro-batches, or None if out of memory: two steps
        of 2 micro-batches (forward, backward, the optimizer's state and step must fit),
        then the fastest of 3 micro-batches timed one by one (their gradients discarded;
        the fastest, as ZeRO-Infinity's set-up may share the GPU meanwhile)."""
        torch = self.torch
        try:
            if self.built != (layers, ckpt):
                self.build(layers, ckpt)
            self.micro = micro
            for _ in range(2):
                Case.iteration(self, 2)
            seconds = []
            for _ in range(3):
                self.sync()
                t = time.perf_counter()
                self.micro_batch(self.batch())
                self.sync()
                seconds.append(time.perf_counter() - t)
            self.opt.zero_grad(set_to_none=True)
            return micro * self.spec["seq"] / min(seconds)
        except torch.OutOfMemoryError:
            self.net = self.opt = self.built = None
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
            return None

    def iteration(self, accum: int | None = None, profiler=None, count: bool = False) -> dict:
        """On running out of memory in a long run, the search again without that
        configuration (reported), and the iteration again (counted again)."""
        for _ in range(4):
            try:
                return dict(super().iteration(accum, profiler, count), layers=self.info["layers"],
                            checkpointing=self.info["checkpointing"], params=self.info["params"])
            except self.torch.OutOfMemoryError:
                self.failed.append((self.info["layers"], self.info["checkpointing"], self.micro))
            self.net = self.opt = self.built = None
            self.search(self.info["layers"])
            accum, count = None, True
        raise RuntimeError("the ceiling kept running out of memory")

"""bench/gpu.py's probes of the machine, run in the run's own process once per round beside
the SSD's: PCIe bandwidth each way and the host's fp32 add rate (a model of the iteration,
bench/gpu_model.py, is calibrated from these).

* ``pcie_h2d_GBps`` / ``pcie_d2h_GBps``: one copy of ``nbytes`` (1 GiB by default) between
  pinned host memory and the GPU, ``copy_(non_blocking=True)`` timed by CUDA events, after
  one untimed copy; the median of ``repeats``. CUDA only.
* ``host_add_GBps``: ``a.add_(b)`` on two fp32 host tensors of ``nbytes`` each (what host
  gradient accumulation does), counted as 3 x ``nbytes`` (two read, one written) per add,
  torch's intra-op threads, after one untimed add; the median of ``repeats``. Runs with
  ``--cpu`` too (a real figure of this host, unlike the smoke test's others)."""
from __future__ import annotations

import statistics
import time


class Probes:
    def __init__(self, nbytes: int, cuda: bool, repeats: int = 5):
        import torch
        self.torch, self.cuda, self.repeats, self.nbytes = torch, cuda, repeats, nbytes
        n = max(1, nbytes // 4)
        self.a, self.b = torch.ones(n), torch.full((n,), 1e-3)
        self.host = self.dev = None
        if cuda:
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def info(self) -> dict:
        return {"probe_bytes": self.nbytes, "probe_repeats": self.repeats,
                "host_add_threads": self.torch.get_num_threads()}

    def _copy_GBps(self, dst, src) -> float:
        torch = self.torch
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return self.nbytes / statistics.median(times) / 1e9

    def host_add_GBps(self) -> float:
        self.a.add_(self.b)
        times = []
        for _ in range(self.repeats):
            t = time.perf_counter()
            self.a.add_(self.b)
            times.append(time.perf_counter() - t)
        self.a.fill_(1.0)
        return 3 * self.a.numel() * 4 / statistics.median(times) / 1e9

    def run(self) -> dict:
        out = {"host_add_GBps": self.host_add_GBps()}
        if self.cuda:
            out["pcie_h2d_GBps"] = self._copy_GBps(self.dev, self.host)
            out["pcie_d2h_GBps"] = self._copy_GBps(self.host, self.dev)
        return out

    def close(self) -> None:
        self.a = self.b = self.host = self.dev = None
        if self.cuda:
            self.torch.cuda.empty_cache()

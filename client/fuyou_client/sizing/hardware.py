"""The host a plan is for: its GPU (a shipped profile, one measured here, or none: the
CPU computes), host memory and the daemon's pinned budget, SSDs, CPU cores, and the rates
the iteration model needs. Every rate carries where it came from: ``measured`` (on this
kind of hardware, with the run that measured it) or ``assumed`` (and why), so that a
plan is never silently optimistic.

Strings a person types are parsed here too: ``2x7GB/s`` (two SSDs of 7 GB/s each way),
``128GiB``.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

GB, GiB = 1e9, 1 << 30
H100_RUN = "bench/results/gpu-h100.json"


class HostError(ValueError):
    """A resource that cannot be: zero or negative, a GPU profile not known, an unreadable size."""


@dataclass(frozen=True)
class Rate:
    value: float
    source: str  # "measured: ..." or "assumed: ..."

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")


@dataclass(frozen=True)
class GpuProfile:
    """A GPU as the iteration model sees it. ``kernel_tflops``: the bf16 FLOP rate while a
    block's kernels run; ``pass_gap_s``: the GPU's idle time per forward or backward pass
    of a block (launches, syncs); both from the ceiling run of ``bench/gpu.py`` where one
    exists. ``device_factor``: the measured peak device memory of that run over the
    model's estimate of it (scales every estimate)."""
    name: str
    memory: int
    peak_tflops: float  # dense bf16, the datasheet's
    kernel_tflops: Rate
    pass_gap_s: Rate
    pcie_h2d: Rate  # GB/s
    pcie_d2h: Rate
    hbm: float = 2600.0  # GB/s of a device copy
    device_factor: float = 1.0
    source: str = ""

    @property
    def efficiency(self) -> float:
        return self.kernel_tflops.value / self.peak_tflops


# The H100's rates come from its ceiling run (bench/results/gpu-h100.json: a 2048-wide
# GPT-2 block, micro-batches of 2 x 1024 tokens, recomputed) through bench/gpu_model.py's
# calibration; tests/test_sizing.py checks these numbers against that run.
H100_KERNEL_TFLOPS = 225.31
H100_PASS_GAP_S = 1.913e-4
H100_DEVICE_FACTOR = 1.1593
_EFFICIENCY = H100_KERNEL_TFLOPS / 989.4
_MEASURED_PCIE = f"measured: 54 GB/s each way on the H100 host ({H100_RUN}'s session, docs/performance.md)"


def _scaled(name: str, memory: int, peak: float, pcie: float, pcie_source: str, source: str) -> GpuProfile:
    """A GPU no run here has measured: the H100's measured share of its peak, at the
    datasheet's peak; the H100's per-pass idle time."""
    eff = (f"assumed: the H100's measured {_EFFICIENCY:.1%} of peak ({H100_RUN}: 2048-wide blocks, 2 x 1024-token "
           f"micro-batches) at this GPU's datasheet peak of {peak:g} TFLOPS")
    return GpuProfile(name, memory, peak, Rate(peak * _EFFICIENCY, eff),
                      Rate(H100_PASS_GAP_S, f"assumed: the H100's measured idle time per pass ({H100_RUN})"),
                      Rate(pcie, pcie_source), Rate(pcie, pcie_source), source=source)


_GEN4 = "assumed: PCIe 4.0 x16, about 25 GB/s of its 32 each way"
PROFILES: dict[str, GpuProfile] = {
    "h100": GpuProfile("h100", 80 * GiB, 989.4, Rate(H100_KERNEL_TFLOPS, f"measured: {H100_RUN} (ceiling run)"),
                       Rate(H100_PASS_GAP_S, f"measured: {H100_RUN} (ceiling run)"),
                       Rate(54.0, _MEASURED_PCIE), Rate(54.0, _MEASURED_PCIE), device_factor=H100_DEVICE_FACTOR,
                       source="NVIDIA H100 SXM5 80 GB: 989.4 dense bf16 TFLOPS (NVIDIA H100 datasheet); "
                              f"rates measured in {H100_RUN}"),
    "h200": _scaled("h200", 141 * 10**9, 989.4, 55.3,
                    "measured: 55.3 GB/s each way on the H200 host (bench/results/gpu-h200/gpu-bench-35999d1.json)",
                    "NVIDIA H200 SXM 141 GB: 989 dense bf16 TFLOPS (NVIDIA H200 datasheet)"),
    "a100": _scaled("a100", 80 * GiB, 312.0, 25.0, _GEN4,
                    "NVIDIA A100 SXM 80 GB: 312 dense bf16 TFLOPS (NVIDIA A100 datasheet)"),
    "rtx4090": _scaled("rtx4090", 24 * GiB, 165.2, 25.0, _GEN4,
                       "NVIDIA GeForce RTX 4090 24 GB: 165.2 dense bf16 TFLOPS with fp32 accumulate (NVIDIA Ada "
                       "Lovelace architecture whitepaper, appendix table)"),
    "l40s": _scaled("l40s", 48 * GiB, 362.05, 25.0, _GEN4,
                    "NVIDIA L40S 48 GB: 362 dense bf16 TFLOPS (NVIDIA L40S datasheet)"),
}


def gpu_profile(name: str) -> GpuProfile:
    key = name.lower().replace("-", "").replace(" ", "").replace("geforce", "").replace("nvidia", "")
    key = {"4090": "rtx4090", "h10080gb": "h100", "a10080gb": "a100"}.get(key, key)
    if key not in PROFILES:
        raise HostError(f"no GPU profile {name!r}: the planner has {', '.join(PROFILES)} (or --gpu-from a bench/gpu.py "
                        "result measured on your GPU)")
    return PROFILES[key]


@dataclass(frozen=True)
class Disks:
    """The daemon's SSD array: ``count`` devices of ``capacity`` bytes, each reading and
    writing at these GB/s (the array: ``count`` times that)."""
    count: int
    capacity: int
    read: Rate
    write: Rate

    @property
    def read_gbps(self) -> float:
        return self.count * self.read.value

    @property
    def write_gbps(self) -> float:
        return self.count * self.write.value


@dataclass(frozen=True)
class Host:
    gpu: GpuProfile | None  # None: the CPU computes (what this project's CPU runs measure)
    memory: int  # host RAM
    disks: Disks
    cores: int
    pinned_budget: int | None = None  # the daemon's [memory] pinned_budget (default: half of memory)
    buffer_budget: int = 1 << 30  # the daemon's [optimizer] buffer_budget
    buffers: int = 6  # the daemon's [optimizer] buffers
    segment: int = 64 << 20  # the daemon's [memory] segment_size
    adam: Rate = Rate(1.14e9, "measured: the daemon's AdamW kernel on the 2-core reference host "
                              "(docs/performance.md), taken to scale with cores")
    host_add: Rate = Rate(124.0, "measured: an fp32 add on the H100 host, 124 GB/s of memory traffic "
                                 "(docs/performance.md)")
    sources: dict = field(default_factory=dict)  # how each field was found: given, probed, default

    def __post_init__(self):
        for name, value in (("memory", self.memory), ("cores", self.cores), ("SSD count", self.disks.count),
                            ("SSD capacity", self.disks.capacity), ("SSD read rate", self.disks.read.value),
                            ("SSD write rate", self.disks.write.value), ("buffer budget", self.buffer_budget),
                            ("optimizer buffers", self.buffers)):
            if not (value > 0 and math.isfinite(value)):
                raise HostError(f"{name} must be a finite number more than zero, not {value}")
        if self.pinned_budget is not None and not self.pinned_budget > 0:
            raise HostError(f"pinned budget must be more than zero, not {self.pinned_budget}")
        if self.gpu is not None and not self.gpu.memory > 0:
            raise HostError(f"GPU memory must be more than zero, not {self.gpu.memory}")

    @property
    def pinned(self) -> int:
        """The daemon's pinned budget: as configured, else its default (half of RAM)."""
        return self.pinned_budget if self.pinned_budget is not None else self.memory // 2

    @property
    def adam_rate(self) -> float:
        return self.adam.value * max(1, self.cores) / 2

    def replace(self, **changes) -> "Host":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        gpu = f"{self.gpu.name} ({self.gpu.memory / GiB:.0f} GiB)" if self.gpu else "none (the CPU computes)"
        d = self.disks
        return (f"GPU {gpu}; host memory {self.memory / GiB:.0f} GiB (pinned budget {self.pinned / GiB:.0f} GiB); "
                f"{d.count} SSD(s) of {d.capacity / 1e12:.2f} TB{' free' if self.sources.get('ssd') == 'probed' else ''}"
                f" at {d.read.value:.3g}/{d.write.value:.3g} GB/s read/write each; {self.cores} CPU cores")


_SSD = re.compile(r"^\s*(?:(\d+)\s*[x*]\s*)?([\d.]+)\s*(?:GB/s)?(?:\s*/\s*([\d.]+)\s*(?:GB/s)?)?\s*$", re.I)


def parse_ssd(text: str) -> tuple[int, float, float]:
    """``"2x7GB/s"`` -> (2, 7.0, 7.0); ``"4x7/5GB/s"``: 7 read, 5 write each."""
    m = _SSD.match(text)
    if not m:
        raise HostError(f"--ssd {text!r}: expected COUNTxREAD[/WRITE] in GB/s per device, e.g. 2x7GB/s or 4x7/5GB/s")
    count, read = int(m.group(1) or 1), float(m.group(2))
    write = float(m.group(3)) if m.group(3) else read
    if count <= 0 or read <= 0 or write <= 0:
        raise HostError(f"--ssd {text!r}: the count and the rates must be more than zero")
    return count, read, write


def parse_bytes(text: str, what: str) -> int:
    from fuyou_proto.units import parse_size
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise HostError(f"{what}: {exc}") from None
    if value <= 0:
        raise HostError(f"{what} must be more than zero, not {text!r}")
    return value


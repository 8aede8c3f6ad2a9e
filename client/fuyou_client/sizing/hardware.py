"""The host a plan is for: its GPU (a shipped profile, one measured here, or none: the
CPU computes), host memory and the daemon's pinned budget, SSDs, CPU cores, and the rates
the iteration model needs. Every rate carries where it came from: ``measured`` (on this
kind of hardware, with the run that measured it), ``published`` (a datasheet or a public
benchmark, named), ``fitted`` (on the runs recorded here, named), ``given`` or ``assumed``
(and why), so that a plan is never silently optimistic.

Strings a person types are parsed here too: ``2x7GB/s`` (two SSDs of 7 GB/s each way),
``128GiB``.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from fuyou_client.sizing.kernels import LAUNCH_S, GpuKernels

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
    """A GPU as the iteration model sees it: its datasheet (memory, dense bf16 peak in
    TFLOPS, memory bandwidth in GB/s), what its kernels reach of them (``gemm_efficiency``:
    large bf16 GEMMs' share of the peak, from a published measurement;
    ``attention_efficiency``: fused attention's), the host's issue time per kernel
    (``launch_s``) and PCIe each way. kernels.GpuKernels
    prices a block's kernels with these (``kernels``)."""
    name: str
    memory: int
    peak_tflops: float  # dense bf16 with fp32 accumulation, the datasheet's
    hbm: float  # GB/s, the datasheet's memory bandwidth
    gemm_efficiency: Rate
    attention_efficiency: Rate
    launch_s: Rate
    pcie_h2d: Rate  # GB/s
    pcie_d2h: Rate
    source: str = ""

    @property
    def kernels(self) -> GpuKernels:
        return GpuKernels.of(self)


_MEASURED_PCIE = f"measured: 54 GB/s each way on the H100 host ({H100_RUN}'s session, docs/performance.md)"
_GEN4 = "assumed: PCIe 4.0 x16, about 25 GB/s of its 32 each way"
# Large bf16 GEMMs' share of the dense peak, measured with torch.matmul by others:
MAMF = ("Stas Bekman, Machine Learning Engineering Open Book, compute/accelerator/README.md, \"Maximum "
        "Achievable Matmul FLOPS comparison table\" (BF16, mean of 100 iterations, best shape of a search)")
TORCH_PERF = "github.com/zzc0721/torch-performance-test-data"
_FA2_HOPPER = Rate(0.35, "published: FlashAttention-2 reaches 35% of the H100's peak (Shah et al., FlashAttention-3, "
                         "2024); torch's SDPA flash backend is FlashAttention-2")
_FA2 = Rate(0.50, "published: FlashAttention-2 reaches 50-73% of the A100's peak forward and backward (Dao, "
                  "FlashAttention-2, 2023), the low end taken")
_FA2_ADA = Rate(0.50, "assumed: the A100's FlashAttention-2 share (50%, Dao 2023, the low end); no figure published "
                      "for this GPU")


def _launch() -> Rate:
    return Rate(LAUNCH_S, "fitted: the host's issue time per kernel on the H100 and H200 hosts' in-GPU runs "
                          f"({H100_RUN}, bench/results/gpu-h200/; bench/kernel_fit.py), taken for any host")


def _profile(name: str, memory: int, peak: float, hbm: float, gemm: Rate, attention: Rate, pcie: Rate,
             source: str) -> GpuProfile:
    return GpuProfile(name, memory, peak, hbm, gemm, attention, _launch(), pcie, pcie, source)


PROFILES: dict[str, GpuProfile] = {
    "h100": _profile("h100", 80 * GiB, 989.4, 3350.0,
                     Rate(794.5 / 989.4, f"published: 794.5 of 989 TFLOPS (80.3%) on an H100 SXM, torch 2.7.0 ({MAMF})"),
                     _FA2_HOPPER, Rate(54.0, _MEASURED_PCIE),
                     "NVIDIA H100 SXM5 80 GB: 989.4 dense bf16 TFLOPS, 3.35 TB/s HBM3 (NVIDIA H100 datasheet)"),
    "h200": _profile("h200", 141 * 10**9, 989.4, 4800.0,
                     Rate(794.5 / 989.4, f"published: the H100 SXM's 80.3%, \"H200 is the same\" ({MAMF})"),
                     _FA2_HOPPER, Rate(55.3, "measured: 55.3 GB/s each way on the H200 host "
                                             "(bench/results/gpu-h200/gpu-bench-35999d1.json)"),
                     "NVIDIA H200 SXM 141 GB: 989 dense bf16 TFLOPS, 4.8 TB/s HBM3e (NVIDIA H200 datasheet)"),
    "a100": _profile("a100", 80 * GiB, 312.0, 2039.0,
                     Rate(271.2 / 312, f"published: 271.2 of 312 TFLOPS (86.9%) on an A100 SXM, torch 2.6.0 ({MAMF})"),
                     _FA2, Rate(25.0, _GEN4),
                     "NVIDIA A100 SXM 80 GB: 312 dense bf16 TFLOPS, 2,039 GB/s HBM2e (NVIDIA A100 datasheet)"),
    "rtx4090": _profile("rtx4090", 24 * GiB, 165.2, 1008.0,
                        Rate(160.17 / 165.2, "published: torch.matmul bf16 8192 x 8192 x 8192 at 160.2 of 165.2 TFLOPS "
                                             f"(97%) on an RTX 4090, torch 2.7.0+cu128 ({TORCH_PERF}, issue 78)"),
                        _FA2_ADA, Rate(25.0, _GEN4),
                        "NVIDIA GeForce RTX 4090 24 GB: 165.2 dense bf16 TFLOPS with fp32 accumulate, 1,008 GB/s GDDR6X "
                        "(NVIDIA Ada Lovelace architecture whitepaper, appendix table)"),
    "l40s": _profile("l40s", 48 * GiB, 362.05, 864.0,
                     Rate(269.15 / 362.05, "published: torch.matmul bf16 at 269.2 of 362 TFLOPS (74%), the best of "
                                           f"its square sizes, on an L40S, torch 2.8.0+cu128 ({TORCH_PERF}, issue 43)"),
                     _FA2_ADA, Rate(25.0, _GEN4),
                     "NVIDIA L40S 48 GB: 362 dense bf16 TFLOPS, 864 GB/s GDDR6 (NVIDIA L40S datasheet)"),
}
NAMES = {"H100": "h100", "H200": "h200", "A100": "a100", "4090": "rtx4090", "L40S": "l40s"}  # in a device's name


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


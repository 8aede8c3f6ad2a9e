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


COMPUTE = ("bf16", "fp16")  # the model's dtype on the GPU: torch.bfloat16 (the default) or torch.float16
TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


@dataclass(frozen=True)
class Gemms:
    """A GPU's GEMMs in one compute dtype as torch runs them: the datasheet's dense peak
    (TFLOPS) at the accumulation torch uses, and the share of it large GEMMs reach
    (``efficiency``: a published torch.matmul measurement, named). ``source``: the peak's."""
    peak_tflops: float
    efficiency: Rate
    source: str


@dataclass(frozen=True)
class GpuProfile:
    """A GPU as the iteration model sees it: its datasheet (memory, dense bf16 peak in
    TFLOPS, memory bandwidth in GB/s), what its kernels reach of them (``gemm_efficiency``:
    large bf16 GEMMs' share of the peak, from a published measurement;
    ``attention_efficiency``: fused attention's), the host's issue time per kernel
    (``launch_s``) and PCIe each way; ``fp16``: its GEMMs in fp16 (``gemms("fp16")``).
    kernels.GpuKernels prices a block's kernels with these (``kernels``, or
    ``kernels_for(compute)``)."""
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
    fp16: Gemms | None = None  # None: as bf16 (said so in its source)

    @property
    def kernels(self) -> GpuKernels:
        return GpuKernels.of(self)

    def kernels_for(self, compute: str = "bf16") -> GpuKernels:
        return GpuKernels.of(self, compute)

    def gemms(self, compute: str = "bf16") -> Gemms:
        """The GEMMs' peak and large-GEMM share in ``compute`` ("bf16" or "fp16")."""
        if compute == "bf16":
            return Gemms(self.peak_tflops, self.gemm_efficiency, self.source)
        if compute == "fp16":
            return self.fp16 or Gemms(self.peak_tflops, Rate(self.gemm_efficiency.value, (
                "assumed: bf16's share, " + self.gemm_efficiency.source)), self.source + " (fp16 taken as bf16)")
        raise HostError(f"compute dtype {compute!r}: the planner knows {', '.join(COMPUTE)}")


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
             source: str, fp16: Gemms) -> GpuProfile:
    return GpuProfile(name, memory, peak, hbm, gemm, attention, _launch(), pcie, pcie, source, fp16)


# fp16 GEMMs as torch runs them: accumulated in fp32 (cuBLAS's CUBLAS_COMPUTE_32F) whatever
# torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction says (True by default:
# it lets split-K reductions round to fp16, not the products' accumulation; pytorch/pytorch
# issues 123157 and 123558); full fp16 accumulation needs allow_fp16_accumulation=True (torch
# 2.7 and later, False by default). So an fp16 GEMM's peak is the datasheet's fp16 figure with
# fp32 accumulate: on a GeForce Ada GPU half its fp16-accumulate figure, on the others the same.
_FP32_ACC = "with fp32 accumulate, as torch accumulates them"
_H100_FP16 = Rate(736.19 / 989.4, "published: torch.matmul fp16 8192 x 8192 x 8192 at 736.2 of 989.4 TFLOPS (74.4%) "
                                  f"on an H100 80GB HBM3, torch 2.7.0+cu128 ({TORCH_PERF}, issue 79; bf16 797.5 there)")


PROFILES: dict[str, GpuProfile] = {
    "h100": _profile("h100", 80 * GiB, 989.4, 3350.0,
                     Rate(794.5 / 989.4, f"published: 794.5 of 989 TFLOPS (80.3%) on an H100 SXM, torch 2.7.0 ({MAMF})"),
                     _FA2_HOPPER, Rate(54.0, _MEASURED_PCIE),
                     "NVIDIA H100 SXM5 80 GB: 989.4 dense bf16 TFLOPS, 3.35 TB/s HBM3 (NVIDIA H100 datasheet)",
                     Gemms(989.4, _H100_FP16, f"NVIDIA H100 SXM5: 989.4 dense fp16 TFLOPS {_FP32_ACC} (NVIDIA H100 "
                                              "datasheet: fp16 and bf16 alike)")),
    "h200": _profile("h200", 141 * 10**9, 989.4, 4800.0,
                     Rate(794.5 / 989.4, f"published: the H100 SXM's 80.3%, \"H200 is the same\" ({MAMF})"),
                     _FA2_HOPPER, Rate(55.3, "measured: 55.3 GB/s each way on the H200 host "
                                             "(bench/results/gpu-h200/gpu-bench-35999d1.json)"),
                     "NVIDIA H200 SXM 141 GB: 989 dense bf16 TFLOPS, 4.8 TB/s HBM3e (NVIDIA H200 datasheet)",
                     Gemms(989.4, Rate(_H100_FP16.value, "published: the H100's fp16 share (the same tensor cores), "
                                                         + _H100_FP16.source.removeprefix("published: ")),
                           f"NVIDIA H200 SXM: 989 dense fp16 TFLOPS {_FP32_ACC} (NVIDIA H200 datasheet)")),
    "a100": _profile("a100", 80 * GiB, 312.0, 2039.0,
                     Rate(271.2 / 312, f"published: 271.2 of 312 TFLOPS (86.9%) on an A100 SXM, torch 2.6.0 ({MAMF})"),
                     _FA2, Rate(25.0, _GEN4),
                     "NVIDIA A100 SXM 80 GB: 312 dense bf16 TFLOPS, 2,039 GB/s HBM2e (NVIDIA A100 datasheet)",
                     Gemms(312.0, Rate(271.2 / 312, "assumed: bf16's share (271.2 of 312 TFLOPS, MAMF): the same dense "
                                                    "peak, both accumulated in fp32; no fp16 torch.matmul measurement "
                                                    "of an A100 SXM named (an A100 PCIe 40GB: fp16 241.5, bf16 234.1 "
                                                    f"TFLOPS, {TORCH_PERF}, issue 108)"),
                           f"NVIDIA A100 SXM: 312 dense fp16 TFLOPS {_FP32_ACC} (NVIDIA A100 datasheet)")),
    "rtx4090": _profile("rtx4090", 24 * GiB, 165.2, 1008.0,
                        Rate(160.17 / 165.2, "published: torch.matmul bf16 8192 x 8192 x 8192 at 160.2 of 165.2 TFLOPS "
                                             f"(97%) on an RTX 4090, torch 2.7.0+cu128 ({TORCH_PERF}, issue 78)"),
                        _FA2_ADA, Rate(25.0, _GEN4),
                        "NVIDIA GeForce RTX 4090 24 GB: 165.2 dense bf16 TFLOPS with fp32 accumulate, 1,008 GB/s GDDR6X "
                        "(NVIDIA Ada Lovelace architecture whitepaper, appendix table)",
                        Gemms(165.2, Rate(155.50 / 165.2, "published: torch.matmul fp16 8192 x 8192 x 8192 at 155.5 of "
                                                          "165.2 TFLOPS (94.1%) on an RTX 4090, torch 2.7.0+cu128 "
                                                          f"({TORCH_PERF}, issue 78: bf16 160.2 in the same run)"),
                              f"NVIDIA GeForce RTX 4090: 165.2 dense fp16 TFLOPS {_FP32_ACC} (330.3 with fp16 "
                              "accumulate, which torch uses only under allow_fp16_accumulation) (NVIDIA Ada Lovelace "
                              "architecture whitepaper, appendix table)")),
    "l40s": _profile("l40s", 48 * GiB, 362.05, 864.0,
                     Rate(269.15 / 362.05, "published: torch.matmul bf16 at 269.2 of 362 TFLOPS (74%), the best of "
                                           f"its square sizes, on an L40S, torch 2.8.0+cu128 ({TORCH_PERF}, issue 43)"),
                     _FA2_ADA, Rate(25.0, _GEN4),
                     "NVIDIA L40S 48 GB: 362 dense bf16 TFLOPS, 864 GB/s GDDR6 (NVIDIA L40S datasheet)",
                     Gemms(362.05, Rate(264.02 / 362.05, "published: torch.matmul fp16 at 264.0 of 362 TFLOPS (72.9%), "
                                                         "the best of its square sizes, on an L40S, torch 2.8.0+cu128 "
                                                         f"({TORCH_PERF}, issue 43)"),
                           f"NVIDIA L40S: 362.05 dense fp16 TFLOPS {_FP32_ACC} (NVIDIA L40S datasheet; the measured "
                           "264 TFLOPS show its fp32 accumulation is not at half rate)")),
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


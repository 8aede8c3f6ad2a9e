"""What bench/gpu.py's results say of the GPU they ran on: their in-GPU cases (the capped
ceiling, Fuyou's model in GPU memory), the kernel model's time for each, the shipped
profile of their GPU, and the profile they measure (``--gpu-from``). The kernel model's
constants are fitted on these cases (bench/kernel_fit.py); iteration.calibrate reads the
rest of a result.
"""
from __future__ import annotations

from dataclasses import replace

from fuyou_client.sizing.hardware import NAMES, PROFILES, Gemms, GpuProfile, HostError, Rate
from fuyou_client.sizing.kernels import GpuKernels, Time
from fuyou_client.sizing.shape import ModelShape, from_config


def gpt2_family(width: int, layers: int, seq: int, vocab: int = 8192) -> ModelShape:
    """bench/gpu.py's model family: GPT-2 blocks, 128-wide heads, untied head."""
    return from_config({"model_type": "gpt2", "n_embd": width, "n_layer": layers, "n_head": width // 128,
                        "vocab_size": vocab, "n_positions": seq, "tie_word_embeddings": False}, "bench/gpu.py's family")


def in_gpu_runs(run: dict) -> list[dict]:
    """A bench/gpu.py result's in-GPU cases (torch's AdamW, everything in GPU memory, fp32
    parameters under bf16 autocast): the capped ``ceiling`` and, in newer runs, Fuyou's
    model in GPU memory (``inmem``), each with its depth, micro-batch, recomputation and
    time per micro-batch (``seconds``), and the share of it a kernel ran (NVML's
    utilisation, ``busy``; None where not sampled)."""
    args, out = run["args"], []
    for case, info in (("ceiling", run.get("ceiling_info")), ("inmem", run.get("inmem_info"))):
        result = run.get("results", {}).get(case)
        if not info or not result or not result.get("micro_batch_seconds"):
            continue
        out.append({"case": case, "width": args["width"], "seq": args["seq"], "layers": info["layers"],
                    "micro": info.get("micro", args["micro"]), "recompute": bool(info["checkpointing"]),
                    "seconds": result["micro_batch_seconds"], "busy": result.get("busy")})
    return out


def in_gpu_time(kernels: GpuKernels, case: dict) -> Time:
    """The kernel model's time (busy, idle) of one micro-batch of an in-GPU case."""
    shape = gpt2_family(case["width"], 1, case["seq"])
    return kernels.in_gpu_micro_batch(shape, case["layers"], case["micro"], case["seq"], case["recompute"])


def known_gpu(run: dict) -> GpuProfile:
    """The shipped profile of the GPU a bench/gpu.py run names."""
    name = str(run.get("gpu", ""))
    for part, key in NAMES.items():
        if part in name:
            return PROFILES[key]
    raise HostError(f"GPU {name.split(',')[0]!r}: no profile for it (the planner has {', '.join(PROFILES)}); the "
                    "kernel model needs its datasheet's peak and memory bandwidth")


def measured_gpu(run: dict, source: str) -> GpuProfile:
    """The run's GPU: its shipped profile's datasheet, with what its ceiling measured: the
    kernels' speed (every efficiency and the memory bandwidth scaled so that the kernel
    model's busy time is the ceiling's) and the issue time per kernel (so that its idle time
    is), PCIe where probed, memory from the device's name. Its fp16 GEMMs: the profile's
    share scaled alike."""
    base, ceiling = known_gpu(run), in_gpu_runs(run)[0]
    model = in_gpu_time(base.kernels, ceiling)
    scale = model.busy / (ceiling["busy"] * ceiling["seconds"]) if ceiling["busy"] else 1.0
    k = GpuKernels.of(base, gemm_efficiency=min(1.0, base.gemm_efficiency.value * scale),
                      attention_efficiency=min(1.0, base.attention_efficiency.value * scale),
                      hbm_gbps=base.hbm * scale)
    lo, hi = 0.0, 1e-3  # the launch floor that makes the ceiling's time
    for _ in range(50):
        mid = (lo + hi) / 2
        faster = in_gpu_time(replace(k, launch_s=mid), ceiling).seconds < ceiling["seconds"]
        lo, hi = (mid, hi) if faster else (lo, mid)
    m = f"measured: {source} (its ceiling run: the kernel model scaled by {scale:.3f})"
    mib = [int(p.split()[0]) for p in str(run.get("gpu", "")).split(",") if p.strip().endswith("MiB")]
    pcie = Rate(run["pcie_h2d_GBps"], "measured: " + source) if run.get("pcie_h2d_GBps") else \
        Rate(54.0, "assumed: 54 GB/s each way, as measured on the H100 host (this run did not probe PCIe)")
    name = str(run.get("gpu", "measured GPU")).split(",")[0]
    fp16 = base.gemms("fp16")
    fp16 = Gemms(fp16.peak_tflops, Rate(min(1.0, fp16.efficiency.value * scale), m + "; the profile's fp16 share, "
                                        + fp16.efficiency.source), fp16.source)
    return replace(base, name=name, fp16=fp16, memory=mib[0] << 20 if mib else run["gpu_cap_bytes"],
                   hbm=base.hbm * scale,
                   gemm_efficiency=Rate(k.gemm_efficiency, m), attention_efficiency=Rate(k.attention_efficiency, m),
                   launch_s=Rate(lo, f"measured: {source} (its ceiling's idle time)"), pcie_h2d=pcie,
                   pcie_d2h=Rate(run.get("pcie_d2h_GBps") or pcie.value, pcie.source),
                   source=f"{name}, measured here ({source}); peak and memory bandwidth: {base.source}")

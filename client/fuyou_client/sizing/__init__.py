"""Will it fit, and how fast? The planner: one model of a training step (memory per tier,
SSD capacity and traffic, time and what binds) for any model on any host, and a search of
the settings for the fastest plan that fits.

    plan = fuyou_client.plan("llama-70b/config.json", gpu="rtx4090", ram="128GiB", ssd="2x7GB/s", seq=4096)
    print(plan)                      # the table fuyouctl plan prints
    engine = attach(model, plan=plan)  # the options it chose

Modules: shape.py (the model), hardware.py (the host, GPU profiles, every rate's source),
probe.py (this host, measured), iteration.py (the discrete-event model of an iteration),
kernels.py (the GPU's time kernel by kernel), gpu_runs.py (what bench/gpu.py results say of
their GPU), estimate.py (one configuration: tiers, SSD bytes, time), plan_search.py (the
settings), report.py (the table), cli.py (``fuyouctl plan``).
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from fuyou_client.sizing import probe
from fuyou_client.sizing.estimate import Estimate, Settings
from fuyou_client.sizing.hardware import (COMPUTE, PROFILES, Disks, Gemms, GpuProfile, Host, HostError, Rate,
                                          gpu_profile, parse_bytes, parse_ssd)
from fuyou_client.sizing.iteration import from_gpu_run
from fuyou_client.sizing.plan_search import TOKENS_PER_STEP, Plan, search
from fuyou_client.sizing.shape import ModelShape, ShapeError, from_config, from_model, from_path, of

SSD_SIZE = 3_840_000_000_000  # assumed per device when the rates are given and the size is not
DEFAULT_SEQ = 2048


def _bytes(value, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        return parse_bytes(value, what)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HostError(f"{what} must be a positive number of bytes or a size like '128GiB', not {value!r}")
    return value


def host(gpu: str | GpuProfile | None = None, *, cpu: bool = False, gpu_from: str | os.PathLike | None = None,
         gpu_memory=None, gpu_efficiency: float | None = None, pcie: float | None = None, ram=None, pinned_budget=None, buffer_budget=None, ssd=None, ssd_size=None,
         cores: int | None = None, data_dirs: list | None = None) -> Host:
    """A Host from what is given; the rest probed here (memory, cores, the GPU, the disks
    under ``data_dirs``, default the current directory: measured)."""
    sources = {}
    if cpu:
        profile = None
    elif gpu_from is not None:
        profile = from_gpu_run(gpu_from)
    elif isinstance(gpu, GpuProfile):
        profile = gpu
    elif gpu is not None:
        profile = gpu_profile(gpu)
    else:
        profile = probe.gpu()
        sources["gpu"] = "probed" if profile else "none found: the CPU computes"
    if profile is not None and gpu_memory is not None:
        profile = dataclasses.replace(profile, memory=_bytes(gpu_memory, "GPU memory"))
    if profile is not None and pcie is not None:
        if isinstance(pcie, bool) or not isinstance(pcie, (int, float)) or not (pcie > 0 and math.isfinite(pcie)):
            raise HostError(f"PCIe rate must be a number of GB/s more than zero, not {pcie!r}")
        rate = Rate(float(pcie), "given")
        profile = dataclasses.replace(profile, pcie_h2d=rate, pcie_d2h=rate)
    if profile is not None and gpu_efficiency is not None:
        if isinstance(gpu_efficiency, bool) or not isinstance(gpu_efficiency, (int, float)) or \
                not 0 < gpu_efficiency <= 1:
            raise HostError(f"GPU efficiency is a share of the peak, in (0, 1], not {gpu_efficiency!r}")
        given = Rate(gpu_efficiency, "given")  # (whatever the compute dtype)
        profile = dataclasses.replace(profile, gemm_efficiency=given,
                                      fp16=dataclasses.replace(profile.gemms("fp16"), efficiency=given))
    mem = _bytes(ram, "host memory") or probe.memory()
    sources["memory"] = "given" if ram is not None else "probed (/proc/meminfo)"
    if ssd is not None:
        count, read, write = parse_ssd(ssd) if isinstance(ssd, str) else ssd
        size = _bytes(ssd_size, "SSD size") or SSD_SIZE
        given = "given"
        disks = Disks(count, size, Rate(read, given), Rate(write, given))
        sources["ssd"] = "given" + ("" if ssd_size else f"; size assumed {SSD_SIZE / 1e12:.2f} TB each (--ssd-size)")
    else:
        count, size, read, write = probe.disks([Path(d) for d in (data_dirs or [Path.cwd()])])
        disks = Disks(count, _bytes(ssd_size, "SSD size") or size, read, write)
        sources["ssd"] = "probed"
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores <= 0):
        raise HostError(f"CPU cores must be a positive integer, not {cores!r}")
    kwargs = {"buffer_budget": _bytes(buffer_budget, "buffer budget")} if buffer_budget is not None else {}
    return Host(profile, mem, disks, cores or os.cpu_count() or 1, _bytes(pinned_budget, "pinned budget"),
                sources=sources, **kwargs)


def model_compute(model) -> str | None:
    """The compute dtype of a model's own parameters ("bf16", "fp16"), None if they are
    neither (a config, an fp32 model)."""
    params = getattr(model, "parameters", None)
    if params is None:
        return None
    dtype = next((p.dtype for p in params() if p.is_floating_point()), None)
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(dtype))


def plan(model, *, seq: int | None = None, tokens_per_step: int = TOKENS_PER_STEP, state_dtype: str | None = None,
         micro_batch: int | None = None, offload: bool | str | None = None, compute: str | None = None,
         on: Host | None = None, **host_kwargs) -> Plan:
    """The fastest settings that fit for ``model`` (a config.json, a model directory, a
    config dict, a model (the meta device is enough), or a ModelShape) on ``on`` (a Host;
    default: ``host(**host_kwargs)``, probing what is not given). ``compute``: the model's
    dtype on the GPU, "bf16" or "fp16" (default: a model's own if it is one of them, else
    bf16; attach computes in the model's dtype)."""
    shape = of(model)
    where = on if on is not None else host(**host_kwargs)
    compute = compute or model_compute(model) or "bf16"
    if compute not in COMPUTE:
        raise ValueError(f"compute dtype must be one of {', '.join(COMPUTE)} (the model's dtype on the GPU), "
                         f"not {compute!r}")
    return search(shape, where, seq or min(DEFAULT_SEQ, shape.max_seq or DEFAULT_SEQ), tokens_per_step, state_dtype,
                  micro_batch, offload, compute=compute)


__all__ = ["plan", "host", "model_compute", "Plan", "Host", "Disks", "GpuProfile", "Gemms", "Rate", "PROFILES",
           "COMPUTE", "ModelShape", "Settings",
           "Estimate", "search", "from_config", "from_model", "from_path", "ShapeError", "HostError"]

"""``fuyouctl plan MODEL [--gpu NAME] [--ram SIZE] [--ssd COUNTxGB/s] [--seq N] ...``:
will MODEL fit this host (or the one described), with which settings, how fast.

Exit status: 0 a plan fits; 3 nothing fits (the output says the least of each resource);
1 bad input (a config it cannot read, a GPU profile it does not have, a zero resource)."""
from __future__ import annotations

import argparse
import json
import sys

from fuyou_client import sizing

NOTHING_FITS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Hugging Face config.json or a model directory holding one")
    g = p.add_argument_group("the host (what is not given is probed here)")
    g.add_argument("--gpu", help=f"a GPU profile: {', '.join(sizing.PROFILES)}")
    g.add_argument("--gpu-from", help="a bench/gpu.py result measured on your GPU (overrides the profiles)")
    g.add_argument("--gpu-memory", help="GPU memory, if not the profile's (e.g. 40GiB)")
    g.add_argument("--gpu-efficiency", type=float, help="large GEMMs' FLOP rate as a share of the GPU's peak "
                                                       "(default: the profile's, published)")
    g.add_argument("--pcie", type=float, help="GB/s each way between host and GPU (default: the profile's)")
    g.add_argument("--cpu", action="store_true", help="no GPU: the CPU computes (time is then not modelled)")
    g.add_argument("--ram", help="host memory (e.g. 128GiB)")
    g.add_argument("--pinned-budget", help="fuyoud's [memory] pinned_budget (default: half of --ram)")
    g.add_argument("--buffer-budget", help="fuyoud's [optimizer] buffer_budget (default 1GiB)")
    g.add_argument("--ssd", help="COUNTxREAD[/WRITE] GB/s per device, e.g. 2x7GB/s (default: measure the "
                                 "daemon's data directories)")
    g.add_argument("--ssd-size", help="capacity of each SSD (default: the probed file system's, or 3.84TB)")
    g.add_argument("--cores", type=int, help="CPU cores (default: this host's)")
    t = p.add_argument_group("the training")
    t.add_argument("--seq", type=int, help=f"tokens per sequence (default {sizing.DEFAULT_SEQ})")
    t.add_argument("--tokens-per-step", type=int, default=sizing.TOKENS_PER_STEP,
                   help=f"tokens per optimizer step (default {sizing.TOKENS_PER_STEP:,})")
    t.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: searched)")
    t.add_argument("--state-dtype", choices=["auto", "fp32", "bf16", "int8"], default="auto",
                   help="optimizer state dtype (auto: the most exact that fits)")
    t.add_argument("--offload", choices=["auto", "ssd", "host"], default="auto",
                   help="where the blocks' weights live (auto: searched)")
    t.add_argument("--compute", choices=list(sizing.COMPUTE), default="bf16",
                   help="the model's dtype on the GPU, which attach computes in (default bf16; fp16: torch "
                        "accumulates its GEMMs in fp32, at the profile's fp16 rate)")
    p.add_argument("--json", action="store_true", help="the plan as JSON")


def run(args, data_dirs: list | None = None, defaults: dict | None = None) -> int:
    """``defaults``: the daemon's pinned and buffer budgets where its config is known."""
    d = defaults or {}
    try:
        host = sizing.host(args.gpu, cpu=args.cpu, gpu_from=args.gpu_from, gpu_memory=args.gpu_memory,
                           gpu_efficiency=args.gpu_efficiency, pcie=args.pcie, ram=args.ram,
                           pinned_budget=args.pinned_budget or d.get("pinned_budget"),
                           buffer_budget=args.buffer_budget or d.get("buffer_budget"), ssd=args.ssd,
                           ssd_size=args.ssd_size, cores=args.cores, data_dirs=data_dirs)
        for name in ("seq", "tokens_per_step", "micro_batch"):
            if getattr(args, name) is not None and getattr(args, name) <= 0:
                raise sizing.HostError(f"--{name.replace('_', '-')} must be more than zero")
        offload = {"auto": None, "ssd": True, "host": "host"}[args.offload]
        plan = sizing.plan(args.model, seq=args.seq, tokens_per_step=args.tokens_per_step,
                           state_dtype=None if args.state_dtype == "auto" else args.state_dtype,
                           micro_batch=args.micro_batch, offload=offload, compute=args.compute, on=host)
    except (sizing.ShapeError, sizing.HostError, ValueError) as exc:
        print(f"fuyouctl plan: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(plan.to_dict(), indent=1) if args.json else plan)
    return 0 if plan.fits else NOTHING_FITS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fuyou-plan", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))

"""The model of one training iteration on a capped GPU, as bench/gpu.py runs it: where its
seconds go, calibrated on the recorded H100 run.

    python bench/gpu_model.py [--json PATH] [--from bench/results/gpu-h100.json]
                              [--width W --layers L --seq S --micro M --accum K --cap BYTES]
                              [--pcie GBps --ssd-read GBps --ssd-write GBps --host-add GBps ...]

The model itself is the product's (fuyou_client/sizing/iteration.py, the one ``fuyouctl
plan`` uses): this script gives it bench/gpu.py's model family (GPT-2 blocks, 128-wide
heads, vocabulary 8192, untied head) at a width, depth and GPU memory cap, the rates of a
bench/gpu.py run (``--from``: the ceiling's time per micro-batch, busy share and depth;
SSD read and write bandwidth; the cap and Fuyou's measured device peak; the host's
memory), and compares the schedules. Assumed, overridable by flags: PCIe 54 GB/s each way
and 124 GB/s of memory traffic for an fp32 add on the host (measured in that session:
docs/performance.md); AdamW at 1.14e9 parameters/s; an HBM copy at 2.6 TB/s.
``breakdown(Config(...))`` returns it all as a dict; docs/design/iteration-model.md
describes the two schedules.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
import fuyou_client.sizing.estimate as sizing_estimate  # noqa: E402
from fuyou_client.sizing.hardware import PROFILES, Disks, Host, Rate  # noqa: E402
from fuyou_client.sizing.iteration import (Rates, Schedule, at_ceiling_rate, calibrate,  # noqa: E402,F401
                                           gpt2_family, simulate)
from fuyoud.units import parse_size  # noqa: E402

GB, GiB = 1e9, 1 << 30
RUN = HERE / "results" / "gpu-h100.json"


@dataclass(frozen=True)
class Config(Schedule):
    """One iteration of bench/gpu.py's family to model: the product's Schedule (its
    ``schedule`` "today" is the ordinary loop; weights default to host memory) at a width,
    a depth and a GPU memory cap."""
    schedule: str = "block-major"  # or "today" (the ordinary loop)
    weights: str = "host"     # resident (on the GPU) | host (uploaded per use) | ssd (read, then uploaded)
    width: int = 2048
    layers: int = 21
    cap: int = 4 * GiB        # GPU memory

    @property
    def shape(self):
        return gpt2_family(self.width, self.layers, self.seq)

    @property
    def product(self) -> Schedule:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(Schedule)}
        return Schedule(**fields | {"schedule": "loop" if self.schedule == "today" else self.schedule})


def params(width: int, seq: int) -> tuple[int, int]:
    """Parameters of one block and of the rest (embeddings, final norm, untied head)."""
    shape = gpt2_family(width, 1, seq)
    return shape.block_params, shape.rest_params


def depth_for(width: int, seq: int, cap: int) -> int:
    """bench/gpu.py's depth: the smallest whose 16 B/param of state are at least 4x the cap."""
    block, rest = params(width, seq)
    return max(1, math.ceil((4 * cap / 16 - rest) / block))


def recorded(run: dict) -> Config:
    """The run's configuration, as "today"."""
    a = run["args"]
    return Config(schedule="today", width=a["width"], layers=run["model_layers"], seq=a["seq"], micro=a["micro"],
                  accum=a["accum"], cap=run["gpu_cap_bytes"], weights="resident")


def product_estimate(cfg: Config, r: Rates):
    """The product's estimate of this configuration's memory (sizing/estimate.py; block-major:
    every kept input in the host arena, as bench/gpu.py's host_budget keeps them): its GPU
    memory is the device plan attach makes (memory/device_plan.py)."""
    gpu = replace(PROFILES["h100"], name="capped", memory=cfg.cap, pcie_h2d=Rate(r.pcie_h2d, "run"),
                  pcie_d2h=Rate(r.pcie_d2h, "run"))  # (memory only: its rates are not used)
    host = Host(gpu, r.host_bytes or 1 << 40, Disks(1, 1 << 50, Rate(r.ssd_read, "run"), Rate(r.ssd_write, "run")),
                16, pinned_budget=r.host_bytes or 1 << 40)
    offload = {"resident": False, "host": "host", "ssd": True}[cfg.weights]
    s = sizing_estimate.Settings(seq=cfg.seq, micro_batch=cfg.micro, micro_batches=cfg.accum,
                                 schedule="loop" if cfg.schedule == "today" else "block-major", offload=offload)
    kept = sizing_estimate.kept_inputs(cfg.shape, s, 2)
    s = replace(s, host_budget=kept or None)
    return sizing_estimate.estimate(cfg.shape, s, host, simulate_time=False)


def device_estimate(cfg: Config, r: Rates) -> float:
    """Peak bytes on the GPU: the device plan's."""
    return product_estimate(cfg, r).memory["gpu"]


def host_needed(cfg: Config, r: Rates) -> float:
    """Host memory the product's estimate gives this configuration."""
    return product_estimate(cfg, r).memory["host_total"]


def breakdown(config: Config | dict, rates: Rates | None = None) -> dict:
    """Where each second of one iteration of ``config`` goes, and the bytes on each link
    (``rates`` default: calibrated on bench/results/gpu-h100.json)."""
    cfg = config if isinstance(config, Config) else Config(**config)
    r = rates or calibrate(load(RUN))
    out = {"config": dataclasses.asdict(cfg), **simulate(cfg.shape, cfg.product, r)}
    out["over_ceiling"] = out["model_tflops"] / r.ceiling_tflops
    peak = device_estimate(cfg, r)
    # today: the run's own peak, under its cap, is the estimate's scale; block-major: bench/gpu.py's
    # searches leave 10% spare
    fits = peak <= cfg.cap if cfg.schedule == "today" else peak <= 0.9 * cfg.cap
    host = host_needed(cfg, r)
    kept = sizing_estimate.kept_inputs(cfg.shape, sizing_estimate.Settings(
        seq=cfg.seq, micro_batch=cfg.micro, micro_batches=cfg.accum, schedule="block-major"), 2)
    out.update({"device_peak_bytes": peak, "fits_device": fits,
                "host_arena_bytes": 0 if cfg.schedule == "today" else kept, "host_bytes_needed": host,
                "fits_host": host <= 0.9 * r.host_bytes})
    return out


@functools.lru_cache(maxsize=None)
def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


TIMED = ("micro_batch_seconds", "step_seconds", "model_tflops")  # what the model reproduces (calibration_error)


def kernel_share(cfg: Config, rates: Rates, got: dict) -> float | None:
    """The share of the iteration the model's own kernels run (NVML's kind of busy: the
    launches' waits left out) for "today" (the loop, weights resident): per micro-batch each
    block's forward, again before its backward, its backward, the tail, each group's
    gradients flattened to fp32. None without a kernel model."""
    k = rates.gpu
    if k is None or cfg.schedule != "today":
        return None
    shape, m, seq = cfg.shape, cfg.micro, cfg.seq
    fwd, bwd = (k.block_pass(shape, m, seq, w, rates.precision).busy for w in ("forward", "backward"))
    tail = sum(k.tail_pass(shape, m, seq, p, rates.precision).busy for p in ("forward", "input_grad", "weight_grad"))
    flatten = 6 * got["params"] / rates.hbm / GB
    return cfg.accum * (cfg.layers * (2 * fwd + bwd) + tail + flatten) / got["iteration_seconds"]


def calibration(run: dict, rates: Rates) -> dict:
    """The model of "today" against the run: the relative error of each measured figure;
    ``calibration_error`` the largest of the timed ones (TIMED), which the model reproduces.
    NVML's busy share is bounded, not reproduced (``gpu_busy_bounds``): from below by the
    share the model's own kernels run; from above by the compute stream's share plus the
    time the model has it waiting on the host path, where kernels the model does not know of
    (Fuyou's own, beyond the model's) could run without changing the micro-batch's time."""
    cfg = recorded(run)
    got, fuyou = breakdown(cfg, rates), run["results"]["fuyou"]
    pairs = {"micro_batch_seconds": (got["micro_batch_seconds"], fuyou["micro_batch_seconds"]),
             "step_seconds": (got["step_seconds"], fuyou["step_seconds"]),
             "model_tflops": (got["model_tflops"], fuyou["tflops"]), "gpu_busy": (got["gpu_busy"], fuyou["busy"])}
    errors = {k: abs(m / v - 1) for k, (m, v) in pairs.items()}
    stalled = sum(v for k, v in got["seconds"].items() if k.startswith("gpu stalled")) / got["iteration_seconds"]
    kernels = kernel_share(cfg, rates, got)
    bounds = (kernels if kernels is not None else got["gpu_busy"], got["gpu_busy"] + stalled)
    return {"model": {k: m for k, (m, _) in pairs.items()}, "run": {k: v for k, (_, v) in pairs.items()},
            "relative_error": errors, "calibration_error": max(errors[k] for k in TIMED),
            "model_kernel_share": kernels, "gpu_busy_bounds": bounds,
            "gpu_busy_within_bounds": bounds[0] <= fuyou["busy"] <= bounds[1]}


def choose(base: Config, rates: Rates, min_tokens: int = 300_000, tolerance: float = 0.03) -> dict:
    """Block-major's micro-batch and K, from ``min_tokens`` to the base's tokens per step, fitting
    the GPU and the host: the smallest micro-batch within ``tolerance`` of the fastest (it leaves
    the GPU's memory more to spare, where its estimate is least sure), then the fastest."""
    fits = []
    for micro in (1, 2, 4, 8, 16, 32):
        k = math.ceil(min_tokens / (micro * base.seq))
        while k * micro * base.seq <= max(min_tokens, base.tokens):
            cfg = replace(base, schedule="block-major", micro=micro, accum=k)
            on_gpu = device_estimate(cfg, rates) <= 0.9 * cfg.cap  # (before simulating it)
            if on_gpu and (got := breakdown(cfg, rates))["fits_host"]:
                fits.append(got)
            k = 1 << k.bit_length() if k & (k - 1) else 2 * k  # the next power of two
    if not fits:
        raise ValueError(f"no micro-batch of block-major fits {base.cap} bytes of GPU memory")
    best = max(b["model_tflops"] for b in fits)
    return min((b for b in fits if b["model_tflops"] >= (1 - tolerance) * best),
               key=lambda b: (b["config"]["micro"], -b["model_tflops"]))


def candidates(base: Config, rates: Rates, search: bool = True) -> dict:
    """Each schedule at ``base``'s model and tokens per step (block-major's micro-batch: chosen
    if ``search``, else the base's)."""
    today = replace(base, schedule="today", weights="resident", overlap=False)
    bm = replace(base, schedule="block-major", weights="host")
    bm = choose(bm, rates) if search else breakdown(bm, rates)
    cfg = Config(**bm["config"])
    return {"today": breakdown(today, rates),
            "today, download and add overlapped": breakdown(replace(today, overlap=True), rates),
            "large micro-batches (4x, weights in host memory)": breakdown(
                replace(today, weights="host", micro=base.micro * 4, accum=max(1, base.accum // 4)), rates),
            "block-major": bm,
            "block-major, weights on SSD": breakdown(replace(cfg, weights="ssd"), rates),
            "block-major, bf16 gradients, state of block 0 and the rest in host memory":
                breakdown(replace(cfg, grad_bytes=2, host_state=("first", "rest")), rates)}


def table(rows: dict) -> str:
    """Per schedule: its figures, its seconds by cause, its bytes by link."""
    lines = []
    for name, b in rows.items():
        c = b["config"]
        lines += [f"\n== {name}: {b['params'] / 1e9:.3f}B params ({c['width']} x {c['layers']}), {c['micro']} x "
                  f"{c['seq']} tokens x {c['accum']} = {b['tokens']:,} tokens/step, weights {c['weights']}"
                  + ("" if b["fits_device"] else "  ** does not fit the GPU **"),
                  f"   iteration {b['iteration_seconds']:.2f} s, {b['model_tflops']:.1f} model TFLOPS = "
                  f"{b['over_ceiling']:.3f}x ceiling, GPU busy {b['gpu_busy']:.3f}, host additions "
                  f"{b['host_additions']}" + (f", micro-batch {b['micro_batch_seconds'] * 1e3:.1f} ms, step "
                                              f"{b['step_seconds']:.2f} s" if "micro_batch_seconds" in b else "")]
        lines += [f"   {k:<62} {v:8.3f} s {v / b['iteration_seconds']:6.1%}" for k, v in b["seconds"].items()]
        lines += [f"   {k:<62} {v / GB:8.2f} GB" for k, v in b["bytes"].items()]
        lines += [f"   {'host memory traffic (PCIe, SSD, additions, AdamW)':<62} "
                  f"{b['host_memory_traffic_bytes'] / GB:8.2f} GB",
                  f"   SSD {b['ssd_bytes_per_param']:.1f} B/param; PCIe {b['pcie_bytes'] / GB:.1f} GB, of which "
                  f"weights and gradients {b['pcie_weights_and_gradients_bytes'] / GB:.2f}; GPU peak "
                  f"{b['device_peak_bytes'] / GiB:.2f} GiB; host {b['host_bytes_needed'] / GiB:.1f} GiB "
                  f"(arena {b['host_arena_bytes'] / GiB:.1f})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--from", dest="run", type=Path, default=RUN, help="the bench/gpu.py JSON to calibrate on")
    ap.add_argument("--width", type=int, help="(default: the run's; its depth: bench/gpu.py's for that width)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--micro", type=int, help="sequences per micro-batch (with --micro or --accum, block-major "
                                              "uses them rather than choosing)")
    ap.add_argument("--accum", type=int, help="micro-batches per step")
    ap.add_argument("--cap", type=parse_size, help="GPU memory (bytes, or 4GiB)")
    ap.add_argument("--wide-width", type=int, default=4096, help="the wider family predicted (default 4096)")
    overrides = {"pcie": ("pcie_h2d", "pcie_d2h"), "ssd-read": ("ssd_read",), "ssd-write": ("ssd_write",),
                 "host-add": ("host_add",), "adam": ("adam",), "kernel-tflops": ("kernel_tflops",),
                 "host-bytes": ("host_bytes",)}
    for flag, fields in overrides.items():
        ap.add_argument(f"--{flag}", type=parse_size if flag == "host-bytes" else float,
                        help=f"Rates.{fields[0]} (see its comment)")
    args = ap.parse_args(argv)
    run = load(args.run)
    rates = calibrate(run)
    for flag, fields in overrides.items():
        for name in fields * (getattr(args, flag.replace("-", "_")) is not None):
            setattr(rates, name, getattr(args, flag.replace("-", "_")))
    if args.kernel_tflops is not None:  # (the flat model: every pass at that rate, no idle)
        rates.gpu, rates.pass_gap_s = None, 0.0
    cal = calibration(run, rates)
    base = recorded(run)
    base = replace(base, **{k: v for k in ("width", "layers", "seq", "micro", "accum", "cap")
                            if (v := getattr(args, k)) is not None})
    if args.width and not args.layers:
        base = replace(base, layers=depth_for(base.width, base.seq, base.cap))
    wide = replace(base, width=args.wide_width, layers=depth_for(args.wide_width, base.seq, base.cap))
    try:
        rows = candidates(base, rates, search=args.micro is None and args.accum is None)
        wide = {"today": breakdown(wide, rates), "block-major": choose(replace(wide, schedule="block-major",
                                                                                    weights="host"), rates)}
    except ValueError as exc:
        ap.error(str(exc))
    bm, bw = rows["block-major"], wide["block-major"]
    flat = [breakdown(Config(**b["config"]), at_ceiling_rate(rates))["over_ceiling"] for b in (bm, bw)]
    print(f"calibration on {args.run.name}, today's schedule: " + ", ".join(
        f"{k} {cal['model'][k]:.4g} vs {cal['run'][k]:.4g} ({cal['relative_error'][k]:.1%})" for k in cal["model"])
        + f"; NVML's busy {cal['run']['gpu_busy']:.3f} within [{cal['gpu_busy_bounds'][0]:.3f}, "
          f"{cal['gpu_busy_bounds'][1]:.3f}] (the model's kernels; its compute stream plus its waits on the host path): "
        + ("yes" if cal["gpu_busy_within_bounds"] else "NO"))
    print(table(rows) + "\n\nwider family (4x the cap in state):" + table(wide))
    print(f"\nblock-major (predicted, not measured): {bm['model_tflops']:.1f} TFLOPS = {bm['over_ceiling']:.3f}x "
          f"the ceiling's {rates.ceiling_tflops:.1f} ({flat[0]:.3f}x if larger micro-batches were no faster per "
          f"FLOP); wider family {bw['over_ceiling']:.3f}x ({flat[1]:.3f}x)")
    targets = {}
    for label, b in (("", bm), ("wide: ", bw)):
        for name, value, met in (
                ("over ceiling >= 0.8", b["over_ceiling"], b["over_ceiling"] >= 0.8),
                ("PCIe weights and gradients GB <= 9", b["pcie_weights_and_gradients_bytes"] / GB,
                 b["pcie_weights_and_gradients_bytes"] <= 9 * GB),
                ("host additions == 0", b["host_additions"], b["host_additions"] == 0),
                ("exposed step s <= 1", b["exposed_step_seconds"], b["exposed_step_seconds"] <= 1),
                ("GPU busy >= 0.9", b["gpu_busy"], b["gpu_busy"] >= 0.9),
                (f"host GiB needed (fits 90% of {rates.host_bytes / GiB:.0f})", b["host_bytes_needed"] / GiB,
                 b["fits_host"])):
            targets[label + name] = {"value": value, "met": bool(met)}
    print("targets: " + "; ".join(f"{k}: {t['value']:.3g} ({'met' if t['met'] else 'NOT met'})"
                                  for k, t in targets.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        import datetime
        import platform
        args.json.write_text(json.dumps({
            "command": "python " + " ".join([os.path.relpath(__file__, HERE.parent),
                                             *(argv if argv is not None else sys.argv[1:])]),
            "host": {"note": "a model, computed: no rate is measured on this host", "python": platform.python_version(),
                     "machine": platform.machine()},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "calibration_error": cal["calibration_error"], "calibration": cal, "schedule": "block-major",
            "targets": targets,
            "predicted_tflops": bm["model_tflops"], "predicted_over_ceiling": bm["over_ceiling"],
            "predicted_over_ceiling_wide": bw["over_ceiling"], "predicted_wide_tflops": bw["model_tflops"],
            "predicted_over_ceiling_at_ceiling_rate": flat[0], "predicted_over_ceiling_wide_at_ceiling_rate": flat[1],
            "ceiling_tflops": rates.ceiling_tflops, "calibrated_on": os.path.relpath(args.run, HERE.parent),
            "rates": dataclasses.asdict(rates),
            "schedules": rows, "wide": wide,
            "note": "predictions of a model calibrated on one H100 run; block-major has not finished a step of bench/gpu.py on a GPU"},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training on a GPU whose memory is capped: Fuyou, the in-GPU ceiling and ZeRO-Infinity, one run.

    python bench/gpu.py --json PATH [--cap 4GiB] [--width 2048] [--seq 1024] [--micro 2] [--accum 256]
                        [--weights resident|host] [--grads host|device] [--iters 2] [--zero-accum 4]
                        [--zero-micro N] [--host-budget 9GiB] [--dir DIR] [--no-zero] [--deadline S]
                        [--profile DIR] [--ssd-probe 4GiB] [--cpu]

One model family: Hugging Face ``GPT2LMHeadModel`` (width ``--width``, 128-wide heads, vocabulary
8192, untied head, sequence ``--seq``, dropout off, random tokens), bf16 compute, fp32 AdamW state. Every case
is its own process with ``torch.cuda.set_per_process_memory_fraction`` set to ``--cap`` bytes:

* **fuyou**: the smallest depth whose weights + gradients + AdamW state (2 + 2 + 12 bytes per
  parameter) are at least 4x the cap. ``attach(offload=False, accumulation_steps=--accum,
  activations="recompute", grad_accumulation="host")`` (``--weights host``: ``offload="host"``;
  ``--grads device``: ``grad_accumulation="device"``; ``--activations auto``: the planner's choice
  per block within ``--act-device-budget`` and ``--act-host-budget``) on a private fuyoud whose shared memory
  (``--host-budget``) and optimizer buffers (``--buffer-budget``) are well below the state: the fp32 masters and
  moments live on SSD; bf16 weights stay on the GPU; each micro-batch's gradients go to fp32
  accumulators in shared memory; each layer group's step runs in the daemon as soon as the last
  micro-batch's backward has finished it. Before the rounds it fits its micro-batch: one forward
  and backward of ``--micro`` sequences within 90% of the cap, halving the micro-batch (and
  doubling the micro-batches per step) on running out of memory.
* **ceiling**: the largest depth of the same family that trains entirely in the capped GPU memory
  with ``torch.optim.AdamW(fused=True)`` (fp32 parameters, ``torch.autocast`` bf16), first without
  and then with activation checkpointing; same micro-batch and accumulation.
* **zero**: DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to NVMe (ZeRO-Infinity),
  the fuyou case's model, bf16, activation checkpointing, tuned as its documentation says (aio block
  size 1 MiB, queue depth 32, pipelined optimizer reads and writes, pinned buffers, buckets small
  enough for the cap, parameters released after use; no prefetch, see its config). It runs
  ``--zero-accum`` micro-batches per step (a step of ``--accum`` micro-batches would take many
  minutes); its time per micro-batch and per step are measured apart, and its throughput at
  ``--accum`` is computed from them (reported as such, next to what it ran).

The cases run interleaved, one iteration (``--accum`` micro-batches and the step) of each per round
after one warm-up iteration, with the SSD's bare read and write bandwidth (fuyoud's engine on a
4 GiB file, 1 MiB requests, depth 32) measured in the same rounds. Model TFLOPS = 6 x parameters
x tokens / seconds (recompute not counted); GPU busy fraction = the mean of NVML's utilisation
(share of time a kernel ran) sampled every 50 ms during the timed iterations. Medians over rounds.

``--profile DIR``: after the rounds, one more step of Fuyou and of the ceiling with the last
micro-batches and the step under torch.profiler (traces, operator tables, kernel-busy share and
longest gaps from the trace). ``--cpu``: the same run on the CPU, Fuyou through the tests'
stand-in for a device with its own memory, no cap and no DeepSpeed: a smoke test of the run
itself (tests/test_gpu_bench.py), whose numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_cases import PROFILED, REPO, VOCAB, GiB  # noqa: E402 (the workers' side: gpu_cases.py)

from fuyoud.units import parse_size  # noqa: E402

STATE_BYTES_PER_PARAM = 16  # bf16 weights + bf16 gradients + fp32 masters, exp_avg, exp_avg_sq
TARGET_CEILING, TARGET_ZERO = 0.8, 3.0


def params_of(width: int, layers: int, seq: int) -> int:
    """GPT-2's parameter count (head not tied: DeepSpeed's NVMe prefetch trips over a tied
    one): blocks, token and position embeddings, head, final norm."""
    block = 12 * width * width + 13 * width
    return layers * block + (2 * VOCAB + seq) * width + 2 * width


def fuyou_depth(width: int, seq: int, cap: int) -> int:
    layers = 1
    while params_of(width, layers, seq) * STATE_BYTES_PER_PARAM < 4 * cap:
        layers += 1
    return layers


# -- the run: workers side by side, interleaved rounds ------------------------------------------

class Worker:
    def __init__(self, name: str, spec: dict, log: Path):
        self.name, self.log, self.started = name, log, time.perf_counter()
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")  # (every case alike)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", name,
                                      "--spec", json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "w"), text=True, cwd=REPO, env=env)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        tail = self.log.read_text()[-3000:]
        raise RuntimeError(f"{self.name} worker exited ({self.proc.wait()}):\n{tail}")

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def tflops(params: int, tokens: int, seconds: float) -> float:
    return 6 * params * tokens / seconds / 1e12


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="where to write the results (required)")
    ap.add_argument("--cap", default="4GiB", type=parse_size, help="GPU memory per case (default 4GiB)")
    ap.add_argument("--width", default=2048, type=int)
    ap.add_argument("--seq", default=1024, type=int)
    ap.add_argument("--micro", default=2, type=int, help="sequences per micro-batch (default 2)")
    ap.add_argument("--accum", default=256, type=int, help="micro-batches per step (default 256)")
    ap.add_argument("--zero-accum", default=4, type=int, help="micro-batches per ZeRO-Infinity step (default 4)")
    ap.add_argument("--zero-micro", default=0, type=int,
                    help="sequences per ZeRO-Infinity micro-batch (default: --micro)")
    ap.add_argument("--iters", default=2, type=int, help="timed rounds after one warm-up round (default 2)")
    ap.add_argument("--host-budget", default="9GiB", type=parse_size, help="fuyoud's pinned_budget (default 9GiB)")
    ap.add_argument("--buffer-budget", default="2560MiB", type=parse_size,
                    help="fuyoud's optimizer buffer_budget, three buffers (default 2560MiB)")
    ap.add_argument("--weights", default="resident", choices=["resident", "host"],
                    help="Fuyou's blocks' weights: on the GPU (offload=False, the default) or in host memory, "
                         "uploaded per use (offload=\"host\")")
    ap.add_argument("--grads", default="host", choices=["host", "device"],
                    help="Fuyou's grad_accumulation (default host)")
    ap.add_argument("--activations", default="recompute", choices=["recompute", "auto"],
                    help="Fuyou's activations: every block recomputed in backward (default), or the planner's "
                         "choice per block of keep, swap (host arena, then SSD) or recompute, within the two "
                         "budgets below")
    ap.add_argument("--act-device-budget", default="1GiB", type=parse_size,
                    help="with --activations auto: activation bytes on the GPU (default 1GiB)")
    ap.add_argument("--act-host-budget", default="1GiB", type=parse_size,
                    help="with --activations auto: the host arena for swapped activations (default 1GiB)")
    ap.add_argument("--dir", type=Path, help="parent of the work directory (default <repo>/.fuyou/bench)")
    ap.add_argument("--no-zero", action="store_true", help="skip ZeRO-Infinity")
    ap.add_argument("--deadline", default=0, type=float, help="stop starting rounds after this many seconds")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help=f"after the rounds, one more step of Fuyou and of the ceiling with their last {PROFILED} "
                         "micro-batches and the step under torch.profiler: gzipped Chrome traces, operator "
                         "tables and the GPU's busy share from the trace, into DIR")
    ap.add_argument("--ssd-probe", default="4GiB", type=parse_size,
                    help="file size of the bare SSD bandwidth measurement in each round (default 4GiB)")
    ap.add_argument("--cpu", action="store_true",
                    help="a smoke test of the run itself on the CPU (Fuyou through the tests' stand-in for a "
                         "device with its own memory; no cap, no ZeRO-Infinity): its numbers mean nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        from gpu_cases import worker
        worker(args.worker, json.loads(args.spec))
        return 0
    if args.json is None:
        ap.error("--json is required")
    from common import BareLoop, host_info

    started = time.perf_counter()
    work = (args.dir or REPO / ".fuyou" / "bench").resolve() / f"gpu-{os.getpid()}"
    work.mkdir(parents=True)
    layers = fuyou_depth(args.width, args.seq, args.cap)
    params = params_of(args.width, layers, args.seq)
    ceiling_max = max(1, max((L for L in range(1, layers) if params_of(args.width, L, args.seq) * STATE_BYTES_PER_PARAM <= args.cap),
                             default=1))
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    spec = dict(cap=args.cap, width=args.width, seq=args.seq, micro=args.micro, accum=args.accum,
                zero_accum=args.zero_accum, zero_micro=args.zero_micro, layers=layers, params=params, host_budget=args.host_budget,
                buffer_budget=args.buffer_budget, weights=args.weights, grads=args.grads,
                activations=args.activations, act_device_budget=args.act_device_budget,
                act_host_budget=args.act_host_budget,
                dir=str(work), max_layers=ceiling_max, cpu=args.cpu,
                profile_dir=str(args.profile.resolve()) if args.profile else None)
    gpu = "CPU smoke test (--cpu)" if args.cpu else subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.strip()
    try:
        host = host_info(work)
    except OSError as exc:  # (findmnt missing)
        host = {"error": str(exc), "cpus": os.cpu_count()}
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("worker", "spec")}
    out = {"host": host, "gpu": gpu, "args": settings,
           "gpu_cap_bytes": args.cap, "model_params": params, "model_layers": layers,
           "state_bytes": params * STATE_BYTES_PER_PARAM, "state_over_cap": params * STATE_BYTES_PER_PARAM / args.cap,
           "rounds": [], "errors": {}}
    workers: dict[str, Worker] = {}
    starting = {name: Worker(name, spec, work / f"{name}.log")  # set-ups run at once (DeepSpeed compiles)
                for name in ["ceiling", "fuyou"] + ([] if args.no_zero or args.cpu else ["zero"])}
    for name, w in starting.items():
        try:
            info = w.read()
            out[f"{name}_info"] = dict(info, start_seconds=time.perf_counter() - w.started)
            workers[name] = w
            print(f"{name}: ready in {time.perf_counter() - w.started:.0f} s {info}", flush=True)
        except RuntimeError as exc:
            out["errors"][name] = str(exc)
            print(exc, flush=True)
    disk = BareLoop(work / "ssd.dat", args.ssd_probe, 1 << 20, 32)
    try:
        for r in range(args.iters + 1 if workers else 0):
            if r and args.deadline and time.perf_counter() - started > args.deadline:
                break
            names = list(workers)
            if not names:
                break
            names = names[r % len(names):] + names[:r % len(names)]
            rnd = {"warmup": r == 0}
            for name in names:
                try:
                    rnd[name] = workers[name].ask("iter")
                    print(f"round {r} {name}: {rnd[name]}", flush=True)
                except (RuntimeError, OSError) as exc:
                    out["errors"][name] = str(exc)
                    print(f"round {r} {name}: {str(exc)[-2000:]}", flush=True)
                    workers.pop(name).close()
            rnd["ssd_write_GBps"] = args.ssd_probe / disk.run(disk.WRITE) / 1e9
            rnd["ssd_read_GBps"] = args.ssd_probe / disk.run(disk.READ) / 1e9
            out["rounds"].append(rnd)
            save(out, args)
        for name in [n for n in ("fuyou", "ceiling") if n in workers and args.profile]:
            try:
                out.setdefault("profiles", {})[name] = workers[name].ask("profile")
                print(f"profile {name}: {out['profiles'][name]}", flush=True)
            except (RuntimeError, OSError) as exc:
                out["errors"][f"{name}_profile"] = str(exc)
            save(out, args)
    finally:
        disk.close()
        for w in workers.values():
            w.close()
        shutil.rmtree(work, ignore_errors=True)
    print_table(out)
    return 0


def save(out: dict, args) -> None:
    """The results so far, summarised, to --json (after every round: a run cut short keeps them)."""
    summarize(out, args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))


def summarize(out: dict, args) -> None:
    timed = [r for r in out["rounds"] if not r["warmup"]] or out["rounds"]
    res = {}
    for name in ("ceiling", "fuyou", "zero"):
        rows = [r[name] for r in timed if name in r]
        if not rows:
            continue
        n = out["model_params"] if name != "ceiling" else rows[-1].get("params", out["ceiling_info"]["params"])
        res[name] = {"tokens_per_s": med([x["tokens"] / x["seconds"] for x in rows]),
                     "tflops": med([tflops(x.get("params", n), x["tokens"], x["seconds"]) for x in rows]),
                     "micro_batch_seconds": med([x["micro_seconds"] / x["micro_batches"] for x in rows]),
                     "step_seconds": med([x["step_seconds"] for x in rows]),
                     "busy": med([x["busy"] for x in rows]),
                     "peak_bytes": max((x["peak_bytes"] or 0) for x in rows) or None,
                     "params": n, "micro_batches_per_step": rows[0]["micro_batches"]}
    if "zero" in res:  # at Fuyou's tokens per step, from its measured micro-batch and step times
        z, micro = res["zero"], args.zero_micro or args.micro
        k = max(1, args.accum * args.micro // micro)
        tokens = k * micro * args.seq
        z["modelled_at_accum"] = {"micro_batches_per_step": k,
                                  "seconds": k * z["micro_batch_seconds"] + z["step_seconds"]}
        z["modelled_at_accum"]["tflops"] = tflops(out["model_params"], tokens, z["modelled_at_accum"]["seconds"])
    out["results"] = res
    f = res.get("fuyou", {})
    out["fuyou_tflops"] = f.get("tflops")
    out["fuyou_tokens_per_s"] = f.get("tokens_per_s")
    out["gpu_busy_fraction"] = f.get("busy")
    out["inmem_ceiling_tflops"] = res.get("ceiling", {}).get("tflops")
    out["zero_infinity_tflops"] = res["zero"]["modelled_at_accum"]["tflops"] if "zero" in res else None
    out["zero_infinity_tflops_as_run"] = res.get("zero", {}).get("tflops")
    out["ssd_read_GBps"] = med([r["ssd_read_GBps"] for r in out["rounds"]])
    out["ssd_write_GBps"] = med([r["ssd_write_GBps"] for r in out["rounds"]])
    if out["fuyou_tflops"] and out["inmem_ceiling_tflops"]:
        out["fuyou_over_ceiling"] = out["fuyou_tflops"] / out["inmem_ceiling_tflops"]
    if out["fuyou_tflops"] and out["zero_infinity_tflops"]:
        out["fuyou_over_zero_infinity"] = out["fuyou_tflops"] / out["zero_infinity_tflops"]
    out["targets_met"] = {key: (out[key] >= target if out.get(key) is not None else None)
                          for key, target in (("fuyou_over_ceiling", TARGET_CEILING),
                                              ("fuyou_over_zero_infinity", TARGET_ZERO))}


def print_table(out: dict) -> None:
    print(f"\n{out['gpu']}; cap {out['gpu_cap_bytes'] / GiB:.1f} GiB; model {out['model_params'] / 1e9:.3f}B params "
          f"({out['state_over_cap']:.2f}x the cap in weights+grads+AdamW state); SSD read {out['ssd_read_GBps']:.2f} "
          f"write {out['ssd_write_GBps']:.2f} GB/s")
    for name, r in out.get("results", {}).items():
        print(f"{name:8s} params {r['params'] / 1e6:8.1f}M  {r['tokens_per_s']:9.0f} tok/s  {r['tflops']:6.1f} TFLOPS  "
              f"busy {r['busy'] or 0:.2f}  micro {r['micro_batch_seconds'] * 1e3:7.1f} ms  "
              f"step {r['step_seconds']:6.2f} s  "
              f"peak {(r['peak_bytes'] or 0) / GiB:.2f} GiB")
    for key in ("fuyou_over_ceiling", "fuyou_over_zero_infinity", "zero_infinity_tflops"):
        print(f"{key}: {out.get(key)}")
    print(f"targets met (>= {TARGET_CEILING}x the ceiling, >= {TARGET_ZERO}x ZeRO-Infinity): {out['targets_met']}")
    for name, err in out["errors"].items():
        print(f"ERROR {name}: {err[-1500:]}")


if __name__ == "__main__":
    sys.exit(main())

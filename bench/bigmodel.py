"""A model whose training state does not fit in this machine's memory, trained through Fuyou.

    python bench/bigmodel.py --json PATH [--family gpt2|llama] [--width 2048] [--layers 1] [--mlp N]
                             [--heads 16] [--vocab 8192] [--seq 128] [--batch 1] [--steps 5]
                             [--state-dtype fp32|bf16|int8] [--activations recompute]
                             [--schedule loop|block-major] [--micro-batches K] [--host-budget BYTES]
                             [--check-loop] [--over 1.3] [--dir DIR]
                             [--pinned-budget SIZE] [--buffer-budget SIZE] [--capacity SIZE]
                             [--device cpu|cuda|stand-in] [--dtype fp32|bf16] [--tied]
                             [--cap SIZE] [--granularity auto|block|module] [--check-uncapped]
                             [--swap-blocks N]

A GPT-2-style (Hugging Face ``GPT2LMHeadModel``) or Llama-style (``LlamaForCausalLM``) model,
untied head, sized so that its fp32 weights, gradients and AdamW moments (16 bytes per
parameter) exceed the host's physical memory by at least ``--over`` (``--over 0``: exactly
``--layers``; the Llama-2-7B shape is ``--family llama --width 4096 --layers 32 --mlp 11008
--heads 32 --vocab 32000 --over 0``). It is created on the meta device and attached with
``weights="init"``: each block is initialised by the model's own ``_init_weights`` and
streamed into the daemon, so the training process never holds more than a few blocks; with
``--activations recompute`` (the default) it keeps only each block's input for backward, as
one would train a model this size. It then trains ``--steps`` steps on ``--device`` (the CPU by
default; ``cuda``: the blocks' weights stream from the SSD array to the GPU, the compute in
``--dtype``; ``stand-in``: the CUDA code path on the tests' stand-in device), with one private
fuyoud and one data directory under ``--dir``, on ``--micro-batches`` micro-batches per step, in
the ordinary loop (``accumulation_steps``) or with ``engine.train_step`` (``--schedule
block-major``; ``--host-budget`` smaller than the step's kept inputs makes it spill them to the
SSD array; ``--check-loop`` then runs the ordinary loop on the same micro-batches from the same
initial weights in a fresh daemon and checks that the losses are bitwise the same).
``--tied``: the head tied to the token embeddings (GPT-3's). ``--cap``: the compute device's
memory (the stand-in's capacity; on CUDA torch's per-process fraction), below one block's
bytes where the blocks come to it by their modules (``--granularity``, attach's; "auto"
chooses); ``--check-uncapped`` then runs the same training without the cap in a fresh daemon
and checks that the losses are bitwise the same (the device plan then takes more slots and
overlap; the arithmetic must not change). The stand-in reports its peak (what the engine
allocated on it: weight slots, gradient buffers, resident groups, kept inputs) and the
bytes up and down per step.

The daemon runs with its defaults for memory and storage unless ``--pinned-budget``,
``--buffer-budget`` or ``--capacity`` say otherwise. The script reports:

* params, state_bytes (the optimizer state on the SSD array, in the state dtype),
  physical_memory_bytes, state_over_memory;
* peak resident memory of the client and of the daemon (``VmRSS`` sampled every 50 ms and
  ``VmHWM`` at the end, shared memory included), and of the two together, sampled at the
  same instants with the shared memory counted once: peak_rss_over_state and
  resident_gib_per_billion_params (target <= 1.0);
* attach_seconds against the time to write the state at the disk's durable write bandwidth
  (attach_over_write_bound, target <= 1.2), and the time the model's own init takes just to
  draw its weights from torch's CPU generator (attach_init_draw_seconds: each Linear's
  kaiming draw and the Hugging Face init's normal one, in one stream, as a CPU build draws
  them; with ``weights="init"`` attach cannot be faster): attach_over_floor is attach
  against the larger of the two;
* seconds per step, the optimizer phase of each step (first group step submitted to last
  group step done; the share of it the disk had I/O in flight, from /proc/diskstats:
  optimizer_disk_busy) against its SSD bound (the state read once at the bare read bandwidth and
  written once at the durable write bandwidth, measured before and after the run with
  fuyoud's own I/O engine, a write pass timed until its fdatasync has returned, as each step's
  new state is synced before its commit): optimizer_over_ssd_bound (target <= 1.15);
* on CUDA: model TFLOPS per step (6 x parameters x tokens / seconds), the GPU's busy share
  (NVML utilisation sampled every 50 ms) and its peak allocated memory;
* ssd_bytes_per_param_per_iter (the daemon's own count), the same by cause
  (bytes_by_cause: the client's weight reads in forward and in backward, the optimizer's
  state reads and writes, spilled inputs), the memory plan attach chose, and the losses,
  which should fall.

It checks free disk first (the state, a new version of the largest group while it is
written, and headroom) and refuses clearly when there is not enough. Work files are removed at
the end unless ``--keep-files``. Not part of the test suite: it needs tens of GB of disk and
many minutes (``tests/test_bigmodel_bench.py`` runs it on a tiny model with ``--over 0``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bigmodel_shapes import default_mlp, group_sizes, model_params  # noqa: E402
from common import BareLoop, gbps, host_info  # noqa: E402

from fuyou_proto.contract import state_object_bytes  # noqa: E402
from fuyoud.storage.device import keep_free_default  # noqa: E402
from fuyoud.units import format_size, parse_size  # noqa: E402

STATE_BYTES_PER_PARAM = 16  # fp32 weights, gradients, exp_avg, exp_avg_sq: what --over compares with memory
TARGET_RSS_GIB_PER_B, TARGET_OPT, TARGET_ATTACH = 1.0, 1.15, 1.2
WORKER = HERE / "bigmodel_worker.py"


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def size_model(args, memory: int) -> tuple[int, int]:
    """The layers needed for state > --over x memory (at least --layers)."""
    layers = args.layers

    def count(n: int) -> int:
        return model_params(args.family, args.width, n, args.vocab, args.seq, args.mlp, args.tied, args)
    while STATE_BYTES_PER_PARAM * count(layers) < args.over * memory:
        layers += 1
    return layers, count(layers)


class RssSampler:
    """Peak resident memory, sampled in a thread: of each process (VmRSS), and of the two
    together at the same instant with the shared memory counted once (the daemon maps and
    prefaults every segment of its pool, the client maps them and touches what it uses:
    client RssAnon + RssFile + daemon VmRSS, each process's fields read at once), with what
    made up that peak
    (``at_peak``: each process's anonymous, file and shared pages, and when: CLOCK_MONOTONIC,
    as the worker stamps its events)."""

    def __init__(self, interval: float = 0.05):
        self.pids: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.at_peak: dict = {}
        self.phases: dict[str, int] = {}  # the peak of both together in each phase (mark)
        self._phase_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, args=(interval,))
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            now = {}
            for name, pid in list(self.pids.items()):
                status = read_statuses(pid)  # (one read: the fields of one instant)
                if "VmRSS" in status:
                    now[name] = status
                    self.peak[name] = max(self.peak.get(name, 0), status["VmRSS"])
            if len(now) == 2:  # the client's own pages, and the daemon's with every segment
                both = now["client"]["RssAnon"] + now["client"]["RssFile"] + now["daemon"]["VmRSS"]
                self._phase_peak = max(self._phase_peak, both)
                if both > self.peak.get("together", 0):
                    self.peak["together"] = both
                    self.at_peak = {f"{name}_{key}": now[name].get(key, 0) for name in now
                                    for key in ("RssAnon", "RssFile", "RssShmem")}
                    self.at_peak["monotonic"] = time.monotonic()

    def mark(self, phase: str) -> None:
        """The peak of both together since the last mark is ``phase``'s."""
        self.phases[phase], self._phase_peak = self._phase_peak, 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def read_statuses(pid: int) -> dict[str, int]:
    """The memory fields of /proc/PID/status (bytes), read at once; {} if it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in lines)
            if k.startswith(("Vm", "Rss")) and v.strip().endswith("kB")}


def bare_bandwidth(directory: Path, size: int) -> dict:
    loop = BareLoop(directory / "bare.bin", size, 1 << 20, 32)
    try:
        loop.run(loop.WRITE, durable=True)  # (untimed: the fresh file's unwritten extents)
        durable = loop.run(loop.WRITE, durable=True)
        write = loop.run(loop.WRITE)
        os.fdatasync(loop.fd)
        read = loop.run(loop.READ)
    finally:
        loop.close()
        (directory / "bare.bin").unlink(missing_ok=True)
    return {"read_gbps": gbps(size, read), "write_gbps": gbps(size, write), "durable_write_gbps": gbps(size, durable)}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--family", choices=["gpt2", "llama", "qwen3-moe"], default="gpt2")
    p.add_argument("--experts", type=int, default=128, help="qwen3-moe: routed experts per block")
    p.add_argument("--experts-per-token", type=int, default=8, help="qwen3-moe: experts a token takes")
    p.add_argument("--moe-mlp", type=int, default=768, help="qwen3-moe: an expert's MLP width")
    p.add_argument("--kv-heads", type=int, help="qwen3-moe: key-value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, help="qwen3-moe: a head's width (default: width / heads)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=1, help="at least this many blocks (more to reach --over)")
    p.add_argument("--mlp", type=int, help="MLP width (default: GPT-2's 4 w, Llama's 8/3 w rounded up to 256)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"], default="fp32")
    p.add_argument("--prefetch", type=int, help="attach(prefetch=...) (default: the memory plan's)")
    p.add_argument("--host-budget", help="attach(host_budget=...) (default: the memory plan's)")
    p.add_argument("--schedule", choices=["loop", "block-major"], default="loop")
    p.add_argument("--micro-batches", type=int, default=1, help="per step (accumulation_steps, or train_step's)")
    p.add_argument("--check-loop", action="store_true",
                   help="with --schedule block-major: also run the ordinary loop and compare the losses bitwise")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--activations", default="recompute", choices=["keep", "recompute", "swap", "auto"],
                   help="attach(activations=...) for the blocks (default recompute)")
    p.add_argument("--over", type=float, default=1.3, help="state bytes over physical memory, at least")
    p.add_argument("--dir", help="work directory (default: a new one under <repo>/.fuyou/bench)")
    p.add_argument("--buffer-budget", help="the daemon's [optimizer] buffer_budget (default: the daemon's)")
    p.add_argument("--pinned-budget", help="the daemon's [memory] pinned_budget (default: the daemon's)")
    p.add_argument("--capacity", help="the daemon's [storage] capacity_per_device (default: the daemon's)")
    p.add_argument("--bare-size", default="2GiB", help="file size of the bare bandwidth measurement")
    p.add_argument("--keep-files", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda", "stand-in"], default="cpu",
                   help="where the model computes (stand-in: the CUDA code path on the tests' stand-in device)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the model's compute dtype")
    p.add_argument("--tied", action="store_true", help="the head tied to the token embeddings (GPT-3's)")
    p.add_argument("--cap", help="the compute device's memory (the stand-in's capacity; CUDA: a per-process cap)")
    p.add_argument("--granularity", choices=["auto", "block", "module", "expert"],
                   help="attach's (default: its own, auto)")
    p.add_argument("--swap-blocks", type=int, default=0,
                   help="attach(swap_blocks=...): blocks train_step swaps instead of recomputing (block-major)")
    p.add_argument("--check-uncapped", action="store_true",
                   help="then the same run without --cap in a fresh daemon: the losses must be bitwise the same")
    args = p.parse_args(argv)
    args.mlp = args.mlp or default_mlp(args.family, args.width)
    if args.check_loop and args.schedule != "block-major":
        p.error("--check-loop compares a block-major run with the loop: pass --schedule block-major")
    if args.check_uncapped and not args.cap:
        p.error("--check-uncapped compares a run under --cap with one without it: pass --cap")
    if args.cap and args.device == "cpu":
        p.error("--cap caps a device with its own memory: pass --device stand-in or cuda")
    return args


def disk_name(directory: Path) -> str | None:
    """The block device under ``directory`` as /proc/diskstats names it (vda), or None."""
    source = host_info(directory).get("fs_source") or ""
    return Path(source).name if source.startswith("/dev/") else None


def daemon_config(args) -> dict:
    """The daemon's config: its defaults, but for what the command line sets."""
    config: dict = {}
    for section, key, value in (("memory", "pinned_budget", args.pinned_budget),
                                ("optimizer", "buffer_budget", args.buffer_budget),
                                ("storage", "capacity_per_device", args.capacity)):
        if value is not None:
            config.setdefault(section, {})[key] = value
    return config


def train(args, layers: int, work: Path, sampler: "RssSampler", schedule: str, tag: str,
          capped: bool = True) -> tuple[dict, list, int]:
    """One run in a fresh daemon: (events by kind, step events, the daemon's peak)."""
    import fuyou_client

    daemon = fuyou_client.start_daemon(work / f"state-{tag}", config=daemon_config(args))
    try:
        sampler.pids["daemon"] = daemon.pid
        child = {"family": args.family, "width": args.width, "layers": layers, "heads": args.heads,
                 "mlp": args.mlp, "vocab": args.vocab, "seq": args.seq, "batch": args.batch, "steps": args.steps,
                 "experts": args.experts, "experts_per_token": args.experts_per_token, "moe_mlp": args.moe_mlp,
                 "kv_heads": args.kv_heads or args.heads, "head_dim": args.head_dim or args.width // args.heads,
                 "lr": args.lr, "prefetch": args.prefetch, "activations": args.activations,
                 "state_dtype": args.state_dtype, "schedule": schedule, "micro_batches": args.micro_batches,
                 "host_budget": parse_size(args.host_budget) if args.host_budget else None,
                 "socket": daemon.socket, "disk": disk_name(work), "device": args.device, "dtype": args.dtype,
                 "tied": args.tied, "granularity": args.granularity, "swap_blocks": args.swap_blocks or None,
                 "cap": parse_size(args.cap) if args.cap and capped else None}
        proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(child)], stdout=subprocess.PIPE, text=True)
        sampler.pids["client"] = proc.pid
        steps, events = [], {}
        for line in proc.stdout:
            event = json.loads(line)
            events[event["event"]] = event
            if event["event"] == "step":
                steps.append(event)
                print(f"  [{tag}] step {len(steps)}: loss {event['loss']:.4f}, {event['seconds']:.1f} s "
                      f"(optimizer {event['optimizer']:.1f} s), SSD {format_size(event['read'])} read, "
                      f"{format_size(event['written'])} written", flush=True)
                print(f"  [{tag}] {json.dumps(event)}", flush=True)  # (all of it: a run cut short keeps its steps)
            elif event["event"] == "attached":
                sampler.mark(f"{tag}: attach")
                print(f"  [{tag}] attached from the meta device in {event['seconds']:.1f} s\n{event['plan']}",
                      flush=True)
            elif event["event"] == "done":
                sampler.mark(f"{tag}: training")
        if proc.wait() != 0:
            raise RuntimeError(f"the training process failed (exit code {proc.returncode}): "
                               f"{events.get('error', {}).get('error', 'see its output above')}")
        return events, steps, read_statuses(daemon.pid).get("VmHWM", 0)
    finally:
        sampler.pids.pop("client", None)
        sampler.pids.pop("daemon", None)
        daemon.stop()


CAUSES = ("forward_weight_reads", "backward_weight_reads", "spilled_inputs_written", "spilled_inputs_read",
          "swapped_activations_written", "swapped_activations_read")


def by_cause(step: dict, params: int) -> dict:
    """A step's SSD bytes per parameter by cause: what the client read itself (weights in
    forward and backward, spilled inputs and swapped activations back), what it wrote
    (spilled inputs, swapped activations), and the rest of the daemon's count: the
    optimizer's state reads and writes."""
    client_read = step["forward_weight_reads"] + step["backward_weight_reads"] + step["spilled_inputs_read"] \
        + step["swapped_activations_read"]
    out = {key: step[key] / params for key in CAUSES}
    out["optimizer_state_read"] = (step["read"] - client_read) / params
    out["optimizer_state_written"] = (step["written"] - step["spilled_inputs_written"]
                                      - step["swapped_activations_written"]) / params
    out["masters_handed_to_steps"] = step["masters_handed"] / params
    out["backward_weights_served_from_state"] = step["backward_weights_served"] / params
    return out


def main(argv=None) -> int:
    args = parse(argv)
    memory = physical_memory()
    layers, params = size_model(args, memory)
    state = sum(state_object_bytes("adamw", args.state_dtype, n) for n in group_sizes(args, layers))
    parent = Path(args.dir) if args.dir else REPO / ".fuyou" / "bench"
    parent.mkdir(parents=True, exist_ok=True)
    bare_size = parse_size(args.bare_size)
    free = shutil.disk_usage(parent).free
    largest = max(state_object_bytes("adamw", args.state_dtype, n) for n in group_sizes(args, layers))
    # (a compute dtype other than fp32: each offloaded block's weights are an object of their own;
    # fuyoud also keeps keep_free bytes of the file system free: its default here)
    weights = sum(group_sizes(args, layers)[:-1]) * 2 if args.dtype == "bf16" else 0
    need = state + weights + 3 * largest + bare_size + (256 << 20) + keep_free_default(parent)
    if free < need:
        print(f"bigmodel: {parent} has {format_size(free)} free; this run needs {format_size(need)} "
              f"({params / 1e9:.2f}B parameters: {format_size(state)} of AdamW state ({args.state_dtype}) on SSD, "
              f"{format_size(weights)} of the blocks' {args.dtype} weights, new versions of the groups being "
              "stepped, what fuyoud keeps free, and headroom). Free space or pass --dir on a larger disk.",
              file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bigmodel-", dir=parent))
    print(f"bigmodel: {params / 1e9:.2f}B parameters ({args.family}, {layers} x {args.width}), fp32 training state "
          f"{format_size(STATE_BYTES_PER_PARAM * params)} = {STATE_BYTES_PER_PARAM * params / memory:.2f}x physical "
          f"memory {format_size(memory)}; {args.state_dtype} optimizer state {format_size(state)} in {work}",
          flush=True)
    result = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "params": params, "family": args.family, "layers": layers, "width": args.width, "mlp": args.mlp,
              "vocab": args.vocab, "seq": args.seq, "batch": args.batch, "micro_batches": args.micro_batches,
              "schedule": args.schedule, "activations": args.activations, "state_dtype": args.state_dtype,
              "device": args.device, "dtype": args.dtype, "gpu": gpu_name() if args.device == "cuda" else None,
              "daemon_config": daemon_config(args) or "defaults", "state_bytes": state,
              "physical_memory_bytes": memory, "state_over_memory": STATE_BYTES_PER_PARAM * params / memory,
              "host": host_info(work)}
    sampler = RssSampler()
    try:
        bare = [bare_bandwidth(work, bare_size)]
        events, steps, daemon_hwm = train(args, layers, work, sampler, args.schedule, args.schedule)
        client_peak = max(sampler.peak.get("client", 0), events["done"]["vmhwm"])
        daemon_peak = max(sampler.peak.get("daemon", 0), daemon_hwm)
        together = sampler.peak.get("together", client_peak + daemon_peak)
        bare.append(bare_bandwidth(work, bare_size))
        if args.check_uncapped:
            shutil.rmtree(work / f"state-{args.schedule}", ignore_errors=True)
            _, uncapped_steps, _ = train(args, layers, work, sampler, args.schedule, "uncapped", capped=False)
            result["uncapped_losses"] = [s["losses"] for s in uncapped_steps]
            result["uncapped_steps"] = uncapped_steps
        if args.check_loop:
            shutil.rmtree(work / f"state-{args.schedule}", ignore_errors=True)
            shutil.rmtree(work / "state-uncapped", ignore_errors=True)
            try:
                _, loop_steps, _ = train(args, layers, work, sampler, "loop", "loop")
                result["loop_losses"] = [s["losses"] for s in loop_steps]
            except RuntimeError as exc:  # (the loop may not fit where block-major does: recorded, not fatal)
                result["loop_error"] = str(exc)
                print(f"  [loop] failed: {exc}", flush=True)
    finally:
        sampler.stop()
        if not args.keep_files:
            shutil.rmtree(work, ignore_errors=True)
    read_bw = statistics.median(b["read_gbps"] for b in bare) * 1e9
    write_bw = statistics.median(b["write_gbps"] for b in bare) * 1e9
    durable_bw = statistics.median(b["durable_write_gbps"] for b in bare) * 1e9
    bound = state / read_bw + state / durable_bw
    cached_bound = state / read_bw + state / write_bw
    attach_bound = state / durable_bw
    timed = steps[1:] or steps  # the first step also pays for first-touch page faults
    optimizer = statistics.median(s["optimizer"] for s in timed)
    gib_per_b = together / 2**30 / (params / 1e9)
    tokens = args.batch * args.seq * args.micro_batches
    if args.device == "cuda":
        result.update({
            "tokens_per_step": tokens,
            "model_tflops": statistics.median(6 * params * tokens / s["seconds"] for s in timed) / 1e12,
            "model_tflops_by_step": [6 * params * tokens / s["seconds"] / 1e12 for s in steps],
            "gpu_busy_fraction": statistics.median(s["gpu_busy"] for s in timed if s.get("gpu_busy") is not None)
            if any(s.get("gpu_busy") is not None for s in timed) else None,
            "gpu_peak_bytes": max(s.get("gpu_peak_bytes") or 0 for s in steps)})
    result.update({
        "attach_seconds": events["attached"]["seconds"], "attach_write_bound_seconds": attach_bound,
        "attach_over_write_bound": events["attached"]["seconds"] / attach_bound,
        # weights="init" draws every weight from torch's one CPU generator stream (bitwise what
        # a CPU build gets): at this machine's rate that alone is this long, whatever the disk.
        "attach_init_draw_seconds": events["attached"]["init_draw_seconds"],
        "attach_over_floor": events["attached"]["seconds"] / max(attach_bound,
                                                                  events["attached"]["init_draw_seconds"]),
        "memory_plan": {k: events["attached"][k] for k in ("plan", "plan_bytes", "prefetch", "weight_slots",
                                                           "grad_buffers", "handoff", "host_budget",
                                                           "chunked_groups", "groups", "device_plan",
                                                           "device_plan_fixed_bytes", "device_budget_bytes",
                                                           "granularity")},
        "device_peak_bytes": events["done"].get("device_peak_bytes"),
        "device_capacity_bytes": events["done"].get("device_capacity_bytes"),
        "pcie_bytes_per_step": {"up": statistics.median(s.get("pcie_up", 0) for s in timed),
                                "down": statistics.median(s.get("pcie_down", 0) for s in timed)},
        "peak_rss_client_bytes": client_peak, "peak_rss_daemon_bytes": daemon_peak,
        "peak_rss_together_bytes": together, "peak_rss_over_state": together / (STATE_BYTES_PER_PARAM * params),
        "peak_rss_together_parts": sampler.at_peak,
        "peak_rss_together_by_phase": sampler.phases,
        "resident_gib_per_billion_params": gib_per_b,
        "seconds_per_step": statistics.median(s["seconds"] for s in timed),
        "optimizer_seconds": optimizer, "ssd_bound_seconds": bound, "optimizer_over_ssd_bound": optimizer / bound,
        "optimizer_disk_busy": statistics.median(s["optimizer_disk_busy"] for s in timed),
        "ssd_cached_bound_seconds": cached_bound, "optimizer_over_ssd_cached_bound": optimizer / cached_bound,
        "ssd_bytes_per_param_per_iter": statistics.median((s["read"] + s["written"]) / params for s in timed),
        "bytes_by_cause": {key: statistics.median(by_cause(s, params)[key] for s in timed)
                           for key in by_cause(timed[0], params)},
        "bare": bare, "losses": [s["loss"] for s in steps], "steps": steps,
        "targets": {"resident_gib_per_billion_params": TARGET_RSS_GIB_PER_B, "optimizer_over_ssd_bound": TARGET_OPT,
                    "attach_over_write_bound": TARGET_ATTACH},
    })
    result["targets_met"] = {
        "resident_gib_per_billion_params": gib_per_b <= TARGET_RSS_GIB_PER_B,
        "optimizer_over_ssd_bound": result["optimizer_over_ssd_bound"] <= TARGET_OPT,
        "attach_over_write_bound": result["attach_over_write_bound"] <= TARGET_ATTACH,
        "loss_falls": len(steps) > 1 and steps[-1]["loss"] < steps[0]["loss"]}
    if args.check_loop:
        result["targets_met"]["block_major_bitwise_loop"] = \
            result.get("loop_losses") == [s["losses"] for s in steps]
    if args.check_uncapped:
        result["targets_met"]["capped_bitwise_uncapped"] = \
            result.get("uncapped_losses") == [s["losses"] for s in steps]
        cap = parse_size(args.cap)
        result["targets_met"]["device_below_cap"] = (result["device_peak_bytes"] or 0) <= cap if \
            args.device == "stand-in" else None
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"params {params / 1e9:.2f}B; peak RSS client {format_size(client_peak)}, daemon "
          f"{format_size(daemon_peak)}, together (shared memory once) {format_size(together)} = {gib_per_b:.2f} GiB "
          f"per billion parameters (target <= {TARGET_RSS_GIB_PER_B}); attach {result['attach_seconds']:.0f} s = "
          f"{result['attach_over_write_bound']:.2f}x writing the state durably (target <= {TARGET_ATTACH}); "
          f"{result['seconds_per_step']:.1f} s/step, optimizer {optimizer:.1f} s = "
          f"{result['optimizer_over_ssd_bound']:.2f}x its SSD bound {bound:.1f} s (target <= {TARGET_OPT}); "
          f"{result['ssd_bytes_per_param_per_iter']:.2f} SSD bytes/param/iter "
          f"({', '.join(f'{k} {v:.2f}' for k, v in result['bytes_by_cause'].items() if v)}); losses "
          f"{', '.join(f'{x:.3f}' for x in result['losses'])}"
          + (f"; block-major bitwise the loop: {result['targets_met']['block_major_bitwise_loop']}"
             if args.check_loop else "")
          + (f"; under the {args.cap} cap (device peak {format_size(result['device_peak_bytes'] or 0)}, "
             f"{result['memory_plan']['granularity']}) bitwise uncapped: "
             f"{result['targets_met']['capped_bitwise_uncapped']}" if args.check_uncapped else "")
          + (f"; GPU: {result['model_tflops']:.1f} model TFLOPS, busy {result['gpu_busy_fraction']}, peak "
             f"{format_size(result['gpu_peak_bytes'])}" if args.device == "cuda" else ""))
    return 0


def gpu_name() -> str:
    import torch
    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, {p.total_memory >> 20} MiB, torch {torch.__version__}"


if __name__ == "__main__":
    sys.exit(main())

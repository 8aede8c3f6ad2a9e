"""A model whose training state does not fit in this machine's memory, trained through Fuyou.

    python bench/bigmodel.py --json PATH [--width 2048] [--layers 1] [--vocab 8192] [--seq 128]
                             [--batch 1] [--steps 5] [--prefetch 1] [--over 1.3] [--dir DIR]
                             [--buffer-budget 1GiB] [--pinned-budget 4GiB] [--activations recompute]

A GPT-2-style model (Hugging Face ``GPT2LMHeadModel``, untied head) is sized so that its fp32
weights, gradients and AdamW moments (16 bytes per parameter) exceed the host's physical memory
by at least ``--over`` (2.1B parameters on a 24 GiB host). It is created on the meta device and
attached with ``weights="init"``: each block is initialised by the model's own ``_init_weights``
and streamed into the daemon, so the training process never holds more than a few blocks; with
``--activations recompute`` (the default) it keeps only each block's input for backward, as
one would train a model this size (``keep`` holds every block's activations: about 40 MB a
block at width 2048 and 128 tokens, 1.6 GB for 41 blocks, and the allocator keeps more). It
then trains ``--steps`` steps on the CPU (one private fuyoud, one data directory under ``--dir``),
and the script reports:

* params, state_bytes (16 per parameter), physical_memory_bytes, state_over_memory;
* peak resident memory of the client and of the daemon (``VmRSS`` sampled every 50 ms and
  ``VmHWM`` at the end, shared memory included), and of the two together, sampled at the
  same instants with the shared memory counted once: peak_rss_over_state (target <= 0.12);
* seconds per step, the optimizer phase of each step (first group step submitted to last group
  step done) against its SSD bound (12 bytes per parameter read and 12 written at the bare
  read and durable write bandwidths of the same directory, measured before and after the run
  with fuyoud's own I/O engine, a write pass timed until its fdatasync has returned, as each
  step's new state is synced before its commit): optimizer_over_ssd_bound (target <= 1.15),
  and against the bound with cached writes (no sync): optimizer_over_ssd_cached_bound;
* ssd_bytes_per_param_per_iter (the daemon's own count) and the losses, which should fall.

It checks free disk first (the state, a new version of the largest group while it is written,
and headroom) and refuses clearly when there is not enough. Work files are removed at the end
unless ``--keep-files``. Not part of the test suite: it needs tens of GB of disk and many minutes
(``tests/test_bigmodel_bench.py`` runs it on a tiny model with ``--over 0``).
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from common import BareLoop, gbps, host_info  # noqa: E402

from fuyoud.units import format_size, parse_size  # noqa: E402

STATE_BYTES_PER_PARAM = 16  # fp32 weights, gradients, exp_avg, exp_avg_sq
OPT_BYTES_EACH_WAY = 12  # an AdamW step reads and writes weights and both moments
TARGET_RSS, TARGET_OPT = 0.12, 1.15

# The training process: builds the model on the meta device, attaches it, trains, reports.
CHILD = r"""
import json, sys, time, torch, transformers
import fuyou_client
args = json.loads(sys.argv[1])
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_embd=args["width"], n_layer=args["layers"], n_head=args["heads"],
                              vocab_size=args["vocab"], n_positions=args["seq"], tie_word_embeddings=False,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
with torch.device("meta"):
    model = transformers.GPT2LMHeadModel(cfg)
params = sum(p.numel() for p in model.parameters())
t0 = time.perf_counter()
engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=args["lr"], weight_decay=0.01), socket=args["socket"],
                             namespace="bigmodel", weights="init", offload=True, prefetch=args["prefetch"],
                             activations=args["activations"])
attach_s = time.perf_counter() - t0
print(json.dumps({"event": "attached", "params": params, "seconds": attach_s}), flush=True)
gen = torch.Generator().manual_seed(1)
batch = torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=gen)  # one batch, learnt
sga = engine.session.step_group_async
times = []
def timed(name, *a, **kw):
    fut = sga(name, *a, **kw)
    rec = [time.perf_counter(), None]
    fut.add_done_callback(lambda _f, rec=rec: rec.__setitem__(1, time.perf_counter()))
    times.append(rec)
    return fut
engine.session.step_group_async = timed
for step in range(args["steps"]):
    times.clear()
    st0 = engine.session.status()
    t0 = time.perf_counter()
    loss = model(batch, labels=batch).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    engine.step()
    t3 = time.perf_counter()
    engine.zero_grad()
    st1 = engine.session.status()
    print(json.dumps({"event": "step", "loss": loss.item(), "seconds": t3 - t0, "forward": t1 - t0,
                      "backward": t2 - t1, "exposed": t3 - t2,
                      "optimizer": max(r[1] for r in times) - min(r[0] for r in times),
                      "read": st1.bytes_read - st0.bytes_read, "written": st1.bytes_written - st0.bytes_written}),
          flush=True)
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"event": "done", "vmhwm": peak}), flush=True)
engine.close(materialize=False)
"""


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpt2_params(width: int, layers: int, vocab: int, seq: int) -> int:
    block = 12 * width * width + 13 * width  # attention (4 w^2 + 4 w), MLP (8 w^2 + 5 w), two norms (4 w)
    return layers * block + vocab * width + seq * width + 2 * width + vocab * width  # wte, wpe, ln_f, lm_head


def size_model(args, memory: int) -> tuple[int, int]:
    """The layers needed for state > --over x memory (at least --layers)."""
    layers = args.layers
    while STATE_BYTES_PER_PARAM * gpt2_params(args.width, layers, args.vocab, args.seq) < args.over * memory:
        layers += 1
    return layers, gpt2_params(args.width, layers, args.vocab, args.seq)


class RssSampler:
    """Peak resident memory, sampled in a thread: of each process (VmRSS), and of the two
    together at the same instant with the shared memory counted once (the client maps every
    segment of the daemon's pool: client VmRSS + daemon VmRSS - daemon RssShmem)."""

    def __init__(self, interval: float = 0.05):
        self.pids: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, args=(interval,))
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            now = {}
            for name, pid in list(self.pids.items()):
                rss = read_status(pid, "VmRSS")
                if rss is not None:
                    now[name] = rss
                    self.peak[name] = max(self.peak.get(name, 0), rss)
            if len(now) == 2:
                both = now["client"] + now["daemon"] - (read_status(self.pids["daemon"], "RssShmem") or 0)
                self.peak["together"] = max(self.peak.get("together", 0), both)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def read_status(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=1, help="at least this many blocks (more to reach --over)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prefetch", type=int, default=1, help="attach(prefetch=...): blocks fetched ahead")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--activations", default="recompute", choices=["keep", "recompute", "swap", "auto"],
                   help="attach(activations=...) for the blocks (default recompute)")
    p.add_argument("--over", type=float, default=1.3, help="state bytes over physical memory, at least")
    p.add_argument("--dir", help="work directory (default: a new one under <repo>/.fuyou/bench)")
    p.add_argument("--buffer-budget", default="1GiB", help="the daemon's [optimizer] buffer_budget")
    p.add_argument("--pinned-budget", default="4GiB", help="the daemon's [memory] pinned_budget")
    p.add_argument("--bare-size", default="2GiB", help="file size of the bare bandwidth measurement")
    p.add_argument("--keep-files", action="store_true")
    args = p.parse_args(argv)

    memory = physical_memory()
    layers, params = size_model(args, memory)
    state = STATE_BYTES_PER_PARAM * params
    # attach refuses an array with less than twice the state free (each step writes a group's
    # new version before the old one goes; attach does not know how many run at once).
    headroom = max(64 << 20, OPT_BYTES_EACH_WAY * params // 20)
    capacity = 2 * (OPT_BYTES_EACH_WAY * params + 4096 * (layers + 1) * 3) + headroom
    capacity = (capacity + (1 << 20) - 1) >> 20 << 20
    parent = Path(args.dir) if args.dir else REPO / ".fuyou" / "bench"
    parent.mkdir(parents=True, exist_ok=True)
    bare_size = parse_size(args.bare_size)
    free = shutil.disk_usage(parent).free
    need = capacity + bare_size
    if free < need:
        print(f"bigmodel: {parent} has {format_size(free)} free; this run needs {format_size(need)} "
              f"({params / 1e9:.2f}B parameters: {format_size(OPT_BYTES_EACH_WAY * params)} of AdamW state on SSD, "
              "twice that free for new versions, and headroom). Free space or pass --dir on a larger disk.",
              file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bigmodel-", dir=parent))
    print(f"bigmodel: {params / 1e9:.2f}B parameters ({layers} x {args.width}), state {format_size(state)} = "
          f"{state / memory:.2f}x physical memory {format_size(memory)}; SSD {format_size(capacity)} in {work}",
          flush=True)
    import fuyou_client

    result = {"params": params, "layers": layers, "width": args.width, "vocab": args.vocab, "seq": args.seq,
              "batch": args.batch, "activations": args.activations, "buffer_budget": args.buffer_budget,
              "pinned_budget": args.pinned_budget, "state_bytes": state, "physical_memory_bytes": memory,
              "state_over_memory": state / memory, "host": host_info(work)}
    daemon = None
    sampler = RssSampler()
    try:
        bare = [bare_bandwidth(work, bare_size)]
        daemon = fuyou_client.start_daemon(work / "state", config={
            "storage": {"capacity_per_device": capacity},
            "memory": {"pinned_budget": args.pinned_budget},
            "optimizer": {"buffer_budget": args.buffer_budget}})
        sampler.pids["daemon"] = daemon.pid
        child_args = {"width": args.width, "layers": layers, "heads": args.heads, "vocab": args.vocab,
                      "seq": args.seq, "batch": args.batch, "steps": args.steps, "lr": args.lr,
                      "prefetch": args.prefetch, "activations": args.activations,
                      "socket": daemon.socket}
        proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(child_args)], stdout=subprocess.PIPE,
                                text=True)
        sampler.pids["client"] = proc.pid
        steps, events = [], {}
        for line in proc.stdout:
            event = json.loads(line)
            events[event["event"]] = event
            if event["event"] == "step":
                steps.append(event)
                print(f"  step {len(steps)}: loss {event['loss']:.4f}, {event['seconds']:.1f} s "
                      f"(optimizer {event['optimizer']:.1f} s), SSD {format_size(event['read'])} read, "
                      f"{format_size(event['written'])} written", flush=True)
            elif event["event"] == "attached":
                print(f"  attached from the meta device in {event['seconds']:.1f} s", flush=True)
        if proc.wait() != 0:
            raise RuntimeError(f"the training process failed (exit code {proc.returncode}); see its output above")
        daemon_hwm = read_status(daemon.pid, "VmHWM") or 0
        bare.append(bare_bandwidth(work, bare_size))
    finally:
        sampler.stop()
        if daemon is not None:
            daemon.stop()
        if not args.keep_files:
            shutil.rmtree(work, ignore_errors=True)
    read_bw = statistics.median(b["read_gbps"] for b in bare) * 1e9
    write_bw = statistics.median(b["write_gbps"] for b in bare) * 1e9
    durable_bw = statistics.median(b["durable_write_gbps"] for b in bare) * 1e9
    bound = OPT_BYTES_EACH_WAY * params / read_bw + OPT_BYTES_EACH_WAY * params / durable_bw
    cached_bound = OPT_BYTES_EACH_WAY * params / read_bw + OPT_BYTES_EACH_WAY * params / write_bw
    client_peak = max(sampler.peak.get("client", 0), events["done"]["vmhwm"])
    daemon_peak = max(sampler.peak.get("daemon", 0), daemon_hwm)
    together = sampler.peak.get("together", client_peak + daemon_peak)
    timed = steps[1:] or steps  # the first step also pays for first-touch page faults
    optimizer = statistics.median(s["optimizer"] for s in timed)
    result.update({
        "attach_seconds": events["attached"]["seconds"],
        "peak_rss_client_bytes": client_peak, "peak_rss_daemon_bytes": daemon_peak,
        "peak_rss_together_bytes": together,
        "peak_rss_over_state": together / state,
        "seconds_per_step": statistics.median(s["seconds"] for s in timed),
        "optimizer_seconds": optimizer, "ssd_bound_seconds": bound, "optimizer_over_ssd_bound": optimizer / bound,
        "ssd_cached_bound_seconds": cached_bound, "optimizer_over_ssd_cached_bound": optimizer / cached_bound,
        "ssd_bytes_per_param_per_iter": statistics.median((s["read"] + s["written"]) / params for s in timed),
        "bare": bare, "losses": [s["loss"] for s in steps], "steps": steps,
        "targets": {"peak_rss_over_state": TARGET_RSS, "optimizer_over_ssd_bound": TARGET_OPT},
    })
    result["targets_met"] = {"peak_rss_over_state": result["peak_rss_over_state"] <= TARGET_RSS,
                             "optimizer_over_ssd_bound": result["optimizer_over_ssd_bound"] <= TARGET_OPT,
                             "loss_falls": len(steps) > 1 and steps[-1]["loss"] < steps[0]["loss"]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"params {params / 1e9:.2f}B, state {state / memory:.2f}x memory; peak RSS client "
          f"{format_size(client_peak)}, daemon {format_size(daemon_peak)}, together (shared memory once) "
          f"{format_size(together)} = {result['peak_rss_over_state']:.3f}x state (target <= {TARGET_RSS}); {result['seconds_per_step']:.1f} s/step, optimizer "
          f"{optimizer:.1f} s = {result['optimizer_over_ssd_bound']:.2f}x its SSD bound {bound:.1f} s (target <= "
          f"{TARGET_OPT}); {result['ssd_bytes_per_param_per_iter']:.1f} SSD bytes/param/iter; losses "
          f"{', '.join(f'{x:.3f}' for x in result['losses'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

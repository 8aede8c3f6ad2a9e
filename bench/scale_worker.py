"""One rank of bench/scale.py: trains GPT-2 through ``attach(offload=False)`` (``--offload``:
``attach(offload=True)``) and writes what it saw.

    python bench/scale_worker.py --out DIR [--layers 8 --width 768 --vocab 50257 --seq 128 --batch 2
                                           --dtype fp32 --warmup 2 --iters 3 --namespace NS --offload]

Run as it is for one process (attach then runs single-process), or under torchrun (gloo;
the world from torchrun's environment), each rank with OMP_NUM_THREADS=1 and its host's
daemon at $FUYOUD_SOCKET (the client's default socket: what a real job would use).

Why a separate process per run rather than one long-lived worker: a process group cannot be
resized, and keeping nine ranks of a ~95M-parameter model alive across configurations would
not fit this machine beside the daemons. Every rank builds the same model (seed 0; attach
broadcasts rank 0's weights anyway) and trains on its own random batches.

The measured window is bracketed identically on every rank: barrier, wait until the daemon
is quiet (bench/common.quiet_counters: a step's read-ahead or write may trail ``engine.step()``),
read the counters, barrier. Inside it the iterations run back to back, as a training loop
would; the only extra work is one Status call per iteration after ``zero_grad`` (to sample the
daemon's pinned memory while the session holds its buffers), outside the timed spans.
Recorded per rank (rank<r>.json): per-iteration timestamps (forward start, forward end,
backward end, step end, zero_grad end), the StepInfo sums, the daemon's counters and CPU
seconds over the window, loopback tx bytes (/proc/net/dev, rank 0 reads the machine-wide
figure) and this process's own TCP bytes sent (``ss -tinp``: per socket, so other users of
loopback on this shared machine do not count), the daemon's identity (to sum over daemons),
and what the engine asked of the network: every call of ``fuyou_client.parallel.world``'s
reduce_scatter / all_gather / all_reduce in the window (counted by wrapping them: the
engine's collectives all go through them; an offloaded block's fetch gather apart from the
barrier's), the layer groups' sizes (numel, the padded numel the shards cut, offloaded or
not) and the offloader's fetched / served weight bytes: bench/scale.py's formulas use them.
After the window the rank deletes its namespace's objects, so the rounds do not fill the array.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import quiet_counters  # noqa: E402

import fuyou_client  # noqa: E402

LR, WD = 1e-4, 0.01
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
now = time.perf_counter


def lo_tx_bytes() -> int:
    """Bytes sent on the loopback interface (this network namespace, all processes)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def tcp_bytes_sent(pid: int) -> int:
    """TCP bytes this process's sockets sent (tcp_info bytes_sent, summed; ``ss -tinp``)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            mine = f"pid={pid}," in line
        elif mine:
            m = re.search(r"\bbytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CollectiveCounter:
    """Wraps ``fuyou_client.parallel.world``'s collectives (sharded.py calls them through the
    module): per kind, calls and bytes of the full vector (reduce-scatter: its input; all-gather:
    its output; all-reduce: the tensor), and per call site of the all-gathers, the weights
    fetches' (``gather_fetch``) apart from the landing's."""

    def __init__(self):
        from fuyou_client.parallel import world as distributed
        self.counts = {k: {"calls": 0, "bytes": 0} for k in ("reduce_scatter", "all_gather", "all_gather_fetch",
                                                              "all_reduce")}
        self.on = False
        for kind, full_arg in (("reduce_scatter", 1), ("all_gather", 0), ("all_reduce", 0)):
            setattr(distributed, kind, self._wrap(kind, getattr(distributed, kind), full_arg))

    def _wrap(self, kind, fn, full_arg):
        def wrapped(*a, **kw):
            if self.on:
                key = kind
                caller = sys._getframe(1).f_code
                if kind == "all_gather" and caller.co_name == "run" and caller.co_filename.endswith("sharded.py"):
                    key = "all_gather_fetch"  # (Sharded.gather_fetch's run(): an offloaded block's fetch)
                self.counts[key]["calls"] += 1
                self.counts[key]["bytes"] += a[full_arg].numel() * a[full_arg].element_size()
            return fn(*a, **kw)
        return wrapped

    def snapshot(self) -> dict:
        return {k: dict(v) for k, v in self.counts.items()}


def groups_info(engine) -> list[dict]:
    """The engine's layer groups: numel, the padded numel its shards cut it into (the
    collectives' vector), whether its weights are offloaded, its place among the offloaded."""
    out = []
    for g in getattr(engine, "groups", []):
        og = getattr(g, "offloaded", None)
        numel = int(g.spec.numel)
        out.append({"name": g.spec.name, "numel": numel, "padded": int(getattr(g, "shard_padded", 0) or numel),
                    "offloaded": og is not None, "offload_index": og.index if og is not None else None,
                    "itemsize": g.dtype.itemsize})
    return out


def build_model(args):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width,
                                  n_layer=args.layers, n_head=max(1, args.width // 64), resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(DTYPES[args.dtype])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--namespace", default=None)
    ap.add_argument("--offload", action="store_true", help="attach(offload=True): the blocks' weights on the SSD")
    ap.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                    help="AdamW's state dtype (the moments; the masters stay fp32)")
    ap.add_argument("--optimizer-rank", type=int, default=None,
                    help="this rank is the optimizer host (serve_optimizer); the others are its workers "
                         "(attach(optimizer_ranks=[it])), which write rank<r>.json; it writes optimizer.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t_start = now()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    barrier = dist.barrier if world > 1 else (lambda: None)
    host = args.optimizer_rank
    if host is not None:  # (the workers' brackets are theirs: the optimizer rank serves its link meanwhile)
        workers = dist.new_group([r for r in range(world) if r != host])
        barrier = lambda: dist.barrier(group=workers)  # noqa: E731
        if rank == host:
            return serve(args, host)
        rank = rank - (rank > host)  # (the workers' JSONs are rank0..rank<W-1>)

    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    t_built = now()
    counter = CollectiveCounter()
    extra = {"optimizer_ranks": [host]} if host is not None else {}
    engine = fuyou_client.attach(model, optimizer(args), offload=args.offload,
                                 namespace=args.namespace, **extra)
    t_attached = now()
    session = engine.session
    status = session.status()
    daemon = {"pid": status.pid, "socket": status.session_socket}
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
               for _ in range(args.warmup + args.iters)]

    def iteration(x: torch.Tensor) -> dict:
        t0 = now()
        loss = model(x, labels=x).loss
        t1 = now()
        loss.backward()
        t2 = now()
        engine.step()
        t3 = now()
        engine.zero_grad()
        t4 = now()
        infos = engine.last_step_infos
        return {"t": [t0, t1, t2, t3, t4], "loss": loss.item(), "groups": len(infos),
                **{f"{k}_s": sum(getattr(i, f"{k}_seconds") for i in infos) for k in ("read", "compute", "write")}}

    warm = [iteration(x) for x in batches[:args.warmup]]

    def mark() -> dict:
        barrier()  # every rank's last step has landed (engine.step() returned everywhere)
        read, written = quiet_counters(session)
        out = {"bytes_read": read, "bytes_written": written, "daemon_cpu_s": cpu_seconds(status.pid),
               "lo_tx": lo_tx_bytes(), "tcp_sent": tcp_bytes_sent(os.getpid()), "time": now(),
               "fetched_bytes": getattr(offloader, "fetched_bytes", 0),
               "served_bytes": getattr(offloader, "served_bytes", 0)}
        barrier()
        return out

    offloader = getattr(engine, "offloader", None)
    start = mark()
    counter.on = True  # (the window's collectives; marks' barriers are torch's own, not counted)
    its, pinned = [], []
    for x in batches[args.warmup:]:
        its.append(iteration(x))
        st = session.status()  # (untimed) the daemon's pinned memory while the session holds its buffers
        pinned.append({"pinned_used_bytes": st.pinned_used_bytes, "sessions": st.sessions})
    counter.on = False
    collectives = counter.snapshot()
    end = mark()

    # Leave the array as we found it: the namespace's persistent objects (optimizer state) go.
    names = [o.name for o in session.objects()]
    if names:
        session.delete(*names, missing_ok=True)
    engine.close(materialize=False)
    result = {"rank": rank, "world": world, "params": params, "daemon": daemon,
              "args": vars(args) | {"out": str(args.out)},
              "iterations": its, "warmup": warm, "start": start, "end": end, "pinned": pinned,
              "delta": {k: end[k] - start[k] for k in start}, "collectives": collectives,
              "offload": args.offload, "groups": groups_info(engine),
              "keep": getattr(offloader, "keep", None), "prefetch": getattr(offloader, "prefetch", None),
              "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "setup_s": {"build": t_built - t_start, "attach": t_attached - t_built},
              "peers": [list(p) for p in getattr(engine, "peers", None) or []]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        end_process_group()
    return 0


def optimizer(args):
    return fuyou_client.AdamW(lr=LR, weight_decay=WD, state_dtype=args.state_dtype)


def serve(args, host: int) -> int:
    """The optimizer host's rank: serve the workers (a model built on the meta device:
    only what it owns takes memory), then write optimizer.json: its resident memory, its
    TCP bytes sent and the commands it served."""
    with torch.device("meta"):
        model = build_model(args)
    t0 = now()
    served = fuyou_client.serve_optimizer(model, optimizer(args), optimizer_ranks=[host],
                                          namespace=args.namespace)
    result = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "tcp_sent": tcp_bytes_sent(os.getpid()), "served": served.commands, "steps": served.steps,
              "serve_s": now() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizer.json").write_text(json.dumps(result))
    with fuyou_client.connect(namespace=f"{args.namespace}.opt0") as session:  # (leave the array as we found it)
        names = [o.name for o in session.objects()]
        if names:
            session.delete(*names, missing_ok=True)
    end_process_group()
    return 0


def end_process_group() -> None:
    """The group ends while Python is alive: what holds it is collected first
    (docs/guide/distributed.md: a gloo group freed at the interpreter's exit can abort it)."""
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    sys.exit(main())

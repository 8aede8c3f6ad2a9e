"""Training throughput of a GPT-2-style model through Fuyou, side by side with in-memory torch.

    python bench/train.py [--json PATH] [--layers 8] [--width 768] [--seq 128] [--batch 4]
                          [--steps 6] [--warmup 2] [--rounds 3] [--vocab 512] [--prefetch 2]
                          [--keep 0] [--no-resident] [--dir DIR] [--keep-files]
                          [--state-dtypes fp32,bf16,int8]

One Hugging Face ``GPT2LMHeadModel`` (random init, seed 0; ~57M parameters by default, dropout
off) is copied into each case; every case trains on the same random token batches (seed 1), in
the same order, one full iteration being forward, ``loss.backward()``, optimizer step, zero_grad:

* fuyou:          ``fuyou_client.attach(offload=True, prefetch=--prefetch, keep=--keep)`` on a
                  private fuyoud (``start_daemon``): AdamW state (fp32 master weights, exp_avg,
                  exp_avg_sq) on SSD, the blocks' weights fetched from SSD ahead of use, each
                  layer group's step submitted while backward goes on, ``engine.step()`` the barrier.
* fuyou_resident: the same with ``offload=False`` (weights resident, only the optimizer state on
                  SSD), on a second private daemon (so neither case's read-ahead buffers are held
                  while the other runs). Skipped with ``--no-resident``.
* fuyou_bf16, fuyou_int8: the fuyou case with ``AdamW(state_dtype="bf16" | "int8")``: the moments
                  on SSD in bf16 or block-wise int8 (fuyoud/optimizer/lowp.py), each on its own
                  private daemon. ``--state-dtypes`` (default fp32,bf16,int8) picks which of
                  fuyou (fp32), fuyou_bf16 and fuyou_int8 run; the resident case is fp32 only.
* inmem:          ``torch.optim.AdamW(fused=True)`` in memory, same hyperparameters.

Models, daemons and engines stay alive across rounds. Every round runs ``--warmup`` untimed
iterations of each case, then ``--steps`` timed iterations of each, interleaved iteration by
iteration (case order rotated per round): this machine's speed drifts by 2-3x within minutes, so
only side-by-side iterations compare. After each Fuyou iteration (untimed) the script waits until
its daemon is quiet (a step's read-ahead of the next group may trail ``engine.step()``), so that
no case's I/O spills into another's timing and SSD bytes are counted per iteration. Reported as
medians over rounds of per-round figures (GB = 1e9 bytes, tokens = batch x seq per iteration):

* tokens/s (whole iteration: forward start to zero_grad end) and fuyou/inmem ratios (of the
  medians; medians of per-round and of per-iteration paired ratios);
* exposed_optimizer_fraction: (``loss.backward()`` returning -> ``engine.step()`` returning) /
  (forward start -> step end), summed over a round's timed iterations; target <= 0.10. The same
  fraction of ``opt.step()`` for inmem;
* ssd_bytes_per_param_per_iter: the daemon's bytes_read + bytes_written deltas over the timed
  iterations / parameters / iterations; target <= 28 with fp32 state. Split into optimizer state
  and weight fetches (``engine.offloader.fetched_bytes``; fetches are daemon reads);
* the daemon's per-phase seconds (StepInfo read / compute / write, summed over groups) and how
  many steps found their state read ahead, the daemon's CPU seconds, and (instrumentation of this
  script only, wrapping the engine's objects) the client's time blocked on weight fetches in
  forward and backward and on the gradient pool in backward, and every step's group, submission
  and completion time relative to backward's end and StepInfo (in the JSON's "iterations");
* the losses of all cases, which should agree for fp32 state (same init, same batches, same fused
  kernel); bf16 and int8 state drift from them a little.

The top-level keys are the fp32 fuyou case's (or, without fp32 in ``--state-dtypes``, the first
dtype's; ``state_dtype`` says which); ``by_state_dtype`` maps each dtype to the same figures for its
own case (bytes target: its own state bytes plus the 4 bytes of weight fetches, 28 / 20 / 16.1).

Work files go to a fresh directory under ``<repo>/.fuyou/bench`` (or ``--dir``), removed at the end
unless ``--keep-files``; the JSON goes to ``--json`` (default ``<repo>/.fuyou/bench-results/
train-<time>.json``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import fuyou_client
from fuyoud.optimizer import kernels
from common import host_info, parse_state_dtypes, quiet_counters, summarize

REPO = Path(__file__).resolve().parents[1]
LR, WD = 1e-4, 0.01
TARGET_EXPOSED, TARGET_BYTES = 0.10, 28.0
TARGET_BYTES_BY_DTYPE = {"fp32": 28.0, "bf16": 20.0, "int8": 16.1}  # state read + written, + 4 B of fetches


def case_name(state_dtype: str) -> str:
    return "fuyou" if state_dtype == "fp32" else f"fuyou_{state_dtype}"
now = time.perf_counter


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class InMem:
    name = "inmem"

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)

    def iteration(self, x: torch.Tensor) -> dict:
        t0 = now()
        loss = self.model(x, labels=x).loss
        t1 = now()
        loss.backward()
        t2 = now()
        self.opt.step()
        t3 = now()
        self.opt.zero_grad(set_to_none=True)
        t4 = now()
        return {"t": (t0, t1, t2, t3, t4), "loss": loss.item()}

    def close(self) -> None:
        pass


class Fuyou:
    def __init__(self, name: str, model: torch.nn.Module, workdir: Path, args, offload: bool,
                 state_dtype: str = "fp32"):
        self.name, self.model, self.state_dtype = name, model, state_dtype
        config = {"storage": {"data_dirs": [str(workdir / f"{name}-data")], "capacity_per_device": "8GiB"},
                  "optimizer": {"buffer_budget": "1GiB"}}
        self.daemon = fuyou_client.start_daemon(workdir / f"{name}-state", config=config)
        try:
            kw = {"prefetch": args.prefetch, "keep": args.keep} if offload else {}
            self.engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=LR, weight_decay=WD, state_dtype=state_dtype),
                                              socket=self.daemon.socket, namespace=f"bench-{name}",
                                              offload=offload, **kw)
        except BaseException:
            self.daemon.stop()
            raise
        self.io_engine = self.engine.session.daemon_status.io_engine
        self.numels = {g.spec.name: g.spec.numel for g in self.engine.groups}
        # Instrumentation (this script only): time blocked on weight fetches, step completion times.
        self.phase, self.wait, self.fetches, self.log = "fwd", {}, {}, []
        off = self.engine.offloader
        if off is not None:
            ensure = off.ensure

            def timed_ensure(g, *args, **kwargs):
                if g.slot is not None:
                    return ensure(g, *args, **kwargs)
                t = now()
                ensure(g, *args, **kwargs)
                self.wait[self.phase] = self.wait.get(self.phase, 0.0) + now() - t
                self.fetches[self.phase] = self.fetches.get(self.phase, 0) + 1
            off.ensure = timed_ensure  # the hooks call self.ensure: the instance attribute wins
        sga = self.engine.session.step_group_async

        def timed_step(name, *a, **kw):  # submission times, per group
            fut = sga(name, *a, **kw)
            rec = [name, now(), None, fut]
            fut.add_done_callback(lambda _f, rec=rec: rec.__setitem__(2, now()))
            self.log.append(rec)
            return fut
        self.engine.session.step_group_async = timed_step
        pool = getattr(self.engine, "gradients", None)  # pooled gradient buffers (newer clients)
        if pool is not None:
            reclaim = pool._reclaim_oldest

            def timed_reclaim():
                t = now()
                reclaim()
                if self.phase == "bwd":  # backward waiting for a step to free a gradient buffer
                    self.wait["pool"] = self.wait.get("pool", 0.0) + now() - t
            pool._reclaim_oldest = timed_reclaim
        self.last = self.snapshot()

    def iteration(self, x: torch.Tensor) -> dict:
        self.phase, self.wait, self.fetches, self.log = "fwd", {}, {}, []
        t0 = now()
        loss = self.model(x, labels=x).loss
        t1 = now()
        self.phase = "bwd"
        loss.backward()
        t2 = now()
        self.phase = "step"
        self.engine.step()
        t3 = now()
        self.engine.zero_grad()
        t4 = now()
        infos = self.engine.last_step_infos
        cur = self.snapshot()  # untimed: waits for the daemon's trailing read-ahead too
        delta = {k: cur[k] - self.last[k] for k in cur}
        self.last = cur
        # Per step, in submission order: group, submitted and done (s after backward's end), StepInfo.
        steps = [{"group": n, "submitted": round(ts - t2, 4), "done": round((td or t3) - t2, 4),
                  **dataclasses.asdict(f.result())} for n, ts, td, f in self.log]
        late = [st for st in steps if st["done"] > 0]
        return {"t": (t0, t1, t2, t3, t4), "loss": loss.item(), "bytes_read": delta["read"],
                "bytes_written": delta["written"], "fetched_bytes": delta["fetched"],
                "daemon_cpu_s": delta["daemon_cpu_s"], "groups": len(infos),
                **{f"{k}_s": sum(getattr(i, f"{k}_seconds") for i in infos) for k in ("read", "compute", "write")},
                "prefetched": sum(bool(i.prefetched) for i in infos), "fetch_wait_fwd_s": self.wait.get("fwd", 0.0),
                "fetch_wait_bwd_s": self.wait.get("bwd", 0.0) + self.wait.get("step", 0.0),
                "grad_pool_wait_bwd_s": self.wait.get("pool", 0.0),
                "fetches_waited": sum(self.fetches.values()), "groups_done_after_backward": len(late),
                "late_read_s": sum(st["read_seconds"] for st in late),
                "last_submit_before_backward_end_s": -max(st["submitted"] for st in steps), "steps": steps}

    def snapshot(self) -> dict:
        """Counters once the daemon is quiet (unchanged over two 0.1 s waits)."""
        cur = quiet_counters(self.engine.session, stable=2, tries=50)
        off = self.engine.offloader
        return {"read": cur[0], "written": cur[1], "fetched": off.fetched_bytes if off else 0,
                "daemon_cpu_s": cpu_seconds(self.daemon.pid)}

    def close(self) -> None:
        try:
            self.engine.close(materialize=False)
        finally:
            self.daemon.stop()


def round_figures(its: list[dict], tokens: int, params: int) -> dict:
    """One case's figures over one round's timed iterations."""
    span = lambda a, b: sum(it["t"][b] - it["t"][a] for it in its)  # noqa: E731
    n = len(its)
    f = {"tokens_per_s": n * tokens / span(0, 4), "iter_s": span(0, 4) / n, "forward_s": span(0, 1) / n,
         "backward_s": span(1, 2) / n, "step_s": span(2, 3) / n, "zero_grad_s": span(3, 4) / n,
         "exposed_fraction": span(2, 3) / span(0, 3),
         "exposed_fraction_iter_median": statistics.median((i["t"][3] - i["t"][2]) / (i["t"][3] - i["t"][0])
                                                          for i in its)}
    if "bytes_read" in its[0]:
        rd, wr, fe, cpu = (sum(i[k] for i in its) for k in ("bytes_read", "bytes_written", "fetched_bytes",
                                                             "daemon_cpu_s"))
        f.update({"bytes_read": rd, "bytes_written": wr, "fetched_bytes": fe,
                  "ssd_bytes_per_param_per_iter": (rd + wr) / params / n,
                  "state_bytes_per_param_per_iter": (rd - fe + wr) / params / n,
                  "fetch_bytes_per_param_per_iter": fe / params / n,
                  "daemon_cpu_s_per_iter": cpu / n})
        for k in ("read_s", "compute_s", "write_s", "prefetched", "groups", "fetch_wait_fwd_s", "fetch_wait_bwd_s",
                  "grad_pool_wait_bwd_s", "fetches_waited", "groups_done_after_backward", "late_read_s",
                  "last_submit_before_backward_end_s"):
            f[k] = sum(i[k] for i in its) / n
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="where to write the results (default <repo>/.fuyou/bench-results/"
                    "train-<time>.json)")
    ap.add_argument("--layers", default=8, type=int, help="transformer blocks (default 8)")
    ap.add_argument("--width", default=768, type=int, help="hidden size, a multiple of 64 (default 768)")
    ap.add_argument("--seq", default=128, type=int, help="tokens per sequence (default 128)")
    ap.add_argument("--batch", default=4, type=int, help="sequences per iteration (default 4)")
    ap.add_argument("--vocab", default=512, type=int, help="vocabulary size (default 512)")
    ap.add_argument("--steps", default=6, type=int, help="timed iterations per case per round (default 6)")
    ap.add_argument("--warmup", default=2, type=int, help="untimed iterations before them (default 2)")
    ap.add_argument("--rounds", default=3, type=int, help="rounds (default 3)")
    ap.add_argument("--prefetch", default=2, type=int, help="attach(prefetch=) for the fuyou case (default 2)")
    ap.add_argument("--keep", default=0, type=int, help="attach(keep=) for the fuyou case (default 0)")
    ap.add_argument("--no-resident", action="store_true", help="skip the fuyou offload=False case")
    ap.add_argument("--dir", type=Path, help="parent of the bench directory (default <repo>/.fuyou/bench)")
    ap.add_argument("--keep-files", action="store_true", help="keep the daemons' files")
    ap.add_argument("--state-dtypes", default="fp32,bf16,int8", type=parse_state_dtypes,
                    help="AdamW state dtypes of the offloaded fuyou cases, comma-separated (default fp32,bf16,int8)")
    args = ap.parse_args(argv)
    if min(args.layers, args.seq, args.batch, args.steps, args.rounds) < 1 or args.warmup < 0 or args.width % 64:
        ap.error("need positive --layers/--seq/--batch/--steps/--rounds, --warmup >= 0, --width % 64 == 0")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.json = args.json or REPO / ".fuyou" / "bench-results" / f"train-{stamp}.json"

    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width,
                                  n_layer=args.layers, n_head=args.width // 64, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    params = sum(p.numel() for p in base.parameters())
    tokens = args.batch * args.seq
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
               for _ in range(args.warmup + args.steps)]
    parent = (args.dir or REPO / ".fuyou" / "bench").resolve()
    workdir = parent / f"train-{stamp}-{os.getpid()}"
    workdir.mkdir(parents=True)
    print(f"bench dir {workdir}; GPT-2 {args.layers}x{args.width}, vocab {args.vocab}: {params / 1e6:.1f}M params; "
          f"batch {args.batch}x{args.seq} = {tokens} tokens; {args.warmup} warm-up + {args.steps} timed iterations "
          f"per case per round, {args.rounds} rounds; torch threads {torch.get_num_threads()}", flush=True)

    cases, per_round, losses, order_log, raw, setup = [], {}, {}, [], {}, {}
    t_start = now()
    try:
        makers = [(case_name(dt), lambda m, dt=dt: Fuyou(case_name(dt), m, workdir, args, offload=True, state_dtype=dt))
                  for dt in args.state_dtypes]
        if not args.no_resident:
            makers.append(("fuyou_resident", lambda m: Fuyou("fuyou_resident", m, workdir, args, offload=False)))
        for name, make in (*makers, ("inmem", InMem)):
            t = now()
            cases.append(make(copy.deepcopy(base)))
            setup[name] = now() - t
            print(f"[{name}] ready in {setup[name]:.1f} s", flush=True)
        del base
        per_round = {c.name: [] for c in cases}
        losses = {c.name: [] for c in cases}
        raw = {c.name: [] for c in cases}
        for r in range(args.rounds):
            k = r % len(cases)
            order = cases[k:] + cases[:k]
            order_log.append([c.name for c in order])
            for case in order:
                for x in batches[:args.warmup]:
                    losses[case.name].append(case.iteration(x)["loss"])
            its = {c.name: [] for c in cases}
            for x in batches[args.warmup:]:  # timed iterations interleaved: the machine's speed drifts
                for case in order:
                    its[case.name].append(case.iteration(x))
            parts = []
            for case in order:
                losses[case.name].extend(i["loss"] for i in its[case.name])
                raw[case.name].append(its[case.name])
                f = round_figures(its[case.name], tokens, params)
                per_round[case.name].append(f)
                extra = ""
                if "bytes_read" in f:
                    extra = (f", exposed {f['exposed_fraction']:.3f}, {f['ssd_bytes_per_param_per_iter']:.1f} B/param"
                             f", fetch wait f/b {f['fetch_wait_fwd_s']:.2f}/{f['fetch_wait_bwd_s']:.2f} s")
                parts.append(f"{case.name} {f['tokens_per_s']:.0f} tok/s (f/b/s {f['forward_s']:.2f}/"
                             f"{f['backward_s']:.2f}/{f['step_s']:.3f} s{extra})")
            print(f"round {r + 1}/{args.rounds}: " + " | ".join(parts), flush=True)
    finally:
        for case in cases:
            try:
                case.close()
            except Exception as exc:  # noqa: BLE001 - report, keep cleaning up
                print(f"[{case.name}] close failed: {exc!r}", flush=True)
        if not args.keep_files:
            shutil.rmtree(workdir, ignore_errors=True)
    wall = now() - t_start

    keys = sorted({k for rows in per_round.values() for row in rows for k in row})
    stats = {n: {k: summarize([row[k] for row in rows]) for k in keys if k in rows[0]} for n, rows in per_round.items()}
    med = {n: {k: s["median"] for k, s in st.items()} for n, st in stats.items()}
    dtypes = args.state_dtypes
    primary = case_name(dtypes[0])  # "fuyou" (fp32) whenever it runs: the top-level keys
    fy, im = med[primary], med["inmem"]
    ratio = fy["tokens_per_s"] / im["tokens_per_s"]
    paired = statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                               for a, b in zip(per_round[primary], per_round["inmem"]))
    dur = lambda it: it["t"][4] - it["t"][0]  # noqa: E731
    paired_iter = {n: statistics.median(dur(b) / dur(a) for ra, rb in zip(raw[n], raw["inmem"]) for a, b in zip(ra, rb))
                   for n in raw if n != "inmem"}
    loss_diff = {n: max(abs(a - b) for a, b in zip(losses[n], losses["inmem"])) for n in losses if n != "inmem"}

    print(f"\n{'case':<15} {'tok/s':>7} {'min':>7} {'max':>7} {'iter s':>7} {'fwd s':>6} {'bwd s':>6} "
          f"{'step s':>7} {'zero s':>6} {'exposed':>7}")
    for n, m in med.items():
        s = stats[n]["tokens_per_s"]
        print(f"{n:<15} {m['tokens_per_s']:7.0f} {s['min']:7.0f} {s['max']:7.0f} {m['iter_s']:7.3f} "
              f"{m['forward_s']:6.3f} {m['backward_s']:6.3f} {m['step_s']:7.3f} {m['zero_grad_s']:6.3f} "
              f"{m['exposed_fraction']:7.3f}")
    print("(medians over rounds of per-round means; 'step s' = backward end -> step end; exposed = step s / "
          "(fwd + bwd + step))")
    fuyous = [n for n in med if n != "inmem"]
    print(f"\n{'case':<15} {'B/param':>7} {'state':>6} {'fetch':>6} {'read s':>6} {'comp s':>6} {'write s':>7} "
          f"{'ahead':>5} {'dmn cpu':>7} {'wait f/b s':>11} {'late':>4} {'late rd':>7}  vs inmem tok/s")
    for n in fuyous:
        m = med[n]
        print(f"{n:<15} {m['ssd_bytes_per_param_per_iter']:7.2f} {m['state_bytes_per_param_per_iter']:6.2f} "
              f"{m['fetch_bytes_per_param_per_iter']:6.2f} {m['read_s']:6.3f} {m['compute_s']:6.3f} "
              f"{m['write_s']:7.3f} "
              f"{m['prefetched']:5.1f} {m['daemon_cpu_s_per_iter']:7.3f} {m['fetch_wait_fwd_s']:5.3f}/"
              f"{m['fetch_wait_bwd_s']:5.3f} {m['groups_done_after_backward']:4.1f} {m['late_read_s']:7.3f}  "
              f"{m['tokens_per_s'] / im['tokens_per_s']:.3f} (paired per iteration {paired_iter[n]:.3f})")
    print("(per iteration, medians over rounds: SSD bytes per parameter = optimizer state + weight fetches; daemon "
          "StepInfo read / compute / write s summed over groups; steps whose state was read ahead; daemon CPU s; "
          "client blocked on weight fetches in forward / backward; steps done after backward and their read s)")
    for n in fuyous:
        m = med[n]
        print(f"{n} vs inmem, s per iteration: forward {m['forward_s'] - im['forward_s']:+.3f}, backward "
              f"{m['backward_s'] - im['backward_s']:+.3f}, after backward {m['step_s'] - im['step_s']:+.3f}, zero_grad "
              f"{m['zero_grad_s'] - im['zero_grad_s']:+.3f}; backward blocked on the gradient pool "
              f"{m['grad_pool_wait_bwd_s']:.3f}; max |loss - inmem's| {loss_diff[n]:.3g}")
    by_case = {c.name: c for c in cases}

    def expected(dt: str) -> float:
        """2 x the state objects' bytes (padding included) / parameters: what a step reads and writes."""
        spec = kernels.OptimizerSpec("adamw", state_dtype=dt)
        return sum(2 * spec.layout(n).size for n in by_case[case_name(dt)].numels.values()) / params

    def figures(dt: str) -> dict:
        n = case_name(dt)
        m = med[n]
        target = TARGET_BYTES_BY_DTYPE[dt]
        return {
            "state_dtype": dt, "case": n, "fuyou_tokens_per_s": m["tokens_per_s"], "fuyou_over_inmem": m["tokens_per_s"] / im["tokens_per_s"],
            "fuyou_over_inmem_paired": statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                                         for a, b in zip(per_round[n], per_round["inmem"])),
            "fuyou_over_inmem_paired_iter": paired_iter[n],
            "exposed_optimizer_fraction": m["exposed_fraction"], "exposed_target_met": m["exposed_fraction"] <= TARGET_EXPOSED,
            "step_s": m["step_s"], "iter_s": m["iter_s"],
            "ssd_bytes_per_param_per_iter": m["ssd_bytes_per_param_per_iter"],
            "state_bytes_per_param_per_iter": m["state_bytes_per_param_per_iter"],
            "fetch_bytes_per_param_per_iter": m["fetch_bytes_per_param_per_iter"],
            "expected_state_bytes_per_param_per_iter": expected(dt),
            "target_ssd_bytes_per_param_per_iter": target, "ssd_bytes_target_met": m["ssd_bytes_per_param_per_iter"] <= target,
            "read_s": m["read_s"], "compute_s": m["compute_s"], "write_s": m["write_s"],
            "daemon_cpu_s_per_iter": m["daemon_cpu_s_per_iter"],
            "tokens_per_s_over_fp32_paired_iter": (statistics.median(
                dur(b) / dur(a) for ra, rb in zip(raw[n], raw["fuyou"]) for a, b in zip(ra, rb)) if "fuyou" in raw else None),
            "loss_max_abs_diff_vs_inmem": loss_diff[n], "final_loss": losses[n][-1],
        }

    by_dtype = {dt: figures(dt) for dt in dtypes}
    if len(dtypes) > 1:
        print(f"\n{'state dtype':<11} {'tok/s':>7} {'vs inmem':>8} {'vs fp32':>7} {'exposed':>7} {'B/param':>7} "
              f"{'expect':>6} {'target':>6} {'comp s':>6} {'max|dloss|':>10}")
        for dt, f in by_dtype.items():
            vs = f["tokens_per_s_over_fp32_paired_iter"]
            print(f"{dt:<11} {f['fuyou_tokens_per_s']:7.0f} {f['fuyou_over_inmem']:8.3f} "
                  + (f"{vs:7.3f}" if vs else f"{'-':>7}")
                  + f" {f['exposed_optimizer_fraction']:7.3f} {f['ssd_bytes_per_param_per_iter']:7.2f} "
                  f"{f['expected_state_bytes_per_param_per_iter'] + f['fetch_bytes_per_param_per_iter']:6.2f} "
                  f"{f['target_ssd_bytes_per_param_per_iter']:6.1f} {f['compute_s']:6.3f} {f['loss_max_abs_diff_vs_inmem']:10.3g}")
        print("(expect = 2 x state bytes + the weight fetches measured, per parameter per iteration; vs fp32 = median "
              "of paired per-iteration tokens/s ratios; max|dloss| = largest loss difference to inmem's)")
    exp_met = fy["exposed_fraction"] <= TARGET_EXPOSED
    bytes_met = fy["ssd_bytes_per_param_per_iter"] <= TARGET_BYTES_BY_DTYPE[dtypes[0]]
    print(f"\nfuyou_tokens_per_s {fy['tokens_per_s']:.0f}, inmem_tokens_per_s {im['tokens_per_s']:.0f}: ratio "
          f"{ratio:.3f} (median of paired per-round ratios {paired:.3f}, of paired per-iteration ratios "
          f"{paired_iter[primary]:.3f})")
    print(f"exposed_optimizer_fraction {fy['exposed_fraction']:.3f} (inmem opt.step fraction "
          f"{im['exposed_fraction']:.3f}); target <= {TARGET_EXPOSED}: {'MET' if exp_met else 'NOT met'}")
    print(f"ssd_bytes_per_param_per_iter {fy['ssd_bytes_per_param_per_iter']:.2f}; target <= "
          f"{TARGET_BYTES_BY_DTYPE[dtypes[0]]}: "
          f"{'MET' if bytes_met else 'NOT met'}; wall {wall:.0f} s")

    expected_state = by_dtype[dtypes[0]]["expected_state_bytes_per_param_per_iter"]
    result = {
        "fuyou_tokens_per_s": fy["tokens_per_s"], "inmem_tokens_per_s": im["tokens_per_s"],
        "fuyou_resident_tokens_per_s": med.get("fuyou_resident", {}).get("tokens_per_s"),
        "fuyou_over_inmem": ratio, "fuyou_over_inmem_paired": paired,
        "fuyou_over_inmem_paired_iter": paired_iter[primary], "paired_iter_ratios": paired_iter,
        "exposed_optimizer_fraction": fy["exposed_fraction"], "inmem_step_fraction": im["exposed_fraction"],
        "target_exposed_fraction": TARGET_EXPOSED, "exposed_target_met": exp_met,
        "ssd_bytes_per_param_per_iter": fy["ssd_bytes_per_param_per_iter"],
        "state_bytes_per_param_per_iter": fy["state_bytes_per_param_per_iter"],
        "fetch_bytes_per_param_per_iter": fy["fetch_bytes_per_param_per_iter"],
        "expected_state_bytes_per_param_per_iter": expected_state,
        "target_ssd_bytes_per_param_per_iter": TARGET_BYTES_BY_DTYPE[dtypes[0]], "ssd_bytes_target_met": bytes_met,
        "state_dtype": dtypes[0], "state_dtypes": dtypes, "by_state_dtype": by_dtype,
        "medians": med, "stats": stats, "per_round": per_round, "losses": losses,
        "loss_max_abs_diff_vs_inmem": loss_diff, "case_order": order_log,
        "iterations": raw,
        "params": params, "group_numels": cases[0].numels, "tokens_per_iter": tokens,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "lr": LR, "weight_decay": WD, "io_engine": cases[0].io_engine, "setup_s": setup, "wall_s": wall,
        "dir": str(workdir), "host": {**host_info(parent), "transformers": transformers.__version__}, "argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

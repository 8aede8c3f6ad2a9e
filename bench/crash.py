"""Crash consistency: SIGKILL fuyoud at random moments while a client trains.

    python bench/crash.py [--trials 100] [--steps 24] [--json PATH] [--dir DIR] [--seed 0]
                          [--at random|checkpoint]

Each trial starts a private daemon, trains a small block model through
``fuyou_client.attach`` (AdamW state on SSD, blocks offloaded), checkpoints every few
steps (snapshot or copy, at random) and kills the daemon with SIGKILL after a random
delay, whatever it is doing (stepping, writing, committing, checkpointing); with ``--at
checkpoint``, inside a checkpoint (the daemon pauses there, at a failpoint, between
linking or copying the objects and publishing the directory). Then:

* the client must have raised ``DaemonUnavailable`` within 5 seconds of the kill;
* after a restart on the same state, every group's optimizer state object must be at
  the last step the client saw acknowledged or the next one (a step in flight may have
  committed), and bitwise equal - master weights and both moments - to the reference
  trajectory of ``torch.optim.AdamW(fused=True)`` at that step: never a torn mix;
* resuming from the newest checkpoint directory there is (``attach(resume=...)``; one
  whose save the kill interrupted is there only if complete) and training on must
  reproduce the reference weights bitwise.

Recorded, for the caller to judge (tests/test_crash.py asserts them): what the kill
interrupted, how long the client took to notice, the partial checkpoint directories the
restart left (``debris``), and the array's bytes once every checkpoint and object is
deleted (``left_bytes``: extents the crash leaked).

The test suite runs a few trials (tests/test_crash.py); this script runs many.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import fuyou_client
from fuyou_proto.contract import HEADER, slot_bytes as _slot_bytes
from fuyoud.optimizer.kernels import OptimizerSpec

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
CONFIG = {
    "storage": {"capacity_per_device": "128MiB", "stripe_size": "1MiB"},
    "memory": {"pinned_budget": "128MiB", "segment_size": "8MiB", "staging_size": "4MiB"},
    "io": {"chunk_size": "256KiB", "queue_depth": 16, "threads": 4},
    "optimizer": {"buffer_budget": "16MiB", "buffers": 4},
}
DETECT_LIMIT_S = 5.0
# --at checkpoint: the daemon pauses this long inside every checkpoint (after linking a
# snapshot's objects or copying a copy's files, before the directory is published).
CHECKPOINT_PAUSE_S = 0.3


class Blocks(nn.Module):
    def __init__(self, width: int = 128, depth: int = 4):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def make_model(seed: int) -> Blocks:
    torch.manual_seed(seed)
    return Blocks()


def batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(32, 128, generator=gen) for _ in range(steps)]


def loss_of(model, x):
    return model(x).square().mean()


class Reference:
    """torch.optim.AdamW's trajectory: per step, every parameter's weights and moments."""

    def __init__(self, steps: int, data: list[torch.Tensor]):
        model = make_model(0)
        names = [n for n, _ in model.named_parameters()]
        opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
        self.weights = [{n: p.detach().clone() for n, p in model.named_parameters()}]
        self.moments: list[dict] = [{n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in model.named_parameters()}]
        for x in data[:steps]:
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
            self.weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
            self.moments.append({n: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                                 for n, p in zip(names, model.parameters())})

    def group_state(self, step: int, names: list[str]) -> list[torch.Tensor]:
        """[weights, exp_avg, exp_avg_sq] of a group, flat, in its parameter order."""
        w = torch.cat([self.weights[step][n].reshape(-1) for n in names])
        m = torch.cat([self.moments[step][n][0].reshape(-1) for n in names])
        v = torch.cat([self.moments[step][n][1].reshape(-1) for n in names])
        return [w, m, v]


@dataclass
class Trial:
    delay_s: float
    acked_step: int = 0
    killed_during: str = ""
    detect_s: float | None = None
    states: dict = field(default_factory=dict)  # group -> step found after restart
    checkpoint: int | None = None  # the last checkpoint whose save returned
    resumed_from: int | None = None  # the newest checkpoint directory after the restart
    resumed_to: int | None = None
    debris: list = field(default_factory=list)  # partial checkpoint directories after the restart
    left_bytes: int | None = None  # the array's used bytes once everything is deleted


def group_names(engine) -> dict[str, list[str]]:
    """Each engine group's parameters by their model names, in group order."""
    by_id = {id(p): n for n, p in engine.model.named_parameters()}
    return {g.spec.name: [by_id[id(p)] for _, p in g.spec.params] for g in engine.groups}


def slot_bytes(numel: int) -> int:
    """An fp32 slot of a state object, padding included."""
    return _slot_bytes("float32", 1, numel)


def read_state(session, group: str, numel: int) -> tuple[int, list[torch.Tensor]]:
    size = HEADER + 3 * slot_bytes(numel)
    buf = session.allocate(size)
    session.swap_in(f"optim/{group}", buf)
    raw = bytes(buf.view[:HEADER])
    _, n, step = OptimizerSpec.parse_header(raw)
    assert n == numel, (group, n, numel)
    flat = buf.tensor(torch.uint8)
    slots = [flat[HEADER + i * slot_bytes(numel):HEADER + i * slot_bytes(numel) + numel * 4].view(torch.float32).clone()
             for i in range(3)]
    buf.free()
    return step, slots


def run_trial(root: Path, rng: random.Random, ref: Reference, data: list[torch.Tensor], steps: int,
              every: int = 4, at: str = "random") -> Trial:
    """``at``: "random" (a random point of a random iteration) or "checkpoint" (inside a
    checkpoint taken after an earlier one)."""
    if at == "random":
        # The kill comes at a random point of a random iteration: after the chosen step
        # begins, within about one iteration's time (forward, backward, the daemon's steps,
        # a checkpoint every few steps).
        kill_step, trial = rng.randrange(steps), Trial(delay_s=rng.uniform(0.0, 0.12))
        env = None
    elif at == "checkpoint":
        kill_step = rng.choice(range(2 * every - 1, steps, every))  # (its checkpoint is the second or later)
        trial = Trial(delay_s=rng.uniform(0.0, 0.8 * CHECKPOINT_PAUSE_S))
        env = dict(os.environ, FUYOUD_FAILPOINTS=f"checkpoint.linked=sleep({CHECKPOINT_PAUSE_S}),"
                                                 f"checkpoint.copied=sleep({CHECKPOINT_PAUSE_S})")
    else:
        raise ValueError(f"at: random or checkpoint, not {at!r}")
    daemon = fuyou_client.start_daemon(root / "state", config=CONFIG, env=env)
    model = make_model(0)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=daemon.socket, namespace="crash")
    groups = group_names(engine)
    killed_at: list[float] = []
    phase = ["start"]

    def kill():
        trial.killed_during = phase[0]
        killed_at.append(time.monotonic())
        daemon.process.send_signal(signal.SIGKILL)

    timer = threading.Timer(trial.delay_s, kill)
    try:
        for s in range(steps):
            if s == kill_step and at == "random":
                timer.start()
            phase[0] = "training"
            loss_of(model, data[s]).backward()
            engine.step()
            engine.zero_grad()
            trial.acked_step = s + 1
            if trial.acked_step % every == 0:
                phase[0] = "checkpoint"
                directory = root / f"ckpt-{trial.acked_step}"
                if s == kill_step and at == "checkpoint":
                    timer.start()
                engine.save_checkpoint(directory, mode=rng.choice(["snapshot", "copy"]))
                trial.checkpoint = trial.acked_step
        phase[0] = "idle"
        timer.join()  # (started: kill_step < steps)
    except fuyou_client.DaemonUnavailable:
        trial.detect_s = time.monotonic() - killed_at[0]
    finally:
        if timer.ident is None:  # an error before the chosen step: the kill happens now
            kill()
        else:
            timer.join()
        daemon.process.wait()
        try:
            engine.session.close()
        except Exception:  # noqa: BLE001 - the daemon is gone
            pass

    # Restart on the same state: each object at its acknowledged step or the next, bitwise.
    daemon = fuyou_client.start_daemon(root / "state", config=CONFIG)
    try:
        trial.debris = sorted(p.name for p in root.iterdir() if ".partial-" in p.name)
        with fuyou_client.connect(daemon.socket, namespace="crash") as s:
            for name, names in groups.items():
                numel = sum(ref.weights[0][n].numel() for n in names)
                step, slots = read_state(s, name, numel)
                trial.states[name] = step
                if step not in (trial.acked_step, trial.acked_step + 1):
                    raise AssertionError(f"group {name} at step {step}, acknowledged {trial.acked_step}")
                for label, got, want in zip(("weights", "exp_avg", "exp_avg_sq"), slots, ref.group_state(step, names)):
                    if not torch.equal(got, want):
                        raise AssertionError(f"group {name} step {step}: {label} differs from the reference (torn?)")
        done = sorted(int(p.name.split("-")[1]) for p in root.glob("ckpt-*") if p.name.split("-")[1].isdigit())
        if done:  # resume from the newest checkpoint directory there is and train on
            c = trial.resumed_from = done[-1]
            target = min(c + 3, steps)
            fresh = make_model(99)
            resumed = fuyou_client.attach(fresh, fuyou_client.AdamW(**HYPER), socket=daemon.socket,
                                          namespace="resumed", resume=root / f"ckpt-{c}")
            for s in range(c, target):
                loss_of(fresh, data[s]).backward()
                resumed.step()
                resumed.zero_grad()
            resumed.close()
            for n, p in fresh.named_parameters():
                if not torch.equal(p.detach(), ref.weights[target][n]):
                    raise AssertionError(f"resumed from step {c}: {n} differs at step {target}")
            trial.resumed_to = target
        # Everything deleted, the array is empty again: no extent leaked by the crash.
        with fuyou_client.connect(daemon.socket, namespace="crash") as s:
            for c in done:
                s.delete_checkpoint(root / f"ckpt-{c}")
            s.delete(*[o.name for o in s.objects()], missing_ok=True)
        with fuyou_client.connect(daemon.socket, namespace="resumed") as s:
            s.delete(*[o.name for o in s.objects()], missing_ok=True)
        trial.left_bytes = sum(d.used_bytes for d in daemon.status().devices)
    finally:
        code = daemon.stop()
        if code != 0:
            raise AssertionError(f"daemon exit {code}: {daemon.log()[-2000:]}")
    return trial


def run(trials: int, steps: int, seed: int, directory: Path | None, at: str = "random") -> list[Trial]:
    data = batches(steps)
    ref = Reference(steps, data)
    rng = random.Random(seed)
    results = []
    for i in range(trials):
        root = Path(tempfile.mkdtemp(prefix=f"fy-crash{i}-", dir=directory or "/tmp"))
        try:
            results.append(run_trial(root, rng, ref, data, steps, at=at))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--at", choices=["random", "checkpoint"], default="random",
                        help="kill at a random moment (default) or inside a checkpoint")
    parser.add_argument("--dir", type=Path, help="where the trials' state goes (default /tmp)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    t0 = time.time()
    results = run(args.trials, args.steps, args.seed, args.dir, args.at)
    detect = [t.detect_s for t in results if t.detect_s is not None]
    summary = {
        "trials": len(results),
        "killed_during": {k: sum(t.killed_during == k for t in results) for k in {t.killed_during for t in results}},
        "in_flight_step_committed": sum(any(v == t.acked_step + 1 for v in t.states.values()) for t in results),
        "resumed": sum(t.resumed_to is not None for t in results),
        "resumed_from_interrupted_checkpoint": sum(t.resumed_from is not None and t.resumed_from != t.checkpoint
                                                   for t in results),
        "debris_left": sum(len(t.debris) for t in results),
        "bytes_left_max": max((t.left_bytes or 0) for t in results) if results else 0,
        "detect_s_median": statistics.median(detect) if detect else None,
        "detect_s_max": max(detect) if detect else None,
        "detect_limit_s": DETECT_LIMIT_S,
        "all_consistent": all(not t.debris and not t.left_bytes for t in results),
        "seconds": time.time() - t0,
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "trials": [t.__dict__ for t in results]}, indent=2))


if __name__ == "__main__":
    main()

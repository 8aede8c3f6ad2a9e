"""One training job of bench/soak.py: trains a small block model through ``attach`` on a
shared fuyoud, checkpoints every few steps, and picks up after any death from its newest
good checkpoint.

    python bench/soak_job.py SPEC_JSON

SPEC (from bench/soak.py): ``name`` (also its namespace), ``socket``, ``dir`` (its
checkpoints and its event log), ``steps``, ``every`` (a checkpoint after every so many
steps), ``keep`` (checkpoints kept), and the job's model and training settings (``width``,
``depth``, ``optimizer``, ``state_dtype``, ``offload``, ``accumulation``, ``clip``,
``seed``). Each run of this script is one *life* of the job:

1. It lists its checkpoint directories (``ckpt-<step>-<life>``), newest step first, and
   resumes from the first that ``attach(resume=...)`` accepts, with the learning-rate
   schedule's state from the checkpoint's ``extra``. One refused as damaged (DataLoss,
   or anything but the daemon being unavailable) is logged with the daemon's message and
   deleted, and the previous one is tried. None left: it starts from step 0 (attach
   without resume resets the namespace's groups).
2. It trains to ``steps``: step s's micro-batches are a function of (seed, s) only, so a
   replayed step computes what it computed before. Each step's loss (float.hex) is logged.
3. After every ``every`` steps it checkpoints, in a mode fixed by (name, step) (so a run
   without faults keeps the same checkpoints), and deletes all but the newest ``keep``.
4. At the end it logs a digest of each group's whole optimizer state (master weights,
   moments, step count: read from the daemon), and of the trained weights, then exits 0.

The event log (``events.jsonl``, one JSON object a line, appended, fsynced) is what
bench/soak.py judges. Exit codes: 0 done; 75 (EX_TEMPFAIL) the daemon was unavailable;
1 any other error (logged with its type and message).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch
from torch import nn

import fuyou_client

TEMPFAIL = 75


class Blocks(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def make_model(spec: dict) -> Blocks:
    torch.manual_seed(spec["seed"])
    return Blocks(spec["width"], spec["depth"])


def micro_batches(spec: dict, step: int) -> list[torch.Tensor]:
    """Step ``step``'s micro-batches: the same every time the step is computed."""
    gen = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + step)
    return [torch.randn(16, spec["width"], generator=gen) for _ in range(spec["accumulation"])]


def optimizer(spec: dict):
    if spec["optimizer"] == "sgd":
        return fuyou_client.SGD(lr=0.05, momentum=0.9, weight_decay=0.01)
    return fuyou_client.AdamW(lr=5e-3, betas=(0.9, 0.98), eps=1e-7, weight_decay=0.05,
                              state_dtype=spec["state_dtype"])


def schedule(engine) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))


def checkpoint_mode(name: str, step: int) -> str:
    """Snapshot or copy, fixed by the job and the step (a third of them copies)."""
    return "copy" if zlib.crc32(f"{name}/{step}".encode()) % 3 == 0 else "snapshot"


def checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the job's checkpoint directories, newest first (a partial one the
    daemon was writing is named ``<dir>.partial-<pid>`` and is not listed)."""
    found = []
    for p in directory.iterdir():
        parts = p.name.split("-")
        if len(parts) == 3 and parts[0] == "ckpt" and parts[1].isdigit() and parts[2].isdigit():
            found.append((int(parts[1]), int(parts[2]), p))
    return [(step, p) for step, _, p in sorted(found, reverse=True)]


def read_events(path: Path) -> list[dict]:
    """The event log's events; a line torn by a kill mid-write is skipped."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events


class Log:
    """Appends events to the job's log, each fsynced; a new life starts on a new line."""

    def __init__(self, path: Path):
        self.life = max((e["life"] for e in read_events(path) if e.get("event") == "start"), default=-1) + 1
        torn = path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
        self.f = open(path, "a")
        if torn:
            self.f.write("\n")

    def __call__(self, event: str, **fields) -> None:
        self.f.write(json.dumps({"event": event, "life": self.life, "pid": os.getpid(), "t": time.time(),
                                 **fields}) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def state_digest(session, engine) -> dict[str, str]:
    """sha256 of each group's whole state object (its header with the step count, master
    weights, moments) as the daemon holds it."""
    out = {}
    for g in engine.groups:
        name = g.spec.name
        size = session.stat(f"optim/{name}").size
        buf = session.allocate(size)
        try:
            session.swap_in(f"optim/{name}", buf)
            out[name] = hashlib.sha256(bytes(buf.view[:size])).hexdigest()
        finally:
            buf.free()
    return out


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for n, p in sorted(model.state_dict().items()):
        h.update(n.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def attach_resumed(spec: dict, log: Log):
    """(engine, model, scheduler, first step): from the newest checkpoint the daemon accepts."""
    directory = Path(spec["dir"])
    options = dict(socket=spec["socket"], namespace=spec["name"], offload=spec["offload"],
                   accumulation_steps=spec["accumulation"], max_grad_norm=spec["clip"])
    listed = checkpoints(directory)
    log("listed", checkpoints=[s for s, _ in listed])
    for step, path in listed:
        model = make_model(spec)
        try:
            engine = fuyou_client.attach(model, optimizer(spec), resume=path, **options)
        except fuyou_client.DataLoss as exc:
            if str(path) not in str(exc):  # (the array failed a transfer: not this checkpoint's fault)
                raise
            # Damaged: refused, naming it. It goes, and the previous one is tried.
            log("refused", step=step, checkpoint=str(path), error=type(exc).__name__, message=str(exc))
            with fuyou_client.connect(spec["socket"], namespace=spec["name"]) as s:
                try:
                    s.delete_checkpoint(path)
                except fuyou_client.FuyouClientError:  # (a copy the daemon no longer knows: its files go)
                    import shutil

                    shutil.rmtree(path, ignore_errors=True)
            continue
        sched = schedule(engine)
        sched.load_state_dict(engine.checkpoint_extra["sched"])
        engine.resume_lr()
        log("resumed", step=step, checkpoint=str(path))
        return engine, model, sched, step
    model = make_model(spec)
    engine = fuyou_client.attach(model, optimizer(spec), **options)
    log("resumed", step=0, checkpoint=None)
    return engine, model, schedule(engine), 0


def rotate(engine, directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` steps' checkpoints, one per step (a step checkpointed again
    by a later life: the later one), as a run without faults keeps."""
    kept: set[int] = set()
    for step, path in checkpoints(directory):  # (newest first)
        if step in kept or len(kept) >= keep:
            engine.session.delete_checkpoint(path)
        else:
            kept.add(step)


def train(spec: dict, log: Log) -> None:
    directory = Path(spec["dir"])
    engine, model, sched, start = attach_resumed(spec, log)
    for s in range(start, spec["steps"]):
        losses = []
        for x in micro_batches(spec, s):
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
        engine.step()
        engine.zero_grad()
        sched.step()
        log("step", step=s, loss=[v.item().hex() for v in losses])
        if (s + 1) % spec["every"] == 0:
            path = directory / f"ckpt-{s + 1:05d}-{log.life:03d}"
            mode = checkpoint_mode(spec["name"], s + 1)
            log("checkpoint", step=s + 1, checkpoint=str(path), mode=mode)
            engine.save_checkpoint(path, extra={"sched": sched.state_dict()}, mode=mode)
            log("checkpointed", step=s + 1, checkpoint=str(path), mode=mode)
            rotate(engine, directory, spec["keep"])
    rotate(engine, directory, spec["keep"])  # (a life killed between a checkpoint and its rotation left one more)
    digest = state_digest(engine.session, engine)
    engine.close()
    log("done", state=digest, weights=weights_digest(model), steps=spec["steps"])


def main() -> int:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    log = Log(Path(spec["dir"]) / "events.jsonl")
    log("start")
    try:
        train(spec, log)
    except fuyou_client.DaemonUnavailable as exc:
        log("failed", error=type(exc).__name__, message=str(exc)[:500])
        return TEMPFAIL
    except Exception as exc:  # noqa: BLE001 - logged for bench/soak.py, which restarts the job
        log("failed", error=type(exc).__name__, message=str(exc)[:500])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of the optimizer-host tests (test_optimizer_host.py), run under torchrun or
launched directly (RANK, WORLD_SIZE, MASTER_ADDR/PORT set).

    opthost_worker.py CASE OUT_DIR [key=value ...]     (OPT_RANKS="2" or "2,3")

The ranks named by $OPT_RANKS are optimizer ranks (``serve_optimizer`` against the daemon
at $FUYOUD_SOCKET, $FUYOUD_SOCKET_<rank> where a test gives each its own host); the
others are workers that train a tiny model through ``attach(optimizer_ranks=...)`` next
to a reference: torch DDP + fused AdamW on the workers' own group (two workers), or the
same collectives by hand around fused AdamW (the workers' reduce-scatter and all-gather
of each group's padded gradient). Each rank writes ``OUT_DIR/<case>-rank<r>.json``.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import HYPER, tiny_gpt2, tiny_llama  # noqa: E402
from dp_worker import NORMS, Masters, differ, max_diff, poisoned_step  # noqa: E402
from dp_worker import _layer_groups as layer_groups  # noqa: E402

import fuyou_client  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
OPT_RANKS = [int(r) for r in os.environ.get("OPT_RANKS", str(WORLD - 1)).split(",")]
WORKERS = [r for r in range(WORLD) if r not in OPT_RANKS]
W = len(WORKERS)
IS_OPT = RANK in OPT_RANKS
SOCKET = os.environ.get(f"FUYOUD_SOCKET_{RANK}") or os.environ.get("FUYOUD_SOCKET")
# FY_DEVICE=cuda: each worker computes on cuda:LOCAL_RANK (the links stay gloo: the optimizer rank has no GPU)
DEVICE = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if os.environ.get("FY_DEVICE") == "cuda" and not IS_OPT else "cpu"
G_WORKERS = None  # the workers' own group (DDP's), made by every rank at start


def batch(step: int, micro: int, size: int = 2, seq: int = 16, vocab: int = 256) -> torch.Tensor:
    """This worker's micro-batch ``micro`` of iteration ``step`` (the same on every run)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + WORKERS.index(RANK))
    return torch.randint(0, vocab, (size, seq), generator=g).to(DEVICE)


def model_for(kind: str, dtype: torch.dtype, meta: bool = False):
    """GPT-2 or Llama, 2 layers of width 32 ("wide": GPT-2 of width 96, 1.4 MB of state)."""
    torch.manual_seed(0)
    make = {"llama": lambda: tiny_llama(layers=2, width=32), "wide": lambda: tiny_gpt2(layers=2, width=96)}.get(
        kind, lambda: tiny_gpt2(layers=2, width=32))
    if meta:
        with torch.device("meta"):
            return make().to(dtype)
    return make().to(dtype).to(DEVICE)


def config(**kw) -> dict:
    cfg = {"model": "gpt2", "dtype": torch.float32, "accum": 1, "clip": None, "stand_in": False, "offload": False}
    cfg.update(kw)
    return cfg


MATRIX = {
    "plain": config(),
    "llama": config(model="llama"),
    "accum": config(accum=2),
    "clip": config(clip=0.05),
    "bf16": config(dtype=torch.bfloat16),
    "stand-in": config(accum=2, stand_in=True),
    "stand-in-clip": config(clip=0.05, stand_in=True),
    "offload": config(offload=True),
    "offload-accum": config(offload=True, accum=2),
    "offload-bf16": config(offload=True, dtype=torch.bfloat16),
    "offload-clip": config(offload=True, clip=0.05),
    "stand-in-offload": config(offload=True, accum=2, stand_in=True),
}


def run_ddp(cfg: dict, steps: int):
    """torch DDP on the workers' group around fused AdamW (two workers)."""
    model = model_for(cfg["model"], cfg["dtype"])
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=G_WORKERS)
    opt, losses, k = Masters(model), [], cfg["accum"]
    NORMS.clear()  # (Masters.step appends each clipped step's norm)
    for step in range(steps):
        for micro in range(k):
            x = batch(step, micro)
            if micro < k - 1:
                with ddp.no_sync():
                    loss = ddp(x, labels=x).loss / k
                    loss.backward()
            else:
                loss = ddp(x, labels=x).loss / k
                loss.backward()
            losses.append(loss.item())
        opt.step(cfg["clip"])
    return model, losses, list(NORMS)


def run_manual(cfg: dict, steps: int):
    """The engine's collectives around fused AdamW: each layer group's flat gradient
    (padded to the workers' shards) reduce-scattered among the workers (added in rank
    order), the shards gathered again, divided by the number of workers."""
    from fuyou_client.parallel import world as distributed

    model = model_for(cfg["model"], cfg["dtype"])
    opt, groups, losses, k = Masters(model), layer_groups(model), [], cfg["accum"]
    NORMS.clear()
    for step in range(steps):
        for micro in range(k):
            x = batch(step, micro)
            loss = model(x, labels=x).loss / k
            loss.backward()
            losses.append(loss.item())
        for params in reversed(groups):
            numel = sum(p.numel() for p in params)
            shards = distributed.Shards(numel, W, WORKERS.index(RANK))
            flat = torch.zeros(shards.padded, dtype=cfg["dtype"], device=DEVICE)
            flat[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
            mine = torch.empty(shards.per, dtype=flat.dtype)
            distributed.reduce_scatter(mine, flat, G_WORKERS)
            distributed.all_gather(flat, mine, G_WORKERS)
            flat.div_(W)
            at = 0
            for p in params:
                p.grad.copy_(flat[at:at + p.numel()].view(p.shape))
                at += p.numel()
        opt.step(cfg["clip"])
    return model, losses, list(NORMS)


def serve(cfg: dict | None = None, meta: bool = True, **options):
    cfg = cfg or config()
    model = model_for(cfg["model"], cfg["dtype"], meta=meta)
    return fuyou_client.serve_optimizer(model, fuyou_client.AdamW(**HYPER), optimizer_ranks=OPT_RANKS,
                                        socket=SOCKET, **options)


def attach(model, cfg: dict, **extra):
    if cfg.get("stand_in"):  # a device with its own memory and late copies (discrete_device.py)
        from discrete_device import LateCopyDevice
        extra["device"] = LateCopyDevice(seed=RANK)
    return fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), optimizer_ranks=OPT_RANKS, offload=cfg["offload"],
                               accumulation_steps=cfg["accum"], max_grad_norm=cfg["clip"], socket=SOCKET,
                               host_budget=16 << 20, **extra)


def run_ours(cfg: dict, steps: int, keep: list | None = None, first: int = 0, **extra):
    model = model_for(cfg["model"], cfg["dtype"])
    engine = attach(model, cfg, **extra)
    losses, norms, k = [], [], cfg["accum"]
    for step in range(first, first + steps):
        for micro in range(k):
            x = batch(step, micro)
            loss = model(x, labels=x).loss / k
            loss.backward()
            losses.append(loss.item())
        norms.append(engine.grad_norm())
        engine.step()
        engine.zero_grad()
    # What the worker holds between steps: no object in its daemon (no optimizer state, no
    # master weights), and with offload no block's weights (the parameters are empty).
    HELD.update(objects=len(engine.session.objects()),
                block_elements=sum(p.data.numel() for g in engine.groups if g.offloaded is not None
                                   for _, p in g.spec.params))
    if keep is not None:
        keep.append(engine)
    else:
        engine.close()
    return model, losses, norms


HELD: dict = {}  # the last run_ours's: what the worker held between steps


def case_exact(out: Path, names: str = "plain") -> dict:
    """Every name: the reference, then ours (the optimizer ranks serve both)."""
    result = {}
    for name in names.split(","):
        cfg = MATRIX[name]
        manual = W != 2
        if IS_OPT:
            served = serve(cfg)
            result[name] = {"served": served.commands, "steps": served.steps}
            continue
        ref, ref_losses, ref_norms = (run_manual if manual else run_ddp)(cfg, 3)
        ours, losses, norms = run_ours(cfg, 3)
        result[name] = {"differ": differ(ours, ref), "max_diff": max_diff(ours, ref), "losses": losses,
                        "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
                        "reference": "manual" if manual else "ddp", "held": dict(HELD)}
    return result


def _saved(out: Path, name: str):
    ref = model_for("gpt2", torch.float32)
    ref.load_state_dict(torch.load(out / name, map_location=DEVICE))
    return ref


def _train(model, engine, steps) -> None:
    for step in steps:
        x = batch(step, 0)
        model(x, labels=x).loss.backward()
        engine.step()
        engine.zero_grad()


def case_checkpoint(out: Path, phase: str = "save", ckpt: str = "", steps: str = "2", offload: str = "0") -> dict:
    """save: 2 steps, checkpoint, the weights then (at_ckpt.pt), 2 more (continued.pt),
    export. resume: attach(resume=ckpt), the weights at once against at_ckpt.pt (resident;
    ``offload=1``: the blocks' come with their fetches), ``steps`` more steps (against
    continued.pt where the workers are as many as at the save)."""
    cfg = config(offload=offload == "1")
    if IS_OPT:
        served = serve(cfg, resume=ckpt if phase == "resume" else None)
        return {"served": served.commands, "steps": served.steps}
    model = model_for("gpt2", torch.float32)
    if phase == "save":
        engine = attach(model, cfg)
        _train(model, engine, range(2))
        engine.save_checkpoint(ckpt, extra={"data_position": 2})
        if RANK == WORKERS[0]:
            torch.save(model.state_dict(), out / "at_ckpt.pt")
        _train(model, engine, range(2, 4))
        if RANK == WORKERS[0]:
            torch.save(model.state_dict(), out / "continued.pt")
        engine.export(out / "export")
        engine.close()
        return {}
    engine = attach(model, cfg, resume=ckpt)
    at_ckpt = _saved(out, "at_ckpt.pt")
    resident = [n for n, p in model.named_parameters() if p.numel()]  # (offloaded ones: empty until fetched)
    result = {"at_resume": [n for n in differ(model, at_ckpt) if n in resident], "resident": len(resident),
              "extra": engine.checkpoint_extra, "lr": engine.optimizer.param_groups[0]["lr"]}
    _train(model, engine, range(2, 2 + int(steps)))
    result["daemon_steps"] = sorted({info.step for info in engine.coordinator.infos})  # (the optimizer ranks')
    engine.close()  # (the parameters materialized: offloaded ones fetched)
    if int(steps) == 2:
        result["differ"] = differ(model, _saved(out, "continued.pt"))
    return result


def case_kill(out: Path, who: str = "worker", ckpt: str = "") -> dict:
    """2 steps and a checkpoint, then in step 3, after backward (its steps sent), the last
    worker dies (SIGKILL), or the first worker kills the first optimizer rank; the others
    report how they ended and how soon."""
    cfg = config()
    pids = [None] * WORLD
    dist.all_gather_object(pids, os.getpid())
    victim = WORKERS[-1] if who == "worker" else OPT_RANKS[0]
    if IS_OPT:
        try:
            serve(cfg)
            return {"error": None}
        except Exception as exc:  # noqa: BLE001 - what the test reads
            return {"error": f"{type(exc).__name__}: {exc}", "at": time.time()}
    model = model_for("gpt2", torch.float32)
    engine = attach(model, cfg)
    _train(model, engine, range(2))
    engine.save_checkpoint(ckpt)
    x = batch(2, 0)
    model(x, labels=x).loss.backward()
    if RANK == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if who == "optimizer" and RANK == WORKERS[0]:
        os.kill(pids[victim], signal.SIGKILL)
    t0 = time.monotonic()
    try:
        engine.step()
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - what the test reads
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}


def case_bad(out: Path, what: str = "model") -> dict:
    """Ranks that disagree: every rank gets an error, none hangs, the group stays usable."""
    result = {}
    for kind in what.split(","):
        try:
            if IS_OPT:
                options = {}
                if kind == "capacity":
                    options["socket"] = os.environ["FUYOUD_SOCKET_SMALL"]
                cfg = config(model={"model": "llama", "capacity": "wide"}.get(kind, "gpt2"))
                model = model_for(cfg["model"], cfg["dtype"], meta=True)
                fuyou_client.serve_optimizer(model, fuyou_client.AdamW(**HYPER), optimizer_ranks=OPT_RANKS,
                                             socket=options.get("socket", SOCKET))
            else:
                ranks = OPT_RANKS if not (kind == "ranks" and RANK == WORKERS[-1]) else [0]
                model = model_for("wide" if kind == "capacity" else "gpt2", torch.float32)
                engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), optimizer_ranks=ranks,
                                             offload=False, socket=SOCKET)
                engine.close()
            result[kind] = None
        except Exception as exc:  # noqa: BLE001
            result[kind] = f"{type(exc).__name__}: {exc}"
    dist.barrier()  # (still usable)
    return result


def case_nonfinite(out: Path) -> dict:
    """The last worker's gradient of block 0 holds NaN in step 2: without clipping the
    optimizer rank's daemon refuses that group's step (NonFinite on every worker naming it,
    the others stepped); with clipping the norm is NaN and no group steps. The workers'
    weights stay equal, and training goes on."""
    result = {}
    for clip in (None, 0.05):
        cfg = config(clip=clip)
        if IS_OPT:
            result[str(clip)] = serve(cfg).steps
            continue
        model = model_for("gpt2", torch.float32)
        engine = attach(model, cfg)
        _train(model, engine, range(1))
        error = poisoned_step(model, engine, batch(1, 0), RANK == WORKERS[-1])
        _train(model, engine, range(2, 3))
        stepped = sorted(info.step for info in engine.coordinator.infos)  # (the daemon's step counts after step 3)
        digest = float(sum(p.detach().double().sum() for p in model.parameters()))
        engine.close()
        digests = [None] * W
        dist.all_gather_object(digests, digest, group=G_WORKERS)
        result[str(clip)] = {"error": error, "stepped": stepped, "same_weights": len(set(digests)) == 1}
    return result


CASES = {"nonfinite": case_nonfinite, "exact": case_exact, "checkpoint": case_checkpoint, "kill": case_kill,
         "bad": case_bad}


def _setup() -> None:
    global G_WORKERS
    if DEVICE != "cpu":
        torch.cuda.set_device(DEVICE)
    logging.basicConfig(level=logging.WARNING, format=f"rank {RANK}: %(name)s: %(message)s")
    G_WORKERS = dist.new_group(WORKERS)


if __name__ == "__main__":
    import dp_worker

    dp_worker.main(CASES, "gloo", _setup)

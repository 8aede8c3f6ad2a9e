"""One rank of the data-parallel tests (test_distributed.py), run under torchrun.

    torchrun --nproc-per-node N tests/dp_worker.py CASE OUT_DIR [key=value ...]

Each case trains a tiny model through ``attach`` on the gloo group torchrun set up, next
to its reference (torch DDP with torch's fused AdamW, or the same collectives around
torch's fused AdamW by hand), and writes ``OUT_DIR/<case>-rank<r>.json`` with what the
test asserts (mismatches, losses). The daemon is the one at $FUYOUD_SOCKET.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import HYPER, tiny_gpt2, tiny_llama  # noqa: E402

import fuyou_client  # noqa: E402
from fuyou_client.parallel import world as distributed  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BACKEND = os.environ.get("FY_BACKEND", "gloo")  # "nccl": each rank on cuda:LOCAL_RANK
DEVICE = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if BACKEND == "nccl" else "cpu"


def batch(step: int, micro: int, rank: int, size: int = 2, seq: int = 16, vocab: int = 256) -> torch.Tensor:
    """Rank ``rank``'s micro-batch ``micro`` of iteration ``step`` (the same on every run)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, vocab, (size, seq), generator=g).to(DEVICE)


def model_for(kind: str, dtype: torch.dtype):
    torch.manual_seed(0)
    m = tiny_llama(layers=2, width=32) if kind == "llama" else tiny_gpt2(layers=2, width=32)
    return m.to(dtype).to(DEVICE)


def differ(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sb = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(p.detach(), sb[n].detach())]


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sb = dict(b.named_parameters())
    return max(float((p.detach().float() - sb[n].detach().float()).abs().max()) for n, p in a.named_parameters())


class Masters:
    """The reference's fp32 master weights, stepped by torch's fused AdamW and copied into
    the (maybe bf16) model after each step, as fuyoud keeps them."""

    def __init__(self, model):
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, **HYPER, fused=True)

    def step(self, clip: float | None, grads=None) -> None:
        """``grads``: the mean gradients as the collectives made them (default: .grad), in
        whatever dtype they were summed in; clipped as they are."""
        holders = self.params
        if grads is not None:
            holders = [torch.zeros_like(g).requires_grad_() for g in grads]
            for h, g in zip(holders, grads):
                h.grad = g.clone()
        if clip is not None:
            NORMS.append(float(torch.nn.utils.clip_grad_norm_(holders, clip)))
        for m, h in zip(self.masters, holders):
            m.grad = h.grad.float()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.params):
                p.copy_(m)
                p.grad = None


def run_ddp(cfg: dict, steps: int) -> tuple[torch.nn.Module, list[float]]:
    """torch DDP (gloo) around fused AdamW: the reference of N=2."""
    model = model_for(cfg["model"], cfg["dtype"])
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[DEVICE] if BACKEND == "nccl" else None)
    opt = Masters(model)
    losses = []
    k = cfg["accum"]
    for step in range(steps):
        for micro in range(k):
            x = batch(step, micro, RANK)
            if micro < k - 1:
                with ddp.no_sync():
                    loss = ddp(x, labels=x).loss / k
                    loss.backward()
            else:
                loss = ddp(x, labels=x).loss / k
                loss.backward()
            losses.append(loss.item())
        opt.step(cfg["clip"])
    return model, losses


def run_manual(cfg: dict, steps: int) -> tuple[torch.nn.Module, list[float]]:
    """The same collectives as the engine around torch's fused AdamW: reduce-scatter each
    layer group's flat gradient (padded as the engine pads it), divide by N (with
    ``reduce="backward"`` after every backward, the shard summed in fp32), all-gather;
    the reference where DDP's arithmetic is not the engine's (N=3, per-backward)."""
    model = model_for(cfg["model"], cfg["dtype"])
    opt = Masters(model)
    groups = _layer_groups(model)
    per_backward = cfg["reduce"] == "backward"
    losses = []
    k = cfg["accum"]
    for step in range(steps):
        sums = [None] * len(groups)
        for micro in range(k):
            x = batch(step, micro, RANK)
            loss = model(x, labels=x).loss / k
            loss.backward()
            losses.append(loss.item())
            if per_backward or micro == k - 1:
                for i, params in enumerate(groups):
                    part = _reduce_scatter(params)
                    if per_backward:
                        sums[i] = part.float() if sums[i] is None else sums[i].add_(part)
                        for p in params:
                            p.grad = None
                    else:
                        sums[i] = part
        grads = []
        for params, mine in zip(groups, sums):
            shards = distributed.Shards(sum(p.numel() for p in params), WORLD, RANK)
            flat = torch.empty(shards.padded, dtype=mine.dtype, device=DEVICE)
            distributed.all_gather(flat, mine, None)
            at = 0
            for p in params:
                grads.append(flat[at:at + p.numel()].view(p.shape))
                at += p.numel()
        order = {id(p): i for i, p in enumerate(q for params in groups for q in params)}
        opt.step(cfg["clip"], [grads[order[id(p)]] for p in opt.params])
    return model, losses


def _reduce_scatter(params) -> torch.Tensor:
    numel = sum(p.numel() for p in params)
    shards = distributed.Shards(numel, WORLD, RANK)
    flat = torch.zeros(shards.padded, dtype=params[0].dtype, device=DEVICE)
    flat[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
    mine = torch.empty(shards.per, dtype=flat.dtype, device=DEVICE)
    distributed.reduce_scatter(mine, flat, None)
    return mine.div_(WORLD)


def _layer_groups(model) -> list[list[torch.nn.Parameter]]:
    from fuyou_client.model.blocks import split
    from fuyou_client.model.param_groups import resolve

    tg = resolve(model, fuyou_client.AdamW(**HYPER), None, None)
    return [[p for _, p in spec.params] for spec in split(model, None, tg.index) if spec.params]


def run_ours(cfg: dict, steps: int, engine_out: list | None = None, **extra) -> tuple[torch.nn.Module, list[float]]:
    model = model_for(cfg["model"], cfg["dtype"])
    if cfg.get("stand_in"):  # a device with its own memory and late copies (discrete_device.py)
        from discrete_device import LateCopyDevice
        extra["device"] = LateCopyDevice(seed=RANK)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), offload=cfg["offload"], accumulation_steps=cfg["accum"],
                                 max_grad_norm=cfg["clip"], reduce=cfg["reduce"], namespace=cfg.get("namespace"),
                                 activations=cfg.get("activations", "keep"), host_budget=16 << 20, **extra)
    losses = []
    k = cfg["accum"]
    device = extra.get("device")
    before = (device.bytes_up, device.bytes_down) if device is not None else None
    for step in range(steps):
        for micro in range(k):
            x = batch(step, micro, RANK)
            loss = model(x, labels=x).loss / k
            loss.backward()
            losses.append(loss.item())
        if cfg["clip"] is not None:
            NORMS.append(engine.grad_norm())
        engine.step()
        engine.zero_grad()
    if device is not None and cfg["offload"] and RANK == 0:  # each fetch uploads what this rank read: its shard
        resident = sum(g.shard.shards.per * g.dtype.itemsize for g in engine.groups if g.offloaded is None)
        PCIE.update(up=device.bytes_up - before[0],  # (and the resident groups' shards, once per step)
                    want_up=engine.offloader.fetched_bytes + engine.offloader.served_bytes + steps * resident)
    if device is not None and not cfg["offload"]:  # what crossed "PCIe": the shards only, once per reduction and step
        shard_bytes = sum(g.shard.shards.per * g.dtype.itemsize for g in engine.groups)
        reductions = k if cfg["reduce"] == "backward" else 1
        PCIE.update(up=device.bytes_up - before[0], down=device.bytes_down - before[1],
                    want_up=steps * shard_bytes, want_down=steps * reductions * shard_bytes)
    if engine_out is not None:
        engine_out.append(engine)
    else:
        engine.close()
    return model, losses


PCIE: dict = {}  # the stand-in device's byte counts of the last run_ours
NORMS: list = []  # the gradient norms of a reference run, then of ours (engine.grad_norm())


def config(**kw) -> dict:
    cfg = {"model": "gpt2", "dtype": torch.float32, "accum": 1, "clip": None, "reduce": "step", "offload": False}
    cfg.update(kw)
    return cfg


MATRIX = {
    "plain": config(),
    "llama": config(model="llama"),
    "accum": config(accum=2),
    "accum-backward": config(accum=2, reduce="backward"),
    "clip": config(clip=0.05),
    "bf16": config(dtype=torch.bfloat16),
    "swap": config(activations="swap", accum=2),
    "offload": config(offload=True),
    "offload-accum": config(offload=True, accum=2),
    "offload-bf16": config(offload=True, dtype=torch.bfloat16),
    "offload-clip": config(offload=True, clip=0.05),
    "stand-in": config(accum=2, stand_in=True),
    "stand-in-backward": config(accum=2, reduce="backward", stand_in=True, dtype=torch.bfloat16),
    "stand-in-clip": config(clip=0.05, stand_in=True),
    "stand-in-offload": config(offload=True, accum=2, stand_in=True),
    "stand-in-offload-bf16": config(offload=True, stand_in=True, dtype=torch.bfloat16),
}


def case_exact(out: Path, names: str = "plain") -> dict:
    """Bitwise against DDP at N=2 (within 1e-6 with clipping: the norm's sums differ),
    against the same collectives by hand otherwise."""
    result = {}
    for name in names.split(","):
        cfg = config(**MATRIX[name]) if name in MATRIX else config()
        ref_fn = run_ddp if WORLD == 2 and cfg["reduce"] == "step" else run_manual
        NORMS.clear()
        ref, ref_losses = ref_fn(cfg, 3)
        PCIE.clear()
        ref_norms = list(NORMS)
        NORMS.clear()
        ours, losses = run_ours(cfg, 3)
        result[name] = {"differ": differ(ours, ref), "max_diff": max_diff(ours, ref), "losses": losses,
                        "ref_losses": ref_losses, "reference": ref_fn.__name__, "pcie": dict(PCIE),
                        "norms": list(NORMS), "ref_norms": ref_norms}
    return result


def case_single(out: Path, lr: str = "1e-4") -> dict:
    """One step of N ranks against one process on the concatenated batch (the gradients'
    sums differ in order; AdamW's first step, lr * g / (|g| + eps), magnifies that by
    lr / eps where |g| is below eps, hence a moderate ``lr``)."""
    hyper = dict(HYPER, lr=float(lr))
    model = model_for("gpt2", torch.float32)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**hyper), offload=False)
    x = batch(0, 0, RANK)
    model(x, labels=x).loss.backward()
    engine.step()
    engine.close()
    ours = model
    model = model_for("gpt2", torch.float32)
    opt = torch.optim.AdamW(model.parameters(), **hyper, fused=True)
    x = torch.cat([batch(0, 0, r) for r in range(WORLD)])
    model(x, labels=x).loss.backward()
    opt.step()
    return {"max_diff": max_diff(ours, model)}


def _train(model, engine, steps) -> None:
    for step in steps:
        x = batch(step, 0, RANK)
        model(x, labels=x).loss.backward()
        engine.step()
        engine.zero_grad()


def _saved(out: Path, name: str):
    ref = model_for("gpt2", torch.float32)
    ref.load_state_dict(torch.load(out / name))
    return ref


def case_checkpoint(out: Path, phase: str = "save", ckpt: str = "", save_to: str = "", steps: str = "0",
                    mode: str = "auto") -> dict:
    """save (N=2): 2 steps, checkpoint, the weights then (at_ckpt.pt), 2 more steps
    (continued.pt), export. resume: attach(resume=ckpt, reshard=True) at this world
    size: the weights must be at_ckpt's; then a checkpoint to ``save_to``, or ``steps``
    more steps compared with continued.pt (the same data only at N=2)."""
    if phase == "save":
        engines = []
        model, _ = run_ours(config(namespace=f"ck{WORLD}"), 2, engines)
        engine = engines[0]
        engine.save_checkpoint(ckpt, extra={"data_position": 2}, mode=mode)
        if RANK == 0:
            torch.save(model.state_dict(), out / "at_ckpt.pt")
        _train(model, engine, range(2, 4))
        engine.export(out / f"export{WORLD}")
        engine.close()
        if RANK == 0:
            torch.save(model.state_dict(), out / "continued.pt")
        return {"lr": engine.lr}
    model = model_for("gpt2", torch.float32)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), offload=False, resume=ckpt, reshard=True)
    result = {"at_resume": differ(model, _saved(out, "at_ckpt.pt")), "extra": engine.checkpoint_extra,
              "world": json.loads((Path(ckpt) / "world.json").read_text())["world_size"]}
    if save_to:
        engine.save_checkpoint(save_to, extra=engine.checkpoint_extra)
    _train(model, engine, range(2, 2 + int(steps)))
    if int(steps):
        ref = _saved(out, "continued.pt")
        result.update(differ=differ(model, ref), max_diff=max_diff(model, ref), steps=engine.part_steps())
    engine.close()
    return result


def case_kill(out: Path, ckpt: str = "") -> dict:
    """2 steps and a checkpoint as case_checkpoint's, then rank 1 dies (SIGKILL) after its
    backward of step 3; rank 0 reports how it ended, how soon its daemon had reclaimed
    the dead session, and the step counts left in rank 1's namespace."""
    engines = []
    model, _ = run_ours(config(namespace="killed"), 2, engines)
    engine = engines[0]
    engine.save_checkpoint(ckpt, extra={"data_position": 2})
    x = batch(2, 0, RANK)
    model(x, labels=x).loss.backward()
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        engine.step()
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - what the test reads
        result = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    while engine.session.status().sessions > 1 and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    result["reclaimed_seconds"] = time.monotonic() - t0
    with fuyou_client.connect(namespace="killed.r1") as s:  # (free again once reclaimed)
        result["steps_r1"] = sorted({s.group(o.name[len("optim/"):]).step for o in s.objects("optim/")})
    result["steps_r0"] = sorted(set(engine.part_steps().values()))
    return result


def case_bad(out: Path, what: str = "model", ckpt: str = "") -> dict:
    """Ranks that attach inconsistently: every rank must get an error, none hang, and the
    process group stays usable (the cases run one after another)."""
    result = {}
    for kind in what.split(","):
        model = model_for("llama" if (kind == "model" and RANK == 1) else "gpt2", torch.float32)
        options = dict(offload=False, namespace=f"bad-{kind}")
        held = None
        if kind == "daemon" and RANK == 1:
            options["socket"] = str(out / "no-daemon-here.sock")
        if kind == "namespace":
            if RANK == 0:
                held = fuyou_client.connect(namespace="bad-namespace.r1")  # a live session holds rank 1's
            dist.barrier()
        if kind == "world":
            options["resume"] = ckpt
        if kind == "diverge":
            options["check_collectives"] = True
        try:
            engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), **options)
            if kind == "diverge":  # rank 1 leaves its second block out: its collectives differ from rank 0's
                if RANK == 1:
                    model.transformer.h = torch.nn.ModuleList(list(model.transformer.h)[:1])
                x = batch(0, 0, RANK)
                try:
                    model(x, labels=x).loss.backward()
                    engine.step()
                finally:
                    engine.close(materialize=False)
            else:
                engine.close()
            result[kind] = None
        except Exception as exc:  # noqa: BLE001
            result[kind] = f"{type(exc).__name__}: {exc}"
        if held is not None:
            held.close()
    dist.barrier()  # (still usable)
    return result


def poisoned_step(model, engine, x, poison: bool) -> str | None:
    """One backward whose gradient of block 0's c_fc weight is NaN where ``poison``, then
    the step: the NonFinite message it raised, or None."""
    hook = model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: g.fill_(float("nan")) if poison else g)
    model(x, labels=x).loss.backward()
    hook.remove()
    try:
        engine.step()
    except fuyou_client.NonFinite as exc:
        return str(exc)
    finally:
        engine.zero_grad()
    return None


def case_nonfinite(out: Path) -> dict:
    """Rank 1's gradient of one block holds NaN in step 2: no rank steps that block (its
    state kept everywhere), every rank raises NonFinite naming it, the others step, and
    the ranks' weights stay equal."""
    model = model_for("gpt2", torch.float32)
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), offload=False, namespace="nonfinite")
    _train(model, engine, range(1))
    error = poisoned_step(model, engine, batch(1, 0, RANK), RANK == 1)
    steps = {g.spec.name: engine.session.group(g.shard.pieces[0][0].name).step for g in engine.groups
             if g.shard.pieces}
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    _train(model, engine, range(2, 3))
    engine.close()
    digests = [None] * WORLD
    dist.all_gather_object(digests, digest)
    return {"error": error, "steps": steps, "same_weights": len(set(digests)) == 1}


CASES = {"nonfinite": case_nonfinite, "exact": case_exact, "single": case_single, "checkpoint": case_checkpoint, "kill": case_kill,
         "bad": case_bad}


def main(cases_table: dict | None = None, backend: str = BACKEND, setup=None) -> None:
    """CASE may be several, joined by "+": they run in one launch (arguments "case.key=value").
    (tests/opthost_worker.py runs its own ``cases_table`` through it; ``setup()`` once the
    process group is up.)"""
    table = cases_table or CASES
    cases, out = sys.argv[1].split("+"), Path(sys.argv[2])
    args = dict(a.split("=", 1) for a in sys.argv[3:])
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend, timeout=timedelta(seconds=float(os.environ.get("FY_PG_TIMEOUT", "60"))))
    if setup is not None:
        setup()
    for case in cases:
        kwargs = {k.split(".", 1)[1] if "." in k else k: v for k, v in args.items()
                  if "." not in k or k.split(".", 1)[0] == case}
        result = table[case](out, **kwargs)
        (out / f"{case}-rank{RANK}.json").write_text(json.dumps(result, default=str))
    # The process group dies before the interpreter does: what still holds it (the reference
    # runs' DDP reducers, closed engines, in reference cycles) is collected now, and then the
    # group itself, so that its gloo threads are joined while Python is alive. Freed by the
    # interpreter's last collection instead, a gloo thread can drop the last reference of a
    # finished collective's tensor views then, take the GIL during finalization and abort the
    # process ("terminate called without an active exception": pytorch/pytorch issue 190489).
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()

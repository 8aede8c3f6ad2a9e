"""``attach(model, optimizer, **options)``: the one call that hooks a model up to fuyoud.

It validates the options (options.py) and the parameter groups (param_groups.py), cuts
the model into layer groups (grouping.py), makes a model built on the meta device real
one group at a time (materialize.py), connects, resumes when asked, and builds the
Engine (engine.py); when anything fails the model is left as it came.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fuyou_client import checkpoints, distributed, dp_checkpoints, materialize
from fuyou_client.device import resolve
from fuyou_client.distributed import World
from fuyou_client.engine import GRADIENT_CHECKPOINTING, Engine, hf_checkpointing
from fuyou_client.grouping import block_list, split
from fuyou_client.optim import AdamW, SGD
from fuyou_client.options import AttachOptions
from fuyou_client.param_groups import resolve as resolve_groups
from fuyou_client.session import connect


def attach(model: nn.Module, optimizer: AdamW | SGD | None = None, **options) -> Engine:
    """Hook ``model`` up to fuyoud: its optimizer state (``optimizer``, default
    ``AdamW()``) moves to the SSD array, each layer group is stepped by the daemon as soon
    as backward has finished it, and the blocks' weights are fetched ahead of use. The
    options (``socket=``, ``max_grad_norm=``, ``offload=``, ``resume=``, ``weights=``,
    ``activations=``...) are the fields of ``fuyou_client.AttachOptions``, which
    documents each one; a misspelt or invalid one is refused before anything starts.

    Under torch.distributed (a world of more than one rank) every rank calls it: each
    connects to its own host's daemon and keeps its shard of the optimizer state there
    (docs/guide/distributed.md); a failure on any rank is an error on every rank.

    ``plan=``: a ``fuyou_client.plan(...)`` result or ``"auto"`` (plan for this model on
    this host now): its settings become the options not given (sizing/apply.py);
    ``engine.sizing_plan`` keeps it (its ``settings``: the micro-batch shape it assumed)."""
    plan = options.pop("plan", None)  # a fuyou_client.plan(...) or "auto": its settings (sizing/apply.py)
    if plan is not None:
        from fuyou_client.sizing.apply import apply
        options, optimizer, plan = apply(plan, model, optimizer, options)
    base = options.pop("options", None)  # attach(model, opt, options=AttachOptions(...), **overrides) too
    opts = dataclasses.replace(base, **options) if base is not None else AttachOptions(**options)
    world = World.of(opts.process_group)
    blocks, weights, resume, session = opts.blocks, opts.weights, opts.resume, opts.session
    materializer, error = None, None
    try:
        if world is not None:
            _check_world_options(opts)
        materializer = materialize.prepare(model, weights, resume is not None)  # (a meta model: CPU stand-ins now)
        if world is not None and materializer is not None:
            raise ValueError("a model on the meta device cannot be attached with data parallelism yet: build it on "
                             "the CPU on every rank (rank 0's weights are broadcast)")
        torch_groups = resolve_groups(model, optimizer or AdamW(), opts.param_groups, opts.no_decay)
        groups = split(model, blocks, torch_groups.index)
        if not any(g.params for g in groups):
            raise ValueError("the model has no trainable parameters")
        if opts.offload and hf_checkpointing(model):
            raise ValueError(GRADIENT_CHECKPOINTING)
        if materializer is not None:
            materializer.bind(block_list(model, blocks))
        device = resolve(opts.device, model)
        if world is not None and opts.offload == "host" and not device.shares_host_memory:
            raise ValueError("attach(offload=\"host\") with data parallelism is not built yet: pass offload=True (each "
                             "fetch reads this rank's shard and gathers the rest on the device) or False")
    except BaseException as exc:
        if materializer is not None:
            materializer.undo()
        if world is None:
            raise
        error = exc
    namespace = opts.namespace
    if world is not None:
        world.agree(error, "attach")
        world.same("the model's layer groups and optimizer",
                   distributed.signature((spec, [torch_groups.spec(p.index) for p in spec.parts]) for spec in groups))
        job = distributed.job_id(world, namespace)
        namespace = f"{job}.r{world.rank}"
    owns = session is None
    try:
        session = session or connect(opts.socket, namespace=namespace)
    except BaseException as exc:
        if materializer is not None:
            materializer.undo()
        if world is None:
            raise
        error = exc
    if world is not None:
        world.agree(error, "connecting to fuyoud")
    try:
        state = None
        if world is not None:
            state = _join(world, model, session, groups, opts, job)
        elif resume is not None and dp_checkpoints.is_world(resume):  # (a data-parallel run's, cut to one)
            state = checkpoints.load_client_state(dp_checkpoints.restore(
                session, World(None, 0, 1, "none"), resume, groups, opts.reshard, session.namespace))
        elif resume is not None:
            state = checkpoints.load_client_state(session.restore(resume).client_state)
        engine = Engine(model, session, torch_groups, groups, opts, device, owns, resume=state is not None,
                        materializer=materializer, world=world)
    except BaseException as exc:
        _undo(owns, session, device, materializer)
        if world is None:
            raise
        world.agree(exc, "attach")
    try:
        if world is not None:
            world.agree(None, "attach")
            engine.peers = world.gather(distributed.daemon_identity(session))
        if state is not None:
            engine._checkpoint_groups = state["groups"]
            engine.resume_lr()
            engine.checkpoint_extra = state["extra"]
        if materializer is not None:
            materializer.commit()
        engine.sizing_plan = plan
        return engine
    except BaseException:
        engine.close(materialize=False)
        if materializer is not None:
            materializer.undo()
        raise


def _check_world_options(opts: AttachOptions) -> None:
    """What this version does not do with data parallelism, refused on every rank alike."""
    if opts.session is not None:
        raise ValueError("with data parallelism attach opens each rank's session itself (in the job's namespace); "
                         "pass socket= rather than session=")


def _join(world: World, model: nn.Module, session, groups, opts: AttachOptions, job: str) -> dict | None:
    """(every rank) Rank 0's weights and buffers on every rank, or this rank's shards of a
    checkpoint; a failure anywhere is an error everywhere."""
    error, state = None, None
    try:
        if opts.resume is not None:
            state = checkpoints.load_client_state(dp_checkpoints.restore(
                session, world, opts.resume, groups, opts.reshard, job))
    except BaseException as exc:  # noqa: BLE001 - agreed below
        error = exc
    world.agree(error, "resume")
    with torch.no_grad():
        world.broadcast([t.data for t in (*model.parameters(), *model.buffers())])
    if state is not None:  # the parameters take the masters, gathered from the ranks' shards
        dp_checkpoints.load_masters(session, world, [spec for spec in groups if spec.numel])
    return state


def _undo(owns: bool, session, device, materializer) -> None:
    if owns:
        session.close()
    elif not device.shares_host_memory:
        session.use_device(None)
    device.close()
    if materializer is not None:
        materializer.undo()  # (the model is on the meta device again)

"""``attach(model, optimizer, **options)``: the one call that hooks a model up to fuyoud.

It validates the options (options.py) and the parameter groups (param_groups.py), cuts
the model into layer groups (grouping.py), makes a model built on the meta device real
one group at a time (materialize.py), connects, resumes when asked, and builds the
Engine (engine.py); when anything fails the model is left as it came.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from fuyou_client import checkpoints, materialize
from fuyou_client.device import resolve
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
    documents each one; a misspelt or invalid one is refused before anything starts."""
    base = options.pop("options", None)  # attach(model, opt, options=AttachOptions(...), **overrides) too
    opts = dataclasses.replace(base, **options) if base is not None else AttachOptions(**options)
    blocks, weights, resume, session = opts.blocks, opts.weights, opts.resume, opts.session
    materializer = materialize.prepare(model, weights, resume is not None)  # (a meta model: CPU stand-ins now)
    try:
        torch_groups = resolve_groups(model, optimizer or AdamW(), opts.param_groups, opts.no_decay)
        groups = split(model, blocks, torch_groups.index)
        if not any(g.params for g in groups):
            raise ValueError("the model has no trainable parameters")
        if opts.offload and hf_checkpointing(model):
            raise ValueError(GRADIENT_CHECKPOINTING)
        if materializer is not None:
            materializer.bind(block_list(model, blocks))
        device = resolve(opts.device, model)
    except BaseException:
        if materializer is not None:
            materializer.undo()
        raise
    owns = session is None
    try:
        session = session or connect(opts.socket, namespace=opts.namespace)
    except BaseException:
        if materializer is not None:
            materializer.undo()
        raise
    try:
        state = None
        if resume is not None:
            state = checkpoints.load_client_state(session.restore(resume).client_state)
        engine = Engine(model, session, torch_groups, groups, opts, device, owns, resume=state is not None,
                        materializer=materializer)
        if state is not None:
            engine._checkpoint_groups = state["groups"]
            engine.resume_lr()
            engine.checkpoint_extra = state["extra"]
        if materializer is not None:
            materializer.commit()
        return engine
    except BaseException:
        if owns:
            session.close()
        elif not device.shares_host_memory:
            session.use_device(None)
        device.close()
        if materializer is not None:
            materializer.undo()  # (the model is on the meta device again)
        raise

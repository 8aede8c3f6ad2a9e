"""``attach(model, optimizer, **options)``: the one call that hooks a model up to fuyoud.

It validates the options (options.py) and the parameter groups (model/param_groups.py),
cuts the model into layer groups (model/blocks.py), makes a model built on the meta
device real one group at a time (model/materialize.py), connects, resumes when asked,
and builds the Engine (build.py); when anything fails the model is left as it came. What
differs between one process and data parallelism is asked of the parallelism seam
(parallel/seam.py): with data parallelism every rank calls attach, and a failure on any
rank is an error on every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from fuyou_client import parallel as parallelism
from fuyou_client.connection import connect
from fuyou_client.device import resolve
from fuyou_client.engine.build import build
from fuyou_client.engine.engine import Engine
from fuyou_client.engine.hooks import GRADIENT_CHECKPOINTING, hf_checkpointing
from fuyou_client.engine.options import AttachOptions
from fuyou_client.model import block_list, prepare, split
from fuyou_client.model.experts import ExpertsNotCut, cut_experts, uncut_experts
from fuyou_client.model import resolve as resolve_groups
from fuyou_client.optim import SGD, AdamW


def _check_optimizer(optimizer) -> None:
    """attach's second argument is a fuyou_client optimizer: torch's habits (its parameter
    groups, or a torch optimizer) are refused with the way to say them here."""
    if optimizer is None or isinstance(optimizer, (AdamW, SGD)):
        return
    if isinstance(optimizer, (list, tuple, dict)):
        raise TypeError("attach's second argument is the optimizer (fuyou_client.AdamW(...) or SGD(...)), not "
                        "parameter groups: pass torch-style groups as attach(model, optimizer, param_groups=[...])")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"attach takes a fuyou_client optimizer, not {type(optimizer).__module__}."
                        f"{type(optimizer).__name__}: use fuyou_client.AdamW(lr=..., ...) or SGD(...) (the daemon "
                        "steps it), and its parameter groups as attach(..., param_groups=[...])")
    raise TypeError(f"attach's second argument is the optimizer (fuyou_client.AdamW(...) or SGD(...)), not "
                    f"{type(optimizer).__name__}")


def attach_frozen(model: nn.Module, **options) -> Engine:
    """Hook up a model that is only run forward, never trained (a DPO or GRPO reference
    model): every parameter must have ``requires_grad=False``. No optimizer state; its
    blocks' weights are stored once on the SSD array, in their dtype, and fetched ahead of
    each forward as a trained model's are (``offload=True``, the default), so the model
    need not be in memory: built on the meta device with ``weights=DIR``, it never is as a
    whole. The options are ``attach``'s; ``engine.close()`` detaches it."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if trainable:
        raise ValueError(f"attach_frozen takes a model that is not trained, but {trainable[0]!r} (and "
                         f"{len(trainable) - 1} more) requires grad: model.requires_grad_(False) first, or attach() it")
    base = options.pop("options", None)
    opts = dataclasses.replace(base, **options) if base is not None else AttachOptions(**options)
    return _attached(model, None, opts, None, frozen=True)


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
    ``engine.sizing_plan`` keeps it (its ``settings``: the micro-batch shape it assumed).

    ``options=``: an ``AttachOptions`` to start from; the other keyword options replace
    its fields."""
    _check_optimizer(optimizer)
    plan = options.pop("plan", None)  # a fuyou_client.plan(...) or "auto": its settings (sizing/apply.py)
    if plan is not None:
        from fuyou_client.sizing.apply import apply
        options, optimizer, plan = apply(plan, model, optimizer, options)
    base = options.pop("options", None)  # attach(model, opt, options=AttachOptions(...), **overrides) too
    opts = dataclasses.replace(base, **options) if base is not None else AttachOptions(**options)
    return _attached(model, optimizer, opts, plan)


def _attached(model: nn.Module, optimizer, opts: AttachOptions, plan, frozen: bool = False) -> Engine:
    """attach's work once its options are settled (``frozen``: attach_frozen's model)."""
    par = parallelism.of(opts.process_group, opts.optimizer_ranks)
    materializer, error, prepared = None, None, None
    try:
        par.check_options(opts)
        materializer = prepare(model, opts.weights, opts.resume is not None)  # (a meta model: CPU stand-ins now)
        if opts.granularity == "expert":
            _cut_experts(model, opts, par)
        prepared = _prepare(model, optimizer, opts, materializer, par, frozen)
    except BaseException as exc:  # noqa: BLE001 - agreed below (one process: raised there)
        if materializer is not None:
            materializer.undo()
        uncut_experts(model)
        error = exc
    par.agree(error, "attach")
    torch_groups, groups, device = prepared
    par.agree_on_model(groups, torch_groups)
    namespace = par.namespace(opts.namespace)
    owns, session = opts.session is None, opts.session
    try:
        session = session or connect(opts.socket, namespace=namespace)
    except BaseException as exc:  # noqa: BLE001 - agreed below
        if materializer is not None:
            materializer.undo()
        uncut_experts(model)
        error = exc
    par.agree(error, "connecting to fuyoud")
    try:
        state = par.restore(session, model, groups, opts)
        def recut():  # (granularity="auto", where neither whole blocks nor their modules fit)
            _cut_experts(model, opts, par, state is not None)
            cut_torch_groups = resolve_groups(model, optimizer or AdamW(), opts.param_groups, opts.no_decay)
            return split(model, opts.blocks, cut_torch_groups.index), cut_torch_groups
        engine = build(model, session, torch_groups, groups, opts, device, owns, state is not None, materializer,
                       par, recut)
    except BaseException as exc:  # noqa: BLE001 - agreed below
        _undo(owns, session, device, materializer)
        uncut_experts(model)
        par.agree(exc, "attach")
    try:
        engine.peers = par.joined(session)
        if state is not None:
            engine.checkpoint_groups = state["groups"]
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


def _cut_experts(model: nn.Module, opts: AttachOptions, par, resume: bool = False) -> None:
    """The model's fused experts cut into parts (model/experts.py), or ExpertsNotCut saying
    why they cannot be here. (A model on the meta device is cut after its materializer has
    put its stand-ins in: it makes the fused parameters real, and the parts view them.)"""
    why = None
    if not opts.offload:
        why = "granularity='expert' is what comes to the device at a time with offload; offload=False keeps all"
    elif par.strategy_kind is not None:
        why = "several processes (data parallelism, an optimizer host) step whole blocks only"
    elif resume or opts.resume is not None:
        why = "resuming a checkpoint whose experts were cut is not built yet (the optimizer state is per group)"
    elif opts.param_groups is not None:
        why = ("param_groups name the fused expert parameters, which the cut replaces: leave param_groups to "
               "attach (no_decay= names what takes no weight decay), or granularity='module'")
    if why is not None:
        raise ExpertsNotCut(f"the experts cannot be cut: {why}")
    cut_experts(model)


def _prepare(model: nn.Module, optimizer, opts: AttachOptions, materializer, par, frozen: bool = False):
    """(torch param groups, layer-group specs, device), checked before anything connects."""
    par.check_model(materializer)
    torch_groups = resolve_groups(model, optimizer or AdamW(), opts.param_groups, opts.no_decay)
    groups = split(model, opts.blocks, torch_groups.index)
    if not frozen and not any(g.params for g in groups):
        raise ValueError("the model has no trainable parameters (a model only run forward: attach_frozen(model))")
    if opts.offload and hf_checkpointing(model):
        raise ValueError(GRADIENT_CHECKPOINTING)
    if materializer is not None:
        materializer.bind(block_list(model, opts.blocks))
    device = resolve(opts.device, model)
    par.check_device(opts, device)
    return torch_groups, groups, device


def _undo(owns: bool, session, device, materializer) -> None:
    if owns:
        session.close()
    else:
        session.use_device(None)
        with contextlib.suppress(Exception):  # (the plan's reservation: the session is the caller's)
            session.reserve(0)
    device.close()
    if materializer is not None:
        materializer.undo()  # (the model is on the meta device again)

"""The one place that builds an Engine's parts, each from the parts it uses (as
fuyoud/server.py builds the daemon), in dependency order; nothing is patched into a part
after it is built.

    memory plan -> gradient strategies -> layer groups (state created in the daemon)
    -> offloader -> gradient pool / host accumulator -> step coordinator
    -> activation swapper, policy and planner -> model hooks -> state_dict hooks -> Engine

When a part fails, the model's parameters are put back as they came.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from torch import nn

from fuyou_proto.contract import stepped_in_chunks
from fuyou_proto.units import format_size

from fuyou_client import errors, memory
from fuyou_client.activations import ActivationPolicy, ActivationSwapper, AutoPlanner, treatments
from fuyou_client.connection import Session
from fuyou_client.device import Device
from fuyou_client.engine.hooks import ModelHooks
from fuyou_client.engine.options import AttachOptions
from fuyou_client.engine.trained_values import TrainedValues
from fuyou_client.gradients import HostAccumulated, Pooled, Resident
from fuyou_client.groups import LayerGroup, Scratch, create
from fuyou_client.groups.placement import hands_over, placement, weights_rewritten
from fuyou_client.model import GroupSpec, TorchGroups, cut, mlp_layout
from fuyou_client.model.experts import ExpertsNotCut, cuttable, uncut_experts
from fuyou_client.model.experts import release as release_fused
from fuyou_client.offload import Offloader
from fuyou_client.steps import StepCoordinator

log = logging.getLogger("fuyou_client.engine")


def build(model: nn.Module, session: Session, torch_groups: TorchGroups, specs: list[GroupSpec],
          options: AttachOptions, device: Device, owns_session: bool, resume: bool, materializer, parallel,
          recut=None):
    """The Engine of ``model``: its groups' state created in the daemon (or, ``resume``,
    restored there already), its parameters pointed at shared or device memory, every part
    wired. ``parallel``: the seam (parallel/seam.py); ``recut``: "auto"'s expert parts (_planned)."""
    from fuyou_client.engine.engine import Engine  # (the API this module builds)

    options = options.for_device(device.shares_host_memory)
    # Every shared buffer below, and the compute device's memory, planned from the session's
    # budget and the device's first (memory/): by whole blocks, or by their modules where
    # blocks do not fit; a budget that cannot hold the smallest plan is refused before
    # anything is allocated; the plan is then reserved in the daemon (held against the
    # other sessions).
    sharers = parallel.daemon_sharers(session)  # (a collective: once, on every rank, whatever the plans do)
    specs, layout, plan, torch_groups = _planned(model, session, specs, torch_groups, options, device, parallel,
                                                 resume, sharers, recut)
    (log.warning if plan.shrunk else log.info)("%s", plan.describe())
    options = dataclasses.replace(options, prefetch=plan.prefetch, host_budget=plan.host_budget)
    if parallel.holds_state:  # (an optimizer-host worker keeps no state: its optimizer ranks check theirs)
        check_capacity(session, specs, torch_groups, options.offload, resume, parallel.share)
    session.use_device(device)  # (CUDA: cudaHostRegister of every shared segment; the CPU: nothing to do)
    # Where each group's gradients live until its step (gradients/strategy.py).
    strategies = {"resident": Resident(device), "pooled": Pooled(), "host": HostAccumulated()}
    if parallel.strategy_kind is not None:  # (its parameters' memory: the seam's; the engine is built last)
        strategies[parallel.strategy_kind] = parallel.gradient_strategy(options, device,
                                                                        lambda: engine.optimizer.param_groups)
    groups = _create_groups(session, device, layout, torch_groups, strategies, resume, materializer, parallel, model)
    by_spec = {g.spec.name: g.spec for g in groups}
    # The order fetches follow: the rest's embeddings before the blocks (they are made after them)
    offloaded = sorted((g.offloaded for g in groups if g.offloaded is not None),
                       key=lambda og: not by_spec[og.name].early)
    cut_blocks = {id(spec.block) for spec in specs if spec.block is not None and spec.module is None}
    for i, og in enumerate(offloaded):
        og.index = i
        og.cut = id(by_spec[og.name].module) in cut_blocks
        og.unit = by_spec[og.name].unit
    for g in groups:  # (blocks stepped in chunks: their steps take the masters their backward read)
        if g.offloaded is not None:
            g.offloaded.hands_over = plan.handoff and hands_over(g)
    pooled, host = strategies["pooled"], strategies["host"]
    by_name = {g.spec.name: g for g in groups}

    def on_backward(og) -> None:  # (a frozen block has no gradients)
        if by_name[og.name].strategy is pooled:
            pooled.pool.assign(by_name[og.name])
    offloader = Offloader(session, device, offloaded, plan.prefetch, plan.keep, slots=plan.slot_sizes,
                          on_backward=on_backward, gather=parallel.fetch_gather(session, groups)) \
        if offloaded else None
    accumulated = [g for g in groups if g.strategy is host]
    host_grads = host.bind(session, device, max(g.numel for g in accumulated) * 4, plan.staging_buffers) \
        if accumulated else None
    gradients = pooled.bind(session, device, plan.grad_classes) if any(g.strategy is pooled for g in groups) else None
    in_use = [st for st in strategies.values() if st is not None and any(g.strategy is st for g in groups)]
    grouped = {id(p) for g in groups for _, p in g.spec.params}
    frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in grouped]  # (at attach)
    engine = None  # (built last; the coordinator reads its torch param groups, as schedulers left them, per step)
    coordinator = StepCoordinator(session, device, groups, lambda: engine.optimizer.param_groups, torch_groups,
                                  offloader, in_use,
                                  parallel.clipper(model, groups), options.accumulation_steps,
                                  options.max_grad_norm, frozen,
                                  recomputed=lambda name: policy.treatments.get(name) == "recompute")
    blocks = [g for g in groups if g.spec.module is not None]
    weights = {(g.device_weights if g.device_weights is not None else g.weights.tensor(torch.uint8))
               .untyped_storage().data_ptr() for g in groups if g.weights is not None}
    activations = ActivationSwapper(session, options.host_budget, device=device,
                                    protected=lambda t: t.untyped_storage().data_ptr() in weights)
    policy = ActivationPolicy(blocks, activations, offloader, treatments(options.activations,
                                                                         [g.spec.name for g in blocks]))
    auto = AutoPlanner(activations, device, policy.apply, [g.spec.name for g in blocks],
                       options.device_budget, options.host_budget) \
        if options.activations == "auto" and blocks else None
    hooks = ModelHooks(model, device, groups, coordinator, offloader, activations, policy, auto)
    block_modules = [spec.module for spec in specs if spec.module is not None]  # (frozen ones too)
    values = TrainedValues(model, session, groups, coordinator.require_idle, parallel.world)  # (state_dict() hooks)
    engine = Engine(model, session, device, options, plan, groups, torch_groups, coordinator, offloader, activations,
                    policy, hooks, auto, parallel, owns_session, block_modules, gradients=gradients,
                    host_grads=host_grads, values=values)
    engine.zero_grad()
    return engine


def _create_groups(session, device, layout, torch_groups, strategies, resume, materializer, parallel, model=None):
    """Every layer group's state in the daemon and its parameters pointed at their memory,
    in forward order; on failure the parameters are put back as they came."""
    groups: list[LayerGroup] = []
    originals = [(p, p.data, p.grad) for spec, _, _ in layout for _, p in (*spec.params, *spec.frozen)]
    # The daemon creates a group's state while the next group's values are made (a
    # reused buffer: groups/creation.py Scratch); resume and data parallelism read or shard instead.
    biggest = max((spec.numel for spec, _, _ in layout), default=0)
    scratch = Scratch(session, biggest * 4) if biggest and not resume and not parallel.data_parallel else None
    done_block = None  # (the block whose groups were made last)
    try:
        for spec, mode, kind in layout:
            index = sum(1 for g in groups if g.offloaded is not None)  # position in forward order
            if model is not None and done_block is not None and spec.block is not done_block:
                release_fused(done_block)  # (its expert parts are made: the fused values go, memory with them)
            done_block = spec.block or done_block
            if materializer is not None:  # a model on the meta device: this group's values, now
                materializer.fill(spec, device.torch_device)
            optimizers = [torch_groups.spec(part.index) for part in spec.parts]
            shards = parallel.shards(spec.numel) if spec.params else None
            buf = scratch.take() if scratch is not None and spec.numel else None
            groups.append(create(session, device, spec, optimizers, mode, index, strategies[kind], resume, shards,
                                 buf, stateless=not parallel.holds_state))
            if buf is not None:
                scratch.lend(buf, groups[-1].created)
            if spec.params:
                parallel.bind(session, groups[-1])
        if scratch is not None:
            scratch.close()
            scratch = None
        for g in groups:
            g.settle()
        if materializer is not None:
            materializer.finish(device.torch_device)
    except BaseException:  # leave the user's model as it was
        if scratch is not None:
            with contextlib.suppress(Exception):  # (the error raised is the one that stopped attach)
                scratch.close()
        with torch.no_grad():
            for p, data, grad in originals:
                p.grad = None
                p.data = data
                p.grad = grad
        raise
    if model is not None:
        release_fused(model)  # (a mixture of experts cut in parts: the parts hold the values now)
    return groups


def _planned(model, session, specs, torch_groups, options, device, parallel, resume, sharers, recut):
    """(specs, layout, memory plan, torch groups), the plan held (hold_plan): the specs and
    torch groups are the model's cut into expert parts where "auto" came to that."""
    cut_here = []  # (the experts cut by a try of "auto": a second try plans from the model as it came)

    def recut_once():
        cut_here.append(True)
        return recut()

    def make():
        if cut_here:
            uncut_experts(model)
            cut_here.clear()
        return plan_granularity(model, session, specs, torch_groups, options, device, parallel, resume, sharers,
                                recut_once if recut is not None else None)
    return hold_plan(session, make)


def hold_plan(session, make_plan):
    """``make_plan()``'s (specs, layout, memory plan, ...), the plan reserved in the daemon: a
    plan admitted is a plan held, so that no session admitted later takes what this one's
    plan counts on. Another session admitted between the plan and its reservation, or
    gone between a refusal and the daemon's account of it: planned again, once, against
    what is left. A plan that cannot fit for what the others hold is refused with the
    daemon's own account of them."""
    for attempt in range(2):
        try:
            made = make_plan()
            plan = made[2]
        except memory.DoesNotFit as exc:
            if exc.smallest is None or not exc.smallest.limits.others:
                raise
            try:  # (the daemon's refusal names the sessions that hold the budget)
                session.reserve(exc.smallest.limits.held + exc.smallest.total)
            except errors.ResourceExhausted as why:
                raise memory.DoesNotFit(f"{exc}\nfuyoud: {why}", exc.smallest) from None
            session.reserve(0)  # (room came back meanwhile: planned again)
            if attempt:
                raise
            continue
        try:
            session.reserve(plan.limits.held + plan.total)
            return made
        except errors.ResourceExhausted as exc:
            if attempt:
                raise memory.DoesNotFit(f"the memory plan could not be reserved: {exc}\n{plan.describe()}",
                                        plan) from None
    raise AssertionError("unreachable")


def plan_granularity(model: nn.Module, session, specs: list[GroupSpec], torch_groups: TorchGroups,
                     options: AttachOptions, device: Device, parallel, resume: bool = False, sharers: int = 1,
                     recut=None):
    """(specs, layout, memory plan, torch groups): the layer groups by whole blocks, or cut
    into sub-blocks (model/cuts.py), or those with a mixture of experts' fused experts cut
    into parts too (model/experts.py), where ``granularity`` asks or ("auto") where the
    coarser cut does not fit the pinned or the device plan (``resume``: as the checkpoint's
    groups are); the memory plan holds the device plan (``plan.device``). Raises
    memory.DoesNotFit or memory.DeviceDoesNotFit, naming the bytes, before any allocation.
    ``sharers``: the job's processes sharing the daemon (memory.limits_of). ``recut()``:
    the experts cut, (specs, torch groups) again ("auto"'s last try; None: not tried).

    "auto" with fused experts weighs expert parts against the coarser plan that fits (every
    pinned buffer one whole block's, or one experts module's): the parts where they pay
    (``finer_pays``), else the coarser (the experts uncut again)."""
    wanted = options.granularity if options.offload else "block"
    if parallel.strategy_kind is not None:  # (data parallelism, an optimizer host's worker)
        if wanted in ("module", "expert"):
            raise ValueError(f'granularity="{wanted}" with several processes (data parallelism, an optimizer host) is '
                             'not built yet: attach with granularity="block" (or "auto", which keeps whole blocks there)')
        wanted = "block"
    elif resume:
        wanted = restored_granularity(session, specs, wanted)
    tries = ["block", "module"] if wanted == "auto" else [wanted]
    if wanted == "auto" and recut is not None and cuttable(model):
        tries.append("expert")
    limits, budget = memory.limits_of(session, sharers), device_budget(options, device)
    error, last, coarser = None, None, None
    for granularity in tries:
        if granularity == "expert" and recut is not None and wanted == "auto":
            try:
                specs, torch_groups = recut()
            except ExpertsNotCut:  # (the coarser cuts' refusal is the one raised)
                continue
        cut_specs = cut(specs, model, torch_groups.index) if granularity != "block" else specs
        pool_grads = bool(options.offload) and options.accumulation_steps == 1 and options.max_grad_norm is None
        layout = [(spec, *where) for spec in cut_specs
                  if (where := placement(spec, options.offload, pool_grads, options.grad_accumulation,
                                         parallel.strategy_kind)) is not None]
        shapes = group_shapes(layout, torch_groups, limits, parallel, cut=granularity != "block")
        work = model_work(model, cut_specs, options)
        reserve = device.memory_reserve() if options.device_memory is None else 0

        def device_side(p, shapes=shapes, work=work, reserve=reserve, granularity=granularity):
            return memory.plan_device(shapes, p, work, budget, reserve, granularity)
        try:
            plan = plan_memory(shapes, layout, limits, options, device,
                               None if device.shares_host_memory else lambda p: device_side(p).fits)
        except memory.DoesNotFit as exc:
            error = exc
            continue
        dplan = None
        if not device.shares_host_memory:
            dplan = device_side(plan)
            if not dplan.fits:
                error = memory.DeviceDoesNotFit(memory.device_refusal(dplan, None), dplan)
                last = last or dplan
                continue
        made = (cut_specs, layout, dataclasses.replace(plan, device=dplan), torch_groups)
        if "expert" in tries[tries.index(granularity) + 1:]:
            coarser = coarser or made  # (expert parts are weighed against it: model/experts.py)
            continue
        if granularity == "expert" and coarser is not None and not finer_pays(coarser[2], plan):
            break
        return made
    if coarser is not None:
        uncut_experts(model)  # (the same Parameter objects again: the coarser specs hold them)
        return coarser
    if isinstance(error, memory.DeviceDoesNotFit) and last is not None and last is not error.plan:
        raise memory.DeviceDoesNotFit(memory.device_refusal(error.plan, last), error.plan)
    raise error


def finer_pays(coarser: "memory.MemoryPlan", finer: "memory.MemoryPlan") -> bool:
    """Whether a plan by expert parts is worth its more, smaller groups over a coarser one:
    more read-ahead, or as much in at most half the shared memory (a mixture of experts'
    block is mostly its experts, so every coarser buffer is about one experts module)."""
    return finer.prefetch > coarser.prefetch or (finer.prefetch == coarser.prefetch
                                                 and 2 * finer.total <= coarser.total)


def device_budget(options: AttachOptions, device: Device) -> int | None:
    """What the device plan may take: ``device_memory``, else what the device has free less
    its reserve (None: a device without memory of its own to count)."""
    budget, available = options.device_memory, device.memory_available()
    if budget is None and available is not None:
        budget = max(0, available - device.memory_reserve())
    elif budget is not None and available is not None and budget > available:
        raise memory.DeviceDoesNotFit(f"device_memory={budget} ({format_size(budget)}) is more than the compute "
                                      f"device has for this process ({format_size(available)} free, with what its "
                                      "allocator holds): leave device_memory to attach, or free the device's memory")
    elif budget is not None and device.shares_host_memory:
        raise ValueError(f"device_memory={budget}: the model computes on the CPU, whose memory is the host's (the "
                         "daemon's pinned budget plans it); leave device_memory out")
    return budget


def restored_granularity(session, specs: list[GroupSpec], wanted: str) -> str:
    """The granularity a checkpoint's groups were made by (a block's state whole, or its
    own group's only: its modules are sub-blocks), checked against what attach asks."""
    block = next((spec for spec in specs if spec.module is not None and spec.params), None)
    if block is None:
        return wanted
    try:
        saved = "block" if session.group(block.parts[0].name).numel == block.parts[0].numel else "module"
    except errors.ObjectNotFound:  # (cut, its own group had nothing to train: a PEFT block's norms are frozen)
        saved = "module"
    if wanted not in ("auto", saved):
        held = "the whole block" if saved == "block" else "the block's modules but its large ones"
        raise ValueError(f"the checkpoint's layer groups are by {saved} (its {block.name} group holds {held}), and "
                         f"this attach asks for granularity={wanted!r}: resume with granularity={saved!r} or 'auto' "
                         "(the optimizer state is per group; start from engine.export's weights to change it)")
    return saved


def model_work(model: nn.Module, specs: list[GroupSpec], options: AttachOptions):
    """What a micro-batch computes, for the device plan's activations (memory.Work): the
    model's width and vocabulary from its largest embedding outside the blocks (None: no
    embedding, the activations are not estimated)."""
    blocks = {id(m) for spec in specs if spec.block is not None for m in spec.block.modules()}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding) and id(m) not in blocks]
    if not embeddings:
        return None
    emb = max(embeddings, key=lambda m: m.num_embeddings)
    layers = len({id(spec.block) for spec in specs if spec.block is not None})
    dtype = next((p.dtype for spec in specs for _, p in spec.params), torch.float32)
    acts = options.activations
    block = next((spec.block for spec in specs if spec.block is not None), None)
    layout, mlp = mlp_layout(block, emb.embedding_dim) if block is not None else ("gpt2", None)
    return memory.Work(emb.embedding_dim, emb.num_embeddings, layers, dtype.itemsize, schedule="block-major",
                       recompute=acts == "recompute", layout=layout, mlp=mlp)


def group_shapes(layout, torch_groups: TorchGroups, limits, parallel, cut: bool = False) -> list[memory.GroupShape]:
    """What the plans need of each layer group (memory.GroupShape); ``cut``: the blocks
    are cut into sub-blocks (their own groups are ``held``)."""
    shapes = []
    for spec, mode, kind in layout:
        dtype = (spec.params or spec.frozen)[0][1].dtype
        numel, shard = spec.numel, 0
        shards = parallel.shards(spec.numel) if spec.params else None
        if shards is not None:
            numel, shard = shards.padded, shards.per
        chunked = any(stepped_in_chunks(torch_groups.spec(part.index).state_bytes(part.numel), part.numel,
                                        limits.optimizer_buffer_budget, limits.optimizer_buffers)
                      for part in spec.parts)
        shapes.append(memory.GroupShape(
            spec.name, numel, dtype.itemsize, chunked=chunked, offload=mode, strategy=kind, shard=shard,
            frozen_bytes=spec.frozen_numel * dtype.itemsize if mode is True else 0,
            held=cut and spec.module is not None, unit=spec.unit if cut and spec.module is None else ""))
    return shapes


def plan_memory(shapes: list, layout, limits, options: AttachOptions, device: Device,
                device_fits=None) -> memory.MemoryPlan:
    """The shared buffers of an engine, planned from the session's budget and the groups'
    sizes (memory/budget.py), the device's own memory checked by ``device_fits``; raises
    memory.DoesNotFit before any allocation."""
    acts = options.activations
    swaps = acts in ("swap", "auto") or (isinstance(acts, dict) and "swap" in acts.values())
    wanted = memory.Wanted(options.prefetch, options.keep, options.host_budget,
                           arena=any(spec.module is not None for spec, _, _ in layout), swaps=swaps,
                           shares_host_memory=device.shares_host_memory)
    return memory.plan(shapes, limits, wanted, device_fits)


def check_capacity(session, specs: list[GroupSpec], torch_groups: TorchGroups, offload, resume: bool,
                   share: int) -> None:
    """Fail before any work starts when the SSD array cannot hold what training puts
    there: every group's state (in its state dtype; after a resume it is there
    already), the new versions of the steps in flight (a step writes its group's
    new version before the old one is freed: the three largest groups, for the read
    ahead, the step and the write-back at once), and offloaded weights other than
    fp32 (fp32 ones are read from the state in place). ``share``: this process's part
    of the state (data parallelism: its shards)."""
    states = sorted(torch_groups.spec(part.index).state_bytes(part.numel) for g in specs for part in g.parts)
    need = ((0 if resume else sum(states)) + sum(states[-3:])) // share
    need += sum(g.numel * g.params[0][1].dtype.itemsize for g in specs
                if g.params and weights_rewritten(offload, g.params[0][1].dtype))
    if offload is True:
        need += sum(g.frozen_numel * g.frozen[0][1].dtype.itemsize for g in specs if g.block is not None and g.frozen)
    status = session.daemon_status
    free = sum(d.available_bytes if d.HasField("available_bytes") else d.capacity_bytes - d.used_bytes
               for d in status.devices)
    if need > free:
        raise RuntimeError(
            f"the SSD array of fuyoud has {_size(free)} free but this model needs {_size(need)} there (its "
            "optimizer state, the new versions of the steps in flight and offloaded weights); free space on "
            "its disks, raise [storage] capacity_per_device (or lower keep_free), add data_dirs, or keep the "
            "state in fewer bytes (AdamW(state_dtype='bf16' or 'int8'))")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"

"""The Engine that ``attach(model)`` (attach.py) returns: an ordinary PyTorch model trained
with its optimizer state on SSD.

    engine = fuyou_client.attach(model, optimizer=fuyou_client.AdamW(lr=1e-4))
    for batch in data:
        loss = model(batch).loss
        loss.backward()          # each group's step starts in fuyoud as soon as its grads are final
        engine.step()            # barrier: every update of this iteration is in the weights
        engine.zero_grad()

On the CPU each layer group's parameters and gradients become views of two shared
buffers (so autograd accumulates gradients straight into shared memory and the daemon
writes the new weights straight into the parameters); on a GPU they are device memory,
and gradients and new weights cross to and from shared memory on side streams
(layergroup.py, device.py). The fp32 master weights and the AdamW/SGD moments live only
on the SSD array, in the daemon. A post-accumulate-grad hook counts
each group's gradients; when the last one lands during backward, that group's step is
submitted while backward goes on with earlier layers. `engine.step()` waits for all of
them. With `max_grad_norm`, clipping is exact: the steps wait for every gradient (the
norm needs them all), then go out together with the clip coefficient.

With ``offload=True`` (the default) the blocks' weights, too, are in memory only while
they compute (see offload.py); the "rest" group (embeddings, final norm, head) stays
resident. Gradients of every group stay in shared memory (they accumulate there).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from concurrent.futures import Future

import torch
from torch import nn

from fuyou_client import (blockmajor, checkpoints, clipping, dp_checkpoints, grad_guard, heap, layergroup,
                          memory_plan, sharded)
from fuyou_client.activations import ActivationSwapper, treatments
from fuyou_client.autoplan import AutoPlanner
from fuyou_client.device import Device
from fuyou_client.distributed import Collectives, Shards
from fuyou_client.errors import NonFinite
from fuyou_client.gradstrategy import HostAccumulated, Pooled, Resident, placement
from fuyou_client.grouping import ParamGroup
from fuyou_client.layergroup import LayerGroup
from fuyou_client.offload import Offloader, Saved
from fuyou_client.sharded import Sharded
from fuyou_client.optim import StepInfo
from fuyou_client.options import AttachOptions
from fuyou_client.param_groups import TorchGroups
from fuyou_client.session import Session, gather
from fuyou_client.torch_optimizer import TorchOptimizer
from fuyou_proto.contract import stepped_in_chunks


log = logging.getLogger(__name__)

GRADIENT_CHECKPOINTING = (
    "the model has Hugging Face gradient checkpointing on (gradient_checkpointing_enable()): it reruns blocks "
    "outside their forward hooks, which fetch offloaded weights. Use attach(activations=\"recompute\") instead "
    "(the same recomputation, weights fetched again), or offload=False")


def hf_checkpointing(model: nn.Module) -> bool:
    """Whether Hugging Face activation (gradient) checkpointing is on."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # (the first: transformers >= 5)
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


class Engine:
    sizing_plan = None  # the fuyou_client.plan(...) attach(plan=...) applied (sizing/), else None

    def __init__(self, model: nn.Module, session: Session, torch_groups: TorchGroups, groups: list[ParamGroup],
                 options: AttachOptions, device: Device, owns_session: bool, resume: bool = False,
                 materializer=None, world=None):
        options = options.for_device(device.shares_host_memory)
        self.world = world  # data parallelism (distributed.World), or None
        self.peers: list | None = None  # data parallelism: each rank's (host, daemon)
        self.session = session
        pool_grads = bool(options.offload) and options.accumulation_steps == 1 and options.max_grad_norm is None
        layout = [(spec, *where) for spec in groups
                  if (where := placement(spec, options.offload, pool_grads, options.grad_accumulation,
                                         world is not None)) is not None]
        # Every shared buffer below, planned from the session's budget first (memory_plan.py):
        # a budget that cannot hold the smallest plan is refused before anything is allocated.
        self.memory = self._plan_memory(layout, torch_groups, options, device, world)
        if self.memory.shrunk:
            log.warning("%s", self.memory.describe())
        else:
            log.info("%s", self.memory.describe())
        options = dataclasses.replace(options, prefetch=self.memory.prefetch, host_budget=self.memory.host_budget)
        self.collectives = Collectives(world, options.check_collectives) if world is not None else None
        self.options = options
        self.model = model
        self.device = device
        self._resume = resume  # the groups exist in the daemon (restored): take their weights
        self.checkpoint_extra = None  # what save_checkpoint(extra=...) kept, after a resume
        self._checkpoint_groups: list[dict] = []  # each param group's hyperparameters at the checkpoint
        self.max_grad_norm = options.max_grad_norm
        self.accumulation_steps = accumulation_steps = options.accumulation_steps
        max_grad_norm, offload = options.max_grad_norm, options.offload
        activations, host_budget, device_budget = options.activations, options.host_budget, options.device_budget
        self._owns_session = owns_session
        self.last_step_infos: list[StepInfo] = []
        self._last_step_end: float | None = None  # for the iteration times reported to the daemon
        self._torch_groups = torch_groups
        self.optimizer = TorchOptimizer(self, torch_groups)
        self.groups: list[LayerGroup] = []
        self._hooks = []
        self._check_capacity(groups, torch_groups, offload)
        if not self.device.shares_host_memory:
            session.use_device(self.device)  # cudaHostRegister of every shared segment
        # Where each group's gradients live until its step (gradstrategy.py): offloaded
        # groups borrow buffers from a pool, unless every gradient must be kept until the
        # step (accumulation over micro-batches, exact clipping); kept gradients are in
        # each group's own buffer, or accumulate in host memory instead of on the device.
        resident, pooled, host = Resident(self.device), Pooled(), HostAccumulated()
        self.sharding = Sharded(world, self.collectives, options.reduce, device) if world is not None else None
        strategies = {"resident": resident, "pooled": pooled, "host": host, "sharded": self.sharding}
        originals = [(p, p.data, p.grad) for spec in groups for _, p in (*spec.params, *spec.frozen)]
        # The daemon creates a group's state while the next group's values are made (a
        # reused buffer: layergroup.Scratch); resume and data parallelism read or shard instead.
        biggest = max((spec.numel for spec, _, _ in layout), default=0)
        scratch = layergroup.Scratch(session, biggest * 4) if biggest and not resume and world is None else None
        try:
            for spec, mode, kind in layout:
                index = sum(1 for g in self.groups if g.offloaded is not None)  # position in forward order
                if materializer is not None:  # a model on the meta device: this group's values, now
                    materializer.fill(spec, self.device.torch_device)
                optimizers = [torch_groups.spec(part.index) for part in spec.parts]
                shards = self.sharding.shards(spec.numel) if self.sharding is not None and spec.params else None
                buf = scratch.take() if scratch is not None and spec.numel else None
                self.groups.append(layergroup.upload(session, self.device, spec, optimizers, mode, index,
                                                     strategies[kind], self._resume, shards, buf))
                if buf is not None:
                    scratch.lend(buf, self.groups[-1].created)
                if shards is not None:
                    self.sharding.bind(session, self.groups[-1])
            if scratch is not None:
                scratch.close()
                scratch = None
            for g in self.groups:
                g.settle()
            if materializer is not None:
                materializer.finish(self.device.torch_device)
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
        del originals
        offloaded = [g.offloaded for g in self.groups if g.offloaded is not None]
        for g in self.groups:  # (blocks stepped in chunks: their steps take the masters their backward read)
            if g.offloaded is not None:
                g.offloaded.hands_over = self.memory.handoff and self._hands_over(g)
        self.offloader = Offloader(session, self.device, offloaded, self.memory.prefetch, self.memory.keep,
                                   slots=self.memory.weight_slots) if offloaded else None
        if self.offloader is not None and self.sharding is not None:
            self.offloader.gather = self.sharding.gather_fetch(session, {g.spec.name: g.shard.shards for g in self.groups
                                                                         if g.offloaded is not None and g.shard})
        accumulated = [g for g in self.groups if g.strategy is host]
        self.host_grads = host.bind(session, self.device, max(g.numel for g in accumulated) * 4,
                                    self.memory.staging_buffers) if accumulated else None
        self.gradients = None
        if any(g.strategy is pooled for g in self.groups):
            by_name = {g.spec.name: g for g in self.groups}
            self.gradients = pooled.bind(session, self.device, self.memory.grad_buffers,
                                         max(g.numel * g.dtype.itemsize for g in self.groups if g.strategy is pooled))

            def on_backward(og) -> None:
                if by_name[og.name].strategy is pooled:  # (a frozen block has no gradients)
                    self.gradients.assign(by_name[og.name])
            self.offloader.on_backward = on_backward
        self._strategies = [st for st in (resident, pooled, host, self.sharding)
                            if st is not None and any(g.strategy is st for g in self.groups)]
        grouped = {id(p) for g in self.groups for _, p in g.spec.params}
        self._frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in grouped]  # (at attach)
        self._hooks.append(model.register_load_state_dict_pre_hook(self._refuse_load))
        for g in self.groups:
            for _, p in g.spec.params:
                self._hooks.append(p.register_hook(lambda grad, g=g: self._before_grad(g)))
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, g=g: self._on_grad(g)))
        self._saved_ctx = None
        blocks = [g for g in self.groups if g.spec.module is not None]
        self._block_modules = [spec.module for spec in groups if spec.module is not None]  # (frozen ones too)
        self._train_step_store: blockmajor.Store | None = None
        self._block_major = False  # in train_step: weights stay until a group's last micro-batch
        self._treatment = treatments(activations, [g.spec.name for g in blocks])
        weights = {(g.device_weights if g.device_weights is not None else g.weights.tensor(torch.uint8))
                   .untyped_storage().data_ptr() for g in self.groups if g.weights is not None}
        self.activations = ActivationSwapper(session, host_budget, device=self.device,
                                             protected=lambda t: t.untyped_storage().data_ptr() in weights)
        self._swap_now = False
        self._current: str | None = None
        self._originals: dict[str, object] = {}  # block -> its own forward, while recomputing
        self._by_name = {g.spec.name: g for g in blocks}
        self.apply_treatments(self._treatment)
        self._auto = AutoPlanner(self.activations, self.device, self.apply_treatments, [g.spec.name for g in blocks],
                                 device_budget, host_budget) \
            if activations == "auto" and blocks else None
        for g in blocks:  # around each block, so that calling a block directly works too
            name = g.spec.name
            self._hooks.append(g.spec.module.register_forward_pre_hook(
                lambda m, a, k, n=name: self._enter_forward(n, a, k), with_kwargs=True))
            self._hooks.append(g.spec.module.register_forward_hook(lambda m, a, o, n=name: self._exit_forward(n),
                                                                   always_call=True))
        self.zero_grad()

    # -- set-up ---------------------------------------------------------------------------
    def _plan_memory(self, layout, torch_groups: TorchGroups, options: AttachOptions, device: Device,
                     world) -> memory_plan.MemoryPlan:
        """The shared buffers of this engine, planned from the session's budget and the
        groups' sizes (memory_plan.py); raises memory_plan.DoesNotFit before any allocation."""
        limits = memory_plan.limits_of(self.session)
        shapes = []
        for spec, mode, kind in layout:
            dtype = (spec.params or spec.frozen)[0][1].dtype
            numel, shard = spec.numel, 0
            if world is not None and spec.params:
                shards = Shards(spec.numel, world.size, world.rank)
                numel, shard = shards.padded, shards.per
            chunked = any(stepped_in_chunks(torch_groups.spec(part.index).state_bytes(part.numel), part.numel,
                                            limits.optimizer_buffer_budget, limits.optimizer_buffers)
                          for part in spec.parts)
            shapes.append(memory_plan.GroupShape(
                spec.name, numel, dtype.itemsize, chunked=chunked, offload=mode, strategy=kind, shard=shard,
                frozen_bytes=spec.frozen_numel * dtype.itemsize if mode is True else 0))
        acts = options.activations
        swaps = acts in ("swap", "auto") or (isinstance(acts, dict) and "swap" in acts.values())
        wanted = memory_plan.Wanted(options.prefetch, options.keep, options.host_budget,
                                    arena=any(spec.module is not None for spec, _, _ in layout), swaps=swaps,
                                    shares_host_memory=device.shares_host_memory)
        return memory_plan.plan(shapes, limits, wanted)

    def memory_plan(self) -> memory_plan.MemoryPlan:
        """The shared buffers this engine planned and holds: ``print(engine.memory_plan())``
        shows what goes where and what was given up to fit the session's budget."""
        return self.memory

    def _hands_over(self, g: LayerGroup) -> bool:
        """Whether the group's steps take its fp32 master weights from the slot its backward
        used (its parts are stepped in chunks, which would read them from the SSD again)."""
        og = g.offloaded
        return og.host is None and g.dtype == torch.float32 and g.shard is None and bool(g.chunked) \
            and g.strategy.name == "pooled"  # (its step goes as its backward ends, the slot lent meanwhile)

    def _check_capacity(self, groups: list[ParamGroup], torch_groups: TorchGroups, offload) -> None:
        """Fail before any work starts when the SSD array cannot hold what training puts
        there: every group's state (in its state dtype; after a resume it is there
        already), the new versions of the steps in flight (a step writes its group's
        new version before the old one is freed: the three largest groups, for the read
        ahead, the step and the write-back at once), and offloaded weights other than
        fp32 (fp32 ones are read from the state in place)."""
        states = sorted(torch_groups.spec(part.index).state_bytes(part.numel) for g in groups for part in g.parts)
        share = self.world.size if self.world is not None else 1  # (data parallel: this rank's shards)
        need = ((0 if self._resume else sum(states)) + sum(states[-3:])) // share
        if offload and offload != "host":
            need += sum(g.numel * g.params[0][1].dtype.itemsize for g in groups
                        if g.params and g.params[0][1].dtype != torch.float32)
            need += sum(g.frozen_numel * g.frozen[0][1].dtype.itemsize for g in groups
                        if g.module is not None and g.frozen)
        status = self.session.daemon_status
        free = sum(d.available_bytes if d.HasField("available_bytes") else d.capacity_bytes - d.used_bytes
                   for d in status.devices)
        if need > free:
            raise RuntimeError(
                f"the SSD array of fuyoud has {_size(free)} free but this model needs {_size(need)} there (its "
                "optimizer state, the new versions of the steps in flight and offloaded weights); free space on "
                "its disks, raise [storage] capacity_per_device (or lower keep_free), add data_dirs, or keep the "
                "state in fewer bytes (AdamW(state_dtype='bf16' or 'int8'))")

    # -- the training loop ------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The learning rate (of the first param group); setting it sets every group's."""
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = value

    @staticmethod
    def _refuse_load(*_) -> None:
        raise RuntimeError(
            "load_state_dict() on an attached model would not reach the fp32 master weights in fuyoud (the next "
            "step would start from the old ones): load the weights before attach, resume with attach(model, "
            "resume=DIR), or engine.close() first")

    def _check_trainable(self) -> None:
        """requires_grad changed since attach: the groups (and the daemon's state) are the
        parameters that trained then."""
        for g in self.groups:
            if g.backwards > 0 or g.pending != len(g.spec.params):  # (this group steps now)
                frozen = [n for n, p in g.spec.params if not p.requires_grad]
                if frozen:
                    raise RuntimeError(
                        f"{frozen[0]} was frozen (requires_grad=False) after attach, but its group {g.spec.name} "
                        "still trains: its step would apply weight decay and moments to it. Freeze before attach "
                        "(engine.close(), then attach again)")
        thawed = [n for n, p in self._frozen if p.requires_grad and p.grad is not None]
        if thawed:
            raise RuntimeError(f"{thawed[0]} was unfrozen (requires_grad=True) after attach, which left it out: "
                               "no step would train it. Attach again after changing requires_grad "
                               "(engine.close(), then attach)")

    def _before_grad(self, g: LayerGroup) -> None:
        """Before autograd accumulates a gradient into a parameter's .grad."""
        if self.offloader is not None:
            self.offloader.poll()  # (a slot lent to a step may be back: a deferred prefetch starts)
        g.strategy.before_grad(g)
        if g.submitted:  # its step may be reading the gradient buffer right now
            raise RuntimeError(
                f"group {g.spec.name} got a gradient after its step was submitted (accumulation_steps="
                f"{self.accumulation_steps}): call engine.step() after each backward or attach with "
                "accumulation_steps=N")

    def _on_grad(self, g: LayerGroup) -> None:
        # Called once per parameter per backward (autograd sums a parameter's uses first).
        if self._auto is not None:
            self._auto.backward_seen = True
        g.pending -= 1
        if self.offloader is not None:
            self.offloader.poll()  # (a slot lent to a step may be back: a deferred prefetch starts)
        if g.pending:
            return
        g.pending = len(g.spec.params)
        g.backwards += 1
        if self.device.shares_host_memory:
            heap.trim()  # (the block's backward temporaries were malloc'ed: heap.py)
        if g.backwards > self.accumulation_steps:
            raise RuntimeError(
                f"group {g.spec.name} got gradients from {g.backwards} backward passes since the last "
                f"engine.step(), but accumulation_steps={self.accumulation_steps}: its step may already be "
                "reading them; call engine.step() after each backward or attach with accumulation_steps=N")
        if not self._block_major:
            g.strategy.on_backward(g, first=g.backwards == 1)  # (before the weights go: views need their shapes)
        elif g.backwards == self.accumulation_steps:  # (train_step: the micro-batches' sum, made on the device)
            g.strategy.on_backward(g, first=True)
        steps_now = g.backwards == self.accumulation_steps and self.max_grad_norm is None and not g.submitted
        if g.offloaded is not None and (not self._block_major or g.backwards == self.accumulation_steps):
            g.offloaded.busy = False
            if steps_now and g.offloaded.hands_over and g.offloaded.slot is not None:
                masters = self.offloader.lend(g.offloaded)  # (the step reads the masters there)
                self.offloader.lent_until(self._submit(g, masters=masters))
                return
            self.offloader.release(g.offloaded)  # backward is done with these weights
        if steps_now:
            self._submit(g)  # final gradients: step now, while backward goes on

    def _submit(self, g: LayerGroup, scale: float | None = None, masters=None) -> Future | None:
        """Send the group's step: one per part, each with its torch group's learning rate
        and hyperparameters as of now (the steps may go from another thread). ``masters``:
        the shared buffer holding the group's fp32 weights as its backward read them, from
        which its chunked parts' steps take their master weights. Returns the step's future
        where the gradient strategy keeps it (pooled gradients)."""
        offloaded_bf = g.offloaded is not None and g.dtype != torch.float32 and g.offloaded.host is None
        session, groups = self.session, self.optimizer.param_groups
        parts = [(part, groups[part.index]["lr"], self._torch_groups.spec(part.index, groups[part.index]))
                 for part in g.spec.parts]
        gsize, wsize = g.grad_dtype.itemsize, g.dtype.itemsize

        def start(grads, out=None, pieces=None):
            """The steps of the parts (or of ``pieces``: (part, element offset) in ``grads``
            and ``out``, a shard's), gradients from ``grads``, weights into ``out``."""
            g.host_weights_read().synchronize()  # the step overwrites what the last upload read
            at = {id(part): start for part, start in pieces} if pieces is not None else \
                {id(part): part.start for part, _, _ in parts}
            return gather([session.step_group_async(
                part.name, grads, lr, grads_offset=at[id(part)] * gsize, grad_dtype=g.grad_dtype,
                out=g.weights if out is None else out, out_offset=at[id(part)] * wsize, out_dtype=g.dtype,
                grad_scale=scale, hyper=hyper, weights_object=f"weights/{part.name}" if offloaded_bf else "",
                masters=masters if part.name in g.chunked else None, masters_offset=part.start * 4)
                for part, lr, hyper in parts if id(part) in at],
                combine=StepInfo.combine)

        g.submitted = True
        future = g.strategy.submit(g, start)
        grad_guard.guard(g.spec.params, g.spec.name)  # (read-only until the barrier: grad_guard.py)
        return future

    @property
    def plan(self):
        """The activation plan of ``activations="auto"`` (None until the first profiled
        iteration's ``step()``); ``print(engine.plan)`` shows it."""
        return self._auto.plan if self._auto is not None else None

    def apply_treatments(self, treatments: dict[str, str]) -> None:
        """Keep, swap or recompute, per block, from the next forward on."""
        self._treatment.update(treatments)
        for name, g in self._by_name.items():
            recompute = self._treatment[name] == "recompute"
            if recompute and name not in self._originals:
                self._originals[name] = g.spec.module.forward
                g.spec.module.forward = self.activations.recomputed(g.spec.module.forward,
                                                                    lambda og=g.offloaded: self._resident(og))
            elif not recompute and name in self._originals:
                del g.spec.module.forward  # the class's own forward again
                del self._originals[name]

    def _resident(self, og) -> None:
        """Before a block is recomputed in backward: its weights, held until its gradients
        are complete (the recomputed graph refers to them: no eviction)."""
        if og is not None:
            self.offloader.ensure_for_backward(og)
            og.busy = True

    def _enter_forward(self, name: str, args, kwargs) -> None:
        g = self._by_name[name]
        if g.offloaded is not None and getattr(g.spec.module, "gradient_checkpointing", False):
            raise RuntimeError(GRADIENT_CHECKPOINTING)  # (enabled after attach: transformers >= 5 flags the layers)
        if self._auto is not None:
            self._auto.before(name, args, kwargs)
        self._current = name
        self._swap_now = self._treatment[name] == "swap"
        if torch.is_grad_enabled() and self._saved_ctx is None:
            self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_ctx.__enter__()

    def _exit_forward(self, name: str) -> None:
        if self._auto is not None:
            self._auto.after(name)
        if self.device.shares_host_memory:
            heap.trim()  # (the block's temporaries, freed around what it keeps: heap.py)
        self._swap_now = False
        self._current = None
        if self._saved_ctx is not None:
            self._saved_ctx.__exit__(None, None, None)
            self._saved_ctx = None

    def _pack(self, t: torch.Tensor):
        """A block's saved tensor: offloaded weights become markers (offload.py), the rest
        are activations, kept or swapped out (activations.py)."""
        if self.offloader is not None:
            marker = self.offloader.pack(t)
            if marker is not t:
                return marker
        if self._auto is not None and self._current is not None and self.activations.is_activation(t):
            self._auto.saved(self._current, t.numel() * t.element_size())
        return self.activations.pack(t, self._swap_now)

    def _unpack(self, saved):
        if self.offloader is not None and isinstance(saved, Saved):
            return self.offloader.unpack(saved)
        return self.activations.unpack(saved)

    def step(self) -> None:
        """The barrier: after it every update of this iteration is in the parameters.
        With ``accumulation_steps=n``, call it after the n-th backward (as with torch).

        Non-finite gradients never reach the optimizer state. Without ``max_grad_norm``
        each group's step leaves during backward, so a group whose gradients hold NaN or
        inf is refused by the daemon (its state and step count kept) while the others
        step; this then raises ``fuyou_client.errors.NonFinite`` naming it. With
        ``max_grad_norm`` (``float("inf")`` checks without clipping) every gradient is
        checked before any group steps: a non-finite global norm steps nothing and raises
        NonFinite naming the groups at fault. Either way the loss-scaling skip is
        ``except fuyou_client.errors.NonFinite: engine.zero_grad(); continue``."""
        t_start = time.perf_counter()
        self.optimizer._opt_called = True  # tells torch's LR schedulers that a step happened
        scale = None
        for g in self.groups:  # gradients of a backward that left some parameters without one
            if g.pending != len(g.spec.params):
                g.strategy.before_step(g)
        if self.max_grad_norm is not None:
            try:
                scale = sharded.coefficient(self.sharding, self.groups, self.max_grad_norm) \
                    if self.sharding is not None else clipping.coefficient(self.model, self.groups, self.max_grad_norm)
            except NonFinite:  # nothing was submitted: the gradients stay for zero_grad() to clear
                if self.offloader is not None:
                    self.offloader.release_all()
                raise
        if self.offloader is not None:
            self.offloader.release_all()  # weights of groups that got no gradient (or eval forwards)
        infos, errors = {}, []
        try:
            self._check_trainable()
            for g in self.groups:
                # With clipping every step goes now; a group none of whose parameters got a
                # gradient since the last step is not stepped (torch skips parameters without
                # .grad; within a stepped group such a parameter steps with a zero gradient).
                touched = g.backwards > 0 or g.pending != len(g.spec.params)
                if not g.submitted and touched:
                    self._submit(g, scale)
        finally:  # wait for everything in flight, whatever failed, so no buffer is left in use
            self._land(infos, errors)
        self.last_step_infos = [infos[g.spec.name] for g in self.groups if g.spec.name in infos]  # group order
        if errors:
            for strategy in self._strategies:  # (additions of groups never stepped must not land in the next sum)
                strategy.discard()
            if all(isinstance(e, NonFinite) for e in errors):  # the daemon refused these groups' steps
                raise NonFinite(
                    f"{len(errors)} of {len(errors) + len(infos)} groups refused by fuyoud, the others stepped: "
                    + " | ".join(str(e) for e in errors)) from errors[0]
            raise errors[0]
        self.activations.reset()
        if self._auto is not None:
            self._auto.step_done()
        self._report(t_start)

    def train_step(self, micro_batches, loss_fn) -> torch.Tensor:
        """One iteration over ``micro_batches`` in block-major order (blockmajor.py): each
        block runs forward for every micro-batch before the next block does, and backward
        block by block, each block's gradient accumulated over the micro-batches on the
        compute device, sent to fuyoud once and stepped at once (while backward goes on),
        so weights and gradients cross once per block and iteration, not per micro-batch.

        ``loss_fn(micro_batch)`` returns the scalar to backpropagate (divide by
        ``len(micro_batches)`` in it for a mean). Returns the losses, detached, one per
        micro-batch; the step's barrier has run (``engine.step()`` and ``zero_grad()``
        are not called after it). Trains exactly as the ordinary loop over the same
        micro-batches would, each micro-batch's dropout drawn as under
        ``fuyou_client.micro_batch_rng``. Each micro-batch's input to each block is kept
        until backward, in host memory up to ``host_budget`` bytes (on a GPU in a shared
        arena), the rest on the SSD array, read back ahead of backward (block_store.py;
        ``engine.train_step_stats`` counts it); ``host_budget`` must hold at least the
        micro-batches of one block plus two. ``activations=`` does not apply to it, and each
        group's gradients add up on the compute device over the micro-batches (in the
        parameters' dtype, as torch adds them) whatever ``grad_accumulation`` says: they
        leave it once per step."""
        if hf_checkpointing(self.model):
            raise RuntimeError("train_step recomputes blocks itself; turn Hugging Face gradient checkpointing off "
                               "(gradient_checkpointing_disable())")
        if self.world is not None:
            raise RuntimeError("train_step is not built for data parallelism yet: train with the ordinary loop "
                               "(accumulation_steps=K for K micro-batches per step)")
        return blockmajor.train_step(self, micro_batches, loss_fn)

    @property
    def train_step_stats(self):
        """The last ``train_step``'s traffic to and from the SSD array (block_store.StoreStats:
        bytes of kept inputs spilled and read back, seconds waited for them), or None before
        the first."""
        return self._train_step_store.stats if self._train_step_store is not None else None

    def _land(self, infos: dict, errors: list) -> None:
        """Wait for every step in flight and put its new weights into the parameters; each
        group's result goes to ``infos`` (by name), each failure to ``errors``."""
        for g in self.groups:  # (data parallel: the weights gathered from the shards, in group order)
            if g.future is not None:
                g.future = g.strategy.landing(g, g.future)
        for g in self.groups:
            if g.future is not None:
                try:
                    infos[g.spec.name] = g.future.result()
                    if g.shard is None:  # (data parallel: the all-gather put them there)
                        layergroup.upload_weights(self.device, g)  # (GPU: the new weights into the parameters)
                except Exception as exc:  # noqa: BLE001 - the caller raises
                    errors.append(exc)
            g.future, g.submitted, g.backwards = None, False, 0
            g.pending = len(g.spec.params)  # (a loop may zero with torch's model.zero_grad() instead of ours)
            grad_guard.release(g.spec.params)  # (the daemon is done with them)
        for strategy in self._strategies:  # steps whose futures a strategy kept
            kept, kept_errors = strategy.reclaim()
            infos.update(kept)
            errors.extend(kept_errors)
        if self.offloader is not None:
            self.offloader.take_back_all()  # (slots lent to steps: every step has landed)

    def _report(self, t_start: float) -> None:
        """Send this iteration's time and the part of it spent waiting in step() to the
        daemon's metrics (fire and forget: a lost report costs nothing but a sample)."""
        now, last = time.perf_counter(), self._last_step_end
        self._last_step_end = now
        if last is not None:  # an iteration runs from one step() return to the next
            to_host, to_ssd = self.activations.stats.take_traffic()
            self.session.report_async(1, now - last, now - t_start, to_host, to_ssd).add_done_callback(
                lambda f: f.exception())

    def grad_norm(self) -> float | None:
        """This iteration's global gradient norm so far, as ``torch.nn.utils.clip_grad_norm_``
        computes it (what ``step()`` clips with), where attach has ``max_grad_norm`` (every
        gradient is then kept until ``step()``); None without it (the groups' steps leave
        during backward and their gradients with them). For logging, as Hugging Face's
        Trainer logs it; reading it changes nothing. With data parallelism it is the norm of
        the ranks' mean gradient, and every rank must call it (it is all-reduced)."""
        if self.max_grad_norm is None:
            return None
        if self.sharding is not None:  # (every rank calls it: the norm is all-reduced)
            return sharded.total_norm(self.sharding, self.groups)
        return clipping.total_norm(self.model, self.groups)[2].item()

    def zero_grad(self) -> None:
        """Zero every gradient (in shared memory: they stay views of it; pooled ones are
        zeroed when a group's backward takes a buffer). Between the micro-batches of an
        accumulation it discards what they accumulated so far."""
        if getattr(self, "activations", None) is not None:
            self.activations.reset()  # what a forward without backward parked
        for strategy in getattr(self, "_strategies", []):  # (additions discarded mid-accumulation land first)
            strategy.discard()
        for g in self.groups:
            grad_guard.release(g.spec.params)
            g.strategy.zero(g, self.device)
            g.pending, g.backwards = len(g.spec.params), 0

    def require_idle(self, what: str) -> None:
        if any(g.submitted or g.future is not None or g.backwards for g in self.groups):
            raise RuntimeError(f"{what} between iterations: call engine.step() first")

    def save_checkpoint(self, directory, extra=None, mode: str = "auto", timeout: float = 60.0):
        """Everything needed to resume: the daemon's optimizer state (master weights,
        moments, step counts) and this engine's learning rate, plus ``extra`` (plain data:
        scheduler.state_dict(), the data loader's position...), given back after
        ``attach(model, resume=directory)`` as ``engine.checkpoint_extra``. ``directory``
        is a new path on the daemon's host; on the SSD array's filesystem the checkpoint is
        a snapshot (no bytes copied), elsewhere a copy (``mode`` forces either)."""
        self.require_idle("save_checkpoint")
        if self.world is not None:  # (every rank calls it: dp_checkpoints.py)
            return dp_checkpoints.save(self, directory, extra, mode, timeout)
        return self.session.checkpoint(directory, timeout, mode, checkpoints.client_state(self, extra))

    def resume_lr(self) -> None:
        """Set every param group's learning rate (and a scheduler's initial_lr) and
        hyperparameters back to the checkpoint's. attach(resume=...) does it; call it
        again after creating an LR scheduler, whose constructor sets the rate of its
        epoch 0, and loading its state_dict."""
        checkpoints.restore_groups(self.optimizer.param_groups, self._checkpoint_groups)
        for i, group in enumerate(self.optimizer.param_groups):
            self._torch_groups.spec(i, group)  # (a checkpoint's values out of range: refused now, named)

    def export(self, directory, dtype: torch.dtype | None = None):
        """The trained weights as sharded safetensors (``from_pretrained`` reads the
        directory; plain modules: ``load_state_dict(fuyou_client.load_exported(dir))``),
        streamed from the SSD array one layer group at a time. ``dtype``: default, each
        group's parameter dtype."""
        if self.world is None:
            return checkpoints.export(self, directory, dtype)
        return checkpoints.export(self, directory, dtype, masters=lambda session, spec: dp_checkpoints.gather_masters(
            session, self.world, self.collectives, spec))  # (every rank calls it: gathered, rank 0 writes)

    def _held_parts(self):
        """The parts whose daemon groups this process holds (data parallel: its shards')."""
        for g in self.groups:
            yield from ((part for part, _, _ in g.shard.pieces) if g.shard is not None else g.spec.parts)

    def state_dict(self) -> dict:
        return {"lr": self.lr, "group_steps": {part.name: self.session.group(part.name).step
                                               for part in self._held_parts()}}

    def part_steps(self) -> dict[int, int]:
        """The daemon's step count of each torch param group (of its first part)."""
        steps: dict[int, int] = {}
        for part in self._held_parts():
            steps.setdefault(part.index, self.session.group(part.name).step)
        return steps

    def close(self, materialize: bool = True) -> None:
        """Detach from the daemon. With ``materialize`` the parameters become ordinary
        tensors holding the trained weights (e.g. for save_pretrained) — the whole model
        in memory; without, offloaded parameters stay empty."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._train_step_store is not None:
            self._train_step_store.close()
        self.apply_treatments({name: "keep" for name in self._by_name})  # unpatch recomputed forwards
        try:
            for g in self.groups:  # steps in flight still write into shared buffers: let them land
                if g.future is not None and g.future.exception() is None and g.shard is None:
                    layergroup.upload_weights(self.device, g)  # (GPU: into the parameters)
            for strategy in self._strategies:
                strategy.reclaim()
            if self.offloader is not None:
                self.offloader.take_back_all()
                self.offloader.release_all()
            with torch.no_grad():
                for g in self.groups:
                    if g.offloaded is not None and materialize:
                        self.offloader.ensure(g.offloaded)
                    for p in (g.offloaded.params if g.offloaded is not None else [p for _, p in g.spec.params]):
                        p.grad = None
                        if materialize and p.data.numel():
                            p.data = p.data.clone()  # out of shared memory, which goes with the session
                    if g.offloaded is not None:
                        self.offloader.release(g.offloaded, keep_params=materialize)
        finally:
            if self.collectives is not None:  # (after the last fetches: with offload they gather from the ranks)
                self.collectives.close()
            if self.offloader is not None:
                self.offloader.close()
            self.device.synchronize()
            if self._owns_session:
                self.session.close()
            if not self.device.shares_host_memory:
                self.session.use_device(None)
            self.device.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

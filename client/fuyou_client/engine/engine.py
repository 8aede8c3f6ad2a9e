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
(groups/, device/). The fp32 master weights and the AdamW/SGD moments live only
on the SSD array, in the daemon. A post-accumulate-grad hook counts
each group's gradients; when the last one lands during backward, that group's step is
submitted while backward goes on with earlier layers. `engine.step()` waits for all of
them. With `max_grad_norm`, clipping is exact: the steps wait for every gradient (the
norm needs them all), then go out together with the clip coefficient.

With ``offload=True`` (the default) the blocks' weights, too, are in memory only while
they compute (see offload/); the "rest" group (embeddings, final norm, head) stays
resident. Gradients of every group stay in shared memory (they accumulate there).
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch.utils._pytree import tree_flatten
from torch import nn

from fuyou_client.blockmajor import StepTimes, Store, check_micro_batches, run as run_block_major, swapped_blocks
from fuyou_client.blockmajor.swapped import Swapped
from fuyou_client.checkpoints import Trained, restore_groups
from fuyou_client.engine import closing
from fuyou_client.engine.hooks import hf_checkpointing
from fuyou_client.engine.torch_optimizer import TorchOptimizer
from fuyou_client.errors import DeviceOutOfMemory, ResourceExhausted
from fuyou_client.model.experts import uncut_experts
from fuyou_client.optim import StepInfo
from fuyou_proto.units import format_size


def micro_batch_tokens(micro_batch) -> int:
    """A micro-batch's tokens: its largest tensor of integers (token ids, labels), 0 if it has none."""
    ints = [t.numel() for t in tree_flatten(micro_batch)[0]
            if isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()]
    return max(ints, default=0)


def out_of_device_memory(dplan, device, exc) -> str:
    allocated = device.memory_allocated()
    return (f"the compute device ran out of memory during train_step ({str(exc).splitlines()[0][:200]}): "
            + (f"{format_size(allocated)} allocated now; " if allocated is not None else "")
            + (f"the device plan counted on {format_size(dplan.fixed_bytes)} fixed within a budget of "
               f"{format_size(dplan.budget)}, so something else took device memory after attach (another process, "
               "or tensors of this one). " if dplan is not None and dplan.budget is not None else "")
            + "The steps already sent landed and the rest were dropped: the state on the SSD array is that of the "
              "last complete step (resumable from a checkpoint, or train_step again once memory is free)"
            + (f"\n{dplan.describe()}" if dplan is not None else ""))


class Engine:
    """The public API of an attached model. Built by engine/build.py from its parts:

    * ``coordinator`` (steps/): gradients counted, steps submitted and landed, clipping;
    * ``offloader`` (offload/, None without offloaded groups): the weight slots and fetches;
    * ``activations``, ``activation_policy`` (activations/) and ``hooks``
      (engine/hooks.py): activations kept, swapped or recomputed, and every hook on the model;
    * ``parallel`` (parallel/seam.py): one process or data parallelism;
    * ``groups``: the layer groups (groups/), ``memory``: the memory plan (memory/).

    What a training loop reads besides the methods:
      ``optimizer``: a ``torch.optim.Optimizer`` whose ``param_groups`` are attach's
      parameter groups; torch's LR schedulers, Hugging Face's Trainer and Accelerate
      drive it (engine/torch_optimizer.py).
      ``model``: the attached model.
      ``session``: the ``fuyou_client.Session`` to the daemon.
      ``options``: the ``AttachOptions`` in force, ``prefetch`` and ``host_budget`` as
      the memory plan set them.
      ``checkpoint_extra``: after ``attach(resume=...)``, the ``extra`` that
      ``save_checkpoint`` kept; else None.
      ``train_step_times``: the last ``train_step``'s forward, backward and step
      seconds; None before the first.
      ``sizing_plan``: the ``fuyou_client.plan(...)`` result that ``attach(plan=...)``
      applied; else None.
      ``peers``: with data parallelism, each rank's (host, daemon); else None.
    """
    sizing_plan = None  # the fuyou_client.plan(...) attach(plan=...) applied (sizing/), else None

    def __init__(self, model: nn.Module, session, device, options, plan, groups, torch_groups, coordinator,
                 offloader, activations, policy, hooks, auto, parallel, owns_session: bool, block_modules: list,
                 gradients=None, host_grads=None, values=None):
        self.model, self.session, self.device, self.options = model, session, device, options
        self.memory = plan
        self.groups = groups
        self._torch_groups = torch_groups
        self.optimizer = TorchOptimizer(self, torch_groups)
        self.coordinator = coordinator
        self.offloader = offloader
        self.activations = activations
        self.activation_policy = policy
        self.hooks = hooks
        self._auto = auto
        self.parallel = parallel
        self.gradients = gradients  # the pool of offloaded groups' gradient buffers (gradients/pool.py), or None
        self.host_grads = host_grads  # grad_accumulation="host"'s accumulator (gradients/host.py), or None
        self._owns_session = owns_session
        self._block_modules = block_modules  # every block, in forward order (frozen ones too)
        self._train_step_store: Store | None = None
        self._train_step_swapper = None  # (swap_blocks: train_step's activation swapper, its arena what the kept inputs leave)
        self.train_step_times: StepTimes | None = None  # the last train_step's: forward, backward, step seconds
        self.peers: list | None = None  # data parallelism: each rank's (host, daemon)
        self.checkpoint_extra = None  # what save_checkpoint(extra=...) kept, after a resume
        self.checkpoint_groups: list[dict] = []  # each param group's hyperparameters at the checkpoint
        self._last_step_end: float | None = None  # for the iteration times reported to the daemon
        self._values = values  # state_dict() hooks and gathered() (engine/trained_values.py)

    # -- what attach chose ------------------------------------------------------------------
    @property
    def world(self):
        """Data parallelism's world (parallel.World), or None for one process."""
        return self.parallel.world

    @property
    def max_grad_norm(self) -> float | None:
        """attach's ``max_grad_norm``: the global gradient norm steps are clipped to, or None."""
        return self.coordinator.max_grad_norm

    @property
    def accumulation_steps(self) -> int:
        """attach's ``accumulation_steps``: backward passes per ``step()``."""
        return self.coordinator.accumulation_steps

    @property
    def last_step_infos(self) -> list[StepInfo]:
        """The last step's outcome per group (``StepInfo``), in group order."""
        return self.coordinator.infos

    def memory_plan(self):
        """The shared buffers this engine planned and holds: ``print(engine.memory_plan())``
        shows what goes where and what was given up to fit the session's budget."""
        return self.memory

    @property
    def plan(self):
        """The activation plan of ``activations="auto"`` (None until the first profiled
        iteration's ``step()``); ``print(engine.plan)`` shows it."""
        return self._auto.plan if self._auto is not None else None

    def apply_treatments(self, treatments: dict[str, str]) -> None:
        """Keep, swap or recompute, per block, from the next forward on."""
        self.activation_policy.apply(treatments)

    @property
    def lr(self) -> float:
        """The learning rate (of the first param group); setting it sets every group's."""
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = value

    # -- the training loop ------------------------------------------------------------------
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
        self.optimizer.stepped()  # tells torch's LR schedulers that a step happened
        self.coordinator.step()
        self.activations.reset()
        if self._auto is not None:
            self._auto.step_done()
        self._report(t_start)

    def train_step(self, micro_batches, loss_fn) -> torch.Tensor:
        """One iteration over ``micro_batches`` in block-major order (blockmajor/schedule.py): each
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
        arena), the rest on the SSD array, read back ahead of backward (blockmajor/store.py;
        ``engine.train_step_stats`` counts it); ``host_budget`` must hold at least the
        micro-batches of one block plus two. ``activations=`` does not apply to it;
        ``swap_blocks=N`` (attach) swaps N blocks' activations instead of recomputing them
        (blockmajor/swapped.py). Each
        group's gradients add up over the micro-batches in the parameters' dtype, as torch
        adds them, on the compute device (a sub-block's sum waits on the host between them:
        ``granularity="module"``), and leave it once per step, whatever ``grad_accumulation``
        says. It calls each block's ``forward`` itself, so a block with
        hooks of its own (forward or backward, on the block module) is refused; hooks on
        modules inside a block run as usual."""
        if hf_checkpointing(self.model):
            raise RuntimeError("train_step recomputes blocks itself; turn Hugging Face gradient checkpointing off "
                               "(gradient_checkpointing_disable())")
        self.parallel.refuse_train_step()
        check_micro_batches(micro_batches, loss_fn)
        self.require_idle("train_step")
        self._refuse_block_hooks()
        self._check_device_room(micro_batches)
        swapped = self._swapped()
        if self._train_step_store is None:
            budget = self.options.host_budget
            self._train_step_store = Store(self.session, self.device, budget // 2 if swapped is not None else budget)
        by_module = {id(g.spec.module): g for g in self.groups if g.spec.module is not None}
        blocks = []
        for module in self._block_modules:
            g = by_module.get(id(module))
            blocks.append((module, g.offloaded if g is not None else None,
                           self.activation_policy.forward_of(g.spec.name, module) if g is not None else module.forward))
        rest_trains = any(g.spec.is_rest and g.spec.params for g in self.groups)
        try:
            losses, self.train_step_times = run_block_major(
                self.model, self.device, self.coordinator, self.offloader, self._train_step_store, blocks,
                rest_trains, micro_batches, loss_fn, barrier=self.step, on_failure=self.zero_grad, swapped=swapped)
        except torch.OutOfMemoryError as exc:  # (another process took device memory the plan counted on)
            raise DeviceOutOfMemory(out_of_device_memory(self.memory.device, self.device, exc)) from exc
        self.zero_grad()
        return losses

    def _swapped(self) -> Swapped | None:
        """train_step's swapped blocks (``swap_blocks``), with the activation swapper they
        park in: its arena what the kept inputs leave of ``host_budget`` (they plan within
        half of it)."""
        which = swapped_blocks(len(self._block_modules), self.options.swap_blocks)
        if not which:
            return None
        budget = self.options.host_budget
        if self._train_step_swapper is None:  # (its arena's size is set at the step's first swapped block)
            self._train_step_swapper = self.activations.sibling(budget)
        return Swapped(which, self._train_step_swapper, self.hooks.saving,
                       arena=lambda: budget - self._train_step_store.plan.held)

    def _check_device_room(self, micro_batches) -> None:
        """train_step's micro-batches against the device plan, before any work: its tokens'
        activations (memory/device_plan.py), and with several micro-batches a cut block's
        sub-blocks' gradients, kept on the device until the last one. Swapped blocks'
        activations come back into device memory even on a device that computes elsewhere
        (the stand-in): counted there too."""
        dplan = self.memory.device
        if dplan is None or dplan.budget is None:
            return
        tokens = micro_batch_tokens(micro_batches[0])
        activations = self.device.computes_in_its_memory or self.options.swap_blocks > 0
        need = dplan.total(tokens, activations=activations)
        why = [f"{format_size(dplan.fixed_bytes)} fixed"]
        if tokens:
            why.append(f"{format_size(need - dplan.fixed_bytes)} for {tokens} tokens a micro-batch")
        if need > dplan.budget:
            fit = dplan.max_tokens(activations)
            raise ResourceExhausted(
                f"train_step's micro-batches do not fit the device plan: {format_size(need)} "
                f"({', '.join(why)}) against a budget of {format_size(dplan.budget)}; pass micro-batches of at most "
                f"{fit} tokens"
                + ", or give the device more (attach(device_memory=...))\n" + dplan.describe(tokens))

    def _refuse_block_hooks(self) -> None:
        """train_step calls each block's ``forward`` itself (blockmajor/schedule.py), so hooks
        registered on a block would silently not run: refused, naming them."""
        for module in self._block_modules:
            found = self.hooks.foreign(module)
            if found:
                name = next(n for n, m in self.model.named_modules() if m is module)
                raise RuntimeError(
                    f"train_step calls each block's forward itself (block-major order), so hooks on a block do not "
                    f"run, and block {name!r} has {', '.join(found)}: remove them, register them on a module inside "
                    "the block (those run as usual), or train with the ordinary loop (forward, backward, step)")

    @property
    def train_step_stats(self):
        """The last ``train_step``'s traffic to and from the SSD array (blockmajor.store.StoreStats:
        bytes of kept inputs spilled and read back, seconds waited for them), or None before
        the first."""
        return self._train_step_store.stats if self._train_step_store is not None else None

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
        return self.coordinator.clipper.total_norm()  # (data parallel: every rank calls it, all-reduced)

    def zero_grad(self) -> None:
        """Zero every gradient (in shared memory: they stay views of it; pooled ones are
        zeroed when a group's backward takes a buffer). Between the micro-batches of an
        accumulation it discards what they accumulated so far."""
        self.activations.reset()  # what a forward without backward parked
        self.coordinator.zero_grad()

    def require_idle(self, what: str) -> None:
        """Raise RuntimeError naming ``what`` while an iteration is under way (gradients
        counted, steps submitted or in flight): ``step()`` ends it."""
        self.coordinator.require_idle(what)

    # -- checkpoints and export ---------------------------------------------------------------
    def save_checkpoint(self, directory, extra=None, mode: str = "auto", timeout: float = 60.0):
        """Everything needed to resume: the daemon's optimizer state (master weights,
        moments, step counts) and this engine's learning rate, plus ``extra`` (plain data:
        scheduler.state_dict(), the data loader's position...), given back after
        ``attach(model, resume=directory)`` as ``engine.checkpoint_extra``. ``directory``
        is a new path this process can create on the daemon's host, its files this user's
        (the client creates them and the daemon writes through their descriptors); on the
        SSD array's filesystem the checkpoint is a snapshot (no bytes copied), elsewhere a
        copy (``mode`` forces either). A daemon that deletes its store when it stops
        (``start_daemon()`` without a ``state_dir``) gives a copy in mode "auto": a snapshot
        would go with it."""
        self.require_idle("save_checkpoint")
        return self.parallel.save_checkpoint(self.session, self.groups, self.optimizer.param_groups, extra, directory,
                                             mode, timeout)  # (data parallel: every rank calls it)

    def resume_lr(self) -> None:
        """Set every param group's learning rate (and a scheduler's initial_lr) and
        hyperparameters back to the checkpoint's. attach(resume=...) does it; call it
        again after creating an LR scheduler, whose constructor sets the rate of its
        epoch 0, and loading its state_dict."""
        restore_groups(self.optimizer.param_groups, self.checkpoint_groups)
        for i, group in enumerate(self.optimizer.param_groups):
            self._torch_groups.spec(i, group)  # (a checkpoint's values out of range: refused now, named)

    def export(self, directory, dtype: torch.dtype | None = None):
        """The trained weights as sharded safetensors (``from_pretrained`` reads the
        directory; plain modules: ``load_state_dict(fuyou_client.load_exported(dir))``),
        streamed from the SSD array one layer group at a time. ``dtype``: default, each
        group's parameter dtype."""
        self.require_idle("export")
        return self.parallel.export(Trained(self.model, self.session, self.groups, self.world), directory, dtype)

    def gathered(self, *modules):
        """A context manager: inside it the offloaded parameters of ``modules`` (modules or
        parameters; default: the whole model) hold their trained values, read from the SSD
        array into new CPU tensors, for code that reads ``named_parameters()``; after it they
        are empty placeholders again. Read only (a write does not reach the master weights).
        Between steps only; more bytes than ``values_limit`` is refused, naming ``export``.
        (``model.state_dict()`` needs no such block: it always gives the trained values.)"""
        return self._values.gathered(modules)

    @property
    def values_limit(self) -> int | None:
        """The most bytes of offloaded weights ``model.state_dict()`` and ``gathered()`` put in
        host memory (beyond it they refuse, naming ``export``); None (the default): what the
        host has available at the time (MemAvailable, and a cgroup's memory limit)."""
        return self._values.limit

    @values_limit.setter
    def values_limit(self, nbytes: int | None) -> None:
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
            raise ValueError(f"values_limit must be a number of bytes >= 0 or None, not {nbytes!r}")
        self._values.limit = nbytes

    def state_dict(self) -> dict:
        """The learning rate and the daemon's step count of each layer group this process
        holds (for logs; a checkpoint is ``save_checkpoint``)."""
        return {"lr": self.lr, "group_steps": {part.name: self.session.group(part.name).step
                                               for part in self.parallel.held_parts(self.groups)}}

    def part_steps(self) -> dict[int, int]:
        """The daemon's step count of each torch param group (of its first part)."""
        steps: dict[int, int] = {}
        for part in self.parallel.held_parts(self.groups):
            steps.setdefault(part.index, self.session.group(part.name).step)
        return steps

    def close(self, materialize: bool = True) -> None:
        """Detach from the daemon. With ``materialize`` the parameters become ordinary
        tensors holding the trained weights (e.g. for save_pretrained) — the whole model in
        memory; without, offloaded parameters stay empty.

        Either way no parameter is left a view of the shared memory that goes with the
        session (it would read zeros after close):

        * a resident group's parameters (the "rest" group; every group with
          ``offload=False``) hold their trained weights, copied out of shared memory,
          whatever ``materialize`` says;
        * an offloaded group's parameters (its frozen ones too) hold their trained weights,
          read from the SSD array, with ``materialize``; without, they are empty
          placeholders (``numel() == 0``);
        * parameters attach left alone (frozen ones outside offloaded blocks) keep theirs.

        A step still in flight (close between ``backward()`` and ``engine.step()``) lands
        first when it can. When a group's weights in this process may not be its trained
        ones, they are not kept: its parameters become empty placeholders and close raises
        RuntimeError naming the groups, after everything else is detached (the daemon's
        committed state, and a checkpoint, have the trained weights). That is a step in
        flight whose outcome is unknown (the daemon died or the connection broke under it,
        or the step failed in this process), a step in flight whose new weights come back
        through a collective close does not run (data parallelism, an optimizer host), or
        an offloaded group whose weights could not be read back for ``materialize``. A step
        the daemon refused or failed itself (``NonFinite``, an I/O error) leaves the
        weights as its committed state has them: those are kept."""
        self.hooks.remove()
        self._values.remove()
        self.activation_policy.close()  # (the recomputed forwards unpatched)
        if self._train_step_store is not None:
            self._train_step_store.close()
        if self._train_step_swapper is not None:
            self._train_step_swapper.close()
        lost: dict = {}
        try:
            try:
                lost.update(closing.settle_in_flight(self.groups, self.coordinator.strategies, self.device,
                                                     self.parallel.data_parallel))
            finally:
                try:
                    if self.offloader is not None:  # (whatever failed: no slot stays, each group read again or emptied)
                        try:
                            self.offloader.take_back_all()
                        finally:
                            self.offloader.release_all()
                finally:  # (no parameter is left a view of the session's memory)
                    lost.update(closing.detach_parameters(self.groups, self.offloader, materialize, lost))
        finally:
            self.parallel.close()  # (after the last fetches: with offload they gather from the ranks)
            self.device.synchronize()
            if self._owns_session:
                self.session.close()
            elif not self.session.closed:  # (the caller's session goes on: its plan's reservation goes)
                with contextlib.suppress(Exception):
                    self.session.reserve(0)
            self.session.use_device(None)
            self.device.close()
        if materialize and not lost:
            uncut_experts(self.model, values=True)  # (expert parts joined: the model's own fused parameters)
        if lost:
            raise closing.lost_weights(lost)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

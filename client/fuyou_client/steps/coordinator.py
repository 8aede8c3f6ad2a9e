"""The step coordinator: counting each layer group's gradients, submitting its step the
moment they are final, the barrier that lands every step, and the errors.

A post-accumulate-grad hook (engine/hooks.py) calls ``on_grad`` once per parameter per
backward; when a group's last gradient lands it has had one more backward, and after
``accumulation_steps`` of them (and without exact clipping, which needs every gradient
first) its step is submitted while backward goes on with earlier layers. ``step()`` is
the barrier: the groups not yet submitted go (with the clip coefficient), every step is
waited for, the new weights land in the parameters, and failures are raised together.

It is handed what it uses: the session, the device, the groups, the torch param groups
(learning rates and hyperparameters as of each submission), the offloader (slots are
let go or lent to steps), the gradient strategies in use and a clipper from the
parallelism seam. Block-major (blockmajor/schedule.py) calls ``block_major(k)`` around
its passes: each group's gradient is then the sum of ``k`` micro-batches made on the
device, handed to its strategy once.
"""
from __future__ import annotations

from concurrent.futures import Future
from contextlib import contextmanager

from fuyou_client.connection import Session, all_of
from fuyou_client.device import Device
from fuyou_client.errors import NonFinite
from fuyou_client.gradients import guard
from fuyou_client.groups import LayerGroup, land_new_weights
from fuyou_client.groups.placement import step_weights_object
from fuyou_client.optim import StepInfo


class StepCoordinator:
    def __init__(self, session: Session, device: Device, groups: list[LayerGroup], param_groups, torch_groups,
                 offloader, strategies: list, clipper, accumulation_steps: int, max_grad_norm: float | None,
                 frozen: list, recomputed=None):
        self.session, self.device, self.groups = session, device, groups
        self._param_groups = param_groups  # () -> engine.optimizer.param_groups (what schedulers change)
        self._torch_groups = torch_groups
        self.offloader = offloader
        self.strategies = strategies  # the gradient strategies some group uses
        self.clipper = clipper
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self._frozen = frozen  # (name, parameter) not trained at attach
        self._recomputed = recomputed or (lambda name: False)  # (block name) -> its forward is recomputed now
        self._block_major = False  # in train_step: weights stay until a group's last micro-batch
        self.infos: list[StepInfo] = []  # the last barrier's, in group order

    # -- during backward ----------------------------------------------------------------
    def before_grad(self, g: LayerGroup) -> None:
        """Before autograd accumulates a gradient into one of the group's parameters."""
        if self.offloader is not None:
            self.offloader.poll()  # (a slot lent to a step may be back: a deferred prefetch starts)
        g.strategy.before_grad(g)
        if g.submitted:  # its step may be reading the gradient buffer right now
            raise RuntimeError(
                f"group {g.spec.name} got a gradient after its step was submitted (accumulation_steps="
                f"{self.accumulation_steps}): call engine.step() after each backward or attach with "
                "accumulation_steps=N")

    def on_grad(self, g: LayerGroup) -> None:
        """Once per parameter per backward (autograd sums a parameter's uses first)."""
        g.pending -= 1
        if self.offloader is not None:
            self.offloader.poll()  # (a slot lent to a step may be back: a deferred prefetch starts)
        if g.pending:
            return
        g.pending = len(g.spec.params)
        g.backwards += 1
        self.device.block_done()  # (the CPU: its backward temporaries' heap given back)
        if g.backwards > self.accumulation_steps:
            raise RuntimeError(
                f"group {g.spec.name} got gradients from {g.backwards} backward passes since the last "
                f"engine.step(), but accumulation_steps={self.accumulation_steps}: its step may already be "
                "reading them; call engine.step() after each backward or attach with accumulation_steps=N")
        final = g.backwards == self.accumulation_steps
        if not self._block_major:
            g.strategy.on_backward(g, first=g.backwards == 1)  # (before the weights go: views need their shapes)
        elif final:  # (train_step: the micro-batches' sum, made on the device)
            g.strategy.on_backward(g, first=True)
        else:
            g.strategy.between_micro_batches(g)
        steps_now = final and self.max_grad_norm is None and not g.submitted
        og = g.offloaded
        if og is not None and (not self._block_major or final):
            if len(og.params) > len(g.spec.params) and self._recomputed(og.name):
                # A recomputed block's graph saved its frozen parameters themselves (the recomputation
                # runs outside the saved-tensor hooks that make markers of them), and backward may still
                # read them after its trained ones are final (a frozen layer norm or base weight before
                # them): its slot stays, evicted when another block needs one (backward is then past
                # it: it goes on to earlier blocks) or given back at the barrier.
                self.offloader.let_go(og)
            elif steps_now and og.hands_over and og.slot is not None:
                self.offloader.lend_for_step(og, lambda masters: self.submit(g, masters=masters))
                return
            else:
                self.offloader.backward_done(og)  # backward is done with these weights
        if steps_now:
            self.submit(g)  # final gradients: step now, while backward goes on

    def submit(self, g: LayerGroup, scale: float | None = None, masters=None) -> Future:
        """Send the group's step: one per part, each with its torch group's learning rate
        and hyperparameters as of now (the steps may go from another thread). ``masters``:
        the shared buffer holding the group's fp32 weights as its backward read them, from
        which its chunked parts' steps take their master weights. Returns the step's future."""
        session, groups = self.session, self._param_groups()
        parts = [(part, groups[part.index]["lr"], self._torch_groups.spec(part.index, groups[part.index]))
                 for part in g.spec.parts]
        gsize, wsize = g.grad_dtype.itemsize, g.dtype.itemsize

        def start(grads, out=None, pieces=None):
            """The steps of the parts (or of ``pieces``: (part, element offset) in ``grads``
            and ``out``, a shard's), gradients from ``grads``, weights into ``out``."""
            g.host_weights_read().synchronize()  # the step overwrites what the last upload read
            at = {id(part): start for part, start in pieces} if pieces is not None else \
                {id(part): part.start for part, _, _ in parts}
            return all_of([session.step_group_async(
                part.name, grads, lr, grads_offset=at[id(part)] * gsize, grad_dtype=g.grad_dtype,
                out=g.weights if out is None else out, out_offset=at[id(part)] * wsize, out_dtype=g.dtype,
                grad_scale=scale, hyper=hyper, weights_object=step_weights_object(g.offload, g.dtype, part.name),
                masters=masters if part.name in g.chunked else None, masters_offset=part.start * 4,
                tensors=g.spec.tensors(part.start, part.numel) if pieces is None else ())
                for part, lr, hyper in parts if id(part) in at],
                combine=StepInfo.combine)

        start.scale = scale  # (a strategy whose steps run elsewhere sends it: parallel/remote.py)
        g.submitted = True
        if g.offloaded is not None and self.offloader is not None:
            self.offloader.forget(g.offloaded)  # (weights it cached are stale from now on)
        future = g.strategy.submit(g, start)
        if not g.strategy.keeps_steps:
            g.future = future
        guard.guard(g.spec.params, g.spec.name)  # (read-only until the barrier: gradients/guard.py)
        return future

    # -- the barrier ----------------------------------------------------------------------
    def step(self) -> None:
        """Every group's step submitted and landed (see Engine.step)."""
        scale = None
        for g in self.groups:  # gradients of a backward that left some parameters without one
            if g.pending != len(g.spec.params):
                g.strategy.before_step(g)
        if self.max_grad_norm is not None:
            try:
                scale = self.clipper.coefficient(self.max_grad_norm)
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
                    self.submit(g, scale)
        finally:  # wait for everything in flight, whatever failed, so no buffer is left in use
            self.land(infos, errors)
        self.infos = [infos[g.spec.name] for g in self.groups if g.spec.name in infos]  # group order
        if errors:
            for strategy in self.strategies:  # (additions of groups never stepped must not land in the next sum)
                strategy.discard()
            if all(isinstance(e, NonFinite) for e in errors):  # the daemon refused these groups' steps
                raise NonFinite(
                    f"{len(errors)} of {len(errors) + len(infos)} groups refused by fuyoud, the others stepped: "
                    + " | ".join(str(e) for e in errors)) from errors[0]
            raise errors[0]

    def land(self, infos: dict, errors: list) -> None:
        """Wait for every step in flight and put its new weights into the parameters; each
        group's result goes to ``infos`` (by name), each failure to ``errors``."""
        for g in self.groups:  # (data parallel: the weights gathered from the shards, in group order)
            if g.future is not None:
                g.future = g.strategy.landing(g, g.future)
        for g in self.groups:
            if g.future is not None:
                try:
                    infos[g.spec.name] = g.future.result()
                    if not g.strategy.lands_weights:  # (data parallel: the all-gather put them there)
                        land_new_weights(self.device, g)  # (GPU: the new weights into the parameters)
                except Exception as exc:  # noqa: BLE001 - the caller raises
                    errors.append(exc)
            g.future, g.submitted, g.backwards = None, False, 0
            g.pending = len(g.spec.params)  # (a loop may zero with torch's model.zero_grad() instead of ours)
            guard.release(g.spec.params)  # (the daemon is done with them)
        for strategy in self.strategies:  # steps whose futures a strategy kept
            kept, kept_errors = strategy.reclaim()
            infos.update(kept)
            errors.extend(kept_errors)
        if self.offloader is not None:
            self.offloader.take_back_all()  # (slots lent to steps: every step has landed)

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

    # -- between iterations ---------------------------------------------------------------
    def zero_grad(self) -> None:
        """Forget every gradient (additions discarded mid-accumulation land first)."""
        for strategy in self.strategies:
            strategy.discard()
        for g in self.groups:
            guard.release(g.spec.params)
            g.strategy.zero(g, self.device)
            g.pending, g.backwards = len(g.spec.params), 0

    def busy(self) -> bool:
        """Whether an iteration is under way (gradients counted, steps submitted or in flight)."""
        return any(g.submitted or g.future is not None or g.backwards for g in self.groups)

    def require_idle(self, what: str) -> None:
        if self.busy():
            raise RuntimeError(f"{what} between iterations: call engine.step() first")

    @contextmanager
    def block_major(self, micro_batches: int):
        """Within it (train_step) each group's gradient adds up on the device over
        ``micro_batches`` backwards and goes to its strategy once, after the last."""
        accumulation, self.accumulation_steps = self.accumulation_steps, micro_batches
        self._block_major = True
        try:
            yield
        finally:
            self.accumulation_steps, self._block_major = accumulation, False

    def abandon(self) -> None:
        """A train_step that failed: the steps already sent land, the rest is forgotten."""
        self.land({}, [])  # (the error raised is train_step's own)
        for strategy in self.strategies:
            strategy.discard()
        if self.offloader is not None:
            self.offloader.let_go_all()

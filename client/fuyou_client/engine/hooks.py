"""The hooks attach puts on the user's model, all registered here, in this order:

1. ``load_state_dict`` is refused (it would not reach the master weights in fuyoud).
2. Per trained parameter, a gradient hook (before autograd adds a gradient): the
   offloader makes the group's weights resident first (autograd shapes the gradient after
   the parameter, which must not be an empty placeholder then), then the step
   coordinator checks the group may take it; and a post-accumulate-grad hook: the
   coordinator counts the gradient (the group's step leaves with its last one).
3. Per block, around its forward (also when a block is called directly): the offloader's
   fetch (``enter_forward``) before the activation policy's set-up (saved-tensor hooks:
   offloaded weights become markers, activations are kept or swapped; ``auto``
   profiles), and after it the policy's tear-down after the offloader's release.
4. Per module a sub-block is used by (model/cuts.py), around its forward: the sub-block's
   fetch and release; with gradients on and no block's saved-tensor hooks active (the
   rest's embeddings and head, a block that train_step recomputes), saved-tensor hooks
   for that module's call, so that its weights are saved as markers there too.

The hooks of 3 and 4 are kept out of ``torch.compile``'s graphs (``torch.compiler.disable``):
a compiled model breaks its graph there and runs them as they are, so each block's compute
is compiled with its weights resident (traced, the fetch put empty placeholders in the
graph: an assertion in inductor's generated code).

The activation policy (activations/policy.py) says which blocks swap; a recomputed
block's ``forward`` is the policy's.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from fuyou_client.offload import Saved, SavedCast

GRADIENT_CHECKPOINTING = (
    "the model has Hugging Face gradient checkpointing on (gradient_checkpointing_enable()): it reruns blocks "
    "outside their forward hooks, which fetch offloaded weights. Use attach(activations=\"recompute\") instead "
    "(the same recomputation, weights fetched again), or offload=False")


def hf_checkpointing(model) -> bool:
    """Whether Hugging Face activation (gradient) checkpointing is on."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # (the first: transformers >= 5)
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _refuse_load(*_) -> None:
    raise RuntimeError(
        "load_state_dict() on an attached model would not reach the fp32 master weights in fuyoud (the next "
        "step would start from the old ones): load the weights before attach, resume with attach(model, "
        "resume=DIR), or engine.close() first")


class ModelHooks:
    def __init__(self, model, device, groups, coordinator, offloader, activations, policy, auto):
        self.device, self.coordinator, self.offloader = device, coordinator, offloader
        self.activations, self.policy, self.auto = activations, policy, auto
        blocks = [g for g in groups if g.spec.module is not None]
        self._by_name = {g.spec.name: g for g in blocks}
        self._saved_ctx = None
        self._swap_now = False
        self._current: str | None = None
        self._handles = [model.register_load_state_dict_pre_hook(_refuse_load)]
        for g in groups:
            og = g.offloaded
            for _, p in g.spec.params:
                self._handles.append(p.register_hook(lambda grad, g=g, og=og: self._before_grad(g, og)))
                self._handles.append(p.register_post_accumulate_grad_hook(lambda p, g=g: self._on_grad(g)))
        for g in blocks:
            name, og, module = g.spec.name, g.offloaded, g.spec.module
            self._handles.append(module.register_forward_pre_hook(torch.compiler.disable(
                lambda m, a, k, n=name, og=og: self._enter_forward(n, og, a, k)), with_kwargs=True))
            self._handles.append(module.register_forward_hook(torch.compiler.disable(
                lambda m, a, o, n=name, og=og: self._exit_forward(n, og)), always_call=True))
        self._use_ctx: list = []  # (saved-tensor hooks a sub-block's use entered, innermost last)
        for g in groups:
            if g.offloaded is not None and g.spec.module is None:  # (a sub-block: model/cuts.py)
                for module in g.spec.uses:
                    self._handles.append(module.register_forward_pre_hook(torch.compiler.disable(
                        lambda m, a, og=g.offloaded: self._enter_use(og))))
                    self._handles.append(module.register_forward_hook(torch.compiler.disable(
                        lambda m, a, o, og=g.offloaded: self._exit_use(og)), always_call=True))
        self._ours = {h.id for h in self._handles}  # (told from the user's hooks: foreign)

    # -- gradients -------------------------------------------------------------------------
    def _before_grad(self, g, og) -> None:
        if og is not None:
            self.offloader.gradient_arriving(og)
        self.coordinator.before_grad(g)

    def _on_grad(self, g) -> None:
        if self.auto is not None:
            self.auto.saw_backward()
        self.coordinator.on_grad(g)

    # -- forward ---------------------------------------------------------------------------
    def _enter_forward(self, name: str, og, args, kwargs) -> None:
        if og is not None:
            self.offloader.enter_forward(og)
            if getattr(self._by_name[name].spec.module, "gradient_checkpointing", False):
                raise RuntimeError(GRADIENT_CHECKPOINTING)  # (enabled after attach: transformers >= 5 flags layers)
        if self.auto is not None:
            self.auto.before(name, args, kwargs)
        self._current = name
        self._swap_now = self.policy.swaps(name)
        if torch.is_grad_enabled() and self._saved_ctx is None:
            self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_ctx.__enter__()

    def _exit_forward(self, name: str, og) -> None:
        if og is not None:
            self.offloader.exit_forward(og)
        if self.auto is not None:
            self.auto.after(name)
        self.device.block_done()  # (the CPU: the block's temporaries' heap given back)
        torch.clear_autocast_cache()  # (this thread's casts of the block's weights: see offload.SavedCast)
        self._swap_now = False
        self._current = None
        if self._saved_ctx is not None:
            self._saved_ctx.__exit__(None, None, None)
            self._saved_ctx = None

    def _enter_use(self, og) -> None:
        self.offloader.enter_forward(og)
        ctx = None
        if torch.is_grad_enabled() and self._saved_ctx is None:
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
        self._use_ctx.append(ctx)

    def _exit_use(self, og) -> None:
        ctx = self._use_ctx.pop() if self._use_ctx else None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        self.offloader.exit_forward(og)
        torch.clear_autocast_cache()  # (this thread's casts of the module's weights: see offload.SavedCast)

    def _pack(self, t: torch.Tensor):
        """A block's saved tensor: offloaded weights become markers (offload/), the rest
        are activations, kept or swapped out (activations/)."""
        return self._pack_into(t, self.activations, self._swap_now, profile=self.auto is not None)

    def _pack_into(self, t: torch.Tensor, swapper, swap: bool, profile: bool = False):
        if self.offloader is not None:
            marker = self.offloader.pack(t)
            if marker is not t:
                return marker
        if profile and self._current is not None and swapper.is_activation(t):
            self.auto.saved(self._current, t.numel() * t.element_size())
        return swapper.pack(t, swap)

    def _unpack(self, saved, swapper=None):
        if self.offloader is not None and isinstance(saved, (Saved, SavedCast)):
            return self.offloader.unpack(saved)
        return (swapper or self.activations).unpack(saved)

    @contextmanager
    def saving(self, swapper):
        """train_step's swapped block (blockmajor/swapped.py): what its forward saves for
        backward, offloaded weights as markers and every activation swapped out by
        ``swapper``; the modules a sub-block is used by add no hooks of their own inside."""
        ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack_into(t, swapper, True),
                                                       lambda saved: self._unpack(saved, swapper))
        with ctx:
            self._saved_ctx = ctx
            try:
                yield
            finally:
                self._saved_ctx = None

    def foreign(self, module) -> list[str]:
        """The hooks on ``module`` that are not attach's (the user's, a library's), counted
        by kind: "1 forward pre-hook"."""
        found = []
        for attr, kind in (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
                           ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook")):
            n = sum(1 for key in getattr(module, attr) if key not in self._ours)
            if n:
                found.append(f"{n} {kind}{'s' if n > 1 else ''}")
        return found

    def remove(self) -> None:
        """Every hook off."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

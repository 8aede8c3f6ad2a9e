"""Gradients that are no longer the training loop's to change.

Once a layer group's step has been submitted, fuyoud reads its gradients (on the CPU
straight from the buffer the parameters' ``.grad`` are views of), so a write to them
then, such as ``torch.nn.utils.clip_grad_norm_`` after ``backward()`` in a loop written
for torch (Hugging Face's Trainer does it), either races with the step or is silently
ignored by it: two identical runs end apart. From its submission until the barrier
(``engine.step()``) has waited for it a group's parameters therefore hold their gradients as
``SubmittedGrad``: the same values, readable by any op (norms, logging), but any op that
writes one (in place or as ``out=``) raises a RuntimeError that says what to do instead,
before anything is written. ``release`` gives the plain tensors back.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from fuyou_client.model.blocks import set_grad

WHY = ("was written after its layer group's step went to fuyoud, which reads it (e.g. clip_grad_norm_ after "
       "backward(): the steps leave during backward). Clip with attach(max_grad_norm=...) instead (exact, the steps "
       "then wait for every gradient), or change gradients in a hook before backward is done with their group")


class SubmittedGrad(torch.Tensor):
    """A gradient whose group's step was submitted: read-only (``elem`` is the tensor)."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, what: str):
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                 storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                 device=elem.device, requires_grad=False)
        t.elem, t.what = elem, what
        return t

    def __repr__(self) -> str:
        return f"SubmittedGrad({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            named = dict(zip((a.name for a in schema.arguments), args))
            named.update(kwargs)
            for arg in schema.arguments:
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = named.get(arg.name)
                    guarded = [v for v in (value if isinstance(value, (list, tuple)) else [value])
                               if isinstance(v, SubmittedGrad)]
                    if guarded:
                        raise RuntimeError(f"the gradient of {guarded[0].what} {WHY} ({func.__name__} refused)")
        unwrap = lambda x: x.elem if isinstance(x, SubmittedGrad) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def guard(params, what: str) -> None:
    """Make each parameter's gradient a SubmittedGrad (``what`` names the group)."""
    with torch.no_grad():
        for name, p in params:
            if p.grad is not None and not isinstance(p.grad, SubmittedGrad):
                set_grad(p, SubmittedGrad(p.grad, f"{name} (group {what})"))


def release(params) -> None:
    """The plain gradients back."""
    with torch.no_grad():
        for _, p in params:
            if isinstance(p.grad, SubmittedGrad):
                set_grad(p, p.grad.elem)

"""Exact clipping by the global gradient norm, as ``torch.nn.utils.clip_grad_norm_``.

With ``attach(max_grad_norm=...)`` every gradient is kept until ``engine.step()``, which
computes the norm over all of them (in ``model.parameters()`` order, as torch sums:
the same bits), and each group's step then multiplies its gradients by the coefficient
in the daemon. A non-finite norm steps nothing and names the groups at fault.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fuyou_client.errors import NonFinite
from fuyou_client.model.experts import fused_names


def total_norm(model: nn.Module, groups) -> tuple[list, list, torch.Tensor]:
    """(parameters with a gradient, their norms, the total norm). Gradients a group keeps
    elsewhere than ``.grad`` (summed on the host) are taken from there."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    elsewhere = {id(p): v for g in groups for views in [g.strategy.norm_grads(g)] if views is not None
                 for (_, p), v in zip(g.spec.params, views)}
    if elsewhere:
        grads = [elsewhere.get(id(p), p.grad) for p in params]
    params, grads = [p for p, t in zip(params, grads) if t is not None], [t for t in grads if t is not None]
    params, grads = _joined(model, params, grads)
    plain = iter(torch._foreach_norm([t for t in grads if not isinstance(t, list)], 2.0))
    norms = [torch._foreach_norm([torch.cat(t)], 2.0)[0] if isinstance(t, list) else next(plain) for t in grads]
    return params, norms, torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)


def _joined(model: nn.Module, params: list, grads: list) -> tuple[list, list]:
    """Expert parts' gradients (model/experts.py) joined into their fused tensor's, where
    its first part is (as the uncut model lists it), so that its norm is torch's of the
    whole tensor, bit for bit (the caller joins each, one fused tensor's gradient copied at
    a time): a fused tensor's gradients come as the list of its parts'."""
    rows = fused_names(model)
    if not rows:
        return params, grads
    out_params, out_grads, pieces = [], [], {}
    for p, g in zip(params, grads):
        r = rows.get(id(p))
        if r is None:
            out_params.append(p)
            out_grads.append(g)
        elif r.name not in pieces:
            pieces[r.name] = [g]
            out_params.append(p)
            out_grads.append(pieces[r.name])
        else:
            pieces[r.name].append(g)
    return out_params, out_grads


def coefficient_of(total: torch.Tensor, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient for the total norm ``total`` (a float32
    scalar); exactly 1.0 with ``max_norm=inf``. The formula's one home."""
    return float(torch.clamp(max_norm / (total + 1e-6), max=1.0))


class Clipper:
    """The global gradient norm of one process's groups (the parallelism seam hands the
    step coordinator this one, or data parallelism's, parallel/sharded.py)."""

    def __init__(self, model: nn.Module, groups):
        self.model, self.groups = model, groups

    def total_norm(self) -> float:
        return total_norm(self.model, self.groups)[2].item()

    def coefficient(self, max_norm: float) -> float:
        """The clip coefficient; a non-finite norm raises NonFinite naming the groups whose
        gradients made it so."""
        params, norms, total = total_norm(self.model, self.groups)
        if not math.isfinite(total.item()):
            raise non_finite(self.groups, params, norms, total.item())
        return coefficient_of(total, max_norm)


class NormClipper:
    """A clipper whose norm several processes make together (``total_norm``: data
    parallelism's, parallel/sharded.py; an optimizer host's, parallel/remote.py):
    ``coefficient`` clips with it; a non-finite norm raises NonFinite on every rank."""
    made = ""  # how the norm is made, for the message

    def total_norm(self) -> float:
        raise NotImplementedError

    def coefficient(self, max_norm: float) -> float:
        norm = self.total_norm()
        if not math.isfinite(norm):
            raise NonFinite(f"the total gradient norm is {norm} ({self.made}): some gradient holds NaN or inf, or "
                            "the norm overflows float32; no group was stepped on any rank (the optimizer state is "
                            "unchanged): call engine.zero_grad() and go on with the next batch")
        return coefficient_of(torch.tensor(norm, dtype=torch.float32), max_norm)


def non_finite(groups, params: list, norms: list, total: float) -> NonFinite:
    bad = {id(p) for p, n in zip(params, torch.stack([n.float() for n in norms]).tolist()) if not math.isfinite(n)}
    names = [g.spec.name for g in groups if any(id(p) in bad for _, p in g.spec.params)]
    if names:
        which = ", ".join(map(repr, names))
        cause = f"the gradients of group{'s' if len(names) > 1 else ''} {which} hold NaN or inf"
    elif bad:
        cause = "gradients of parameters outside the groups hold NaN or inf"
    else:
        cause = "every group's gradient norm is finite but their sum of squares overflows float32"
    return NonFinite(f"the total gradient norm is {total}: {cause} (or a norm too large for float32); no group "
                     "was stepped (the optimizer state is unchanged): call engine.zero_grad() and go on with "
                     "the next batch")

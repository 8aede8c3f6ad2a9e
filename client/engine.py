"""`attach(model)`: train an ordinary PyTorch model with its optimizer state on SSD.

    engine = fuyou_client.attach(model, optimizer=fuyou_client.AdamW(lr=1e-4))
    for batch in data:
        loss = model(batch).loss
        loss.backward()          # each group's step starts in fuyoud as soon as its grads are final
        engine.step()            # barrier: every update of this iteration is in the weights
        engine.zero_grad()

Each layer group's parameters and gradients become views of two shared buffers (so
autograd accumulates gradients straight into shared memory and the daemon writes the
new weights straight into the parameters); the fp32 master weights and the AdamW/SGD
moments live only on the SSD array, in the daemon. A post-accumulate-grad hook counts
each group's gradients; when the last one lands during backward, that group's step is
submitted while backward goes on with earlier layers. `engine.step()` waits for all of
them. With `max_grad_norm`, clipping is exact: the steps wait for every gradient (the
norm needs them all), then go out together with the clip coefficient.

This release keeps the (compute-dtype) weights resident in the training process;
offloading them between uses is the next step of the design.
"""
from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from fuyou_client.grouping import ParamGroup, split
from fuyou_client.optim import AdamW, SGD, StepInfo
from fuyou_client.session import Session, connect


class _Optimizer(torch.optim.Optimizer):
    """The engine's face for torch LR schedulers: one param group whose "lr" is read at
    every step. ``step()`` is the engine's barrier."""

    def __init__(self, engine: "Engine", lr: float):
        self._engine = engine
        super().__init__([torch.zeros(0)], {"lr": lr})  # placeholder tensor: the real params live in the daemon

    def step(self, closure=None):  # noqa: D401 - torch's signature
        if closure is not None:
            raise ValueError("closures are not supported by fuyou")
        self._engine.step()

    def zero_grad(self, set_to_none: bool = True):
        self._engine.zero_grad()


@dataclass
class _Group:
    spec: ParamGroup
    weights: object  # SharedBuffer of compute-dtype weights (the parameters are views of it)
    grads: object  # SharedBuffer of gradients (the .grad tensors are views of it)
    dtype: torch.dtype
    pending: int = 0  # gradients still to come in the current backward
    backwards: int = 0  # backward passes completed since the last step (gradient accumulation)
    future: Future | None = None


class Engine:
    def __init__(self, model: nn.Module, session: Session, optimizer: AdamW | SGD, groups: list[ParamGroup],
                 max_grad_norm: float | None, accumulation_steps: int, owns_session: bool):
        self.model = model
        self.session = session
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self._owns_session = owns_session
        self.last_step_infos: list[StepInfo] = []
        self.optimizer = _Optimizer(self, optimizer.lr)
        self.groups: list[_Group] = []
        self._hooks = []
        self._check_capacity(groups, optimizer)
        for spec in groups:
            self.groups.append(self._upload(spec, optimizer))
        for g in self.groups:
            for _, p in g.spec.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, g=g: self._on_grad(g)))
        self.zero_grad()

    # -- set-up ---------------------------------------------------------------------------
    def _check_capacity(self, groups: list[ParamGroup], optimizer) -> None:
        """Fail before any work starts when the SSD array cannot hold the state."""
        slots = 3 if isinstance(optimizer, AdamW) else (2 if optimizer.momentum else 1)
        need = sum(4096 + slots * -(-g.numel * 4 // 4096) * 4096 for g in groups)
        status = self.session.daemon_status
        free = sum(d.capacity_bytes - d.used_bytes for d in status.devices)
        if need * 2 > free:  # a step writes a new version before the old one is freed
            raise RuntimeError(
                f"the SSD array of fuyoud has {free / 2**30:.1f} GiB free but this model's optimizer state "
                f"needs {need / 2**30:.1f} GiB (twice that while a group's new version is written); raise "
                "[storage] capacity_per_device or add data_dirs")

    def _upload(self, spec: ParamGroup, optimizer) -> _Group:
        dtypes = {p.dtype for _, p in spec.params}
        if len(dtypes) != 1:
            raise TypeError(f"group {spec.name} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                            "cast the model to one dtype first")
        dtype = dtypes.pop()
        n = spec.numel
        weights = self.session.allocate(n * dtype.itemsize)
        grads = self.session.allocate(n * dtype.itemsize)
        master = self.session.allocate(n * 4)
        flat_w, flat_m = weights.tensor(dtype)[:n], master.tensor(torch.float32)[:n]
        flat_g = grads.tensor(dtype)[:n]
        offset = 0
        with torch.no_grad():
            for _, p in spec.params:
                k = p.numel()
                flat_m[offset:offset + k].copy_(p.detach().reshape(-1))
                flat_w[offset:offset + k].copy_(p.detach().reshape(-1))
                # From here on the parameter *is* shared memory: the daemon writes updates into it.
                p.data = flat_w[offset:offset + k].view(p.shape)
                p.grad = flat_g[offset:offset + k].view(p.shape)
                offset += k
        self.session.create_group(spec.name, master, optimizer, numel=n)
        master.free()
        return _Group(spec, weights, grads, dtype)

    # -- the training loop ------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.param_groups[0]["lr"] = value

    def _on_grad(self, g: _Group) -> None:
        # Called once per parameter per backward (autograd sums a parameter's uses first).
        g.pending -= 1
        if g.pending:
            return
        g.pending = len(g.spec.params)
        g.backwards += 1
        if g.backwards == self.accumulation_steps and self.max_grad_norm is None and g.future is None:
            self._submit(g)  # final gradients: step now, while backward goes on

    def _submit(self, g: _Group, scale: float | None = None) -> None:
        g.future = self.session.step_group_async(g.spec.name, g.grads, self.lr, grad_dtype=g.dtype, out=g.weights,
                                                 out_dtype=g.dtype, grad_scale=scale)

    def step(self) -> None:
        """The barrier: after it every update of this iteration is in the parameters.
        With ``accumulation_steps=n``, call it after the n-th backward (as with torch)."""
        self.optimizer._opt_called = True  # tells torch's LR schedulers that a step happened
        scale = None
        if self.max_grad_norm is not None:
            scale = self._clip_coefficient()
        for g in self.groups:
            if g.future is None:  # clipping, or a group whose parameters got no gradient this time
                self._submit(g, scale)
        futures = [g.future for g in self.groups]
        for g in self.groups:
            g.future = None
        self.last_step_infos = [f.result() for f in futures]

    def _clip_coefficient(self) -> float:
        """torch.nn.utils.clip_grad_norm_'s coefficient (norm over every gradient)."""
        # In model.parameters() order, as torch.nn.utils.clip_grad_norm_(model.parameters()) sums.
        grads = [p.grad for p in self.model.parameters() if p.requires_grad]
        norms = torch._foreach_norm(grads, 2.0)
        total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
        if not math.isfinite(total.item()):
            raise FloatingPointError(f"the total gradient norm is {total.item()}; not stepping")
        return float(torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0))

    def zero_grad(self) -> None:
        """Zero every gradient (in shared memory: they stay views of it)."""
        for g in self.groups:
            g.grads.tensor(torch.uint8).zero_()
            g.pending, g.backwards = len(g.spec.params), 0

    def state_dict(self) -> dict:
        return {"lr": self.lr, "group_steps": {g.spec.name: self.session.group(g.spec.name).step
                                               for g in self.groups}}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._owns_session:
            self.session.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def attach(model: nn.Module, optimizer: AdamW | SGD | None = None, *, session: Session | None = None,
           socket: str | None = None, namespace: str | None = None, blocks: list[nn.Module] | None = None,
           max_grad_norm: float | None = None, accumulation_steps: int = 1) -> Engine:
    """Hook ``model`` up to fuyoud: its optimizer state moves to the SSD array and each
    layer group is stepped by the daemon as soon as backward has finished it."""
    if accumulation_steps < 1:
        raise ValueError("accumulation_steps must be at least 1")
    groups = split(model, blocks)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    owns = session is None
    session = session or connect(socket, namespace=namespace)
    try:
        return Engine(model, session, optimizer or AdamW(), groups, max_grad_norm, accumulation_steps, owns)
    except BaseException:
        if owns:
            session.close()
        raise

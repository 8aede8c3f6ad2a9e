"""Optimizer arithmetic: exactly torch's fused CPU kernels, on flat fp32 tensors.

The kernels are torch's own (`torch.optim.adamw.adamw(..., fused=True)` and
`torch._fused_sgd_`): the same family as `torch.optim.AdamW(fused=True)` and
`torch.optim.SGD(fused=True)`, with the same step counting, decoupled weight decay and
bias correction (measured on the project's machine: fused AdamW reaches 97% of the
memory-bandwidth floor, the foreach path 18%, the single-tensor path 11%). All of these
optimizers are elementwise, but torch's kernels round a tensor's last few elements in
another loop: a group's elements are stepped as the tensors they are where the client
says which (tensors.py), as one flat tensor where it does not. AdamW's moments may be kept in bf16 or
int8 (``state_dtype``: lowp.py), the master weights are always fp32.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch.optim.adamw import adamw as _adamw

from fuyoud.errors import InvalidArgument
from fuyoud.optimizer import lowp, tensors
from fuyoud.optimizer.layout import Layout, Slot, slots_for
from fuyoud.optimizer.tensors import Piece
from fuyoud.sessions.names import shown
from fuyou_proto.contract import STATE_DTYPES


@dataclass(frozen=True)
class OptimizerSpec:
    kind: str  # "adamw" | "sgd"
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    state_dtype: str = "fp32"  # of AdamW's moments: "fp32", "bf16" or "int8"

    def __post_init__(self) -> None:
        """Every hyperparameter checked here, in the daemon: a NaN or infinite one would
        turn the master weights into NaN at the first step (and commit them)."""
        if self.kind not in ("adamw", "sgd"):
            raise InvalidArgument(f"unknown optimizer {shown(self.kind)} (adamw or sgd)")
        for name in ("beta1", "beta2", "eps", "weight_decay", "momentum", "dampening"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidArgument(f"optimizer {name} must be a finite number, got {value!r}")
        if self.kind == "adamw" and not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise InvalidArgument(f"betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        for name in ("eps", "weight_decay", "momentum", "dampening"):  # (torch does not bound dampening above)
            if getattr(self, name) < 0:
                raise InvalidArgument(f"optimizer {name} must not be negative, got {getattr(self, name)!r}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgument("Nesterov momentum requires a momentum and zero dampening")
        if self.state_dtype not in STATE_DTYPES:
            raise InvalidArgument(f"state_dtype {shown(self.state_dtype)} is not one of {', '.join(STATE_DTYPES)}")
        if self.kind == "sgd" and self.state_dtype != "fp32":
            raise InvalidArgument(f"SGD keeps its state in fp32 (state_dtype {self.state_dtype!r} is for AdamW)")

    def slot_list(self) -> tuple[Slot, ...]:
        kind = "sgd+momentum" if self.kind == "sgd" and self.momentum else self.kind
        return slots_for(kind, self.state_dtype)

    def layout(self, numel: int) -> Layout:
        """Where the state's tensors of a group of ``numel`` parameters lie (layout.py)."""
        return Layout(self.slot_list(), numel)

    # Version 1 (fp32 state only) is still read: objects and checkpoints written before
    # state_dtype existed. Version 2 adds the state dtype's index in STATE_DTYPES.
    _FORMAT = "<8sQQ7dQ"  # magic, numel, step, 7 hyperparameters, nesterov
    _FORMAT2 = _FORMAT + "Q"
    _MAGIC = b"FYOPT001"
    _MAGIC2 = b"FYOPT002"

    def header(self, numel: int, step: int) -> bytes:
        fields = (numel, step, float(self.kind == "sgd"), self.beta1, self.beta2, self.eps, self.weight_decay,
                  self.momentum, self.dampening, int(self.nesterov))
        if self.state_dtype == "fp32":  # readable by daemons that predate state_dtype
            return struct.pack(self._FORMAT, self._MAGIC, *fields)
        return struct.pack(self._FORMAT2, self._MAGIC2, *fields, STATE_DTYPES.index(self.state_dtype))

    @classmethod
    def parse_header(cls, data: bytes) -> tuple["OptimizerSpec", int, int]:
        """(spec, numel, step) from a state object's header; ValueError if it is none."""
        magic = bytes(data[:8])
        if magic == cls._MAGIC:
            state_dtype = 0
        elif magic == cls._MAGIC2:
            state_dtype = struct.unpack_from("<Q", data, struct.calcsize(cls._FORMAT))[0]
            if state_dtype >= len(STATE_DTYPES):
                raise ValueError(f"unknown state dtype {state_dtype} in an optimizer state header")
        else:
            raise ValueError("not an optimizer state object")
        _, numel, step, is_sgd, b1, b2, eps, wd, mom, damp, nest = struct.unpack_from(cls._FORMAT, data)
        try:
            spec = cls("sgd" if is_sgd else "adamw", b1, b2, eps, wd, mom, damp, bool(nest),
                       STATE_DTYPES[state_dtype])
        except InvalidArgument as exc:
            raise ValueError(f"an optimizer state header with impossible settings: {exc}") from None
        return spec, numel, step

    def to_dict(self) -> dict:
        return asdict(self)


def step(spec: OptimizerSpec, step_count: int, slots: list[torch.Tensor], grad: torch.Tensor, lr: float,
         scratch: lowp.Scratch | None = None, pieces: Sequence[Piece] = ()) -> None:
    """One optimizer step in place. ``slots`` are the state's tensors in the layout's
    order (fp32 weights first), ``step_count`` the number of steps taken before this one;
    reduced-precision state needs ``scratch`` (one per concurrent caller). ``pieces``: the
    tensors behind the elements (tensors.py), each element then stepped in the loop
    torch.optim steps it in (fp32 state); none: one tensor."""
    if spec.kind == "adamw" and spec.state_dtype != "fp32":
        lowp.adamw_step(spec.state_dtype, step_count, slots, grad, lr, spec.beta1, spec.beta2, spec.eps,
                        spec.weight_decay, scratch if scratch is not None else lowp.Scratch())
        return
    width = tensors.vector_width() if len(pieces) > 1 or (pieces and pieces[0] != (grad.numel(), 0, grad.numel())) \
        else None
    runs = tensors.lists(slots, grad, pieces, width) if width else tensors.Lists([[s] for s in slots], [grad])
    if spec.kind == "adamw":
        weights, exp_avg, exp_avg_sq = runs.slots
        steps = [torch.tensor(float(step_count)) for _ in weights]  # (the functional API increments them)
        _adamw(weights, runs.grads, exp_avg, exp_avg_sq, [], steps, fused=True, amsgrad=False,
               beta1=spec.beta1, beta2=spec.beta2, lr=lr, weight_decay=spec.weight_decay, eps=spec.eps,
               maximize=False)
    else:
        torch._fused_sgd_(runs.slots[0], runs.grads, runs.slots[1] if spec.momentum else [],
                          weight_decay=spec.weight_decay, momentum=spec.momentum, lr=lr, dampening=spec.dampening,
                          nesterov=spec.nesterov, maximize=False, is_first_step=step_count == 0)
    runs.done()


def all_finite(t: torch.Tensor, parts: Sequence[torch.Tensor] | None = None) -> bool:
    """Whether every element is finite (no NaN, no infinity).

    One summation decides in the usual case: a finite sum means every element is finite
    (a NaN or an infinity makes the sum NaN or infinite whatever else is added). Only a
    non-finite sum, which large finite values can also give by overflowing, is checked
    exactly, element by element: on ``parts`` where given (the tensors that matter inside
    ``t``, e.g. a state's slots without the padding between them), else on ``t``."""
    if t.numel() == 0 or math.isfinite(t.sum().item()):
        return True
    return all(bool(torch.isfinite(p).all()) for p in (parts if parts is not None else [t]))

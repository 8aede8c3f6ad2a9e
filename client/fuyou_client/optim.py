"""Client side of the daemon's out-of-core optimizer: specs and group handles.

    group = session.create_group("block3", weights_buf, AdamW(lr=1e-4, weight_decay=0.1))
    fut = session.step_group_async("block3", grads_buf, lr=sched_lr, out=weights_buf)
    ...                                            # backward goes on meanwhile
    fut.result()                                   # the update is visible in weights_buf
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from fuyou_client.errors import InvalidArgument
from fuyou_proto import pb, state_dtype_name, state_dtype_value
from fuyou_proto.contract import STATE_DTYPES, state_object_bytes

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_number(owner: str, name: str, value, below: float | None = None) -> None:
    """``value`` a finite number >= 0 (and < ``below`` where given), else InvalidArgument
    (a ValueError) naming the field: the daemon refuses the same, this says it sooner."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidArgument(f"{owner}: {name} must be a finite number, got {value!r}")
    if value < 0 or (below is not None and value >= below):
        bound = f"in [0, {below:g})" if below is not None else ">= 0"
        raise InvalidArgument(f"{owner}: {name} must be {bound}, got {value!r}")




@dataclass(frozen=True)
class AdamW:
    """Same meaning and defaults as torch.optim.AdamW (amsgrad and maximize unsupported).
    ``lr`` is only the default: each step names its own learning rate.

    ``state_dtype`` is what the moments are kept in on the SSD (the master weights are
    always fp32): ``"fp32"``, exactly torch's fused AdamW, 24 bytes per parameter read
    and written per step; ``"bf16"``, 16 bytes; ``"int8"``, block-wise 8-bit moments,
    about 12 bytes (the arithmetic: fuyoud/optimizer/lowp.py; the quality measured:
    docs/guide/state-dtype.md)."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    state_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.state_dtype not in STATE_DTYPES:
            raise InvalidArgument(f"AdamW: state_dtype must be one of {', '.join(STATE_DTYPES)}, "
                                  f"got {self.state_dtype!r}")
        check_number("AdamW", "lr", self.lr)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise InvalidArgument(f"AdamW: betas must be a pair (beta1, beta2), got {self.betas!r}")
        for i, beta in enumerate(self.betas):
            check_number("AdamW", f"betas[{i}]", beta, below=1.0)
        check_number("AdamW", "eps", self.eps)
        check_number("AdamW", "weight_decay", self.weight_decay)

    def to_pb(self) -> pb.OptimizerSpec:
        return pb.OptimizerSpec(kind=self.state_kind, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                                weight_decay=self.weight_decay,
                                state_dtype=state_dtype_value(self.state_dtype))

    @property
    def state_kind(self) -> str:
        """The layout of its state object (fuyou_proto.contract.STATE_SLOTS' key, with the state dtype)."""
        return "adamw"

    def state_bytes(self, numel: int) -> int:
        """Bytes of a group's state on the SSD array."""
        return state_object_bytes(self.state_kind, self.state_dtype, numel)


@dataclass(frozen=True)
class SGD:
    """Same meaning and defaults as torch.optim.SGD (maximize unsupported)."""
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "momentum", "dampening", "weight_decay"):  # (torch does not bound dampening above)
            check_number("SGD", name, getattr(self, name))
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgument("SGD: Nesterov momentum requires a momentum and zero dampening")

    def to_pb(self) -> pb.OptimizerSpec:
        return pb.OptimizerSpec(kind="sgd", momentum=self.momentum, dampening=self.dampening,
                                weight_decay=self.weight_decay, nesterov=self.nesterov, state_dtype=pb.STATE_FP32)

    state_dtype = "fp32"

    @property
    def state_kind(self) -> str:
        """The layout of its state object (fuyou_proto.contract.STATE_SLOTS' key, with the state dtype)."""
        return "sgd+momentum" if self.momentum else "sgd"

    def state_bytes(self, numel: int) -> int:
        """Bytes of a group's state on the SSD array."""
        return state_object_bytes(self.state_kind, self.state_dtype, numel)


@dataclass(frozen=True)
class GroupInfo:
    name: str
    numel: int
    step: int
    state_bytes: int
    optimizer: AdamW | SGD
    weights_offset: int  # of the fp32 master weights in the state object "optim/<name>"
    chunked: bool = False  # the daemon steps it in chunks (its state does not fit one optimizer buffer)

    @classmethod
    def from_pb(cls, m: pb.GroupInfo) -> "GroupInfo":
        o = m.optimizer
        spec = (AdamW(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                      state_dtype=state_dtype_name(o.state_dtype)) if o.kind == "adamw"
                else SGD(momentum=o.momentum, dampening=o.dampening, weight_decay=o.weight_decay, nesterov=o.nesterov))
        return cls(m.name, m.numel, m.step, m.state_bytes, spec, m.weights_offset, m.chunked)


@dataclass(frozen=True)
class StepInfo:
    step: int
    read_seconds: float
    compute_seconds: float
    write_seconds: float
    prefetched: bool
    cached_bytes: int = 0  # state bytes the daemon's state cache had: not read from the SSD
    masters_bytes: int = 0  # master-weight bytes the step took from the client's buffer: not read from the SSD

    @classmethod
    def from_pb(cls, m: pb.StepGroupReply) -> "StepInfo":
        return cls(m.step, m.read_seconds, m.compute_seconds, m.write_seconds, m.prefetched, m.cached_bytes,
                   m.masters_bytes)

    @classmethod
    def combine(cls, infos: list["StepInfo"]) -> "StepInfo":
        """The steps of a layer group's parts as one: seconds and bytes summed."""
        if len(infos) == 1:
            return infos[0]
        return cls(max(i.step for i in infos), sum(i.read_seconds for i in infos),
                   sum(i.compute_seconds for i in infos), sum(i.write_seconds for i in infos),
                   all(i.prefetched for i in infos), sum(i.cached_bytes for i in infos),
                   sum(i.masters_bytes for i in infos))

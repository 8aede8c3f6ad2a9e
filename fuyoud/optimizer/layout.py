"""Where each tensor of a group's optimizer state lies in its state object.

    [4 KiB header] [slot 0: fp32 master weights] [slot 1] [slot 2] ...

every slot 4 KiB aligned, its padding zero. The slots depend on the optimizer and its
state dtype (kernels.OptimizerSpec.state_dtype):

    adamw fp32   weights f32 | exp_avg f32  | exp_avg_sq f32                      12 B/param
    adamw bf16   weights f32 | exp_avg bf16 | exp_avg_sq bf16                       8 B/param
    adamw int8   weights f32 | exp_avg int8 | exp_avg_sq uint8 | scales f32 x 2  6.03 B/param
    sgd          weights f32 [| momentum f32]

A slot holds one element per parameter, or (``per`` > 1) one per block of ``per``
parameters: the int8 moments' scales, one per QBLOCK parameters. The master weights are
always fp32 and always first (at HEADER): clients read them there, for export and resume.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from fuyoud.units import align_up

HEADER = 4096
QBLOCK = 256  # parameters per scale of the int8 moments


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: torch.dtype
    per: int = 1  # parameters per element

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def count(self, numel: int) -> int:
        """Elements of this slot for ``numel`` parameters."""
        return -(-numel // self.per)


_SLOTS = {
    ("adamw", "fp32"): (Slot("weights", torch.float32), Slot("exp_avg", torch.float32),
                        Slot("exp_avg_sq", torch.float32)),
    ("adamw", "bf16"): (Slot("weights", torch.float32), Slot("exp_avg", torch.bfloat16),
                        Slot("exp_avg_sq", torch.bfloat16)),
    ("adamw", "int8"): (Slot("weights", torch.float32), Slot("exp_avg", torch.int8), Slot("exp_avg_sq", torch.uint8),
                        Slot("exp_avg_scale", torch.float32, QBLOCK), Slot("exp_avg_sq_scale", torch.float32, QBLOCK)),
    ("sgd", "fp32"): (Slot("weights", torch.float32),),
    ("sgd+momentum", "fp32"): (Slot("weights", torch.float32), Slot("momentum", torch.float32)),
}


def slots_for(kind: str, state_dtype: str) -> tuple[Slot, ...] | None:
    """The slots of an optimizer kind ("adamw", "sgd", "sgd+momentum") in a state dtype,
    or None if that pair has no layout."""
    return _SLOTS.get((kind, state_dtype))


@dataclass(frozen=True)
class Layout:
    slots: tuple[Slot, ...]
    numel: int

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], HEADER
        for s in self.slots:
            out.append(at)
            at += self.slot_bytes(s)
        return tuple(out)

    def slot_bytes(self, slot: Slot) -> int:
        """A slot's bytes in the object, its padding included."""
        return align_up(slot.count(self.numel) * slot.itemsize, 4096)

    @property
    def size(self) -> int:
        """The state object's bytes."""
        return self.offsets[-1] + self.slot_bytes(self.slots[-1])

    @property
    def bytes_per_param(self) -> float:
        """State bytes per parameter, padding aside (what a step reads and writes once)."""
        return sum(s.itemsize / s.per for s in self.slots)

    def tensors(self, state: memoryview) -> list[torch.Tensor]:
        """Each slot's elements as a tensor of its dtype, over the object's bytes ``state``."""
        out = []
        for s, off in zip(self.slots, self.offsets):
            n = s.count(self.numel) * s.itemsize
            out.append(torch.frombuffer(state[off:off + n], dtype=s.dtype))
        return out

    def floating(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The slots that can hold a NaN or an infinity (the int8 codes cannot)."""
        return [t for t in tensors if t.is_floating_point()]

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

from fuyou_proto.contract import HEADER, QBLOCK, STATE_SLOTS, slot_bytes

__all__ = ["HEADER", "QBLOCK", "Slot", "Layout", "slots_for"]


@dataclass(frozen=True)
class Slot:
    name: str
    dtype_name: str  # "float32", "bfloat16", "int8", "uint8"
    per: int = 1  # parameters per element

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def count(self, numel: int) -> int:
        """Elements of this slot for ``numel`` parameters."""
        return -(-numel // self.per)


def slots_for(kind: str, state_dtype: str) -> tuple[Slot, ...] | None:
    """The slots of an optimizer kind ("adamw", "sgd", "sgd+momentum") in a state dtype
    (fuyou_proto.contract.STATE_SLOTS), or None if that pair has no layout."""
    slots = STATE_SLOTS.get((kind, state_dtype))
    return None if slots is None else tuple(Slot(*slot) for slot in slots)


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
        return slot_bytes(slot.dtype_name, slot.per, self.numel)

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

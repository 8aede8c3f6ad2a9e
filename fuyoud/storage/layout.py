"""Where an object's bytes live: striping over the devices of the array.

An object of ``size`` bytes is cut into stripe units of ``stripe`` bytes; unit k lives
on extent ``k % n`` at ``(k // n) * stripe`` into that extent. Small objects (one unit)
take a single extent. No RAID: the array's bandwidth is the sum of its devices'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from fuyou_proto.contract import PAGE as BLOCK



@dataclass(frozen=True, slots=True)
class Extent:
    device: int
    offset: int
    length: int  # bytes reserved on the device (a multiple of BLOCK)


@dataclass(frozen=True, slots=True)
class Piece:
    device: int
    device_offset: int
    object_offset: int
    length: int


@dataclass(frozen=True)
class Layout:
    size: int
    stripe: int
    extents: tuple[Extent, ...]

    def pieces(self, start: int, length: int, max_piece: int) -> Iterator[Piece]:
        """The device ranges that hold object bytes [start, start+length), in object order,
        none longer than ``max_piece`` and none crossing a stripe unit."""
        n = len(self.extents)
        pos, end = start, start + length
        while pos < end:
            unit, within = divmod(pos, self.stripe)
            ext = self.extents[unit % n]
            take = min(end - pos, self.stripe - within, max_piece)
            yield Piece(ext.device, ext.offset + (unit // n) * self.stripe + within, pos, take)
            pos += take

    def to_json(self) -> dict:
        return {"stripe": self.stripe, "extents": [[e.device, e.offset, e.length] for e in self.extents]}

    @classmethod
    def from_json(cls, size: int, data: dict) -> "Layout":
        return cls(size, data["stripe"], tuple(Extent(*e) for e in data["extents"]))


def extent_lengths(size: int, stripe: int, n: int) -> list[int]:
    """Bytes each of ``n`` extents must hold for an object of ``size`` striped by ``stripe``."""
    units = max(1, -(-size // stripe))
    n = min(n, units)
    lengths = [0] * n
    for k in range(units):
        lengths[k % n] += min(stripe, size - k * stripe) if size else 0
    return [max(BLOCK, -(-b // BLOCK) * BLOCK) for b in lengths]

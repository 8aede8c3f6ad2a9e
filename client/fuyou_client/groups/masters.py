"""A layer group's fp32 master weights, read from its parts' optimizer state objects on
the SSD array (the first slot of each: ``fuyou_proto.contract``): on resume, where the
parameters take them, and for export, streamed through a bounded buffer.
"""
from __future__ import annotations

import torch

from fuyou_proto.contract import state_object

from fuyou_client.connection.session import In, Session
from fuyou_client.memory.budget import EXPORT_PIECE
from fuyou_client.model.blocks import GroupSpec


def _check_sizes(spec: GroupSpec, infos) -> None:
    for part, info in zip(spec.parts, infos):
        if info.numel != part.numel:
            raise ValueError(f"group {part.name} has {info.numel} parameters in the daemon, {part.numel} in this "
                             "model: the checkpoint is of another model (or its parameters were grouped otherwise: "
                             "the same param_groups)")


def read_masters(session: Session, spec: GroupSpec):
    """A layer group's fp32 master weights, from its parts' state objects on the SSD
    array, into a new shared buffer (the caller frees it): (buffer, each part's GroupInfo)."""
    infos = [session.group(part.name) for part in spec.parts]
    _check_sizes(spec, infos)
    buf = session.allocate(spec.numel * 4)
    try:
        session.swap_in_many([In(state_object(part.name), buf, part.start * 4, part.numel * 4, info.weights_offset)
                              for part, info in zip(spec.parts, infos)])
    except BaseException:
        buf.free()
        raise
    return buf, infos


def read_masters_into(session: Session, spec: GroupSpec, out: list[torch.Tensor],
                      piece: int = EXPORT_PIECE) -> None:
    """A layer group's fp32 master weights into ``out`` (one tensor per trained parameter,
    in the group's order, of any dtype: cast as they are copied), read from the SSD array
    through one shared buffer of at most ``piece`` bytes: export holds no more pinned
    memory than that, whatever the group's size."""
    infos = {part.name: session.group(part.name) for part in spec.parts}
    _check_sizes(spec, infos.values())
    buf = session.allocate(min(piece, spec.numel * 4))
    per, at = buf.size // 4, 0
    try:
        for t in out:
            flat, done = t.view(-1), 0
            while done < flat.numel():
                part = next(p for p in spec.parts if p.start <= at < p.start + p.numel)
                n = min(per, flat.numel() - done, part.start + part.numel - at)
                session.swap_in(state_object(part.name), buf, length=n * 4,
                                object_offset=infos[part.name].weights_offset + (at - part.start) * 4)
                flat[done:done + n].copy_(buf.tensor(torch.float32)[:n])
                done, at = done + n, at + n
    finally:
        buf.free()

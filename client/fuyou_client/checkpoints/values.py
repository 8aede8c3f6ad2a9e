"""The values of a layer group's parameters, read from the SSD array: what an offloaded
block holds between its uses, where memory has only empty placeholders.

A trained parameter's value is its fp32 master weight, cast to the parameter's dtype (as
every step casts it for the next forward); a frozen one of an offloaded block is read
from the object it was stored in at attach. One layer group at a time: ``export``
(exporter.py) streams them to files, ``state_dict()`` and ``engine.gathered()``
(engine/trained_values.py) put them in memory.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from fuyou_client.connection.session import Session
from fuyou_client.groups.masters import read_masters_into
from fuyou_client.model.blocks import flat_parts


def group_params(g) -> list[nn.Parameter]:
    """A layer group's parameters in its layout's order: the trained ones, then (an
    offloaded block's) the frozen ones."""
    return list(g.offloaded.params) if g.offloaded is not None else [p for _, p in g.spec.params]


def group_shapes(g) -> list[torch.Size]:
    """Their shapes (an offloaded parameter's own is an empty placeholder between uses)."""
    return list(g.offloaded.shapes) if g.offloaded is not None else [p.shape for _, p in g.spec.params]


def read_group(session: Session, g, dtype: torch.dtype | None = None, masters=None,
               frozen: bool = True, trained: bool = True) -> list[torch.Tensor]:
    """New CPU tensors holding the values of ``group_params(g)``, in that order (``frozen``
    False: the trained ones only; ``trained`` False: the frozen ones only): the trained ones from their fp32 masters (``masters(session,
    spec)``, data parallelism: the gathered flat masters; default: read from this session's
    state objects), the frozen ones of an offloaded block from the object they were stored
    in. ``dtype``: default, the group's."""
    shapes = group_shapes(g)
    trained = shapes[:len(g.spec.params)]
    if not g.spec.numel or not trained:
        out = []
    elif masters is None:
        out = [torch.empty(shape, dtype=dtype or g.dtype) for shape in trained]
        read_masters_into(session, g.spec, out)
    else:
        flat = masters(session, g.spec)[:g.spec.numel]
        out = [part.view(shape).to(dtype or g.dtype, copy=True) for shape, part in zip(trained, flat_parts(flat, trained))]
    stored = g.offloaded.params[len(g.spec.params):] if g.offloaded is not None else []
    if frozen and stored:
        source = next(s for s in g.offloaded.sources if not s.part)  # (frozen/<group>: no optimizer group)
        buf = session.allocate(source.length)
        try:
            session.swap_in(source.object, buf, length=source.length)
            flat = buf.tensor(g.dtype)[:source.length // g.dtype.itemsize]
            fshapes = shapes[len(g.spec.params):]
            out += [part.view(shape).to(dtype or g.dtype, copy=True) for shape, part in zip(fshapes, flat_parts(flat, fshapes))]
        finally:
            buf.free()
    return out


def group_bytes(g, frozen: bool = True) -> int:
    """The bytes ``read_group`` puts in memory for the group."""
    shapes = group_shapes(g)
    if not frozen:
        shapes = shapes[:len(g.spec.params)]
    return sum(s.numel() for s in shapes) * g.dtype.itemsize


def host_memory_available() -> int:
    """Bytes this process may still put in host memory: the kernel's MemAvailable, and
    within a cgroup (a container, a systemd unit) with a memory limit what is left of it."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    left = _cgroup_left()
    values = [v for v in (available, left) if v is not None]
    return min(values) if values else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_left() -> int | None:
    """What the memory limit of this process's cgroup (v2) leaves, or None without one."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        root = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(root, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(root, "memory.current")) as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None

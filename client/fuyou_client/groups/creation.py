"""Creating a layer group: its optimizer state in the daemon (created from the
parameters, or restored), its weights where the placement rule (placement.py) puts them,
its parameters and gradients pointed at that memory.
"""
from __future__ import annotations

from concurrent.futures import Future

import torch

from fuyou_proto.contract import HEADER, state_object

from fuyou_client.connection.session import Out, Session, all_of
from fuyou_client.device import Device
from fuyou_client.gradients.strategy import GradientStrategy
from fuyou_client.groups.layer_group import LayerGroup, flat_copy
from fuyou_client.groups.masters import read_masters
from fuyou_client.groups.placement import frozen_object, weights_in_state, weights_object, weights_rewritten
from fuyou_client.model.blocks import GroupSpec, flat_parts
from fuyou_client.offload.group import OffloadedGroup, Source


class Scratch:
    """The shared buffer attach makes the groups' optimizer state from, reused group after
    group (allocating a segment per group cost about a second each on a 7B model): the
    daemon writes one group's state from it (``create_group_async``) while the next
    group's values are made in the process's own memory; they are copied in once that
    write is done. (A second buffer would overlap the copy too, for one more block's
    memory at attach.)"""

    def __init__(self, session: Session, nbytes: int, count: int = 1):
        self._free = [session.allocate(nbytes) for _ in range(count)]
        self._busy: list[tuple[Future, object]] = []

    def take(self):
        """A buffer no create reads any more (waits for the oldest otherwise; a create that
        failed is raised here, so attach stops at the first group the daemon refused)."""
        if not self._free:
            created, buf = self._busy.pop(0)
            self._free.append(buf)
            error = created.exception()  # (waits)
            if error is not None:
                raise error
        return self._free.pop(0)

    def lend(self, buf, created: Future | None) -> None:
        """``buf`` is read by the create of ``created`` until it is done."""
        if created is None:
            self._free.append(buf)
        else:
            self._busy.append((created, buf))

    def close(self) -> None:
        """Wait for every create, free the buffers."""
        for created, buf in self._busy:
            created.exception()
            self._free.append(buf)
        self._busy.clear()
        for buf in self._free:
            buf.free()
        self._free.clear()


def create(session: Session, device: Device, spec: GroupSpec, optimizers: list, offload: bool | str, index: int,
           strategy: GradientStrategy, resume: bool, shards=None, scratch=None, stateless: bool = False) -> LayerGroup:
    """Create the group's optimizer state in the daemon from the parameters, one daemon
    group per part with ``optimizers[k]`` (its torch group's hyperparameters), or with
    ``resume`` take the restored groups' weights; then the parameters become views of
    shared memory or of one device allocation (resident) or empty (offloaded: to the SSD
    array, or with ``offload="host"`` in a shared host buffer the step writes, uploaded
    per use), and their gradients views of the buffer ``strategy`` keeps (if any). An
    offloaded block's frozen parameters go to the SSD array too, after its trained ones
    (the transient object ``frozen/<group>``, written once, read with the rest).

    With data parallelism (``shards``: parallel.Shards) the daemon's groups are this
    rank's shard of each part (``resume``: restored ones, whose masters the caller put in
    the parameters), and the flat weights and gradients are padded to the shards' sum.

    ``scratch`` (a shared buffer of at least the group's fp32 bytes): the masters go there
    and the daemon creates the state without the call waiting (``group.created``, a future
    of the parts' GroupInfos: ``settle`` it before training); the caller leaves the buffer
    alone until then.

    ``stateless`` (an optimizer-host worker, parallel/remote.py): no state in this
    process's daemon; resident weights are kept here, offloaded ones are nowhere between
    uses (each fetch brings them from the optimizer rank that owns the group)."""
    frozen = [p for _, p in spec.frozen] if offload is True else []
    if frozen and stateless:
        raise ValueError(f"block {spec.name} has frozen parameters: offloading them on an optimizer-host worker is "
                         "not built yet; attach with offload=False")
    dtype = _one_dtype(spec, frozen)
    n = spec.numel
    params = [p for _, p in spec.params]
    shapes, frozen_shapes = [p.shape for p in params], [p.shape for p in frozen]  # (before they are emptied)
    created = None
    if stateless:
        master, infos = None, [None] * len(spec.parts)
        pieces = [(part, part.start, part.start + part.numel) for part in spec.parts]
    elif shards is None:
        master, infos = _masters(session, spec, optimizers, resume, scratch)
        if isinstance(infos, Future):  # (created while the caller goes on: the masters' offset is the layout's)
            created, infos = infos, [None] * len(spec.parts)
        pieces = [(part, part.start, part.start + part.numel) for part in spec.parts]
    else:  # (data parallel: this rank's shard of each part)
        if frozen:
            raise ValueError(f"block {spec.name} has frozen parameters: offloading them with data parallelism is not "
                             "built yet; attach with offload=False")
        master, infos = _shard_masters(session, spec, optimizers, shards, resume)
        pieces = shards.pieces(spec.parts)
    grad_bytes = strategy.host_buffer_bytes(n, dtype) if n else 0
    grads = session.allocate(grad_bytes) if grad_bytes else None
    padded = shards.padded if shards is not None else n
    weights, sources = (None, []) if stateless and offload else \
        _weights_home(session, device, params, dtype, offload, pieces, infos, padded)
    if master is not None:
        master.free()
    if frozen:
        sources.append(_store_frozen(session, spec.name, frozen, spec.frozen_numel, dtype, n * dtype.itemsize))
    group = LayerGroup(spec, weights, grads, dtype, strategy=strategy, shard_padded=padded if shards else 0,
                       chunked=frozenset(info.name for info in infos if info is not None and info.chunked),
                       created=created)
    _point_parameters(group, device, params, shapes, frozen, offload, padded)
    if offload:
        group.offloaded = OffloadedGroup(index, spec.name, spec.uses, params + frozen, dtype, sources,
                                         padded + (spec.frozen_numel if frozen else 0), shapes=shapes + frozen_shapes,
                                         host=weights if offload == "host" else None)
    return group


def _one_dtype(spec: GroupSpec, frozen: list) -> torch.dtype:
    dtypes = {p.dtype for _, p in spec.params} | {p.dtype for p in frozen}
    if len(dtypes) != 1:
        raise TypeError(f"group {spec.name} mixes parameter dtypes {sorted(map(str, dtypes))}"
                        f"{' (its frozen ones included: they are offloaded with it)' if frozen else ''}; cast the "
                        "model to one dtype first")
    return dtypes.pop()


def _weights_home(session: Session, device: Device, params: list, dtype: torch.dtype, offload: bool | str,
                  pieces: list, infos: list, padded: int):
    """Where the group's compute weights live between steps (groups/placement.py): (the
    shared buffer the step writes, or None; the sources an offloaded group is fetched from)."""
    n, size = sum(p.numel() for p in params), dtype.itemsize
    if not n:
        return None, []
    if weights_in_state(offload, dtype):  # the compute weights are the masters: read in place
        return None, [Source(state_object(part.name), info.weights_offset if info is not None else HEADER, lo * 4,
                             (hi - lo) * 4, part.name) for (part, lo, hi), info in zip(pieces, infos)]
    weights = session.allocate(padded * size)
    if offload or device.shares_host_memory:  # (a GPU's resident group: the step fills it, nothing reads it now)
        flat_copy(params, weights.tensor(dtype)[:n])
    if not weights_rewritten(offload, dtype):
        return weights, []
    sources = [Source(weights_object(part.name), 0, lo * size, (hi - lo) * size, part.name) for part, lo, hi in pieces]
    session.swap_out_many([Out(s.object, weights, s.offset, s.length) for s in sources])
    weights.free()
    return None, sources


def _point_parameters(group: LayerGroup, device: Device, params: list, shapes: list, frozen: list,
                      offload: bool | str, padded: int) -> None:
    """From here on each parameter *is* shared memory (the daemon writes updates into it),
    a slice of the group's device allocation, or empty until the offloader fetches it;
    its gradient a view of the gradient buffer, if the strategy keeps one."""
    dtype, n, weights, grads = group.dtype, group.numel, group.weights, group.grads
    if device.shares_host_memory:  # (offload="host" does not come here: on the CPU it is resident)
        flat_w = weights.tensor(dtype)[:n] if weights is not None else None
        flat_g = grads.tensor(dtype)[:n] if grads is not None else None
    else:
        flat_w = None
        if weights is not None and not offload:
            flat_w = group.device_weights = device.empty(padded * dtype.itemsize).view(dtype)
            flat_copy(params, flat_w[:n])
        flat_g = group.device_grads = device.empty(padded * dtype.itemsize).view(dtype) \
            if grads is not None and group.strategy.keeps_device_grads() else None
    grad_parts = flat_parts(flat_g[:n], shapes) if flat_g is not None else [None] * len(params)
    weight_parts = flat_parts(flat_w[:n], shapes) if flat_w is not None else [None] * len(params)
    empty = torch.empty(0, dtype=dtype, device=device.torch_device)
    with torch.no_grad():
        for p, shape, g, w in zip(params, shapes, grad_parts, weight_parts):
            if g is not None and p.device != g.device:
                # (a model built on the meta device comes as CPU stand-ins: a gradient on the
                # compute device needs a tensor there of the parameter's shape; one element, expanded)
                p.data = empty.new_empty(()).expand(shape)
            p.grad = g.view(shape) if g is not None else None  # (p has its shape)
            p.data = w.view(shape) if w is not None else empty
        for p in frozen:
            p.data = empty


def _masters(session: Session, spec: GroupSpec, optimizers: list, resume: bool, scratch=None):
    """The parts' optimizer groups in the daemon: created from the parameters' values
    (fp32, in a shared buffer), or with ``resume`` restored ones, whose masters the
    parameters take (cast as each step casts them). (that buffer or None, each part's
    GroupInfo); with ``scratch``: (None, a future of the GroupInfos), created from it."""
    n = spec.numel
    if not n:  # (a frozen block)
        return None, []
    params = [p for _, p in spec.params]
    if not resume and scratch is not None:
        flat_copy(params, scratch.tensor(torch.float32)[:n])
        return None, all_of([session.create_group_async(part.name, scratch, optimizer, offset=part.start * 4,
                                                        numel=part.numel)
                             for part, optimizer in zip(spec.parts, optimizers)])
    if not resume:
        master = session.allocate(n * 4)
        flat_copy(params, master.tensor(torch.float32)[:n])
        return master, [session.create_group(part.name, master, optimizer, offset=part.start * 4, numel=part.numel)
                        for part, optimizer in zip(spec.parts, optimizers)]
    master, infos = read_masters(session, spec)
    for part, info, optimizer in zip(spec.parts, infos, optimizers):
        bad = _incompatible(part.name, info.optimizer, optimizer)
        if bad:
            master.free()
            raise ValueError(bad)
    with torch.no_grad():
        for p, part in zip(params, flat_parts(master.tensor(torch.float32), [p.shape for p in params])):
            p.copy_(part.view(p.shape))
    return master, infos


def _shard_masters(session: Session, spec: GroupSpec, optimizers: list, shards, resume: bool):
    """This rank's daemon groups: its shard of each part, created from the parameters'
    values (or, with ``resume``, restored ones: their sizes checked)."""
    pieces = shards.pieces(spec.parts)
    if resume:
        infos = [session.group(part.name) for part, _, _ in pieces]
        for (part, lo, hi), info in zip(pieces, infos):
            if info.numel != hi - lo:
                raise ValueError(f"group {part.name} has {info.numel} parameters in this rank's checkpoint shard, "
                                 f"{hi - lo} in this model's: the checkpoint is of another model or world")
        return None, infos
    if not pieces:
        return None, []
    lo0, hi0 = pieces[0][1], pieces[-1][2]
    master = session.allocate((hi0 - lo0) * 4)
    params = [p for _, p in spec.params]
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    master.tensor(torch.float32)[:hi0 - lo0].copy_(flat[lo0:hi0])
    del flat
    by_part = {id(part): optimizer for part, optimizer in zip(spec.parts, optimizers)}
    return master, [session.create_group(part.name, master, by_part[id(part)], offset=(lo - lo0) * 4, numel=hi - lo)
                    for part, lo, hi in pieces]


def _store_frozen(session: Session, name: str, frozen: list, count: int, dtype: torch.dtype, offset: int) -> Source:
    """An offloaded block's frozen parameters (``count`` elements), as one transient
    object read with its weights (from byte ``offset`` of them): never written again,
    never stepped."""
    buf = session.allocate(count * dtype.itemsize)
    try:
        flat_copy(frozen, buf.tensor(dtype)[:count])
        source = Source(frozen_object(name), 0, offset, count * dtype.itemsize, "")
        session.swap_out(source.object, buf, length=source.length)
    finally:
        buf.free()
    return source


def _incompatible(name: str, was, now) -> str | None:
    """Why a group checkpointed with optimizer ``was`` cannot resume as ``now``, or None.
    Hyperparameters may differ (each step sends its torch group's, restored from the
    checkpoint); the kind of optimizer, the state dtype and the state's layout may not."""
    was_dtype, now_dtype = (getattr(o, "state_dtype", "fp32") for o in (was, now))
    if was_dtype != now_dtype:
        return (f"group {name} was checkpointed with state_dtype={was_dtype!r}, and this run asks for {now_dtype!r}: "
                f"the moments are not converted between state dtypes; resume with state_dtype={was_dtype!r}, or "
                f"start from the exported weights (engine.export) with state_dtype={now_dtype!r} (fresh moments)")
    if type(was) is not type(now) or bool(getattr(was, "momentum", 0)) != bool(getattr(now, "momentum", 0)):
        return (f"group {name} was checkpointed with {was}, not {now}: resume with the same optimizer (its "
                "hyperparameters may differ)")
    return None



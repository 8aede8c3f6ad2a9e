"""An offloaded layer group as the offloader keeps it (``OffloadedGroup``: its parameters,
where its compute weights are on the SSD array (``Source``), its slot and fetch), what a
saved tensor that is a view of its weights becomes (``Saved``, ``SavedCast``), and the
sources a fetch left for the client to read (``read_declined``)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn

from fuyou_client.connection.session import In, Session
from fuyou_client.device.devices import DONE
from fuyou_client.offload.slots import Slot

@dataclass(frozen=True)
class Source:
    """Where a run of a group's compute weights is on the SSD array: ``length`` bytes at
    ``offset`` in the group's weights, from ``object`` at ``object_offset`` (the masters
    of a state object, a weights object, or a block's frozen parameters); FetchWeights
    asks ``part`` (the daemon's optimizer group) for them ("": none, they are read)."""
    object: str
    object_offset: int
    offset: int
    length: int
    part: str


@dataclass
class OffloadedGroup:
    index: int
    name: str
    uses: tuple[nn.Module, ...]  # the modules it is fetched around (the block; a sub-block's own: model/cuts.py)
    params: list[nn.Parameter]
    dtype: torch.dtype
    sources: list[Source]  # where the compute weights are on the SSD array (none: ``host``)
    numel: int
    slot: "Slot | None" = None  # while resident
    cached: "Slot | None" = None  # released, its weights still in this slot until another group takes it
    ready: object = DONE  # event: the slot's upload (compute waits for it before using the weights)
    fetch: Future | None = None
    fetch_slot: "Slot | None" = None
    fetch_via_state: bool = False  # the fetch asks the daemon to serve it from a state read-ahead
    fetch_backward: bool = False  # the fetch is for backward
    in_backward: bool = False
    busy: bool = False  # between its forward pre- and post-hook: its slot must stay
    last_used: int = 0
    shapes: list[torch.Size] = field(default_factory=list)
    placeholders: list[torch.Tensor] = field(default_factory=list)
    host: object = None  # offload="host": the shared buffer holding the weights (the step writes it)
    host_uploaded: object = DONE  # event: the last upload out of ``host`` (the step waits for it)
    hands_over: bool = False  # its slot goes to its step, which takes the fp32 masters from it (lend)
    cut: bool = False  # a block's own group whose large modules are sub-blocks (model/cuts.py)
    unit: str = ""  # the block it is of, or "rest" (a block's own group and its sub-blocks share it)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Saved:
    group: OffloadedGroup
    offset: int
    size: tuple
    stride: tuple


@dataclass(frozen=True)
class SavedCast:
    """A saved tensor that is a copy of an offloaded weight in another dtype (autocast's,
    or the model's own ``.to``): cast again from the weight when backward needs it. Kept,
    autocast's copies of every offloaded block's weights stayed until backward, 2 bytes
    per parameter beside the slots."""
    weight: Saved
    dtype: torch.dtype


def read_declined(session: Session, sources: list[Source], served: list, host) -> None:
    """The sources a fetch served from a state read-ahead reported declined (``False``: no
    optimizer buffer was spare), read into the slot's ``host`` buffer by the client."""
    declined = [s for s, ok in zip(sources, served) if ok is False]
    if declined:
        session.swap_in_many([In(s.object, host, s.offset, s.length, s.object_offset) for s in declined])


"""One optimizer group as the daemon keeps it (``Group``: its namespace, name, spec, size
and step count; the state read ahead or cached for it; its chunk plan), the name and size
of its state object, the dtypes a request may name, and what a step reports
(``StepResult``). groups.py steps them."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from fuyou_proto.contract import state_object, step_buffer_bytes
from fuyoud.errors import InvalidArgument
from fuyoud.optimizer import chunks
from fuyoud.optimizer.held import HeldWeights
from fuyoud.optimizer.kernels import OptimizerSpec
from fuyoud.sessions.names import shown

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named in a request; InvalidArgument for others."""
    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype {shown(dtype)} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype].itemsize


def state_name(group: str) -> str:
    return state_object(group)


def state_bytes(spec: OptimizerSpec, numel: int) -> int:
    return spec.layout(numel).size


@dataclass
class Group:
    namespace: str
    name: str
    spec: OptimizerSpec
    numel: int
    step: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    prefetched: memoryview | None = None  # the state, read ahead of its step or kept from the last (cached)
    cached: bool = False  # prefetched is the state cache's: kept from the group's last step
    dead: bool = False  # forgotten (session ended, state deleted): nothing may be read ahead for it
    held: HeldWeights | None = None  # a chunked group's weights, read for backward, kept for its step

    @property
    def nbytes(self) -> int:
        return state_bytes(self.spec, self.numel)

    @property
    def buffer_bytes(self) -> int:
        """A step's buffer: the state, then room for the new weights in any dtype."""
        return step_buffer_bytes(self.nbytes, self.numel)

    def chunk_plan(self, per_buffer: int, buffers: int = 1) -> chunks.ChunkPlan:
        """How a step of this group is cut into chunks within ``buffers`` buffers of
        ``per_buffer`` bytes (ResourceExhausted if they are too small even for that)."""
        return chunks.ChunkPlan.make(self.spec.layout(self.numel), per_buffer, f"group {self.name!r}", buffers)


@dataclass
class StepResult:
    step: int
    read_s: float
    compute_s: float
    write_s: float
    prefetched: bool
    cached_bytes: int = 0  # state bytes not read from the SSD: the state cache had them
    masters_bytes: int = 0  # master weights taken from the client's buffer (not read from the SSD)

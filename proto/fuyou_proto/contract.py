"""What client and daemon agree on beyond the messages of fuyou.proto, defined once.

* Alignment: O_DIRECT transfers happen in place when addresses, lengths and device
  offsets are multiples of PAGE.
* Object names: a layer group's optimizer state is the persistent object
  ``STATE_PREFIX + group``; checkpoint snapshots live under ``SNAPSHOT_PREFIX``.
* The state object's layout: a HEADER, then one slot per state tensor, each 4 KiB
  aligned, the fp32 master weights first (at HEADER: clients read them there for
  export and resume). ``STATE_SLOTS`` lists the slots of each optimizer and state dtype;
  the daemon's layout (fuyoud/optimizer/layout.py) and the client's capacity check both
  read it.
* Errors: the gRPC status codes the daemon sends (``ERROR_CODES``); the client has an
  exception class for each (fuyou_client.errors), a test holds both to this table.
"""
from __future__ import annotations

import math

import numpy as np

PAGE = 4096
STATE_PREFIX = "optim/"
SNAPSHOT_PREFIX = "snapshots/"
HEADER = 4096
QBLOCK = 256  # parameters per scale of block-quantized (int8) moments

# (optimizer, state dtype) -> slots: (name, dtype name, parameters per element)
STATE_SLOTS: dict[tuple[str, str], tuple[tuple[str, str, int], ...]] = {
    ("adamw", "fp32"): (("weights", "float32", 1), ("exp_avg", "float32", 1), ("exp_avg_sq", "float32", 1)),
    ("adamw", "bf16"): (("weights", "float32", 1), ("exp_avg", "bfloat16", 1), ("exp_avg_sq", "bfloat16", 1)),
    ("adamw", "int8"): (("weights", "float32", 1), ("exp_avg", "int8", 1), ("exp_avg_sq", "uint8", 1),
                        ("exp_avg_scale", "float32", QBLOCK), ("exp_avg_sq_scale", "float32", QBLOCK)),
    ("sgd", "fp32"): (("weights", "float32", 1),),
    ("sgd+momentum", "fp32"): (("weights", "float32", 1), ("momentum", "float32", 1)),
}
STATE_DTYPES = ("fp32", "bf16", "int8")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1}

# Status codes fuyoud sends, with what each means to a caller.
ERROR_CODES = {
    "INVALID_ARGUMENT": "a malformed request or setting",
    "NOT_FOUND": "no such object, group or session",
    "ALREADY_EXISTS": "the namespace is in use by another session",
    "PERMISSION_DENIED": "not the caller's to touch (or the operator's only)",
    "UNAUTHENTICATED": "no session, or one that ended",
    "OUT_OF_RANGE": "a step refused as non-finite; the committed state kept",
    "RESOURCE_EXHAUSTED": "a memory budget, the SSD array or a quota is full",
    "FAILED_PRECONDITION": "well formed, but not now (e.g. a checkpoint without a common step)",
    "DATA_LOSS": "the SSD failed or returned other bytes than were written",
    "UNAVAILABLE": "the daemon is draining or stopping",
    "INTERNAL": "a bug: see the daemon's log",
}


def state_object(group: str) -> str:
    """The name of a group's optimizer state object."""
    return STATE_PREFIX + group


def group_of(name: str) -> str | None:
    """The group whose state object ``name`` is (a snapshot's copy too), or None."""
    base = name[len(SNAPSHOT_PREFIX):].split("/", 1)[-1] if name.startswith(SNAPSHOT_PREFIX) else name
    return base[len(STATE_PREFIX):] if base.startswith(STATE_PREFIX) else None


def slot_bytes(dtype: str, per: int, numel: int) -> int:
    """A slot's bytes in the state object, its padding to 4 KiB included."""
    return -(-math.ceil(numel / per) * ITEMSIZE[dtype] // PAGE) * PAGE


def state_object_bytes(kind: str, state_dtype: str, numel: int) -> int:
    """The size of a group's state object (``kind``: "adamw", "sgd" or "sgd+momentum")."""
    return HEADER + sum(slot_bytes(dtype, per, numel) for _, dtype, per in STATE_SLOTS[(kind, state_dtype)])


HUGE = 2 << 20  # shared segments and optimizer buffers are whole 2 MiB (huge) pages


def optimizer_buffer_bytes(budget: int, count: int) -> int:
    """The size of each of the daemon's ``count`` optimizer buffers in ``budget`` bytes."""
    return budget // count // HUGE * HUGE


def step_buffer_bytes(state_bytes: int, numel: int) -> int:
    """What a whole-group step holds: the state, then room for the new weights in any dtype."""
    return state_bytes + slot_bytes("float32", 1, numel)


def stepped_in_chunks(state_bytes: int, numel: int, buffer_budget: int, buffers: int) -> bool:
    """Whether the daemon steps a group (``state_bytes`` of state, ``numel`` parameters) in
    chunks: its step does not fit one optimizer buffer."""
    return step_buffer_bytes(state_bytes, numel) > optimizer_buffer_bytes(buffer_budget, buffers)


def segment_bytes(nbytes: int, segment: int) -> int:
    """Pinned bytes a shared buffer of ``nbytes`` takes from a session's budget when it
    gets a segment of its own (a buffer of at least ``segment`` bytes); smaller ones
    share segments of ``segment`` bytes."""
    size = -(-nbytes // PAGE) * PAGE
    return -(-max(size, segment) // HUGE) * HUGE


def buffer_address(buf) -> int:
    """Address of the first byte of a buffer (mmap, bytearray, memoryview, read-only too)."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data

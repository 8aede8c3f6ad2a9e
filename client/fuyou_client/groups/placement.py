"""Where a layer group's weights and gradients live: the one owner of the placement rule
and of the names of the objects a group's weights are kept in on the SSD array.

* Blocks and sub-blocks (model/cuts.py: the rest's large modules too) follow
  ``attach(offload=...)``; the rest group (embeddings, final norm, head; cut, its small
  parameters) stays resident.
* An offloaded group's compute weights between uses: in fp32 they *are* the master
  weights, read in place from the first slot of its optimizer state object
  (``fuyou_proto.contract.state_object``); in any other dtype they are the transient
  object ``weights/<part>``, which every step rewrites (the step is told its name:
  ``step_weights_object``). With ``offload="host"`` they are in a shared host buffer the
  step writes instead, and nothing is on the SSD array.
* An offloaded block's frozen parameters: the object ``frozen/<block>``, written once.
* Gradients: offloaded groups borrow pooled buffers when nothing keeps gradients until
  the step (no accumulation, no exact clipping); otherwise each group keeps its own (on
  the device, or summed on the host); data parallelism shards them.
"""
from __future__ import annotations

import torch


def weights_object(part: str) -> str:
    """The transient object holding an offloaded part's compute weights (not fp32)."""
    return f"weights/{part}"


def frozen_object(block: str) -> str:
    """The object holding an offloaded block's frozen parameters."""
    return f"frozen/{block}"


def weights_in_state(offload: bool | str, dtype: torch.dtype) -> bool:
    """Whether an offloaded group's compute weights are read from its masters in place."""
    return offload is True and dtype == torch.float32


def weights_rewritten(offload: bool | str, dtype: torch.dtype) -> bool:
    """Whether each step rewrites the group's ``weights/<part>`` object."""
    return offload is True and dtype != torch.float32


def step_weights_object(offload: bool | str, dtype: torch.dtype, part: str) -> str:
    """What a step of ``part`` is asked to rewrite besides its state ("": nothing)."""
    return weights_object(part) if weights_rewritten(offload, dtype) else ""


def placement(spec, offload: bool | str, pool_grads: bool, grad_accumulation: str,
              parallel_kind: str | None) -> tuple[bool | str, str] | None:
    """Where a layer group's weights and gradients live: (offload mode, strategy kind), or
    None for a frozen block left as it is. Blocks and sub-blocks follow ``offload``, the
    rest group stays resident; offloaded groups borrow pooled gradient buffers when nothing keeps gradients
    until the step (``pool_grads``: no accumulation, no exact clipping), else each group
    keeps its own (on the device, or summed on the host); with several processes the
    parallelism seam's strategy moves them (``parallel_kind``: "sharded", "remote")."""
    mode = offload if spec.uses else False
    if not spec.params and mode is not True:
        return None
    if not spec.params:
        return mode, "resident"  # (a frozen offloaded block: no gradients)
    if parallel_kind is not None:
        return mode, parallel_kind
    if mode and pool_grads:
        return mode, "pooled"
    return mode, "host" if grad_accumulation == "host" else "resident"


def hands_over(g) -> bool:
    """Whether an offloaded group's steps take its fp32 master weights from the slot its
    backward used (its parts are stepped in chunks, which would read them from the SSD
    again): fp32 weights from the SSD array, not sharded, pooled gradients (its step goes
    as its backward ends, the slot lent meanwhile)."""
    og = g.offloaded
    return og.host is None and g.dtype == torch.float32 and g.shard is None and bool(g.chunked) \
        and g.strategy.name == "pooled"

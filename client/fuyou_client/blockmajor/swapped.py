"""Blocks whose activations ``train_step`` swaps instead of recomputing them
(``attach(swap_blocks=N)``).

A recomputed block (the default) keeps only its input between forward and backward and
runs its forward again before its backward: a third more of the block's FLOPs. A swapped
block runs its forward once, with a graph, and what autograd saves for backward leaves the
compute device as it is made (activations/swapper.py: a host arena, beyond it the SSD
array), coming back ahead of the block's backward. It trades the recomputation for PCIe
and host (or SSD) traffic: 17 bytes per token, unit of width and byte of the compute dtype
each way (memory/device_plan.py ``ACTIVATION_BYTES``). The planner (sizing/iteration.py)
weighs the two and picks how many blocks swap.

Which blocks: ``swapped_blocks(n, count)``, spread evenly over the model so that the
activations' transfers spread over the pass instead of bunching up.

A swapped block's graph is kept from its forward to its backward without holding its input
or its outputs on the device: its input enters through ``Entry`` (a function of no tensor
that needs a gradient, so no leaf tensor is held; its backward hands the input's gradient
to a box), and its outputs are kept as gradient edges (``torch.autograd.graph.
get_gradient_edge``), the roots backward starts from.
"""
from __future__ import annotations

import torch


def swapped_blocks(n: int, count: int) -> frozenset[int]:
    """Which of ``n`` blocks swap their activations when ``count`` do: spread evenly
    (``count >= n``: every block)."""
    if count < 0:
        raise ValueError(f"swap_blocks must be at least 0, got {count}")
    count = min(count, n)
    return frozenset((j * n) // count for j in range(count)) if count else frozenset()


class Entry(torch.autograd.Function):
    """``Entry.apply(anchor, x, box)``: a copy of ``x`` whose gradient, in backward, is
    appended to ``box``. ``anchor``: a scalar that requires a gradient (and never gets one),
    so that the copy is part of the graph while ``x`` itself is not held by it."""

    @staticmethod
    def forward(ctx, anchor, x, box):
        ctx.box = box
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.box.append(grad)
        return None, None, None

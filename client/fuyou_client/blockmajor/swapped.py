"""Blocks whose activations ``train_step`` swaps instead of recomputing them
(``attach(swap_blocks=N)``).

A recomputed block (the default) keeps only its input between forward and backward and
runs its forward again before its backward: a third more of the block's FLOPs. A swapped
block runs its forward once, with a graph, and what autograd saves for backward leaves the
compute device as it is made (activations/swapper.py: a host arena, beyond it the SSD
array), coming back ahead of the block's backward. Of ``host_budget``, the kept inputs take
what their plan holds, at most half (store.py), and the activations' arena the rest. It trades the recomputation for PCIe
and host (or SSD) traffic each way: what autograd saves, an HF GPT-2 block's 29 bytes per
token, unit of width and byte of the compute dtype (memory/device_plan.py
``SAVED_ACTIVATIONS``, by the block's layout). The planner (sizing/iteration.py)
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
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten


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


class Swapped:
    """The swapped blocks of one ``train_step`` and their graphs, kept from forward to
    backward, keyed (block, micro-batch). ``saving()``: the saved-tensor hooks a swapped
    block's forward runs under (engine/hooks.py ``ModelHooks.saving``: offloaded weights as
    markers, activations to ``swapper``, an activations/swapper.ActivationSwapper of
    train_step's own)."""

    def __init__(self, blocks: frozenset[int], swapper, saving, arena=None):
        """``arena()``: the activations' arena bytes, asked once the step's kept inputs are
        planned (before the first swapped block runs)."""
        self.blocks, self.swapper, self.saving, self._arena = blocks, swapper, saving, arena
        self._graphs: dict[tuple[int, int], tuple[list, list]] = {}
        self._anchor = torch.zeros((), requires_grad=True)
        st = swapper.stats
        self._start = (st.copied, st.returned, st.spilled, st.read_back)

    def count(self, stats) -> None:
        """This step's activation traffic into ``stats`` (store.StoreStats)."""
        st = self.swapper.stats
        now = (st.copied, st.returned, st.spilled, st.read_back)
        stats.swapped_blocks = len(self.blocks)
        (stats.activations_to_host, stats.activations_back, stats.activations_to_ssd,
         stats.activations_from_ssd) = (b - a for a, b in zip(self._start, now))

    def __contains__(self, l: int) -> bool:
        return l in self.blocks

    def forward(self, key: tuple[int, int], forward, rebuild, stored: list, used) -> object:
        """Block ``key[0]`` for micro-batch ``key[1]`` with a graph: ``rebuild(inputs)`` makes
        its arguments from its inputs (``stored``: the previous block's outputs; ``used``:
        the positions the call takes) entered through ``Entry``. Returns its output, whose
        tensors the caller detaches."""
        if self._arena is not None:  # (the first swapped block of the step)
            self.swapper.resize(self._arena())
            self._arena = None
        boxes = [[] for _ in stored]
        entered = [Entry.apply(self._anchor, t.detach(), box) if t is not None and j in used else None
                   for j, (t, box) in enumerate(zip(stored, boxes))]
        args, kwargs = rebuild(entered)
        del entered
        with torch.enable_grad(), self.saving(self.swapper):
            out = forward(*args, **kwargs)
        torch.clear_autocast_cache()  # (this thread's casts of the block's weights: saved as markers)
        leaves, _ = tree_flatten(out)
        edges = [get_gradient_edge(x) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves]
        self._graphs[key] = (edges, boxes)
        return out

    def backward(self, key: tuple[int, int], floating: list[int], grads: list) -> list:
        """Backward through the kept graph from its outputs' gradients (``grads``, aligned
        with the output's ``floating`` positions); returns the gradients of its inputs,
        aligned with the previous block's outputs."""
        edges, boxes = self._graphs.pop(key)
        pairs = [(edges[j], g) for j, g in zip(floating, grads) if g is not None and edges[j] is not None]
        if pairs:
            torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
        return [box[0] if box else None for box in boxes]

    def discard(self) -> None:
        """The step is over (or failed): every graph left and what it parked go."""
        self._graphs.clear()
        self.swapper.reset()

"""Block-major's swapped activations on the iteration model's timeline (iteration.py):
the blocks whose saved activations ``train_step`` swaps instead of recomputing them
(``attach(swap_blocks=N)``, blockmajor/swapped.py), their bytes on PCIe, in the host arena
and, beyond it, on the SSD array.

What it assumes (docs/design/iteration-model.md):

* **Bytes**: what autograd saves for a block's backward, per token ``a * width + b * mlp``
  at 16 bits by the block's layout (memory/device_plan.py's ``SAVED_ACTIVATIONS``, counted on
  the families' blocks), down once in forward and up once before backward.
* **Device memory**: the device plan's one block's activations with a graph at a time. The
  activations leave as autograd saves them (streaming over the block's forward): their
  download starts with the compute and ends no earlier than it; the next forward with a
  graph (the next micro-batch of a swapped block) starts once they have left. In backward
  the next micro-batch's activations come up while the backward before it frees its own
  (from that backward's start; done no earlier than its end), and a backward starts once
  its own are up. So a swapped block's micro-batch takes the longer of its compute and its
  transfer, each way.
* **Host arena**: ``arena`` bytes (what the kept inputs leave of ``host_budget`` in train_step: they take what they need, at most half); what
  exceeds it goes to the SSD array, the earliest blocks' first (backward needs them last),
  written after its download and read back one block ahead of its backward (issued as the
  backward of the block after it starts).
"""
from __future__ import annotations

from fuyou_client.blockmajor.swapped import swapped_blocks
from fuyou_client.memory.device_plan import activation_bytes as per_token
from fuyou_client.sizing.kernels import layout, widths

GB = 1e9


def activation_bytes(shape, tokens: int, compute_bytes: int) -> int:
    """What a block of ``shape`` (sizing.shape.ModelShape) saves for its backward, for
    ``tokens`` tokens."""
    return tokens * per_token(layout(shape), shape.width, widths(shape)[2], compute_bytes)


def spilled(blocks: frozenset, runs: int, each: float, arena: float) -> dict:
    """Per swapped block, the bytes of each of its ``runs`` micro-batch runs (``each``
    bytes) beyond the ``arena``: the earliest blocks' first."""
    over = max(0.0, len(blocks) * runs * each - arena)
    out = {}
    for l in sorted(blocks):
        take = min(over, runs * each)
        out[l] = take / runs
        over -= take
    return out


class SwappedActivations:
    """The swapped blocks of one iteration on a Timeline: ``forward`` after a swapped
    block's forward, ``read_ahead`` as backward reaches a block, ``upload`` before a swapped
    block's backward."""

    def __init__(self, t, rates, layers: int, count: int, runs: int, each: float, arena: float):
        self.t, self.r, self.each, self.runs = t, rates, each, runs
        self.blocks = swapped_blocks(layers, count)
        self.spill = spilled(self.blocks, runs, each, arena)
        self.free = 0.0  # when the device's activation memory is free for the next forward with a graph
        self.written, self.read, self.asked = {}, {}, set()

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def forward(self, key: tuple, start: float, end: float) -> None:
        """A swapped block's micro-batch run computed from ``start`` to ``end``: its
        activations down as they are made, the part beyond the arena on to the SSD array."""
        t = self.t
        t.move("d2h", "activations", self.each)
        self.free = max(end, t.op("d2h", self.each / self.r.pcie_d2h / GB, (start, "compute")))
        spill = self.spill.get(key[1], 0.0)
        if spill:
            t.move("ssd", "write activations", spill)
            self.written[key] = t.op("ssd", spill / self.r.ssd_write / GB, (self.free, ""))

    def read_ahead(self, block: int, when: float) -> None:
        """Read ``block``'s spilled activations back into host memory, from ``when`` on."""
        if block not in self.blocks or block in self.asked:
            return
        self.asked.add(block)
        for key in [k for k in self.written if k[1] == block]:
            self.t.move("ssd", "read activations", self.spill[block])
            self.read[key] = self.t.op("ssd", self.spill[block] / self.r.ssd_read / GB, (self.written[key], ""),
                                       (when, ""))

    def upload(self, key: tuple, before: tuple[float, float]) -> float:
        """When ``key``'s activations are on the device, the backward before it having run
        over ``before`` (start, end)."""
        self.t.move("h2d", "activations", self.each)
        up = self.t.op("h2d", self.each / self.r.pcie_h2d / GB, (self.read.get(key, 0.0), "activations read back"),
                       (before[0], "activation memory"))
        return max(up, before[1])

"""``activations="auto"``: profile an iteration, plan (planner.py), apply, re-plan when
the batch shape changes.

The profiling micro-batch (the second forward and backward: the first pays one-time
costs) swaps every block (safe for memory, and it measures the copy bandwidth); per block
it records the forward time (less the time spent copying and spilling activations), the
bytes saved for backward and the bytes of its inputs; the SSD bandwidth comes from the
spills, or from a short probe when nothing spilled. When the next micro-batch's first
block starts (or at ``engine.step()``, whichever comes first) the plan is made and
applied to what follows; it is ``engine.plan`` (``print(engine.plan)`` shows the table)
and is logged. With gradient accumulation the plan thus applies from the third
micro-batch on, and is made from one micro-batch's activations (those alive at once),
not a whole step's. A first block called with a differently shaped input starts a new
profiling micro-batch.
"""
from __future__ import annotations

import logging
from collections import defaultdict

import torch

from fuyou_client.activations.planner import BlockProfile, Plan, Profile, plan

log = logging.getLogger("fuyou_client")
UNLIMITED = 1 << 62


def tensor_bytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def first_shape(args, kwargs):
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape)
    return None


class AutoPlanner:
    def __init__(self, activations, device, apply_treatments, blocks: list[str], device_budget: int | None,
                 host_budget: int):
        """``activations``: the engine's ActivationSwapper (its stats, its SSD probe);
        ``device``: the compute device; ``apply_treatments(dict)``: how a plan is applied."""
        self.activations, self.device, self.apply_treatments = activations, device, apply_treatments
        self.blocks = blocks
        self.device_budget = UNLIMITED if device_budget is None else device_budget
        self.host_budget = host_budget
        self.plan: Plan | None = None
        self.shape = None
        self.profiling = False
        self._t0: dict[str, tuple[float, float]] = {}
        self.backward_seen = False  # set by the engine's gradient hooks: the profiled forward's backward ran
        self._now = device.timer()  # on a GPU it synchronises: profiled times are the device's
        self.start_profiling()

    def start_profiling(self, warmup: int = 1) -> None:
        """Swap everything and measure; the first ``warmup`` iterations (one-time costs:
        allocation, first fetches) are not used."""
        self._warmup = warmup
        self.profiling = True
        self.backward_seen = False
        self._forward = defaultdict(float)
        self._saved = defaultdict(int)
        self._inputs: dict[str, int] = {}
        stats = self.activations.stats
        self._ssd0 = (stats.spilled, stats.spill_s, stats.read_back, stats.read_back_s)
        self._copy0 = (stats.copied, stats.copy_s)
        self.activations.measure = True  # copies timed to completion while profiling
        self.apply_treatments({n: "swap" for n in self.blocks})

    # -- hooks -------------------------------------------------------------------------------
    def saw_backward(self) -> None:
        """A gradient arrived (the model's hooks): the profiled forward's backward ran."""
        self.backward_seen = True

    def before(self, name: str, args, kwargs) -> None:
        if name == self.blocks[0]:
            if self.profiling and self._forward and self.backward_seen:  # a new micro-batch
                self._micro_batch_done()
            shape = first_shape(args, kwargs)
            if self.plan is not None and shape != self.shape and not self.profiling:
                log.info("activation plan: the input shape changed from %s to %s; profiling again", self.shape, shape)
                self.start_profiling()
            self.shape = shape
        if self.profiling:
            self._inputs[name] = tensor_bytes((*args, *kwargs.values()))
            self._t0[name] = (self._now(), self._moving())

    def after(self, name: str) -> None:
        if self.profiling and name in self._t0:
            t0, moving0 = self._t0.pop(name)
            self._forward[name] += self._now() - t0 - (self._moving() - moving0)

    def _moving(self) -> float:
        """Seconds spent moving activations so far (not the block's own compute)."""
        stats = self.activations.stats
        return stats.copy_s + stats.spill_s

    def saved(self, name: str, nbytes: int) -> None:
        if self.profiling:
            self._saved[name] += nbytes

    # -- planning ------------------------------------------------------------------------------
    def profile(self) -> Profile:
        stats = self.activations.stats
        copied, copy_s = stats.copied - self._copy0[0], stats.copy_s - self._copy0[1]
        spilled, spill_s = stats.spilled - self._ssd0[0], stats.spill_s - self._ssd0[1]
        read, read_s = stats.read_back - self._ssd0[2], stats.read_back_s - self._ssd0[3]
        if not spilled or not read:
            write_bps, read_bps = self.activations.probe_ssd()
        else:
            write_bps, read_bps = spilled / max(spill_s, 1e-9), read / max(read_s, 1e-9)
        blocks = [BlockProfile(n, self._forward[n], self._saved[n], self._inputs.get(n, 0)) for n in self.blocks]
        copies_overlap = not self.device.shares_host_memory  # side streams: copies overlap compute
        return Profile(blocks, copied / max(copy_s, 1e-9) if copied else 10e9, write_bps, read_bps,
                       self.device_budget, self.host_budget, copies_overlap=copies_overlap)

    def step_done(self) -> None:
        """At engine.step(): after a profiling micro-batch, plan and apply."""
        if self.profiling and self._forward:
            self._micro_batch_done()

    def _micro_batch_done(self) -> None:
        if self._warmup:
            self.start_profiling(self._warmup - 1)
            return
        self.profiling = False
        self.activations.measure = False
        self.plan = plan(self.profile())
        self.apply_treatments(self.plan.treatments)
        log.info("%s", self.plan.summary())

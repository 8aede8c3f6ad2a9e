"""The client's memory plan: every shared buffer a training process takes from fuyoud,
worked out from the session's pinned budget and the model's layer groups before
anything is allocated, then allocated exactly so (the engine builds its parts with the
counts the plan chose; ``engine.memory_plan()`` shows it).

What a training process holds in shared memory:

* per layer group, for the whole run: the gradients kept until its step (resident and
  host-accumulated groups: gradients/strategy.py), the weights its step writes (resident
  groups; ``offload="host"``), with data parallelism its shard buffers (parallel/sharded.py);
* weight slots (offload/offloader.py), each as large as the largest offloaded block: the block
  computing, ``prefetch`` blocks fetched ahead, the ``keep`` blocks kept from forward to
  backward, and a spare where blocks are read from the SSD array (a slot is also GPU memory); where the steps of blocks stepped in chunks take their fp32
  master weights from the slot their block's backward used (``handoff``: 4 SSD bytes per
  parameter fewer), the slots of the steps in flight instead of the spare;
* gradient buffers shared by the offloaded blocks (gradients/pool.py): the block in backward
  and the steps in flight;
* staging buffers of host gradient accumulation (gradients/host.py);
* the host arena of ``host_budget`` bytes (activations/swapper.py's swapped activations;
  blockmajor/store.py's kept inputs of ``train_step``);
* for a moment: a buffer of the largest group's fp32 master weights (attach creates each
  group's state from it; resume reads them back) before the training buffers exist, and
  a buffer export reads master weights through (``EXPORT_PIECE``) beside them.

How many of each: enough bytes in flight to keep an SSD array busy (``WINDOW``), capped at
the counts that serve small blocks: a 28 MiB block gets two fetched ahead and four steps
in flight, a 772 MiB one (Llama-7B's, fp32) one and one. While that plan is larger than
what the session may still take, it gives up, in this order: arena bytes (to
``ARENA_FLOOR``: beyond it what the arena would hold goes to the SSD array, a small share
of a step's traffic, and most runs never allocate it), the spare slot, steps in flight,
the master handoff, prefetch, down to the smallest plan that still trains (no block
ahead, one gradient buffer). A budget below that
is refused before anything is allocated, with the bytes needed and what to change. What
the caller fixed (``prefetch``, ``keep``, ``host_budget`` given to attach) is never
changed: a plan that cannot hold it is refused naming it.

The plan is a pure function of numbers (``GroupShape``, ``Limits``, ``Wanted``), so the
planner of a model that does not exist here yet can call it too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fuyou_client.errors import ResourceExhausted
from fuyou_proto.contract import segment_bytes
from fuyou_proto.units import format_size

WINDOW = 512 << 20  # bytes in flight that keep an SSD array busy: more buffers buy no speed
MAX_PREFETCH = 2  # blocks fetched ahead, at most (small blocks)
MAX_STAGING = 3  # host accumulation's staging buffers, at most
ARENA_DEFAULT = 256 << 20  # host_budget when attach leaves it to the plan
ARENA_FLOOR = 64 << 20  # the least the plan shrinks it to
EXPORT_PIECE = 64 << 20  # the shared buffer export reads master weights through (checkpoints/)


def depth(nbytes: int, most: int) -> int:
    """How many buffers of ``nbytes`` fill ``WINDOW``: at least 1, at most ``most``."""
    return max(1, min(most, -(-WINDOW // max(nbytes, 1))))


@dataclass(frozen=True)
class GroupShape:
    """What the plan needs of a layer group."""
    name: str
    numel: int  # trained elements (with data parallelism: padded to the shards' sum)
    itemsize: int  # of the compute dtype
    chunked: bool = False  # the daemon steps it in chunks (fuyou_proto.contract.stepped_in_chunks)
    frozen_bytes: int = 0  # an offloaded block's frozen parameters, fetched with its weights
    offload: bool | str = False  # True: weights on the SSD array; "host": in shared memory; False: resident
    strategy: str = "resident"  # where its gradients live: resident | pooled | host | sharded | remote (gradients/strategy.py)
    shard: int = 0  # data parallelism: this rank's shard, elements
    held: bool = False  # a cut block's own group (model/cuts.py): held while its sub-blocks come, small slots of its own
    unit: str = ""  # the block (or "rest") a sub-block is cut from: train_step sums a unit's sub-blocks at once

    @property
    def weight_bytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def fetched_bytes(self) -> int:
        """What one weight slot holds of it (offloaded groups)."""
        return self.weight_bytes + self.frozen_bytes


@dataclass(frozen=True)
class Limits:
    """What the daemon gives a session (its Status)."""
    session_budget: int
    held: int = 0  # what the session holds already
    segment: int = 64 << 20
    optimizer_buffer_budget: int = 1 << 30
    optimizer_buffers: int = 6
    others: int = 0  # what the daemon's other sessions hold of its budget (allocated or reserved by their plans)
    sharers: int = 1  # the job's processes on this daemon, each within an equal part of its budget

    @property
    def room(self) -> int:
        return max(0, self.session_budget - self.held)


def limits_of(session, sharers: int = 1) -> Limits:
    """The limits of a session of a running daemon, now (its Status; daemons older than
    the session budget's field: their whole pinned budget). The daemon's budget for all
    sessions bounds it too, and what its user may still take over all its sessions
    ([limits] user_pinned), and ``sharers``: the processes of one job that share this
    daemon (data parallelism's ranks of one host) each take at most an equal part of it,
    so that the first to plan does not hold what the others' plans need."""
    st = session.status()
    budget = st.session_budget_bytes or st.pinned_budget_bytes
    if sharers > 1:
        budget = min(budget, st.pinned_budget_bytes // sharers)
    if st.user_pinned_budget_bytes:  # (what its user may hold over all its sessions, [limits] user_pinned)
        budget = min(budget, st.user_pinned_budget_bytes // sharers,
                     max(0, st.user_pinned_budget_bytes - st.user_pinned_others_bytes))
    held = session.pinned_bytes
    others = max(0, st.pinned_used_bytes + st.pinned_reserved_bytes - held)  # (their plans' reservations too)
    return Limits(min(budget, max(0, st.pinned_budget_bytes - others)), held, st.segment_bytes or 64 << 20,
                  st.optimizer_buffer_budget_bytes or 1 << 30, st.optimizer_buffers or 6, others, sharers)


@dataclass(frozen=True)
class Wanted:
    """What the caller fixed (None: the plan chooses)."""
    prefetch: int | None = None
    keep: int = 0
    host_budget: int | None = None
    arena: bool = True  # a host arena may be used (train_step's)
    swaps: bool = False  # activations "swap" or "auto": the activation swapper's arena too
    shares_host_memory: bool = True  # the compute device is the CPU (no device-side copies)


    @property
    def arenas(self) -> int:
        """Host arenas of ``host_budget`` bytes: train_step's or the activation swapper's
        (train_step ignores ``activations=``: a run uses one of them)."""
        return int(self.arena or self.swaps)


@dataclass(frozen=True)
class Item:
    what: str
    count: int
    each: int  # bytes per buffer
    why: str
    phase: str = "run"  # "run": from attach on; "train": from the end of attach; "attach", "export": for a moment

    @property
    def nbytes(self) -> int:
        return self.count * self.each


OWN_SLOTS = 2  # cut blocks: slots for their own groups (the block computing, the next one's ahead)


@dataclass(frozen=True)
class MemoryPlan:
    prefetch: int
    keep: int
    weight_slots: int
    slot_bytes: int
    slots_on_host: bool  # the slots have a shared host buffer (some block is read from the SSD array)
    grad_buffers: int
    grad_bytes: int
    staging_buffers: int
    staging_bytes: int
    host_budget: int
    handoff: bool  # chunked fp32 blocks' steps take their masters from the slot (held until the step is done)
    items: tuple[Item, ...]
    limits: Limits
    shrunk: tuple[str, ...] = ()  # what was given up to fit, in order
    segment: int = field(default=64 << 20, repr=False)
    device: "object | None" = None  # the compute device's plan (device_plan.DevicePlan; None: the CPU)
    # Blocks cut into sub-blocks (model/cuts.py): their own groups' slots and gradient buffers,
    # sized for them (a block's norms need not take a slot of its largest module)
    own_slots: int = 0
    own_slot_bytes: int = 0
    own_grad_buffers: int = 0
    own_grad_bytes: int = 0
    device_grad_buffers: int = 0  # of the gradient buffers, how many on a device with its own memory
    # The rest's sub-blocks (embeddings, head) where they are larger than any block's: a slot
    # and gradient buffers of their own size, so that a block's (or an expert part's) need not be
    rest_slots: int = 0
    rest_slot_bytes: int = 0
    rest_grad_buffers: int = 0
    rest_grad_bytes: int = 0

    DEVICE_GRAD_BUFFERS = 2  # at most: the group in backward, the one whose gradients go down

    @property
    def slot_sizes(self) -> list[int]:
        """Each weight slot's bytes (offload/offloader.py)."""
        return ([self.slot_bytes] * self.weight_slots + [self.own_slot_bytes] * self.own_slots
                + [self.rest_slot_bytes] * self.rest_slots)

    @property
    def grad_classes(self) -> list[tuple[int, int, int]]:
        """The gradient buffers, (host count, device count, bytes) per size (gradients/pool.py)."""
        return [(n, d, b) for n, d, b in ((self.grad_buffers, self.device_grad_buffers, self.grad_bytes),
                                          (self.own_grad_buffers, min(self.own_grad_buffers, self.DEVICE_GRAD_BUFFERS),
                                           self.own_grad_bytes),
                                          (self.rest_grad_buffers,
                                           min(self.rest_grad_buffers, self.DEVICE_GRAD_BUFFERS), self.rest_grad_bytes))
                if n and b]

    def _at(self, *phases: str) -> int:
        return pinned_bytes([i for i in self.items if i.phase in phases], self.segment)

    @property
    def training(self) -> int:
        """What training holds, as the daemon counts it (segments)."""
        return self._at("run", "train")

    @property
    def total(self) -> int:
        """The most the plan holds at once: while attach makes a group's state (before the
        training buffers exist), or while export reads one back (beside them)."""
        return max(self._at("run", "attach"), self._at("run", "train", "export"))

    def describe(self) -> str:
        """A short table: what goes where, and what was given up to fit."""
        rows = [f"  {i.what:<34} {i.count:>3} x {format_size(i.each):>10} = {format_size(i.nbytes):>10}  {i.why}"
                for i in self.items if i.count]
        head = (f"memory plan: {format_size(self.total)} of shared memory (session budget "
                f"{format_size(self.limits.session_budget)}"
                f"{f', {format_size(self.limits.held)} held already' if self.limits.held else ''}); prefetch "
                f"{self.prefetch}, {self.weight_slots} weight slot(s), {self.grad_buffers} gradient buffer(s)"
                f"{', master weights handed to the steps' if self.handoff else ''}")
        tail = [f"  to fit, gave up: {', '.join(self.shrunk)}"] if self.shrunk else []
        device = [self.device.describe()] if self.device is not None else []
        return "\n".join([head, *rows, *tail, *device])

    def __str__(self) -> str:
        return self.describe()


def pinned_bytes(items, segment: int) -> int:
    """Pinned bytes of these buffers, as the daemon's pool counts them (an upper bound): a
    buffer of a segment or more gets one of its own (2 MiB pages), one of more than half a
    segment takes a segment to itself (no other its size fits beside it), smaller ones
    share segments (one more counted for how they pack)."""
    whole = sum(i.count * segment_bytes(i.each, segment) for i in items if i.count and i.each > segment // 2)
    small = sum(i.count * -(-i.each // 4096) * 4096 for i in items if i.count and 0 < i.each <= segment // 2)
    return whole + (-(-small // segment) + 1) * segment if small else whole


@dataclass(frozen=True)
class _Knobs:
    prefetch: int
    spare: int
    inflight: int  # steps in flight while a block is in backward (gradient buffers: 1 + this)
    handoff: bool
    arena: int
    staging: int


class DoesNotFit(ResourceExhausted):
    """The smallest plan is larger than what the session may take; the message says by
    how much and what to change, ``smallest`` is that plan."""

    def __init__(self, message: str, smallest: "MemoryPlan | None" = None):
        super().__init__(message)
        self.smallest = smallest


def plan(groups: list[GroupShape], limits: Limits, wanted: Wanted = Wanted(), device_fits=None) -> MemoryPlan:
    """The largest plan of at most the wanted counts that fits ``limits.room`` and, where
    given, ``device_fits(plan)`` (the compute device's budget: device_plan.py; its slots
    and gradient buffers are the device's too). Only what a device holds is given up for
    the device's sake. Raises DoesNotFit when the smallest plan is too large for the
    session; returns it when only the device's check fails (the caller refuses it, naming
    the device's figures)."""
    offloaded = [g for g in groups if g.offload and g.numel + g.frozen_bytes]
    from_ssd = [g for g in offloaded if g.offload is True]
    pooled = [g for g in groups if g.strategy == "pooled"]
    hosted = [g for g in groups if g.strategy == "host"]
    slot, rest_slot = _classes([g for g in offloaded if not g.held], lambda g: g.fetched_bytes)
    grad, rest_grad = _classes([g for g in pooled if not g.held], lambda g: g.weight_bytes)
    rest_subs = sum(1 for g in pooled if not g.held and g.unit == "rest")
    own_slot, own_grad, summed = _sub_block_sizes(offloaded, pooled)
    n_own_slots, n_own_grads = (OWN_SLOTS if own_slot else 0), (OWN_SLOTS if own_grad else 0)
    staging = max((g.numel * 4 for g in hosted), default=0)
    chunked_fp32 = [g for g in from_ssd if g.strategy == "pooled" and g.itemsize == 4 and g.chunked]
    fixed = _fixed(groups, wanted.shares_host_memory)

    def build(k: _Knobs, shrunk: tuple[str, ...] = ()) -> MemoryPlan:
        held_by_steps = k.inflight if k.handoff else 0
        # Blocks of a WINDOW or more: a fetch and a step's I/O share the SSD array, so a
        # prefetch may wait for a slot a step holds (offload/offloader.py: deferred, started as the
        # step ends) at no cost; smaller ones get room for both.
        shared = held_by_steps and slot >= WINDOW
        extra = max(k.prefetch, held_by_steps) if shared else k.prefetch + (held_by_steps or k.spare)
        n_slots = (1 + extra + wanted.keep) if offloaded else 0
        n_grads = max(1 + k.inflight, summed) if pooled else 0
        n_rest_slots = (1 if k.prefetch else 0) + 1 if rest_slot and from_ssd else 0
        # (the rest's: the head's and the embeddings', one of them in backward, the other's step in flight)
        n_rest_grads = max(2, rest_subs) if rest_grad else 0
        n_staging = k.staging if hosted else 0
        items = list(fixed)
        items.append(Item("weight slots", n_slots if from_ssd else 0, slot,  # (offload="host": device memory only)
                          f"the {'sub-block' if own_slot else 'block'} computing, {k.prefetch} ahead"
                          + (f", {wanted.keep} kept" if wanted.keep else "")
                          + (f" (or lent to the {held_by_steps} step(s) in flight: master handoff)" if shared else
                             f", {held_by_steps} lent to steps in flight (master handoff)" if held_by_steps else
                             ", a spare" if k.spare else ""), "train"))
        items.append(Item("weight slots, blocks' own groups", n_own_slots if from_ssd else 0, own_slot,
                          "a cut block's small modules: the block computing, the next one's ahead", "train"))
        items.append(Item("weight slots, the rest's sub-blocks", n_rest_slots, rest_slot,
                          "the embeddings or the head computing" + (", the other one ahead" if k.prefetch else ""),
                          "train"))
        items.append(Item("gradient buffers", n_grads, grad, f"the block in backward, {k.inflight} step(s) in flight"
                          + (f" (or a cut block's {summed} sums over train_step's micro-batches)" if summed > 1 else ""),
                          "train"))
        items.append(Item("gradient buffers, blocks' own groups", n_own_grads, own_grad,
                          "a cut block's small modules: the block in backward, the one before in flight", "train"))
        items.append(Item("gradient buffers, the rest's sub-blocks", n_rest_grads, rest_grad,
                          "the head's and the embeddings': one in backward, the other's step in flight", "train"))
        items.append(Item("host accumulation staging", n_staging, staging, "gradients added on the host", "train"))
        if wanted.arenas:
            items.append(Item("host arena (host_budget)", wanted.arenas, k.arena,
                              ("swapped activations or " if wanted.swaps else "") + "train_step's kept inputs"
                              + " (beyond it: the SSD array)", "train"))
        items.append(Item("attach's buffer for groups' masters", 1, max((g.numel * 4 for g in groups), default=0),
                          "the daemon makes each group's state from it (resume reads them back)", phase="attach"))
        items.append(Item("a block's weights stored", 1, max((_stored(g) for g in groups), default=0),
                          "16-bit weights and frozen parameters, written once at attach", phase="attach"))
        items.append(Item("export's read buffer", 1, min(EXPORT_PIECE, max((g.numel * 4 for g in groups), default=0)),
                          "while export reads master weights", phase="export"))
        return MemoryPlan(k.prefetch, wanted.keep, n_slots, slot, bool(from_ssd), n_grads, grad, n_staging, staging,
                          k.arena, k.handoff, tuple(i for i in items if i.count and i.each), limits, shrunk,
                          limits.segment, own_slots=n_own_slots, own_slot_bytes=own_slot, own_grad_buffers=n_own_grads,
                          own_grad_bytes=own_grad, rest_slots=n_rest_slots, rest_slot_bytes=rest_slot,
                          rest_grad_buffers=n_rest_grads, rest_grad_bytes=rest_grad,
                          device_grad_buffers=min(1 + k.inflight, MemoryPlan.DEVICE_GRAD_BUFFERS) if pooled else 0)

    p0 = wanted.prefetch if wanted.prefetch is not None else depth(slot, MAX_PREFETCH)
    arena = wanted.host_budget if wanted.host_budget is not None else ARENA_DEFAULT
    knobs = _Knobs(prefetch=p0, spare=1 if from_ssd and slot < WINDOW else 0, inflight=depth(grad, p0 + 2),
                   handoff=bool(chunked_fp32), arena=arena, staging=depth(staging, MAX_STAGING))
    best = _shrink(knobs, build, limits, wanted, device_fits or (lambda p: True))
    if best.total <= limits.room:
        return best
    kept = sum(g.weight_bytes for g in groups if g.offload is True and g.strategy in ("resident", "host"))
    raise DoesNotFit(_refusal(best, wanted, limits, kept), best)


def _shrink(knobs: _Knobs, build, limits: Limits, wanted: Wanted, device_ok) -> MemoryPlan:
    """``build(knobs)``'s plan, given up step by step along the ladder while it is larger
    than the session's room, or (steps a device holds only) than ``device_ok`` allows."""
    shrunk: list[str] = []
    best = build(knobs)
    for what, smaller, on_device in _ladder(wanted):
        while (nxt := smaller(knobs)) is not None:
            short_pinned, short_device = best.total > limits.room, not device_ok(best)
            if not (short_pinned or short_device and on_device):
                break
            knobs = nxt
            trial = build(knobs, tuple(shrunk))
            saved = trial.total < best.total or short_device and device_ok(trial) != device_ok(best)
            if saved and what not in shrunk:  # (named only where it saved something)
                shrunk.append(what)
            best = build(knobs, tuple(shrunk))
    return best


REST_CLASS = 4  # the rest's sub-blocks get buffers of their own size past this many times a block's


def _classes(groups: list[GroupShape], size) -> tuple[int, int]:
    """(the largest ``size`` of the groups but the rest's sub-blocks, theirs where more than
    REST_CLASS times larger, else 0): a model cut in sub-blocks whose vocabulary-sized
    embeddings and head are several times any block's sub-block (a mixture of experts cut in
    parts, model/experts.py: Qwen3-30B-A3B's head is 8 of its parts) gets slots and gradient
    buffers of each size, rather than every one the head's; where they are about as large
    (a dense model's modules) one size serves all."""
    rest = max((size(g) for g in groups if g.unit == "rest"), default=0)
    others = max((size(g) for g in groups if g.unit != "rest"), default=0)
    return (others, rest) if others and rest > REST_CLASS * others else (max(others, rest), 0)


def _sub_block_sizes(offloaded: list[GroupShape], pooled: list[GroupShape]) -> tuple[int, int, int]:
    """Cut blocks (model/cuts.py): the bytes of a slot and of a gradient buffer for their
    own groups, and how many sub-blocks of one block train_step sums at once over its
    micro-batches (each sum parked on the host between them on a device with its own
    memory: gradients/pool.py); zeros without cut blocks."""
    per_unit: dict[str, int] = {}
    for g in pooled:
        if g.unit and not g.held:
            per_unit[g.unit] = per_unit.get(g.unit, 0) + 1
    return (max((g.fetched_bytes for g in offloaded if g.held), default=0),
            max((g.weight_bytes for g in pooled if g.held), default=0), max(per_unit.values(), default=0))


def _ladder(wanted: Wanted):
    """What the plan gives up, in order, each one step at a time (None: no further)."""
    def spare(k):
        return dataclasses.replace(k, spare=0) if k.spare else None

    def inflight(k):
        return dataclasses.replace(k, inflight=k.inflight - 1) if k.inflight > 1 else None

    def handoff(k):
        return dataclasses.replace(k, handoff=False) if k.handoff else None

    def arena(k):
        if wanted.host_budget is not None or k.arena <= ARENA_FLOOR:
            return None
        return dataclasses.replace(k, arena=max(ARENA_FLOOR, k.arena // 2))

    def prefetch(k):
        return dataclasses.replace(k, prefetch=k.prefetch - 1) if wanted.prefetch is None and k.prefetch else None

    def staging(k):
        return dataclasses.replace(k, staging=k.staging - 1) if k.staging > 1 else None

    def last_inflight(k):
        return dataclasses.replace(k, inflight=0) if k.inflight else None

    # (what, how, whether a device with its own memory holds it too)
    return [("arena bytes", arena, False), ("the spare weight slot", spare, True), ("steps in flight", inflight, True),
            ("the master handoff (4 more SSD bytes per parameter)", handoff, True),
            ("prefetch", prefetch, True), ("host accumulation staging", staging, True),
            ("overlap of steps with backward", last_inflight, True)]


def _stored(g: GroupShape) -> int:
    """What attach holds for a moment beside a group's masters: an offloaded block's
    weights in a 16-bit dtype and its frozen parameters, written to the SSD array."""
    weights = g.weight_bytes if g.offload is True and g.itemsize != 4 else 0
    return weights + (g.frozen_bytes if g.offload is True else 0)


def _fixed(groups: list[GroupShape], shares_host_memory: bool) -> list[Item]:
    """The buffers each group keeps for the whole run."""
    items = []
    for g in groups:
        if g.strategy == "resident":
            items.append(Item(f"{g.name} gradients", 1, g.weight_bytes, "kept until its step"))
        elif g.strategy == "host":
            items.append(Item(f"{g.name} gradients (fp32)", 1, g.numel * 4, "accumulated on the host"))
        elif g.strategy == "remote":
            items.append(Item(f"{g.name} gradients", 1, g.weight_bytes, "reduced to its optimizer rank"))
        elif g.strategy == "sharded":
            items.append(Item(f"{g.name} gradients", 1, g.weight_bytes, "reduce-scattered at its step"))
            items.append(Item(f"{g.name} shard", 2, g.shard * max(g.itemsize, 4), "this rank's shard"))
        if g.offload == "host" or (not g.offload and g.numel):
            items.append(Item(f"{g.name} weights", 1, g.weight_bytes, "written by each step"))
    return items


def _refusal(smallest: MemoryPlan, wanted: Wanted, limits: Limits, kept: int = 0) -> str:
    fixed = [f"{w}={v}" for w, v in (("prefetch", wanted.prefetch), ("keep", wanted.keep or None),
                                      ("host_budget", wanted.host_budget)) if v is not None]
    needed = max(smallest.total + limits.held + limits.others, (smallest.total + limits.held) * limits.sharers)
    ranks = (f"; this job's {limits.sharers} processes on this fuyoud take an equal part of its budget each"
             if limits.sharers > 1 else "")
    shared = (f"; fuyoud's other sessions hold {format_size(limits.others)} of its budget (allocated or reserved "
              "by their plans): it frees as they end (`fuyouctl sessions` lists them)" if limits.others else "")
    return (f"this model does not fit the session's pinned-memory budget: the smallest plan takes "
            f"{format_size(smallest.total)} and the session may take {format_size(limits.room)} (budget "
            f"{format_size(limits.session_budget)}{f', {format_size(limits.held)} held already' if limits.held else ''}"
            f"{ranks}{shared}). "
            + ("Wait for them, or raise" if limits.others else "Raise")
            + f" fuyoud's [memory] pinned_budget (and session_budget, if set) to at least "
            f"{format_size(needed)}"
            + (f", or leave {', '.join(fixed)} to the plan" if fixed else "")
            + "; bf16 weights halve the blocks' buffers."
            + (f" Every block keeps its gradients until the step ({format_size(kept)}: accumulation_steps > 1 or "
               "max_grad_norm): engine.train_step(micro_batches) adds a block's micro-batches up on the compute "
               "device and sends them once, and without clipping the blocks share a few gradient buffers."
               if kept > limits.room // 2 else "")
            + "\n" + smallest.describe())

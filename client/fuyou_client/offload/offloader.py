"""Parameter offload: a layer group's weights are in memory only while it computes.

Between uses a group's compute-dtype weights live on the SSD array: for fp32 training
they are the master weights themselves (the first slot of the optimizer state object,
read in place), otherwise the transient object ``weights/<group>`` that every step
rewrites. With ``offload="host"`` (a device with its own memory) they live in a shared
host buffer per group that every step rewrites instead, and a "fetch" is only the
upload. A handful of slots hold the groups in use:

* forward: a block's pre-hook makes its weights resident (waiting for the fetch if
  needed) and starts fetching the next ``prefetch`` blocks; its post-hook lets them go
  (the last block stays: backward starts there; so do the ``keep`` blocks before it,
  trading memory for SSD reads);
* saved tensors: autograd keeps weights (and views of them, like ``weight.t()``) for
  backward. A saved-tensors hook replaces any tensor that lives in a slot by a marker
  (group, offset, size, stride); in backward the marker becomes a view of the group's
  weights fetched again, and the first such request of a group starts fetching the
  ``prefetch`` groups before it. A slot is therefore never read after it was reused.
  Backward's fetches are served by the daemon from a read-ahead of the group's whole
  optimizer state, which the group's step uses moments later (one read, not two);
  when the daemon has no spare buffer, the client reads the weights itself;
* a group whose weights backward never unpacks (a first block whose input needs no
  gradient saves none) is made resident when its first gradient arrives, by a hook on
  its parameters: autograd shapes new gradients after their parameter, so that must
  not be an empty placeholder then;
* a group's weights go as soon as its gradients are complete (its step is then
  submitted). Parameters not resident are empty placeholders. A group whose step is
  done in chunks in the daemon (its state is larger than an optimizer buffer) and whose
  slot holds its fp32 master weights *lends* the slot to its step instead (``lend_for_step``,
  ``hands_over``): the step takes the masters from there rather than reading them from
  the SSD again, and the slot comes back when the step is done (a fetch that finds no
  free slot waits for the oldest lent one before it evicts a resident group). Such a
  group's backward fetch is a plain read: serving it from a read-ahead would hold daemon
  buffers the step needs.

How many slots: the memory plan's (memory/budget.py), by default the block computing,
``prefetch`` ahead, ``keep``, and a spare or the slots lent to steps in flight.

A slot is a shared host buffer (where the daemon puts the weights) and the compute
device's memory for them. On the CPU these are the same bytes. On a GPU a landed fetch
is uploaded on the upload stream as soon as the offloader sees it done (at the next
hook: prefetched blocks are uploaded while earlier ones compute), after the compute
stream has finished with the slot's previous group; a block's compute waits for its own
upload's event only, and the host buffer takes a new fetch only after its upload ran.
"""
from __future__ import annotations

from contextlib import contextmanager
from concurrent.futures import Future

import torch

from fuyou_client.device.devices import DONE, Device
from fuyou_client.model.blocks import flat_parts
from fuyou_client.offload.group import OffloadedGroup, Saved, SavedCast, Source, read_declined
from fuyou_client.offload.slots import Slot, SlotPool
from fuyou_client.connection.session import In, Session, all_of


class Offloader:
    """The weight slots and the fetches of the offloaded groups. The model's hooks
    (engine/hooks.py) call ``enter_forward``/``exit_forward`` around each block and
    ``gradient_arriving`` before a gradient lands; autograd's saved-tensor hooks call
    ``pack``/``unpack``; block-major (blockmajor/schedule.py) calls the same methods in
    its own order. ``on_backward(group)``: called when a group's backward begins (its
    weights resident). ``gather`` (data parallelism, parallel/sharded.py): the sources
    are this rank's shard, and ``gather(group, slot, fetch)`` returns the future of the
    whole group in the slot, gathered from the ranks."""

    def __init__(self, session: Session, device: Device, groups: list[OffloadedGroup], prefetch: int,
                 keep: int = 0, slots: list[int] | None = None, on_backward=None, gather=None):
        self.session = session
        self.device = device
        self.groups = groups
        self.prefetch = prefetch
        self.keep = keep  # blocks (the last ones) kept from forward to backward: fewer fetches, more memory
        if slots is None:  # (the memory plan's sizes: memory/budget.py MemoryPlan.slot_sizes)
            slots = [max(g.nbytes for g in groups)] * (prefetch + 2 + keep)
        # A group released keeps its weights in its slot until a fetch takes it: used again
        # before that (a sub-block over the micro-batches of train_step, a recomputed one in
        # backward, the last blocks of forward in backward) it needs no fetch. Forgotten when
        # the group's step is submitted (new weights) and at the barrier. Not with data
        # parallelism: every rank must fetch, and gather, in the same order.
        self._slots = SlotPool(session, device, slots, any(g.host is None for g in groups), caching=gather is None)
        self._deferred: list[tuple[OffloadedGroup, bool]] = []  # prefetches waiting for a slot (poll)
        self._entered = -1  # the last group forward entered (a group used again after it is not prefetched for)
        self.inputs_only = False  # (see input_gradients)
        # Set by train_step while a block runs for all but its last micro-batch: fetches ahead
        # stay within that block (a cut block's sub-blocks are used again by the next
        # micro-batch; fetching the next block's would evict them).
        self.prefetch_within: str | None = None
        self._recomputing: OffloadedGroup | None = None  # a cut block's own group, held while it is recomputed
        self._inputs_only_used: list[OffloadedGroup] = []
        self._clock = 0
        self._by_ptr: dict[int, OffloadedGroup] = {}
        self.fetched_bytes = 0  # weight bytes read from the SSD array for this client
        self.fetched_forward = 0  # of which for forward (the rest: backward's)
        self.served_bytes = 0  # weight bytes served from optimizer-state read-aheads (no extra read)
        self.reused_bytes = 0  # weight bytes used again from a released group's slot (no fetch, no upload)
        self.reuses = 0  # how many times
        self._on_backward = on_backward or (lambda g: None)
        self._gather = gather
        for g in groups:
            g.placeholders = [p.data for p in g.params]  # empty since the groups were placed
        # Blocks with no trained parameters: no gradient says when backward is done with
        # them; it is once backward asks for an earlier block.
        self._frozen_blocks = [g for g in groups if not any(p.requires_grad for p in g.params)]

    # -- residency ----------------------------------------------------------------------
    def _start_fetch(self, g: OffloadedGroup, backward: bool = False) -> None:
        """Start reading a group's weights into a free slot. In backward the daemon serves
        them from a read-ahead of the group's optimizer state, which the group's step, due
        right after, then uses: one SSD read instead of two (unless the group lends its
        slot to its step instead: ``lend``)."""
        if g.slot is not None or g.fetch is not None or g.cached is not None:
            return
        self._slots.take_back()
        slot = self._slots.take(g)
        if slot is not None:
            self._fetch_into(g, slot, backward)
        elif self._slots.lent and not any(d is g for d, _ in self._deferred):  # (when a lent slot is back: poll)
            self._deferred.append((g, backward))

    def forget(self, g: OffloadedGroup) -> None:
        """The group's step was submitted: weights cached from before it are stale."""
        self._slots.forget(g)

    def _reland(self, g: OffloadedGroup) -> None:
        """A cached group resident again: its slot still holds its weights (on the device too)."""
        slot = self._slots.reclaim(g)
        g.slot, g.ready = slot, slot.uploaded
        self.reused_bytes += g.nbytes
        self.reuses += 1
        self._point(g, slot)

    def poll(self) -> None:
        """Cheap, called often (each gradient): slots lent to steps that are done are free
        again, and the fetches deferred for want of a slot start in them."""
        if not self._slots.lent and not self._deferred:
            return
        self._slots.take_back()
        waiting, self._deferred = self._deferred, []
        for g, backward in waiting:
            if g.slot is not None or g.fetch is not None or g.cached is not None:
                continue
            slot = self._slots.take(g)
            if slot is None:
                self._deferred.append((g, backward))
            else:
                self._fetch_into(g, slot, backward)

    def _lend(self, g: OffloadedGroup):
        """Backward is done with the group's weights, and its step will read its fp32 masters
        from the slot: the parameters let go of it as with ``release``, but the slot is out of
        use until its step is done (SlotPool.lent_until). Returns the slot's shared buffer."""
        slot = g.slot
        self.release(g, lend=True)
        self._slots.lend(slot)
        return slot.host

    def take_back_all(self) -> None:
        """(at the barrier, every step landed) Every lent slot is free again; prefetches
        still deferred are forgotten (the next forward asks again)."""
        self._slots.take_back_all()
        self._deferred.clear()
        self.forget_all()

    def forget_all(self) -> None:
        """Every cached group forgotten (at the barrier: the steps wrote new weights)."""
        self._slots.forget_all()
        self._entered = -1

    def _fetch_into(self, g: OffloadedGroup, slot: Slot, backward: bool) -> None:
        slot.uploaded.synchronize()  # the host buffer's last upload has run (normally long ago)
        self._deferred = [(d, b) for d, b in self._deferred if d is not g]
        via_state = backward and not g.hands_over
        g.fetch_slot, g.fetch_via_state, g.fetch_backward = slot, via_state, backward
        if g.host is not None or not g.sources:  # nothing to read: the upload starts when the fetch lands
            g.fetch = Future()  # (no sources: an optimizer-host worker's group, which the gather brings)
            g.fetch.set_result(False if g.host is not None else [])
        elif via_state:  # (a list: per source, served (True), declined (False) or read (None))
            g.fetch = all_of([self.session.fetch_weights_async(s.part, slot.host, g.dtype, out_offset=s.offset)
                              if s.part else self._read([s], slot) for s in g.sources])
        else:
            g.fetch = self._read(g.sources, slot)
        if self._gather is not None:  # (every rank starts its fetches in the same order)
            g.fetch = self._gather(g, slot, g.fetch)

    def _read(self, sources: list[Source], slot: Slot) -> Future:
        return self.session.swap_in_async([In(s.object, slot.host, s.offset, s.length, s.object_offset)
                                           for s in sources])

    def ensure(self, g: OffloadedGroup, backward: bool = False) -> None:
        """Make the group's weights resident (waits for its fetch); the compute stream's
        next work waits for their upload."""
        if g.slot is None and g.cached is not None:
            self._reland(g)
        elif g.slot is None:
            if g.fetch is None:
                self._fetch_into(g, self._slot_for(g), backward)
            self._land(g)
        self.device.wait(g.ready)

    def _slot_for(self, g: OffloadedGroup) -> "Slot":
        """A slot for a fetch that cannot wait: a free one, else the oldest lent one once its
        step is done, else a resident group's (evicted)."""
        self._slots.take_back()
        if self._slots.lent and not self._slots.could_take(g):
            self._slots.take_back(wait=True)
        return self._slots.take(g) or self._evict(g)

    def _land(self, g: OffloadedGroup) -> None:
        """A fetch is done (or waited for): upload it and point the parameters at it."""
        served = g.fetch.result()  # (waits for the reads; via the state: per source, served or not)
        if not g.fetch_via_state:
            served = [None] * len(g.sources)
        slot = g.fetch_slot
        if g.host is None:  # (offload="host": nothing was read)
            read_declined(self.session, g.sources, served, slot.host)
            read = sum(s.length for s, ok in zip(g.sources, served) if not ok)
            self.served_bytes += sum(s.length for s, ok in zip(g.sources, served) if ok)
            self.fetched_bytes += read
            if not g.fetch_backward:
                self.fetched_forward += read
        g.slot, g.fetch, g.fetch_slot = slot, None, None
        if self._gather is not None:  # (data parallel: gathered in the slot's device memory already)
            slot.uploaded = DONE
        elif not self.device.shares_host_memory:
            source = g.host if g.host is not None else slot.host
            slot.uploaded = self.device.upload(slot.device[:g.nbytes], source.tensor(torch.uint8)[:g.nbytes],
                                               after=slot.released)
            if g.host is not None:
                g.host_uploaded = slot.uploaded
        g.ready = slot.uploaded
        self._point(g, slot)

    def _point(self, g: OffloadedGroup, slot: "Slot") -> None:
        """The group's parameters become views of the slot's weights."""
        with torch.inference_mode(False):  # (an eval forward under inference_mode: still plain tensors)
            flat = slot.weights(g.dtype)
            self._by_ptr[flat.untyped_storage().data_ptr()] = g
            for p, shape, part in zip(g.params, g.shapes, flat_parts(flat, g.shapes)):
                p.data = part.view(shape)

    def _poll(self) -> None:
        """Land the fetches that are done, so that their uploads overlap compute."""
        if self.device.shares_host_memory:
            return
        for g in self.groups:
            if g.fetch is not None and g.fetch.done():
                self._land(g)

    def _evict(self, wanted: OffloadedGroup):
        """All slots hold groups (parameters that got no gradient keep a group resident
        until the step; a model called twice keeps more): free the least recently used one
        that is not computing. Its saved tensors are markers, so a later use fetches it again."""
        victims = [g for g in self.groups if g.slot is not None and g is not wanted and not g.busy
                   and g.slot.nbytes >= wanted.nbytes]
        if victims:
            self.release(min(victims, key=lambda g: g.last_used), cache=False)
            return self._slots.free.pop()
        ahead = [g for g in self.groups if g.fetch is not None and g is not wanted and g.fetch_slot.nbytes >= wanted.nbytes]
        if ahead:  # (prefetches hold the other slots: the one asked for first is given up, read or not)
            g = ahead[0]
            g.fetch.exception()  # (waits: the slot is written no more)
            slot, g.fetch, g.fetch_slot = g.fetch_slot, None, None
            return slot
        raise RuntimeError(f"no weight slot for {wanted.name}: all {self._slots.count} hold blocks computing "
                           "right now; attach with a larger prefetch or keep")

    def release(self, g: OffloadedGroup, keep_params: bool = False, lend: bool = False, cache: bool = True) -> None:
        """Give the group's slot back; its parameters become empty placeholders (unless
        ``keep_params``: the caller has already pointed them elsewhere; ``lend``: the slot
        goes to the group's step, see ``lend``). The slot keeps its weights, cached, until
        another group takes it (``cache=False``: not)."""
        if g.slot is None:
            return
        if not keep_params:
            for p, ph in zip(g.params, g.placeholders):
                p.data = ph
        self._by_ptr.pop(g.slot.weights(g.dtype).untyped_storage().data_ptr(), None)
        g.slot.released = self.device.record()  # the compute enqueued so far may still read it
        if lend:
            pass
        elif cache and not keep_params:
            self._slots.keep(g, g.slot)
        else:
            self._slots.free.append(g.slot)
        g.slot, g.ready = None, DONE

    def release_all(self) -> None:
        """Every group's slot given back, its parameters empty placeholders, and every
        prefetch waited for (its slot is written no more). A prefetch that failed is
        raised once all of them are released (none is left resident or in flight)."""
        error = None
        for g in self.groups:
            if g.fetch is not None:  # let a prefetch land before its slot is reused
                exc = g.fetch.exception()
                error = error or exc
                self._slots.free.append(g.fetch_slot)
                g.fetch = g.fetch_slot = None
            self.release(g, cache=False)
        self.forget_all()
        if error is not None:
            raise error

    # -- hooks ----------------------------------------------------------------------------
    def _touch(self, g: OffloadedGroup) -> None:
        self._clock += 1
        g.last_used = self._clock

    def enter_forward(self, g: OffloadedGroup) -> None:
        """Before the block's forward: its weights resident, the next blocks' fetches started."""
        g.in_backward = False
        # A cut block recomputed in backward: its sub-blocks' fetches are backward's (served from
        # the read-ahead of the state their steps then use), and the next block's groups are
        # not what backward needs next.
        recomputing = self._recomputing is not None and g.unit == self._recomputing.unit
        self.ensure(g, backward=recomputing)
        g.busy = True
        self._touch(g)
        within = self.prefetch_within or (self._recomputing.unit if self._recomputing is not None else None)
        if len(g.uses) < 2 or g.index > self._entered:  # (a tied head, used again late: forward is past the rest)
            for nxt in self.groups[g.index + 1:g.index + 1 + self.prefetch]:
                if within in (None, nxt.unit):
                    self._start_fetch(nxt, backward=recomputing)
        self._entered = max(self._entered, g.index)
        self._poll()

    def exit_forward(self, g: OffloadedGroup) -> None:
        """After the block's forward: its slot free again (not the last ``keep`` + 1 blocks')."""
        g.busy = False
        if g.index < len(self.groups) - 1 - self.keep:  # the last block stays: backward starts with it
            self.release(g)

    def pack(self, t: torch.Tensor):
        g = self._by_ptr.get(t.untyped_storage().data_ptr())
        if g is None:
            return self._pack_cast(t)
        if t.dtype != g.dtype:
            return t
        return Saved(g, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _pack_cast(self, t: torch.Tensor):
        """A dtype copy of an offloaded weight (its grad_fn a ToCopy of the parameter) as a
        marker; any other tensor as it is."""
        fn = t.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0":
            return t
        source = getattr(fn.next_functions[0][0], "variable", None)  # (AccumulateGrad: a parameter)
        if (source is None or source.device != t.device or source.shape != t.shape
                or source.stride() != t.stride()):  # (a copy to another device, or reshaped: kept as it is)
            return t
        weight = self.pack(source)
        return SavedCast(weight, t.dtype) if isinstance(weight, Saved) else t

    def unpack(self, saved):
        if isinstance(saved, SavedCast):
            return self.unpack(saved.weight).to(saved.dtype)
        if not isinstance(saved, Saved):
            return saved
        g = saved.group
        self.ensure_for_backward(g)
        self._poll()
        if self.inputs_only:
            self._touch(g)
            if not any(u is g for u in self._inputs_only_used):
                self._inputs_only_used.append(g)
        else:
            self.begin_backward(g)
        return g.slot.weights(g.dtype).as_strided(saved.size, saved.stride, saved.offset)

    def ensure_for_backward(self, g: OffloadedGroup, ahead: bool = True) -> None:
        """A group's weights for its backward (or its recomputed forward); the first
        request of a group starts fetching the ``prefetch`` groups before it, which
        backward needs next (unless ``ahead`` is False)."""
        if not g.in_backward:  # (once per group and backward, not per saved tensor)
            for done in self._frozen_blocks:
                if done.index > g.index and done.slot is not None and not done.busy:
                    self.release(done)
        if g.slot is None:
            self.ensure(g, backward=True)
            for prev in reversed(self.groups[max(0, g.index - self.prefetch):g.index] if ahead else []):
                if self.prefetch_within in (None, prev.unit):
                    self._start_fetch(prev, backward=True)
        else:
            self.device.wait(g.ready)

    def gradient_arriving(self, g: OffloadedGroup) -> None:
        """Before autograd adds a gradient to one of the group's parameters (it shapes it after
        the parameter, which must not be an empty placeholder then)."""
        self.ensure(g, backward=True)
        self.begin_backward(g)

    def begin_backward(self, g: OffloadedGroup) -> None:
        """The group's backward begins (its weights resident)."""
        self._touch(g)
        if not g.in_backward:
            g.in_backward = True
            self._on_backward(g)

    def next_micro_batch(self, g: OffloadedGroup) -> None:
        """A cut block's sub-blocks begin another micro-batch's backward with no forward
        between (train_step's swapped blocks: blockmajor/swapped.py): each begins its
        backward again, as a recomputed forward would have it (its gradient sum comes back)."""
        for sub in self.groups:
            if sub.unit == g.unit and sub is not g:
                sub.in_backward = False

    def hold(self, g: OffloadedGroup) -> None:
        """The group's weights for its backward (or recomputed forward), held until
        ``backward_done``: the graph being built refers to them, so no eviction. (A block
        cut into sub-blocks: its own group; the sub-blocks come as their modules run, and
        the groups before it are fetched only once backward reaches them.)"""
        self.ensure_for_backward(g, ahead=not g.cut)
        g.busy = True
        if g.cut:
            self._recomputing = g

    def let_go(self, g: OffloadedGroup) -> None:
        """The group's weights may be evicted again (its slot stays until then)."""
        g.busy = False
        if self._recomputing is g:
            self._recomputing = None

    def backward_done(self, g: OffloadedGroup) -> None:
        """Backward is done with the group's weights: its slot is free again (cached until
        the group's step is submitted, for the next micro-batch of an accumulation)."""
        g.busy = False
        if self._recomputing is g:
            self._recomputing = None
        self.release(g)
        self._entered = -1  # (the next forward starts over)

    def lend_for_step(self, g: OffloadedGroup, submit) -> None:
        """Backward is done with the group's weights and its step takes the fp32 masters from
        its slot: ``submit(buffer)`` sends the step (returns its future); the slot is free
        again once that step is done."""
        g.busy = False
        self._slots.lent_until(submit(self._lend(g)))

    @contextmanager
    def input_gradients(self):
        """A backward that takes input gradients only (train_step's tail: the gradient of the
        loss with respect to the last block's output): a group whose weights it unpacks (an
        offloaded head, model/cuts.py) does not begin its backward (no gradient buffer for it
        yet) and is released after it."""
        self.inputs_only = True
        try:
            yield
        finally:
            self.inputs_only = False
            for g in self._inputs_only_used:
                if not g.busy and not g.in_backward:
                    self.release(g)
            self._inputs_only_used.clear()

    def let_go_all(self) -> None:
        """(a step abandoned) No group is held any more; every slot and fetch is given back."""
        for g in self.groups:
            g.busy = False
        self._recomputing, self.prefetch_within = None, None
        self.release_all()

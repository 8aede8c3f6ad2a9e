"""Out-of-core optimizer groups: state on the SSD array, stepped on the CPU.

A group's state is one persistent object, ``optim/<group>``:

    [4 KiB header: spec, numel, step] [fp32 master weights] [exp_avg] [exp_avg_sq]

(each slot 4 KiB aligned; SGD keeps weights and its momentum buffer; AdamW's moments
may be bf16 or int8 with their scales: layout.py). A step reads the
object into a daemon buffer, runs the fused kernel on the gradients in the client's
shared buffer, writes the new compute-dtype weights into the client's shared buffer,
and commits the state as a new version of the object (the header's step count with
it: one atomic commit). A step whose new state would hold a NaN or an infinity is
refused (NonFinite) before anything is committed: the group keeps its state and step
count. Steps of one group run in order; steps of different groups run
concurrently, so with the client submitting groups as backward finishes them the
daemon reads group g+1, steps g and writes g-1 at once. After each step it prefetches
the state of the group expected next (the order of the previous iteration; at first,
the reverse of creation order, which is backward's), within the buffer budget.

The state cache: where the buffers are more than one step's working set, a buffer
stays with the group just stepped, holding its committed state (the step's own copy),
as long as CACHE_RESERVE buffers stay free for the steps, read-aheads and FetchWeights
of the other groups and no step waits for a buffer; the group's next step, and FetchWeights, then read nothing from
the SSD (the write-back stays: every step commits its state). Kept buffers stay with
their groups between iterations (the first groups to find one spare keep theirs: a
cyclic order gains nothing from replacing them) and are given back when a step finds no
buffer free, or its session's budget of buffers full (then one of the session's own;
StateBuffers.evict), when the group is deleted, replaced or restored, or
when its session ends. The bytes served so are counted (StepResult.cached_bytes).

A group whose step does not fit one optimizer buffer (``Group.buffer_bytes`` above
``[optimizer] buffer_budget / buffers``) is created and stepped in chunks (chunks.py),
with the same arithmetic and one atomic commit per step; its state is never read ahead
whole (no prefetch); FetchWeights reads its master weights into spare buffers that its
step then uses (held.py). Its new weights reach ``out`` chunk by chunk
while the step runs, before the commit: a step that fails after that (a later chunk not
finite, an I/O error) first puts the committed weights back into ``out``, so that there
too weights and state never disagree once the step has returned or raised.

(Past ~500 lines on purpose: ``Optimizer`` is one class because its steps, FetchWeights,
the read-ahead and the state cache share one lock, one order of groups and one set of
buffers. What stands apart is elsewhere: a group's record in group.py, chunked steps in
chunks.py and chunk_io.py, the weights kept for them in held.py.)
"""
from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from fuyoud import failpoints
from fuyoud.concurrency.fairness import FairTurns, Tenant
from fuyoud.errors import DataLoss, FuyouError, InvalidArgument, NonFinite, NotFound
from fuyoud.optimizer import chunks
from fuyoud.optimizer import held as held_weights
from fuyoud.optimizer import lowp
from fuyoud.optimizer.buffers import StateBuffers
from fuyoud.optimizer.group import DTYPES, Group, StepResult, state_bytes, state_name
from fuyoud.optimizer import tensors
from fuyoud.optimizer.kernels import OptimizerSpec, all_finite, step as run_kernel
from fuyoud.optimizer.tensors import Piece
from fuyoud.optimizer.layout import HEADER
from fuyou_proto.contract import STATE_PREFIX, group_of
from fuyoud.concurrency.threads import Threads
from fuyoud.storage.store import ReadItem, Store, WriteItem

log = logging.getLogger(__name__)
CACHE_RESERVE = 3  # buffers the state cache leaves free: a step, a read-ahead and a FetchWeights in backward
@contextmanager
def _stepping_with(group: Group, hyper: OptimizerSpec | None) -> Iterator[None]:
    """(group.lock held) The step runs with ``hyper`` as the group's spec (its header
    commits it); a step that does not commit leaves the group's own."""
    before, step = group.spec, group.step
    if hyper is not None:
        group.spec = hyper
    try:
        yield
    finally:
        if group.step == step:
            group.spec = before


def _tensor(view: memoryview, dtype: torch.dtype, numel: int) -> torch.Tensor:
    t = torch.frombuffer(view, dtype=dtype)
    if t.numel() < numel:
        raise InvalidArgument(f"buffer holds {t.numel()} {dtype} elements, the group has {numel}")
    return t[:numel]


class Optimizer:
    def __init__(self, store: Store, buffers: StateBuffers, cache: bool = True, threads: Threads | None = None,
                 tenant: Tenant | None = None):
        self.store = store
        self.buffers = buffers
        self.cache = cache  # keep states in spare buffers between steps
        self._threads = threads or Threads("optimizer")  # the read-aheads (joined by close)
        buffers.evict = self._evict_one
        self._groups: dict[tuple[str, str], Group] = {}
        self._lock = threading.Lock()
        # One kernel at a time (it is memory-bound and uses every core), the users and their jobs
        # served in turn while several wait (concurrency/fairness.py; ``tenant``: a namespace's user
        # and job): a job with many groups in flight does not take the CPU from one with few, nor
        # a user with many jobs from one with one.
        self._compute = FairTurns(1, tenant)
        self._scratch = lowp.Scratch()  # the reduced-precision kernels' temporaries (under _compute)
        self._order: dict[str, list[str]] = {}  # namespace -> step order of the last iteration
        self._current: dict[str, list[str]] = {}

    # -- groups -----------------------------------------------------------------------------
    def create(self, namespace: str, session_id: int, name: str, spec: OptimizerSpec, body: memoryview,
               numel: int, step: int = 0) -> Group:
        """A new group of ``numel`` parameters at step count ``step``. ``body`` is what
        follows the header in its state object: either the fp32 master weights only
        (``numel * 4`` bytes; the rest, moments and padding, starts at zero) or the whole
        slot area (``state_bytes - HEADER``: a state assembled from other groups', to
        re-shard a job's optimizer state). Creating an existing group replaces it."""
        layout = spec.layout(numel)
        if numel <= 0 or len(body) not in (numel * 4, layout.size - HEADER):
            raise InvalidArgument(
                f"group {name!r}: {numel} parameters take {numel * 4} bytes of fp32 weights or {layout.size - HEADER} "
                f"bytes of whole state ({spec.kind}, {spec.state_dtype}), got {len(body)}")
        if step and len(body) != layout.size - HEADER:
            raise InvalidArgument(f"group {name!r}: a step count ({step}) needs the whole state, not weights only")
        group = Group(namespace, name, spec, numel, step)
        header = spec.header(numel, step).ljust(HEADER, b"\0")
        if self.chunked(group):  # the state in pieces, never whole in memory
            plan = group.chunk_plan(self.buffers.per_buffer)
            with self.buffers.acquire(plan.buffer_bytes(0), namespace) as buf:
                chunks.create(self.store, buf, plan, namespace, state_name(name), header, body, session_id)
        else:
            with self.buffers.acquire(group.nbytes, namespace) as buf:  # (a copy: the client's memory may change meanwhile)
                buf[:HEADER] = header
                slots = buf[HEADER:]
                slots[:len(body)] = body
                torch.frombuffer(slots, dtype=torch.uint8)[len(body):].zero_()  # padding, moments, scales
                self.store.write([WriteItem(namespace, state_name(name), buf, persistent=True,
                                            session_id=session_id)])
        with self._lock:
            old = self._groups.get((namespace, name))
            self._groups[(namespace, name)] = group
        if old is not None:
            self._retire(old)
        with self._lock:
            order = self._order.setdefault(namespace, [])
            if name not in order:
                order.insert(0, name)  # backward visits groups in reverse creation order
        return group

    def chunked(self, group: Group) -> bool:
        """Whether the group's steps are too large for one buffer and go in chunks."""
        return not self.buffers.fits(group.buffer_bytes)

    def get(self, namespace: str, name: str) -> Group:
        """The group, loaded from its state object's header after a restart."""
        with self._lock:
            group = self._groups.get((namespace, name))
        if group is not None:
            return group
        try:
            meta = self.store.stat(namespace, state_name(name))
        except NotFound:
            raise NotFound(f"no optimizer group {name!r} in namespace {namespace!r}") from None
        with self.buffers.acquire(HEADER) as buf:
            self.store.read([ReadItem(namespace, state_name(name), buf[:HEADER])])
            try:
                spec, numel, step = OptimizerSpec.parse_header(bytes(buf[:HEADER]))
            except ValueError:
                raise InvalidArgument(f"object {state_name(name)!r} is not an optimizer state") from None
        if meta.size != state_bytes(spec, numel):
            raise InvalidArgument(f"optimizer state {state_name(name)!r} has the wrong size")
        with self._lock:
            return self._groups.setdefault((namespace, name), Group(namespace, name, spec, numel, step))

    def groups_of(self, namespace: str) -> list[Group]:
        """Every group of a namespace, those only on SSD (after a restart) loaded too."""
        names = [group_of(m.name) for m in self.store.list(namespace, STATE_PREFIX)]
        return sorted((self.get(namespace, n) for n in names), key=lambda g: g.name)

    def loaded(self, namespace: str) -> list[Group]:
        """The namespace's groups in memory (cheap: for status displays)."""
        with self._lock:
            return [g for (ns, _), g in self._groups.items() if ns == namespace]

    def forget(self, namespace: str, name: str | None = None) -> None:
        """Drop cached groups (of a session that ended, or one whose state was deleted);
        the state objects stay on SSD unless deleted."""
        with self._lock:
            gone = [g for (ns, n), g in self._groups.items() if ns == namespace and name in (None, n)]
            for g in gone:
                del self._groups[(g.namespace, g.name)]
        for g in gone:
            self._retire(g)
        if name is None:
            with self._lock:
                self._order.pop(namespace, None)
                self._current.pop(namespace, None)

    def _retire(self, group: Group) -> None:
        """No longer the live group of its name: give back its read-ahead, refuse new ones."""
        with group.lock:
            group.dead = True
            if group.prefetched is not None:
                self.buffers.release(group.prefetched)
                group.prefetched, group.cached = None, False
            if group.held is not None:
                group.held.release()
                group.held = None

    # -- stepping -----------------------------------------------------------------------------
    def step(self, group: Group, grads: memoryview, grad_dtype: str, out: memoryview | None, out_dtype: str,
             lr: float, grad_scale: float, session_id: int, weights_object: str = "",
             hyper: OptimizerSpec | None = None, masters: memoryview | None = None,
             pieces: Sequence[Piece] = ()) -> StepResult:
        """One step. The new weights go, in ``out_dtype``, to the client's ``out`` buffer
        and/or to the transient object ``weights_object`` (for clients that offload them).
        ``hyper``: this step's hyperparameters (a scheduler may change betas, eps, weight
        decay between steps), the group's from its commit on; its layout must be the
        group's. ``masters``: the group's fp32 master weights as the client holds them (read
        for its backward); a chunked step takes them from there instead of the SSD, a
        whole-group step ignores them. ``pieces``: the tensors behind the elements
        (tensors.py: each element stepped as torch.optim steps its tensor).

        Nothing non-finite reaches the state: ``lr`` and ``grad_scale`` must be finite and
        non-negative (InvalidArgument, before anything is read), and a step whose new state
        (weights or moments) holds a NaN or an infinity (NaN or infinite gradients, or an
        update that overflows) is refused with NonFinite: nothing is committed or written
        to ``out``, and the group keeps its state and step count."""
        for what, value in (("learning rate", lr), ("grad_scale", grad_scale)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"group {group.name!r}: {what} must be a finite number >= 0, got {value!r}")
        if grad_dtype not in DTYPES or ((out is not None or weights_object) and out_dtype not in DTYPES):
            raise InvalidArgument(f"dtypes must be one of {sorted(DTYPES)}")
        if hyper is not None and (hyper.kind, hyper.state_dtype, hyper.slot_list()) != (
                group.spec.kind, group.spec.state_dtype, group.spec.slot_list()):
            raise InvalidArgument(f"group {group.name!r}: a step's hyperparameters must keep the group's optimizer, "
                                  f"state dtype and state layout ({group.spec.kind}, {group.spec.state_dtype}, "
                                  f"{'with' if len(group.spec.slot_list()) > 1 else 'without'} momentum); "
                                  f"got {hyper.kind}, {hyper.state_dtype}")
        grad = _tensor(grads, DTYPES[grad_dtype], group.numel)
        out_t = _tensor(out, DTYPES[out_dtype], group.numel) if out is not None else None
        self._note_order(group)
        if self.chunked(group):
            client = held_weights.ClientMasters(_tensor(masters, torch.float32, group.numel), group.step) \
                if masters is not None else None
            result = self._step_chunked(group, grad, out_t, DTYPES[out_dtype] if weights_object else None, lr,
                                        grad_scale, session_id, weights_object, hyper, client, pieces)
            self._prefetch_next(group)  # (a group that fits, after this one)
            return result
        with group.lock:
            if group.dead:
                raise NotFound(f"optimizer group {group.name!r} was deleted or replaced while this step waited")
            buf, prefetched, cached = group.prefetched, group.prefetched is not None, group.cached
            group.prefetched, group.cached = None, False
            if buf is None:
                buf = self.buffers.acquire_blocking(group.buffer_bytes, group.namespace)
            t0 = time.perf_counter()  # after waiting for a buffer: read time is the read's own
            keep = False
            try:
                with _stepping_with(group, hyper):
                    if out_t is None and weights_object:
                        out_t = _tensor(buf[group.nbytes:], DTYPES[out_dtype], group.numel)
                    result = self._step_locked(group, buf[:group.nbytes], grad, out_t, lr, grad_scale, session_id,
                                               t0, prefetched, pieces)
                    if weights_object:
                        raw = memoryview(out_t.view(torch.uint8).numpy())
                        self.store.write([WriteItem(group.namespace, weights_object, raw, False, session_id)])
                    # The buffer holds the state just committed: the cache keeps it if enough
                    # stay free and no step waits for it.
                    keep = self.cache and self.buffers.may_keep(buf, CACHE_RESERVE)
                    if keep:
                        group.prefetched, group.cached = buf, True
            finally:
                if not keep:
                    self.buffers.release(buf)
            if cached:
                result.cached_bytes = group.nbytes
        self._prefetch_next(group)  # after our buffer is back: read-ahead needs a spare one
        return result

    def _evict_one(self, namespace: str | None = None, cheaper_than: int | None = None) -> bool:
        """Give back one buffer the state cache keeps (for a step that found none free);
        False if there is none to give (or each is in use by its group right now). With
        ``namespace`` (a session at its budget of buffers), one of that session's. With
        ``cheaper_than`` (FetchWeights finding no buffer spare: declining costs the client
        that many bytes of weight reads), only a state smaller than that, the smallest
        first: its next step reads fewer bytes than the decline would (a small group such
        as "rest" otherwise keeps a whole buffer while blocks' weights are read twice)."""
        with self._lock:
            kept = [g for g in self._groups.values() if g.cached and namespace in (None, g.namespace)]
        if cheaper_than is not None:
            kept = sorted((g for g in kept if g.nbytes < cheaper_than), key=lambda g: g.nbytes)
        for group in kept:
            if not group.lock.acquire(blocking=False):
                continue
            try:
                if group.cached and group.prefetched is not None:
                    self.buffers.release(group.prefetched)
                    group.prefetched, group.cached = None, False
                    return True
            finally:
                group.lock.release()
        return False

    def cached_bytes(self) -> int:
        """State bytes the cache holds now (for metrics)."""
        with self._lock:
            return sum(g.nbytes for g in self._groups.values() if g.cached)

    def _step_locked(self, group: Group, state: memoryview, grad: torch.Tensor, out: torch.Tensor | None,
                     lr: float, grad_scale: float, session_id: int, t0: float, prefetched: bool,
                     pieces: Sequence[Piece] = ()) -> StepResult:
        name = state_name(group.name)
        if not prefetched:
            self.store.read([ReadItem(group.namespace, name, state)])
        t1 = time.perf_counter()
        n, layout = group.numel, group.spec.layout(group.numel)
        slots = layout.tensors(state)
        with self._compute.turn(group.namespace):
            g = grad  # the kernels only read gradients: no copy unless they must change
            if grad.dtype != torch.float32:
                g = grad.float()
            if grad_scale != 1.0:
                g = g.clone() if g is grad else g
                g.mul_(grad_scale)  # global-norm clipping: the client's clip coefficient
            run_kernel(group.spec, group.step, slots, g, lr, self._scratch, pieces)
            if not self._finite(layout, state, slots):
                raise self._non_finite(group, grad, g, lr, grad_scale)  # the buffer is dropped: nothing kept
        state[:HEADER] = group.spec.header(n, group.step + 1).ljust(HEADER, b"\0")
        t2 = time.perf_counter()
        self.store.write([WriteItem(group.namespace, name, state, persistent=True, session_id=session_id)])
        group.step += 1
        if out is not None:  # only once committed: weights and state never disagree
            out.copy_(slots[0])
        t3 = time.perf_counter()
        return StepResult(group.step, t1 - t0, t2 - t1, t3 - t2, prefetched)

    def _step_chunked(self, group: Group, grad: torch.Tensor, out: torch.Tensor | None,
                      weights_dtype: torch.dtype | None, lr: float, grad_scale: float, session_id: int,
                      weights_object: str, hyper: OptimizerSpec | None,
                      client: "held_weights.ClientMasters | None" = None,
                      pieces: Sequence[Piece] = ()) -> StepResult:
        """A step of a group larger than a buffer, chunk by chunk (chunks.py), in one
        buffer, or in up to three (one per stage: larger chunks, fewer and longer
        transfers) when that many are free without waiting and one stays free. Each
        chunk's new weights go to ``out`` once the chunk is checked; if the step then
        fails, the committed weights are put back there before the error is raised."""
        per_buffer = self.buffers.per_buffer
        group.chunk_plan(per_buffer)  # (refused before waiting when a buffer is too small)
        written = 0  # elements [0, written) of out hold new weights

        def compute(a: int, b: int, slots: list[torch.Tensor], weights: torch.Tensor | None) -> None:
            nonlocal written
            part = grad[a:b]
            with self._compute.turn(group.namespace):
                g = part if part.dtype == torch.float32 else part.float()
                if grad_scale != 1.0:
                    g = g.clone() if g is part else g
                    g.mul_(grad_scale)
                run_kernel(group.spec, group.step, slots, g, lr, self._scratch, tensors.within(pieces, a, b))
                if not all(all_finite(s) for s in group.spec.layout(b - a).floating(slots)):
                    raise self._non_finite(group, part, g, lr, grad_scale)
                if weights is not None:
                    weights.copy_(slots[0])
                if out is not None:
                    out[a:b].copy_(weights if weights is not None else slots[0])
                    written = b

        with group.lock:
            if group.dead:
                raise NotFound(f"optimizer group {group.name!r} was deleted or replaced while this step waited")
            held, group.held = group.held, None
            if held is not None and (held.step != group.step or client is not None):  # (stale, or not needed)
                held.release()
                held = None
            if client is not None:  # (the client's copy of this step count's masters)
                held = client
            bufs = []
            try:
                bufs.append(self.buffers.acquire_blocking(per_buffer, group.namespace))
                # More buffers (larger chunks) only while one stays free (of the pool and of
                # the session's budget) and no step waits; with weights held (backward reads
                # the next groups' weights) while two stay free. Never waiting here, a step
                # holding buffers cannot deadlock with one waiting ahead of it.
                while len(bufs) < chunks.STAGES:
                    more = self.buffers.try_acquire(per_buffer, leave=1 if held is None else 2,
                                                    owner=group.namespace)
                    if more is None:
                        break
                    bufs.append(more)
                plan = group.chunk_plan(per_buffer, len(bufs))
                with _stepping_with(group, hyper):
                    header = group.spec.header(group.numel, group.step + 1).ljust(HEADER, b"\0")
                    try:
                        timing = chunks.step(self.store, bufs, plan, group.namespace, state_name(group.name),
                                             header, session_id, compute, weights_object, weights_dtype, held)
                    except BaseException as exc:
                        if written:
                            self._restore_out(group, plan.stages(bufs)[0], plan, out, written, exc)
                        raise
                    group.step += 1
            finally:
                for buf in bufs:
                    self.buffers.release(buf)
                if held is not None:
                    held.release()
        return StepResult(group.step, timing.read_s, timing.compute_s, timing.write_s, False,
                          cached_bytes=held.nbytes if held is not None and client is None else 0,
                          masters_bytes=held.nbytes if client is not None else 0)

    def _restore_out(self, group: Group, area: memoryview, plan: chunks.ChunkPlan, out: torch.Tensor, end: int,
                     exc: BaseException) -> None:
        """After a failed chunked step: the committed weights of elements [0, end) back
        into ``out`` (the state object's version is the one the step started from),
        through ``area``, memory of the step's."""
        try:
            chunks.read_weights(self.store, area, plan, group.namespace, state_name(group.name), end,
                                lambda a, b, w: out[a:b].copy_(w))
        except Exception as again:  # noqa: BLE001 - reported with the step's own error
            what = exc if isinstance(exc, FuyouError) else repr(exc)
            raise DataLoss(f"{what}; moreover the client's weights buffer of group {group.name!r} already held "
                           f"new weights for elements [0, {end}) and restoring the committed ones failed "
                           f"({again}): read the group's weights again before using them") from exc

    @staticmethod
    def _finite(layout, state: memoryview, slots: list[torch.Tensor]) -> bool:
        """Whether the new state is finite. fp32 state: one sum over all the slots (the
        padding between them is zero); otherwise each slot that can hold a NaN apart
        (the int8 moments' scales turn NaN or infinite with them)."""
        if all(t.dtype == torch.float32 for t in slots):
            return all_finite(torch.frombuffer(state[HEADER:layout.size], dtype=torch.float32), slots)
        return all(all_finite(t) for t in layout.floating(slots))

    @staticmethod
    def _non_finite(group: Group, grad: torch.Tensor, scaled: torch.Tensor, lr: float,
                    grad_scale: float) -> NonFinite:
        """The refusal of a step whose new state is not finite, with its cause (checked
        exactly, only now that the step failed)."""
        if not all_finite(grad):
            cause = "its gradients hold non-finite values (NaN or inf)"
        elif scaled is not grad and not all_finite(scaled):
            cause = f"its gradients times grad_scale {grad_scale!r} overflow float32"
        else:
            cause = (f"its gradients are finite but its update is not (learning rate {lr!r}): the step "
                     "overflows float32, or the state it starts from was not finite")
        return NonFinite(f"group {group.name!r}: {cause}; the step was refused and its committed state "
                         f"(step {group.step}) kept")

    def fetch_weights(self, group: Group, out: memoryview, out_dtype: str) -> bool:
        """Serve a group's current weights from a read-ahead of its whole state.

        Backward needs a block's weights shortly before that block's step reads the same
        state: reading it once, into an optimizer buffer kept for the step, saves the
        separate weight read (4 bytes per parameter and iteration in fp32); a group
        stepped in chunks (its state is larger than a buffer) keeps its weights only
        (held.py). Returns False, having done nothing, when no buffer is spare; the client
        then reads the weights itself. A buffer the state cache keeps for a smaller state
        is taken back first."""
        if out_dtype not in DTYPES:
            raise InvalidArgument(f"out_dtype must be one of {sorted(DTYPES)}")
        out_t = _tensor(out, DTYPES[out_dtype], group.numel)
        if self.chunked(group):
            return self._fetch_held(group, out_t)
        with group.lock:
            if group.dead:
                raise NotFound(f"optimizer group {group.name!r} was deleted or replaced")
            if group.prefetched is None:
                ns = group.namespace
                buf = self.buffers.try_acquire(group.buffer_bytes, leave=1, owner=ns)
                if buf is None:
                    mine = ns if self.buffers.at_budget(ns, leave=1) else None  # (its budget full: its own help)
                    if self._evict_one(mine, cheaper_than=len(out)):
                        buf = self.buffers.try_acquire(group.buffer_bytes, leave=1, owner=ns)
                if buf is None:
                    return False
                try:
                    self.store.read([ReadItem(group.namespace, state_name(group.name), buf[:group.nbytes])])
                except BaseException:
                    self.buffers.release(buf)
                    raise
                group.prefetched = buf
            weights = torch.frombuffer(group.prefetched[HEADER:HEADER + group.numel * 4], dtype=torch.float32)
            out_t.copy_(weights)
            return True

    def _fetch_held(self, group: Group, out: torch.Tensor) -> bool:
        with group.lock:
            if group.dead:
                raise NotFound(f"optimizer group {group.name!r} was deleted or replaced")
            if group.held is not None:  # (fetched twice before its step: read again, the newest wins)
                group.held.release()
                group.held = None
            if self.buffers.at_budget(group.namespace, leave=1):
                self._evict_one(group.namespace, cheaper_than=4 * group.numel)
            elif self.buffers.spare() <= 1:
                self._evict_one(cheaper_than=4 * group.numel)
            group.held = held_weights.read(self.store, self.buffers, group.namespace, state_name(group.name),
                                           group.numel, group.step, out)
            return group.held is not None

    def _note_order(self, group: Group) -> None:
        with self._lock:
            self._note_order_locked(group)

    def _note_order_locked(self, group: Group) -> None:
        cur = self._current.setdefault(group.namespace, [])
        if group.name in cur:  # a new iteration began: what we saw is the order to expect
            self._order[group.namespace] = cur[:]
            cur.clear()
        cur.append(group.name)

    def _prefetch_next(self, group: Group) -> None:
        with self._lock:
            order = self._order.get(group.namespace, [])
            if group.name not in order:
                return
            i = order.index(group.name) + 1
            if i == len(order):  # the next iteration's first group: it would hold a buffer for a whole forward
                return
            nxt = self._groups.get((group.namespace, order[i]))
        if nxt is None or nxt is group or nxt.prefetched is not None or self.chunked(nxt) \
                or not nxt.lock.acquire(blocking=False):
            return
        try:
            started = self._threads.start(self._prefetch, nxt, name="optim-prefetch")
        except BaseException:
            nxt.lock.release()
            raise
        if started is None:  # (the daemon is stopping: no new reads)
            nxt.lock.release()

    def close(self, timeout: float = 30.0) -> list[str]:
        """Start no more read-aheads and wait for those running (before the store closes);
        returns the names of threads still running after ``timeout`` seconds."""
        return self._threads.join(timeout)

    def _prefetch(self, group: Group) -> None:
        try:  # group.lock is held (taken by _prefetch_next)
            failpoints.hit("optimizer.prefetch")
            if group.prefetched is not None or group.dead:  # FetchWeights got there first, or it is gone
                return
            buf = self.buffers.try_acquire(group.buffer_bytes, leave=1, owner=group.namespace)
            if buf is None:
                return
            try:
                self.store.read([ReadItem(group.namespace, state_name(group.name), buf[:group.nbytes])])
                group.prefetched = buf
            except Exception as exc:  # noqa: BLE001 - the step will read (and report) it itself
                log.debug("prefetch of %s failed: %s", group.name, exc)
                self.buffers.release(buf)
        finally:
            group.lock.release()

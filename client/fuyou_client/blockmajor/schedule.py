"""Block-major training over a list of micro-batches: ``engine.train_step(micro_batches, loss_fn)``.

The ordinary loop runs micro-batch after micro-batch, so every micro-batch moves every
block's weights up and (with accumulation) every block's gradients down, and a block's
step can only start after the last micro-batch's backward. Here the order is turned
around (layer-to-layer training's order; FlexGen's for inference):

* **forward**, block by block: block l runs for micro-batches 1..K before block l+1 does,
  without keeping a graph. Each micro-batch's input to each block (its *kept input*) is kept:
  on the CPU as the tensor itself, on a device with its own memory in a host arena of
  shared memory (downloaded as it is made, uploaded again ahead of its use), and what
  ``host_budget`` cannot hold on the SSD array (written as it is made, read back ahead
  of backward: store.py). The tail
  (final norm, head, ``loss_fn``) runs with a graph, and its gradient with respect to the
  last block's output is taken at once;
* **backward**, block by block in reverse: the block's weights come up once, then for
  micro-batches 1..K in ascending order its forward is recomputed from the kept input and
  backward runs through it, so its gradient accumulates on the device in the order
  torch's loop would add it. After the K-th the group's gradient is final: it goes down
  once and its step is submitted, overlapping the backward of the blocks before it. A
  *swapped* block (``swap_blocks``: swapped.py) is not recomputed: its forward ran with a
  graph whose saved activations went to host memory, and backward runs through that graph;
* **the rest** (embeddings, head, final norm): each micro-batch's ``loss_fn`` is replayed
  with the blocks answered from the kept inputs, and one backward per micro-batch takes
  the head's and the embeddings' gradients together (tied weights add up as in torch).

The model's own ``forward`` runs unchanged: each micro-batch's forward runs in a thread of
its own, and the blocks are replaced (in their parent module, during the call) by stand-ins
that let exactly one micro-batch compute at a time, in block-major order. Between blocks the
model holds "ghosts" (meta tensors) instead of the hidden states, so device memory holds
one micro-batch's activations at a time.

Dropout: micro-batch k draws from the default generators seeded ``seed + k``, with
``seed`` drawn once per call from the default CPU generator, in forward and recomputation
alike (``micro_batch_rng`` gives the same draws to an ordinary loop). The result is
bitwise that of the ordinary loop over the same micro-batches with
``accumulation_steps=K`` (fp32 and bf16 compute: tests/test_blockmajor.py). The
kept inputs are held by store.py.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fuyou_client.blockmajor.store import Store
from fuyou_client.blockmajor.swapped import Swapped
from fuyou_client.blockmajor.turns import Aborted, Turns, rng_state, seed_generators, set_rng_state


def _is_cache(x) -> bool:
    """A key/value cache (transformers' Cache): training keeps none, so blocks get None."""
    return hasattr(x, "update") and hasattr(x, "get_seq_length")


def _checked(loss, i: int) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        raise ValueError(f"loss_fn returned {type(loss).__name__}"
                         f"{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)} for micro-batch {i}: "
                         "it must return a scalar floating-point tensor")
    return loss


@dataclass
class _Call:
    """What a block received for one micro-batch: the call's structure, its constant
    leaves, and which leaves are carried (hidden states: kept, given gradients)."""
    spec: object
    leaves: list
    carried: list[int]  # leaf positions
    sources: list[int]  # for each carried leaf, its index in the stored tensors


@dataclass(eq=False)
class _Micro:
    rng: object = None  # the generators' state now (swapped at every turn)
    initial: object = None  # at the start of its forward
    tail: object = None  # when its tail starts
    loss: torch.Tensor | None = None
    ghosts: dict = field(default_factory=dict)  # id(ghost) -> index in the previous block's stored outputs
    ghost_refs: list = field(default_factory=list)  # (the ghosts, alive until the next block: ids stay unique)
    last: int = -1  # the last block it ran


@dataclass
class StepTimes:
    """Where one ``train_step``'s seconds went, the device synchronised at each boundary:
    ``forward`` (every block over every micro-batch, the tail included), ``backward`` (the
    blocks in reverse, then the rest's), ``step`` (the step's barrier after backward: the
    optimizer's exposed time)."""
    forward: float = 0.0
    backward: float = 0.0
    step: float = 0.0


class BlockMajor:
    """One ``train_step``: forward, backward and the rest's backward, in block-major order.
    ``blocks``: [(module, offloaded group or None, forward)], in forward order."""

    def __init__(self, model, device, offloader, blocks: list, rest_trains: bool, store: Store,
                 swapped: Swapped | None = None):
        self.model, self.offloader, self.blocks, self.store = model, offloader, blocks, store
        self.swapped = swapped  # (blocks whose graphs are kept, their activations swapped: swapped.py)
        self._rest = rest_trains  # (the embeddings', head's, final norm's group has trained parameters)
        self.device = device
        self.cuda = self.device.torch_device if self.device.torch_device.type == "cuda" else None
        self.calls: dict[tuple[int, int], _Call] = {}
        self.rng: dict[tuple[int, int], object] = {}
        self.out_specs: dict[int, tuple] = {}  # block -> (output spec, floating positions)
        self.times = StepTimes()

    # -- the call -------------------------------------------------------------------------
    def run(self, micro_batches: list, loss_fn) -> torch.Tensor:
        k = len(micro_batches)
        seed = int(torch.randint(0, 2**62, (1,)).item())
        with torch.random.fork_rng(devices=[self.cuda.index or 0] if self.cuda else [], device_type="cuda"):
            micros = []
            for i in range(k):
                seed_generators(seed + i, self.cuda)
                state = rng_state(self.cuda)
                micros.append(_Micro(rng=state, initial=state))
            if not self.blocks:  # (no repeated blocks: every parameter is in the rest group)
                for i, (mb, micro) in enumerate(zip(micro_batches, micros)):
                    set_rng_state(micro.initial, self.cuda)
                    micro.loss = _checked(loss_fn(mb), i)
                    micro.loss.backward()
                    micro.loss = micro.loss.detach()
                return torch.stack([m.loss for m in micros])
            t0 = time.perf_counter()
            with self._stand_ins(self._forward_turn):
                self._forward(micro_batches, loss_fn, micros)
            self.device.synchronize()
            t1 = time.perf_counter()
            self._backward(k)
            if self._rest_trains():
                self._rest_backward(micro_batches, loss_fn, micros)
            self.device.synchronize()
            self.times.forward, self.times.backward = t1 - t0, time.perf_counter() - t1
        return torch.stack([m.loss for m in micros])

    def _rest_trains(self) -> bool:
        return self._rest

    @contextmanager
    def _stand_ins(self, turn):
        """Replace each block in its parent by a stand-in calling ``turn(l, args, kwargs)``."""
        parents = []
        for l, (module, _, _) in enumerate(self.blocks):
            for parent in self.model.modules():
                key = next((n for n, m in parent._modules.items() if m is module), None)
                if key is not None:
                    parents.append((parent, key, module))
                    parent._modules[key] = _StandIn(turn, l)
                    break
            else:
                raise RuntimeError(f"block {l} is not a submodule of the model: train_step replaces blocks in place")
        try:
            yield
        finally:
            for parent, key, module in parents:
                parent._modules[key] = module

    # -- forward --------------------------------------------------------------------------
    def _forward(self, micro_batches, loss_fn, micros) -> None:
        k, n = len(micro_batches), len(self.blocks)
        order = [(-1, i) for i in range(k)] + [(l, i) for l in range(n) for i in range(k)]
        self.turns = Turns(order, k, self.device.thread_turn_done)
        self.micros = micros
        context = self._context()
        errors: list[BaseException] = []

        def work(i: int) -> None:
            self._local.i = i
            try:
                with context():
                    self.turns.wait((-1, i))
                    set_rng_state(micros[i].rng, self.cuda)
                    loss = _checked(loss_fn(micro_batches[i]), i)
                    if micros[i].last != n - 1:
                        raise RuntimeError(f"micro-batch {i}'s forward called {micros[i].last + 1} of the {n} blocks: "
                                           "train_step needs every block called once, in order")
                    leaves = self._last_leaves.pop(i)
                    wanted = [t for t in leaves if t is not None and t.requires_grad]
                    with self.offloader.input_gradients() if self.offloader is not None else nullcontext():
                        grads = torch.autograd.grad(loss, wanted, allow_unused=True) \
                            if loss.requires_grad and wanted else [None] * len(wanted)
                    it = iter(grads)
                    self.store.put(("g", n - 1, i), [next(it) if t is not None and t.requires_grad else None
                                                     for t in leaves])
                    micros[i].loss = loss.detach()
                    micros[i].rng = None
                self.turns.advance()
            except Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(exc)
                self.turns.abort(exc)

        self._last_leaves: dict[int, list] = {}
        self._local = threading.local()
        self._work_code, self._micro_batches = work.__code__, micro_batches
        self._modules = {id(m) for m in self.model.modules()}
        self._resident = {t.untyped_storage().data_ptr() for t in (*self.model.parameters(),
                                                                   *self.model.buffers()) if t.numel()}
        threads = [threading.Thread(target=work, args=(i,), name=f"fuyou-micro{i}", daemon=True) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _context(self):
        """The calling thread's autocast, device and stream, for the micro-batches' threads."""
        kind = self.device.torch_device.type
        autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        stream = torch.cuda.current_stream(self.cuda) if self.cuda is not None else None

        @contextmanager
        def context():
            with torch.autocast(kind, dtype=autocast[1], enabled=autocast[0]), \
                    (torch.cuda.device(self.cuda) if stream is not None else nullcontext()), \
                    (torch.cuda.stream(stream) if stream is not None else nullcontext()):
                yield
        return context

    def _forward_turn(self, l: int, args, kwargs):
        """Block ``l`` for the micro-batch whose thread calls it, on its turn."""
        i = self._local.i
        micro, n, k = self.micros[i], len(self.blocks), len(self.micros)
        if micro.last != l - 1:
            raise RuntimeError(f"micro-batch {i} called block {l} after block {micro.last}: train_step needs every "
                               "block called once, in order")
        micro.rng = rng_state(self.cuda)
        early = l == 0 and not self.device.shares_host_memory
        if early:  # (still its prologue's turn)
            call, carried = self._record(0, i, args, kwargs)
            self._park(carried, tree_flatten((args, kwargs))[0], i)
        self.turns.advance()  # (its prologue or previous block is done)
        self.turns.wait((l, i))
        set_rng_state(micro.rng, self.cuda)
        module, og, forward = self.blocks[l]
        if not early:
            call, carried = self._record(l, i, args, kwargs)
            carried = [t.detach() for t in carried]
        if og is not None:  # (a cut block's sub-blocks stay for the next micro-batch: nothing else fetched ahead)
            self.offloader.prefetch_within = og.unit if i < k - 1 else None
        if i == 0 and og is not None:
            self.offloader.enter_forward(og)  # (weights in, the next blocks' fetches started)
        swapped = self.swapped is not None and l in self.swapped
        if l > 0 or early:  # (a swapped block's: forward's take is its last)
            carried = self.store.take(("x", l, i), keep=not swapped, forward=swapped)
        elif swapped:  # (block 0 on the CPU computes from the model's own tensors)
            self.store.drop(("x", 0, i))
        for nxt in ([("x", l, i + 1)] if i + 1 < k else [("x", l + 1, 0)] if l + 1 < n else []):
            self.store.prefetch(nxt)
        self.rng[(l, i)] = micro.rng  # (the state the block starts from, for its recomputation)
        if swapped:
            out = self.swapped.forward((l, i), forward, lambda entered: self._rebuild(call, entered), carried,
                                       set(call.sources))
        else:
            args, kwargs = self._rebuild(call, carried)
            with torch.no_grad():
                out = forward(*args, **kwargs)
            del args, kwargs
        del carried
        if i == k - 1 and og is not None:
            self.offloader.exit_forward(og)
        leaves, spec = tree_flatten(out)
        floating = [j for j, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        self.out_specs.setdefault(l, (spec, floating))
        tensors = [leaves[j].detach() for j in floating]
        if l + 1 < n or self._rest_trains():  # (the last outputs: for the rest's backward only)
            self.store.put(("x", l + 1, i), tensors)
        micro.last = l
        if l == n - 1:  # the tail: with a graph, from leaves
            given = [t.detach().requires_grad_() for t in tensors]
            self._last_leaves[i] = given
            micro.tail = rng_state(self.cuda)
        else:
            given = [torch.empty_like(t, device="meta") for t in tensors]
            micro.ghosts = {id(g): j for j, g in enumerate(given)}
            micro.ghost_refs = given
            micro.rng = rng_state(self.cuda)
        for j, t in zip(floating, given):
            leaves[j] = t
        return tree_unflatten(leaves, spec)

    def _park(self, carried: list, arguments: list, i: int) -> None:
        """Before micro-batch ``i`` waits for block 0 on a device with its own memory: its
        inputs to block 0 (on their way to the arena) and the rest of what its forward made
        before block 0 and still holds in the model's forward frames (an embedding, the
        positions' own, ...) leave the device; each waiting micro-batch would otherwise hold
        them until its forward returns, a step's tokens x width several times over. Emptied
        in place (the model's references stay; a copy in flight holds its memory until
        done): floating tensors on the device, not parameters, buffers or views of them, not
        block 0's other arguments (masks, rotary tables), no 4-D tensor (another layer
        type's attention mask, which later blocks take: gpt-oss's full-attention mask beside
        block 0's sliding one), not the micro-batch itself and nothing of ``loss_fn``'s own.
        A model that reads one of them after its blocks fails on its empty shape."""
        keep = {id(t) for t in arguments if isinstance(t, torch.Tensor)} - {id(t) for t in carried}
        keep |= {id(t) for t in tree_flatten(self._micro_batches[i])[0] if isinstance(t, torch.Tensor)}
        for t in carried:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        frame = sys._getframe(2)  # (the stand-in's caller: the model's forward)
        while frame is not None and frame.f_code is not self._work_code:
            if id(frame.f_locals.get("self")) not in self._modules:
                frame = frame.f_back  # (not one of the model's forwards: loss_fn's own tensors stay)
                continue
            for value in list(frame.f_locals.values()):
                for t in tree_flatten(value)[0] if isinstance(value, (tuple, list, dict)) else [value]:
                    if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and id(t) not in keep \
                            and t.is_floating_point() and t.dim() < 4 and t.device == self.device.torch_device \
                            and t.numel() \
                            and t.untyped_storage().data_ptr() not in self._resident:
                        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            frame = frame.f_back

    def _record(self, l: int, i: int, args, kwargs) -> tuple[_Call, list]:
        leaves, spec = tree_flatten((args, kwargs))
        carried, sources, tensors = [], [], []
        micro = self.micros[i]
        for j, x in enumerate(leaves):
            if _is_cache(x):
                leaves[j] = None
            elif isinstance(x, torch.Tensor):
                if l > 0 and id(x) in micro.ghosts:
                    carried.append(j)
                    sources.append(micro.ghosts[id(x)])
                elif x.device.type == "meta":
                    raise RuntimeError(f"block {l} of micro-batch {i} got a tensor computed between blocks: train_step "
                                       "needs each block's input to be the previous block's output, unchanged")
                elif l == 0 and x.is_floating_point() and x.requires_grad:
                    carried.append(j)
                    sources.append(len(tensors))
                    tensors.append(x)
                elif x.requires_grad:
                    raise RuntimeError(f"block {l} of micro-batch {i} got an input that needs a gradient besides "
                                       "the previous block's output: train_step cannot carry it")
        if l == 0:
            self.store.reserve(sum(t.numel() * t.element_size() for t in tensors) or 1, len(self.blocks),
                               len(self.micros), last=self._rest_trains(),
                               swapped=self.swapped.blocks if self.swapped is not None else frozenset())
            self.store.put(("x", 0, i), tensors)
        for j in carried:
            leaves[j] = None  # (the stored tensors stand in for them)
        call = _Call(spec, leaves, carried, sources)
        self.calls[(l, i)] = call
        return call, tensors  # (block 0's inputs as the model made them)

    @staticmethod
    def _rebuild(call: _Call, stored: list, grad: bool = False):
        leaves = list(call.leaves)
        inputs = []
        for j, s in zip(call.carried, call.sources):
            t = stored[s]
            if grad:
                t = t.detach().requires_grad_()
                inputs.append(t)
            leaves[j] = t
        args, kwargs = tree_unflatten(leaves, call.spec)
        return (args, kwargs, inputs) if grad else (args, kwargs)

    # -- backward -------------------------------------------------------------------------
    def _backward(self, k: int) -> None:
        n = len(self.blocks)
        offloader = self.offloader
        for l in reversed(range(n)):
            module, og, forward = self.blocks[l]
            if og is not None:
                offloader.hold(og)
                offloader.begin_backward(og)
            _, floating = self.out_specs[l]
            for i in range(k):
                if og is not None:  # (as in forward)
                    offloader.prefetch_within = og.unit if i < k - 1 else None
                for nxt in ([("x", l, i + 1), ("g", l, i + 1)] if i + 1 < k else
                            [("x", l - 1, 0), ("g", l - 1, 0)] if l > 0 else []):
                    self.store.prefetch(nxt)
                call = self.calls.pop((l, i))
                rng = self.rng.pop((l, i))
                if self.swapped is not None and l in self.swapped:  # (no recomputation: its graph was kept)
                    if og is not None and og.cut and i:
                        offloader.next_micro_batch(og)
                    d_inputs = self.swapped.backward((l, i), floating, self.store.take(("g", l, i)))
                else:
                    d_inputs = self._recomputed_backward(forward, call, floating, rng, (l, i))
                self.store.put(("g", l - 1, i), d_inputs)
                del d_inputs
            if og is not None and og.slot is not None:  # (a frozen block: no gradient released it)
                offloader.let_go(og)
        if offloader is not None:
            offloader.prefetch_within = None

    def _recomputed_backward(self, forward, call: _Call, floating: list[int], rng, key) -> list:
        """A block's backward for one micro-batch, its forward recomputed from its kept
        input; returns the input gradients, aligned with the previous block's outputs."""
        stored = self.store.take(("x", *key))
        args, kwargs, inputs = self._rebuild(call, stored, grad=True)
        grads = self.store.take(("g", *key))
        set_rng_state(rng, self.cuda)
        with torch.enable_grad():
            out = forward(*args, **kwargs)
        leaves, _ = tree_flatten(out)
        pairs = [(leaves[j], g) for j, g in zip(floating, grads) if g is not None and leaves[j].requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        del out, leaves, pairs
        d_inputs = [None] * len(stored)
        for x, s in zip(inputs, call.sources):
            if x.grad is not None:
                d_inputs[s] = x.grad if d_inputs[s] is None else d_inputs[s] + x.grad
        return d_inputs

    # -- the rest -------------------------------------------------------------------------
    def _rest_backward(self, micro_batches, loss_fn, micros) -> None:
        """The embeddings', head's and final norm's gradients: each micro-batch's loss_fn
        again, the blocks answered from the kept inputs, one backward each."""
        n = len(self.blocks)
        state = {}

        def turn(l: int, args, kwargs):
            spec, floating = self.out_specs[l]
            if l == 0:
                leaves, _ = tree_flatten((args, kwargs))
                state["inputs"] = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()
                                   and x.requires_grad]
            if l == n - 1:
                tensors = state["last"]
                set_rng_state(state["tail"], self.cuda)
            else:
                tensors = [None] * len(floating)
            leaves = [None] * spec.num_leaves
            for j, t in zip(floating, tensors):
                leaves[j] = t if t is not None else torch.empty(0, device="meta")
            return tree_unflatten(leaves, spec)

        with self._stand_ins(turn):
            for i in range(len(micro_batches)):
                if i + 1 < len(micro_batches):
                    self.store.prefetch(("x", n, i + 1))
                    self.store.prefetch(("g", -1, i + 1))
                state["last"] = self.store.take(("x", n, i))
                state["tail"] = micros[i].tail
                d_inputs = self.store.take(("g", -1, i))
                set_rng_state(micros[i].initial, self.cuda)
                loss = loss_fn(micro_batches[i])
                heads = [loss] if loss.requires_grad else []
                pairs = [(x, g) for x, g in zip(state.pop("inputs", []), d_inputs) if g is not None]
                outputs = heads + [x for x, _ in pairs]
                if outputs:
                    torch.autograd.backward(outputs, [None] * len(heads) + [g for _, g in pairs])


class _StandIn(nn.Module):
    """Where a block was, during train_step: hands the call to the schedule."""

    def __init__(self, turn, index: int):
        super().__init__()
        self._turn, self._index = turn, index

    def forward(self, *args, **kwargs):
        return self._turn(self._index, args, kwargs)


def run(model, device, coordinator, offloader, store: Store, blocks: list, rest_trains: bool, micro_batches,
        loss_fn, barrier, on_failure, swapped: Swapped | None = None) -> tuple[torch.Tensor, StepTimes]:
    """Engine.train_step's work, once it has checked the micro-batches
    (``check_micro_batches``) and that no iteration is under way: BlockMajor, with the
    step coordinator counting each group's gradient once over the micro-batches, then
    ``barrier()`` (the engine's step). ``blocks``: [(module, offloaded group or None, its
    own forward)]. A failure leaves the steps already sent landed and the rest forgotten
    (``on_failure()``: the engine's zero_grad). Returns the losses and where the seconds went."""
    try:
        with coordinator.block_major(len(micro_batches)):
            schedule = BlockMajor(model, device, offloader, blocks, rest_trains, store, swapped)
            losses = schedule.run(micro_batches, loss_fn)
            t0 = time.perf_counter()
            barrier()
            schedule.times.step = time.perf_counter() - t0
    except BaseException:
        coordinator.abandon()
        on_failure()
        raise
    finally:
        if swapped is not None:
            swapped.count(store.stats)
            swapped.discard()
        store.discard()
    return losses, schedule.times

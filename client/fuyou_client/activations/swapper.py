"""Activation swapping: what autograd saves for backward leaves the compute device.

During the forward of a block whose treatment is "swap", a saved-tensors hook copies
each saved activation (not weights: those are the offloader's, or the parameters'
own storage) into a *host arena* - one pinned shared buffer of ``host_budget`` bytes -
and hands autograd a small handle instead. When the arena is full, the oldest parked
activations (the first layers': backward needs them last) go on to the SSD array as
transient objects, written by the daemon straight from the arena. In backward the
handle becomes a tensor again: from the arena, or read back from SSD. A tensor saved by
several operators (a Llama block's q, k and v projections each save their input, three
views of one tensor) is parked once, its saves sharing the handle, as long as it is the
same live tensor, unchanged (its storage, layout and version). As soon as
backward reaches a parked activation, the SSD-resident ones it will need next (reverse
order) are read ahead into free arena space. Every activation is freed (arena range
released, object deleted) once backward has used it, and anything left over - a
forward without backward - is dropped at the next ``engine.step()`` or
``zero_grad()``. Transient objects die with the session, so a killed client leaves
nothing behind. The arena and the SSD tier are spill.py's, shared with block-major
training's store: each spilled activation carries a CRC32C taken as it leaves, and one
that comes back damaged is a ``DataLoss``, not a wrong gradient. A spill waits for its
write here (the oldest activation makes room for the next at once); blockmajor/store.py,
which knows its whole step in advance, writes ahead instead.

On a GPU the copy into the arena runs on the device's download stream (the source is
kept from reuse by the caching allocator until it ran; a spill to SSD waits for it) and
the copy back on the upload stream, the compute stream waiting for its event; when
backward takes an activation, the next ``UPLOAD_AHEAD`` parked in the arena start
their uploads too, so they are on the device before backward reaches them. An arena
range is reused only once its upload has run. Only tensors on the compute device are
swapped (anything else autograd saves is kept). On the CPU both copies are plain ones.

Accounting (``ActivationStats``): bytes kept on the compute device for backward (now
and peak), bytes parked in the host arena (now and peak), and bytes moved to host and
to SSD; the engine reports the traffic to the daemon's metrics.
"""
from __future__ import annotations

import itertools
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from fuyou_client.device.devices import DONE, Device, HostDevice
from fuyou_client.connection.session import Session
from fuyou_client.activations.spill import ALIGN, Arena, Spilled, SsdTier

MIN_BYTES = 16 << 10  # smaller saved tensors are not worth a round trip: kept
UPLOAD_AHEAD = 2  # activations uploaded back to a GPU ahead of backward's use
TREATMENTS = ("keep", "swap", "recompute")
WORDS = (*TREATMENTS, "auto")


@dataclass
class ActivationStats:
    device_bytes: int = 0  # saved for backward and resident on the compute device
    device_peak: int = 0
    host_bytes: int = 0  # parked in the host arena
    host_peak: int = 0
    to_host: int = 0  # bytes moved device -> host arena (since the last report)
    to_ssd: int = 0  # bytes moved host arena -> SSD (since the last report)
    # Totals and their times, for the planner's profile.
    copied: int = 0
    copy_s: float = 0.0
    spilled: int = 0
    spill_s: float = 0.0
    read_back: int = 0
    read_back_s: float = 0.0
    returned: int = 0  # bytes backward took back

    def kept(self, n: int) -> None:
        self.device_bytes += n
        self.device_peak = max(self.device_peak, self.device_bytes)

    def take_traffic(self) -> tuple[int, int]:
        out = (self.to_host, self.to_ssd)
        self.to_host = self.to_ssd = 0
        return out


@dataclass(eq=False)
class _Parked:
    key: int
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    offset: int | None = None  # in the arena, while there
    spilled: Spilled | None = None  # the SSD object, once spilled
    fetch: Future | None = None  # a read-ahead from SSD into ``offset``
    copied: object = DONE  # event: the copy into the arena
    on_device: tuple | None = None  # (tensor, event): uploaded ahead of its use in backward
    refs: int = 1  # saves of this tensor (one op's input saved by several: each gets this handle)
    unpacked: torch.Tensor | None = None  # the tensor backward took, for the saves still to take it


@dataclass(eq=False)
class _Kept:
    tensor: torch.Tensor
    nbytes: int


class ActivationSwapper:
    def __init__(self, session: Session, host_budget: int, protected=lambda t: False, device: Device | None = None,
                 min_bytes: int = MIN_BYTES):
        if host_budget < ALIGN:
            raise ValueError(f"host_budget must be at least {ALIGN} bytes, got {host_budget}")
        self.session = session
        self.min_bytes = min_bytes  # (smaller saved tensors are kept where they are)
        self.device = device or HostDevice()
        self.measure = False  # time copies to completion (the planner's profile on an asynchronous device)
        self._uploading: list[tuple[object, int, int]] = []  # (event, offset, nbytes): arena ranges in use
        self.host_budget = host_budget
        self._arena: Arena | None = None  # allocated at the first swapped activation
        self._tier: SsdTier | None = None  # (with it)
        self.stats = ActivationStats()
        self._protected = protected  # tensors that are weights, not activations
        self._keys = itertools.count()
        self._host: dict[int, _Parked] = {}  # in the arena, in pack order
        self._ssd: dict[int, _Parked] = {}  # spilled, in pack order
        # The tensors parked lately, by identity: one saved again (q, k and v projections all
        # save their input) is parked once, and its saves share the handle.
        self._parked_by_tensor: dict[tuple, tuple[weakref.ref, _Parked]] = {}

    def sibling(self, host_budget: int) -> "ActivationSwapper":
        """Another swapper on the same session and device, telling weights from activations
        as this one does, with an arena of its own of ``host_budget`` bytes, swapping
        every activation however small (train_step's: blockmajor/swapped.py; the device
        plan counts one block's activations at a time, so none may stay there for the step)."""
        return ActivationSwapper(self.session, host_budget, self._protected, self.device, min_bytes=0)

    def resize(self, host_budget: int) -> None:
        """The arena's size from now on (train_step's: what its kept inputs leave of
        ``host_budget``); one already allocated at another size is given back first. Only
        between steps: nothing may be parked."""
        if host_budget < ALIGN:
            raise ValueError(f"an activation arena of {host_budget} bytes: at least {ALIGN} are needed; raise "
                             "host_budget")
        if self._arena is not None and self._arena.size != host_budget:
            self.close()
        self.host_budget = host_budget

    def close(self) -> None:
        """Everything parked dropped and the arena given back (the engine's close)."""
        if self._arena is not None:
            self.reset()
            self.device.synchronize()
            self._arena.free()
            self._arena = self._tier = None

    @property
    def arena(self) -> Arena:
        if self._arena is None:
            self._arena = Arena(self.session, self.host_budget)
            self._tier = SsdTier(self.session, self._arena, f"act/{id(self):x}")
        return self._arena

    def is_activation(self, t: torch.Tensor) -> bool:
        return not self._protected(t)

    def probe_ssd(self, nbytes: int = 8 << 20) -> tuple[float, float]:
        """The SSD's write and read bandwidth for activations, measured with one object
        from the arena (for a plan made before anything spilled)."""
        nbytes = min(nbytes, self.arena.size) // ALIGN * ALIGN
        off = self.arena.take(nbytes)
        if off is None:
            return 1e9, 1e9
        try:
            name = f"act/{id(self):x}/probe"
            t0 = time.perf_counter()
            self.session.swap_out(name, self.arena.buffer, offset=off, length=nbytes)
            t1 = time.perf_counter()
            self.session.swap_in(name, self.arena.buffer, offset=off, length=nbytes)
            t2 = time.perf_counter()
            self.session.delete(name, missing_ok=True)
        finally:
            self.arena.give(off, nbytes)
        return nbytes / max(t1 - t0, 1e-9), nbytes / max(t2 - t1, 1e-9)

    # -- forward ------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, swap: bool):
        nbytes = t.numel() * t.element_size()
        if self._protected(t):
            return t
        if not swap or nbytes < self.min_bytes or t.device != self.device.torch_device:
            self.stats.kept(nbytes)
            return _Kept(t, nbytes)
        again = self._saved_again(t)
        if again is not None:
            self._saved_later(again)
            return again
        if nbytes > self.arena.size:
            raise ValueError(f"an activation of {nbytes} bytes does not fit the host arena of {self.arena.size} "
                             f"bytes: attach with host_budget of at least {-(-nbytes // ALIGN) * ALIGN} bytes")
        off = self._make_room(nbytes)
        parked = _Parked(next(self._keys), t.shape, t.dtype, nbytes, off)
        self._remember(t, parked)
        t0 = time.perf_counter()
        dst = self._parked_tensor(parked)
        if self.device.shares_host_memory:
            dst.copy_(t)
        else:
            parked.copied = self.device.download(dst, t)
            if self.measure:
                parked.copied.synchronize()
        self.stats.copy_s += time.perf_counter() - t0
        self.stats.copied += nbytes
        self._host[parked.key] = parked
        self.stats.to_host += nbytes
        self.stats.host_bytes += nbytes
        self.stats.host_peak = max(self.stats.host_peak, self.stats.host_bytes)
        return parked

    @staticmethod
    def _identity(t: torch.Tensor) -> tuple:
        """The same tensor, unchanged: its storage, where in it, its layout and its version
        (an in-place change between two saves makes them two activations)."""
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)

    @staticmethod
    def _owner(t: torch.Tensor) -> torch.Tensor:
        """What keeps ``t``'s memory alive: its base where it is a view (each linear layer
        views its input anew, so the q, k and v projections' saves are three views of one
        tensor), else itself."""
        return t._base if t._base is not None else t

    def _saved_again(self, t: torch.Tensor) -> _Parked | None:
        """The handle of ``t`` where it is parked already and still there (the same bytes
        of the same live tensor: a freed one's memory reused by another is not it)."""
        hit = self._parked_by_tensor.get(self._identity(t))
        if hit is None or hit[0]() is not self._owner(t):
            return None
        p = hit[1]
        return p if (p.key in self._host or p.key in self._ssd) and p.unpacked is None else None

    def _saved_later(self, p: _Parked) -> None:
        """``p`` saved once more: one more save shares it, and it takes this save's place in
        pack order (backward, which runs in reverse, needs it by then: the read-ahead, the
        uploads ahead and which to spill first all go by that order)."""
        p.refs += 1
        where = self._host if p.key in self._host else self._ssd
        del where[p.key]
        p.key = next(self._keys)
        where[p.key] = p

    def _remember(self, t: torch.Tensor, p: _Parked) -> None:
        if len(self._parked_by_tensor) > 256:  # (those whose tensor is gone are no use)
            self._parked_by_tensor = {k: v for k, v in self._parked_by_tensor.items() if v[0]() is not None}
        self._parked_by_tensor[self._identity(t)] = (weakref.ref(self._owner(t)), p)

    def _make_room(self, nbytes: int) -> int:
        """An arena range, spilling the oldest parked activations to SSD until one fits."""
        while True:
            self._reap()
            off = self.arena.take(nbytes)
            if off is not None:
                return off
            if self._uploading:  # ranges still being copied back to the device
                self._reap(wait=True)
                continue
            victim = next((p for p in self._host.values() if p.fetch is None and p.on_device is None), None)
            if victim is None:
                raise RuntimeError("the host arena is full of activations being read back; raise host_budget")
            self._spill(victim)

    def _spill(self, p: _Parked) -> None:
        t0 = time.perf_counter()
        p.copied.synchronize()  # the daemon reads what the download stream wrote
        p.spilled = self._tier.write(p.offset, p.nbytes, f"an activation saved in forward ({p.dtype}, shape "
                                     f"{tuple(p.shape)})").result()
        self.stats.spill_s += time.perf_counter() - t0
        self.stats.spilled += p.nbytes
        self.arena.give(p.offset, p.nbytes)
        self.stats.host_bytes -= p.nbytes
        self.stats.to_ssd += p.nbytes
        p.offset = None
        del self._host[p.key]
        self._ssd[p.key] = p

    # -- backward -----------------------------------------------------------------------
    def unpack(self, saved):
        if isinstance(saved, _Kept):
            self.stats.device_bytes -= saved.nbytes
            return saved.tensor
        if not isinstance(saved, _Parked):
            return saved
        p = saved
        if p.unpacked is not None:  # (another save of the same tensor took it back already)
            t = p.unpacked
            p.refs -= 1
            if p.refs == 0:
                p.unpacked = None
            return t
        p.refs -= 1
        self.stats.returned += p.nbytes
        if p.key in self._ssd:
            self._read_back(p)
        self._read_ahead(p.key)
        if self.device.shares_host_memory:
            t = self._parked_tensor(p).clone()
            self._release(p)
        else:
            t, uploaded = p.on_device or self._upload(p)
            p.on_device = None
            self.device.wait(uploaded)
            self._release(p, uploaded)
            for q in sorted((q for q in self._host.values() if q.key < p.key),
                            key=lambda q: -q.key)[:UPLOAD_AHEAD]:  # the next ones backward needs
                if q.on_device is None:
                    q.on_device = self._upload(q)
        if p.refs:
            p.unpacked = t
        return t

    def _parked_tensor(self, p: _Parked) -> torch.Tensor:
        """A parked activation's bytes in the arena, as its tensor."""
        return self.arena.view(p.offset, p.nbytes).view(p.dtype).view(p.shape)

    def _upload(self, p: _Parked) -> tuple:
        return self.device.upload_new(self._parked_tensor(p), p.copied)

    def _reap(self, wait: bool = False) -> None:
        """Arena ranges whose copy back to the device has run become free (``wait``: the
        oldest is waited for)."""
        if wait and self._uploading:
            self._uploading[0][0].synchronize()
        still = []
        for event, off, n in self._uploading:
            if event.query():
                self.arena.give(off, n)
            else:
                still.append((event, off, n))
        self._uploading = still

    def _read_back(self, p: _Parked) -> None:
        if p.fetch is None:
            p.offset = self._make_room(p.nbytes)
            self._start_fetch(p)
        t0 = time.perf_counter()
        p.fetch.result()
        self.stats.read_back_s += time.perf_counter() - t0  # what read-ahead did not hide
        self.stats.read_back += p.nbytes
        p.fetch = None
        del self._ssd[p.key]
        self._host[p.key] = p
        self.stats.host_bytes += p.nbytes
        self.stats.host_peak = max(self.stats.host_peak, self.stats.host_bytes)

    def _start_fetch(self, p: _Parked) -> None:
        p.fetch = self._tier.read(p.spilled, p.offset)

    def _read_ahead(self, key: int) -> None:
        """Start reading back the spilled activations backward needs next (the highest
        keys below ``key``), as far as free arena space goes."""
        for p in sorted((q for q in self._ssd.values() if q.key < key and q.fetch is None),
                        key=lambda q: -q.key)[:4]:
            off = self.arena.take(p.nbytes)
            if off is None:
                return
            p.offset = off
            self._start_fetch(p)

    def _release(self, p: _Parked, uploading=None) -> None:
        if uploading is None:
            self.arena.give(p.offset, p.nbytes)
        else:  # freed once the upload out of it has run
            self._uploading.append((uploading, p.offset, p.nbytes))
        self.stats.host_bytes -= p.nbytes
        del self._host[p.key]
        if p.spilled is not None:  # its SSD copy goes too (without waiting for the daemon)
            self._tier.drop(p.spilled)

    def recomputed(self, fn, on_recompute):
        """``fn`` wrapped for "recompute": torch.utils.checkpoint (non-reentrant, RNG state
        restored, so dropout draws the same masks) keeps only the block's inputs and runs
        it again in backward, after ``on_recompute()`` has made its weights resident."""
        from torch.utils.checkpoint import checkpoint

        def forward(*args, **kwargs):
            if not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            inputs = sum(a.numel() * a.element_size() for a in (*args, *kwargs.values())
                         if isinstance(a, torch.Tensor))
            self.stats.kept(inputs)
            calls = [0]

            def run(*a, **k):
                calls[0] += 1
                if calls[0] == 2:  # the recomputation, in backward: the inputs are used now
                    on_recompute()
                    self.stats.device_bytes -= inputs
                return fn(*a, **k)

            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

        return forward

    def reset(self) -> None:
        """Drop everything a forward parked that no backward used."""
        for event, _, _ in self._uploading:
            event.synchronize()
        self._reap()
        for p in list(self._host.values()):
            p.copied.synchronize()
            if p.on_device is not None:
                p.on_device[1].synchronize()
        for p in list(self._ssd.values()):
            if p.fetch is not None:
                p.fetch.exception()
                self._arena.give(p.offset, p.nbytes)
        self._ssd.clear()
        for p in list(self._host.values()):
            self._arena.give(p.offset, p.nbytes)
        self._host.clear()
        self._parked_by_tensor.clear()
        if self._tier is not None:
            self._tier.reset()
        self.stats.host_bytes = 0
        self.stats.device_bytes = 0


def treatments(spec, group_names: list[str]) -> dict[str, str]:
    """``activations=`` as a treatment per block group: one word for all, or a dict by
    group name (the others keep)."""
    if isinstance(spec, str):
        if spec not in WORDS:
            raise ValueError(f"activations={spec!r}: expected one of {WORDS} or a dict by group name")
        return {n: "swap" if spec == "auto" else spec for n in group_names}  # auto: profiles swapping first
    unknown = set(spec) - set(group_names)
    if unknown:
        raise ValueError(f"activations names unknown groups {sorted(unknown)}; the block groups are {group_names}")
    bad = {k: v for k, v in spec.items() if v not in TREATMENTS}
    if bad:
        raise ValueError(f"activations treatments must be one of {TREATMENTS}, got {bad}")
    return {n: spec.get(n, "keep") for n in group_names}

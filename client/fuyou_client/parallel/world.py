"""Data parallelism on torch.distributed: the job's world as attach sees it.

Fuyou joins a process group the user (or torchrun, Ray Train, Slurm) initialised; it
never creates one. This module holds what every rank must agree on and how they agree:

* ``World``: the group, this rank, the size; ``World.of(process_group)`` is None for a
  single process (no group, or a world of one).
* ``agree``: one rank's failure becomes every rank's error, so that no rank is left
  waiting in a collective the failed one will never join (attach, checkpoints).
* ``Collectives``: every collective of an engine goes through one thread, in the order
  the training thread asks for them (reduce-scatters in backward order, all-gathers in
  group order), so the ranks issue them in the same order whatever order their local
  work (SSD reads, optimizer steps) completes in. With ``check=True`` each collective is
  preceded by an exchange of what it is, and ranks that disagree get an error naming
  both instead of a hang or mixed data.
* ``Shards``: how a layer group's flat vector is cut: N equal shards of a multiple of
  ``ALIGN`` elements (4 KiB of fp32), the last padded with zeros that never leave.
"""
from __future__ import annotations

import hashlib
import os
import queue
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

ALIGN = 1024  # shard sizes are multiples of this many elements (4 KiB of fp32)


class CollectiveError(RuntimeError):
    """A collective failed: a rank died or timed out, or the ranks disagreed on the order."""


@dataclass
class World:
    group: object  # a torch.distributed ProcessGroup (None: the default group)
    rank: int
    size: int
    backend: str

    @classmethod
    def of(cls, process_group=None) -> "World | None":
        """The data-parallel world attach joins: ``process_group`` or torch.distributed's
        default group when it is initialised, None for one process."""
        if not dist.is_available() or not dist.is_initialized():
            if process_group is not None:
                raise ValueError("process_group given, but torch.distributed is not initialised")
            return None
        size = dist.get_world_size(process_group)
        if size == 1:
            return None
        return cls(process_group, dist.get_rank(process_group), size, str(dist.get_backend(process_group)))

    @property
    def comm_device(self) -> torch.device:
        """Where this backend's tensors must be (NCCL: the current CUDA device)."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    @property
    def timeout(self) -> float:
        """The process group's collective timeout, in seconds."""
        try:
            pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
            device = torch.device("cuda" if self.backend == "nccl" else "cpu")
            return pg._get_backend(device).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - only for messages
            return dist.default_pg_timeout.total_seconds()

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (small, picklable), in rank order."""
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def from_rank0(self, obj):
        """Rank 0's ``obj`` on every rank."""
        return self.from_rank(0, obj)

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this group's ``rank`` (what dist's src and dst take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def from_rank(self, rank: int, obj):
        """Rank ``rank``'s ``obj`` on every rank."""
        box = [obj if self.rank == rank else None]
        dist.broadcast_object_list(box, src=self.global_rank(rank), group=self.group)
        return box[0]

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if ``what`` failed on any: this rank's own error as it is,
        the others' as a RuntimeError naming the ranks and their errors."""
        errors = self.gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = {r: e for r, e in enumerate(errors) if e is not None}
        if error is not None:
            raise error
        if failed:
            listed = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
            raise RuntimeError(f"{what} failed on rank{'s' if len(failed) > 1 else ''} "
                               f"{', '.join(map(str, failed))} ({listed})")

    def same(self, what: str, value) -> None:
        """Every rank must have the same ``value`` (e.g. the model's signature)."""
        values = self.gather(value)
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            raise ValueError(f"{what} differs between ranks: rank 0 has {values[0]!r}, rank {differ[0]} "
                             f"{values[differ[0]]!r}; every rank must attach the same model with the same optimizer "
                             "and options")

    def broadcast(self, tensors) -> None:
        """Rank 0's values of ``tensors`` on every rank (in place)."""
        for t in tensors:
            dist.broadcast(t, src=self.global_rank(0), group=self.group)


def job_id(world: World, namespace: str | None) -> str:
    """The job's name, agreed from rank 0: ``namespace``, else torchrun's run id, else a
    fresh one."""
    job = namespace or os.environ.get("TORCHELASTIC_RUN_ID") or ""
    if not job or job == "none":
        job = "dp-" + os.urandom(4).hex()
    return world.from_rank0(job)


def daemon_identity(session) -> tuple[str, str]:
    """(host, daemon): where this rank's daemon is. Ranks of one host that share a daemon
    have the same pair (tests simulate hosts with several daemons on one machine)."""
    status = session.daemon_status
    return socket.gethostname(), f"{status.session_socket}:{status.pid}"


def signature(groups) -> str:
    """What every rank's attach must agree on: the layer groups, their parameters'
    names, shapes and dtypes, and the optimizer of each part."""
    h = hashlib.sha256()
    for spec, optimizers in groups:
        h.update(spec.name.encode())
        for name, p in spec.params:
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        for opt in optimizers:
            h.update(repr(opt).encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Shards:
    """A layer group's ``numel`` elements cut into ``size`` shards of ``per`` each (a
    multiple of ALIGN); this rank's is [start, stop) (empty when the group is smaller
    than the ranks before it hold)."""
    numel: int
    size: int
    rank: int

    @property
    def per(self) -> int:
        return -(-(-(-self.numel // self.size)) // ALIGN) * ALIGN

    @property
    def padded(self) -> int:
        return self.per * self.size

    @property
    def start(self) -> int:
        return min(self.rank * self.per, self.numel)

    @property
    def stop(self) -> int:
        return min((self.rank + 1) * self.per, self.numel)

    def range_of(self, rank: int) -> tuple[int, int]:
        return min(rank * self.per, self.numel), min((rank + 1) * self.per, self.numel)

    def pieces(self, parts) -> list[tuple[object, int, int]]:
        """(part, lo, hi): where this shard meets each part (elements of the group's flat
        vector); parts it misses are left out."""
        out = []
        for part in parts:
            lo, hi = max(part.start, self.start), min(part.start + part.numel, self.stop)
            if lo < hi:
                out.append((part, lo, hi))
        return out


_STOP = object()


class Collectives:
    """One thread that runs the engine's collectives in the order they were asked for."""

    def __init__(self, world: World, check: bool = False):
        self.world = world
        self.check = check
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._seq = 0
        self._thread: threading.Thread | None = None  # (started by the first submission)

    def submit(self, what: str, fn, after: Future | None = None) -> Future:
        """Run ``fn()`` (which issues collectives) once ``after`` is done, in order with
        every other submission; the future has ``fn``'s result. ``after``'s failure does
        not skip the collective (the other ranks wait for it); it is the future's error."""
        fut: Future = Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fuyou-collectives", daemon=True)
            self._thread.start()
        self._queue.put((what, fn, after, fut))
        return fut

    @property
    def broken(self) -> BaseException | None:
        """The error of the collective that failed (every later one fails fast), or None."""
        return self._broken

    def run(self, what: str, fn):
        """``submit`` and wait."""
        return self.submit(what, fn).result()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            what, fn, after, fut = item
            local = None
            if after is not None:
                try:
                    after.result()
                except BaseException as exc:  # noqa: BLE001 - reported through fut, after the collective
                    local = exc
            if self._broken is not None:
                fut.set_exception(CollectiveError(f"{what}: not run, an earlier collective failed "
                                                  f"({self._broken})"))
                continue
            try:
                self._seq += 1
                if self.check:
                    self._check(what)
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - every later collective fails fast
                self._broken = _explain(exc, what, self.world)
                fut.set_exception(self._broken)
                continue
            if local is not None:
                fut.set_exception(local)
            else:
                fut.set_result(result)

    def _check(self, what: str) -> None:
        seen = self.world.gather((self._seq, what))
        if any(s != seen[0] for s in seen):
            listed = ", ".join(f"rank {r}: #{s[0]} {s[1]}" for r, s in enumerate(seen))
            raise CollectiveError(f"the ranks issued different collectives ({listed}): each rank must run the same "
                                  "layer groups in the same order (a group some rank did not use in an iteration, "
                                  "different models, or control flow that differs by rank)")

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=5)


def _explain(exc: BaseException, what: str, world: World) -> CollectiveError:
    if isinstance(exc, CollectiveError):
        return exc
    return CollectiveError(explain(f"{what} failed on rank {world.rank} of {world.size}", exc, world))


def explain(failed: str, exc: BaseException, world: World) -> str:
    """``failed`` (what failed where) because of ``exc``, with the ranks that were lost
    (liveness.py) and what to do."""
    from fuyou_client.parallel import liveness

    others = [world.global_rank(r) for r in range(world.size) if r != world.rank]
    gone = liveness.lost(others)
    return (f"{failed} ({type(exc).__name__}: {exc}): {gone or 'another rank died, hung or left'} (the process "
            f"group's timeout is {world.timeout:.0f} s); the optimizer state of every group is at its last "
            "acknowledged step or the next: resume from the last checkpoint (attach(resume=...))")


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group) -> None:
    """``out`` = this rank's chunk of the sum over the ranks of ``full``. gloo's own
    reduce-scatter moves as many bytes as an all-reduce (2(N-1)/N of ``full`` per rank):
    there each rank's chunks go straight to their owners (an all-to-all: (N-1)/N) and are
    summed here, in rank order."""
    if dist.get_backend(group) != "gloo":
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn(out, full, group=group)
        return
    chunks = torch.empty_like(full)
    dist.all_to_all_single(chunks, full, group=group)
    chunks = chunks.view(-1, out.numel())
    out.copy_(chunks[0])
    for chunk in chunks[1:]:
        out.add_(chunk)


def all_gather(full: torch.Tensor, shard: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(full, shard, group=group)


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    dist.all_reduce(t, op=op, group=group)

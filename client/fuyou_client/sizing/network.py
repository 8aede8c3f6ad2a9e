"""The network time of one data-parallel step, in each mode, from the bytes each host
must move (docs/guide/optimizer-host.md; measured by bench/scale.py):

* sharded (parallel/sharded.py): every rank sends and receives 2 (N-1)/N of the model's
  compute-dtype vector (the gradients' reduce-scatter, the weights' all-gather), all
  hosts at once: the step's network time is that over one host's link.
* optimizer host (parallel/remote.py): the workers reduce-scatter their gradients among
  themselves ((N-1)/N of a vector each way), each sends its shard to the owner (1/N), the
  owner scatters the new weights back (1/N in) and the workers all-gather them ((N-1)/N):
  2 - 1/N vectors each way per worker, 1/N more than the sharded mode. Each optimizer rank
  receives one vector of its groups' gradients and sends one of their weights per step,
  whatever N: its link is never the bound at equal bandwidth (``bound``); its SSD array,
  which steps the whole model every step (24 B/param in fp32 state), is what a growing N
  meets (docs/guide/optimizer-host.md).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NetworkTime:
    mode: str
    workers: int
    worker_bytes: float  # sent + received by one worker (or rank) per step
    host_bytes: float  # sent + received by one optimizer rank per step (0: sharded)
    seconds: float  # the step's network time: the busiest link's bytes over its bandwidth (full duplex)
    bound: str  # "workers" or "optimizer host": whose link that is


def sharded(params: int, itemsize: int, ranks: int, gbps: float) -> NetworkTime:
    """``params`` parameters in ``itemsize``-byte compute dtype over ``ranks`` ranks, one
    ``gbps`` GB/s link each (each way)."""
    each_way = 2 * (ranks - 1) / ranks * params * itemsize
    return NetworkTime("sharded", ranks, 2 * each_way, 0.0, each_way / (gbps * 1e9), "workers")


def optimizer_host(params: int, itemsize: int, workers: int, gbps: float, optimizer_ranks: int = 1,
                   host_gbps: float | None = None) -> NetworkTime:
    """The optimizer-host mode: ``workers`` workers, ``optimizer_ranks`` optimizer ranks
    (each owning 1/M of the parameters, on a ``host_gbps`` link; default ``gbps``)."""
    vector = params * itemsize
    each_way = (2 - 1 / workers) * vector if workers > 1 else vector
    worker_s = each_way / (gbps * 1e9)
    share = vector / optimizer_ranks  # (in: its groups' summed gradients; out: their weights)
    host_s = share / ((host_gbps or gbps) * 1e9)
    bound = "optimizer host" if host_s > worker_s else "workers"
    return NetworkTime("optimizer host", workers, 2 * each_way, 2 * share, max(worker_s, host_s), bound)


def optimizer_host_bound_workers(optimizer_ranks: int = 1, gbps: float = 12.5,
                                 host_gbps: float | None = None, most: int = 1 << 16) -> int | None:
    """The smallest number of workers from which the optimizer host's link, not the
    workers', bounds the step's network time; None when it never does (up to ``most``):
    its bytes per step do not grow with the workers."""
    for n in range(1, most + 1):
        if optimizer_host(1, 1, n, gbps, optimizer_ranks, host_gbps).bound == "optimizer host":
            return n
    return None

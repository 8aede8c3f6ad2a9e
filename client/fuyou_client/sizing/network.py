"""The network time of one data-parallel step, in each mode, from the bytes each host
must move (docs/guide/optimizer-host.md; measured by bench/scale.py):

* sharded (parallel/sharded.py): every rank sends and receives 2 (N-1)/N of the model's
  compute-dtype vector (the gradients' reduce-scatter, the weights' all-gather), all
  hosts at once: the step's network time is that over one host's link.
* optimizer host (parallel/remote.py): every worker sends its gradient once (the reduce)
  and receives the weights once; each optimizer rank receives its groups' gradients
  (about one vector of them per link, a reduce's tree or ring) and sends its groups'
  weights to every worker (gloo's broadcast from the root: N copies, as bench/scale.py
  measured). The optimizer host's egress grows with N: ``optimizer_host_bound_workers``
  is where it becomes the bound.
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
    share = vector / optimizer_ranks
    worker_s = vector / (gbps * 1e9)  # (each way: its gradient out, the weights in)
    host_out, host_in = workers * share, share
    host_s = max(host_out, host_in) / ((host_gbps or gbps) * 1e9)
    bound = "optimizer host" if host_s > worker_s else "workers"
    return NetworkTime("optimizer host", workers, 2 * vector, host_out + host_in, max(worker_s, host_s), bound)


def optimizer_host_bound_workers(optimizer_ranks: int = 1, gbps: float = 12.5, host_gbps: float | None = None) -> int:
    """The smallest number of workers from which the optimizer host's link, not the
    workers', bounds the step's network time (its egress: N copies of its share)."""
    n = 1
    while optimizer_host(1, 1, n, gbps, optimizer_ranks, host_gbps).bound != "optimizer host":
        n += 1
    return n

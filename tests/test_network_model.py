"""The network model of a data-parallel step (sizing/network.py) in each mode: the bytes
each host moves, as bench/scale.py measures them, and where the optimizer host's link
would become the bound."""
from __future__ import annotations

import pytest

from fuyou_client.sizing import network

P, S = 7_000_000_000, 2  # a 7B model in bf16
VECTOR = P * S


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_each_host_moves_what_its_collectives_send(n):
    sharded = network.sharded(P, S, n, 12.5)
    host = network.optimizer_host(P, S, n, 12.5)
    assert sharded.worker_bytes == pytest.approx(2 * 2 * (n - 1) / n * VECTOR)  # (reduce-scatter + all-gather, both ways)
    assert host.worker_bytes == pytest.approx(2 * (2 - 1 / n) * VECTOR)  # (and the shard to and from the host)
    assert host.host_bytes == pytest.approx(2 * VECTOR)  # (one vector in, one out, whatever n)
    assert host.worker_bytes - sharded.worker_bytes == pytest.approx(2 * VECTOR / n)


def test_the_optimizer_hosts_link_is_never_the_bound_at_equal_bandwidth_but_is_on_a_slower_one():
    """One worker moves one vector each way, as the host does; from two workers each moves
    2 - 1/N: a host link of at least the workers' bandwidth never binds, a slower one binds
    at one worker, and from the N where 2 - 1/N exceeds the ratio it binds no more."""
    assert network.optimizer_host_bound_workers(1, 12.5) is None
    assert network.optimizer_host(P, S, 64, 12.5).bound == "workers"
    assert network.optimizer_host_bound_workers(1, 12.5, host_gbps=7.0) == 1
    assert network.optimizer_host(P, S, 2, 12.5, host_gbps=9.0).bound == "workers"  # (1.5 / 12.5 > 1 / 9)
    assert network.optimizer_host(P, S, 4, 12.5, host_gbps=5.0).bound == "optimizer host"  # (1.75 / 12.5 < 1 / 5)


def test_several_optimizer_ranks_divide_the_host_bytes():
    one, two = network.optimizer_host(P, S, 4, 12.5), network.optimizer_host(P, S, 4, 12.5, optimizer_ranks=2)
    assert two.host_bytes == pytest.approx(one.host_bytes / 2)

"""The network model of a data-parallel step (sizing/network.py) in each mode: the bytes
each host moves against what bench/scale.py measured on real sockets (its committed
results), and where the optimizer host's link would become the bound."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuyou_client.sizing import network

P, S = 7_000_000_000, 2  # a 7B model in bf16
VECTOR = P * S


RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
# bench/scale.py's runs (real torchrun launches on gloo over TCP): per config, what each
# rank's sockets sent per parameter per iteration, and, with an optimizer host, what the
# host sent (loopback's total less the ranks'). Offloaded configs ("o") gather blocks at
# each fetch, which this model does not describe.
SCALE_RUNS = sorted(RESULTS.glob("scale*-cpu.json"))


def _measured():
    for path in SCALE_RUNS:
        run = json.loads(path.read_text())
        params, itemsize = run["model"]["params"], {"fp32": 4, "bf16": 2}[run["model"]["dtype"]]
        for name, c in run["configs"].items():
            if c["ranks"] > 1 and not c["offload"] and c["dtype"] == run["model"]["dtype"]:
                yield pytest.param(name, c, params, itemsize, id=f"{path.stem}-{name}")


@pytest.mark.parametrize("name, config, params, itemsize", list(_measured()))
def test_each_host_moves_what_the_benchmark_measured(name, config, params, itemsize):
    """The model's bytes against the bytes bench/scale.py counted on real sockets (the
    payload: headers and barriers add well under 1%): a worker sends half of what it moves
    (full duplex, each way the same), the optimizer host the shard of the step it serves."""
    n = config["ranks"]
    model = (network.optimizer_host(params, itemsize, n, 12.5) if name.endswith("h")
             else network.sharded(params, itemsize, n, 12.5))
    sent = config["tcp_sent_bytes_per_param_per_iter_per_rank"]
    assert model.worker_bytes / 2 / params == pytest.approx(sent, rel=0.01), (name, model)
    if "optimizer_host_sent_bytes_per_param_per_iter" in config:
        assert model.host_bytes / 2 / params == pytest.approx(config["optimizer_host_sent_bytes_per_param_per_iter"],
                                                             rel=0.01), (name, model)


def test_the_measurements_cover_both_modes_and_several_sizes():
    """(what the test above compares: both modes, 2 and 4 ranks, a host's own bytes)"""
    cases = {(c.values[0][-1] == "h", c.values[1]["ranks"]) for c in _measured()}
    assert {(False, 2), (False, 4), (True, 2), (True, 4)} <= cases
    assert any("optimizer_host_sent_bytes_per_param_per_iter" in c.values[1] for c in _measured())


def test_a_7b_model_in_bf16_by_hand():
    """One case worked out by hand (docs/guide/optimizer-host.md): 7B parameters, 2 bytes,
    4 workers: sharded, each moves 2 x 2 x 3/4 x 14 GB = 42 GB; with an optimizer host,
    2 x 1.75 x 14 GB = 49 GB, the host 2 x 14 GB = 28 GB."""
    assert network.sharded(P, S, 4, 12.5).worker_bytes == pytest.approx(42e9)
    host = network.optimizer_host(P, S, 4, 12.5)
    assert host.worker_bytes == pytest.approx(49e9) and host.host_bytes == pytest.approx(28e9)
    assert host.seconds == pytest.approx(24.5e9 / 12.5e9)  # (the workers' 1.75 vectors each way bind)


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

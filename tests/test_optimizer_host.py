"""A dedicated optimizer host (parallel/link.py, parallel/remote.py, engine/serve.py)
under real launches on gloo: workers and optimizer ranks of tests/opthost_worker.py
against real daemons (one per simulated host), each case's results read back from the
JSON files the ranks write."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fuyou_client
from conftest import SMALL, merge, private_daemon
from test_distributed import TORCHRUN, env_for, free_port

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "opthost_worker.py")
CONFIG = merge(SMALL, {"storage": {"capacity_per_device": "1GiB"}})


def torchrun(daemon, nproc: int, case: str, out: Path, *args: str, opt_ranks: str | None = None,
             timeout: float = 240, env: dict | None = None) -> None:
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", WORKER, case, str(out), *args]
    run_env = dict(env_for(daemon, out), OPT_RANKS=opt_ranks or str(nproc - 1), **(env or {}))
    done = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def launch(daemon, world: int, case: str, out: Path, *args: str, opt_ranks: str, sockets: dict | None = None):
    """The ranks started directly (no torchrun agent, which would stop the others when one
    dies): returns the processes."""
    port = free_port()
    env = dict(env_for(daemon, out), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               OPT_RANKS=opt_ranks)
    for rank, sock in (sockets or {}).items():
        env[f"FUYOUD_SOCKET_{rank}"] = str(sock)
    return [subprocess.Popen([sys.executable, WORKER, case, str(out), *args],
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for r in range(world)]


def results(out: Path, case: str, nproc: int) -> list[dict]:
    return [json.loads((out / f"{case}-rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(CONFIG, prefix="fy-oh-") as d:
        yield d


@pytest.fixture
def out(tmp_path):
    return tmp_path


def _assert_exact(ranks: list[dict], workers: int) -> None:
    for rank in ranks[:workers]:
        for name, r in rank.items():
            if "clip" in name:  # (the norm: summed by groups where the gradients are summed, by parameters in torch)
                assert r["max_diff"] < 1e-6, (name, r)
                assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), (name, r)
            else:
                assert r["differ"] == [] and r["losses"] == r["ref_losses"], (name, r)
    for rank in ranks[workers:]:  # (the optimizer rank stepped every group, every iteration)
        for name, r in rank.items():
            assert r["steps"] > 0 and r["served"]["reduce"] >= r["steps"] and "close" in r["served"], (name, r)


def test_two_workers_bitwise_against_ddp(daemon, out):
    """Two workers and one optimizer rank (built on the meta device): bitwise against torch
    DDP + fused AdamW for GPT-2 and Llama, accumulation, bf16, and on the stand-in for a
    device with its own memory (gradients down, weights up through host memory); clipping
    (the norm computed on the optimizer rank) within 1e-6."""
    torchrun(daemon, 3, "exact", out, "exact.names=plain,llama,accum,clip,bf16,stand-in,stand-in-clip")
    ranks = results(out, "exact", 3)
    assert all(r["reference"] == "ddp" for r in ranks[0].values())
    _assert_exact(ranks, 2)

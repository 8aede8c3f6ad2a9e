"""A dedicated optimizer host (parallel/link.py, parallel/remote.py, engine/serve.py)
under real launches on gloo: workers and optimizer ranks of tests/opthost_worker.py
against real daemons (one per simulated host), each case's results read back from the
JSON files the ranks write."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fuyou_client
from conftest import SMALL, merge, private_daemon
import test_distributed as distributed
from test_distributed import env_for, free_port, results

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "opthost_worker.py")
CONFIG = merge(SMALL, {"storage": {"capacity_per_device": "1GiB"}})


def torchrun(daemon, nproc: int, case: str, out: Path, *args: str, env: dict | None = None) -> None:
    """opthost_worker.py under torchrun; the last rank is the optimizer rank."""
    distributed.torchrun(daemon, nproc, case, out, *args, worker=WORKER,
                         env=dict(OPT_RANKS=str(nproc - 1), **(env or {})))


class launch:
    """The ranks started directly (no torchrun agent, which would stop the others when one
    dies), the job's store in this process as torchrun's agent holds it (so that a rank's
    end does not take the store with it): ``with launch(...) as procs``."""

    def __init__(self, daemon, world: int, case: str, out: Path, *args: str, opt_ranks: str,
                 sockets: dict | None = None):
        self.args = (daemon, world, case, out, args, opt_ranks, sockets or {})

    def __enter__(self) -> list:
        import torch.distributed as dist

        daemon, world, case, out, args, opt_ranks, sockets = self.args
        port = free_port()
        self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        env = dict(env_for(daemon, out), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   OPT_RANKS=opt_ranks, TORCHELASTIC_USE_AGENT_STORE="True")
        for rank, sock in sockets.items():
            env[f"FUYOUD_SOCKET_{rank}"] = str(sock)
        return [subprocess.Popen([sys.executable, WORKER, case, str(out), *args],
                                 env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for r in range(world)]

    def __exit__(self, *exc) -> None:
        del self.store


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
            assert r["held"]["objects"] == 0, (name, r["held"])  # (no optimizer state on a worker)
            if "offload" in name:  # (no weights between uses either)
                assert r["held"]["block_elements"] == 0, (name, r["held"])
            if "clip" in name:  # (the norm: summed by groups where the gradients are summed, by parameters in torch)
                assert r["max_diff"] < 1e-6, (name, r)
                assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), (name, r)
            else:
                assert r["differ"] == [] and r["losses"] == r["ref_losses"], (name, r)
    for rank in ranks[workers:]:  # (the optimizer rank stepped every group, every iteration)
        for name, r in rank.items():
            assert r["steps"] > 0 and r["served"]["reduce"] >= r["steps"] and "close" in r["served"], (name, r)


# Two workers' exactness cases: a first set in the default suite (one launch, with the
# non-finite gradient), the combinations of the same features with `-m slow`.
EXACT_FIRST = "plain,clip,offload,stand-in-offload"
EXACT_REST = "llama,accum,bf16,stand-in,stand-in-clip,offload-accum,offload-bf16,offload-clip"


@pytest.mark.parametrize("names", [EXACT_FIRST, pytest.param(EXACT_REST, marks=pytest.mark.slow)],
                         ids=["first", "combinations"])
def test_two_workers_bitwise_against_ddp(daemon, out, names):
    """Two workers and one optimizer rank (built on the meta device): bitwise against torch
    DDP + fused AdamW for GPT-2 and Llama, accumulation, bf16, offloaded weights (each fetch
    brought from the optimizer rank), and on the stand-in for a device with its own memory
    (gradients down, weights up through host memory); clipping (the norm computed on the
    optimizer rank) within 1e-6. Then (the first set's launch) a NaN in one worker's
    gradient: that group steps nowhere (without clipping) or no group does (with),
    NonFinite on every worker, the workers' weights still equal."""
    first = names == EXACT_FIRST
    torchrun(daemon, 3, "exact+nonfinite" if first else "exact", out, f"exact.names={names}")
    ranks = results(out, "exact", 3)
    assert all(r["reference"] == "ddp" for r in ranks[0].values())
    _assert_exact(ranks, 2)
    if not first:
        return
    for rank in results(out, "nonfinite", 3)[:2]:  # (NaN in the last worker's gradient of block 0, step 2)
        plain, clipped = rank["None"], rank["0.05"]
        assert "block0000" in plain["error"] and plain["stepped"] == [2, 3, 3], plain  # (the other two stepped)
        assert "total gradient norm is nan" in clipped["error"] and clipped["stepped"] == [2, 2, 2], clipped
        assert plain["same_weights"] and clipped["same_weights"]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpu_workers_bitwise_against_ddp(daemon, out):
    """Workers on two GPUs (gradients down to host memory, weights up; the links gloo) and
    an optimizer rank on the CPU: bitwise against DDP on the same GPUs."""
    torchrun(daemon, 3, "exact", out, "exact.names=plain,accum,bf16,offload", env={"FY_DEVICE": "cuda"})
    _assert_exact(results(out, "exact", 3), 2)


@pytest.mark.slow  # (four ranks on two cores: about a minute)
def test_three_workers_bitwise_against_the_same_collectives(daemon, out):
    """Three workers (the shards are padded): bitwise against the same collectives around
    torch's fused AdamW (the workers' reduce-scatter adds in rank order; DDP's all-reduce in
    another), offloaded weights too."""
    torchrun(daemon, 4, "exact", out, "exact.names=plain,accum,clip,offload,stand-in-offload")
    ranks = results(out, "exact", 4)
    assert all(r["reference"] == "manual" for r in ranks[0].values())
    _assert_exact(ranks, 3)


@pytest.mark.slow  # (four to five ranks and two daemons, four launches: about a minute)
def test_two_optimizer_ranks_on_two_hosts_and_resume_at_other_worker_counts(out):
    """Two workers and two optimizer ranks, each optimizer rank on its own simulated host
    (its own daemon, socket and data directories), each owning a contiguous share of the
    groups: bitwise against DDP; a checkpoint written by the two optimizer ranks alone
    resumes at the same number of workers bitwise the run that never stopped (offloaded
    weights too), and at one and three workers with the checkpoint's weights and step
    counts, no resharding."""
    with private_daemon(CONFIG, prefix="fy-oh0-") as d0, private_daemon(CONFIG, prefix="fy-oh1-") as d1:
        sockets = {2: d0.socket, 3: d1.socket}
        with launch(d0, 4, "exact+checkpoint", out, "exact.names=plain", f"checkpoint.ckpt={out / 'ck'}",
                    opt_ranks="2,3", sockets=sockets) as procs:
            logs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, "\n".join(log[-3000:] for log in logs)
        _assert_exact(results(out, "exact", 4), 2)
        for d in (d0, d1):  # (each daemon holds the state of its rank's groups)
            with fuyou_client.connect(d.socket) as s:
                assert s.status().bytes_written > 0
        layout = json.loads((out / "ck" / "optimizer-host.json").read_text())
        assert layout == {"format": 1, "optimizer_ranks": 2, "groups": [["block0000"], ["block0001", "rest"]]}
        assert sorted(p.name for p in (out / "ck").iterdir()) == ["optimizer-00000", "optimizer-00001",
                                                                 "optimizer-host.json"]
        for workers, offload in ((2, "0"), (1, "0"), (3, "0"), (2, "1")):
            with launch(d0, workers + 2, "checkpoint", out, f"ckpt={out / 'ck'}", "phase=resume",
                        f"offload={offload}", opt_ranks=f"{workers},{workers + 1}",
                        sockets={workers: d0.socket, workers + 1: d1.socket}) as procs:
                logs = [p.communicate(timeout=240)[0] for p in procs]
            assert [p.returncode for p in procs] == [0] * (workers + 2), "\n".join(log[-3000:] for log in logs)
            ranks = results(out, "checkpoint", workers + 2)
            for rank in ranks[:workers]:
                assert rank["at_resume"] == [] and rank["extra"] == {"data_position": 2}, rank
                assert rank["daemon_steps"] == [4], rank  # (checkpointed at 2, two more)
                if workers == 2:  # (the same data: the run that never stopped)
                    assert rank["differ"] == [], rank
            assert [r["steps"] for r in ranks[workers:]] == [2, 4], ranks  # (one group and two, stepped twice)


@pytest.fixture(scope="module")
def saved(daemon, tmp_path_factory):
    """Two workers and an optimizer rank: checkpoint after 2 steps, 2 more steps, export
    (opthost_worker.case_checkpoint)."""
    out = tmp_path_factory.mktemp("oh-ckpt")
    torchrun(daemon, 3, "checkpoint", out, f"ckpt={out / 'ck'}", "phase=save")
    return out


@pytest.mark.slow  # (the saved run: about 20 s)
def test_exported_weights_load_with_from_pretrained(saved):
    """The first worker exports, streaming the masters from the optimizer rank; the files
    load with from_pretrained and hold the weights the workers trained."""
    import transformers

    exported = transformers.GPT2LMHeadModel.from_pretrained(saved / "export")
    continued = torch.load(saved / "continued.pt")
    for name, p in exported.named_parameters():
        assert torch.equal(p.detach(), continued[name]), name


@pytest.mark.slow  # (a kill and a resume each: about 30 s)
@pytest.mark.parametrize("who", ["worker", "optimizer"])
def test_a_killed_rank_is_named_on_the_others_and_resume_continues(daemon, saved, who):
    """A worker, or the optimizer rank, SIGKILLed mid-step (after backward sent the
    gradients): every other rank raises an error naming the lost rank within the group's
    timeout plus 5 s, and the checkpoint before it resumes bitwise the run that never
    stopped."""
    out, ckpt = saved, saved / f"ck-{who}"
    with launch(daemon, 3, "kill", out, f"who={who}", f"ckpt={ckpt}", opt_ranks="2") as procs:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    victim = 1 if who == "worker" else 2
    assert procs[victim].returncode == -9, logs[victim][-3000:]
    for r in (r for r in range(3) if r != victim):
        assert procs[r].returncode == 0, logs[r][-3000:]
        rank = json.loads((out / f"kill-rank{r}.json").read_text())
        assert rank["error"] and f"rank {victim} stopped answering (lost)" in rank["error"], rank
        assert "resume from the last checkpoint" in rank["error"], rank
        if "seconds" in rank:  # (a worker: from engine.step() to its error)
            assert rank["seconds"] < 60 + 5, rank
    torchrun(daemon, 3, "checkpoint", out, f"ckpt={ckpt}", "phase=resume", "steps=2")
    for rank in results(out, "checkpoint", 3)[:2]:
        assert rank["at_resume"] == [] and rank["differ"] == [] and rank["daemon_steps"] == [4], rank


@pytest.mark.slow  # (three attach attempts in one launch: about 25 s)
def test_ranks_that_disagree_are_refused_on_every_rank(daemon, out):
    """Workers that disagree on the model or on the optimizer ranks, an optimizer rank
    whose daemon cannot hold the state: an error on every rank, no hang, and the group
    still usable after each."""
    small = merge(SMALL, {"storage": {"capacity_per_device": "1MiB"}})
    with private_daemon(small, prefix="fy-ohs-") as tiny:
        torchrun(daemon, 3, "bad", out, "what=model,ranks,capacity", env={"FUYOUD_SOCKET_SMALL": str(tiny.socket)})
    ranks = results(out, "bad", 3)
    for rank in ranks:
        assert all(v is not None for v in rank.values()), rank
        assert "differs between ranks" in rank["model"], rank
        assert "optimizer_ranks differs between ranks" in rank["ranks"], rank
        assert "SSD array" in rank["capacity"], rank
    assert "rank 2" in ranks[0]["capacity"] and "rank 2" in ranks[1]["capacity"]


def test_bad_options_are_refused_before_anything_starts():
    from fuyou_client import AttachOptions

    with pytest.raises(ValueError, match="non-empty list of ranks"):
        AttachOptions(optimizer_ranks=[])
    with pytest.raises(ValueError, match="names a rank twice"):
        AttachOptions(optimizer_ranks=[2, 2])
    with pytest.raises(ValueError, match="no torch.distributed world"):
        fuyou_client.attach(__import__("conftest").tiny_gpt2(layers=1, width=16), optimizer_ranks=[1], offload=False)

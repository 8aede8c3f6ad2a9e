"""Data parallelism (sharded.py, distributed.py, dp_checkpoints.py) under real torchrun
launches on gloo: the ranks of tests/dp_worker.py against a real daemon (one per
simulated host), each case's results read back from the JSON files the ranks write."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fuyou_client
from conftest import SMALL, merge, private_daemon

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "dp_worker.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
CONFIG = merge(SMALL, {"storage": {"capacity_per_device": "1GiB"}})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(daemon, tmp: Path) -> dict:
    """The ranks' environment; their temporary files (torchrun's torchelastic_* among
    them) under ``tmp``, the test's own directory."""
    env = dict(os.environ, FUYOUD_SOCKET=str(daemon.socket), OMP_NUM_THREADS="1", FY_PG_TIMEOUT="60", TMPDIR=str(tmp),
               PYTHONPATH=os.pathsep.join([str(ROOT / "client"), str(ROOT / "proto"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def torchrun(daemon, nproc: int, case: str, out: Path, *args: str, timeout: float = 240, worker: str = WORKER,
             env: dict | None = None) -> None:
    """``worker`` CASE OUT ARGS under torchrun on one host (``env``: more of the ranks' environment)."""
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", worker, case, str(out), *args]
    done = subprocess.run(cmd, env=dict(env_for(daemon, out), **(env or {})), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def results(out: Path, case: str, nproc: int) -> list[dict]:
    return [json.loads((out / f"{case}-rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(CONFIG, prefix="fy-dp-") as d:
        yield d


@pytest.fixture
def out(tmp_path):
    return tmp_path


# Two ranks' exactness cases: a first set in the default suite (one torchrun launch, with the
# refusals and the non-finite gradient), the combinations of the same features with `-m slow`.
EXACT_FIRST = "plain,llama,accum-backward,clip,bf16,offload,stand-in"
EXACT_REST = ("accum,swap,offload-accum,offload-bf16,offload-clip,stand-in-backward,stand-in-clip,stand-in-offload,"
              "stand-in-offload-bf16")


@pytest.mark.parametrize("names", [EXACT_FIRST, pytest.param(EXACT_REST, marks=pytest.mark.slow)],
                         ids=["first", "combinations"])
def test_two_ranks_bitwise_against_ddp_and_inconsistent_ranks_refused(daemon, out, names):
    """N=2: bitwise against torch DDP + fused AdamW (fp32 masters for bf16) for GPT-2,
    Llama, accumulation, bf16, swapped activations, offloaded weights (each fetch reads the rank's shard and
    gathers the rest); per-backward reduction against the same collectives by
    hand; clipping (the norm is summed by shards, not by parameters) within 1e-6; the
    same on the stand-in for a device with its own memory (late copies), whose links carry
    exactly the shards (1/N of a single process's bytes). Then (the first set's launch)
    ranks that attach inconsistently all get an error and the group stays usable, and with
    check_collectives a rank that skips a block is an error on both, not a hang; a NaN in
    one rank's gradient steps that group on no rank and raises NonFinite on both."""
    first = names == EXACT_FIRST
    torchrun(daemon, 2, "exact+bad+nonfinite" if first else "exact", out, f"exact.names={names}",
             *(["bad.what=model,daemon,namespace,diverge"] if first else []))
    for rank in results(out, "exact", 2):
        for name, r in rank.items():
            if "clip" in name:  # (engine.grad_norm(): the norm of the ranks' mean gradient, as DDP's)
                assert r["max_diff"] < 1e-6, (name, r)
                assert len(r["norms"]) == 3 and r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), r
            else:
                assert r["differ"] == [] and r["losses"] == r["ref_losses"], (name, r)
            if "stand-in" in name and r["pcie"]:  # a device with its own memory: only this rank's shards cross
                assert r["pcie"]["up"] == r["pcie"]["want_up"] and r["pcie"].get("down") == r["pcie"].get("want_down")
        if first:
            assert rank["accum-backward"]["reference"] == "run_manual"
            assert rank["plain"]["reference"] == "run_ddp"
        assert set(rank) == set(names.split(","))
    if not first:
        return
    bad = results(out, "bad", 2)
    for rank in bad:
        assert all(v is not None for v in rank.values()), rank
    assert "differs between ranks" in bad[0]["model"] and "differs between ranks" in bad[1]["model"]
    assert "DaemonUnavailable" in bad[1]["daemon"] and "rank 1" in bad[0]["daemon"]
    assert "NamespaceBusy" in bad[1]["namespace"] and "rank 1" in bad[0]["namespace"]
    for rank in results(out, "nonfinite", 2):  # (NaN in rank 1's gradient of block 0: stepped nowhere)
        assert "block0000" in rank["error"] and "not stepped on any rank" in rank["error"], rank
        assert rank["steps"] == {"block0000": 1, "block0001": 2, "rest": 2} and rank["same_weights"], rank
    for rank in bad:  # (check_collectives: rank 1 skipped a block)
        assert "issued different collectives" in rank["diverge"] and "reduce-scatter block0001" in rank["diverge"]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_on_nccl_bitwise_against_ddp(daemon, out):
    """NCCL: the collectives on the GPUs' flat tensors, only the shards over PCIe."""
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", WORKER, "exact", str(out), "names=plain,accum,bf16"]
    done = subprocess.run(cmd, env=dict(env_for(daemon, out), FY_BACKEND="nccl"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for rank in results(out, "exact", 2):
        for name, r in rank.items():
            assert r["differ"] == [] and r["reference"] == "run_ddp", (name, r)


@pytest.mark.slow  # (about a minute; three ranks also in test_checkpoint_resumes_bitwise_and_reshards, slow too)
def test_three_ranks_pad_and_match_the_collectives_and_one_process(daemon, out):
    """N=3 (the shards are padded): bitwise against the same collectives around fused
    AdamW (clipping within 1e-6); one step against one process on the concatenated batch within 1e-6."""
    torchrun(daemon, 3, "exact+single", out, "exact.names=plain,accum-backward,clip,offload")
    for rank in results(out, "exact", 3):
        for name, r in rank.items():
            assert r["reference"] == "run_manual"
            if name == "clip":  # (the norm: summed by shards here, by parameters in torch)
                assert r["max_diff"] < 1e-6, (name, r)
            else:
                assert r["differ"] == [] and r["losses"] == r["ref_losses"], (name, r)
    for rank in results(out, "single", 3):
        assert rank["max_diff"] < 1e-6, rank


@pytest.mark.slow  # (two torchrun agents and two daemons, then a third launch: about 45 s)
def test_two_hosts_each_with_its_daemon(out):
    """Two simulated hosts: two torchrun agents (--nnodes 2) on 127.0.0.1, each with its own
    daemon, socket and data directories; bitwise against DDP, each daemon steps its rank's
    shards; a checkpoint written as copies on a shared path is resumed by one process on
    one host's daemon (2 -> 1, reading the other host's copy)."""
    port = free_port()
    with private_daemon(CONFIG, prefix="fy-h0-") as d0, private_daemon(CONFIG, prefix="fy-h1-") as d1:
        daemons = [d0, d1]
        procs = []
        for node, d in enumerate(daemons):
            cmd = [TORCHRUN, "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                   f"--master-port={port}", WORKER, "exact+checkpoint", str(out), "exact.names=plain",
                   f"checkpoint.ckpt={out / 'ck'}", "checkpoint.phase=save", "checkpoint.mode=copy"]
            procs.append(subprocess.Popen(cmd, env=env_for(d, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        logs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-4000:] for log in logs)
        for d in daemons:
            with fuyou_client.connect(d.socket) as s:
                status = s.status()
                assert status.bytes_written > 0  # (each daemon stepped its rank's shards)
        for rank in results(out, "exact", 2):
            assert rank["plain"]["differ"] == [] and rank["plain"]["reference"] == "run_ddp"
        world = json.loads((out / "ck" / "world.json").read_text())
        assert [r["mode"] for r in world["ranks"]] == ["copy", "copy"]
        assert world["ranks"][0]["daemon"] != world["ranks"][1]["daemon"]
        # One process on the first host's daemon takes both hosts' shards (the copies on a shared path).
        torchrun(d0, 1, "checkpoint", out, f"ckpt={out / 'ck'}", "phase=resume", "steps=1")
        (one,) = results(out, "checkpoint", 1)
        assert one["at_resume"] == [] and one["steps"] == {"0": 3}, one


@pytest.fixture(scope="module")
def saved(daemon, tmp_path_factory):
    """A 2-rank run: checkpoint after 2 steps, 2 more steps, export (dp_worker.case_checkpoint)."""
    out = tmp_path_factory.mktemp("dp-ckpt")
    torchrun(daemon, 2, "checkpoint", out, f"ckpt={out / 'ck2'}", "phase=save")
    return out


@pytest.mark.slow  # (five torchrun launches, 2 -> 3 -> 2 -> 1 ranks: over a minute)
def test_checkpoint_resumes_bitwise_and_reshards(daemon, saved):
    """2 -> 3 (refused without reshard=True, then cut again and checkpointed at once),
    3 -> 2 (then 2 more steps: bitwise the run that never stopped), 2 -> 1; the export of
    the sharded run loads with from_pretrained."""
    import transformers

    out = saved
    world = json.loads((out / "ck2" / "world.json").read_text())
    assert world["world_size"] == 2 and world["step"] == 2 and world["extra"] == {"data_position": 2}
    assert sorted(p.name for p in (out / "ck2").iterdir()) == ["rank-00000", "rank-00001", "world.json"]
    torchrun(daemon, 3, "bad+checkpoint", out, f"bad.ckpt={out / 'ck2'}", "bad.what=world",
             f"checkpoint.ckpt={out / 'ck2'}", "checkpoint.phase=resume", f"checkpoint.save_to={out / 'ck3'}")
    for rank in results(out, "bad", 3):
        assert "written by 2 ranks" in rank["world"] and "reshard=True" in rank["world"], rank
    for rank in results(out, "checkpoint", 3):
        assert rank["at_resume"] == [] and rank["extra"] == {"data_position": 2}, rank
    torchrun(daemon, 2, "checkpoint", out, f"ckpt={out / 'ck3'}", "phase=resume", "steps=2")
    for rank in results(out, "checkpoint", 2):
        assert rank["world"] == 3 and rank["at_resume"] == [] and rank["differ"] == [], rank
        assert rank["steps"] == {"0": 4}
    torchrun(daemon, 1, "checkpoint", out, f"ckpt={out / 'ck2'}", "phase=resume", "steps=1")
    (one,) = results(out, "checkpoint", 1)
    assert one["at_resume"] == [] and one["steps"] == {"0": 3}, one
    exported = transformers.GPT2LMHeadModel.from_pretrained(out / "export2")
    continued = torch.load(out / "continued.pt")
    for name, p in exported.named_parameters():
        assert torch.equal(p.detach(), continued[name]), name


@pytest.mark.slow  # (the checkpointed run it resumes, a kill and a resume: about 35 s)
def test_a_killed_rank_is_an_error_on_the_others_and_resume_continues(daemon, saved):
    """Rank 1 SIGKILLed mid-step: rank 0 raises at once (well within the group's timeout
    plus 5 s) naming the lost rank, its daemon has reclaimed the dead session within 5 s,
    every group is at the last acknowledged step or the next, and resume from the last
    checkpoint continues bitwise."""
    out = saved
    port = free_port()
    env = dict(env_for(daemon, out), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, WORKER, "kill", str(out), f"ckpt={out / 'ckk'}"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert procs[1].returncode == -9, logs[1][-3000:]
    assert procs[0].returncode == 0, logs[0][-3000:]
    r0 = json.loads((out / "kill-rank0.json").read_text())
    assert r0["error"] and "rank 1 stopped answering (lost)" in r0["error"] and r0["seconds"] < 60 + 5, r0
    assert r0["reclaimed_seconds"] < 5, r0
    assert set(r0["steps_r1"]) <= {2, 3} and set(r0["steps_r0"]) <= {2, 3}, r0
    torchrun(daemon, 2, "checkpoint", out, f"ckpt={out / 'ckk'}", "phase=resume", "steps=2")
    for rank in results(out, "checkpoint", 2):
        assert rank["at_resume"] == [] and rank["differ"] == [], rank


def test_a_damaged_world_file_and_bad_options_are_refused(tmp_path):
    """A world.json whose world size is not a positive integer is refused before any
    shard is read; the data-parallel options are checked like the others."""
    from fuyou_client.parallel import checkpoints as dp_checkpoints

    (tmp_path / "world.json").write_text(json.dumps({"format": 1, "world_size": 0}))
    with pytest.raises(ValueError, match="world_size 0, not a positive integer"):
        dp_checkpoints.read_world(tmp_path)
    with pytest.raises(ValueError, match="reduce must be 'step' or 'backward'"):
        fuyou_client.AttachOptions(reduce="sometimes")
    with pytest.raises(ValueError, match="reshard must be True or False"):
        fuyou_client.AttachOptions(reshard="yes")

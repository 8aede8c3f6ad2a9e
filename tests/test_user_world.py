"""The user's world (tests/userworld.py): the host's fuyoud run as deploy/fuyoud.service runs
it, its own uid and group, and training users who are other uids. What these tests show of
it is what each test of the harness may take for granted."""
from __future__ import annotations

import json
import os
import stat
import tempfile
import textwrap
from pathlib import Path

import pytest

from conftest import wait_until
from userworld import DAEMON, OUTSIDER, TRAINER, host_daemon, needs_user_world, owners, proc_status

pytestmark = needs_user_world

# The member's run: a 2-layer GPT-2 built from its config (nothing downloaded), attached
# to the host's daemon, 2 steps; what it wrote lands in its home (cwd).
MODEL = """
import json, math, sys
from pathlib import Path
import torch, transformers, fuyou_client

def gpt2(seed):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))

X = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

def train_step(model, engine):
    loss = model(X, labels=X).loss
    loss.backward()
    engine.step()
    engine.zero_grad()
    return loss.item()
"""

TRAIN = MODEL + textwrap.dedent("""
    model = gpt2(0)
    engine = fuyou_client.attach(model, socket=sys.argv[1])
    losses = [train_step(model, engine) for _ in range(2)]
    engine.close()
    Path("losses.json").write_text(json.dumps(losses))
    model.save_pretrained("trained")
    print(json.dumps({"losses": losses}))
""")

SAVE = MODEL + textwrap.dedent("""
    model = gpt2(0)
    engine = fuyou_client.attach(model, socket=sys.argv[1])
    for _ in range(2):
        train_step(model, engine)
    engine.save_checkpoint(Path.home() / "ckpt")
    third = train_step(model, engine)  # the run that goes on: its next loss
    engine.close()
    print(json.dumps({"third": third}))
""")

RESUME = MODEL + textwrap.dedent("""
    model = gpt2(123)  # other initial weights: all of them must come from the checkpoint
    engine = fuyou_client.attach(model, socket=sys.argv[1], resume=Path.home() / "ckpt")
    steps = engine.state_dict()["group_steps"]
    third = train_step(model, engine)
    engine.close()
    print(json.dumps({"steps": sorted(set(steps.values())), "third": third}))
""")

CONNECT = textwrap.dedent("""
    import sys, fuyou_client
    try:
        fuyou_client.connect(sys.argv[1]).close()
        print("OK")
    except fuyou_client.FuyouClientError as exc:
        print(type(exc).__name__ + ": " + str(exc))
""")


@pytest.fixture(scope="module")
def host():
    root = Path(tempfile.mkdtemp(prefix="fyuw-", dir="/tmp"))
    with host_daemon(root) as d:
        yield d
        code = d.stop()
        assert code == 0, d.log()
    assert not root.exists()


def last_json(out: str):
    return json.loads(out.strip().splitlines()[-1])


def test_the_daemon_runs_as_the_unit_runs_it(host):
    """Its own uid and gid, no supplementary groups, UMask=0027, NoNewPrivileges; it told
    its supervisor READY=1 and its watchdog probe (through its own control socket, as its
    own uid) passes."""
    status = proc_status(host.pid)
    assert status["Uid"].split() == [str(DAEMON.uid)] * 4
    assert status["Gid"].split() == [str(DAEMON.gid)] * 4
    assert status["Groups"] == ""
    assert status["Umask"] == "0027"
    assert status["NoNewPrivs"] == "1"
    wait_until(lambda: "WATCHDOG=1" in host.notices(), "a watchdog ping", seconds=20)
    assert any(n.startswith("READY=1") for n in host.notices())


def test_its_sockets_are_its_groups_in_a_0750_directory(host):
    run = host.runtime_dir.lstat()
    assert (run.st_uid, run.st_gid, stat.S_IMODE(run.st_mode)) == (DAEMON.uid, DAEMON.gid, 0o750)
    for path in (host.socket, host.session_socket):
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode), path
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (DAEMON.uid, DAEMON.gid, 0o660), path
    token = (host.runtime_dir / "admin.token").lstat()
    assert (token.st_uid, stat.S_IMODE(token.st_mode)) == (DAEMON.uid, 0o600)
    # StateDirectory= (0750) and all in it: the daemon's, nothing for others (UMask=0027).
    for name, (uid, gid, mode) in owners(host.state_dir).items():
        assert (uid, gid) == (DAEMON.uid, DAEMON.gid), name
        assert mode & 0o027 == 0, f"{name}: {oct(mode)}"
    assert stat.S_IMODE(host.state_dir.lstat().st_mode) == 0o750


def test_a_user_not_in_the_daemons_group_is_refused(host):
    _, out, _ = host.run_as(OUTSIDER, CONNECT, args=[host.socket], walk=("fuyou_client.connection", "fuyou_proto"),
                            imports=())
    got = out.strip().splitlines()[-1]
    assert got.startswith("PermissionDenied: permission denied on ") and str(host.runtime_dir) in got, got
    assert f"add user {OUTSIDER.name} to group {DAEMON.name}" in got, got


@pytest.mark.slow  # (test_a_member_checkpoints_into_its_home_and_resumes trains as the member too)
def test_a_member_trains_a_tiny_gpt2_and_what_it_writes_is_its_own(host):
    _, out, _ = host.run_as(TRAINER, TRAIN, args=[host.socket])
    losses = last_json(out)["losses"]
    assert len(losses) == 2 and all(isinstance(v, float) and v == v and abs(v) != float("inf") for v in losses)
    home = host.home(TRAINER)
    written = owners(home)
    assert {"losses.json", "trained/model.safetensors", "trained/config.json"} <= set(written)
    for name, (uid, gid, mode) in written.items():
        assert (uid, gid) == (TRAINER.uid, TRAINER.gid), name
    assert written["."][2] == 0o700
    assert written["losses.json"][2] == 0o644  # (umask 0022)
    assert json.loads((home / "losses.json").read_text()) == losses
    assert f"opened: uid {TRAINER.uid} " in host.log()  # (the daemon saw the user's uid: SO_PEERCRED)


def test_a_member_checkpoints_into_its_home_and_resumes(host):
    """The target: save_checkpoint(home/ckpt) as the member user succeeds, the files are
    the user's, and a fresh process of the same user resumes from them where the run left
    off (its next loss is the uninterrupted run's)."""
    home = host.home(TRAINER)
    _, out, _ = host.run_as(TRAINER, SAVE, args=[host.socket])
    third = last_json(out)["third"]
    files = owners(home / "ckpt")
    assert "manifest.json" in files
    for name, (uid, _gid, mode) in files.items():
        assert uid == TRAINER.uid, f"ckpt/{name} is uid {uid}'s"
    _, out, _ = host.run_as(TRAINER, RESUME, args=[host.socket])
    resumed = last_json(out)
    assert resumed["steps"] == [2]
    assert resumed["third"] == third

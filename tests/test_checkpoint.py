"""Checkpoints, resume and export: a resumed run continues bitwise like one that never
stopped; snapshots share extents; copies are checked; exports load with transformers."""
from __future__ import annotations

import copy
import json
import os
import sqlite3

import pytest
import torch
from torch import nn

import fuyou_client
from conftest import SMALL, merge

transformers = pytest.importorskip("transformers")
CONFIG = merge(SMALL, {"optimizer": {"buffer_budget": "12MiB", "buffers": 3}})
HYPER = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


BATCHES = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(6)]


def schedule(step):
    return 1.0 / (1 + step)


def run(model, engine, sched, batches):
    for x in batches:
        model(x, labels=x).loss.backward()
        engine.step()
        engine.zero_grad()
        sched.step()


def start(root, failpoints=None):
    env = dict(os.environ, FUYOUD_FAILPOINTS=failpoints) if failpoints else None
    return fuyou_client.start_daemon(root / "state", config=merge(CONFIG, {"storage": {"data_dirs": [
        str(root / "ssd0"), str(root / "ssd1")]}}), env=env)


def params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode, state_dtype", [
    # (snapshot-int8 in the default suite: a snapshot across a daemon restart, another state dtype refused;
    # copies resume in test_disk_room.py; the others, 6-12 s each, with `-m slow`)
    pytest.param("snapshot", "fp32", marks=pytest.mark.slow), pytest.param("copy", "fp32", marks=pytest.mark.slow),
    pytest.param("copy", "bf16", marks=pytest.mark.slow), ("snapshot", "int8")])
def test_resume_continues_bitwise_like_a_run_that_never_stopped(short_tmp, mode, state_dtype):
    d = start(short_tmp)
    try:
        # The run that never stops: 3 steps, checkpoint, 3 more.
        model = gpt2()
        engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER, state_dtype=state_dtype), socket=d.socket)
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)
        run(model, engine, sched, BATCHES[:3])
        reply = engine.save_checkpoint(short_tmp / "ckpt", extra={"sched": sched.state_dict(), "batch": 3},
                                       mode=mode)
        assert reply.mode == mode and reply.step == 3
        run(model, engine, sched, BATCHES[3:])
        engine.close()
        uninterrupted = params(model)
        if mode == "snapshot":  # the snapshot outlives the daemon
            assert d.stop() == 0, d.log()
            d = start(short_tmp)

        # The resumed run: another process's fresh model (other random weights).
        resumed = gpt2(seed=123)
        if state_dtype != "fp32":  # the moments are not converted: another state dtype is refused by name
            other = "int8" if state_dtype == "bf16" else "bf16"
            with pytest.raises(ValueError, match=f"checkpointed with state_dtype='{state_dtype}'.*asks for '{other}'"):
                fuyou_client.attach(resumed, fuyou_client.AdamW(**HYPER, state_dtype=other), socket=d.socket,
                                    resume=short_tmp / "ckpt")
        engine = fuyou_client.attach(resumed, fuyou_client.AdamW(**HYPER, state_dtype=state_dtype), socket=d.socket,
                                     resume=short_tmp / "ckpt")
        assert engine.checkpoint_extra["batch"] == 3
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)
        sched.load_state_dict(engine.checkpoint_extra["sched"])
        engine.resume_lr()
        assert engine.lr == HYPER["lr"] * schedule(3)
        assert engine.state_dict()["group_steps"] == {g.spec.name: 3 for g in engine.groups}
        run(resumed, engine, sched, BATCHES[3:])
        engine.close()
        for name, value in params(resumed).items():
            assert torch.equal(value, uninterrupted[name]), name
    finally:
        assert d.stop() == 0, d.log()


def test_snapshots_share_extents_and_deleting_one_frees_them(short_tmp):
    d = start(short_tmp)
    try:
        model = gpt2()
        engine = fuyou_client.attach(model, socket=d.socket)
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)
        run(model, engine, sched, BATCHES[:1])
        used = lambda: sum(dev.used_bytes for dev in d.status().devices)  # noqa: E731
        before = used()
        engine.save_checkpoint(short_tmp / "snap")
        assert used() == before  # nothing copied
        snap_objects = engine.session.objects("snapshots/")
        assert len(snap_objects) == len(engine.groups)
        run(model, engine, sched, BATCHES[1:3])  # new versions: the snapshot keeps the old extents
        state = sum(o.size for o in engine.session.objects("optim/"))
        assert used() >= before + state - (1 << 20)
        engine.session.delete_checkpoint(short_tmp / "snap")
        assert not (short_tmp / "snap").exists() and not engine.session.objects("snapshots/")
        assert used() <= before + (1 << 20)
        with pytest.raises(fuyou_client.InvalidArgument, match="belong to checkpoint snapshots"):
            engine.session.swap_out("snapshots/mine", engine.session.allocate(4096), persistent=True)
        engine.close()
    finally:
        assert d.stop() == 0, d.log()


def test_a_corrupt_copy_is_refused_and_nothing_is_restored(short_tmp):
    d = start(short_tmp)
    try:
        model = gpt2()
        engine = fuyou_client.attach(model, socket=d.socket, namespace="run1")
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)
        run(model, engine, sched, BATCHES[:1])
        engine.save_checkpoint(short_tmp / "copy", mode="copy")
        engine.close()
        manifest = json.loads((short_tmp / "copy" / "manifest.json").read_text())
        victim = short_tmp / "copy" / manifest["objects"][-1]["file"]
        data = bytearray(victim.read_bytes())
        data[5000] ^= 0x01
        victim.write_bytes(bytes(data))
        with fuyou_client.connect(d.socket, namespace="run2") as s:
            with pytest.raises(fuyou_client.DataLoss, match=f"{victim.name}.*corrupt"):
                s.restore(short_tmp / "copy")
            assert s.objects() == []  # all or nothing
            with pytest.raises(fuyou_client.ObjectNotFound, match="no checkpoint"):
                s.restore(short_tmp / "nowhere")
            (short_tmp / "empty").mkdir()  # a directory that never held one: not found, not a damaged checkpoint
            for call in (s.restore, s.delete_checkpoint):
                with pytest.raises(fuyou_client.ObjectNotFound, match="empty holds no checkpoint: it has no manifest"):
                    call(short_tmp / "empty")
            assert (short_tmp / "empty").is_dir() and s.objects() == []
    finally:
        assert d.stop() == 0, d.log()


def test_export_loads_with_from_pretrained_and_load_state_dict(short_tmp):
    d = start(short_tmp)
    try:
        model = gpt2()
        engine = fuyou_client.attach(model, socket=d.socket)
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)
        run(model, engine, sched, BATCHES[:2])
        out = engine.export(short_tmp / "export")
        engine.close()  # materialises the trained weights in `model`
        loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
        assert len(list(out.glob("*.safetensors"))) == len(engine.groups)
        trained = model.state_dict()
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, trained[name]), name

        mlp = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        engine = fuyou_client.attach(mlp, socket=d.socket, blocks=[mlp[0], mlp[2]], offload=False)
        mlp(torch.randn(4, 8)).sum().backward()
        engine.step()
        out = engine.export(short_tmp / "mlp", dtype=torch.float32)
        engine.close()
        fresh = copy.deepcopy(mlp)
        for p in fresh.parameters():
            nn.init.zeros_(p)
        fresh.load_state_dict(fuyou_client.load_exported(out))
        for (name, a), b in zip(fresh.state_dict().items(), mlp.state_dict().values()):
            assert torch.equal(a, b), name
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.slow  # (a daemon killed at a failpoint and restarted, per mode: about 9 s each)
@pytest.mark.parametrize("point, mode", [("checkpoint.linked", "snapshot"), ("checkpoint.copied", "copy")])
def test_a_daemon_killed_while_checkpointing_leaves_no_debris(short_tmp, point, mode):
    d = start(short_tmp, failpoints=f"{point}=kill")
    model = gpt2()
    engine = fuyou_client.attach(model, socket=d.socket, namespace="victim")
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)
    run(model, engine, sched, BATCHES[:1])
    groups = len(engine.groups)
    with pytest.raises(fuyou_client.DaemonUnavailable):
        engine.save_checkpoint(short_tmp / "ck", mode=mode)
    d.process.wait()
    engine.session.close()
    d = start(short_tmp)
    try:
        assert not (short_tmp / "ck").exists() and not list(short_tmp.glob("ck.partial-*"))
        assert "never completed" in d.log()
        with fuyou_client.connect(d.socket, namespace="victim") as s:
            assert s.objects("snapshots/") == []
            assert len(s.objects("optim/")) == groups  # the live state is untouched
            assert all(s.group(o.name[len("optim/"):]).step == 1 for o in s.objects("optim/"))
    finally:
        assert d.stop() == 0, d.log()


def test_a_run_that_names_no_namespace_leaves_only_its_checkpoints_behind(short_tmp):
    """The daemon named the namespace, so nobody can come back to it: when the session
    closes its state goes, and the SSD array holds what it held before, but for the
    snapshot checkpoint it took (which still restores, and deleting it frees the rest). A
    named namespace keeps its state for the next run that names it."""
    d = start(short_tmp)
    try:
        used = lambda: sum(dev.used_bytes for dev in d.status().devices)  # noqa: E731
        empty = used()
        model = gpt2()
        engine = fuyou_client.attach(model, socket=d.socket)
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)
        run(model, engine, sched, BATCHES[:1])
        engine.save_checkpoint(short_tmp / "snap", mode="snapshot")
        run(model, engine, sched, BATCHES[1:2])
        engine.close()
        assert empty < used() <= empty + sum(p.numel() * 12 for p in model.parameters()) + (1 << 20)
        again = fuyou_client.attach(gpt2(), socket=d.socket, resume=short_tmp / "snap")
        again.session.delete_checkpoint(short_tmp / "snap")
        again.close()
        assert used() == empty
        # Neither namespace's owner stays: the second's held nothing when it closed, the first's
        # last object (its snapshot) went with the checkpoint, its session being over.
        owners = sqlite3.connect(f"file:{short_tmp / 'state' / 'index.sqlite'}?mode=ro", uri=True)
        assert owners.execute("SELECT name FROM namespaces").fetchall() == []
        owners.close()
        named = fuyou_client.attach(gpt2(), socket=d.socket, namespace="kept")
        named.close()
        assert used() > empty
        with fuyou_client.connect(d.socket, namespace="kept") as s:
            assert s.objects("optim/")
    finally:
        assert d.stop() == 0, d.log()


def test_deleted_snapshots_give_their_extents_back_whatever_copies_were_taken(short_tmp):
    """The mix the docs recommend (snapshots, and copies for backup): a copy checkpoint
    taken while a snapshot exists pinned the snapshot's objects for good, so deleting the
    snapshot freed nothing; each round leaked an object's size, and an "auto" data file
    grew for ever. Now every round ends where it began and the data file is reused."""
    from fuyoud.server import Daemon
    from conftest import in_process_config

    d = Daemon(in_process_config(short_tmp, ndirs=1, storage__capacity_per_device="auto",
                                 storage__keep_free="1GiB"))
    d.start()
    try:
        data_file = d.store.devices[0].path
        with fuyou_client.connect(str(d.config.daemon.control_path), namespace="job") as s:
            buf = s.allocate(16 << 20)
            buf.tensor(torch.uint8).random_(generator=torch.Generator().manual_seed(0))
            s.swap_out("state", buf, persistent=True)
            used = lambda: sum(dev.used_bytes for dev in s.status().devices)  # noqa: E731
            baseline, size = used(), os.stat(data_file).st_size
            for i in range(6):
                s.checkpoint(short_tmp / f"snap{i}", mode="snapshot")
                buf.view[:8] = i.to_bytes(8, "little")
                s.swap_out("state", buf, persistent=True)  # (the snapshot now holds the old extents alone)
                s.checkpoint(short_tmp / f"copy{i}", mode="copy")
                s.delete_checkpoint(short_tmp / f"snap{i}")
                s.delete_checkpoint(short_tmp / f"copy{i}")
                assert used() == baseline, f"round {i}: {used() - baseline} bytes leaked"
            assert os.stat(data_file).st_size == size
    finally:
        d.stop()

"""Exports and copy checkpoints to a filesystem without room for them: refused before the
first byte, naming the bytes needed and free, with nothing created; one that runs out of
room mid-way anyway (another writer filled the disk) leaves nothing of itself behind.

"A disk without room" is a real tmpfs, small in bytes (or in inodes: the up-front check
counts bytes, so a write still fails mid-way), mounted in a private mount namespace:
each scenario runs in a child process under ``unshare --mount`` (``--map-root-user``
where the suite is not root), and the daemon it starts, its own child, sees the same
mounts. The mount goes with the namespace when the child ends. Where no namespace can
be made the tests skip, saying why. The child reports what it saw as JSON; the
assertions are here.

    python tests/test_disk_room.py SCENARIO DIR   (the child, in the namespace)
"""
from __future__ import annotations

import functools
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
RESULT = "result.json"
KiB, MiB = 1 << 10, 1 << 20
SLACK = 256 * KiB  # how far over the real bytes a refusal's estimate may be (headers, blocks)


# -- the parent: a namespace to run in, and the results -------------------------------------------
@functools.lru_cache(maxsize=1)
def namespace() -> tuple[list[str] | None, str]:
    """The ``unshare`` command that gives a child a private mount namespace in which it may
    mount a tmpfs, or None and why not."""
    tries = [["unshare", "--mount", "--propagation", "private"]] if os.geteuid() == 0 else []
    tries.append(["unshare", "--mount", "--map-root-user", "--propagation", "private"])
    why = []
    with tempfile.TemporaryDirectory(prefix="fy-ns-") as d:
        for cmd in tries:
            try:
                done = subprocess.run(cmd + ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d],
                                      capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as exc:
                why.append(f"{' '.join(cmd)}: {exc}")
                continue
            if done.returncode == 0:
                return cmd, ""
            why.append(f"{' '.join(cmd)}: {done.stderr.strip()[:200]}")
    return None, "; ".join(why)


def in_small_fs(tmp_path: Path, scenario: str, *args: str) -> dict:
    """Run ``scenario`` in a child with a private mount namespace; what it reported."""
    cmd, why = namespace()
    if cmd is None:
        pytest.skip(f"no private mount namespace to mount a small tmpfs in (not root, and no user namespaces): {why}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "client"), str(ROOT / "proto"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCHELASTIC_RUN_ID", None)
    done = subprocess.run(cmd + [sys.executable, str(HERE), scenario, str(tmp_path), *args], env=env,
                          capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads((tmp_path / RESULT).read_text())


def numbers(message: str) -> tuple[int, int]:
    """(bytes needed, bytes free) as a refusal names them."""
    needed = re.search(r"needs ([\d,]+) bytes", message)
    free = re.search(r"([\d,]+) bytes \([^)]*\) free", message)
    assert needed and free, message
    return int(needed.group(1).replace(",", "")), int(free.group(1).replace(",", ""))


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.slow  # (a namespace, a daemon and a training child each: 15-25 s)
def test_an_export_without_room_is_refused_before_the_first_byte(tmp_path):
    seen = in_small_fs(tmp_path, "export-refused")
    small = tmp_path / "small"
    for case, where in (("new", small / "new" / "model"), ("existing", small / "keep")):
        err = seen[case]
        assert err is not None, f"the export to {where} was not refused"
        assert {"OSError", "ResourceExhausted"} <= set(err["mro"]) and err["errno"] == 28, err
        message = err["message"]
        needed, free = numbers(message)
        assert str(where) in message and "bfloat16" in message, message
        assert seen["fp32_bytes"] <= needed <= seen["fp32_bytes"] + SLACK, (needed, seen["fp32_bytes"])
        assert free == seen["free"] < needed
    assert not seen["new_created"], "the refused export created its directory"
    assert seen["keep_listing"] == ["README"] and seen["keep_readme"] == "mine\n"
    # The hint holds: in bf16 it fits the same filesystem, and loads.
    assert seen["bf16_bytes"] <= seen["free"] and seen["bf16_tensors"] == seen["fp32_tensors"]


@pytest.mark.slow  # (a namespace, a daemon and a training child each: 15-25 s)
def test_an_export_that_runs_out_of_room_midway_removes_what_it_wrote(tmp_path):
    seen = in_small_fs(tmp_path, "export-fills-up")
    for case, where, left in (("new", tmp_path / "small" / "model", []),
                              ("existing", tmp_path / "small2" / "keep", ["README"])):
        err = seen[case]
        assert err is not None and err["errno"] == 28 and "OSError" in err["mro"], err
        shard = where / "model-00003-of-00005.safetensors"  # (two shards were written: the third found no room)
        assert str(shard) in err["message"] and "No space left" in err["message"], err["message"]
        assert seen[f"{case}_listing"] == left, f"the failed export left {seen[f'{case}_listing']} behind"
    assert seen["after"]["step"] and seen["after"]["exported"] == 5


@pytest.mark.parametrize("mode", ["copy", pytest.param("auto", marks=pytest.mark.slow)])
def test_a_copy_checkpoint_without_room_is_refused_and_training_goes_on(tmp_path, mode):
    seen = in_small_fs(tmp_path, "checkpoint-refused", mode)
    err = seen["refused"]
    assert err is not None, "the checkpoint to a full filesystem was not refused"
    assert "ResourceExhausted" in err["mro"], err
    needed, free = numbers(err["message"])
    assert str(tmp_path / "small" / "ckpt") in err["message"], err["message"]
    assert seen["bytes"] <= needed <= seen["bytes"] + SLACK and free == seen["free"] < needed, (needed, free, seen)
    assert seen["listing"] == [], f"the refused checkpoint left {seen['listing']} behind"
    assert seen["roomy"] == {"mode": "copy", "step": 2}, seen["roomy"]  # a further step, then a copy elsewhere
    assert seen["resumed_equal"], "the checkpoint taken after the refusal does not resume the weights"


@pytest.mark.slow  # (a namespace, a daemon and a training child each: 15-25 s)
def test_a_copy_checkpoint_that_runs_out_of_room_midway_leaves_nothing(tmp_path):
    seen = in_small_fs(tmp_path, "checkpoint-fills-up")
    err = seen["failed"]
    assert err is not None and "ResourceExhausted" in err["mro"], err
    assert str(tmp_path / "small" / "ckpt") in err["message"] and "No space left" in err["message"], err["message"]
    assert seen["listing"] == [], f"the failed checkpoint left {seen['listing']} behind"
    assert seen["roomy"] == {"mode": "copy", "step": 2}, seen["roomy"]


@pytest.mark.slow  # (a namespace, a daemon and a training child each: 15-25 s)
def test_a_copy_checkpoint_whose_disk_fills_after_the_check_leaves_nothing(tmp_path):
    # The daemon pauses after its check (a failpoint), another writer takes the room, the
    # copy's writes fail: the error is the disk's, not an internal one, and nothing is left.
    seen = in_small_fs(tmp_path, "checkpoint-filled-after-check")
    err = seen["failed"]
    assert err is not None and "ResourceExhausted" in err["mro"], err
    assert str(tmp_path / "small" / "ckpt") in err["message"] and "No space left" in err["message"], err["message"]
    assert seen["listing"] == ["other"], f"the failed checkpoint left {seen['listing']} behind"
    assert seen["roomy"] == {"mode": "copy", "step": 2}, seen["roomy"]


@pytest.mark.slow  # (two ranks under torchrun in a namespace: about 30 s)
def test_every_rank_is_refused_alike_and_the_ranks_stay_in_step(tmp_path):
    seen = in_small_fs(tmp_path, "dp-export")
    assert len(seen["ranks"]) == 2, seen
    for r, rank in enumerate(seen["ranks"]):
        err = rank["refused"]
        assert err is not None and {"OSError", "ResourceExhausted"} <= set(err["mro"]), (r, err)
        assert str(tmp_path / "small" / "model") in err["message"], (r, err["message"])
        assert rank["after"] == {"step": True, "exported": True}, (r, rank["after"])
    assert seen["ranks"][0]["refused"]["message"] == seen["ranks"][1]["refused"]["message"]
    assert seen["listing"] == [] and seen["exported"] == 5


# -- the child: in the namespace ------------------------------------------------------------------
def _mount(path: Path, **options: str) -> Path:
    path.mkdir()
    opts = ",".join(f"{k}={v}" for k, v in {"mode": "0755", **options}.items())
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
    return path


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _attempt(fn) -> dict | None:
    """None if ``fn()`` succeeded; else what it raised."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which judges it
        return {"mro": [c.__name__ for c in type(exc).__mro__], "errno": getattr(exc, "errno", None),
                "message": str(exc)}
    return None


def _file_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


def _model():
    import torch
    from conftest import tiny_gpt2

    torch.manual_seed(0)
    return tiny_gpt2(width=128)  # (4 blocks and the rest: 5 layer groups, 3.3 MB of fp32 weights)


def _step(model, engine, i: int) -> None:
    import torch

    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i))
    model(x, labels=x).loss.backward()
    engine.step()
    engine.zero_grad()


def _daemon(root: Path, failpoints: str = ""):
    import fuyou_client
    from conftest import SMALL, merge

    env = dict(os.environ, FUYOUD_FAILPOINTS=failpoints) if failpoints else None
    return fuyou_client.start_daemon(root / "state", config=merge(SMALL, {"storage": {
        "capacity_per_device": "512MiB", "data_dirs": [str(root / "ssd0"), str(root / "ssd1")]}}), env=env)


def _trained(root: Path, work, failpoints: str = "") -> dict:
    """``work(model, engine, daemon)`` on a model attached to a new daemon, after one step."""
    import fuyou_client
    from conftest import HYPER

    d = _daemon(root, failpoints)
    try:
        model = _model()
        engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=d.socket)
        _step(model, engine, 0)
        seen = work(model, engine, d)
        engine.close()
    finally:
        code = d.stop()
    assert code == 0, d.log()
    return seen


def scenario_export_refused(root: Path) -> dict:
    import torch
    import fuyou_client

    small = _mount(root / "small", size="2560k")
    keep = small / "keep"
    keep.mkdir()
    (keep / "README").write_text("mine\n")

    def work(model, engine, d):
        seen = {"free": _free(small)}
        seen["new"] = _attempt(lambda: engine.export(small / "new" / "model"))
        seen["new_created"] = (small / "new").exists()
        seen["existing"] = _attempt(lambda: engine.export(keep))
        seen["keep_listing"] = sorted(os.listdir(keep))
        seen["keep_readme"] = (keep / "README").read_text()
        seen["fp32_bytes"] = _file_bytes(engine.export(root / "roomy"))
        seen["fp32_tensors"] = len(fuyou_client.load_exported(root / "roomy"))
        half = engine.export(small / "bf16", dtype=torch.bfloat16)
        seen["bf16_bytes"] = _file_bytes(half)
        seen["bf16_tensors"] = len(fuyou_client.load_exported(half))
        return seen
    return _trained(root, work)


def scenario_export_fills_up(root: Path) -> dict:
    # Room for every byte, but inodes for the directory and two shards only (the tmpfs's
    # root takes one): the third shard's file cannot be created, as on a disk another
    # writer filled after the check.
    small = _mount(root / "small", size="64m", nr_inodes="4")
    small2 = _mount(root / "small2", size="64m", nr_inodes="5")
    keep = small2 / "keep"
    keep.mkdir()
    (keep / "README").write_text("mine\n")

    def work(model, engine, d):
        seen = {"new": _attempt(lambda: engine.export(small / "model")), "new_listing": sorted(os.listdir(small)),
                "existing": _attempt(lambda: engine.export(keep)), "existing_listing": sorted(os.listdir(keep))}
        _step(model, engine, 1)
        seen["after"] = {"step": True, "exported": len(list(engine.export(root / "roomy").glob("*.safetensors")))}
        return seen
    return _trained(root, work)


def _resumes(d, root: Path, ckpt: Path, model) -> bool:
    import torch
    import fuyou_client
    from conftest import HYPER

    fresh = _model()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in fresh.parameters():
            p.normal_()
    engine = fuyou_client.attach(fresh, fuyou_client.AdamW(**HYPER), socket=d.socket, namespace="resumed",
                                 resume=ckpt)
    try:
        theirs = dict(fresh.named_parameters())
        return all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())
    finally:
        engine.close()


def scenario_checkpoint_refused(root: Path, mode: str) -> dict:
    small = _mount(root / "small", size="1m")

    def work(model, engine, d):
        seen = {"free": _free(small)}
        seen["refused"] = _attempt(lambda: engine.save_checkpoint(small / "ckpt", mode=mode))
        seen["listing"] = sorted(os.listdir(small))
        _step(model, engine, 1)
        reply = engine.save_checkpoint(root / "roomy", mode="copy")
        seen["roomy"], seen["bytes"] = {"mode": reply.mode, "step": reply.step}, reply.bytes
        seen["resumed_equal"] = _resumes(d, root, root / "roomy", model)
        return seen
    return _trained(root, work)


def scenario_checkpoint_fills_up(root: Path) -> dict:
    # Inodes for the partial directory, its objects/ and two object files only.
    small = _mount(root / "small", size="64m", nr_inodes="5")

    def work(model, engine, d):
        seen = {"failed": _attempt(lambda: engine.save_checkpoint(small / "ckpt", mode="copy"))}
        seen["listing"] = sorted(os.listdir(small))
        _step(model, engine, 1)
        reply = engine.save_checkpoint(root / "roomy", mode="copy")
        seen["roomy"] = {"mode": reply.mode, "step": reply.step}
        return seen
    return _trained(root, work)


def scenario_checkpoint_filled_after_check(root: Path) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    small = _mount(root / "small", size="16m")

    def work(model, engine, d):
        with ThreadPoolExecutor(1) as pool:
            saving = pool.submit(engine.save_checkpoint, small / "ckpt", mode="copy")
            deadline = time.monotonic() + 120
            while "failpoint checkpoint.room_checked" not in d.log():  # (the check passed: the daemon sleeps)
                assert time.monotonic() < deadline and not saving.done(), d.log()[-2000:]
                time.sleep(0.02)
            with open(small / "other", "wb") as f:  # another writer takes all but 64 KiB
                os.posix_fallocate(f.fileno(), 0, _free(small) - 64 * KiB)
            seen = {"failed": _attempt(saving.result)}
        seen["listing"] = sorted(os.listdir(small))
        _step(model, engine, 1)
        reply = engine.save_checkpoint(root / "roomy", mode="copy")
        seen["roomy"] = {"mode": reply.mode, "step": reply.step}
        return seen
    return _trained(root, work, failpoints="checkpoint.room_checked=sleep(5)")


def scenario_dp_export(root: Path) -> dict:
    """Two ranks under torchrun (gloo) in this namespace export to the small tmpfs."""
    small = _mount(root / "small", size="1m")
    d = _daemon(root)
    try:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        env = dict(os.environ, FUYOUD_SOCKET=str(d.socket), TMPDIR=str(root))  # (torchrun's files go with root's)
        done = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(HERE), "dp-rank", str(root)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    finally:
        code = d.stop()
    assert code == 0, d.log()
    return {"ranks": [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)],
            "listing": sorted(os.listdir(small)), "exported": len(list((root / "roomy").glob("*.safetensors")))}


def scenario_dp_rank(root: Path) -> None:
    """One rank of scenario_dp_export: refused alike, then still in step with the other."""
    import torch
    import torch.distributed as dist
    import fuyou_client
    from conftest import HYPER

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = _model()
    engine = fuyou_client.attach(model, fuyou_client.AdamW(**HYPER), socket=os.environ["FUYOUD_SOCKET"])
    _step(model, engine, 0)
    seen = {"refused": _attempt(lambda: engine.export(root / "small" / "model"))}
    _step(model, engine, 1)
    engine.export(root / "roomy", dtype=torch.bfloat16)
    seen["after"] = {"step": True, "exported": True}
    engine.close()
    (root / f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    gc.collect()  # (the group ends while Python is alive: docs/guide/distributed.md)
    dist.destroy_process_group()
    gc.collect()


SCENARIOS = {"export-refused": scenario_export_refused, "export-fills-up": scenario_export_fills_up,
             "checkpoint-refused": scenario_checkpoint_refused, "checkpoint-fills-up": scenario_checkpoint_fills_up,
             "checkpoint-filled-after-check": scenario_checkpoint_filled_after_check,
             "dp-export": scenario_dp_export, "dp-rank": scenario_dp_rank}


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    name, where = sys.argv[1], Path(sys.argv[2])
    result = SCENARIOS[name](where, *sys.argv[3:])
    if result is not None:
        (where / RESULT).write_text(json.dumps(result, default=str))

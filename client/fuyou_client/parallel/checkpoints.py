"""Checkpoints of a data-parallel run (sharded.py): collective, and resumable at another
world size.

    DIR/rank-00000/ ... DIR/rank-0000{N-1}/   each rank's daemon's checkpoint of its shards
    DIR/world.json                            written last, by rank 0: the commit point

Every rank calls ``engine.save_checkpoint(DIR)`` between steps. Each rank's daemon
checkpoints its namespace (the rank's shard of every group, with the engine's client
state) into ``DIR/rank-NNNNN``; once every rank has, rank 0 writes ``world.json`` (world
size, the shards' ranges per group, step, learning rate, ``extra``) through a rename: a
directory without it is an unfinished checkpoint, which resume refuses.

Resume (``attach(model, resume=DIR)``) at the same world size restores each rank's own
directory: bitwise the run that saved it. At another size, with ``reshard=True``, each
new rank restores the old ranks' directories whose shards overlap its own into scratch
namespaces, reads the overlapping ranges of their state objects (master weights,
moments; step counts are equal) and creates its groups from them. That needs every old
rank's checkpoint readable by every new rank's daemon: a copy on a path every host sees,
or snapshots on one daemon.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fuyou_proto.contract import HEADER, ITEMSIZE, STATE_SLOTS, slot_bytes, state_object
from fuyou_client.checkpoints.state import client_state
from fuyou_client.parallel import world as distributed
from fuyou_client.parallel.world import Shards, World
from fuyou_client.connection.session import In, connect

WORLD_FILE = "world.json"
FORMAT = 1


def rank_dir(root: Path, rank: int) -> Path:
    return root / f"rank-{rank:05d}"


def layout(groups) -> dict:
    """Each layer group's size and parts (the shards follow from them and the world size)."""
    return {spec.name: {"numel": spec.numel, "parts": [[p.name, p.start, p.numel] for p in spec.parts]}
            for spec in groups if spec.numel}


def shard_ranges(groups, size: int) -> dict:
    """Each layer group's [start, stop) per rank, for the record."""
    return {spec.name: [list(Shards(spec.numel, size, 0).range_of(r)) for r in range(size)]
            for spec in groups if spec.numel}


def save(session, world: World, groups: list, param_groups: list[dict], extra, directory, mode: str,
         timeout: float) -> dict:
    """(collective) The checkpoint of every rank, then ``world.json``; returns its content."""
    root = Path(directory)
    error, reply = None, None
    try:
        if not root.is_absolute():
            raise ValueError(f"checkpoint directory {root} must be an absolute path (every rank's daemon reads it)")
        if (root / WORLD_FILE).exists():
            raise FileExistsError(f"{root} holds a committed checkpoint already ({WORLD_FILE}): pick a new directory")
        root.mkdir(parents=True, exist_ok=True)
        reply = session.checkpoint(rank_dir(root, world.rank), timeout, mode,
                                   client_state(param_groups, extra))
    except Exception as exc:  # noqa: BLE001 - every rank raises (agree)
        error = exc
    world.agree(error, "save_checkpoint")
    ranks = world.gather({"rank": world.rank, "step": reply.step, "mode": reply.mode,
                          "daemon": list(distributed.daemon_identity(session)), "objects": reply.objects})
    info = {"format": FORMAT, "world_size": world.size, "step": max(r["step"] for r in ranks),
            "lr": param_groups[0]["lr"], "align": distributed.ALIGN, "groups": layout(g.spec for g in groups),
            "shards": shard_ranges([g.spec for g in groups], world.size), "ranks": ranks}
    try:
        json.dumps(extra)
        info["extra"] = extra
    except (TypeError, ValueError):
        info["extra"] = None  # (not plain JSON: every rank's client state holds it)
    error = None
    if world.rank == 0:
        try:
            tmp = root / (WORLD_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(info, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, root / WORLD_FILE)
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except Exception as exc:  # noqa: BLE001
            error = exc
    world.agree(error, f"writing {WORLD_FILE}")
    return info


def is_world(directory) -> bool:
    """Whether ``directory`` is a data-parallel checkpoint (has world.json)."""
    return (Path(directory) / WORLD_FILE).exists()


def read_world(root: Path) -> dict:
    try:
        info = json.loads((root / WORLD_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"{root} has no {WORLD_FILE}: not a data-parallel checkpoint, or one whose save did not "
                         "finish (resume from an earlier one)") from None
    except ValueError as exc:
        raise ValueError(f"{root / WORLD_FILE} is not readable JSON: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"{root / WORLD_FILE} is not a checkpoint this version of fuyou_client reads")
    size = info.get("world_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{root / WORLD_FILE} has world_size {size!r}, not a positive integer: it is damaged")
    return info


def restore(session, world: World, directory, specs, reshard: bool, namespace_base: str) -> bytes:
    """(every rank) This rank's shards of the checkpoint into ``session``'s namespace;
    returns the client state."""
    root = Path(directory)
    info = read_world(root)
    old = info["world_size"]
    mine = layout(specs)
    if info["groups"] != mine:
        raise ValueError(f"the checkpoint in {root} is of another model or other param groups (its layer groups and "
                         "parts differ from this attach's)")
    if old == world.size:
        return session.restore(rank_dir(root, world.rank)).client_state
    if not reshard:
        raise ValueError(f"the checkpoint in {root} was written by {old} ranks, this run has {world.size}: pass "
                         "attach(..., reshard=True) to cut its shards again")
    return _reshard(session, world, root, old, specs, namespace_base)


def _reshard(session, world: World, root: Path, old: int, specs, namespace_base: str) -> bytes:
    """Build this rank's shards from the old ranks' overlapping ones."""
    needed = {}  # old rank -> [(spec, part, lo, hi)] of this rank's pieces it overlaps
    for spec in specs:
        if not spec.numel:
            continue
        new, was = Shards(spec.numel, world.size, world.rank), Shards(spec.numel, old, 0)
        for part, lo, hi in new.pieces(spec.parts):
            for r in range(old):
                olo, ohi = was.range_of(r)
                if max(lo, olo) < min(hi, ohi):
                    needed.setdefault(r, []).append((spec, part, lo, hi))
    pieces = {}  # (part name) -> (spec, part, lo, hi, buffer, kind/dtype, step)
    client_state = b""
    scratch = []
    try:
        for r in sorted(needed) or [0]:
            src = connect(session.socket_path, namespace=f"{namespace_base}.reshard{world.rank}.from{r}")
            scratch.append(src)
            reply = src.restore(rank_dir(root, r))
            client_state = client_state or reply.client_state
            for spec, part, lo, hi in needed.get(r, []):
                was = Shards(spec.numel, old, r)
                olo, ohi = max(part.start, was.range_of(r)[0]), min(part.start + part.numel, was.range_of(r)[1])
                info = src.group(part.name)
                key = part.name
                if key not in pieces:
                    opt = info.optimizer
                    slots = STATE_SLOTS[(opt.state_kind, opt.state_dtype)]
                    body = sum(slot_bytes(d, per, hi - lo) for _, d, per in slots)
                    buf = session.allocate(body)
                    buf.tensor(torch.uint8)[:body].zero_()
                    pieces[key] = [spec, part, lo, hi, buf, slots, info.step, opt]
                _, _, lo, hi, buf, slots, step, _ = pieces[key]
                if info.step != step:
                    raise ValueError(f"the checkpoint's shards of {part.name} have different step counts ({step}, "
                                     f"{info.step}): it is damaged")
                a, b = max(lo, olo), min(hi, ohi)
                _copy_slots(src, state_object(part.name), buf, slots, olo, ohi, lo, hi, a, b, part.name)
        for key, (spec, part, lo, hi, buf, slots, step, opt) in pieces.items():
            session.create_group(part.name, buf, opt, numel=hi - lo, state=True, step=step)
    finally:
        for key, piece in pieces.items():
            piece[4].free()
        for src in scratch:
            try:
                names = [o.name for o in src.objects()]
                if names:
                    src.delete(*names, missing_ok=True)
            finally:
                src.close()
    return client_state


def _copy_slots(src, name: str, buf, slots, olo: int, ohi: int, lo: int, hi: int, a: int, b: int, part: str) -> None:
    """Elements [a, b) of the group's flat vector, from the old piece [olo, ohi)'s state
    object (in the scratch session ``src``) into the new piece [lo, hi)'s state body
    ``buf``, slot by slot."""
    old_at, new_at, reads, copies, at = HEADER, 0, [], [], 0
    for _, dtype, per in slots:
        size = ITEMSIZE[dtype]
        if per > 1 and ((a - olo) % per or (a - lo) % per):
            raise ValueError(f"group {part}: its int8 moments are quantized in blocks of {per} that the new shards "
                             "would cut; resume at the same world size, or from the exported weights")
        first, count = (a - olo) // per, -(-(b - a) // per)
        reads.append((at, count * size, old_at + first * size))
        copies.append((at, new_at + (a - lo) // per * size, count * size))
        at += count * size
        old_at += slot_bytes(dtype, per, ohi - olo)
        new_at += slot_bytes(dtype, per, hi - lo)
    tmp = src.allocate(at)  # (a buffer is its session's: read there, then copied)
    try:
        src.swap_in_many([In(name, tmp, off, length, obj) for off, length, obj in reads])
        raw, out = tmp.tensor(torch.uint8), buf.tensor(torch.uint8)
        for off, dst, length in copies:
            out[dst:dst + length].copy_(raw[off:off + length])
    finally:
        tmp.free()


def load_masters(session, world: World, specs) -> None:
    """(collective) After a resume: every group's parameters take the fp32 masters,
    gathered from the ranks' shards (cast as each step casts them)."""
    for spec in specs:
        full = gather_masters(session, world, None, spec)
        with torch.no_grad():
            at = 0
            for _, p in spec.params:
                p.copy_(full[at:at + p.numel()].view(p.shape))
                at += p.numel()


def gather_masters(session, world: World, collectives, spec) -> torch.Tensor:
    """(collective) A layer group's fp32 master weights, whole, on every rank."""
    shards = Shards(spec.numel, world.size, world.rank)
    pieces = shards.pieces(spec.parts)
    buf = session.allocate(shards.per * 4)
    try:
        shard = buf.tensor(torch.float32)[:shards.per]
        shard.zero_()
        infos = [session.group(part.name) for part, _, _ in pieces]
        session.swap_in_many([In(state_object(part.name), buf, (lo - shards.start) * 4, (hi - lo) * 4,
                                 info.weights_offset) for (part, lo, hi), info in zip(pieces, infos)])
        where = world.comm_device
        full = torch.empty(shards.padded, dtype=torch.float32, device=where)

        def gather():
            distributed.all_gather(full, shard.to(where), world.group)
        if collectives is not None:
            collectives.run(f"all-gather masters {spec.name}", gather)
        else:
            gather()
        return full[:spec.numel].cpu()
    finally:
        buf.free()

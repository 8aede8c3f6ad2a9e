"""Export: the trained weights as sharded safetensors.

(Checkpoints: the daemon's optimizer state with state.py's part.)

* ``save_checkpoint``: the daemon checkpoints the session's optimizer state (master
  weights, moments, step counts) between two steps (see fuyoud/checkpoints/checkpointer.py); the
  client's own state (learning rate, the caller's ``extra``: scheduler state, data
  position) travels with it as ``client_state``.
* resume: ``attach(model, resume=dir)`` restores the objects into the new session's
  namespace, then builds its groups from them: the parameters take the checkpoint's
  master weights (cast to their dtype, as every step does), so training continues
  bitwise as if it had never stopped.
* ``export``: the trained weights as sharded safetensors (one shard per layer group,
  with ``model.safetensors.index.json``, the layout ``from_pretrained`` reads; plain
  modules: ``model.load_state_dict(load_exported(dir))``), streamed from the SSD array
  one group at a time. Its bytes are counted first: a filesystem without room for them
  is refused before anything is created (``NotEnoughRoom``: an OSError with errno ENOSPC
  and a ``ResourceExhausted``, naming the bytes needed and free); a write that fails
  anyway (another process filled the disk) removes the files this export wrote.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fuyou_client.connection.session import Session
from fuyou_client.errors import ResourceExhausted
from fuyou_client.checkpoints.values import group_params, group_shapes, read_group
from fuyou_client.model.experts import fused_names
from fuyou_client.model.weights_file import INDEX_FILE


@dataclass(frozen=True)
class Trained:
    """What an export reads: the model, its session, its layer groups (groups.LayerGroup)
    and, with data parallelism, the world (parallel.World: every rank gathers, rank 0 writes)."""
    model: nn.Module
    session: Session
    groups: list
    world: object = None


def export(trained: "Trained", directory: str | os.PathLike, dtype: torch.dtype | None = None,
           masters=None, transform=None) -> Path:
    """Write the trained weights, the frozen parameters and the model's persistent buffers
    to ``directory``; holds one layer group in memory at a time. ``transform(tensors)``: each
    shard's tensors by name, as they will be written (renamed, merged: a PEFT model's merged
    export; it may only drop or shrink, as the room check counts them before). A filesystem without room
    for all of it is refused before anything is created (NotEnoughRoom); a write that fails
    anyway removes what this call wrote and names the file."""
    out = Path(directory)
    world = trained.world
    writes = world is None or world.rank == 0  # (data parallel: every rank gathers, rank 0 writes)
    model = trained.model
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    writer, error = None, None
    if writes:
        try:
            _require_room(trained, names, out, dtype)
            writer = _Writer.start(out)
        except Exception as exc:  # noqa: BLE001 - every rank raises it (_rank0_outcome)
            error = exc
    _rank0_outcome(world, error, f"export to {out}")
    try:
        _write_shards(trained, out, names, dtype, masters, writer, transform)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return out


def _write_shards(trained: "Trained", out: Path, names: dict[int, str], dtype: torch.dtype | None, masters,
                  writer: "_Writer | None", transform=None) -> None:
    """Each layer group's shard (and the parameters no group holds, and the buffers, in the
    last), then the index and the model's config; ``writer`` None: this rank writes nothing."""
    model = trained.model
    keys = set(model.state_dict(keep_vars=True).keys())  # (the names only: no trained values read)
    buffers = {n: b.detach().cpu().clone() for n, b in model.named_buffers() if n in keys}
    count = len(trained.groups)
    weight_map, total, done = {}, 0, set()
    fused = FusedRows(model, names)
    for i, g in enumerate(trained.groups):
        tensors = fused.join(_group_tensors(trained.session, g, names, dtype, masters))
        done.update(id(p) for p in group_params(g))
        if i == count - 1:  # the parameters no group holds (frozen, resident) and the buffers
            tensors.update({names[id(p)]: p.detach().to("cpu", dtype or p.dtype, copy=True)
                            for p in model.parameters() if id(p) not in done})
            tensors.update(buffers)
        if transform is not None:
            tensors = transform(tensors)
        shard = _shard_name(i, count)
        error = None
        if writer is not None:
            try:
                writer.write(shard, lambda path: save_file(tensors, path, metadata={"format": "pt"}))
            except Exception as exc:  # noqa: BLE001 - every rank raises it (_rank0_outcome)
                error = exc
        _rank0_outcome(trained.world, error, f"export to {out}")
        for key, t in tensors.items():
            weight_map[key] = shard
            total += t.numel() * t.element_size()
        del tensors
    error = None
    if writer is not None:
        try:
            writer.finish(model, {"metadata": {"total_size": total}, "weight_map": weight_map})
        except Exception as exc:  # noqa: BLE001 - every rank raises it (_rank0_outcome)
            error = exc
    _rank0_outcome(trained.world, error, f"export to {out}")


def _shard_name(i: int, count: int) -> str:
    return f"model-{i + 1:05d}-of-{count:05d}.safetensors"


# -- room for an export -----------------------------------------------------------------------------
class NotEnoughRoom(ResourceExhausted, OSError):
    """An export's filesystem has less free space than the export needs (refused before
    anything is created), or filled up while it was written (what the export had written
    is removed). An OSError with errno ENOSPC, and a fuyou_client.ResourceExhausted."""


# An over-estimate of what is not tensor bytes: a safetensors header's entry per tensor
# (its name, dtype, shape and offsets, in JSON), an index entry per tensor, a config whose
# size is not known. It errs high by a few KiB per shard: refusing an export that would
# just have fit costs less than one that dies mid-way.
SHARD_HEADER = 256  # the header's length, its metadata and padding
TENSOR_HEADER = 96  # per tensor, plus its name and 24 bytes a dimension
INDEX_ENTRY = 64  # per tensor in model.safetensors.index.json, plus its name
UNKNOWN_CONFIG = 64 << 10


def _shard_tensors(trained: "Trained", names: dict[int, str], dtype: torch.dtype | None) -> list[list[tuple]]:
    """Each shard's tensors as export writes them: (name, shape, dtype)."""
    model = trained.model
    shards, done = [], set()
    if not trained.groups:
        return shards
    for g in trained.groups:
        params, shapes = group_params(g), group_shapes(g)
        done.update(id(p) for p in params)
        shards.append([(names[id(p)], shape, dtype or g.dtype) for p, shape in zip(params, shapes)])
    keys = set(model.state_dict(keep_vars=True).keys())  # (the names only: no trained values read)
    shards[-1] += [(names[id(p)], p.shape, dtype or p.dtype) for p in model.parameters() if id(p) not in done]
    shards[-1] += [(n, b.shape, b.dtype) for n, b in model.named_buffers() if n in keys]
    return shards


def _config_bytes(config) -> int:
    try:
        return len(config.to_json_string()) + 4096
    except Exception:  # noqa: BLE001 - a config of another kind: an allowance
        return UNKNOWN_CONFIG


def _room_needed(trained: "Trained", names: dict[int, str], dtype: torch.dtype | None, block: int) -> int:
    """The bytes the export writes (every shard, the index, the config), each file rounded
    up to whole ``block``-byte blocks: a small over-estimate (see SHARD_HEADER)."""
    def blocks(n: int) -> int:
        return -(-n // block) * block

    total, index = 0, 256
    for tensors in _shard_tensors(trained, names, dtype):
        size = SHARD_HEADER
        for name, shape, dt in tensors:
            size += math.prod(shape) * dt.itemsize + TENSOR_HEADER + len(name) + 24 * len(shape)
            index += INDEX_ENTRY + len(name)
        total += blocks(size)
    total += blocks(index)
    model = trained.model
    for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if config is not None and hasattr(config, "save_pretrained"):
            total += blocks(_config_bytes(config))
    return total


def _missing(directory: Path) -> tuple[Path, list[Path]]:
    """``directory``'s nearest existing ancestor (itself if it exists), and the
    directories below it that do not exist yet, deepest first."""
    missing, where = [], directory.absolute()
    while not where.exists() and where != where.parent:
        missing.append(where)
        where = where.parent
    return where, missing


def _free_bytes(directory: Path) -> tuple[int, int]:
    """(bytes free to this user, block size) of the filesystem that will hold
    ``directory``: its nearest existing ancestor's."""
    st = os.statvfs(_missing(directory)[0])
    return st.f_bavail * st.f_frsize, st.f_frsize or 4096


def _shown(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({nbytes / 2**30:.1f} GiB)" if nbytes >= 2**30 else \
        f"{nbytes:,} bytes ({nbytes / 2**20:.1f} MiB)"


def _require_room(trained: "Trained", names: dict[int, str], out: Path, dtype: torch.dtype | None) -> None:
    """NotEnoughRoom unless the export fits the free space of ``out``'s filesystem (files
    that ``out`` holds already count as taken: what the export would overwrite is not
    subtracted)."""
    free, block = _free_bytes(out)
    needed = _room_needed(trained, names, dtype, block)
    if needed <= free:
        return
    hint = ""
    half = _room_needed(trained, names, torch.bfloat16, block)
    if half < needed:
        hint = f", or pass dtype=torch.bfloat16 (an export in bf16 needs {_shown(half)})"
    raise NotEnoughRoom(errno.ENOSPC, f"export to {out} needs {_shown(needed)} but its filesystem has {_shown(free)} "
                                       f"free; nothing was written. Export to a directory on a filesystem with room, "
                                       f"or free space on this one{hint}")


class _Writer:
    """The files one export writes into ``out``, and the directories it created for them:
    ``abort`` removes them (a directory that existed before stays, with what it held)."""

    def __init__(self, out: Path, created: list[Path]):
        self.out, self.created, self.written = out, created, []

    @classmethod
    def start(cls, out: Path) -> "_Writer":
        created = _missing(out)[1]
        out.mkdir(parents=True, exist_ok=True)
        return cls(out, created)

    def write(self, name: str, write) -> None:
        """``write(path)`` writes the file ``name``; a failure removes everything this
        export wrote and is raised naming the file (NotEnoughRoom where the disk is full)."""
        path = self.out / name
        try:
            write(path)
        except Exception as exc:
            self.abort(path)
            raise _write_failed(self.out, path, exc) from exc
        self.written.append(path)

    def finish(self, model, index: dict) -> None:
        """The index, then the model's config and generation config (``save_pretrained``)."""
        self.write(INDEX_FILE, lambda path: path.write_text(json.dumps(index, indent=2)))
        for attr in ("config", "generation_config"):
            config = getattr(model, attr, None)
            if config is None or not hasattr(config, "save_pretrained"):
                break  # (no generation config without a config)
            before = set(os.listdir(self.out))
            try:
                config.save_pretrained(self.out)
            except Exception as exc:
                self.written += [self.out / n for n in set(os.listdir(self.out)) - before]
                self.abort()
                raise _write_failed(self.out, self.out / f"{attr}.json", exc) from exc
            self.written += [self.out / n for n in set(os.listdir(self.out)) - before]

    def abort(self, failed: Path | None = None) -> None:
        """Remove what this export wrote (and ``failed``, the file it was writing), then
        the directories it created, deepest first, if nothing else is in them."""
        for path in self.written + ([failed] if failed is not None else []):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        self.written = []
        for where in self.created:
            try:
                where.rmdir()
            except OSError:
                break  # (something else is in it)


def _os_errno(exc: BaseException) -> int | None:
    """The errno of an OSError, or of an error safetensors raises ("... (os error 28)")."""
    if isinstance(exc, OSError):
        return exc.errno
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return int(found.group(1)) if found else None


def _write_failed(out: Path, path: Path, exc: BaseException) -> OSError:
    code = _os_errno(exc)
    message = (f"export to {out} failed writing {path}: {exc}; the files this export had written were removed "
               "(a directory that existed before is kept)")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return NotEnoughRoom(errno.ENOSPC, message + ". Its filesystem filled while the export ran (another "
                             "process wrote to it): free space there, or export to another directory")
    return OSError(code or errno.EIO, message)


def _rank0_outcome(world, error: Exception | None, what: str) -> None:
    """Raise rank 0's ``error`` on every rank (only rank 0 writes, so only it can fail
    here; every rank calls this at the same points, between the collectives that gather
    the weights, so none is left waiting in one): NotEnoughRoom as the same error, others
    as a RuntimeError naming it. One process: raise ``error``, if any."""
    if world is None:
        if error is not None:
            raise error
        return
    shared = world.from_rank0(None if error is None else
                              (isinstance(error, NotEnoughRoom), error.strerror if isinstance(error, OSError)
                               and error.strerror else f"{type(error).__name__}: {error}"))
    if error is not None:
        raise error
    if shared is not None:
        room, message = shared
        if room:
            raise NotEnoughRoom(errno.ENOSPC, message)
        raise RuntimeError(f"{what} failed on rank 0 ({message})")


class FusedRows:
    """A mixture of experts cut in parts (model/experts.py) exported by the model's own
    names: each part's rows held until the last part of its fused tensor comes, then the
    fused tensor in that shard (the parts of one fused tensor are consecutive groups)."""

    def __init__(self, model: nn.Module, names: dict[int, str]):
        self._rows = {names[i]: r for i, r in fused_names(model).items() if i in names}
        self._pending: dict[str, list] = {}

    def join(self, tensors: dict) -> dict:
        for key in [k for k in tensors if k in self._rows]:
            r = self._rows[key]
            got = self._pending.setdefault(r.name, [])
            got.append((r.start, tensors.pop(key)))
            if sum(t.shape[0] for _, t in got) == r.experts:
                tensors[r.name] = torch.cat([t for _, t in sorted(got, key=lambda x: x[0])])
                del self._pending[r.name]
        return tensors


def _group_tensors(session: "Session", g, names: dict[int, str], dtype: torch.dtype | None, masters) -> dict:
    """A layer group's parameters by name (values.py: the trained ones from their fp32
    masters, an offloaded block's frozen ones from the object they were stored in)."""
    return {names[id(p)]: t for p, t in zip(group_params(g), read_group(session, g, dtype, masters))}


def load_exported(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """An exported directory as one state dict (for ``load_state_dict``)."""
    root = Path(directory)
    index = json.loads((root / INDEX_FILE).read_text())
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(load_file(root / shard))
    return state

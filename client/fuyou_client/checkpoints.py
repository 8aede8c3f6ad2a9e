"""The engine's checkpoints and exports.

* ``save_checkpoint``: the daemon checkpoints the session's optimizer state (master
  weights, moments, step counts) between two steps (see fuyoud/checkpoint.py); the
  client's own state (learning rate, the caller's ``extra``: scheduler state, data
  position) travels with it as ``client_state``.
* resume: ``attach(model, resume=dir)`` restores the objects into the new session's
  namespace, then builds its groups from them: the parameters take the checkpoint's
  master weights (cast to their dtype, as every step does), so training continues
  bitwise as if it had never stopped.
* ``export``: the trained weights as sharded safetensors (one shard per layer group,
  with ``model.safetensors.index.json``, the layout ``from_pretrained`` reads; plain
  modules: ``model.load_state_dict(load_exported(dir))``), streamed from the SSD array
  one group at a time.
"""
from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from fuyou_proto.contract import state_object

from fuyou_client.grouping import flat_parts
from fuyou_client.session import In

if TYPE_CHECKING:
    from fuyou_client.engine import Engine
    from fuyou_client.grouping import ParamGroup
    from fuyou_client.session import Session

CLIENT_STATE_FORMAT = 1
INDEX_FILE = "model.safetensors.index.json"


SAVED_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")


def client_state(engine: "Engine", extra: Any) -> bytes:
    """The client's part of a checkpoint: each param group's learning rate (and a
    scheduler's initial_lr) and hyperparameters, and ``extra``. ("lr", the first group's
    rates, is what earlier versions read.)"""
    buf = io.BytesIO()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in SAVED_KEYS}
              for g in engine.optimizer.param_groups]
    lr_state = {k: v for k, v in groups[0].items() if k in ("lr", "initial_lr")}
    torch.save({"format": CLIENT_STATE_FORMAT, "lr": lr_state, "groups": groups, "extra": extra}, buf)
    return buf.getvalue()


def _plain_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _valid_group(g) -> bool:
    if not isinstance(g, dict) or not set(g) <= set(SAVED_KEYS):
        return False
    for k, v in g.items():
        if k == "betas":
            if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(_plain_number(x) for x in v)):
                return False
        elif k == "nesterov":
            if not isinstance(v, bool):
                return False
        elif not (_plain_number(v) and v >= 0):
            return False
    return True


def restore_groups(param_groups: list[dict], saved: list[dict]) -> None:
    """Each param group's saved values back (a checkpoint with one "lr" for all: that
    to every group)."""
    if len(saved) == 1 and len(param_groups) > 1 and set(saved[0]) <= {"lr", "initial_lr"}:
        saved = saved * len(param_groups)
    if saved and len(saved) != len(param_groups):
        raise ValueError(f"the checkpoint has {len(saved)} param groups, this attach {len(param_groups)}: resume "
                         "with the param_groups (or no_decay) it was saved with")
    for group, values in zip(param_groups, saved):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in values.items()})


MAX_CLIENT_STATE = 16 << 20  # the daemon keeps at most this much (fuyoud/checkpoint_files.py)


def load_client_state(data: bytes) -> dict:
    """Plain data only (weights_only): a checkpoint cannot run code in the client. A
    client state that is not one ``client_state`` wrote is a ValueError saying so."""
    if not data:
        return {"groups": [], "extra": None}
    if len(data) > MAX_CLIENT_STATE:
        raise ValueError(f"the checkpoint's client state is {len(data)} bytes, more than {MAX_CLIENT_STATE}")
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for hostile bytes
        raise ValueError(f"the checkpoint's client state is unreadable ({type(exc).__name__}): it holds "
                         "something other than plain data written by fuyou_client") from None
    if not isinstance(state, dict) or state.get("format") != CLIENT_STATE_FORMAT:
        raise ValueError("the checkpoint's client state is not one this version of fuyou_client reads")
    lr = state.get("lr")
    if lr is not None and not (isinstance(lr, dict) and set(lr) <= {"lr", "initial_lr"} and _valid_group(lr)):
        raise ValueError("the checkpoint's client state has a learning rate that is not a finite number >= 0")
    groups = state.get("groups")
    if groups is None:  # (written before param groups)
        groups = [lr] if lr else []
    if not isinstance(groups, list) or not all(_valid_group(g) for g in groups):
        raise ValueError("the checkpoint's client state has param groups whose hyperparameters are not finite "
                         "numbers >= 0")
    return {"groups": groups, "extra": state.get("extra")}


def read_masters(session: "Session", spec: "ParamGroup"):
    """A layer group's fp32 master weights, from its parts' state objects on the SSD
    array, into a new shared buffer (the caller frees it): (buffer, each part's GroupInfo)."""
    infos = [session.group(part.name) for part in spec.parts]
    for part, info in zip(spec.parts, infos):
        if info.numel != part.numel:
            raise ValueError(f"group {part.name} has {info.numel} parameters in the daemon, {part.numel} in this "
                             "model: the checkpoint is of another model (or its parameters were grouped otherwise: "
                             "the same param_groups)")
    buf = session.allocate(spec.numel * 4)
    try:
        session.swap_in_many([In(state_object(part.name), buf, part.start * 4, part.numel * 4, info.weights_offset)
                              for part, info in zip(spec.parts, infos)])
    except BaseException:
        buf.free()
        raise
    return buf, infos


def export(engine: "Engine", directory: str | os.PathLike, dtype: torch.dtype | None = None,
           masters=None) -> Path:
    """Write the trained weights, the frozen parameters and the model's persistent buffers
    to ``directory``; holds one layer group in memory at a time."""
    engine.require_idle("export")
    out = Path(directory)
    writes = engine.world is None or engine.world.rank == 0  # (data parallel: every rank gathers, rank 0 writes)
    if writes:
        out.mkdir(parents=True, exist_ok=True)
    if masters is None:  # (data parallel: the engine gathers them from the ranks' shards)
        def masters(session, spec):
            buf, _ = read_masters(session, spec)
            return buf
    model = engine.model
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    keys = set(model.state_dict().keys())
    buffers = {n: b.detach().cpu().clone() for n, b in model.named_buffers() if n in keys}
    count = len(engine.groups)
    weight_map, total, done = {}, 0, set()
    for i, g in enumerate(engine.groups):
        tensors = _group_tensors(engine.session, g, names, dtype, masters)
        done.update(id(p) for p in (g.offloaded.params if g.offloaded is not None else [p for _, p in g.spec.params]))
        if i == count - 1:  # the parameters no group holds (frozen, resident) and the buffers
            tensors.update({names[id(p)]: p.detach().to("cpu", dtype or p.dtype, copy=True)
                            for p in model.parameters() if id(p) not in done})
            tensors.update(buffers)
        shard = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        if writes:
            save_file(tensors, out / shard, metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = shard
            total += t.numel() * t.element_size()
        del tensors
    if not writes:
        return out
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(out)
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(out)
    return out


def _group_tensors(session: "Session", g, names: dict[int, str], dtype: torch.dtype | None, masters) -> dict:
    """A layer group's parameters by name: the trained ones from their fp32 masters
    (``masters(session, spec)``: a shared buffer, or a tensor), an offloaded block's
    frozen ones from the object they were stored in."""
    tensors = {}
    shapes = g.offloaded.shapes if g.offloaded is not None else [p.shape for _, p in g.spec.params]
    if g.spec.numel:
        buf = masters(session, g.spec)
        try:
            flat = buf[:g.spec.numel] if isinstance(buf, torch.Tensor) else buf.tensor(torch.float32)[:g.spec.numel]
            trained = shapes[:len(g.spec.params)]
            for (_, p), shape, part in zip(g.spec.params, trained, flat_parts(flat, trained)):
                tensors[names[id(p)]] = part.view(shape).to(dtype or g.dtype, copy=True)
        finally:
            if not isinstance(buf, torch.Tensor):
                buf.free()
    frozen = g.offloaded.params[len(g.spec.params):] if g.offloaded is not None else []
    if frozen:
        source = next(s for s in g.offloaded.sources if not s.part)  # (frozen/<group>: no optimizer group)
        buf = session.allocate(source.length)
        try:
            session.swap_in(source.object, buf, length=source.length)
            flat = buf.tensor(g.dtype)[:source.length // g.dtype.itemsize]
            fshapes = shapes[len(g.spec.params):]
            for p, shape, part in zip(frozen, fshapes, flat_parts(flat, fshapes)):
                tensors[names[id(p)]] = part.view(shape).to(dtype or g.dtype, copy=True)
        finally:
            buf.free()
    return tensors


def load_exported(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """An exported directory as one state dict (for ``load_state_dict``)."""
    root = Path(directory)
    index = json.loads((root / INDEX_FILE).read_text())
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(load_file(root / shard))
    return state

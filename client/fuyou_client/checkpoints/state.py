"""The client's part of a checkpoint: each torch param group's learning rate and
hyperparameters and the caller's ``extra`` (scheduler state, data position), written as
plain data beside the daemon's optimizer state (``engine.save_checkpoint``) and read back
on resume without running any code from the file.
"""
from __future__ import annotations

import io
import math
from typing import Any

import torch

CLIENT_STATE_FORMAT = 1


SAVED_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")


def client_state(param_groups: list[dict], extra: Any) -> bytes:
    """The client's part of a checkpoint: each param group's learning rate (and a
    scheduler's initial_lr) and hyperparameters, and ``extra``. ("lr", the first group's
    rates, is what earlier versions read.)"""
    buf = io.BytesIO()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in SAVED_KEYS}
              for g in param_groups]
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


MAX_CLIENT_STATE = 16 << 20  # the daemon keeps at most this much (fuyoud/checkpoints/files.py)


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

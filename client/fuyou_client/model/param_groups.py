"""Torch-style parameter groups: which hyperparameters each parameter steps with.

``attach(model, AdamW(lr=..., weight_decay=...), param_groups=[...])`` takes what
``torch.optim.AdamW(param_groups, ...)`` takes: a list of dicts, each with ``params``
(parameters, or ``(name, parameter)`` pairs) and any of the optimizer's hyperparameters
(AdamW: ``lr``, ``betas``, ``eps``, ``weight_decay``; SGD: ``lr``, ``momentum``,
``dampening``, ``weight_decay``, ``nesterov``); what a group leaves out is the
optimizer's. ``no_decay=`` is the usual recipe in one word: every trainable parameter in
two groups, those that decay (the optimizer's weight decay) and those that do not
(``weight_decay=0``), chosen by name substrings (``["bias", "LayerNorm.weight"]``), a
predicate ``f(name, parameter) -> bool``, or ``"auto"`` (biases and the weights of
normalisation layers, as Hugging Face's Trainer chooses them).

A layer group whose parameters fall in several torch groups is stepped in parts, one
daemon optimizer group per torch group it touches (blocks.py); each step sends its
torch group's current hyperparameters (``engine.optimizer.param_groups``), so schedulers
that change ``lr``, ``betas`` or ``weight_decay`` per group work as with torch.

Bad input is refused before anything starts, naming what is wrong: a parameter in two
groups, one that is not the model's, a frozen one (``requires_grad=False``), a trainable
one in no group, an unknown key, a hyperparameter out of range, and the torch options
Fuyou does not implement (``amsgrad``, ``maximize``, ``foreach=False``...).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch
from torch import nn

from fuyou_client.errors import InvalidArgument
from fuyou_client.optim import AdamW, SGD

HYPER = {AdamW: ("lr", "betas", "eps", "weight_decay"),
         SGD: ("lr", "momentum", "dampening", "weight_decay", "nesterov")}
# torch's options that Fuyou accepts only at the value it implements (fused, single-device)
FIXED = {"amsgrad": (False,), "maximize": (False,), "capturable": (False,), "differentiable": (False,),
         "foreach": (None, True), "fused": (None, True)}
WHY = {"amsgrad": "AMSGrad is not implemented", "maximize": "maximize is not implemented (negate the loss)",
       "capturable": "CUDA graph capture of the step does not apply: the step runs in fuyoud",
       "differentiable": "a differentiable step does not apply: the step runs in fuyoud",
       "foreach": "Fuyou runs torch's fused kernel, whose results may differ in the last bit from the for-loop one",
       "fused": "Fuyou always runs torch's fused kernel"}
# What the "auto" no-decay recipe exempts, as Hugging Face's Trainer (get_decay_parameter_names):
# parameters of nn.LayerNorm modules and those whose lower-cased name matches one of these
AUTO_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")

NoDecay = str | list[str] | tuple[str, ...] | Callable[[str, nn.Parameter], bool] | None


@dataclasses.dataclass
class TorchGroups:
    """The resolved groups: ``groups[i]`` is torch group i as ``engine.optimizer.param_groups[i]``
    starts (its parameters and every hyperparameter), ``index[id(p)]`` the group of p."""
    groups: list[dict]
    index: dict[int, int]
    base: AdamW | SGD

    def spec(self, i: int, group: dict | None = None) -> AdamW | SGD:
        """Torch group i's hyperparameters as a spec (of ``group``, default its first
        form), checked: a value out of range is an InvalidArgument naming it."""
        group = self.groups[i] if group is None else group
        values = {k: group[k] for k in HYPER[type(self.base)]}
        if "betas" in values:
            values["betas"] = tuple(values["betas"]) if isinstance(values["betas"], (list, tuple)) else values["betas"]
        try:
            return dataclasses.replace(self.base, **values)
        except InvalidArgument as exc:
            raise InvalidArgument(f"param_groups[{i}]: {exc}") from None


def _names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _no_decay_rule(model: nn.Module, no_decay: NoDecay) -> Callable[[str, nn.Parameter], bool]:
    if no_decay == "auto":
        in_norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
        return lambda name, p: id(p) in in_norms or bool(AUTO_NO_DECAY.search(name.lower()))
    if callable(no_decay):
        return no_decay
    if isinstance(no_decay, (list, tuple)) and all(isinstance(s, str) for s in no_decay):
        return lambda name, p: any(s in name for s in no_decay)
    raise InvalidArgument(f"no_decay must be 'auto', a list of name substrings or a function (name, parameter) -> "
                          f"bool, not {no_decay!r}")


def _params_of(entry, i: int) -> list[nn.Parameter]:
    params = entry.get("params")
    if isinstance(params, torch.Tensor):
        params = [params]
    if params is None or isinstance(params, (str, bytes, dict)):
        raise InvalidArgument(f"param_groups[{i}]['params'] must be parameters (or (name, parameter) pairs), "
                              f"not {type(params).__name__}")
    out = []
    for p in list(params):
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            p = p[1]
        if not isinstance(p, torch.Tensor):
            raise InvalidArgument(f"param_groups[{i}]['params'] holds a {type(p).__name__}, not a parameter")
        out.append(p)
    return out


def resolve(model: nn.Module, base: AdamW | SGD, param_groups=None, no_decay: NoDecay = None) -> TorchGroups:
    """The torch groups of ``attach(model, base, param_groups=..., no_decay=...)``,
    every hyperparameter filled in and checked."""
    names = _names(model)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    keys = HYPER[type(base)]
    defaults = {k: getattr(base, k) for k in keys}
    if param_groups is not None and no_decay is not None:
        raise InvalidArgument("param_groups and no_decay are two ways to give the groups: pass one")
    if no_decay is not None:
        rule = _no_decay_rule(model, no_decay)
        exempt = [(n, p) for n, p in trainable if rule(n, p)]
        decay = [(n, p) for n, p in trainable if not rule(n, p)]
        entries = [{"params": [p for _, p in decay]}, {"params": [p for _, p in exempt], "weight_decay": 0.0}]
    elif param_groups is None:
        entries = [{"params": [p for _, p in trainable]}]
    else:
        if isinstance(param_groups, dict):
            param_groups = [param_groups]
        entries = list(param_groups)
        if entries and not isinstance(entries[0], dict):  # a plain list of parameters: one group, as torch
            entries = [{"params": entries}]
    groups, index = [], {}
    allowed = set(keys) | set(FIXED) | {"params", "name"}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise InvalidArgument(f"param_groups[{i}] must be a dict with 'params', not {type(entry).__name__}")
        unknown = sorted(set(entry) - allowed)
        if unknown:
            raise InvalidArgument(f"param_groups[{i}] has {unknown[0]!r}, which {type(base).__name__} has not "
                                  f"(its keys: params, {', '.join(keys)})")
        for key, accepted in FIXED.items():
            if key in entry and entry[key] not in accepted:
                raise InvalidArgument(f"param_groups[{i}]: {key}={entry[key]!r} is not supported: {WHY[key]}")
        params = _params_of(entry, i)
        for p in params:
            name = names.get(id(p))
            if name is None:
                raise InvalidArgument(f"param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that is not a "
                                      "parameter of this model")
            if not p.requires_grad:
                raise InvalidArgument(f"param_groups[{i}] holds {name!r}, which is frozen (requires_grad=False): "
                                      "a frozen parameter gets no optimizer state; leave it out, or unfreeze it")
            if id(p) in index:
                raise InvalidArgument(f"{name!r} is in param_groups[{index[id(p)]}] and param_groups[{i}]: a "
                                      "parameter belongs to one group")
            index[id(p)] = i
        group = {"params": params, **defaults, **{k: v for k, v in entry.items() if k in keys}}
        if "name" in entry:
            group["name"] = entry["name"]
        groups.append(group)
    missing = [n for n, p in trainable if id(p) not in index]
    if missing:
        raise InvalidArgument(f"{missing[0]!r} ({len(missing)} in all) requires grad but is in no param group: add "
                              "it to one, or freeze it (requires_grad=False) before attach")
    resolved = TorchGroups(groups, index, base)
    for i in range(len(groups)):
        resolved.spec(i)  # (every value checked now, named)
    return resolved

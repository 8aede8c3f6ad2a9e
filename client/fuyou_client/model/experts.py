"""A mixture of experts' fused experts cut along the expert dimension: *expert parts*, for
a device (or a pinned budget) that cannot hold one block's experts at once.

Hugging Face's mixture-of-experts blocks (transformers 5: Qwen3-MoE, Qwen2-MoE, OLMoE,
DeepSeek-V3, GLM-4-MoE, Qwen3-Next, gpt-oss, ...) hold all of a block's experts in one
module of fused parameters, ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` of shape
``(experts, ., .)``, biases ``(experts, .)`` where the family has them: one atom, most of
the block (a Qwen3-30B-A3B block's experts are 97% of it; gpt-oss-120b's are 3.2B
parameters a block). Llama 4's experts (every expert over every token in one batched
matmul, not transformers' experts interface) are not found here, and not cut. ``cut_experts`` cuts each such module into ``PARTS`` parts of consecutive
experts, ``ExpertPart`` modules registered under it (``experts.parts.<k>``) that hold
parameters of their own, the rows of the fused ones; model/cuts.py then makes each part
a sub-block (``block0003.m<k>``), fetched around its own forward as a projection is.

The experts' forward becomes ``parts_forward``: the one of transformers' "grouped_mm"
experts implementation (``integrations/moe.py``: tokens sorted by expert, one grouped GEMM
up and one down, weighted, summed over the top-k), with the grouped GEMMs run part by
part on the part's rows. Every row meets the same kernels with the same rows as in the
whole module, the gather before and the sum after are the whole module's, and a part's
gradients are the rows of the whole module's: the cut model computes, and trains, bitwise
as the uncut one with "grouped_mm" (tests/test_expert_parts.py). A model set to another
experts implementation ("eager", "batched_mm") computes differently: its experts are not
cut (``ExpertsNotCut`` names why). Every part runs every step, rows or none: an expert no
token reached still has a gradient (zeros), as in the whole module, so the optimizer
steps it as torch does.

Names stay the model's: ``state_dict()`` gives the fused tensors under their own keys
(the parts' rows joined, after an engine's hooks have put its trained values in), and
``load_state_dict`` takes them (split into the parts); ``uncut_experts`` gives the module
its fused parameters back (the same Parameter objects, which the cut module keeps as
attributes). ``fused_names`` maps each part's parameter to the fused parameter's name and
its rows, for what writes by name (the exporter, the clipping norm). A model on the meta
device is made real by its fused parameters (``whole_parameters``: by their names, from a
checkpoint or the model's init), the parts then viewing their rows (``repoint``); once a
block's parts are made, the fused values are let go (``release``).
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

from fuyou_client.model.blocks import ROWS_OF

PARTS = 16  # a fused experts module is cut into this many parts (fewer with fewer experts)


class ExpertsNotCut(ValueError):
    """A fused experts module that cannot be cut, and why."""


def _grouped_linear():
    from transformers.integrations.moe import _grouped_linear as grouped  # (the whole module's own kernel call)
    return grouped


def fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's fused experts modules (transformers' ``use_experts_implementation``
    classes: ``num_experts`` and parameters whose first dimension is it), by name."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, ExpertPart) or not hasattr(m, "has_gate") or not hasattr(m, "is_transposed"):
            continue
        n = getattr(m, "num_experts", None)
        own = [p for p in m._parameters.values() if p is not None]
        if isinstance(n, int) and own and all(p.dim() >= 2 and p.shape[0] == n for p in own):
            out.append((name, m))
    return out


def why_not(module: nn.Module) -> str | None:
    """Why this fused experts module cannot be cut (None: it can)."""
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if impl != "grouped_mm":
        return (f"its experts implementation is {impl!r}, and the cut experts compute as 'grouped_mm' does "
                "(model.set_experts_implementation('grouped_mm') before attach, or granularity='module')")
    if getattr(module, "_is_expert_parallel", False):
        return "it is expert-parallel (its experts are spread over processes)"
    if getattr(module, "has_post_expert_norm", False):
        return "its experts have a norm after each (has_post_expert_norm)"
    if any(True for c in module.children() for _ in c.parameters()):
        return "it holds modules with parameters of their own"
    return None


def cuttable(model: nn.Module) -> bool:
    """Whether the model has fused experts and every one of them can be cut."""
    found = fused_experts(model)
    return bool(found) and all(why_not(m) is None for _, m in found)


class ExpertPart(nn.Module):
    """Experts ``[first, first + count)`` of a fused experts module: its parameters' rows,
    as parameters of this module under the same names. Its forward is the grouped
    projection of the rows routed to its experts (``parts_forward``)."""

    def __init__(self, owner: nn.Module, first: int, count: int):
        super().__init__()
        self.first, self.count = first, count
        self.__dict__["owner"] = owner  # (not a child: the owner holds the parts)
        for name, p in owner._parameters.items():
            part = nn.Parameter(p.data[first:first + count], requires_grad=p.requires_grad)
            per = p[0].numel()
            setattr(part, ROWS_OF, (first * per, p.numel()))  # (stepped as torch steps the fused tensor)
            self.register_parameter(name, part)

    def forward(self, rows: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        o, linear = self.owner, _grouped_linear()
        up = self.gate_up_proj if o.has_gate else self.up_proj
        up_bias = (self.gate_up_proj_bias if o.has_gate else self.up_proj_bias)[ids] if o.has_bias else None
        out = linear(rows, up, offsets, bias=up_bias, is_transposed=o.is_transposed)
        out = o._apply_gate(out) if o.has_gate else o.act_fn(out)
        out = linear(out, self.down_proj, offsets, bias=self.down_proj_bias[ids] if o.has_bias else None,
                     is_transposed=o.is_transposed)
        return out * weights.unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.count - 1}"


def parts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """A cut experts module's forward: transformers' grouped_mm experts forward with its two
    grouped GEMMs (and the bias, gate and weighting between) run part by part."""
    top_k, tokens, hidden = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    selected = hidden_states[perm // top_k]
    weights = top_k_weights.reshape(-1)[perm]
    histc_input = expert_ids.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids.int()
    per_expert = torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
    bounds = [0, *offsets.tolist()]  # (one host sync a layer: where each part's rows are)
    sizes = [bounds[p.first + p.count] - bounds[p.first] for p in self.parts]
    outs = [part(rows, offsets[part.first:part.first + part.count] - bounds[part.first], ids - part.first, w)
            for part, rows, ids, w in zip(self.parts, selected.split(sizes), expert_ids.split(sizes),
                                          weights.split(sizes))]
    weighted = torch.cat(outs)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    return weighted[inverse].view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _fuse_state(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook of a cut experts module: the parts' rows joined under the fused
    names (the parts' own keys dropped)."""
    for name in module.fused_names:
        keys = [f"{prefix}parts.{k}.{name}" for k in range(len(module.parts))]
        if all(k in state_dict for k in keys):
            values = [state_dict.pop(k) for k in keys]
            state_dict[prefix + name] = torch.cat([v.detach() if isinstance(v, nn.Parameter) else v for v in values])


def _split_state(module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: fused tensors given under their own names go to the parts."""
    for name in module.fused_names:
        value = state_dict.pop(prefix + name, None)
        if value is not None:
            for k, part in enumerate(module.parts):
                state_dict[f"{prefix}parts.{k}.{name}"] = value[part.first:part.first + part.count]


@dataclass(frozen=True)
class Rows:
    """Where a part's parameter is in the model's own naming: rows [start, stop) of ``name``."""
    name: str
    start: int
    stop: int
    experts: int  # the fused parameter's first dimension


def part_bounds(experts: int, parts: int = PARTS) -> list[tuple[int, int]]:
    """The parts' expert ranges [first, stop): ``parts`` of them (fewer with fewer experts),
    as equal as they can be. The planner cuts by this rule too (model/cuts.py atom_sizes)."""
    count = min(parts, experts)
    bounds = [experts * k // count for k in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


def cut_experts(model: nn.Module, parts: int = PARTS) -> list[str]:
    """Cut every fused experts module of ``model`` into ``parts`` parts (fewer where it has
    fewer experts; sizes as equal as they can be), in place; the names of those cut.
    Raises ExpertsNotCut (naming the module and why) before changing anything.

    A part's parameters are views of the fused ones' rows. The fused Parameter objects stay
    the module's attributes (``module.gate_up_proj``, not registered: ``parameters()``
    gives the parts), so that what holds them (a user's reference, a meta model's
    materializer, its init writing ``module.gate_up_proj``) keeps working, and
    ``uncut_experts`` registers those same objects again."""
    found = [(n, m) for n, m in fused_experts(model) if not is_cut(m)]
    for name, m in found:
        reason = why_not(m)
        if reason is not None:
            raise ExpertsNotCut(f"the experts of {name!r} cannot be cut: {reason}")
    for _, m in found:
        names = [k for k, p in m._parameters.items() if p is not None]
        part_modules = nn.ModuleList(ExpertPart(m, a, b - a) for a, b in part_bounds(m.num_experts, parts))
        for k in names:
            m.__dict__[k] = m._parameters.pop(k)  # (an attribute still; no longer a parameter)
        m.parts = part_modules
        m.fused_names = names
        m.forward = types.MethodType(parts_forward, m)
        m.fuyou_hooks = (m.register_state_dict_post_hook(_fuse_state),
                         m.register_load_state_dict_pre_hook(_split_state))
    return [n for n, _ in found]


def is_cut(module: nn.Module) -> bool:
    return isinstance(getattr(module, "parts", None), nn.ModuleList) and hasattr(module, "fused_names")


def _cut_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if is_cut(m)]


def uncut_experts(model: nn.Module, values: bool = False) -> None:
    """Register every cut module's fused Parameter objects again, give it its own forward
    and drop its parts. ``values``: the fused parameters take the parts' values (joined;
    a part left empty, as by an engine closed without its weights, leaves that module
    cut); else they keep the data they hold (attach failed: what it was given)."""
    for _, m in _cut_modules(model):
        got = {name: [getattr(part, name) for part in m.parts] for name in m.fused_names}
        if values and any(v.shape[0] != part.count for vs in got.values() for v, part in zip(vs, m.parts)):
            continue
        for name in m.fused_names:
            fused = m.__dict__.pop(name)
            if values or (_released(fused) and not any(_released(v) or not v.numel() for v in got[name])):
                with torch.no_grad():  # (released after the parts' upload, attach failing later: the parts')
                    fused.data = joined(got[name])
            m.register_parameter(name, fused)
        for h in m.fuyou_hooks:
            h.remove()
        del m.parts, m.fused_names, m.fuyou_hooks
        m.__dict__.pop("forward", None)


def _released(t: torch.Tensor) -> bool:
    """An empty stand-in (``release``): every stride 0, not the meta device."""
    return not t.is_meta and t.dim() > 0 and t.numel() > 1 and all(s == 0 for s in t.stride())


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' rows as one tensor: their common base where they are its consecutive rows
    in order (no copy), else a copy."""
    base = parts[0].data._base
    if base is not None and base.is_contiguous() and all(p.data._base is base for p in parts):
        at, whole = 0, True
        for p in parts:
            whole = whole and p.data.storage_offset() == base.storage_offset() + at and p.data.is_contiguous()
            at += p.numel()
        if whole and at == base.numel():
            return base
    return torch.cat([p.detach() for p in parts])


def repoint(module: nn.Module) -> None:
    """Each part under ``module`` a view of its fused parameters' rows again (a meta
    model's materializer has just given the fused ones their values)."""
    for _, m in _cut_modules(module):
        for name in m.fused_names:
            fused = m.__dict__[name]
            for part in m.parts:
                getattr(part, name).data = fused.data[part.first:part.first + part.count]


def release(model: nn.Module) -> None:
    """The fused parameters' data dropped (an empty stand-in of their shape, no memory):
    the parts hold the values now (attach has uploaded them)."""
    for _, m in _cut_modules(model):
        for name in m.fused_names:
            fused = m.__dict__[name]
            fused.data = torch.zeros((), dtype=fused.dtype, device=fused.device).expand(fused.shape)


def whole_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module.named_parameters()`` as if uncut: a cut module's fused parameters, by their
    names, in place of its parts' (what a meta model is made real by)."""
    out, seen = [], set()
    owners = {id(getattr(part, name)): (prefix, m, name) for prefix, m in _cut_modules(module)
              for part in m.parts for name in m.fused_names}
    for n, p in module.named_parameters():
        if id(p) not in owners:
            out.append((n, p))
            continue
        prefix, m, name = owners[id(p)]
        if (id(m), name) not in seen:
            seen.add((id(m), name))
            out.append((f"{prefix}.{name}" if prefix else name, m.__dict__[name]))
    return out


def fused_names(model: nn.Module) -> dict[int, Rows]:
    """id(part parameter) -> its rows in the model's own naming, for every cut module."""
    out = {}
    for name, m in _cut_modules(model):
        for k in m.fused_names:
            for part in m.parts:
                out[id(getattr(part, k))] = Rows(f"{name}.{k}" if name else k, part.first, part.first + part.count,
                                                 m.num_experts)
    return out

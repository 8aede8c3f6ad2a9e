"""Splitting a model into layer groups: the unit of offload and of optimizer steps.

The repeated blocks of a model (GPT-2's ``transformer.h``, Llama's ``model.layers``, any
``nn.ModuleList`` of same-typed modules) become one group each; every other parameter
(embeddings, final norm, a head tied to the embeddings) goes to one more group, "rest".
Groups never share parameters: one shared between two blocks is refused (name the
blocks yourself so that it lives in one); tied weights outside the blocks (GPT-2's
embedding and head) are simply both in "rest".

A group's parameters are laid out one after another (every buffer of a group: weights,
gradients, accumulators) ordered by torch parameter group (param_groups.py), so that the
parameters of each torch group it holds are one run, a *part*: one optimizer group in
the daemon each, with that torch group's hyperparameters. A group within one torch group
(the usual case) is one part, named as the group.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn

SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
ROWS_OF = "_fuyou_rows_of"  # a parameter's attribute: (offset, numel) of the tensor it is rows of


def flat_parts(flat: torch.Tensor, shapes: list[torch.Size]) -> tuple[torch.Tensor, ...]:
    """``flat`` (a group's elements, its parameters one after another) as one flat view per
    parameter: the layout of every buffer of a group (weights, gradients, accumulators)."""
    sizes = [shape.numel() for shape in shapes]
    return flat[:sum(sizes)].split(sizes)


@dataclass(frozen=True)
class Part:
    """A run of a layer group's elements stepped as one optimizer group in the daemon."""
    name: str  # the daemon's group (its state object: "optim/<name>")
    start: int  # first element in the layer group's layout
    numel: int
    index: int  # its torch param group: engine.optimizer.param_groups[index]


@dataclass
class GroupSpec:
    name: str
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    module: nn.Module | None = None  # the block, for a block's own group (None for "rest" and sub-blocks)
    parts: list[Part] = field(default_factory=list)  # (set by split)
    # A block's frozen parameters (requires_grad=False): no optimizer state; offloaded with
    # the block's weights (after its trained ones) when the block is, else left as they are.
    frozen: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    # Where its weights are fetched around (offload/): the block for a block's own group,
    # the modules holding a sub-block's parameters (model/cuts.py), none for the resident rest.
    uses: tuple[nn.Module, ...] = ()
    block: nn.Module | None = None  # the block it is of (its own group's or a sub-block's), None for the rest's
    unit: str = ""  # the block it is cut from ("block0003") or "rest": what a meta model makes real with it
    early: bool = False  # a sub-block of the rest forward uses before the blocks (the embeddings)

    def __post_init__(self):
        if self.module is not None and not self.uses:
            self.uses, self.block = (self.module,), self.module
        self.unit = self.unit or self.name

    @property
    def is_rest(self) -> bool:
        """Of the rest (embeddings, final norm, head): not of a block."""
        return self.block is None

    @cached_property
    def numel(self) -> int:
        """Trained elements in the group, counted once (offloaded parameters are empty later)."""
        return sum(self.tensor_numels)

    @cached_property
    def tensor_numels(self) -> tuple[int, ...]:
        """Each trained parameter's elements, in the group's layout (counted with ``numel``)."""
        return tuple(p.numel() for _, p in self.params)

    def tensors(self, start: int, numel: int) -> tuple[int, ...]:
        """The parameters behind the group's elements [start, start + numel), as the daemon's
        StepGroup takes them: (numel, offset, tensor numel) triples, flat; () where the
        range reaches past them (padding). An expert part's parameter (model/experts.py) is
        the rows of a fused tensor: its offset and numel are that tensor's (``ROWS_OF``), as
        torch steps it."""
        out, at = [], 0
        for (_, p), n in zip(self.params, self.tensor_numels):
            lo, hi = max(start, at), min(start + numel, at + n)
            base, total = getattr(p, ROWS_OF, (0, n))
            if lo < hi:
                out += [hi - lo, base + lo - at, total]
            at += n
        return tuple(out) if sum(out[0::3]) == numel else ()

    @cached_property
    def frozen_numel(self) -> int:
        return sum(p.numel() for _, p in self.frozen)


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The largest ModuleList whose children share one type (the transformer blocks)."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[2]:
                best = (name, module, size)
    return (best[0], best[1]) if best else None


# An MLP activation module of one operator (torch's, or transformers' wrappers of one torch
# function); any other (HF's NewGELUActivation: gelu_new written out) counts as written out.
ONE_OPERATOR = {"GELU", "ReLU", "SiLU", "GELUActivation", "PytorchGELUTanh", "GELUTanh", "SiLUActivation"}


def mlp_layout(block: nn.Module, width: int) -> tuple[str, int]:
    """A block's MLP as the device plan counts its activations (memory.SAVED_ACTIVATIONS):
    ("llama", its width) where three matrices share a width other than the model's (gate,
    up and down: SiLU-gated), else GPT-2's, the width two matrices share (up and down):
    "gpt2-fused" where its activation module is one operator, "gpt2" otherwise. Read from
    the block's 2-D parameters (Linear and GPT-2's Conv1D alike; GQA's narrow key and value
    projections are two, the MLP's three or two of a width at least theirs) and modules."""
    dims = collections.Counter(d for p in block.parameters() if p.dim() == 2 and width in p.shape
                               for d in p.shape if d != width)
    shared = [d for d, n in dims.items() if n >= 2]
    mlp = max(shared, key=lambda d: (dims[d], d)) if shared else 4 * width
    if shared and dims[mlp] >= 3:
        return "llama", mlp
    names = {type(m).__name__ for m in block.modules()}
    written = names & {"NewGELUActivation", "FastGELUActivation", "QuickGELUActivation", "BloomGelu"}
    return ("gpt2-fused" if names & ONE_OPERATOR and not written else "gpt2"), mlp


def block_list(model: nn.Module, blocks: list[nn.Module] | None = None) -> list[nn.Module]:
    """The blocks, in forward order: ``blocks`` or the ones ``find_blocks`` discovers."""
    if blocks is not None:
        return list(blocks)
    found = find_blocks(model)
    return list(found[1]) if found else []


def split(model: nn.Module, blocks: list[nn.Module] | None = None,
          index: dict[int, int] | None = None) -> list[GroupSpec]:
    """Groups in forward order: one per block, then "rest". ``blocks`` overrides discovery;
    ``index`` maps id(parameter) to its torch param group (default: all in group 0)."""
    blocks = block_list(model, blocks)
    owner: dict[int, str] = {}
    frozen: set[int] = set()
    groups: list[GroupSpec] = []
    for i, block in enumerate(blocks):
        group = GroupSpec(f"block{i:04d}", module=block)
        for pname, p in block.named_parameters():
            if not p.requires_grad:
                if p.dtype in SUPPORTED and id(p) not in frozen:  # (others stay where they are)
                    frozen.add(id(p))
                    group.frozen.append((pname, p))
                continue
            if id(p) in owner:
                raise ValueError(f"parameter {pname!r} is shared between groups {owner[id(p)]} and {group.name}; "
                                 "a parameter must belong to exactly one group: pass blocks= so that the "
                                 "modules sharing it form one block")
            owner[id(p)] = group.name
            group.params.append((pname, p))
        groups.append(group)
    seen = set(owner)
    rest = GroupSpec("rest")
    for pname, p in model.named_parameters():  # named_parameters() already skips tied duplicates
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            rest.params.append((pname, p))
    if rest.params:
        groups.append(rest)
    for g in groups:
        for pname, p in g.params:
            if p.dtype not in SUPPORTED:
                raise TypeError(f"parameter {pname!r} of group {g.name} is {p.dtype}; Fuyou trains "
                                "float32, bfloat16 and float16 parameters (freeze it with requires_grad=False)")
    groups = [g for g in groups if g.params or g.frozen]  # (a frozen block: offloaded, never stepped)
    for g in groups:
        lay_out(g, index)
    return groups


def lay_out(g: GroupSpec, index: dict[int, int] | None) -> None:
    """The group's parameters in layout order (by torch param group, model order within
    one) and its parts: one per torch param group it holds."""
    which = (lambda p: index.get(id(p), 0)) if index is not None else (lambda p: 0)
    g.params.sort(key=lambda item: which(item[1]))  # (stable: model order within a torch group)
    g.numel, g.frozen_numel  # noqa: B018 - counted now, while every parameter holds its data
    g.parts, start = [], 0
    for k, (i, run) in enumerate(itertools.groupby(g.params, key=lambda item: which(item[1]))):
        count = sum(p.numel() for _, p in run)
        g.parts.append(Part(g.name if k == 0 else f"{g.name}.g{i}", start, count, i))
        start += count


def set_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    """``p.grad = grad``, also while an offloaded parameter's data is empty (torch checks
    the gradient's shape against the data's)."""
    if p.shape == grad.shape:
        p.grad = grad
        return
    data = p.data
    p.data = grad
    p.grad = grad
    p.data = data

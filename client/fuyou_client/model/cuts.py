"""Layer groups finer than a block: *sub-blocks*, for a device (or a pinned budget) that
cannot hold a whole block's weights and gradients at once.

``cut(groups, model, index)`` takes the groups ``split`` made (one per block, then "rest")
and cuts each along its modules:

* a block's *atoms*: its modules that own parameters themselves (a ``Linear``, a norm),
  those sharing a parameter joined into one (a tied or shared weight is in one group,
  fetched once per use and its gradient summed once by autograd, as torch sums it);
* each *large* atom (at least ``1/LARGE`` of the block's bytes: the projections and the
  MLP's matrices) becomes a sub-block of its own, ``block0003.m<k>``, fetched around the
  atom's modules (their forward pre- and post-hooks: offload/), so that only the module
  computing, the ones fetched ahead and the ones backward holds are on the device;
* the small atoms (norms, GQA's narrow key and value projections, a LoRA adapter)
  stay in the block's own group, still named ``block0003`` and fetched around the whole
  block as an uncut block is: a few kilobytes to megabytes held while the block computes,
  rather than a fetch for each norm (a block of large modules only gives its smallest to
  its own group: every block has one, what the activation policy and train_step hold);
* the rest group keeps its small parameters resident (final norm, position embeddings)
  and its large atoms become sub-blocks too, ``rest.m<k>``: the embeddings (token and
  learned position embeddings in one: used together, their gradients final together; with
  the head when tied: used at both ends of the model) and an untied head.

Frozen parameters go with their atom. A PEFT tuner layer is one atom, its frozen base
weight and its adapters together (DoRA and an embedding's LoRA read the base weight
outside the base layer's own forward): one sub-block, its base weight fetched, never
stepped, its adapters stepped. Sub-blocks are ordered as their first
module is registered, which for the transformer blocks here (GPT-2, Llama, and the other
families the tests train) is the order forward uses them in. The groups stay in ``split``'s
order (blocks, then the rest: the order a meta model is made real in); the rest's
embeddings are marked ``early``, and the offloader prefetches them before the blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from fuyou_client.model.blocks import GroupSpec, lay_out
from fuyou_client.model.experts import fused_experts, part_bounds

LARGE = 32  # an atom of at least 1/LARGE of its group's bytes is a sub-block of its own


@dataclass
class _Atom:
    modules: list[nn.Module] = field(default_factory=list)
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    frozen: list[tuple[str, nn.Parameter]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in (*self.params, *self.frozen))


def _whole(module: nn.Module) -> bool:
    """A module never cut below itself: a PEFT tuner layer (LoRA, DoRA, LoHa, LoKr...),
    whose forward reads its base layer's weight outside the base layer's own forward
    (DoRA's weight norm, an embedding's LoRA), so the base layer and its adapters are one
    atom, fetched around the tuner layer's forward."""
    return any(c.__name__ == "BaseTunerLayer" for c in type(module).__mro__)


def _atoms(root: nn.Module, spec: GroupSpec, skip: set[int]) -> list[_Atom]:
    """The group's parameters by the modules under ``root`` that own them (modules sharing
    a parameter joined), in module registration order; ``skip``: modules not searched
    (the blocks, for the rest)."""
    mine = {id(p): ("param", n, p) for n, p in spec.params} | {id(p): ("frozen", n, p) for n, p in spec.frozen}
    owner: dict[int, _Atom] = {}  # id(parameter) -> its atom
    atoms: list[_Atom] = []
    stack = [root]
    order: list[nn.Module] = []
    while stack:  # (modules in registration order, depth first, not below a skipped one or a whole one)
        m = stack.pop()
        if id(m) in skip:
            continue
        order.append(m)
        if not _whole(m):
            stack.extend(reversed(list(m.children())))
    for m in order:
        own = m.parameters() if _whole(m) else m._parameters.values()
        owned = [p for p in own if p is not None and id(p) in mine]
        if not owned:
            continue
        joined = []
        for p in owned:
            if id(p) in owner and owner[id(p)] not in joined:
                joined.append(owner[id(p)])
        atom = joined[0] if joined else _Atom()
        for other in joined[1:]:  # (a parameter shared with an earlier atom: one atom)
            atom.modules += other.modules
            for p in (*other.params, *other.frozen):
                owner[id(p[1])] = atom
            atom.params += other.params
            atom.frozen += other.frozen
            atoms.remove(other)
        if not joined:
            atoms.append(atom)
        atom.modules.append(m)
        for p in owned:
            if id(p) not in owner:
                owner[id(p)] = atom
                kind, name, _ = mine[id(p)]
                (atom.params if kind == "param" else atom.frozen).append((name, p))
    for atom in atoms:  # (the group's own order within each atom: layout follows it)
        rank = {id(p): i for i, (_, p) in enumerate((*spec.params, *spec.frozen))}
        atom.params.sort(key=lambda item: rank[id(item[1])])
        atom.frozen.sort(key=lambda item: rank[id(item[1])])
    return atoms


def large_atoms(sizes: list[int], block: bool = True) -> list[int]:
    """Which atoms (by their sizes, in order) become sub-blocks: those of at least
    1/LARGE of the group's bytes; in a block of large atoms only, all but its smallest
    (which stays its own group's). The planner cuts the blocks it sizes by this rule too."""
    total = sum(sizes)
    large = [i for i, n in enumerate(sizes) if n and n * LARGE >= total]
    if block and large and len(large) == len([n for n in sizes if n]):
        large.remove(min(large, key=lambda i: sizes[i]))
    return large


def rest_sub_blocks(atoms: list[tuple[int, bool]]) -> list[list[int]]:
    """The rest's sub-blocks, from its atoms' (size, holds an embedding), as lists of atom
    indices: its large atoms, the embeddings among them in one (used, and their gradients
    final, together). The planner cuts the rest it sizes by this rule too."""
    large = large_atoms([n for n, _ in atoms], block=False)
    embedding = [i for i in large if atoms[i][1]]
    return ([embedding] if embedding else []) + [[i] for i in large if not atoms[i][1]]


def _large(atoms: list[_Atom], block: bool = True) -> list[_Atom]:
    return [atoms[i] for i in large_atoms([a.nbytes for a in atoms], block)]


def atom_sizes(model: nn.Module, block: nn.Module | None, blocks: list[nn.Module],
               experts: bool = False) -> list[tuple[int, bool]]:
    """The parameter counts of a block's atoms (``block``), or of the rest's (None), in
    order, each with whether it holds an embedding: what the planner cuts (sizing/shape.py).
    ``experts``: a fused experts module's atom as the parts model/experts.py cuts it into."""
    if block is not None:
        spec = GroupSpec("block", params=list(block.named_parameters()))
        atoms = _atoms(block, spec, set())
    else:
        inside = {id(p) for b in blocks for p in b.parameters()}
        spec = GroupSpec("rest", params=[(n, p) for n, p in model.named_parameters() if id(p) not in inside])
        atoms = _atoms(model, spec, {id(b) for b in blocks})
    fused = {id(m): m for _, m in fused_experts(block)} if experts and block is not None else {}
    out = []
    for a in atoms:
        n = sum(p.numel() for _, p in a.params)
        owner = next((fused[id(m)] for m in a.modules if id(m) in fused), None)
        if owner is not None and len(a.modules) == 1:
            out += [(n * (b - f) // owner.num_experts, False) for f, b in part_bounds(owner.num_experts)]
        else:
            out.append((n, any(isinstance(m, nn.Embedding) for m in a.modules)))
    return out


def cut(groups: list[GroupSpec], model: nn.Module, index: dict[int, int] | None = None) -> list[GroupSpec]:
    """``split``'s groups cut into sub-blocks (see above): each block's own group and its
    sub-blocks, then the rest's sub-blocks and the resident rest. ``index``: id(parameter)
    -> its torch param group (as ``split`` takes it)."""
    blocks = [g for g in groups if not g.is_rest]
    rest = next((g for g in groups if g.is_rest), None)
    out = []
    for g in blocks:
        atoms = _atoms(g.module, g, set())
        large = _large(atoms)
        small = [a for a in atoms if not any(a is b for b in large)]
        own = GroupSpec(g.name, module=g.module, params=[p for a in small for p in a.params],
                        frozen=[p for a in small for p in a.frozen])
        subs = [GroupSpec(f"{g.name}.m{k}", params=a.params, frozen=a.frozen, uses=tuple(a.modules), block=g.module,
                          unit=g.name) for k, a in enumerate(large, 1)]
        out += [s for s in (own, *subs) if s.params or s.frozen]
    if rest is not None:
        atoms = _atoms(model, rest, {id(g.module) for g in blocks})
        subs = rest_sub_blocks([(a.nbytes, any(isinstance(m, nn.Embedding) for m in a.modules)) for a in atoms])
        cut_out = {i for sub in subs for i in sub}
        kept = GroupSpec("rest", params=[p for i, a in enumerate(atoms) if i not in cut_out for p in a.params])
        for k, sub in enumerate(subs, 1):
            out.append(GroupSpec(f"rest.m{k}", params=[p for i in sub for p in atoms[i].params],
                                 uses=tuple(m for i in sub for m in atoms[i].modules), unit="rest",
                                 early=any(isinstance(m, nn.Embedding) for i in sub for m in atoms[i].modules)))
        out += [kept] if kept.params else []
    for g in out:
        lay_out(g, index)
    return out

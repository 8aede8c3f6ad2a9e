"""Stepping a group's elements as the tensors they are, as torch.optim steps them.

torch's fused CPU kernels (AdamW's, SGD's) step each tensor of their list in a vector
loop of ``width`` elements and its last ``numel % width`` elements in a scalar loop, whose
rounding differs (measured here: one element in about 30 after three AdamW steps). A
group stepped as one flat tensor puts a tensor's last elements through the vector loop
where torch.optim, stepping the tensor alone, puts them through the scalar one: a model
with a tensor whose size is not a multiple of the width (gpt-oss's attention sinks at 4
heads, say) then drifts from torch by an ulp a step.

A client names the tensors behind a group's elements (``Piece``: that many elements from
that offset of a tensor of that size; a data-parallel shard or a chunk may hold part of
one), and ``lists`` turns a run of the group's flat tensors into the fused kernels' lists
so that every element takes the loop it takes in torch.optim: whole vectors as views,
each tensor's scalar tail as a view of its own (shorter than the width: all scalar), and
what is left of a run of vector elements cut short by a piece's or a chunk's edge
through a zero-padded scratch vector, copied back after (``Lists.done``).

``width`` is found by trying torch's kernel here (``vector_width``), once: None where its
vector and scalar loops agree, and then nothing needs doing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
from torch.optim.adamw import adamw as _adamw


class Piece(NamedTuple):
    """``numel`` elements of a tensor of ``tensor_numel``, from its element ``offset``."""
    numel: int
    offset: int
    tensor_numel: int


@functools.cache
def vector_width() -> int | None:
    """How many fp32 elements torch's fused AdamW steps at once here; None if its vector
    and scalar loops round alike (found by stepping the same values as one long tensor,
    as tensors of one element, and as tensors of 2, 4, ... 64: the shortest whose first
    element takes the long tensor's result is a whole vector)."""
    gen = torch.Generator().manual_seed(0)
    n = 64 * 64
    w, g = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3

    def stepped(length: int) -> torch.Tensor:
        ws = [t.clone() for t in w.split(length)]
        ms, vs = [torch.zeros_like(t) for t in ws], [torch.zeros_like(t) for t in ws]
        steps = [torch.tensor(0.0) for _ in ws]
        for _ in range(3):
            _adamw(ws, list(g.split(length)), ms, vs, [], steps, fused=True, amsgrad=False, beta1=0.9, beta2=0.999,
                   lr=1e-3, weight_decay=0.1, eps=1e-8, maximize=False)
        return torch.cat(ws)

    vector, scalar = stepped(n), stepped(1)
    differ = (vector != scalar).nonzero().flatten()
    if differ.numel() == 0:
        return None
    for length in (2, 4, 8, 16, 32, 64):
        firsts = differ[differ % length == 0]
        if firsts.numel() and bool((stepped(length)[firsts] == vector[firsts]).all()):
            return length
    return None


def within(pieces: Sequence[Piece], a: int, b: int) -> list[Piece]:
    """The pieces of the group's elements [a, b) (a chunk's)."""
    out, at = [], 0
    for p in pieces:
        lo, hi = max(a, at), min(b, at + p.numel)
        if lo < hi:
            out.append(Piece(hi - lo, p.offset + lo - at, p.tensor_numel))
        at += p.numel
    return out


@dataclass
class Lists:
    """The fused kernels' arguments for a run of flat tensors: ``slots[k]`` (the state's
    k-th tensor's pieces), ``grads``; ``done()`` copies the scratch vectors' results back."""
    slots: list[list[torch.Tensor]]
    grads: list[torch.Tensor]
    _back: list[tuple[int, int, list[torch.Tensor]]] = field(default_factory=list)  # (start, length, scratch slots)
    _flat: list[torch.Tensor] = field(default_factory=list)

    def done(self) -> None:
        for start, length, scratch in self._back:
            for flat, s in zip(self._flat, scratch):
                flat[start:start + length].copy_(s[:length])


def lists(slots: Sequence[torch.Tensor], grad: torch.Tensor, pieces: Sequence[Piece], width: int) -> Lists:
    """``slots`` (flat, the state's tensors) and ``grad`` over ``pieces`` as the kernels'
    lists, each element in the loop torch.optim gives it (see the module's doc)."""
    out = Lists([[] for _ in slots], [], _flat=list(slots))

    def view(start: int, length: int) -> None:
        for k, s in enumerate(slots):
            out.slots[k].append(s[start:start + length])
        out.grads.append(grad[start:start + length])

    def padded(start: int, length: int) -> None:  # (a vector's worth: the vector loop)
        scratch = []
        for k, s in enumerate(slots):
            t = s.new_zeros(width)
            t[:length] = s[start:start + length]
            out.slots[k].append(t)
            scratch.append(t)
        g = grad.new_zeros(width, dtype=grad.dtype)
        g[:length] = grad[start:start + length]
        out.grads.append(g)
        out._back.append((start, length, scratch))

    at = 0
    for p in pieces:
        tail = p.tensor_numel - p.tensor_numel % width  # (the tensor's elements from here: scalar loop)
        vector = max(0, min(p.offset + p.numel, tail) - p.offset)
        whole = vector - vector % width
        if whole:
            view(at, whole)
        if vector - whole:
            padded(at + whole, vector - whole)
        if p.numel - vector:
            view(at + vector, p.numel - vector)  # (shorter than the width: all scalar)
        at += p.numel
    return out

"""What ``train_step`` refuses before any work (schedule.py runs what passes)."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def check_micro_batches(micro_batches, loss_fn) -> None:
    """Refuse, before any work, what train_step cannot run: no micro-batches, micro-batches
    of mixed structure or shapes, a loss_fn that is not callable."""
    if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
        raise ValueError("train_step needs a non-empty list of micro-batches")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (micro_batch -> scalar loss), got {type(loss_fn).__name__}")
    first, spec = tree_flatten(micro_batches[0])
    for i, mb in enumerate(micro_batches[1:], 1):
        leaves, other = tree_flatten(mb)
        if other != spec:
            raise ValueError(f"micro-batch {i} is structured differently from micro-batch 0: {other} vs {spec}")
        for a, b in zip(first, leaves):
            if isinstance(a, torch.Tensor) and (a.shape != b.shape or a.dtype != b.dtype):
                raise ValueError(f"micro-batch {i} holds a {b.dtype} tensor of shape {tuple(b.shape)} where "
                                 f"micro-batch 0 has {a.dtype} {tuple(a.shape)}: train_step needs micro-batches "
                                 "of one shape (pad them, or call it once per shape)")
    if not torch.is_grad_enabled():
        raise RuntimeError("train_step under torch.no_grad() or inference_mode: it trains, so it needs gradients")

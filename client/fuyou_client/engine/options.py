"""The options of ``attach(model, optimizer, **options)``, in one frozen dataclass,
validated once: every refusal names the option and what it accepts."""
from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass
from typing import Any

from torch import nn

from fuyou_client.activations.swapper import TREATMENTS, WORDS


def _count(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, not {value!r}")


def check_optimizer_ranks(ranks) -> None:
    """``optimizer_ranks``: a non-empty list of distinct ranks (ints >= 0)."""
    if (not isinstance(ranks, (list, tuple)) or not ranks
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks)):
        raise ValueError(f"optimizer_ranks must be a non-empty list of ranks (ints >= 0), not {ranks!r}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"optimizer_ranks names a rank twice ({list(ranks)!r}): each optimizer rank owns its own "
                         "share of the layer groups")


GRANULARITIES = ("auto", "block", "module", "expert")


@dataclass(frozen=True)
class AttachOptions:
    """How ``attach`` hooks a model up to fuyoud: each field is an option of ``attach``.
    docs/reference.md lists them, generated from the entries below (one per field).

    Where the daemon is:
      ``session``: an open ``fuyou_client.Session`` to use (the engine leaves it open).
      ``socket``: the daemon's control socket (default: ``$FUYOUD_SOCKET``, else the
      current user's).
      ``namespace``: the session's namespace (default: a fresh one).

    The model:
      ``blocks``: the modules that become layer groups (default: the repeated blocks
      found: GPT-2's ``transformer.h``, Llama's ``model.layers``, any ``ModuleList`` of
      one module type); everything else is one more group, "rest".
      ``weights``: for a model built on the meta device, where its values come from, one
      group at a time: a safetensors checkpoint (a ``from_pretrained`` directory, sharded
      or not, or one ``.safetensors`` file) or ``"init"`` (the model's own
      initialisation, bitwise what the same model built on the CPU gets from the same
      seed). Required for a meta model (unless ``resume`` gives the weights), refused for
      one whose parameters hold values.
      ``device``: where the model computes (default: where its parameters are, the CPU
      or a CUDA device; a meta model's default is the CPU).
      ``resume``: a directory written by ``engine.save_checkpoint``: weights, optimizer
      state, step counts and learning rate continue from it.

    The step:
      ``param_groups``: torch-style parameter groups, as ``torch.optim.AdamW`` takes them
      (a list of dicts with ``params`` and any of the optimizer's hyperparameters: AdamW's
      ``lr``, ``betas``, ``eps``, ``weight_decay``; SGD's ``lr``, ``momentum``,
      ``dampening``, ``weight_decay``, ``nesterov``; the optimizer's values fill the
      rest). Every trainable parameter must be in exactly one; ``engine.optimizer.
      param_groups`` is one entry per group. Default: one group of every trainable one.
      ``no_decay``: instead of ``param_groups``, the usual recipe: a group that decays
      and one with ``weight_decay=0`` for the parameters whose names contain one of the
      given strings (``["bias", "LayerNorm.weight"]``), for which a function
      ``f(name, parameter)`` is true, or with ``"auto"`` biases and normalisation weights
      as Hugging Face's Trainer picks them (model/param_groups.py).
      ``max_grad_norm``: clip the global gradient norm to it, exactly as
      ``torch.nn.utils.clip_grad_norm_`` (the steps then wait for every gradient); every
      gradient is then checked before any group steps, and a non-finite norm steps
      nothing and raises ``NonFinite`` (``float("inf")``: that check without clipping).
      Without it each group steps as soon as backward has finished it, and the daemon
      refuses (keeping its state) the step of a group whose gradients are not finite.
      ``accumulation_steps``: backward passes per step (as with torch: call
      ``engine.step()`` after the n-th).
      ``grad_accumulation``: where gradients kept until the step live on a device with its
      own memory: "device" (in ``.grad``, as torch) or "host" (each backward's gradients
      leave the device at once and are summed in fp32 in shared host memory). On the CPU
      (a device that shares host memory) both are the same: ``for_device`` makes it
      "device".

    Memory: the shared buffers all these take are planned from the daemon's session
    budget before anything is allocated (memory/budget.py, ``engine.memory_plan()``).
      ``offload``: True (the default): the blocks' weights are on the SSD array and in
      memory only while they compute, fetched ``prefetch`` blocks ahead. "host": the
      blocks' weights stay in shared host memory (each step writes them there) and are
      uploaded to the device ahead of each use; on the CPU that is simply resident, so
      ``for_device`` makes it False there. False: every group resident.
      ``prefetch``: with ``offload``, how many blocks ahead the weights are fetched
      (default: chosen by the memory plan: two for small blocks, one for blocks of 512 MiB
      or more, fewer when the budget is tight).
      ``keep``: with ``offload``, how many of the last blocks stay in memory from forward
      to backward instead of being fetched twice.
      ``activations``: what happens to the blocks' activations saved for backward: "keep",
      "swap" (to a host arena of ``host_budget`` bytes of shared memory, then to the SSD
      array), "recompute" (only block inputs kept, the block run again in backward), or a
      dict of those by group name; or "auto": the planner chooses per block after
      profiling the first iteration, fastest within ``device_budget``.
      ``swap_blocks``: how many blocks ``train_step`` runs with a graph, swapping what
      autograd saves to host memory (then the SSD array) instead of recomputing them in
      backward (default 0: every block recomputed; blockmajor/swapped.py says which). It
      saves a third of those blocks' FLOPs for what autograd saves (an HF GPT-2 block's:
      29 bytes per token, unit of width and byte of the compute dtype) down and up
      again; ``fuyouctl plan`` weighs the two.
      ``host_budget``: bytes of shared host memory for the arena that swapped activations
      and ``train_step``'s kept block inputs go to before the SSD array (default: 256 MiB,
      less when the budget is tight); with ``swap_blocks``, train_step's kept inputs take
      what they need of it, at most half, and its swapped activations the rest.
      ``device_budget``: with ``activations="auto"``, the bytes of activations the planner
      may keep on the compute device (None: no limit).
      ``device_memory``: on a device with its own memory (a GPU), the bytes the device
      plan may take (memory/device_plan.py: weight slots, gradient buffers, resident
      groups, activations per token); default: the device's free memory at attach (with
      what this process's allocator holds: the model's own parameters, which attach
      replaces) less the device's reserve. A plan larger is refused before any work.
      ``granularity``: with ``offload``, what comes to the device at a time: "block" (a
      whole block's weights; its gradients leave together), "module" (a block's large
      modules one at a time, each fetched ahead of its use and dropped after it, each
      one's gradients leaving once final; the rest's embeddings and head too:
      model/cuts.py), "expert" (modules, and a mixture of experts' fused experts cut into
      parts of consecutive experts, each fetched around its use: model/experts.py) or
      "auto" (the default: whole blocks where the pinned and device plans hold them, else
      modules, else expert parts). With several processes (data parallelism, an
      optimizer host), whole blocks only.

    Several processes: data parallelism (docs/guide/distributed.md). When
    torch.distributed is initialised with more than one rank (or ``process_group`` is
    given), attach joins that group: each rank's daemon keeps its shard of every layer
    group's optimizer state, gradients are reduce-scattered and weights all-gathered.
      ``process_group``: the group to train over (default: torch.distributed's default).
      ``reduce``: when gradients are reduce-scattered: "step" (after the last backward of
      an accumulation: the micro-batches add up locally, as in DDP's ``no_sync``) or
      "backward" (after every backward; each rank's shard adds up in fp32 in host memory).
      ``check_collectives``: before each collective the ranks compare what they are about
      to run, and a rank that diverges (a group it did not use, another model) is an error
      naming both instead of a hang (costs a small collective each).
      ``reshard``: with ``resume``, allow a checkpoint written at another world size (its
      shards are cut again; the checkpoint must be readable from every rank's daemon).
      ``optimizer_ranks``: the ranks of the group that are optimizer hosts (they call
      ``fuyou_client.serve_optimizer``): this rank is then a worker that holds no optimizer
      state and no master weights (with ``offload=True`` no weights between uses either);
      the workers' summed gradients go to the optimizer rank that owns each layer group,
      which steps it out of core and sends the new weights back
      (docs/guide/optimizer-host.md). Default None: the sharded mode above.
    """
    session: Any = None
    socket: str | None = None
    namespace: str | None = None
    blocks: list[nn.Module] | None = None
    weights: str | os.PathLike | None = None
    device: Any = None
    resume: str | os.PathLike | None = None
    param_groups: Any = None
    no_decay: Any = None
    max_grad_norm: float | None = None
    accumulation_steps: int = 1
    grad_accumulation: str = "device"
    offload: bool | str = True
    prefetch: int | None = None
    keep: int = 0
    activations: str | dict[str, str] = "keep"
    swap_blocks: int = 0
    host_budget: int | None = None
    device_budget: int | None = None
    device_memory: int | None = None
    granularity: str = "auto"
    process_group: Any = None
    reduce: str = "step"
    check_collectives: bool = False
    reshard: bool = False
    optimizer_ranks: Any = None

    def __post_init__(self) -> None:
        _count("accumulation_steps", self.accumulation_steps, 1)
        if self.prefetch is not None:
            _count("prefetch", self.prefetch, 0)
        _count("keep", self.keep, 0)
        _count("swap_blocks", self.swap_blocks, 0)
        if self.host_budget is not None:
            _count("host_budget", self.host_budget, 1)
        if self.device_budget is not None:
            _count("device_budget", self.device_budget, 1)
        if self.device_memory is not None:
            _count("device_memory", self.device_memory, 1)
        mgn = self.max_grad_norm
        if mgn is not None and (isinstance(mgn, bool) or not isinstance(mgn, numbers.Real) or not mgn > 0):
            raise ValueError(f"max_grad_norm must be a number > 0 (float('inf') to check the gradients for NaN and "
                             f"inf without clipping) or None, not {mgn!r}")
        if not (self.offload is True or self.offload is False or self.offload == "host"):
            raise ValueError(f"offload must be True, False or 'host', not {self.offload!r}")
        for name in ("check_collectives", "reshard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, not {getattr(self, name)!r}")
        if self.optimizer_ranks is not None:
            check_optimizer_ranks(self.optimizer_ranks)
        if self.reduce not in ("step", "backward"):
            raise ValueError(f"reduce must be 'step' or 'backward', not {self.reduce!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, not {self.granularity!r}")
        if self.grad_accumulation not in ("device", "host"):
            raise ValueError(f"grad_accumulation must be 'device' or 'host', not {self.grad_accumulation!r}")
        acts = self.activations
        if isinstance(acts, str):
            if acts not in WORDS:
                raise ValueError(f"activations={acts!r}: expected one of {WORDS} or a dict by group name")
        elif isinstance(acts, dict):
            bad = {k: v for k, v in acts.items() if v not in TREATMENTS}
            if bad:
                raise ValueError(f"activations treatments must be one of {TREATMENTS}, got {bad}")
        else:
            raise ValueError(f"activations must be one of {WORDS} or a dict by group name, not {acts!r}")
        for name in ("socket", "namespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{name} must be a string, not {value!r}")

    def for_device(self, shares_host_memory: bool) -> "AttachOptions":
        """The options as they apply on a device: where it shares host memory (the CPU)
        ``offload="host"`` is resident weights and host gradient accumulation is the
        ordinary kind."""
        if not shares_host_memory:
            return self
        return dataclasses.replace(self, offload=False if self.offload == "host" else self.offload,
                                   grad_accumulation="device")

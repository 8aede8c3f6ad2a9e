"""Reading an attached model's weights: every way a user or a library does it gives the
trained values, or is refused with the way that works. Between its uses an offloaded
block's parameters are empty placeholders; its values are on the SSD array
(checkpoints/values.py).

* ``state_dict()`` of the model or of any module holding offloaded blocks, and so
  ``save_pretrained``, PEFT's ``get_peft_model_state_dict`` and ``save_pretrained``,
  Accelerate's ``get_state_dict`` and the Trainer's checkpoints: a post-hook on each
  offloaded block puts its parameters' trained values (new CPU tensors, read one block at
  a time) in place of the placeholders. ``state_dict(keep_vars=True)`` asks for the
  parameters themselves and gets them, as torch gives them.
* ``engine.gathered(*modules)``: for the ``with`` block, the offloaded parameters of
  ``modules`` (default: the whole model) hold their trained values, for code that reads
  ``named_parameters()``; they go back to placeholders after it. Read only: what is
  written to them there does not reach the master weights.

Both put those values in host memory at once: more than ``limit`` bytes (None: what the
host has available at the time) is refused before anything is read, naming
``engine.export`` (streamed to files one group at a time). Both read the master weights
between steps only (not while an iteration's steps are under way), and with data
parallelism not at all (its masters are gathered collectively: ``engine.export``).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from fuyou_client.checkpoints.values import group_bytes, group_params, host_memory_available, read_group

EXPORT_HINT = ("engine.export(DIR) streams them to safetensors one layer group at a time (from_pretrained loads "
               "the directory; FuyouTrainer.save_model does the same, and for a PEFT model writes its adapter)")


def _shown(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


class TrainedValues:
    """The state_dict hooks on an engine's offloaded blocks and ``gathered``. ``require_idle(what)``
    raises while an iteration is under way; ``world``: data parallelism's, or None."""

    def __init__(self, model: nn.Module, session, groups, require_idle, world=None):
        self.session, self._require_idle, self._world = session, require_idle, world
        self.limit: int | None = None
        self._groups = [g for g in groups if g.offloaded is not None]
        # Each offloaded group's hook goes on the modules holding its parameters: its block, or the
        # modules a sub-block is used by (model/cuts.py); a group with neither, on the model itself.
        self._by_module: dict[int, list] = {}
        hooked = []
        for g in self._groups:
            for module in g.spec.uses or (model,):
                if id(module) not in self._by_module:
                    hooked.append(module)
                self._by_module.setdefault(id(module), []).append(g)
        # (functions, not bound methods: torch marks the hooks it is given)
        self._handles = [model.register_state_dict_pre_hook(lambda *a: self._before_model(*a))] \
            if self._groups else []
        for module in hooked:
            self._handles.append(module.register_state_dict_pre_hook(lambda *a: self._before_module(*a)))
            self._handles.append(module.register_state_dict_post_hook(lambda *a: self._after(*a)))

    # -- state_dict() -------------------------------------------------------------------------
    def _before_model(self, module, prefix, keep_vars) -> None:
        """The whole model's: all its offloaded blocks will be read (checked once, before any)."""
        if not keep_vars:  # (keep_vars: the parameters themselves, as torch gives them)
            self._check("state_dict() of the attached model", self._groups)

    def _before_module(self, module, prefix, keep_vars) -> None:
        """(also when a block's own state_dict() is asked for)"""
        if not keep_vars:
            self._check("state_dict() of the attached model", self._by_module[id(module)])

    def _after(self, module, state_dict, prefix, local_metadata) -> None:
        keys: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            keys.setdefault(id(p), []).append(prefix + name)
        for g in self._by_module[id(module)]:
            params = group_params(g)
            if not any(k in state_dict and state_dict[k] is not p for p in params for k in keys.get(id(p), [])):
                continue  # keep_vars=True: the parameters themselves (or none of the group's here)
            for p, value in zip(params, read_group(self.session, g)):
                for key in keys.get(id(p), []):
                    if key in state_dict:
                        state_dict[key] = value

    # -- gathered() ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, modules: tuple):
        wanted = None
        if modules:
            wanted = set()
            for m in modules:
                wanted.update(id(p) for p in (m.parameters() if isinstance(m, nn.Module) else [m]))
        groups = [g for g in self._groups if wanted is None or any(id(p) in wanted for p in group_params(g))]
        self._check("engine.gathered()", groups)
        saved = []
        try:
            with torch.no_grad():
                for g in groups:
                    for p, value in zip(group_params(g), read_group(self.session, g)):
                        saved.append((p, p.data))
                        p.data = value
            yield
        finally:
            with torch.no_grad():
                for p, data in reversed(saved):
                    p.data = data

    # -- both ---------------------------------------------------------------------------------
    def _check(self, what: str, groups) -> None:
        if self._world is not None:
            raise RuntimeError(f"{what} with data parallelism: the master weights are sharded over the ranks; "
                               f"{EXPORT_HINT}, called on every rank")
        self._require_idle(what)
        need = sum(group_bytes(g) for g in groups)
        limit = self.limit if self.limit is not None else host_memory_available()
        if need > limit:
            where = "engine.values_limit" if self.limit is not None else "the host's available memory"
            raise MemoryError(f"{what} would put {_shown(need)} of offloaded weights in host memory, more than "
                              f"{_shown(limit)} ({where}): {EXPORT_HINT}")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

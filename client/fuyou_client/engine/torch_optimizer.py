"""``engine.optimizer``: the engine's face for code written for a torch optimizer.

A ``torch.optim.Optimizer`` whose ``param_groups`` are the torch parameter groups of
``attach`` (model/param_groups.py), one dict each with its parameters and hyperparameters, so
LR schedulers (a list of lambdas too), Hugging Face's Trainer and Accelerate drive it as
they drive ``torch.optim.AdamW``: each group step reads its torch group's values at that
moment. ``step()`` is the engine's barrier, ``zero_grad()`` the engine's.

``state_dict()`` holds what torch's does except the moments, which stay in fuyoud (its
checkpoint saves them): the groups' hyperparameters and, per parameter, ``{"step": n}``.
``load_state_dict()`` takes such a dict back (hyperparameters, e.g. after a scheduler's
resume); one holding moments (``exp_avg``...: a torch optimizer's) or other step counts
than the daemon's is refused, saying how to resume instead. Closures are refused too.
"""
from __future__ import annotations

import torch

from fuyou_client.model.param_groups import TorchGroups


class TorchOptimizer(torch.optim.Optimizer):
    def __init__(self, engine, groups: TorchGroups):
        self._engine = engine
        self._groups = groups
        defaults = {k: v for k, v in groups.groups[0].items() if k != "params"} if groups.groups else {}
        super().__init__([dict(g) for g in groups.groups], defaults)

    @property
    def engine(self):
        """The Engine this optimizer steps (``engine.close()``, ``export``...)."""
        return self._engine

    def stepped(self) -> None:
        """A step happened (what torch's LR schedulers check for, in torch's own attribute)."""
        self._opt_called = True

    def step(self, closure=None):  # noqa: D401 - torch's signature
        if closure is not None:
            raise ValueError("closures are not supported by fuyou: compute the loss and call backward() before "
                             "engine.step()")
        self._engine.step()

    def zero_grad(self, set_to_none: bool = True):
        self._engine.zero_grad()

    def steps(self) -> list[int]:
        """Each torch group's step count, as the daemon has it (-1: a group with no
        parameters in any layer group)."""
        counts = self._engine.part_steps()
        return [counts.get(i, -1) for i in range(len(self.param_groups))]

    def state_dict(self) -> dict:
        sd = super().state_dict()
        steps = self.steps()
        for i, group in enumerate(sd["param_groups"]):
            for index in group["params"]:
                sd["state"][index] = {"step": torch.tensor(float(max(steps[i], 0)))}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state = state_dict.get("state", {})
        moments = sorted({k for s in state.values() for k in s if k != "step"})
        if moments:
            raise ValueError(f"this optimizer state holds {', '.join(moments)}: a torch optimizer's moments, which "
                             "fuyou does not take (its state is in fuyoud). Resume with attach(model, resume=DIR) "
                             "from engine.save_checkpoint(DIR)")
        steps = self.steps()
        saved = {}
        for i, group in enumerate(state_dict.get("param_groups", [])):
            for index in group.get("params", []):
                if index in state and "step" in state[index]:
                    saved[i] = int(float(state[index]["step"]))
        wrong = [(i, n, steps[i]) for i, n in saved.items() if i < len(steps) and steps[i] >= 0 and n != steps[i]]
        if wrong:
            i, n, now = wrong[0]
            raise ValueError(f"this optimizer state is at step {n} in param group {i}, fuyoud's state at step {now}: "
                             "load the state_dict saved with the daemon's checkpoint (attach(model, resume=DIR))")
        super().load_state_dict({"state": {}, "param_groups": state_dict.get("param_groups", [])})
        for i, group in enumerate(self.param_groups):
            self._groups.spec(i, group)  # (hyperparameters out of range: refused now, named)

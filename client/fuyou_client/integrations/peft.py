"""PEFT adapters trained through Fuyou, saved as PEFT saves them.

    from fuyou_client.integrations.peft import save_adapter, export_merged
    save_adapter(engine, "adapter")   # adapter_config.json + adapter_model.safetensors
    export_merged(engine, "merged")   # the full model with the adapters merged in

``save_adapter`` is ``PeftModel.save_pretrained`` given the trained values of the
trainable parameters only (the adapters: an offloaded block's from their fp32 masters on
the SSD array, checkpoints/values.py), so the frozen base model is never read:
``PeftModel.from_pretrained(base, directory)`` loads adapters equal to the trained ones.
(``model.save_pretrained`` of an attached PeftModel works too, through ``state_dict()``,
which reads every block, base weights included.)

``export_merged``: the model as PEFT's ``merge_and_unload()`` makes it (each adapted
layer's weight plus PEFT's own ``get_delta_weight``; the adapters' and wrappers' names
gone), streamed from the SSD array one layer group at a time as ``engine.export`` writes
a model: sharded safetensors that ``AutoModelForCausalLM.from_pretrained`` loads. Adapters
that are not added to a weight (LoRA, LoHa, LoKr... have ``get_delta_weight``; IA3 and
prompt learning do not) are refused, naming them.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from fuyou_client.checkpoints import Trained
from fuyou_client.checkpoints.exporter import export
from fuyou_client.checkpoints.values import group_params, read_group


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def trainable_values(engine) -> dict[str, torch.Tensor]:
    """The trainable parameters' values by ``state_dict()`` key, and every resident
    parameter's (references, no copies): an offloaded block's trained ones read from their
    masters, its frozen ones left out (what PEFT's ``get_peft_model_state_dict`` picks from)."""
    engine.require_idle("saving the adapters")
    model = engine.model
    values: dict[int, torch.Tensor] = {}
    for g in engine.groups:
        if g.offloaded is not None and g.spec.numel:
            values.update((id(p), t) for p, t in zip(group_params(g), read_group(engine.session, g, frozen=False)))
    offloaded = {id(p) for g in engine.groups if g.offloaded is not None for p in group_params(g)}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in values:
            out[name] = values[id(p)]
        elif id(p) not in offloaded:
            out[name] = p.detach()
    return out


def save_adapter(engine, directory: str | os.PathLike, **kwargs) -> None:
    """``PeftModel.save_pretrained(directory)`` with the trained adapters (``kwargs`` go to
    it: ``selected_adapters``, ``safe_serialization``...)."""
    model = engine.model
    if not is_peft_model(model):
        raise TypeError(f"save_adapter saves a PEFT model's adapters; the attached model is a {type(model).__name__}: "
                        "use engine.export(DIR)")
    model.save_pretrained(directory, state_dict=trainable_values(engine), **kwargs)


# -- the merged model ---------------------------------------------------------------------------
class _Merge:
    """Renames a PeftModel's keys to the base model's and adds each adapted layer's delta
    to its weight (a layer group's tensors at a time)."""

    def __init__(self, model):
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils import ModulesToSaveWrapper

        if len(model.active_adapters) != 1:
            raise ValueError(f"export_merged merges one adapter; {model.active_adapters} are active")
        self.adapter = model.active_adapters[0]
        self.model = model
        self.layers: dict[str, nn.Module] = {}
        self.wrappers: list[str] = []
        for name, m in model.named_modules():
            if isinstance(m, BaseTunerLayer):
                if not hasattr(m, "get_delta_weight") or not hasattr(m, "base_layer"):
                    raise ValueError(f"export_merged adds each adapter's delta to its weight; {name} is a "
                                     f"{type(m).__name__}, which has none: save it with save_adapter instead")
                self.layers[name] = m
            elif isinstance(m, ModulesToSaveWrapper):
                self.wrappers.append(name)

    def _rename(self, key: str) -> str | None:
        """The merged model's name of ``key``, or None: it goes (an adapter's own tensors)."""
        for name in self.wrappers:
            if key.startswith(name + "."):
                rest = key[len(name) + 1:]
                ours = f"modules_to_save.{self.adapter}."
                if rest.startswith(ours):
                    key = f"{name}.{rest[len(ours):]}"
                    break
                return None  # (the original module, or another adapter's copy)
        for name in self.layers:
            if key.startswith(name + "."):
                rest = key[len(name) + 1:]
                if not rest.startswith("base_layer."):
                    return None  # (lora_A, lora_B, their dropout...)
                key = f"{name}.{rest[len('base_layer.'):]}"
                break
        prefix = "base_model.model."
        return key[len(prefix):] if key.startswith(prefix) else key

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, layer in self.layers.items():
                weight_key = f"{name}.base_layer.weight"
                if weight_key not in tensors:
                    continue
                own = [(k, p) for k, p in params.items() if k.startswith(name + ".") and not
                       k.startswith(name + ".base_layer.")]
                saved = [(p, p.data) for _, p in own]
                try:
                    for k, p in own:  # (the adapter's values, for PEFT's own arithmetic)
                        p.data = tensors[k]
                    delta = layer.get_delta_weight(self.adapter)
                finally:
                    for p, data in saved:
                        p.data = data
                tensors[weight_key] = tensors[weight_key] + delta.to(tensors[weight_key].dtype)
        out = {}
        for key, t in tensors.items():
            new = self._rename(key)
            if new is not None:
                out[new] = t
        return out


def export_merged(engine, directory: str | os.PathLike, dtype: torch.dtype | None = None):
    """The attached PeftModel with its active adapter merged into the base weights, written
    as ``engine.export`` writes a model (see the module's docstring)."""
    model = engine.model
    if not is_peft_model(model):
        raise TypeError(f"export_merged merges a PEFT model's adapters; the attached model is a "
                        f"{type(model).__name__}: use engine.export(DIR)")
    if engine.world is not None:
        raise RuntimeError("export_merged with data parallelism is not supported: engine.export(DIR) on every rank, "
                           "then merge")
    engine.require_idle("export_merged")
    merge = _Merge(model)
    return export(Trained(model, engine.session, engine.groups), directory, dtype, transform=merge)

"""PEFT adapters trained through Fuyou, saved as PEFT saves them.

    from fuyou_client.integrations.peft import save_adapter, export_merged
    save_adapter(engine, "adapter")   # adapter_config.json + adapter_model.safetensors
    export_merged(engine, "merged")   # the full model with the adapters merged in

``save_adapter`` is ``PeftModel.save_pretrained`` given the values of the entries PEFT
saves and nothing else (PEFT's own ``get_peft_model_state_dict`` picks them: every selected
adapter's tensors, a DoRA magnitude, ``modules_to_save`` copies, embeddings it saves): an
offloaded layer group's trained ones from their fp32 masters on the SSD array
(checkpoints/values.py), a frozen one (an adapter that is not active, so not trained) from
the object its group's frozen parameters were stored in; a base weight is read only where
PEFT saves it. ``PeftModel.from_pretrained(base, directory)`` loads adapters equal to the
trained ones. (``model.save_pretrained`` of an attached PeftModel works too, through
``state_dict()``, which reads every layer group, base weights included.)

``export_merged``: the model as PEFT's ``merge_and_unload()`` makes it, by PEFT's own
arithmetic: each adapted layer's ``merge()`` (the active adapters; DoRA's magnitude, a LoRA
bias, rsLoRA's scaling as PEFT applies them) run on the layer with its trained values put in
its parameters for that moment, the layer then replaced by its base layer, a
``modules_to_save`` wrapper by its active copy, the adapters' own tensors dropped. It is
streamed from the SSD array one layer group at a time as ``engine.export`` writes a model
(sharded safetensors that ``AutoModelForCausalLM.from_pretrained`` loads); an adapted layer
whose base weight and adapters are in different groups (``granularity="module"``: the base
weight is a sub-block of its own) is merged when its last part has been read, its first
parts (the adapters: small) held until then. With ``dtype`` the values are cast as they are
read, so the merge is PEFT's of the model cast to ``dtype``.

What it merges: LoRA layers (``Linear``, ``Embedding``, ``Conv1d/2d/3d``; plain or DoRA;
``lora_bias``, ``use_rslora``), LoHa and LoKr layers, ``modules_to_save``, any number of
active adapters. Everything else (other tuners, LoRA variants such as aLoRA, layers PEFT
wraps specially such as ``trainable_token_indices`` or ``target_parameters``, prompt
learning) is refused before anything is written, naming the layer and what to do instead:
``_Merge`` checks the whole model first.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from fuyou_client.checkpoints import Trained
from fuyou_client.checkpoints.exporter import export
from fuyou_client.checkpoints.values import group_params, read_group

# What to do with what export_merged refuses (the same words in each refusal).
MERGE_WITH_PEFT = ("save the adapter with save_adapter(engine, DIR) (FuyouTrainer.save_model) and merge it with PEFT: "
                   "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR).merge_and_unload()"
                   ".save_pretrained(OUT)")


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def trainable_values(engine) -> dict[str, torch.Tensor]:
    """The trainable parameters' values by ``state_dict()`` key, and every resident
    parameter's (references, no copies): an offloaded block's trained ones read from their
    masters, its frozen ones left out (so an adapter that is not active, being frozen, is
    missing there: save_adapter reads what PEFT saves instead, ``adapter_values``)."""
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


# -- the adapter ----------------------------------------------------------------------------------
def _saved_keys(model, kwargs: dict) -> set[str] | None:
    """The ``state_dict()`` keys ``model.save_pretrained(**kwargs)`` reads: PEFT's own
    ``get_peft_model_state_dict`` for each selected adapter, given a state dict of empty
    stand-ins (``keep_vars``: the names only, no value read) and followed back by identity.
    None where PEFT computes a saved tensor from the state dict's (then only the real state
    dict will do)."""
    from peft.utils import get_peft_model_state_dict

    standins = {key: torch.empty(0, device="meta") for key in model.state_dict(keep_vars=True)}
    back = {id(t): key for key, t in standins.items()}
    selected = kwargs.get("selected_adapters") or list(model.peft_config)
    keys: set[str] = set()
    for adapter in selected:
        if adapter not in model.peft_config:
            return None  # (save_pretrained refuses it, naming the adapters there are)
        got = get_peft_model_state_dict(model, state_dict=standins, adapter_name=adapter,
                                        save_embedding_layers=kwargs.get("save_embedding_layers", "auto"))
        for t in got.values():
            if id(t) in back:
                keys.add(back[id(t)])
            elif isinstance(t, torch.Tensor) and t.device.type == "meta":
                return None  # (computed from the stand-ins: VB-LoRA's top-k)
            # (else taken from the model itself, not the state dict: a prompt encoder's embeddings)
    return keys


def adapter_values(engine, keys: set[str]) -> dict[str, torch.Tensor]:
    """The values of the ``state_dict()`` entries ``keys`` (new tensors for an offloaded
    group's, read one group at a time: its trained ones from their masters, and its frozen
    ones, where one of them is asked for, from the object they were stored in; references
    for the resident ones)."""
    engine.require_idle("saving the adapters")
    model = engine.model
    entries = model.state_dict(keep_vars=True)
    wanted = {id(entries[k]) for k in keys}
    values: dict[int, torch.Tensor] = {}
    offloaded = set()
    for g in engine.groups:
        if g.offloaded is None:
            continue
        params = group_params(g)
        offloaded.update(id(p) for p in params)
        if not any(id(p) in wanted for p in params):
            continue
        frozen = any(id(p) in wanted for p in params[len(g.spec.params):])
        if not frozen and not g.spec.numel:
            continue
        for p, t in zip(params, read_group(engine.session, g, frozen=frozen)):
            if id(p) in wanted:
                values[id(p)] = t
    out = {}
    for key in keys:
        t = entries[key]
        if id(t) in values:
            out[key] = values[id(t)]
        elif id(t) in offloaded:
            raise RuntimeError(f"save_adapter: no value read for {key}")  # (a group that read none of it: a bug)
        else:
            out[key] = t.detach()
    return out


def save_adapter(engine, directory: str | os.PathLike, **kwargs) -> None:
    """``PeftModel.save_pretrained(directory)`` with the trained adapters (``kwargs`` go to
    it: ``selected_adapters``, ``safe_serialization``...)."""
    model = engine.model
    if not is_peft_model(model):
        raise TypeError(f"save_adapter saves a PEFT model's adapters; the attached model is a {type(model).__name__}: "
                        "use engine.export(DIR)")
    engine.require_idle("saving the adapters")
    if "state_dict" in kwargs:
        model.save_pretrained(directory, **kwargs)
        return
    keys = _saved_keys(model, kwargs)
    if keys is None:  # (model.state_dict(): every value, within engine.values_limit)
        model.save_pretrained(directory, **kwargs)
        return
    model.save_pretrained(directory, state_dict=adapter_values(engine, keys), **kwargs)


# -- the merged model ---------------------------------------------------------------------------
def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"export_merged cannot merge {name}: {what}. Nothing was written; {MERGE_WITH_PEFT}")


def _mergeable(name: str, layer) -> None:
    """Refuse a tuner layer export_merged does not merge exactly (see the module's docstring)."""
    from peft.tuners.lora import layer as lora
    from peft.tuners.lora import variants

    kinds = [lora.Linear, lora.Embedding, lora.Conv1d, lora.Conv2d, lora.Conv3d]
    try:
        from peft.tuners.loha import layer as loha
        from peft.tuners.lokr import layer as lokr
        kinds += [loha.Linear, loha.Conv1d, loha.Conv2d, lokr.Linear, lokr.Conv1d, lokr.Conv2d]
    except (ImportError, AttributeError):  # (an older PEFT: LoRA only)
        pass
    kind = type(layer)
    if kind not in kinds:
        raise _refuse(name, f"it is a {kind.__module__}.{kind.__qualname__}; export_merged merges LoRA layers "
                            "(Linear, Embedding, Conv; plain or DoRA, lora_bias, use_rslora), LoHa and LoKr layers and "
                            "modules_to_save")
    if layer.merged:
        raise _refuse(name, f"its adapters {layer.merged_adapters} are merged into the attached model already "
                            "(merge_adapter()): call model.unmerge_adapter() first")
    dora = tuple(c for c in (getattr(variants, n, None) for n in ("DoraLinearVariant", "DoraEmbeddingVariant",
                                                                  "_DoraConvNdVariant")) if c is not None)
    for adapter in layer.active_adapters:
        variant = getattr(layer, "lora_variant", {}).get(adapter)
        if variant is None or isinstance(variant, dora):
            continue
        option = next((keys for keys, cls in getattr(layer, "lora_variants", {}).items() if cls is type(variant)), ())
        shown = " / ".join(f"LoraConfig({k}=...)" for k in option) or type(variant).__name__
        raise _refuse(name, f"its adapter {adapter!r} is the LoRA variant {type(variant).__name__} ({shown}); "
                            "export_merged merges plain LoRA and DoRA")


class _Layer:
    """An adapted layer: the parameters its ``merge()`` reads (by export key), and the
    merged model's names of its base layer's parameters."""

    def __init__(self, name: str, layer, keys: dict[str, nn.Parameter], out: dict[int, str]):
        self.name, self.layer, self.keys = name, layer, keys
        self.base = [p for p in layer.get_base_layer().parameters()]
        self.out = out

    def merge(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """PEFT's ``merge()`` of the layer with ``values`` in its parameters (the base
        layer's merged in place or replaced: ``values`` are this export's own tensors), then
        the layer as it was (its parameters, merged adapters and caches)."""
        layer = self.layer
        saved = [(p, p.data) for p in self.keys.values()]
        merged = list(layer.merged_adapters)
        caches = dict(getattr(layer, "_caches", {}))
        try:
            with torch.no_grad():
                for key, p in self.keys.items():
                    p.data = values[key]
                layer.merge()  # (safe_merge=False, the active adapters: as merge_and_unload() calls it)
                return {self.out[id(p)]: p.data for p in self.base if id(p) in self.out}
        finally:
            for p, data in saved:
                p.data = data
            layer.merged_adapters[:] = merged
            if hasattr(layer, "_caches"):
                layer._caches.clear()
                layer._caches.update(caches)


class _Merge:
    """A PeftModel's export transform: each layer group's tensors (by the PeftModel's names)
    as the merged model's. Built (and everything it cannot merge refused) before the export."""

    def __init__(self, model, groups: int):
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

        self._tuner, self._wrapper, self._aux = BaseTunerLayer, ModulesToSaveWrapper, AuxiliaryTrainingWrapper
        for adapter in model.active_adapters:
            config = model.peft_config[adapter]
            if config.is_prompt_learning:
                raise _refuse(f"adapter {adapter!r}", f"it is {config.peft_type.value} (prompt learning), which has no "
                                                      "weight to merge into")
        tuner = model.base_model
        if not hasattr(tuner, "merge_and_unload") or not isinstance(getattr(tuner, "model", None), nn.Module):
            raise _refuse(f"adapter {model.active_adapters}", f"PEFT has no merge for {type(tuner).__name__}")
        if hasattr(tuner, "_check_merge_allowed"):
            try:
                tuner._check_merge_allowed()  # (PEFT's refusals: gptq, layer_replication)
            except ValueError as exc:
                raise _refuse("this model", f"PEFT refuses to merge it ({exc})") from exc
        self.groups, self.calls = groups, 0
        self.prefix = "base_model.model."
        self.param_out: dict[int, str] = {}  # id(parameter) -> its name in the merged model (the first)
        self.buffer_out: dict[int, str] = {}
        self.layers: list[tuple[str, object]] = []  # (PEFT's name, the tuner layer merged)
        self._walk(tuner.model, "")
        names: dict[int, str] = {}
        for name, p in model.named_parameters():
            names.setdefault(id(p), name)
        params = dict(model.named_parameters(remove_duplicate=False))
        self.owner: dict[str, _Layer] = {}  # export key -> the adapted layer that takes it
        for name, layer in self.layers:
            keys = {names[id(p)]: p for p in layer.parameters()}
            entry = _Layer(name, layer, keys, self.param_out)
            for key in keys:
                if key in self.owner:
                    raise _refuse(name, f"its parameter {key} is also {self.owner[key].name}'s (adapted layers that "
                                        "share a weight)")
                self.owner[key] = entry
        self.out: dict[str, str] = {}  # export key -> merged name, for the tensors no layer takes
        for key, p in params.items():
            if key == names[id(p)] and key not in self.owner and id(p) in self.param_out:
                self.out[key] = self.param_out[id(p)]
        for key, b in model.named_buffers():
            if id(b) in self.buffer_out:
                self.out[key] = self.buffer_out[id(b)]
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.untie = self._unties(tuner.model)

    def _walk(self, m: nn.Module, path: str) -> None:
        """The merged model's names, as ``merge_and_unload`` replaces the modules: an adapted
        layer by its base layer, a ``modules_to_save`` wrapper by its active copy."""
        full = self.prefix + path
        if isinstance(m, self._tuner):
            _mergeable(full, m)
            self.layers.append((full, m))
            return self._walk(m.get_base_layer(), path)
        if isinstance(m, self._wrapper):
            return self._walk(m.modules_to_save[m.active_adapters[0]] if m.active_adapters else m.original_module, path)
        if isinstance(m, self._aux) or hasattr(m, "unload_and_optionally_merge_module"):
            raise _refuse(full, f"it is a {type(m).__name__} (trainable_token_indices, or a layer PEFT unloads its own "
                                "way); export_merged merges LoRA, LoHa and LoKr layers and modules_to_save")
        dot = path + "." if path else ""
        for name, p in m._parameters.items():
            if p is not None:
                self.param_out.setdefault(id(p), dot + name)
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                self.buffer_out.setdefault(id(b), dot + name)
        for name, child in m._modules.items():
            if child is not None:
                self._walk(child, dot + name)

    def _unties(self, inner: nn.Module) -> bool:
        """Whether merge_and_unload unties the embeddings (a tied model whose head is a
        ``modules_to_save`` copy of its own, say): it then sets ``tie_word_embeddings=False``."""
        config = getattr(inner, "config", None)
        if not getattr(config, "tie_word_embeddings", False):
            return False
        try:
            pair = [inner.get_input_embeddings(), inner.get_output_embeddings()]
        except (NotImplementedError, AttributeError):
            return False
        weights = []
        for m in pair:
            while True:
                if isinstance(m, self._tuner):
                    m = m.get_base_layer()
                elif isinstance(m, self._wrapper):
                    m = m.modules_to_save[m.active_adapters[0]] if m.active_adapters else m.original_module
                else:
                    break
            weights.append(getattr(m, "weight", None))
        return all(w is not None for w in weights) and weights[0] is not weights[1]

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.calls += 1
        out, complete = {}, []
        for key, t in tensors.items():
            layer = self.owner.get(key)
            if layer is not None:
                got = self.pending.setdefault(id(layer), {})
                got[key] = t
                if len(got) == len(layer.keys):
                    complete.append(layer)
            elif key in self.out:
                out[self.out[key]] = t
        for layer in complete:
            out.update(layer.merge(self.pending.pop(id(layer))))
        if self.calls == self.groups and self.pending:  # (the last shard: every layer has been read whole)
            raise RuntimeError(f"export_merged: {len(self.pending)} adapted layers were not read whole")
        return out


def export_merged(engine, directory: str | os.PathLike, dtype: torch.dtype | None = None):
    """The attached PeftModel with its active adapters merged into the base weights as
    ``merge_and_unload()`` merges them, written as ``engine.export`` writes a model (see the
    module's docstring). What it cannot merge exactly is refused (ValueError) before
    anything is written."""
    model = engine.model
    if not is_peft_model(model):
        raise TypeError(f"export_merged merges a PEFT model's adapters; the attached model is a "
                        f"{type(model).__name__}: use engine.export(DIR)")
    if engine.world is not None:
        raise RuntimeError("export_merged with data parallelism is not supported: engine.export(DIR) on every rank, "
                           "then merge")
    engine.require_idle("export_merged")
    merge = _Merge(model, max(1, len(engine.groups)))
    config = getattr(model.base_model.model, "config", None)
    tied = getattr(config, "tie_word_embeddings", None)
    try:
        if merge.untie:  # (as merge_and_unload: the config written says the embeddings are not tied)
            config.tie_word_embeddings = False
        return export(Trained(model, engine.session, engine.groups), directory, dtype, transform=merge)
    finally:
        if merge.untie:
            config.tie_word_embeddings = tied

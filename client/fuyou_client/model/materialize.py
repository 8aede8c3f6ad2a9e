"""A model built on the meta device, given its values one layer group at a time.

``attach(model, weights=...)`` takes a model whose parameters are on the meta device
(``with torch.device("meta"): model = GPT2LMHeadModel(config)``, or accelerate's
``init_empty_weights``) and never holds it whole in memory: each layer group is made
real on the CPU just before the engine uploads its master weights to fuyoud and (with
``offload=True``) is dropped to the empty placeholders of offloaded parameters right
after; only the "rest" group (embeddings, final norm, head), frozen parameters and
buffers stay resident. The values come from

* a safetensors checkpoint (``weights=DIR``: a ``from_pretrained`` directory, sharded
  with ``model.safetensors.index.json`` or one ``model.safetensors``, or a
  ``.safetensors`` file), read tensor by tensor with ``safetensors.safe_open``: a memory
  map, opened for one group; its tensors are views of the map until the upload has
  copied them, so only that group's pages are ever resident. A parameter is looked up
  under its name, then under the other names of the same tensor (tied weights: GPT-2's
  ``lm_head.weight`` is ``transformer.wte.weight``, which ``save_pretrained`` leaves
  out), the other side of a Hugging Face tie, and the name with or without the model's
  ``base_model_prefix``; it is cast to the parameter's dtype (``Tensor.to``). A missing,
  mis-shaped or non-floating tensor is refused, named, before any work starts (from the
  shards' headers). Keys the model lacks are ignored (as ``from_pretrained`` does);
* the model's own initialisation (``weights="init"``), replayed group by group (below);
* with ``attach(resume=DIR)``, the fuyou checkpoint's masters (frozen parameters need
  ``weights=DIR`` as well: the checkpoint holds the trained ones only).

Buffers on the meta device (rotary ``inv_freq``, position ids) come from the checkpoint
when it has them (persistent buffers, as ``from_pretrained``), else from the module's
own init run on that module alone with its parameters left on the meta device (Hugging
Face: ``_init_weights``, which in transformers 5 recomputes non-persistent buffers, as
its own ``from_pretrained`` relies on; plain modules: ``reset_parameters()``). A buffer
that neither gives a value is refused, named: build the model with its buffers on the
CPU (accelerate's ``init_empty_weights(include_buffers=False)``). Buffers not on the meta
device are left as they are. Loading from a checkpoint or resuming consumes no random
numbers.

``weights="init"`` gives the values of the same model built normally on the CPU from the
same random-number state, bitwise, and leaves the CPU generator where that construction
leaves it. For a Hugging Face model this holds by replaying its construction: the class
is rebuilt on the meta device from ``model.config`` (``type(model)(config)``, the
post_init weight init on) while a dispatch mode records in order every random draw made
outside the weight init (the constructors' ``nn.init`` calls, which consume numbers that
``_init_weights`` then overwrites) and every ``_initialize_weights(module)`` call (a
sub-model's own post_init runs during construction: the passes interleave), with the
tensors each wrote. The replay draws the overwritten numbers into scratch memory (one
tensor at a time) and calls the model's real ``_initialize_weights`` on the real module;
a group is made real when the record first writes it and is final after the last
write; a module whose parameter was not yet tied when its init ran (GPT-2's ``lm_head``,
before ``tie_weights``) draws into scratch memory, as it did then. Values are computed in
the rebuilt model's dtypes and cast to the parameters' (as ``.to(dtype)`` after building
on the CPU). Plain modules cannot be rebuilt: their init is ``reset_parameters()`` (or
``_reset_parameters()``) of each module that has one, children before parents (the order
of their constructors: bitwise equal for models made of torch's layers whose parameters
belong to modules that reset them); a Hugging Face model that cannot be rebuilt falls
back to the ``_initialize_weights`` pass of ``initialize_weights`` with a warning (its
init's distribution, not a CPU build's values). Parameters and floating buffers start as
NaN: one an init leaves (partly) unwritten is refused, named, and so is an init that
writes a group after its upload (an ancestor's ``_init_weights`` reaching into a block;
attach such a model with ``offload=False``).

(Past ~500 lines on purpose: ``Materializer`` is one object because the three sources of
values share one walk of the groups, one set of stand-ins and one record of what is
final; a third of the file is this description. What stands apart is elsewhere:
recording a Hugging Face model's construction in init_record.py, reading safetensors
shards in weights_file.py.)
"""
from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from fuyou_client.model.init_record import Draw, InitCall, TensorRef, hf_guard, pretrained_class, record_hf
from fuyou_client.model.experts import repoint, whole_parameters
from fuyou_client.model.weights_file import Checkpoint, ReusedMaps, own_memory_empty

INIT = "init"



def meta_parameters(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of the parameters on the meta device, names of the others)."""
    meta, real = [], []
    for name, p in model.named_parameters():
        (meta if p.is_meta else real).append(name)
    return meta, real


def prepare(model: nn.Module, weights, resume: bool) -> "Materializer | None":
    """Check ``attach(weights=...)`` against the model. For a model on the meta device: a
    Materializer, which has put CPU stand-ins (holding no memory) in place of its meta
    parameters; None for an ordinary model."""
    if isinstance(weights, str) and weights == INIT:
        source = INIT
    elif weights is None or isinstance(weights, (str, os.PathLike)):
        source = weights
    else:
        raise TypeError(f"weights must be the path of a safetensors checkpoint, \"init\" or None, not {weights!r}")
    meta, real = meta_parameters(model)
    if not meta:
        if source is not None:
            raise ValueError(
                "attach(weights=...) fills a model built on the meta device, but this model's parameters already hold "
                "values: load a checkpoint into it before attach (from_pretrained, load_state_dict), or build it "
                "under `with torch.device(\"meta\"):` to have the checkpoint streamed one layer group at a time")
        return None
    if real:
        raise ValueError(f"the model's parameters are on several devices: {meta[0]!r} ({len(meta)} in all) on the meta "
                         f"device, {real[0]!r} ({len(real)} in all) not; move the model to one device, or build all "
                         "of its parameters on the meta device (its buffers may be real) and attach with weights=")
    if resume and source == INIT:
        raise ValueError("attach(resume=...) restores a checkpoint's weights: weights=\"init\" does not go with it")
    if source is None and not resume:
        raise ValueError(
            f"the model's parameters are on the meta device ({meta[0]!r} and {len(meta) - 1} more): pass "
            "attach(weights=DIR) to stream them from a safetensors checkpoint (a from_pretrained directory or a "
            ".safetensors file), or weights=\"init\" to initialise them with the model's own init, one layer group "
            "at a time")
    checkpoint = Checkpoint(source) if source not in (None, INIT) else None
    return Materializer(model, checkpoint, init=source == INIT, resume=resume)



# -- the materializer --------------------------------------------------------------------------

@dataclass(eq=False)
class _Unit:
    """What is made real at once: a block (its subtree) or the rest of the model."""
    name: str
    module: nn.Module | None
    params: list = field(default_factory=list)  # (canonical name, Parameter)
    buffers: list = field(default_factory=list)  # (name, [(module, attribute)], the meta buffer)
    live: bool = False
    done: bool = False
    end: int = -1  # (weights="init") the last event that writes or calls into it


class Materializer:
    """Used by attach: ``bind(blocks)`` once the groups are known, ``fill(group)`` before
    each group's upload, ``finish()`` after the last, ``undo()`` when attach fails."""

    def __init__(self, model: nn.Module, checkpoint: Checkpoint | None, init: bool, resume: bool):
        self.model = model
        self.checkpoint = checkpoint
        self.init = init
        self.resume = resume
        self._names: dict[int, list[str]] = {}  # id(parameter) -> its names, canonical first
        for name, p in model.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), []).append(name)
        self._dtype: dict[int, torch.dtype] = {}  # id(parameter) -> its dtype
        self._holders: dict[int, nn.Parameter] = {}  # id(parameter) -> the Parameter holding its meta tensor
        self._swapped: list[nn.Parameter] = []
        self._meta_buffers: dict[int, tuple[torch.Tensor, list]] = {}  # id -> (buffer, [(module, attribute)])
        self._made: dict[int, int] = {}  # id(made buffer) -> its version when made (non-floating ones)
        self._units: list[_Unit] = []
        self._flagged: list[nn.Module] = []  # modules this attach marked _is_hf_initialized
        self._versions: list[tuple[str, nn.Parameter, int]] = []  # (weights="init") after each group's values
        self._events: list = []
        self._next = 0
        self._final: dict[int, str] | None = None
        self._keep: list = []
        self._seen: set[int] = set()
        self._init_dtypes: dict[str, torch.dtype] = {}
        self._memory = ReusedMaps()  # (the units' tensors and the init's scratch draws, block after block)
        for module in model.modules():
            for attr, b in module._buffers.items():
                if b is not None and b.is_meta:
                    self._meta_buffers.setdefault(id(b), (b, []))[1].append((module, attr))
        try:
            for p in model.parameters():
                self._standin(p)
        except BaseException:
            self.undo()
            raise

    def _standin(self, p: nn.Parameter) -> None:
        """Swap the meta parameter's tensor for a CPU one of its shape and dtype holding no
        memory (a zero-stride expansion of one element: writing it raises), keeping the
        Parameter object (ties, references) and its attributes."""
        holder = nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=p.requires_grad)
        holder.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, holder)  # p: the stand-in; holder: the meta tensor and p's attributes
        self._dtype[id(p)] = p.dtype
        self._holders[id(p)] = holder
        self._swapped.append(p)

    def undo(self) -> None:
        """attach failed: the model is back on the meta device, as it came."""
        for p in reversed(self._swapped):
            holder = self._holders.pop(id(p))
            with torch.no_grad():
                p.grad = None
                p.data = torch.zeros((), dtype=holder.dtype).expand(holder.shape)
            torch.utils.swap_tensors(p, holder)
        self._swapped.clear()
        for b, owners in self._meta_buffers.values():
            for module, attr in owners:
                module._buffers[attr] = b
        for m in self._flagged:
            m.__dict__.pop("_is_hf_initialized", None)
        self._flagged.clear()
        self._memory.close()

    # -- units ------------------------------------------------------------------------------
    def bind(self, blocks: list[nn.Module]) -> None:
        """The units: one per block (the parameters and meta buffers of its subtree that no
        earlier block has), then the rest."""
        claimed: set[int] = set()
        prefix = {id(m): n for n, m in self.model.named_modules()}
        for i, block in enumerate(blocks):
            unit = _Unit(f"block{i:04d}", block)
            base = prefix.get(id(block), "")
            for name, p in whole_parameters(block):  # (a mixture of experts cut in parts: made real whole)
                if id(p) not in claimed:
                    claimed.add(id(p))
                    unit.params.append((self._names.get(id(p), [f"{base}.{name}"])[0], p))
            self._collect_buffers(unit, block, base, claimed)
            self._units.append(unit)
        rest = _Unit("rest", None)
        for name, p in whole_parameters(self.model):
            if id(p) not in claimed:
                claimed.add(id(p))
                rest.params.append((name, p))
        self._collect_buffers(rest, self.model, "", claimed)
        self._units.append(rest)
        self._unit_of_name: dict[str, _Unit] = {}
        for unit in self._units:
            for n, p in unit.params:
                for alias in self._names.get(id(p), [n]):
                    self._unit_of_name[alias] = unit
            for n, _, _ in unit.buffers:
                self._unit_of_name[n] = unit
        self._unit_of_module: dict[int, _Unit] = {}
        for unit in self._units:
            if unit.module is not None:
                for m in unit.module.modules():
                    self._unit_of_module.setdefault(id(m), unit)
        if self.init:
            self._plan_init()
        elif self.checkpoint is not None:
            self._check_checkpoint()
        else:  # (resume alone)
            frozen = [name for unit in self._units for name, p in unit.params if not p.requires_grad]
            if frozen:
                raise ValueError(f"{frozen[0]} is frozen (requires_grad=False) and on the meta device: a fuyou "
                                 "checkpoint holds the trained parameters only; pass weights=DIR too, a safetensors "
                                 "checkpoint to take the frozen ones from")

    def _check_checkpoint(self) -> None:
        """Every parameter the checkpoint must give is in it, with the model's shape, before
        any work starts (headers only)."""
        wanted = [(name, p) for unit in self._units for name, p in unit.params if not (self.resume and p.requires_grad)]
        missing = [name for name, p in wanted if self._find(name, p, required=False) is None]
        if missing:
            more = f" ({len(missing)} of the model's {len(wanted)} are missing)" if len(missing) > 1 else ""
            raise ValueError(f"tensor {missing[0]!r} of the model is not in the checkpoint {self.checkpoint.where}"
                             f"{more}: it is of another model, or incomplete")
        for name, p in wanted:
            key = self._find(name, p)
            shape, dtype = self.checkpoint.header(key)
            if shape != list(p.shape):
                raise ValueError(f"tensor {key!r} has shape {shape} in {self.checkpoint.where} but "
                                 f"{list(p.shape)} in the model: the checkpoint is of another configuration")
            if p.dtype.is_floating_point and not dtype.startswith(("F", "BF")):
                raise ValueError(f"tensor {key!r} is {dtype} in {self.checkpoint.where}, not a floating-point "
                                 f"tensor (the model's is {p.dtype})")

    def _collect_buffers(self, unit: _Unit, root: nn.Module, base: str, claimed: set) -> None:
        for name, b in root.named_buffers():
            if id(b) in self._meta_buffers and id(b) not in claimed:
                claimed.add(id(b))
                unit.buffers.append((f"{base}.{name}" if base else name, self._meta_buffers[id(b)][1], b))

    def fill(self, spec, device: torch.device | None = None) -> None:
        """Before the engine uploads the group ``spec`` (grouping.GroupSpec): its
        parameters hold their values on the CPU; its meta buffers and frozen parameters
        are real, on ``device``."""
        self._complete(next(u for u in self._units if u.name == spec.unit), device)

    def finish(self, device: torch.device | None = None) -> None:
        """After every upload: the units without a trained group (frozen blocks), the rest
        of the init's record (its last draws move the generator); checks that no init wrote
        a group after its upload."""
        if self.init:
            while self._next < len(self._events):
                self._step()
        for unit in self._units:
            self._complete(unit, device)
        for name, p, version in self._versions:
            if p._version != version:
                raise RuntimeError(
                    f"the model's init wrote {name} after its layer group had been uploaded to fuyoud (an ancestor "
                    "module's init reaching into a block): attach this model with offload=False, or from a "
                    "checkpoint (weights=DIR)")
        self._keep = []
        self._memory.close()

    def commit(self) -> None:
        """attach succeeded: nothing to undo (the _is_hf_initialized marks stay, as the
        model's own init leaves them)."""
        self._flagged = []
        self._swapped = []

    def _complete(self, unit: _Unit, device) -> None:
        if unit.done:
            return
        if self.init:
            while self._next <= unit.end:
                self._step()
            self._finish(unit, device)
            return
        self._make_live(unit)
        with contextlib.ExitStack() as stack:
            read = stack.enter_context(self.checkpoint.reader()) if self.checkpoint is not None else None
            self._buffers_for(unit, read)
            for name, p in unit.params:
                if self.resume and p.requires_grad:
                    continue  # (left empty: the upload copies the checkpoint's masters in)
                t = read(self._find(name, p), p.shape, self._dtype[id(p)], "tensor")
                # (a frozen one is resident: a copy, not a view of the file's map)
                p.data = t if p.requires_grad else own_memory_empty(t.shape, t.dtype).copy_(t)
        self._finish(unit, device)

    def _make_live(self, unit: _Unit, sentinel: bool = False) -> None:
        """Real CPU memory for the unit's parameters and meta buffers: NaN (for the init: what
        it leaves unwritten shows) or empty; buffers are NaN (floating) or zeros."""
        if unit.live:
            return
        unit.live = True
        with torch.no_grad():
            for name, p in unit.params:
                dtype = self._init_dtypes.get(name, self._dtype[id(p)]) if self.init else self._dtype[id(p)]
                p.data = self._memory.empty(p.shape, dtype)
                if sentinel and dtype.is_floating_point:
                    p.data.fill_(float("nan"))
            for name, owners, old in unit.buffers:
                dtype = self._init_dtypes.get(name, old.dtype) if self.init else old.dtype
                new = torch.full(old.shape, float("nan"), dtype=dtype) if dtype.is_floating_point \
                    else torch.zeros(old.shape, dtype=dtype)
                for module, attr in owners:
                    module._buffers[attr] = new
                self._made[id(new)] = new._version

    def _finish(self, unit: _Unit, device) -> None:
        """The unit's values are final: checked, cast to the parameters' dtypes; buffers and
        frozen parameters go to the compute device."""
        self._make_live(unit, sentinel=self.init)
        with torch.no_grad():
            for name, p in unit.params:
                if self.init and p.is_floating_point() and _has_nan(p):
                    raise RuntimeError(
                        f"parameter {name} is not (wholly) written by the model's init: its value comes from its "
                        "constructor, which ran on the meta device; attach this model from a checkpoint "
                        "(weights=DIR), or initialise it in reset_parameters() / the model's _init_weights")
                if p.dtype != self._dtype[id(p)]:
                    p.data = self._memory.empty(p.shape, self._dtype[id(p)]).copy_(p.data)
                if not p.requires_grad and device is not None and p.device != device:
                    p.data = p.data.to(device)  # (frozen: no group uploads it)
                if self.init:
                    self._versions.append((name, p, p._version))
            for name, owners, old in unit.buffers:
                b = owners[0][0]._buffers[owners[0][1]]
                if b.numel() and (_has_nan(b) if b.is_floating_point()
                                  else b._version == self._made.get(id(b))):
                    where = "the checkpoint does not have it and " if self.checkpoint is not None else ""
                    raise RuntimeError(
                        f"buffer {name} is on the meta device, {where}the module's init does not compute it: build "
                        "the model with its buffers on the CPU (accelerate's init_empty_weights(include_buffers="
                        "False)), or have the init recompute it (_init_weights, reset_parameters)")
                moved = b.to(device=device if device is not None else b.device, dtype=old.dtype)
                if moved is not b:
                    for module, attr in owners:
                        module._buffers[attr] = moved
        if unit.module is not None:
            repoint(unit.module)  # (a mixture of experts' parts: rows of the fused values, model/experts.py)
        unit.done = True

    # -- checkpoints: names, buffers -----------------------------------------------------------
    def _find(self, name: str, p: torch.Tensor | None, required: bool = True) -> str | None:
        """The checkpoint's key for a tensor: its names (tied weights), the other side of a
        Hugging Face tie, with or without base_model_prefix. Missing: a ValueError naming it
        (None where not ``required``)."""
        candidates = list(self._names.get(id(p), [name])) if p is not None else [name]
        tied = getattr(self.model, "all_tied_weights_keys", None)
        if isinstance(tied, dict):
            for n in list(candidates):
                if n in tied:
                    candidates.append(tied[n])
                candidates.extend(k for k, v in tied.items() if v == n)
        prefix = getattr(self.model, "base_model_prefix", "") or ""
        if prefix:
            for n in list(candidates):
                candidates.append(n[len(prefix) + 1:] if n.startswith(prefix + ".") else f"{prefix}.{n}")
        for key in candidates:
            if key in self.checkpoint:
                return key
        if not required:
            return None
        raise ValueError(f"tensor {name!r} of the model is not in the checkpoint {self.checkpoint.where}: it is of "
                       "another model, or incomplete")

    def _buffers_for(self, unit: _Unit, read) -> None:
        """The unit's meta buffers: persistent ones from the checkpoint when it has them,
        others from their module's init, run with its subtree's parameters on the meta
        device (they are left as they are; the random-number generator too)."""
        todo: dict[int, nn.Module] = {}
        for name, owners, _ in unit.buffers:
            module, attr = owners[0]
            b = module._buffers[attr]
            if read is not None and attr not in module._non_persistent_buffers_set:
                key = self._find(name, None, required=False)
                if key is not None:
                    with torch.no_grad():
                        b.copy_(read(key, b.shape, b.dtype, "buffer"))
                    continue
            todo[id(module)] = module
        if not todo:
            return
        state = torch.get_rng_state()
        try:
            for module in todo.values():
                self._init_on_meta(module)
        finally:
            torch.set_rng_state(state)

    def _init_on_meta(self, module: nn.Module) -> None:
        swapped = []
        for m in module.modules():
            for attr, p in m._parameters.items():
                if p is not None and id(p) in self._holders:
                    swapped.append((m, attr, p))
                    m._parameters[attr] = self._holders[id(p)]
        try:
            with torch.no_grad(), hf_guard():
                owner = self._hf_owner(module)
                if owner is not None:
                    owner._init_weights(module)
                else:
                    fn = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
                    if callable(fn):
                        fn()
        finally:
            for m, attr, p in swapped:
                m._parameters[attr] = p

    def _hf_owner(self, module: nn.Module):
        """The PreTrainedModel whose _init_weights initialises ``module`` (the nearest among
        it and its ancestors), or None for a plain model."""
        PreTrainedModel = pretrained_class()
        if PreTrainedModel is None or not isinstance(self.model, PreTrainedModel):
            return None
        owner = self.model
        for m in self.model.modules():  # (pre-order: a deeper container comes later)
            if isinstance(m, PreTrainedModel) and any(x is module for x in m.modules()):
                owner = m
        return owner

    # -- weights="init" -----------------------------------------------------------------------
    def _plan_init(self) -> None:
        """The events to replay, and for each unit the last one it is needed for."""
        self._modules = dict(self.model.named_modules(remove_duplicate=False))
        PreTrainedModel = pretrained_class()
        hf = PreTrainedModel is not None and isinstance(self.model, PreTrainedModel)
        recorded = None
        if hf:
            try:
                recorded = self._recording()
            except Exception as exc:  # noqa: BLE001 - anything: the plain pass instead
                warnings.warn(
                    f"weights=\"init\": could not rebuild {type(self.model).__name__}(config) on the meta device to "
                    f"follow its construction ({type(exc).__name__}: {exc}); initialising module by module with its "
                    "_initialize_weights instead: the model's own init, not bitwise the values of a model built "
                    "on the CPU", stacklevel=4)
        self._events = recorded if recorded is not None else self._plain_events(hf)
        last: dict[str, object] = {}  # tensor name -> the last event that writes it
        if self._final is not None:
            for ev in self._events:
                for k in ([ev.target] if isinstance(ev, Draw) else ev.writes):
                    if k in self._final:
                        last[self._final[k]] = ev
        self._last = last
        for i, ev in enumerate(self._events):
            for unit in self._touched(ev):
                unit.end = max(unit.end, i)

    def _recording(self) -> list:
        events, rebuilt, final, keep = record_hf(self.model)
        mine = [(n, tuple(t.shape)) for n, t in whole_parameters(self.model)]
        if mine != [(n, tuple(t.shape)) for n, t in rebuilt.named_parameters()]:
            raise RuntimeError("its parameters differ from this model's")
        if [n for n, _ in self.model.named_buffers()] != [n for n, _ in rebuilt.named_buffers()]:
            raise RuntimeError("its buffers differ from this model's")
        dtypes = {}
        for name, t in list(rebuilt.named_parameters()) + list(rebuilt.named_buffers()):
            if t.storage_offset() != 0 or not t.is_contiguous():
                raise RuntimeError(f"{name} is not a contiguous tensor of its own")
            dtypes[name] = t.dtype
        self._init_dtypes, self._final, self._keep = dtypes, final, keep
        return events

    def _plain_events(self, hf: bool) -> list:
        """Without a record: the post-order _initialize_weights pass of initialize_weights
        (Hugging Face), or reset_parameters() of each module, children first."""
        events = []
        PreTrainedModel = pretrained_class()
        if hf:
            custom = self.model.is_custom_code() if hasattr(self.model, "is_custom_code") else False
            takes_flag = len(inspect.signature(self.model._initialize_weights).parameters) > 1
        names = {}
        for name, m in self.model.named_modules(remove_duplicate=False):
            names.setdefault(id(m), name)

        def walk(module, owner, name, seen):
            for child_name, child in module.named_children():
                full = f"{name}.{child_name}" if name else child_name
                walk(child, child if hf and isinstance(child, PreTrainedModel) else owner, full, seen)
            if hf:
                events.append(InitCall(module=name, owner=names[id(owner)], extra=(custom,) if takes_flag else ()))
            elif id(module) not in seen and (callable(getattr(module, "reset_parameters", None))
                                             or callable(getattr(module, "_reset_parameters", None))):
                seen.add(id(module))
                events.append(InitCall(module=name))

        walk(self.model, self.model, "", set())
        return events

    def _touched(self, ev) -> list[_Unit]:
        """The units an event needs real: what it writes (recorded), the block it runs in."""
        units: list[_Unit] = []
        if isinstance(ev, Draw):
            name = self._final.get(ev.target) if self._final is not None and ev.target is not None else None
            if name is not None and self._last.get(name) is ev:
                units.append(self._unit_of_name.get(name))
        elif ev.module is not None:
            module = self._modules[ev.module]
            units.append(self._unit_of_module.get(id(module), self._units[-1]))  # (outside the blocks: rest)
            if self._final is not None:
                units.extend(self._unit_of_name.get(self._final[k]) for k in ev.writes if k in self._final)
        out = []
        for u in units:
            if u is not None and u not in out:
                out.append(u)
        return out

    def _step(self) -> None:
        """Replay the next event."""
        ev = self._events[self._next]
        self._next += 1
        for unit in self._touched(ev):
            if unit.done:  # (an event after the unit's end: cannot happen, ends are computed from them)
                raise RuntimeError(f"the model's init writes group {unit.name} after its upload")
            self._make_live(unit, sentinel=True)
        if isinstance(ev, Draw):
            self._replay_draw(ev)
        else:
            self._replay_init(ev)

    def _replay_draw(self, ev: Draw) -> None:
        """A draw whose values the model later overwrites: into scratch memory, for the
        numbers it consumes; a tensor's last write: into the tensor."""
        live = None
        name = self._final.get(ev.target) if self._final is not None and ev.target is not None else None
        if name is not None and self._last.get(name) is ev:
            live = self._tensor(name)

        def real(v):
            if isinstance(v, TensorRef):
                if live is not None and v.key == ev.target:
                    return live.as_strided(v.size, v.stride, v.offset)
                if v.written:
                    if _contiguous(v.size, v.stride):  # (values it overwrites later: memory reused)
                        return self._memory.empty(v.size, v.dtype).as_strided(v.size, v.stride)
                    return torch.empty_strided(v.size, v.stride, dtype=v.dtype)
                return torch.zeros(v.size, dtype=v.dtype)  # (an input: its values do not change what is drawn)
            if isinstance(v, (list, tuple)):
                return type(v)(real(x) for x in v)
            if isinstance(v, torch.device) and v.type == "meta":
                return torch.device("cpu")
            return v

        args, kwargs = real(ev.args), {k: real(v) for k, v in ev.kwargs.items()}
        with torch.no_grad():
            out = ev.func(*args, **kwargs)
            if live is not None and not any(isinstance(a, TensorRef) and a.written for a in ev.args):
                live.copy_(out.reshape(live.shape))  # (the tensor was made by this draw, out of place)

    def _tensor(self, name: str) -> torch.Tensor:
        module, _, attr = name.rpartition(".")
        owner = self._modules[module]
        if attr in owner._parameters:
            t = owner._parameters[attr]
        else:  # (a buffer, or a cut experts module's fused parameter: an attribute, model/experts.py)
            t = owner._buffers[attr] if attr in owner._buffers else owner.__dict__[attr]
        return t.data if isinstance(t, nn.Parameter) else t

    def _replay_init(self, ev: InitCall) -> None:
        if ev.module is None:  # a module the model does not hold: only the numbers it drew matter
            for d in ev.draws:
                self._replay_draw(d)
            return
        module = self._modules[ev.module]
        scratch = []
        for attr, p in list(module._parameters.items()):
            if p is not None and self._stale(ev, attr, p):
                shape, dtype = ev.params[attr][1:] if attr in ev.params else (p.shape, self._init_dtypes.get(
                    self._names[id(p)][0], p.dtype))
                module._parameters[attr] = nn.Parameter(self._memory.empty(shape, dtype), requires_grad=p.requires_grad)
                scratch.append((attr, p))
        had = getattr(module, "_is_hf_initialized", False)
        try:
            with torch.no_grad(), hf_guard():
                if ev.owner is None:
                    fn = getattr(module, "reset_parameters", None)
                    (fn if callable(fn) else module._reset_parameters)()
                else:
                    self._modules[ev.owner]._initialize_weights(module, *ev.extra)
        finally:
            for attr, p in scratch:
                module._parameters[attr] = p
            if not had and getattr(module, "_is_hf_initialized", False):
                self._flagged.append(module)

    def _stale(self, ev: InitCall, attr: str, p) -> bool:
        """Whether the module's parameter was, when its init ran in the model's construction,
        another tensor than it is now (not yet tied): its init then draws into scratch."""
        canonical = self._names.get(id(p), [None])[0]
        if self._final is not None:
            return attr in ev.params and self._final.get(ev.params[attr][0]) != canonical
        tied = getattr(self.model, "all_tied_weights_keys", None)  # (no record: ties as the model declares them)
        if isinstance(tied, dict) and (f"{ev.module}.{attr}" if ev.module else attr) in tied:
            return True
        if id(p) in self._seen:  # an earlier module initialised this tensor: the tie came after
            return True
        self._seen.add(id(p))
        return False


def _has_nan(t: torch.Tensor) -> bool:
    """Whether ``t`` holds a NaN. One summation decides in the usual case (a NaN makes the
    sum NaN whatever else is added; a finite sum means there is none): about five times
    the rate of an element-wise test, which for a 7B model's init was 15 s of attach. Only
    a non-finite sum (an infinity, or large values overflowing) is checked element by
    element, a piece at a time (4M elements: a 4 MiB temporary, no copy of ``t``)."""
    flat = t.detach().reshape(-1)
    if not flat.numel() or torch.isfinite(flat.sum()):
        return False
    return any(bool(piece.isnan().any()) for piece in flat.split(1 << 22))


def _contiguous(size, stride) -> bool:
    return torch.empty(0).new_empty_strided(size, stride, device="meta").is_contiguous()

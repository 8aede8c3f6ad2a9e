"""Recording a Hugging Face model's construction, for ``attach(weights="init")``: the model
is rebuilt on the meta device with its weight init on while a dispatch mode records, in
order, every random draw and every ``_initialize_weights`` call with the tensors each
writes; client/materialize.py replays the record one layer group at a time (its
docstring says why and what equality that gives)."""
from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class TensorRef:
    """A tensor argument of a recorded op: its place, not its values."""
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    key: int  # its storage
    written: bool


@dataclass
class Draw:
    """A random op outside the weight init (or in the init of a module the model does not hold)."""
    func: object
    args: tuple
    kwargs: dict
    target: int | None  # the storage it wrote (in place) or made (out of place)


@dataclass
class InitCall:
    """One ``_initialize_weights(module)`` call (Hugging Face) or ``reset_parameters()``."""
    module: object  # its qualified name in the model (None: a module the model does not hold)
    owner: object = None  # the PreTrainedModel whose _initialize_weights ran (None: reset_parameters)
    extra: tuple = ()
    params: dict = field(default_factory=dict)  # attribute -> (storage key, shape, dtype) when it ran
    draws: list = field(default_factory=list)
    writes: set = field(default_factory=set)  # storage keys


def written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def record_hf(model: nn.Module):  # long: one recording, its dispatch mode and the init hooks share its state
    """Rebuild ``type(model)(config)`` on the meta device with its weight init on, recording
    draws and init calls: (events, rebuilt model, storage key -> tensor name, storages
    kept alive). Raises where that is impossible."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import PreTrainedModel
    import transformers.modeling_utils as mu

    for m in model.modules():
        if isinstance(m, PreTrainedModel) and type(m)._initialize_weights is not PreTrainedModel._initialize_weights:
            raise RuntimeError(f"{type(m).__name__} overrides _initialize_weights")
    if not callable(getattr(mu, "get_torch_context_manager_or_global_device", None)):
        raise RuntimeError("transformers.modeling_utils has no get_torch_context_manager_or_global_device")
    events: list = []
    stack: list[InitCall] = []
    keep: list = []  # every storage seen stays alive, so that its key (address) is not reused

    def key(t: torch.Tensor) -> int:
        s = t.untyped_storage()
        keep.append(s)
        return s._cdata

    def spec(v, written: set):
        if isinstance(v, torch.Tensor):
            return TensorRef(tuple(v.size()), tuple(v.stride()), v.storage_offset(), v.dtype, key(v), id(v) in written)
        if isinstance(v, (list, tuple)):
            return type(v)(spec(x, written) for x in v)
        return v

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            written = written_tensors(func, args, kwargs)
            out = func(*args, **kwargs)
            random = torch.Tag.nondeterministic_seeded in func.tags
            made = key(out) if random and not written and isinstance(out, torch.Tensor) else None
            if random:
                ids = {id(t) for t in written}
                target = key(written[0]) if written else made
                draw = Draw(func, spec(tuple(args), ids), {k: spec(v, ids) for k, v in kwargs.items()}, target)
                (stack[-1].draws if stack else events).append(draw)
            if stack:
                stack[-1].writes.update(key(t) for t in written)
                if made is not None:
                    stack[-1].writes.add(made)
            return out

    original = PreTrainedModel._initialize_weights

    def initialize(self, module, *extra, **kw):
        if kw or stack:
            raise RuntimeError("an unexpected _initialize_weights call")
        if getattr(module, "_is_hf_initialized", False):  # (returns at once: the replay's will too)
            return original(self, module, *extra)
        event = InitCall(module=id(module), owner=id(self), extra=extra,
                      params={n: (key(p), tuple(p.shape), p.dtype) for n, p in module._parameters.items()
                              if p is not None})
        events.append(event)
        stack.append(event)
        try:
            return original(self, module, *extra)
        finally:
            stack.pop()

    config = copy.deepcopy(model.config)
    rng = torch.get_rng_state()
    context = mu.get_torch_context_manager_or_global_device
    verbosity = None
    try:
        from transformers.utils import logging as hf_logging
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # (the model's own construction has said it all once)
    except Exception:  # noqa: BLE001
        hf_logging = None
    try:
        PreTrainedModel._initialize_weights = initialize
        mu.get_torch_context_manager_or_global_device = lambda: torch.device("cpu")  # the init runs (on meta)
        with torch.device("meta"), Recorder():
            rebuilt = type(model)(config)
    finally:
        PreTrainedModel._initialize_weights = original
        mu.get_torch_context_manager_or_global_device = context
        torch.set_rng_state(rng)  # (a draw on a real device during the rebuild is replayed, not kept)
        if hf_logging is not None and verbosity is not None:
            hf_logging.set_verbosity(verbosity)
    names: dict[int, str] = {}
    for name, m in rebuilt.named_modules(remove_duplicate=False):
        names.setdefault(id(m), name)
    for ev in events:
        if isinstance(ev, InitCall):
            ev.module, ev.owner = names.get(ev.module), names.get(ev.owner)
    final: dict[int, str] = {}
    for name, t in list(rebuilt.named_parameters()) + list(rebuilt.named_buffers()):
        final.setdefault(key(t), name)
    return events, rebuilt, final, keep



def pretrained_class():
    """transformers' PreTrainedModel where transformers is in use (a model of it is), else None."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel


@contextlib.contextmanager
def hf_guard():
    """transformers' guard of torch.nn.init (it respects _is_hf_initialized), under which
    its initialize_weights runs; nothing without transformers."""
    try:
        if "transformers" not in sys.modules:
            raise ImportError
        from transformers.initialization import guard_torch_init_functions
    except ImportError:
        yield
        return
    with guard_torch_init_functions():
        yield

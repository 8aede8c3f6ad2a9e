"""TRL's trainers through Fuyou: ``FuyouSFTTrainer``, ``FuyouDPOTrainer``,
``FuyouGRPOTrainer`` (docs/guide/trl.md).

    from fuyou_client.integrations.trl import FuyouDPOTrainer
    trainer = FuyouDPOTrainer(model=model, args=trl.DPOConfig(...), train_dataset=pairs,
                              processing_class=tokenizer, fuyou={"socket": daemon.socket})
    trainer.train(); trainer.save_model("out"); trainer.close()

Each is ``FuyouTrainer`` (integrations/transformers.py: Fuyou's optimizer, its
checkpoints, saves as PEFT saves) mixed into TRL's trainer, which keeps its data
handling, losses, generation and logging. TRL's defaults work: ``gradient_checkpointing=
True`` becomes Fuyou's recomputation, ``bf16=True`` the Trainer's autocast.

The reference model of DPO (and of GRPO with ``beta`` > 0) is not a second copy of the
model in memory: it is attached frozen (``attach_frozen``: its blocks' weights stored
once on the SSD array and fetched ahead of each forward, as the trained model's are),
so preference tuning of a model larger than host memory works. Where it comes from:

* ``ref_model`` given to ``FuyouDPOTrainer`` (a model, or the path of a ``from_pretrained``
  directory): that one, attached frozen (a model on the meta device takes
  ``reference_weights=DIR``);
* none given: what TRL itself would load, the policy's ``from_pretrained`` directory
  (``config._name_or_path``; a policy on the meta device: its ``fuyou={"weights": DIR}``),
  built on the meta device and streamed from it one layer group at a time, never whole
  in memory;
* a PEFT policy, or ``precompute_ref_log_probs=True``: none (TRL disables the adapter, or
  computes the reference's log-probabilities before training).

A policy loaded from a Hub id (``config._name_or_path`` "org/name") has its reference
streamed from that model's snapshot in the local Hugging Face cache (where
``from_pretrained`` put the policy's files; nothing is downloaded); one not there, or
without safetensors weights, is refused naming ``ref_model=``. ``trust_remote_code`` is
the TRL config's, or True where the policy itself is a remote-code model (its class came
from the checkpoint's code, which loading it trusted).

``stream_reference=False`` leaves the reference to TRL, in memory. ``sync_ref_model=True``
is refused: the streamed reference's weights are written once and never again.

Every refusal of FuyouTrainer (integrations/transformers.py: ``optim``, ``fp16``,
DeepSpeed, FSDP, several processes, checkpointing with another treatment, CUDA-graph
compile modes, ``state_dtype``) is made at construction before TRL's set-up: before a
model is loaded, a data set tokenized or a reference model written to the SSD array.
So is ``use_vllm=True`` (GRPO) with offloaded blocks: TRL sends vLLM the policy's
weights from ``named_parameters()``, which hold empty placeholders for offloaded blocks
between uses; it works with ``fuyou={"offload": False}`` (every block resident).
"""
from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

import torch
import transformers
import trl
from trl.trainer import dpo_trainer as dpo_module
from trl.trainer import grpo_trainer as grpo_module

from fuyou_client.engine.attach import attach_frozen
from fuyou_client.engine.options import AttachOptions
from fuyou_client.integrations.transformers import (DECIDED, FuyouTrainer, check_arguments, check_compile,
                                                    map_checkpointing)
from fuyou_client.optim import AdamW


def _options(fuyou) -> AttachOptions:
    return fuyou if isinstance(fuyou, AttachOptions) else AttachOptions(**(fuyou or {}))


def check_before_work(model, args, fuyou, state_dtype: str = "fp32") -> AttachOptions:
    """FuyouTrainer's refusals (integrations/transformers.py), made before TRL's ``__init__``
    does any work (loads a model, tokenizes a data set, writes a reference model to the SSD
    array), and those of TRL's options that cannot work with Fuyou. FuyouTrainer makes its
    own again after TRL's set-up (and on a config TRL builds itself, ``args=None``)."""
    options = _options(fuyou)
    if args is not None:
        check_arguments(args)
        taken = [f"{k} ({why})" for k, why in DECIDED.items()
                 if getattr(options, k) != getattr(AttachOptions, k, None)]
        if taken:
            raise ValueError(f"FuyouTrainer(fuyou=...) sets {taken[0]}, which the Trainer decides")
        check_compile(args, map_checkpointing(copy.copy(args), options))  # (a copy: the mapping turns the flags off)
        if getattr(args, "use_vllm", False) and options.offload is not False:
            raise ValueError(
                "use_vllm=True: TRL sends vLLM the policy's weights from model.named_parameters() between steps, "
                "but an offloaded block's parameters are empty placeholders between uses (its weights are on the SSD "
                "array), so vLLM would get none. Set use_vllm=False (TRL generates with the model itself: each "
                "generated token runs every block, fetching each offloaded block's weights again), or "
                "fuyou={'offload': False} (every block resident: named_parameters() hold the trained weights after "
                "each step; the whole model then stays in device memory, beside vLLM's copy)")
    AdamW(state_dtype=state_dtype)  # (refused now if unknown)
    if (not isinstance(model, (str, os.PathLike)) and options.weights is None
            and any(p.is_meta for p in model.parameters())):
        raise ValueError("the model is on the meta device: pass fuyou={'weights': DIR} (its from_pretrained "
                         "directory) to have attach stream its weights in one layer group at a time")
    return options


def _dtype(value, config) -> torch.dtype:
    """A ``from_pretrained`` dtype argument (a torch.dtype, a name, "auto" or None) as TRL reads it."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in ("bfloat16", "float16", "float32"):
        return getattr(torch, value)
    if value == "auto":
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        return getattr(torch, found) if isinstance(found, str) else (found or torch.float32)
    return torch.float32


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def from_pretrained_directory(name, revision=None, cache_dir=None) -> Path:
    """The local directory a reference model is streamed from: ``name`` itself, or a Hub id's
    snapshot in the local Hugging Face cache (``HF_HUB_CACHE``, or ``cache_dir``), where
    ``from_pretrained`` put the policy's files; nothing is downloaded. It must hold
    safetensors weights (what the stream reads). Anything else is refused, naming what to pass."""
    name = os.fspath(name) if name is not None else ""
    if name and Path(name).is_dir():
        directory = Path(name)
    else:
        found = None
        if name:
            from huggingface_hub import constants, try_to_load_from_cache
            try:
                found = try_to_load_from_cache(name, "config.json", cache_dir=cache_dir, revision=revision)
            except ValueError:  # (not a Hub id either: HFValidationError)
                found = None
        if not isinstance(found, str):
            where = f" ({cache_dir or constants.HF_HUB_CACHE})" if name else ""
            raise ValueError(
                "the reference model is streamed from the SSD array, built from the policy's from_pretrained files "
                f"(nothing is downloaded for it), but {name[:80]!r}, neither a directory nor a model in the local "
                f"Hugging Face cache{where}, is none here: pass ref_model= (a model, or the path of its directory), "
                f"e.g. ref_model=huggingface_hub.snapshot_download({name[:80]!r}) (which downloads it), load the policy "
                "from a local directory, or pass stream_reference=False to leave the reference to TRL, in memory")
        directory = Path(found).parent
    if not any((directory / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(
            f"the reference model is streamed from the safetensors weights of {str(directory)[:120]!r}, but it holds "
            f"neither {WEIGHT_FILES[0]} nor {WEIGHT_FILES[1]}: pass ref_model= (a model, or a directory that "
            "save_pretrained wrote), or stream_reference=False to leave the reference to TRL, in memory")
    return directory


def stream_reference(ref_model, options: AttachOptions, weights=None, **init):
    """The reference model attached frozen (see the module's docstring): (model, engine).
    ``ref_model``: a model (one on the meta device takes ``weights``), or the path of a
    ``from_pretrained`` directory or a Hub id in the local Hugging Face cache
    (``from_pretrained_directory``), built on the meta device with ``init`` (``dtype``,
    ``attn_implementation``, ``trust_remote_code``; ``revision`` and ``cache_dir`` find a
    Hub id's snapshot) and streamed from it."""
    if isinstance(ref_model, (str, os.PathLike)):
        if init.get("quantization_config") is not None:
            raise ValueError("a quantized reference model is not streamed: stream_reference=False")
        path = from_pretrained_directory(ref_model, init.get("revision"), init.get("cache_dir"))
        trust = bool(init.get("trust_remote_code", False))
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust)
        kwargs = {"dtype": _dtype(init.get("dtype"), config), "trust_remote_code": trust}
        if init.get("attn_implementation"):
            kwargs["attn_implementation"] = init["attn_implementation"]
        with torch.device("meta"):
            ref_model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        weights = str(path)
    elif weights is None and any(p.is_meta for p in ref_model.parameters()):
        raise ValueError("ref_model is on the meta device: pass reference_weights=DIR (its from_pretrained "
                         "directory) to stream its weights from there")
    ref_model.requires_grad_(False)
    ref_model.eval()
    opts = AttachOptions(socket=options.socket, device=options.device, weights=weights,
                         offload=True if options.offload is False else options.offload)
    return ref_model, attach_frozen(ref_model, options=opts)


def _is_remote_code(model) -> bool:
    """Whether ``model``'s class came from a checkpoint's own code (``trust_remote_code=True``)."""
    return type(model).__module__.startswith("transformers_modules")


def _init_kwargs(args, model) -> dict:
    """What a reference given by path is built with: the config's ``trust_remote_code`` (or
    the policy's, see the module's docstring), ``revision`` and ``cache_dir``."""
    init = {k: v for k, v in (getattr(args, "model_init_kwargs", None) or {}).items()
            if k in ("revision", "cache_dir", "trust_remote_code")}
    init.setdefault("trust_remote_code", bool(getattr(args, "trust_remote_code", False)))
    init["trust_remote_code"] = init["trust_remote_code"] or _is_remote_code(model)
    return init


class _Reference:
    """What the DPO and GRPO trainers share: a reference model streamed from the SSD array,
    closed with the trainer (``close()``) or when its construction fails.

    Where TRL would load the reference itself (``create_model_from_path`` of the policy's
    directory: a second full copy in memory), its loader is swapped for the length of TRL's
    ``__init__`` for one that builds the model on the meta device and attaches it frozen;
    TRL then prepares it as it would its own (dropout off, its fused head, Accelerate)."""
    reference_engine = None

    def _construct(self, module, model, ref_model, args, fuyou, state_dtype, stream: bool, weights, init):
        options = check_before_work(model, args, fuyou, state_dtype)
        if stream and args is not None and getattr(args, "sync_ref_model", False):
            raise ValueError("sync_ref_model=True: the streamed reference model's weights are written to the SSD "
                             "array once and never again; set sync_ref_model=False (or stream_reference=False)")
        if stream and ref_model is not None:
            ref_model, self.reference_engine = stream_reference(
                ref_model, options, weights,
                **(_init_kwargs(args, model) if isinstance(ref_model, (str, os.PathLike)) else {}))
        try:
            if stream and ref_model is None:
                with self._loading_references(module, model, options):
                    init(ref_model)
            else:
                init(ref_model)
        except BaseException:
            self._close_reference()
            raise

    @contextlib.contextmanager
    def _loading_references(self, module, model, options: AttachOptions):
        original = getattr(module, "create_model_from_path", None)
        if original is None:
            raise RuntimeError(f"this TRL ({trl.__version__}) loads its reference model otherwise than Fuyou knows: "
                               "pass ref_model= (streamed as given), or stream_reference=False")
        policy_calls = [1 if isinstance(model, (str, os.PathLike)) else 0]  # (TRL loads a policy given by path first)
        loaded = [model]

        def load(path, *args, **kwargs):
            if policy_calls[0]:
                policy_calls[0] -= 1
                loaded[0] = original(path, *args, **kwargs)
                return loaded[0]
            if (not path or not Path(path).is_dir()) and options.weights is not None and Path(options.weights).is_dir():
                path = options.weights  # (a policy on the meta device: its weights' directory)
            if _is_remote_code(loaded[0]):
                kwargs["trust_remote_code"] = True  # (as the policy was loaded: its own code, trusted then)
            ref, self.reference_engine = stream_reference(path, options, **kwargs)
            return ref

        module.create_model_from_path = load
        try:
            yield
        finally:
            module.create_model_from_path = original

    def _close_reference(self) -> None:
        if self.reference_engine is not None:
            self.reference_engine.close(materialize=False)  # (the reference is the trainer's own: it goes)
            self.reference_engine = None

    def close(self, materialize: bool = True) -> None:
        """Detach the model (``FuyouTrainer.close``) and the streamed reference model from fuyoud."""
        try:
            super().close(materialize)
        finally:
            self._close_reference()


class FuyouSFTTrainer(FuyouTrainer, trl.SFTTrainer):
    """``trl.SFTTrainer`` with Fuyou's optimizer (FuyouTrainer's arguments: ``fuyou=``,
    ``state_dtype=``)."""

    def __init__(self, model, args=None, *rest, fuyou=None, state_dtype: str = "fp32", **kwargs):
        check_before_work(model, args, fuyou, state_dtype)
        super().__init__(model, args, *rest, fuyou=fuyou, state_dtype=state_dtype, **kwargs)


class FuyouDPOTrainer(_Reference, FuyouTrainer, trl.DPOTrainer):
    """``trl.DPOTrainer`` with Fuyou's optimizer and a reference model streamed from the
    SSD array (see the module's docstring). Besides FuyouTrainer's arguments:
    ``stream_reference`` (default True) and ``reference_weights`` (a meta-device
    ``ref_model``'s from_pretrained directory)."""

    def __init__(self, model, ref_model=None, args=None, *rest, fuyou=None, state_dtype: str = "fp32",
                 stream_reference: bool = True, reference_weights=None, **kwargs):
        self._construct(dpo_module, model, ref_model, args, fuyou, state_dtype, stream_reference, reference_weights,
                        lambda ref: super(FuyouDPOTrainer, self).__init__(model, ref, args, *rest, fuyou=fuyou,
                                                                          state_dtype=state_dtype, **kwargs))


class FuyouGRPOTrainer(_Reference, FuyouTrainer, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with Fuyou's optimizer; with ``beta`` > 0 its reference model
    (the policy's from_pretrained directory, as TRL loads it) is streamed from the SSD
    array. Besides FuyouTrainer's arguments: ``stream_reference`` (default True).
    ``use_vllm=True`` needs ``fuyou={"offload": False}`` (see the module's docstring)."""

    def __init__(self, model, reward_funcs=None, args=None, *rest, fuyou=None, state_dtype: str = "fp32",
                 stream_reference: bool = True, **kwargs):
        self._construct(grpo_module, model, None, args, fuyou, state_dtype, stream_reference, None,
                        lambda _: super(FuyouGRPOTrainer, self).__init__(model, reward_funcs, args, *rest,
                                                                         fuyou=fuyou, state_dtype=state_dtype,
                                                                         **kwargs))


__all__ = ["FuyouSFTTrainer", "FuyouDPOTrainer", "FuyouGRPOTrainer", "check_before_work",
           "from_pretrained_directory", "stream_reference"]

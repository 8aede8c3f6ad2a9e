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

``stream_reference=False`` leaves the reference to TRL, in memory. ``sync_ref_model=True``
is refused: the streamed reference's weights are written once and never again.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import transformers
import trl
from trl.trainer import dpo_trainer as dpo_module
from trl.trainer import grpo_trainer as grpo_module

from fuyou_client.engine.attach import attach_frozen
from fuyou_client.engine.options import AttachOptions
from fuyou_client.integrations.transformers import FuyouTrainer


def _options(fuyou) -> AttachOptions:
    return fuyou if isinstance(fuyou, AttachOptions) else AttachOptions(**(fuyou or {}))


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


def stream_reference(ref_model, options: AttachOptions, weights=None, **init):
    """The reference model attached frozen (see the module's docstring): (model, engine).
    ``ref_model``: a model (one on the meta device takes ``weights``) or the path of a
    ``from_pretrained`` directory, built on the meta device with ``init`` (dtype,
    attn_implementation) and streamed from it."""
    if isinstance(ref_model, (str, os.PathLike)):
        path = ref_model
        if not Path(path).is_dir():
            raise ValueError(
                "the reference model is streamed from the SSD array, built from its from_pretrained directory, but "
                f"{str(path)[:80]!r} is none here: pass ref_model= (a model, or the path of its directory), or "
                "stream_reference=False to leave it to TRL, in memory")
        if init.get("quantization_config") is not None:
            raise ValueError("a quantized reference model is not streamed: stream_reference=False")
        config = transformers.AutoConfig.from_pretrained(path)
        kwargs = {"dtype": _dtype(init.get("dtype"), config)}
        if init.get("attn_implementation"):
            kwargs["attn_implementation"] = init["attn_implementation"]
        with torch.device("meta"):
            ref_model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        weights = path
    elif weights is None and any(p.is_meta for p in ref_model.parameters()):
        raise ValueError("ref_model is on the meta device: pass reference_weights=DIR (its from_pretrained "
                         "directory) to stream its weights from there")
    ref_model.requires_grad_(False)
    ref_model.eval()
    opts = AttachOptions(socket=options.socket, device=options.device, weights=weights,
                         offload=True if options.offload is False else options.offload)
    return ref_model, attach_frozen(ref_model, options=opts)


class _Reference:
    """What the DPO and GRPO trainers share: a reference model streamed from the SSD array,
    closed with the trainer (``close()``) or when its construction fails.

    Where TRL would load the reference itself (``create_model_from_path`` of the policy's
    directory: a second full copy in memory), its loader is swapped for the length of TRL's
    ``__init__`` for one that builds the model on the meta device and attaches it frozen;
    TRL then prepares it as it would its own (dropout off, its fused head, Accelerate)."""
    reference_engine = None

    def _construct(self, module, model, ref_model, args, fuyou, stream: bool, weights, init):
        if stream and args is not None and getattr(args, "sync_ref_model", False):
            raise ValueError("sync_ref_model=True: the streamed reference model's weights are written to the SSD "
                             "array once and never again; set sync_ref_model=False (or stream_reference=False)")
        options = _options(fuyou)
        if stream and ref_model is not None:
            ref_model, self.reference_engine = stream_reference(ref_model, options, weights)
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

        def load(path, *args, **kwargs):
            if policy_calls[0]:
                policy_calls[0] -= 1
                return original(path, *args, **kwargs)
            if (not path or not Path(path).is_dir()) and options.weights is not None and Path(options.weights).is_dir():
                path = options.weights  # (a policy on the meta device: its weights' directory)
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


class FuyouDPOTrainer(_Reference, FuyouTrainer, trl.DPOTrainer):
    """``trl.DPOTrainer`` with Fuyou's optimizer and a reference model streamed from the
    SSD array (see the module's docstring). Besides FuyouTrainer's arguments:
    ``stream_reference`` (default True) and ``reference_weights`` (a meta-device
    ``ref_model``'s from_pretrained directory)."""

    def __init__(self, model, ref_model=None, args=None, *rest, fuyou=None, stream_reference: bool = True,
                 reference_weights=None, **kwargs):
        self._construct(dpo_module, model, ref_model, args, fuyou, stream_reference, reference_weights,
                        lambda ref: super(FuyouDPOTrainer, self).__init__(model, ref, args, *rest, fuyou=fuyou,
                                                                          **kwargs))


class FuyouGRPOTrainer(_Reference, FuyouTrainer, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with Fuyou's optimizer; with ``beta`` > 0 its reference model
    (the policy's from_pretrained directory, as TRL loads it) is streamed from the SSD
    array. Besides FuyouTrainer's arguments: ``stream_reference`` (default True)."""

    def __init__(self, model, reward_funcs=None, args=None, *rest, fuyou=None, stream_reference: bool = True,
                 **kwargs):
        self._construct(grpo_module, model, None, args, fuyou, stream_reference, None,
                        lambda _: super(FuyouGRPOTrainer, self).__init__(model, reward_funcs, args, *rest,
                                                                         fuyou=fuyou, **kwargs))


__all__ = ["FuyouSFTTrainer", "FuyouDPOTrainer", "FuyouGRPOTrainer", "stream_reference"]

"""Hugging Face's ``Trainer`` through Fuyou: ``FuyouTrainer``, a drop-in subclass.

    from fuyou_client.integrations.transformers import FuyouTrainer
    trainer = FuyouTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                           fuyou=fuyou_client.AttachOptions(socket=...))   # optional: how to attach
    trainer.train()                                   # train(resume_from_checkpoint=True) resumes
    trainer.save_model("out")                         # safetensors, from_pretrained loads it

The model is attached when the Trainer creates its optimizer, with its own arguments:

* ``learning_rate``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``, ``weight_decay``:
  Fuyou's AdamW, with the Trainer's parameter groups (``get_decay_parameter_names``: no
  decay for biases and normalisation weights), bitwise ``optim="adamw_torch_fused"``;
  ``optim`` must be ``adamw_torch`` or ``adamw_torch_fused`` (others are refused: Fuyou
  runs torch's fused AdamW arithmetic, with fp32, bf16 or int8 moments:
  ``FuyouTrainer(..., state_dtype="bf16")``);
* ``lr_scheduler_type``, ``warmup_steps``/``warmup_ratio``: the Trainer's own scheduler on
  ``engine.optimizer``, one learning rate per group;
* ``gradient_accumulation_steps``: ``attach(accumulation_steps=...)``;
* ``max_grad_norm``: ``attach(max_grad_norm=...)``, Fuyou's exact clipping (the steps
  wait for every gradient); the Trainer's own ``clip_grad_norm_`` is not called (its
  ``grad_norm`` in the logs is Fuyou's norm), so nothing is clipped twice;
* ``save_steps`` and friends: a Trainer checkpoint folder holds Fuyou's checkpoint in
  ``fuyou/`` (master weights, moments, step counts, each group's hyperparameters) and the
  scheduler as usual; ``resume_from_checkpoint`` attaches with ``resume=`` from it and
  continues bitwise; ``save_total_limit`` deletes old ones through fuyoud first (a
  snapshot checkpoint holds extents on the SSD array);
* ``save_model``: ``engine.export`` (sharded safetensors streamed from the SSD array,
  with the config); a PEFT model's as PEFT saves it (``adapter_config.json`` and
  ``adapter_model.safetensors``, the trained adapters only: integrations/peft.py), and
  ``save_merged_model`` the full model with the adapters merged in.

* ``gradient_checkpointing`` / ``activation_checkpointing`` (TRL's configs default to
  True; or ``gradient_checkpointing_enable()`` on the model): Fuyou's recomputation,
  ``activations="recompute"`` (the same arithmetic, offloaded weights fetched again;
  every block recomputed), with Hugging Face's turned off;
* ``bf16``: the Trainer's autocast, as without Fuyou;
* ``torch_compile``: the model compiled as the Trainer compiles it, attach's hooks (the
  fetches of offloaded weights) outside the graph; bitwise the plain Trainer with
  ``torch_compile_backend="aot_eager"``, within a stated tolerance with inductor
  (docs/guide/trl.md); CUDA-graph modes refused with offloaded weights;
* ``load_best_model_at_end`` (which ``EarlyStoppingCallback`` needs): at the end the model
  is attached again from the best checkpoint's ``fuyou/``, its weights and moments bitwise
  those of that step.

Refused before training starts, naming the argument: another ``optim``, DeepSpeed or
FSDP, ``fp16`` (its loss scaler rewrites gradients; use ``bf16``), checkpointing together
with ``fuyou={"activations": "swap"}`` or another treatment (set
``gradient_checkpointing=False``), and several processes (data parallelism: not yet).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch
import transformers
from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints

from fuyou_client.checkpoints.values import group_bytes, group_params, group_shapes, host_memory_available, read_group
from fuyou_client.engine.attach import attach
from fuyou_client.engine.engine import Engine
from fuyou_client.engine.hooks import hf_checkpointing
from fuyou_client.optim import AdamW
from fuyou_client.engine.options import AttachOptions
from fuyou_client.integrations.peft import export_merged, is_peft_model, save_adapter

FUYOU_DIR = "fuyou"  # Fuyou's checkpoint inside a Trainer checkpoint folder
SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"
OPTIMS = ("adamw_torch", "adamw_torch_fused")
# The AttachOptions the Trainer's arguments decide
DECIDED = {"param_groups": "the Trainer's weight decay groups", "no_decay": "the Trainer's weight decay groups",
           "max_grad_norm": "TrainingArguments.max_grad_norm",
           "accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
           "resume": "train(resume_from_checkpoint=...)"}


def check_arguments(args: transformers.TrainingArguments) -> None:
    """Refuse what FuyouTrainer cannot honour, naming the argument."""
    optim = getattr(args.optim, "value", args.optim)
    if optim not in OPTIMS:
        raise ValueError(f"FuyouTrainer trains with Fuyou's AdamW (torch's fused arithmetic, its state on the SSD "
                         f"array): optim={optim!r} is not available; use optim='adamw_torch_fused' (or "
                         "'adamw_torch'), and FuyouTrainer(state_dtype='bf16' or 'int8') for fewer bytes of state")
    if args.deepspeed:
        raise ValueError("FuyouTrainer with deepspeed: Fuyou is the optimizer and the offload here; remove deepspeed=")
    if args.fsdp:
        raise ValueError("FuyouTrainer with fsdp: Fuyou does not shard over FSDP; remove fsdp=")
    if args.fp16:
        raise ValueError("FuyouTrainer with fp16=True: its gradient scaler rewrites gradients that Fuyou's steps "
                         "read; use bf16=True")
    if args.world_size > 1:
        raise ValueError(f"FuyouTrainer with {args.world_size} processes: data-parallel training is not supported yet")


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile(args: transformers.TrainingArguments, options: AttachOptions) -> None:
    """``torch_compile``: the model is compiled as the Trainer compiles it; attach's hooks (the
    fetches of offloaded weights) stay out of the graph (engine/hooks.py), so each block's
    compute is compiled between them. Modes that capture CUDA graphs are refused with
    offloaded weights: a graph replays the addresses it captured, and an offloaded block's
    weights are in another slot at each fetch."""
    mode = getattr(args, "torch_compile_mode", None)
    if getattr(args, "torch_compile", False) and mode in CUDA_GRAPH_MODES and options.offload is not False:
        raise ValueError(f"torch_compile_mode={mode!r} captures CUDA graphs, which replay the weights' addresses, but "
                         "offloaded weights are in another slot at each fetch: use torch_compile_mode='default' or "
                         "'max-autotune-no-cudagraphs', or fuyou={'offload': False}")


def checkpointing_asked(args: transformers.TrainingArguments) -> bool:
    """``activation_checkpointing`` (``gradient_checkpointing``, its old name, which TRL's
    configs default to True)."""
    return bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))


def map_checkpointing(args: transformers.TrainingArguments, options: AttachOptions) -> AttachOptions:
    """Hugging Face activation (gradient) checkpointing becomes Fuyou's recomputation, the
    same arithmetic with offloaded weights fetched again: ``activations="recompute"``, and
    the argument off (Hugging Face's would rerun blocks outside the hooks that fetch their
    weights). Refused where ``fuyou=`` chose another treatment, naming the argument."""
    if not checkpointing_asked(args):
        return options
    if options.activations not in ("keep", "recompute"):
        raise ValueError(f"gradient_checkpointing=True (TRL's configs default to it) is Fuyou's activations="
                         f"'recompute', but fuyou= sets activations={options.activations!r}: set "
                         "gradient_checkpointing=False in the TrainingArguments (or TRL config) to keep yours")
    args.activation_checkpointing = args.gradient_checkpointing = False
    return dataclasses.replace(options, activations="recompute")


def _stand_ins(engine: Engine) -> list:
    """What an offloaded parameter holds while the model is attached again (its shape: an
    empty placeholder has none): its value for a frozen one (stored again at attach), an
    allocation never written for a trained one (attach(resume=...) writes the masters into
    it one group at a time, so its pages are touched, then freed, one group at a time)."""
    out = []
    for g in engine.groups:
        if g.offloaded is None:
            continue
        params, shapes, n = group_params(g), group_shapes(g), len(g.spec.params)
        frozen = read_group(engine.session, g, trained=False) if len(params) > n else []
        out += [(p, torch.empty(shape, dtype=g.dtype, device=p.device)) for p, shape in zip(params[:n], shapes[:n])]
        out += list(zip(params[n:], frozen))
    return out


class FuyouTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose optimizer is Fuyou's (see the module's docstring).
    ``self.engine`` is the attached Engine once training has begun.

    Its arguments are the Trainer's, and:
      ``fuyou``: ``AttachOptions`` (or a dict of them) for everything the Trainer's
      arguments do not decide (socket, offload, activations, ...). A model built on the
      meta device (larger than memory) takes ``fuyou={"weights": DIR}``: attach streams
      its weights in one layer group at a time, and it is never whole in memory.
      ``state_dtype``: what the AdamW moments are kept in: "fp32", "bf16" or "int8".
    """

    def __init__(self, *args, fuyou: AttachOptions | dict | None = None, state_dtype: str = "fp32", **kwargs):
        options = fuyou if isinstance(fuyou, AttachOptions) else AttachOptions(**(fuyou or {}))
        self.fuyou_options_given = options  # (the Trainer's __init__ asks it: a model on the meta device)
        super().__init__(*args, **kwargs)
        check_arguments(self.args)
        taken = [f"{k} ({why})" for k, why in DECIDED.items()
                 if getattr(options, k) != getattr(AttachOptions, k, None)]
        if taken:
            raise ValueError(f"FuyouTrainer(fuyou=...) sets {taken[0]}, which the Trainer decides")
        self.fuyou_options = map_checkpointing(self.args, options)
        check_compile(self.args, self.fuyou_options)
        self.state_dtype = state_dtype
        AdamW(state_dtype=state_dtype)  # (refused now if unknown)
        self.engine: Engine | None = None
        self._fuyou_resume: str | None = None

    # -- the optimizer ------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint in {self.args.output_dir} to resume from")
        if resume_from_checkpoint:
            fuyou = Path(resume_from_checkpoint) / FUYOU_DIR
            if not fuyou.is_dir():
                raise ValueError(f"{resume_from_checkpoint} is not a FuyouTrainer checkpoint (no {FUYOU_DIR}/ in it)")
            if self.engine is not None:
                raise ValueError("this FuyouTrainer has trained already: resume with a new one")
            self._fuyou_resume = str(fuyou.resolve())
        return super().train(resume_from_checkpoint or None, *args, **kwargs)

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        self.engine = self._attach(self._fuyou_resume)
        self.optimizer = self.engine.optimizer
        if self.args.load_best_model_at_end:
            self._check_best_model_fits()
        return self.optimizer

    def _check_best_model_fits(self) -> None:
        """Before the first step: loading the best checkpoint at the end attaches the model
        again, and the frozen parameters of its offloaded blocks (a PEFT model's base) are
        held in memory for that moment (attach stores them from the parameters)."""
        frozen = sum(group_bytes(g) - group_bytes(g, frozen=False) for g in self.engine.groups if g.offloaded is not None)
        available = host_memory_available()
        if frozen > available:
            self.engine.close(materialize=False)
            self.engine = None
            raise ValueError(
                f"load_best_model_at_end=True: loading the best checkpoint attaches the model again, holding the "
                f"{frozen / 2**30:.1f} GiB of its offloaded frozen parameters in host memory for that moment, more than "
                f"the {available / 2**30:.1f} GiB available; set load_best_model_at_end=False (and drop "
                "EarlyStoppingCallback), then resume from the best checkpoint (trainer.state.best_model_checkpoint) "
                "with train(resume_from_checkpoint=...) or load its adapter with PeftModel.from_pretrained")

    def _attach(self, resume: str | None) -> Engine:
        """The model attached with the Trainer's arguments (``resume``: from a Fuyou checkpoint)."""
        model = self.model
        args = self.args
        decay = set(self.get_decay_parameter_names(model))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trainable if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
        optimizer = AdamW(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                          weight_decay=args.weight_decay, state_dtype=self.state_dtype)
        if hf_checkpointing(model):  # (turned on on the model itself: the same mapping as the argument's)
            args.activation_checkpointing = True
            self.fuyou_options = map_checkpointing(args, self.fuyou_options)
            model.gradient_checkpointing_disable()
        return attach(model, optimizer, options=dataclasses.replace(
            self.fuyou_options, param_groups=groups, max_grad_norm=args.max_grad_norm or None,
            accumulation_steps=args.gradient_accumulation_steps, resume=resume))

    def _move_model_to_device(self, model, device):
        """A model built on the meta device stays there until attach makes it real, one
        layer group at a time, from ``fuyou={"weights": DIR}`` (the Trainer's ``model.to``
        would fail on it: a meta tensor has no data to copy)."""
        if any(p.is_meta for p in model.parameters()):
            if self.fuyou_options_given.weights is None:
                raise ValueError("the model is on the meta device: pass fuyou={'weights': DIR} (its from_pretrained "
                                 "directory) to have attach stream its weights in one layer group at a time")
            return
        super()._move_model_to_device(model, device)

    def close(self, materialize: bool = True) -> None:
        """Detach the model from fuyoud (a subclass closes what else it attached: a streamed
        reference model). ``materialize`` (the default): the model's parameters become
        ordinary tensors holding the trained weights, the whole model in memory; more than
        the host has available is refused (MemoryError), since the model could not be used
        after it anyway: save it first (``save_model``), then ``close(materialize=False)``,
        which leaves an offloaded block's parameters empty."""
        if self.engine is None:
            return
        if materialize:
            need = sum(group_bytes(g) for g in self.engine.groups if g.offloaded is not None)
            available = host_memory_available()
            if need > available:
                raise MemoryError(f"close() would put the model's {need / 2**30:.1f} GiB of offloaded weights in host "
                                  f"memory, more than the {available / 2**30:.1f} GiB available: save it first "
                                  "(save_model), then close(materialize=False)")
        self.engine.close(materialize=materialize)
        self.engine = None

    def _clip_grad_norm(self, model):
        return None  # Fuyou clips, exactly, in the optimizer's step (attach(max_grad_norm=...))

    def _get_grad_norm(self, model, grad_norm=None):
        return self.engine.grad_norm() if self.engine is not None else grad_norm

    # -- checkpoints --------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.args.should_save:
            return
        target = Path(output_dir).resolve() / FUYOU_DIR
        if target.exists():  # (the Trainer overwrites a folder of the same step, a resumed run's say)
            self.engine.session.delete_checkpoint(target)
        self.engine.save_checkpoint(target)
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        self.engine.resume_lr()  # (the scheduler's constructor set its epoch 0's rates)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        pass  # the weights come with attach(resume=...), from Fuyou's checkpoint in the folder

    def _load_best_model(self) -> None:
        """``load_best_model_at_end`` (and so ``EarlyStoppingCallback``): the best checkpoint's
        Fuyou state (master weights, moments, step counts) becomes the engine's, bitwise: the
        model is attached again from it (``load_state_dict`` would not reach the masters)."""
        best = Path(self.state.best_model_checkpoint) / FUYOU_DIR
        if not best.is_dir():
            raise ValueError(f"the best checkpoint {self.state.best_model_checkpoint} has no {FUYOU_DIR}/ (it was not "
                             "written by FuyouTrainer)")
        old, self.engine = self.engine, None
        stand_ins = _stand_ins(old)
        old.close(materialize=False)
        with torch.no_grad():
            for p, data in stand_ins:
                p.data = data
        self.fuyou_options = dataclasses.replace(self.fuyou_options, weights=None)  # (the stand-ins hold the values)
        self.engine = self._attach(str(best.resolve()))
        self.optimizer = self.engine.optimizer

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's, with its rotation (save_total_limit) done here: a folder's Fuyou
        checkpoint is deleted through fuyoud before the folder goes."""
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        if limit and limit > 0 and self.args.should_save:
            self._rotate(self._get_output_dir(trial=trial), limit)

    def _rotate(self, run_dir: str, limit: int) -> None:
        checkpoints = sort_checkpoints(run_dir, use_mtime=True)
        protected = {checkpoints[-1]} if checkpoints else set()
        if self.state.best_model_checkpoint is not None:
            protected.add(str(Path(self.state.best_model_checkpoint)))
        remaining = len(checkpoints)
        for checkpoint in checkpoints:
            if remaining <= max(limit, len(protected)):
                break
            if checkpoint not in protected:
                fuyou = Path(checkpoint) / FUYOU_DIR
                if fuyou.is_dir():
                    self.engine.session.delete_checkpoint(fuyou.resolve())
                shutil.rmtree(checkpoint, ignore_errors=True)
                remaining -= 1

    # -- the model ------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.engine is None:  # (not attached yet: an ordinary model)
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        if is_peft_model(self.model):  # as PEFT saves it: adapter_config.json, adapter_model.safetensors
            save_adapter(self.engine, output_dir)
        else:
            self.engine.export(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def save_merged_model(self, output_dir: str, dtype: torch.dtype | None = None) -> None:
        """A PEFT model's adapters merged into its base weights, saved as a full model
        (``AutoModelForCausalLM.from_pretrained`` loads it), streamed from the SSD array one
        layer group at a time (integrations/peft.py); the tokenizer beside it."""
        if self.engine is None:
            raise RuntimeError("save_merged_model saves what training produced: train() first")
        if not self.args.should_save:
            return
        export_merged(self.engine, output_dir, dtype)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

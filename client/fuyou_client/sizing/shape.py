"""A model's shape as the planner needs it: parameters per block and outside the blocks,
and the FLOPs of a block's and the tail's forward and backward.

From a Hugging Face ``config.json`` (``from_config``, ``from_path``: the file or a model
directory holding it), or counted on a model already built, typically on the meta device
(``from_model``: the blocks attach would find, model/blocks.py). The families below are read
field by field; a field a family needs and the config lacks is an error naming it.

Parameter counts follow each family's modules (untied heads add ``vocab x width``); FLOPs
count every matmul of a block (2 per multiply-add) and attention over the whole ``S x S``
(as ``torch.utils.flop_counter`` counts it), backward twice forward.

Any other family transformers knows (the mixtures of experts among them: Qwen-MoE, OLMoE,
DeepSeek-V3, GLM-4-MoE, Llama 4, gpt-oss) is built from its config on the meta device
(no memory, no download) and counted on its modules. A mixture of experts' FLOPs count
what a token passes through: the dense parameters and ``experts_per_token`` of its routed
experts (sizing/experts.py); its parameters, state and bytes moved count every expert.
Blocks of unequal size (DeepSeek-V3's dense first blocks) are planned at the largest for
buffers, and counted at their sum for totals (``params``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from fuyou_client.sizing import experts as moe


class ShapeError(ValueError):
    """A config the planner cannot read: says which file and field."""


@dataclass(frozen=True)
class Family:
    """How a family's blocks are built: ``gated`` MLPs have three matrices (Llama's
    gate, up, down); ``biases``: which linear layers carry one ("all", "qkv", "none");
    ``norm_bias``: LayerNorm (weight and bias) or RMSNorm (weight); ``positions``: rows of
    learned position embeddings beyond the vocabulary's (0: rotary); ``tied``: the
    default of ``tie_word_embeddings``."""
    gated: bool
    biases: str
    norm_bias: bool
    positions: str | None
    tied: bool
    fields: dict  # our name -> the config's (first found wins)


_LLAMA_FIELDS = {"width": ("hidden_size",), "layers": ("num_hidden_layers",), "heads": ("num_attention_heads",),
                 "kv_heads": ("num_key_value_heads",), "mlp": ("intermediate_size",), "vocab": ("vocab_size",),
                 "head_dim": ("head_dim",)}
# The MLP's activation: the config's field and the family's default (transformers' ACT2FN
# names; BLOOM's is its own GELU, written out like gpt2's gelu_new).
ACTIVATIONS = {"gpt2": ("activation_function", "gelu_new"), "gpt_neox": ("hidden_act", "gelu"),
               "opt": ("activation_function", "relu"), "bloom": (None, "bloom_gelu")}
FAMILIES = {
    "gpt2": Family(False, "all", True, "n_positions", True,
                   {"width": ("n_embd",), "layers": ("n_layer",), "heads": ("n_head",), "mlp": ("n_inner",),
                    "vocab": ("vocab_size",)}),
    "llama": Family(True, "none", False, None, False, _LLAMA_FIELDS),
    "mistral": Family(True, "none", False, None, False, _LLAMA_FIELDS),
    "qwen2": Family(True, "qkv", False, None, False, _LLAMA_FIELDS),
    "gemma": Family(True, "none", False, None, True, _LLAMA_FIELDS),
    "phi3": Family(True, "none", False, None, False, _LLAMA_FIELDS),
    "gpt_neox": Family(False, "all", True, None, False,
                       {"width": ("hidden_size",), "layers": ("num_hidden_layers",),
                        "heads": ("num_attention_heads",), "mlp": ("intermediate_size",), "vocab": ("vocab_size",)}),
    "opt": Family(False, "all", True, "max_position_embeddings", True,
                  {"width": ("hidden_size",), "layers": ("num_hidden_layers",), "heads": ("num_attention_heads",),
                   "mlp": ("ffn_dim",), "vocab": ("vocab_size",)}),
    "bloom": Family(False, "all", True, None, True,
                    {"width": ("hidden_size", "n_embed"), "layers": ("n_layer", "num_hidden_layers"),
                     "heads": ("n_head", "num_attention_heads"), "vocab": ("vocab_size",)}),
}


@dataclass(frozen=True)
class ModelShape:
    """What the planner knows of a model: ``layers`` blocks of ``block_params`` each,
    ``rest_params`` outside them (embeddings, final norm, an untied head), and the
    dimensions its FLOPs follow from."""
    family: str
    layers: int
    width: int
    block_params: int
    rest_params: int
    vocab: int
    attn_width: int  # heads x head_dim: the width of attention's S x S products
    block_matmul_params: int  # of block_params, those in matrices (the FLOPs' share)
    max_seq: int | None = None  # learned positions: the longest sequence it takes
    source: str = ""
    # The parameters of a block's modules and of the rest's, in order (model/cuts.py's atoms:
    # what granularity="module" cuts), each (count, holds an embedding); () where unknown.
    block_atoms: tuple = ()
    rest_atoms: tuple = ()
    kv_width: int | None = None  # key-value heads x head_dim (GQA's narrower); None: unknown
    mlp_width: int | None = None  # the MLP's hidden width; None: unknown (kernels.widths solves it)
    activation: str | None = None  # the MLP's activation as the config names it (ACT2FN's name)
    blocks_params: int | None = None  # every block's parameters together; None: layers x block_params
    # A mixture of experts: routed experts per block and per token; the matrix parameters a
    # token multiplies and all it passes through, per block on average (None: every one).
    experts: int = 0
    experts_per_token: int = 0
    block_active_matmul: float | None = None
    block_active_params: float | None = None
    # A block's atoms with its fused experts cut into parts (model/experts.py: what
    # granularity="expert" cuts); () where it has none.
    expert_atoms: tuple = ()

    @property
    def params(self) -> int:
        return (self.blocks_params if self.blocks_params is not None else self.layers * self.block_params) + \
            self.rest_params

    @property
    def active_params(self) -> float:
        """The parameters one token passes through (all of them but a mixture of experts')."""
        if self.block_active_params is None:
            return self.params
        return self.layers * self.block_active_params + self.rest_params

    @property
    def active_matmul_params(self) -> float:
        """A block's matrix parameters a token multiplies (on average over the blocks)."""
        return self.block_active_matmul if self.block_active_matmul is not None else self.block_matmul_params

    def flops(self, seq: int, micro: int) -> dict:
        """Hardware FLOPs of one micro-batch of ``micro`` sequences of ``seq`` tokens: a
        block's forward and backward (``block_fwd``, ``block_bwd``), the tail's (final
        norm, head, loss: ``tail_fwd``, ``tail_bwd``)."""
        tokens = micro * seq
        block = 2 * tokens * self.active_matmul_params + 4 * micro * seq * seq * self.attn_width
        tail = 2 * tokens * self.width * self.vocab
        return {"block_fwd": block, "block_bwd": 2 * block, "tail_fwd": tail, "tail_bwd": 2 * tail}

    def describe(self) -> str:
        blocks = (f"{self.layers} blocks of {self.block_params / 1e6:.1f}M" if self.blocks_params is None else
                  f"{self.layers} blocks of at most {self.block_params / 1e6:.1f}M")
        routing = (f"; {self.experts} experts per block, {self.experts_per_token} per token: "
                   f"{self.active_params / 1e9:.2f}B active" if self.experts else "")
        return (f"{self.params / 1e9:.2f}B parameters ({self.family}: {blocks}, {self.rest_params / 1e6:.1f}M outside "
                f"them; width {self.width}, vocabulary {self.vocab}{routing})")


def _field(cfg: dict, family: str, name: str, source: str, default=None):
    keys = FAMILIES[family].fields.get(name, ())
    for key in keys:
        if cfg.get(key) is not None:
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ShapeError(f"{source}: {key} must be a positive integer, not {value!r}")
            return value
    if default is not None:
        return default
    raise ShapeError(f"{source}: a {family} config needs {' or '.join(keys) or name} (the model's {name}), "
                     "which it does not have")


def from_config(cfg: dict, source: str = "config", build: bool = True) -> ModelShape:
    """The shape of the model a Hugging Face config (as a dict) describes: read field by
    field for the families above, else (``build``) counted on the model transformers
    builds from it on the meta device."""
    if not isinstance(cfg, dict):
        raise ShapeError(f"{source}: expected a JSON object, not {type(cfg).__name__}")
    family = cfg.get("model_type")
    if family is None:
        raise ShapeError(f"{source}: no model_type field: the planner needs it to know the family "
                         f"(it knows {', '.join(sorted(FAMILIES))} and any other transformers builds); or plan a "
                         "model built on the meta device")
    if family not in FAMILIES:
        if build:
            return _built(cfg, family, source)
        raise ShapeError(f"{source}: model_type {family!r} is not read field by field")
    fam = FAMILIES[family]
    w = _field(cfg, family, "width", source)
    layers = _field(cfg, family, "layers", source)
    heads = _field(cfg, family, "heads", source)
    kv = _field(cfg, family, "kv_heads", source, default=heads)
    head_dim = _field(cfg, family, "head_dim", source, default=w // heads)
    mlp = _field(cfg, family, "mlp", source, default=4 * w)
    vocab = _field(cfg, family, "vocab", source)
    q, kvw = heads * head_dim, kv * head_dim
    attn = w * q + 2 * w * kvw + q * w
    ffn = (3 if fam.gated else 2) * w * mlp
    bias = {"all": q + 2 * kvw + w + (2 * mlp if fam.gated else mlp + w), "qkv": q + 2 * kvw, "none": 0}[fam.biases]
    norms = 2 * w * (2 if fam.norm_bias else 1)
    tied = bool(cfg.get("tie_word_embeddings", fam.tied))
    positions = cfg.get(fam.positions) if fam.positions else None
    if fam.positions and (isinstance(positions, bool) or not isinstance(positions, int) or positions <= 0):
        raise ShapeError(f"{source}: a {family} config needs {fam.positions} (its learned positions) as a positive "
                         f"integer, not {positions!r}")
    extra = {"opt": 2}.get(family, 0)  # (OPT's learned positions keep 2 rows of offset)
    rest = vocab * w * (1 if tied else 2) + (positions + extra if positions else 0) * w + w * (2 if fam.norm_bias else 1)
    if family == "bloom":
        rest += 2 * w  # (the embeddings' own LayerNorm)
    block_atoms, rest_atoms = _atoms(family, fam, w, q, kvw, mlp, vocab, tied, positions, extra)
    assert sum(n for n, _ in block_atoms) == attn + ffn + bias + norms and sum(n for n, _ in rest_atoms) == rest
    field, default = ACTIVATIONS.get(family, ("hidden_act", "silu"))
    activation = str(cfg.get(field) or default) if field else default
    return ModelShape(family, layers, w, attn + ffn + bias + norms, rest, vocab, q, attn + ffn, positions, source,
                      tuple(block_atoms), tuple(rest_atoms), kvw, mlp, activation)


FUSED_QKV = ("gpt2", "gpt_neox", "bloom", "phi3")  # one projection for queries, keys and values
FUSED_GATE_UP = ("phi3",)  # one for the MLP's gate and up


def _atoms(family: str, fam: Family, w: int, q: int, kvw: int, mlp: int, vocab: int, tied: bool, positions,
           extra: int) -> tuple[list, list]:
    """A block's modules and the rest's, as (parameters, holds an embedding), in the
    order the family's modules register them, with their biases (model/cuts.py's atoms)."""
    b = {"all": 1, "qkv": 1, "none": 0}[fam.biases]
    b_out = 1 if fam.biases == "all" else 0
    norm = (2 if fam.norm_bias else 1) * w
    if family in FUSED_QKV:
        attn = [(w * (q + 2 * kvw) + b * (q + 2 * kvw), False), (q * w + b_out * w, False)]
    else:
        attn = [(w * q + b * q, False), (w * kvw + b * kvw, False), (w * kvw + b * kvw, False), (q * w + b_out * w, False)]
    if fam.gated and family in FUSED_GATE_UP:
        ffn = [(2 * w * mlp + b_out * 2 * mlp, False), (mlp * w + b_out * w, False)]
    elif fam.gated:
        ffn = [(w * mlp + b_out * mlp, False), (w * mlp + b_out * mlp, False), (mlp * w + b_out * w, False)]
    else:
        ffn = [(w * mlp + b_out * mlp, False), (mlp * w + b_out * w, False)]
    block = [(norm, False), *attn, (norm, False), *ffn]
    rest = [(vocab * w, True)] + ([((positions + extra) * w, True)] if positions else [])
    rest += [(2 * w, False)] if family == "bloom" else []
    rest += [(norm, False)] + ([] if tied else [(vocab * w, False)])
    return block, rest


def _built(cfg: dict, family: str, source: str) -> ModelShape:
    """Counted on the causal LM transformers builds from ``cfg`` on the meta device."""
    try:
        import torch
        import transformers
    except ImportError:
        raise ShapeError(f"{source}: model_type {family!r} is not one the planner reads field by field "
                         f"({', '.join(sorted(FAMILIES))}), and without transformers it cannot build it to count it: "
                         "pip install \"fuyou[hf]\"") from None
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        config = transformers.AutoConfig.for_model(family, **fields)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as exc:
        raise ShapeError(f"{source}: model_type {family!r}: transformers {transformers.__version__} cannot build a "
                         f"causal LM from this config ({str(exc).splitlines()[0][:200]}); the planner knows "
                         f"{', '.join(sorted(FAMILIES))} field by field, or plan a model built on the meta device") from None
    return replace(from_model(model), source=source)


def from_path(path: str | os.PathLike) -> ModelShape:
    """From a ``config.json``, or a model directory that holds one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ShapeError(f"{p}: no such file (give a config.json or a model directory holding one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShapeError(f"{p}: not a readable JSON config: {exc}") from None
    return from_config(cfg, str(p))


def from_model(model) -> ModelShape:
    """Counted on a model (any device, the meta device included): the blocks attach finds
    (model/blocks.py) and everything else; dimensions from its Hugging Face config where it
    has one, else from the blocks' largest linear layers; a mixture of experts' routing from
    its config (sizing/experts.py)."""
    from fuyou_client.model.blocks import find_blocks
    from fuyou_client.model.cuts import atom_sizes

    found = find_blocks(model)
    if found is None:
        raise ShapeError(f"{type(model).__name__}: no repeated blocks found (an nn.ModuleList of one module type); "
                         "the planner plans models made of blocks")
    blocks = list(found[1])
    total = sum(p.numel() for p in model.parameters())
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    matrices = max(sum(p.numel() for p in b.parameters() if p.dim() >= 2) for b in blocks)
    cfg = getattr(model, "config", None)
    cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    routing = moe.of_config(cfg)
    if routing is not None and not any(moe.routed(n) for b in blocks for n, _ in b.named_parameters()):
        routing = None  # (a config that names experts, a model without them)
    width, vocab, attn, max_seq, kv, mlp, activation = _dims(model, blocks, cfg)
    widest = max(range(len(blocks)), key=lambda i: sizes[i])
    atoms = tuple(atom_sizes(model, blocks[widest], blocks))
    cut = tuple(atom_sizes(model, blocks[widest], blocks, experts=True))
    return ModelShape(cfg.get("model_type") or type(model).__name__, len(blocks), width, sizes[widest],
                      total - sum(sizes), vocab, attn, matrices, max_seq, type(model).__name__,
                      atoms, tuple(atom_sizes(model, None, blocks)), kv,
                      None if routing else mlp, activation, expert_atoms=cut if cut != atoms else (),
                      blocks_params=sum(sizes) if len(set(sizes)) > 1 else None,
                      experts=routing.experts if routing else 0, experts_per_token=routing.per_token if routing else 0,
                      block_active_matmul=sum(moe.active_matmul(b, routing) for b in blocks) / len(blocks) if routing
                      else None,
                      block_active_params=sum(moe.active(b, routing) for b in blocks) / len(blocks) if routing else None)


_WIDTH_FIELDS = ("hidden_size", "n_embd", "d_model")


def _dims(model, blocks: list, cfg: dict) -> tuple:
    """(width, vocabulary, attention width, learned positions, key-value width, MLP width,
    activation): from the config, read as its family is, else its generic fields, else the
    modules."""
    from torch import nn

    from fuyou_client.model.blocks import mlp_layout

    try:
        d = from_config(cfg, type(model).__name__, build=False)
        return d.width, d.vocab, d.attn_width, d.max_seq, d.kv_width, d.mlp_width, d.activation
    except ShapeError:
        pass
    emb = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = cfg.get("vocab_size") or max((m.num_embeddings for m in emb), default=0)
    width = next((cfg[k] for k in _WIDTH_FIELDS if isinstance(cfg.get(k), int) and cfg[k] > 0), 0)
    if not width:
        linears = [m for b in blocks[:1] for m in b.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        width = min((min(m.weight.shape) for m in linears), default=0)
    if not width or not vocab:
        raise ShapeError(f"{type(model).__name__}: its width and vocabulary cannot be read (no Hugging Face config, "
                         "no linear layers or embedding)")
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (width // heads if heads else None)
    attn = heads * head_dim if heads and head_dim else width
    kv_heads = cfg.get("num_key_value_heads")
    kv = kv_heads * head_dim if kv_heads and head_dim else None
    act = cfg.get("hidden_act")
    return width, vocab, attn, None, kv, mlp_layout(blocks[0], width)[1], str(act) if isinstance(act, str) else None


def of(model_or_path) -> ModelShape:
    """A ModelShape as given, from a path, a config dict, or a model."""
    if isinstance(model_or_path, ModelShape):
        return model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        return from_path(model_or_path)
    if isinstance(model_or_path, dict):
        return from_config(model_or_path)
    return from_model(model_or_path)

"""The model bench/bigmodel.py builds, counted: its parameters, its layer groups' sizes,
its MLP's default width, and the qwen3-moe family's config (bench/bigmodel_worker.py builds
the same model)."""
from __future__ import annotations


def moe_config(args, layers: int) -> dict:
    """The qwen3-moe model's config.json fields (what the worker builds)."""
    return {"model_type": "qwen3_moe", "hidden_size": args.width, "num_hidden_layers": layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads or args.heads,
            "head_dim": args.head_dim or args.width // args.heads, "intermediate_size": args.mlp,
            "moe_intermediate_size": args.moe_mlp, "num_experts": args.experts,
            "num_experts_per_tok": args.experts_per_token, "vocab_size": args.vocab, "tie_word_embeddings": False}


def moe_sizes(args, layers: int) -> tuple[int, int]:
    """(a block's parameters, the rest's) of the qwen3-moe model, as the planner counts them
    on the model transformers builds on the meta device."""
    from fuyou_client.sizing.shape import from_config
    shape = from_config(moe_config(args, max(2, layers)))  # (one block is no repeated list: counted on two)
    return shape.block_params, shape.rest_params


def model_params(family: str, width: int, layers: int, vocab: int, seq: int, mlp: int, tied: bool = False,
                 args=None) -> int:
    """Parameters of the model the worker builds (an untied head, unless ``tied``)."""
    if family == "qwen3-moe":
        block, rest = moe_sizes(args, layers)
        return layers * block + rest
    head = 0 if tied else vocab * width
    if family == "llama":  # attention 4 w^2, MLP 3 w m, two RMS norms; embeddings, final norm, head
        return layers * (4 * width * width + 3 * width * mlp + 2 * width) + vocab * width + head + width
    block = 4 * width * width + 4 * width + 2 * width * mlp + mlp + width + 4 * width  # attention, MLP, two norms
    return layers * block + vocab * width + seq * width + 2 * width + head  # wte, wpe, ln_f, lm_head


def default_mlp(family: str, width: int) -> int:
    """GPT-2's 4 w; Llama's 8/3 w rounded up to 256 (11008 at width 4096)."""
    return 4 * width if family == "gpt2" else -(-(8 * width // 3) // 256) * 256


def group_sizes(args, layers: int) -> list[int]:
    """The parameters of each layer group: the blocks, then the rest (with
    ``--granularity expert``: each block's experts as their 16 parts, model/experts.py)."""
    if args.family == "qwen3-moe":
        block, rest = moe_sizes(args, layers)
        if args.granularity != "expert":
            return [block] * layers + [rest]
        from fuyou_client.model.experts import PARTS
        experts = args.experts * 3 * args.width * args.moe_mlp
        return [block - experts, *[experts // PARTS] * PARTS] * layers + [rest]
    block = model_params(args.family, args.width, 1, 0, 0, args.mlp) - (args.width if args.family == "llama" else
                                                                        2 * args.width)
    return [block] * layers + [model_params(args.family, args.width, layers, args.vocab, args.seq, args.mlp, args.tied)
                               - layers * block]

"""The memory-bound traffic and the kernel launches of a block and of the tail, counted on
the operators torch dispatches: the numbers sizing/kernels.py's time model is built from.

    python bench/kernel_counts.py          # the table kernels.TRAFFIC holds, as Python; and the
                                           # saved activations memory/device_plan.py holds

Each family's block (GPT-2: LayerNorm, fused QKV, GELU-tanh written out as HF's gelu_new;
Llama: RMSNorm, rotary, SiLU-gated MLP) and its tail (final norm, head, loss as
transformers computes it), built from a Hugging Face config with SDPA attention, run
forward and backward on the CPU under a TorchDispatchMode that records every operator:
its kind (a matrix multiply, attention, a view that launches nothing, or a memory-bound
kernel) and the bytes of its inputs and outputs. Two precisions: ``bf16`` (the
parameters and activations in bf16: how Fuyou's clients train) and ``autocast`` (fp32
parameters under torch.autocast bf16: how bench/gpu.py's in-GPU runs train); ``fp16``
counts the same as ``bf16`` (the same operators on 2-byte elements: kernels.TRAFFIC_AS,
checked by tests/test_kernel_model.py), so the table holds bf16's. The
memory-bound bytes are split into a part per token (solved for as ``a * width + b * mlp``
(+ ``c * vocab`` in the tail) bytes per token from counts at several shapes) and a part
per parameter (autocast's weight casts, the gradients' casts). The CPU's operators are
the CUDA ones at this level (the same aten calls; only SDPA's kernel differs, counted
as attention either way). tests/test_kernel_model.py counts again and checks the table.

A block's saved activations (``saved``, ``activation_coefficients``): the bytes autograd
packs for its backward (saved_tensors_hooks, each storage once, the block's weights not),
per token as ``a * width + b * mlp``: what a block computing with a graph holds on the
device and what a swapped block sends to the host (memory/device_plan.py).
"""
from __future__ import annotations

import collections
import json
import sys
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operators that only make a view (no kernel, no traffic)
VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "split", "split_with_sizes", "slice",
         "select", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "reshape", "unbind", "_reshape_alias",
         "narrow", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
         "_local_scalar_dense", "is_same_size", "view_as", "expand_as", "sym_size", "sym_stride", "sym_numel",
         "_has_compatible_shallow_copy_type", "clone_noop", "arange", "scalar_tensor"}
GEMMS = {"mm", "addmm", "bmm", "baddbmm"}
LAYOUTS = ("gpt2", "gpt2-fused", "llama")  # sizing/kernels.py's layout()


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class Counter(TorchDispatchMode):
    """Per operator kind: launches and bytes moved (inputs read, outputs written)."""

    def __init__(self):
        super().__init__()
        self.launches, self.bytes = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in VIEWS:
            return out
        kind = "gemm" if name in GEMMS else "attention" if "attention" in name else "memory"
        self.launches[kind] += 1
        self.bytes[kind] += _nbytes(args) + _nbytes(list((kwargs or {}).values())) + _nbytes(out)
        return out


def _config(family: str, width: int, mlp: int, vocab: int, seq: int):
    """``family``: a layout of sizing/kernels.py ("gpt2": GELU written out as gelu_new;
    "gpt2-fused": gelu_pytorch_tanh, one operator; "llama")."""
    import transformers
    heads = max(1, width // 64)
    if family.startswith("gpt2"):
        cfg = transformers.GPT2Config(n_embd=width, n_layer=1, n_head=heads, n_inner=mlp, vocab_size=vocab,
                                      n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
                                      activation_function="gelu_pytorch_tanh" if family == "gpt2-fused" else "gelu_new")
    else:
        cfg = transformers.LlamaConfig(hidden_size=width, num_hidden_layers=1, num_attention_heads=heads,
                                       num_key_value_heads=heads, intermediate_size=mlp, vocab_size=vocab,
                                       max_position_embeddings=seq, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def count(family: str, precision: str, part: str, width: int, mlp: int, vocab: int, micro: int, seq: int) -> dict:
    """One block's (``part="block"``) or the tail's (``"tail"``: final norm, head, loss)
    forward and backward: {"forward"|"backward": (launches by kind, bytes by kind)},
    and the part's parameters."""
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, width, mlp, vocab, seq))
    model = model.to({"autocast": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)).train()
    dtype = next(model.parameters()).dtype
    inner = model.transformer if family.startswith("gpt2") else model.model
    x = torch.randn(micro, seq, width, dtype=dtype, requires_grad=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else nullcontext()
    if part == "block":
        module = inner.h[0] if family.startswith("gpt2") else inner.layers[0]
        kwargs = {}
        if not family.startswith("gpt2"):
            kwargs["position_embeddings"] = inner.rotary_emb(x, torch.arange(seq)[None])

        def forward():
            out = module(x, **kwargs)
            return out[0] if isinstance(out, tuple) else out
    else:
        norm = inner.ln_f if family.startswith("gpt2") else inner.norm
        module = torch.nn.ModuleList([norm, model.lm_head])
        labels = torch.randint(0, vocab, (micro, seq))

        def forward():
            return model.loss_function(logits=model.lm_head(norm(x)), labels=labels, vocab_size=vocab)
    out = {"params": sum(p.numel() for p in module.parameters())}
    with Counter() as f:
        with autocast:
            y = forward()
    grad = torch.ones_like(y) if y.dim() == 0 else torch.randn_like(y)
    with Counter() as b:
        y.backward(grad)
    out["forward"], out["backward"] = (f.launches, f.bytes), (b.launches, b.bytes)
    return out


def coefficients(family: str, precision: str, part: str) -> dict:
    """Per pass: memory-bound bytes per token as a * width + b * mlp (block) or
    a * width + c * vocab (tail), the bytes per parameter, and launches by kind."""
    seq, w1, w2 = 64, 128, 192
    shapes = [(w1, 4 * w1, 256), (w2, 3 * w2, 384)] if part == "block" else [(w1, 4 * w1, 256), (w2, 4 * w2, 512)]
    per_token, per_param, launches = {}, {}, {}
    rows = []
    for width, mlp, vocab in shapes:
        one, two = (count(family, precision, part, width, mlp, vocab, micro, seq) for micro in (1, 2))
        for p in ("forward", "backward"):
            t = (two[p][1]["memory"] - one[p][1]["memory"]) / seq  # bytes per token
            rows.append((p, width, mlp, vocab, t, one[p][1]["memory"] - seq * t, one["params"], one[p][0]))
    for p in ("forward", "backward"):
        (_, wa, ma, va, ta, ra, pa, la), (_, wb, mb, vb, tb, rb, pb, lb) = [r for r in rows if r[0] == p]
        second = (ma, mb) if part == "block" else (va, vb)
        det = wa * second[1] - wb * second[0]
        a = (ta * second[1] - tb * second[0]) / det
        c = (wa * tb - wb * ta) / det
        per_token[p] = (round(a, 2), round(c, 2))
        per_param[p] = round(max(0.0, ra / pa), 2)  # (what is left per part: never below none)
        launches[p] = {k: la[k] for k in ("gemm", "attention", "memory")}
    return {"per_token": per_token, "per_param": per_param, "launches": launches}


def saved(family: str, precision: str, width: int, mlp: int, micro: int, seq: int) -> int:
    """The bytes autograd saves for one block's backward (what a swapped block sends to the
    host, what a block computing with a graph holds): every tensor packed by
    saved_tensors_hooks in its forward, each once as the swapper parks it (the same bytes
    in the same layout: activations/swapper.py's identity; two layouts of one storage count
    twice, as they are sent twice), the parameters' (and views of them) not, the block's
    input (a non-leaf in a model) counted."""
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, width, mlp, 256, seq))
    model = model.to({"autocast": torch.float32, "fp32": torch.float32, "fp16": torch.float16}.get(
        precision, torch.bfloat16)).train()
    inner = model.transformer if family.startswith("gpt2") else model.model
    module = inner.h[0] if family.startswith("gpt2") else inner.layers[0]
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    x = torch.randn(micro, seq, width, dtype=next(model.parameters()).dtype, requires_grad=True) * 1
    kwargs = {} if family.startswith("gpt2") else {"position_embeddings": inner.rotary_emb(x, torch.arange(seq)[None])}
    parked = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            parked[(st.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)] = t.numel() * t.element_size()
        return t
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        module(x, **kwargs)
    return sum(parked.values())


def activation_coefficients(family: str, precision: str) -> tuple[float, float]:
    """A block's saved activations per token as ``a * width + b * mlp`` bytes, solved from
    two shapes (per token: the difference of one and two sequences a micro-batch, so that
    what does not grow with the tokens, autocast's weight copies, drops out)."""
    seq, rows = 64, []
    for width, mlp in ((128, 512), (192, 576)):
        per_token = (saved(family, precision, width, mlp, 2, seq) - saved(family, precision, width, mlp, 1, seq)) / seq
        rows.append((width, mlp, per_token))
    (wa, ma, ta), (wb, mb, tb) = rows
    det = wa * mb - wb * ma
    return round((ta * mb - tb * ma) / det, 2), round((wa * tb - wb * ta) / det, 2)


def activations_table() -> dict:
    return {(family, precision): activation_coefficients(family, precision)
            for family in LAYOUTS for precision in ("bf16", "autocast")}


def table() -> dict:
    return {(family, precision, part): coefficients(family, precision, part)
            for family in LAYOUTS for precision in ("bf16", "autocast") for part in ("block", "tail")}


def literal(counted: dict) -> str:
    """The table as kernels.TRAFFIC's Python literal."""
    def q(x):
        return json.dumps(x).replace("[", "(").replace("]", ")")
    lines = ["TRAFFIC = {"]
    for key, v in counted.items():
        lines += [f"    {q(list(key))}: {{",
                  f'        "per_token": {q(v["per_token"])},',
                  f'        "per_param": {q(v["per_param"])},',
                  f'        "launches": {{"forward": {q(v["launches"]["forward"])},',
                  f'                     "backward": {q(v["launches"]["backward"])}}}}},']
    return "\n".join(lines + ["}"])


def main() -> int:
    import transformers
    print(f"# counted by bench/kernel_counts.py (torch {torch.__version__}, transformers {transformers.__version__})")
    print(literal(table()))
    print("# a block's saved activations per token, a * width + b * mlp bytes at 16 bits "
          "(memory/device_plan.py's SAVED_ACTIVATIONS; autocast's for bench/gpu.py's in-GPU runs)")
    print(f"SAVED_ACTIVATIONS = {activations_table()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

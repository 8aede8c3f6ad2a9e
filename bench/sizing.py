"""The worked examples of docs/guide/sizing.md, from the planner itself.

    python bench/sizing.py            # print the examples' Markdown
    python bench/sizing.py --write    # and replace them in docs/guide/sizing.md

7B, 13B, 70B, a 175B-class model and Llama-3.1-405B (and three mixtures of experts) on a workstation (one 24 GB GPU, 128 GiB,
two NVMe) and a server (one 80 GB GPU, 512 GiB, four NVMe), sequences of 2048 tokens, half a
million tokens per step; GPT-3 175B and Llama-3.1-405B on the Fuyou paper's box (one RTX 4090,
768 GB, twelve NVMe) as the paper trains 175B there (16 sequences of 1024 a step); beside them,
the largest models trained here, read from their committed results. tests/test_sizing.py
checks that the page holds what this prints.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fuyou_client import sizing
from fuyou_proto.units import format_size

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "guide" / "sizing.md"
BEGIN, END = "<!-- examples: bench/sizing.py -->", "<!-- end of examples -->"
SEQ = 2048

MODELS = {  # the published configs' shapes
    "Llama-2-7B": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "intermediate_size": 11008, "vocab_size": 32000},
    "Llama-2-13B": {"model_type": "llama", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
                    "intermediate_size": 13824, "vocab_size": 32000},
    "Llama-2-70B": {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 32000},
    "GPT-3 175B shape": {"model_type": "gpt2", "n_embd": 12288, "n_layer": 96, "n_head": 96, "vocab_size": 50257,
                         "n_positions": 2048},
    "Llama-3.1-405B": {"model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126,
                       "num_attention_heads": 128, "num_key_value_heads": 8, "intermediate_size": 53248,
                       "vocab_size": 128256, "tie_word_embeddings": False},
}
MIXTURES = {  # mixtures of experts, the published configs' shapes (tests/test_planner_experts.py reads them too)
    "Qwen3-235B-A22B": {"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
                        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128,
                        "num_experts_per_tok": 8, "vocab_size": 151936},
    "gpt-oss-120b": {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
                     "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 128,
                     "num_experts_per_tok": 4, "vocab_size": 201088},
    "DeepSeek-V3": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "vocab_size": 129280, "n_group": 8,
                    "topk_group": 4},
}
PAPER_BOX = dict(gpu="rtx4090", ram="768GiB", ssd="12x6.5/3.4GB/s", ssd_size="3.84TB", cores=32)
PAPER_SEQ, PAPER_TOKENS = 1024, 16 * 1024  # (the paper's 175B runs: 16 sequences of 1024 a step)
HOSTS = {
    "workstation": dict(gpu="rtx4090", ram="128GiB", ssd="2x7GB/s", ssd_size="4TB", cores=16),
    "server": dict(gpu="h100", ram="512GiB", ssd="4x7GB/s", ssd_size="7.68TB", cores=64),
}
FULL = ("Llama-2-70B", "workstation")  # the example shown whole


def _where(offload) -> str:
    return {True: "SSD", "host": "host"}[offload]


def row(model_name: str, host_name: str, plan) -> str:
    """One example's table row: the plan chosen, or what does not fit and the least it needs."""
    e, host = plan.best, plan.host
    if e is None:
        short = "; ".join(f"{k} needs {format_size(n)}, has {format_size(h)}" for k, (n, h) in plan.minimums().items()
                          if n > h)
        return f"| {model_name} | {host_name} | does not fit: {short} | | | | | | | |"
    s, m = e.settings, e.memory
    wear = 1000 * e.written_per_step / host.disks.count / 1e12
    return (f"| {model_name} ({e.shape.params / 1e9:.1f}B) | {host_name} | {s.micro_batch} x {s.micro_batches}, "
            f"{s.state_dtype}, weights: {_where(s.offload)}"
            f"{', by module' if s.granularity == 'module' else ', by expert parts' if s.granularity == 'expert' else ''}"
            f"{f', {s.swap_blocks} swapped' if s.swap_blocks else ''} | "
            f"{format_size(m['gpu'])} | {format_size(m['pinned_plan'])} / {format_size(m['host_total'])} | "
            f"{format_size(m['ssd_capacity'])} | {wear:,.0f} TB | {e.tokens_per_second:,.0f} | "
            f"{e.time['model_tflops']:.0f} / {e.time['hardware_tflops']:.0f} | "
            f"{e.binds} ({e.utilisation[e.binds]:.2f}) |")


def rows() -> tuple[list[str], str]:
    """The examples' table rows, and the whole output of the FULL example."""
    out, full = [], ""
    for host_name, kwargs in HOSTS.items():
        host = sizing.host(**kwargs)
        for model_name, cfg in MODELS.items():
            plan = sizing.plan(cfg, on=host, seq=SEQ)
            if (model_name, host_name) == FULL:
                full = str(plan)
            out.append(row(model_name, host_name, plan))
    return out, full


def paper_rows() -> list[str]:
    """GPT-3 175B and Llama-3.1-405B on the paper's box, as the paper trains 175B there."""
    host = sizing.host(**PAPER_BOX)
    return [row(name, "the paper's box", sizing.plan(MODELS[name], on=host, seq=PAPER_SEQ,
                                                     tokens_per_step=PAPER_TOKENS))
            for name in ("GPT-3 175B shape", "Llama-3.1-405B")]


def mixture_rows() -> list[str]:
    """The mixtures of experts on the workstation: a block of each is past its GPU by its
    modules; by expert parts (model/experts.py) it fits."""
    host = sizing.host(**HOSTS["workstation"])
    return [row(name, "workstation", sizing.plan(cfg, on=host, seq=SEQ)) for name, cfg in MIXTURES.items()]


def trained() -> list[str]:
    """The largest models trained here, from their committed results."""
    cpu = json.loads((ROOT / "bench" / "results" / "bigmodel-llama7b-int8-cpu.json").read_text())
    gpu = json.loads((ROOT / "bench" / "results" / "gpu-h100.json").read_text())
    f = gpu["results"]["fuyou"]
    return [
        f"| {cpu['params'] / 1e9:.2f}B, Llama-2-7B shape, int8 state | the 2-core, {cpu['physical_memory_bytes'] / 2**30:.0f} "
        f"GiB reference host, no GPU | {cpu['seconds_per_step']:.0f} s per step ({cpu['seq']} tokens), "
        f"{cpu['ssd_bytes_per_param_per_iter']:.2f} SSD B/param, {cpu['peak_rss_together_bytes'] / 2**30:.2f} GiB "
        f"resident | `bench/results/bigmodel-llama7b-int8-cpu.json` |",
        f"| {gpu['model_params'] / 1e9:.2f}B, GPT-2 family | one H100, capped at {gpu['gpu_cap_bytes'] / 2**30:.0f} GiB | "
        f"{f['tflops']:.1f} model TFLOPS, GPU busy {f['busy']:.2f}, {f['tokens_per_s']:,.0f} tokens/s | "
        f"`bench/results/gpu-h100.json` |"]


def render() -> str:
    table, full = rows()
    return "\n".join([
        BEGIN,
        "| model | host | micro-batch x micro-batches, state, blocks' weights, blocks swapped | GPU | "
        "pinned / host memory | "
        "SSD capacity | written per device per 1,000 steps | tokens/s | model / hardware TFLOPS | binds (busy share) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *table, "",
        f"The whole answer for {FULL[0]} on the {FULL[1]} "
        f"(`fuyouctl plan llama-2-70b/config.json --gpu rtx4090 --ram 128GiB --ssd 2x7GB/s --ssd-size 4TB "
        f"--cores 16 --seq {SEQ}`):", "", "```", full, "```", "",
        f"On the Fuyou paper's box (one RTX 4090, 768 GB, twelve 3.84 TB NVMe drives at 6.5/3.4 GB/s, 32 "
        f"cores; `fuyouctl plan ... --gpu rtx4090 --ram 768GiB --ssd 12x6.5/3.4GB/s --ssd-size 3.84TB --cores 32 "
        f"--seq {PAPER_SEQ} --tokens-per-step {PAPER_TOKENS}`), the paper's 175B run and Llama-3.1-405B, which no "
        "published system fine-tunes on one 24 GB GPU:", "",
        "| model | host | micro-batch x micro-batches, state, blocks' weights, blocks swapped | GPU | "
        "pinned / host memory | "
        "SSD capacity | written per device per 1,000 steps | tokens/s | model / hardware TFLOPS | binds (busy share) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *paper_rows(), "",
        "Mixtures of experts on the workstation (model TFLOPS count the parameters a token passes through: "
        "6 x active parameters x tokens); a block of each is past its 24 GB GPU by its modules, its experts "
        "cut into 16 parts of consecutive experts it fits (`granularity=\"expert\"`):", "",
        "| model | host | micro-batch x micro-batches, state, blocks' weights, blocks swapped | GPU | "
        "pinned / host memory | "
        "SSD capacity | written per device per 1,000 steps | tokens/s | model / hardware TFLOPS | binds (busy share) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *mixture_rows(), "",
        "The largest models trained so far, for comparison (measured, not planned):", "",
        "| model | host | figures | result |", "|---|---|---|---|", *trained(),
        END])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"replace the examples in {PAGE.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        page = PAGE.read_text()
        start, end = page.index(BEGIN), page.index(END) + len(END)
        PAGE.write_text(page[:start] + text + page[end:])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

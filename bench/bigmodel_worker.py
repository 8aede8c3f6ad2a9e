"""The training process of bench/bigmodel.py: builds the model on the meta device, attaches
it to the daemon, trains, and reports one JSON line per event on stdout.

    python bench/bigmodel_worker.py '{"family": "llama", "width": 4096, ...}'

Events: "attached" (seconds, the memory plan), "step" (loss, seconds, optimizer phase,
SSD bytes read and written by the daemon, and by cause: the client's weight reads in
forward and backward, master weights handed to the steps, state served from the cache,
spilled block-major inputs; on CUDA the GPU's busy share and peak memory), "done" (peak
resident memory).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import fuyou_client
from gpu_cases import Busy  # (NVML utilisation sampled every 50 ms)


def build(args: dict):
    """The model on the meta device, its parameters counted."""
    torch.manual_seed(0)
    if args["family"] == "qwen3-moe":  # (every block a mixture of experts, as Qwen3-30B-A3B's)
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=args["width"], intermediate_size=args["mlp"], num_hidden_layers=args["layers"],
            num_attention_heads=args["heads"], num_key_value_heads=args["kv_heads"], head_dim=args["head_dim"],
            moe_intermediate_size=args["moe_mlp"], num_experts=args["experts"],
            num_experts_per_tok=args["experts_per_token"], norm_topk_prob=True, vocab_size=args["vocab"],
            max_position_embeddings=args["seq"], tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        cls = transformers.Qwen3MoeForCausalLM
    elif args["family"] == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=args["width"], intermediate_size=args["mlp"], num_hidden_layers=args["layers"],
            num_attention_heads=args["heads"], num_key_value_heads=args["heads"], vocab_size=args["vocab"],
            max_position_embeddings=args["seq"], tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(
            n_embd=args["width"], n_layer=args["layers"], n_head=args["heads"], n_inner=args["mlp"],
            vocab_size=args["vocab"], n_positions=args["seq"], tie_word_embeddings=bool(args.get("tied")), resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    with torch.device("meta"):
        model = cls(cfg)
    return model.to(torch.bfloat16) if args.get("dtype") == "bf16" else model


def compute_device(name: str, cap: int | None = None):
    """attach's device: the CPU (None: where the model is), CUDA (``cap``: its memory capped
    by torch's per-process fraction), or (``stand-in``) the tests' stand-in for a device
    with its own memory, which runs the CUDA code path here (``cap``: its capacity)."""
    if name == "stand-in":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from discrete_device import LateCopyDevice
        return LateCopyDevice(max_delay=0.0, capacity=cap)
    if name == "cuda" and cap:
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    return None if name == "cpu" else name


def link_bytes(device) -> dict:
    """A stand-in's bytes up and down so far (running totals; none elsewhere)."""
    return {"pcie_up": getattr(device, "bytes_up", 0), "pcie_down": getattr(device, "bytes_down", 0)}


def disk_ticks(disk: str | None) -> float:
    """Seconds the block device has spent with I/O in flight (/proc/diskstats' io_ticks)."""
    if not disk:
        return 0.0
    for line in open("/proc/diskstats"):
        fields = line.split()
        if fields[2] == disk:
            return int(fields[12]) / 1000
    return 0.0


class StepTimes:
    """When each group step was submitted and done (the optimizer phase of an iteration),
    and the disk's busy time then."""

    def __init__(self, session, disk: str | None):
        self.times: list[list[float]] = []
        submit = session.step_group_async

        def timed(*a, **kw):
            fut = submit(*a, **kw)
            rec = [time.perf_counter(), None, disk_ticks(disk), None]

            def done(_f, rec=rec):
                rec[1], rec[3] = time.perf_counter(), disk_ticks(disk)
            fut.add_done_callback(done)
            self.times.append(rec)
            return fut
        session.step_group_async = timed

    def phase(self) -> tuple[float, float]:
        """(the phase's seconds, the share of them the disk was busy)."""
        done = [r for r in self.times if r[1] is not None]
        if not done:
            return 0.0, 0.0
        first, last = min(done, key=lambda r: r[0]), max(done, key=lambda r: r[1])
        seconds = last[1] - first[0]
        return seconds, (last[3] - first[2]) / seconds if seconds else 0.0


def counters(engine) -> dict:
    """The offloader's byte counters, by cause (running totals)."""
    off = engine.offloader
    return {
        "forward_weight_reads": off.fetched_forward if off is not None else 0,
        "backward_weight_reads": off.fetched_bytes - off.fetched_forward if off is not None else 0,
        "backward_weights_served": off.served_bytes if off is not None else 0,
        "weights_reused_from_slots": off.reused_bytes if off is not None else 0,
    } | link_bytes(engine.device)


def draw_seconds(model) -> float:
    """Seconds torch's CPU generator takes to make the draws the model's init makes (one
    stream: ``weights="init"`` is bitwise a CPU build's, so attach cannot go faster): each
    nn.Linear's constructor draws its weight uniformly (kaiming) and each nn.Embedding's
    normally, then the Hugging Face init draws every one again, normally; the norms are
    filled. The rates are measured here, on a generator of its own (the default one's
    state is the init's)."""
    n, gen = 1 << 26, torch.Generator().manual_seed(0)
    t = torch.empty(n)
    t.normal_(generator=gen)  # (first touch)
    t0 = time.perf_counter()
    t.uniform_(-0.01, 0.01, generator=gen)
    t1 = time.perf_counter()
    t.normal_(0.0, 0.02, generator=gen)
    t2 = time.perf_counter()
    per = {"uniform": (t1 - t0) / n, "normal": (t2 - t1) / n}
    seconds = 0.0
    for module in model.modules():
        first = "uniform" if isinstance(module, torch.nn.Linear) else "normal"
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            seconds += module.weight.numel() * (per[first] + per["normal"])
        elif hasattr(module, "num_experts"):  # (fused experts: the HF init's normal draw)
            seconds += sum(p.numel() for p in module.parameters(recurse=False) if p.dim() == 3) * per["normal"]
    return seconds


def main() -> None:
    args = json.loads(sys.argv[1])
    model = build(args)
    params = sum(p.numel() for p in model.parameters())
    init_floor = draw_seconds(model)
    options = {k: args[k] for k in ("prefetch", "host_budget", "granularity", "swap_blocks") if args.get(k) is not None}
    if args["layers"] == 1:  # (one block is no repeated list: name it, or it would be the rest's)
        options["blocks"] = list(model.model.layers if args["family"] != "gpt2" else model.transformer.h)
    k = args["micro_batches"]
    t0 = time.perf_counter()
    engine = fuyou_client.attach(model, fuyou_client.AdamW(lr=args["lr"], weight_decay=0.01,
                                                           state_dtype=args["state_dtype"]),
                                 socket=args["socket"], namespace="bigmodel", weights="init", offload=True,
                                 device=compute_device(args.get("device", "cpu"), args.get("cap")),
                                 activations=args["activations"],
                                 accumulation_steps=k if args["schedule"] == "loop" else 1, **options)
    attach_s = time.perf_counter() - t0
    plan = engine.memory_plan()
    print(json.dumps({"event": "attached", "at": time.monotonic(), "params": params, "seconds": attach_s,
                      "init_draw_seconds": init_floor, "plan": plan.describe(),
                      "plan_bytes": plan.total, "prefetch": plan.prefetch, "weight_slots": plan.weight_slots,
                      "grad_buffers": plan.grad_buffers, "handoff": plan.handoff, "host_budget": plan.host_budget,
                      "chunked_groups": sum(1 for g in engine.groups if g.chunked), "groups": len(engine.groups),
                      "device_plan": plan.device.describe() if plan.device else None,
                      "device_plan_fixed_bytes": plan.device.fixed_bytes if plan.device else None,
                      "device_budget_bytes": plan.device.budget if plan.device else None,
                      "granularity": plan.device.granularity if plan.device else None}), flush=True)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=gen) for _ in range(k)]
    cuda = args.get("device") == "cuda"
    if cuda:
        batches = [b.cuda() for b in batches]
    times = StepTimes(engine.session, args.get("disk"))
    for _ in range(args["steps"]):
        times.times.clear()
        st0, c0 = engine.session.status(), counters(engine)
        cached0 = masters0 = 0
        busy = Busy(cuda).__enter__()
        t0 = time.perf_counter()
        if args["schedule"] == "block-major":
            losses = engine.train_step(batches, lambda mb: model(mb, labels=mb).loss / k).tolist()
            t1 = t2 = time.perf_counter()
        else:
            losses = []
            for i, mb in enumerate(batches):
                loss = model(mb, labels=mb).loss / k
                t1 = time.perf_counter()
                loss.backward()
                losses.append(loss.item())
            t2 = time.perf_counter()
            engine.step()
            engine.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        busy.__exit__(None, None, None)
        infos = engine.last_step_infos
        st1, c1 = engine.session.status(), counters(engine)
        phase, busy = times.phase()
        event = {"event": "step", "at": time.monotonic(), "losses": losses, "loss": sum(losses), "seconds": t3 - t0,
                 "forward": t1 - t0, "backward": t2 - t1, "exposed": t3 - t2, "optimizer": phase,
                 "optimizer_disk_busy": busy,
                 "read": st1.bytes_read - st0.bytes_read, "written": st1.bytes_written - st0.bytes_written,
                 "masters_handed": sum(i.masters_bytes for i in infos) - masters0,
                 "state_cached": sum(i.cached_bytes for i in infos) - cached0}
        event.update({key: c1[key] - c0[key] for key in c1})
        if cuda:
            event.update(gpu_busy=statistics.mean(busy.samples) if busy.samples else None,
                         gpu_peak_bytes=torch.cuda.max_memory_allocated())
        stats = engine.train_step_stats if args["schedule"] == "block-major" else None  # (this step's)
        event.update({"spilled_inputs_written": stats.spilled if stats is not None else 0,
                      "spilled_inputs_read": stats.read_back if stats is not None else 0,
                      "spill_read_wait": stats.read_wait_s if stats is not None else 0.0,
                      "swapped_activations_to_host": stats.activations_to_host if stats is not None else 0,
                      "swapped_activations_written": stats.activations_to_ssd if stats is not None else 0,
                      "swapped_activations_read": stats.activations_from_ssd if stats is not None else 0})
        print(json.dumps(event), flush=True)
    peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"event": "done", "vmhwm": peak, "device_peak_bytes": getattr(engine.device, "peak", None),
                      "device_capacity_bytes": getattr(engine.device, "capacity", None)}), flush=True)
    engine.close(materialize=False)


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        print(json.dumps({"event": "error", "error": f"{type(exc).__name__}: {exc}"[:4000]}), flush=True)
        raise

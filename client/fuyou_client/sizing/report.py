"""The plan as a person reads it: a table of what goes where, bytes and time per step,
what binds, what would help, and every assumed rate with its source."""
from __future__ import annotations

from fuyou_proto.units import format_size

# (plan: a plan_search.Plan, which formats itself with this module: not imported here)


def _where(offload) -> str:
    return {True: "the SSD array", "host": "pinned host memory", False: "the GPU"}[offload]


def _swapped(e) -> str:
    a = e.activations
    if e.settings.schedule != "block-major":
        return ""
    if not a["swapped_blocks"]:
        return "; every block recomputed in backward"
    return f"; {a['swapped_blocks']} of {a['of_blocks']} blocks' activations swapped, not recomputed"


def settings_line(plan) -> str:
    s = plan.best.settings
    how = "engine.train_step (block-major)" if s.schedule == "block-major" else "the ordinary loop"
    return (f"{how}: {s.micro_batch} x {s.seq} tokens per micro-batch, {s.micro_batches} micro-batch{'es' if s.micro_batches > 1 else ''} = "
            f"{s.tokens:,} tokens per step; {s.state_dtype} optimizer state; blocks' weights on {_where(s.offload)}; "
            f"host arena {format_size(plan.best.plan.host_budget)}{_swapped(plan.best)}; "
            f"the model in {s.model_dtype(plan.host)}")


def swap_line(e) -> str | None:
    """The swapped activations' bytes per step, where blocks swap."""
    a = e.activations
    if not a["swapped_blocks"]:
        return None
    return (f"swap    activations of {a['swapped_blocks']} of {a['of_blocks']} blocks, not recomputed: "
            f"{format_size(a['pcie_bytes'] / 2)} down and the same up over PCIe per step; "
            f"{format_size(a['ssd_bytes'] / 2)} of it beyond their host arena ({format_size(a['arena'])}: what the "
            f"kept inputs leave of host_budget) written to the SSD array and read back")


def call_line(plan) -> str:
    s = plan.best.settings
    opts = ", ".join(f"{k}={v!r}" for k, v in s.attach_options().items())
    return (f"attach(model, AdamW(state_dtype={s.state_dtype!r}), {opts})  # model in {s.model_dtype(plan.host)}; "
            "or attach(model, plan=plan)")


def text(plan) -> str:
    shape, host = plan.shape, plan.host
    lines = [f"model   {shape.describe()}", f"host    {host.describe()}"]
    if plan.best is None:
        lines.append("DOES NOT FIT: even the smallest settings (int8 state, one sequence per micro-batch, weights "
                     "on the SSD array) need more than this host has:")
        for k, (need, has) in plan.minimums().items():
            lines.append(f"  {k:<14} needs {format_size(need):>10}, has {format_size(has):>10}" + ("  <- short" if need > has else ""))
        lines += [f"  with {what}: {effect}" for what, effect in plan.advice]
        return "\n".join(lines)
    e = plan.best
    m = e.memory
    lines += [f"plan    {settings_line(plan)}", f"        {call_line(plan)}",
              "memory  " + " | ".join(f"{k} {format_size(e.needs[k])} of {format_size(e.has[k])}" for k in e.needs),
              f"        pinned: {format_size(m['pinned'])} in training ({format_size(m['pinned_plan'])} at attach's peak); "
              f"daemon's own {format_size(m['daemon_own'])}, training process's own {format_size(m['client_own'])}",
              "        SSD: " + ", ".join(f"{k} {format_size(v)}" for k, v in m["ssd_capacity_parts"].items() if v)
              + f"; with one checkpoint copied beside them {format_size(m['ssd_capacity_with_checkpoint'])}"
              + ("" if m["ssd_capacity_with_checkpoint"] <= e.has["SSD capacity"] else
                 " (more than the array has: checkpoint to another disk, or as a snapshot)")]
    read = sum(v for k, v in e.ssd.items() if "read" in k)
    written = e.written_per_step
    lines.append(f"SSD     {e.ssd_bytes_per_param:.2f} B/param per step = {format_size(e.ssd_bytes)} (read {format_size(read)}, "
                 f"written {format_size(written)}); wear {1000 * written / host.disks.count / 1e12:.1f} TB written per "
                 f"device per 1,000 steps")
    if swap_line(e):
        lines.append(swap_line(e))
    if e.time is not None:
        use = ", ".join(f"{k} {v:.2f}" for k, v in sorted(e.utilisation.items(), key=lambda x: -x[1]))
        balance = e.time["balance_tokens"]
        spilled = sum(v for k, v in e.ssd.items() if k.startswith("spilled"))
        lines += [f"time    {e.seconds:.1f} s per step, {e.tokens_per_second:,.0f} tokens/s, "
                  f"{e.time['model_tflops']:.1f} model TFLOPS (6 x {'active ' if e.shape.experts else ''}parameters x tokens / s), "
                  f"{e.time['hardware_tflops']:.1f} hardware TFLOPS (what the GPU executes, recomputation included), "
                  f"GPU busy {e.time['gpu_busy']:.2f}",
                  f"binds   {e.binds} (share of the step each resource is busy: {use}); "
                  + (f"the GPU's compute outlasts the SSD array's {format_size(e.ssd_bytes)} from about "
                     f"{balance:,.0f} tokens per step" if balance is not None else
                     f"the SSD array's {format_size(spilled)} spilled alone outlast the GPU's compute at any tokens "
                     "per step")
                  + (f" (its {format_size(spilled)} spilled growing with them)" if spilled and balance is not None
                     else "")]
    else:
        lines.append("time    not modelled: no GPU (the CPU computes); the SSD bytes above are per step")
    if plan.advice:
        lines.append("helps   " + "; ".join(f"{w}: {x:.2f}x tokens/s" if isinstance(x, float) else f"{w}: {x}"
                                            for w, x in plan.advice))
    lines += ["assumed " + a if i == 0 else "        " + a for i, a in enumerate(e.assumptions)]
    return "\n".join(lines)

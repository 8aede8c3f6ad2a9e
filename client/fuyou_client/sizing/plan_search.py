"""The search: the settings that fit a host and, among them, the fastest; what would
help most; and when nothing fits, the least of each resource the smallest settings need.

The state dtype is chosen by exactness before speed: the most exact one (fp32, then
bf16, then int8) for which some settings fit, unless one is asked for; a less exact one
is offered as advice with its speed-up, never taken silently. Then, for that dtype: where
the blocks' weights live (the SSD array, or pinned host memory where it holds them),
sequences per micro-batch (what the GPU's memory allows), the host arena
(``host_budget``: the memory plan's default, or enough to keep every kept input off the
SSD array) and, for block-major on a GPU by whole blocks, how many blocks swap their
activations instead of recomputing them (``swap_blocks``: none, quarters of the blocks and
as many as host memory holds the activations of, each with an arena that holds them and
the kept inputs; never more: activations through the SSD array would multiply its writes,
its wear, for a few tenths more speed). Micro-batches per step follow from the tokens per
step asked for.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fuyou_client.memory.budget import ARENA_DEFAULT
from fuyou_client.sizing.estimate import Estimate, Settings, estimate, kept_inputs, swapped_activations
from fuyou_client.sizing.hardware import Host
from fuyou_client.sizing.shape import ModelShape
from fuyou_proto.units import format_size

DTYPES = ("fp32", "bf16", "int8")  # most exact first
MICRO = (1, 2, 4, 8, 16, 32)
TOKENS_PER_STEP = 1 << 19  # half a million: a common fine-tuning batch (256 x 2048)
WRITTEN_OUT = {"gelu_new", "gelu_fast"}  # GPT-2 configs' tanh GELUs written out in elementwise operators


@dataclass
class Plan:
    """The planner's answer: ``best`` (None when nothing fits), the smallest settings'
    estimate (``smallest``: what nothing-fits is measured against), ``advice``."""
    shape: ModelShape
    host: Host
    asked: dict
    best: Estimate | None
    smallest: Estimate
    advice: list = field(default_factory=list)  # (what, tokens/s ratio or "fits")
    considered: int = 0

    @property
    def fits(self) -> bool:
        return self.best is not None

    @property
    def settings(self) -> Settings | None:
        return self.best.settings if self.best else None

    def attach_options(self) -> dict:
        if self.best is None:
            raise ValueError("this plan has no settings that fit: " + self.minimums_text())
        return self.best.settings.attach_options()

    def minimums(self) -> dict:
        """Per resource: (what the smallest settings need, what the host has)."""
        return {k: (self.smallest.needs[k], self.smallest.has[k]) for k in self.smallest.needs}

    def minimums_text(self) -> str:
        from fuyou_proto.units import format_size
        return "; ".join(f"{k} needs {format_size(n)} (has {format_size(h)})" for k, (n, h) in self.minimums().items() if n > h)

    def to_dict(self) -> dict:
        return {"fits": self.fits, "asked": self.asked, "host": self.host.describe(),
                "plan": self.best.to_dict() if self.best else None,
                "minimums": {k: {"needs": n, "has": h} for k, (n, h) in self.minimums().items()},
                "advice": [{"change": w, "effect": e} for w, e in self.advice], "considered": self.considered}

    def __str__(self) -> str:
        from fuyou_client.sizing.report import text
        return text(self)


def _fastest(estimates: list[Estimate]) -> Estimate:
    """The fastest, or among those within 1% of it the one taking least host memory (with
    no GPU: the fewest SSD bytes per token)."""
    def cost(e: Estimate) -> float:
        return 1 / e.tokens_per_second if e.time is not None else e.ssd_bytes / e.settings.tokens
    least = min(cost(e) for e in estimates)
    return min((e for e in estimates if cost(e) <= 1.01 * least), key=lambda e: (e.memory["host_total"], cost(e)))


def _granularities(shape: ModelShape, offload) -> tuple[str, ...]:
    """Whole blocks, and (offloaded, where the shape's modules are known) sub-blocks, and
    (a mixture of experts with fused experts) expert parts."""
    if not (offload and shape.block_atoms):
        return ("block",)
    return ("block", "module", "expert") if shape.expert_atoms else ("block", "module")


def _candidates(shape: ModelShape, host: Host, seq: int, tokens: int, dtype: str, micro: int | None,
                offload: tuple, schedule: str, compute: str = "bf16"):
    """Each candidate's estimate without its time (memory, SSD bytes: whether it fits)."""
    for where, granularity in [(w, g) for w in offload for g in _granularities(shape, w)]:
        for m in (micro,) if micro else [m for m in MICRO if m == 1 or m * seq <= tokens]:
            base = Settings(seq=seq, micro_batch=m, micro_batches=max(1, math.ceil(tokens / (m * seq))),
                            schedule=schedule, state_dtype=dtype, offload=where, granularity=granularity,
                            compute=compute)
            e = estimate(shape, base, host, simulate_time=False)
            yield e
            c = 2 if host.gpu else 4
            arena = e.plan.host_budget
            room = min(host.pinned - (e.needs["pinned budget"] - arena),
                       e.has["host memory"] - (e.needs["host memory"] - arena))
            kept = kept_inputs(shape, base, c)
            if kept > ARENA_DEFAULT:  # more arena, less spilled: all of them, or as many as memory holds
                for hb in sorted({kept, min(kept, int(0.95 * room)) >> 20 << 20}):
                    if hb > ARENA_DEFAULT:
                        yield estimate(shape, dataclasses.replace(base, host_budget=hb), host, simulate_time=False)
            if not (host.gpu and schedule == "block-major" and granularity == "block"):
                continue
            # Swapped blocks whose activations host memory holds: train_step gives half the arena to
            # the kept inputs, half to the activations. Not those that would go through the SSD array:
            # a step's activations written and read back multiply the SSD's writes (its wear) several
            # times for a few tenths more speed; swap_blocks given to attach takes that trade knowingly.
            one = swapped_activations(shape, dataclasses.replace(base, swap_blocks=1), c)
            fit = max(0, min(shape.layers, (int(0.95 * room) - kept) // one)) if one else 0
            for n in sorted({n for n in swap_counts(shape.layers) if n <= fit} | ({fit} if fit else set())):
                swapping = dataclasses.replace(base, swap_blocks=n)
                # train_step's arena: the kept inputs' (at most half of it), the rest the activations'
                inputs, acts = kept_inputs(shape, swapping, c), swapped_activations(shape, swapping, c)
                want = max(inputs + acts, 2 * inputs)
                if 2 * ARENA_DEFAULT <= want <= 0.95 * room:
                    yield estimate(shape, dataclasses.replace(swapping, host_budget=want), host, simulate_time=False)


def swap_counts(layers: int) -> list[int]:
    """How many blocks swapping their activations the search weighs (besides none): a
    quarter of the blocks, a half, three quarters, all of them."""
    return sorted({max(1, round(layers * j / 4)) for j in range(1, 5)})


def search(shape: ModelShape, host: Host, seq: int, tokens_per_step: int = TOKENS_PER_STEP,
           state_dtype: str | None = None, micro_batch: int | None = None, offload: bool | str | None = None,
           schedule: str | None = None, advise: bool = True, compute: str = "bf16") -> Plan:
    for name, value in (("seq", seq), ("tokens_per_step", tokens_per_step), ("micro_batch", micro_batch)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be an integer more than zero, not {value!r}")
    if shape.max_seq is not None and seq > shape.max_seq:
        raise ValueError(f"{shape.source}: the model takes sequences of at most {shape.max_seq} tokens "
                         f"(learned positions), not {seq}")
    if state_dtype is not None and state_dtype not in DTYPES:
        raise ValueError(f"state dtype must be one of {', '.join(DTYPES)}, not {state_dtype!r}")
    schedule = schedule or "block-major"
    places = (offload,) if offload is not None else ((True, "host") if host.gpu else (True,))
    asked = {"seq": seq, "tokens_per_step": tokens_per_step, "state_dtype": state_dtype or "auto",
             "micro_batch": micro_batch or "auto", "schedule": schedule, "compute": compute}
    considered, best = 0, None
    for dtype in (state_dtype,) if state_dtype else DTYPES:
        fitting = []
        for e in _candidates(shape, host, seq, tokens_per_step, dtype, micro_batch, places, schedule, compute):
            considered += 1
            if e.fits:
                fitting.append(e.settings)
        if fitting:
            best = _fastest([estimate(shape, s, host) for s in fitting])
            break
    smallest = estimate(shape, Settings(seq=seq, micro_batch=micro_batch or 1, schedule=schedule,
                                        state_dtype=state_dtype or DTYPES[-1], offload=True,
                                        micro_batches=max(1, math.ceil(tokens_per_step / ((micro_batch or 1) * seq))),
                                        host_budget=64 << 20, granularity=_granularities(shape, True)[-1],
                                        compute=compute), host, simulate_time=False)
    plan = Plan(shape, host, asked, best, smallest, considered=considered)
    if advise:
        plan.advice = _advice(plan, seq, tokens_per_step, state_dtype, micro_batch, offload, schedule, compute)
    return plan


def _advice(plan: Plan, seq, tokens, state_dtype, micro, offload, schedule, compute="bf16") -> list:
    """What one change would do: the tokens/s ratio of the best plan after it (the same
    settings re-estimated; more memory: searched again, it may allow more); where nothing
    fits, whether the smallest settings then fit."""
    host, d = plan.host, plan.host.disks
    more_ssd = host.replace(disks=dataclasses.replace(d, count=d.count + 1))
    more_ram = host.replace(memory=2 * host.memory, pinned_budget=2 * host.pinned_budget if host.pinned_budget else None)
    if plan.best is None:
        out = []
        for what, h, dt in (("another SSD", more_ssd, state_dtype), ("twice the host memory", more_ram, state_dtype)):
            other = search(plan.shape, h, seq, tokens, dt, micro, offload, schedule, advise=False, compute=compute)
            out.append((what, "fits" if other.fits else "still does not fit"))
        return out
    best = plan.best
    if best.time is None:
        return []
    s = best.settings
    trials = [("another SSD", estimate(plan.shape, s, more_ssd)),
              ("twice the host memory", search(plan.shape, more_ram, seq, tokens, s.state_dtype, micro, offload,
                                               schedule, advise=False, compute=compute).best),
              ("twice the tokens per step", estimate(plan.shape, dataclasses.replace(
                  s, micro_batches=2 * s.micro_batches), host))]
    if s.state_dtype != "int8":
        trials.append(("int8 optimizer state", estimate(plan.shape, dataclasses.replace(s, state_dtype="int8"), host)))
    trials.append(_more_pinned(plan, seq, tokens, micro, offload, schedule, compute))
    if plan.shape.family == "gpt2" and plan.shape.activation in WRITTEN_OUT:
        one = dataclasses.replace(plan.shape, activation="gelu_pytorch_tanh")
        trials.append((f"activation_function='gelu_pytorch_tanh' ({plan.shape.activation}'s tanh GELU as one "
                       "operator: fewer activations and their bytes; not bitwise the same)",
                       search(one, host, seq, tokens, s.state_dtype, micro, offload, schedule, advise=False,
                              compute=compute).best))
    out = [(what, e.tokens_per_second / best.tokens_per_second) for what, e in trials if e is not None and e.fits]
    return sorted(out, key=lambda x: -x[1])


def _more_pinned(plan: Plan, seq, tokens, micro, offload, schedule, compute) -> tuple[str, Estimate | None]:
    """The daemon's pinned budget (``[memory] pinned_budget``, by default half of the host's
    memory) raised to all the host memory a plan may use: where the best plan then pins more
    than the budget now allows (a larger host arena: more blocks' activations swapped, fewer
    kept inputs on the SSD array), that budget, what the plan pins of it and its speed-up;
    else nothing (the budget does not bind). An operator's change, not a purchase."""
    host, s = plan.host, plan.best.settings
    most = plan.best.has["host memory"]  # (what the plan lets a process use of the host's memory)
    if host.pinned >= most:
        return "", None
    wider = search(plan.shape, host.replace(pinned_budget=most), seq, tokens, s.state_dtype, micro, offload,
                   schedule, advise=False, compute=compute).best
    if wider is None or wider.needs["pinned budget"] <= host.pinned:
        return "", None
    return (f"a pinned budget of {format_size(most)} ([memory] pinned_budget; the plan pins "
            f"{format_size(wider.needs['pinned budget'])} of it)", wider)

"""The compute device's memory, planned like the pinned memory (budget.py) and from the
same plan, before anything is allocated: what a device with memory of its own (a GPU)
holds of a training process, against a budget.

* **Fixed**, from attach on: the weight slots (the pinned plan's count, each as large as
  the largest offloaded group: a block, or with ``granularity="module"`` a sub-block,
  model/cuts.py), the gradient buffers the offloaded groups borrow in backward (the
  block or sub-block in backward and the one whose download runs:
  ``DEVICE_GRAD_BUFFERS``), and each resident group's weights and, where its strategy
  keeps them on the device (gradients/strategy.py), its gradients, in the compute dtype
  (the dtype torch gives a parameter's ``.grad``).
* **Per token of a micro-batch** (``Work``, where the model's width is known): the
  activations of one block computing with a graph (what autograd saves for its backward,
  ``SAVED_ACTIVATIONS``: ``a * width + b * mlp`` bytes per token at 16 bits, counted by
  bench/kernel_counts.py on Hugging Face's GPT-2 and Llama blocks with SDPA attention, whose
  S x S products stay in the fused kernel; other families as the nearer layout, fp32
  models twice the 16-bit bytes) or the tail's logits
  (10 bytes per vocabulary entry: 16-bit logits, their fp32 copy for the loss and its
  gradient), whichever is larger; block-major's kept-input buffers in flight
  (``CHECKPOINT_BUFFERS`` of a block's input, blockmajor/store.py); the ordinary loop's
  saved activations of every block (their inputs only where blocks are recomputed).
* **A reserve** the device keeps for itself (CUDA: its kernels' workspaces and the caching
  allocator's fragmentation: ``Device.memory_reserve``).

``plan_device`` is a pure function of numbers, so the planner (sizing/) prints the same
figures for a host it only describes. A fixed part above the budget is refused at attach
(``DeviceDoesNotFit``, naming the bytes, what holds them and what would fit); the
tokens of a micro-batch are checked where they are known (``train_step``).
"""
from __future__ import annotations

from dataclasses import dataclass

from fuyou_client.errors import ResourceExhausted
from fuyou_client.memory.budget import GroupShape, MemoryPlan
from fuyou_proto.units import format_size

DEVICE_GRAD_BUFFERS = MemoryPlan.DEVICE_GRAD_BUFFERS  # gradients/pool.py: the group in backward, the one downloading
CHECKPOINT_BUFFERS = 8  # block-major's kept inputs on the device at once: uploads and downloads in flight
# What autograd saves for one block's backward, per token, as the swapper parks it (each
# tensor once, in each layout it is saved in): a * width + b * mlp bytes with 16-bit
# parameters (the block's input included, its weights not), by block layout ("gpt2":
# LayerNorm, fused QKV, GELU-tanh written out as HF's gelu_new; "gpt2-fused": the same with an
# activation of one operator, gelu_pytorch_tanh; "llama": RMSNorm computed in fp32, rotary,
# SiLU-gated MLP), dropout off. Counted by ``python bench/kernel_counts.py``
# (activations_table; torch 2.13.0, transformers 5.24.0; tests/test_kernel_model.py counts
# again; train_step's swapped blocks move exactly these bytes, activations_to_host). A GPT-2
# block of MLP 4 x width saves 29 bytes per token and unit of width per byte of the compute
# dtype, a Llama block of MLP 2.75 x width 24: Korthikanti et al.'s 17
# (Reducing Activation Recomputation in Large Transformer Models, 2022) is Megatron's fused
# kernels', not these blocks'.
SAVED_ACTIVATIONS = {"gpt2": (18.04, 10.02), "gpt2-fused": (18.04, 4.02), "llama": (26.04, 8.02)}
LOGIT_BYTES = 10  # per token and vocabulary entry: 16-bit logits, an fp32 copy, its gradient
UNIT_WORDS = {"expert": "expert part"}  # what comes to the device at a time, by granularity, where not its name


def activation_bytes(layout: str, width: int, mlp: int, compute_bytes: int) -> int:
    """A block's saved activations per token (``layout``: a key of SAVED_ACTIVATIONS, the
    families' blocks as counted; ``mlp``: its MLP's width), for parameters of
    ``compute_bytes`` (16-bit counts scaled by ``compute_bytes / 2``, rounded up)."""
    a, b = SAVED_ACTIVATIONS[layout]
    return -(-int((a * width + b * mlp) * compute_bytes * 50) // 100)  # (x compute_bytes / 2, rounded up)


@dataclass(frozen=True)
class Work:
    """What one micro-batch computes, as the plan needs it: the model's width and
    vocabulary, its blocks, the compute dtype, and the schedule (``"block-major"``:
    ``train_step``; ``"loop"``: the ordinary loop, keeping every block's activations or,
    ``recompute``, their inputs only)."""
    width: int
    vocab: int
    layers: int
    compute_bytes: int
    schedule: str = "block-major"
    recompute: bool = True
    layout: str = "gpt2"  # the block's, as SAVED_ACTIVATIONS counts it
    mlp: int | None = None  # the MLP's width (None: 4 x width)

    @property
    def activations(self) -> int:
        """One block's saved activations per token."""
        return activation_bytes(self.layout, self.width, self.mlp or 4 * self.width, self.compute_bytes)


@dataclass(frozen=True)
class DeviceItem:
    what: str
    count: int
    each: int  # bytes per buffer; per token for the per-token items
    why: str
    activation: bool = False  # the model's own tensors (not what the engine allocates)

    @property
    def nbytes(self) -> int:
        return self.count * self.each


@dataclass(frozen=True)
class DevicePlan:
    budget: int | None  # what the plan may take (None: not checked)
    reserve: int  # kept aside for the device itself, within the budget's source (not in it)
    fixed: tuple[DeviceItem, ...]
    per_token: tuple[DeviceItem, ...]  # bytes per token of a micro-batch
    granularity: str = "block"

    @property
    def fixed_bytes(self) -> int:
        return sum(i.nbytes for i in self.fixed)

    @property
    def token_bytes(self) -> int:
        return sum(i.nbytes for i in self.per_token)

    def total(self, tokens: int, activations: bool = True) -> int:
        """Peak bytes with micro-batches of ``tokens`` tokens (``activations=False``: what
        the engine allocates only, without the model's own tensors)."""
        return self.fixed_bytes + tokens * sum(i.nbytes for i in self.per_token if activations or not i.activation)

    def max_tokens(self, activations: bool = True) -> int | None:
        """The most tokens a micro-batch may have within the budget (None: no budget or no
        estimate; ``activations``: as ``total``)."""
        per = self.total(1, activations) - self.fixed_bytes
        if self.budget is None or not per:
            return None
        return max(0, (self.budget - self.fixed_bytes) // per)

    @property
    def fits(self) -> bool:
        """Whether the fixed part fits the budget."""
        return self.budget is None or self.fixed_bytes <= self.budget

    def describe(self, tokens: int | None = None) -> str:
        head = (f"device plan: {format_size(self.fixed_bytes)} fixed"
                + (f" + {format_size(self.token_bytes)} per token of a micro-batch" if self.token_bytes else "")
                + (f" (budget {format_size(self.budget)}, {format_size(self.reserve)} kept for the device)"
                   if self.budget is not None else "")
                + f"; weights come to it by {UNIT_WORDS.get(self.granularity, self.granularity)}")
        rows = [f"  {i.what:<34} {i.count:>3} x {format_size(i.each):>10} = {format_size(i.nbytes):>10}  {i.why}"
                for i in self.fixed if i.count and i.each]
        rows += [f"  {i.what:<34} {i.count:>3} x {i.each:>7} B/token = {format_size(i.nbytes):>8}/token  {i.why}"
                 for i in self.per_token if i.count and i.each]
        tail = []
        if tokens is not None:
            tail.append(f"  at {tokens} tokens a micro-batch: {format_size(self.total(tokens))}")
        elif self.max_tokens() is not None:
            tail.append(f"  room for micro-batches of up to {self.max_tokens()} tokens (estimated)")
        return "\n".join([head, *rows, *tail])

    def __str__(self) -> str:
        return self.describe()


class DeviceDoesNotFit(ResourceExhausted):
    """The device plan is larger than its budget: the message names the bytes, what holds
    them and what to change; ``plan`` is that plan."""

    def __init__(self, message: str, plan: DevicePlan | None = None):
        super().__init__(message)
        self.plan = plan


def plan_device(groups: list[GroupShape], pinned: MemoryPlan, work: Work | None, budget: int | None,
                reserve: int = 0, granularity: str = "block") -> DevicePlan:
    """The device's share of a training process with these groups and this pinned plan
    (its weight slots and gradient buffers are the device's too)."""
    fixed = [DeviceItem("weight slots", pinned.weight_slots, pinned.slot_bytes,
                        f"the {UNIT_WORDS.get(granularity, granularity)} computing, {pinned.prefetch} ahead"
                        + (f", {pinned.keep} kept" if pinned.keep else "") + ", spare or held"),
             DeviceItem("weight slots, blocks' own groups", pinned.own_slots, pinned.own_slot_bytes,
                        "a cut block's small modules, held while its sub-blocks come"),
             DeviceItem("gradient buffers", pinned.device_grad_buffers, pinned.grad_bytes,
                        f"the {UNIT_WORDS.get(granularity, granularity)} in backward, the one whose gradients go down"),
             DeviceItem("gradient buffers, blocks' own groups", min(pinned.own_grad_buffers, DEVICE_GRAD_BUFFERS),
                        pinned.own_grad_bytes, "a cut block's small modules"),
             DeviceItem("weight slots, the rest's sub-blocks", pinned.rest_slots, pinned.rest_slot_bytes,
                        "the embeddings or the head, larger than any block's sub-block"),
             DeviceItem("gradient buffers, the rest's sub-blocks", min(pinned.rest_grad_buffers, DEVICE_GRAD_BUFFERS),
                        pinned.rest_grad_bytes, "the head's and the embeddings'")]
    hosted = [g for g in groups if g.strategy == "host" and g.numel]
    if hosted:  # (each backward's .grad, queued for its download to the host: gradients/host.py)
        n = max(g.numel for g in hosted)
        fixed.append(DeviceItem("gradients on their way to the host", 1 + min(2, pinned.staging_buffers - 1),
                                n * max(g.itemsize for g in hosted),
                                "the group in backward's .grad, and those waiting for their download"))
    for g in groups:
        if not g.offload and g.numel:
            fixed.append(DeviceItem(f"{g.name} weights", 1, g.weight_bytes, "resident"))
        if g.strategy in ("resident", "sharded", "remote") and g.numel:
            fixed.append(DeviceItem(f"{g.name} gradients", 1, g.weight_bytes,
                                    "kept until its step" if g.strategy == "resident" else "until reduced"))
    per_token = []
    if work is not None:
        c, w = work.compute_bytes, work.width
        per_token.append(DeviceItem("working set", 1, max(work.activations, LOGIT_BYTES * work.vocab),
                                    "a block's activations with a graph, or the tail's logits", activation=True))
        if work.schedule == "block-major":
            per_token.append(DeviceItem("kept inputs in flight", CHECKPOINT_BUFFERS, c * w,
                                        "block-major: block inputs and their gradients up and down"))
        else:
            per_token.append(DeviceItem("saved activations", work.layers,
                                        c * w if work.recompute else work.activations,
                                        "every block's input (recomputed)" if work.recompute else
                                        "every block's activations (kept)", activation=True))
    return DevicePlan(budget, reserve, tuple(i for i in fixed if i.count and i.each), tuple(per_token), granularity)


def refusal(plan: DevicePlan, other: DevicePlan | None = None) -> str:
    """Why ``plan`` does not fit its budget, and what would (``other``: the same model at
    the other granularity, where one was tried)."""
    held = ", ".join(f"{i.what} {format_size(i.nbytes)}" for i in sorted(plan.fixed, key=lambda i: -i.nbytes)[:4])
    slot = next((i.each for i in plan.fixed if i.what == "weight slots"), 0)
    text = (f"this model does not fit the compute device's memory: by {plan.granularity}, the device plan holds "
            f"{format_size(plan.fixed_bytes)} before any activation ({held}) and the budget is "
            f"{format_size(plan.budget)}" + (f"; its largest {plan.granularity} alone is {format_size(slot)}"
                                             if slot else "") + ".")
    if other is not None:
        text += f" By {other.granularity} it would hold {format_size(other.fixed_bytes)}."
    ways = ["give the device more (attach(device_memory=...), or free what other processes hold)"]
    if plan.granularity == "block":
        ways.append('granularity="module" (a block\'s large modules one at a time)')
    if any(i.why == "kept until its step" and i.what != "rest gradients" for i in plan.fixed):
        ways.append('grad_accumulation="host" (the gradients accumulation or clipping keep until the step: '
                    'on the host)')
    ways += ["prefetch=0", "bf16 weights"]
    return text + " To fit: " + ", ".join(ways) + ".\n" + plan.describe()

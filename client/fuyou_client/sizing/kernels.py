"""The GPU's time by shape: a block's forward, backward and recomputation, and the tail's
(final norm, head, loss), summed from the kernels they launch.

* **Matrix multiplies** (GEMMs) from their shape (M, N, K): the longer of ``2MNK`` FLOPs at
  the GPU's dense bf16 peak times an efficiency, and their operands' bytes at its memory
  bandwidth (a roofline). The efficiency rises with the GEMM's dimensions,
  ``wide / (1 + E / K + E**2 / (M * N))``: ``wide`` is what large bf16 GEMMs reach on that
  GPU (a published measurement, named in each profile); the reduction's length K pays for
  filling each output tile's pipeline, the output's area M x N for the last wave of tiles;
  ``E = GEMM_EDGE`` is fitted on bench/gpu.py's in-GPU runs (bench/kernel_fit.py; of the
  one-parameter forms tried it reproduced them best: this one within 1.9%, the symmetric
  ``1 + E (1/M + 1/N + 1/K)`` within 2.7%, K alone within 5%). A block's GEMMs: QKV (one
  fused matrix, or Q, K and V with the key-value width), attention's output, the MLP's up
  (and gate) and down; backward two per forward GEMM (the input's gradient and the
  weight's). Families other than GPT-2's and Llama's are priced as the nearer of the two.
* **Attention**: FlashAttention-style fused kernels, as torch's SDPA runs them (flash
  backend: the ``S x S`` products never reach memory), causal (half of the ``S x S``
  work, a block's edge more), backward 2.5 times forward's FLOPs; at a share of the peak
  the profile names (FlashAttention-2's published utilisation).
* **Memory-bound kernels** (norms, activations, residual adds, casts, bias gradients,
  the loss's softmax): bytes counted on the operators torch dispatches for the family's
  block (bench/kernel_counts.py: ``TRAFFIC``), per token and per parameter, at the
  memory bandwidth times ``HBM_EFFICIENCY``. The gradient's sum over micro-batches (read,
  add, write per parameter) is added to backward.
* **Launches**: a kernel takes at least ``LAUNCH_S`` (the host's issue time per kernel,
  fitted on the same runs): a pass of short kernels is bound by the CPU issuing them.

``GpuKernels.of(profile)`` prices it all for one GPU; ``block_seconds`` and ``tail_seconds``
are what the iteration model calls (a block's forward, its recomputed backward, or its
backward alone where its activations were swapped instead of recomputed). Each pass's time
is ``busy`` (kernels running, what NVML's utilisation reads) plus ``idle`` (waiting for
launches).

Precisions: ``"bf16"`` and ``"fp16"`` (parameters and activations in that dtype: Fuyou's
clients compute in the model's own dtype) and ``"autocast"`` (fp32 parameters under
torch.autocast bf16, fp32 residual stream: how bench/gpu.py's in-GPU runs train, the runs
this model is fitted on). fp16 moves the bytes bf16 does (2 per element, the same
operators); its GEMMs run at the profile's fp16 peak and share (``GpuKernels.of(profile,
"fp16")``: torch accumulates them in fp32, so on the profiles shipped the peak is bf16's).
FlashAttention-2 runs both alike.

Hardware FLOPs (what the GPU executed): each pass's GEMMs (``2 M N K``) and attention as
shape.ModelShape.flops counts them (the ``S x S`` products whole); iteration.executed_flops
counts a schedule's passes, recomputation included.
"""
from __future__ import annotations

from dataclasses import dataclass

# Fitted on every in-GPU run recorded (bench/results/gpu-h100.json and
# bench/results/gpu-h200/gpu-bench-*.json: the capped ceiling and the same model in GPU
# memory, 2048-wide GPT-2 blocks, micro-batches of 2 to 16 sequences of 1024) by
# ``python bench/kernel_fit.py``: GEMM_EDGE on the kernels' busy time (NVML's utilisation
# times the micro-batch's time), LAUNCH_S on the rest (the GPU idle between kernels).
GEMM_EDGE = 1973.0
LAUNCH_S = 3.00e-05
# Assumed: elementwise kernels stream at 90% of the datasheet's memory bandwidth (large
# contiguous tensors; a device-to-device copy reaches about that).
HBM_EFFICIENCY = 0.90
CAUSAL_BLOCK = 128  # FlashAttention's tile along the sequence: the causal diagonal's extra work

# Memory-bound traffic and launches, counted by ``python bench/kernel_counts.py`` (torch
# 2.13.0, transformers 5.24.0; tests/test_kernel_model.py counts again): per family layout
# (gpt2: LayerNorm, fused QKV with biases, GELU-tanh as HF's gelu_new writes it out;
# gpt2-fused: the same with gelu_pytorch_tanh, the GELU one operator; llama:
# RMSNorm in fp32, rotary, SiLU-gated MLP), precision and part (a block; the tail: final
# norm, head, loss), per pass: bytes per token = a * width + b * mlp (tail: a * width +
# b * vocab), bytes per parameter, and launches of GEMMs, attention and memory-bound
# kernels.
TRAFFIC = {
    ("gpt2", "bf16", "block"): {
        "per_token": {"forward": (19.98, 36.02), "backward": (45.98, 58.02)},
        "per_param": {"forward": 0.01, "backward": 0.02},
        "launches": {"forward": {"gemm": 4, "attention": 1, "memory": 12},
                     "backward": {"gemm": 8, "attention": 1, "memory": 20}}},
    ("gpt2", "bf16", "tail"): {
        "per_token": {"forward": (4.94, 17.77), "backward": (6.19, 25.95)},
        "per_param": {"forward": 0.0, "backward": 0.03},
        "launches": {"forward": {"gemm": 1, "attention": 0, "memory": 5},
                     "backward": {"gemm": 2, "attention": 0, "memory": 4}}},
    ("gpt2", "autocast", "block"): {
        "per_token": {"forward": (47.96, 36.04), "backward": (93.96, 58.04)},
        "per_param": {"forward": 5.99, "backward": 6.02},
        "launches": {"forward": {"gemm": 4, "attention": 1, "memory": 22},
                     "backward": {"gemm": 8, "attention": 1, "memory": 32}}},
    ("gpt2", "autocast", "tail"): {
        "per_token": {"forward": (15.0, 17.75), "backward": (18.25, 25.94)},
        "per_param": {"forward": 5.92, "backward": 6.02},
        "launches": {"forward": {"gemm": 1, "attention": 0, "memory": 7},
                     "backward": {"gemm": 2, "attention": 0, "memory": 6}}},
    ("gpt2-fused", "bf16", "block"): {
        "per_token": {"forward": (19.98, 4.02), "backward": (45.98, 8.02)},
        "per_param": {"forward": 0.01, "backward": 0.02},
        "launches": {"forward": {"gemm": 4, "attention": 1, "memory": 5},
                     "backward": {"gemm": 8, "attention": 1, "memory": 10}}},
    ("gpt2-fused", "bf16", "tail"): {
        "per_token": {"forward": (4.94, 17.77), "backward": (6.19, 25.95)},
        "per_param": {"forward": 0.0, "backward": 0.03},
        "launches": {"forward": {"gemm": 1, "attention": 0, "memory": 5},
                     "backward": {"gemm": 2, "attention": 0, "memory": 4}}},
    ("gpt2-fused", "autocast", "block"): {
        "per_token": {"forward": (47.96, 4.04), "backward": (93.96, 8.04)},
        "per_param": {"forward": 5.99, "backward": 6.02},
        "launches": {"forward": {"gemm": 4, "attention": 1, "memory": 15},
                     "backward": {"gemm": 8, "attention": 1, "memory": 22}}},
    ("gpt2-fused", "autocast", "tail"): {
        "per_token": {"forward": (15.0, 17.75), "backward": (18.25, 25.94)},
        "per_param": {"forward": 5.92, "backward": 6.02},
        "launches": {"forward": {"gemm": 1, "attention": 0, "memory": 7},
                     "backward": {"gemm": 2, "attention": 0, "memory": 6}}},
    ("llama", "bf16", "block"): {
        "per_token": {"forward": (123.88, 10.12), "backward": (285.81, 18.19)},
        "per_param": {"forward": 0.13, "backward": 0.13},
        "launches": {"forward": {"gemm": 7, "attention": 1, "memory": 30},
                     "backward": {"gemm": 14, "attention": 1, "memory": 56}}},
    ("llama", "bf16", "tail"): {
        "per_token": {"forward": (37.25, 17.69), "backward": (96.69, 25.83)},
        "per_param": {"forward": 0.0, "backward": 0.02},
        "launches": {"forward": {"gemm": 1, "attention": 0, "memory": 12},
                     "backward": {"gemm": 2, "attention": 0, "memory": 19}}},
    ("llama", "autocast", "block"): {
        "per_token": {"forward": (177.88, 10.12), "backward": (409.81, 18.19)},
        "per_param": {"forward": 6.25, "backward": 6.25},
        "launches": {"forward": {"gemm": 7, "attention": 1, "memory": 40},
                     "backward": {"gemm": 14, "attention": 1, "memory": 72}}},
    ("llama", "autocast", "tail"): {
        "per_token": {"forward": (35.25, 17.69), "backward": (102.69, 25.83)},
        "per_param": {"forward": 5.93, "backward": 6.01},
        "launches": {"forward": {"gemm": 1, "attention": 0, "memory": 12},
                     "backward": {"gemm": 2, "attention": 0, "memory": 19}}},
}
ONE_OPERATOR = {"gelu", "gelu_pytorch_tanh", "relu", "silu", "swish"}  # ACT2FN's activations of one kernel
PRECISIONS = ("bf16", "fp16", "autocast")
TRAFFIC_AS = {"bf16": "bf16", "fp16": "bf16", "autocast": "autocast"}  # (fp16's bytes: bf16's)
GATED = {"llama", "mistral", "qwen2", "gemma", "phi3"}  # SiLU-gated MLP, RMSNorm: counted as llama's


@dataclass(frozen=True)
class Time:
    """Seconds of kernels running (``busy``) and of the GPU waiting for their launches."""
    busy: float = 0.0
    idle: float = 0.0

    @property
    def seconds(self) -> float:
        return self.busy + self.idle

    def __add__(self, other: "Time") -> "Time":
        return Time(self.busy + other.busy, self.idle + other.idle)

    def __mul__(self, k: float) -> "Time":
        return Time(self.busy * k, self.idle * k)

    __rmul__ = __mul__


def layout(shape) -> str:
    """The block as counted: "llama" (SiLU-gated MLP, RMSNorm), else GPT-2's with its
    activation in one operator ("gpt2-fused": F.gelu, gelu_pytorch_tanh, ReLU, SiLU) or
    written out ("gpt2": HF's gelu_new, six elementwise operators; any activation not
    known to be one operator counts so, the larger)."""
    if shape.family in GATED:
        return "llama"
    return "gpt2-fused" if getattr(shape, "activation", None) in ONE_OPERATOR else "gpt2"


def widths(shape) -> tuple[int, int, int]:
    """(query width, key-value width, MLP width) of a block: from the shape where it says
    (``kv_width``, ``mlp_width``), else the key-value width taken as the query's and the MLP
    width solved from the block's matrix parameters (exact FLOPs either way)."""
    w, q = shape.width, shape.attn_width
    kv = getattr(shape, "kv_width", None) or q
    mlp = getattr(shape, "mlp_width", None)
    if not mlp:
        ffn = getattr(shape, "active_matmul_params", shape.block_matmul_params) - (2 * w * q + 2 * w * kv)
        mlp = max(1, round(ffn / ((3 if layout(shape) == "llama" else 2) * w)))
    return q, kv, mlp


def block_gemms(shape, tokens: int) -> list[tuple[int, int, int]]:
    """A block's forward GEMMs as (M, N, K): M the tokens."""
    w = shape.width
    q, kv, mlp = widths(shape)
    attn = [(tokens, q + 2 * kv, w)] if layout(shape) != "llama" else [(tokens, q, w), (tokens, kv, w), (tokens, kv, w)]
    up = [(tokens, mlp, w)] * (2 if layout(shape) == "llama" else 1)
    return attn + [(tokens, w, q)] + up + [(tokens, w, mlp)]


def backward_gemms(gemms: list) -> list[tuple[int, int, int]]:
    """Per forward GEMM (M, N, K): the input's gradient (M, K, N) and the weight's (K, N, M)."""
    return [g for m, n, k in gemms for g in ((m, k, n), (k, n, m))]


@dataclass(frozen=True)
class GpuKernels:
    """The kernel-by-kernel time model for one GPU (``of(profile)``: its datasheet's peak
    and memory bandwidth, its GEMMs' and attention's published efficiencies, the launch
    floor)."""
    peak_tflops: float  # the GEMMs' dense peak in the compute dtype
    hbm_gbps: float  # the datasheet's
    gemm_efficiency: float  # of the peak, wide GEMMs
    attention_efficiency: float
    launch_s: float = LAUNCH_S
    gemm_edge: float = GEMM_EDGE
    hbm_efficiency: float = HBM_EFFICIENCY
    compute: str = "bf16"  # whose GEMM peak and share these are

    @classmethod
    def of(cls, profile, compute: str = "bf16", **overrides) -> "GpuKernels":
        """The model of ``profile`` (hardware.GpuProfile) computing in ``compute``."""
        gemms = profile.gemms(compute)
        fields = {"peak_tflops": gemms.peak_tflops, "hbm_gbps": profile.hbm, "gemm_efficiency": gemms.efficiency.value,
                  "attention_efficiency": profile.attention_efficiency.value, "launch_s": profile.launch_s.value,
                  "compute": compute}
        return cls(**fields | overrides)

    @property
    def peak(self) -> float:  # FLOP/s
        return self.peak_tflops * 1e12

    @property
    def hbm(self) -> float:  # bytes/s that memory-bound kernels reach
        return self.hbm_gbps * 1e9 * self.hbm_efficiency

    # -- one kernel each
    def gemm_efficiency_at(self, m: int, n: int, k: int) -> float:
        e = self.gemm_edge
        return self.gemm_efficiency / (1 + e / k + e * e / (m * n))

    def gemm_s(self, m: int, n: int, k: int, nbytes: int = 2) -> float:
        compute = 2 * m * n * k / (self.gemm_efficiency_at(m, n, k) * self.peak)
        return max(compute, nbytes * (m * k + k * n + m * n) / self.hbm)

    def attention_s(self, micro: int, seq: int, width: int, backward: bool) -> float:
        causal = 0.5 + min(0.5, CAUSAL_BLOCK / (2 * seq))
        flops = 4 * micro * seq * seq * width * causal * (2.5 if backward else 1.0)
        return flops / (self.attention_efficiency * self.peak)

    def memory_s(self, nbytes: float) -> float:
        return nbytes / self.hbm

    def _launched(self, seconds: list[float]) -> Time:
        busy = sum(seconds)
        return Time(busy, sum(max(0.0, self.launch_s - s) for s in seconds))

    def _memory(self, nbytes: float, launches: int) -> Time:
        if launches <= 0:
            return Time(self.memory_s(nbytes), 0.0)
        each = self.memory_s(nbytes) / launches  # (the bytes spread evenly over the pass's kernels)
        return Time(launches * each, launches * max(0.0, self.launch_s - each))

    # -- a pass
    def block_pass(self, shape, micro: int, seq: int, which: str, precision: str = "bf16") -> Time:
        """One block, one micro-batch of ``micro`` x ``seq`` tokens: ``"forward"`` or
        ``"backward"`` (the gradients alone; a recomputed backward is forward plus this),
        with the gradients' sum into the parameters' ``.grad`` in backward."""
        tokens = micro * seq
        traffic = TRAFFIC[(layout(shape), TRAFFIC_AS[precision], "block")]
        gemms = block_gemms(shape, tokens)
        if which == "backward":
            gemms = backward_gemms(gemms)
        q, _, mlp = widths(shape)
        a, b = traffic["per_token"][which]
        nbytes = tokens * (a * shape.width + b * mlp) + traffic["per_param"][which] * shape.block_params
        launches = traffic["launches"][which]["memory"]
        if which == "backward":  # .grad += this micro-batch's: read both, write one
            grad = 4 if precision == "autocast" else 2
            nbytes += 3 * grad * shape.block_params
            launches += 9 if layout(shape) == "llama" else 12  # (one per parameter tensor)
        t = self._launched([self.gemm_s(*g) for g in gemms])
        t += self._launched([self.attention_s(micro, seq, q, which == "backward")])
        return t + self._memory(nbytes, launches)

    def tail_pass(self, shape, micro: int, seq: int, which: str, precision: str = "bf16") -> Time:
        """The tail (final norm, head, loss) for one micro-batch: ``"forward"``,
        ``"input_grad"`` (backward to the tail's input: the head's input gradient and the
        memory-bound backward) or ``"weight_grad"`` (the head's weight gradient)."""
        tokens = micro * seq
        traffic = TRAFFIC[(layout(shape), TRAFFIC_AS[precision], "tail")]
        head = (tokens, shape.vocab, shape.width)
        if which == "forward":
            gemms, which_traffic = [head], "forward"
        elif which == "input_grad":
            gemms, which_traffic = [backward_gemms([head])[0]], "backward"
        else:
            return self._launched([self.gemm_s(*backward_gemms([head])[1])])
        a, b = traffic["per_token"][which_traffic]
        nbytes = tokens * (a * shape.width + b * shape.vocab) + \
            traffic["per_param"][which_traffic] * shape.width * shape.vocab
        return self._launched([self.gemm_s(*g) for g in gemms]) + \
            self._memory(nbytes, traffic["launches"][which_traffic]["memory"])

    # -- what the iteration model asks
    def block_seconds(self, shape, micro: int, seq: int, which: str, precision: str = "bf16") -> float:
        """``"forward"``; ``"backward"`` recomputed: forward again, then the gradients; or
        ``"backward only"``: the gradients alone, from activations kept (a swapped block's:
        blockmajor/swapped.py), the same kernels as the recomputed backward's second part."""
        if which == "backward only":
            return self.block_pass(shape, micro, seq, "backward", precision).seconds
        t = self.block_pass(shape, micro, seq, "forward", precision)
        if which == "backward":
            t += self.block_pass(shape, micro, seq, "backward", precision)
        return t.seconds

    def tail_seconds(self, shape, micro: int, seq: int, parts: tuple, precision: str = "bf16") -> float:
        return sum((self.tail_pass(shape, micro, seq, p, precision) for p in parts), Time()).seconds

    def in_gpu_micro_batch(self, shape, layers: int, micro: int, seq: int, recompute: bool,
                           precision: str = "autocast") -> Time:
        """One micro-batch of bench/gpu.py's in-GPU cases: ``layers`` blocks forward, the
        tail forward and backward, each block's backward (recomputed first if
        ``recompute``). The embeddings' lookups are left out (under 1% of it)."""
        fwd = self.block_pass(shape, micro, seq, "forward", precision)
        bwd = self.block_pass(shape, micro, seq, "backward", precision)
        tail = sum((self.tail_pass(shape, micro, seq, p, precision) for p in ("forward", "input_grad", "weight_grad")),
                   Time())
        return layers * (fwd * (2 if recompute else 1) + bwd) + tail

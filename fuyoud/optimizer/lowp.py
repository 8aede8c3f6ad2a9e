"""AdamW with reduced-precision moments: fewer bytes per parameter on the SSD per step.

The master weights stay fp32; the moments are stored in bf16 or in 8 bits, and every
step decodes them to fp32, runs torch's fused AdamW (the same kernel as fp32 state) and
encodes the new moments. The weights are updated from the fp32 moments of this step,
before they are encoded. The arithmetic, which tests/test_state_dtype.py restates as a
plain torch reference (the daemon is bitwise equal to it):

bf16   decode ``m.float()``; encode ``m32.to(bfloat16)`` (round to nearest even).

int8   block-wise: one fp32 scale per QBLOCK (256) parameters, square-root companding.
       A code is the number of thresholds at or below the value (exact comparisons,
       ties go up), so encoding needs no square root and gives the same bits on any CPU.
       exp_avg, signed, int8 codes c in [-127, 127]:
           s = max|m| over the block;  r = m / max(s, tiny)
           |c| = #{k in 1..127 : |r| >= T_m[k]},  T_m[k] = fp32(x * x), x = (k - 1/2) / 127;  c has r's sign
           decode: y = c / 127; m = (y * |y|) * s
       exp_avg_sq, non-negative, uint8 codes c in [0, 255], its fourth root linear and
       zero excluded (decodes to at least s / 256^4):
           s = max v over the block (+0.0: never -0);  r = v / max(s, tiny)
           c = #{k in 1..255 : r >= T_v[k]},  T_v[k] = fp32((y * y) * (y * y)), y = (k + 1/2) / 256
           decode: y = (c + 1) / 256; v = ((y * y) * (y * y)) * s
       (the thresholds are the values halfway between neighbouring codes' square or
       fourth roots, computed in float64 as written and rounded to fp32 once). Every other operation
       is one IEEE fp32 operation in the order written. Companding spends the codes
       where the moments' values are (small values keep a relative precision, as the
       dynamic maps of published 8-bit optimizers do); excluding zero from exp_avg_sq's
       codes keeps a quantized-to-zero second moment from turning a small first moment
       into an update of m / eps (the zero-point problem of low-bit optimizers). A block
       of zeros (s = 0) decodes to zeros. The last block of a group may be short: it is
       quantized as if padded with zeros. A NaN in a block makes its scale NaN (the
       step is then refused as not finite).

The codec runs in C (native/fy_lowp.c, ``fuyoud._lowp``, built at install) and, where
that was not built, in torch: the same bits, several times slower.

All of it is element-wise or per QBLOCK block, so the daemon runs it in pieces of WORK
parameters (a multiple of QBLOCK) whose fp32 temporaries stay in the CPU's caches, and
stepping a group chunk by chunk gives the same bits as stepping it whole.
"""
from __future__ import annotations

import math

import torch
from torch.optim.adamw import adamw as _adamw

from fuyoud.optimizer.layout import QBLOCK

try:  # the C codec (native/fy_lowp.c), where it was built
    from fuyoud._lowp import ffi as _ffi, lib as _C
except ImportError:  # pragma: no cover - depends on the install
    _ffi = _C = None

WORK = 1 << 18  # parameters per piece: fp32 temporaries of 1 MiB each; fewer, larger ops (each op hands off to torch's threads)
TINY = torch.finfo(torch.float32).tiny


def _thresholds(values: list[float]) -> torch.Tensor:
    """[-inf, the thresholds..., +inf] in fp32: code c has t[c] <= r < t[c + 1]."""
    return torch.tensor([-math.inf, *values, math.inf], dtype=torch.float64).float()


def _square(x: float) -> float:
    return x * x


T_SIGNED = _thresholds([_square((k - 0.5) / 127) for k in range(1, 128)])  # (as native/fy_lowp.c)
T_UNSIGNED = _thresholds([_square(_square((k + 0.5) / 256)) for k in range(1, 256)])


def _codes(r: torch.Tensor, guess: torch.Tensor, t: torch.Tensor, last: int) -> torch.Tensor:
    """The exact code of each r (count of thresholds <= r) from a guess at most one off
    (a NaN's code is 0: its block's scale is NaN and the step is refused anyway)."""
    c = guess.nan_to_num_(0.0).clamp_(0, last).long()
    c += (r >= t[(c + 1).clamp_(max=last + 1)]).long()
    c -= (r < t[c]).long()
    return c


def decode_signed(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """int8 codes (n) and their blocks' scales -> fp32 ``out`` (n)."""
    if _C is not None:
        _C.fy_decode_signed(_ptr(codes), _ptr(scales), _ptr(out), out.numel(), QBLOCK)
        return
    y = out.copy_(codes).div_(127)
    y.mul_(y.abs())
    _scale(y, scales)


def encode_signed(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tmp: torch.Tensor) -> None:
    """fp32 ``x`` (n) -> int8 codes and scales; ``tmp`` is fp32 scratch of n elements."""
    n = x.numel()
    if _C is not None:
        _C.fy_encode_signed(_ptr(x), _ptr(codes), _ptr(scales), n, QBLOCK)
        return
    _block_max(x.abs(), scales, n)
    r = _divide_by_block(x, scales, tmp, n)
    a = r.abs()
    c = _codes(a, a.sqrt().mul_(127).round_(), T_SIGNED, 127)
    codes.copy_(torch.where(r < 0, -c, c))


def decode_unsigned(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """uint8 codes (n) and their blocks' scales -> fp32 ``out`` (n), fourth powers."""
    if _C is not None:
        _C.fy_decode_unsigned(_ptr(codes), _ptr(scales), _ptr(out), out.numel(), QBLOCK)
        return
    y = out.copy_(codes).add_(1).div_(256)
    y.mul_(y)
    y.mul_(y)
    _scale(y, scales)


def encode_unsigned(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tmp: torch.Tensor) -> None:
    """fp32 ``x`` (n, non-negative) -> uint8 codes and scales."""
    n = x.numel()
    if _C is not None:
        _C.fy_encode_unsigned(_ptr(x), _ptr(codes), _ptr(scales), n, QBLOCK)
        return
    _block_max(x, scales, n)
    scales.add_(0.0)  # (-0 -> +0)
    r = _divide_by_block(x, scales, tmp, n)
    guess = r.clamp(min=0).sqrt_().sqrt_().mul_(256).round_().sub_(1)
    codes.copy_(_codes(r, guess, T_UNSIGNED, 255))


def _ptr(t: torch.Tensor):
    return _ffi.cast("void *", t.data_ptr())


def _by_block(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.view(n // QBLOCK, QBLOCK)


def _scale(y: torch.Tensor, scales: torch.Tensor) -> None:
    """y *= its block's scale, in place."""
    full = y.numel() // QBLOCK * QBLOCK
    if full:
        _by_block(y[:full], full).mul_(scales[:full // QBLOCK, None])
    if full < y.numel():
        y[full:].mul_(scales[-1])


def _block_max(x: torch.Tensor, scales: torch.Tensor, n: int) -> None:
    full = n // QBLOCK * QBLOCK
    if full:
        torch.amax(_by_block(x[:full], full), dim=1, out=scales[:full // QBLOCK])
    if full < n:
        scales[-1] = x[full:].max()


def _divide_by_block(x: torch.Tensor, scales: torch.Tensor, tmp: torch.Tensor, n: int) -> torch.Tensor:
    """x / max(scale, tiny), block by block, into ``tmp``."""
    div = scales.clamp_min(TINY)
    full = n // QBLOCK * QBLOCK
    if full:
        torch.div(_by_block(x[:full], full), div[:full // QBLOCK, None], out=_by_block(tmp[:full], full))
    if full < n:
        torch.div(x[full:], div[-1], out=tmp[full:n])
    return tmp[:n]


class Scratch:
    """fp32 temporaries for one stepping thread: two moments and one for encoding."""

    def __init__(self) -> None:
        self.m = torch.empty(WORK)
        self.v = torch.empty(WORK)
        self.tmp = torch.empty(WORK)


def adamw_step(state_dtype: str, step_count: int, slots: list[torch.Tensor], grad: torch.Tensor, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float, scratch: Scratch) -> None:
    """One AdamW step in place on reduced-precision state ``slots`` (layout.py's order),
    piece by piece; ``step_count`` steps were taken before this one."""
    weights, m, v = slots[0], slots[1], slots[2]
    n = weights.numel()
    for a in range(0, n, WORK):
        b = min(a + WORK, n)
        k = b - a
        m32, v32 = scratch.m[:k], scratch.v[:k]
        if state_dtype == "bf16":
            m32.copy_(m[a:b])
            v32.copy_(v[a:b])
        else:
            qa, qb = a // QBLOCK, -(-b // QBLOCK)
            decode_signed(m[a:b], slots[3][qa:qb], m32)
            decode_unsigned(v[a:b], slots[4][qa:qb], v32)
        steps = torch.tensor(float(step_count))
        _adamw([weights[a:b]], [grad[a:b]], [m32], [v32], [], [steps], fused=True, amsgrad=False, beta1=beta1,
               beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
        if state_dtype == "bf16":
            m[a:b].copy_(m32)
            v[a:b].copy_(v32)
        else:
            encode_signed(m32, m[a:b], slots[3][qa:qb], scratch.tmp[:k])
            encode_unsigned(v32, v[a:b], slots[4][qa:qb], scratch.tmp[:k])

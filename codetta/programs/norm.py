"""Residual add + RMSNorm (docs/design.md): the K1 producer, the norm's scale
applied by the next GEMM, and the programs of the norm's backward.

The norm's per-row scale is r = rsqrt(sumsq / d + eps), formed wherever it is
used from K1's row sums ``sumsq`` (so no kernel writes r on its own).
"""

import torch
import triton
import triton.language as tl

from ..kernels import primitives as P
from ..kernels.configs import BACKWARD_CANDIDATES, SEEDED_CANDIDATES
from ..kernels.program import ColSum, DType, PerCol, PerRow, Program, RowSum, Scalar, Tile


@triton.jit
def rms_scale_of(sumsq, inv_d, eps):
    """r = rsqrt(sumsq / d + eps): the RMSNorm scale of a row from its sum of squares."""
    return tl.rsqrt(sumsq * inv_d + eps)


@triton.jit
def residual_rms(acc, gamma, elem):
    """x = acc (= residual + y W^T: the residual seeds the accumulator);
    h = x * gamma[n];  sumsq[m] = sum_n x^2.

    x is rounded to the stream dtype before h and sumsq are formed, so the norm
    is that of the residual stream as stored."""
    x = P.rounded(acc, elem)
    return x, x * gamma, x * x


def _round(acc, dtype):
    return acc.to(dtype).to(acc.dtype)


RESIDUAL_RMS = Program(
    "residual_rms",
    residual_rms,
    inputs=(Tile("residual", seeds_acc=True), PerCol("gamma"), DType("elem")),
    outputs=(Tile("x"), Tile("h"), RowSum("sumsq")),
    reference=lambda acc, residual, gamma, elem: {
        "x": _round(acc, elem),
        "h": _round(acc, elem) * gamma.to(acc.dtype),
        "sumsq": _round(acc, elem).pow(2).sum(1),
    },
    configs=tuple(SEEDED_CANDIDATES),
)


@triton.jit
def residual_rms_f32(acc, gamma):
    """K1 over a float32 residual stream (the GEMM in bf16/fp16; mixed precision, as
    autocast keeps the stream): x = acc, stored in float32 without rounding;
    h = x * gamma[n] in the GEMM's dtype (the next GEMM's input); sumsq[m] = sum_n x^2."""
    return acc, acc * gamma, acc * acc


RESIDUAL_RMS_F32 = Program(
    "residual_rms_f32",
    residual_rms_f32,
    inputs=(Tile("residual", seeds_acc=True, dtype=torch.float32), PerCol("gamma")),
    outputs=(Tile("x", dtype=torch.float32), Tile("h"), RowSum("sumsq")),
    reference=lambda acc, residual, gamma: {
        "x": acc,
        "h": acc * gamma.to(acc.dtype),
        "sumsq": acc.pow(2).sum(1),
    },
    # a float32 seed tile: 128x128 tiles leave shared memory for the A/B stages beside it
    configs=tuple(BACKWARD_CANDIDATES),
)


@triton.jit
def residual_sumsq(acc, elem):
    """K1 without h (gamma folded into the next GEMM's weight): x = acc (residual-seeded),
    sumsq[m] = sum_n x^2."""
    x = P.rounded(acc, elem)
    return x, x * x


RESIDUAL_SUMSQ = Program(
    "residual_sumsq",
    residual_sumsq,
    inputs=(Tile("residual", seeds_acc=True), DType("elem")),
    outputs=(Tile("x"), RowSum("sumsq")),
    reference=lambda acc, residual, elem: {
        "x": _round(acc, elem),
        "sumsq": _round(acc, elem).pow(2).sum(1),
    },
    configs=tuple(SEEDED_CANDIDATES),
    # (K1 less its h output, on the same candidates: where its own shape is untuned, K1's
    # picks; it serves float16's normalize-first forward and the fold_gamma variant)
    tuned_like=RESIDUAL_RMS,
)


@triton.jit
def rms_scale(acc, sumsq, inv_d, eps):
    """out = acc * r[m], r = rsqrt(sumsq[m] / d + eps): the GEMM after an RMSNorm whose
    gamma was applied on the producer's side (K1's h)."""
    return acc * rms_scale_of(sumsq, inv_d, eps)


def _r(sumsq, inv_d, eps):
    return (sumsq * inv_d + eps).rsqrt()


RMS_SCALE = Program(
    "rms_scale",
    rms_scale,
    inputs=(PerRow("sumsq"), Scalar("inv_d"), Scalar("eps")),
    outputs=(Tile("out"),),
    reference=lambda acc, sumsq, inv_d, eps: {"out": acc * _r(sumsq.to(acc.dtype), inv_d, eps)[:, None]},
)


@triton.jit
def rms_scale_bias(acc, sumsq, inv_d, eps, bias):
    """``rms_scale`` plus the projection's bias: out = acc * r[m] + bias[n] (Qwen2's v)."""
    return acc * rms_scale_of(sumsq, inv_d, eps) + bias


RMS_SCALE_BIAS = Program(
    "rms_scale_bias",
    rms_scale_bias,
    inputs=(PerRow("sumsq"), Scalar("inv_d"), Scalar("eps"), PerCol("bias")),
    outputs=(Tile("out"),),
    reference=lambda acc, sumsq, inv_d, eps, bias: {
        "out": acc * _r(sumsq.to(acc.dtype), inv_d, eps)[:, None] + bias.to(acc.dtype)
    },
    tuned_like=RMS_SCALE,
)


@triton.jit
def gamma_weight_grad(acc, gamma, w):
    """The dW GEMM when gamma is folded into the weight (W' = W gamma): acc = dz^T n' [out, d].

    dw = acc * gamma[k];  dgamma[k] = sum_j acc[j, k] W[j, k]."""
    return acc * gamma, acc * w


GAMMA_WEIGHT_GRAD = Program(
    "gamma_weight_grad",
    gamma_weight_grad,
    inputs=(PerCol("gamma"), Tile("w")),
    outputs=(Tile("dw"), ColSum("dgamma")),
    reference=lambda acc, gamma, w: {
        "dw": acc * gamma.to(acc.dtype),
        "dgamma": (acc * w.to(acc.dtype)).sum(0),
    },
    layouts=((True, True),),  # dz^T @ n: both operands enter as transposed views
)


@triton.jit
def rms_backward(acc, x, dres, sumsq, zeta, gamma, inv_d, eps):
    """RMSNorm backward on the dX GEMM: acc = dn = dz W (over the norm's d columns).

    dx = r (gamma dn - x r zeta / d) + dres;  n = x r gamma (stored for dW);
    dgamma[k] = sum_m dn x r."""
    r = rms_scale_of(sumsq, inv_d, eps)
    xr = x * r
    return r * (gamma * acc - xr * zeta * inv_d) + dres, xr * gamma, acc * xr


def _rms_backward_ref(acc, x, dres, sumsq, zeta, gamma, inv_d, eps):
    r = _r(sumsq.to(acc.dtype), inv_d, eps)[:, None]
    xr = x.to(acc.dtype) * r
    g = gamma.to(acc.dtype)
    dx = r * (g * acc - xr * zeta.to(acc.dtype)[:, None] * inv_d) + dres.to(acc.dtype)
    return {"dx": dx, "n": xr * g, "dgamma": (acc * xr).sum(0)}


RMS_BACKWARD = Program(
    "rms_backward",
    rms_backward,
    inputs=(
        Tile("x"),
        Tile("dres"),
        PerRow("sumsq"),
        PerRow("zeta"),
        PerCol("gamma"),
        Scalar("inv_d"),
        Scalar("eps"),
    ),  # fmt: skip
    outputs=(Tile("dx"), Tile("n"), ColSum("dgamma")),
    reference=_rms_backward_ref,
    configs=tuple(BACKWARD_CANDIDATES),
    layouts=((False, True),),  # dz @ W: the weight enters as a transposed view
)


@triton.jit
def rms_grad_partials(acc, x, sumsq, gamma, inv_d, eps):
    """The dX GEMM of the two-pass RMSNorm backward: acc = dn = dz W (over the d columns).

    dn stored;  zeta[m] = sum_k dn x r gamma (= dn . n);  dgamma[k] = sum_m dn x r."""
    xr = x * rms_scale_of(sumsq, inv_d, eps)
    return acc, acc * xr * gamma, acc * xr


def _rms_grad_partials_ref(acc, x, sumsq, gamma, inv_d, eps):
    xr = x.to(acc.dtype) * _r(sumsq.to(acc.dtype), inv_d, eps)[:, None]
    return {"dn": acc, "zeta": (acc * xr * gamma.to(acc.dtype)).sum(1), "dgamma": (acc * xr).sum(0)}


RMS_GRAD_PARTIALS = Program(
    "rms_grad_partials",
    rms_grad_partials,
    inputs=(Tile("x"), PerRow("sumsq"), PerCol("gamma"), Scalar("inv_d"), Scalar("eps")),
    outputs=(Tile("dn"), RowSum("zeta"), ColSum("dgamma")),
    reference=_rms_grad_partials_ref,
    layouts=((False, True),),
)

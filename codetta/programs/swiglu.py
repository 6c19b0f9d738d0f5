"""SwiGLU as GEMM epilogues (docs/design.md, the MLP block): the gate and up
projections in one GEMM (their weights paired, each its own tensor) whose epilogue
forms ``y = silu(g) * u``, and the product's backward in the epilogue of the down
projection's dX GEMM.

    forward:  g = r * (h @ W_gate^T), u = r * (h @ W_up^T)   (r: the RMSNorm scale of
              the row, formed from K1's sumsq; 1 without a norm), y = silu(g) * u
    backward: dy = d_out @ W_down;  du = dy * silu(g),
              dg = dy * u * s * (1 + g (1 - s)),  s = sigmoid(g)

The forward stores g, u (what the backward needs) and y (the down projection's
input and its dW operand); y is formed from the fp32 g and u, the backward reads
the stored (rounded) g and u. ``DSWIGLU_Y`` also forms y again, from the stored g and
u, for a backward whose forward did not keep y (``CODETTA_SWIGLU_KEEP_Y=0``): its dW
then uses that y, one rounding of the stored g and u away from the forward's.
"""

import torch
import triton
import triton.language as tl

from ..kernels.configs import (
    BACKWARD_CANDIDATES,
    PINGPONG_HEAVY_CANDIDATES,
    PINGPONG_NARROW_HEAVY_CANDIDATES,
    config_grid,
)
from ..kernels.program import PairedWeight, PerRow, Program, Scalar, Tile
from .norm import rms_scale_of

__all__ = ["SWIGLU", "SWIGLU_RMS", "DSWIGLU", "DSWIGLU_Y"]


@triton.jit
def silu_mul(g, u):
    """silu(g) * u in fp32."""
    return g * tl.sigmoid(g) * u


@triton.jit
def swiglu(acc):
    """acc = (h @ W_gate^T, h @ W_up^T):  g, u and y = silu(g) * u."""
    g, u = acc
    return g, u, silu_mul(g, u)


@triton.jit
def swiglu_rms(acc, sumsq, inv_d, eps):
    """The same after an RMSNorm whose gamma K1 applied (its h): g and u scaled by the
    row's r = rsqrt(sumsq / d + eps) first."""
    r = rms_scale_of(sumsq, inv_d, eps)
    g = acc[0] * r
    u = acc[1] * r
    return g, u, silu_mul(g, u)


@triton.jit
def dswiglu(acc, g, u):
    """acc = dy = d_out @ W_down (the down projection's dX):  dg, du of y = silu(g) * u."""
    s = tl.sigmoid(g)
    du = acc * g * s
    dg = acc * u * s * (1.0 + g * (1.0 - s))
    return dg, du


@triton.jit
def dswiglu_y(acc, g, u):
    """``dswiglu``, and y = silu(g) * u formed again from the stored g and u (the down
    projection's weight-gradient operand, when the forward did not keep y). One sigmoid
    for the three; dg and du as ``dswiglu``'s, y as ``silu_mul``'s, operation for
    operation."""
    s = tl.sigmoid(g)
    du = acc * g * s
    dg = acc * u * s * (1.0 + g * (1.0 - s))
    return dg, du, g * s * u


def _silu_mul(g, u):
    return torch.nn.functional.silu(g) * u


def _reference(g, u):
    return {"g": g, "u": u, "y": _silu_mul(g, u)}


def _rms(sumsq, inv_d, eps):
    return (sumsq.float() * inv_d + eps).rsqrt()[:, None]


def dswiglu_reference(dy, g, u) -> dict:
    """{"dg", "du"} of y = silu(g) * u given dy, in PyTorch (float32 math, dy's dtype)."""
    dt = dy.dtype
    dy, g, u = dy.float(), g.float(), u.float()
    s = torch.sigmoid(g)
    return {"dg": (dy * u * s * (1 + g * (1 - s))).to(dt), "du": (dy * g * s).to(dt)}


def dswiglu_y_reference(dy, g, u) -> dict:
    """``dswiglu_reference`` and y = silu(g) * u from g and u (float32 math, dy's dtype)."""
    return {**dswiglu_reference(dy, g, u), "y": _silu_mul(g.float(), u.float()).to(dy.dtype)}


# two fp32 accumulators per tile: BLOCK_N is each one's width, so 128x128 (a 128x256
# tile's registers) and smaller; the epilogue writes three tiles, so flattened loops
# (the next tile's loads start during this tile's epilogue) are candidates too
PAIRED_CANDIDATES = tuple(
    config_grid(((128, 128, 3, 8), (128, 128, 4, 8)), (2, 4))
    + config_grid(((128, 64, 4, 4),), (1, 2), (False,))
)

_OUTS = (Tile("g"), Tile("u"), Tile("y"))

SWIGLU = Program(
    "swiglu",
    swiglu,
    inputs=(PairedWeight("up"),),
    outputs=_OUTS,
    reference=lambda acc: _reference(*acc),
    configs=PAIRED_CANDIDATES,
)

SWIGLU_RMS = Program(
    "swiglu_rms",
    swiglu_rms,
    inputs=(PairedWeight("up"), PerRow("sumsq"), Scalar("inv_d"), Scalar("eps")),
    outputs=_OUTS,
    reference=lambda acc, sumsq, inv_d, eps: _reference(
        acc[0] * _rms(sumsq, inv_d, eps), acc[1] * _rms(sumsq, inv_d, eps)
    ),  # fmt: skip
    configs=PAIRED_CANDIDATES,
)

DSWIGLU = Program(
    "dswiglu",
    dswiglu,
    inputs=(Tile("g"), Tile("u")),
    outputs=(Tile("dg"), Tile("du")),
    reference=dswiglu_reference,
    configs=tuple(BACKWARD_CANDIDATES),
    layouts=((False, True),),
)

DSWIGLU_Y = Program(
    "dswiglu_y",
    dswiglu_y,
    inputs=(Tile("g"), Tile("u")),
    outputs=(Tile("dg"), Tile("du"), Tile("y")),
    reference=dswiglu_y_reference,
    configs=tuple(BACKWARD_CANDIDATES),
    layouts=((False, True),),
    # five sub-tiles held at once: at 128x128 split 4 the default register split (232 / 256)
    # spilled 32 B in one consumer, the even one (240 / 248) none (sm_90a check)
    pingpong_configs=PINGPONG_HEAVY_CANDIDATES + PINGPONG_NARROW_HEAVY_CANDIDATES,
    pingpong_regs=240,
)

"""Pairwise rotation of adjacent output columns (the RoPE pattern)."""

import triton
import triton.language as tl

from .. import reference as ref
from ..kernels import primitives as P
from ..kernels.program import Epilogue, Kind, Operand


@triton.jit
def _rotate_pairs(acc, off_m, off_n, M, N, ops, state):
    """For each column pair (a, b) = (acc[:, 2i], acc[:, 2i+1]) and row angle t = angle[m]:
    out[:, 2i] = a cos t - b sin t,  out[:, 2i+1] = b cos t + a sin t."""
    angle, out = ops
    t = P.load_col_vector(angle, acc, off_m, M)  # [BM, 1]
    cos = tl.cos(t)
    sin = tl.sin(t)
    a, b = P.even_odd(acc)
    P.store_tile(out, P.interleave(a * cos - b * sin, b * cos + a * sin), off_m, off_n)
    return state


ROTATE_PAIRS = Epilogue(
    "rotate_pairs",
    _rotate_pairs,
    inputs=(Operand("angle", Kind.COL),),
    outputs=(Operand("out", Kind.TILE),),
    reference=lambda acc, lay, angle: {"out": ref.rotate_pairs(acc, angle.float())},
)

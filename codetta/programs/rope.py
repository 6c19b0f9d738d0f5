"""Pairwise rotation of adjacent output columns (the RoPE pattern)."""

import triton
import triton.language as tl  # noqa: F401 - the JIT needs tl in scope

from .. import reference as ref
from ..kernels import primitives as P
from ..kernels.program import Epilogue, Kind, Operand


@triton.jit
def _rotate_pairs(acc, off_m, off_n, M, N, ops, state):
    """For each column pair (a, b) = (acc[:, 2i], acc[:, 2i+1]) of row m, with c = cos[m], s = sin[m]:
    out[:, 2i] = a c - b s,  out[:, 2i+1] = b c + a s."""
    cos, sin, out = ops
    c = P.load_col_vector(cos, acc, off_m, M)  # [BM, 1]
    s = P.load_col_vector(sin, acc, off_m, M)
    a, b = P.even_odd(acc)
    P.store_tile(out, P.interleave(a * c - b * s, b * c + a * s), off_m, off_n)
    return state


def _check_even(M, N):
    if N % 2:
        raise ValueError(f"rotate_pairs pairs adjacent columns: N must be even, got N={N}")


ROTATE_PAIRS = Epilogue(
    "rotate_pairs",
    _rotate_pairs,
    inputs=(Operand("cos", Kind.COL), Operand("sin", Kind.COL)),
    outputs=(Operand("out", Kind.TILE),),
    reference=lambda acc, lay, cos, sin: {"out": ref.rotate_pairs(acc, cos.float(), sin.float())},
    check=_check_even,
)

"""Online log-sum-exp over each row of the product (the stateful primitive)."""

import triton
import triton.language as tl

from .. import reference as ref
from ..kernels import primitives as P
from ..kernels.program import Epilogue, Kind, Operand


@triton.jit
def _lse_apply(acc, off_m, off_n, M, N, ops, state):
    """Fold the sub-tile (times scale) into the running (max, sum exp) of each row."""
    scale, lse = ops
    return P.lse_update(state, acc * scale, off_n, N)


@triton.jit
def _lse_finish(state, off_m, off_n, M, N, ops, BLOCK_N: tl.constexpr):
    """lse[m, t] = log sum_n exp(scale * acc[m, n]) over the columns n of N-tile t."""
    scale, lse = ops
    P.store_row_partial(lse, P.lse_value(state), off_m, M, off_n // BLOCK_N, tl.cdiv(N, BLOCK_N))


TILE_LSE = Epilogue(
    "tile_lse",
    _lse_apply,
    inputs=(Operand("scale", Kind.SCALAR),),
    outputs=(Operand("lse", Kind.TILE_ROW_PARTIAL),),
    init=P.lse_init,
    finish=_lse_finish,
    reference=lambda acc, lay, scale: {"lse": ref.row_partial_lse(acc * scale, lay.block_n)},
)

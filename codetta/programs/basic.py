"""Basic epilogue programs: plain store, row scaling, a column-sum partial."""

import triton
import triton.language as tl  # noqa: F401 - the JIT needs tl in scope
from triton.experimental import gluon

from .. import reference as ref
from ..kernels import primitives as P
from ..kernels import primitives_sm90 as G
from ..kernels.program import Epilogue, Kind, Operand


@triton.jit
def _store(acc, off_m, off_n, M, N, ops, state):
    """out = acc."""
    (out,) = ops
    P.store_tile(out, acc, off_m, off_n)
    return state


@gluon.jit
def _store_sm90(acc, buf, off_m, off_n, M, N, ops):
    (out,) = ops
    G.store_tile(out, buf, acc, off_m, off_n)


STORE = Epilogue(
    "store",
    _store,
    outputs=(Operand("out", Kind.TILE),),
    reference=lambda acc, lay: {"out": acc},
    sm90=_store_sm90,
)


@triton.jit
def _row_scale(acc, off_m, off_n, M, N, ops, state):
    """out = acc * scale[m]  (scale: one value per output row)."""
    scale, out = ops
    P.store_tile(out, acc * P.load_col_vector(scale, acc, off_m, M), off_m, off_n)
    return state


@gluon.jit
def _row_scale_sm90(acc, buf, off_m, off_n, M, N, ops):
    scale, out = ops
    G.store_tile(out, buf, acc * G.load_col_vector(scale, acc, off_m, M), off_m, off_n)


ROW_SCALE = Epilogue(
    "row_scale",
    _row_scale,
    inputs=(Operand("scale", Kind.COL),),
    outputs=(Operand("out", Kind.TILE),),
    reference=lambda acc, lay, scale: {"out": acc * scale.float()[:, None]},
    sm90=_row_scale_sm90,
)


@triton.jit
def _mul_colsum(acc, off_m, off_n, M, N, ops, state):
    """out = acc; colsum[i, n] = sum over the rows m of M-tile i of acc * other."""
    other, out, colsum = ops
    P.store_tile(out, acc, off_m, off_n)
    P.store_col_partial(colsum, acc * P.load_tile(other, off_m, off_n), off_m, off_n, M, N)
    return state


MUL_COLSUM = Epilogue(
    "mul_colsum",
    _mul_colsum,
    inputs=(Operand("other", Kind.TILE),),
    outputs=(Operand("out", Kind.TILE), Operand("colsum", Kind.COL_PARTIAL)),
    reference=lambda acc, lay, other: {
        "out": acc,
        "colsum": ref.col_partials(acc * other.float(), lay.block_m),
    },
)

"""Residual add + RMSNorm producer (kernel K1 of DESIGN.md 2.6)."""

import triton
import triton.language as tl

from .. import reference as ref
from ..kernels import primitives as P
from ..kernels.program import Epilogue, Kind, Operand
from ..kernels.tuning import SEEDED_CANDIDATES


@triton.jit
def _residual_rms(acc, off_m, off_n, M, N, ops, state):
    """x = acc (= residual + y W^T: the residual seeds the accumulator);
    h = x * gamma[n];  sumsq[m, j] = sum over sub-tile j of x^2.

    x is rounded to the stream dtype before h and sumsq are formed, so the
    norm is that of the residual stream as stored.
    """
    residual, gamma, x_out, h_out, sumsq = ops
    x = acc.to(x_out.dtype).to(tl.float32)
    P.store_tile(x_out, x, off_m, off_n)
    P.store_tile(h_out, x * P.load_row_vector(gamma, acc, off_n, N), off_m, off_n)
    P.store_row_sum_partial(sumsq, x * x, off_m, off_n, M, N)
    return state


def _residual_rms_ref(acc, lay, residual, gamma):
    x = ref.round_to(acc, residual.dtype)
    return {"x": x, "h": x * gamma.float(), "sumsq": ref.row_partials(x * x, lay.sub_n)}


RESIDUAL_RMS = Epilogue(
    "residual_rms",
    _residual_rms,
    inputs=(Operand("residual", Kind.TILE), Operand("gamma", Kind.ROW)),
    outputs=(Operand("x", Kind.TILE), Operand("h", Kind.TILE), Operand("sumsq", Kind.ROW_PARTIAL)),
    reference=_residual_rms_ref,
    acc_init="residual",
    configs=tuple(SEEDED_CANDIDATES),
)

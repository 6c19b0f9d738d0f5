"""Residual add + RMSNorm: the K1 producer (DESIGN.md 2.6) and the backward programs."""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .. import reference as ref
from ..kernels import primitives as P
from ..kernels import primitives_sm90 as G
from ..kernels.program import Epilogue, Kind, Operand
from ..kernels.tuning import BACKWARD_CANDIDATES, SEEDED_CANDIDATES


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


@gluon.jit
def _residual_rms_sm90(acc, buf, off_m, off_n, M, N, ops):
    """As ``_residual_rms``, on the whole tile (sumsq: one partial per N-tile)."""
    residual, gamma, x_out, h_out, sumsq = ops
    x = acc.to(x_out.dtype).to(gl.float32)
    G.store_tile(x_out, buf, x, off_m, off_n)
    G.store_row_sum_partial(sumsq, x * x, acc, off_m, off_n, M, N)
    G.store_tile(h_out, buf, x * G.load_row_vector(gamma, acc, off_n, N), off_m, off_n)


RESIDUAL_RMS = Epilogue(
    "residual_rms",
    _residual_rms,
    inputs=(Operand("residual", Kind.TILE), Operand("gamma", Kind.ROW)),
    outputs=(Operand("x", Kind.TILE), Operand("h", Kind.TILE), Operand("sumsq", Kind.ROW_PARTIAL)),
    reference=_residual_rms_ref,
    acc_init="residual",
    configs=tuple(SEEDED_CANDIDATES),
    sm90=_residual_rms_sm90,
)


@triton.jit
def _residual_sumsq(acc, off_m, off_n, M, N, ops, state):
    """K1 without h (gamma folded into the next GEMM's weight): x = acc (residual-seeded),
    sumsq[m, j] = sum over sub-tile j of x^2."""
    residual, x_out, sumsq = ops
    x = acc.to(x_out.dtype).to(tl.float32)
    P.store_tile(x_out, x, off_m, off_n)
    P.store_row_sum_partial(sumsq, x * x, off_m, off_n, M, N)
    return state


def _residual_sumsq_ref(acc, lay, residual):
    x = ref.round_to(acc, residual.dtype)
    return {"x": x, "sumsq": ref.row_partials(x * x, lay.sub_n)}


@gluon.jit
def _residual_sumsq_sm90(acc, buf, off_m, off_n, M, N, ops):
    residual, x_out, sumsq = ops
    x = acc.to(x_out.dtype).to(gl.float32)
    G.store_tile(x_out, buf, x, off_m, off_n)
    G.store_row_sum_partial(sumsq, x * x, acc, off_m, off_n, M, N)


RESIDUAL_SUMSQ = Epilogue(
    "residual_sumsq",
    _residual_sumsq,
    inputs=(Operand("residual", Kind.TILE),),
    outputs=(Operand("x", Kind.TILE), Operand("sumsq", Kind.ROW_PARTIAL)),
    reference=_residual_sumsq_ref,
    acc_init="residual",
    configs=tuple(SEEDED_CANDIDATES),
    sm90=_residual_sumsq_sm90,
)


@triton.jit
def _gamma_weight_grad(acc, off_m, off_n, M, N, ops, state):
    """The dW GEMM when gamma is folded into the weight (W' = W gamma): acc = dz^T n [out, d].

    dW = acc * gamma[k];  dgamma[i, k] = sum over the rows j of row-tile i of acc W[j, k]."""
    gamma, w, dw_out, dgamma = ops
    P.store_tile(dw_out, acc * P.load_row_vector(gamma, acc, off_n, N), off_m, off_n)
    P.store_col_partial(dgamma, acc * P.load_tile(w, off_m, off_n), off_m, off_n, M, N)
    return state


def _gamma_weight_grad_ref(acc, lay, gamma, w):
    return {"dw": acc * gamma.float(), "dgamma": ref.col_partials(acc * w.float(), lay.block_m)}


GAMMA_WEIGHT_GRAD = Epilogue(
    "gamma_weight_grad",
    _gamma_weight_grad,
    inputs=(Operand("gamma", Kind.ROW), Operand("w", Kind.TILE)),
    outputs=(Operand("dw", Kind.TILE), Operand("dgamma", Kind.COL_PARTIAL)),
    reference=_gamma_weight_grad_ref,
    layouts=((True, True),),  # dz^T @ n: both operands enter as transposed views
)


@triton.jit
def _rms_backward(acc, off_m, off_n, M, N, ops, state):
    """RMSNorm backward on the dX GEMM: acc = dn = dz W (over the norm's d columns).

    dx = r (gamma dn - x r zeta / d) + dres;  n = x r gamma (stored for dW);
    dgamma[i, k] = sum over the rows m of M-tile i of dn x r.
    """
    x, dres, rstd, zeta, gamma, inv_d, dx_out, n_out, dgamma = ops
    xt = P.load_tile(x, off_m, off_n)
    r = P.load_col_vector(rstd, acc, off_m, M)  # [BM, 1]
    zt = P.load_col_vector(zeta, acc, off_m, M)
    g = P.load_row_vector(gamma, acc, off_n, N)  # [1, BNs]
    xr = xt * r
    dx = r * (g * acc - xr * zt * inv_d) + P.load_tile(dres, off_m, off_n)
    P.store_tile(dx_out, dx, off_m, off_n)
    P.store_tile(n_out, xr * g, off_m, off_n)
    P.store_col_partial(dgamma, acc * xr, off_m, off_n, M, N)
    return state


def _rms_backward_ref(acc, lay, x, dres, rstd, zeta, gamma, inv_d):
    xr = x.float() * rstd.float()[:, None]
    g = gamma.float()
    dx = rstd.float()[:, None] * (g * acc - xr * zeta.float()[:, None] * inv_d) + dres.float()
    return {"dx": dx, "n": xr * g, "dgamma": ref.col_partials(acc * xr, lay.block_m)}


RMS_BACKWARD = Epilogue(
    "rms_backward",
    _rms_backward,
    inputs=(
        Operand("x", Kind.TILE),
        Operand("dres", Kind.TILE),
        Operand("rstd", Kind.COL),
        Operand("zeta", Kind.COL),
        Operand("gamma", Kind.ROW),
        Operand("inv_d", Kind.SCALAR),
    ),
    outputs=(Operand("dx", Kind.TILE), Operand("n", Kind.TILE), Operand("dgamma", Kind.COL_PARTIAL)),
    reference=_rms_backward_ref,
    configs=tuple(BACKWARD_CANDIDATES),
    layouts=((False, True),),  # dz @ W: the weight enters as a transposed view
)


@triton.jit
def _rms_grad_partials(acc, off_m, off_n, M, N, ops, state):
    """The dX GEMM of the two-pass RMSNorm backward: acc = dn = dz W (over the d columns).

    dn stored;  zeta[m, j] = sum over sub-tile j of dn x r gamma (= dn . n);
    dgamma[i, k] = sum over the rows m of M-tile i of dn x r.
    """
    x, rstd, gamma, dn_out, zeta, dgamma = ops
    xr = P.load_tile(x, off_m, off_n) * P.load_col_vector(rstd, acc, off_m, M)
    P.store_tile(dn_out, acc, off_m, off_n)
    P.store_row_sum_partial(zeta, acc * xr * P.load_row_vector(gamma, acc, off_n, N), off_m, off_n, M, N)
    P.store_col_partial(dgamma, acc * xr, off_m, off_n, M, N)
    return state


def _rms_grad_partials_ref(acc, lay, x, rstd, gamma):
    xr = x.float() * rstd.float()[:, None]
    return {
        "dn": acc,
        "zeta": ref.row_partials(acc * xr * gamma.float(), lay.sub_n),
        "dgamma": ref.col_partials(acc * xr, lay.block_m),
    }


RMS_GRAD_PARTIALS = Epilogue(
    "rms_grad_partials",
    _rms_grad_partials,
    inputs=(Operand("x", Kind.TILE), Operand("rstd", Kind.COL), Operand("gamma", Kind.ROW)),
    outputs=(
        Operand("dn", Kind.TILE),
        Operand("zeta", Kind.ROW_PARTIAL),
        Operand("dgamma", Kind.COL_PARTIAL),
    ),
    reference=_rms_grad_partials_ref,
    layouts=((False, True),),
)

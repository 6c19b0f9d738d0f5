"""The RMSNorm part of ``residual_rmsnorm_linear``'s backward, and the next GEMMs' dW.

With dn = dz @ w (the dX GEMM; several next weights: dh = sum_i dz_i @ W_i in one launch)
and zeta = rowsum(dn * n): dx_total = r (gamma dn - x r zeta / d) + dx, n = x r gamma,
dgamma = colsum(dn x r), dW = dz^T n. The modes (``BACKWARDS``; the module docstring of
``residual_rmsnorm.py`` describes each, NOTES.md has their times) differ in where zeta,
dx_total and n are formed: a row pass after the plain dX GEMM ("rowwise", the default),
the dX epilogue plus an elementwise pass ("two_pass"), or the dX epilogue alone after
zeta from the saved z ("folded"); ``fold_gamma`` applies gamma to the next weight.
``FACTORS`` (no next GEMM, the norm's output handed on as h = x gamma and r): from dh and
dr, dx_total = gamma dh - x r^3 dr / d + dx, dgamma = colsum(dh x), one row pass, no n.
"""

from __future__ import annotations

import torch

from ..kernels.launch import gemm, parts_fit
from ..kernels.reductions import col_sum
from ..kernels.settings import SETTINGS
from ..programs import (
    ACCUMULATE,
    GAMMA_WEIGHT_GRAD,
    RMS_BACKWARD,
    RMS_GRAD_PARTIALS,
    STORE_K2,
    STORE_K3,
    STORE_K4,
    STORE_M3,
)
from ..programs.norm_rows import rms_backward_factors, rms_backward_finish, rms_backward_rows, rowdot

BACKWARDS = ("rowwise", "two_pass", "folded")
# no next GEMM, the norm's output handed on as its factors h = x gamma and r (the final norm
# before the LM head + loss: ``residual_rmsnorm_factors``); not a research variant
FACTORS = "factors"
_SUMS = {2: STORE_K2, 3: STORE_K3, 4: STORE_K4}  # by the number of products: their sum, one launch


def norm_backward(dx, dzs, gamma, ws, x, z, sumsq, w_gamma, eps, mode, fold_gamma):
    """The RMSNorm part of the backward and the next GEMMs' dW: (dx_total, [dW], dgamma,
    dx_low): dx_low is dx_total in the GEMMs' dtype (the previous GEMMs' input), a copy
    when the stream is float32 (``norm_checks.mixed``), else dx_total itself. n, the
    normalized input that dW needs, is [M, d] and dies when this returns, before dy and
    dW_o allocate theirs (it is not kept to the end)."""
    d = x.shape[1]
    if mode == FACTORS:  # the norm's output handed on as h and r: their gradients, dzs = [dh, dr]
        low = None if dzs[0].dtype == x.dtype else torch.empty_like(dzs[0])
        dx_total, dgamma_parts = rms_backward_factors(dzs[0], dzs[1], x, dx, sumsq, gamma, eps, low_out=low)
        return dx_total, [], col_sum(dgamma_parts, dtype=gamma.dtype), _low(dx_total, low)
    if not ws:  # no next GEMM: the incoming gradient is the norm output's
        low = None if dzs[0].dtype == x.dtype else torch.empty_like(dzs[0])
        dx_total, _, dgamma_parts = rms_backward_rows(dzs[0], x, dx, sumsq, gamma, eps, low_out=low)
        return dx_total, [], col_sum(dgamma_parts, dtype=gamma.dtype), _low(dx_total, low)
    if x.dtype != dzs[0].dtype and (fold_gamma or mode != "rowwise"):
        raise ValueError("a float32 residual stream takes the default backward (rowwise, no fold_gamma)")
    if len(ws) > 1:
        # several next GEMMs read the norm's output: dh = sum_i dz_i @ W_i in one launch, one
        # rounding (up to four products: K parts, kernels/program.py; q, k, v: three), any
        # further product accumulated onto them in its epilogue (no separate adds)
        parts = {}
        for i, (dz_i, w_i) in enumerate(zip(dzs[1:4], ws[1:4]), 1):
            parts[f"a{i}"], parts[f"w{i}"] = dz_i, w_i.t()
        dh = gemm(dzs[0], ws[0].t(), epilogue=_SUMS[min(len(ws), 4)], **parts)
        for dz_i, w_i in zip(dzs[4:], ws[4:]):
            dh = gemm(dz_i, w_i.t(), epilogue=ACCUMULATE, c=dh)
        dx_total, n, dgamma_parts = _rows(dh, x, dx, sumsq, gamma, eps)
        dgamma = col_sum(dgamma_parts, dtype=gamma.dtype)
        heights = tuple(dz_i.shape[1] for dz_i in dzs)
        if len(dzs) == 3 and SETTINGS.qkv_one_launch and parts_fit(STORE_M3, x.device, heights=heights):
            # the three weight gradients from one launch (M parts: dq^T, dk^T, dv^T stacked)
            return (
                dx_total,
                list(gemm(dzs[0].t(), n.t(), epilogue=STORE_M3, a1=dzs[1].t(), a2=dzs[2].t())),
                dgamma,
                _low(dx_total, dh),
            )
        return dx_total, [gemm(dz_i.t(), n.t()) for dz_i in dzs], dgamma, _low(dx_total, dh)
    dz, w = dzs[0], ws[0]
    if fold_gamma:
        # z = n' @ (W gamma)^T with n' = x r: dn' = dz @ (W gamma); the norm backward
        # without gamma; dW = (dz^T n') gamma and dgamma = colsum(W * dz^T n') in the
        # dW GEMM's epilogue
        dn = gemm(dz, w_gamma.t())
        dx_total, n, _ = rms_backward_rows(dn, x, dx, sumsq, None, eps, dx_out=dn)
        gw = gemm(dz.t(), n.t(), epilogue=GAMMA_WEIGHT_GRAD, gamma=gamma, w=w)
        return dx_total, [gw.dw], gw.dgamma.to(gamma.dtype), dx_total
    if mode == "rowwise":
        # the plain dX GEMM, then one pass over whole rows writes dx_total (over dh) and n
        dh = gemm(dz, w.t())
        dx_total, n, dgamma_parts = _rows(dh, x, dx, sumsq, gamma, eps)
        dgamma = col_sum(dgamma_parts, dtype=gamma.dtype)
        return dx_total, [gemm(dz.t(), n.t())], dgamma, _low(dx_total, dh)
    elif mode == "folded":
        # zeta = rowsum(dz * z) first, then the whole RMSNorm backward in the dX epilogue
        bw = gemm(
            dz, w.t(), epilogue=RMS_BACKWARD, x=x, dres=dx, sumsq=sumsq, zeta=rowdot(dz, z), gamma=gamma,
            inv_d=1.0 / d, eps=eps,
        )  # fmt: skip
        dx_total, n, dgamma = bw.dx, bw.n, bw.dgamma.to(gamma.dtype)
    else:
        # two-pass: the dX epilogue stores dn with zeta and dgamma; one elementwise pass
        # finishes dx and n (no z saved, no pass over dz and z)
        bw = gemm(
            dz, w.t(), epilogue=RMS_GRAD_PARTIALS, x=x, sumsq=sumsq, gamma=gamma, inv_d=1.0 / d, eps=eps
        )
        dx_total, n = rms_backward_finish(bw.dn, x, dx, sumsq, bw.zeta, gamma, eps, dx_out=bw.dn)
        dgamma = bw.dgamma.to(gamma.dtype)
    return dx_total, [gemm(dz.t(), n.t())], dgamma, dx_total


def _rows(dh, x, dx, sumsq, gamma, eps):
    """The row pass after a dX GEMM that wrote dh: dx_total over dh, or over a float32
    stream a new float32 dx_total and its copy in dh's dtype over dh (``_low``)."""
    if x.dtype == dh.dtype:
        return rms_backward_rows(dh, x, dx, sumsq, gamma, eps, dx_out=dh)
    return rms_backward_rows(dh, x, dx, sumsq, gamma, eps, low_out=dh)


def _low(dx_total, low):
    """dx_total in the GEMMs' dtype: ``low`` (its copy) over a float32 stream, else itself."""
    return dx_total if low is None or low.dtype == dx_total.dtype else low

"""Residual add + RMSNorm folded into GEMM epilogues (DESIGN.md 2.1, 2.2), forward and backward.

    x = residual + y @ w_o^T          (the residual stream, returned)
    z = RMSNorm(x; gamma, eps) @ w^T  (the next GEMM)

Forward: K1 (o-proj GEMM; residual seeds the accumulator; stores x, h = x*gamma
and partial sums of x^2) -> r = rsqrt(mean x^2 + eps) -> z = r * (h @ w^T)
(row-scale epilogue). The normalized n is never written.

Backward, given dx (gradient of the stream from downstream) and dz, with
dn = dz @ w (the dX GEMM) and zeta = rowsum(dn * n):
  dx_total = r (gamma dn - x r zeta / d) + dx,  n = x r gamma (for dW),
  dgamma from per-M-tile partial column sums of dn x r;
then dW = dz^T n, dy = dx_total @ w_o, dW_o = dx_total^T y, and the residual's
gradient is dx_total. "rowwise" (default): the plain dX GEMM writes dn, and one
pass over whole rows (zeta needs the full row) writes dx_total (over dn), n and
dgamma partials. "two_pass": the dX epilogue stores dn, zeta and dgamma
partials, and one elementwise pass writes dx_total (over dn) and n.
"folded": zeta = rowsum(dz * z) from the saved z first, then the dX epilogue
writes dx_total and n directly.

Registered as torch.library custom ops with fake implementations, so
torch.compile(fullgraph=True) traces through them.
"""

from __future__ import annotations

import torch

from ..kernels.finish import (
    col_sum,
    rms_backward_finish,
    rms_backward_rows,
    rowdot,
    rstd_from_partials,
    scale_columns,
)
from ..kernels.launch import gemm
from ..programs import (
    GAMMA_WEIGHT_GRAD,
    RESIDUAL_RMS,
    RESIDUAL_SUMSQ,
    RMS_BACKWARD,
    RMS_GRAD_PARTIALS,
    ROW_SCALE,
)

BACKWARDS = ("rowwise", "two_pass", "folded")


@torch.library.custom_op("codetta::residual_rmsnorm_linear", mutates_args=())
def _forward(
    y: torch.Tensor,
    w_o: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    backward: str,
    fold_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # returns (x, z, rstd, w_gamma): w_gamma = W * gamma when fold_gamma (kept for
    # the backward), else an empty tensor
    if fold_gamma:
        # h is never written: z = r * (x @ (w * gamma)^T)
        k1 = gemm(y, w_o, epilogue=RESIDUAL_SUMSQ, residual=residual)
        rstd = rstd_from_partials(k1.sumsq, residual.shape[1], eps)
        w_gamma = _gamma_weight(w, gamma)
        z = gemm(k1.x, w_gamma, epilogue=ROW_SCALE, scale=rstd)
        return k1.x, z, rstd, w_gamma
    k1 = gemm(y, w_o, epilogue=RESIDUAL_RMS, residual=residual, gamma=gamma)
    rstd = rstd_from_partials(k1.sumsq, residual.shape[1], eps)
    z = gemm(k1.h, w, epilogue=ROW_SCALE, scale=rstd)
    return k1.x, z, rstd, w.new_empty(0)


def _gamma_weight(w, gamma):
    """W' = W * gamma over the d columns, in W's dtype (weight-sized, [N, d])."""
    return scale_columns(w.contiguous(), gamma)


@_forward.register_fake
def _(y, w_o, residual, gamma, w, eps, backward, fold_gamma):
    M = y.shape[0]
    return (
        residual.new_empty(residual.shape),
        y.new_empty((M, w.shape[0])),
        y.new_empty((M,), dtype=torch.float32),
        w.new_empty(w.shape if fold_gamma else (0,)),
    )


def _norm_backward(dx, dz, gamma, w, x, z, rstd, w_gamma, mode, fold_gamma):
    """The RMSNorm part of the backward and the next GEMM's dW: (dx_total, dW, dgamma
    partials). n, the normalized input that dW needs, is [M, d] and dies when this
    returns, before dy and dW_o allocate theirs (it is not kept to the end)."""
    if fold_gamma:
        # z = n' @ (W gamma)^T with n' = x r: dn' = dz @ (W gamma); the norm backward
        # without gamma; dW = (dz^T n') gamma and dgamma = colsum(W * dz^T n') in the
        # dW GEMM's epilogue
        dn = gemm(dz, w_gamma.t())
        dx_total, n, _ = rms_backward_rows(dn, x, dx, rstd, None, dx_out=dn)
        gw = gemm(dz.t(), n.t(), epilogue=GAMMA_WEIGHT_GRAD, gamma=gamma, w=w)
        dw, dgamma_parts = gw.dw, gw.dgamma
    else:
        if mode == "rowwise":
            # the plain dX GEMM, then one pass over whole rows writes dx_total (over dh) and n
            dh = gemm(dz, w.t())
            dx_total, n, dgamma_parts = rms_backward_rows(dh, x, dx, rstd, gamma, dx_out=dh)
        elif mode == "folded":
            # zeta = rowsum(dz * z) first, then the whole RMSNorm backward in the dX epilogue
            zeta = rowdot(dz, z)
            bw = gemm(
                dz, w.t(), epilogue=RMS_BACKWARD, x=x, dres=dx, rstd=rstd, zeta=zeta, gamma=gamma,
                inv_d=1.0 / x.shape[1],
            )  # fmt: skip
            dx_total, n, dgamma_parts = bw.dx, bw.n, bw.dgamma
        else:
            # two-pass: the dX epilogue stores dn with zeta and dgamma partials; one
            # elementwise pass finishes dx and n (no z saved, no pass over dz and z)
            bw = gemm(dz, w.t(), epilogue=RMS_GRAD_PARTIALS, x=x, rstd=rstd, gamma=gamma)
            dx_total, n = rms_backward_finish(bw.dn, x, dx, rstd, bw.zeta, gamma, dx_out=bw.dn)
            dgamma_parts = bw.dgamma
        dw = gemm(dz.t(), n.t())
    return dx_total, dw, dgamma_parts


@torch.library.custom_op("codetta::residual_rmsnorm_linear_backward", mutates_args=())
def _backward(
    dx: torch.Tensor,
    dz: torch.Tensor,
    y: torch.Tensor,
    w_o: torch.Tensor,
    gamma: torch.Tensor,
    w: torch.Tensor,
    x: torch.Tensor,
    z: torch.Tensor | None,
    rstd: torch.Tensor,
    w_gamma: torch.Tensor,
    mode: str,
    fold_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx_total, dw, dgamma_parts = _norm_backward(dx, dz, gamma, w, x, z, rstd, w_gamma, mode, fold_gamma)
    dgamma = col_sum(dgamma_parts, gamma.dtype)
    dy = gemm(dx_total, w_o.t())
    dw_o = gemm(dx_total.t(), y.t())
    return dy, dw_o, dx_total, dgamma, dw


@_backward.register_fake
def _(dx, dz, y, w_o, gamma, w, x, z, rstd, w_gamma, mode, fold_gamma):
    return (
        y.new_empty(y.shape),
        w_o.new_empty(w_o.shape),
        x.new_empty(x.shape),
        gamma.new_empty(gamma.shape),
        w.new_empty(w.shape),
    )


def _setup_context(ctx, inputs, output):
    y, w_o, residual, gamma, w, eps, backward, fold_gamma = inputs
    x, z, rstd, w_gamma = output
    ctx.mode, ctx.fold_gamma = backward, fold_gamma
    ctx.set_materialize_grads(False)  # rstd and w_gamma get no gradient: no zero tensors for them
    ctx.save_for_backward(y, w_o, gamma, w, x, z if backward == "folded" else None, rstd, w_gamma)


def _autograd_backward(ctx, dx, dz, drstd, dw_gamma):
    y, w_o, gamma, w, x, z, rstd, w_gamma = ctx.saved_tensors
    dx = torch.zeros_like(x) if dx is None else dx.contiguous()
    dz = x.new_zeros((x.shape[0], w.shape[0])) if dz is None else dz.contiguous()
    dy, dw_o, dres, dgamma, dw = _backward(
        dx, dz, y, w_o, gamma, w, x, z, rstd, w_gamma, ctx.mode, ctx.fold_gamma
    )
    return dy, dw_o, dres, dgamma, dw, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check(y, w_o, residual, gamma, w):
    for name, t in (("y", y), ("w_o", w_o), ("residual", residual), ("gamma", gamma), ("weight", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if residual.shape[-1] != w_o.shape[0]:
        raise ValueError(
            f"residual has {residual.shape[-1]} features but w_o produces {w_o.shape[0]} (w_o is [d, K])"
        )
    if y.shape[-1] != w_o.shape[1]:
        raise ValueError(f"y has {y.shape[-1]} features but w_o expects {w_o.shape[1]}")
    if y.shape[:-1] != residual.shape[:-1]:
        raise ValueError(f"y {tuple(y.shape)} and residual {tuple(residual.shape)} must share leading dims")
    if gamma.shape != (residual.shape[-1],):
        raise ValueError(f"gamma must have shape ({residual.shape[-1]},), got {tuple(gamma.shape)}")
    if w.dim() != 2 or w.shape[1] != residual.shape[-1]:
        raise ValueError(f"weight must be [N, {residual.shape[-1]}], got {tuple(w.shape)}")
    if residual.dtype != y.dtype:
        raise TypeError(f"residual ({residual.dtype}) and y ({y.dtype}) must share a dtype")
    if gamma.dtype not in (torch.float32, y.dtype):
        raise TypeError(f"gamma must be float32 or {y.dtype}, got {gamma.dtype}")


def residual_rmsnorm_linear(
    y: torch.Tensor,
    w_o: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    weight: torch.Tensor,
    eps: float | None = None,
    backward: str = "rowwise",
    fold_gamma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x = residual + y @ w_o.T``;  ``z = rms_norm(x, gamma, eps) @ weight.T``.  Returns (x, z).

    y [..., K], w_o [d, K], residual [..., d], gamma [d] (float32 or the input
    dtype), weight [N, d]; ``eps=None`` means ``torch.finfo(dtype).eps`` as in
    ``torch.nn.RMSNorm``. Differentiable in every tensor argument.

    ``backward`` picks the RMSNorm backward: ``"rowwise"`` (default: the plain
    dX GEMM, then one pass over whole rows writes dx and n), ``"two_pass"``
    (the dX GEMM's epilogue stores dn with zeta and dgamma partials, one
    elementwise pass finishes dx and n) or ``"folded"`` (zeta = rowsum(dz z)
    first, then everything in the dX GEMM's epilogue; saves z). Same math;
    NOTES.md has the measured times of each.

    ``fold_gamma=True`` applies gamma on the next GEMM's side instead (DESIGN.md
    2.1): the K1 GEMM stores only x and the sums of squares (h is never written)
    and the next GEMM runs on x with W * gamma (formed once in the forward and
    kept for the backward: one weight-sized buffer); the backward gets dgamma
    from the dW GEMM's epilogue. Needs ``backward="rowwise"``.
    """
    _check(y, w_o, residual, gamma, weight)
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if fold_gamma and backward != "rowwise":
        raise ValueError(f"fold_gamma=True needs backward='rowwise', got {backward!r}")
    lead = residual.shape[:-1]
    eps = torch.finfo(residual.dtype).eps if eps is None else float(eps)
    x, z, _, _ = _forward(
        y.reshape(-1, y.shape[-1]).contiguous(),
        w_o,
        residual.reshape(-1, residual.shape[-1]).contiguous(),
        gamma,
        weight,
        eps,
        backward,
        bool(fold_gamma),
    )
    return x.reshape(*lead, x.shape[-1]), z.reshape(*lead, z.shape[-1])

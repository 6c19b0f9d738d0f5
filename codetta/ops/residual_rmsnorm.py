"""Residual add + RMSNorm folded into GEMM epilogues (docs/design.md), forward and backward.

    x = residual + y @ w_o^T          (the residual stream, returned)
    z = RMSNorm(x; gamma, eps) @ w^T  (the next GEMM)

Forward: K1 (o-proj GEMM; residual seeds the accumulator; stores x, h = x*gamma
and the row sums of x^2) -> z = r * (h @ w^T), r = rsqrt(sumsq / d + eps)
formed in the next GEMM's epilogue (RMS_SCALE). Neither n nor r is written.

Backward, given dx (gradient of the stream from downstream) and dz, with
dn = dz @ w (the dX GEMM) and zeta = rowsum(dn * n):
  dx_total = r (gamma dn - x r zeta / d) + dx,  n = x r gamma (for dW),
  dgamma = colsum(dn x r);
then dW = dz^T n, dy = dx_total @ w_o, dW_o = dx_total^T y, and the residual's
gradient is dx_total. The default ("rowwise"): the plain dX GEMM writes dn, and
one pass over whole rows (zeta needs the full row) writes dx_total (over dn), n
and dgamma partials. Research variants, for the benchmarks
(``residual_rmsnorm_linear_variant``): "two_pass" (the dX epilogue stores dn,
zeta and dgamma; one elementwise pass writes dx_total and n), "folded" (zeta =
rowsum(dz * z) from the saved z first, then the dX epilogue writes dx_total and
n directly) and fold_gamma (gamma applied to the next GEMM's weight; h never
written). NOTES.md has each one's measured time.

Registered as torch.library custom ops with fake implementations, so
torch.compile(fullgraph=True) traces through them.
"""

from __future__ import annotations

import math

import torch

from ..kernels.launch import gemm
from ..kernels.operands import check_dtype, check_gemm_dtype, check_same_device, check_tensor
from ..kernels.reductions import col_sum
from ..programs import (
    GAMMA_WEIGHT_GRAD,
    RESIDUAL_RMS,
    RESIDUAL_SUMSQ,
    RMS_BACKWARD,
    RMS_GRAD_PARTIALS,
    RMS_SCALE,
)
from ..programs.norm_rows import rms_backward_finish, rms_backward_rows, rowdot, scale_columns

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
    # returns (x, z, sumsq, w_gamma): w_gamma = W * gamma when fold_gamma (kept for
    # the backward), else an empty tensor
    d = residual.shape[1]
    if fold_gamma:
        # h is never written: z = r * (x @ (w * gamma)^T)
        k1 = gemm(y, w_o, epilogue=RESIDUAL_SUMSQ, residual=residual)
        w_gamma = scale_columns(w.contiguous(), gamma)
        z = gemm(k1.x, w_gamma, epilogue=RMS_SCALE, sumsq=k1.sumsq, inv_d=1.0 / d, eps=eps)
        return k1.x, z, k1.sumsq, w_gamma
    k1 = gemm(y, w_o, epilogue=RESIDUAL_RMS, residual=residual, gamma=gamma)
    z = gemm(k1.h, w, epilogue=RMS_SCALE, sumsq=k1.sumsq, inv_d=1.0 / d, eps=eps)
    return k1.x, z, k1.sumsq, w.new_empty(0)


@_forward.register_fake
def _(y, w_o, residual, gamma, w, eps, backward, fold_gamma):
    M = y.shape[0]
    return (
        residual.new_empty(residual.shape),
        y.new_empty((M, w.shape[0])),
        y.new_empty((M,), dtype=torch.float32),
        w.new_empty(w.shape if fold_gamma else (0,)),
    )


def _norm_backward(dx, dz, gamma, w, x, z, sumsq, w_gamma, eps, mode, fold_gamma):
    """The RMSNorm part of the backward and the next GEMM's dW: (dx_total, dW, dgamma).
    n, the normalized input that dW needs, is [M, d] and dies when this returns,
    before dy and dW_o allocate theirs (it is not kept to the end)."""
    d = x.shape[1]
    if fold_gamma:
        # z = n' @ (W gamma)^T with n' = x r: dn' = dz @ (W gamma); the norm backward
        # without gamma; dW = (dz^T n') gamma and dgamma = colsum(W * dz^T n') in the
        # dW GEMM's epilogue
        dn = gemm(dz, w_gamma.t())
        dx_total, n, _ = rms_backward_rows(dn, x, dx, sumsq, None, eps, dx_out=dn)
        gw = gemm(dz.t(), n.t(), epilogue=GAMMA_WEIGHT_GRAD, gamma=gamma, w=w)
        return dx_total, gw.dw, gw.dgamma.to(gamma.dtype)
    if mode == "rowwise":
        # the plain dX GEMM, then one pass over whole rows writes dx_total (over dh) and n
        dh = gemm(dz, w.t())
        dx_total, n, dgamma_parts = rms_backward_rows(dh, x, dx, sumsq, gamma, eps, dx_out=dh)
        dgamma = col_sum(dgamma_parts, dtype=gamma.dtype)
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
    return dx_total, gemm(dz.t(), n.t()), dgamma


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
    sumsq: torch.Tensor,
    w_gamma: torch.Tensor,
    eps: float,
    mode: str,
    fold_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx_total, dw, dgamma = _norm_backward(dx, dz, gamma, w, x, z, sumsq, w_gamma, eps, mode, fold_gamma)
    dy = gemm(dx_total, w_o.t())
    dw_o = gemm(dx_total.t(), y.t())
    return dy, dw_o, dx_total, dgamma, dw


@_backward.register_fake
def _(dx, dz, y, w_o, gamma, w, x, z, sumsq, w_gamma, eps, mode, fold_gamma):
    return (
        y.new_empty(y.shape),
        w_o.new_empty(w_o.shape),
        x.new_empty(x.shape),
        gamma.new_empty(gamma.shape),
        w.new_empty(w.shape),
    )


def _setup_context(ctx, inputs, output):
    y, w_o, residual, gamma, w, eps, backward, fold_gamma = inputs
    x, z, sumsq, w_gamma = output
    ctx.eps, ctx.mode, ctx.fold_gamma = eps, backward, fold_gamma
    ctx.set_materialize_grads(False)  # sumsq and w_gamma get no gradient: no zero tensors for them
    ctx.save_for_backward(y, w_o, gamma, w, x, z if backward == "folded" else None, sumsq, w_gamma)


def _autograd_backward(ctx, dx, dz, dsumsq, dw_gamma):
    y, w_o, gamma, w, x, z, sumsq, w_gamma = ctx.saved_tensors
    dx = torch.zeros_like(x) if dx is None else dx.contiguous()
    dz = x.new_zeros((x.shape[0], w.shape[0])) if dz is None else dz.contiguous()
    dy, dw_o, dres, dgamma, dw = _backward(
        dx, dz, y, w_o, gamma, w, x, z, sumsq, w_gamma, ctx.eps, ctx.mode, ctx.fold_gamma
    )
    return dy, dw_o, dres, dgamma, dw, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check(y, w_o, residual, gamma, w, eps) -> float:
    """Validate the operator's arguments (naming them as the caller does); return eps."""
    named = {"y": y, "w_o": w_o, "residual": residual, "gamma": gamma, "weight": w}
    for name, t in named.items():
        check_tensor(name, t)
    check_same_device(named)
    for name in ("y", "w_o", "residual", "weight"):
        check_gemm_dtype(name, named[name], on_gpu_too=False)
    for name in ("w_o", "residual", "weight"):
        if named[name].dtype != y.dtype:
            raise TypeError(f"{name} ({named[name].dtype}) must have y's dtype ({y.dtype})")
    check_gemm_dtype("y", y)
    check_dtype("gamma", gamma, (torch.float32, y.dtype), f"float32 or y's dtype ({y.dtype})")
    if w_o.dim() != 2 or w.dim() != 2:
        raise ValueError(f"w_o and weight must be 2-D, got shapes {tuple(w_o.shape)} and {tuple(w.shape)}")
    if y.dim() < 1 or y.shape[-1] != w_o.shape[1]:
        raise ValueError(
            f"y has {y.shape[-1] if y.dim() else 0} features but w_o [d, K] expects K={w_o.shape[1]}"
        )
    d = w_o.shape[0]
    if residual.shape[-1] != d:
        raise ValueError(f"residual has {residual.shape[-1]} features but w_o produces d={d} (w_o is [d, K])")
    if y.shape[:-1] != residual.shape[:-1]:
        raise ValueError(f"y {tuple(y.shape)} and residual {tuple(residual.shape)} must share leading dims")
    if gamma.shape != (d,):
        raise ValueError(f"gamma must have shape ({d},), got {tuple(gamma.shape)}")
    if w.shape[1] != d:
        raise ValueError(f"weight must be [N, {d}], got {tuple(w.shape)}")
    unit = 16 // y.element_size()
    for what, size in (
        ("y's features K", w_o.shape[1]),
        ("the hidden size d", d),
        ("weight's N", w.shape[0]),
    ):
        if size % unit:
            raise ValueError(
                f"{what} = {size} must be a multiple of {unit} for {y.dtype} "
                "(TMA moves rows in 16-byte units)"
            )
    eps = torch.finfo(y.dtype).eps if eps is None else eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def residual_rmsnorm_linear(
    y: torch.Tensor,
    w_o: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    weight: torch.Tensor,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x = residual + y @ w_o.T``;  ``z = rms_norm(x, gamma, eps) @ weight.T``.  Returns (x, z).

    y [..., K], w_o [d, K], residual [..., d], gamma [d] (float32 or the input
    dtype), weight [N, d]; ``eps=None`` means ``torch.finfo(dtype).eps`` as in
    ``torch.nn.RMSNorm``. Differentiable in every tensor argument. bf16/fp16 on
    the GPU (fp32 too on CPU); K, d and N multiples of 8 (16-byte rows).
    """
    return residual_rmsnorm_linear_variant(y, w_o, residual, gamma, weight, eps)


def residual_rmsnorm_linear_variant(y, w_o, residual, gamma, weight, eps=None, backward="rowwise",
                                    fold_gamma=False):  # fmt: skip
    """``residual_rmsnorm_linear`` with a research variant of the backward (see the
    module's docstring; for benchmarks and tests): ``backward`` one of
    ``BACKWARDS``; ``fold_gamma=True`` (needs "rowwise") applies gamma to the next
    GEMM's weight instead of writing h."""
    eps = _check(y, w_o, residual, gamma, weight, eps)
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if fold_gamma and backward != "rowwise":
        raise ValueError(f"fold_gamma=True needs backward='rowwise', got {backward!r}")
    lead = residual.shape[:-1]
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

"""Residual add + RMSNorm folded into GEMM epilogues (docs/design.md), forward and backward.

    x = residual + y @ w_o^T          (the residual stream, returned)
    z = RMSNorm(x; gamma, eps) @ w^T  (the next GEMM)

Forward: K1 (o-proj GEMM; residual seeds the accumulator; stores x, h = x*gamma
and the row sums of x^2) -> z = r * (h @ w^T), r = rsqrt(sumsq / d + eps)
formed in the next GEMM's epilogue (RMS_SCALE). Neither n nor r is written
(in float16, whose range may not hold h, K1 stores no h over a float16 stream and one
row pass writes n = x r gamma; the next GEMMs' r is 1: ``_k1``).
Without a next GEMM, ``residual_rmsnorm`` forms n in one pass after K1, and
``residual_rmsnorm_factors`` returns h and r themselves (the mode ``FACTORS``: a
consumer that scales rows, the loss's ``row_scale``; its backward takes dh and dr,
``norm_backward.py``).

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
from typing import NamedTuple

import torch

from ..kernels.launch import gemm, parts_fit
from ..kernels.operands import GEMM_DTYPES, check_dtype, check_same_device, check_tensor
from ..kernels.settings import SETTINGS
from ..programs import (
    RESIDUAL_RMS,
    RESIDUAL_RMS_F32,
    RESIDUAL_SUMSQ,
    RMS_SCALE,
    RMS_SCALE_BIAS,
)
from ..programs.norm_rows import gamma_sumsq, normalize_rows, scale_columns
from ..programs.rope import (
    RMS_QKNORM_ROPE,
    RMS_QKNORM_ROPE_PAIRS,
    RMS_ROPE,
    RMS_ROPE_BIAS,
    RMS_ROPE_PAIRS,
    RMS_ROPE_QKV,
    qknorm_backward_rows,
    unrotate_half_rows,
    unrotate_two_rows,
)
from ..programs.swiglu import SWIGLU_RMS, dswiglu_reference
from ._eager import FastOp, derived, refuse_nonzero, saved_tensors
from .norm_backward import BACKWARDS, FACTORS, norm_backward
from .norm_checks import bias_args, check_args, mixed, weights_of
from .rope import RoPE, column_freq, rope_operands
from .swiglu import dswiglu_dx


def _forward_impl(
    y: torch.Tensor,
    w_o: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    ws: list[torch.Tensor],
    eps: float,
    backward: str,
    fold_gamma: bool,
    gate_up: list[torch.Tensor],
    swiglu: bool,
    rope: list[torch.Tensor],
    rope_scaling: float,
    n_rope: int,
    qk_eps: float,
    rope_pairs: bool,
    internal: bool,
    keep_y: bool,
    biases: list[torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    # rope: [] or [positions [M], frequencies [head_dim], (a q/k norm weight [head_dim]
    # per rotated output)]: the first n_rope outputs (q, k) get RoPE (rotate-half, or with
    # rope_pairs interleaved pairs: then the frequencies are inv_freq.repeat_interleave(2)),
    # after that per-head norm if given, in their GEMM's epilogue; then zs also holds,
    # after the outputs, each normed one's un-normalized z (for the backward)
    # returns (x, [z per next weight], sumsq, w_gamma): w_gamma = W * gamma when
    # fold_gamma (one next weight; kept for the backward), else an empty tensor.
    # gate_up: [g, u] when y = silu(g) * u came from a SwiGLU epilogue (the backward then
    # returns their gradients from the dX GEMM's epilogue); swiglu: ws = [W_gate, W_up]
    # and zs = [g, u, y] from one paired GEMM; internal: those SwiGLU tensors (made here
    # or taken as gate_up) are seen by no one else (the Hugging Face drop-in): nothing is
    # kept for a gradient reaching y directly, and the backward writes dg, du over g, u
    # keep_y: with gate_up, whether the backward gets y (else it forms y again from g and u:
    # ``Settings.keeps_y``, decided by the caller: an argument, so a traced graph records it
    # and torch.compile's caches tell the two apart)
    # no o-projection (w_o [d, 0], y [M, 0]; ``rmsnorm_linear``): x is the residual itself,
    # returned as an empty tensor (an output may not alias an input), h and sumsq from one
    # row pass (in float16 a second pass writes n over h: ``_k1``)
    # biases: [] or one [N_i] bias per next weight, added in the epilogues (before RoPE);
    # only with next weights, the default backward (rowwise, no fold_gamma), swiglu=False
    # (a SwiGLU y is fine), no q/k norms and rotate-half RoPE (the callers check first)
    if biases and (not ws or swiglu or fold_gamma or backward != "rowwise" or rope_pairs or len(rope) > 2):
        raise ValueError(
            "biases: only with next weights, backward='rowwise' without fold_gamma, swiglu=False, "
            "no q/k norms and rotate-half RoPE"
        )
    d = residual.shape[1]
    if not ws and backward == FACTORS:
        # no next GEMM, the norm's output as its factors: h and r = rsqrt(sumsq / d + eps)
        k1 = _k1(y, w_o, residual, gamma, eps, factors=True)
        return k1.x, [k1.h, torch.rsqrt(k1.sumsq * (1.0 / d) + eps)], k1.sumsq, residual.new_empty(0)
    if not ws:
        # no next GEMM: the normalized rows themselves, n = h * r (one pass over [M, d])
        k1 = _k1(y, w_o, residual, gamma, eps)
        n = k1.h if k1.inv_d == 0.0 else normalize_rows(k1.h, k1.sumsq, eps)
        return k1.x, [n], k1.sumsq, residual.new_empty(0)
    if swiglu:
        k1 = _k1(y, w_o, residual, gamma, eps)
        act = gemm(k1.h, ws[0], epilogue=SWIGLU_RMS, up=ws[1], sumsq=k1.sumsq, inv_d=k1.inv_d, eps=k1.eps)
        return k1.x, list(act), k1.sumsq, ws[0].new_empty(0)
    if fold_gamma:
        # h is never written: z = r * (x @ (w * gamma)^T)
        k1 = gemm(y, w_o, epilogue=RESIDUAL_SUMSQ, residual=residual)
        w_gamma = scale_columns(ws[0].contiguous(), gamma)
        z = gemm(k1.x, w_gamma, epilogue=RMS_SCALE, sumsq=k1.sumsq, inv_d=1.0 / d, eps=eps)
        return k1.x, [z], k1.sumsq, w_gamma
    k1 = _k1(y, w_o, residual, gamma, eps)
    widths = tuple(w.shape[0] for w in ws)
    one_launch = SETTINGS.qkv_one_launch and not rope_pairs and rope_scaling == 1.0 and not biases
    if (one_launch and n_rope == 2 and len(ws) == 3 and len(rope) == 2
            and parts_fit(RMS_ROPE_QKV[rope[1].shape[0]], k1.h.device, widths=widths)):  # fmt: skip
        # q, k and v in one GEMM over the three weights (N parts), each into its own tensor:
        # v's columns get RoPE frequency 0, an exact identity rotation (cos 1, sin 0)
        pos, freq = rope
        cols = derived(freq, widths, lambda: torch.cat([column_freq(freq, widths[0]),
                        column_freq(freq, widths[1]), freq.new_zeros(widths[2])]))  # fmt: skip
        zs = gemm(k1.h, ws[0], epilogue=RMS_ROPE_QKV[freq.shape[0]], w1=ws[1], w2=ws[2], sumsq=k1.sumsq,
                  inv_d=k1.inv_d, eps=k1.eps, pos=pos, freq=cols, scaling=rope_scaling)  # fmt: skip
        return k1.x, list(zs), k1.sumsq, ws[0].new_empty(0)
    zs, pres = [], []
    for i, w in enumerate(ws):
        norm = {"sumsq": k1.sumsq, "inv_d": k1.inv_d, "eps": k1.eps}
        if biases:
            norm["bias"] = biases[i]
        if i < n_rope:
            pos, freq, *qk_ws = rope
            rot = {"pos": pos, "freq": column_freq(freq, w.shape[0]), "scaling": rope_scaling}
            if qk_ws:
                prog = (RMS_QKNORM_ROPE_PAIRS if rope_pairs else RMS_QKNORM_ROPE)[freq.shape[0]]
                qk_w = column_freq(qk_ws[i], w.shape[0], keep=False)  # a trained weight: made per call
                out = gemm(k1.h, w, epilogue=prog, **norm, **rot, qk_w=qk_w, qk_eps=qk_eps)
                zs.append(out.out)
                pres.append(out.pre)
            else:
                progs = RMS_ROPE_BIAS if biases else RMS_ROPE_PAIRS if rope_pairs else RMS_ROPE
                prog = progs[freq.shape[0]]
                zs.append(gemm(k1.h, w, epilogue=prog, **norm, **rot))
        else:
            zs.append(gemm(k1.h, w, epilogue=RMS_SCALE_BIAS if biases else RMS_SCALE, **norm))
    return k1.x, zs + pres, k1.sumsq, ws[0].new_empty(0)


class _K1(NamedTuple):
    x: torch.Tensor
    h: torch.Tensor
    sumsq: torch.Tensor
    inv_d: float  # the next GEMMs' row scale r = rsqrt(sumsq * inv_d + eps) ...
    eps: float  # ... (inv_d 0 and eps 1: r = 1, h already normalized)


def _k1(y, w_o, residual, gamma, eps, factors=False) -> _K1:
    """K1 (x = residual + y @ w_o^T, h = x * gamma, sumsq); without an o-projection
    (w_o [d, 0]) x is the residual (an empty tensor stands for it) and one row pass forms
    h and sumsq. A float32 residual stream (``mixed``) keeps x in float32, unrounded, and
    h in the GEMMs' dtype.

    float16 GEMMs (unless ``factors``: that mode hands h = x * gamma on by contract)
    normalize first, as PyTorch does: x * gamma alone may pass float16's 65504 (a massive
    activation of 1500 under a gamma of 50) or fall into its subnormals (rows of RMS ~1e-4
    under small gammas) where n = x r gamma does not, so one row pass writes n (from x,
    rounded once) and the next GEMMs get inv_d 0 and eps 1 (r = rsqrt(1) = 1). Over a
    float16 stream K1 is RESIDUAL_SUMSQ (no h written; K1's tuned picks, ``tuned_like``),
    else n is written over h. The next GEMMs' programs and entries are the same; one read
    of x more per norm. The backward reads x,
    sumsq and gamma, never h: unchanged. bf16 (float32's exponent range) keeps h = x gamma."""
    d = residual.shape[1]
    first = y.dtype == torch.float16 and not factors  # (normalize first)
    if first and w_o.shape[1] != 0 and not mixed(residual, y):
        # K1 without h (RESIDUAL_SUMSQ: x and sumsq), then n from x in a new tensor
        x, sumsq = gemm(y, w_o, epilogue=RESIDUAL_SUMSQ, residual=residual)
        return _K1(x, normalize_rows(x, sumsq, eps, gamma=gamma), sumsq, 0.0, 1.0)
    if w_o.shape[1] == 0:
        k1 = _K1(residual.new_empty(0), *gamma_sumsq(residual, gamma, dtype=y.dtype), 1.0 / d, eps)
    else:
        prog = RESIDUAL_RMS_F32 if mixed(residual, y) else RESIDUAL_RMS
        k1 = _K1(*gemm(y, w_o, epilogue=prog, residual=residual, gamma=gamma), 1.0 / d, eps)
    if not first:
        return k1
    # (no o-projection, or a float32 stream: no program stores x and sumsq alone, so h is
    # written and n then written over it)
    x = residual if w_o.shape[1] == 0 else k1.x
    return k1._replace(h=normalize_rows(x, k1.sumsq, eps, gamma=gamma, out=k1.h), inv_d=0.0, eps=1.0)


_forward = torch.library.custom_op("codetta::residual_rmsnorm_linear", mutates_args=())(_forward_impl)


@_forward.register_fake
def _(
    y,
    w_o,
    residual,
    gamma,
    ws,
    eps,
    backward,
    fold_gamma,
    gate_up,
    swiglu,
    rope,
    rope_scaling,
    n_rope,
    qk_eps,
    rope_pairs,
    internal,
    keep_y,
    biases,
):
    M = y.shape[0]
    pre = ws[:n_rope] if len(rope) > 2 else []  # the normed outputs' z
    if ws:
        zs = [y.new_empty((M, w.shape[0])) for w in ws + ws[:1] * swiglu + pre]
    elif backward == FACTORS:
        zs = [y.new_empty(residual.shape), y.new_empty((M,), dtype=torch.float32)]  # (h, r)
    else:
        zs = [y.new_empty(residual.shape)]  # (n, in the GEMMs' dtype)
    return (
        residual.new_empty(0 if w_o.shape[1] == 0 else residual.shape),
        zs,
        y.new_empty((M,), dtype=torch.float32),
        # (as the real op: the empty w_gamma in the next weights' dtype, or the residual's
        # without next weights)
        ws[0].new_empty(ws[0].shape) if fold_gamma else (ws[0] if ws else residual).new_empty(0),
    )


def _backward_impl(
    dx: torch.Tensor | None,
    dzs: list[torch.Tensor],
    y: torch.Tensor,
    w_o: torch.Tensor,
    gamma: torch.Tensor,
    ws: list[torch.Tensor],
    x: torch.Tensor,
    z: torch.Tensor | None,
    sumsq: torch.Tensor,
    w_gamma: torch.Tensor,
    eps: float,
    mode: str,
    fold_gamma: bool,
    gate_up: list[torch.Tensor],
    rope: list[torch.Tensor],
    rope_scaling: float,
    n_rope: int,
    qk_eps: float,
    rope_pairs: bool,
    pres: list[torch.Tensor],
    overwrite: bool,
    n_bias: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    # returns (dy, dW_o, dx_total, dgamma, [dW per next weight] + [dg, du] with gate_up;
    # dy is then empty: y's gradient goes to g and u). overwrite: dg, du may be written
    # over gate_up (an internal SwiGLU); the custom op (what torch.compile traces) never
    # does, its schema mutates nothing: only the eager path does (_backward_body)
    # n_bias: 0, or every next weight had a bias (len(ws)): their gradients (float32) come last
    return _backward_body(dx, dzs, y, w_o, gamma, ws, x, z, sumsq, w_gamma, eps, mode, fold_gamma, gate_up,
                          rope, rope_scaling, n_rope, qk_eps, rope_pairs, pres, False, n_bias)  # fmt: skip


def _backward_body(dx, dzs, y, w_o, gamma, ws, x, z, sumsq, w_gamma, eps, mode, fold_gamma, gate_up, rope,
                   rope_scaling, n_rope, qk_eps, rope_pairs, pres, overwrite, n_bias=0):  # fmt: skip
    if n_rope:
        # the rotation's transpose turns the rotated outputs' gradients into the GEMMs' (one
        # pass over each; freq holds each head's frequencies twice, the pass takes them once)
        pos, freq, *qk_ws = rope
        if rope_pairs:  # every other entry, contiguous for the passes: made once per table
            half = derived(freq, "first_of_pairs", lambda: freq[0::2].contiguous())
        else:
            half = freq[: freq.shape[0] // 2]
        dzs, dqk = list(dzs), []
        if qk_ws:  # the per-head norm's backward in the same pass
            for i in range(n_rope):
                dzs[i], dw = qknorm_backward_rows(
                    dzs[i], pres[i], qk_ws[i], pos, half, rope_scaling, qk_eps, pairs=rope_pairs
                )
                dqk.append(dw.to(qk_ws[i].dtype))
        elif n_rope == 2:  # q's and k's gradients in one launch
            dzs[0], dzs[1] = unrotate_two_rows(dzs[0], dzs[1], pos, half, rope_scaling, pairs=rope_pairs)
        else:  # (one rotated output, or three and more: each its own pass)
            for i in range(n_rope):
                dzs[i] = unrotate_half_rows(dzs[i], pos, half, rope_scaling, pairs=rope_pairs)
    # a bias's gradient: the column sums of its output's gradient (before the rotation)
    dbs = [dzs[i].sum(0, dtype=torch.float32) for i in range(n_bias)]
    # (dx_low: dx_total in the GEMMs' dtype, a copy over a float32 stream)
    dx_total, dws, dgamma, dx_low = norm_backward(dx, dzs, gamma, ws, x, z, sumsq, w_gamma, eps, mode,
                                                  fold_gamma)  # fmt: skip
    if w_o.shape[1] == 0:  # no o-projection: no dy, no dW_o
        dy, dw_o = y.new_empty(y.shape), w_o.new_empty(w_o.shape)
    else:
        if gate_up:
            # y = silu(g) * u: the dSwiGLU in the dX GEMM's epilogue (dy itself is never written)
            # (y not kept, CODETTA_SWIGLU_KEEP_Y=0: a placeholder, y formed again from g and u;
            # overwrite: dg, du written over g, u, an internal SwiGLU's, in eager mode)
            dg, du, formed = dswiglu_dx(dx_low, w_o.t(), *gate_up, y.dim() == 1, overwrite)
            y = y if formed is None else formed
            dy, dws = y.new_empty(0), dws + [dg, du]
        else:
            dy = gemm(dx_low, w_o.t())
        dw_o = gemm(dx_low.t(), y.t())
    if n_rope and len(rope) > 2:
        dws = dws + dqk  # the q/k norm weights' gradients, after the next weights'
    return dy, dw_o, dx_total, dgamma, dws + dbs


_backward = torch.library.custom_op("codetta::residual_rmsnorm_linear_backward", mutates_args=())(
    _backward_impl
)


@_backward.register_fake
def _(
    dx,
    dzs,
    y,
    w_o,
    gamma,
    ws,
    x,
    z,
    sumsq,
    w_gamma,
    eps,
    mode,
    fold_gamma,
    gate_up,
    rope,
    rope_scaling,
    n_rope,
    qk_eps,
    rope_pairs,
    pres,
    overwrite,
    n_bias,
):
    qk_ws = rope[2:] if n_rope else []
    return (
        y.new_empty(0 if gate_up else y.shape),
        w_o.new_empty(w_o.shape),
        x.new_empty(x.shape),
        gamma.new_empty(gamma.shape),
        [w.new_empty(w.shape) for w in ws]
        + [t.new_empty(t.shape) for t in gate_up]
        + [w.new_empty(w.shape) for w in qk_ws]
        + [w.new_empty((w.shape[0],), dtype=torch.float32) for w in ws[:n_bias]],
    )


def _setup_context(ctx, inputs, output):
    (
        y,
        w_o,
        residual,
        gamma,
        ws,
        eps,
        backward,
        fold_gamma,
        gate_up,
        swiglu,
        rope,
        rope_scaling,
        n_rope,
        qk_eps,
        rope_pairs,
        internal,
        keep_y,
        biases,
    ) = inputs
    x, zs, sumsq, w_gamma = output
    ctx.bias_dtypes = [b.dtype for b in biases]
    ctx.eps, ctx.mode, ctx.fold_gamma, ctx.n_ws = eps, backward, fold_gamma, len(ws)
    ctx.n_gate_up, ctx.swiglu = len(gate_up), swiglu
    ctx.rope, ctx.rope_scaling, ctx.n_rope, ctx.qk_eps = list(rope), rope_scaling, n_rope, qk_eps
    ctx.rope_pairs, ctx.internal = rope_pairs, internal
    pres = tuple(zs[len(ws) :]) if n_rope else ()  # the q/k norms' inputs z (with qk norms)
    ctx.n_pres = len(pres)
    ctx.set_materialize_grads(False)  # sumsq and w_gamma get no gradient: no zero tensors for them
    # with swiglu, g and u (zs[0], zs[1]) in case y is also used outside the next operator
    # (not for an internal SwiGLU: the next operator's backward writes over them)
    kept = (*gate_up, *zs[:2]) if swiglu and not internal else (*gate_up, *pres)
    if w_o.shape[1] == 0:
        x = residual  # no o-projection: the norm's input is the residual itself
    if gate_up and not keep_y:
        y = y.new_empty(0)  # (a SwiGLU y: the backward forms it again from g and u, DSWIGLU_Y)
    ctx.save_for_backward(
        y, w_o, gamma, x, zs[0] if backward == "folded" else None, sumsq, w_gamma, *ws, *kept
    )


def _autograd_backward(ctx, dx, dzs, dsumsq, dw_gamma):
    y, w_o, gamma, x, z, sumsq, w_gamma, *rest = saved_tensors(ctx, "residual_rmsnorm_linear")
    ws, gate_up = rest[: ctx.n_ws], rest[ctx.n_ws : ctx.n_ws + ctx.n_gate_up]
    pres = rest[ctx.n_ws + ctx.n_gate_up : ctx.n_ws + ctx.n_gate_up + ctx.n_pres]
    if dx is not None and dx.shape == x.shape:
        dx = dx.contiguous()
    elif ctx.mode not in ("rowwise", FACTORS):
        dx = torch.zeros_like(x)  # (the research backwards read a tensor)
    else:
        # no gradient reaches x from downstream (the first layer's norm input, whose
        # stream gradient arrives through the next operator; an unused final x): the
        # row pass reads none, instead of a [M, d] tensor of zeros
        dx = None
    if ctx.mode == FACTORS:  # (no next weight: h's and r's gradients, zeros for one that got none)
        dh, dr = dzs if dzs is not None else (None, None)
        M, d = x.shape[0], x.shape[1]
        dzs = [y.new_zeros((M, d)) if dh is None else dh.contiguous(),
               x.new_zeros(M, dtype=torch.float32) if dr is None else dr.float().contiguous()]  # fmt: skip
    else:
        if dzs is None:
            dzs = [None] * max(1, ctx.n_ws + ctx.swiglu)
        dzs = list(dzs)[: max(1, ctx.n_ws + ctx.swiglu)]  # the q/k norms' z are internal: no gradient
    if ctx.swiglu:
        # zs = [g, u, y]: a gradient that reaches y directly (y used outside the next
        # operator, which sends its gradient to g and u) goes through SwiGLU here
        dg, du, dact = dzs
        if dact is not None and ctx.internal:
            # nothing was kept for it: only zeros may come (AOTAutograd forms a tangent of
            # zeros for y where a compiled graph ends between this operator and the next,
            # which sends y none); anything else is a use outside the next operator
            refuse_nonzero(
                dact,
                "a gradient reached an internal SwiGLU's y directly (residual_rmsnorm_swiglu(..., "
                "internal=True)): its g and u were not kept for it; use internal=False where y is "
                "used outside the next operator",
            )
            dact = None
        if dact is not None:
            g, u = rest[-2:]
            extra = dswiglu_reference(dact, g, u)
            dg = extra["dg"] if dg is None else dg + extra["dg"]
            du = extra["du"] if du is None else du + extra["du"]
        dzs = [dg, du]
    if ctx.mode != FACTORS:
        widths = [w.shape[0] for w in ws] if ws else [x.shape[1]]  # no next weight: dn [M, d]
        dzs = [y.new_zeros((x.shape[0], n)) if g is None else g.contiguous() for g, n in zip(dzs, widths)]
    dy, dw_o, dres, dgamma, dws = _backward_fast(
        dx, dzs, y, w_o, gamma, ws, x, z, sumsq, w_gamma, ctx.eps, ctx.mode, ctx.fold_gamma, list(gate_up),
        ctx.rope, ctx.rope_scaling, ctx.n_rope, ctx.qk_eps, ctx.rope_pairs, list(pres),
        bool(ctx.internal) and len(gate_up) > 0 and bool(SETTINGS.overwrite_saved), len(ctx.bias_dtypes),
    )  # fmt: skip
    # dws: the next weights', then g's and u's (a SwiGLU y), then the q/k norm weights',
    # then the biases' (float32)
    n, g, nb = ctx.n_ws, ctx.n_gate_up, len(ctx.bias_dtypes)
    dbs = [db.to(dt) for db, dt in zip(dws[len(dws) - nb :], ctx.bias_dtypes)]
    dws = dws[: len(dws) - nb]
    rope_grads = [None, None] + list(dws[n + g :]) if len(ctx.rope) > 2 else [None] * len(ctx.rope)
    # swiglu, rope, rope_scaling, n_rope, qk_eps, rope_pairs, internal, keep_y, biases
    rest = (None, rope_grads, None, None, None, None, None, None, dbs)
    if gate_up:
        return None, dw_o, dres, dgamma, dws[:n], None, None, None, dws[n : n + g], *rest
    return dy, dw_o, dres, dgamma, dws[:n], None, None, None, [], *rest


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)
# eager calls skip torch.library's dispatch (ops/_eager.py); torch.compile traces the custom ops
_forward_fast = FastOp(_forward, _forward_impl, _setup_context, _autograd_backward)
_backward_fast = FastOp(_backward, _backward_body)  # (eager: overwrite as asked)


class SwiGLU(NamedTuple):
    """``y = silu(gate) * up`` with the gate and up projections it came from
    (``residual_rmsnorm_swiglu`` returns one). Given as ``residual_rmsnorm_linear``'s
    ``y``, the down projection's backward forms the gate's and up's gradients in its dX
    GEMM's epilogue (dy is never written). ``internal`` (``residual_rmsnorm_swiglu(...,
    internal=True)``): gate and up are read by nothing but that next operator, whose
    backward then writes their gradients over them (two [M, f] tensors off its peak)."""

    y: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    internal: bool = False


def residual_rmsnorm_swiglu(
    y: torch.Tensor,
    w_o: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    eps: float | None = None,
    internal: bool = False,
) -> tuple[torch.Tensor, SwiGLU]:
    """``x = residual + y @ w_o.T``;  ``n = rms_norm(x, gamma, eps)``;
    ``act = silu(n @ w_gate.T) * (n @ w_up.T)``.  Returns (x, SwiGLU(act, gate, up)).

    The first half of a Llama MLP sublayer: the gate and up projections run as one
    GEMM (their weights used as they are: [f, d] each, no concatenation) whose
    epilogue applies the norm's row scale and forms SwiGLU. Pass the returned
    ``SwiGLU`` as the ``y`` of the down projection's ``residual_rmsnorm_linear``
    (its backward then forms dgate and dup in its dX GEMM's epilogue). Arguments as
    ``residual_rmsnorm_linear``'s; differentiable in every tensor.

    ``internal=True`` promises that the returned gate and up (and y) are read by nothing
    but the next ``residual_rmsnorm_linear``: its backward writes their gradients over
    them (eager mode; their version counters are bumped, so a second backward through the
    graph raises), and nothing is kept for a gradient reaching y directly: one not all zeros
    raises (in a compiled backward, as a device assertion: on a GPU it ends the process); a
    compiled graph that ends between the two operators gives y a tangent of zeros, which passes.
    The Hugging Face drop-in passes it.
    """
    ws, eps = check_args(y, w_o, residual, gamma, [w_gate, w_up], eps, names=("w_gate", "w_up"))
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must have one shape")
    lead = residual.shape[:-1]
    x, (g, u, act), _, _ = _forward_fast(
        y.reshape(-1, y.shape[-1]).contiguous(), w_o, residual.reshape(-1, residual.shape[-1]).contiguous(),
        gamma, ws, eps, "rowwise", False, [], True, [], 1.0, 0, 0.0, False, bool(internal), False, [],
    )  # fmt: skip
    f = w_gate.shape[0]
    return x.reshape(*lead, x.shape[-1]), SwiGLU(*(t.reshape(*lead, f) for t in (act, g, u)), bool(internal))


def residual_rmsnorm(
    y, w_o: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x = residual + y @ w_o.T``;  ``n = rms_norm(x, gamma, eps)``.  Returns (x, n).

    ``residual_rmsnorm_linear`` without a next GEMM, for a norm whose output is not
    consumed by a plain projection (e.g. the final norm before a fused LM head + loss):
    K1 writes x and the row statistics, one pass forms n. ``y`` may be a ``SwiGLU``.
    """
    return residual_rmsnorm_linear_variant(y, w_o, residual, gamma, None, eps)


def residual_rmsnorm_linear(
    y: torch.Tensor,
    w_o: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    weight,
    eps: float | None = None,
    rope: RoPE | None = None,
    bias=None,
):
    """``x = residual + y @ w_o.T``;  ``z = rms_norm(x, gamma, eps) @ weight.T (+ bias)``.  Returns (x, z).

    y [..., K] (or a ``SwiGLU`` from ``residual_rmsnorm_swiglu``), w_o [d, K],
    residual [..., d], gamma [d] (float32 or the input
    dtype), weight [N, d]; ``eps=None`` means ``torch.finfo(dtype).eps`` as in
    ``torch.nn.RMSNorm``. Differentiable in every tensor argument. bf16/fp16 on
    the GPU (fp32 too on CPU); K, d and N multiples of 8 (16-byte rows). In bf16 K1
    stores h = x * gamma and the next GEMMs apply the row's rstd; in fp16, whose range
    may not hold x * gamma (a massive activation of 1500 under a gamma of 50 is past
    65504, rows of RMS ~1e-4 under small gammas are subnormal), one row pass after K1
    forms n = x * rstd * gamma first, as PyTorch does (NOTES.md).

    ``weight`` may be a list or tuple of [N_i, d] tensors (a norm that feeds several
    GEMMs: a layer's q, k and v projections, or gate and up): then ``z`` is a tuple,
    one output per weight, the norm is computed once and the weights are used as they
    are (no concatenation); the backward sums their input gradients in the GEMMs'
    epilogues. ``rope`` (a ``RoPE``): the first ``rope.n_weights`` outputs (q, k) come
    out rotated, in their GEMMs' epilogues (the backward applies the rotation's
    transpose to their gradients in one pass, then the usual GEMMs). ``bias``: a [N]
    tensor (one weight) or a sequence with an entry per weight ([N_i] or None), float32 or
    the weights' dtype, added in the GEMMs' epilogues before RoPE, as ``F.linear``'s bias
    (Qwen2's q, k and v projections); not with q/k norms or the interleaved-pairs RoPE.
    """
    return residual_rmsnorm_linear_variant(y, w_o, residual, gamma, weight, eps, rope=rope, bias=bias)


def rmsnorm_linear(x: torch.Tensor, gamma: torch.Tensor, weight, eps: float | None = None,
                   rope: RoPE | None = None, bias=None):  # fmt: skip
    """``z = rms_norm(x, gamma, eps) @ weight.T (+ bias)``: ``residual_rmsnorm_linear`` for a
    norm with no projection before it (a first decoder layer's, over the embeddings).
    Returns z (a tuple of outputs when ``weight`` is a list or tuple); ``weight``, ``eps``,
    ``rope`` and ``bias`` as there. One row pass writes h = x * gamma and the row sums of x^2; the
    next GEMMs apply the norm's row scale (and RoPE) in their epilogues (in float16 a
    second pass writes n = x r gamma over h and the GEMMs' scale is 1: ``_k1``); the
    backward is ``residual_rmsnorm_linear``'s without the o-projection's GEMMs."""
    check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (its features)")
    if weight is None:
        raise ValueError("weight: give one [N, d] tensor or several (the next GEMMs)")
    d, lead = x.shape[-1], x.shape[:-1]
    M = math.prod(lead)
    rows = x.reshape(M, d).contiguous()
    # the o-projection of the general operator, absent: [M, 0] @ [d, 0]^T, in the next
    # GEMMs' dtype (x may be a float32 stream over bf16/fp16 weights)
    low = weight[0] if isinstance(weight, (list, tuple)) and weight else weight
    low = low.dtype if isinstance(low, torch.Tensor) else x.dtype
    y, w_o = x.new_empty((M, 0), dtype=low), x.new_empty((d, 0), dtype=low)
    _check_x(x, gamma, y, weight)
    ws, eps = check_args(y, w_o, rows, gamma, weight, eps)
    rope_args, rope_scaling, n_rope, qk_eps, pairs = rope_operands(rope, ws, lead, x.device)
    biases = _biases(bias, weight, ws, y, rope_args, pairs)
    _, zs, _, _ = _forward_fast(
        y, w_o, rows, gamma, ws, eps, "rowwise", False, [], False, rope_args, rope_scaling, n_rope, qk_eps,
        pairs, False, False, biases,
    )  # fmt: skip
    zs = tuple(z.reshape(*lead, z.shape[-1]) for z in zs[: len(ws)])
    return zs if isinstance(weight, (list, tuple)) else zs[0]


def _check_x(x: torch.Tensor, gamma, y: torch.Tensor, weight) -> None:
    """``rmsnorm_linear``'s checks that name x (the general operator's, run after, call
    it the residual and its GEMMs' dtype y's): x's dtype against the next weights' (y's,
    as ``check_args`` judges a residual: the same dtype, or ``mixed``), its features
    against gamma's."""
    check_dtype("x", x, GEMM_DTYPES, "bfloat16 or float16, or float32 (a float32 stream, or on CPU)")
    if x.dtype != y.dtype and not mixed(x, y):
        raise TypeError(
            f"weight ({y.dtype}) must have x's dtype ({x.dtype}), or x be float32 (a float32 residual "
            "stream over bf16/fp16 weights)"
        )
    if isinstance(gamma, torch.Tensor) and gamma.shape != (x.shape[-1],):
        raise ValueError(f"gamma {tuple(gamma.shape)} and x [..., {x.shape[-1]}] disagree: gamma must be "
                         f"[{x.shape[-1]}], x's features")  # fmt: skip
    # (x's device by its name: y, made on it, would be the one named)
    ws, names = weights_of(weight)
    named = {"x": x, "gamma": gamma, **dict(zip(names, ws))}
    check_same_device({k: v for k, v in named.items() if isinstance(v, torch.Tensor)})


def _biases(bias, weight, ws, y, rope_args, pairs) -> list:
    """``bias_args``, refused where no program adds one: with q/k norms or the
    interleaved-pairs RoPE (no Hugging Face model has them with biases)."""
    biases = bias_args(bias, weight, ws, y)
    if biases and len(rope_args) > 2:
        raise ValueError("bias: not with q/k norms (RoPE's qk_norm_weights)")
    if biases and pairs:
        raise ValueError("bias: not with the interleaved-pairs RoPE (RoPE(interleaved=True))")
    return biases


def _swiglu_parts(y):
    """(y, [gate, up] as [M, f] rows or [], internal) of a ``SwiGLU`` y (checked), else (y, [], False)."""
    if not isinstance(y, SwiGLU):
        return y, [], False
    gate_up = [y.gate, y.up]
    for name, t in (("y.gate", gate_up[0]), ("y.up", gate_up[1])):
        check_tensor(name, t)
        if t.shape != y.y.shape or t.dtype != y.y.dtype or t.device != y.y.device:
            raise ValueError(f"{name} must match y.y ({y.y.dtype} {tuple(y.y.shape)} on {y.y.device})")
    return y.y, [t.reshape(-1, t.shape[-1]).contiguous() for t in gate_up], bool(y.internal)


def residual_rmsnorm_factors(
    y, w_o: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x = residual + y @ w_o.T`` and the RMSNorm of x as two factors: returns (x, h,
    rstd) with ``rms_norm(x, gamma, eps) == h * rstd[..., None]``, h = x * gamma (K1's
    own output, in the GEMMs' dtype) and rstd = rsqrt(mean(x^2) + eps) (float32, x's
    leading shape).

    For a norm whose consumer scales rows itself: the final norm before the LM head +
    loss, ``linear_cross_entropy(h, lm_head_weight, target, row_scale=rstd)``, whose
    logits GEMM applies rstd in its epilogue: the normalized rows are never formed (K1
    alone in the forward; in the backward one pass over the rows, no n written, the
    norm's zeta coming with rstd's gradient). Arguments as ``residual_rmsnorm``'s (``y``
    may be a ``SwiGLU``); differentiable in every tensor, through h and rstd both.
    In float16, h = x * gamma itself may pass 65504 where n does not: there use
    ``residual_rmsnorm`` (n formed first), as the Hugging Face drop-in does.
    """
    y, gate_up, internal = _swiglu_parts(y)
    ws, eps = check_args(y, w_o, residual, gamma, None, eps)
    lead = residual.shape[:-1]
    x, (h, rstd), _, _ = _forward_fast(
        y.reshape(-1, y.shape[-1]).contiguous(), w_o, residual.reshape(-1, residual.shape[-1]).contiguous(),
        gamma, ws, eps, FACTORS, False, gate_up, False, [], 1.0, 0, 0.0, False, internal,
        len(gate_up) > 0 and SETTINGS.keeps_y(w_o.shape[0]), [],
    )  # fmt: skip
    return x.reshape(*lead, x.shape[-1]), h.reshape(*lead, h.shape[-1]), rstd.reshape(lead)


def residual_rmsnorm_linear_variant(y, w_o, residual, gamma, weight, eps=None, backward="rowwise",
                                    fold_gamma=False, rope=None, bias=None):  # fmt: skip
    """``residual_rmsnorm_linear`` with a research variant of the backward (see the
    module's docstring; for benchmarks and tests): ``backward`` one of
    ``BACKWARDS``; ``fold_gamma=True`` (needs "rowwise") applies gamma to the next
    GEMM's weight instead of writing h. The variants take one next weight."""
    y, gate_up, internal = _swiglu_parts(y)
    ws, eps = check_args(y, w_o, residual, gamma, weight, eps)
    if gate_up and (fold_gamma or backward != "rowwise"):
        raise ValueError("a SwiGLU y takes the default backward (rowwise, no fold_gamma)")
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if fold_gamma and backward != "rowwise":
        raise ValueError(f"fold_gamma=True needs backward='rowwise', got {backward!r}")
    if len(ws) != 1 and (fold_gamma or backward != "rowwise"):
        raise ValueError("several or no next weights take the default backward (rowwise, no fold_gamma)")
    if mixed(residual, y) and (fold_gamma or backward != "rowwise"):
        raise ValueError("a float32 residual stream takes the default backward (rowwise, no fold_gamma)")
    lead = residual.shape[:-1]
    rope_args, rope_scaling, n_rope, qk_eps, pairs = rope_operands(rope, ws, lead, y.device)
    if n_rope and (fold_gamma or backward != "rowwise"):
        raise ValueError("rope takes the default backward (rowwise, no fold_gamma)")
    biases = _biases(bias, weight, ws, y, rope_args, pairs)
    if biases and (fold_gamma or backward != "rowwise"):
        raise ValueError("bias takes the default backward (rowwise, no fold_gamma)")
    x, zs, _, _ = _forward_fast(
        y.reshape(-1, y.shape[-1]).contiguous(),
        w_o,
        residual.reshape(-1, residual.shape[-1]).contiguous(),
        gamma,
        ws,
        eps,
        backward,
        bool(fold_gamma),
        gate_up,
        False,
        rope_args,
        rope_scaling,
        n_rope,
        qk_eps,
        pairs,
        internal,
        # (len, not bool(list): torch 2.11's dynamo cannot trace bool() of a list, run 188)
        len(gate_up) > 0 and SETTINGS.keeps_y(w_o.shape[0]),
        biases,
    )
    zs = tuple(z.reshape(*lead, z.shape[-1]) for z in zs[: max(1, len(ws))])
    return x.reshape(*lead, x.shape[-1]), zs if isinstance(weight, (list, tuple)) else zs[0]  # None: n

"""``linear_cross_entropy``'s low-memory mode (``vocab_chunk``; ``cross_entropy.py``'s
docstring): the vocabulary in slices over all rows, the logits formed again in the
backward, each slice's dW one GEMM rounded once, dX summed in float32."""

from __future__ import annotations

import torch

from ..kernels.launch import gemm
from ..programs.basic import ACCUMULATE_F32, STORE_F32
from ..programs.ce import CE_LOGITS, CE_LOGITS_EXT, CE_LOGITS_SCALED, ce_grad_
from .ce_rows import CEOptions, coefs, combine_lse, logits_bias, row_loss, scaled_pick, scales, target_rows


def slices(V: int, width: int) -> list:
    """[v0, v1) of each vocabulary slice; a last one narrower than 8 classes joins the one
    before it (a slice is a GEMM's K in the backward's dX: at least 16 bytes for TMA)."""
    out = [(v0, min(V, v0 + width)) for v0 in range(0, V, width)]
    if len(out) > 1 and out[-1][1] - out[-1][0] < 8:
        out[-2:] = [(out[-2][0], V)]
    return out


def slice_logits(x, w, v0, v1, buf, opts: CEOptions, bias, want_lse: bool):
    """The logits of classes [v0, v1) for every row, in ``buf`` (rows padded to 16 bytes),
    and with ``want_lse`` their log-sum-exp per row; the same rounded values either way
    (with a row scale: the unscaled products, CE_LOGITS_SCALED's)."""
    logits = buf[:, : v1 - v0]
    ws = w[v0:v1]
    if opts.plain and not want_lse:
        gemm(x, ws, out=logits)  # (CE_LOGITS's stored values: the accumulator rounded once)
        return logits, None
    if opts.row_scale is not None:
        return logits, gemm(x, ws, epilogue=CE_LOGITS_SCALED, scale=opts.row_scale, out=(logits, None)).lse
    if opts.plain:
        return logits, gemm(x, ws, epilogue=CE_LOGITS, out=(logits, None)).lse
    lse = gemm(x, ws, epilogue=CE_LOGITS_EXT, bias=bias[v0:v1], softcap=opts.softcap, out=(logits, None)).lse
    return logits, lse


def slice_setup(x, w, width: int, opts: CEOptions):
    V = w.shape[0]
    unit = 16 // x.element_size()
    widest = max(v1 - v0 for v0, v1 in slices(V, width))
    buf = torch.empty(x.shape[0], -(-widest // unit) * unit, dtype=x.dtype, device=x.device)
    return buf, logits_bias(x, V, opts)


def sliced_forward(x, w, target, ignore_index, width: int, opts: CEOptions):
    """Low-memory forward (``vocab_chunk``): each row's loss (fp32, 0 where ignored, NaN
    where the target is bad) and log-sum-exp (fp32 [2, M], hi + lo), over vocabulary slices of ``width``
    classes: per slice one logits GEMM into a [M, width] buffer with its rows'
    log-sum-exp, the target's logit picked where it falls in the slice, and the
    smoothing term's sums; the slices' log-sum-exps combined at the end."""
    M, V = x.shape[0], w.shape[0]
    buf, bias = slice_setup(x, w, width, opts)
    bad, valid, wt, w_sum = target_rows(target, V, ignore_index, opts)
    picked = torch.zeros(M, dtype=torch.float32, device=x.device)
    sums = torch.zeros(M, dtype=torch.float32, device=x.device) if opts.smoothing else None
    parts = []
    for v0, v1 in slices(V, width):
        logits, lse = slice_logits(x, w, v0, v1, buf, opts, bias, want_lse=True)
        parts.append(lse)
        picked += scaled_pick(logits, target - v0, opts)  # (0 outside the slice)
        if sums is not None:
            cw = None if opts.weight is None else opts.weight[v0:v1]
            sums += ce_grad_(logits, lse, target, lse[0], weight=cw, softcap=opts.softcap, write=False,
                             want_sum=True, row_scale=opts.row_scale)[0]  # fmt: skip
    lse = combine_lse(parts)
    losses = torch.where(valid, row_loss(lse, picked, wt, sums, opts, V, w_sum), 0.0)
    if bad is not None:
        losses = torch.where(bad, float("nan"), losses)
    return losses, lse


def sliced_backward(grad, x, w, target, lse, ignore_index, reduction, width: int, opts: CEOptions):
    """Low-memory backward: per vocabulary slice the logits again (the forward's values),
    turned into their gradient in place (the incoming gradient folded into each row's
    scale), then dW of the slice = dlogits^T @ X over every row (one GEMM, one rounding)
    and dX += dlogits @ W_slice (float32, cast once at the end). Returns dX, dW, db and the
    row scale's gradient (float32 [M]; db, that one empty without them)."""
    V = w.shape[0]
    rs = opts.row_scale
    dr = x.new_zeros((x.shape[0],) if rs is not None else (0,), dtype=torch.float32)
    if x.shape[0] == 0:  # no rows: zero gradients (the GEMMs would have K = 0)
        db = torch.zeros_like(opts.bias) if opts.bias is not None else w.new_empty(0)
        return torch.empty_like(x), torch.zeros_like(w), db, dr
    buf, bias = slice_setup(x, w, width, opts)
    bad, valid, wt, w_sum = target_rows(target, V, ignore_index, opts)
    if reduction == "none":
        scale = scales(valid, None, "none", grad)
    else:
        scale = scales(valid, wt.sum(), reduction, None) * grad.float()
    if bad is not None:
        scale = torch.where(bad, float("nan"), scale)
    coef = coefs(lse, wt, opts, V, w_sum)
    dx32 = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dw = torch.empty_like(w)
    db32 = torch.empty(V, dtype=torch.float32, device=x.device) if opts.bias is not None else None
    for v0, v1 in slices(V, width):
        logits, _ = slice_logits(x, w, v0, v1, buf, opts, bias, want_lse=False)
        cw = None if opts.weight is None else opts.weight[v0:v1]
        _, dr_v = ce_grad_(logits, lse, target - v0, scale, weight=cw, smooth=opts.smoothing / V,
                           softcap=opts.softcap, row_scale=rs, **coef)  # fmt: skip
        if dr_v is not None:
            dr += dr_v
        gemm(logits.t(), x.t(), out=dw[v0:v1])  # dW slice = dl^T x
        if v0 == 0:
            gemm(logits, w[v0:v1].t(), epilogue=STORE_F32, out=dx32)  # dX = dl W_slice
        else:
            gemm(logits, w[v0:v1].t(), epilogue=ACCUMULATE_F32, c=dx32, out=dx32)  # dX += dl W_slice
        if db32 is not None:
            torch.sum(logits, 0, dtype=torch.float32, out=db32[v0:v1])
    db = db32.to(opts.bias.dtype) if db32 is not None else w.new_empty(0)
    return dx32.to(x.dtype), dw, db, dr

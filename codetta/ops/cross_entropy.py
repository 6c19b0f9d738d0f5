"""Linear layer + cross-entropy (the LM head and its loss) without [M, V] logits in fp32.

    loss = cross_entropy(input @ linear_weight.T, target)       (reduction mean / sum / none)

Rows are processed in chunks whose logits fit a fixed budget (``CHUNK_BYTES``). Per
chunk, one GEMM stores the chunk's logits in the input dtype and, from its fp32
accumulator, each row's log-sum-exp and target logit (``programs/ce.py``). For
``mean`` and ``sum`` the loss is the graph's last op, so the gradient is known up to
the incoming scalar: the chunk's logits become (softmax - onehot) * scale in place,
then dX = dlogits @ W (the chunk's rows) and dW += dlogits^T @ X (accumulated in fp32)
are computed right away, and the backward only scales them. ``none`` keeps the
per-row log-sum-exp and does the same work in the backward, with its per-row
gradient. Extra memory beyond the inputs and their gradients: one logits buffer
(<= ``CHUNK_BYTES``, reused by every chunk; rows padded to 16 bytes, so any V
works) and the fp32 dW accumulator (4 V d bytes, summed in place by the
ACCUMULATE_F32 epilogue), plus O(M) row statistics: at V = 128256, d = 4096 that is
0.25 + 2 GiB, above issue 15's 512 MiB bar (the fp32 accumulator is the term).

First version: label smoothing, class weights, z-loss, soft-capping and a bias are
not supported yet; one logits GEMM per chunk plus the dX and dW GEMMs.
"""

from __future__ import annotations

import torch

from ..kernels.launch import gemm
from ..kernels.operands import check_dtype, check_gemm_dtype, check_same_device, check_tensor
from ..programs.basic import ACCUMULATE_F32
from ..programs.ce import CE_LOGITS, softmax_grad_

REDUCTIONS = ("mean", "sum", "none")
CHUNK_BYTES = 256 * 2**20  # logits of one chunk of rows


def rows_per_chunk(M: int, V: int, itemsize: int, budget: int = CHUNK_BYTES) -> int:
    """Rows per chunk: as many as fit ``budget`` bytes of logits (a multiple of 128 when
    more than 128 fit), at least 1."""
    rows = max(1, budget // (V * itemsize))
    if rows > 128:
        rows -= rows % 128
    return min(max(M, 1), rows)


def _scales(target, ignore_index: int, reduction: str, grad: torch.Tensor | None, M: int):
    """Per-row gradient scale: 0 for ignored rows; 1/n_valid (mean), 1 (sum), grad[m] (none)."""
    valid = target != ignore_index
    if reduction == "none":
        return torch.where(valid, grad.float(), 0.0)
    s = valid.float()
    if reduction == "mean":
        s = s / valid.sum().clamp_min(1)
    return s


def _pass(x, w, target, ignore_index, reduction, rows, grad=None, want_grads=True):
    """Loss rows (fp32 [M]) and, with ``want_grads``, dX (input dtype) and dW (fp32)."""
    M, V = x.shape[0], w.shape[0]
    losses = torch.empty(M, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x) if want_grads else x.new_empty(0)
    dw32 = torch.zeros(w.shape, dtype=torch.float32, device=x.device) if want_grads else None
    scale = _scales(target, ignore_index, reduction, grad, M) if want_grads else None
    # one logits buffer for every chunk, rows padded to 16 bytes (an odd V still moves by TMA)
    unit = 16 // x.element_size()
    buf = torch.empty(min(rows, M), -(-V // unit) * unit, dtype=x.dtype, device=x.device)
    for start in range(0, M, rows):
        sl = slice(start, min(M, start + rows))
        xc, tc = x[sl], target[sl]
        logits = buf[: xc.shape[0], :V]
        out = gemm(xc, w, epilogue=CE_LOGITS, target=tc, out=(logits, None, None))
        losses[sl] = torch.where(tc != ignore_index, out.lse - out.picked, 0.0)
        if want_grads:
            dl = softmax_grad_(logits, out.lse, tc, scale[sl])
            gemm(dl, w.t(), out=dx[sl])
            gemm(dl.t(), xc.t(), epilogue=ACCUMULATE_F32, c=dw32, out=dw32)  # dW += dl^T x, in place
    return losses, dx, dw32


def _check_targets(target, V: int, ignore_index: int) -> None:
    bad = ((target < 0) | (target >= V)) & (target != ignore_index)
    if bool(bad.any()):
        raise IndexError(f"target values must be in [0, {V}) or ignore_index={ignore_index}")


@torch.library.custom_op("codetta::linear_cross_entropy", mutates_args=())
def _forward(
    x: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    need_grad: bool,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (loss, dx, dw): dx/dw for mean and sum when gradients are needed (else empty)
    _check_targets(target, w.shape[0], ignore_index)  # here, not in the wrapper: torch.compile traces that
    grads = need_grad and reduction != "none"
    losses, dx, dw32 = _pass(x, w, target, ignore_index, reduction, rows, want_grads=grads)
    if reduction == "none":
        loss = losses
    else:
        loss = losses.sum()
        if reduction == "mean":
            loss = loss / (target != ignore_index).sum()  # 0/0 = nan when all are ignored, as torch
    return loss, dx, (dw32.to(w.dtype) if grads else w.new_empty(0))


@_forward.register_fake
def _(x, w, target, ignore_index, reduction, need_grad, rows):
    f32 = torch.float32
    loss = x.new_empty(x.shape[0], dtype=f32) if reduction == "none" else x.new_empty((), dtype=f32)
    grads = need_grad and reduction != "none"
    return loss, x.new_empty(x.shape if grads else (0,)), w.new_empty(w.shape if grads else (0,))


@torch.library.custom_op("codetta::linear_cross_entropy_backward", mutates_args=())
def _backward_none(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, ignore_index: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    _, dx, dw32 = _pass(x, w, target, ignore_index, "none", rows, grad=grad)
    return dx, dw32.to(w.dtype)


@_backward_none.register_fake
def _(grad, x, w, target, ignore_index, rows):
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _setup(ctx, inputs, output):
    x, w, target, ignore_index, reduction, need_grad, rows = inputs
    _, dx, dw = output
    ctx.reduction, ctx.ignore_index, ctx.rows = reduction, ignore_index, rows
    ctx.set_materialize_grads(False)
    if reduction == "none":
        ctx.save_for_backward(x, w, target)
    else:
        ctx.save_for_backward(dx, dw)


def _autograd_backward(ctx, dloss, _ddx, _ddw):
    if dloss is None:
        return None, None, None, None, None, None, None
    if ctx.reduction == "none":
        x, w, target = ctx.saved_tensors
        dx, dw = _backward_none(dloss.contiguous(), x, w, target, ctx.ignore_index, ctx.rows)
    else:
        dx, dw = ctx.saved_tensors
        if dx.numel() == 0:
            raise RuntimeError("codetta.linear_cross_entropy: gradients were not computed in the forward")
        g = dloss.to(torch.float32)
        dx, dw = (dx * g).to(dx.dtype), (dw * g).to(dw.dtype)
    return dx, dw, None, None, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup)


def linear_cross_entropy(
    input, linear_weight, target, *, reduction="mean", ignore_index=-100, chunk_rows=None, loss_dtype=None
):
    """``F.cross_entropy(F.linear(input, linear_weight), target, reduction=..., ignore_index=...)``
    without materializing the logits in fp32 (module docstring: chunks, memory).

    input [..., d] (bf16/fp16 on the GPU; fp32 too on CPU), linear_weight [V, d] in
    input's dtype, target [...] int64 or int32 class indices (``ignore_index`` rows
    count nowhere). Returns a scalar (mean, sum) or the per-row losses (none), in
    input's dtype. A target outside [0, V) other than ``ignore_index`` raises
    (checked on the host, one synchronization). ``chunk_rows`` overrides the rows per
    chunk (default: as many as ``CHUNK_BYTES`` of logits hold). ``loss_dtype``: the
    loss's dtype (default input's, as torch; it is computed in float32 either way).
    """
    check_tensor("input", input)
    check_tensor("linear_weight", linear_weight)
    check_tensor("target", target)
    check_same_device({"input": input, "linear_weight": linear_weight, "target": target})
    check_gemm_dtype("input", input)
    if linear_weight.dtype != input.dtype:
        raise TypeError(f"linear_weight ({linear_weight.dtype}) must have input's dtype ({input.dtype})")
    check_dtype("target", target, (torch.int64, torch.int32))
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if linear_weight.dim() != 2 or input.dim() < 1 or input.shape[-1] != linear_weight.shape[1]:
        raise ValueError(
            f"input [..., d] and linear_weight [V, d] disagree: {tuple(input.shape)} and "
            f"{tuple(linear_weight.shape)}"
        )
    if target.shape != input.shape[:-1]:
        raise ValueError(f"target must have shape {tuple(input.shape[:-1])}, got {tuple(target.shape)}")
    V = linear_weight.shape[0]
    unit = 16 // input.element_size()
    if input.shape[-1] % unit:
        raise ValueError(
            f"d = {input.shape[-1]} must be a multiple of {unit} for {input.dtype} (rows of the input "
            "and the weight move through TMA in 16-byte units)"
        )
    x = input.reshape(-1, input.shape[-1]).contiguous()
    t = target.reshape(-1).contiguous()
    rows = chunk_rows or rows_per_chunk(x.shape[0], V, x.element_size())
    need_grad = torch.is_grad_enabled() and (input.requires_grad or linear_weight.requires_grad)
    loss, _, _ = _forward(x, linear_weight, t, int(ignore_index), reduction, need_grad, int(rows))
    loss = loss.to(loss_dtype or input.dtype)
    return loss.reshape(target.shape) if reduction == "none" else loss

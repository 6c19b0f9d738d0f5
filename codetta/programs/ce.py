"""Cross-entropy over a linear layer's output (the LM head): the logits GEMM's epilogue
program and the row pass that turns a stored logits chunk into its gradient in place.

The logits GEMM stores a bounded chunk of rows of logits in the GEMM's dtype and,
from the fp32 accumulator, each row's log-sum-exp and target logit (no fp32
[M, V] logits anywhere). The row pass then writes (softmax - onehot) * scale over
the chunk, which the dX and dW GEMMs consume.
"""

import torch
import triton
import triton.language as tl

from ..kernels import device
from ..kernels.configs import BACKWARD_CANDIDATES, PLAIN_CANDIDATES
from ..kernels.program import DType, PerRow, Program, RowLogSumExp, RowPick, Tile
from .norm_rows import torch_path


@triton.jit
def ce_logits(acc, target, elem):
    """l = acc rounded to the GEMM's dtype (stored); lse[m] = log sum_n exp(l);
    picked[m] = l[m, target[m]]. The statistics are those of the stored logits, so the
    gradient pass's exp(l - lse) sums to one over the row (as PyTorch's own chain on
    logits in that dtype)."""
    logit = acc.to(elem.dtype).to(tl.float32)
    return logit, logit, logit


def _pick(acc, target):
    valid = (target >= 0) & (target < acc.shape[1])
    got = acc.gather(1, target.clamp(0, acc.shape[1] - 1).long()[:, None])[:, 0]
    return torch.where(valid, got, torch.zeros((), dtype=acc.dtype))


CE_LOGITS = Program(
    "ce_logits",
    ce_logits,
    inputs=(PerRow("target", index=True), DType("elem")),
    outputs=(Tile("logits"), RowLogSumExp("lse"), RowPick("picked", index="target")),
    reference=lambda acc, target, elem: _reference(acc.to(elem).to(acc.dtype), target),
    # three outputs, one a gathered element: 128x256 tiles and 4-warp 128x128 ones spill (sm_90a
    # check); these do not
    configs=tuple(BACKWARD_CANDIDATES) + tuple(c for c in PLAIN_CANDIDATES if c.occupancy == 2),
)


def _reference(logit, target):
    return {"logits": logit, "lse": logit.logsumexp(1), "picked": _pick(logit, target)}


@triton.jit
def _softmax_grad_kernel(l_ptr, lse_ptr, t_ptr, s_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(s_ptr + row)
    target = tl.load(t_ptr + row).to(tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        logit = tl.load(l_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(logit - lse) - tl.where(cols == target, 1.0, 0.0)
        tl.store(l_ptr + row * stride + cols, (g * scale).to(l_ptr.dtype.element_ty), mask=mask)


def softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor):
    """In place: logits[m, n] <- (exp(logits[m, n] - lse[m]) - [n == target[m]]) * scale[m]
    (a target outside [0, V) subtracts nothing; scale 0 zeroes an ignored row). fp32
    math, one rounding to the logits' dtype."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a row-contiguous [M, V] tensor, got strides {logits.stride()}")
    M, V = logits.shape
    if M == 0:
        return logits
    if torch_path(logits):
        g = torch.exp(logits.float() - lse.float()[:, None])
        valid = (target >= 0) & (target < V)
        rows = torch.arange(M, device=logits.device)[valid]
        g[rows, target[valid].long()] -= 1.0
        return logits.copy_(g * scale.float()[:, None])
    with device.on_device(logits.device):
        _softmax_grad_kernel[(M,)](logits, lse, target, scale, V, logits.stride(0), BLOCK=1024, num_warps=4)
    return logits

"""Finishing kernels: the small row-wise reductions that epilogue programs hand over."""

import torch
import triton
import triton.language as tl

from .launch import _on_device, interpreting


@triton.jit
def _rowdot_kernel(a_ptr, b_ptr, out_ptr, N, stride_a, stride_b, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 [M] = sum over columns of a * b (a, b [M, N], rows contiguous), summed in fp32."""
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"rowdot needs two [M, N] tensors, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("rowdot needs row-contiguous inputs")
    M, N = a.shape
    out = torch.empty(M, dtype=torch.float32, device=a.device)
    if M == 0:
        return out
    if a.device.type == "cpu" and not interpreting():
        return (a.double() * b.double()).sum(1).float()
    with _on_device(a.device):
        _rowdot_kernel[(M,)](
            a, b, out, N, a.stride(0), b.stride(0), BLOCK=min(4096, triton.next_power_of_2(N))
        )
    return out


@triton.jit
def _rstd_kernel(part_ptr, out_ptr, M, T, inv_d, eps, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, T, BLOCK_T):
        cols = start + tl.arange(0, BLOCK_T)
        mask = (rows < M)[:, None] & (cols < T)[None, :]
        acc += tl.sum(
            tl.load(part_ptr + rows[:, None].to(tl.int64) * T + cols[None, :], mask=mask, other=0.0), 1
        )
    tl.store(out_ptr + rows, 1.0 / tl.sqrt(acc * inv_d + eps), mask=rows < M)


def rstd_from_partials(sumsq: torch.Tensor, d: int, eps: float) -> torch.Tensor:
    """r[m] = rsqrt(sum_j sumsq[m, j] / d + eps): the finish of the K1 program's partial sums."""
    if sumsq.dim() != 2 or sumsq.dtype != torch.float32 or not sumsq.is_contiguous():
        raise ValueError(
            f"sumsq must be a contiguous float32 [M, T] tensor, got {sumsq.dtype} {tuple(sumsq.shape)}"
        )
    M, T = sumsq.shape
    if sumsq.device.type == "cpu" and not interpreting():
        return torch.rsqrt(sumsq.sum(1) / d + eps)
    out = torch.empty(M, dtype=torch.float32, device=sumsq.device)
    if M:
        with _on_device(sumsq.device):
            _rstd_kernel[(triton.cdiv(M, 64),)](sumsq, out, M, T, 1.0 / d, eps, BLOCK_M=64, BLOCK_T=32)
    return out

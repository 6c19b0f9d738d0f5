"""Finishing kernels: row-wise reductions the epilogue programs hand over."""

import torch
import triton
import triton.language as tl

from .launch import interpreting


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
    _rowdot_kernel[(M,)](a, b, out, N, a.stride(0), b.stride(0), BLOCK=min(4096, triton.next_power_of_2(N)))
    return out

"""Finishing the reduction outputs: per-sub-tile partials -> [M] or [N] results.

The mainloops write row partials as fp32 [M, T] (T = one column per sub-tile of
the N axis; a log-sum-exp's as [M, 2T], each sub-tile's max in the first T columns and
its sum of exp(v - max) in the last T) and column partials as fp32 [R, N] (R = one row
per M-tile). These
kernels combine them in a fixed order (no atomics): the same inputs give the same
bits, run to run. Their shapes depend on the tile configuration; the finished
outputs do not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import device, precompile
from .direct import DirectKernel
from .program import Kind, Layout
from .settings import SETTINGS


def workspace_shape(kind: Kind, M: int, N: int, lay: Layout) -> tuple:
    """The partials a launch with this geometry writes for a reduction output."""
    if kind is Kind.COL_SUM:
        return (-(-M // lay.block_m), N)
    return (M, (2 if kind is Kind.ROW_LSE else 1) * -(-N // lay.sub_n))


@triton.jit
def _two_sum(a, b):
    """(s, e): s = a + b rounded, e = what the rounding left out (a + b = s + e exactly;
    Knuth's TwoSum, no condition on the magnitudes). Non-finite s: e = 0."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, tl.where(tl.abs(s) < float("inf"), e, 0.0)


@triton.jit
def _rows_kernel(p_ptr, out_ptr, M, T, LSE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_T: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    base = p_ptr + rows.to(tl.int64)[:, None] * (2 * T if LSE else T)
    acc = tl.zeros([BLOCK_M], tl.float32)
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for start in range(0, T, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        m = rmask[:, None] & (t < T)[None, :]
        x = tl.load(base + t[None, :], mask=m, other=0.0)
        if LSE:
            # online over the sub-tiles' (max, sum exp(v - max)) pairs: the row's max
            # and sum exp(v - row max), each sub-tile's sum rescaled to the running max
            x = tl.where(m, x, float("-inf"))
            part = tl.load(base + T + t[None, :], mask=m, other=0.0)
            new_max = tl.maximum(run_max, tl.max(x, 1))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            acc = acc * tl.exp(run_max - safe) + tl.sum(part * tl.exp(x - safe[:, None]), 1)
            run_max = new_max
        else:
            acc += tl.sum(x, 1)
    if LSE:
        # max + log(sum): the max is one of the row's values (exact), the log small; a row
        # of only -inf (or padding) is -inf, as log(0); a NaN or +inf value makes it NaN (max
        # drops NaNs: a NaN sub-tile's sum carries it)
        none = (run_max == float("-inf")) & (acc == 0.0)
        hi, lo = _two_sum(tl.where(none, 0.0, run_max), tl.log(tl.where(none, 1.0, acc)))
        acc = tl.where(none, float("-inf"), hi)
        lo = tl.where(none, 0.0, lo)
        if SPLIT:
            tl.store(out_ptr + M + rows, lo, mask=rmask)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _cols_kernel(p_ptr, out_ptr, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for start in range(0, R, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        m = (rows < R)[:, None] & cmask[None, :]
        acc += tl.load(p_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=m, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, 0).to(out_ptr.dtype.element_ty), mask=cmask)


def _torch_path(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and (not device.interpreting() or SETTINGS.force_reference)


def _rows_consts(lse: bool, T: int, split: bool = False) -> dict:
    """The row finish's block: BLOCK_T partials of a row per step (the row's width, up to
    256) and 2048 / BLOCK_T rows per program. Wide rows need narrow programs: with a
    fixed 64 x 32 block, the LM head's LSE partials (4096 rows of 2004 sub-tiles) ran on
    64 programs of 63 serial steps, 86.6 us; this block takes 15.5 us (NOTES.md, run 114)."""
    block_t = max(16, min(256, triton.next_power_of_2(max(T, 1))))
    return {"LSE": lse, "SPLIT": split, "BLOCK_M": 2048 // block_t, "BLOCK_T": block_t}


def row_pass_jobs() -> list[tuple]:
    """The row finish as the sm_90a check compiles it (``programs/sm90_check.py``): sums,
    and log-sum-exps into [M] and [2, M], over the LM head's ~2000 sub-tiles."""
    types = {"p_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "T": "i32"}
    return [
        (f"row finish {what}", _rows_kernel, types, _rows_consts(lse, 2004, split), 4)
        for what, lse, split in (("sum", False, False), ("lse", True, False), ("lse split", True, True))
    ]


def _cols_consts(R: int) -> dict:
    return {"BLOCK_R": min(256, triton.next_power_of_2(R)), "BLOCK_D": 16}


def lse_pairs_finish(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) of each row's log-sum-exp from [M, 2T] (max, sum) partials (PyTorch)."""
    T = parts.shape[1] // 2
    m, s = parts[:, :T], parts[:, T:]
    top = m.max(1).values if T else parts.new_full((parts.shape[0],), float("-inf"))
    top = torch.where(top == float("-inf"), 0.0, top)
    return two_sum(top, torch.log((s * torch.exp(m - top[:, None])).sum(1)))


def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, e) with s = a + b rounded and a + b = s + e exactly (e = 0 where s is not finite)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, torch.where(s.isfinite(), e, 0.0)


def _row_launch(parts: torch.Tensor, out: torch.Tensor, lse: bool):
    """Launch the row finish; returns the compiled kernel (None on the PyTorch path).
    ``lse``: [M, 2T] pairs into ``out`` [M] (the log-sum-exp) or [2, M] (hi, lo)."""
    M = parts.shape[0]
    if lse and parts.shape[1] % 2:
        raise ValueError(f"log-sum-exp partials are (max, sum) pairs, [M, 2T]: got {tuple(parts.shape)}")
    T = parts.shape[1] // 2 if lse else parts.shape[1]
    split = lse and out.dim() == 2
    if M == 0:
        return None
    if _torch_path(parts):
        if lse:
            hi, lo = lse_pairs_finish(parts)
            out.copy_(torch.stack([hi, lo]) if split else hi)
        else:
            out.copy_(parts.sum(1))
        return None
    with device.on_device(parts.device):
        consts = _rows_consts(lse, T, split)
        grid = (-(-M // consts["BLOCK_M"]),)
        return precompile.launch(_rows_kernel, grid, parts, out, M, T, **consts)


def row_finish(parts: torch.Tensor, out: torch.Tensor, lse: bool = False) -> torch.Tensor:
    """out[m] = sum_t parts[m, t] in fp32; with ``lse``, parts [M, 2T] as a log-sum-exp's
    (max, sum exp(v - max)) pairs and out its [M] log-sum-exp or [2, M] (hi, lo) split
    (``program.RowLogSumExp``)."""
    _row_launch(parts, out, lse)
    return out


def col_sum(parts: torch.Tensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None):
    """[D] = parts.sum(0) for fp32 partials [R, D], summed in fp32 and rounded once to
    ``out``'s dtype (or ``dtype``). Narrow column blocks give every SM work; torch's
    dim-0 reduction of such a shape ran 19 us against this kernel's 5 us at d = 2048
    on an H200 (NOTES.md, run 13)."""
    if parts.dim() != 2 or parts.dtype != torch.float32 or not parts.is_contiguous():
        raise ValueError(
            f"parts must be a contiguous float32 [R, D] tensor, got {parts.dtype} {tuple(parts.shape)}"
        )
    if out is None:
        out = torch.empty(parts.shape[1], dtype=dtype, device=parts.device)
    _col_launch(parts, out)
    return out


def _col_launch(parts: torch.Tensor, out: torch.Tensor):
    """Launch the column sum; returns the compiled kernel (None on the PyTorch path)."""
    R, D = parts.shape
    if R == 0:
        out.zero_()
        return None
    if _torch_path(parts):
        out.copy_(parts.sum(0))
        return None
    with device.on_device(parts.device):
        grid = (-(-D // 16),)
        return precompile.launch(_cols_kernel, grid, parts, out, R, D, **_cols_consts(R), num_warps=4)


def finish(kind: Kind, parts: torch.Tensor, out: torch.Tensor):
    """Combine one reduction output's partials into ``out``; returns the compiled
    kernel that did it (None on the PyTorch path)."""
    if kind is Kind.COL_SUM:
        return _col_launch(parts, out)
    return _row_launch(parts, out, lse=kind is Kind.ROW_LSE)


def bind_finish(kind: Kind, parts: torch.Tensor, compiled, split: bool = False):
    """``fn(parts, out, stream)`` finishing partials of this exact shape again with the
    compiled kernel of an earlier ``finish`` (direct.py); None if there was none."""
    if compiled is None:
        return None
    R, T = parts.shape
    if kind is Kind.COL_SUM:
        kernel = DirectKernel(_cols_kernel, compiled, 4, _cols_consts(R), -(-T // 16))
    else:
        lse = kind is Kind.ROW_LSE
        T = T // 2 if lse else T
        consts = _rows_consts(lse, T, split)
        kernel = DirectKernel(_rows_kernel, compiled, 4, consts, -(-R // consts["BLOCK_M"]))

    def run(parts, out, stream):
        kernel(stream, parts, out, R, T)

    return run

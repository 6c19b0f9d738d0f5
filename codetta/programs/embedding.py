"""The weight gradient of an embedding table in one pass over the table: of a table that
is also the LM head's weight (tied embeddings, ``tied_weight_grad``),

    dW = scale * dW_head + E,   E[v] = sum of demb[t] over the tokens t with ids[t] = v

and of a table used by the lookup alone (``embedding_weight_grad``: dW = E).

dW_head is the LM head's float32 weight gradient (``linear_cross_entropy`` forms it in
the forward, unscaled), scale the loss's incoming gradient (0-dim float32) and demb the
embedding output's gradient [T, d]. PyTorch forms the two terms apart: the head's
gradient cast to the weight's dtype, the embedding's own backward (a sort, a zero-filled
[V, d] table and two kernels over it), then their sum: three more passes over a [V, d]
table (NOTES.md has their times in the Llama-3.2-1B step). Here the float32 table is read
once and the result rounded once. Without the head's term PyTorch's own backward still
zero-fills the table, then sums the sorted tokens' rows in one kernel and scatters them in
another; here the table is written once.

Deterministic (no atomics): the tokens are sorted by id (stable), pass A sums each run
of equal ids within a block of ``SEG`` sorted tokens (a segmented scan) and stores the
sum at the run's last slot, pass B adds to each row of the table the run sums of its
tokens' slots, in order (ROWS rows at once: one load of run sums per block of SEG sorted
tokens a row spans). A frequent id (a padding token thousands of times in a batch) costs
one partial sum per ``SEG`` of its tokens, not one load per token. No host
synchronization: the rows' first slots come from a search of the sorted ids. Rows equal to
``padding_idx`` get no embedding term (as ``nn.Embedding``'s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import device, precompile
from ..kernels.launch import alloc
from .norm_rows import torch_path, traced

SEG = 64  # sorted tokens per block of pass A
_MAX_SPARSE_SLOTS = 16
_BLOCK_D = 256
_ROWS = 16  # table rows per program of pass B


@triton.jit
def _seg_combine(k1, v1, k2, v2):
    # segmented sum over sorted keys: a run restarts where the key changes
    return k2, tl.where(k1 == k2, v1 + v2, v2)


@triton.jit
def _run_sums_kernel(demb, sid, order, runs, T, D, SEG: tl.constexpr, BLOCK_D: tl.constexpr):
    slots = tl.program_id(0) * SEG + tl.arange(0, SEG)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = slots < T
    cmask = cols < D
    key = tl.load(sid + slots, mask=live, other=-1)
    nxt = tl.load(sid + slots + 1, mask=slots + 1 < T, other=-1)
    tok = tl.load(order + slots, mask=live, other=0).to(tl.int64)
    both = live[:, None] & cmask[None, :]
    g = tl.load(demb + tok[:, None] * D + cols[None, :], mask=both, other=0.0).to(tl.float32)
    keys = key[:, None] + tl.zeros((SEG, BLOCK_D), dtype=key.dtype)
    _, sums = tl.associative_scan((keys, g), 0, _seg_combine)
    # a run's sum lands at its last slot in this block
    ends = live & ((nxt != key) | (tl.arange(0, SEG) == SEG - 1))
    at = slots.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(runs + at, sums, mask=ends[:, None] & cmask[None, :])


@triton.jit
def _add_runs(acc, runs, a, b, cols, mask, D, SEG: tl.constexpr):
    # acc's rows plus their tokens' run sums: a row's tokens are the sorted slots [a, b);
    # their sums sit at the last slot of each block of SEG slots they touch (the block's
    # end, or b - 1): n of them, added in order
    first = a // SEG
    n = tl.where(b > a, (b - 1) // SEG - first + 1, 0)
    for k in range(0, tl.max(n, axis=0)):
        slot = tl.minimum((first + k + 1) * SEG, b) - 1
        take = mask & (k < n)[:, None]
        acc += tl.load(runs + slot.to(tl.int64)[:, None] * D + cols[None, :], mask=take, other=0.0)
    return acc


@triton.jit
def _tied_grad_kernel(dw32, scale, runs, starts, out, V, D, PAD, SEG: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_D: tl.constexpr, HEAD: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < V
    both = rmask[:, None] & (cols < D)[None, :]
    at = rows.to(tl.int64)[:, None] * D + cols[None, :]
    if HEAD:  # the LM head's term (tied), else the lookup's sums alone
        acc = tl.load(dw32 + at, mask=both, other=0.0) * tl.load(scale)
    else:
        acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    a = tl.load(starts + rows, mask=rmask, other=0)
    b = tl.load(starts + rows + 1, mask=rmask, other=0)
    b = tl.where(rows == PAD, a, b)
    acc = _add_runs(acc, runs, a, b, cols, both, D, SEG)
    tl.store(out + at, acc.to(out.dtype.element_ty), mask=both)


@triton.jit
def _sparse_rows_kernel(runs, sid, starts, out, T, D, PAD, SEG: tl.constexpr, SLOTS: tl.constexpr,
                        BLOCK_D: tl.constexpr):  # fmt: skip
    # pass B's sparse form (no head term, the table zero-filled before): a program per SLOTS
    # sorted slots; each slot that is its row's first (the id changes there) writes that
    # row, summing its runs as pass B does; the other slots and the padding row write nothing
    slots = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = slots < T
    cmask = cols < D
    v = tl.load(sid + slots, mask=live, other=-1)
    prev = tl.load(sid + slots - 1, mask=live & (slots > 0), other=-1)
    lead = live & (v != prev) & (v != PAD)
    b = tl.load(starts + v + 1, mask=lead, other=0)
    b = tl.where(lead, b, slots)
    acc = tl.zeros((SLOTS, BLOCK_D), dtype=tl.float32)
    acc = _add_runs(acc, runs, slots, b, cols, lead[:, None] & cmask[None, :], D, SEG)
    at = v.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out + at, acc.to(out.dtype.element_ty), mask=lead[:, None] & cmask[None, :])


def tied_weight_grad(dw32: torch.Tensor, scale: torch.Tensor, demb: torch.Tensor, ids: torch.Tensor,
                     padding_idx: int | None, dtype: torch.dtype, launch: tuple = ()):  # fmt: skip
    """``(scale * dw32 + E).to(dtype)`` with E the embedding's gradient of ``ids`` (module
    docstring): dw32 a contiguous float32 [V, d], scale a float32 0-dim tensor on its
    device, demb [T, d] (any float dtype), ids [T] integer in [0, V). ``launch``: pass B's
    (rows, block_d, num_warps) instead of the defaults (``scripts/tied_grad_time.py
    --sweep``). Returns a new [V, d] tensor of ``dtype``."""
    if dw32.dim() != 2 or not dw32.is_contiguous() or dw32.dtype != torch.float32:
        raise ValueError(f"dw32 must be a contiguous float32 [V, d], got {dw32.dtype} {tuple(dw32.shape)}")
    if traced(dw32) or torch_path(dw32) or torch_path(demb):
        _check(demb, ids, dw32.shape[1])
        return _summed(dw32, scale, demb, ids, _pad(padding_idx), torch.float32).to(dtype)
    return _one_pass(dw32, scale, demb, ids, padding_idx, dw32.shape[0], dtype, launch)


def embedding_weight_grad(demb: torch.Tensor, ids: torch.Tensor, padding_idx: int | None, V: int,
                          dtype: torch.dtype, launch: tuple = (), sparse: bool = False):  # fmt: skip
    """E.to(dtype), the weight gradient of ``F.embedding(ids, W, padding_idx)`` for a [V, d]
    table W (``demb`` [T, d] its output's gradient, any float dtype; ids [T] integer in
    [0, V)): as ``torch.ops.aten.embedding_dense_backward``, in float32, rounded once.
    ``launch`` as for ``tied_weight_grad``. ``sparse``: the table zero-filled first and
    only the rows some token names written (pass B over the sorted slots, ``launch`` then
    (slots, block_d, num_warps)), the same values; not yet timed on a GPU, so not the
    default (``scripts/tied_grad_time.py --untied`` times both). Returns a new [V, d]
    tensor of ``dtype``."""
    if V < 0:
        raise ValueError(f"V must be >= 0, got {V}")
    if demb.dim() != 2:
        raise ValueError(f"demb must be [T, d], got {tuple(demb.shape)}")
    if traced(demb) or torch_path(demb):
        _check(demb, ids, demb.shape[1])
        return _lookup_sums(demb, ids, padding_idx, V, torch.float32).to(dtype)
    return _one_pass(None, None, demb, ids, padding_idx, V, dtype, launch, sparse)


def _pad(padding_idx: int | None) -> int:
    return -1 if padding_idx is None else int(padding_idx)


def _check(demb: torch.Tensor, ids: torch.Tensor, D: int) -> None:
    if demb.dim() != 2 or demb.shape[1] != D or ids.shape != (demb.shape[0],):
        raise ValueError(f"demb [T, {D}] and ids [T] disagree: {tuple(demb.shape)} and {tuple(ids.shape)}")


def _one_pass(dw32, scale, demb, ids, padding_idx, V: int, dtype: torch.dtype, launch: tuple,
              sparse: bool = False):  # fmt: skip
    """The two passes (module docstring); dw32 None: no head term (scale unused); sparse
    (no head term only): pass B writes only the rows some token names, into zeros."""
    D = demb.shape[1]
    _check(demb, ids, D)
    if sparse and launch and launch[0] > _MAX_SPARSE_SLOTS:
        # (Triton 3.6's layout pass fails on the 1-D slot vectors at 32 slots a program,
        # with sizes divisible by 16 specialised, as on the GPU; NOTES.md)
        most = _MAX_SPARSE_SLOTS
        raise ValueError(f"launch: the sparse form takes at most {most} slots a program, got {launch[0]}")
    pad = _pad(padding_idx)
    dev = demb.device
    # (sparse: the zeros are part of the result, never poisoned)
    out = torch.zeros((V, D), dtype=dtype, device=dev) if sparse else alloc((V, D), dtype, dev)
    if V == 0 or D == 0:
        return out
    T = ids.shape[0]
    demb = demb.contiguous()
    sid, order = torch.sort(ids, stable=True)
    # row v's first sorted slot (no bincount: its output size is a host synchronization)
    starts = torch.searchsorted(sid, torch.arange(V + 1, device=ids.device, dtype=sid.dtype))
    runs = alloc((max(T, 1), D), torch.float32, dev)
    rows_b, block_b, warps_b = launch or (_ROWS, _BLOCK_D, 4)
    block_d = min(_BLOCK_D, triton.next_power_of_2(D))
    block_b = min(block_b, triton.next_power_of_2(D))
    cols = triton.cdiv(D, block_d)
    head = dw32 is not None
    assert not (sparse and head), "the sparse form has no head term"
    with device.on_device(dev):
        if T:
            precompile.launch(_run_sums_kernel, (triton.cdiv(T, SEG), cols), demb, sid, order, runs, T, D,
                              SEG=SEG, BLOCK_D=block_d, num_warps=4)  # fmt: skip
        if sparse:
            if T:
                grid = (triton.cdiv(T, rows_b), triton.cdiv(D, block_b))
                precompile.launch(_sparse_rows_kernel, grid, runs, sid, starts, out, T, D, pad, SEG=SEG,
                                  SLOTS=rows_b, BLOCK_D=block_b, num_warps=warps_b)  # fmt: skip
            return out
        grid = (triton.cdiv(V, rows_b), triton.cdiv(D, block_b))
        precompile.launch(_tied_grad_kernel, grid, dw32 if head else runs, scale if head else runs, runs,
                          starts, out, V, D, pad, SEG=SEG, ROWS=rows_b, BLOCK_D=block_b, num_warps=warps_b,
                          HEAD=head)  # fmt: skip
    return out


def _summed(dw32, scale, demb, ids, pad: int, acc: torch.dtype) -> torch.Tensor:
    """scale * dw32 + the lookup's rows, in PyTorch with ``acc`` math (pad -1: none;
    scale None: dw32 itself)."""
    keep = ids != pad
    base = dw32.to(acc) if scale is None else dw32.to(acc) * scale.to(acc)
    return base.index_add(0, ids[keep], demb[keep].to(acc))


def tied_weight_grad_reference(dw32, scale, demb, ids, padding_idx):
    """The same in float64 PyTorch, not rounded (tests)."""
    return _summed(dw32, scale, demb, ids, _pad(padding_idx), torch.float64)


def _lookup_sums(demb, ids, padding_idx, V: int, acc: torch.dtype) -> torch.Tensor:
    """The lookup's rows summed into a zero [V, d] table, in PyTorch with ``acc`` math."""
    zero = torch.zeros((V, demb.shape[1]), dtype=acc, device=demb.device)
    return _summed(zero, None, demb, ids, _pad(padding_idx), acc)


def embedding_weight_grad_reference(demb, ids, padding_idx, V):
    """The lookup's gradient alone in float64 PyTorch, not rounded (tests)."""
    return _lookup_sums(demb, ids, padding_idx, V, torch.float64)


def row_pass_jobs() -> list[tuple]:
    """The embedding gradient's pass B as the sm_90a check compiles it
    (``programs/sm90_check.py``): (label, kernel, argument types, constexprs, warps) at the
    default launch, bf16 output, int64 ids, with and without the head's term, and its
    sparse form. Pass A (``_run_sums_kernel``) is left out: at its default launch (SEG 64,
    BLOCK_D 256, 4 warps) the segmented scan spills a 40 B stack frame on sm_90a (SEG 32
    does not; not timed yet, NOTES.md)."""
    # (aligned pointers and sizes divisible by 16, as the GPU specialises them at training sizes)
    ptrs = {"sid": "*i64:16", "runs": "*fp32:16", "starts": "*i64:16", "out": "*bf16:16", "dw32": "*fp32:16",
            "scale": "*fp32:16", "T": "i32:16", "V": "i32:16", "D": "i32:16", "PAD": "i32"}  # fmt: skip
    jobs = []
    for head in (True, False):
        consts = {"SEG": SEG, "ROWS": _ROWS, "BLOCK_D": _BLOCK_D, "HEAD": head}
        jobs.append((f"embedding pass B{' + head' if head else ''}", _tied_grad_kernel, ptrs, consts, 4))
    consts = {"SEG": SEG, "SLOTS": _ROWS, "BLOCK_D": _BLOCK_D}
    jobs.append(("embedding pass B sparse", _sparse_rows_kernel, ptrs, consts, 4))
    return jobs

"""Epilogue primitives: the five kinds every epilogue program is built from.

A program sees one fp32 sub-tile ``acc`` [BM, BNs] whose top-left element is
``(off_m, off_n)`` of the [M, N] output. Rows >= M and columns >= N of a
sub-tile are padding: loads fill them with zeros, stores skip them, and the
reductions below leave them out.

1. elementwise / pairwise: ``sigmoid``, ``silu``, ``gelu_tanh``, ``even_odd``, ``interleave``
2. vector load / store: ``load_row_vector``, ``load_col_vector``, ``store_col_vector``
3. tile load / store: ``load_tile``, ``store_tile``
4. tile reductions: ``row_sum``, ``store_row_partial``, ``store_col_partial``
5. stateful transform: ``lse_init``, ``lse_update``, ``lse_value`` (online max / sum-exp)
"""

import triton
import triton.language as tl

# ---- coordinates and masks


@triton.jit
def tile_rows(acc, off_m):
    """Row indices [BM] of the sub-tile."""
    return off_m + tl.arange(0, acc.shape[0])


@triton.jit
def tile_cols(acc, off_n):
    """Column indices [BNs] of the sub-tile."""
    return off_n + tl.arange(0, acc.shape[1])


# ---- 1. elementwise / pairwise transforms


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def silu(x):
    return x * sigmoid(x)


@triton.jit
def gelu_tanh(x):
    """GELU, tanh approximation (as torch's approximate='tanh')."""
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (2.0 * sigmoid(2.0 * inner) - 1.0))


@triton.jit
def even_odd(x):
    """Split [BM, BNs] into its even and odd columns, [BM, BNs/2] each."""
    BM: tl.constexpr = x.shape[0]
    BN: tl.constexpr = x.shape[1]
    return tl.split(tl.reshape(x, (BM, BN // 2, 2)))


@triton.jit
def interleave(even, odd):
    """Inverse of ``even_odd``: [BM, H] and [BM, H] -> [BM, 2H]."""
    BM: tl.constexpr = even.shape[0]
    H: tl.constexpr = even.shape[1]
    return tl.reshape(tl.join(even, odd), (BM, 2 * H))


# ---- 2. vector loads / stores


@triton.jit
def load_row_vector(ptr, acc, off_n, N):
    """Broadcast a length-N vector over the sub-tile's rows: [1, BNs] fp32."""
    cols = tile_cols(acc, off_n)
    return tl.load(ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]


@triton.jit
def load_col_vector(ptr, acc, off_m, M):
    """Broadcast a length-M vector over the sub-tile's columns: [BM, 1] fp32."""
    rows = tile_rows(acc, off_m)
    return tl.load(ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]


@triton.jit
def store_col_vector(ptr, val, off_m, M):
    """Store one value per row, ``val`` [BM].

    Every sub-tile that calls this writes the rows' values, the last one
    winning: call it from one sub-tile (guard with ``if off_n == 0``) or when
    one sub-tile spans all N columns; per-N-tile values belong in row partials."""
    rows = off_m + tl.arange(0, val.shape[0])
    tl.store(ptr + rows, val.to(ptr.dtype.element_ty), mask=rows < M)


# ---- 3. tile loads / stores


@triton.jit
def load_tile(desc, off_m, off_n):
    """Read another [M, N] tensor at the sub-tile's coordinates, as fp32."""
    return desc.load([off_m, off_n]).to(tl.float32)


@triton.jit
def store_tile(desc, val, off_m, off_n):
    """Write ``val`` at the sub-tile's coordinates (cast once, here)."""
    desc.store([off_m, off_n], val.to(desc.dtype))


# ---- 4. tile reductions


@triton.jit
def row_sum(val, off_n, N):
    """Sum of each row over the sub-tile's existing columns: [BM]."""
    cols = off_n + tl.arange(0, val.shape[1])
    return tl.sum(tl.where((cols < N)[None, :], val, 0.0), axis=1)


@triton.jit
def store_row_partial(ptr, part, off_m, M, j, T):
    """Store ``part`` [BM] as column j of a row-major [M, T] fp32 partials buffer.

    A sub-tile that lies wholly past column N has j >= T and stores nothing."""
    rows = off_m + tl.arange(0, part.shape[0])
    tl.store(ptr + rows.to(tl.int64) * T + j, part, mask=(rows < M) & (j < T))


@triton.jit
def store_row_sum_partial(ptr, val, off_m, off_n, M, N):
    """Row sums of ``val`` into [M, cdiv(N, BNs)]: one value per row and sub-tile."""
    BNS: tl.constexpr = val.shape[1]
    store_row_partial(ptr, row_sum(val, off_n, N), off_m, M, off_n // BNS, tl.cdiv(N, BNS))


@triton.jit
def store_col_partial(ptr, val, off_m, off_n, M, N):
    """Column sums of ``val`` into [cdiv(M, BM), N]: one value per column and M-tile."""
    BM: tl.constexpr = val.shape[0]
    rows = off_m + tl.arange(0, BM)
    part = tl.sum(tl.where((rows < M)[:, None], val, 0.0), axis=0)
    cols = off_n + tl.arange(0, val.shape[1])
    tl.store(ptr + (off_m // BM).to(tl.int64) * N + cols, part, mask=cols < N)


# ---- 5. stateful transform: online log-sum-exp across sub-tiles


@triton.jit
def lse_init(BLOCK_M: tl.constexpr):
    """Empty running (max, sum of exp) per row."""
    return (
        tl.full((BLOCK_M,), float("-inf"), tl.float32),
        tl.zeros((BLOCK_M,), tl.float32),
    )


@triton.jit
def lse_update(state, x, off_n, N):
    """Fold the sub-tile's existing columns into the running (max, sum exp)."""
    run_max, run_sum = state
    cols = off_n + tl.arange(0, x.shape[1])
    x = tl.where((cols < N)[None, :], x, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(x, axis=1))
    # rows whose columns are all padding keep max = -inf; avoid inf - inf
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    run_sum = run_sum * tl.exp(run_max - safe_max) + tl.sum(tl.exp(x - safe_max[:, None]), axis=1)
    return new_max, run_sum


@triton.jit
def lse_value(state):
    """log(sum exp) per row from the running state: [BM]."""
    run_max, run_sum = state
    return run_max + tl.log(run_sum)


# ---- programs with no state use these


@triton.jit
def no_state(BLOCK_M: tl.constexpr):
    return 0


@triton.jit
def no_finish(state, off_m, off_n, M, N, ops, BLOCK_N: tl.constexpr):
    pass

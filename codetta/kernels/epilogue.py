"""The engine-independent half of an epilogue: operand loaders and sinks that both
mainloops share, and the call of the program's body.

Each mainloop (``mainloop.py``, ``pingpong.py``) walks a tile's column sub-tiles,
moves tile operands its own way (TMA loads/stores) and makes the sub-tile's row
and column indices in its own register layout; everything else happens here, in
plain ``@triton.jit`` functions over those indices, which also compile inside the
Gluon kernel. So a vector load, a reduction or the body's math is written once.

Rows >= M and columns >= N of a sub-tile are padding: loads fill zeros there,
reductions leave them out, stores skip them.
"""

import triton
import triton.language as tl

from . import primitives as P
from .program import Kind

K_TILE: tl.constexpr = tl.constexpr(int(Kind.TILE))
K_PER_ROW: tl.constexpr = tl.constexpr(int(Kind.PER_ROW))
K_PER_ROW_INDEX: tl.constexpr = tl.constexpr(int(Kind.PER_ROW_INDEX))
K_PER_COL: tl.constexpr = tl.constexpr(int(Kind.PER_COL))
K_SCALAR: tl.constexpr = tl.constexpr(int(Kind.SCALAR))
K_DTYPE: tl.constexpr = tl.constexpr(int(Kind.DTYPE))
K_ROW_TABLE: tl.constexpr = tl.constexpr(int(Kind.ROW_TABLE))
K_HALF_TILE: tl.constexpr = tl.constexpr(int(Kind.HALF_TILE))
K_ROW_SUM: tl.constexpr = tl.constexpr(int(Kind.ROW_SUM))
K_ROW_LSE: tl.constexpr = tl.constexpr(int(Kind.ROW_LSE))
K_ROW_PICK: tl.constexpr = tl.constexpr(int(Kind.ROW_PICK))
K_COL_SUM: tl.constexpr = tl.constexpr(int(Kind.COL_SUM))


@triton.jit
def pack_operands(o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, NUM_OPS: tl.constexpr):
    """The kernel's operand slots as one tuple (Triton's launcher cannot pass TMA
    descriptors inside a tuple argument, so they arrive as separate slots)."""
    ops = (o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11)
    out = ()
    for i in tl.static_range(NUM_OPS):
        out = out + (ops[i],)
    return out


@triton.jit
def part_k_blocks(ops, KPARTS: tl.constexpr, A_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K blocks of every K part together (each part's K is its A descriptor's)."""
    n = 0
    for p in tl.static_range(len(KPARTS)):
        pa = ops[KPARTS[p][0]]
        n += tl.cdiv(pa.shape[0] if A_T else pa.shape[1], BLOCK_K)
    return n


@triton.jit
def _segment(off, total, ops, PART_SLOTS: tl.constexpr, AXIS: tl.constexpr):
    """(part, its first index) of the tile at ``off`` along an axis of ``total`` that the
    GEMM's own operand begins and each part (its descriptor's extent along AXIS) follows."""
    bound = total
    for p in tl.static_range(len(PART_SLOTS)):
        bound = bound - ops[PART_SLOTS[p]].shape[AXIS]  # where the first part begins
    seg = off * 0
    start = off * 0
    for p in tl.static_range(len(PART_SLOTS)):
        if off >= bound:
            seg = seg * 0 + (p + 1)
            start = bound + off * 0
        bound = bound + ops[PART_SLOTS[p]].shape[AXIS]
    return seg, start


@triton.jit
def part_of(off_m, off_n, M, N, ops, MPARTS: tl.constexpr, NPARTS: tl.constexpr, A_T: tl.constexpr,
            B_T: tl.constexpr):  # fmt: skip
    """With M or N parts: which part holds the tile at (off_m, off_n) (0: a and the weight
    themselves, then each part in order) and where that part starts, (seg, start_m,
    start_n); zeros without parts. A tile never straddles two parts: the launcher keeps
    BLOCK_M / BLOCK_N dividing every boundary (``launch.check_parts``)."""
    seg = off_m * 0
    start_m = off_m * 0
    start_n = off_m * 0
    if len(MPARTS) > 0:
        seg, start_m = _segment(off_m, M, ops, MPARTS, 1 if A_T else 0)
    if len(NPARTS) > 0:
        seg, start_n = _segment(off_n, N, ops, NPARTS, 1 if B_T else 0)
    return seg, start_m, start_n


@triton.jit
def column_blocks(acc, EPI_SPLIT: tl.constexpr):
    """The tile as a tuple of EPI_SPLIT column sub-tiles, left to right."""
    if EPI_SPLIT == 1:
        blocks = (acc,)
    elif EPI_SPLIT == 2:
        blocks = P.halves(acc)
    else:
        tl.static_assert(EPI_SPLIT == 4, "EPI_SPLIT must be 1, 2 or 4")
        left, right = P.halves(acc)
        blocks = P.halves(left) + P.halves(right)
    return blocks


# ---- loaders (given the sub-tile's row and column indices)


@triton.jit
def load_per_row(ptr, rows, M):
    """[M] vector -> fp32 [BM, 1]."""
    return tl.load(ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]


@triton.jit
def load_per_row_index(ptr, rows, M):
    """[M] integer vector -> int32 [BM] (padding rows: -1)."""
    return tl.load(ptr + rows, mask=rows < M, other=-1).to(tl.int32)


@triton.jit
def load_per_col(ptr, cols, N):
    """[N] vector -> fp32 [1, BNs]."""
    return tl.load(ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]


@triton.jit
def load_row_table(ptr, idx, cols, W: tl.constexpr):
    """table[idx[m], n % W] of a contiguous [P, W] table -> fp32 [BM, BNs] (idx < 0: zeros)."""
    offs = idx.to(tl.int64)[:, None] * W + (cols % W)[None, :]
    return tl.load(ptr + offs, mask=(idx >= 0)[:, None], other=0.0).to(tl.float32)


@triton.jit
def body_inputs(ops, tiles, IN_KINDS: tl.constexpr, rows, cols, M, N, ELEM: tl.constexpr):
    """The body's arguments in declared order: ``tiles[i]`` holds input i when it is
    a tile the engine loaded; vectors, scalars, tables and the dtype come from here."""
    vals = ()
    for i in tl.static_range(len(IN_KINDS)):
        if IN_KINDS[i][0] == K_TILE:
            vals = vals + (tiles[i],)
        elif IN_KINDS[i][0] == K_PER_ROW:
            vals = vals + (load_per_row(ops[IN_KINDS[i][1]], rows, M),)
        elif IN_KINDS[i][0] == K_PER_ROW_INDEX:
            vals = vals + (load_per_row_index(ops[IN_KINDS[i][1]], rows, M)[:, None],)
        elif IN_KINDS[i][0] == K_PER_COL:
            vals = vals + (load_per_col(ops[IN_KINDS[i][1]], cols, N),)
        elif IN_KINDS[i][0] == K_SCALAR:
            vals = vals + (ops[IN_KINDS[i][1]],)
        elif IN_KINDS[i][0] == K_DTYPE:
            vals = vals + (tl.cast(0.0, ELEM),)  # a dtype itself cannot travel in a tuple
        elif IN_KINDS[i][0] == K_ROW_TABLE:
            idx = load_per_row_index(ops[IN_KINDS[i][2]], rows, M)
            vals = vals + (load_row_table(ops[IN_KINDS[i][1]], idx, cols, IN_KINDS[i][3]),)
    return vals


@triton.jit
def call_body(BODY: tl.constexpr, acc, vals, NUM_OUT: tl.constexpr):
    """The program's outputs as a tuple, whatever the body returns."""
    res = BODY(acc, *vals)
    if NUM_OUT == 1:
        res = (res,)
    return res


# ---- reductions over a sub-tile (partials, finished by reductions.py)


@triton.jit
def row_sum_part(val, cols, N):
    """Sum of each row over the sub-tile's existing columns: [BM]."""
    return tl.sum(tl.where((cols < N)[None, :], val, 0.0), axis=1)


@triton.jit
def row_lse_part(val, cols, N):
    """Each row's max over the sub-tile's existing columns and sum exp(val - max): two
    [BM] (a row with no finite value: -inf and 0). Kept as a pair, not as max + log(sum),
    whose rounding at the max's magnitude the row's log-sum-exp would carry (reductions.py)."""
    x = tl.where((cols < N)[None, :], val, float("-inf"))
    m = tl.max(x, axis=1)
    safe = tl.where(m == float("-inf"), 0.0, m)  # padding rows: avoid inf - inf
    return m, tl.sum(tl.exp(x - safe[:, None]), axis=1)


@triton.jit
def row_pick_part(val, cols, idx):
    """val[m, idx[m]] where idx[m] falls in the sub-tile's columns, else 0: [BM]."""
    return tl.sum(tl.where(cols[None, :] == idx[:, None], val, 0.0), axis=1)


@triton.jit
def col_sum_part(val, rows, M):
    """Sum of each column over the sub-tile's existing rows: [BNs]."""
    return tl.sum(tl.where((rows < M)[:, None], val, 0.0), axis=0)


@triton.jit
def store_row_partial(ws, part, rows, M, j, T):
    """part [BM] as column j of a row-major fp32 [M, T] workspace (j >= T: a sub-tile
    wholly past column N, nothing to store)."""
    tl.store(ws + rows.to(tl.int64) * T + j, part, mask=(rows < M) & (j < T))


@triton.jit
def store_row_pair(ws, first, second, rows, M, j, T):
    """Two [BM] partials as columns j and T + j of a row-major fp32 [M, 2T] workspace."""
    mask = (rows < M) & (j < T)
    base = ws + rows.to(tl.int64) * (2 * T) + j
    tl.store(base, first, mask=mask)
    tl.store(base + T, second, mask=mask)


@triton.jit
def store_col_partial(ws, part, cols, N, i):
    """part [BNs] as row i of a row-major fp32 [cdiv(M, BM), N] workspace."""
    tl.store(ws + i.to(tl.int64) * N + cols, part, mask=cols < N)


@triton.jit
def store_reductions(res, ops, OUT_KINDS: tl.constexpr, rows, cols, M, N, j, T, i):
    """Every reduction output of the sub-tile into its workspace: row partials as column
    j of [M, T] (a log-sum-exp's (max, sum) pair as columns j and T + j of [M, 2T]),
    column partials as row i of [cdiv(M, BM), N]. Tile outputs are the engine's."""
    for o in tl.static_range(len(OUT_KINDS)):
        if OUT_KINDS[o][0] == K_ROW_SUM:
            store_row_partial(ops[OUT_KINDS[o][1]], row_sum_part(res[o], cols, N), rows, M, j, T)
        elif OUT_KINDS[o][0] == K_ROW_LSE:
            m, s = row_lse_part(res[o], cols, N)
            store_row_pair(ops[OUT_KINDS[o][1]], m, s, rows, M, j, T)
        elif OUT_KINDS[o][0] == K_ROW_PICK:
            idx = load_per_row_index(ops[OUT_KINDS[o][2]], rows, M)
            store_row_partial(ops[OUT_KINDS[o][1]], row_pick_part(res[o], cols, idx), rows, M, j, T)
        elif OUT_KINDS[o][0] == K_COL_SUM:
            store_col_partial(ops[OUT_KINDS[o][1]], col_sum_part(res[o], rows, M), cols, N, i)

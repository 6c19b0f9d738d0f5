"""Epilogue primitives for the sm_90 ping-pong mainloop (``pingpong.py``), in Gluon.

The same kinds as ``primitives.py``, for a program that sees the whole fp32 tile
``acc`` [BLOCK_M, BLOCK_N] in the wgmma register layout and its consumer's
shared tile ``buf`` (for TMA stores). Rows >= M and columns >= N are padding:
A and B tiles are zero there (TMA fills out-of-bounds elements with zeros), so
is a tile loaded through TMA; vector loads fill zeros, stores skip them, and
the reductions leave them out.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma


@gluon.jit
def tile_rows(acc, off_m):
    """Row indices [BLOCK_M] of the tile, in the layout a row reduction of ``acc`` has."""
    return off_m + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, acc.type.layout))


@gluon.jit
def tile_cols(acc, off_n):
    """Column indices [BLOCK_N] of the tile, in the layout a column reduction of ``acc`` has."""
    return off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))


@gluon.jit
def load_row_vector(ptr, acc, off_n, N):
    """A length-N vector broadcast over the tile's rows: [1, BLOCK_N] fp32."""
    cols = tile_cols(acc, off_n)
    return gl.load(ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]


@gluon.jit
def load_col_vector(ptr, acc, off_m, M):
    """A length-M vector broadcast over the tile's columns: [BLOCK_M, 1] fp32."""
    rows = tile_rows(acc, off_m)
    return gl.load(ptr + rows, mask=rows < M, other=0.0).to(gl.float32)[:, None]


@gluon.jit
def store_tile(desc, buf, val, off_m, off_n):
    """Write ``val`` at the tile's coordinates through the shared tile ``buf`` (TMA).
    Waits first for this consumer's earlier stores to have read ``buf``; the store
    itself completes in the background."""
    tma.store_wait(0)
    buf.store(val.to(buf.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [off_m, off_n], buf)


@gluon.jit
def row_sum(val, acc, off_n, N):
    """Sum of each row over the tile's existing columns: [BLOCK_M]."""
    cols = tile_cols(acc, off_n)
    return gl.sum(gl.where((cols < N)[None, :], val, 0.0), axis=1)


@gluon.jit
def store_row_sum_partial(ptr, val, acc, off_m, off_n, M, N):
    """Row partial: ptr[m, j] = sum of ``val`` over row m of N-tile j; ``ptr`` is fp32
    [M, cdiv(N, BLOCK_N)] (a ROW_PARTIAL output: the whole tile is one sub-tile)."""
    BLOCK_N: gl.constexpr = acc.shape[1]
    rows = tile_rows(acc, off_m)
    width = gl.cdiv(N, BLOCK_N)
    gl.store(ptr + rows * width + off_n // BLOCK_N, row_sum(val, acc, off_n, N), mask=rows < M)

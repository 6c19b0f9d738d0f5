"""Spike: a warp-specialized "ping-pong" GEMM for sm_90 in Gluon, with the K1 epilogue.

Why: in the Triton mainloop (mainloop.py) the epilogue of a tile runs on the same
warps as the next tile's K loop, one after the other (Triton 3.6 does not
warp-specialize on sm_90). For K1 at short K that serialized epilogue is most of
the gap to cuBLAS (NOTES.md). Here three partitions share one persistent CTA:

- a loader warp issues the TMA loads of A and W stages into a ring of buffers;
- two consumer warpgroups take alternate tiles (BM x BN each, accumulator in
  registers). Because the loader fills the ring tile after tile, consumer 1's
  K loop runs while consumer 0 runs its epilogue, and the other way round: the
  epilogue overlaps the other consumer's mainloop instead of adding to it.

Each consumer loads its tile's residual with TMA when it starts the tile (the
load completes during the K loop), and uses one [BM, BN] shared buffer for the
residual in, x out (written over the residual) and then h out.

EPI = 0: plain store of the accumulator (out = A @ W^T), to compare mainloops.
EPI = 1: K1: x = residual + A @ W^T (rounded to the stream dtype), h = x * gamma,
sumsq[m, j] = sum over N-tile j of x^2 (fp32).

No interpreter path: gluon.jit kernels run on sm_90 GPUs only.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M):
    """Grouped order: GROUP_M row-blocks share the W tiles they read from L2."""
    in_group = GROUP_M * num_pid_n
    group = tile // in_group
    first_m = group * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % size_m
    pid_n = (tile % in_group) // size_m
    return pid_m, pid_n


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M):
    # (constexprs do not cross into worker partitions: sizes come from the buffers)
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    NUM_SMS = gl.num_programs(0)
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile in range(pid, num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_tiles):
            s = it % STAGES
            # a fresh barrier counts its previous phase (parity 1) as complete
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_n, kk * BLOCK_K], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _consumer(p, C: gl.constexpr, EPI: gl.constexpr):
    (a_bufs, b_bufs, ready, empty, epi_buf, res_bar, go_mine, go_other) = p[:8]
    (r_desc, x_desc, h_desc, gamma_ptr, ss_ptr, M, N, K, GROUP_M) = p[8:]
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    NUM_SMS = gl.num_programs(0)
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    out_dtype: gl.constexpr = x_desc.dtype
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = gl.cdiv(K, BLOCK_K)
    # this consumer takes every other tile of this CTA: j = C, C + 2, ...
    j = C
    n_done = 0
    for tile in range(pid + C * NUM_SMS, num_tiles, 2 * NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if EPI == 1:
            # the epilogue buffer is free once this consumer's last h store has read it
            tma.store_wait(0)
            mbarrier.expect(res_bar, r_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(r_desc, [off_m, off_n], res_bar, epi_buf)
        # The K loops of the two consumers take turns (consumer 0 first): a consumer
        # waits until the other has passed every ready-barrier wait of its tile. Without
        # the turn, consumer 1 could wait on a stage's barrier two phases ahead of its
        # fills, and an mbarrier parity wait cannot tell those phases apart.
        turn = n_done - 1 + C
        if turn >= 0:
            mbarrier.wait(go_mine, turn & 1)
        it = j * k_tiles
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        prev = 0
        for kk in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(
                a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0, is_async=True
            )
            # one MMA stays in flight; the one before it is done with its stage
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index(prev), count=1, pred=kk > 0)
            prev = s
            it += 1
        mbarrier.arrive(go_other, count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(prev), count=1)

        if EPI == 0:
            tma.store_wait(0)
            epi_buf.store(acc.to(out_dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(x_desc, [off_m, off_n], epi_buf)
        else:
            mbarrier.wait(res_bar, n_done & 1)
            res = epi_buf.load(mma)
            x = (acc + res.to(gl.float32)).to(out_dtype)
            epi_buf.store(x)
            fence_async_shared()
            tma.async_copy_shared_to_global(x_desc, [off_m, off_n], epi_buf)
            xf = x.to(gl.float32)
            rows = off_m + gl.arange(0, BLOCK_M, layout=rows_l)
            cols = off_n + gl.arange(0, BLOCK_N, layout=cols_l)
            # columns >= N: W's rows there are TMA zero padding and so is the residual: x = 0
            gl.store(ss_ptr + rows * num_pid_n + pid_n, gl.sum(xf * xf, axis=1), mask=rows < M)
            g = gl.load(gamma_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
            h = (xf * g[None, :]).to(out_dtype)
            tma.store_wait(0)
            epi_buf.store(h)
            fence_async_shared()
            tma.async_copy_shared_to_global(h_desc, [off_m, off_n], epi_buf)
        j += 2
        n_done += 1
    tma.store_wait(0)


@gluon.jit
def _consumer0_plain(p):
    _consumer(p, 0, 0)


@gluon.jit
def _consumer1_plain(p):
    _consumer(p, 1, 0)


@gluon.jit
def _consumer0_k1(p):
    _consumer(p, 0, 1)


@gluon.jit
def _consumer1_k1(p):
    _consumer(p, 1, 1)


@gluon.jit
def pingpong_kernel(
    a_desc,
    b_desc,
    r_desc,
    x_desc,
    h_desc,
    gamma_ptr,
    ss_ptr,
    M,
    N,
    K,
    GROUP_M,
    EPI: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    epi_bufs = gl.allocate_shared_memory(x_desc.dtype, [2, BLOCK_M, BLOCK_N], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    res_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    go = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(res_bars.index(i), count=1)
        mbarrier.init(go.index(i), count=1)
    shared = (r_desc, x_desc, h_desc, gamma_ptr, ss_ptr, M, N, K, GROUP_M)
    p0 = (
        a_bufs,
        b_bufs,
        ready,
        empty,
        epi_bufs.index(0),
        res_bars.index(0),
        go.index(0),
        go.index(1),
    ) + shared
    p1 = (
        a_bufs,
        b_bufs,
        ready,
        empty,
        epi_bufs.index(1),
        res_bars.index(1),
        go.index(1),
        go.index(0),
    ) + shared
    load_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M)
    if EPI == 0:
        gl.warp_specialize(
            [(_consumer0_plain, (p0,)), (_consumer1_plain, (p1,)), (_loader, load_args)],
            [4, 1],
            [CONSUMER_REGS, 24],
        )
    else:
        gl.warp_specialize(
            [(_consumer0_k1, (p0,)), (_consumer1_k1, (p1,)), (_loader, load_args)],
            [4, 1],
            [CONSUMER_REGS, 24],
        )


def _desc(t: torch.Tensor, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPE[t.dtype])
    return TensorDescriptor.from_tensor(t, block, layout)


def pingpong_gemm(
    a,
    w,
    residual=None,
    gamma=None,
    *,
    block_m=128,
    block_n=128,
    block_k=64,
    stages=4,
    group_m=8,
    consumer_regs=232,
    maxnreg=168,
    num_sms=None,
):
    """out = a @ w^T (residual None), or K1: returns (x, h, sumsq)."""
    M, K = a.shape
    N = w.shape[0]
    num_sms = num_sms or torch.cuda.get_device_properties(a.device).multi_processor_count
    k1 = residual is not None
    x = torch.empty((M, N), dtype=a.dtype, device=a.device)
    h = torch.empty_like(x) if k1 else x
    nt_n = triton.cdiv(N, block_n)
    ss = torch.empty((M, nt_n), dtype=torch.float32, device=a.device) if k1 else x
    tiles = triton.cdiv(M, block_m) * nt_n
    grid = (min(num_sms, tiles),)
    a_d = _desc(a, [block_m, block_k])
    b_d = _desc(w, [block_n, block_k])
    x_d = _desc(x, [block_m, block_n])
    r_d = _desc(residual, [block_m, block_n]) if k1 else x_d
    h_d = _desc(h, [block_m, block_n])
    g = gamma if k1 else x
    pingpong_kernel[grid](
        a_d,
        b_d,
        r_d,
        x_d,
        h_d,
        g,
        ss,
        M,
        N,
        K,
        group_m,
        EPI=1 if k1 else 0,
        STAGES=stages,
        CONSUMER_REGS=consumer_regs,
        num_warps=4,
        maxnreg=maxnreg,
    )
    return (x, h, ss) if k1 else x

"""The sm_90 ping-pong mainloop (Gluon): the epilogue of one tile overlaps the K loop of the next.

In the Triton mainloop (``mainloop.py``) a tile's epilogue runs on the warps that
then run the next tile's K loop, one after the other: Triton 3.6 does not
warp-specialize on sm_90. For programs that move extra tiles in the epilogue
(K1: residual in, x and h out) at short K that serialized epilogue was most of
the gap to cuBLAS (NOTES.md). Here one persistent CTA runs three partitions:

- a loader warp issues the TMA loads of A and B stages into a ring of buffers;
- two consumer warpgroups take alternate tiles of the CTA (BLOCK_M x BLOCK_N
  each, fp32 accumulator in registers, wgmma). Their K loops take turns (an
  mbarrier hand-off), so one consumer's epilogue runs while the other's K loop
  keeps the tensor cores busy.

Each consumer owns one [BLOCK_M, BLOCK_N] shared tile ``buf`` for its epilogue's
TMA traffic. A program with ``acc_init`` (a tile input that seeds the
accumulator) gets that tile loaded into ``buf`` by TMA when the consumer starts
the tile; it lands during the K loop and is added to the accumulator before the
program runs, so the program sees ``acc = init + A @ B^T`` exactly as in the
Triton mainloop.

The epilogue program is the Gluon function ``Epilogue.sm90``, called once per
tile as ``sm90(acc, buf, off_m, off_n, M, N, ops)`` with the whole fp32 tile in
the wgmma register layout; ``primitives_sm90`` has its building blocks.

Layouts: A_T / B_T as in ``mainloop.py`` (A stored [M, K] or [K, M]; B stored
[N, K] or [K, N]); wgmma reads a transposed tile through a permuted view of its
shared buffer. No tail split: the last partial wave runs as it is.

No interpreter path: Gluon kernels run on sm_90 GPUs only, and the CPU suite
checks them by compiling for sm_90a (``aot.py``).
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .mainloop import _pack

MAX_OPERANDS = 6


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M):
    """Grouped order (as the Triton mainloop): GROUP_M row-blocks share W tiles in L2."""
    in_group = GROUP_M * num_pid_n
    group = tile // in_group
    first_m = group * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % size_m
    pid_n = (tile % in_group) // size_m
    return pid_m, pid_n


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M,
            A_T: gl.constexpr, B_T: gl.constexpr):  # fmt: skip
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[2] if A_T else a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[1] if A_T else a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[2] if B_T else b_bufs.shape[1]
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_tiles):
            s = it % STAGES
            # a fresh mbarrier counts its previous phase (parity 1) as complete
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            if A_T:
                tma.async_copy_global_to_shared(a_desc, [kk * BLOCK_K, off_m], bar, a_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], bar, a_bufs.index(s))
            if B_T:
                tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, off_n], bar, b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(b_desc, [off_n, kk * BLOCK_K], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, buf, init_bar, go_mine, go_other, M, N, K, GROUP_M,
              o0, o1, o2, o3, o4, o5, NUM_OPS: gl.constexpr, ACC_INIT: gl.constexpr,
              EPI: gl.constexpr, A_T: gl.constexpr, B_T: gl.constexpr, C: gl.constexpr):  # fmt: skip
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[2] if A_T else a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[1] if A_T else a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[2] if B_T else b_bufs.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    # operands arrive in slots (descriptors cannot travel inside a tuple argument)
    ops = _pack(o0, o1, o2, o3, o4, o5, None, None, None, None, None, None, NUM_OPS)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    nprog = gl.num_programs(0)
    # this consumer takes the CTA's tiles j = C, C + 2, C + 4, ...
    j = C
    n_done = 0
    for tile in range(gl.program_id(0) + C * nprog, num_pid_m * num_pid_n, 2 * nprog):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        # buf is free once this consumer's stores of its last tile have read it
        tma.store_wait(0)
        if ACC_INIT >= 0:
            init_desc = ops[ACC_INIT]
            mbarrier.expect(init_bar, init_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(init_desc, [off_m, off_n], init_bar, buf)
        # The K loops of the two consumers take turns (consumer 0 first): one waits
        # until the other has passed every ready-barrier wait of its tile. Without
        # it, consumer 1 could wait on a stage's barrier two phases ahead of the
        # loader, and an mbarrier parity wait cannot tell those phases apart.
        turn = n_done - 1 + C
        if turn >= 0:
            mbarrier.wait(go_mine, turn & 1)
        it = j * k_tiles
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)
        prev = 0
        for kk in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a = a_bufs.index(s).permute((1, 0)) if A_T else a_bufs.index(s)
            b = b_bufs.index(s) if B_T else b_bufs.index(s).permute((1, 0))
            acc = warpgroup_mma(a, b, acc, use_acc=kk > 0, is_async=True)
            # one MMA stays in flight; the one before it has finished with its stage
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index(prev), count=1, pred=kk > 0)
            prev = s
            it += 1
        mbarrier.arrive(go_other, count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(prev), count=1)
        if ACC_INIT >= 0:
            mbarrier.wait(init_bar, n_done & 1)
            acc = acc + buf.load(layout).to(gl.float32)
        EPI(acc, buf, off_m, off_n, M, N, ops)
        j += 2
        n_done += 1
    tma.store_wait(0)


@gluon.jit
def pingpong_kernel(a_desc, b_desc, M, N, K, GROUP_M, o0, o1, o2, o3, o4, o5,
                    NUM_OPS: gl.constexpr, ACC_INIT: gl.constexpr, EPI: gl.constexpr,
                    BUF_DTYPE: gl.constexpr, BUF_LAYOUT: gl.constexpr, A_T: gl.constexpr,
                    B_T: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[1] if A_T else a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_T else b_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bufs = gl.allocate_shared_memory(BUF_DTYPE, [2, BLOCK_M, BLOCK_N], BUF_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    init_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    go = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(init_bars.index(i), count=1)
        mbarrier.init(go.index(i), count=1)
    gl.warp_specialize(
        [
            (_consumer, (a_bufs, b_bufs, ready, empty, bufs.index(0), init_bars.index(0), go.index(0),
                         go.index(1), M, N, K, GROUP_M, o0, o1, o2, o3, o4, o5, NUM_OPS, ACC_INIT, EPI,
                         A_T, B_T, 0)),
            (_consumer, (a_bufs, b_bufs, ready, empty, bufs.index(1), init_bars.index(1), go.index(1),
                         go.index(0), M, N, K, GROUP_M, o0, o1, o2, o3, o4, o5, NUM_OPS, ACC_INIT, EPI,
                         A_T, B_T, 1)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, A_T, B_T)),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )  # fmt: skip


# Registers: 4 consumer warps + 4 consumer warps + 1 loader warp (its warpgroup)
# = 3 warpgroups. 168 per thread at launch is the most that fits 65536; the
# worker consumer asks for 232, the loader gives back to 24, the default
# consumer gets the rest (256).
MAXNREG = 168
CONSUMER_REGS = 232


def grid_size(M: int, N: int, cfg, num_sms: int) -> int:
    return min(num_sms, triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n))

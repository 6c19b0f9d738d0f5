"""The sm_90 ping-pong mainloop (Gluon): the epilogue of one tile overlaps the K loop of the next.

In the portable mainloop (``mainloop.py``) a tile's epilogue runs on the warps
that then run the next tile's K loop, one after the other: Triton 3.6 does not
warp-specialize on sm_90. Here one persistent CTA runs three partitions:

- a loader warp issues the TMA loads of A and B stages into a ring of buffers;
- two consumer warpgroups take alternate tiles of the CTA (BLOCK_M x BLOCK_N
  each, fp32 accumulator in registers, wgmma). Their K loops take turns (an
  mbarrier hand-off), so one consumer's epilogue runs while the other's K loop
  keeps the tensor cores busy.

The epilogue runs the same program body as the portable mainloop, through the
same shared loaders and sinks (``epilogue.py``); only tile operands move
differently. Each consumer owns ``EPI_SPLIT`` shared sub-tiles [BLOCK_M,
BLOCK_N / EPI_SPLIT], used as a ring by the epilogue's TMA traffic: a tile
output is written to one and TMA-stored from it (a slot is reused only once the
store issued from it EPI_SPLIT stores earlier has read it). A (non-seeding) tile
input goes through a prefetch buffer of one sub-tile per input and consumer where
the shared memory has room for it (beside 4 A/B stages, not 5:
``PingPongEngine.prefetches``): sub-tile 0's inputs are issued when the consumer
starts the tile (they land during the K loop), sub-tile j+1's as soon as j's are in
registers. Without the buffer (5 stages) each input is loaded through ring slot 0
once every store has left the ring, one at a time. A seeding tile is TMA-loaded
into the ring when the consumer starts the tile; it lands during the K loop
and is added to the accumulator before the body runs, so the body sees
``acc = seed + A @ B^T`` exactly as in the portable mainloop.

The ring holds the GEMM's dtype, or float32 when every tile operand of the program
declares float32 (``ACCUMULATE_F32``, ``STORE_F32``: a weight gradient summed over
chunks of rows in an fp32 buffer). Whole float32 rings of 128x128 tiles would leave
room for 3 A/B stages, so such a program with one tile output and no other tile input
gets a ring of RING_SLOTS = 2 sub-tiles (``PingPongEngine.ring_slots``) and its seed
streams through it one sub-tile ahead (``_streamed_seed``): 4-5 stages.

Layouts: A_T / B_T as in ``mainloop.py``; wgmma reads a transposed tile through
a permuted view of its shared buffer. The kernel runs the first ``TILES`` tiles in
tile order (all of them, or all but the last partial wave's, which then run split
along K on the portable mainloop: ``PingPongEngine``'s tail split). A paired weight
(``PairedWeight``: SwiGLU's gate and up) is loaded into the same B stage below the
first weight's rows, so one wgmma of twice the tile's width forms both products; the epilogue splits the
accumulator into the two halves and hands the body their sub-tiles as a pair.
K parts (``KPart``): the loader issues each part's stages after the tile's own, from
the part's descriptors; the consumers see one longer K loop. N parts (``NPart``): the
loader reads each tile's B from its weight's descriptor and the epilogue stores its
tile outputs into that weight's output tensors.

No interpreter path: Gluon kernels run on sm_90 GPUs only; the CPU suite
compiles them for sm_90a (``aot.py``), and the body they run is the one the
interpreter tests.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import epilogue as E
from . import primitives as P

# the CTA-wide barrier: ``gl.thread_barrier`` in Triton 3.6, ``gl.barrier`` from 3.7 (the same op)
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M):
    """Grouped order, the portable mainloop's exactly (``mainloop.tile_coords``: a tail
    split runs the last tiles there): GROUP_M row-blocks share W tiles in L2."""
    in_group = GROUP_M * num_pid_n
    group = tile // in_group
    first_m = group * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + tile % size_m
    pid_n = (tile % in_group) // size_m
    return pid_m, pid_n


@gluon.jit
def _load_part(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, k_tiles, it,
               A_T: gl.constexpr, B_T: gl.constexpr):  # fmt: skip
    """The A and B stages of one K part's K loop (its own descriptors); returns the
    stage counter after it."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.shape[1] if A_T else a_bufs.shape[2]
    for kk in range(k_tiles):
        s = it % STAGES
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
    return it


@gluon.jit
def _loader(a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, TILES,
            o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, NUM_OPS: gl.constexpr, KPARTS: gl.constexpr,
            NPARTS: gl.constexpr, MPARTS: gl.constexpr, A_T: gl.constexpr, B_T: gl.constexpr,
            PAIRED: gl.constexpr):  # fmt: skip
    """With PAIRED (B not transposed), each B stage holds the tile rows of both weights,
    b_desc's on top of b2_desc's: one wgmma then forms both products side by side.
    K parts (KPARTS): after each tile's A and B stages, each part's, from its descriptors."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[2] if A_T else a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[1] if A_T else a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_T else b_desc.block_type.shape[0]
    B_BYTES: gl.constexpr = b_desc.block_type.nbytes * (2 if PAIRED else 1)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile in range(gl.program_id(0), TILES, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if len(MPARTS) + len(NPARTS) > 0:  # the tile's rows (columns) are one A's (weight's)
            ops = E.pack_operands(o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, NUM_OPS)
            seg, start_m, start_n = E.part_of(off_m, off_n, M, N, ops, MPARTS, NPARTS, A_T, B_T)
            off_a, off_b = off_m - start_m, off_n - start_n
            if seg == 0:
                it = _load_part(
                    a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_a, off_b, k_tiles, it, A_T, B_T
                )
            for p in gl.static_range(len(MPARTS) + len(NPARTS)):
                if seg == p + 1:
                    a_p = ops[MPARTS[p]] if len(MPARTS) > 0 else a_desc
                    b_p = ops[NPARTS[p]] if len(NPARTS) > 0 else b_desc
                    it = _load_part(
                        a_p, b_p, a_bufs, b_bufs, ready, empty, off_a, off_b, k_tiles, it, A_T, B_T
                    )
        else:
            for kk in range(k_tiles):
                s = it % STAGES
                # a fresh mbarrier counts its previous phase (parity 1) as complete
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, a_desc.block_type.nbytes + B_BYTES)
                if A_T:
                    tma.async_copy_global_to_shared(a_desc, [kk * BLOCK_K, off_m], bar, a_bufs.index(s))
                else:
                    tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], bar, a_bufs.index(s))
                if PAIRED:
                    b_stage = b_bufs.index(s)
                    tma.async_copy_global_to_shared(
                        b_desc, [off_n, kk * BLOCK_K], bar, b_stage.slice(0, BLOCK_N)
                    )
                    tma.async_copy_global_to_shared(b2_desc, [off_n, kk * BLOCK_K], bar,
                                                    b_stage.slice(BLOCK_N, BLOCK_N))  # fmt: skip
                elif B_T:
                    tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, off_n], bar, b_bufs.index(s))
                else:
                    tma.async_copy_global_to_shared(b_desc, [off_n, kk * BLOCK_K], bar, b_bufs.index(s))
                it += 1
            if len(KPARTS) > 0:
                ops = E.pack_operands(o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, NUM_OPS)
                for p in gl.static_range(len(KPARTS)):
                    pa = ops[KPARTS[p][0]]
                    k_part = gl.cdiv(pa.shape[0] if A_T else pa.shape[1], BLOCK_K)
                    it = _load_part(pa, ops[KPARTS[p][1]], a_bufs, b_bufs, ready, empty, off_m, off_n, k_part,
                                    it, A_T, B_T)  # fmt: skip


@gluon.jit
def _load_tiles(ops, IN_KINDS: gl.constexpr, ring, ld_bar, ld_phase, like, off_m, off_n):
    """The sub-tile of every non-seeding tile input, as fp32 in the layout of ``like``
    (0 for other inputs), each TMA-loaded through ring slot 0 once every store has left it
    (where the shared memory holds no prefetch buffer: ``_take_inputs``)."""
    tiles = ()
    for i in gl.static_range(len(IN_KINDS)):
        if IN_KINDS[i][0] == E.K_TILE:
            desc = ops[IN_KINDS[i][1]]
            buf = ring.index(0)
            tma.store_wait(0)
            mbarrier.expect(ld_bar, desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [off_m, off_n], ld_bar, buf)
            mbarrier.wait(ld_bar, ld_phase)
            ld_phase = ld_phase ^ 1
            tiles = tiles + (buf.load(like.type.layout).to(gl.float32),)
        else:
            tiles = tiles + (0,)
    return tiles, ld_phase


@gluon.jit
def _issue_inputs(ops, IN_TILES: gl.constexpr, inb, ld_bar, off_m, off_n):
    """TMA-load the sub-tile at (off_m, off_n) of every non-seeding tile input into its
    slot of the prefetch buffer, all on one barrier."""
    first = ops[IN_TILES[0]]
    mbarrier.expect(ld_bar, len(IN_TILES) * first.block_type.nbytes)
    for t in gl.static_range(len(IN_TILES)):
        tma.async_copy_global_to_shared(ops[IN_TILES[t]], [off_m, off_n], ld_bar, inb.index(t))


@gluon.jit
def _take_inputs(ops, IN_KINDS: gl.constexpr, IN_TILES: gl.constexpr, inb, ld_bar, ld_phase, like, off_m,
                 next_n, MORE: gl.constexpr):  # fmt: skip
    """As ``_load_tiles``, from the prefetch buffer: the sub-tile's inputs were issued one
    sub-tile earlier (the first at the tile's start, so they land during its K loop);
    once they are in registers, the next sub-tile's (at column next_n) are issued."""
    mbarrier.wait(ld_bar, ld_phase)
    tiles = ()
    t = 0
    for i in gl.static_range(len(IN_KINDS)):
        if IN_KINDS[i][0] == E.K_TILE:
            tiles = tiles + (inb.index(t).load(like.type.layout).to(gl.float32),)
            t += 1
        else:
            tiles = tiles + (0,)
    if MORE:
        _issue_inputs(ops, IN_TILES, inb, ld_bar, off_m, next_n)
    return tiles, ld_phase ^ 1


@gluon.jit
def _store_tiles(res, ops, OUT_KINDS: gl.constexpr, ring, j: gl.constexpr, off_m, off_n,
                 OUT_PARTS: gl.constexpr, seg, start_m, start_n):  # fmt: skip
    """TMA-store sub-tile j's tile outputs through the ring, round robin over the tile's
    stores (OUT_KINDS[o][3]: the output's place among the tile outputs, [4]: their number);
    with M or N parts (OUT_PARTS), into the tensor of the tile's part ``seg``, at its own
    (off_m - start_m, off_n - start_n)."""
    SLOTS: gl.constexpr = ring.shape[0]
    for o in gl.static_range(len(OUT_KINDS)):
        if OUT_KINDS[o][0] == E.K_TILE or OUT_KINDS[o][0] == E.K_HALF_TILE:
            desc = ops[OUT_KINDS[o][1]]
            buf = ring.index((j * OUT_KINDS[o][4] + OUT_KINDS[o][3]) % SLOTS)
            if OUT_KINDS[o][0] == E.K_HALF_TILE:
                buf = buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)
                off = off_n // 2
            else:
                off = off_n
            tma.store_wait(SLOTS - 1)  # the store issued from this slot SLOTS stores ago is done
            if desc.dtype != ring.dtype:
                # a narrower output through a float32 ring slot viewed in its dtype
                # (FINISH_F32): the view's elements lie in other threads' bytes, which may
                # still hold the seed they are reading from this slot, so all read first. The
                # view: the slot's bytes as desc.dtype rows, twice (or more) the tile's, of which
                # the first rows are the tile in its own layout (a row-major swizzle repeats every
                # 8 rows); Triton 3.8 reinterprets only to the same storage size
                WIDER: gl.constexpr = ring.dtype.primitive_bitwidth // desc.dtype.primitive_bitwidth
                ROWS: gl.constexpr = desc.block_type.shape[0]
                buf = buf._reinterpret(desc.dtype, [WIDER * ROWS, desc.block_type.shape[1]], desc.layout)
                buf = buf.slice(0, ROWS)
                _cta_barrier()
            buf.store(res[o].to(desc.dtype))
            fence_async_shared()
            if len(OUT_PARTS) == 0:
                tma.async_copy_shared_to_global(desc, [off_m, off], buf)
            else:
                if seg == 0:
                    tma.async_copy_shared_to_global(desc, [off_m, off], buf)
                for p in gl.static_range(len(OUT_PARTS[o])):
                    if seg == p + 1:
                        part = ops[OUT_PARTS[o][p]]
                        tma.async_copy_shared_to_global(part, [off_m - start_m, off - start_n], buf)


@gluon.jit
def _epilogue(acc, ring, inb, ld_bar, ld_phase, seed_bar, sd_phase, off_m, off_n, M, N, ops,
              BODY: gl.constexpr, IN_KINDS: gl.constexpr, OUT_KINDS: gl.constexpr, SEED: gl.constexpr,
              ELEM: gl.constexpr, PAIRED: gl.constexpr, IN_TILES: gl.constexpr, PREFETCH: gl.constexpr,
              EPI_SPLIT: gl.constexpr, OUT_PARTS: gl.constexpr, seg, start_m, start_n,
              STORES_FIRST: gl.constexpr):  # fmt: skip
    """The program over the tile's EPI_SPLIT column sub-tiles; returns the load and seed
    barriers' next phases. With PAIRED, acc holds the two products side by side and the
    body gets each sub-tile as their pair. A ring of fewer slots than sub-tiles streams
    the seed (``_streamed_seed``)."""
    SLOTS: gl.constexpr = ring.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[0]
    SUB_N: gl.constexpr = ring.shape[2]
    if PAIRED:
        first, second = P.halves(acc)
        blocks = E.column_blocks(first, EPI_SPLIT)
        blocks2 = E.column_blocks(second, EPI_SPLIT)
    else:
        blocks = E.column_blocks(acc, EPI_SPLIT)
    if SEED >= 0 and SLOTS == EPI_SPLIT:
        # the seed landed in the ring during the K loop: add all of it first, freeing the ring
        seeded = ()
        for j in gl.static_range(EPI_SPLIT):
            seeded = seeded + (blocks[j] + ring.index(j).load(blocks[j].type.layout).to(gl.float32),)
        blocks = seeded
    for j in gl.static_range(EPI_SPLIT):
        like = blocks[j]
        sub_n = off_n + j * SUB_N
        if SEED >= 0 and SLOTS < EPI_SPLIT:
            like, sd_phase = _streamed_seed(like, ops[SEED], ring, seed_bar, sd_phase, off_m, sub_n + SUB_N,
                                            j, j + 1 < EPI_SPLIT)  # fmt: skip
        a = (like, blocks2[j]) if PAIRED else like
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, like.type.layout))
        cols = sub_n + gl.arange(0, SUB_N, layout=gl.SliceLayout(0, like.type.layout))
        if PREFETCH:
            tiles, ld_phase = _take_inputs(ops, IN_KINDS, IN_TILES, inb, ld_bar, ld_phase, like, off_m,
                                           sub_n + SUB_N, j + 1 < EPI_SPLIT)  # fmt: skip
        else:
            tiles, ld_phase = _load_tiles(ops, IN_KINDS, ring, ld_bar, ld_phase, like, off_m, sub_n)
        vals = E.body_inputs(ops, tiles, IN_KINDS, rows, cols, M, N, ELEM)
        res = E.call_body(BODY, a, vals, len(OUT_KINDS))
        # reductions first (they shrink their values to vectors before the tile stores), or
        # (STORES_FIRST) the tile outputs first: their registers free before values formed
        # only for a reduction (CE_LOGITS_SCALED's products) are held
        if STORES_FIRST:
            _store_tiles(res, ops, OUT_KINDS, ring, j, off_m, sub_n, OUT_PARTS, seg, start_m, start_n)
        E.store_reductions(res, ops, OUT_KINDS, rows, cols, M, N, sub_n // SUB_N, gl.cdiv(N, SUB_N),
                           off_m // BLOCK_M)  # fmt: skip
        if not STORES_FIRST:
            _store_tiles(res, ops, OUT_KINDS, ring, j, off_m, sub_n, OUT_PARTS, seg, start_m, start_n)
    return ld_phase, sd_phase


@gluon.jit
def _streamed_seed(block, seed, ring, seed_bar, sd_phase, off_m, next_n, j: gl.constexpr, MORE: gl.constexpr):
    """Sub-tile j plus its seed, which was TMA-loaded into ring slot j % SLOTS (sub-tile
    0's at the tile's start, during the K loop; j+1's here, once j's is in registers, into
    the next slot after the store issued from it has left). A program with one tile
    output (the seed's: ACCUMULATE_F32) then writes sub-tile j back to slot j % SLOTS.
    So a float32 seed needs a ring of 2 sub-tiles per consumer, not a whole tile's."""
    SLOTS: gl.constexpr = ring.shape[0]
    mbarrier.wait(seed_bar, sd_phase)
    block = block + ring.index(j % SLOTS).load(block.type.layout).to(gl.float32)
    if MORE:
        tma.store_wait(0)
        mbarrier.expect(seed_bar, seed.block_type.nbytes)
        tma.async_copy_global_to_shared(seed, [off_m, next_n], seed_bar, ring.index((j + 1) % SLOTS))
    return block, sd_phase ^ 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, ring, inb, seed_bar, ld_bar, go_mine, go_other, M, N, K, GROUP_M,
              TILES, o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, NUM_OPS: gl.constexpr,
              SEED: gl.constexpr, KPARTS: gl.constexpr, NPARTS: gl.constexpr, MPARTS: gl.constexpr,
              OUT_PARTS: gl.constexpr,
              BODY: gl.constexpr, IN_KINDS: gl.constexpr, OUT_KINDS: gl.constexpr,
              A_T: gl.constexpr, B_T: gl.constexpr, C: gl.constexpr, PAIRED: gl.constexpr,
              IN_TILES: gl.constexpr, PREFETCH: gl.constexpr, EPI_SPLIT: gl.constexpr,
              STORES_FIRST: gl.constexpr):  # fmt: skip
    STAGES: gl.constexpr = a_bufs.shape[0]
    SLOTS: gl.constexpr = ring.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[2] if A_T else a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[1] if A_T else a_bufs.shape[2]
    # the accumulator's width: the tile's, or (PAIRED) both products of it side by side
    ACC_N: gl.constexpr = b_bufs.shape[2] if B_T else b_bufs.shape[1]
    BLOCK_N: gl.constexpr = ACC_N // 2 if PAIRED else ACC_N
    ELEM: gl.constexpr = a_bufs.dtype
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ACC_N, 16]
    )
    ops = E.pack_operands(o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, NUM_OPS)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    if len(KPARTS) > 0:  # the K parts' stages follow each tile's own (the loader's order)
        k_tiles += E.part_k_blocks(ops, KPARTS, A_T, BLOCK_K)
    nprog = gl.num_programs(0)
    # this consumer takes the CTA's tiles j = C, C + 2, C + 4, ...
    j = C
    n_done = 0
    ld_phase = 0
    sd_phase = 0
    for tile in range(gl.program_id(0) + C * nprog, TILES, 2 * nprog):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        # the ring is free once this consumer's stores of its last tile have read it
        tma.store_wait(0)
        if SEED >= 0:
            seed = ops[SEED]
            # the whole seed, or (a ring of fewer slots) its first sub-tile: the rest streams
            FIRST: gl.constexpr = EPI_SPLIT if SLOTS == EPI_SPLIT else 1
            mbarrier.expect(seed_bar, FIRST * seed.block_type.nbytes)
            for q in gl.static_range(FIRST):
                tma.async_copy_global_to_shared(seed, [off_m, off_n + q * (BLOCK_N // EPI_SPLIT)], seed_bar,
                                                ring.index(q))  # fmt: skip
        if PREFETCH:  # the first sub-tile's tile inputs land during the K loop
            _issue_inputs(ops, IN_TILES, inb, ld_bar, off_m, off_n)
        # The K loops of the two consumers take turns (consumer 0 first): one waits
        # until the other has passed every ready-barrier wait of its tile. Without
        # it, consumer 1 could wait on a stage's barrier two phases ahead of the
        # loader, and an mbarrier parity wait cannot tell those phases apart.
        turn = n_done - 1 + C
        if turn >= 0:
            mbarrier.wait(go_mine, turn & 1)
        it = j * k_tiles
        acc = gl.zeros((BLOCK_M, ACC_N), gl.float32, layout)
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
        if SEED >= 0 and SLOTS == EPI_SPLIT:
            mbarrier.wait(seed_bar, sd_phase)
            sd_phase = sd_phase ^ 1
        seg, start_m, start_n = E.part_of(off_m, off_n, M, N, ops, MPARTS, NPARTS, A_T, B_T)
        ld_phase, sd_phase = _epilogue(acc, ring, inb, ld_bar, ld_phase, seed_bar, sd_phase, off_m, off_n, M,
                                       N, ops, BODY, IN_KINDS, OUT_KINDS, SEED, ELEM, PAIRED, IN_TILES,
                                       PREFETCH, EPI_SPLIT, OUT_PARTS, seg, start_m, start_n,
                                       STORES_FIRST)  # fmt: skip
        j += 2
        n_done += 1
    tma.store_wait(0)


@gluon.jit
def pingpong_kernel(a_desc, b_desc, M, N, K, GROUP_M, TILES, o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11,
                    NUM_OPS: gl.constexpr, SEED: gl.constexpr, PAIR: gl.constexpr, KPARTS: gl.constexpr,
                    NPARTS: gl.constexpr, MPARTS: gl.constexpr, OUT_PARTS: gl.constexpr, BODY: gl.constexpr,
                    IN_KINDS: gl.constexpr, OUT_KINDS: gl.constexpr, RING_DTYPE: gl.constexpr,
                    RING_LAYOUT: gl.constexpr, EPI_SPLIT: gl.constexpr, A_T: gl.constexpr, B_T: gl.constexpr,
                    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, IN_TILES: gl.constexpr,
                    PREFETCH: gl.constexpr, RING_SLOTS: gl.constexpr,
                    STORES_FIRST: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[1] if A_T else a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_T else b_desc.block_type.shape[0]
    PAIRED: gl.constexpr = PAIR >= 0
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    if PAIRED:  # both weights' rows of a tile, one above the other (B not transposed)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_N, b_desc.block_type.shape[1]],
                                           b_desc.layout)  # fmt: skip
        b2_desc = E.pack_operands(o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, NUM_OPS)[PAIR]
    else:
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        b2_desc = b_desc
    ring0 = gl.allocate_shared_memory(RING_DTYPE, [RING_SLOTS, BLOCK_M, BLOCK_N // EPI_SPLIT], RING_LAYOUT)
    ring1 = gl.allocate_shared_memory(RING_DTYPE, [RING_SLOTS, BLOCK_M, BLOCK_N // EPI_SPLIT], RING_LAYOUT)
    if PREFETCH:  # per consumer, one sub-tile of each tile input
        in_shape: gl.constexpr = [len(IN_TILES), BLOCK_M, BLOCK_N // EPI_SPLIT]
        inb0 = gl.allocate_shared_memory(RING_DTYPE, in_shape, RING_LAYOUT)
        inb1 = gl.allocate_shared_memory(RING_DTYPE, in_shape, RING_LAYOUT)
    else:
        inb0 = ring0
        inb1 = ring1
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    seed_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ld_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    go = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        # (the seed barriers only where a seed uses them: the allocator may place a column
        # sum's scratch over unused ones, and PTX asks an initialized mbarrier's memory to be
        # invalidated before any other use)
        if SEED >= 0:
            mbarrier.init(seed_bars.index(i), count=1)
        mbarrier.init(ld_bars.index(i), count=1)
        mbarrier.init(go.index(i), count=1)
    gl.warp_specialize(
        [
            (_consumer, (a_bufs, b_bufs, ready, empty, ring0, inb0, seed_bars.index(0), ld_bars.index(0),
                         go.index(0), go.index(1), M, N, K, GROUP_M, TILES,
                         o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11,
                         NUM_OPS, SEED, KPARTS, NPARTS, MPARTS, OUT_PARTS, BODY, IN_KINDS, OUT_KINDS, A_T,
                         B_T, 0, PAIRED, IN_TILES,
                         PREFETCH,
                         EPI_SPLIT, STORES_FIRST)),
            (_consumer, (a_bufs, b_bufs, ready, empty, ring1, inb1, seed_bars.index(1), ld_bars.index(1),
                         go.index(1), go.index(0), M, N, K, GROUP_M, TILES,
                         o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11,
                         NUM_OPS, SEED, KPARTS, NPARTS, MPARTS, OUT_PARTS, BODY, IN_KINDS, OUT_KINDS, A_T,
                         B_T, 1, PAIRED, IN_TILES,
                         PREFETCH,
                         EPI_SPLIT, STORES_FIRST)),
            (_loader, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, TILES,
                       o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, NUM_OPS, KPARTS, NPARTS, MPARTS, A_T,
                       B_T, PAIRED)),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )  # fmt: skip


# Registers: 4 consumer warps + 4 consumer warps + 1 loader warp (its warpgroup)
# = 3 warpgroups. 168 per thread at launch is the most that fits 65536; the
# worker consumer asks for 232, the loader gives back to 24, the default
# consumer gets the rest (256). A program may even them (``Program.pingpong_regs``:
# 240 / 248 keeps DSWIGLU_Y's five held sub-tiles out of the stack at 128x128 split 4).
MAXNREG = 168
CONSUMER_REGS = 232

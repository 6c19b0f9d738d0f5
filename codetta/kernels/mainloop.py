"""The portable GEMM mainloop: ``acc = A @ B^T`` handed to an epilogue program.

It runs every program, on every GPU and through the Triton interpreter (so the
CPU suite runs the real kernel code). On sm_90 GPUs the tuner also times its
warp-specialized twin (``pingpong.py``) and keeps the faster.

Persistent grid (one program per SM), host TMA tensor descriptors, grouped
tile order. The mainloop never writes memory itself: every store, including
the plain output, belongs to the program it is given (``program.py``).

Layouts (all served by this one kernel):
  A_T = False: A is stored [M, K];  A_T = True: A is stored [K, M] (a transposed view)
  B_T = False: B is stored [N, K] (nn.Linear weight);  B_T = True: B is stored [K, N]

Epilogue: the fp32 tile is split into ``EPI_SPLIT`` column sub-tiles; for each,
the tile inputs are TMA-loaded at the sub-tile's coordinates, the body runs
(``epilogue.call_body``), tile outputs are TMA-stored and reductions go to
their workspaces (``epilogue.store_reductions``). A seeding tile input is read
once per tile, before the K loop, into the accumulator (in a split tail: added to part
0's partial after its products, so that no part's accumulator starts from a select,
which ptxas met by serializing the wgmma).

K parts (``KPARTS``, a program with ``KPart`` inputs): after the K loop over A and
B, one more K loop per part over its own (A, B) descriptors, into the same
accumulator: acc = A @ B^T + A_1 @ B_1^T + ... (a tail split, with ``CODETTA_TAIL_LAUNCH=1``
only, splits their K laid end to end).

N parts (``NPARTS``, a program with ``NPart`` weights): a tile's columns lie within one
weight (BLOCK_N divides every boundary): its K loop reads that weight's descriptor and
its tile outputs go to that weight's output tensors (``OUT_PARTS``), at the weight's
own columns (no tail split). M parts (``MPARTS``, ``MPart`` A operands) likewise along
the rows: a tile's K loop reads its A's descriptor, its outputs go to that A's tensors.

Tail split (``TAIL_SPLIT`` > 1): when the tile count is not a multiple of the
grid, the last partial wave would leave most SMs idle. Those tail tiles are
instead split along K into ``tail_splits`` parts run by different programs
(split-K on the last wave only). Each part writes its fp32 partial tile to a
workspace and bumps the tile's arrival counter; the part that arrives last
resets the counter, sums the partials in part order (so results are
bit-identical run to run, whoever finishes last) and runs the epilogue on the
whole tile. Nothing waits on another program. ``TAIL_ONLY`` runs the tail alone (grid
``tail * tail_splits``, ``NUM_SMS`` the grid whose tail it is): the split tail of a
ping-pong launch, whose kernel ran the other tiles (``engines.PingPongEngine``), or of a
``MAIN_ONLY`` launch of this kernel, which runs all but the tail (``engines.TritonEngine``:
a tail too large to split within one launch, ``CODETTA_TAIL_LAUNCH``).
"""

import triton
import triton.language as tl

from . import epilogue as E


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-tiles share each column sweep, so W tiles stay in L2."""
    num_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_in_group
    first_m = group_id * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group_rows)
    pid_n = (tile_id % num_in_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _accumulate(a_desc, b_desc, acc, off_am, off_bn, k_lo, k_hi, A_T, B_T, BLOCK_K, IEEE):
    """acc += A[off_am:, k] @ B[off_bn:, k]^T over the K blocks [k_lo, k_hi)."""
    for ki in range(k_lo, k_hi):
        off_k = ki * BLOCK_K
        if A_T:
            a = a_desc.load([off_k, off_am]).T  # [BM, BK]
        else:
            a = a_desc.load([off_am, off_k])  # [BM, BK]
        if B_T:
            b = b_desc.load([off_k, off_bn])  # [BK, BN]
        else:
            b = b_desc.load([off_bn, off_k]).T  # [BK, BN]
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _accumulate_parts(ops, KPARTS: tl.constexpr, acc, off_am, off_bn, A_T, B_T, BLOCK_K, IEEE):
    """acc += a_i @ w_i^T for every K part (slots KPARTS[i] = (a_i, w_i)), one K loop
    after another; each part's K is its descriptor's."""
    for p in tl.static_range(len(KPARTS)):
        pa = ops[KPARTS[p][0]]
        k_part = pa.shape[0] if A_T else pa.shape[1]
        acc = _accumulate(pa, ops[KPARTS[p][1]], acc, off_am, off_bn, 0, tl.cdiv(k_part, BLOCK_K), A_T, B_T,
                          BLOCK_K, IEEE)  # fmt: skip
    return acc


@triton.jit
def _accumulate_span(a_desc, b_desc, ops, KPARTS: tl.constexpr, acc, off_am, off_bn, k_lo, k_hi, k_tiles, A_T,
                     B_T, BLOCK_K, IEEE):  # fmt: skip
    """acc += the K blocks [k_lo, k_hi) of the products' K laid end to end: the first
    product's k_tiles blocks, then each K part's (a tail part of a K-part GEMM)."""
    acc = _accumulate(a_desc, b_desc, acc, off_am, off_bn, k_lo, tl.minimum(k_hi, k_tiles), A_T, B_T, BLOCK_K,
                      IEEE)  # fmt: skip
    base = k_tiles
    for p in tl.static_range(len(KPARTS)):
        pa = ops[KPARTS[p][0]]
        k_part = tl.cdiv(pa.shape[0] if A_T else pa.shape[1], BLOCK_K)
        acc = _accumulate(pa, ops[KPARTS[p][1]], acc, off_am, off_bn, tl.maximum(k_lo - base, 0),
                          tl.minimum(k_hi - base, k_part), A_T, B_T, BLOCK_K, IEEE)  # fmt: skip
        base += k_part
    return acc


@triton.jit
def _accumulate_mn_part(a_desc, b_desc, ops, MPARTS: tl.constexpr, NPARTS: tl.constexpr, seg, acc, off_a,
                        off_b, k_tiles, A_T, B_T, BLOCK_K, IEEE):  # fmt: skip
    """acc += A_seg @ B_seg^T: the tile's rows (M parts) or columns (N parts) belong to part
    ``seg`` (0: a_desc and b_desc themselves), at (off_a, off_b) of that part's operands."""
    if seg == 0:
        acc = _accumulate(a_desc, b_desc, acc, off_a, off_b, 0, k_tiles, A_T, B_T, BLOCK_K, IEEE)
    for p in tl.static_range(len(MPARTS) + len(NPARTS)):
        if seg == p + 1:
            a_p = ops[MPARTS[p]] if len(MPARTS) > 0 else a_desc
            b_p = ops[NPARTS[p]] if len(NPARTS) > 0 else b_desc
            acc = _accumulate(a_p, b_p, acc, off_a, off_b, 0, k_tiles, A_T, B_T, BLOCK_K, IEEE)
    return acc


@triton.jit
def _accumulate_pair(a_desc, b_desc, b2_desc, acc, acc2, off_am, off_bn, k_tiles, A_T, B_T, BLOCK_K, IEEE):
    """acc += A @ B^T and acc2 += A @ B2^T over all K blocks, one A tile for both (a
    program with a PairedWeight, e.g. SwiGLU's gate and up)."""
    for ki in range(0, k_tiles):
        off_k = ki * BLOCK_K
        if A_T:
            a = a_desc.load([off_k, off_am]).T
        else:
            a = a_desc.load([off_am, off_k])
        if B_T:
            b = b_desc.load([off_k, off_bn])
            b2 = b2_desc.load([off_k, off_bn])
        else:
            b = b_desc.load([off_bn, off_k]).T
            b2 = b2_desc.load([off_bn, off_k]).T
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
            acc2 = tl.dot(a, b2, acc2, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
            acc2 = tl.dot(a, b2, acc2)
    return acc, acc2


@triton.jit
def _load_tiles(ops, IN_KINDS: tl.constexpr, off_m, off_n):
    """The sub-tile of every non-seeding tile input, as fp32 (0 for other inputs)."""
    tiles = ()
    for i in tl.static_range(len(IN_KINDS)):
        if IN_KINDS[i][0] == E.K_TILE:
            tiles = tiles + (ops[IN_KINDS[i][1]].load([off_m, off_n]).to(tl.float32),)
        else:
            tiles = tiles + (0,)
    return tiles


@triton.jit
def _store_tiles(res, ops, OUT_KINDS: tl.constexpr, off_m, off_n, OUT_PARTS: tl.constexpr, seg, start_m,
                 start_n):  # fmt: skip
    """Each tile output's sub-tile at (off_m, off_n); with M or N parts (OUT_PARTS), into
    the tensor of the tile's part ``seg``, at its own (off_m - start_m, off_n - start_n)."""
    for o in tl.static_range(len(OUT_KINDS)):
        desc = ops[OUT_KINDS[o][1]]
        if OUT_KINDS[o][0] == E.K_TILE:
            if len(OUT_PARTS) == 0:
                desc.store([off_m, off_n], res[o].to(desc.dtype))
            else:
                if seg == 0:
                    desc.store([off_m, off_n], res[o].to(desc.dtype))
                for p in tl.static_range(len(OUT_PARTS[o])):
                    if seg == p + 1:
                        part = ops[OUT_PARTS[o][p]]
                        part.store([off_m - start_m, off_n - start_n], res[o].to(part.dtype))
        elif OUT_KINDS[o][0] == E.K_HALF_TILE:
            desc.store([off_m, off_n // 2], res[o].to(desc.dtype))


@triton.jit
def _epilogue(src, off_m, off_n, M, N, ops, BODY: tl.constexpr, IN_KINDS: tl.constexpr,
              OUT_KINDS: tl.constexpr, ELEM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              EPI_SPLIT: tl.constexpr, FROM_PARTIALS: tl.constexpr = False,
              PAIRED: tl.constexpr = False, OUT_PARTS: tl.constexpr = None, seg=0, start_m=0,
              start_n=0):  # fmt: skip
    """Run the program over the tile's EPI_SPLIT column sub-tiles.

    ``src`` is the fp32 accumulator tile, or, with FROM_PARTIALS (a split tail
    tile), ``(ws_ptr, slot, n_parts)``: each sub-tile is then the sum of the
    tile's n_parts partials, added in part order (so the result does not depend
    on which part finished last) and read one sub-tile at a time. With PAIRED,
    ``src`` is the pair of accumulators and so is each sub-tile the body gets."""
    SUB_N: tl.constexpr = BLOCK_N // EPI_SPLIT
    if PAIRED:
        blocks = E.column_blocks(src[0], EPI_SPLIT)
        blocks2 = E.column_blocks(src[1], EPI_SPLIT)
    elif not FROM_PARTIALS:
        blocks = E.column_blocks(src, EPI_SPLIT)
    rows = off_m + tl.arange(0, BLOCK_M)
    for j in tl.static_range(EPI_SPLIT):
        if PAIRED:
            acc = (blocks[j], blocks2[j])
        elif FROM_PARTIALS:
            acc = _sum_partials(src, j, BLOCK_M, BLOCK_N, SUB_N)
        else:
            acc = blocks[j]
        sub_n = off_n + j * SUB_N
        cols = sub_n + tl.arange(0, SUB_N)
        tiles = _load_tiles(ops, IN_KINDS, off_m, sub_n)
        vals = E.body_inputs(ops, tiles, IN_KINDS, rows, cols, M, N, ELEM)
        res = E.call_body(BODY, acc, vals, len(OUT_KINDS))
        # reductions first: they shrink their values to vectors before the tile stores
        E.store_reductions(res, ops, OUT_KINDS, rows, cols, M, N, sub_n // SUB_N, tl.cdiv(N, SUB_N),
                           off_m // BLOCK_M)  # fmt: skip
        _store_tiles(res, ops, OUT_KINDS, off_m, sub_n, OUT_PARTS, seg, start_m, start_n)


@triton.jit
def _partial_offsets(slot, j, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    # workspace slot = one [BLOCK_M, BLOCK_N] fp32 tile, row-major; this is its
    # column block j of width WIDTH (so partials can be written and read back in
    # blocks of different widths)
    inner = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + (j * WIDTH + tl.arange(0, WIDTH))[None, :]
    return slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + inner


@triton.jit
def _store_partial(acc, ws_ptr, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # in quarters whatever the program's split: each block passes through a
    # layout conversion on its way to memory, and quarters keep that conversion's
    # registers small (halves spill in register-tight programs)
    blocks = E.column_blocks(acc, 4)
    for j in tl.static_range(4):
        tl.store(ws_ptr + _partial_offsets(slot, j, BLOCK_M, BLOCK_N, BLOCK_N // 4), blocks[j])


@triton.jit
def _sum_partials(partials, j, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    """Sub-tile j (WIDTH columns) of a split tile: its partials summed in part order."""
    ws_ptr, slot, n_parts = partials
    offs = _partial_offsets(slot, j, BLOCK_M, BLOCK_N, WIDTH)
    acc = tl.load(ws_ptr + offs, cache_modifier=".cg")
    for p in range(1, n_parts):
        acc += tl.load(ws_ptr + offs + p * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
    return acc


@triton.jit
def gemm_kernel(
    a_desc, b_desc, M, N, K,
    o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11,
    ws_ptr, counts_ptr, tail_splits,
    NUM_OPS: tl.constexpr, SEED: tl.constexpr, PAIR: tl.constexpr, KPARTS: tl.constexpr, NPARTS: tl.constexpr,
    MPARTS: tl.constexpr, OUT_PARTS: tl.constexpr, BODY: tl.constexpr, IN_KINDS: tl.constexpr,
    OUT_KINDS: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EPI_SPLIT: tl.constexpr,
    NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, IEEE: tl.constexpr,
    TAIL_SPLIT: tl.constexpr, TAIL_ONLY: tl.constexpr, MAIN_ONLY: tl.constexpr,
):  # fmt: skip
    ops = E.pack_operands(o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, NUM_OPS)
    ELEM: tl.constexpr = a_desc.dtype
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    # tail_splits > 1 (host-chosen, only with TAIL_SPLIT): the last num_tiles % NUM_SMS
    # tiles are split along K instead of run whole
    tail = num_tiles * 0
    if TAIL_SPLIT > 1:
        if tail_splits > 1:
            tail = num_tiles % NUM_SMS
    main_tiles = num_tiles - tail
    # TAIL_ONLY: the tail alone (the ping-pong mainloop ran the main tiles; NUM_SMS is its
    # grid, this launch's is tail * tail_splits)
    main_end = main_tiles
    if TAIL_ONLY:
        main_end = 0
    # a separate counter for the epilogue lets the compiler pipeline the next
    # tile's loads across this tile's epilogue when the loops are flattened
    tile_id_c = start_pid - NUM_SMS

    for tile_id in tl.range(start_pid, main_end, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_am = pid_m * BLOCK_M
        off_bn = pid_n * BLOCK_N
        if PAIR >= 0:
            # two products of one A tile: acc = A @ B^T, acc2 = A @ B2^T (the paired weight)
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = _accumulate_pair(a_desc, b_desc, ops[PAIR], zero, zero, off_am, off_bn, k_tiles, A_T, B_T,
                                   BLOCK_K, IEEE)  # fmt: skip
        else:
            if SEED >= 0:
                # C = seed + A @ B^T: the seeding tile (e.g. a residual) starts the accumulator
                acc = ops[SEED].load([off_am, off_bn]).to(tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if len(MPARTS) + len(NPARTS) > 0:  # the tile's rows (columns) are one part's
                seg, start_m, start_n = E.part_of(off_am, off_bn, M, N, ops, MPARTS, NPARTS, A_T, B_T)
                acc = _accumulate_mn_part(a_desc, b_desc, ops, MPARTS, NPARTS, seg, acc, off_am - start_m,
                                          off_bn - start_n, k_tiles, A_T, B_T, BLOCK_K, IEEE)  # fmt: skip
            else:
                acc = _accumulate(a_desc, b_desc, acc, off_am, off_bn, 0, k_tiles, A_T, B_T, BLOCK_K, IEEE)
            if len(KPARTS) > 0:  # more products summed in (K parts: no tail split)
                acc = _accumulate_parts(ops, KPARTS, acc, off_am, off_bn, A_T, B_T, BLOCK_K, IEEE)

        tile_id_c += NUM_SMS
        pid_m, pid_n = tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_m = (pid_m * BLOCK_M).to(tl.int32)
        off_n = (pid_n * BLOCK_N).to(tl.int32)
        seg, start_m, start_n = E.part_of(off_m, off_n, M, N, ops, MPARTS, NPARTS, A_T, B_T)
        _epilogue(acc, off_m, off_n, M, N, ops, BODY, IN_KINDS, OUT_KINDS, ELEM, BLOCK_M, BLOCK_N, EPI_SPLIT,
                  PAIRED=PAIR >= 0, OUT_PARTS=OUT_PARTS, seg=seg, start_m=start_m,
                  start_n=start_n)  # fmt: skip

    if TAIL_SPLIT > 1 and not MAIN_ONLY:
        if start_pid < tail * tail_splits:
            t = start_pid // tail_splits  # which tail tile
            part = start_pid % tail_splits  # which K range of it
            pid_m, pid_n = tile_coords(main_tiles + t, num_pid_m, num_pid_n, GROUP_M)
            off_m = (pid_m * BLOCK_M).to(tl.int32)
            off_n = (pid_n * BLOCK_N).to(tl.int32)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            k_all = k_tiles
            if len(KPARTS) > 0:  # (with CODETTA_TAIL_LAUNCH: the parts' K split with the rest)
                k_all += E.part_k_blocks(ops, KPARTS, A_T, BLOCK_K)
            k_lo = part * k_all // tail_splits
            k_hi = (part + 1) * k_all // tail_splits
            acc = _accumulate_span(a_desc, b_desc, ops, KPARTS, acc, off_m, off_n, k_lo, k_hi, k_tiles, A_T,
                                   B_T, BLOCK_K, IEEE)  # fmt: skip
            if SEED >= 0:
                # the seeding tile joins part 0's partial after its products: seeded before
                # them (a select of the accumulator's start by part), ptxas serialized the
                # wgmma of every seeded program's tail-split kernel (C7515, NOTES.md)
                if part == 0:
                    acc += ops[SEED].load([off_m, off_n]).to(tl.float32)
            # every part stores its partial; the part that arrives last (the
            # counter's old value says so) sums them in part order and runs the program
            slot = t * tail_splits
            _store_partial(acc, ws_ptr, slot + part, BLOCK_M, BLOCK_N)
            tl.debug_barrier()  # all of this program's partial is written before the release
            arrived = tl.atomic_add(counts_ptr + t, 1, sem="acq_rel", scope="gpu")
            if arrived == tail_splits - 1:
                tl.store(counts_ptr + t, 0)  # ready for the next launch
                _epilogue(
                    (ws_ptr, slot, tail_splits), off_m, off_n, M, N, ops, BODY, IN_KINDS, OUT_KINDS,
                    ELEM, BLOCK_M, BLOCK_N, EPI_SPLIT, FROM_PARTIALS=True, OUT_PARTS=OUT_PARTS,
                )  # fmt: skip

"""Cross-entropy over a linear layer's output (the LM head): the logits GEMM's epilogue
program and the row pass that turns a stored logits chunk into its gradient in place.

The logits GEMM stores a bounded chunk of rows of logits in the GEMM's dtype and,
from the fp32 accumulator, each row's log-sum-exp, no fp32 [M, V] logits anywhere (the
target logit is gathered from the stored chunk, ``pick_stored``, for both programs).
The row pass then writes (softmax - onehot) * scale over
the chunk, which the dX and dW GEMMs consume.
"""

import torch
import triton
import triton.language as tl

from ..kernels import device, precompile
from ..kernels import primitives as P
from ..kernels.configs import (
    BACKWARD_CANDIDATES,
    PINGPONG_CANDIDATES,
    PINGPONG_F32_RING_CANDIDATES,
    PINGPONG_HEAVY_CANDIDATES,
    PINGPONG_STREAMING_CANDIDATES,
    PLAIN_CANDIDATES,
    config_grid,
    with_row_groups,
)
from ..kernels.program import DType, PerCol, PerRow, Program, RowLogSumExp, RowSum, RowTable, Scalar, Tile
from .basic import FINISH_F32
from .norm_rows import torch_path, traced


@triton.jit
def ce_logits(acc, elem):
    """l = acc rounded to the GEMM's dtype (stored); lse[m] = log sum_n exp(l), split as
    (hi, lo) (``RowLogSumExp(split=True)``). The statistics are those of the stored
    logits, so the gradient pass's exp((l - hi) - lo) sums to one over the row (as
    PyTorch's own chain on logits in that dtype). The target
    logit is read back from the stored chunk (``pick_stored``): the same rounded value,
    without a RowPick here (with one, the GEMM took twice as long, run 47, NOTES.md).
    (``P.rounded``: in fp16 ptxas serialized this GEMM's wgmma without its guard, run 216.)"""
    logit = P.rounded(acc, elem)
    return logit, logit


def _pick(acc, target):
    valid = (target >= 0) & (target < acc.shape[1])
    got = acc.gather(1, target.clamp(0, acc.shape[1] - 1).long()[:, None])[:, 0]
    # (a Python zero: a CPU tensor here is copied to the GPU by a blocking copy, which
    # stopped the host twice per step until the GPU caught up, NOTES.md)
    return torch.where(valid, got, 0.0)


CE_LOGITS = Program(
    "ce_logits",
    ce_logits,
    inputs=(DType("elem"),),
    outputs=(Tile("logits"), RowLogSumExp("lse", split=True)),
    reference=lambda acc, elem: _lse_reference(acc.to(elem).to(acc.dtype)),
    # (the portable mainloop's 128x256 and 256x128 tiles at quarter sub-tiles too: cuBLAS
    # runs these GEMMs on 256x128 / 320x128 tiles, and on an H100 the ping-pong 128x128 pick
    # was 1.10-1.26x its time, runs 238-239; none spills on sm_90a, 168-211 registers; not
    # e2 flattened, the rule's pick for a vocabulary-wide store: a tuned pick only)
    configs=tuple(BACKWARD_CANDIDATES)
    + tuple(c for c in PLAIN_CANDIDATES if c.occupancy == 2)
    + tuple(config_grid(((128, 256, 3, 8), (128, 256, 4, 8), (256, 128, 3, 8)), (4,), (False,))),
    # (the held-tiles rule's candidates, e1 and e2) at raster row groups of 8 and 4: the LM
    # head's chunks are few row-tiles by many column-tiles (configs.with_row_groups)
    pingpong_configs=with_row_groups(PINGPONG_CANDIDATES),
)


def _lse_reference(logit):
    return {"logits": logit, "lse": logit.double().logsumexp(1)}  # (split by the launcher)


@triton.jit
def ce_logits_scaled(acc, scale, elem):
    """CE_LOGITS for logits with a row scale, l = scale[m] * a: a = acc rounded to the GEMM's
    dtype is what is stored, l is formed from it in float32 (one product, which the gradient
    pass forms again from the stored a, to the bit) and lse[m] = log sum_n exp(l). With K1's
    h = x * gamma as the GEMM's input and the final RMSNorm's rstd as the scale, the
    norm's output n = h * rstd is never formed (``linear_cross_entropy(row_scale=)``)."""
    raw = P.rounded(acc, elem)
    return raw, raw * scale


def _scaled_reference(acc, scale, elem):
    raw = acc.to(elem).to(acc.dtype)
    return {"logits": raw, "lse": (raw * scale.to(acc.dtype)[:, None]).double().logsumexp(1)}


CE_LOGITS_SCALED = Program(
    "ce_logits_scaled",
    ce_logits_scaled,
    inputs=(PerRow("scale"), DType("elem")),
    outputs=(Tile("logits"), RowLogSumExp("lse", split=True)),
    reference=_scaled_reference,
    configs=CE_LOGITS.configs,
    # the stored values and their products held at once spilled 80 B on the ping-pong
    # mainloop at a whole 128x128 sub-tile (bf16, sm_90a check) with the reductions first;
    # with the tile stored first, no sub-tile spills: CE_LOGITS's candidates (e1, e2) and the
    # quarters (e4, the H200's 1B-width pick, run 223), each at row groups 8 and 4
    stores_first=True,
    pingpong_configs=with_row_groups(PINGPONG_CANDIDATES + PINGPONG_HEAVY_CANDIDATES),
    # the same tiles and mainloop with one product more an element: CE_LOGITS's picks (the
    # nearest of them among these candidates)
    tuned_like=CE_LOGITS,
)


def pick_stored(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """fp32 [M]: logits[m, target[m]] of a stored chunk, 0 where the target is not in
    [0, V) (an ignored or bad row): the references' own pick."""
    return _pick(logits, target).float()


@triton.jit
def ce_logits_ext(acc, bias, softcap, elem):
    """CE_LOGITS with a bias and logit soft-capping: l = (acc + bias[n]) rounded to the
    GEMM's dtype (stored, before the cap); the log-sum-exp is that of the capped logits
    c = softcap * tanh(l / softcap) (softcap 0: c = l). The target's c is formed from
    the stored l (``pick_stored`` then ``cap``), as for CE_LOGITS."""
    logit = (acc + bias).to(elem.dtype).to(tl.float32)
    capped = logit
    if softcap > 0.0:
        capped = softcap * P.tanh(logit / softcap)
    return logit, capped


def cap(logit, softcap: float):
    """The soft-capped logits (the PyTorch formulation: softcap * tanh(l / softcap))."""
    return softcap * torch.tanh(logit / softcap) if softcap > 0 else logit


CAP_BLOCK = 1024


@triton.jit
def _cap_kernel(x_ptr, out_ptr, n, softcap, BLOCK: tl.constexpr):
    """out = softcap tanh(x / softcap) by ``P.tanh``: CE_LOGITS_EXT's cap, the same ops."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, softcap * P.tanh(x / softcap), mask=mask)


def cap_rows(picked: torch.Tensor, softcap: float, dtype: torch.dtype) -> torch.Tensor:
    """``cap`` of the rows' target logits (float32 [M], from a chunk stored in ``dtype``)
    as the kernels cap the chunk (``P.tanh``: CE_LOGITS_EXT's log-sum-exp, the gradient
    pass): with ``torch.tanh`` against their log-sum-exp, ~2 % of targets were an ulp off,
    a confident row's loss 5-8x past PyTorch's error in float32 (found by review); in
    PyTorch where the row passes run there (``torch_path``: the references cap so too)."""
    if softcap <= 0:
        return picked
    if torch_path(picked, dtype) or picked.numel() == 0:
        return cap(picked, softcap)
    x = picked.float().contiguous()
    out = torch.empty_like(x)
    with device.on_device(x.device):
        grid = (triton.cdiv(x.numel(), CAP_BLOCK),)
        precompile.launch(_cap_kernel, grid, x, out, x.numel(), float(softcap), BLOCK=CAP_BLOCK, num_warps=4)
    return out


def _ext_reference(acc, bias, softcap, elem):
    logit = (acc + bias.to(acc.dtype)).to(elem).to(acc.dtype)
    return {"logits": logit, "lse": cap(logit, float(softcap)).double().logsumexp(1)}


CE_LOGITS_EXT = Program(
    "ce_logits_ext",
    ce_logits_ext,
    inputs=(PerCol("bias"), Scalar("softcap"), DType("elem")),
    outputs=(Tile("logits"), RowLogSumExp("lse", split=True)),
    reference=_ext_reference,
    configs=CE_LOGITS.configs,
    # the logits and their capped values (tanh's temporaries) held at once: a whole
    # 128x128 sub-tile spills on the ping-pong mainloop (sm_90a check), halves do not
    pingpong_configs=with_row_groups(PINGPONG_STREAMING_CANDIDATES),
)


@triton.jit
def ce_probs(acc, ref, elem):
    """q = exp(acc - ref[m]) for a per-row reference chosen before the GEMM (stored in the
    GEMM's dtype) and qsum[m] = sum_n q (from the float32 values): the row's probabilities
    are q / qsum, a row factor, so the loss needs no gradient pass over the stored chunk
    (``CODETTA_CE_PROBS``, experimental: ``ops/cross_entropy.py``, ``_probs_chunk``). The
    reference keeps q inside bf16's and float32's range when it is within ~75 nats below
    the row's largest logit and not far above it; the caller checks qsum. q is summed as
    stored (rounded to the GEMM's dtype), so that p = q / qsum sums to one over the row:
    p[t] - 1 of a confident row is then as exact as the rest (from an unrounded sum, bf16's
    2^-8 relative error of q[t] swamped it, 4x off at p[t] 0.9992)."""
    q = P.rounded(tl.exp(acc - ref), elem)
    return q, q


def _probs_reference(acc, ref, elem):
    q = torch.exp(acc - ref.to(acc.dtype)[:, None]).to(elem).to(acc.dtype)
    return {"q": q, "qsum": q.sum(1)}


CE_PROBS = Program(
    "ce_probs",
    ce_probs,
    inputs=(PerRow("ref"), DType("elem")),
    outputs=(Tile("q"), RowSum("qsum")),
    reference=_probs_reference,
    configs=CE_LOGITS.configs,
    pingpong_configs=with_row_groups(PINGPONG_CANDIDATES),
    # (the same tiles and one exp an element, as the logits' log-sum-exp: their picks)
    tuned_like=CE_LOGITS,
)


@triton.jit
def ce_probs_scaled(acc, scale, ref, elem):
    """CE_PROBS for logits with a row scale, l = scale[m] * acc (CE_LOGITS_SCALED's): q =
    exp(l - ref[m]) stored (rounded, summed as stored), qsum[m] = sum_n q and qa[m] =
    sum_n q acc (what the scale's gradient needs: sum_n p a = qa / qsum)."""
    q = P.rounded(tl.exp(acc * scale - ref), elem)
    return q, q, q * acc


def _probs_scaled_reference(acc, scale, ref, elem):
    q = torch.exp(acc * scale.to(acc.dtype)[:, None] - ref.to(acc.dtype)[:, None]).to(elem).to(acc.dtype)
    return {"q": q, "qsum": q.sum(1), "qa": (q * acc).sum(1)}


CE_PROBS_SCALED = Program(
    "ce_probs_scaled",
    ce_probs_scaled,
    inputs=(PerRow("scale"), PerRow("ref"), DType("elem")),
    outputs=(Tile("q"), RowSum("qsum"), RowSum("qa")),
    reference=_probs_scaled_reference,
    configs=CE_LOGITS.configs,
    stores_first=True,  # (CE_LOGITS_SCALED's reason: the stored tile and its products held at once)
    # (its whole sub-tile, e1, spills 328 B on sm_90a even stored first: two row sums held)
    pingpong_configs=with_row_groups(PINGPONG_STREAMING_CANDIDATES),
    tuned_like=CE_LOGITS,
)


@triton.jit
def ce_probs_dx(acc, s, g, wt):
    """The loss's dX rows from CE_PROBS' q: acc = (q @ W)[m], s[m] = g[m] / qsum[m] (the
    probabilities' row factor at the row's gradient scale g, 0 for an ignored row), wt =
    W[target[m]] (the target's row; any row for an ignored one, g being 0): s acc - g wt,
    rounded once."""
    return acc * s - g * wt


CE_PROBS_DX = Program(
    "ce_probs_dx",
    ce_probs_dx,
    inputs=(PerRow("s"), PerRow("g"), Tile("wt")),
    outputs=(Tile("dx"),),
    reference=lambda acc, s, g, wt: {"dx": acc * s.to(acc.dtype)[:, None] - g.to(acc.dtype)[:, None] * wt},
    # (one tile streamed in, one out: the streaming candidates, 128x256 tiles among them, as
    # the stored-logits path's plain dX GEMM picks on both GPUs; the backward's 128x128
    # candidates alone before the thirty-first session, untimed then: NOTES.md)
    layouts=((False, True),),
)


@triton.jit
def ce_probs_dw(acc, slot, corr):
    """The loss's dW from CE_PROBS' q when the call is one chunk: acc = (q^T (s x))[v] (the
    probabilities' term of class v's row), corr = the row of the target rows' float32 sums that
    class v's ``slot`` names (- sum of g x over the rows whose target is v, formed as (sum
    q) (s x) from the rows acc reads; zeros for a class no row targets, slot -1): their sum
    rounded once, no float32 [V, d] sum held."""
    return acc + corr


def _probs_dw_reference(acc, slot, corr):
    has = (slot >= 0)[:, None]
    rows = corr.float()[slot.long().clamp(min=0)].repeat(1, acc.shape[1] // corr.shape[1])
    return {"dw": acc + torch.where(has, rows, 0.0)}


CE_PROBS_DW = Program(
    "ce_probs_dw",
    ce_probs_dw,
    inputs=(PerRow("slot", index=True), RowTable("corr", index="slot")),
    outputs=(Tile("dw"),),
    reference=_probs_dw_reference,
    # (the same GEMM as FINISH_F32's, a sparse table read for its float32 seed tile: its
    # candidates, and its picks until its own keys are tuned)
    configs=FINISH_F32.configs,
    pingpong_configs=PINGPONG_F32_RING_CANDIDATES,
    layouts=FINISH_F32.layouts,
    tuned_like=FINISH_F32,
)


# The gradient pass's launch: one program a row, 4096 columns a step over 16 warps. Against
# 1024 over 4 (the launch before): 0.962-0.997 of its time at V 32768-262144 on an H100,
# plain and with the row scale, under paired and sustained-block timing alike (run 226),
# and on an H200 0.92-0.98 plain (V 32768-262144) and 0.96-0.99 row-scaled (V 65536-262144),
# both timings (run 232; 1.02 row-scaled at V 32768; the same bits: the pass is elementwise,
# its row sums' (dr, and the sum of w c) order aside)
GRAD_BLOCK, GRAD_WARPS = 4096, 16


@triton.jit
def _ce_grad_kernel(l_ptr, lse_ptr, t_ptr, s_ptr, a_ptr, b_ptr, w_ptr, sum_ptr, r_ptr, dr_ptr, smooth,
                    softcap, V, stride, lse_stride, HAS_COEF: tl.constexpr, HAS_W: tl.constexpr,
                    SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, WRITE: tl.constexpr, SUM: tl.constexpr,
                    ROWSCALE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)  # the row's log-sum-exp as hi + lo (RowLogSumExp(split=True))
    lse_lo = tl.load(lse_ptr + lse_stride + row)
    scale = tl.load(s_ptr + row)
    target = tl.load(t_ptr + row).to(tl.int64)
    a = 1.0
    b = 1.0
    if HAS_COEF:
        a = tl.load(a_ptr + row)
        b = tl.load(b_ptr + row)
    r = 1.0
    row_scale = scale
    if ROWSCALE:  # stored: the unscaled a; the logits l = r a (CE_LOGITS_SCALED's product)
        r = tl.load(r_ptr + row)
        row_scale = scale * r  # (what the written gradient carries: x's and W's GEMMs run on h)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    dr = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        stored = tl.load(l_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        logit = stored
        if ROWSCALE:
            logit = stored * r
        c = logit
        if SOFTCAP:
            c = softcap * P.tanh(logit / softcap)
        wc = 1.0
        if HAS_W:
            wc = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if SUM:
            total += tl.where(mask, wc * c, 0.0)
        if WRITE:
            # (c - hi is exact where p is large: p carries lo's error, not one ulp of hi)
            g = a * tl.exp((c - lse) - lse_lo) - b * tl.where(cols == target, 1.0, 0.0)
            if SMOOTH:
                g -= smooth * wc
            if SOFTCAP:
                t = c / softcap
                g = g * (1.0 - t * t)
            if ROWSCALE:  # d loss / d r = sum_n g a (the scale's gradient, before the row's scale)
                dr += tl.where(mask, g * stored, 0.0)
            tl.store(l_ptr + row * stride + cols, (g * row_scale).to(l_ptr.dtype.element_ty), mask=mask)
    if SUM:
        tl.store(sum_ptr + row, tl.sum(total, axis=0))
    if ROWSCALE and WRITE:
        tl.store(dr_ptr + row, tl.sum(dr, axis=0) * scale)


def ce_grad_(logits, lse, target, scale, a=None, b=None, weight=None, smooth=0.0, softcap=0.0,
             write=True, want_sum=False, row_scale=None):  # fmt: skip
    """The cross-entropy gradient over stored logits l, in place, in fp32 with one
    rounding: with c = softcap * tanh(l / softcap) (softcap 0: c = l), lse the rows' fp32
    [2, M] (hi, lo) log-sum-exps (the CE programs' split ``lse``) and p = exp((c - hi) - lo),

        l[m, n] <- (a[m] p - b[m] [n == target[m]] - smooth w[n]) * dc/dl * scale[m]

    (a = b = 1 and w = 1 when not given; a target outside [0, V) subtracts nothing).
    Returns (sums, dr): sum_n w[n] c[m, n] per row (fp32 [M]) with ``want_sum``, else None;
    ``write=False`` leaves the logits as they are. ``row_scale`` (fp32 [M], r): the stored
    values s are CE_LOGITS_SCALED's unscaled products and l = r s; the written gradient is
    then also times r[m] (so that dX and dW, GEMMs on the unscaled input, are its
    gradients), and dr (fp32 [M], with ``write``) is scale[m] sum_n g[m, n] s[m, n], g the
    bracket above times dc/dl (the loss's gradient with respect to r); else None."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a row-contiguous [M, V] tensor, got strides {logits.stride()}")
    M, V = logits.shape
    if lse.shape != (2, M) or lse.stride(1) != 1:
        raise ValueError(f"lse must be the rows' [2, M] (hi, lo) log-sum-exps, M {M}, got {tuple(lse.shape)}")
    sums = torch.empty(M, dtype=torch.float32, device=logits.device) if want_sum else None
    scaled = write and row_scale is not None
    dr = torch.empty(M, dtype=torch.float32, device=logits.device) if scaled else None
    if M == 0:
        return sums, dr
    if torch_path(logits):
        stored = logits.float()
        c = cap(stored if row_scale is None else stored * row_scale.float()[:, None], softcap)
        w = torch.ones(V, device=logits.device) if weight is None else weight.float()
        if want_sum:
            sums.copy_((c * w).sum(1))
        if write:
            g = torch.exp((c - lse[0].float()[:, None]) - lse[1].float()[:, None])
            if a is not None:
                g = g * a.float()[:, None]
            valid = (target >= 0) & (target < V)
            rows = torch.arange(M, device=logits.device)[valid]
            g[rows, target[valid].long()] -= 1.0 if b is None else b.float()[valid]
            if smooth:
                g = g - smooth * w
            if softcap > 0:
                g = g * (1 - (c / softcap) ** 2)
            row = scale.float()
            if dr is not None:
                dr.copy_((g * stored).sum(1) * row)
                row = row * row_scale.float()
            logits.copy_(g * row[:, None])
        return sums, dr
    coef = a is not None
    with device.on_device(logits.device):
        precompile.launch(_ce_grad_kernel, (M,),
            logits, lse, target, scale, a if coef else scale, b if coef else scale,
            scale if weight is None else weight, scale if sums is None else sums,
            scale if row_scale is None else row_scale, scale if dr is None else dr, float(smooth),
            float(softcap), V, logits.stride(0), lse.stride(0), HAS_COEF=coef, HAS_W=weight is not None,
            SOFTCAP=softcap > 0, SMOOTH=bool(smooth), WRITE=write, SUM=want_sum,
            ROWSCALE=row_scale is not None, BLOCK=GRAD_BLOCK, num_warps=GRAD_WARPS,
        )  # fmt: skip
    return sums, dr


TARGET_ROWS_BLOCK = 1024  # (columns of dW a program sums: d 4096 in 4 programs a target)
TARGET_ROWS_STEP = 8  # (rows of a segment whose loads a program issues together)


@triton.jit
def _target_rows_kernel(x_ptr, alt_ptr, pick_ptr, g_ptr, order_ptr, keys_ptr, dw_ptr, slot_ptr, R, d, V, row0,
                        key0, x_stride, alt_stride, dw_stride, BLOCK: tl.constexpr, STEP: tl.constexpr,
                        TABLE: tl.constexpr, ALT: tl.constexpr):  # fmt: skip
    """dw[t] -= sum of g[m] x[m] over the rows m whose target is t: the rows sorted by key
    (``order``, their keys ``keys``: key0 + the target, key0 + V for a row without one, which
    is skipped; row m is x's row order - row0); the program of a segment's last row sums it,
    backwards, one row after another (its loads STEP rows at a time), and writes its
    target's row of dw; every other program returns. ``TABLE``: dw is an [R, d] table
    instead, the segment ending at sorted row i writes - its sum into row i and i into
    slot[t]. ``ALT``: a row m with pick[m] set takes alt[m] instead of x[m] (each row's
    vector read from one of the two)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    key = tl.load(keys_ptr + i)
    after = tl.load(keys_ptr + i + 1, mask=i + 1 < R, other=-1)
    t = key - key0
    if (after != key) & (t < V):  # (the segment's last row, a target's)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        j = i
        more = i >= 0
        while more:
            for k in tl.static_range(STEP):
                inside = j - k >= 0
                same = tl.load(keys_ptr + j - k, mask=inside, other=-1) == key
                row = tl.load(order_ptr + j - k, mask=same, other=row0).to(tl.int64) - row0
                gk = tl.load(g_ptr + row, mask=same, other=0.0)
                if ALT:
                    pk = tl.load(pick_ptr + row, mask=same, other=0) != 0
                    yk = tl.load(alt_ptr + row * alt_stride + cols, mask=mask & same & pk, other=0.0)
                    xk = tl.load(x_ptr + row * x_stride + cols, mask=mask & same & ~pk, other=0.0)
                    xk = tl.where(pk, yk, xk).to(tl.float32)
                else:
                    xk = tl.load(x_ptr + row * x_stride + cols, mask=mask & same, other=0.0).to(tl.float32)
                acc += gk * xk  # (the rows in order; + 0 past the segment: the bits of one at a time)
                if k == STEP - 1:
                    more = same
            j -= STEP
        if TABLE:
            tl.store(dw_ptr + i.to(tl.int64) * dw_stride + cols, -acc, mask=mask)
            if tl.program_id(1) == 0:
                tl.store(slot_ptr + t, i)
        else:
            dst = dw_ptr + t.to(tl.int64) * dw_stride + cols
            tl.store(dst, tl.load(dst, mask=mask) - acc, mask=mask)


def sort_targets(target: torch.Tensor, V: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_rows_sub_``'s order, for every chunk of ``rows`` rows in one sort: the rows'
    indices sorted by key = c (V + 1) + the target (c: the row's chunk; V for a target
    outside [0, V), an ignored row's, which the sums skip) and the sorted keys. Chunk c's
    slice of both goes to its call, with row0 = its first row and key0 = c (V + 1)."""
    M = target.numel()
    chunks = -(-M // max(rows, 1))
    # (int32 keys where they fit: half the radix sort's passes of int64's)
    kind = torch.int32 if chunks * (V + 1) < 2**31 else torch.int64
    chunk = torch.arange(M, device=target.device, dtype=kind) // max(rows, 1)
    key = torch.where((target >= 0) & (target < V), target, V).to(kind) + chunk * (V + 1)
    order = torch.argsort(key, stable=True)
    return order, key[order]


def target_rows_sub_(dw: torch.Tensor, x: torch.Tensor, g: torch.Tensor, order: torch.Tensor,
                     keys: torch.Tensor, row0: int = 0, key0: int = 0, alt: tuple | None = None):  # fmt: skip
    """dw[t] -= g[m] x[m] for every row m of x with a target t in [0, V), in place (dw float32
    [V, d], x [M, d], g float32 [M]; ``order``, ``keys``: the chunk's slice of
    ``sort_targets``, with its row0 and key0): each target's rows summed in one order, by
    one program, no atomics: the same bits every run (the probabilities path's target term,
    ``ops/cross_entropy.py``). ``alt``: (y [M, d], pick bool [M]): row m's vector is y[m]
    where pick[m] is set, x[m] elsewhere."""
    _target_rows(dw, None, x, g, order, keys, dw.shape[0], row0, key0, alt)
    return dw


def target_rows_table(x: torch.Tensor, g: torch.Tensor, V: int, order: torch.Tensor, keys: torch.Tensor,
                      row0: int = 0, key0: int = 0, alt: tuple | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``target_rows_sub_``'s sums as a table for CE_PROBS_DW (a call of one chunk): slot
    (int32 [V], -1 for a class no row targets) and corr (float32 [M, d]: row slot[t] holds
    - sum of g x over the rows whose target is t; the rows no slot names unwritten)."""
    M, d = x.shape
    slot = torch.full((V,), -1, dtype=torch.int32, device=x.device)
    corr = torch.empty(M, d, dtype=torch.float32, device=x.device)
    _target_rows(corr, slot, x, g, order, keys, V, row0, key0, alt)
    return slot, corr


def _target_rows(dw, slot, x, g, order, keys, V: int, row0: int, key0: int, alt=None):
    """Each target's rows summed (``_target_rows_kernel``): subtracted from dw's row of the
    target, or, with ``slot``, written negated into dw's row i (the segment's last sorted
    row) and i into slot[target]; ``alt`` (y, pick): y's row where pick is set."""
    M, d = x.shape
    if M == 0:
        return
    if alt is not None:
        assert alt[0].shape == x.shape and alt[0].stride(1) == 1 and alt[1].shape == (M,), "target rows: alt"
    if torch_path(x):
        rel, ts = order - row0, keys - key0
        rows = x if alt is None else torch.where(alt[1][:, None], alt[0], x)
        contrib = g.float()[rel, None] * rows.float()[rel]
        ends = torch.ones(M, dtype=torch.bool, device=x.device)
        ends[:-1] = ts[1:] != ts[:-1]
        for i in torch.nonzero(ends & (ts < V)).flatten().tolist():  # (each segment summed backwards)
            j, acc = i, torch.zeros(d, dtype=torch.float32, device=x.device)
            while j >= 0 and ts[j] == ts[i]:
                acc += contrib[j]
                j -= 1
            if slot is None:
                dw[ts[i]] -= acc
            else:
                dw[i], slot[ts[i]] = -acc, i
        return
    with device.on_device(x.device):
        grid = (M, triton.cdiv(d, TARGET_ROWS_BLOCK))
        y, pick = (x, g) if alt is None else (alt[0], alt[1].view(torch.uint8))
        precompile.launch(_target_rows_kernel, grid, x, y, pick, g, order, keys, dw,
                          dw if slot is None else slot, M, d, V, row0, key0, x.stride(0), y.stride(0),
                          dw.stride(0), BLOCK=TARGET_ROWS_BLOCK, STEP=TARGET_ROWS_STEP,
                          TABLE=slot is not None, ALT=alt is not None, num_warps=4)  # fmt: skip


PROBS_ROWS_BLOCK = 1024  # (columns a step of the row loop: d 2048 in two)


@triton.jit
def _probs_rows_kernel(x_ptr, wt_ptr, s_ptr, at_ptr, xs_ptr, d, x_stride, wt_stride, xs_stride,
                       BLOCK: tl.constexpr):  # fmt: skip
    """One row m: at[m] = sum_k x[m, k] wt[m, k] (float32) and xs[m] = x[m] s[m] (rounded to
    xs' dtype), x and wt read once."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(s_ptr + row)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, d, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < d
        xv = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        acc += xv * tl.load(wt_ptr + row * wt_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(xs_ptr + row * xs_stride + cols, (xv * s).to(xs_ptr.dtype.element_ty), mask=mask)
    tl.store(at_ptr + row, tl.sum(acc, 0))


def probs_rows(x: torch.Tensor, wt: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(at, xs)`` for x and wt [M, d] (wt: each row's target row of W) and s float32 [M]:
    at = the rows' dot products x . wt in float32 [M] (the target's logit, as its GEMM
    forms it: bf16 products summed in float32) and xs = x s rounded to x's dtype [M, d] (the
    dW GEMM's rows on the probabilities path, ``ops/cross_entropy.py``). One pass: x and wt
    read once (as PyTorch ops, ~8 passes over [M, d] in float32: ~0.3 ms a 16384-token call
    at d 2048). The same bits every run (a fixed order)."""
    M, d = x.shape
    assert x.stride(1) == wt.stride(1) == 1 and s.is_contiguous(), "probs_rows: rows with unit column stride"
    if torch_path(x, wt.dtype) or M == 0:
        return (x.float() * wt.float()).sum(1), (x.float() * s[:, None]).to(x.dtype)
    at = torch.empty(M, dtype=torch.float32, device=x.device)
    xs = torch.empty_like(x)
    with device.on_device(x.device):
        precompile.launch(_probs_rows_kernel, (M,), x, wt, s, at, xs, d, x.stride(0), wt.stride(0),
                          xs.stride(0), BLOCK=PROBS_ROWS_BLOCK, num_warps=4)  # fmt: skip
    return at, xs


def row_pass_jobs() -> list[tuple]:
    """The gradient pass (``ce_grad_``) as the sm_90a check compiles it (``sm90_check.py``):
    (label, kernel, argument types, constexprs, warps), bf16 logits, its default launch,
    plain and with every option (coefficients, class weights, soft-cap, smoothing, the sum,
    a row scale)."""
    f32 = "*fp32"
    types = {"l_ptr": "*bf16", "lse_ptr": f32, "t_ptr": "*i64", "s_ptr": f32, "a_ptr": f32, "b_ptr": f32,
             "w_ptr": f32, "sum_ptr": f32, "r_ptr": f32, "dr_ptr": f32, "smooth": "fp32", "softcap": "fp32",
             "V": "i32", "stride": "i32", "lse_stride": "i32"}  # fmt: skip
    jobs = []
    for every in (False, True):
        consts = {k: every for k in ("HAS_COEF", "HAS_W", "SOFTCAP", "SMOOTH", "SUM", "ROWSCALE")}
        consts.update(WRITE=True, BLOCK=GRAD_BLOCK)
        label = f"ce_grad {'every option' if every else 'plain'}, {GRAD_WARPS} warps"
        jobs.append((label, _ce_grad_kernel, types, consts, GRAD_WARPS))
    i32 = "i32"
    for table, alt in ((False, False), (True, False), (False, True), (True, True)):
        types = {"x_ptr": "*bf16", "alt_ptr": "*bf16", "pick_ptr": "*u8" if alt else f32, "g_ptr": f32,
                 "order_ptr": "*i64", "keys_ptr": "*i32", "dw_ptr": f32, "slot_ptr": "*i32" if table else f32,
                 "R": i32, "d": i32, "V": i32, "row0": i32, "key0": i32, "x_stride": i32, "alt_stride": i32,
                 "dw_stride": i32}  # fmt: skip
        consts = {"BLOCK": TARGET_ROWS_BLOCK, "STEP": TARGET_ROWS_STEP, "TABLE": table, "ALT": alt}
        label = f"ce target rows{' (table)' if table else ''}{' (two inputs)' if alt else ''}"
        jobs.append((label, _target_rows_kernel, types, consts, 4))
    types = {"x_ptr": "*bf16", "wt_ptr": "*bf16", "s_ptr": f32, "at_ptr": f32, "xs_ptr": "*bf16", "d": "i32",
             "x_stride": "i32", "wt_stride": "i32", "xs_stride": "i32"}  # fmt: skip
    jobs.append(("ce probs rows", _probs_rows_kernel, types, {"BLOCK": PROBS_ROWS_BLOCK}, 4))
    types = {"x_ptr": f32, "out_ptr": f32, "n": "i32", "softcap": "fp32"}
    jobs.append(("ce cap rows", _cap_kernel, types, {"BLOCK": CAP_BLOCK}, 4))
    return jobs


@triton.jit
def _scale_blocks(src, s, dst, n, BLOCK: tl.constexpr):
    # dst = src * s over the blocks of this program, striding by the grid (fp32 math)
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(src + offs, mask=mask).to(tl.float32) * s
        tl.store(dst + offs, v.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(src, scale, dst, n, BLOCK: tl.constexpr, SKIP_ONE: tl.constexpr):
    # scale_cast (a block a program) and rescale_ (in place, a few programs a SM: one program
    # a block took 83 us at [128256, 4096] just to read a scale of 1, run 131)
    s = tl.load(scale)
    if SKIP_ONE:
        if s != 1.0:  # (the usual incoming gradient: each program reads 4 bytes and stops)
            _scale_blocks(src, s, dst, n, BLOCK)
    else:
        _scale_blocks(src, s, dst, n, BLOCK)


def rescale_(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t *= scale`` in place (fp32 math, rounded once), a contiguous floating tensor and
    a float32 0-dim tensor on its device, with no host synchronization: where scale is 1
    the kernel's programs read it and stop (the LM head's dW, rounded in the forward; the
    float32 scale-and-cast pass it replaces took 0.73 ms at V 128256, d 4096, run 129).
    The tensor's version counter is bumped either way, so a second backward through a
    graph that saved ``t`` is refused by PyTorch. Traced (torch.compile): out of place."""
    if not t.is_contiguous() or not t.is_floating_point():
        raise ValueError(f"t must be a contiguous floating tensor, got {t.dtype}, strides {t.stride()}")
    if traced(t):
        return (t.float() * scale).to(t.dtype)
    if torch_path(t):  # (CPU bf16 included)
        return t.copy_(t.float() * scale)
    n = t.numel()
    if n:
        with device.on_device(t.device):
            most = 8 * device.num_sms(t.device.index or 0) if t.device.type == "cuda" else 2
            programs = min(triton.cdiv(n, 4096), most)  # (the interpreter: 2, so that they stride)
            precompile.launch(_scale_kernel, (programs,), t, scale, t, n, BLOCK=4096, SKIP_ONE=True,
                              num_warps=8)  # fmt: skip
    torch.autograd.graph.increment_version(t)
    return t


def scale_cast(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * scale).to(dtype)`` in one pass: src a contiguous floating tensor, scale a
    float32 0-dim tensor on its device (the loss's incoming gradient), the product formed
    in float32 and rounded once. PyTorch's multiply by a float32 tensor into a narrower
    output takes its unvectorized mixed-dtype kernel: 1.17 ms for the Llama-3.2-1B LM
    head's float32 dW (run 59), ~1.3 TB/s over its 1.57 GB; 0.31 ms for a bf16 [16384,
    4096] dX (run 129)."""
    if not src.is_contiguous() or not src.is_floating_point():
        raise ValueError(f"src must be a contiguous floating tensor, got {src.dtype}, strides {src.stride()}")
    if traced(src):  # a backward traced under torch.compile: its own fused pass
        return (src.float() * scale).to(dtype)
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    if torch_path(src) or (src.device.type == "cpu" and dtype == torch.bfloat16):
        return out.copy_(src.float() * scale)
    n = src.numel()
    if n:
        with device.on_device(src.device):
            grid = (triton.cdiv(n, 4096),)
            precompile.launch(_scale_kernel, grid, src, scale, out, n, BLOCK=4096, SKIP_ONE=False,
                              num_warps=8)  # fmt: skip
    return out

"""Linear layer + cross-entropy (the LM head and its loss) without [M, V] logits in fp32.

    loss = cross_entropy(input @ linear_weight.T, target)       (reduction mean / sum / none)

Rows are processed in chunks whose logits fit a budget (the ``CODETTA_CE_CHUNK_MB``
setting, 1 GiB: at 16384 tokens and V = 128256, 4 chunks of 4096 rows). Per
chunk, one GEMM stores the chunk's logits in the input dtype and, from the same
rounded values, each row's log-sum-exp (``programs/ce.py``); the target logit is
read back from the stored chunk. For
``mean`` and ``sum`` the loss is the graph's last op, so the gradient is known up to
the incoming scalar: the chunk's logits become (softmax - onehot) * scale in place,
then dX = dlogits @ W (the chunk's rows) and dW += dlogits^T @ X (accumulated in fp32)
are computed right away, and the backward only scales them. ``none`` keeps the
per-row log-sum-exp and does the same work in the backward, with its per-row
gradient. Extra memory beyond the inputs and their gradients: one logits buffer
(<= the budget, reused by every chunk; rows padded to 16 bytes, so any V works) and
the fp32 dW accumulator (4 V d bytes: the first chunk's product stored by the
STORE_F32 epilogue, the middle ones' summed in place by ACCUMULATE_F32, the last one's
added by FINISH_F32, which rounds the sum once into the weight's dtype; for mean and sum
the backward then scales that in place where its incoming gradient is not 1, a second
rounding there, none for a power of 2, and a pass that does nothing on the device when it
is 1, the usual ``loss.backward()``; with tied embeddings, ``tied=``, dW stays float32
and the embedding's backward scales it, casts it and adds its own gradient in one pass,
``ops/tied_embedding.py``; in float16 the gradients are formed at a power-of-2 gain,
``ce_rows.gain``, so that a mean's small entries stay normal numbers, dW is summed in
float32 to the backward and the gain divided out there, exactly), plus O(M) row
statistics: at
V = 128256, d = 4096 that is 1 + 2 GiB, above issue 15's 512 MiB bar (the fp32
accumulator is the larger term). Each chunk reads and writes the whole fp32
accumulator (2 GiB of traffic at d = 4096): bigger chunks make fewer of those passes,
which is why the budget is 1 GiB and not less (NOTES.md).

The low-memory mode (``vocab_chunk``): the vocabulary goes in slices over all rows at
once. The forward computes each slice's logits into one [M, vocab_chunk] buffer with
their rows' log-sum-exp (the slices' combined at the end) and the target's logit; the
backward computes each slice's logits again, turns them into their gradient in place,
and forms that slice's dW with one GEMM over every row (rounded once, straight into
the weight's dtype) and dX += dlogits @ W_slice into a float32 [M, d] (the STORE_F32 /
ACCUMULATE_F32 epilogues). Four GEMMs instead of three; extra memory: the buffer and
the float32 dX (at M = 16384, d = 4096, V = 262144 with slices of 4096 classes: 128 +
256 MiB, where the default holds a 4 GiB float32 dW).

Options (``linear_cross_entropy``'s docstring): a bias and soft-capping go into the
logits GEMM's epilogue (``CE_LOGITS_EXT``; the target's capped logit is formed from the
stored one); class weights, label smoothing and z-loss
only change each row's coefficients in the gradient pass (``programs/ce.py:
ce_grad_``), which also forms the smoothing term's row sums. Still one logits GEMM
per chunk plus the dX and dW GEMMs.

The probabilities path (``CODETTA_CE_PROBS=1``; experimental: its tests pass on an H200,
where, tuned, it was faster than this default at bench ce's shapes; in an H100's model step
a tie with it, run 240; NOTES.md): for the plain
loss (a row scale allowed: ``CE_PROBS_SCALED`` also sums q a for r's gradient) in bf16 or
float32, the logits GEMM stores q = exp(l - ref) instead of l (``CE_PROBS``), for each row's reference
ref = its largest logit over 256 evenly spaced classes (one small GEMM) plus 20, and sums
q per row; lse = ref + log sum q, so p = q / sum q is a row factor and no gradient pass
runs: dX = (g / sum q) (q @ W) - g W[t] (``CE_PROBS_DX``: the target's row subtracted in
float32, rounded once), dW = q^T xs by the GEMMs (xs = (g / sum q) x rounded), - g x added
into the target rows of the float32 dW sum: a confident row's (q[t] over half of sum q) as
- (sum q) xs, from the GEMM's own rounded rows, so that q[t] xs - (sum q) xs holds p[t] - 1
to xs' rounding as p[t] nears 1; any other row's unrounded, xs' rounding then scaled by
p[t] (each target's rows summed by one program in one order, ``programs/ce.py: target_rows_sub_``: the
same bits every run; a call of one chunk holds no float32 sum: those sums go to its dW GEMM
as a table, ``CE_PROBS_DW``). A call with a row whose
lse - ref leaves [-60, 50] (q near bf16's range, or (g / sum q) x near its subnormals; its
largest logit ~60 nats above its sampled classes') runs again on the stored-logits path
(one wait a call on an event queued after the last chunk's log-sum-exp, its gradient GEMMs
queued behind it; CUDA graph capture keeps the stored-logits path). Why and what it should save:
NOTES.md, "A lead for the loss".

A row scale (``row_scale=r``, the final RMSNorm's rstd with its h as the input): the
logits GEMM's epilogue (``CE_LOGITS_SCALED``) stores a = round(x W^T) and takes the
statistics of l = r a; the gradient pass forms l from a again, writes r g (so the dX
and dW GEMMs on x give x's and W's gradients) and sums r's gradient, sum_n g a, in the
same read (docs/design.md, "The final norm for free").
"""

from __future__ import annotations

import contextvars

import torch

from ..kernels import launch
from ..kernels.launch import gemm
from ..kernels.operands import check_dtype, check_gemm_dtype, check_same_device, check_tensor
from ..kernels.settings import SETTINGS
from ..programs.basic import ACCUMULATE_F32, FINISH_F32, STORE_F32
from ..programs.ce import (
    CE_LOGITS,
    CE_LOGITS_EXT,
    CE_LOGITS_SCALED,
    CE_PROBS,
    CE_PROBS_DW,
    CE_PROBS_DX,
    CE_PROBS_SCALED,
    ce_grad_,
    probs_rows,
    rescale_,
    scale_cast,
    sort_targets,
    target_rows_sub_,
    target_rows_table,
)
from ._eager import FastOp, refuse_nonzero
from .ce_rows import (
    CEOptions,
    coefs,
    gain,
    logits_bias,
    row_loss,
    row_weights,
    scaled_pick,
    scales,
    target_rows,
)
from .ce_sliced import sliced_backward, sliced_forward
from .norm_checks import check_layouts
from .tied_embedding import TiedLink

REDUCTIONS = ("mean", "sum", "none")
# the TiedLink of the call being set up (``tied=``): read by ``_setup``, eager calls only
_TIED = contextvars.ContextVar("codetta_tied", default=None)


def _finishes(untied: bool, dtype: torch.dtype, reduction: str) -> bool:
    """Whether the loss rounds dW into the weight's dtype in its last chunk's GEMM
    (FINISH_F32): unless the ``ce_finish`` setting is off (``CODETTA_CE_FINISH=0``: 1 GB
    less at the untied 8B slice's peak, a float32 pass more). Reduction 'none' forms its
    gradients in the backward, where the incoming gradient is known: the setting alone
    decides. Mean and sum form them in the forward, and do not finish where a tied
    embedding's lookup takes part (not ``untied``: its backward takes the float32 sum and
    adds its own rows to it in one pass, ``ops/tied_embedding.py``) or the dtype is float16
    (its gradients are formed at a gain, ``ce_rows.gain``, and summed in float32 to the
    backward: a finished float16 dW at the gain could overflow where the true one does
    not). Decided at the call and passed to the ops as an argument (a compiled graph keeps
    the choice it traced)."""
    if reduction == "none":
        return bool(SETTINGS.ce_finish)
    return bool(SETTINGS.ce_finish) and untied and dtype != torch.float16


def rows_per_chunk(M: int, V: int, itemsize: int, budget: int | None = None) -> int:
    """Rows per chunk: as many as fit ``budget`` bytes of logits (default: the
    ``CODETTA_CE_CHUNK_MB`` setting, 1 GiB) (a multiple of 128 when more than 128 fit),
    at least 1."""
    budget = SETTINGS.ce_chunk_mb * 2**20 if budget is None else budget
    rows = max(1, budget // (V * itemsize))
    if rows > 128:
        rows -= rows % 128
    return min(max(M, 1), rows)


# The experimental probabilities path (``CODETTA_CE_PROBS=1``, ``_probs_chunk``): each row's
# reference is the largest of its logits over PROBS_SAMPLE classes of the vocabulary plus
# PROBS_MARGIN. A call with a row whose log-sum-exp lies more than PROBS_WINDOW above its
# reference (q = exp(l - ref) near bf16's range, e^88, and s = g / sum q, which scales x for
# the dW GEMM, toward bf16's subnormals: e^-50 g) or more than PROBS_BELOW below it (q's
# largest value near underflow; the reference is at most the margin above the row's largest
# logit, bar the sample's bf16 rounding) goes through the stored-logits path instead. A row
# passes the upper bound unless its largest logit is ~60 nats above its sample's.
PROBS_SAMPLE, PROBS_MARGIN, PROBS_WINDOW, PROBS_BELOW = 256, 20.0, 50.0, 60.0


def _probs_ok(x, opts: CEOptions, want_grads: bool, dx_f32: bool, gained) -> bool:
    """Whether this call takes the probabilities path: the setting on, gradients wanted,
    the plain loss (no bias, soft-cap, class weights, smoothing or z-loss; a row scale
    allowed), bf16 or float32 (float16's range, e^+-11, leaves the reference no room), dX
    rounded in the forward, and no CUDA graph being captured (the path checks each call
    on the host)."""
    plain = opts.plain and opts.weight is None and not (opts.smoothing or opts.z_loss)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    return (SETTINGS.ce_probs and want_grads and plain and x.dtype in (torch.bfloat16, torch.float32)
            and not dx_f32 and gained is None and not capturing)  # fmt: skip


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[2, M]: a + b as float32 hi and what its rounding left out (Knuth's TwoSum)."""
    hi = a + b
    bb = hi - a
    return torch.stack((hi, (a - (hi - bb)) + (b - bb)))


class _WindowCheck:
    """Whether every chunk of a call on the probabilities path stayed in its window, read
    on the host without draining the stream: the chunks' flags are combined as the last one
    comes (right after the last chunk's log-sum-exp), copied to pinned memory and an event
    recorded there, so the wait (``passed``) leaves that chunk's gradient GEMMs, queued
    after, running on the GPU while the host goes on (a plain read, the host sync it was,
    left the GPU idle while the host queued the next work: 0.7 ms a call, NOTES.md)."""

    def __init__(self, chunks: int):
        self.chunks, self.flags, self.host, self.event = chunks, [], None, None

    def add(self, flag: torch.Tensor):
        self.flags.append(flag.all())
        if len(self.flags) < self.chunks:
            return
        ok = torch.stack(self.flags).all()
        if not ok.is_cuda:
            self.host = ok
            return
        with torch.cuda.device(ok.device):
            self.host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self.host.copy_(ok, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def passed(self) -> bool:
        assert len(self.flags) == self.chunks, "every chunk's flag is in"
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host)


def _probs_chunk(xc, tc, valid, w, w_sample, q, g, r, dx, dw32, dw, dr, lse_out, loss_out, first: bool,
                 finishing: bool, sorted_rows: tuple, window: _WindowCheck):  # fmt: skip
    """One chunk on the probabilities path (``CODETTA_CE_PROBS``): q = exp(l - ref) into
    ``q`` (CE_PROBS, ref: the row's largest logit over ``w_sample``'s classes plus
    PROBS_MARGIN), the rows' log-sum-exp (ref + log sum q, hi + lo) into ``lse_out`` and
    losses into ``loss_out`` (0 where not ``valid``: an ignored row); with g the rows'
    gradient scale (0 for an ignored row), dlogits = (g / sum q) q - g onehot: dX = that
    (q @ W) - g W[t] into ``dx`` (CE_PROBS_DX, rounded once), dW += q^T xs by the GEMMs
    (xs = (g / sum q) x rounded, ``probs_rows``) and - g x (a confident row's as - (sum q)
    xs) into the target rows of the float32 sum (``target_rows_sub_``, its rows sorted by
    target: ``sorted_rows``, the chunk's order, keys, row0 and key0; before the last chunk's
    GEMM rounds it, ``finishing``: FINISH_F32 into ``dw``; ``first``: the sum's first term,
    STORE_F32). A
    call of one chunk (``finishing``, no float32 sum: ``dw32`` None) hands its target rows'
    sums to the dW GEMM as a table (CE_PROBS_DW: ``target_rows_table``), no float32 [V, d]
    written or read. With a row scale ``r`` (the rows' [R] float32, else None) the logits
    are l = r a, a = x W^T (CE_PROBS_SCALED, as
    CE_LOGITS_SCALED): the GEMMs' gradient scale is g r, and r's gradient g (sum_n p a -
    a[t]) goes into ``dr``, sum_n p a = qa / sum q. Whether every row's log-sum-exp lay
    within the window of its reference (else q may have left bf16's range, or the dW GEMM's
    s x float32's normal one, and the call runs again on the stored-logits path) goes to
    ``window`` as soon as the log-sum-exp is known, before the gradient GEMMs are queued."""
    V = w.shape[0]
    sampled = (xc @ w_sample.t()).float()
    ref = (sampled if r is None else sampled * r[:, None]).amax(1) + PROBS_MARGIN
    if r is None:
        qsum = gemm(xc, w, epilogue=CE_PROBS, ref=ref, out=(q, None)).qsum
    else:
        qsum, qa = gemm(xc, w, epilogue=CE_PROBS_SCALED, scale=r, ref=ref, out=(q, None, None))[1:]
    lse_out.copy_(_two_sum(ref, torch.log(qsum)))
    d = lse_out[0] - ref  # (NaN and inf fail both bounds)
    window.add((d <= PROBS_WINDOW) & (d >= -PROBS_BELOW))
    inside = (tc >= 0) & (tc < V)
    tcc = tc.clamp(0, V - 1)
    wt = w[tcc]  # (the targets' rows of W: the loss's l[t] and dX's target term)
    # (the gradient the GEMMs on x = h form with a row scale: dl/da = r dl/dl)
    gx = g if r is None else g * r
    s = gx / qsum  # (p = q / sum q)
    # l[t] = x . W[t] and x s for the dW GEMM, in one pass over the rows (``probs_rows``);
    # the row's loss log(sum q) - (l[t] - ref): l[t] - ref as log q[t] from a stored float32
    # q (the GEMM's own value: ref cancels exactly), else (bf16's q is 2^-9 off; a float32
    # q[t] that underflowed) from that float32 dot product
    at, xs = probs_rows(xc, wt, s)
    at = torch.where(inside, at, 0.0)
    rel = (at if r is None else at * r) - ref
    qt = q.gather(1, tcc[:, None])[:, 0].float()
    if q.dtype == torch.float32:
        rel = torch.where(qt > torch.finfo(torch.float32).tiny, torch.log(qt), rel)
    # a confident row (q[t] over half of sum q): its loss log(1 + (the others' sum) / q[t]),
    # q[t] as exp(rel) (the stored one's rounding, 2^-9 in bf16, no longer in the sum: as
    # log(sum q) - rel the loss of a row at p[t] 0.9999 was 20x off, 2^-9 of 1e-4)
    sure = qt > 0.5 * qsum
    loss = torch.where(sure, torch.log1p((qsum - qt) / torch.exp(rel)), torch.log(qsum) - rel)
    loss_out.copy_(torch.where(valid, loss, 0.0))
    if r is not None:  # (g is NaN for a bad target: its dr NaN, as the stored-logits path's)
        dr.copy_(torch.where(valid, g * (qa / qsum - at), 0.0))
    gemm(q, w.t(), epilogue=CE_PROBS_DX, s=s, g=gx, wt=wt, out=dx)
    # (a row without a target is skipped: a bad target's NaN reaches dW through xs.) The
    # target term of a confident row as - qsum xs, from the rows the GEMM reads: their sum
    # (q[t] - qsum) xs, 1 - p[t] as exact as the rest (as - g x, xs' bf16 rounding was left
    # over whole: dW at a confident row's target 0.9-35x its size off); of any other row as
    # - g x, unrounded (xs' rounding then enters scaled by p[t] < 1/2; as - qsum xs, whole:
    # dW at the targets 2x PyTorch's error at p[t] ~ 0, NOTES.md;
    # test_confident_rows_and_a_class_ignored, test_probs_path_matches_float64)
    gt, alt = torch.where(sure, qsum, gx), (xs, sure)
    if finishing and dw32 is None:  # (one chunk: its target rows' sums a table the GEMM adds in)
        slot, corr = target_rows_table(xc, gt, V, *sorted_rows, alt=alt)
        gemm(q.t(), xs.t(), epilogue=CE_PROBS_DW, slot=slot, corr=corr, out=dw)
    elif finishing:
        target_rows_sub_(dw32, xc, gt, *sorted_rows, alt=alt)
        gemm(q.t(), xs.t(), epilogue=FINISH_F32, c=dw32, out=dw)
    else:
        if first:
            gemm(q.t(), xs.t(), epilogue=STORE_F32, out=dw32)
        else:
            gemm(q.t(), xs.t(), epilogue=ACCUMULATE_F32, c=dw32, out=dw32)
        target_rows_sub_(dw32, xc, gt, *sorted_rows, alt=alt)


def _pass(x, w, target, ignore_index, reduction, rows, opts: CEOptions, grad=None, want_grads=True,
          finish=True, dx_f32=False):  # fmt: skip
    """Loss rows (fp32 [M]), each row's log-sum-exp (fp32 [2, M]: hi, lo) and, with ``want_grads``,
    dX (input dtype), dW and dbias (fp32), the gain they were formed at (``ce_rows.
    gain``: float16's mean and sum, a 0-dim float32 power of 2 the backward divides out;
    else None) and, with ``opts.row_scale``, its gradient (fp32 [M], at that gain; else
    None). dW: with ``finish`` in the weight's dtype (the last chunk's GEMM adds its
    product to the float32 sum of the others and rounds once, FINISH_F32; one chunk: a
    plain GEMM), else float32 (the tied embedding's one pass takes it). ``dx_f32``: dX in
    float32 (the backward's scale then rounds it once).

    Row loss, with p = softmax(c) over the (capped) logits c, eps = label smoothing,
    w = class weights (1 without), t = the row's target:
      (1 - eps) w[t] (lse - c[t]) + eps/V sum_n w[n] (lse - c[n]) + z_loss lse^2
    and its gradient with respect to c: a p - b onehot(t) - eps/V w, a = (1 - eps) w[t]
    + eps/V sum(w) + 2 z_loss lse, b = (1 - eps) w[t]."""
    M, V = x.shape[0], w.shape[0]
    losses = torch.empty(M, dtype=torch.float32, device=x.device)
    lse_all = torch.empty(2, M, dtype=torch.float32, device=x.device)  # (hi, lo): RowLogSumExp(split=True)
    dx = (
        torch.empty(x.shape, dtype=torch.float32 if dx_f32 else x.dtype, device=x.device)
        if want_grads
        else x.new_empty(0)
    )
    # (the first chunk stores its product, the others add theirs: no zero fill; no rows:
    # no chunk, a zero gradient)
    last = (M - 1) // rows * rows if M else 0  # the last chunk's first row
    dw32 = dw = None
    if want_grads and (last or not finish):
        dw32 = (torch.empty if M else torch.zeros)(w.shape, dtype=torch.float32, device=x.device)
    if want_grads and finish:
        dw = (torch.empty if M else torch.zeros)(w.shape, dtype=w.dtype, device=x.device)
    db32 = (
        torch.zeros(V, dtype=torch.float32, device=x.device) if want_grads and opts.bias is not None else None
    )
    rs = opts.row_scale
    dr = torch.empty(M, dtype=torch.float32, device=x.device) if want_grads and rs is not None else None
    bad, valid, wt, w_sum = target_rows(target, V, ignore_index, opts)
    scale = scales(valid, wt.sum(), reduction, grad) if want_grads else None
    gained = None
    if want_grads and grad is None:  # (the gain sized to the gradient as stored: with a row scale, r g)
        gained = gain(scale if opts.row_scale is None else scale * opts.row_scale, opts, x.dtype, wt)
    if gained is not None:
        if finish:
            raise ValueError("float16's gradients at a gain are summed in float32: finish must be off")
        scale = scale * gained
    if bad is not None and scale is not None:
        scale = torch.where(bad, float("nan"), scale)
    eps, smooth = opts.smoothing, opts.smoothing / V
    bias = logits_bias(x, V, opts)
    # one logits buffer for every chunk, rows padded to 16 bytes (an odd V still moves by TMA)
    unit = 16 // x.element_size()
    buf = torch.empty(min(rows, M), -(-V // unit) * unit, dtype=x.dtype, device=x.device)
    probs = M > 0 and _probs_ok(x, opts, want_grads, dx_f32, gained)
    if probs:  # (evenly spaced classes for the rows' references; every chunk's rows sorted by
        # target for its target-row sums, in one sort)
        w_sample = w[torch.linspace(0, V - 1, min(V, PROBS_SAMPLE), device=x.device).round().long()]
        order, keys = sort_targets(target, V, rows)
    # (the probabilities path first where it is on; one wait a call, on the window's event: a
    # chunk out of its window runs the call again on the stored-logits path, which rewrites
    # every output)
    for use_probs in (True, False) if probs else (False,):
        window = _WindowCheck(-(-M // rows)) if use_probs else None
        for start in range(0, M, rows):
            sl = slice(start, min(M, start + rows))
            xc, tc = x[sl], target[sl]
            logits = buf[: xc.shape[0], :V]
            if use_probs:
                sorted_rows = (order[sl], keys[sl], start, start // rows * (V + 1))
                _probs_chunk(xc, tc, valid[sl], w, w_sample, logits, scale[sl],
                             None if rs is None else rs[sl], dx[sl], dw32, dw, None if dr is None else dr[sl],
                             lse_all[:, sl], losses[sl], start == 0, finish and start == last, sorted_rows,
                             window)  # fmt: skip
                continue
            # the target logit read back from the stored chunk (the epilogue's own value; a
            # gather in the epilogue cost as much as the GEMM, NOTES.md), capped here if need be
            if rs is not None:  # (the unscaled products stored; l = r a formed from them)
                lse = gemm(xc, w, epilogue=CE_LOGITS_SCALED, scale=rs[sl], out=(logits, None)).lse
            elif opts.plain:
                lse = gemm(xc, w, epilogue=CE_LOGITS, out=(logits, None)).lse
            else:
                lse = gemm(
                    xc, w, epilogue=CE_LOGITS_EXT, bias=bias, softcap=opts.softcap, out=(logits, None)
                ).lse
            picked = scaled_pick(logits, tc, opts, sl)
            wc = wt[sl]
            lse_all[:, sl] = lse
            coef = coefs(lse, wc, opts, V, w_sum)
            sums = None
            if want_grads:
                # (with a row scale r the stored gradient is r g: what dX = dl W and dW = dl^T x
                # need of x = h, the norm's output n = h r being never formed)
                sums, dr_c = ce_grad_(logits, lse, tc, scale[sl], weight=opts.weight, smooth=smooth,
                                      softcap=opts.softcap, want_sum=bool(eps),
                                      row_scale=None if rs is None else rs[sl], **coef)  # fmt: skip
                if dr is not None:
                    dr[sl] = dr_c
                gemm(logits, w.t(), epilogue=STORE_F32 if dx_f32 else None, out=dx[sl])
                if finish and start == last:  # dW = (the float32 sum so far +) dl^T x, rounded once
                    if start == 0:
                        gemm(logits.t(), xc.t(), out=dw)
                    else:
                        gemm(logits.t(), xc.t(), epilogue=FINISH_F32, c=dw32, out=dw)
                elif start == 0:
                    gemm(logits.t(), xc.t(), epilogue=STORE_F32, out=dw32)  # dW = dl^T x
                else:  # dW += dl^T x, in place
                    gemm(logits.t(), xc.t(), epilogue=ACCUMULATE_F32, c=dw32, out=dw32)
                if db32 is not None:
                    db32 += logits.sum(0, dtype=torch.float32)  # (no fp32 copy of the chunk)
            elif eps:
                sums, _ = ce_grad_(logits, lse, tc, lse[0], weight=opts.weight, softcap=opts.softcap,
                                   write=False, want_sum=True,
                                   row_scale=None if rs is None else rs[sl])  # fmt: skip
            losses[sl] = torch.where(valid[sl], row_loss(lse, picked, wc, sums, opts, V, w_sum), 0.0)
        # (a recording without running, ``codetta.tune``'s: its outputs hold nothing, and a
        # real run stays on the probabilities path)
        if not use_probs or launch.dry() or window.passed():
            break
    if bad is not None:
        losses = torch.where(bad, float("nan"), losses)
    return losses, lse_all, dx, dw if finish else dw32, db32, gained, dr


def _forward_impl(
    x: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    smoothing: float,
    z_loss: float,
    softcap: float,
    need_grad: bool,
    rows: int,
    vocab_chunk: int,
    finish: bool,
    dx_f32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # (loss, lse, dx, dw, db, gain, dr): dx/dw/db (and dr, row_scale's gradient, with one)
    # for mean and sum when gradients are needed (else empty), formed at gain (float16: a
    # 0-dim power of 2, ce_rows.gain; else empty);
    # vocab_chunk > 0: the low-memory passes, gradients always in the backward; finish:
    # dW rounded to the weight's dtype in the forward (_finishes)
    grads = need_grad and reduction != "none" and not vocab_chunk
    opts = CEOptions(bias, class_weight, smoothing, z_loss, softcap, row_scale)
    if vocab_chunk:
        losses, lse = sliced_forward(x, w, target, ignore_index, vocab_chunk, opts)
        dx = dw32 = db32 = gained = dr = None
    else:
        losses, lse, dx, dw32, db32, gained, dr = _pass(
            x, w, target, ignore_index, reduction, rows, opts, want_grads=grads, finish=finish, dx_f32=dx_f32
        )
    if not grads:
        dx = x.new_empty(0)
    if reduction == "none":
        loss = losses
    else:
        # (summed in float64, as PyTorch's CPU loss does: a float32 sum of rows of loss ~60
        # rounds at the total's ulp, several times PyTorch's error at 48 rows, NOTES.md)
        loss = losses.sum(dtype=torch.float64)
        if reduction == "mean":  # 0/0 = nan when every row is ignored, as torch
            loss = loss / row_weights(target, target != ignore_index, opts).sum(dtype=torch.float64)
        loss = loss.float()
    # dW in the weight's dtype (the backward scales it in place where its incoming gradient
    # is not 1), or float32 for a tied embedding's one pass (_finishes)
    dw = dw32 if grads else w.new_empty(0)
    # dB kept in float32 ([V]: the backward scales it and rounds once; rounded here, a
    # gradient other than a power of 2 coming in rounded it twice: 1.36x PyTorch's error at
    # the median with a softcap, NOTES.md)
    db = db32 if grads and bias is not None else w.new_empty(0, dtype=torch.float32)
    gained = gained if gained is not None else lse.new_empty(0)
    dr = dr if grads and dr is not None else lse.new_empty(0)
    return loss, lse, dx, dw, db, gained, dr


_forward = torch.library.custom_op("codetta::linear_cross_entropy", mutates_args=())(_forward_impl)


@_forward.register_fake
def _(x, w, target, bias, row_scale, class_weight, ignore_index, reduction, smoothing, z_loss, softcap,
      need_grad, rows, vocab_chunk, finish, dx_f32):  # fmt: skip
    f32 = torch.float32
    loss = x.new_empty(x.shape[0], dtype=f32) if reduction == "none" else x.new_empty((), dtype=f32)
    grads = need_grad and reduction != "none" and not vocab_chunk
    db = w.new_empty((w.shape[0],) if grads and bias is not None else (0,), dtype=f32)
    dw_dtype = f32 if grads and not finish else w.dtype
    gained = x.new_empty(() if grads and x.dtype == torch.float16 else (0,), dtype=f32)
    dx = x.new_empty(x.shape, dtype=f32) if grads and dx_f32 else x.new_empty(x.shape if grads else (0,))
    dr = x.new_empty((x.shape[0],) if grads and row_scale is not None else (0,), dtype=f32)
    return (loss, x.new_empty((2, x.shape[0]), dtype=f32), dx,
            w.new_empty(w.shape if grads else (0,), dtype=dw_dtype), db, gained, dr)  # fmt: skip


def _backward_none_impl(
    grad: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    smoothing: float,
    z_loss: float,
    softcap: float,
    rows: int,
    finish: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduction 'none': the loss's gradients from the incoming per-row gradient ``grad``
    (dX, dW, db, d row_scale; db and d row_scale empty without them). ``finish``: dW rounded
    once into the weight's dtype by the last chunk's GEMM (the gradient is known here,
    nothing is scaled after), else summed in float32 and cast."""
    opts = CEOptions(bias, class_weight, smoothing, z_loss, softcap, row_scale)
    _, _, dx, dw, db32, _, dr = _pass(x, w, target, ignore_index, "none", rows, opts, grad=grad,
                                      finish=finish)  # fmt: skip
    db = db32.to(bias.dtype) if bias is not None else w.new_empty(0)
    dr = dr if dr is not None else grad.new_empty(0, dtype=torch.float32)
    return dx, dw if finish else dw.to(w.dtype), db, dr


_backward_none = torch.library.custom_op("codetta::linear_cross_entropy_backward", mutates_args=())(
    _backward_none_impl
)


def _fake_grads(x, w, bias, row_scale):
    """The backward ops' outputs under fake tensors: dX, dW, db (empty without a bias) and
    d row_scale (float32 [M], empty without one)."""
    db = w.new_empty((w.shape[0],) if bias is not None else (0,))
    dr = x.new_empty((x.shape[0],) if row_scale is not None else (0,), dtype=torch.float32)
    return x.new_empty(x.shape), w.new_empty(w.shape), db, dr


@_backward_none.register_fake
def _(grad, x, w, target, bias, row_scale, class_weight, ignore_index, smoothing, z_loss, softcap, rows,
      finish):  # fmt: skip
    return _fake_grads(x, w, bias, row_scale)


def _backward_sliced_impl(
    grad: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    smoothing: float,
    z_loss: float,
    softcap: float,
    vocab_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    opts = CEOptions(bias, class_weight, smoothing, z_loss, softcap, row_scale)
    return sliced_backward(grad, x, w, target, lse, ignore_index, reduction, vocab_chunk, opts)


_backward_sliced = torch.library.custom_op("codetta::linear_cross_entropy_sliced_backward", mutates_args=())(
    _backward_sliced_impl
)


@_backward_sliced.register_fake
def _(grad, x, w, target, lse, bias, row_scale, class_weight, ignore_index, reduction, smoothing, z_loss,
      softcap, vocab_chunk):  # fmt: skip
    return _fake_grads(x, w, bias, row_scale)


def _setup(ctx, inputs, output):
    (x, w, target, bias, row_scale, class_weight, ignore_index, reduction, smoothing, z_loss, softcap,
     need_grad, rows, vocab_chunk, finish, _dx_f32) = inputs  # fmt: skip
    _, lse, dx, dw, db, gained, dr = output
    ctx.reduction, ctx.ignore_index, ctx.rows, ctx.vocab_chunk = reduction, ignore_index, rows, vocab_chunk
    ctx.opts = (smoothing, z_loss, softcap)
    ctx.b_dtype = bias.dtype if bias is not None else None  # (None: no bias)
    ctx.scaled = row_scale is not None
    ctx.grads_in_forward = need_grad and reduction != "none" and not vocab_chunk
    ctx.w_dtype, ctx.x_dtype = w.dtype, x.dtype
    ctx.tied = _TIED.get() if ctx.grads_in_forward else None
    ctx.finish = finish  # (the call's choice: an argument of the op, never a setting read in it)
    ctx.handed = False  # (set once the backward hands out the saved dX and dW, scaled in place)
    ctx.set_materialize_grads(False)
    if vocab_chunk:
        ctx.save_for_backward(x, w, target, lse, bias, row_scale, class_weight)
    elif reduction == "none":
        ctx.save_for_backward(x, w, target, bias, row_scale, class_weight)
    else:
        ctx.save_for_backward(dx, dw, db, gained, dr)


def _scaled_dx(dx: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The forward's dX times the incoming gradient: in place where it is already in the
    input's dtype (no work on the device when the scale is 1; a second rounding where it is
    not a power of 2), else (``CODETTA_CE_DX_F32``: float32) scaled and rounded once into it."""
    if not dx.numel():
        return dx
    return rescale_(dx, scale) if dx.dtype == dtype else scale_cast(dx, scale, dtype)


def _autograd_backward(ctx, dloss, dlse, _ddx, _ddw, _ddb, _dgain, _ddr):
    rest = (None,) * 11  # (the inputs after x, w, target, the bias and the row scale: no gradient)
    if dlse is not None:  # (zeros pass: a compiled graph that ends between the loss and lse's use)
        refuse_nonzero(
            dlse,
            "codetta.linear_cross_entropy: a gradient reached the returned lse (return_lse=True), "
            "whose gradient is not formed (only the loss's is); for a z-loss pass z_loss=, or use "
            "lse.detach() where it only reports",
        )
    if dloss is None:
        return (None, None, None, None, None) + rest
    if ctx.vocab_chunk:
        x, w, target, lse, bias, row_scale, class_weight = ctx.saved_tensors
        dx, dw, db, dr = _backward_sliced_fast(
            dloss.contiguous(), x, w, target, lse, bias, row_scale, class_weight, ctx.ignore_index,
            ctx.reduction, *ctx.opts, ctx.vocab_chunk,
        )  # fmt: skip
    elif ctx.reduction == "none":
        x, w, target, bias, row_scale, class_weight = ctx.saved_tensors
        dx, dw, db, dr = _backward_none_fast(dloss.contiguous(), x, w, target, bias, row_scale, class_weight,
                                             ctx.ignore_index, *ctx.opts, ctx.rows, ctx.finish)  # fmt: skip
    else:
        if ctx.handed:
            raise RuntimeError(
                "codetta.linear_cross_entropy: a second backward through the same loss is not supported: "
                "the first one returned its saved gradients themselves, scaled in place (with "
                "CODETTA_CE_FINISH=0 they are kept for a retain_graph=True backward: a float32 dW, "
                "one more pass; a Hugging Face model patched by codetta also needs "
                "CODETTA_OVERWRITE_SAVED=0 for its SwiGLU backwards)"
            )
        dx, dw, db, gained, dr = ctx.saved_tensors
        if not ctx.grads_in_forward:
            raise RuntimeError("codetta.linear_cross_entropy: gradients were not computed in the forward")
        scale = dloss.to(torch.float32)
        if gained.numel():  # (float16: formed at a power-of-2 gain, divided out exactly here)
            scale = scale / gained
        db = (db * scale).to(ctx.b_dtype) if db.numel() else db  # (float32 [V], rounded once)
        dr = dr * scale  # (float32 [M]; empty without a row scale)
        if ctx.finish:  # (mean / sum: gradients formed in the forward)
            # dX, and dW already rounded to the weight's dtype in the forward, scaled in place
            # where the incoming gradient is not 1 (for dW a second rounding there, none for
            # powers of 2): passes that skip their work on the device when it is 1 (the usual
            # loss.backward()), no new [M, d]; the graph is then spent (ctx.handed)
            ctx.handed = True
            dx = _scaled_dx(dx, scale, ctx.x_dtype)
            dw = rescale_(dw, scale)
        else:
            # dX scaled in one vectorized pass into a new tensor (PyTorch's product with a
            # float32 0-dim factor takes its unvectorized mixed-dtype kernel: 0.31 ms at
            # [16384, 4096] bf16, run 129); the float32 dW handed to the tied embedding, or
            # scaled and cast to the weight's dtype in one pass
            dx = scale_cast(dx, scale, ctx.x_dtype) if dx.numel() else dx
            if ctx.tied is not None and ctx.tied.hand_over(dw, scale):
                dw = None  # the tied embedding's backward returns the weight's whole gradient
            else:
                dw = scale_cast(dw, scale, ctx.w_dtype)
    return (dx, dw, None, db if ctx.b_dtype is not None else None, dr if ctx.scaled else None) + rest


_forward.register_autograd(_autograd_backward, setup_context=_setup)
# eager calls skip torch.library's dispatch (ops/_eager.py); torch.compile traces the custom ops
_forward_fast = FastOp(_forward, _forward_impl, _setup, _autograd_backward)
_backward_none_fast = FastOp(_backward_none, _backward_none_impl)
_backward_sliced_fast = FastOp(_backward_sliced, _backward_sliced_impl)


def check_options(reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None, vocab_chunk=None) -> None:
    """``linear_cross_entropy``'s options that are not tensors, checked (also at a loss
    module's construction, ``nn.LinearCrossEntropyLoss``: an error there, not at the first
    forward)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if float(z_loss) < 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be > 0 (or None), got {softcap}")
    whole = isinstance(vocab_chunk, int) and not isinstance(vocab_chunk, bool)
    if vocab_chunk is not None and (not whole or vocab_chunk < 8 or vocab_chunk % 8):
        raise ValueError(f"vocab_chunk must be a positive multiple of 8 (or None), got {vocab_chunk!r}")


def linear_cross_entropy(
    input,
    linear_weight,
    target,
    *,
    linear_bias=None,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    return_lse=False,
    chunk_rows=None,
    loss_dtype=None,
    vocab_chunk=None,
    tied=None,
    row_scale=None,
):
    """``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=weight,
    reduction=..., ignore_index=..., label_smoothing=...)`` without materializing the
    logits in fp32 (module docstring: chunks, memory), plus two options of other fused
    losses: ``softcap`` (the logits become ``softcap * tanh(logits / softcap)`` before
    the loss) and ``z_loss`` (``z_loss * lse**2`` added to each counted row's loss,
    lse = the row's log-sum-exp; not scaled by class weights; averaged with the rest
    under ``mean``).

    input [..., d] (bf16/fp16 on the GPU; fp32 too on CPU), linear_weight [V, d] and
    linear_bias [V] in input's dtype, weight [V] (class weights, any float dtype),
    target [...] int64 or int32 class indices (``ignore_index`` rows count nowhere).
    Returns a scalar (mean, sum) or the per-row losses (none), in input's dtype; with
    ``return_lse``, also each row's log-sum-exp (fp32, target's shape). A target
    outside [0, V) other than ``ignore_index`` raises on the CPU; on the GPU its row's
    loss and gradients are NaN (so a mean or sum loss is NaN: checking on the host
    would cost a synchronization per step). ``chunk_rows`` overrides the rows per chunk
    (default: as many as the ``CODETTA_CE_CHUNK_MB`` setting's logits hold).
    ``loss_dtype``: the loss's dtype (default input's, as torch; it is computed in
    float32 either way).

    ``vocab_chunk`` (an int, a multiple of 8; or None): the low-memory mode. The
    vocabulary goes in slices of this many classes over all rows at once, and the
    backward computes the logits again: four GEMMs instead of three, for at most one
    [rows, vocab_chunk] logits slice and a float32 dX ([rows, d]) of extra memory
    (no float32 dW: each slice's dW is one GEMM over every row, rounded once).
    ``chunk_rows`` does not apply then. Default: the ``CODETTA_CE_VOCAB_CHUNK`` setting
    (0: off), so the Hugging Face drop-in's loss can use it unchanged.

    ``tied``: a ``TiedLink`` from ``tied_embedding(ids, linear_weight, ...)`` (tied
    embeddings, ``ops/tied_embedding.py``): the weight's gradient then reaches it
    through the embedding's backward, summed with the embedding's in one pass. Used in
    eager mode for mean and sum without ``vocab_chunk``; ignored elsewhere.

    ``row_scale`` (a floating tensor of target's shape, or None): the logits are
    ``row_scale[..., None] * (input @ linear_weight.T)``, the row scale applied in the
    logits GEMM's epilogue (``CE_LOGITS_SCALED``) and in the gradient pass, and
    differentiable like the other inputs. For the final RMSNorm of a decoder:
    ``x, h, rstd = residual_rmsnorm_factors(...)`` and ``linear_cross_entropy(h, W, t,
    row_scale=rstd)``: the norm's output ``h * rstd`` is never formed (one pass over
    [M, d] less in the forward, no n written in the backward). With ``linear_bias``,
    ``softcap`` or a float16 input, ``input * row_scale`` is formed first instead (in
    float32, rounded once into input's dtype): no program scales rows under a bias or a
    cap, and float16's range may not hold the unscaled products (logits / row_scale:
    with rstd, the logits times the rows' RMS).
    """
    check_tensor("input", input)
    check_tensor("linear_weight", linear_weight)
    check_tensor("target", target)
    named = {"input": input, "linear_weight": linear_weight, "target": target}
    for name, t in (("linear_bias", linear_bias), ("weight", weight)):
        if t is not None:
            check_tensor(name, t)
            named[name] = t
    if row_scale is not None:
        check_tensor("row_scale", row_scale)
        named["row_scale"] = row_scale
    check_same_device(named)
    check_gemm_dtype("input", input)
    if tied is not None and not isinstance(tied, TiedLink):
        raise TypeError(f"tied must be a TiedLink (ops.tied_embedding) or None, got {type(tied).__name__}")
    if tied is not None and not torch.compiler.is_compiling():  # (compiled: the link is not used)
        tied.check_weight(linear_weight)
    if linear_weight.dtype != input.dtype:
        raise TypeError(f"linear_weight ({linear_weight.dtype}) must have input's dtype ({input.dtype})")
    check_dtype("target", target, (torch.int64, torch.int32))
    if linear_weight.dim() != 2 or input.dim() < 1 or input.shape[-1] != linear_weight.shape[1]:
        raise ValueError(
            f"input [..., d] and linear_weight [V, d] disagree: {tuple(input.shape)} and "
            f"{tuple(linear_weight.shape)}"
        )
    if target.shape != input.shape[:-1]:
        raise ValueError(f"target must have shape {tuple(input.shape[:-1])}, got {tuple(target.shape)}")
    if row_scale is not None:
        if row_scale.shape != input.shape[:-1]:
            raise ValueError(
                f"row_scale must have shape {tuple(input.shape[:-1])} (one per row of input), got "
                f"{tuple(row_scale.shape)}"
            )
        if not row_scale.is_floating_point():
            raise TypeError(f"row_scale must be a floating-point tensor, got {row_scale.dtype}")
        if linear_bias is not None or softcap is not None or input.dtype == torch.float16:
            # the scaled input formed first (rounded once into input's dtype): no program
            # scales the rows under a bias or a cap, and in float16 the unscaled products
            # input @ W^T (logits / row_scale) could overflow its range where the logits do not
            input = (input.float() * row_scale.float()[..., None]).to(input.dtype)
            row_scale = None
    check_layouts({"linear_weight": linear_weight})  # (input: made contiguous where it is not)
    V = linear_weight.shape[0]
    if linear_bias is not None:
        if linear_bias.shape != (V,):
            raise ValueError(f"linear_bias must have shape ({V},), got {tuple(linear_bias.shape)}")
        if linear_bias.dtype != input.dtype:
            raise TypeError(f"linear_bias ({linear_bias.dtype}) must have input's dtype ({input.dtype})")
    if weight is not None:
        if weight.shape != (V,):
            raise ValueError(f"weight must have shape ({V},) (one per class), got {tuple(weight.shape)}")
        if not weight.is_floating_point():
            raise TypeError(f"weight must be a floating-point tensor, got {weight.dtype}")
        if weight.requires_grad and torch.is_grad_enabled():  # (PyTorch's refuses too, at the backward)
            raise RuntimeError("weight (the class weights) must not require grad: none is formed for it")
        weight = weight.detach().float().contiguous()
    unit = 16 // input.element_size()
    if input.shape[-1] % unit:
        raise ValueError(
            f"d = {input.shape[-1]} must be a multiple of {unit} for {input.dtype} (rows of the input "
            "and the weight move through TMA in 16-byte units)"
        )
    whole = isinstance(chunk_rows, int) and not isinstance(chunk_rows, bool)
    if chunk_rows is not None and (not whole or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive whole number (or None), got {chunk_rows!r}")
    floating = isinstance(loss_dtype, torch.dtype) and loss_dtype.is_floating_point
    if loss_dtype is not None and not floating:
        raise TypeError(f"loss_dtype must be a floating-point torch.dtype (or None), got {loss_dtype!r}")
    if vocab_chunk is None:
        vocab_chunk = SETTINGS.ce_vocab_chunk or None
    check_options(reduction, label_smoothing, z_loss, softcap, vocab_chunk)
    x = input.reshape(-1, input.shape[-1]).contiguous()
    t = target.reshape(-1).contiguous()
    rs = None if row_scale is None else row_scale.reshape(-1).float().contiguous()
    rows = chunk_rows or rows_per_chunk(x.shape[0], V, x.element_size())
    grad_of = [input, linear_weight] + [v for v in (linear_bias, row_scale) if v is not None]
    need_grad = torch.is_grad_enabled() and any(v.requires_grad for v in grad_of)
    untied = tied is None or torch.compiler.is_compiling()  # (dynamo cannot trace a ContextVar)
    finish = _finishes(untied, x.dtype, reduction)
    args = (x, linear_weight, t, linear_bias, rs, weight, int(ignore_index), reduction,
            float(label_smoothing), float(z_loss), float(softcap or 0.0), need_grad, int(rows),
            int(vocab_chunk or 0), finish, bool(SETTINGS.ce_dx_f32))  # fmt: skip
    if untied:
        loss, lse, *_ = _forward_fast(*args)
    else:
        token = _TIED.set(tied)
        try:
            loss, lse, *_ = _forward_fast(*args)
        finally:
            _TIED.reset(token)
    loss = loss.to(loss_dtype or input.dtype)
    loss = loss.reshape(target.shape) if reduction == "none" else loss
    return (loss, lse[0].reshape(target.shape)) if return_lse else loss

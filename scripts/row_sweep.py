"""The step's memory-bound row passes under other launch shapes (GPU machine).

Three passes of the Llama step that the profile (scripts/profile_step.py) shows as
their own kernels, each at the benchmark's shapes (16384 tokens; the LM head's 4096-row
chunks), timed paired, as us and GB/s (bytes read and written / time):

- the row finish of reduction partials (``reductions._rows_kernel``): the previous fixed
  64 x 32 block against the width-dependent one (``reductions._rows_consts``), on the
  LM head's LSE partials and a norm's sum-of-squares partials; outputs must agree
  within 1e-6 relative (the summation order follows the block);
- the cross-entropy gradient over stored logits (``ce._ce_grad_kernel``, in place):
  block width x warps;
- the rowwise RMSNorm backward (``norm_rows._rms_backward_rows_kernel``): rows per step x
  warps x programs per SM. Its outputs must equal the default launch's bit for bit
  (dgamma's partials follow the programs' rows, so only their sum is compared, 1e-5).

Usage (repo root): PYTHONPATH=. python scripts/row_sweep.py [tokens] [finish] [ce] [cegrid]
[rms] (default 16384 tokens, every sweep but cegrid: the gradient pass's launch at five
vocabulary widths, plain and row-scaled, against 1024 x 4 warps, the launch before 4096 x
16). The LSE partials are (max, sum) pairs, [M, 2T], since the split log-sum-exp (NOTES.md);
run 114 timed the single-value [M, T] ones.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import triton

from codetta.kernels import device, precompile, reductions
from codetta.kernels.timing import paired_ms, sustained_ms
from codetta.programs import ce, norm_rows

REPS = 20


def _time(fns: dict) -> dict:
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    return paired_ms(fns, min_s=0.3, warm_s=0.1)


def _finish_reps(parts, out, c) -> None:
    """REPS launches back to back (one alone would time the host's launch latency)."""
    M, T = parts.shape
    T = T // 2 if c["LSE"] else T  # (a log-sum-exp's partials: (max, sum) pairs, [M, 2T])
    for _ in range(REPS):
        precompile.launch(reductions._rows_kernel, (triton.cdiv(M, c["BLOCK_M"]),), parts, out, M, T, **c)


def row_finish(tokens: int) -> None:
    print("== row finish of partials [M, T] (old: 64 x 32 block; new: reductions._rows_consts)")
    for M, T, lse in ((4096, 2004, True), (4096, 1002, True), (tokens, 64, False), (tokens, 128, False)):
        parts = torch.randn(M, T, device="cuda") * 3
        if lse:  # each sub-tile's max, then its sum of exp(v - max), >= 1
            parts = torch.cat([parts, parts.abs() * 20 + 1], 1)
        outs = {k: torch.empty(M, device="cuda") for k in ("old", "new")}
        old = {"LSE": lse, "SPLIT": False, "BLOCK_M": 64, "BLOCK_T": 32}
        geo = {"old": old, "new": reductions._rows_consts(lse, T)}

        fns = {k: partial(_finish_reps, parts, outs[k], geo[k]) for k in geo}
        t = {k: ms / REPS for k, ms in _time(fns).items()}
        err = ((outs["old"] - outs["new"]).abs() / outs["old"].abs().clamp_min(1e-30)).max().item()
        gbs = parts.numel() * 4 / 1e6
        print(f"  [{M}, {T}] {'lse' if lse else 'sum'}: old {t['old'] * 1e3:7.1f} us "
              f"({gbs / t['old']:6.0f} GB/s), new {geo['new']} {t['new'] * 1e3:7.1f} us "
              f"({gbs / t['new']:6.0f} GB/s); max rel diff {err:.1e}")  # fmt: skip


def ce_grad(V: int = 128256, M: int = 4096) -> None:
    print(f"== ce grad over stored logits [{M}, {V}] bf16, in place "
          f"(default BLOCK {ce.GRAD_BLOCK}, {ce.GRAD_WARPS} warps)")  # fmt: skip
    logits = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
    lse = torch.stack([torch.logsumexp(logits.float(), 1), torch.zeros(M, device="cuda")])  # (hi, lo)
    target = torch.randint(0, V, (M,), device="cuda")
    scale = torch.full((M,), 1.0 / M, device="cuda")
    fns = {}
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            if block // (32 * warps) < 4:
                continue

            def fn(block=block, warps=warps):
                precompile.launch(ce._ce_grad_kernel, (M,), logits, lse, target, scale, scale, scale, scale,
                                  scale, scale, scale, 0.0, 0.0, V, logits.stride(0), lse.stride(0),
                                  HAS_COEF=False, HAS_W=False, SOFTCAP=False, SMOOTH=False, WRITE=True,
                                  SUM=False, ROWSCALE=False, BLOCK=block, num_warps=warps)  # fmt: skip

            fns[(block, warps)] = fn
    t = _time(fns)
    gb = 2 * M * V * 2 / 1e6
    for k, ms in sorted(t.items(), key=lambda kv: kv[1]):
        print(f"  BLOCK {k[0]:5d} warps {k[1]:2d}: {ms * 1e3:7.1f} us  {gb / ms:6.0f} GB/s")


def ce_grad_shapes(M: int = 4096) -> None:
    """The gradient pass's launch at other vocabulary widths (a vocab slice's 32768 and
    65536, Llama 3's 128256, Qwen's 151936, Gemma's 262144), plain and with the row scale
    (the final norm as factors: dr formed too): each launch's output the 1024 x 4 launch's bits
    (dr within 1e-5 relative: its sum follows the block)."""
    print(f"== ce grad launch by vocabulary width, [{M}, V] bf16 (time / 1024 x 4 warps, the launch "
          f"before {ce.GRAD_BLOCK} x {ce.GRAD_WARPS}; paired / sustained)")  # fmt: skip
    launches = ((1024, 4), (2048, 8), (4096, 16), (8192, 16), (8192, 8))
    for V in (32768, 65536, 128256, 151936, 262144):
        src = torch.randn(M, V, device="cuda", dtype=torch.bfloat16) * 4
        lse = torch.stack([torch.logsumexp(src.float(), 1), torch.zeros(M, device="cuda")])
        target = torch.randint(0, V, (M,), device="cuda")
        scale = torch.full((M,), 1.0 / M, device="cuda")
        r = torch.rand(M, device="cuda") + 0.5
        for rowscale in (False, True):
            outs, fns = {}, {}
            for block, warps in launches:
                logits, dr = src.clone(), torch.empty(M, device="cuda")

                fn = partial(precompile.launch, ce._ce_grad_kernel, (M,), logits, lse, target, scale, scale,
                             scale, scale, scale, r, dr, 0.0, 0.0, V, logits.stride(0), lse.stride(0),
                             HAS_COEF=False, HAS_W=False, SOFTCAP=False, SMOOTH=False, WRITE=True, SUM=False,
                             ROWSCALE=rowscale, BLOCK=block, num_warps=warps)  # fmt: skip
                fn()  # (once on the fresh logits: the outputs compared below)
                outs[(block, warps)] = (logits.clone(), dr.clone())
                fns[(block, warps)] = fn
            t = _time(fns)
            s = sustained_ms(fns, block_ms=30.0, blocks=3, warm_s=0.1, settle_ms=30.0)
            base = launches[0]
            row = []
            for k in launches:
                same = torch.equal(outs[k][0], outs[base][0])
                if rowscale:
                    ref = outs[base][1]
                    same = same and ((outs[k][1] - ref).abs().max() <= 1e-5 * ref.abs().max()).item()
                ratio = f"{t[k] / t[base]:.3f} / {s[k] / s[base]:.3f}"
                row.append(f"{k[0]}x{k[1]} {ratio}{'' if same else ' DIFFERS'}")
            print(f"  V {V:6d} {'row scale' if rowscale else 'plain    '} 1024x4 {t[base] * 1e3:7.1f} us: "
                  + ", ".join(row[1:]), flush=True)  # fmt: skip
        del src


def rms_rows(tokens: int) -> None:
    print("== rowwise RMSNorm backward (dh, x, dres read; dx, n written), bf16, with gamma")
    sms = device.num_sms(0)
    for d in (2048, 4096):
        dh, x, dres = (torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        sumsq = x.float().pow(2).sum(1)
        gamma = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
        block_d = triton.next_power_of_2(d)
        base = norm_rows.rows_launch(d)
        outs, fns = {}, {}
        for bm in (1, 2, 4, 8):
            for warps in (4, 8, 16):
                for per_sm in (2, 4, 8, 16):
                    programs = max(1, min(per_sm * sms, triton.cdiv(tokens, bm)))
                    rpp = triton.cdiv(triton.cdiv(tokens, programs), bm) * bm
                    programs = triton.cdiv(tokens, rpp)
                    dx, n = torch.empty_like(x), torch.empty_like(x)
                    dg = torch.empty(programs, d, device="cuda")
                    key = (bm, warps, per_sm)
                    outs[key] = (dx, n, dg)

                    # (low_ptr and dr_ptr unread: no float32 stream, not the factors' pass)
                    args = (dh, x, dres, sumsq, gamma, dx, n, dg, dx, sumsq, tokens, d, 1.0 / d, 1e-5, rpp)
                    consts = dict(BLOCK_M=bm, BLOCK_D=block_d, HAS_GAMMA=True, HAS_DRES=True, HAS_LOW=False,
                                  FACTORS=False, num_warps=warps)  # fmt: skip
                    kernel = norm_rows._rms_backward_rows_kernel
                    fns[key] = partial(precompile.launch, kernel, (programs,), *args, **consts)
        t = _time(fns)
        ref = outs[(base[0], base[2], 4)]
        gb = 5 * tokens * d * 2 / 1e6
        print(f"  d {d}: default (rows per step {base[0]}, {base[2]} warps, 4 programs per SM) "
              f"{t[(base[0], base[2], 4)] * 1e3:.1f} us")  # fmt: skip
        for k, ms in sorted(t.items(), key=lambda kv: kv[1])[:8]:
            dx, n, dg = outs[k]
            same = torch.equal(dx, ref[0]) and torch.equal(n, ref[1])
            dgerr = ((dg.sum(0) - ref[2].sum(0)).abs().max() / ref[2].sum(0).abs().max()).item()
            print(f"   rows/step {k[0]} warps {k[1]:2d} programs/SM {k[2]:2d}: {ms * 1e3:7.1f} us "
                  f"{gb / ms:6.0f} GB/s  dx, n equal: {same}  dgamma rel {dgerr:.1e}")  # fmt: skip


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    parts = sys.argv[2:] or ["finish", "ce", "rms"]  # (which sweeps: all by default)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "tokens", tokens)
    if "finish" in parts:
        row_finish(tokens)
    if "ce" in parts:
        ce_grad()
    if "cegrid" in parts:
        ce_grad_shapes()
    if "rms" in parts:
        rms_rows(tokens)


if __name__ == "__main__":
    main()

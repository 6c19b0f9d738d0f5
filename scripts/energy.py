"""Energy per GEMM of each mainloop, under sustained load at the power cap (GPU machine).

In a Llama-3.2-1B step codetta's kernels ran at a median SM clock of 1485 MHz where
Liger's (cuBLAS GEMMs) ran at 1620 MHz, both at the 700 W cap, and 1650 MHz with the
portable mainloop only (NOTES.md, runs 50-54): the ping-pong mainloop seems to spend
more energy per FLOP. This tests it on plain GEMMs (no epilogue work): each variant
runs back to back for a few seconds while nvidia-smi samples the clock and the power.
Per variant: ms per GEMM, median SM clock and power, energy per GEMM (power x time)
and SM cycles per GEMM (time x clock: the work, apart from the clock it ran at).

With ``--program NAME ...`` it does the same for GEMMs with those epilogues, as a
model's layer calls them (``--widths``, ``--tokens``; the shapes of ``codetta tune``):
cuBLAS's plain GEMM of the same products, then codetta with each candidate
configuration of both mainloops and the 64-row ping-pong tiles: whether a heavy
epilogue's power goes with the mainloop's operand traffic (it would change with the
tile shape) or with the epilogue's own tile traffic (it would not).

With ``--bytes``: one GEMM (16384 x 4096 x 4096) with epilogues that move one to four
bf16 tiles' worth of HBM bytes (store, accumulate, finish_f32, residual_rms,
accumulate_f32), cuBLAS's mm and addmm, and a memory-bound pass for reference: what an
epilogue's byte costs at the cap (runs 153-155, NOTES.md). Every line also gives the
share of nvidia-smi's samples with each clock event reason (why the clock is below its
maximum: at 16384 tokens every GEMM reads "SW power cap").

Usage: python scripts/energy.py [seconds per variant]
       python scripts/energy.py [seconds] --program dswiglu residual_rms [--widths llama3-1b]
           [--tokens 16384]
       python scripts/energy.py [seconds] --bytes
"""

import argparse
import dataclasses

import torch
from profile_step import Clocks, _operand

import codetta
from codetta.kernels import configs

SHAPES = [  # (M, N, K, layout): the 1B step's long-K and short-K GEMMs
    (16384, 2048, 8192, "nt"),
    (16384, 8192, 2048, "nt"),
    (8192, 2048, 16384, "tt"),
]


def operands(M, N, K, layout):
    a = _operand(M, K, layout[0] == "t", torch.bfloat16)
    return a, _operand(N, K, layout[1] == "t", torch.bfloat16) * K**-0.5


def variants(a, w):
    out = {"cuBLAS": lambda: a @ w.t()}
    portable = [c for c in configs.PLAIN_CANDIDATES if not c.pingpong]
    wide = next(c for c in portable if (c.block_m, c.block_n) == (128, 256))
    out[f"portable {wide.short()}"] = lambda: codetta.gemm(a, w, config=wide)
    for split in (1, 2):
        cfg = configs.Config(128, 128, 64, 8, split, 5, 4, pingpong=True)
        out[f"ping-pong {cfg.short()}"] = lambda cfg=cfg: codetta.gemm(a, w, config=cfg)
    return out


def measure(fn, seconds: float) -> tuple[float, Clocks]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 0
    with Clocks() as clocks:
        start.record()
        while True:
            for _ in range(20):
                fn()
            n += 20
            end.record()
            end.synchronize()
            if start.elapsed_time(end) > seconds * 1e3:
                break
    return start.elapsed_time(end) / n, clocks


def program_cases(names, widths, tokens):
    """(label, FLOPs, {variant: fn}) per distinct call of the named programs."""
    from call_ratios import plain_operands

    from codetta.kernels.operands import make_call
    from codetta.kernels.tuning import candidates
    from codetta.models import widths_of
    from codetta.tune import _probe, _probe_dims, _scaled, call_inputs

    for spec in widths:
        wid = widths_of(spec)
        dims = _probe_dims(wid)
        calls = [_scaled(c, dims, tokens) for c in _probe(wid, torch.bfloat16) if c.program.name in names]
        calls = {(c.program.name, c.a_t, c.b_t, c.M, c.N, c.K): c for c in calls}.values()
        for rec in calls:
            prog = rec.program
            a, w, ops = call_inputs(rec)
            ac, wc = plain_operands(prog, a, w, ops)
            fns = {"cuBLAS": lambda ac=ac, wc=wc: ac @ wc.t()}
            cands = candidates(make_call(prog, a, w, ops))
            r64 = configs.PINGPONG_64_ROW_CANDIDATES
            rows64 = dataclasses.replace(prog, pingpong=True, pingpong_configs=r64)
            width = prog.sub_tile_width
            extra = [c for c in r64 if c not in cands and (not width or c.sub_n == width)]
            for p, cfg in [(prog, c) for c in cands] + [(rows64, c) for c in extra]:
                fns[cfg.short()] = lambda p=p, cfg=cfg, a=a, w=w, ops=ops: codetta.gemm(
                    a, w, epilogue=p, config=cfg, **ops
                )
            label = f"{prog.name} {wid.name} {rec.M}x{rec.N}x{rec.K}"
            yield label, 2 * rec.M * rec.N * rec.K, fns


def byte_cases():
    """The ``--bytes`` case: (label, FLOPs, {variant: fn}); each variant's name ends with its
    epilogue's HBM bytes beyond the operands (MB)."""
    from codetta.programs import ACCUMULATE, ACCUMULATE_F32, FINISH_F32, RESIDUAL_RMS

    M, N, K = 16384, 4096, 4096
    x, w = operands(M, N, K, "nn")  # both row-major, as runs 153-155
    c = _operand(M, N, False, torch.bfloat16)
    c32, gamma = c.float(), torch.rand(N, device="cuda").bfloat16() + 0.5
    out = torch.empty_like(c)
    mb = M * N * 2 // 2**20  # one bf16 [M, N] tensor
    gemm = codetta.gemm
    fns = {
        f"cuBLAS mm ({mb})": lambda: torch.mm(x, w.t(), out=out),
        f"cuBLAS addmm, c bf16 ({2 * mb})": lambda: torch.addmm(c, x, w.t(), out=out),
        f"store ({mb})": lambda: gemm(x, w),
        f"accumulate, c bf16 ({2 * mb})": lambda: gemm(x, w, epilogue=ACCUMULATE, c=c),
        f"finish_f32, c fp32 ({3 * mb})": lambda: gemm(x, w, epilogue=FINISH_F32, c=c32),
        f"residual_rms ({3 * mb})": lambda: gemm(x, w, epilogue=RESIDUAL_RMS, residual=c, gamma=gamma),
        f"accumulate_f32 ({4 * mb})": lambda: gemm(x, w, epilogue=ACCUMULATE_F32, c=c32),
        f"cuBLAS mm again ({mb})": lambda: torch.mm(x, w.t(), out=out),
    }
    yield f"{M}x{N}x{K} epilogue bytes", 2 * M * N * K, fns
    yield "memory-bound pass", 0, {f"torch add ({2 * mb} in, {2 * mb} out)": lambda: torch.add(c32, 1.0)}


def plain_cases():
    for M, N, K, layout in SHAPES:
        a, w = operands(M, N, K, layout)
        yield f"{M}x{N}x{K} {layout}", 2 * M * N * K, variants(a, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("seconds", nargs="?", type=float, default=3.0, help="per variant (default 3)")
    ap.add_argument("--program", nargs="+", help="epilogue programs (default: plain GEMMs)")
    ap.add_argument("--widths", nargs="+", default=["llama3-1b"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--bytes", action="store_true", help="one GEMM, epilogues moving more bytes")
    args = ap.parse_args()
    if args.bytes:
        cases = byte_cases()
    else:
        cases = program_cases(args.program, args.widths, args.tokens) if args.program else plain_cases()
    head = f"{'case':<40} {'variant':<24} {'ms':>7} {'TFLOP/s':>8} {'MHz':>6} {'W':>5} {'mJ':>7}"
    print(f"{head} {'Mcycles':>8}  clock held back by")
    for label, flops, fns in cases:
        for name, fn in fns.items():
            try:
                ms, clocks = measure(fn, args.seconds)
            except Exception as exc:  # a 64-row tile that does not fit this program: say so, go on
                print(f"{label:<40} {name:<24} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            v = clocks.samples[len(clocks.samples) // 4 :] or [(float("nan"), float("nan"))]
            mhz = sorted(c for c, _ in v)[len(v) // 2]
            watts = sorted(p for _, p in v)[len(v) // 2]
            print(f"{label:<40} {name:<24} {ms:7.3f} {flops / ms / 1e9:8.0f} {mhz:6.0f} "
                  f"{watts:5.0f} {watts * ms:7.1f} {ms * mhz / 1e3:8.2f}  {clocks.why()}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""Host time per call of codetta's launches, with the direct launch path (kernels/direct.py)
on and off, against PyTorch's own launches (GPU machine).

Each piece is timed at a tiny shape (the GPU never the bottleneck) in blocks of calls,
the two settings taking turns block after block (the host's speed drifts); the table
gives each setting's best block. Then a cProfile of the default path's GEMM and K1 calls.

Usage (repo root): python scripts/profile_launch.py [--no-profile]
"""

import cProfile
import pstats
import sys

import torch

import codetta
from codetta.bench import qkv
from codetta.bench.harness import cpu_overhead_us
from codetta.kernels import direct
from codetta.kernels.reductions import col_sum
from codetta.kernels.settings import override
from codetta.programs import RESIDUAL_RMS
from codetta.programs.norm_rows import gamma_sumsq, rms_backward_rows
from codetta.programs.rope import unrotate_half_rows

dev, bf = "cuda", torch.bfloat16
a = torch.randn(64, 256, device=dev, dtype=bf)
w = torch.randn(256, 256, device=dev, dtype=bf)
r = torch.randn(64, 256, device=dev, dtype=bf)
g = torch.rand(256, device=dev)
x = torch.randn(128, 2048, device=dev, dtype=bf)
gx = torch.rand(2048, device=dev, dtype=bf) + 0.5
sumsq = x.float().pow(2).sum(1)
dq = torch.randn(128, 2048, device=dev, dtype=bf)
pos = torch.arange(128, device=dev)
inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, device=dev, dtype=torch.float32) / 64))
parts = torch.randn(16, 2048, device=dev)
tiny = qkv.problem("1B", batch=1, seq=128)

PIECES = {
    "torch add (PyTorch's launch)": lambda: x.add(1.0),
    "cuBLAS mm 64x256x256": lambda: a @ w.t(),
    "codetta.gemm store": lambda: codetta.gemm(a, w),
    "codetta.gemm K1 (RESIDUAL_RMS)": lambda: codetta.gemm(a, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g),
    "gamma_sumsq (row pass)": lambda: gamma_sumsq(x, gx),
    "rms_backward_rows (row pass)": lambda: rms_backward_rows(dq, x, None, sumsq, gx, 1e-5),
    "unrotate_half_rows (row pass)": lambda: unrotate_half_rows(dq, pos, inv_freq, 1.0),
    "col_sum (row pass)": lambda: col_sum(parts),
    "q/k/v op fwd+bwd, 1B, 128 tokens": qkv.fwd_bwd(tiny, qkv.codetta),
}


def main() -> None:
    print(f"direct launches usable: {direct.usable()}")
    rows = []
    for name, fn in PIECES.items():
        calls = 50 if "fwd+bwd" in name else 300
        best = {True: float("inf"), False: float("inf")}
        for _ in range(5):  # (each block warms its path first: cpu_overhead_us)
            for on in (True, False):
                with override(direct_launch=on):
                    best[on] = min(best[on], cpu_overhead_us(fn, calls))
        rows.append((name, best[True], best[False]))
        print(f"  {name:34s} direct {best[True]:8.1f} us   Triton's path {best[False]:8.1f} us")
    print("\n| piece | direct (us/call) | Triton's path (us/call) |\n|---|---|---|")
    for name, on, off in rows:
        print(f"| {name} | {on:.1f} | {off:.1f} |")
    if "--no-profile" in sys.argv:
        return
    for name in ("codetta.gemm store", "codetta.gemm K1 (RESIDUAL_RMS)", "q/k/v op fwd+bwd, 1B, 128 tokens"):
        fn = PIECES[name]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        print(f"--- {name}: where the host time goes (cProfile, 200 calls)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()

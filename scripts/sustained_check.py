"""Does a sustained-timing block inherit the clock state of the block before it?

Times, in one process, cuBLAS's GEMM and the same codetta K1 call as two variants ("A"
and "B", identical work) under ``timing.sustained_ms`` with each ``settle_ms`` asked
for (default: 0, the method of the runs before 2026-12-01's last, and 120), and prints
B / A per shape. Identical variants should agree: a gap that shrinks with settling says
the block order, not the kernel, moved the ratio (runs 91-93, NOTES.md). GPU only.

Usage (repo root): PYTHONPATH=. python3 scripts/sustained_check.py [SETTLE_MS ...]
"""

import sys

import torch

from codetta import gemm
from codetta.bench.harness import rand_bf16
from codetta.kernels.timing import paired_ms, sustained_ms
from codetta.programs import RESIDUAL_RMS

M = 16384
SHAPES = [(2048, 2048), (4096, 4096), (2048, 8192)]


def row(N: int, K: int, settles) -> str:
    y, w = rand_bf16(M, K), rand_bf16(N, K, scale=K**-0.5)
    r, g = rand_bf16(M, N), torch.rand(N, device="cuda") + 0.5
    fns = {
        "cublas": lambda: y @ w.t(),
        "A": lambda: gemm(y, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g),
        "B": lambda: gemm(y, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g),
    }
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    p = paired_ms(fns)
    cells = [f"{p['B'] / p['A']:8.3f}"]
    for settle in settles:
        t = sustained_ms(fns, settle_ms=settle)
        cells.append(f"{t['B'] / t['A']:11.3f}")
    return f"{f'{N}x{K}':>12} " + " ".join(cells)


def main() -> None:
    settles = [float(a) for a in sys.argv[1:]] or [0.0, 120.0]
    print(f"{torch.cuda.get_device_name()}; K1 at M {M}; B / A of two identical codetta variants")
    print(f"{'N x K':>12} {'paired':>8} " + " ".join(f"{'settle ' + str(int(s)):>11}" for s in settles))
    for N, K in SHAPES:
        print(row(N, K, settles), flush=True)


if __name__ == "__main__":
    main()

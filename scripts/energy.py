"""Energy per GEMM of each mainloop, under sustained load at the power cap (GPU machine).

In a Llama-3.2-1B step codetta's kernels ran at a median SM clock of 1485 MHz where
Liger's (cuBLAS GEMMs) ran at 1620 MHz, both at the 700 W cap, and 1650 MHz with the
portable mainloop only (NOTES.md, runs 50-54): the ping-pong mainloop seems to spend
more energy per FLOP. This tests it on plain GEMMs (no epilogue work): each variant
runs back to back for a few seconds while nvidia-smi samples the clock and the power.
Per variant: ms per GEMM, median SM clock and power, energy per GEMM (power x time)
and SM cycles per GEMM (time x clock: the work, apart from the clock it ran at).

Usage: python scripts/energy.py [seconds per variant]
"""

import sys

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


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    head = f"{'shape':<24} {'variant':<34} {'ms':>7} {'TFLOP/s':>8} {'MHz':>6} {'W':>5} {'mJ':>7}"
    print(f"{head} {'Mcycles':>8}")
    for M, N, K, layout in SHAPES:
        a, w = operands(M, N, K, layout)
        for name, fn in variants(a, w).items():
            ms, clocks = measure(fn, seconds)
            v = clocks.samples[len(clocks.samples) // 4 :] or [(float("nan"), float("nan"))]
            mhz = sorted(c for c, _ in v)[len(v) // 2]
            watts = sorted(p for _, p in v)[len(v) // 2]
            print(f"{M}x{N}x{K} {layout:<6} {name:<34} {ms:7.3f} {2 * M * N * K / ms / 1e9:8.0f} {mhz:6.0f} "
                  f"{watts:5.0f} {watts * ms:7.1f} {ms * mhz / 1e3:8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

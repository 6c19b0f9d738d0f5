"""cProfile of ``codetta.gemm`` calls that each see a token count (M) not seen before:
every call misses the bound launcher and takes the full path (GPU machine). Prints the
host time per call (plain GEMM and K1) and the profile's top functions.

Usage (repo root): python scripts/profile_new_m.py
"""

import torch

from codetta import gemm
from codetta.bench.harness import cpu_overhead_us, profile_calls
from codetta.programs import RESIDUAL_RMS

dev, bf = "cuda", torch.bfloat16
top = 8192
a = torch.randn(top, 256, device=dev, dtype=bf)
r = torch.randn(top, 256, device=dev, dtype=bf)
w = torch.randn(256, 256, device=dev, dtype=bf)
g = torch.rand(256, device=dev)
ms = iter(range(1024, top))


def plain():
    m = next(ms)
    return gemm(a[:m], w)


def k1():
    m = next(ms)
    return gemm(a[:m], w, epilogue=RESIDUAL_RMS, residual=r[:m], gamma=g)


for fn in (plain, k1):
    print(f"{fn.__name__}: {cpu_overhead_us(fn, 200):.0f} us/call, a new M each call")
    profile_calls(fn, 200, f"{fn.__name__}, a new M each call", rows=35)

"""Where the host time of one codetta.gemm call goes (GPU machine)."""

import cProfile
import pstats
import time

import torch

import codetta
from codetta.programs import RESIDUAL_RMS

a = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
r = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
g = torch.rand(256, device="cuda")
for _ in range(20):
    codetta.gemm(a, w)
    codetta.gemm(a, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g)
torch.cuda.synchronize()
from codetta.bench.harness import cpu_overhead_us  # noqa: E402
from codetta.kernels import direct, launch  # noqa: E402

print(f"direct launches usable: {direct.usable()}")
for name, fn in [
    ("cublas", lambda: a @ w.t()),
    ("store", lambda: codetta.gemm(a, w)),
    ("k1", lambda: codetta.gemm(a, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g)),
]:
    print(f"{name}: {cpu_overhead_us(fn):.1f} us/call host (harness.cpu_overhead_us)")
print(f"bound call signatures: {len(launch._BOUND)}")
for name, fn in [
    ("cublas", lambda: a @ w.t()),
    ("store", lambda: codetta.gemm(a, w)),
    ("k1", lambda: codetta.gemm(a, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g)),
]:
    t0 = time.perf_counter()
    for _ in range(1000):
        fn()
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t0) * 1e3:.1f} us/call (1000 calls and a sync)")
for name, fn in [
    ("store", lambda: codetta.gemm(a, w)),
    ("k1", lambda: codetta.gemm(a, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g)),
]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(1000):
        fn()
    prof.disable()
    print(f"--- {name}: where the host time goes (cProfile, 1000 calls)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)

"""cProfile of ``codetta.gemm`` calls that each see a token count (M) not seen before:
every call misses the bound launcher and takes the full path (GPU machine). Prints the
host time per call (plain GEMM and K1) and the profile's top functions.

Usage (repo root): python scripts/profile_new_m.py
"""

from codetta.bench.foundation import new_m_calls
from codetta.bench.harness import cpu_overhead_us, profile_calls

fns = new_m_calls()  # (1024 new counts: 2 x (210 timed + 200 profiled) calls take 820)
for name in ("codetta", "codetta-k1"):
    print(f"{name}: {cpu_overhead_us(fns[name], 200):.0f} us/call, a new M each call")
    profile_calls(fns[name], 200, f"{name}, a new M each call", rows=35)

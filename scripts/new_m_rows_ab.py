"""A/B of the row passes' direct launch at a new token count each call (GPU machine):
``direct.launch_jit`` keys a plain int argument by its Triton specialization class (a new
row count of a class seen before binds to the compiled kernel), against keying it by its
value (the way before: every new count takes Triton's full launch path and binds anew).

Host us per call of K1 (its GEMM plus the row pass that finishes the norm's sums) and of
plain gemm (no row pass: the control) at [M, 256] x [256, 256], M new on every call,
alternating A and B in rounds, the garbage collector off during the timed calls (its
passes would land in either side at random: NOTES.md, "Session 49").

Usage (repo root): python scripts/new_m_rows_ab.py [ROUNDS]
"""

import gc
import statistics
import sys

from codetta.bench.foundation import new_m_calls
from codetta.bench.harness import cpu_overhead_us
from codetta.kernels import direct

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
_CLASS_SPECS = direct._specs


def _value_specs(jit_fn, args):
    return tuple(map(direct._spec, args))


def timed(name: str, by_value: bool, first: int) -> float:
    direct._specs = _value_specs if by_value else _CLASS_SPECS
    fn = new_m_calls(first=first)[name]
    gc.collect()
    gc.disable()
    try:
        return cpu_overhead_us(fn, 150, collect=False)
    finally:
        gc.enable()
        direct._specs = _CLASS_SPECS


results: dict = {}
first = 1024
for r in range(ROUNDS):
    for name in ("codetta-k1", "codetta"):
        for by_value in (False, True):
            us = timed(name, by_value, first)
            first += 1024  # (counts never seen before by any earlier set)
            results.setdefault((name, by_value), []).append(us)
            way = "by value" if by_value else "by class"
            print(f"round {r}: {name:11s} {way}: {us:.0f} us/call", flush=True)

print("\nmedian host us/call, a new M each call (collector off):")
for (name, by_value), v in results.items():
    way = "by value (before)" if by_value else "by class (now)"
    print(f"  {name:11s} {way:18s} {statistics.median(v):6.0f}")

"""Paired GPU timing: the variants of one measurement alternate call by call.

The H200 runs large GEMMs at its 700 W power cap, where the SM clock moves
between about 1.3 and 1.6 GHz on a 10-100 ms scale. Timing each variant over
its own stretch of time (even interleaved in rounds) left +-3 % between
variants that ran identical kernels (NOTES.md, runs 13-15); calls made side by
side see the same clock, and the median over many such calls is stable to
about 0.3 % (run 16). The tuner and the benchmark harness both time this way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable

import torch


def paired_ms(
    fns: dict[Hashable, Callable[[], object]],
    min_s: float = 2.0,
    min_cycles: int = 25,
    max_cycles: int = 400,
    warm_s: float = 1.0,
) -> dict[Hashable, float]:
    """Median GPU time in ms of each callable: after ``warm_s`` seconds of sustained
    load, the callables run one call each in turn (the order rotating from cycle to
    cycle) for at least ``min_s`` seconds of GPU time and ``min_cycles`` cycles, every
    call timed with its own CUDA events on the current stream. No cache flush: the
    working sets here (tens of MB and up) do not stay in the 50 MB L2 from one call
    to the next. The callables must already be compiled (call each once first)."""
    keys = list(fns)
    cycle_ms = 0.0
    for k in keys:  # one timed call each sizes the run
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fns[k]()
        e.record()
        e.synchronize()
        cycle_ms += s.elapsed_time(e)
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        for fn in fns.values():
            fn()
    cycles = max(min_cycles, min(max_cycles, math.ceil(min_s * 1e3 / max(cycle_ms, 1e-3))))
    events = []
    for c in range(cycles):
        r = c % len(keys)
        for k in keys[r:] + keys[:r]:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fns[k]()
            e.record()
            events.append((k, s, e))
    torch.cuda.synchronize()
    times: dict[Hashable, list[float]] = {k: [] for k in keys}
    for k, s, e in events:
        times[k].append(s.elapsed_time(e))
    return {k: sorted(ts)[len(ts) // 2] for k, ts in times.items()}

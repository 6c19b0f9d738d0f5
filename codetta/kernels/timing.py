"""GPU timing of variants side by side: paired (call by call) and sustained blocks.

The H200 runs large GEMMs at its 700 W power cap, where the SM clock moves
between about 1.3 and 1.6 GHz on a 10-100 ms scale. Timing each variant over
its own stretch of time (even interleaved in rounds) left +-3 % between
variants that ran identical kernels (NOTES.md, runs 13-15); calls made side by
side see the same clock, and the median over many such calls is stable to
about 0.3 % (run 16). Paired timing alone moved some ratios by 3-10 % against
sustained blocks of one variant at a time (NOTES.md), so the benchmark harness
reports both (a ratio counts only if it holds under each). The tuner times
paired (sustained-block tuning picked worse configs, NOTES.md).
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


def sustained_ms(
    fns: dict[Hashable, Callable[[], object]],
    block_ms: float = 120.0,
    blocks: int = 5,
    warm_s: float = 0.5,
    settle_ms: float = 120.0,
) -> dict[Hashable, float]:
    """Median GPU time in ms of each callable run back to back in blocks: each block
    runs one callable for about ``block_ms`` between two CUDA events (no gaps, no L2
    flush), right after ``settle_ms`` of the same callable untimed; blocks alternate
    between the callables, the order rotating each round; the median over ``blocks``
    rounds. Closest to a training loop, where a kernel runs next to its own kind: at
    the 700 W cap a variant's power draw sets the clock it runs at, which paired timing
    averages between the variants. The settling run is there because a block started
    in the clock state the previous variant left: without it, of two variants running
    the same kernels the one that followed cuBLAS's block timed 1-5 % faster than the
    one that followed a codetta block (runs 91-93, NOTES.md)."""
    keys = list(fns)
    per_call = {}
    for k in keys:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fns[k]()
        e.record()
        e.synchronize()
        per_call[k] = max(s.elapsed_time(e), 1e-3)
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        for fn in fns.values():
            fn()
    calls = {k: max(1, math.ceil(block_ms / per_call[k])) for k in keys}
    settle = {k: math.ceil(settle_ms / per_call[k]) for k in keys}
    times: dict[Hashable, list[float]] = {k: [] for k in keys}
    for b in range(blocks):
        r = b % len(keys)
        for k in keys[r:] + keys[:r]:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn, n = fns[k], calls[k]
            for _ in range(settle[k]):
                fn()
            s.record()
            for _ in range(n):
                fn()
            e.record()
            e.synchronize()
            times[k].append(s.elapsed_time(e) / n)
    return {k: sorted(ts)[len(ts) // 2] for k, ts in times.items()}

"""Per-kernel GPU time of one o-proj + residual + RMSNorm + next GEMM fwd+bwd step,
for cuBLAS (GEMMs only), codetta and torch.compile: where the time over cuBLAS goes.

Usage (GPU, repo root): PYTHONPATH=. python scripts/breakdown.py [1B 8B]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from codetta.bench import residual_norm as rn


def kernels(fn, iters=10, warm_s=1.0):
    """Per-kernel GPU time of one call of fn, the median over ``iters`` profiled calls
    made after ``warm_s`` seconds of sustained load (a cold GPU runs these kernels at
    boost clocks, 10-20 % faster than in training)."""
    import statistics
    import time

    fn()
    torch.cuda.synchronize()
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    evs = sorted(
        (e.time_range.start, e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    per = len(evs) // iters
    if per * iters != len(evs):  # kernels differ between calls: every call's, each at 1/iters of its time
        print(f"   (the calls launched different kernels: {len(evs)} in {iters} calls, each listed at "
              f"1/{iters} of its time, so the sum is the mean call's)")  # fmt: skip
        return [(name, us / iters) for _, name, us in evs]
    return [(evs[i][1], statistics.median(evs[k * per + i][2] for k in range(iters))) for i in range(per)]


def width_breakdown(width):
    p = rn.problem(width)
    variants = {
        "cublas": rn.cublas_gemms(p, backward=True),
        "codetta": rn.fwd_bwd(rn._codetta, p),
        "codetta-foldgamma": rn.fwd_bwd(rn._codetta_fold_gamma, p),
        "torch.compile": rn.fwd_bwd(rn._compiled, p),
    }
    for name, fn in variants.items():
        ks = kernels(fn)
        total = sum(us for _, us in ks)
        print(f"== {width} {name}: {len(ks)} kernels, {total:.0f} us of kernel time")
        for kname, us in ks:
            print(f"   {us:8.1f} us  {kname[:110]}")


if __name__ == "__main__":
    for width in sys.argv[1:] or ["1B", "8B"]:
        width_breakdown(width)

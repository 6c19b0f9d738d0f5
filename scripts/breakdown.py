"""Per-kernel GPU time of one o-proj + residual + RMSNorm + next GEMM fwd+bwd step,
for cuBLAS (GEMMs only), codetta and torch.compile: where the time over cuBLAS goes.

Usage (GPU, repo root): PYTHONPATH=. python scripts/breakdown.py [1B 8B]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from codetta.bench import residual_norm as rn


def kernels(fn, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.time_range.start, e.name, e.time_range.elapsed_us()))
    return [(name, us) for _, name, us in sorted(out)]


def width_breakdown(width):
    M = rn.M
    K, d, N = rn.WIDTHS[width]
    r = lambda *s, scale=1.0: (torch.randn(*s, device="cuda") * scale).to(torch.bfloat16)  # noqa: E731
    leaves = [r(M, K), r(d, K, scale=K**-0.5), r(M, d), (torch.rand(d, device="cuda") + 0.5).bfloat16(),
              r(N, d, scale=d**-0.5)]  # fmt: skip
    leaves = [t.requires_grad_() for t in leaves]
    dx, dz, n = r(M, d), r(M, N), r(M, d)
    y, w_o, res, g, w = leaves

    def gemms():
        with torch.no_grad():
            return (y @ w_o.t(), n @ w.t(), dz @ w, dz.t() @ n, dx @ w_o, dx.t() @ y)

    variants = {
        "cublas": gemms,
        "codetta": lambda: torch.autograd.grad(rn._codetta(*leaves), leaves, (dx, dz)),
        "torch.compile": lambda: torch.autograd.grad(rn._compiled(*leaves), leaves, (dx, dz)),
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

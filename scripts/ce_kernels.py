"""Where the LM head + loss's time over cuBLAS goes: each GPU kernel of one forward+backward
call (bench ce's problem), in launch order, the median over profiled calls made after a
second of sustained load, for cuBLAS's three GEMMs and codetta's variants; then each
variant's kernels summed by name, and its wall time per call against its kernel time
(the difference: the GPU idle between kernels, such as the probabilities path's host sync).

Usage (GPU machine, repo root):
  PYTHONPATH=. python scripts/ce_kernels.py [--shapes 16384x4096x128256 ...]
      [--variants codetta codetta:ce-probs]
(default: T 16384, d 4096, V 128256; variants codetta and codetta:ce-probs; names as bench
ce's ``CODETTA_VARIANTS``)
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from breakdown import kernels

from codetta.bench import ce


def wall_ms(fn, calls: int = 10) -> float:
    """Median wall time of one call (CUDA events around each), after a warm call."""
    fn()
    times = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def show(title: str, fn) -> float:
    ks = kernels(fn)
    total = sum(us for _, us in ks) / 1e3
    wall = wall_ms(fn)
    print(f"== {title}: {len(ks)} kernels, {total:.3f} ms of kernel time, {wall:.3f} ms wall "
          f"({wall - total:+.3f} ms idle or overlapped)")  # fmt: skip
    for name, us in ks:
        print(f"   {us:9.1f} us  {name[:110]}")
    by_name = defaultdict(lambda: [0.0, 0])
    for name, us in ks:
        by_name[name][0] += us
        by_name[name][1] += 1
    print("   -- by name")
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0]):
        print(f"   {us / 1e3:8.3f} ms  x{n:<3d} {name[:100]}")
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["16384x4096x128256"], help="TxdxV")
    ap.add_argument("--variants", nargs="+", default=["codetta", "codetta:ce-probs"],
                    choices=sorted(ce.CODETTA_VARIANTS))  # fmt: skip
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for shape in args.shapes:
        tokens, d, V = (int(s) for s in shape.split("x"))
        p = ce.problem(tokens, d, V)
        (x, w), t = p["leaves"], p["target"]
        case = f"T {tokens} d {d} V {V}"
        base = show(f"{case} cuBLAS GEMMs (logits, dX, dW)", ce.cublas_gemms(p, backward=True))
        for name in args.variants:
            fn = ce.CODETTA_VARIANTS[name]

            def step(fn=fn, x=x, w=w, t=t):
                return torch.autograd.grad(fn(x, w, t), (x, w))

            ours = show(f"{case} {name} fwd+bwd", step)
            print(f"   {name}: kernel time / cuBLAS kernel time {ours / base:.3f}")


if __name__ == "__main__":
    main()

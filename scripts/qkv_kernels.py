"""Each GPU kernel of the q/k/v operator's forward and backward (bench qkv's cases),
with its time per call, from torch.profiler; and each cuBLAS GEMM of the same shapes.

Usage (GPU machine, repo root): PYTHONPATH=. python scripts/qkv_kernels.py [case ...]
(default: 8B qwen3-8B)
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from codetta.bench import qkv


def kernel_table(fn, n: int = 10) -> list[tuple[str, float, int]]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time_total
            count[ev.name] += 1
    return sorted(((k, total[k] / n / 1e3, count[k] // n) for k in total), key=lambda r: -r[1])


def show(title: str, rows) -> None:
    print(f"== {title}: {sum(r[1] for r in rows):.3f} ms of kernels per call")
    for name, ms, calls in rows:
        print(f"   {ms:8.3f} ms  x{calls}  {name[:110]}")


def one_case(case: str) -> None:
    p = qkv.problem(case)
    leaves = p["leaves"]
    grads = []

    def fwd():
        with torch.no_grad():
            return qkv.codetta(p, *leaves)

    def fwd_bwd():
        out = qkv.codetta(p, *leaves)
        if not grads:
            grads.extend(qkv._grads_like(out, p["grads"]))
        torch.autograd.grad(out, leaves, grads)

    show(f"{case} codetta forward (no grad)", kernel_table(fwd))
    show(f"{case} codetta forward (grad enabled)", kernel_table(lambda: qkv.codetta(p, *leaves)))
    show(f"{case} codetta forward+backward", kernel_table(fwd_bwd))
    show(f"{case} cuBLAS forward GEMMs", kernel_table(qkv.cublas_gemms(p, backward=False)))
    show(f"{case} cuBLAS forward+backward GEMMs", kernel_table(qkv.cublas_gemms(p, backward=True)))
    liger = qkv.liger_fn()
    if liger is not None:
        show(f"{case} Liger forward (grad enabled)", kernel_table(lambda: liger(p, *leaves)))


def main() -> None:
    for case in sys.argv[1:] or ["8B", "qwen3-8B"]:
        one_case(case)


if __name__ == "__main__":
    main()

"""The host's time per forward + backward of the norm + q/k/v (+ RoPE) operator, and where
it goes (GPU machine).

bench qkv at 1B width ran codetta 2.4x slower back to back (sustained) than interleaved
with other variants (paired), while its GPU work is ~1 ms (NOTES.md, run 73): the host
issues the work slower than the GPU runs it. This prints, per variant of
``codetta.bench.qkv``: the host's time per fwd+bwd at a tiny token count (the GPU never
the bottleneck), the GPU's time per fwd+bwd back to back at the benchmark's 16384 tokens,
whether a fwd+bwd synchronizes with the GPU (CUDA sync debug mode), and a cProfile of
codetta's fwd+bwd (the host's hot spots).

Usage: python scripts/host_qkv.py [case] [trace] (default 1B; trace: torch.profiler of the backward)
"""

import sys
import warnings

import torch

from codetta.bench import qkv
from codetta.bench.harness import cpu_overhead_us, profile_calls, with_settings


def gpu_ms(run, n: int = 20) -> float:
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def syncs(run) -> int:
    """How many host-GPU synchronizations one call makes (CUDA sync debug mode warnings)."""
    run()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught[:3]:
        print(f"    sync: {str(w.message)[:160]}")
    return len(caught)


def pieces(p) -> None:
    """Host us per call of the pieces a fwd+bwd is made of (128 tokens): one PyTorch launch,
    one codetta GEMM, one row kernel, the operator's forward with and without autograd."""
    import codetta
    from codetta.programs.norm_rows import gamma_sumsq
    from codetta.programs.rope import unrotate_half_rows

    x, gamma, wq = (t.detach() for t in p["leaves"][:3])
    rows = x.reshape(-1, x.shape[-1])
    dq = torch.randn(rows.shape[0], wq.shape[0], device="cuda", dtype=x.dtype)
    leaves = p["leaves"]

    def fwd_grad():
        return qkv.codetta(p, *leaves)

    def fwd_nograd():
        with torch.no_grad():
            return qkv.codetta(p, *leaves)

    def eager_grad():
        return qkv.eager(p, *leaves)

    items = {
        "torch add (1 launch)": lambda: rows.add(1.0),
        "torch empty": lambda: torch.empty(rows.shape, device="cuda", dtype=x.dtype),
        "codetta.gemm (store)": lambda: codetta.gemm(rows, wq),
        "gamma_sumsq (row kernel)": lambda: gamma_sumsq(rows, gamma),
        "unrotate_half_rows": lambda: unrotate_half_rows(dq, p["positions"].reshape(-1), p["inv_freq"], 1.0),
        "codetta fwd, no grad": fwd_nograd,
        "codetta fwd, grad": fwd_grad,
        "eager fwd, grad": eager_grad,
        "autograd.grad of x.sum()": lambda: torch.autograd.grad(leaves[0].sum(), leaves[0]),
    }
    for name, fn in items.items():
        print(f"  piece {name:28s} {cpu_overhead_us(fn, calls=200):8.1f} us host per call")
    for name, fn in (("codetta", qkv.codetta), ("eager", qkv.eager)):
        backward_alone(p, name, fn)


def prebuilt(p, fn, n: int, warm: int = 3):
    """(leaves, n forward graphs of ``fn`` not yet backpropagated, their incoming
    gradients), after ``warm`` forward + backward calls."""
    leaves = p["leaves"]
    outs = [fn(p, *leaves) for _ in range(n + warm)]
    grads = qkv._grads_like(outs[0], p["grads"])
    for o in outs[:warm]:
        torch.autograd.grad(o, leaves, grads)
    torch.cuda.synchronize()
    return leaves, outs[warm:], grads


def backward_alone(p, name, fn, n: int = 50) -> None:
    """The backward's host time apart from the forward's: n graphs built first, then n
    ``autograd.grad`` calls timed (host, and GPU by events), at the tiny shape."""
    import time

    leaves, outs, grads = prebuilt(p, fn, n)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for o in outs:
        torch.autograd.grad(o, leaves, grads)
    end.record()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"  piece {name} backward alone: host {(t1 - t0) / n * 1e6:8.1f} us, GPU "
          f"{start.elapsed_time(end) / n * 1e3:8.1f} us per call (128 tokens)")  # fmt: skip


def trace(p, name, fn, n: int = 5) -> None:
    """torch.profiler's CPU and CUDA time per op of ``n`` backward calls (prebuilt graphs)."""
    from torch.profiler import ProfilerActivity, profile

    leaves, outs, grads = prebuilt(p, fn, n)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for o in outs:
            torch.autograd.grad(o, leaves, grads)
        torch.cuda.synchronize()
    for key in ("self_cpu_time_total", "self_device_time_total"):
        print(f"== {name}: {n} backward calls (128 tokens), torch.profiler by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60))


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "1B"
    if len(sys.argv) > 2 and sys.argv[2] == "trace":
        tiny = qkv.problem(case, batch=1, seq=128)
        for name, fn in (("codetta", qkv.codetta), ("eager", qkv.eager)):
            trace(tiny, name, fn)
        return
    variants = {"eager": qkv.eager, "codetta": qkv.codetta}
    liger = qkv.liger_fn()
    if liger is not None:
        variants["liger"] = liger
    variants["codetta:qkv-one-launch"] = with_settings(qkv.codetta, qkv_one_launch=True)
    tiny = qkv.problem(case, batch=1, seq=128)
    full = qkv.problem(case)
    for name, fn in variants.items():
        small, big = qkv.fwd_bwd(tiny, fn), qkv.fwd_bwd(full, fn)
        host = cpu_overhead_us(small, calls=100) / 1e3
        print(f"== {case} {name}: host {host:.3f} ms per fwd+bwd (128 tokens; {gpu_ms(small):.3f} ms back to "
              f"back by events), GPU {gpu_ms(big):.3f} ms per fwd+bwd back to back (16384 tokens), syncs per "
              f"call {syncs(small)}")  # fmt: skip
    pieces(tiny)
    for name in ("codetta",):
        run = qkv.fwd_bwd(tiny, variants[name])
        for _ in range(5):
            run()
        profile_calls(run, 50, f"{name}: cProfile of 50 fwd+bwd (128 tokens)", rows=35)


if __name__ == "__main__":
    main()

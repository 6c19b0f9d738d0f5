"""The norm + q/k/v operator's own host time, without any kernel (CPU, no GPU needed).

Every kernel the operator launches (its GEMMs and row passes) is replaced by a stub that
only allocates its outputs, so what is timed is the operator's Python and PyTorch's
autograd around it. Beside it, an ``autograd.Function`` that does nothing with the same
inputs, outputs and views: PyTorch's own floor for such an operator. (NOTES.md, "The
host's time per q/k/v fwd+bwd".)

Usage (repo root): PYTHONPATH=. python scripts/host_stub.py [--profile]
"""

from __future__ import annotations

import cProfile
import importlib
import sys
import time

import torch

from codetta.bench import qkv
from codetta.bench.harness import print_profile

rr = importlib.import_module("codetta.ops.residual_rmsnorm")  # (codetta.ops exports a function so named)
nb = importlib.import_module("codetta.ops.norm_backward")  # (the norm's backward and the next dW GEMMs)


def _stub_gemm(a, w, *, epilogue=None, out=None, **operands):
    from codetta.programs import STORE

    prog = epilogue or STORE
    outs = [torch.empty(a.shape[0], w.shape[0], dtype=a.dtype) for _ in prog.outputs]
    return outs[0] if len(outs) == 1 else prog.result(*outs)


def stub_kernels() -> None:
    """Replace the operator module's kernels by output allocations."""
    rr.gemm = _stub_gemm
    rr.gamma_sumsq = lambda x, g, dtype=None: (torch.empty_like(x, dtype=dtype), torch.empty(x.shape[0]))
    rr.unrotate_half_rows = lambda d, pos, half, scaling, pairs=False, **kw: torch.empty_like(d)
    rr.unrotate_two_rows = lambda q, k, pos, half, scaling, pairs=False, **kw: (
        torch.empty_like(q), torch.empty_like(k)
    )  # fmt: skip
    nb.gemm = _stub_gemm
    nb.rms_backward_rows = lambda h, x, dx, sumsq, gamma, eps, dx_out=None, low_out=None: (
        h, torch.empty_like(x), torch.empty(4, x.shape[1])
    )  # fmt: skip
    nb.col_sum = lambda parts, dtype=None: torch.empty(parts.shape[1], dtype=dtype)
    nb.rms_backward_finish = lambda dn, x, dx, sumsq, zeta, gamma, eps, **kw: (dn, torch.empty_like(x))
    for mod in (rr, nb):  # every kernel the operator's modules call is stubbed, or this times it
        missed = [n for n in ("gemm", "rms_backward_rows", "col_sum", "rms_backward_finish")
                  if hasattr(mod, n) and getattr(mod, n).__module__ not in (__name__,)]  # fmt: skip
        if missed:
            raise RuntimeError(f"host_stub: {mod.__name__} calls kernels not stubbed here: {missed}")


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, wq, wk, wv):
        rows = x.shape[0] * x.shape[1]
        return tuple(x.new_empty(rows, w.shape[0]) for w in (wq, wk, wv))

    @staticmethod
    def backward(ctx, *grads):
        return None, None, None, None, None


def nothing(p, x, gamma, wq, wk, wv, *qk):
    """The benchmark's views around an operator that does nothing."""
    B, S, hd = p["batch"], p["seq"], p["head_dim"]
    return tuple(t.view(B, S, -1, hd).transpose(1, 2) for t in _Nothing.apply(x, gamma, wq, wk, wv))


def us_per_call(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    stub_kernels()
    p = qkv.problem("1B", device="cpu", dtype=torch.float32, batch=1, seq=128)
    leaves = p["leaves"]
    for name, op in (("nothing (PyTorch's floor)", nothing), ("codetta, kernels stubbed", qkv.codetta)):
        grads = qkv._grads_like(op(p, *leaves), p["grads"])

        def fwd(op=op):
            return op(p, *leaves)

        def fwd_bwd(op=op, grads=grads):
            return torch.autograd.grad(op(p, *leaves), leaves, grads, allow_unused=True)

        print(f"{name:28s} fwd {us_per_call(fwd):7.1f} us, fwd+bwd {us_per_call(fwd_bwd):7.1f} us")
        if "--profile" in sys.argv and op is qkv.codetta:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                fwd_bwd()
            prof.disable()
            print_profile(prof, "codetta, kernels stubbed: cProfile of 300 fwd+bwd", rows=30)


if __name__ == "__main__":
    main()

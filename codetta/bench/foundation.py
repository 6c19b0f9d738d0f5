"""Issue 'foundation' benchmark: plain GEMM, the K1 program and the backward
layouts against cuBLAS (and torch.compile / eager for K1), M = 16384 tokens.

Every case times its variants side by side in one run, paired and in sustained
blocks (harness.compare)."""

from __future__ import annotations

import torch

from .. import gemm
from ..programs import RESIDUAL_RMS
from .harness import (
    Results,
    Row,
    add_rows,
    compare,
    cpu_overhead_us,
    peak_memory_gb,
    rand_bf16,
    rel_error,
    selected,
    triton_only,
)

M = 16384
PLAIN_SHAPES = [
    (2048, 2048),
    (16384, 2048),
    (2048, 8192),
    (6144, 4096),
    (28672, 4096),
    (4096, 14336),
    (128256, 4096),
]
K1_SHAPES = [(2048, 2048), (4096, 4096), (2048, 8192), (4096, 14336)]


def _check(name, ours, ref):
    """Relative Frobenius error against the cuBLAS result; bf16 outputs land near 4e-3."""
    err = rel_error(ours, ref)
    if not err < 1e-2:
        raise AssertionError(f"{name}: relative error {err:.2e} against cuBLAS")


def _plain_case(res: Results, N: int, K: int):
    a, w = rand_bf16(M, K), rand_bf16(N, K, scale=K**-0.5)
    case = f"plain {M}x{N}x{K}"
    _check(case, gemm(a, w), a @ w.t())
    ours = lambda: gemm(a, w)  # noqa: E731
    times = compare({"cublas": lambda: a @ w.t(), "codetta": ours, "codetta-triton": triton_only(ours)})
    add_rows(res, case, 2 * M * N * K, times)


def _backward_case(res: Results, N: int, K: int):
    x, w, dy = rand_bf16(M, K), rand_bf16(N, K, scale=K**-0.5), rand_bf16(M, N)
    flops = 2 * M * N * K
    case = f"dX=dY@W {M}x{N}x{K}"
    _check(case, gemm(dy, w.t()), dy @ w)
    ours = lambda: gemm(dy, w.t())  # noqa: E731
    add_rows(
        res,
        case,
        flops,
        compare({"cublas": lambda: dy @ w, "codetta": ours, "codetta-triton": triton_only(ours)}),
    )
    case = f"dW=dY^T@X {M}x{N}x{K}"
    _check(case, gemm(dy.t(), x.t()), dy.t() @ x)
    ours = lambda: gemm(dy.t(), x.t())  # noqa: E731
    times = compare({"cublas": lambda: dy.t() @ x, "codetta": ours, "codetta-triton": triton_only(ours)})
    add_rows(res, case, flops, times)


def plain(res: Results, shapes=PLAIN_SHAPES):
    for N, K in shapes:
        _plain_case(res, N, K)
        torch.cuda.empty_cache()


def backward(res: Results, shapes=PLAIN_SHAPES):
    for N, K in shapes:
        _backward_case(res, N, K)
        torch.cuda.empty_cache()


def _k1_chain(y, w, residual, gamma):
    x = residual + y @ w.t()
    return x, (x.float() * gamma).to(x.dtype), x.float().pow(2).sum(-1)


_k1_compiled = torch.compile(_k1_chain)


def _k1_case(res: Results, N: int, K: int):
    y, w = rand_bf16(M, K), rand_bf16(N, K, scale=K**-0.5)
    r, g = rand_bf16(M, N), torch.rand(N, device="cuda") + 0.5
    case = f"K1 {M}x{N}x{K}"
    xr, hr, ssr = _k1_chain(y, w, r, g)
    out = gemm(y, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g)
    _check(f"{case} x", out.x, xr)
    _check(f"{case} h", out.h, hr)
    _check(f"{case} sumsq", out.sumsq, ssr)
    fns = {
        "cublas": lambda: y @ w.t(),
        "eager": lambda: _k1_chain(y, w, r, g),
        "torch.compile": lambda: _k1_compiled(y, w, r, g),
        "codetta": lambda: gemm(y, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g),
    }
    fns["codetta-triton"] = triton_only(fns["codetta"])
    mem = {name: peak_memory_gb(fn) for name, fn in selected(fns).items()}
    add_rows(res, case, 2 * M * N * K, compare(fns), mem)


def k1(res: Results, shapes=K1_SHAPES):
    for N, K in shapes:
        _k1_case(res, N, K)
        torch.cuda.empty_cache()


def overhead(res: Results):
    """Host time per call at a tiny shape: what the launcher adds on top of the GPU time."""
    a, w = rand_bf16(64, 256), rand_bf16(256, 256)
    r, g = rand_bf16(64, 256), torch.rand(256, device="cuda")
    fns = {
        "cublas": lambda: a @ w.t(),
        "codetta": lambda: gemm(a, w),
        "codetta-k1": lambda: gemm(a, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g),
    }
    _host_rows(res, "host us/call 64x256x256", fns, 2 * 64 * 256 * 256)
    # (three variants of cpu_overhead_us's 10 warm-up and 300 timed calls: 930 counts)
    fns = new_m_calls(w, g)
    _host_rows(res, "host us/call, a new M each call (1024-2047)x256x256", fns, 2 * 1500 * 256 * 256)


def new_m_calls(w=None, g=None, first: int = 1024) -> dict:
    """cuBLAS's, codetta's and K1's calls at [M, 256] x [256, 256] with a token count M
    never seen before on every call (``first`` up, 1024 calls among them: a data loader
    padding each batch to its longest sequence): each codetta call misses the bound
    launcher and takes the full path (the call's checks, the config lookup, the launch's
    arguments built anew; scripts/profile_new_m.py profiles it). A second set in the same
    process needs another ``first`` (``first + 1024`` up) to see new counts."""
    top = first + 1024
    w = rand_bf16(256, 256) if w is None else w
    g = torch.rand(256, device="cuda") if g is None else g
    big_a, big_r = rand_bf16(top, 256), rand_bf16(top, 256)
    ms = iter(range(first, top))  # (no M seen before by any of them)

    def fresh(fn):
        return lambda: fn(next(ms))

    return {
        "cublas": fresh(lambda m: big_a[:m] @ w.t()),
        "codetta": fresh(lambda m: gemm(big_a[:m], w)),
        "codetta-k1": fresh(lambda m: gemm(big_a[:m], w, epilogue=RESIDUAL_RMS, residual=big_r[:m], gamma=g)),
    }


def _host_rows(res: Results, case: str, fns: dict, flops: int) -> None:
    us = {name: cpu_overhead_us(fn) for name, fn in fns.items()}
    b = us["cublas"] / 1e3
    for name, t in us.items():
        res.add(Row(case, name, t / 1e3, flops, b, sustained_ms=t / 1e3, baseline_sustained_ms=b))


PARTS = {"plain": plain, "k1": k1, "backward": backward, "overhead": overhead}


def run(out_dir: str, parts=("overhead", "plain", "k1", "backward")) -> list[Results]:
    done = []
    for part in parts:
        res = Results(f"foundation_{part}")
        print(f"== {part}", flush=True)
        PARTS[part](res)
        res.write(out_dir)
        done.append(res)
    for res in done:
        print(res.table())
    return done

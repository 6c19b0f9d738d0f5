"""Issue 'foundation' benchmark: plain GEMM, the K1 program and the backward
layouts against cuBLAS (and torch.compile / eager for K1), M = 16384 tokens."""

from __future__ import annotations

import torch

from .. import gemm
from ..programs import RESIDUAL_RMS
from .harness import Results, Row, peak_memory_gb, time_ms

M = 16384
PLAIN_SHAPES = [(2048, 2048), (16384, 2048), (2048, 8192), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
K1_SHAPES = [(2048, 2048), (4096, 4096), (2048, 8192), (4096, 14336)]


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _check(name, ours, ref):
    """Relative Frobenius error against the cuBLAS result; bf16 outputs land near 4e-3."""
    err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
    if not err < 1e-2:
        raise AssertionError(f"{name}: relative error {err:.2e} against cuBLAS")


def plain(res: Results, shapes=PLAIN_SHAPES):
    for N, K in shapes:
        a, w = _rand(M, K), _rand(N, K, scale=K**-0.5)
        case = f"plain {M}x{N}x{K}"
        flops = 2 * M * N * K
        _check(case, gemm(a, w), a @ w.t())
        t_ref = time_ms(lambda: a @ w.t())
        res.add(Row(case, "cublas", t_ref, flops, t_ref))
        res.add(Row(case, "codetta", time_ms(lambda: gemm(a, w)), flops, t_ref))
        del a, w
        torch.cuda.empty_cache()


def backward(res: Results, shapes=PLAIN_SHAPES):
    for N, K in shapes:
        x, w, dy = _rand(M, K), _rand(N, K, scale=K**-0.5), _rand(M, N)
        flops = 2 * M * N * K
        case = f"dX=dY@W {M}x{N}x{K}"
        _check(case, gemm(dy, w.t()), dy @ w)
        t_ref = time_ms(lambda: dy @ w)
        res.add(Row(case, "cublas", t_ref, flops, t_ref))
        res.add(Row(case, "codetta", time_ms(lambda: gemm(dy, w.t())), flops, t_ref))
        case = f"dW=dY^T@X {M}x{N}x{K}"
        _check(case, gemm(dy.t(), x.t()), dy.t() @ x)
        t_ref = time_ms(lambda: dy.t() @ x)
        res.add(Row(case, "cublas", t_ref, flops, t_ref))
        res.add(Row(case, "codetta", time_ms(lambda: gemm(dy.t(), x.t())), flops, t_ref))
        del x, w, dy
        torch.cuda.empty_cache()


def _k1_chain(y, w, residual, gamma):
    x = residual + y @ w.t()
    return x, (x.float() * gamma).to(x.dtype), x.float().pow(2).sum(-1)


_k1_compiled = torch.compile(_k1_chain)


def k1(res: Results, shapes=K1_SHAPES):
    for N, K in shapes:
        y, w = _rand(M, K), _rand(N, K, scale=K**-0.5)
        r, g = _rand(M, N), torch.rand(N, device="cuda") + 0.5
        case = f"K1 {M}x{N}x{K}"
        flops = 2 * M * N * K
        out = gemm(y, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g)
        xr, hr, ssr = _k1_chain(y, w, r, g)
        _check(case + " x", out.x, xr)
        _check(case + " h", out.h, hr)
        _check(case + " sumsq", out.sumsq.sum(1), ssr)
        t_ref = time_ms(lambda: y @ w.t())
        res.add(Row(case, "cublas", t_ref, flops, t_ref))
        fns = {
            "eager": lambda: _k1_chain(y, w, r, g),
            "torch.compile": lambda: _k1_compiled(y, w, r, g),
            "codetta": lambda: gemm(y, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g),
        }
        for name, fn in fns.items():
            res.add(Row(case, name, time_ms(fn), flops, t_ref, peak_memory_gb(fn)))
        del y, w, r, g
        torch.cuda.empty_cache()


def run(out_dir: str, parts=("plain", "k1", "backward")) -> list[Results]:
    done = []
    for part in parts:
        res = Results(f"foundation_{part}")
        print(f"== {part}", flush=True)
        {"plain": plain, "k1": k1, "backward": backward}[part](res)
        res.write(out_dir)
        done.append(res)
    for res in done:
        print(res.table())
    return done

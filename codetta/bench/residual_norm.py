"""Issue 'Operators I' benchmark: o-proj GEMM + residual + RMSNorm + next GEMM,
16384 tokens, forward and forward+backward, against cuBLAS GEMM-only time, eager,
torch.compile and Liger's fused add+RMSNorm (+ cuBLAS GEMMs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import residual_rmsnorm_linear
from ..ops.residual_rmsnorm import residual_rmsnorm_linear_variant as _variant
from .harness import (
    Results,
    add_rows,
    check_to_eager,
    compare,
    no_grad_call,
    peak_memory_gb,
    rand_bf16,
    run_fwd_bwd_cases,
    selected,
    triton_only,
)

M = 16384
EPS = 1e-6
# name: (K of the o-proj input, d = hidden, N of the next GEMM)
WIDTHS = {"1B": (2048, 2048, 8192), "8B": (4096, 4096, 14336)}


def _eager(y, w_o, res, g, w):
    x = res + y @ w_o.t()
    return x, F.rms_norm(x, (x.shape[-1],), g, EPS) @ w.t()


_compiled = torch.compile(_eager)


def _liger_fn():
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError:
        return None

    def liger(y, w_o, res, g, w):
        n, x = LigerFusedAddRMSNormFunction.apply(y @ w_o.t(), res, g, EPS)
        return x, n @ w.t()

    return liger


def _codetta(y, w_o, res, g, w):
    return residual_rmsnorm_linear(y, w_o, res, g, w, EPS)


def _codetta_folded(y, w_o, res, g, w):
    return _variant(y, w_o, res, g, w, EPS, backward="folded")


def _codetta_two_pass(y, w_o, res, g, w):
    return _variant(y, w_o, res, g, w, EPS, backward="two_pass")


def _codetta_fold_gamma(y, w_o, res, g, w):
    return _variant(y, w_o, res, g, w, EPS, fold_gamma=True)


def problem(name: str) -> dict:
    """The benchmark's tensors at one width: the five leaves (y, w_o, residual, gamma,
    w; requiring grad), the incoming gradients dx, dz, and n, a stand-in for the
    normalized input that the cuBLAS-only baseline multiplies."""
    K, d, N = WIDTHS[name]
    leaves = [
        rand_bf16(M, K),
        rand_bf16(d, K, scale=K**-0.5),
        rand_bf16(M, d),
        (torch.rand(d, device="cuda") + 0.5).bfloat16(),
        rand_bf16(N, d, scale=d**-0.5),
    ]
    return {
        "leaves": [t.requires_grad_() for t in leaves],
        "dx": rand_bf16(M, d),
        "dz": rand_bf16(M, N),
        "n": rand_bf16(M, d),
    }


def fwd_bwd(fn, p: dict):
    """One training step of ``fn`` on the problem: forward, then every gradient."""
    return lambda: torch.autograd.grad(fn(*p["leaves"]), p["leaves"], (p["dx"], p["dz"]))


def cublas_gemms(p: dict, backward: bool):
    """The same GEMMs in cuBLAS alone (the ratios' denominator): 2 forward, 4 backward."""
    y, w_o, _, _, w = p["leaves"]
    dx, dz, n = p["dx"], p["dz"], p["n"]

    @torch.no_grad()
    def run():
        fwd = (y @ w_o.t(), n @ w.t())
        return fwd + (dz @ w, dz.t() @ n, dx @ w_o, dx.t() @ y) if backward else fwd

    return run


def run_width(res_fwd: Results, res_bwd: Results, name: str, research: bool = False):
    K, d, N = WIDTHS[name]
    p = problem(name)
    leaves, dx, dz = p["leaves"], p["dx"], p["dz"]

    variants = {"eager": _eager, "torch.compile": _compiled, "codetta": _codetta}
    research_variants = {
        "codetta-2pass": _codetta_two_pass,
        "codetta-folded": _codetta_folded,
        "codetta-foldgamma": _codetta_fold_gamma,
    }
    if research:
        variants.update(research_variants)
    liger = _liger_fn()
    if liger is not None:
        variants["liger"] = liger

    # correctness against eager (bf16): every output and gradient
    ref_out = _eager(*leaves)
    ref_grads = torch.autograd.grad(ref_out, leaves, (dx, dz))
    for fn in [_codetta] + (list(research_variants.values()) if research else []):
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, (dx, dz))
        labels = ["x", "z", "dy", "dw_o", "dres", "dgamma", "dw"]
        check_to_eager(labels, [*out, *grads], [*ref_out, *ref_grads], show=f"{name} {fn.__name__}")

    def fwd(fn):
        return no_grad_call(fn, *leaves)

    with torch.no_grad():
        fwd_flops = 2 * M * d * K + 2 * M * N * d
        fns = {"cublas": cublas_gemms(p, backward=False), **{k: fwd(v) for k, v in variants.items()}}
        fns["codetta-triton"] = triton_only(fns["codetta"])  # A/B of the ping-pong mainloop
        add_rows(res_fwd, f"{name} fwd", fwd_flops, compare(fns))
    fns = {"cublas": cublas_gemms(p, backward=True), **{k: fwd_bwd(v, p) for k, v in variants.items()}}
    fns["codetta-triton"] = triton_only(fns["codetta"])
    t = compare(fns)
    mem = {k: peak_memory_gb(fwd_bwd(v, p)) for k, v in selected(variants).items()}
    add_rows(res_bwd, f"{name} fwd+bwd", 3 * fwd_flops, t, mem)


def run(out_dir: str, widths=("1B", "8B"), research: bool = False) -> list[Results]:
    """``research``: also the alternative backwards (two_pass, folded, fold_gamma)."""
    tables = run_fwd_bwd_cases(
        out_dir, "residual_norm", widths, lambda f, b, name: run_width(f, b, name, research),
        lambda name: f"residual + RMSNorm + next GEMM, {name} width",
    )  # fmt: skip
    measured = [r for r in tables[1].rows if r.peak_mem_gb == r.peak_mem_gb]  # not NaN
    mems = ", ".join(f"{r.case}/{r.variant} {r.peak_mem_gb:.2f}" for r in measured)
    print(f"peak memory (GB): {mems}")
    return tables

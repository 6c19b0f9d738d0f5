"""Issue 'Operators I' benchmark: o-proj GEMM + residual + RMSNorm + next GEMM,
16384 tokens, forward and forward+backward, against cuBLAS GEMM-only time, eager,
torch.compile and Liger's fused add+RMSNorm (+ cuBLAS GEMMs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import residual_rmsnorm_linear
from .harness import Results, Row, compare, no_tail, peak_memory_gb

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
    return residual_rmsnorm_linear(y, w_o, res, g, w, EPS, backward="folded")


def _codetta_two_pass(y, w_o, res, g, w):
    return residual_rmsnorm_linear(y, w_o, res, g, w, EPS, backward="two_pass")


def _codetta_fold_gamma(y, w_o, res, g, w):
    return residual_rmsnorm_linear(y, w_o, res, g, w, EPS, fold_gamma=True)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_width(res_fwd: Results, res_bwd: Results, name: str):
    K, d, N = WIDTHS[name]
    r = lambda *s, scale=1.0: (torch.randn(*s, device="cuda") * scale).to(torch.bfloat16)  # noqa: E731
    leaves = [
        r(M, K),
        r(d, K, scale=K**-0.5),
        r(M, d),
        (torch.rand(d, device="cuda") + 0.5).bfloat16(),
        r(N, d, scale=d**-0.5),
    ]
    leaves = [t.requires_grad_() for t in leaves]
    dx, dz = r(M, d), r(M, N)
    y, w_o, res, g, w = leaves
    n = r(M, d)

    variants = {
        "eager": _eager,
        "torch.compile": _compiled,
        "codetta": _codetta,
        "codetta-2pass": _codetta_two_pass,
        "codetta-folded": _codetta_folded,
        "codetta-foldgamma": _codetta_fold_gamma,
    }
    liger = _liger_fn()
    if liger is not None:
        variants["liger"] = liger

    # correctness against eager (bf16): every output and gradient
    ref_out = _eager(*leaves)
    ref_grads = torch.autograd.grad(ref_out, leaves, (dx, dz))
    for fn in (_codetta, _codetta_two_pass, _codetta_folded, _codetta_fold_gamma):
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, (dx, dz))
        labels = ["x", "z", "dy", "dw_o", "dres", "dgamma", "dw"]
        for label, a, b in zip(labels, list(out) + list(grads), list(ref_out) + list(ref_grads)):
            err = _rel(a, b)
            print(f"  {name} {fn.__name__} {label}: relative difference to eager {err:.2e}")
            if not err < 3e-2:
                raise AssertionError(f"{name} {fn.__name__} {label}: {err:.2e} from eager")

    def fwd(fn):
        def run():
            with torch.no_grad():
                return fn(*leaves)

        return run

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, (dx, dz))

    gemms_fwd = lambda: (y @ w_o.t(), n @ w.t())  # noqa: E731
    gemms_all = lambda: (y @ w_o.t(), n @ w.t(), dz @ w, dz.t() @ n, dx @ w_o, dx.t() @ y)  # noqa: E731
    with torch.no_grad():
        fwd_flops = 2 * M * d * K + 2 * M * N * d
        fns = {"cublas": gemms_fwd, **{k: fwd(v) for k, v in variants.items()}}
        fns["codetta-notail"] = no_tail(fns["codetta"])  # A/B of the last-wave K split
        t = compare(fns)
        for k, ms in t.items():
            res_fwd.add(Row(f"{name} fwd", k, ms, fwd_flops, t["cublas"]))
    fns = {"cublas": lambda: torch.no_grad()(gemms_all)(), **{k: fwd_bwd(v) for k, v in variants.items()}}
    fns["codetta-notail"] = no_tail(fns["codetta"])
    t = compare(fns)
    mem = {k: peak_memory_gb(fwd_bwd(v)) for k, v in variants.items()}
    for k, ms in t.items():
        res_bwd.add(Row(f"{name} fwd+bwd", k, ms, 3 * fwd_flops, t["cublas"], mem.get(k, float("nan"))))


def run(out_dir: str, widths=("1B", "8B")) -> list[Results]:
    res_fwd, res_bwd = Results("residual_norm_fwd"), Results("residual_norm_fwdbwd")
    for name in widths:
        print(f"== residual + RMSNorm + next GEMM, {name} width", flush=True)
        run_width(res_fwd, res_bwd, name)
        torch.cuda.empty_cache()
    for res in (res_fwd, res_bwd):
        res.write(out_dir)
        print(res.table())
        print(
            "peak memory (GB): "
            + ", ".join(
                f"{r.case}/{r.variant} {r.peak_mem_gb:.2f}"
                for r in res.rows
                if r.peak_mem_gb == r.peak_mem_gb
            )
        )
    return [res_fwd, res_bwd]

"""GPU spike: the Gluon ping-pong kernel (codetta/kernels/pingpong.py) against cuBLAS and
the Triton mainloop, plain GEMM and K1, paired timing. Prints a table last.

Usage (repo root, on the H200): PYTHONPATH=. python scripts/pingpong_spike.py
[--quick] [--check-only] [--skip-check]
"""

from __future__ import annotations

import json
import os
import sys

import torch

from codetta import gemm
from codetta.bench.foundation import _k1_chain, _k1_compiled
from codetta.bench.harness import compare, rand_bf16, rel_error
from codetta.kernels.pingpong import pingpong_gemm
from codetta.programs import RESIDUAL_RMS

M = 16384
VARIANTS = {  # name: kwargs of pingpong_gemm
    "pp-s4": dict(stages=4),
    "pp-s5": dict(stages=5),
    "pp-s4g16": dict(stages=4, group_m=16),
}


def check(name, ours, ref, tol=1e-2):
    err = rel_error(ours, ref)
    ok = err < tol
    print(f"  check {name}: rel err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def correctness() -> bool:
    ok = True
    for m, n, k in [(333, 200, 136), (1000, 2048, 512), (M, 2048, 2048)]:
        y, w = rand_bf16(m, k), rand_bf16(n, k, scale=k**-0.5)
        r, g = rand_bf16(m, n), torch.rand(n, device="cuda") + 0.5
        for vname, kw in VARIANTS.items():
            out = pingpong_gemm(y, w, **kw)
            torch.cuda.synchronize()
            ok &= check(f"{vname} plain {m}x{n}x{k}", out, y @ w.t())
            x, h, ss = pingpong_gemm(y, w, r, g, **kw)
            torch.cuda.synchronize()
            xr, hr, ssr = _k1_chain(y, w, r, g)
            ok &= check(f"{vname} K1 x {m}x{n}x{k}", x, xr)
            ok &= check(f"{vname} K1 h {m}x{n}x{k}", h, hr)
            ok &= check(f"{vname} K1 sumsq {m}x{n}x{k}", ss.sum(1), ssr)
            if m != M:
                continue
            # against the Triton K1 (same rounding of x; its config is cached at this shape)
            tl_out = gemm(y, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g)
            ok &= check(f"{vname} K1 x vs triton K1", x, tl_out.x, tol=2e-3)
            ok &= check(f"{vname} K1 sumsq vs triton", ss.sum(1), tl_out.sumsq.sum(1), tol=2e-3)
    return ok


def shape_rows(n, k) -> list:
    y, w = rand_bf16(M, k), rand_bf16(n, k, scale=k**-0.5)
    fns = {"cublas": lambda: y @ w.t()}
    for vname, kw in VARIANTS.items():
        fns[vname] = lambda kw=kw: pingpong_gemm(y, w, **kw)
    t = compare(fns)
    rows = [("plain", n, k, name, ms, ms / t["cublas"]) for name, ms in t.items()]
    r, g = rand_bf16(M, n), torch.rand(n, device="cuda") + 0.5
    fns = {
        "cublas": lambda: y @ w.t(),
        "torch.compile": lambda: _k1_compiled(y, w, r, g),
        "codetta": lambda: gemm(y, w, epilogue=RESIDUAL_RMS, residual=r, gamma=g),
    }
    for vname, kw in VARIANTS.items():
        fns[vname] = lambda kw=kw: pingpong_gemm(y, w, r, g, **kw)
    t = compare(fns)
    return rows + [("K1", n, k, name, ms, ms / t["cublas"]) for name, ms in t.items()]


def fmt(row) -> str:
    kind, n, k, name, ms, ratio = row
    return f"{kind:5s} {n:5d}x{k:<5d} {name:14s} {ms:.4f} ms  x{ratio:.3f}"


def main():
    quick = "--quick" in sys.argv
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if "--skip-check" not in sys.argv and not correctness():
        print("CORRECTNESS FAILED: no timing")
        sys.exit(1)
    if "--check-only" in sys.argv:
        return
    shapes = [(2048, 2048), (4096, 4096), (2048, 8192), (4096, 14336)]
    rows = []
    for n, k in shapes[:2] if quick else shapes:
        new = shape_rows(n, k)
        print("\n".join("  " + fmt(r) for r in new), flush=True)
        rows += new
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "pingpong.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n== summary (ratio to cuBLAS, paired)")
    print("\n".join(fmt(r) for r in rows))


if __name__ == "__main__":
    main()

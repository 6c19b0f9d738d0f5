"""The LM head + cross-entropy, forward + backward, against its floor and Liger (GPU).

Times ``linear_cross_entropy`` (mean over 16384 tokens, V = 128256) at several chunk
sizes against Liger's fused linear cross-entropy and the floor (the three cuBLAS GEMMs
of the head: logits, dX, dW, on a whole [T, V] logits tensor), paired and sustained,
with each variant's peak memory beyond its inputs. Then the logits GEMM's epilogue
taken apart at one chunk (row LSE only, target pick only, both, none) to show what
each reduction costs.

Usage (repo root): PYTHONPATH=. python scripts/ce_bench.py [--widths 2048 4096] [--chunks 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from codetta.kernels.configs import BACKWARD_CANDIDATES, PLAIN_CANDIDATES
from codetta.kernels.launch import gemm
from codetta.kernels.program import DType, PerRow, Program, RowLogSumExp, RowPick, Tile
from codetta.kernels.timing import paired_ms, sustained_ms
from codetta.ops import linear_cross_entropy
from codetta.programs.ce import CE_LOGITS

V, T = 128256, 16384
_CONFIGS = tuple(BACKWARD_CANDIDATES) + tuple(c for c in PLAIN_CANDIDATES if c.occupancy == 2)


@triton.jit
def _lse_only(acc, elem):
    logit = acc.to(elem.dtype).to(tl.float32)
    return logit, logit


@triton.jit
def _pick_only(acc, target, elem):
    logit = acc.to(elem.dtype).to(tl.float32)
    return logit, logit


LSE_ONLY = Program("bisect_lse", _lse_only, inputs=(DType("elem"),),
                   outputs=(Tile("logits"), RowLogSumExp("lse")), configs=_CONFIGS)  # fmt: skip
PICK_ONLY = Program("bisect_pick", _pick_only, inputs=(PerRow("target", index=True), DType("elem")),
                    outputs=(Tile("logits"), RowPick("picked", index="target")),
                    configs=_CONFIGS)  # fmt: skip


def _peak_gb(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def head(d: int, chunks) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(T, d, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, d, device="cuda", generator=g) * d**-0.5).bfloat16().requires_grad_()
    tgt = torch.randint(0, V, (T,), device="cuda", generator=g)
    fns = {}
    for rows in chunks:

        def ours(rows=rows):
            linear_cross_entropy(x, w, tgt, chunk_rows=rows).backward()
            x.grad = w.grad = None

        fns[f"codetta chunk {rows}"] = ours
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger_loss = LigerFusedLinearCrossEntropyLoss()

        def liger():
            liger_loss(w, x, tgt).backward()
            x.grad = w.grad = None

        fns["liger"] = liger
    except ImportError as exc:
        print(f"  liger unavailable: {exc}")
    xd, wd = x.detach(), w.detach()
    logits = torch.empty(T, V, device="cuda", dtype=torch.bfloat16)

    def floor():
        torch.mm(xd, wd.t(), out=logits)
        logits @ wd
        logits.t() @ xd

    fns["floor"] = floor
    mem = {}
    for k, fn in fns.items():
        fn()
        mem[k] = _peak_gb(fn) if k != "floor" else 0.0
    p = paired_ms(fns, min_s=1.5)
    s = sustained_ms(fns, block_ms=150.0, blocks=3)
    print(f"== LM head + CE fwd+bwd, T {T}, d {d}, V {V}")
    print("   (ms paired, time / floor paired / sustained, peak GB beyond the inputs)")
    for k in fns:
        ratio = f"{p[k] / p['floor']:6.3f} / {s[k] / s['floor']:6.3f}"
        print(f"  {k:<22} {p[k]:8.3f} ms  {ratio}   {mem[k]:6.2f} GB")


def bisect(d: int, rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(rows, d, device="cuda", generator=g) * 0.5).bfloat16()
    w = (torch.randn(V, d, device="cuda", generator=g) * d**-0.5).bfloat16()
    tgt = torch.randint(0, V, (rows,), device="cuda", generator=g)
    fns = {
        "plain": lambda: gemm(x, w),
        "lse only": lambda: gemm(x, w, epilogue=LSE_ONLY),
        "pick only": lambda: gemm(x, w, epilogue=PICK_ONLY, target=tgt),
        "ce_logits": lambda: gemm(x, w, epilogue=CE_LOGITS),
        "cuBLAS": lambda: x @ w.t(),
    }
    for fn in fns.values():
        fn()
    p = paired_ms(fns, min_s=1.0)
    print(f"== logits GEMM epilogue parts, [{rows}, {V}, {d}] (ms, / cuBLAS)")
    for k in fns:
        print(f"  {k:<12} {p[k]:7.3f}  {p[k] / p['cuBLAS']:6.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096])
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    for d in args.widths:
        bisect(d, 1024)
        head(d, args.chunks)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
